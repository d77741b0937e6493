"""What the SmolLM2 study scripts share (``smollm2_mla.py``, ``smollm2_mla_compress.py``,
``smollm2_mhc_retrofit.py``): the main recipe's training mix and its evaluation settings.

They are frozen here, once, rather than read from ``recipes/smollm2_compress.yaml`` at run time,
so that the committed results of these scripts stay reproducible when the recipe's defaults
move; ``tests/test_smollm2_study.py`` fails when the two drift apart.

Never imported by the library.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The recipe's training mix (study.train_tasks, train_records_per_task, text_fraction) ...
TRAIN_TASKS = [
    {"pairs": 8, "distractors": 0},
    {"pairs": 16, "distractors": 0},
    {"pairs": 12, "distractors": 2},
]
RECORDS_PER_TASK = 300
TEXT_FRACTION = 0.4
# ... its data section (no packing, the split at the recall question, no loss on the prompt) ...
DATA = {"seq_len": 192, "batch_size": 4, "pack": False, "split_at": "question",
        "prompt_loss": False, "val_fraction": 0.02}  # fmt: skip
# ... and its evaluation: held-out recall seeds (>= EVAL_SEED_FLOOR) and held-out text blocks.
RECALL_TASK = {"pairs": 8, "distractors": 0}
RECALL_SEED = 1_000_003
TEXT_BLOCKS, TEXT_BLOCK, TEXT_CONTEXT = 8, 256, 192


def training_data(
    work_dir: str | Path,
    tokenizer: str | Path,
    *,
    records_per_task: int = RECORDS_PER_TASK,
    **data: Any,
) -> dict[str, Any]:
    """Write the training mix to ``work_dir/train_mix.jsonl`` (seed 0, below the evaluation
    seeds) and return the recipe's data section pointing at it; ``data`` overrides its fields
    (e.g. ``seq_len``, ``batch_size``)."""
    from unicache_train.data.recall_mix import write_recall_mix
    from unicache_train.eval import RecallTask

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    mix = write_recall_mix(work / "train_mix.jsonl", [RecallTask(**t) for t in TRAIN_TASKS],
                           records_per_task, seed=0, text_fraction=TEXT_FRACTION)  # fmt: skip
    return {**DATA, **data, "source": str(mix), "tokenizer": str(tokenizer)}


def training_datamodule(work_dir: str | Path, tokenizer: str | Path, **data: Any):
    """:func:`training_data` as a set-up :class:`~unicache_train.data.datamodule.LMDataModule`."""
    from unicache_train.config import DataConfig
    from unicache_train.data.datamodule import LMDataModule

    dm = LMDataModule(DataConfig(**training_data(work_dir, tokenizer, **data)))
    dm.setup()
    return dm
