"""Long runs from a named revision: ``unicache-train run --rev REV SCRIPT ARGS...``.

A fine-tune that runs for an hour must not change under its own feet when the working tree does
(another commit, a branch switch, an edit in progress): Python imports modules lazily, and a
study that imports a module forty minutes in gets whatever is on disk then. So a long run runs
from a clean export of one commit:

1. :func:`export_revision` resolves ``REV`` (any ``git rev-parse`` name: a sha, a branch, a tag,
   ``HEAD~2``) to its commit and writes ``git archive`` of that commit to
   ``<cache>/revs/<sha>/``, into a temporary folder renamed into place when complete (a killed
   export leaves no half tree that a later run would reuse); an existing export is reused.
2. :func:`run_at_revision` runs ``python <export>/SCRIPT ARGS...`` (or ``-m MODULE``, or a
   ``unicache-train`` command) with the export first on ``PYTHONPATH``, so ``import
   unicache_train`` is the export's even where the project is installed editable, and with
   :data:`ENV` set to the sha. The working directory is the caller's: relative output paths
   (``runs/...``, a study's ``out_dir``) land where they would without ``--rev``.
3. :func:`current_revision` is what every run records (``revision.json`` next to a fit's
   ``config.yaml``, ``run.json`` of a fine-tune): the sha from :data:`ENV` inside an export, else
   ``git`` on the package's own checkout (with ``dirty`` when the tree has changes), else
   ``unknown``.

Replaces the ad-hoc launcher the studies used before (``runs/evidence/snap_run.py``, an ignored
folder: a snapshot copied by hand).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

from unicache_train.validation import ConfigError

ENV = "UNICACHE_TRAIN_REVISION"
"""Set to the commit's sha in a process started by :func:`run_at_revision`."""

MARKER = ".unicache_revision"
"""File at the root of an export holding its sha (written last: its presence means complete)."""

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
"""The folder that holds this ``unicache_train`` package (a checkout or an export)."""


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, check=check, timeout=600
        )
    except FileNotFoundError as err:
        raise ConfigError("run --rev needs git on PATH; it was not found") from err


