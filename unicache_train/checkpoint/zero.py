"""ZeRO checkpoints (DeepSpeed directories): consolidation, and crash-safe publication.

A ZeRO checkpoint is a directory, one shard per rank::

    step000008.ckpt/                    (Lightning names the directory like a file)
    ├── latest                          the tag ("checkpoint")
    ├── zero_to_fp32.py                 DeepSpeed's offline converter
    └── checkpoint/
        ├── mp_rank_00_model_states.pt  Lightning's client state (loops, schedulers, config, ...)
        └── *_optim_states.pt           the fp32 master weights + optimizer state, per rank

:func:`consolidate_zero_checkpoint` gathers the shards into one state dict (the LightningModule's
keys, ``model.*``) and optionally writes a plain Lightning ``.ckpt`` file that
:func:`unicache_train.checkpoint.load_checkpoint` and ``LMModule.load_from_checkpoint`` read.

Resuming on another number of ranks. Each ``*_optim_states.pt`` holds one rank's slice of the
flat fp32 master weights and AdamW moments, so a run with a different data-parallel size cannot
read them directly. :func:`to_universal_checkpoint` converts them once, with DeepSpeed's
``ds_to_universal``, into DeepSpeed's *universal* layout inside the same directory: one
unsharded tensor per parameter and state (fp32 weight, ``exp_avg``, ``exp_avg_sq``, ``step``),
which an engine of any size re-slices while loading (``"checkpoint": {"load_universal": true}``;
the strategy turns it on for that one load, see ``AtomicDeepSpeedStrategy.load_checkpoint``)::

    step000008.ckpt/
    ├── latest, checkpoint/, ...        as above, untouched
    ├── latest_universal                the universal tag ("universal")
    └── universal/
        ├── mp_rank_00_model_states.pt  copied: Lightning's client state
        └── zero/
            ├── optimizer_state.pt      param groups (lr, betas, weight decay), ZeRO settings
            └── <param name>/{fp32,exp_avg,exp_avg_sq,step}.pt

Weights, moments and step come back exactly (copies, no arithmetic), so a resume on another
world size with the same global batch continues the loss curve up to the summation order of the
gradient all-reduce. The conversion lives and dies with its checkpoint: when ``last.ckpt`` is
replaced by the next save, its universal copy goes with it.

Crash safety: a checkpoint is written under a temporary name in its final directory
(``NAME.tmp``) and renamed into place once every rank has finished (:func:`publish`). A file is
replaced by one atomic ``os.replace``; a directory cannot be (``rename`` refuses a non-empty
target), so the old one moves aside to ``NAME.old`` first and is deleted after the new one is in
place. Hence every path called ``*.ckpt`` is complete; a kill between the two renames leaves the
complete ``NAME.old``, which :func:`find_resume_checkpoint` falls back to.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unicache_train.checkpoint.integrity import WriteError
from unicache_train.checkpoint.safe_load import check_torch_file, check_zero_files, load_torch_file

__all__ = [
    "TMP_SUFFIX",
    "OLD_SUFFIX",
    "is_zero_checkpoint",
    "zero_world_size",
    "consolidate_zero_checkpoint",
    "read_zero_client_state",
    "UNIVERSAL_TAG",
    "has_universal_checkpoint",
    "to_universal_checkpoint",
    "check_universal_files",
    "temporary_path",
    "remove_path",
    "atomic_write",
    "publish",
    "remove_stale_temporaries",
    "find_resume_checkpoint",
]

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
UNIVERSAL_TAG = "universal"  # the tag directory of the universal copy
_LATEST_UNIVERSAL = "latest_universal"  # DeepSpeed's name for the file naming that tag

# Keys DeepSpeed adds to the client state; everything else is Lightning's checkpoint dict.
_DEEPSPEED_KEYS = (
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "csr_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
    "ds_config",
    "ds_version",
)
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


# --------------------------------------------------------------------------------- inspection
def _tag_dir(ckpt_dir: Path) -> Path:
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        raise ValueError(f"{ckpt_dir}: not a ZeRO checkpoint directory (no 'latest' file)")
    tag_dir = ckpt_dir / latest.read_text().strip()
    if not tag_dir.is_dir():
        raise ValueError(f"{ckpt_dir}: 'latest' names {tag_dir.name!r}, which does not exist")
    return tag_dir


def is_zero_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a DeepSpeed checkpoint directory (it has a ``latest`` tag file)."""
    path = Path(path)
    return path.is_dir() and (path / "latest").is_file()


