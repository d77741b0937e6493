"""Lightning callbacks: per-layer signal gain and compression quality, to any logger.

Both log through ``trainer.loggers`` (W&B offline by default, CSV, TensorBoard), so what users
see does not depend on the logger they chose.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

import unicache_train.monitor.metrics as M
from unicache_train.monitor.gain import GainAlarm, mix_stats, rms

log = logging.getLogger(__name__)


def _decoder(pl_module: L.LightningModule) -> nn.Module:
    model = getattr(pl_module, "model", pl_module)
    if not hasattr(model, "layers"):
        raise TypeError(f"{type(model).__name__} has no .layers: cannot monitor per-layer gain")
    return model


def _connections(model: nn.Module) -> list[nn.Module]:
    """The hyper-connection modules in forward order (attn_hc, ffn_hc of each layer)."""
    out = []
    for layer in model.layers:
        for name in ("attn_hc", "ffn_hc"):
            hc = getattr(layer, name, None)
            if hc is not None:
                out.append(hc)
    return out


class _LayerProbe:
    """Forward hooks on every layer for one step: input/output RMS, and tensor hooks for the
    gradient RMS at each layer's input and output.

    Only the training forward counts, i.e. forwards that record autograd: a no-grad forward of
    the same layers in the same step (the uncompressed KL reference of the in-loop objective,
    xKV's recording pass with the causal gradient) is ignored instead of overwriting the
    training forward's numbers. When several recorded forwards run (xKV's recording pass with
    the exact gradient, then the compressed pass), the last one wins, and only its gradient
    hooks are kept.
    """

    def __init__(self, layers: nn.ModuleList) -> None:
        n = len(layers)
        self.fwd_in = [float("nan")] * n
        self.fwd_out = [float("nan")] * n
        self.grad_in = [float("nan")] * n
        self.grad_out = [float("nan")] * n
        self.calls = [0] * n  # recorded forwards of each layer so far
        self.handles = [
            layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)
        ]

    def _hook(self, i: int):
        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return
            self.calls[i] += 1
            call = self.calls[i]
            x = args[0]
            self.fwd_in[i], self.fwd_out[i] = rms(x), rms(output)
            if x.requires_grad:
                x.register_hook(lambda g: self._store(self.grad_in, i, call, g))
            if output.requires_grad:
                output.register_hook(lambda g: self._store(self.grad_out, i, call, g))

        return hook

    def _store(self, buf: list[float], i: int, call: int, g: torch.Tensor) -> None:
        if call == self.calls[i]:  # a gradient of the forward whose numbers were kept
            buf[i] = rms(g)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def gains(self) -> tuple[list[float], list[float]]:
        """Per-layer forward gain out/in and backward gain grad_in/grad_out."""
        fwd = [o / i if i > 0 else float("inf") for i, o in zip(self.fwd_in, self.fwd_out)]
        bwd = [gi / go if go > 0 else float("nan") for gi, go in zip(self.grad_in, self.grad_out)]
        return fwd, bwd


class SignalGainMonitor(L.Callback):
    """Per-layer norm gain, forward and backward, and composite mHC/HC mixing gain.

    Every ``every_n_steps`` optimizer steps, one training batch is probed with hooks (no extra
    forward): per-layer forward gain ``rms(x_{l+1}) / rms(x_l)`` (for hyper-connections, over the
    whole ``[B, T, n, C]`` stream stack), backward gain ``rms(g_l) / rms(g_{l+1})``, their
    maxima over layers, and for mHC/HC models the composite gain of the product of all residual
    mixes (see :func:`unicache_train.monitor.gain.mix_stats`). Other steps cost nothing.

    Alarms compare each gain with the run's own early baseline, not with an absolute band
    (pretrained layers legitimately have gains of 10-24): the baseline of a layer's forward gain,
    and of the composite mix gains, is the median of its first ``baseline_checks`` checks; a
    later value more than ``threshold`` times away from it (or not finite) is logged once per
    layer/kind as a warning on logger ``unicache_train.monitor.callbacks`` (see
    :class:`~unicache_train.monitor.gain.GainAlarm`). With ``stop_after=N`` training stops
    after N consecutive checks with a violation.

    At the end of training a PNG of the gains is written to ``<out_dir>/plots/gain.png`` and
    logged to W&B as an image when W&B is the logger.

    Args:
        every_n_steps: >= 1, optimizer steps between probed batches.
        threshold: > 1, allowed factor of change of a gain against its baseline.
        stop_after: >= 1 or None, consecutive violating checks before stopping.
        plot: write (and log) the PNG at the end.
        baseline_checks: >= 1, checks whose median is each gain's baseline.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        threshold: float = 2.0,
        stop_after: int | None = None,
        plot: bool = True,
        baseline_checks: int = 3,
    ) -> None:
        _check_int("every_n_steps", every_n_steps)
        if stop_after is not None:
            _check_int("stop_after", stop_after)
        _check_int("baseline_checks", baseline_checks)
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not (math.isfinite(threshold) and threshold > 1)
        ):
            raise ValueError(
                f"SignalGainMonitor.threshold={threshold!r} is out of range; allowed (1, inf)"
            )
        self._alarm = GainAlarm(threshold, baseline_checks)
        self.every_n_steps = every_n_steps
        self.threshold = float(threshold)
        self.baseline_checks = baseline_checks
        self.stop_after = stop_after
        self.plot = plot
        self.history: list[dict[str, Any]] = []
        self._probe: _LayerProbe | None = None
        self._consecutive = 0

    # ------------------------------------------------------------------------------ arming
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._probe is not None or trainer.global_step % self.every_n_steps:
            return
        model = _decoder(pl_module)
        self._probe = _LayerProbe(model.layers)
        for hc in _connections(model):
            hc.record = True

    def on_after_backward(self, trainer, pl_module) -> None:
        if self._probe is None:
            return
        model = _decoder(pl_module)
        self._probe.remove()
        fwd, bwd = self._probe.gains()
        self._probe = None
        row: dict[str, Any] = {"step": trainer.global_step, "fwd": fwd, "bwd": bwd}
        metrics = {M.GAIN_FWD_LAYER.format(i): g for i, g in enumerate(fwd)}
        metrics.update({M.GAIN_BWD_LAYER.format(i): g for i, g in enumerate(bwd)})
        metrics[M.GAIN_AMAX_FWD] = max(fwd)
        metrics[M.GAIN_AMAX_BWD] = max(bwd)
        hcs = _connections(model)
        mats = [hc.last_coeffs.res for hc in hcs if getattr(hc, "last_coeffs", None) is not None]
        for hc in hcs:
            hc.record = False
            hc.last_coeffs = None
        if mats:
            s = mix_stats(mats)
            metrics.update(
                {
                    M.MHC_COMPOSITE_FWD: s.composite_fwd,
                    M.MHC_COMPOSITE_BWD: s.composite_bwd,
                    M.MHC_MAX_LOG_ROWSUM: s.max_log_rowsum,
                    M.MHC_MAX_LOG_COLSUM: s.max_log_colsum,
                    M.MHC_SINKHORN_RESIDUAL: s.sinkhorn_residual,
                }
            )
            row.update(composite_fwd=s.composite_fwd, composite_bwd=s.composite_bwd)
        self.history.append(row)
        self.check_gains(trainer, fwd, row.get("composite_fwd"), row.get("composite_bwd"))
        _log(trainer, metrics)

    def check_gains(
        self,
        trainer,
        fwd: list[float],
        composite_fwd: float | None = None,
        composite_bwd: float | None = None,
    ) -> list[str]:
        """Feeds one check's gains to the alarm; logs and returns the new alarm messages.

        Args:
            trainer: reads ``global_step``; ``should_stop`` is set after ``stop_after``
                consecutive violating checks.
            fwd: [L] per-layer forward gains.
            composite_fwd, composite_bwd: the composite mix gains (mHC/HC models), or None.
        """
        values = {M.GAIN_FWD_LAYER.format(i): g for i, g in enumerate(fwd)}
        labels = {key: f"layer {i}: forward norm gain" for i, key in enumerate(values)}
        for key, value, what in (
            (M.MHC_COMPOSITE_FWD, composite_fwd, "forward"),
            (M.MHC_COMPOSITE_BWD, composite_bwd, "backward"),
        ):
            if value is not None:
                values[key] = value
                labels[key] = f"composite residual-mix gain ({what})"
        step = trainer.global_step
        messages = self._alarm.update(step, values, labels)
        for msg in messages:
            _warn(msg)
        self._consecutive = self._consecutive + 1 if self._alarm.violated else 0
        if self.stop_after is not None and self._consecutive >= self.stop_after:
            _warn(
                f"stopping: gains left [1/{self.threshold:g}, {self.threshold:g}] x their "
                f"baseline for {self._consecutive} consecutive checks (step {step})"
            )
            trainer.should_stop = True
        return messages

    # ------------------------------------------------------------------------------ plots
    def on_train_end(self, trainer, pl_module) -> None:
        if self._probe is not None:  # a step that never reached backward
            self._probe.remove()
            self._probe = None
        if self.plot and self.history and trainer.is_global_zero:
            from unicache_train.monitor.plots import plot_gain

            path = plot_gain(self.history, Path(trainer.default_root_dir) / "plots" / "gain.png")
            _log_image(trainer, "gain/plot", path)

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "consecutive": self._consecutive,
            "alarm": self._alarm.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = list(state.get("history", []))
        self._consecutive = int(state.get("consecutive", 0))
        self._alarm.load_state_dict(state.get("alarm", {}))


