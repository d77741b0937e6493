"""Any task's prompts as JSONL, so another harness (kvpress in its own environment) runs exactly
the prompts we run.

One line per prompt: ``id``, ``task``, ``context``, ``question``, ``answer`` (then ``seed``,
``key`` and ``trailing`` when the record has them). The context is what gets compressed; the
question is fed after it on the compressed cache; the prediction is the first generated line,
stripped (and of ``trailing`` characters), compared with ``answer`` exactly
(:func:`unicache_train.eval.recall.run_recall`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PROMPT_FIELDS", "read_prompts", "write_prompts"]

PROMPT_FIELDS = ("id", "task", "context", "question", "answer")
_OPTIONAL = ("seed", "key", "trailing")


def write_prompts(records: Sequence[dict], path: str | Path) -> Path:
    """Write ``records`` (:func:`~unicache_train.data.recall_task.recall_records`,
    :func:`~unicache_train.data.recall_task.passkey_records`) as JSONL (atomically).

    Raises:
        ValueError: a record lacks one of :data:`PROMPT_FIELDS` or ids repeat.
    """
    rows = []
    for i, r in enumerate(records):
        missing = [f for f in PROMPT_FIELDS if f not in r]
        if missing:
            raise ValueError(f"write_prompts: record {i} lacks {missing}")
        rows.append({f: r[f] for f in (*PROMPT_FIELDS, *_OPTIONAL) if f in r})
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError("write_prompts: prompt ids repeat")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def read_prompts(path: str | Path) -> list[dict]:
    """The records :func:`write_prompts` wrote (they run through ``run_recall`` as they are)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
