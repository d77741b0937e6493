"""Triton Sinkhorn-Knopp kernels: forward, and a backward that recomputes the iterations.

Installed as ``unicache_train.kernels.sinkhorn``; the functional API is
:func:`unicache_train.ops.sinkhorn` (``backend="triton"``), whose ``sinkhorn_reference`` is the
spec these kernels are tested against. Formulas, variants and numerics: see
``unicache_train/ops/sinkhorn.py`` (mHC, https://arxiv.org/abs/2512.24880 §4.2).

Shape legend: ``M, n, NP, BLOCK = matrices, streams, n padded to a power of two, matrices per
program``.

Layout: one program owns ``BLOCK`` whole matrices as a ``[BLOCK, NP, NP]`` register tile (masked
where ``i, j >= n``, so n = 3 works); row and column sums are in-register reductions, so no
matrix ever leaves the program between iterations.

Forward: ``2*iters-1`` (``deepseek_v4``) or ``2*iters`` (``paper``) normalizations, statically
unrolled (``iters`` is a compile-time constant); step ``k`` normalizes columns when ``k`` is even,
rows when odd. ``deepseek_v4`` divides by sums; ``paper`` works in the log domain
(``L = (L - max) - log(sum exp(L - max))`` per column/row) and ends with the rounding onto the
doubly-stochastic matrices (Altschuler et al. 2017, Alg. 2). Only the input is saved for
backward.

Backward: recompute the forward once, keeping what each step needs to be undone as SSA values of
the unrolled code, i.e. in registers: the denominator ``d_k`` (``deepseek_v4``) or the max and
log-sum (``paper``), each a ``[BLOCK, 1, NP]`` or ``[BLOCK, NP, 1]`` vector. Then walk the steps
in reverse with the VJP written for ``u = g * iterate``: ``uA = uB - sum_axis(uB) * B`` (for
``paper`` ``u`` is the cotangent of the log-iterate and ``B = exp(L_k)``, the same formula), and
recover each step's input (``A = B * d``; ``L = (L + log-sum) + max``). This is linear in
``iters`` (no O(iters^2) recompute), stores nothing per iteration in global memory, and keeps
``u`` exactly 0 on exact zeros (where ``g`` would overflow). Finally the VJP of ``softmax``
(``deepseek_v4``); for ``paper`` the rounding's VJP comes first, the log iterate's start is the
input itself.

Compute dtype: fp32 for fp16/bf16/fp32 inputs, fp64 for fp64 (so gradcheck can run under the
interpreter). Output fp32/fp64, gradient in the input dtype.

On CPU these kernels run under ``TRITON_INTERPRET=1``, which Triton reads when the kernels are
decorated, i.e. when this module is imported: set it before the first import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from unicache_train.ops.sinkhorn import compute_dtype, num_steps, validate_sinkhorn_args

# Past this tile a matrix no longer fits a program's registers (the backward holds the iterate,
# the cotangent, the softmax and 2*iters denominators per element row/column).
_MAX_NP = 64
# Elements of a program's tile (4 warps). Forward: 8 per thread (36-56 registers). Backward:
# each thread also holds one denominator per step for each of its matrices, so the tile is
# smaller: 2 elements per thread keeps 20 iterations (40 steps) in 56-107 registers and 40
# iterations in ~170, without spills, for n in 2..16 (ptxas -v, sm_90a, fp32 compute,
# ``deepseek_v4``); a 1024-element tile spills 80-460 bytes at 20 iterations. The log-domain
# ``paper`` backward keeps two vectors per step (max and log-sum): not yet measured with ptxas.
_TILE_FWD = 1024
_TILE_BWD = 256


@triton.jit
def _tile(pid, M, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets [BLOCK, NP, NP] of this program's matrices and the validity masks."""
    m = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[:, None, None]  # [BLOCK, 1, 1]
    i = tl.arange(0, NP)[None, :, None]  # [1, NP, 1] row index
    j = tl.arange(0, NP)[None, None, :]  # [1, 1, NP] column index
    mvalid = m < M
    rvalid = mvalid & (i < N)  # [BLOCK, NP, 1]
    cvalid = mvalid & (j < N)  # [BLOCK, 1, NP]
    mask = rvalid & cvalid  # [BLOCK, NP, NP]
    offs = m * (N * N) + i * N + j
    return offs, mask, rvalid, cvalid


