"""Signal-gain measures of a residual stack and the gain alarm (no Lightning).

Shape legend: B, T, n, L = batch, tokens, residual streams, number of mixing matrices.

mHC (arXiv 2512.24880, §3) bounds the *composite* residual mapping ``H_L … H_2 H_1`` of a deep
stack: with doubly-stochastic ``H_l`` every product is doubly stochastic, so its largest absolute
row sum (forward gain: how much a signal can grow going up) and column sum (backward gain: how
much a gradient can grow going down) stay 1. Unconstrained Hyper-Connections do not have that
guarantee; the paper reports composite gains near 3000 at 27B.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch


@dataclass
class MixStats:
    """Diagnostics of a set of per-layer residual mixing matrices (all Python floats).

    Attributes:
        composite_fwd: token-mean of the max absolute row sum of ``H_L … H_1``.
        composite_bwd: token-mean of the max absolute column sum of ``H_L … H_1``.
        max_log_rowsum: max over layers and tokens of ``|log |row sum||`` of each ``H_l``.
        max_log_colsum: same for column sums.
        sinkhorn_residual: max over layers and tokens of ``|row sum - 1|`` and ``|col sum - 1|``
            (how far each ``H_l`` is from doubly stochastic).
    """

    composite_fwd: float
    composite_bwd: float
    max_log_rowsum: float
    max_log_colsum: float
    sinkhorn_residual: float


def composite_mix(mats: list[torch.Tensor]) -> torch.Tensor:
    """The composite mapping ``H_L … H_2 H_1`` (left-multiplication convention ``X' = H X``).

    Args:
        mats: L tensors [..., n, n], applied first to last.

    Returns:
        [..., n, n] in fp64 (products of many matrices lose precision in fp32).
    """
    if not mats:
        raise ValueError("composite_mix needs at least one matrix")
    out = mats[0].double()
    for m in mats[1:]:
        out = m.double() @ out  # [..., n, n]
    return out


def amax_gain(mat: torch.Tensor) -> tuple[float, float]:
    """Token-mean "Amax gain magnitude": (max |row sum|, max |column sum|) of ``mat`` [..., n, n].

    Row sums of ``|H|`` bound the growth of ``H x`` in the max norm (forward); column sums bound
    ``Hᵀ g`` (backward).
    """
    a = mat.abs()
    fwd = a.sum(-1).amax(-1)  # [...]
    bwd = a.sum(-2).amax(-1)  # [...]
    return float(fwd.mean()), float(bwd.mean())


def mix_stats(mats: list[torch.Tensor]) -> MixStats:
    """All diagnostics of :class:`MixStats` for per-layer mixes ``mats`` (each [B, T, n, n])."""
    fwd, bwd = amax_gain(composite_mix(mats))
    log_row = log_col = resid = 0.0
    for m in mats:
        m = m.double()
        rows, cols = m.sum(-1), m.sum(-2)  # [B, T, n]
        # abs() before log: an unconstrained HC mix can have negative sums.
        log_row = max(log_row, float(rows.abs().clamp_min(1e-30).log().abs().max()))
        log_col = max(log_col, float(cols.abs().clamp_min(1e-30).log().abs().max()))
        resid = max(resid, float((rows - 1).abs().max()), float((cols - 1).abs().max()))
    return MixStats(fwd, bwd, log_row, log_col, resid)


def rms(x: torch.Tensor) -> float:
    """Root mean square over every element (for mHC: the whole stream stack [B, T, n, C])."""
    return float(x.detach().float().pow(2).mean().sqrt())


class GainAlarm:
    """Alarms when a gain changes against the run's own early baseline, once per key.

    Pretrained layers legitimately have gains far from 1 (SmolLM2-135M: layer 0's forward gain
    is 18-24, layer 11's about 10 at step 0), so an absolute band alarms on every real
    checkpoint. Instead, each key's baseline is the median of its first ``baseline_checks``
    finite values, and a later value alarms when ``value / baseline`` leaves
    ``[1/band, band]`` or is not finite. Each key alarms at most once (:meth:`update` returns
    the message the first time only); :attr:`violated` tells whether the last update had any
    violation, repeated or not (for stop-after-N-violations logic).

    Args:
        band: > 1, the allowed factor of change against the baseline.
        baseline_checks: >= 1, checks whose median is the baseline.
    """

    def __init__(self, band: float = 2.0, baseline_checks: int = 3) -> None:
        if (
            isinstance(band, bool)
            or not isinstance(band, (int, float))
            or not (math.isfinite(band) and band > 1)
        ):
            raise ValueError(f"GainAlarm.band={band!r} is out of range; allowed (1, inf)")
        if (
            isinstance(baseline_checks, bool)
            or not isinstance(baseline_checks, int)
            or baseline_checks < 1
        ):
            raise ValueError(
                f"GainAlarm.baseline_checks={baseline_checks!r}: expected an integer in [1, inf)"
            )
        self.band = float(band)
        self.baseline_checks = baseline_checks
        self.samples: dict[str, list[float]] = {}
        self.baseline: dict[str, float] = {}
        self.alarmed: set[str] = set()
        self.violated = False

    def update(self, step: int, values: dict[str, float], labels: dict[str, str]) -> list[str]:
        """Feeds one check; returns the messages of keys that alarm for the first time.

        Args:
            step: training step of the check (for the message).
            values: key -> gain (e.g. ``{"fwd_layer_00": 19.7, "composite_fwd": 1.0}``).
            labels: key -> what the value is, for the message (``"layer 0 forward gain"``).
        """
        messages: list[str] = []
        self.violated = False
        for key, value in values.items():
            label = labels.get(key, key)
            base = self.baseline.get(key)
            msg = None
            if not math.isfinite(value):
                msg = f"{label} is {value} at step {step}"
            elif base is None:
                samples = self.samples.setdefault(key, [])
                samples.append(value)
                if len(samples) >= self.baseline_checks:
                    self.baseline[key] = statistics.median(samples)
            else:
                ratio = value / base if base > 0 else (1.0 if value == 0 else math.inf)
                if not 1.0 / self.band <= ratio <= self.band:
                    msg = (
                        f"{label} {value:.3g} is {ratio:.3g}x its baseline {base:.3g} (median of "
                        f"the first {self.baseline_checks} checks), outside "
                        f"[1/{self.band:g}, {self.band:g}] at step {step}"
                    )
            if msg is not None:
                self.violated = True
                if key not in self.alarmed:
                    self.alarmed.add(key)
                    messages.append(msg)
        return messages

    def state_dict(self) -> dict[str, object]:
        return {
            "samples": {k: list(v) for k, v in self.samples.items()},
            "baseline": dict(self.baseline),
            "alarmed": sorted(self.alarmed),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.samples = {k: list(v) for k, v in dict(state.get("samples", {})).items()}
        self.baseline = {k: float(v) for k, v in dict(state.get("baseline", {})).items()}
        self.alarmed = set(state.get("alarmed", []))
