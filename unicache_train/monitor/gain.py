"""Signal-gain measures of a residual stack (pure functions, no Lightning).

Shape legend: B, T, n, L = batch, tokens, residual streams, number of mixing matrices.

mHC (arXiv 2512.24880, §3) bounds the *composite* residual mapping ``H_L … H_2 H_1`` of a deep
stack: with doubly-stochastic ``H_l`` every product is doubly stochastic, so its largest absolute
row sum (forward gain: how much a signal can grow going up) and column sum (backward gain: how
much a gradient can grow going down) stay 1. Unconstrained Hyper-Connections do not have that
guarantee; the paper reports composite gains near 3000 at 27B.
"""

from __future__ import annotations

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