@triton.jit
def _log_step(lg, mask, valid, AXIS: tl.constexpr):
    """``paper``: one log-domain normalization along ``AXIS`` (1: columns, 2: rows).

    ``L = (L - m) - log(sum exp(L - m))``; returns (L, m, log-sum). An all ``-inf`` line
    (padding included) has ``m = 0`` and a sum of 0 read as 1, so it stays ``-inf``; otherwise
    the sum is >= 1 (the max's term). NaN propagates (``== ``, not ``max``, guards).
    """
    mx = tl.where(valid, tl.max(lg, axis=AXIS, keep_dims=True), 0.0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    lg = lg - mx
    s = tl.sum(tl.where(mask, tl.exp(lg), 0.0), axis=AXIS, keep_dims=True)
    ls = tl.log(tl.where(s == 0.0, 1.0, s))
    return lg - ls, mx, ls


@triton.jit
def _round(a, rvalid, cvalid):
    """``paper``: rounding onto the doubly-stochastic matrices (``round_to_birkhoff``)."""
    c = tl.sum(a, axis=1, keep_dims=True)  # [BLOCK, 1, NP] column sums
    y = a / tl.where(c > 1.0, c, 1.0)
    zr = 1.0 - tl.sum(y, axis=2, keep_dims=True)  # [BLOCK, NP, 1]
    zc = 1.0 - tl.sum(y, axis=1, keep_dims=True)  # [BLOCK, 1, NP]
    er = tl.where(rvalid, tl.where(zr < 0.0, 0.0, zr), 0.0)  # NaN propagates, as clamp_min
    ec = tl.where(cvalid, tl.where(zc < 0.0, 0.0, zc), 0.0)
    ser = tl.sum(er, axis=1, keep_dims=True)  # [BLOCK, 1, 1]
    sec = tl.sum(ec, axis=2, keep_dims=True)
    d = tl.where(ser > sec, ser, sec)
    return y + er * (ec / tl.where(d > 0.0, d, 1.0))


@triton.jit
def _round_vjp(a, g, rvalid, cvalid):
    """VJP of :func:`_round` at ``a`` for the cotangent ``g`` (as ``_round_vjp_t`` in ops)."""
    c = tl.sum(a, axis=1, keep_dims=True)  # [BLOCK, 1, NP]
    over = c > 1.0
    cs = tl.where(over, c, 1.0)
    y = a / cs
    zr = 1.0 - tl.sum(y, axis=2, keep_dims=True)  # [BLOCK, NP, 1]
    zc = 1.0 - tl.sum(y, axis=1, keep_dims=True)  # [BLOCK, 1, NP]
    rpass = rvalid & (zr >= 0.0)
    cpass = cvalid & (zc >= 0.0)
    er = tl.where(rpass, zr, 0.0)
    ec = tl.where(cpass, zc, 0.0)
    ser = tl.sum(er, axis=1, keep_dims=True)  # [BLOCK, 1, 1]
    sec = tl.sum(ec, axis=2, keep_dims=True)
    row_wins = ser > sec
    d = tl.where(row_wins, ser, sec)
    pos = d > 0.0
    dd = tl.where(pos, d, 1.0)
    w = ec / dd
    g_er = tl.sum(g * w, axis=2, keep_dims=True)  # [BLOCK, NP, 1]
    g_w = tl.sum(g * er, axis=1, keep_dims=True)  # [BLOCK, 1, NP]
    g_d = tl.where(pos, -tl.sum(g_w * w, axis=2, keep_dims=True) / dd, 0.0)  # [BLOCK, 1, 1]
    g_er = g_er + tl.where(row_wins, g_d, 0.0)
    g_ec = g_w / dd + tl.where(row_wins, 0.0, g_d)
    gy = g - tl.where(rpass, g_er, 0.0) - tl.where(cpass, g_ec, 0.0)
    g_c = tl.where(over, -tl.sum(gy * y, axis=1, keep_dims=True) / cs, 0.0)
    return gy / cs + g_c


@triton.jit
def _init_softmax(x, mask, rvalid):
    """``deepseek_v4`` softmax over the last dim (A0 = p + eps is formed by the caller)."""
    # Padded rows get a harmless max/denominator of 0/1; a real row that is entirely -inf gives
    # NaN, as torch.softmax does.
    rmax = tl.where(rvalid, tl.max(x, axis=2, keep_dims=True), 0.0)  # [BLOCK, NP, 1]
    e = tl.where(mask, tl.exp(x - rmax), 0.0)
    return e / tl.where(rvalid, tl.sum(e, axis=2, keep_dims=True), 1.0)


@triton.jit
def _sinkhorn_fwd_kernel(
    x_ptr,
    y_ptr,
    M,
    eps,
    N: tl.constexpr,
    NP: tl.constexpr,
    STEPS: tl.constexpr,
    PAPER: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    offs, mask, rvalid, cvalid = _tile(tl.program_id(0), M, N, NP, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=float("-inf")).to(DT)
    if PAPER:
        lg = x  # padded entries are -inf: zeros
        for k in tl.static_range(STEPS):
            if k % 2 == 0:
                lg, _, _ = _log_step(lg, mask, cvalid, 1)
            else:
                lg, _, _ = _log_step(lg, mask, rvalid, 2)
        a = _round(tl.where(mask, tl.exp(lg), 0.0), rvalid, cvalid)
    else:
        a = tl.where(mask, _init_softmax(x, mask, rvalid) + eps, 0.0)
        for k in tl.static_range(STEPS):
            # Denominators of padded rows/columns (and of matrices past M) are 1, so padding
            # stays 0 even with eps = 0.
            if k % 2 == 0:
                a = a / tl.where(cvalid, tl.sum(a, axis=1, keep_dims=True) + eps, 1.0)
            else:
                a = a / tl.where(rvalid, tl.sum(a, axis=2, keep_dims=True) + eps, 1.0)
    tl.store(y_ptr + offs, a, mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(
    x_ptr,
    dy_ptr,
    dx_ptr,
    M,
    eps,
    N: tl.constexpr,
    NP: tl.constexpr,
    STEPS: tl.constexpr,
    PAPER: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    offs, mask, rvalid, cvalid = _tile(tl.program_id(0), M, N, NP, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=float("-inf")).to(DT)
    g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(DT)
    if PAPER:
        # Recompute the log-domain forward, keeping each step's max and log-sum in registers (a
        # tuple of SSA values of the unrolled code; its index k is a compile-time constant).
        lg = x
        maxes = ()
        logsums = ()
        for k in tl.static_range(STEPS):
            if k % 2 == 0:
                lg, mx, ls = _log_step(lg, mask, cvalid, 1)
            else:
                lg, mx, ls = _log_step(lg, mask, rvalid, 2)
            maxes = maxes + (mx,)
            logsums = logsums + (ls,)
        a = tl.where(mask, tl.exp(lg), 0.0)
        # u = cotangent of the log-iterate = (cotangent of exp(L)) * exp(L).
        u = _round_vjp(a, g, rvalid, cvalid) * a
        for k in tl.static_range(STEPS - 1, -1, -1):
            if k < STEPS - 1:
                a = tl.where(mask, tl.exp(lg), 0.0)  # step k's output
            if k % 2 == 0:
                u = u - tl.sum(u, axis=1, keep_dims=True) * a
            else:
                u = u - tl.sum(u, axis=2, keep_dims=True) * a
            if k > 0:
                lg = (lg + logsums[k]) + maxes[k]  # NOTE: after step k's VJP: its input
        gx = u  # the log-iterate starts at the input itself
    else:
        pe = _init_softmax(x, mask, rvalid)  # pe = softmax(x)
        a = tl.where(mask, pe + eps, 0.0)
        # Recompute the forward, keeping the denominators in registers.
        dens = ()
        for k in tl.static_range(STEPS):
            if k % 2 == 0:
                d = tl.where(cvalid, tl.sum(a, axis=1, keep_dims=True) + eps, 1.0)
            else:
                d = tl.where(rvalid, tl.sum(a, axis=2, keep_dims=True) + eps, 1.0)
            a = a / d
            dens = dens + (d,)
        # Walk back carrying u = g * iterate, as the torch path does (see _backward_t there):
        # uA = uB - sum_axis(uB) * B, then A = B * d. Exact zeros (-inf logits, padding) keep
        # u = 0, where g of a row of zeros would grow by 1/eps per step.
        u = g * a
        for k in tl.static_range(STEPS - 1, -1, -1):
            if k % 2 == 0:
                u = u - tl.sum(u, axis=1, keep_dims=True) * a
            else:
                u = u - tl.sum(u, axis=2, keep_dims=True) * a
            if k > 0:
                a = a * dens[k]  # NOTE: after step k's VJP, which needs its output B_k = a.
        # Now u = g0 * A0 with A0 = p + eps; softmax VJP with t = p * g0 = u * p / A0:
        # gx = t - p * sum_j t.
        t = tl.where(pe == 0.0, 0.0, pe / (pe + eps)) * u
        gx = t - pe * tl.sum(t, axis=2, keep_dims=True)
    tl.store(dx_ptr + offs, gx, mask=mask)


# Set at import: Triton picks interpreter or compiler when it decorates the kernels above.
INTERPRETED: bool = not isinstance(_sinkhorn_fwd_kernel, triton.runtime.JITFunction)


def _launch_config(n: int, dtype: torch.dtype, tile: int) -> tuple[int, int, tl.dtype]:
    np2 = triton.next_power_of_2(n)
    if np2 > _MAX_NP:
        raise ValueError(
            f"sinkhorn triton kernels support n <= {_MAX_NP}, got n={n}; use backend='torch'"
        )
    block = max(1, tile // (np2 * np2))
    dt = tl.float64 if dtype == torch.float64 else tl.float32
    return np2, block, dt


def _check_device(t: torch.Tensor) -> None:
    if t.is_cuda == INTERPRETED:
        mode = "the interpreter (TRITON_INTERPRET=1)" if INTERPRETED else "compiled mode"
        raise RuntimeError(
            f"sinkhorn triton kernels were imported in {mode} and cannot run on a tensor on "
            f"{t.device}"
        )


def sinkhorn_forward(logits: torch.Tensor, iters: int, eps: float, variant: str) -> torch.Tensor:
    """Launches the forward kernel. ``logits: [..., n, n]`` -> ``[..., n, n]`` fp32 (fp64)."""
    _check_device(logits)
    n = logits.shape[-1]
    x = logits.reshape(-1, n, n).contiguous()
    y = torch.empty(x.shape, dtype=compute_dtype(logits.dtype), device=x.device)
    m = x.shape[0]
    if m:
        np2, block, dt = _launch_config(n, logits.dtype, _TILE_FWD)
        _sinkhorn_fwd_kernel[(triton.cdiv(m, block),)](
            x,
            y,
            m,
            eps,
            N=n,
            NP=np2,
            STEPS=num_steps(iters, variant),
            PAPER=variant == "paper",
            BLOCK=block,
            DT=dt,
            num_warps=4,
        )
    return y.reshape(logits.shape)


def sinkhorn_backward(
    logits: torch.Tensor, grad_out: torch.Tensor, iters: int, eps: float, variant: str
) -> torch.Tensor:
    """Launches the backward kernel: ``grad_out [..., n, n]`` -> grad of logits, logits' dtype."""
    _check_device(logits)
    n = logits.shape[-1]
    x = logits.reshape(-1, n, n).contiguous()
    dy = grad_out.reshape(-1, n, n).contiguous()
    dx = torch.empty(x.shape, dtype=logits.dtype, device=x.device)
    m = x.shape[0]
    if m:
        np2, block, dt = _launch_config(n, logits.dtype, _TILE_BWD)
        _sinkhorn_bwd_kernel[(triton.cdiv(m, block),)](
            x,
            dy,
            dx,
            m,
            eps,
            N=n,
            NP=np2,
            STEPS=num_steps(iters, variant),
            PAPER=variant == "paper",
            BLOCK=block,
            DT=dt,
            num_warps=4,
        )
    return dx.reshape(logits.shape)


class SinkhornTritonFunction(torch.autograd.Function):
    """Triton Sinkhorn: saves only the input; backward recomputes in registers."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float, variant: str) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(logits)
        ctx.cfg = (iters, eps, variant)
        return sinkhorn_forward(logits, iters, eps, variant)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (logits,) = ctx.saved_tensors
        iters, eps, variant = ctx.cfg
        return sinkhorn_backward(logits, grad_out, iters, eps, variant), None, None, None


def sinkhorn_triton(
    logits: torch.Tensor, iters: int = 20, eps: float = 1e-6, variant: str = "deepseek_v4"
) -> torch.Tensor:
    """Differentiable Triton Sinkhorn. Arguments as :func:`unicache_train.ops.sinkhorn`.

    Args:
        logits: [..., n, n] CUDA tensor (CPU under ``TRITON_INTERPRET=1``), any float dtype.
        iters: Sinkhorn iterations, >= 1 (a compile-time constant of the kernels).
        eps: >= 0, added to every denominator.
        variant: ``"deepseek_v4"`` or ``"paper"``.

    Returns:
        [..., n, n] fp32 (fp64 for fp64 input).
    """
    validate_sinkhorn_args(logits, iters, eps, variant)
    return SinkhornTritonFunction.apply(logits, iters, float(eps), variant)
