"""The library's one fine-tune entry point (unicache_train.train.finetune): the spec is the whole
config, each value in one place, and a run writes its spec, its paths and its code revision."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from unicache_train.train.finetune import FinetuneSpec, MixConfig, finetune, run_mapping
from unicache_train.validation import ConfigError, deep_merge

ROOT = Path(__file__).resolve().parents[1]


def _spec(**kw):
    base = {
        "checkpoint": "DIR",
        "out_dir": "runs/x",
        "seed": 3,
        "steps": 5,
        "mix": {"kind": "file", "path": "mix.jsonl"},
        "compress": {"enabled": True, "method": "none"},
        "run": {"train": {"lr": 1e-4}},
    }
    return deep_merge(base, kw)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"checkpoint": ""}, "FinetuneSpec.checkpoint is not set"),
        ({"out_dir": ""}, "FinetuneSpec.out_dir is not set"),
        ({"steps": 0}, "FinetuneSpec.steps=0 is out of range"),
        ({"seed": -1}, "FinetuneSpec.seed=-1 is out of range"),
        ({"export_dtype": "fp8"}, "FinetuneSpec.export_dtype='fp8' is not allowed"),
        ({"mix": {"kind": "web"}}, "MixConfig.kind='web' is not allowed"),
        ({"mix": {"kind": "file", "path": None}}, "set mix.path"),
        ({"mix": {"kind": "recall", "tasks": [{"pairs": 2}], "records": 4}}, "set mix.seed"),
        (
            {
                "mix": {
                    "kind": "long_context",
                    "tasks": ["niah_single"],
                    "records": 0,
                    "seed": 1,
                    "length": 128,
                }
            },
            "MixConfig.records=0 is out of range",
        ),
        (
            {"mix": {"kind": "long_context", "tasks": [], "records": 2, "seed": 1, "length": 128}},
            "mix.tasks is empty",
        ),
        ({"run": {"train": {"max_steps": 9}}}, "run.train.max_steps is set by FinetuneSpec.steps"),
        ({"run": {"train": {"seed": 1}}}, "run.train.seed is set by FinetuneSpec.seed"),
        ({"run": {"data": {"seed": 1}}}, "run.data.seed is set by FinetuneSpec.data_seed"),
        ({"data_seed": -2}, "FinetuneSpec.data_seed=-2 is out of range"),
        ({"run": {"train": {"out_dir": "y"}}}, "run.train.out_dir is set by FinetuneSpec.out_dir"),
        ({"run": {"data": {"source": "a.jsonl"}}}, "run.data.source is set by FinetuneSpec.mix"),
        ({"run": {"compress": {"enabled": True}}}, "give compression as FinetuneSpec.compress"),
        ({"compress": "on"}, "FinetuneSpec.compress='on': expected a mapping"),
        ({"stepz": 3}, "stepz"),
    ],
)
def test_bad_specs_name_the_field(change, message):
    data = _spec()
    for key, value in change.items():
        data[key] = value  # replace whole sections, not merge
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        FinetuneSpec.from_dict(data)


def test_the_run_mapping_takes_each_value_from_its_one_field():
    spec = FinetuneSpec.from_dict(_spec())
    run = run_mapping(spec, "m.jsonl")
    assert run["data"] == {"source": "m.jsonl", "seed": 3}  # data order: the run's seed
    assert run["train"] == {"lr": 1e-4, "out_dir": "runs/x", "max_steps": 5, "seed": 3}
    assert run["compress"] == {"enabled": True, "method": "none"}
    assert spec.run == {"train": {"lr": 1e-4}}  # the spec itself is not changed
    assert isinstance(spec.mix, MixConfig)
    # the spec round-trips through its YAML (what finetune writes as finetune.yaml)
    assert FinetuneSpec.from_dict(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec


def test_the_data_order_has_its_own_seed_when_given():
    """``data_seed`` orders the data (``data.seed``) apart from ``seed`` (``train.seed``); the
    control fine-tune has nothing else random, so two seeds sharing a data order train the
    same weights (measured: raw/identical/ in the long-context study)."""
    run = run_mapping(FinetuneSpec.from_dict(_spec(data_seed=0)), "m.jsonl")
    assert run["data"]["seed"] == 0 and run["train"]["seed"] == 3
    run = run_mapping(FinetuneSpec.from_dict(_spec(seed=1, data_seed=5)), "m.jsonl")
    assert run["data"]["seed"] == 5 and run["train"]["seed"] == 1


def _study_module():
    path = ROOT / "experiments" / "long_context" / "study.py"
    module_spec = importlib.util.spec_from_file_location("long_context_study", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arm", ["compress", "control"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_long_context_study_runs_what_it_ran_before(arm, seed):
    """The study's spec gives the RunConfig mapping its pre-entry-point code built (transcribed
    here from that code, commit 9863534: deep_merge of finetune.run with the mix, the out dir,
    the seed and the arm's compression; data.seed then DataConfig's default, 0), so every arm
    run with the pinned data order is one study."""
    from unicache_train.data.config import DataConfig

    study_py = _study_module()
    study = study_py.load_study(ROOT / "experiments" / "long_context" / "study.yaml")
    ft = study["finetune"]
    spec = study_py.finetune_spec(study, arm, seed)
    got = run_mapping(spec, "MIX")
    cal = json.loads((ROOT / "experiments" / "long_context" / "calibration.json").read_text())
    compress = {"enabled": True, "method": "none"}
    if arm == "compress":
        compress = {
            "enabled": True,
            "method": "unicache",
            "preset": "attention",
            "attention_scorer": str(ROOT / "experiments" / "long_context" / "scorer.safetensors"),
            "unicache": {"target_rate": cal["attention@16"]["rate"], "quantize": {"bits": 4}},
        }
    old_run = copy.deepcopy(ft["run"])
    old_run["train"]["max_steps"] = 60  # then under run.train, now finetune.steps
    out = Path(ft["out_dir"]) / f"{arm}_seed{seed}"
    before = deep_merge(
        old_run,
        {
            "data": {"source": "MIX", "seed": DataConfig().seed},
            "train": {"out_dir": str(out), "seed": seed},
            "compress": {**compress, "seed": seed, **ft["compress"]},
        },
    )
    assert got == before
    assert spec.mix.kind == "long_context" and spec.mix.seed == ft["seed"] == 21
    assert spec.mix.tasks == study["families"] and spec.mix.length == 512
    assert spec.mix.records == 40 and spec.export and spec.export_dtype is None


def test_the_long_context_study_labels_another_data_order_and_pairs_by_seed():
    study_py = _study_module()
    study = study_py.load_study(ROOT / "experiments" / "long_context" / "study.yaml")
    spec = study_py.finetune_spec(study, "control", 1, data_seed=1)
    assert spec.out_dir.endswith("control_seed1_data1") and spec.data_seed == 1
    assert run_mapping(spec, "MIX")["data"]["seed"] == 1
    pinned = study["finetune"]["data_seed"]
    assert study_py.run_label(study, "control", 1, pinned) == "control_seed1"
    assert study_py._seed_of("compress_seed1_data1") == "1" and study_py._seed_of("base") == "0"
    models = ["base", "compress_seed0", "compress_seed1", "control_seed0", "control_seed1_data1"]
    assert study_py._control_of("compress_seed1", models) == "control_seed1_data1"
    assert study_py._control_of("compress_seed0", models) == "control_seed0"
    assert study_py._control_of("compress_seed2", models) is None


def test_the_global_arm_differs_from_the_compress_arm_only_in_its_budget():
    """``compress_global``: the compress arm's run with one budget over all layers in the loop, at
    ``attention_global@16``'s calibrated rate (the same measured bytes), its compressor
    cross-layer; a made-up arm names the allowed ones; the global arm pairs with the control of
    its seed."""
    from unicache_train.compress.attention_scorer import read_attention_scorer
    from unicache_train.inloop import build_compressor
    from unicache_train.train.config import RunConfig

    study_py = _study_module()
    study = study_py.load_study(ROOT / "experiments" / "long_context" / "study.yaml")
    cal = json.loads((ROOT / "experiments" / "long_context" / "calibration.json").read_text())
    per_layer = run_mapping(study_py.finetune_spec(study, "compress", 1, data_seed=1), "MIX")
    spec = study_py.finetune_spec(study, "compress_global", 1, data_seed=1)
    got = run_mapping(spec, "MIX")
    assert spec.out_dir.endswith("compress_global_seed1_data1")
    uc = got["compress"].pop("unicache")
    assert uc == {
        "target_rate": cal["attention_global@16"]["rate"],
        "quantize": {"bits": 4},
        "schedule": {"global_budget": True},
    }
    per_layer["compress"].pop("unicache")
    got["train"]["out_dir"] = per_layer["train"]["out_dir"]
    assert got == per_layer
    cfg = RunConfig.from_dict(run_mapping(spec, "MIX"))
    scorer = read_attention_scorer(cfg.compress.attention_scorer, (30, 3, 64))
    compressor = build_compressor(cfg.compress, attention_scorer=scorer)
    assert compressor.cross_layer and compressor.target_rate == uc["target_rate"]
    with pytest.raises(ConfigError, match="compress, compress_global, control"):
        study_py.finetune_spec(study, "compressed", 0)
    models = ["base", "compress_global_seed0", "compress_global_seed1_data1", "control_seed0"]
    models.append("control_seed1_data1")
    assert study_py._control_of("compress_global_seed1_data1", models) == "control_seed1_data1"
    assert study_py._control_of("compress_global_seed0", models) == "control_seed0"


def test_the_long_context_table_pairs_seeds_by_seed_and_tests_drops():
    """Pooled and drop tests pair seed k of one arm with seed k of the other: a seed missing on
    one side drops out instead of shifting the pairing; the drop test against the control needs
    no base cell; an arm better uncompressed and compressed by the same margin has the same
    drop (p = 1)."""
    study_py = _study_module()

    def cell(model, setting, correct):
        rows = [{"id": f"p{i}", "correct": c} for i, c in enumerate(correct)]
        return {(model, setting): rows}

    cells = {}
    for model, full, comp in [
        ("compress_global_seed0", [1, 1, 1, 0], [1, 1, 0, 0]),
        ("compress_global_seed1_data1", [1, 1, 1, 1], [1, 1, 1, 0]),
        ("control_seed1_data1", [1, 1, 0, 0], [1, 0, 0, 0]),
    ]:
        cells |= cell(model, "none", full) | cell(model, "x@16", comp)
    pairs = study_py._seed_pairs(cells, "compress_global", "control", ["none", "x@16"])
    assert pairs == [("compress_global_seed1_data1", "control_seed1_data1")]
    assert study_py._pooled_tests(cells) == []  # one pair: nothing pooled
    (drop,) = study_py._drop_tests(cells)
    assert drop["a"] == "compress_global seeds 1 x@16" and drop["b"] == "control seeds x@16"
    assert (drop["full_a"], drop["hits_a"], drop["full_b"], drop["hits_b"]) == (4, 3, 2, 1)
    assert drop["drop_a"] == drop["drop_b"] == 1 and drop["p_mcnemar"] == 1.0

    # A sanity row on a subset of the prompts (kvpress without a press on 2 of 4) has no drop
    # against the full uncompressed cell: it is left out, not an error.
    cells |= cell("compress_global_seed1_data1", "kvpress_none", [1, 1])
    cells |= cell("control_seed1_data1", "kvpress_none", [1, 1])
    assert [d["a"] for d in study_py._drop_tests(cells)] == [drop["a"]]


def test_the_long_context_table_tests_the_scorers_margin_over_the_anchor():
    """On the same weights each arm's scorer is tested against KVzip, and the two arms' margins
    (scorer minus KVzip) against each other, pooled over seeds: a fine-tune whose scorer gains
    on KVzip where the control's loses is favoured on those prompts."""
    study_py = _study_module()
    ours, anchor = study_py.ANCHOR_ON_CONTROL

    def cell(model, setting, correct):
        return {(model, setting): [{"id": f"p{i}", "correct": c} for i, c in enumerate(correct)]}

    cells = {}
    for seed in ("seed0", "seed1_data1"):
        cells |= cell(f"compress_global_{seed}", ours, [1, 1, 1, 0])
        cells |= cell(f"compress_global_{seed}", anchor, [1, 0, 0, 0])
        cells |= cell(f"control_{seed}", ours, [1, 0, 0, 1])
        cells |= cell(f"control_{seed}", anchor, [1, 1, 0, 1])
    rows = {
        r["comparison"].split(",")[0] + " " + r["a"].split()[0]: r
        for r in study_py._anchor_on_control_tests(cells)
    }
    claim = rows["fine-tune + scorer vs control + best anchor compress_global"]
    assert (claim["hits_a"], claim["hits_b"], claim["only_a"], claim["favour_a"]) == (6, 6, 2, 1)
    same = rows["scorer vs best anchor compress_global"]
    assert (same["hits_a"], same["hits_b"], same["favour_a"], same["favour_b"]) == (6, 2, 2, 0)
    same = rows["scorer vs best anchor control"]
    assert (same["hits_a"], same["hits_b"], same["favour_a"], same["favour_b"]) == (4, 6, 0, 1)
    margin = rows["scorer's margin over the best anchor compress_global"]
    # Per prompt, (ours - KVzip) summed over seeds: fine-tune [0, 2, 2, 0], control [0, -2, 0, 0].
    assert (margin["drop_a"], margin["drop_b"]) == (-4, 2)
    assert (margin["favour_a"], margin["favour_b"]) == (2, 0)
    # d = [0, -4, -2, 0]: 2 prompts that may flip sign, both on A's side: p = 2 / 4.
    assert margin["p_mcnemar"] == 0.5


