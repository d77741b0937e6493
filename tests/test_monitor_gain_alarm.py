"""The gain alarm: relative to the run's own early baseline, once per layer/kind, one channel."""

from __future__ import annotations

import logging
import math
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from test_monitor import tiny_run

from unicache_train.monitor import GainAlarm, SignalGainMonitor, find_callback
from unicache_train.train.config import MonitorConfig
from unicache_train.train.run import fit
from unicache_train.validation import ConfigError

LOGGER = "unicache_train.monitor.callbacks"


def _noisy(value: float, i: int, spread: float = 0.1) -> float:
    """``value`` wobbling by up to +-spread (deterministic), like a real gain over steps."""
    return value * (1.0 + spread * math.sin(1.7 * i))


def test_steady_gain_of_20_does_not_alarm():
    # A pretrained layer 0 (SmolLM2-135M: forward gain 18-24) and layer 11 (~10): steady
    # gains far from 1 are normal and must not alarm.
    alarm = GainAlarm(band=2.0, baseline_checks=3)
    for step in range(60):
        values = {"layer0": _noisy(20.0, step), "layer1": _noisy(10.0, step + 3), "c": 1.0}
        assert alarm.update(step, values, {}) == []
        assert not alarm.violated


def test_gain_jumping_5x_after_the_baseline_alarms_exactly_once():
    alarm = GainAlarm(band=2.0, baseline_checks=3)
    messages, violations = [], 0
    for step in range(40):
        jump = 5.0 if step >= 10 else 1.0
        values = {"layer0": _noisy(20.0, step), "layer1": jump * _noisy(1.0, step)}
        messages += alarm.update(step, values, {"layer1": "layer 1: forward norm gain"})
        violations += alarm.violated
    assert len(messages) == 1 and messages[0].startswith("layer 1: forward norm gain")
    assert "step 10" in messages[0] and "baseline" in messages[0]
    assert violations == 30  # every check after the jump violates; only the first is printed


def test_baseline_is_the_median_of_the_first_checks():
    alarm = GainAlarm(band=2.0, baseline_checks=3)
    for step, value in enumerate([1.0, 100.0, 1.1]):  # one outlier among the first checks
        assert alarm.update(step, {"g": value}, {}) == []
    assert alarm.baseline == {"g": 1.1}
    assert alarm.update(3, {"g": 2.1}, {}) == []  # 1.9x
    assert len(alarm.update(4, {"g": 2.3}, {})) == 1  # 2.09x
    assert len(alarm.update(5, {"g": float("nan")}, {})) == 0  # g alarmed already
    assert alarm.violated
    assert len(alarm.update(6, {"h": float("inf")}, {})) == 1  # not finite: always a violation


def test_composite_mix_gain_alarms_on_change():
    mon = SignalGainMonitor(every_n_steps=1, plot=False, threshold=2.0, baseline_checks=2)
    trainer = SimpleNamespace(global_step=0, should_stop=False)
    out = []
    for step in range(8):
        trainer.global_step = step
        composite = 1.0 if step < 5 else 3.0  # the product of the mixes starts to grow
        out += mon.check_gains(trainer, [20.0, 1.0], composite, 1.0)
    assert len(out) == 1 and out[0].startswith("composite residual-mix gain (forward)")


def test_each_alarm_is_logged_once_on_one_channel(caplog):
    mon = SignalGainMonitor(every_n_steps=1, plot=False, baseline_checks=1, stop_after=3)
    trainer = SimpleNamespace(global_step=0, should_stop=False)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, LOGGER):
        warnings.simplefilter("always")
        for step in range(5):
            trainer.global_step = step
            mon.check_gains(trainer, [20.0, 1.0 if step == 0 else 5.0])
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    alarms = [r.message for r in caplog.records if "forward norm gain" in r.message]
    assert len(alarms) == 1 and alarms[0].startswith("layer 1:")
    assert trainer.should_stop  # 3 consecutive violating checks (steps 1, 2, 3)
    # A resumed run keeps its baselines and does not print the alarm again.
    again = SignalGainMonitor(every_n_steps=1, plot=False, baseline_checks=1)
    again.load_state_dict(mon.state_dict())
    assert again.check_gains(trainer, [20.0, 5.0]) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 1.0}, r"SignalGainMonitor.threshold=1.0 is out of range; allowed \(1, "),
        ({"threshold": float("inf")}, r"SignalGainMonitor.threshold=inf is out of range"),
        ({"baseline_checks": 0}, r"SignalGainMonitor.baseline_checks=0 is out of range; allowed"),
        ({"every_n_steps": 2.5}, r"SignalGainMonitor.every_n_steps=2.5: expected an integer"),
        ({"stop_after": 0}, r"SignalGainMonitor.stop_after=0 is out of range; allowed \[1, inf\)"),
    ],
)
def test_monitor_arguments_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SignalGainMonitor(**kwargs)


def test_config_fields_are_validated():
    with pytest.raises(
        ConfigError,
        match=r"MonitorConfig.gain_baseline_checks=0 is out of "
        r"range; allowed \[1, inf\)",
    ):
        MonitorConfig(gain_baseline_checks=0)
    with pytest.raises(
        ConfigError,
        match=r"MonitorConfig.gain_threshold=0.5 is out of range; "
        r"allowed \(1, inf\)",
    ):
        MonitorConfig(gain_threshold=0.5)


class _Amplify(L.Callback):
    """Multiplies layer ``layer``'s branch output weights by ``factor`` before step ``at``."""

    def __init__(self, layer: int, factor: float, at: int) -> None:
        self.layer, self.factor, self.at = layer, factor, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            block = pl_module.model.layers[self.layer]
            with torch.no_grad():
                block.self_attn.o_proj.weight.mul_(self.factor)
                block.mlp.down_proj.weight.mul_(self.factor)


def test_pretrained_like_gain_does_not_alarm_but_a_jump_does(tmp_path, caplog):
    # End to end: layer 0 starts with a forward gain far above 2 (as pretrained layers do);
    # the absolute [1/2, 2] band alarmed at step 0. Later layer 2's branch is amplified
    # 300x (its input, the stream, is already large): the change alarms, once.
    cfg = tiny_run(tmp_path, "none")
    cfg.train.max_steps, cfg.train.lr = 8, 1e-6
    cfg.monitor = MonitorConfig(gain_every_n_steps=1, plots=False)
    with caplog.at_level(logging.WARNING, LOGGER):
        trainer = fit(cfg, callbacks=[_Amplify(0, 60.0, at=0), _Amplify(2, 300.0, at=5)])
    mon = find_callback(trainer, SignalGainMonitor)
    fwd0 = [h["fwd"][0] for h in mon.history]
    assert min(fwd0) > 4.0, fwd0  # outside the old absolute band from the first check
    assert mon.history[6]["fwd"][2] > 4 * mon.history[4]["fwd"][2]  # the jump is real
    alarms = [r.message for r in caplog.records if "forward norm gain" in r.message]
    assert len(alarms) == 1 and alarms[0].startswith("layer 2:"), alarms
