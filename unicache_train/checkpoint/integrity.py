"""Checksum manifests: a checkpoint or an export is either exactly what was written, or refused.

Every file checkpoint (``NAME.ckpt``) gets a sidecar ``NAME.ckpt.sha256``; every export directory
and ZeRO checkpoint directory gets ``unicache_manifest.json`` inside it. Both are JSON::

    {"format": "unicache_manifest", "version": 1,
     "files": {"<relative path>": {"size": <bytes>, "sha256": "<hex>"}, ...}}

(a sidecar lists one file, ``"."``: the checkpoint beside it). Manifests are written last and
atomically (temporary name, fsync, rename), so a manifest never describes a half-written file.

:func:`verify` reads the manifest and checks sizes first (cheap: a truncated file is caught without
reading it), then SHA-256. A mismatch raises :class:`IntegrityError` naming the file, what the
manifest says and what is on disk. A file without a manifest (written by an older version, or by
another tool) is *unverified*, not refused: :func:`verify` returns False and loading goes on with
the format's own checks (:func:`unicache_train.checkpoint.safe_load.load_torch_file` refuses a
truncated zip in one line too).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "IntegrityError",
    "CheckpointError",
    "NonFiniteError",
    "WriteError",
    "first_non_finite",
    "MANIFEST_NAME",
    "SIDECAR_SUFFIX",
    "sha256_file",
    "manifest_path",
    "write_manifest",
    "verify",
    "fsync_tree",
]

MANIFEST_NAME = "unicache_manifest.json"
SIDECAR_SUFFIX = ".sha256"
_FORMAT = "unicache_manifest"
_VERSION = 1
_CHUNK = 1 << 22


class WriteError(ValueError):
    """A checkpoint or export could not be written (disk full, permission, ...); the message
    names the path and the cause, and nothing half-written is left behind."""


class CheckpointError(ValueError):
    """A checkpoint reads, but is not what it must be (no state dict or config, another model's
    tensors); the message names the file and what is wrong."""


class NonFiniteError(ValueError):
    """A loss or weight is NaN or infinite where a finite one is needed (training, export); the
    message names the step or the file and the first non-finite tensor."""


class IntegrityError(ValueError):
    """A checkpoint or export differs from its checksum manifest (changed or truncated after it
    was written), or cannot be read as the format it claims; the message names the file."""


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest_path(target: str | Path) -> Path:
    """Where the manifest of ``target`` lives: ``DIR/unicache_manifest.json`` for a directory,
    the sidecar ``FILE.sha256`` for a file."""
    target = Path(target)
    if target.is_dir():
        return target / MANIFEST_NAME
    return target.with_name(target.name + SIDECAR_SUFFIX)


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory; the rename still holds
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file under ``root`` (a directory) and the directories themselves."""
    root = Path(root)
    for dirpath, _, names in os.walk(root):
        for name in names:
            _fsync(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


def _entries(target: Path) -> dict[str, dict[str, Any]]:
    if target.is_file():
        return {".": {"size": target.stat().st_size, "sha256": sha256_file(target)}}
    files = {}
    for p in sorted(target.rglob("*")):
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith(".tmp"):
            rel = p.relative_to(target).as_posix()
            files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return files


def write_manifest(target: str | Path) -> Path:
    """Hash ``target`` (a file, or every file under a directory) and write its manifest
    atomically (temporary name, fsync, rename). Returns the manifest's path."""
    target = Path(target)
    doc = {"format": _FORMAT, "version": _VERSION, "files": _entries(target)}
    out = manifest_path(target)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(json.dumps(doc, indent=1) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise WriteError(f"{out}: could not write it ({os.strerror(err.errno or 0)})") from None
    _fsync_dir(out.parent)
    return out


def _read_manifest(file: Path) -> dict[str, dict[str, Any]]:
    try:
        doc = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise IntegrityError(f"{file}: unreadable checksum manifest ({err})") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != _FORMAT
        or doc.get("version") != _VERSION
        or not isinstance(files, dict)
        or not all(
            isinstance(v, dict)
            and isinstance(v.get("size"), int)
            and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
    ):
        raise IntegrityError(
            f"{file}: not a unicache checksum manifest (format {_FORMAT!r}, version {_VERSION}, "
            "files: {path: {size, sha256}})"
        )
    return files


def verify(target: str | Path) -> bool:
    """Check ``target`` (a checkpoint file, a ZeRO directory or an export directory) against its
    manifest.

    Returns:
        True when a manifest exists and every file it lists matches; False when there is no
        manifest (unverified).

    Raises:
        IntegrityError: a listed file is missing, of another size, or has another SHA-256; the
            message names it.
    """
    target = Path(target)
    file = manifest_path(target)
    if not file.is_file():
        return False
    for rel, want in _read_manifest(file).items():
        path = target if rel == "." else target / rel
        if not path.is_file():
            raise IntegrityError(f"{path}: missing, but listed in {file}")
        size = path.stat().st_size
        if size != want["size"]:
            raise IntegrityError(
                f"{path}: {size} bytes, but {file} records {want['size']} (truncated or "
                f"changed after it was written; if you changed it on purpose, delete {file.name})"
            )
        if sha256_file(path) != want["sha256"]:
            raise IntegrityError(
                f"{path}: its SHA-256 differs from the one in {file} (the file was changed "
                f"after it was written; if you changed it on purpose, delete {file.name})"
            )
    return True


def first_non_finite(tensors: Any) -> str | None:
    """Name of the first floating tensor with a NaN or an infinity among ``(name, tensor)``
    pairs (``named_parameters()``, ``state_dict().items()``); None when all are finite."""
    import torch

    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            if not bool(torch.isfinite(t.detach()).all()):
                return name
    return None