def _tiny_hf(path: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_a_fine_tune_writes_its_spec_paths_and_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("UNICACHE_TRAIN_REVISION", "feedface")  # as under `run --rev`
    src = _tiny_hf(tmp_path / "src")
    spec = FinetuneSpec.from_dict(
        {
            "checkpoint": str(src),
            "out_dir": str(tmp_path / "run"),
            "seed": 7,
            "steps": 2,
            "mix": {
                "kind": "recall",
                "tasks": [{"pairs": 2}],
                "records": 6,
                "seed": 1,
                "text_fraction": 0.25,
            },
            "compress": {
                "enabled": True,
                "method": "unicache",
                "preset": "text_style_baseline",
                "unicache": {"target_rate": 0.5},
            },
            "run": {
                "data": {"seq_len": 160, "batch_size": 2, "pack": False, "val_fraction": 0.0},
                "train": {
                    "lr": 1e-3,
                    "warmup_steps": 0,
                    "accelerator": "cpu",
                    "resume": None,
                    "limit_val_batches": 0,
                    "progress_bar": False,
                },
                "logging": {"logger": "none"},
                "monitor": {"gain": False, "plots": False},
            },
        }
    )
    result = finetune(spec)
    out = tmp_path / "run"
    assert result.steps == 2 and result.export_dir == out / "export"
    assert result.checkpoint.is_file() and result.mix == out / "train_mix.jsonl"
    assert FinetuneSpec.from_dict(yaml.safe_load(result.spec.read_text())) == spec
    record = json.loads(result.run_json.read_text())
    assert record["revision"] == {"sha": "feedface", "dirty": False, "source": "export"}
    assert record["steps"] == 2 and record["export"] == str(out / "export")
    assert json.loads((out / "revision.json").read_text())["sha"] == "feedface"
    config = yaml.safe_load(result.config.read_text())
    assert config["train"]["seed"] == 7 and config["train"]["max_steps"] == 2
    assert config["data"]["source"] == str(out / "train_mix.jsonl")
    policy = json.loads((out / "export" / "compression_config.json").read_text())
    assert policy["policy"]["method"] == "unicache"
    from unicache_train.checkpoint.hf import import_hf

    import_hf(out / "export")  # the export reads back
    # the written spec reruns through the command line, into another folder
    from unicache_train.cli import main

    main(["finetune", "--spec", str(result.spec), "--out_dir", str(tmp_path / "rerun")])
    again = json.loads((tmp_path / "rerun" / "run.json").read_text())
    assert again["steps"] == 2 and again["export"] == str(tmp_path / "rerun" / "export")


def test_cli_finetune_bad_spec_is_one_line(tmp_path, capsys):
    from unicache_train.cli import main

    bad = tmp_path / "spec.yaml"
    bad.write_text(yaml.safe_dump(_spec(steps=0)))
    for argv, message in [
        (["finetune", "--spec", str(bad)], "FinetuneSpec.steps=0 is out of range"),
        (["finetune", "--spec", str(tmp_path / "none.yaml")], "no such file"),
    ]:
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("error: ") and message in err


def test_the_long_context_demo_is_the_studys_spec_made_short(tmp_path):
    """make demo's fine-tunes: the study's seed-0 spec of each arm (the compress label runs the
    arm with one budget over all layers) with the demo's steps, the ramp over the first half,
    warmup and checkpoint within the run; nothing else changed."""
    study_py = _study_module()
    study = study_py.load_study(ROOT / "experiments" / "long_context" / "study.yaml")
    assert study_py.DEMO_ARMS == {"compress": "compress_global", "control": "control"}
    for arm, study_arm in study_py.DEMO_ARMS.items():
        full = study_py.finetune_spec(study, study_arm, 0).to_dict()
        short = study_py.demo_spec(study, arm, 12, tmp_path).to_dict()
        assert short["steps"] == 12 and short["out_dir"] == str(tmp_path / arm)
        assert short["run"]["train"]["checkpoint_every_n_steps"] == 12
        assert short["run"]["train"]["warmup_steps"] == 10
        ramp = short["compress"].get("curriculum_steps")
        assert ramp == (6 if arm == "compress" else full["compress"].get("curriculum_steps"))
        for key in ("checkpoint", "seed", "data_seed", "mix"):
            assert short[key] == full[key], key
        changed = {"steps", "out_dir", "compress", "run"}
        assert {k for k in full if full[k] != short[k]} <= changed
    assert study_py.demo_spec(study, "control", 3, tmp_path).run["train"]["warmup_steps"] == 3


def test_the_long_context_table_clusters_several_questions_by_context():
    """In the several-questions mode a context's questions share one compressed cache: the
    table's test is clustered by context. Three contexts where A answers both questions and B
    neither: 6 discordant pairs (unclustered McNemar p = 2/64), 3 discordant contexts (p = 2/8);
    a context with one question only is paired on that question."""
    study_py = _study_module()

    def rows(correct):
        return [
            {"id": f"c{i}", "question_index": q, "correct": c}
            for i, qs in enumerate(correct)
            for q, c in enumerate(qs)
        ]

    a = rows([[True, True]] * 3 + [[True, False]] * 2 + [[False]])
    b = rows([[False, False]] * 3 + [[True, False]] * 2 + [[False]])
    t = study_py._test(a, b)
    assert (t["n"], t["hits_a"], t["hits_b"], t["only_a"], t["only_b"]) == (11, 8, 2, 6, 0)
    assert t["p_mcnemar"] == pytest.approx(2 / 8)
    one = [{"id": f"c{i}", "correct": r["correct"]} for i, r in enumerate(a)]
    other = [{"id": f"c{i}", "correct": r["correct"]} for i, r in enumerate(b)]
    assert study_py._test(one, other)["p_mcnemar"] == pytest.approx(2 / 64)
