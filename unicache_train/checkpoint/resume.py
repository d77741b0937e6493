"""Which checkpoint ``train.resume=auto`` continues from: the newest intact one.

Candidates, newest first: ``last.ckpt``, ``last.ckpt.old`` (a kill between the two renames of a
ZeRO directory swap, :func:`unicache_train.checkpoint.zero.publish`), then the step checkpoints
``stepNNNNNN.ckpt`` by decreasing step. A candidate is intact when it matches its checksum
manifest (:mod:`unicache_train.checkpoint.integrity`) and, for a file without one, reads as a
``torch.save`` file of plain data. The first intact candidate wins; each one skipped is reported
in one line naming it and why, so a corrupt, truncated or deleted ``last.ckpt`` costs at most the
steps since the newest step checkpoint, never a silent restart from step 0.
"""

from __future__ import annotations

import re
from pathlib import Path

from unicache_train.checkpoint.integrity import IntegrityError, verify
from unicache_train.checkpoint.safe_load import UnsafeCheckpointError, check_torch_file
from unicache_train.checkpoint.zero import OLD_SUFFIX, is_zero_checkpoint

__all__ = ["resume_candidates", "checkpoint_problem", "newest_intact_checkpoint"]

_STEP = re.compile(r"step(\d+)\.ckpt$")


def resume_candidates(ckpt_dir: str | Path, name: str = "last.ckpt") -> list[Path]:
    """Existing checkpoints of ``ckpt_dir``, newest first (see the module doc)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    head = [ckpt_dir / name, ckpt_dir / (name + OLD_SUFFIX)]
    steps = sorted(
        (p for p in ckpt_dir.iterdir() if _STEP.search(p.name)),
        key=lambda p: int(_STEP.search(p.name).group(1)),  # type: ignore[union-attr]
        reverse=True,
    )
    return [p for p in head + steps if p.is_file() or p.is_dir()]


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be resumed from (one line), or None when it is intact."""
    try:
        if path.is_dir():
            if not is_zero_checkpoint(path):
                return "a directory but not a ZeRO checkpoint (no 'latest' file)"
            verify(path)
            return None
        if not verify(path):  # no manifest: the format's own check
            check_torch_file(path)
    except (IntegrityError, UnsafeCheckpointError) as err:
        return str(err)
    return None


def newest_intact_checkpoint(
    ckpt_dir: str | Path, name: str = "last.ckpt"
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest intact checkpoint or None, the newer ones skipped with their reasons)."""
    skipped: list[tuple[Path, str]] = []
    for path in resume_candidates(ckpt_dir, name):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped
