"""End-to-end training: the loss falls, checkpoints resume, fabric run with 2 CPU processes."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from unicache_train.data.config import DataConfig, SyntheticDataConfig
from unicache_train.model.config import ModelConfig
from unicache_train.train.config import LoggingConfig, RunConfig, TrainConfig
from unicache_train.train.module import warmup_cosine
from unicache_train.train.run import apply_launcher_env, fit

ROOT = Path(__file__).resolve().parents[1]


def small_config(out_dir: Path, **train) -> RunConfig:
    tc = dict(
        max_steps=40,
        lr=3e-3,
        warmup_steps=5,
        val_every_n_steps=20,
        limit_val_batches=2,
        checkpoint_every_n_steps=10,
        accelerator="cpu",
        devices=1,
        out_dir=str(out_dir),
        progress_bar=False,
        log_every_n_steps=1,
    )
    tc.update(train)
    return RunConfig(
        model=ModelConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        data=DataConfig(
            seq_len=64, batch_size=8, synthetic=SyntheticDataConfig(num_stories=150, num_recall=150)
        ),
        train=TrainConfig(**tc),
        logging=LoggingConfig(logger="csv"),
    )


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def read_csv_losses(out_dir: Path) -> dict[int, float]:
    rows = {}
    for f in out_dir.glob("csv/version_*/metrics.csv"):
        with f.open() as fh:
            for row in csv.DictReader(fh):
                if row.get("train/loss"):
                    rows[int(row["step"])] = float(row["train/loss"])
    return rows


def test_tiny_model_learns(tmp_path):
    rec = LossRecorder()
    trainer = fit(small_config(tmp_path), callbacks=[rec])
    assert trainer.global_step == 40
    first = sum(rec.losses[:3]) / 3
    last = sum(rec.losses[-5:]) / 5
    # Byte-level LM starts near ln(260) = 5.56; a real learning signal gets well below 60% of it.
    assert first > 5.0
    assert last < 0.6 * first, (first, last)
    assert (tmp_path / "config.yaml").exists()
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert "val/ppl" in trainer.callback_metrics


def test_resume_continues_step_count_and_loss(tmp_path):
    rec1 = LossRecorder()
    fit(small_config(tmp_path, max_steps=20), callbacks=[rec1])
    rec2 = LossRecorder()
    trainer = fit(small_config(tmp_path, max_steps=30, resume="auto"), callbacks=[rec2])
    assert trainer.global_step == 30
    assert len(rec2.losses) == 10  # only the remaining steps ran
    # The curve continues: the first resumed losses sit near the last ones, far from the start.
    assert sum(rec2.losses[:3]) / 3 < 0.8 * (sum(rec1.losses[:3]) / 3)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 30
    assert ckpt["hyper_parameters"]["config"]["train"]["max_steps"] == 30


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(100, 10, 100, 0.1) == pytest.approx(0.1)
    vals = [warmup_cosine(s, 10, 100, 0.1) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_launcher_env_overrides_recipe():
    cfg = RunConfig()
    env = {
        "LT_CLI_USED": "1",
        "LT_ACCELERATOR": "cpu",
        "LT_STRATEGY": "ddp",
        "LT_DEVICES": "2",
        "LT_NUM_NODES": "1",
        "LT_PRECISION": "32",
    }
    apply_launcher_env(cfg, env)
    assert (cfg.train.accelerator, cfg.train.strategy, cfg.train.devices) == ("cpu", "ddp", 2)
    assert cfg.train.precision == "32-true"
    untouched = RunConfig()
    apply_launcher_env(untouched, {"LT_DEVICES": "8"})  # not started by `fabric run`
    assert untouched.train.devices == 1


def _fabric_run(out_dir: Path, max_steps: int) -> subprocess.CompletedProcess:
    fabric = Path(sys.executable).with_name("fabric")
    overrides = [
        f"train.max_steps={max_steps}",
        f"train.out_dir={out_dir}",
        "train.resume=auto",
        "train.checkpoint_every_n_steps=4",
        "train.val_every_n_steps=4",
        "train.limit_val_batches=1",
        "train.progress_bar=false",
        "train.log_every_n_steps=1",
        "train.warmup_steps=2",
        "logging.logger=csv",
        "model.hidden_size=64",
        "model.num_hidden_layers=2",
        "model.intermediate_size=128",
        "data.seq_len=64",
        "data.batch_size=4",
        "data.synthetic.num_stories=100",
        "data.synthetic.num_recall=100",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            str(fabric),
            "run",
            "--accelerator",
            "cpu",
            "--devices",
            "2",
            "--strategy",
            "ddp",
            str(ROOT / "recipes" / "pretrain_tiny.py"),
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )


def test_fabric_run_ddp_two_processes_and_resume(tmp_path):
    out = tmp_path / "run"
    proc = _fabric_run(out, 8)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 8 and ckpt["world_size"] == 2
    losses_before = read_csv_losses(out)
    proc = _fabric_run(out, 12)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 12
    losses = read_csv_losses(out)
    assert max(losses) >= 11 and min(losses) == 0
    # The second run logged only steps 8..11 and started from the trained weights.
    assert losses[8] < losses_before[0]
    assert ckpt["world_size"] == 2  # two ranks really ran (gloo)


def test_cli_fit_accepts_compress_section(monkeypatch):
    """``unicache-train fit compress.*=...`` reaches the run config (preset merge included)."""
    import unicache_train.train.run as run_mod
    from unicache_train.cli import main

    seen = {}
    monkeypatch.setattr(run_mod, "fit", lambda config: seen.setdefault("config", config))
    main(
        [
            "fit",
            "compress.enabled=true",
            "compress.preset=text_style_baseline",
            "compress.unicache.target_rate=0.5",
            "compress.unicache.quantize.bits=4",
            "compress.kl_weight=0.25",
        ]
    )
    cc = seen["config"].compress
    assert cc.enabled and cc.kl_weight == 0.25
    assert cc.unicache.target_rate == 0.5 and cc.unicache.quantize.bits == 4
    # The preset's own settings survive the override (text_style_baseline: no modality budget).
    assert cc.unicache.budget.enabled is False
    with pytest.raises(SystemExit):
        main(["fit", "compress.unicache.target_rate=1.5"])


def test_cli_fit_compress_preset_and_config_file(monkeypatch, tmp_path):
    """A preset chosen in a --config file or on the command line is not hidden by the default
    preset, and dotted flags merge over the file's ``compress.unicache`` mapping."""
    import unicache_train.train.run as run_mod
    from unicache_train.cli import main

    seen = []
    monkeypatch.setattr(run_mod, "fit", lambda config: seen.append(config))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "compress:\n  enabled: true\n  preset: text_style_baseline\n"
        "  unicache:\n    target_rate: 0.5\n    quantize: {bits: 4}\n"
    )
    main(["fit", "--config", str(cfg), "compress.unicache.quantize.bits=8"])
    main(["fit", "compress.preset=text_style_baseline"])
    first, second = (c.compress.unicache for c in seen)
    assert first.target_rate == 0.5 and first.quantize.bits == 8 and not first.budget.enabled
    assert not second.budget.enabled and second.importance.normalize == "global"


