"""Sinkhorn-Knopp projection onto doubly-stochastic matrices, for mHC.

mHC (manifold-constrained hyper-connections, DeepSeek, https://arxiv.org/abs/2512.24880) mixes
``n`` residual streams with a matrix projected onto the Birkhoff polytope by a fixed number of
Sinkhorn-Knopp iterations. This module is the functional API, the pure-PyTorch reference (the spec,
imported by the tests and the benchmark) and the CPU path.

Shape legend: ``M, n = number of matrices (all leading dims flattened), streams``.

Variants (``S = iters``)::

    deepseek_v4:  A = softmax(x, dim=-1) + eps     # as transformers' DeepseekV4HyperConnection
                  A = col_norm(A)
                  repeat S-1 times: A = col_norm(row_norm(A))     -> 2S-1 normalizations
        col_norm(A) = A / (A.sum(-2, keepdim=True) + eps)
        row_norm(A) = A / (A.sum(-1, keepdim=True) + eps)

    paper:        L = x                            # log domain: L = log A
                  repeat S times: L = row_lnorm(col_lnorm(L))     -> 2S normalizations
                  A = round(exp(L))                # exactly doubly stochastic, see below
        col_lnorm(L) = (L - m) - log(sum_i exp(L - m)),  m = max_i L   (per column)
        row_lnorm(L) = the same over j                                 (per row)

``paper`` follows the paper's Eq. ``M(t) = T_r(T_c(M(t-1)))`` from ``M(0) = exp(H_res)`` (§4.2),
column normalization first, row normalization last, written in the log domain: ``exp(L)`` is
the paper's iterate exactly (no ``eps``; ``eps`` is not used by this variant), but nothing
under- or overflows whatever the logits' spread. A fixed number of iterations does not converge
for widely spread logits (near-permutation matrices converge slowly; measured with exact
log-domain iterations in fp64, n = 4, 20 iterations: worst column sum off by 0.2 at logit std 8,
by 2.0 at std 100 and 1e4). So the last iterate (rows sum to 1, columns to ``c_j``) is rounded
onto the Birkhoff polytope by Algorithm 2 of Altschuler, Weed & Rigollet, "Near-linear time
approximation algorithms for optimal transport via Sinkhorn iteration" (NeurIPS 2017,
https://arxiv.org/abs/1705.09634)::

    round(A):  Y  = A / max(c, 1)               # columns with excess mass scaled down to 1
               er = max(1 - rowsum(Y), 0)       # [n] row deficits
               ec = max(1 - colsum(Y), 0)       # [n] column deficits, sum(ec) = sum(er)
               B  = Y + er ecᵀ / sum(ec)        # (B = Y when sum(ec) = 0)

``B`` is non-negative with row and column sums 1 (to fp32 rounding) for any non-negative ``A``,
and ``|B - A|_1 <= 2 |c - 1|_1``: where the iterations converged it changes nothing measurable.
(Algorithm 2 first scales rows with excess mass; the last row normalization leaves none.)
``deepseek_v4`` ends on a column normalization; transformers consumes ``comb`` transposed
(``combᵀ X``), so both presets end on the rows of the matrix that multiplies the streams.

Backends:

* ``"torch"``: :class:`_SinkhornFunction`, an ``autograd.Function`` that saves only the input
  and recomputes the iterations in backward, with a hand-written VJP (no autograd inside). It
  works in place on a ``[n, n, M]`` layout (matrix index innermost), so every op is a long
  unit-stride vector op. Exact: equal to autograd through :func:`sinkhorn_reference` up to fp32
  rounding (closer to the fp64 gradient than that reference, in the tests). Measured on the
  benchmark case (64k matrices, n=4, 20 iters, one thread), ``deepseek_v4``: ~8x faster than
  eager autograd through the loop and ~4x faster than ``torch.compile`` of the naive formula,
  without its warm-up (up to ~70 s here on a cold cache) or recompiles on new batch sizes, so
  there is no compiled backend; see ``benchmarks/bench_sinkhorn.py`` for the caveat on
  oversubscribed machines. ``paper`` pays an ``exp`` per entry and step (log domain): measured
  fwd+bwd on that case, one thread, a shared 2-core VM: 1.05-1.12 s against 0.21-0.28 s for the
  former linear-domain ``paper`` and 0.20-0.29 s for ``deepseek_v4`` (medians of 7, same run);
  eager autograd through the ``paper`` reference: ~2.3 s.
* ``"triton"``: forward and backward Triton kernels (``unicache_train.kernels.sinkhorn``), one
  program per block of matrices, everything in registers.
* ``"auto"``: Triton for CUDA tensors when Triton is importable, else ``"torch"`` (logged once
  on logger ``unicache_train.ops`` when a CUDA tensor falls back).

Numerics (measured, see ``tests/test_sinkhorn.py``):

* Computed in fp32 whatever the input dtype (bf16/fp16/fp32 in, fp32 out); fp64 inputs are
  computed and returned in fp64 so that ``torch.autograd.gradcheck`` can run. The gradient comes
  back in the input dtype.
* The output and the gradient are finite, the output non-negative, for any input free of
  NaN/``+inf``, +-1e4 logits and ``-inf`` entries included (see below for an all ``-inf`` row).
* ``paper``: rows and columns sum to 1 within 1e-6 for any finite input (measured <= 2.4e-7 at
  logit scales 1, 100 and 1e4, n = 2..8). With logits of large magnitude the log-domain
  potentials reach that magnitude, where one fp32 ulp is ~1e-3 (at 1e4): the result is only
  defined to about that precision there; the backends here run the same operations in the
  same order and agreed to 3e-8 in the tests.
* ``paper`` gradient in fp32: within ~1e-4 of the fp64 gradient (measured 5.4e-5 worst over
  32k matrices, logits std 2, 20 iterations; the log-domain iterations alone: 2e-7). The
  rounding step picks its branch (which columns exceed 1, where the deficits go) from column
  sums that can sit within fp32 noise of 1 while the iterations have not converged further;
  its Jacobian there is of the size of d(column sum)/d(logits). In fp64 the hand-written VJP
  equals autograd through the reference to 1e-13.
* ``deepseek_v4``: the last normalized axis (columns) sums to ``s / (s + eps)`` of its
  pre-normalization sum ``s``, i.e. to 1 within ``eps / s``: measured <= 1.3e-6 from 1 for every
  input class tested, +-1e4 and ``-inf`` included (the softmax ``+ eps`` keeps entries
  positive). The other axis carries the convergence residual of a fixed ``iters`` (worst
  |sum - 1| over 20k random matrices, 20 iters): logits of std 0.1: 1.3e-6; std 1: 1.5e-3 for
  n = 4..16 (1.1e-2 at n = 2); std 2..8: 2e-2 to 3e-1 (near-permutation matrices converge
  slowly; some zero patterns admit no doubly-stochastic scaling at all). mHC's small logit
  scales (alpha = 0.01 at init) sit in the converged regime; more ``iters`` shrink the residual.
* ``-inf`` logits mean a zero entry in the iterations. ``deepseek_v4``: a row that is entirely
  ``-inf`` has no softmax and gives NaN, as in transformers. ``paper``: a pattern of ``-inf``
  that admits no doubly-stochastic matrix (an all ``-inf`` row or column, an all ``-inf``
  matrix) is completed by the rounding step, which may put mass on ``-inf`` entries (an all
  ``-inf`` matrix gives the uniform ``1/n``). NaN and ``+inf`` inputs propagate NaN
  (``check_finite=True`` raises instead).
* The rounding step is piecewise smooth (``max(c, 1)``, the deficits' ``max(., 0)``); its
  gradient is the one autograd gives through the reference formula. Where the iterations
  converged its kinks do not move the gradient (the iterate's perturbations keep the sums).
* Double backward is not supported (the backward is a hand-written VJP).
"""

