"""Signal-gain and compression-quality monitoring, through CSV and offline W&B loggers."""

import csv
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from unicache_train.data.config import DataConfig, SyntheticDataConfig
from unicache_train.model.config import ModelConfig
from unicache_train.monitor import (
    CompressionQualityMonitor,
    SignalGainMonitor,
    amax_gain,
    compression_metrics,
    find_callback,
    mix_stats,
)
from unicache_train.monitor.callbacks import _LayerProbe
from unicache_train.monitor.metrics import layer_mean_stats
from unicache_train.train.config import (
    CompressionTrainConfig,
    LoggingConfig,
    MonitorConfig,
    RunConfig,
    TrainConfig,
)
from unicache_train.train.module import LMModule
from unicache_train.train.run import fit


def test_amax_gain_of_known_matrices():
    eye = torch.eye(3).expand(5, 3, 3)
    assert amax_gain(eye) == (1.0, 1.0)
    m = torch.tensor([[2.0, -1.0], [0.5, 0.5]])  # rows 3, 1; cols 2.5, 1.5
    assert amax_gain(m) == (3.0, 2.5)


def test_composite_gain_bounded_for_doubly_stochastic_not_for_unconstrained():
    from unicache_train.ops import sinkhorn

    torch.manual_seed(0)
    ds = [sinkhorn(torch.randn(2, 8, 4, 4) * 3, iters=20) for _ in range(64)]
    s = mix_stats([m.transpose(-1, -2) for m in ds])
    # Products of doubly-stochastic matrices are doubly stochastic; 20 Sinkhorn rounds leave
    # ~1e-4 per-matrix error, which compounds to well under 1% over 64 layers.
    assert s.composite_fwd <= 1.01 and s.composite_bwd <= 1.01
    # Unconstrained mixes of the same scale: identity plus small noise, as HC learns.
    hc = [torch.eye(4) + 0.15 * torch.randn(2, 8, 4, 4) for _ in range(64)]
    assert mix_stats(hc).composite_fwd > 10.0


def test_compression_metric_names():
    per_layer = [
        {
            "kv_bytes": torch.tensor(100.0),
            "kv_reduction": torch.tensor(4.0),
            "rate_realized": 0.6,
            "rate_realized/vision": 0.7,
        },
        {
            "kv_bytes": torch.tensor(300.0),
            "kv_reduction": torch.tensor(2.0),
            "rate_realized": 0.4,
            "rate_realized/vision": 0.5,
        },
    ]
    m = compression_metrics(per_layer)
    # The whole cache's reduction (400 + 600 uncompressed bytes / 400 stored), not the mean.
    assert m["compress/kv_reduction"] == pytest.approx(2.5)
    assert m["compress/kv_bytes"] == pytest.approx(400.0)
    assert m["compress/rate_realized/vision"] == pytest.approx(0.60)
    assert m["compress/kv_reduction/layer_01"] == pytest.approx(2.0)
    assert m["compress/rate_realized/vision/layer_00"] == pytest.approx(0.7)
    assert layer_mean_stats(per_layer)["compress/kv_reduction"] == pytest.approx(2.5)
    sink = CompressionQualityMonitor()
    with pytest.raises(ValueError, match="must start with 'compress/'"):
        sink.record({"attn_kl": 0.1})


def tiny_run(out: Path, logger: str, **model) -> RunConfig:
    mc = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    mc.update(model)
    return RunConfig(
        model=ModelConfig(**mc),
        data=DataConfig(
            seq_len=32, batch_size=4, synthetic=SyntheticDataConfig(num_stories=60, num_recall=60)
        ),
        train=TrainConfig(
            max_steps=6,
            warmup_steps=1,
            val_every_n_steps=6,
            limit_val_batches=1,
            checkpoint_every_n_steps=6,
            accelerator="cpu",
            out_dir=str(out),
            progress_bar=False,
            log_every_n_steps=1,
        ),
        logging=LoggingConfig(logger=logger, name="monitor-test", tags=["test"]),
        monitor=MonitorConfig(gain_every_n_steps=2),
    )


def _csv_rows(out: Path) -> list[dict[str, str]]:
    rows = []
    for f in out.glob("csv/version_*/metrics.csv"):
        with f.open() as fh:
            rows += list(csv.DictReader(fh))
    return rows


def test_gain_monitor_logs_per_layer_and_composite_gain_for_mhc(tmp_path):
    cfg = tiny_run(tmp_path, "csv", residual_mode="mhc", hc_mult=4)
    trainer = fit(cfg)
    rows = [r for r in _csv_rows(tmp_path) if r.get("mhc/composite_fwd")]
    assert len(rows) == 3  # steps 0, 2, 4
    for r in rows:
        for key in (
            "gain/fwd_layer_00",
            "gain/bwd_layer_02",
            "gain/amax_fwd",
            "mhc/composite_bwd",
            "mhc/sinkhorn_residual",
        ):
            assert math.isfinite(float(r[key])), key
        # doubly-stochastic mixes: the composite over 6 connections stays ~1
        assert float(r["mhc/composite_fwd"]) < 1.05
    mon = find_callback(trainer, SignalGainMonitor)
    assert [h["step"] for h in mon.history] == [0, 2, 4]
    assert (tmp_path / "plots" / "gain.png").stat().st_size > 10_000


def test_gain_threshold_warns_once_per_layer_and_can_stop(tmp_path, caplog):
    # A band of 1.000001 around the baseline (the first check): every later change violates.
    cfg = tiny_run(tmp_path, "none")
    cfg.monitor = MonitorConfig(
        gain_every_n_steps=1, gain_threshold=1.000001, gain_baseline_checks=1, gain_stop_after=2
    )
    with caplog.at_level(logging.WARNING, "unicache_train.monitor.callbacks"):
        trainer = fit(cfg)
    assert trainer.global_step == 3  # baseline at step 0, violations at 1 and 2: stop
    per_layer = [r.message for r in caplog.records if "forward norm gain" in r.message]
    assert per_layer and len(per_layer) == len({m.split(":")[0] for m in per_layer})


def test_wandb_offline_run_records_gain_metrics(tmp_path, monkeypatch):
    from unicache_train.monitor.wandb_offline import read_offline_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    fit(tiny_run(tmp_path, "wandb", residual_mode="mhc", hc_mult=2))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    rows = read_offline_history(runs[0])
    gains = [r for r in rows if "gain/amax_fwd" in r]
    assert gains and all(math.isfinite(r["gain/amax_fwd"]) for r in gains)
    assert any("mhc/composite_fwd" in r for r in rows)
    assert any("train/loss" in r for r in rows)
    # The gain plot is an image: its fields come back under its key, not as bare keys.
    plots = [r["gain/plot"] for r in rows if "gain/plot" in r]
    assert len(plots) == 1 and isinstance(plots[0], dict) and "_type" in plots[0]
    assert not any(k in r for r in rows for k in ("_type", "count", "width"))


def test_wandb_disabled_needs_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    fit(tiny_run(tmp_path, "wandb"))
    assert not list((tmp_path / "wandb").glob("offline-run-*"))


# ----------------------------------------------------------------------------- which forward
def _gain_check(module: LMModule, batch: dict[str, torch.Tensor], kl_weight: float) -> dict:
    """One monitored in-loop training step (forward, backward) outside Lightning."""
    module.config.compress.kl_weight = kl_weight
    mon = SignalGainMonitor(every_n_steps=1, plot=False)
    trainer = SimpleNamespace(global_step=0, loggers=[], should_stop=False, is_global_zero=True)
    mon.on_train_batch_start(trainer, module, batch, 0)
    loss, logs, _ = module.compressed_loss(batch, step=0)
    loss.backward()
    mon.on_after_backward(trainer, module)
    module.zero_grad()
    assert ("train/kl" in logs) == (kl_weight > 0)
    return mon.history[-1]


def test_logged_forward_gains_are_the_training_forwards_with_kl():
    # With kl_weight > 0 a second, no-grad forward of the uncompressed model runs after the
    # in-loop (compressed) training forward, inside the monitored step. The logged forward
    # gains must be the training forward's: equal to a step without the KL term (same split,
    # same compressed forward), not the reference forward's.
    cfg = RunConfig(
        model=ModelConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        compress=CompressionTrainConfig(enabled=True, min_context=8),
    )
    torch.manual_seed(0)
    module = LMModule(cfg)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.model.vocab_size, (4, 49), generator=gen)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone()}
    with_kl = _gain_check(module, batch, kl_weight=1.0)
    without_kl = _gain_check(module, batch, kl_weight=0.0)
    assert with_kl["fwd"] == without_kl["fwd"]
    assert all(math.isfinite(g) for g in with_kl["fwd"] + with_kl["bwd"])
    # Not vacuous: the uncompressed reference forward has other gains (measured ~3% apart).
    probe = _LayerProbe(module.model.layers)
    module.model_forward(batch)
    probe.remove()
    reference = probe.gains()[0]
    assert max(abs(a / b - 1) for a, b in zip(reference, with_kl["fwd"])) > 1e-3
