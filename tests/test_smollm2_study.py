"""The SmolLM2 study scripts freeze the main recipe's training mix and evaluation settings in
``scripts/smollm2_study.py``; this fails when they drift from ``recipes/smollm2_compress.yaml``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _study():
    path = ROOT / "scripts" / "smollm2_study.py"
    spec = importlib.util.spec_from_file_location("smollm2_study", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_frozen_settings_equal_the_main_recipe():
    s = _study()
    recipe = yaml.safe_load((ROOT / "recipes" / "smollm2_compress.yaml").read_text())
    study, data = recipe["study"], recipe["data"]
    assert s.TRAIN_TASKS == study["train_tasks"]
    assert s.RECORDS_PER_TASK == study["train_records_per_task"]
    assert s.TEXT_FRACTION == study["text_fraction"]
    assert s.DATA == {k: data[k] for k in s.DATA}
    assert [s.RECALL_TASK] == study["tasks"]
    assert s.RECALL_SEED == study["recall_seed"]
    assert (s.TEXT_BLOCKS, s.TEXT_BLOCK, s.TEXT_CONTEXT) == (
        study["text_blocks"], study["text_block"], study["text_context"])  # fmt: skip


def test_training_data_writes_the_mix_and_points_the_data_section_at_it(tmp_path):
    s = _study()
    d = s.training_data(tmp_path / "w", "tok-dir", records_per_task=5, seq_len=64)
    rows = [json.loads(line) for line in Path(d["source"]).read_text().splitlines()]
    assert d["seq_len"] == 64 and d["batch_size"] == s.DATA["batch_size"]
    assert d["tokenizer"] == "tok-dir" and d["split_at"] == "question"
    # 3 tasks x 5 records, plus text rows making up TEXT_FRACTION of all rows
    n_text = len(rows) - 15
    assert n_text > 0 and abs(n_text / len(rows) - s.TEXT_FRACTION) < 0.1
