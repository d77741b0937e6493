"""Fine-tuning data for real checkpoints: key-value recall records mixed with real English text.

Recall records (:mod:`unicache_train.data.recall_task`, built from **training** seeds only) teach
the model to answer from a compressed context; text passages (the ``"train"`` sections of the
Python Language Reference, :func:`unicache_train.data.reference_text.reference_documents`) keep
its language ability. Written as a JSONL file that
:class:`~unicache_train.data.datamodule.LMDataModule` reads (``source: <file>``, ``pack: false``,
``split_at: question``):

* recall: ``text = context + question + " " + answer + "\\n"``, ``question_char`` at the
  question (the split: the question is decoded on the compressed context, as at inference),
  ``split_char`` at the answer;
* text: a passage of about ``text_chars`` characters, ``split_char = question_char = -1`` (the
  trainer draws a random split).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from unicache_train.data.recall_task import RecallTask, recall_records
from unicache_train.data.reference_text import reference_documents

__all__ = ["write_recall_mix", "EVAL_SEED_FLOOR"]

#: Evaluation seeds are >= this; training data refuses them.
EVAL_SEED_FLOOR = 1_000_000


def _passages(text_chars: int) -> list[str]:
    out = []
    for doc in reference_documents("train"):
        for s in range(0, max(len(doc) - text_chars // 2, 1), text_chars):
            piece = doc[s : s + text_chars]
            if len(piece) >= text_chars // 2:
                out.append(piece)
    return out


def write_recall_mix(
    path: str | Path,
    tasks: Sequence[RecallTask],
    records_per_task: int,
    seed: int = 0,
    text_fraction: float = 0.5,
    text_chars: int = 700,
) -> Path:
    """Write the mixed training file.

    Args:
        path: the ``.jsonl`` file (written atomically).
        tasks: recall difficulties, ``records_per_task`` records each.
        seed: training seed (must be below :data:`EVAL_SEED_FLOOR`).
        text_fraction: share of text passages among all rows (passages repeat if needed).
        text_chars: characters per passage.

    Returns:
        ``path``.
    """
    if not 0 <= seed < EVAL_SEED_FLOOR:
        raise ValueError(
            f"seed={seed} is out of range for training data; allowed [0, {EVAL_SEED_FLOOR}) "
            "(larger seeds are reserved for evaluation)"
        )
    if not 0.0 <= text_fraction < 1.0:
        raise ValueError(f"text_fraction={text_fraction!r} is out of range; allowed [0, 1)")
    rows: list[dict] = []
    for task in tasks:
        for r in recall_records(task, records_per_task, seed):
            q = len(r["context"])
            a = q + len(r["question"]) + 1
            text = r["context"] + r["question"] + " " + r["answer"] + "\n"
            rows.append({"text": text, "split_char": a, "question_char": q})
    n_text = round(len(rows) * text_fraction / (1.0 - text_fraction))
    passages = _passages(text_chars)
    rng = random.Random(f"recall_mix|{seed}")
    rng.shuffle(passages)
    for i in range(n_text):
        rows.append({"text": passages[i % len(passages)], "split_char": -1, "question_char": -1})
    rng.shuffle(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def write_training_data(
    work_dir: str | Path,
    tokenizer: str | Path,
    tasks: Sequence[RecallTask],
    records_per_task: int,
    text_fraction: float,
    data: dict,
    seed: int = 0,
) -> dict:
    """Write a recall + text training mix to ``work_dir/train_mix.jsonl`` (``seed`` must be
    below the evaluation seeds) and return the ``data`` section (a :class:`DataConfig` mapping)
    pointing at it, with ``tokenizer`` set."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "train_mix.jsonl"
    mix = write_recall_mix(path, list(tasks), records_per_task, seed, text_fraction)
    return {**data, "source": str(mix), "tokenizer": str(tokenizer)}


def study_training_data(study: dict, work_dir: str | Path, tokenizer: str | Path, **data) -> dict:
    """:func:`write_training_data` from a study's frozen mapping (``train_tasks``,
    ``records_per_task``, ``text_fraction`` and its ``data`` section, as in
    ``experiments/<study>/study.yaml``); ``data`` overrides fields of the data section, and
    ``records_per_task`` may be overridden too."""
    tasks = [RecallTask(**t) for t in study["train_tasks"]]
    records = data.pop("records_per_task", study["records_per_task"])
    section = {**study["data"], **data}
    return write_training_data(work_dir, tokenizer, tasks, records, study["text_fraction"], section)