def current_revision(repo: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The code revision this process runs: ``{"sha", "dirty", "source"}``.

    ``source`` is ``"export"`` inside :func:`run_at_revision` (sha from :data:`ENV`, never
    dirty), ``"git"`` when ``repo`` (default: the package's own folder) is a git checkout
    (``dirty`` when ``git status`` lists changes to tracked or untracked, unignored files), and
    ``"unknown"`` otherwise (an installed wheel): ``sha`` is then None.
    """
    env = os.environ.get(ENV)
    if env:
        return {"sha": env, "dirty": False, "source": "export"}
    root = Path(repo) if repo is not None else PACKAGE_ROOT
    try:
        head = _git(root, "rev-parse", "--verify", "HEAD", check=False)
        status = _git(root, "status", "--porcelain", check=False)
    except ConfigError:
        return {"sha": None, "dirty": None, "source": "unknown"}
    top = _git(root, "rev-parse", "--show-toplevel", check=False)
    if head.returncode != 0 or top.returncode != 0 or status.returncode != 0:
        return {"sha": None, "dirty": None, "source": "unknown"}
    if Path(top.stdout.decode().strip()).resolve() != root.resolve():
        # The package sits inside some other repository (a virtual environment in a checkout):
        # that repository's HEAD says nothing about this code.
        return {"sha": None, "dirty": None, "source": "unknown"}
    return {
        "sha": head.stdout.decode().strip(),
        "dirty": bool(status.stdout.strip()),
        "source": "git",
    }


def resolve_revision(rev: str, repo: str | os.PathLike[str] = ".") -> str:
    """The full sha of commit ``rev`` in ``repo``; :class:`ConfigError` naming it if none."""
    if not rev or rev.startswith("-"):
        raise ConfigError(f"run --rev={rev!r}: give a commit, branch or tag name")
    done = _git(Path(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if done.returncode != 0:
        inside = _git(Path(repo), "rev-parse", "--git-dir", check=False).returncode == 0
        where = (
            f"the repository at {str(repo)!r}"
            if inside
            else f"{str(repo)!r} (not a git repository)"
        )
        raise ConfigError(f"run --rev={rev!r}: no such commit in {where}")
    return done.stdout.decode().strip()


def default_cache_dir() -> Path:
    """``$UNICACHE_TRAIN_CACHE`` or ``~/.cache/unicache_train`` (as the fetch code)."""
    return Path(os.environ.get("UNICACHE_TRAIN_CACHE", Path.home() / ".cache" / "unicache_train"))


def export_revision(
    rev: str,
    repo: str | os.PathLike[str] = ".",
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """A clean tree of commit ``rev`` of ``repo`` at ``<cache_dir>/revs/<sha>``; its path.

    Reused when it already exists (the marker file is written last); otherwise extracted from
    ``git archive`` into a temporary sibling and renamed into place, so a run never starts from
    a partial export. Symbolic links inside the tree (``unicache_train/kernels``) are kept.
    """
    sha = resolve_revision(rev, repo)
    revs = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "revs"
    target = revs / sha
    if (target / MARKER).is_file():
        return target
    revs.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}.", dir=revs))
    try:
        archive = _git(Path(repo), "archive", "--format=tar", sha).stdout
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
            tar.extractall(tmp, filter="data")
        (tmp / MARKER).write_text(sha + "\n")
        if target.exists():  # an incomplete leftover (no marker) or a concurrent export
            if (target / MARKER).is_file():
                shutil.rmtree(tmp)
                return target
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# The child's first lines. ``python -m`` would put the working directory (often the checkout)
# first on sys.path, and an editable install (setuptools' meta-path finder, or a path entry) would
# serve any module the revision lacks from the checkout instead of failing: so the child drops
# both before it runs anything. argv: -c CHECKOUT KIND TARGET ARGS...
_BOOTSTRAP = """\
import os, runpy, sys
checkout = os.path.realpath(sys.argv.pop(1))
kind, target = sys.argv.pop(1), sys.argv.pop(1)
sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != checkout]
sys.meta_path[:] = [
    f for f in sys.meta_path
    if not str(getattr(f, "__module__", "")).startswith("__editable___unicache_train")
]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.argv[0] = target
    sys.path.insert(0, os.path.dirname(target))
    runpy.run_path(target, run_name="__main__")
"""


def _child(kind: str, target: str, args: list[str]) -> list[str]:
    return [sys.executable, "-c", _BOOTSTRAP, str(PACKAGE_ROOT), kind, target, *args]


def _command_of(export: Path, argv: list[str], commands: Collection[str]) -> list[str]:
    if not argv:
        raise ConfigError(
            "run --rev REV: give the script to run (a .py path, -m MODULE or a command)"
        )
    head, rest = argv[0], argv[1:]
    if head == "-m":
        if not rest:
            raise ConfigError("run --rev REV -m: give the module to run")
        return _child("module", rest[0], rest[1:])
    if head in commands:
        return _child("module", "unicache_train.cli", argv)
    script = Path(head)
    if script.is_absolute():
        try:
            script = script.resolve().relative_to(Path.cwd().resolve())
        except ValueError as err:
            raise ConfigError(
                f"run --rev SCRIPT={head!r}: give the script's path relative to the checkout"
            ) from err
    inside = export / script
    if not inside.is_file():
        raise ConfigError(
            f"run --rev SCRIPT={head!r}: no such file in revision {export.name[:12]} "
            f"(looked for {inside})"
        )
    return _child("script", str(inside), rest)


def run_at_revision(
    rev: str,
    argv: list[str],
    repo: str | os.PathLike[str] = ".",
    cache_dir: str | os.PathLike[str] | None = None,
    commands: Collection[str] = (),
) -> int:
    """Run ``argv`` (``SCRIPT ARGS...``, ``-m MODULE ARGS...`` or ``COMMAND ARGS...``) from the
    export of ``rev``; the child's exit code.

    The working directory stays the caller's; ``PYTHONPATH`` starts with the export; :data:`ENV`
    holds the sha, so :func:`current_revision` in the child (and every run's recorded revision)
    reads it. ``commands``: the names that run as ``python -m unicache_train.cli NAME`` (the
    command line passes its own; a script path never collides with them).
    """
    export = export_revision(rev, repo, cache_dir)
    command = _command_of(export, argv, commands)
    env = dict(os.environ)
    env[ENV] = export.name
    env["PYTHONPATH"] = os.pathsep.join(
        [str(export), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    print(f"[run --rev] {rev} = {export.name} from {export}", file=sys.stderr, flush=True)
    return subprocess.call(command, env=env)


def write_revision(path: str | os.PathLike[str], **extra: Any) -> Path:
    """Write :func:`current_revision` (and ``extra`` fields) as JSON to ``path``, atomically."""
    import json

    from unicache_train.checkpoint.zero import atomic_write

    record = {**current_revision(), **extra}
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    atomic_write(Path(path), lambda tmp: tmp.write_text(text))
    return Path(path)


if __name__ == "__main__":  # python -m unicache_train.revision: what this process would record
    import json

    print(json.dumps({**current_revision(), "package": str(PACKAGE_ROOT)}, sort_keys=True))
