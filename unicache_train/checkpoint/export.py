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

from unicache_train.checkpoint.hf import export_hf
from unicache_train.checkpoint.hf_config import FAMILIES, HFCheckpointError
from unicache_train.checkpoint.integrity import (
    MANIFEST_NAME,
    NonFiniteError,
    WriteError,
    first_non_finite,
    fsync_tree,
)
from unicache_train.checkpoint.lightning_ckpt import load_checkpoint
from unicache_train.checkpoint.policy import policy_of
from unicache_train.checkpoint.zero import publish, remove_path, temporary_path, write_error
from unicache_train.preflight import check_output_dir
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
    overwrite: bool = False,
) -> Path:
    """Load ``checkpoint`` and write it to ``out`` in ``format``, with the run's tokenizer and a
    generation config (see the module doc); returns ``out``.

    ``out`` must be empty or absent; with ``overwrite`` a previous export there is replaced
    whole (no file of it survives). The export is written under ``OUT.tmp``, with a checksum
    manifest (``unicache_manifest.json``), and renamed into place when complete.

    Raises:
        HFCheckpointError: unknown ``format`` / ``family``, or a model that has no form in it.
        WriteError: ``out`` is not empty (see :func:`check_export_target`), or the write failed
            (named, with the cause; nothing is left behind).
        NonFiniteError: a weight of the checkpoint is NaN or infinite.
    """
    if format not in EXPORT_FORMATS:
        raise HFCheckpointError(f"format={format!r}: choose one of {list(EXPORT_FORMATS)}")
    if format == "hf" and family not in FAMILIES:
        raise HFCheckpointError(f"family={family!r}: choose one of {sorted(FAMILIES)}")
    out = Path(out)
    check_export_target(out, overwrite)  # before any work
    check_output_dir(out.parent, what="export parent folder")
    model, config = load_checkpoint(checkpoint)
    bad = first_non_finite(model.state_dict().items())
    if bad is not None:
        raise NonFiniteError(
            f"{checkpoint}: tensor {bad} has NaN or infinite values; refusing to export it "
            "(the run diverged: export an earlier checkpoint)"
        )
    tokenizer = _tokenizer_source(config)
    policy = compression_policy_of(config) if with_compression_config else None
    # NOTE: written whole under OUT.tmp, then swapped in (zero.publish): OUT is never half an
    # export, and the previous export's files (a stale compression_config.json) go with it.
    tmp = temporary_path(out)
    remove_path(tmp)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            _write_export(model, tmp, format, family, dtype, policy, tokenizer)
        for w in said:  # the exporters name the folder they write: the user's is ``out``
            warnings.warn(str(w.message).replace(str(tmp), str(out)), w.category, stacklevel=2)
        fsync_tree(tmp)
        publish(tmp, out)
    except OSError as err:
        remove_path(tmp)
        raise write_error(out, err) from None
    except BaseException:
        remove_path(tmp)
        raise
    return out


def _write_export(
    model,
    tmp: Path,
    format: str,
    family: str,
    dtype: str,  # noqa: A002
    policy: dict[str, Any] | None,
    tokenizer: str | None,
) -> None:
    if format == "deepseek_v3":
        from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3
        from unicache_train.checkpoint.hf import dtype_name

        export_deepseek_v3(
            model,
            tmp,
            dtype=dtype_name(dtype, model),
            compression_policy=policy,
            tokenizer_from=tokenizer,
        )
    else:
        export_hf(
            model,
            tmp,
            family=family,
            dtype=dtype,
            compression_policy=policy,
            tokenizer_from=tokenizer,
        )


def check_export_target(out: Path, overwrite: bool) -> None:
    """``out`` must be absent or empty, or (with ``overwrite``) hold a previous export.

    Raises:
        WriteError: ``out`` is a file; or non-empty without ``overwrite``; or (with it) holds
            files no export writes, which are not deleted: the message names one.
    """
    if out.exists() and not out.is_dir():
        raise WriteError(f"--out {out}: a file is in the way (expected a folder)")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise WriteError(
            f"--out {out}: the folder is not empty; pass --overwrite to replace the export "
            "there (its files are removed first), or choose an empty folder"
        )
    if (out / MANIFEST_NAME).is_file() or (out / "config.json").is_file():
        return  # a previous export (ours, or an HF directory): replaced whole
    first = sorted(p.name for p in out.iterdir())[0]
    raise WriteError(
        f"--out {out}: holds files that are not an export (e.g. {first}); refusing to delete "
        "them, even with --overwrite"
    )


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