def zero_world_size(ckpt_dir: str | Path) -> int:
    """How many data-parallel ranks wrote the checkpoint (one optimizer shard each)."""
    return len(list(_tag_dir(Path(ckpt_dir)).glob("*_optim_states.pt")))


def read_zero_client_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """Lightning's part of a ZeRO checkpoint (loops, schedulers, hyper-parameters), no tensors
    of the model."""
    tag_dir = _tag_dir(Path(ckpt_dir))
    files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise ValueError(f"{ckpt_dir}: no model-states file in {tag_dir}")
    # rank 0's file (ZeRO-3: zero_pp_rank_0_...; ZeRO-1/2: mp_rank_00_...); plain data only.
    state = load_torch_file(files[0], map_location="cpu", deepspeed=True)
    return {k: v for k, v in state.items() if k not in _DEEPSPEED_KEYS}


# --------------------------------------------------------------------------------- consolidation
def _keeps_fp32(key: str) -> bool:
    """Hyper-connection parameters stay fp32 in every dtype (docs/architecture.md#mhc;
    ``attn_hc.*``, ``ffn_hc.*``, ``hc_head.*``): their Sinkhorn inputs lose too much in bf16."""
    name = key.removeprefix("model.")
    return "_hc." in name or name.startswith("hc_head.")


