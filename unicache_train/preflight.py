"""Checks made before any work: the model fits in memory, the output folders take a checkpoint.

A config read from a file (a recipe YAML, an HF ``config.json``, a checkpoint's saved config) can
ask for a model that would never fit (``num_hidden_layers: 1e9``): building it allocates until
the machine gives out, with no message. :func:`check_model_fits` estimates the parameter count
from the config alone (no allocation; the formula below follows :class:`~unicache_train.model.
Decoder`'s modules) and refuses, naming the fields and the estimate, when the fp32 weights alone
exceed the memory available now. :func:`check_output_dir` checks that a folder can be created and
written, and has room for ``need`` bytes, before a run spends time that it could not save.

Imports only the standard library and :mod:`unicache_train.validation`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from unicache_train.validation import ConfigError

__all__ = [
    "MAX_POSITIONS",
    "estimate_parameters",
    "checkpoint_bytes",
    "available_memory",
    "check_model_fits",
    "check_output_dir",
]

#: Largest ``max_position_embeddings`` accepted: RoPE angles take ``positions.float()``, and fp32
#: holds every integer only up to 2**24 (beyond, neighbouring positions share one angle).
MAX_POSITIONS = 1 << 24

_GIB = float(1 << 30)


def estimate_parameters(cfg: Any) -> int:
    """Parameters of a :class:`~unicache_train.model.config.ModelConfig`'s decoder, from its fields.

    Exact for the GQA / MLA / MoE / mHC layouts up to norms and biases (a few per cent at most at
    toy sizes, far less at real ones); what matters here is the order of magnitude.
    """
    C, L, V = int(cfg.hidden_size), int(cfg.num_hidden_layers), int(cfg.vocab_size)
    H, Hk = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    D = int(cfg.head_dim or C // max(H, 1))
    if getattr(cfg, "attention_type", "gqa") == "mla":
        qk = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
        q = C * H * qk if cfg.q_lora_rank is None else int(cfg.q_lora_rank) * (C + H * qk)
        kv = C * (int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim))
        kv += int(cfg.kv_lora_rank) * H * (int(cfg.qk_nope_head_dim) + int(cfg.v_head_dim))
        attn = q + kv + H * int(cfg.v_head_dim) * C
    else:
        attn = 2 * C * H * D + 2 * C * Hk * D
    dense = 3 * C * int(cfg.intermediate_size)
    experts = int(getattr(cfg, "n_routed_experts", 0) or 0)
    if experts:
        width = int(cfg.moe_intermediate_size or cfg.intermediate_size)
        shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        moe = 3 * C * width * (experts + shared) + C * experts
        k = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
        mlp_total = k * dense + (L - k) * moe
    else:
        mlp_total = L * dense
    n = int(getattr(cfg, "hc_mult", 1) or 1) if getattr(cfg, "uses_streams", False) else 1
    hc = 2 * ((2 + n) * n * n * C) if n > 1 else 0  # attn_hc.fn + ffn_hc.fn per layer
    embed = V * C * (1 if getattr(cfg, "tie_word_embeddings", True) else 2)
    return embed + L * (attn + hc + 2 * C) + mlp_total + C


def checkpoint_bytes(cfg: Any, *, optimizer: bool = True) -> int:
    """Bytes of one training checkpoint of ``cfg``: fp32 weights, plus AdamW's two fp32 moments
    when ``optimizer``."""
    return estimate_parameters(cfg) * 4 * (3 if optimizer else 1)


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable`` of ``/proc/meminfo``; elsewhere the
    physical memory)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: do not refuse


def check_model_fits(cfg: Any, where: str, *, memory: int | None = None) -> int:
    """Refuse a model config whose fp32 weights alone exceed the memory available now, or whose
    ``max_position_embeddings`` exceeds :data:`MAX_POSITIONS`, before anything is allocated.

    Args:
        cfg: a :class:`~unicache_train.model.config.ModelConfig`.
        where: how the message names its source (``"recipes/x.yaml"``, ``"DIR/config.json"``).
        memory: bytes available (default :func:`available_memory`).

    Returns:
        The estimated parameter count.

    Raises:
        ConfigError: naming the source, the sizes, the estimate and the memory available.
    """
    pos = cfg.max_position_embeddings
    if pos > MAX_POSITIONS:
        raise ConfigError(
            f"{where}: max_position_embeddings={pos} is out of range; allowed [1, {MAX_POSITIONS}] "
            "(RoPE positions are exact in fp32 only up to 2**24)"
        )
    params = estimate_parameters(cfg)
    need = params * 4
    have = available_memory() if memory is None else memory
    if need > have:
        raise ConfigError(
            f"{where}: the model would not fit in memory: num_hidden_layers="
            f"{cfg.num_hidden_layers}, hidden_size={cfg.hidden_size}, intermediate_size="
            f"{cfg.intermediate_size}, vocab_size={cfg.vocab_size} make ~{params:.3g} parameters, "
            f"{need / _GIB:,.1f} GiB in fp32 before any training state; {have / _GIB:,.1f} GiB "
            "available"
        )
    return params


def check_output_dir(path: str | Path, need: int = 0, what: str = "output folder") -> Path:
    """Create ``path`` if needed and check that a file can be written there and that it has
    ``need`` bytes free.

    Raises:
        WriteError: the folder cannot be created or written (permission, a file in the way,
            read-only file system) or has too little room; the message names the folder,
            the cause, and for room the bytes needed and free.
    """
    from unicache_train.checkpoint.integrity import WriteError

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".unicache_probe_", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        cause = os.strerror(err.errno) if err.errno else str(err)
        raise WriteError(f"{what} {path}: not writable ({cause})") from None
    free = shutil.disk_usage(path).free
    if free < need:
        raise WriteError(
            f"{what} {path}: {free / _GIB:,.2f} GiB free, but one checkpoint needs about "
            f"{need / _GIB:,.2f} GiB"
        )
    return path
