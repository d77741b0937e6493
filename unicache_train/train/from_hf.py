"""A run that starts from a local HF checkpoint: import, optional mHC retrofit, init weights.

    checkpoint dir ──► import_hf ──► (convert_to_mhc) ──► <out_dir>/init_weights.safetensors
                                                          └─► RunConfig (model = the checkpoint's,
                                                              train.init_weights = that file)

Every rank runs the same deterministic steps (seeded conversion) and the init file is written
atomically, so a multi-process launch needs no coordination.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from unicache_train.train.config import RunConfig
from unicache_train.validation import ConfigError

__all__ = ["prepare_hf_run", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def prepare_hf_run(
    checkpoint_dir: str | Path,
    run: dict[str, Any],
    *,
    mhc: bool = False,
    hc_mult: int = 4,
    hc_preset: str = "deepseek_v4",
    seed: int = 0,
) -> RunConfig:
    """Import ``checkpoint_dir``, write its weights as the run's init weights, return the config.

    Args:
        checkpoint_dir: a local HF checkpoint directory (``config.json`` + safetensors).
        run: the run config as a mapping (sections ``data``, ``train``, ``compress``, ...); its
            ``model`` section is ignored (the architecture is the checkpoint's), and
            ``data.tokenizer: auto`` (or absent) becomes the checkpoint's tokenizer when the
            directory has one, else ``byte``.
        mhc: retrofit mHC (identity init: the converted model computes the source's function).
        hc_mult, hc_preset: streams and preset of the retrofit.
        seed: seeds the retrofit's symmetry breakers (same on every rank).

    Returns:
        The validated :class:`RunConfig` with ``train.init_weights`` set.
    """
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.data.tokenizer import load_tokenizer

    ckpt = Path(checkpoint_dir)
    model, model_cfg = import_hf(ckpt)
    if mhc:
        from unicache_train.model.convert import convert_to_mhc

        torch.manual_seed(int(seed))
        model = convert_to_mhc(model, hc_mult=int(hc_mult), preset=hc_preset)
        model_cfg = model.config
    run = {k: v for k, v in run.items() if k != "model"}
    data = dict(run.get("data") or {})
    if data.get("tokenizer", "auto") == "auto":
        has_tok = any((ckpt / f).is_file() for f in TOKENIZER_FILES)
        data["tokenizer"] = str(ckpt) if has_tok else "byte"
    run["data"] = data
    config = RunConfig.from_dict({**run, "model": dataclasses.asdict(model_cfg)})
    vocab = load_tokenizer(config.data.tokenizer).vocab_size
    if vocab > model_cfg.vocab_size:
        raise ConfigError(
            f"data.tokenizer={config.data.tokenizer!r} has {vocab} tokens but the checkpoint's "
            f"vocab_size is {model_cfg.vocab_size}"
        )
    out_dir = Path(config.train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    init = out_dir / "init_weights.safetensors"
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model_cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # shared storage: safetensors refuses aliases
    tmp = init.with_suffix(f".{os.getpid()}.tmp")
    save_file(sd, str(tmp))
    os.replace(tmp, init)  # NOTE: atomic, so concurrent ranks never read a half-written file
    config.train.init_weights = str(init)
    return config
