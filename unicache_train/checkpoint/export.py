"""Export one of our training checkpoints (``.ckpt`` / ZeRO dir) to an inference format.

``hf``: :func:`unicache_train.checkpoint.hf.export_hf` (Llama / Qwen2 / Qwen3 / Mistral, or our
``unicache_mhc`` remote-code format for mHC models); ``deepseek_v3``: MLA models through
:func:`unicache_train.checkpoint.deepseek_v3.export_deepseek_v3`. The run's tokenizer
(``data.tokenizer``) goes next to the weights: a local HF tokenizer directory (for a run started
from an HF checkpoint, the checkpoint directory itself) is copied with its
``generation_config.json`` and chat template; ``byte`` is written as an equivalent HF fast
tokenizer (:func:`unicache_train.checkpoint.serving.byte_tokenizer_files`). When the run trained
with KV compression in the loop, its policy goes to ``compression_config.json``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from unicache_train.checkpoint.hf import (
    FAMILIES,
    HFCheckpointError,
    export_hf,
    write_compression_config,
)
from unicache_train.checkpoint.lightning_ckpt import load_checkpoint
from unicache_train.checkpoint.policy import policy_of
from unicache_train.train.config import RunConfig

__all__ = ["EXPORT_FORMATS", "export_checkpoint", "compression_policy_of"]

EXPORT_FORMATS = ("hf", "deepseek_v3")


def compression_policy_of(config: RunConfig) -> dict[str, Any] | None:
    """The in-loop compression policy a run trained with (None when compression was off)."""
    return policy_of(config.compress)


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    format: str = "hf",  # noqa: A002  (the CLI flag's name)
    family: str = "llama",
    dtype: str = "fp32",
    with_compression_config: bool = True,
) -> Path:
    """Load ``checkpoint`` and write it to ``out`` in ``format``, with the run's tokenizer and a
    generation config (see the module doc); returns ``out``.

    Raises:
        HFCheckpointError: unknown ``format`` / ``family``, or a model that has no form in it.
    """
    if format not in EXPORT_FORMATS:
        raise HFCheckpointError(f"format={format!r}: choose one of {list(EXPORT_FORMATS)}")
    if format == "hf" and family not in FAMILIES:
        raise HFCheckpointError(f"family={family!r}: choose one of {sorted(FAMILIES)}")
    model, config = load_checkpoint(checkpoint)
    tokenizer = _tokenizer_source(config)
    policy = compression_policy_of(config) if with_compression_config else None
    out = Path(out)
    if format == "deepseek_v3":
        from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3
        from unicache_train.checkpoint.hf import dtype_name

        export_deepseek_v3(model, out, dtype=dtype_name(dtype, model), tokenizer_from=tokenizer)
        if policy is not None:
            write_compression_config(policy, out)
    else:
        export_hf(model, out, family=family, dtype=dtype, compression_policy=policy,
                  tokenizer_from=tokenizer)  # fmt: skip
    return out


def _tokenizer_source(config: RunConfig) -> str | None:
    """``data.tokenizer`` (``byte`` or a directory); None, with a warning, when the directory
    has moved since the run (the weights are still exported)."""
    name = config.data.tokenizer
    if name == "byte" or Path(name).expanduser().is_dir():
        return name
    warnings.warn(
        f"data.tokenizer={name!r} is not a directory any more: exporting without a tokenizer",
        stacklevel=3,
    )
    return None