from __future__ import annotations

import logging
import math
import os

import torch
from torch.autograd.function import once_differentiable

logger = logging.getLogger("unicache_train.ops")

VARIANTS: tuple[str, ...] = ("deepseek_v4", "paper")
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")

_logged_fallback = False


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def validate_sinkhorn_args(
    logits: torch.Tensor, iters: int, eps: float, variant: str, backend: str | None = None
) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"sinkhorn: logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"sinkhorn: logits must have a floating dtype, got {logits.dtype}")
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2] or logits.shape[-1] < 1:
        raise ValueError(
            "sinkhorn: logits must be [..., n, n] with the last two dims equal and n >= 1, "
            f"got shape {tuple(logits.shape)}"
        )
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"sinkhorn: iters must be an int >= 1, got {iters!r}")
    if (
        isinstance(eps, bool)
        or not isinstance(eps, (int, float))
        or not (math.isfinite(eps) and eps >= 0)
    ):
        raise ValueError(f"sinkhorn: eps must be a finite float >= 0, got {eps!r}")
    if variant not in VARIANTS:
        raise ValueError(f"sinkhorn: variant must be one of {VARIANTS}, got {variant!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"sinkhorn: backend must be one of {BACKENDS}, got {backend!r}")


def _check_finite(logits: torch.Tensor) -> None:
    # -inf is a legitimate input (a zero entry); NaN and +inf are what turn the output into NaN.
    # NOTE: .item() synchronizes with the device; that is the price of the check.
    bad = int((torch.isnan(logits) | torch.isposinf(logits)).sum().item())
    if bad:
        raise ValueError(
            f"sinkhorn: logits contain {bad} non-finite entries (NaN or +inf) out of "
            f"{logits.numel()}; -inf entries are allowed and mean a zero weight"
        )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def num_steps(iters: int, variant: str) -> int:
    """Number of normalizations; step k normalizes columns when k is even, rows when odd."""
    return 2 * iters - 1 if variant == "deepseek_v4" else 2 * iters


# --------------------------------------------------------------------------------------------
# reference: the spec
# --------------------------------------------------------------------------------------------


def sinkhorn_reference(
    logits: torch.Tensor, iters: int = 20, eps: float = 1e-6, variant: str = "deepseek_v4"
) -> torch.Tensor:
    """Naive unrolled Sinkhorn-Knopp in plain torch ops (autograd goes through the loop).

    This is the spec the fast paths are tested against; it stores every iteration for backward.
    See the module docstring for the exact formulas (arXiv 2512.24880 §4.2; transformers'
    ``DeepseekV4HyperConnection``).

    Args:
        logits: [..., n, n] unnormalized log-weights, any float dtype.
        iters: Sinkhorn iterations (>= 1).
        eps: ``deepseek_v4``: added to every denominator and to the softmax; not used by
            ``paper`` (log domain: no denominator can vanish).
        variant: ``"deepseek_v4"`` or ``"paper"``.

    Returns:
        [..., n, n] in fp32 (fp64 for fp64 input).
    """
    validate_sinkhorn_args(logits, iters, eps, variant)
    x = logits.to(compute_dtype(logits.dtype))
    if variant == "deepseek_v4":
        a = torch.softmax(x, dim=-1) + eps
        a = a / (a.sum(dim=-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            a = a / (a.sum(dim=-1, keepdim=True) + eps)
            a = a / (a.sum(dim=-2, keepdim=True) + eps)
        return a
    log_a = x
    for _ in range(iters):
        log_a = _log_normalize(log_a, dim=-2)  # T_c
        log_a = _log_normalize(log_a, dim=-1)  # T_r
    return round_to_birkhoff(torch.exp(log_a))


def _log_normalize(log_a: torch.Tensor, dim: int) -> torch.Tensor:
    """``log_a - logsumexp(log_a, dim)``: one Sinkhorn normalization of ``exp(log_a)``.

    Written as ``(L - m) - log(sum exp(L - m))`` with ``m`` the max along ``dim``: the entries
    near the max are then exact (Sterbenz) however large ``m`` is. ``m`` carries no gradient
    (it cancels exactly). An all ``-inf`` line has no max: ``m = 0`` and ``sum = 0 -> 1`` leave
    it at ``-inf`` instead of ``-inf - (-inf) = NaN``; otherwise ``sum >= 1`` (the max's term).
    """
    m = log_a.amax(dim=dim, keepdim=True).detach()
    m = m.masked_fill(torch.isneginf(m), 0.0)
    shifted = log_a - m
    return shifted - torch.log(torch.exp(shifted).sum(dim=dim, keepdim=True).clamp_min(1.0))


def round_to_birkhoff(a: torch.Tensor) -> torch.Tensor:
    """Rounds a non-negative matrix onto the doubly-stochastic ones (Altschuler et al. 2017).

    Algorithm 2 of https://arxiv.org/abs/1705.09634 for unit marginals, without its row
    scaling (the ``paper`` iterations end on a row normalization, so no row has excess mass;
    a row over 1 by rounding keeps it). Formula in the module docstring. The rank-one term
    divides by ``max(sum(er), sum(ec))``, equal to ``sum(ec)`` in exact arithmetic: in floating
    point the two sums differ by rounding, and dividing by the larger keeps ``er_i / d`` and
    ``ec_j / d`` in [0, 1], so rounding noise in deficits near zero (a converged iterate) is
    never amplified, in the output or in the gradient.

    Args:
        a: [..., n, n] non-negative.

    Returns:
        [..., n, n] non-negative, rows and columns summing to 1 (to rounding), within
        ``2 * sum_j |colsum_j(a) - 1|`` of ``a`` in L1.
    """
    c = a.sum(dim=-2, keepdim=True)  # [..., 1, n]
    y = a / torch.where(c > 1, c, torch.ones_like(c))
    er = (1 - y.sum(dim=-1, keepdim=True)).clamp_min(0)  # [..., n, 1]
    ec = (1 - y.sum(dim=-2, keepdim=True)).clamp_min(0)  # [..., 1, n]
    ser, sec = er.sum(dim=-2, keepdim=True), ec.sum(dim=-1, keepdim=True)  # [..., 1, 1]
    d = torch.where(ser > sec, ser, sec)
    w = ec / torch.where(d > 0, d, torch.ones_like(d))  # where d = 0, ec = 0: no correction
    return y + er * w


# --------------------------------------------------------------------------------------------
# torch path: [n, n, M] layout, in-place, recompute in backward
# --------------------------------------------------------------------------------------------
# In the [n, n, M] layout ("T layout") a[i, j] is a unit-stride vector over the M matrices, so a
# row or column sum reduces over an outer dim with unit-stride inner loops and a normalization
# is one broadcast division: no tiny inner reductions, which make eager torch slow on [M, n, n].


def _to_t(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., n, n] (any dtype, any strides) -> contiguous [n, n, M] in ``dtype``, one copy."""
    n = x.shape[-1]
    xm = x.reshape(-1, n, n)
    out = torch.empty((n, n, xm.shape[0]), dtype=dtype, device=x.device)
    out.copy_(xm.permute(1, 2, 0))
    return out


def _from_t(a: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return a.permute(2, 0, 1).contiguous().reshape(shape)


def _sum_t(a: torch.Tensor, axis: int, out: torch.Tensor) -> torch.Tensor:
    """Sum of [n, n, M] over ``axis`` into the [n, M] buffer ``out``, returned keepdim.

    ``axis`` 0 sums over rows (column sums, [1, n, M]), 1 over columns (row sums, [n, 1, M]).
    Writing into a buffer matters: a fresh tensor per step costs more in page faults than the
    sum. One reduction op rather than n-1 unrolled adds: about as fast on one thread and much
    faster on an oversubscribed machine, where every parallel op pays for descheduled threads.
    """
    view = out.unsqueeze(axis)
    torch.sum(a, dim=axis, keepdim=True, out=view)
    return view


def _softmax_t(xt: torch.Tensor) -> torch.Tensor:
    """Softmax over j (the last dim of the [..., n, n] view) of [n, n, M].

    Spelled out because torch.softmax over a non-last dim has a ~2 ms fixed cost on CPU (the
    whole op at 64k matrices; 100x the op at a few matrices), and over the last dim of
    [M, n, n] it is 10x slower. Same formula (and NaN/-inf behaviour) as torch.softmax.
    """
    e = torch.exp(xt - torch.amax(xt, dim=1, keepdim=True))
    return e.div_(e.sum(dim=1, keepdim=True))


def _forward_t(
    xt: torch.Tensor, n_steps: int, eps: float, keep: bool
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """``deepseek_v4``: runs the iterations in place.

    Returns the last iterate, the softmax ``p`` (with ``keep``, for the input VJP) and, with
    ``keep``, the per-step [n, M] denominators. These are 2*iters/n times the input, alive only
    during backward. They are allocated one per step on purpose: each stays under glibc's mmap
    threshold and is recycled across calls, where a single [steps, n, M] buffer is mmapped and
    page-faulted anew on every call (measured 8x slower per step on the benchmark case).
    """
    p = _softmax_t(xt)
    a = p + eps if keep else p.add_(eps)
    n, m = a.shape[0], a.shape[2]
    dens: list[torch.Tensor] = []
    buf = torch.empty((n, m), dtype=a.dtype, device=a.device)
    for k in range(n_steps):
        if keep:
            buf = torch.empty((n, m), dtype=a.dtype, device=a.device)
            dens.append(buf)
        d = _sum_t(a, k % 2, buf).add_(eps)  # even k: column sums (over rows), odd k: row sums
        a.div_(d)
    return a, (p if keep else None), dens


def _backward_t(xt: torch.Tensor, gt: torch.Tensor, n_steps: int, eps: float) -> torch.Tensor:
    """``deepseek_v4``: VJP of the whole projection in T layout; ``gt`` is overwritten.

    One normalization ``B = A / d`` with ``d = sum_axis(A) + eps`` has the VJP
    ``gA = (gB - s) / d`` with ``s = sum_axis(gB * B)``. We carry ``u = g * iterate`` instead of
    ``g``: then ``uA = gA * A = (gB - s) * B = uB - s * B`` and ``s = sum_axis(uB)``, i.e. one
    reduction and one fused multiply-subtract per step, no division. Walking back, the step's
    input is recovered as ``A = B * d`` (one rounding per step; the gradient stays as close to
    the fp64 truth as autograd through the reference is, see the tests), so backward holds one
    [n, n, M] iterate and the [n, M] denominators instead of every iterate.

    Carrying ``u`` also keeps exact zeros harmless: where an iterate is 0 (``-inf`` logits)
    ``u`` stays exactly 0, while ``g`` of a row of zeros grows by 1/eps per step and autograd
    through the reference turns 0 * inf into NaN. Wherever that reference is finite the two
    agree.
    """
    a, p, dens = _forward_t(xt, n_steps, eps, keep=True)
    assert p is not None
    n, m = a.shape[0], a.shape[2]
    buf = torch.empty((n, m), dtype=a.dtype, device=a.device)
    u = gt.mul_(a)
    for k in range(n_steps - 1, -1, -1):
        axis = k % 2
        u.addcmul_(_sum_t(u, axis, buf), a, value=-1.0)
        if k > 0:
            a.mul_(dens[k].unsqueeze(axis))  # NOTE: after step k's VJP, which needs B_k = a.
    # Now u = g0 * A0 with A0 = p + eps, and the softmax VJP is gx = p * (g0 - sum_j g0 p):
    # with t = p * g0 = u * p / A0, gx = t - p * sum_j t.
    q = p / (p + eps)
    if eps == 0:
        q.masked_fill_(p == 0, 0.0)  # p / p with p = 0: a zero entry, no gradient
    t = q.mul_(u)
    return t.addcmul_(_sum_t(t, 1, buf), p, value=-1.0)


def _log_forward_t(
    lt: torch.Tensor, n_steps: int, keep: bool
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``paper``: the log-domain iterations, in place on ``lt`` (log A, [n, n, M]).

    Step ``k`` is ``L = (L - m) - log(sum_axis exp(L - m))`` with ``m`` the max along the axis,
    as :func:`_log_normalize`. Returns the last log-iterate and, with ``keep``, each step's
    ([n, M] max, [n, M] log-sum), from which backward recovers the step's input as
    ``(L + log-sum) + m``: the entries near the max come back exactly, however large ``m``.
    """
    n, m = lt.shape[0], lt.shape[2]
    tmp = torch.empty_like(lt)
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    mbuf = torch.empty((n, m), dtype=lt.dtype, device=lt.device)
    sbuf = torch.empty_like(mbuf)
    for k in range(n_steps):
        axis = k % 2  # even k: over rows (column normalization), odd k: over columns
        if keep:
            mbuf, sbuf = torch.empty_like(mbuf), torch.empty_like(sbuf)
            steps.append((mbuf, sbuf))
        mx = mbuf.unsqueeze(axis)
        torch.amax(lt, dim=axis, keepdim=True, out=mx)
        mx.masked_fill_(torch.isneginf(mx), 0.0)  # an all -inf line stays -inf (not NaN)
        lt.sub_(mx)
        torch.exp(lt, out=tmp)
        lt.sub_(_sum_t(tmp, axis, sbuf).clamp_min_(1.0).log_())
    return lt, steps


def _round_t(a: torch.Tensor) -> torch.Tensor:
    """:func:`round_to_birkhoff` of [n, n, M] (rows i = dim 0, columns j = dim 1), in place."""
    c = a.sum(dim=0, keepdim=True)  # [1, n, M]
    y = a.div_(torch.where(c > 1, c, torch.ones_like(c)))
    er = (1 - y.sum(dim=1, keepdim=True)).clamp_min_(0)  # [n, 1, M]
    ec = (1 - y.sum(dim=0, keepdim=True)).clamp_min_(0)  # [1, n, M]
    ser, sec = er.sum(dim=0, keepdim=True), ec.sum(dim=1, keepdim=True)  # [1, 1, M]
    d = torch.where(ser > sec, ser, sec)
    w = ec / torch.where(d > 0, d, torch.ones_like(d))
    return y.addcmul_(er, w)


def _round_vjp_t(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """VJP of :func:`_round_t` at ``a`` [n, n, M] for the cotangent ``g``; a new tensor.

    ``B = Y + er wᵀ`` with ``w = ec / d``; each ``max(., 0)`` and ``where`` passes the gradient
    on the branch autograd through :func:`round_to_birkhoff` takes (``clamp_min`` passes it at
    equality, ``>`` does not).
    """
    c = a.sum(dim=0, keepdim=True)  # [1, n, M]
    over = c > 1
    cs = torch.where(over, c, torch.ones_like(c))
    y = a / cs
    zr = 1 - y.sum(dim=1, keepdim=True)  # [n, 1, M]
    zc = 1 - y.sum(dim=0, keepdim=True)  # [1, n, M]
    er, ec = zr.clamp_min(0), zc.clamp_min(0)
    ser, sec = er.sum(dim=0, keepdim=True), ec.sum(dim=1, keepdim=True)  # [1, 1, M]
    row_wins = ser > sec
    d = torch.where(row_wins, ser, sec)
    pos = d > 0
    dd = torch.where(pos, d, torch.ones_like(d))
    w = ec / dd
    g_er = (g * w).sum(dim=1, keepdim=True)  # [n, 1, M]
    g_w = (g * er).sum(dim=0, keepdim=True)  # [1, n, M]
    # w_j = ec_j / d: d w_j / d ec_j = 1 / d, d w_j / d d = -w_j / d (only where d > 0).
    g_d = torch.where(pos, -(g_w * w).sum(dim=1, keepdim=True) / dd, 0.0)  # [1, 1, M]
    g_er = g_er + torch.where(row_wins, g_d, 0.0)  # d = sum(er) or sum(ec)
    g_ec = g_w / dd + torch.where(row_wins, 0.0, g_d)
    g_zr = torch.where(zr >= 0, g_er, 0.0)
    g_zc = torch.where(zc >= 0, g_ec, 0.0)
    gy = g - g_zr - g_zc  # zr = 1 - rowsum(y), zc = 1 - colsum(y)
    # y = a / cs: d y_ij / d c_j = -y_ij / c_j where c_j > 1, with c_j = sum_i a_ij.
    g_c = torch.where(over, -(gy * y).sum(dim=0, keepdim=True) / cs, 0.0)
    return (gy / cs).add_(g_c)


def _log_backward_t(lt: torch.Tensor, gt: torch.Tensor, n_steps: int) -> torch.Tensor:
    """``paper``: VJP of the log-domain iterations and the rounding; ``lt`` is consumed.

    A log-domain step ``B = L - logsumexp_axis(L)`` has the VJP ``gL = gB - exp(B) *
    sum_axis(gB)`` (the max inside cancels). The cotangent of the log-iterate is ``u = g * A``
    in terms of ``A = exp(L)``, so this is the same walk as the ``deepseek_v4`` one:
    ``u -= sum_axis(u) * A_k`` per step, the step's input recovered from the kept (max,
    log-sum). Exact zeros (``-inf``) keep ``u = 0``.
    """
    lt, steps = _log_forward_t(lt, n_steps, keep=True)
    a = torch.exp(lt)
    u = _round_vjp_t(a, gt).mul_(a)
    n, m = a.shape[0], a.shape[2]
    buf = torch.empty((n, m), dtype=a.dtype, device=a.device)
    for k in range(n_steps - 1, -1, -1):
        axis = k % 2
        if k < n_steps - 1:
            torch.exp(lt, out=a)  # step k's output
        u.addcmul_(_sum_t(u, axis, buf), a, value=-1.0)
        if k > 0:
            mx, ls = steps[k]
            lt.add_(ls.unsqueeze(axis)).add_(mx.unsqueeze(axis))  # step k's input
    return u


class _SinkhornFunction(torch.autograd.Function):
    """Sinkhorn with an exact recompute backward; saves only the input logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float, variant: str) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(logits)
        ctx.cfg = (iters, eps, variant)
        dtype = compute_dtype(logits.dtype)
        if logits.numel() == 0:
            return torch.empty(logits.shape, dtype=dtype, device=logits.device)
        xt = _to_t(logits, dtype)
        n_steps = num_steps(iters, variant)
        if variant == "paper":
            lt, _ = _log_forward_t(xt, n_steps, keep=False)
            a = _round_t(lt.exp_())
        else:
            a, _, _ = _forward_t(xt, n_steps, eps, keep=False)
        return _from_t(a, logits.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (logits,) = ctx.saved_tensors
        iters, eps, variant = ctx.cfg
        if logits.numel() == 0:
            return torch.zeros_like(logits), None, None, None
        dtype = compute_dtype(logits.dtype)
        xt = _to_t(logits, dtype)
        gt = _to_t(grad_out, dtype)
        n_steps = num_steps(iters, variant)
        if variant == "paper":
            gx = _log_backward_t(xt, gt, n_steps)
        else:
            gx = _backward_t(xt, gt, n_steps, eps)
        return _from_t(gx, logits.shape).to(logits.dtype), None, None, None


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------


def _triton_kernels():
    """Imports the Triton kernel module (lazily: importing triton costs seconds)."""
    from unicache_train.kernels import sinkhorn as tk

    return tk


def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _resolve_backend(logits: torch.Tensor, backend: str) -> str:
    global _logged_fallback
    if backend == "auto":
        if logits.is_cuda and _triton_importable():
            return "triton"
        if logits.is_cuda and not _logged_fallback:
            _logged_fallback = True
            logger.warning(
                "sinkhorn: Triton is not importable; CUDA tensors use the torch backend "
                "(correct, slower). Install triton to use the fused kernels."
            )
        return "torch"
    if backend == "triton":
        if not _triton_importable():
            raise RuntimeError("sinkhorn: backend='triton' but the triton package is not installed")
        if not logits.is_cuda:
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError(
                    f"sinkhorn: backend='triton' needs a CUDA tensor, got device {logits.device}; "
                    "on CPU set TRITON_INTERPRET=1 before the kernels are imported "
                    "(interpreter, for tests), or use backend='torch'"
                )
            if not _triton_kernels().INTERPRETED:
                raise RuntimeError(
                    "sinkhorn: TRITON_INTERPRET=1 is set but unicache_train.kernels.sinkhorn was "
                    "imported before it was; set it before the first import"
                )
    return backend


def sinkhorn(
    logits: torch.Tensor,
    iters: int = 20,
    eps: float = 1e-6,
    variant: str = "deepseek_v4",
    backend: str = "auto",
    check_finite: bool = False,
) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``exp``/``softmax`` logits onto doubly-stochastic matrices.

    The projection used by mHC (arXiv 2512.24880) for the residual mixing matrix. The caller
    passes the already scaled and biased logits (``raw * scale + base``); this op is only the
    projection. Exact backward that saves only the input (the iterations are recomputed).

    Args:
        logits: [..., n, n] any float dtype, any leading dims (flattened internally).
        iters: Sinkhorn iterations, >= 1 (transformers' ``hc_sinkhorn_iters``, paper: 20).
        eps: >= 0. ``deepseek_v4``: added to every denominator and to the softmax
            (transformers' ``hc_eps``); not used by ``paper``.
        variant: ``"deepseek_v4"`` (transformers' ``DeepseekV4HyperConnection``, to fp32
            rounding) or ``"paper"`` (``M(t) = T_r(T_c(M(t-1)))`` from ``exp(logits)`` in the
            log domain, then rounded onto the doubly-stochastic matrices); formulas in the
            module docstring.
        backend: ``"auto"`` (Triton on CUDA if importable, else torch), ``"torch"`` or
            ``"triton"`` (raises ``RuntimeError`` if it cannot run).
        check_finite: raise ``ValueError`` if ``logits`` holds NaN or ``+inf`` (synchronizes on
            CUDA). Without it NaN propagates to the output. ``-inf`` is always allowed.

    Returns:
        [..., n, n] fp32 (fp64 for fp64 input). ``deepseek_v4``: the last normalized axis
        sums to 1 within ``~eps``, the other within the convergence residual; ``paper``: both
        sum to 1 (to rounding) for any finite input (module docstring).

    Raises:
        ValueError: bad ``iters``/``eps``/``variant``/``backend``/shape, or non-finite logits with
            ``check_finite``.
        RuntimeError: ``backend="triton"`` that cannot run here.
    """
    validate_sinkhorn_args(logits, iters, eps, variant, backend)
    if check_finite:
        _check_finite(logits)
    eps = float(eps)
    resolved = _resolve_backend(logits, backend)
    if resolved == "triton":
        return _triton_kernels().SinkhornTritonFunction.apply(logits, iters, eps, variant)
    return _SinkhornFunction.apply(logits, iters, eps, variant)