class CompressionQualityMonitor(L.Callback):
    """The sink for compression-quality metrics (names in :mod:`unicache_train.monitor.metrics`).

    Training code pushes per-layer compressor stats with :meth:`record_layers`, evaluation
    pushes scalars (``compress/attn_kl``, ``compress/ppl_delta``, ...) with :meth:`record`;
    pending values are averaged and written to every logger each ``every_n_steps`` steps.
    Find it from a LightningModule with :func:`find_callback`.
    """

    def __init__(self, every_n_steps: int = 10) -> None:
        if every_n_steps < 1:
            raise ValueError(f"CompressionQualityMonitor.every_n_steps={every_n_steps}: >= 1")
        self.every_n_steps = every_n_steps
        self._pending: dict[str, list[float]] = {}
        self.last: dict[str, float] = {}

    def record(self, values: Mapping[str, float | torch.Tensor]) -> None:
        for key, value in values.items():
            if not key.startswith(M.COMPRESS_PREFIX + "/"):
                raise ValueError(f"compression metric {key!r} must start with 'compress/'")
            v = (
                float(value.detach().float().mean())
                if isinstance(value, torch.Tensor)
                else float(value)
            )
            self._pending.setdefault(key, []).append(v)

    def record_layers(self, per_layer: list[Mapping[str, torch.Tensor | float]]) -> None:
        self.record(M.compression_metrics(per_layer))

    def flush(self, trainer) -> dict[str, float]:
        if not self._pending:
            return {}
        out = {k: sum(v) / len(v) for k, v in self._pending.items()}
        self._pending.clear()
        self.last = out
        _log(trainer, out)
        return out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.flush(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.flush(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.flush(trainer)


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"SignalGainMonitor.{name}={value!r}: expected an integer in [1, inf)")
    if value < 1:
        raise ValueError(f"SignalGainMonitor.{name}={value!r} is out of range; allowed [1, inf)")


def find_callback(trainer, cls: type) -> Any | None:
    """The first callback of type ``cls`` on ``trainer`` (or None)."""
    for cb in getattr(trainer, "callbacks", []):
        if isinstance(cb, cls):
            return cb
    return None


@rank_zero_only
def _warn(msg: str) -> None:
    # One channel: the logger (a RuntimeWarning as well printed every alarm twice).
    log.warning(msg)


@rank_zero_only
def _log(trainer, metrics: dict[str, float]) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


@rank_zero_only
def _log_image(trainer, key: str, path: Path) -> None:
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_image(key=key, images=[str(path)], step=trainer.global_step)
