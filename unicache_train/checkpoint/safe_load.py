"""Load ``torch.save`` files without running code from them.

``torch.load(weights_only=False)`` is ``pickle.load``: a checkpoint can name any importable
callable (``os.system``, ``exec``, ...) and have it called while loading. Every checkpoint a user
hands us (``unicache-train evaluate/generate/export --checkpoint``, ``train.resume``,
``recipe.base_checkpoint``, ZeRO directories) therefore goes through :func:`load_torch_file`, which
uses PyTorch's restricted unpickler (``weights_only=True``): dicts, lists, tuples, strings,
numbers, tensors, ``torch.Size``, ``OrderedDict`` and nothing callable.

Our own checkpoints hold only such plain data: the run config travels as a dict
(``RunConfig.to_dict``), Lightning's loop, optimizer, scheduler and callback states are dicts of
numbers and tensors. DeepSpeed's ZeRO files hold a few of DeepSpeed's own classes besides
(:func:`deepspeed_safe_globals`); each is allow-listed only after checking that rebuilding it runs
no code of the file's choosing (see the note there).

DeepSpeed itself reads its files with ``weights_only=False`` (its checkpoint engine and
``zero_to_fp32``), so :func:`check_zero_files` reads every file of a ZeRO directory with the
restricted unpickler first: what it accepts contains no callable beyond the allow-list, and the
full unpickler then rebuilds the same objects. A file that needs more is refused with
:class:`UnsafeCheckpointError` naming the file and what it asked for.
"""

from __future__ import annotations

import functools
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unicache_train.checkpoint.integrity import IntegrityError, verify

__all__ = [
    "UnsafeCheckpointError",
    "deepspeed_safe_globals",
    "load_torch_file",
    "check_torch_file",
    "check_zero_files",
]


class UnsafeCheckpointError(ValueError):
    """A checkpoint file needs the full pickle machinery (it could run code) and was refused."""


@functools.cache
def deepspeed_safe_globals() -> tuple[Any, ...]:
    """DeepSpeed classes stored in ZeRO checkpoint files (0.19: the ZeRO stage, the loss scaler
    and the flat-buffer offsets of each parameter); empty when DeepSpeed is absent.

    NOTE: the restricted unpickler rebuilds an allow-listed class by ``cls.__new__`` plus
    ``__setstate__`` or a ``__dict__`` update, and the int enum by ``ZeroStageEnum(value)``. None
    of these classes defines ``__new__``, ``__setstate__``, ``__setattr__`` or ``__reduce__``, so
    loading one only sets attributes to the (plain) values in the file: nothing is called.
    """
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return ()
    return (ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address)


def _refusal(path: Path, err: Exception) -> UnsafeCheckpointError | IntegrityError:
    text = str(err)
    name = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    detail = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    if name is None and (detail is None or not detail.group(1).strip()):
        return _unreadable(path, "not a pickle, nor a torch.save zip file")
    if name:
        reason = f"its pickle calls {name.group(1)!r}"
    else:
        why = detail.group(1) if detail else (text.splitlines() or [type(err).__name__])[0]
        reason = f"its pickle needs more than plain data ({why})"
    return UnsafeCheckpointError(
        f"{path}: refused to load: {reason}, and loading it could run arbitrary code "
        "(checkpoints are read as plain data only: dicts, lists, numbers, strings, tensors). "
        "If you wrote this file yourself with an older version and trust it, re-save its "
        "state_dict and hyper_parameters as plain data"
    )


def load_torch_file(
    path: str | Path,
    map_location: str | torch.device | Callable | None = "cpu",
    *,
    deepspeed: bool = False,
    mmap: bool = False,
) -> Any:
    """``torch.load(path, weights_only=True)``.

    Args:
        path: a file written by ``torch.save``.
        map_location: as for ``torch.load``.
        deepspeed: also allow :func:`deepspeed_safe_globals` (the files of a ZeRO directory).
        mmap: map the file instead of reading it into memory (a check that discards the result).

    Returns:
        The unpickled object (plain data and tensors).

    Raises:
        UnsafeCheckpointError: the file needs a global (class or function) outside the
            allow-list; the message names the file and the global. Nothing in it was run.
        IntegrityError: the file is empty, truncated or not a ``torch.save`` file.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.stat().st_size == 0:
        raise _unreadable(path, "the file is empty")
    # Only for ZeRO files: importing DeepSpeed takes seconds.
    allowed = list(deepspeed_safe_globals()) if deepspeed else []
    try:
        with torch.serialization.safe_globals(allowed):
            try:
                return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
            except RuntimeError:
                if not mmap:
                    raise
                # a legacy (non-zip) file cannot be mapped: read it
                return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise _refusal(path, err) from None
    except Exception as err:  # noqa: BLE001
        # NOTE: the restricted unpickler runs no code, so whatever it raises on a damaged file
        # (EOFError, IndexError, a zip error, ...) is a property of the file, not a bug here.
        first = (str(err).splitlines() or [""])[0].split(". ")[0] or type(err).__name__
        raise _unreadable(path, first) from None


def _unreadable(path: Path, why: str) -> IntegrityError:
    return IntegrityError(
        f"{path}: not a readable checkpoint ({why}); it is truncated, empty or not written by "
        "torch.save"
    )


def check_torch_file(path: str | Path, *, deepspeed: bool = False) -> None:
    """Raise :class:`UnsafeCheckpointError` unless ``path`` loads with the restricted unpickler
    (memory-mapped when possible, so large shards are not read twice into memory)."""
    load_torch_file(path, deepspeed=deepspeed, mmap=True)


def check_zero_files(ckpt_dir: str | Path) -> list[Path]:
    """Check the files DeepSpeed will unpickle from a ZeRO checkpoint directory, first.

    DeepSpeed reads the ``*.pt`` files of the tag directory that ``ckpt_dir/latest`` names (its
    engine on resume, ``zero_to_fp32`` on consolidation), wherever that tag points; those are
    the files checked.

    Returns:
        The files checked (empty when there is no ``latest`` file: DeepSpeed then loads nothing).

    Raises:
        UnsafeCheckpointError: a file needs more than plain data (named in the message).
    """
    verify(ckpt_dir)  # the directory's checksum manifest, when it has one
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        return []
    tag_dir = Path(ckpt_dir) / latest.read_text().strip()
    files = sorted(p for p in tag_dir.glob("*.pt") if p.is_file())
    for f in files:
        check_torch_file(f, deepspeed=True)
    return files