def consolidate_zero_checkpoint(
    ckpt_dir: str | Path,
    out_file: str | Path | None = None,
    dtype: str | torch.dtype = "fp32",
) -> dict[str, torch.Tensor]:
    """Gather a ZeRO stage 1/2/3 checkpoint's shards into one full state dict.

    The weights come from the fp32 master copies in the optimizer shards (DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``), so they are exact even when training ran in
    bf16; tied weights come back tied.

    Args:
        ckpt_dir: the checkpoint directory (e.g. ``runs/x/checkpoints/last.ckpt``).
        out_file: when given, also write a Lightning ``.ckpt`` file there (the client state with
            this ``state_dict``; no optimizer state), written atomically.
        dtype: ``"fp32"`` (default) or ``"bf16"`` / ``"fp16"``: the dtype of floating tensors
            (hyper-connection parameters stay fp32, as the model keeps them).

    Returns:
        The LightningModule state dict (keys ``model.*``), tensors on CPU.

    Raises:
        UnsafeCheckpointError: a shard needs more than plain data to load (DeepSpeed unpickles
            its files with ``weights_only=False``, so every shard is checked first).
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt_dir = Path(ckpt_dir)
    if not is_zero_checkpoint(ckpt_dir):
        raise ValueError(f"{ckpt_dir}: not a ZeRO checkpoint directory (no 'latest' file)")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    check_zero_files(ckpt_dir)  # NOTE: before DeepSpeed's full unpickler reads them
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir))
    state: dict[str, torch.Tensor] = {}
    converted: dict[int, torch.Tensor] = {}  # keeps tied tensors tied after the cast
    for name, t in fp32.items():
        # Lightning < 2.1 wrapped the module; its prefix may linger in old checkpoints.
        key = name.removeprefix("_forward_module.")
        if id(t) not in converted:
            cast = t.is_floating_point() and not _keeps_fp32(key)
            converted[id(t)] = t.to(dtype) if cast else t
        state[key] = converted[id(t)]
    if out_file is not None:
        client = read_zero_client_state(ckpt_dir)
        client["state_dict"] = state
        atomic_write(Path(out_file), lambda tmp: torch.save(client, tmp))
    return state


# --------------------------------------------------------------------------------- universal
def has_universal_checkpoint(ckpt_dir: str | Path) -> bool:
    """True when ``ckpt_dir`` holds a complete universal copy (written by
    :func:`to_universal_checkpoint`; ``latest_universal`` is written last)."""
    ckpt_dir = Path(ckpt_dir)
    latest = ckpt_dir / _LATEST_UNIVERSAL
    return (
        latest.is_file()
        and latest.read_text().strip() == UNIVERSAL_TAG
        and (ckpt_dir / UNIVERSAL_TAG / "zero" / "optimizer_state.pt").is_file()
    )


def check_universal_files(ckpt_dir: str | Path) -> list[Path]:
    """Check every file DeepSpeed's universal loader will unpickle (it reads them with
    ``weights_only=False``) with the restricted unpickler first.

    Returns:
        The files checked.

    Raises:
        UnsafeCheckpointError: a file needs more than plain data (named in the message).
    """
    return _check_tree(Path(ckpt_dir) / UNIVERSAL_TAG)


def _check_tree(tag_dir: Path) -> list[Path]:
    files = sorted(p for p in tag_dir.rglob("*.pt") if p.is_file())
    for f in files:
        check_torch_file(f, deepspeed=True)
    return files


def to_universal_checkpoint(ckpt_dir: str | Path, workers: int = 1) -> Path:
    """Convert a ZeRO stage 1/2/3 checkpoint to DeepSpeed's universal layout (see the module doc),
    once: an existing complete conversion is kept.

    Written under ``universal.tmp`` by ``deepspeed.checkpoint.ds_to_universal``, renamed to
    ``universal``, then ``latest_universal`` is written atomically; a kill at any point leaves
    either no ``latest_universal`` (the next call converts again) or a complete copy.

    Args:
        ckpt_dir: the checkpoint directory (``.../step000008.ckpt``), written by any number of
            data-parallel ranks (no tensor or pipeline parallelism).
        workers: processes extracting and merging the shards (1: in this process, which is
            what a training rank should use; more for a large checkpoint converted offline).

    Returns:
        ``ckpt_dir``: the directory to give ``engine.load_checkpoint`` with
        ``load_universal`` on.

    Raises:
        ValueError: not a ZeRO checkpoint directory, or ``workers < 1``.
        UnsafeCheckpointError: a shard, or a file of the result, needs more than plain data.
    """
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    ckpt_dir = Path(ckpt_dir)
    if workers < 1:
        raise ValueError(f"workers={workers}: must be >= 1")
    tag_dir = _tag_dir(ckpt_dir)
    if has_universal_checkpoint(ckpt_dir):
        check_universal_files(ckpt_dir)
        return ckpt_dir
    check_zero_files(ckpt_dir)  # NOTE: before ds_to_universal unpickles the shards in full
    out, tmp = ckpt_dir / UNIVERSAL_TAG, temporary_path(ckpt_dir / UNIVERSAL_TAG)
    for stale in (ckpt_dir / _LATEST_UNIVERSAL, tmp, out):
        remove_path(stale)
    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(tmp),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        # Lightning's engine records no UNIVERSAL_CHECKPOINT_INFO (it is for Megatron's tensor
        # and pipeline patterns, which a pure data-parallel checkpoint does not have).
        inject_missing_state=True,
    )
    report = io.StringIO()
    try:
        with contextlib.redirect_stdout(report), contextlib.redirect_stderr(report):
            ds_to_universal(args)  # prints its progress; kept for the debug log
        # ds_to_universal names its output in a latest_universal of its own: ours comes last.
        remove_path(ckpt_dir / _LATEST_UNIVERSAL)
        _check_tree(tmp)
    except BaseException:
        remove_path(tmp)
        raise
    log.debug("ds_to_universal %s:\n%s", tag_dir, report.getvalue())
    publish(tmp, out)
    atomic_write(ckpt_dir / _LATEST_UNIVERSAL, lambda f: f.write_text(UNIVERSAL_TAG))
    log.info(
        "converted %s (%d ranks) to a universal checkpoint", ckpt_dir, zero_world_size(ckpt_dir)
    )
    return ckpt_dir


# --------------------------------------------------------------------------------- crash safety
def temporary_path(path: Path) -> Path:
    """Where a checkpoint is written before :func:`publish` renames it to ``path``."""
    return path.with_name(path.name + TMP_SUFFIX)


def _old(path: Path) -> Path:
    return path.with_name(path.name + OLD_SUFFIX)


def remove_path(path: Path) -> None:
    """Delete a file or a directory tree; no error when it is missing."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path) -> None:
    """Move a complete checkpoint (file or directory) from ``tmp`` to ``path``.

    A file replaces the old one atomically. A directory swaps in with two renames
    (``path -> path.old``, ``tmp -> path``), then ``path.old`` is deleted.
    """
    tmp, path = Path(tmp), Path(path)
    if tmp.is_dir():
        old = _old(path)
        remove_path(old)
        if path.exists():
            os.replace(path, old)
        # NOTE: between these two renames `path` is missing; `path.old` is complete.
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        remove_path(old)
    else:
        os.replace(tmp, path)
        _fsync_dir(path.parent)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, fsync it, then :func:`publish`.

    Raises:
        WriteError: the write failed (disk full, permission, ...): the temporary is removed,
            ``path`` is untouched, and the message names ``path`` and the cause.
    """
    path = Path(path)
    tmp = temporary_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_path(tmp)
        write(tmp)
        if tmp.is_file():
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        publish(tmp, path)
    except (OSError, RuntimeError) as err:
        # NOTE: torch.save reports a full disk as a RuntimeError ("unexpected pos ..."), not
        # as an OSError; the free space tells the two apart, so it is read before the
        # temporary is removed (which frees the room again).
        error = write_error(path, err)
        remove_path(tmp)
        raise error from None


def write_error(path: Path, err: BaseException) -> WriteError:
    """A one-line :class:`WriteError` for a failed write of ``path``: the cause by errno, or by
    the free space left when the writer hid the errno (torch.save)."""
    where = path.parent if path.parent.exists() else Path(path.anchor or ".")
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = None
    if isinstance(err, OSError) and err.errno is not None:
        cause = os.strerror(err.errno)
    elif free is not None and free < (1 << 20):
        cause = "No space left on device"
    else:
        cause = (str(err).splitlines() or [type(err).__name__])[0]
    room = "" if free is None else f"; {free:,} bytes free there"
    return WriteError(f"{path}: could not write it ({cause}{room}); nothing was left behind")


def remove_stale_temporaries(ckpt_dir: str | Path) -> list[Path]:
    """Delete what a killed run left half-written in ``ckpt_dir`` (``*.tmp``), and any
    ``NAME.old`` whose ``NAME`` is in place. Returns what was removed."""
    ckpt_dir = Path(ckpt_dir)
    removed: list[Path] = []
    if not ckpt_dir.is_dir():
        return removed
    for p in sorted(ckpt_dir.iterdir()):
        stale = p.name.endswith(TMP_SUFFIX) or (
            p.name.endswith(OLD_SUFFIX) and p.with_name(p.name[: -len(OLD_SUFFIX)]).exists()
        )
        if stale:
            remove_path(p)
            removed.append(p)
    return removed


def find_resume_checkpoint(ckpt_dir: str | Path, name: str = "last.ckpt") -> Path | None:
    """The checkpoint ``resume="auto"`` continues from: ``NAME`` (file or ZeRO directory), else
    ``NAME.old`` (a kill between the two renames of :func:`publish`), else None.

    Temporary names are never returned: a ``*.tmp`` may be half-written.
    """
    ckpt_dir = Path(ckpt_dir)
    for candidate in (ckpt_dir / name, _old(ckpt_dir / name)):
        if candidate.is_file() or is_zero_checkpoint(candidate):
            return candidate
    return None