_EXIT_ORDER = """
import atexit, sys
import torch.distributed as dist
# registered first, so it runs last (atexit is last-in, first-out): what the group looks like
# after every handler that fit registers has run
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from unicache_train.train.strategies import destroy_process_group_at_exit
if sys.argv[2] != "none":
    destroy_process_group_at_exit()
    destroy_process_group_at_exit()  # idempotent: a recipe calls fit more than once
print("initialized before exit:", dist.is_initialized(), flush=True)
if sys.argv[2] == "crash":
    raise RuntimeError("this rank fails")
"""


@pytest.mark.parametrize(
    "mode, code, left_up",
    [("clean", 0, False), ("none", 0, True), ("crash", 1, True)],
)
def test_process_group_is_destroyed_before_interpreter_exit(tmp_path, mode, code, left_up):
    """fit registers an exit hook that destroys the group while Python is alive (a gloo rank
    left to interpreter finalization can abort: see destroy_process_group_at_exit). Controls:
    without the hook the group is still up when the last handler runs; after an uncaught
    exception the hook leaves it alone (destroying waits for pending collectives)."""
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_ORDER, str(tmp_path / "store"), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "initialized before exit: True" in proc.stdout
    assert f"initialized at exit: {left_up}" in proc.stdout, proc.stdout


def test_exit_hook_wait_is_bounded(monkeypatch):
    """A destroy that does not return (a collective a peer never completes) is given up after
    the hook's timeout: the exit goes on as without the hook instead of hanging the rank."""
    import threading
    import time

    import torch.distributed as dist

    from unicache_train.train import strategies

    release = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(30))
    t0 = time.monotonic()
    try:
        assert strategies._destroy_process_group(timeout_s=0.5) is False
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    assert strategies._destroy_process_group(timeout_s=5) is True


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_stage_2"])
def test_after_fit_a_distributed_caller_keeps_the_group(tmp_path, strategy):
    """What fit's docstring promises a distributed caller once it returns: the group is still
    up on both ranks (an all-reduce gives 1 + 2, a barrier returns), the final checkpoint is on
    disk for both, and a second fit in the same processes resumes from it and trains on."""
    import json

    sys.path.insert(0, str(Path(__file__).parent))
    import distributed_runs

    after = tmp_path / "after.jsonl"
    args = distributed_runs.run_overrides(
        tmp_path / "run", batch_size=2, steps=2, checkpoint_every=1
    )
    proc = distributed_runs.fabric_run(
        2, tmp_path / "record.jsonl", [*args, "--after-fit", str(after)], strategy=strategy
    )
    assert proc.returncode == 0, distributed_runs.failure_report(proc)
    rows = [json.loads(line) for line in after.read_text().splitlines()]
    assert sorted((r["call"], r["rank"]) for r in rows) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for r in rows:
        assert r["initialized"] and r["world_size"] == 2 and r["all_reduce"] == 3.0, r
        assert r["last_ckpt"], r
        assert r["global_step"] == (2 if r["call"] == 1 else 4), r
