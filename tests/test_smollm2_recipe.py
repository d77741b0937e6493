"""The SmolLM2 study recipe's settings: METHOD@REDUCTION parsing and byte-calibrated compressors.

Runs on a tiny random decoder (the real checkpoint is exercised by ``make demo``); what is checked
is the calibration contract: every UniCache setting reaches its KV-bytes target as measured on the
compressed cache, with the storage format its method names.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from unicache_train.eval.budget import measured_reduction
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.validation import ConfigError

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_compress.py"


@pytest.fixture(scope="module")
def recipe():
    return importlib.import_module("recipes.smollm2_compress")


@pytest.mark.parametrize(
    "spec, want",
    [
        ("unicache@4", ("unicache", 4.0)),
        ("unicache_q4@8", ("unicache_q4", 8.0)),
        ("xkv@2.5", ("xkv", 2.5)),
        ("unicache_span@4", ("unicache_span", 4.0)),
        ("unicache+xkv@8", ("unicache+xkv", 8.0)),
        ("retention_q4@16", ("retention_q4", 16.0)),
    ],
)
def test_parse_setting(recipe, spec, want) -> None:
    assert recipe.parse_setting(spec) == want


@pytest.mark.parametrize("spec", ["unicache", "foo@4", "unicache@1", "unicache_q4@x", "@4"])
def test_parse_setting_refuses_bad_specs(recipe, spec) -> None:
    with pytest.raises(ConfigError, match="METHOD@REDUCTION") as err:
        recipe.parse_setting(spec)
    assert "unicache_q4" in str(err.value)  # the allowed methods are named


def _tiny_model_and_batch():
    """A 2-layer GQA decoder and a calibration batch (contexts of 80 and 72 tokens)."""
    torch.manual_seed(0)
    model = Decoder(
        ModelConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=97,
        )
    ).eval()
    return model, torch.randint(0, 97, (2, 96)), torch.tensor([80, 72])


def test_settings_reach_their_byte_targets_with_their_storage(recipe) -> None:
    model, ids, split = _tiny_model_and_batch()
    study = {"settings": ["unicache@4", "unicache_q4@4", "unicache_q4@8"], "span_pool": 7}
    with torch.no_grad():
        settings = recipe.build_settings(model, ids, split, study)
    by = {(s.method, s.target): s for s in settings}
    assert by[("none", 1.0)].rate == 0.0
    for key, bits in [(("unicache", 4.0), 8), (("unicache_q4", 4.0), 4), (("unicache_q4", 8.0), 4)]:
        s = by[key]
        assert s.unicache.quantize.enabled and s.unicache.quantize.bits == bits
        # the calibrated rate reaches the target, measured again on the same batch
        got = measured_reduction(model, ids, split, s.build(model))
        assert got >= key[1] - 1e-6, (key, got)
    # int4 spends the byte budget on precision: far fewer tokens removed at the same target
    assert by[("unicache_q4", 4.0)].rate < 0.5 * by[("unicache", 4.0)].rate
    assert by[("unicache_q4", 4.0)].rate < by[("unicache_q4", 8.0)].rate


def test_unicache_then_xkv_setting_reaches_its_target(recipe) -> None:
    """unicache+xkv: token removal at xkv_token_rate, then xKV calibrated on the measured total
    (16-bit factors: no head merging, no quantization, as in training)."""
    model, ids, split = _tiny_model_and_batch()
    study = {"settings": ["unicache+xkv@4"], "span_pool": 7, "xkv_token_rate": 0.5}
    with torch.no_grad():
        (_, s) = recipe.build_settings(model, ids, split, study)
        got = measured_reduction(model, ids, split, s.build(model))
    assert s.method == "unicache+xkv" and s.rate == 0.5
    assert abs(got - 4.0) / 4.0 < 0.15, got  # rank is an integer: close, not exact
    comp = s.build(model)
    assert comp.token_compressor.config.quantize.bits is None
    assert not comp.token_compressor.config.head_merge.enabled


def test_results_table_and_plot_take_kvpress_rows_and_several_tasks(tmp_path) -> None:
    """kvpress rows (recall only) join the study table and plot; perplexity reads 'not measured'."""
    from scripts.merge_results import kvpress_row
    from unicache_train.eval.report import read_results, write_results

    def row(model, method, red, task, recall, ppl):
        return {
            "model": model,
            "method": method,
            "target_reduction": red,
            "rate": 0.0,
            "kv_reduction": red,
            "task": task,
            "recall": recall,
            "recall_se": 0.05,
            "n": 32,
            "ppl": ppl,
            "ppl_se": 1.0,
            "ppl_delta": ppl / 8.0 - 1.0,
        }

    press = kvpress_row(
        {
            "model": "ft",
            "press": "SnapKVPress",
            "compression_ratio": "0.75",
            "kv_reduction": "4",
            "task": "recall8",
            "recall": "0.125",
            "recall_se": "0.058",
            "n": "32",
        }
    )
    assert press["method"] == "kvpress:SnapKV" and press["kv_reduction"] == 4.0
    rows = [
        row("ft", "none", 1.0, "recall8", 0.9, 8.0),
        row("ft", "none", 1.0, "recall16", 0.8, 8.0),
        row("ft", "unicache_q4", 4.0, "recall8", 0.8, 8.6),
        row("ft", "unicache_q4", 4.0, "recall16", 0.7, 8.6),
        press,
    ]
    write_results(rows, tmp_path, ["command: test"])
    md = (tmp_path / "results.md").read_text()
    # 4 of 32 with its 95% Wilson interval
    want = "| ft | kvpress:SnapKV | 4.00x | recall8 | 0.12 [0.05, 0.28] (n=32) | not measured |"
    assert want in md
    assert (tmp_path / "results.png").stat().st_size > 10_000
    back = read_results(tmp_path / "results.csv")
    assert [r["method"] for r in back] == [r["method"] for r in rows]


@torch.no_grad()
def test_evaluate_writes_per_prompt_predictions_and_per_block_losses(recipe, tmp_path) -> None:
    import json

    from unicache_train.data.tokenizer import ByteTokenizer
    from unicache_train.eval import RecallTask
    from unicache_train.eval.text import text_blocks
    from unicache_train.seam import IdentityCompressor

    torch.manual_seed(0)
    model = Decoder(
        ModelConfig(
            vocab_size=259,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    tok = ByteTokenizer()
    blocks = text_blocks(tok, ["The quick brown fox jumps over the lazy dog. " * 8], 48, 3)
    study = {"num_recall": 3, "recall_seed": 1_000_003, "text_context": 32, "batch_size": 2}
    settings = [recipe.Setting("none", 1.0, 0.0, lambda m: IdentityCompressor())]
    rows = recipe.evaluate(
        model,
        tok,
        "base",
        settings,
        [RecallTask(3, value_digits=2)],
        study,
        blocks,
        lambda m: None,
        tmp_path,
    )
    pred = tmp_path / "predictions" / "base__none@1__recall3.jsonl"
    got = [json.loads(x) for x in pred.read_text().splitlines()]
    assert [r["id"] for r in got] == [f"recall3/1000003/{i}" for i in range(3)]
    assert sum(r["correct"] for r in got) == round(rows[0]["recall"] * 3)
    ppl_file = pred.parent / "base__none@1__ppl.jsonl"
    ppl = [json.loads(x) for x in ppl_file.read_text().splitlines()]
    assert len(ppl) == 3 and all(r["tokens"] == 16 for r in ppl)


def test_selection_settings_reach_their_targets_and_retention_reads_the_models_policy(
    recipe,
) -> None:
    """sinks_recent_q4 / snapkv_q4 / retention_q4: the selection's preset with int4 storage at
    the byte target; a retention setting on a model without a policy ranks as its prior (the
    zero init), on a model with one it uses that policy."""
    from unicache_train.compress.retention import attach_retention

    model, ids, split = _tiny_model_and_batch()
    specs = ["sinks_recent_q4@8", "snapkv_q4@8", "retention_q4@8"]
    with torch.no_grad():
        settings = recipe.build_settings(model, ids, split, {"settings": specs, "span_pool": 7})
    by = {s.method: s for s in settings}
    for method, sel in [
        ("sinks_recent_q4", "sinks_recent"),
        ("snapkv_q4", "snapkv"),
        ("retention_q4", "retention"),
    ]:
        s = by[method]
        assert s.unicache.selection.method == sel and s.unicache.quantize.bits == 4
        assert not s.unicache.head_merge.enabled
        with torch.no_grad():
            got = measured_reduction(model, ids, split, s.build(model))
        assert got >= 8.0 - 1e-6, (method, got)
    assert not hasattr(model, "kv_retention")  # evaluating a policy-less model attaches none
    prior = by["retention_q4"].build(model)
    assert float(prior.retention.weight.abs().sum()) == 0.0
    with torch.no_grad():
        attach_retention(model).weight.normal_()
    assert by["retention_q4"].build(model).retention is model.kv_retention


def test_compress_unicache_overrides_apply_on_top_of_the_calibrated_setting(
    recipe, tmp_path, monkeypatch
) -> None:
    """The in-loop compressor of a ``compress`` fine-tune is the calibrated setting (its rate,
    selection, storage) with the user's ``compress.unicache.*`` overrides merged on top, e.g.
    ``compress.unicache.selection.lr_scale=300``; nothing the user did not name changes."""
    from unicache_train.train import from_hf  # the fine-tune entry point calls it there

    model, ids, split = _tiny_model_and_batch()
    with torch.no_grad():
        settings = recipe.build_settings(
            model, ids, split, {"settings": ["retention_q4@8"], "span_pool": 7}
        )
    (setting,) = [s for s in settings if s.method == "retention_q4"]
    calibrated = setting.unicache.to_dict()
    seen = {}

    class Stop(Exception):
        pass

    def capture(ckpt_dir, run, **retrofit):
        seen.update(run)
        raise Stop

    monkeypatch.setattr(from_hf, "prepare_hf_run", capture)
    study = {"train_tasks": [{"pairs": 4}], "train_records_per_task": 2, "text_fraction": 0.0}
    user = {"compress": {"unicache": {"selection": {"lr_scale": 300.0}}}}
    with pytest.raises(Stop):
        recipe.finetune("compress", tmp_path, user, study, setting.unicache, tmp_path, "llama")
    got = seen["compress"]["unicache"]
    assert got["selection"]["lr_scale"] == 300.0
    assert got["selection"]["method"] == "retention"
    assert got["target_rate"] == calibrated["target_rate"] == pytest.approx(setting.rate)
    assert got["quantize"] == calibrated["quantize"]
    assert calibrated["selection"]["lr_scale"] != 300.0  # the override changed something
    assert user["compress"]["unicache"] == {"selection": {"lr_scale": 300.0}}  # not mutated
    # the data order the studies ran with: data.seed (0 unless given), whatever train.seed is
    assert seen["data"]["seed"] == 0 and seen["train"]["seed"] == 42  # TrainConfig's default
    seen.clear()
    user = {"train": {"seed": 1}, "data": {"seed": 4}}
    with pytest.raises(Stop):
        recipe.finetune("control", tmp_path, user, study, setting.unicache, tmp_path, "llama")
    assert seen["data"]["seed"] == 4 and seen["train"]["seed"] == 1


@pytest.mark.parametrize("evaluate_finetuned", [True, False])
def test_the_recipes_own_evaluation_of_the_fine_tunes_can_be_skipped(
    recipe, tmp_path, monkeypatch, evaluate_finetuned
) -> None:
    """``study.evaluate_finetuned=false``: fine-tune and export only (a study evaluates the
    exports itself); the base is still evaluated unless ``study.evaluate_base=false``."""
    import unicache_train.checkpoint.gguf as gguf
    import unicache_train.checkpoint.hf as hf
    import unicache_train.data.eval_text as eval_text
    import unicache_train.data.tokenizer as tokenizer
    import unicache_train.eval.text as text

    model, ids, _ = _tiny_model_and_batch()
    monkeypatch.setattr(gguf, "fetch", lambda name: tmp_path)
    monkeypatch.setattr(hf, "import_hf", lambda path: (model, model.config))
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(eval_text, "fetch_eval_text", lambda: None)
    monkeypatch.setattr(eval_text, "eval_documents", lambda: [])
    monkeypatch.setattr(text, "text_blocks", lambda tok, docs, n, k: ids)
    monkeypatch.setattr(recipe, "checkpoint_family", lambda path: "llama")
    monkeypatch.setattr(recipe, "build_settings", lambda *a: [])
    labels = []
    monkeypatch.setattr(recipe, "evaluate", lambda m, tok, label, *a: labels.append(label) or [])
    import unicache_train.eval.report as report

    monkeypatch.setattr(report, "write_results", lambda *a: None)
    tuned = []
    monkeypatch.setattr(
        recipe, "finetune", lambda kind, *a: tuned.append(kind) or (model, tmp_path / kind)
    )
    recipe.main(
        [
            f"study.out_dir={tmp_path / 'out'}",
            "study.finetune=[control]",
            f"study.evaluate_finetuned={str(evaluate_finetuned).lower()}",
        ]
    )
    assert tuned == ["control"]
    assert labels == (["base", "control fine-tune"] if evaluate_finetuned else ["base"])
