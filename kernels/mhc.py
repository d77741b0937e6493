"""Fused Triton kernels of one mHC connection: norm+projection, pre-collapse, post + residual mix.

Installed as ``unicache_train.kernels.mhc``; the functional API and the PyTorch paths these
kernels are tested against are in :mod:`unicache_train.ops.mhc` (``backend="triton"``). Formulas
and conventions: ``unicache_train/model/mhc.py`` (mHC, https://arxiv.org/abs/2512.24880;
transformers' ``DeepseekV4HyperConnection``).

Shape legend: ``M, n, C, NC, K = tokens (B*T), streams, hidden size, n*C, coefficient logits
((2+n)*n)``; ``NP, KP`` = ``n``, ``K`` padded to a power of two; ``BC, BM, BK, BN`` = tile sizes.

One connection reads the streams ``X [M, n, C]`` three times in the forward, each time once per
token and in its own dtype (bf16 stays bf16 in memory; every kernel computes in fp32, fp64 for
fp64 inputs):

* :func:`rms_project_forward`: ``raw = (X @ fn^T) / rms(X)`` and ``1/rms`` in one pass over X:
  the sum of squares is accumulated beside the projection (the torch path reads X for the norm,
  again for the GEMM, and writes an fp32 copy of bf16 streams first). The flattened axis is
  split across programs when there are few token blocks; torch adds the ``[splits, M, K]``
  partial sums. Backward: one pass over X writes ``dX = (g/rms) @ fn + coef * X`` and
  accumulates ``dfn = (g/rms)^T X`` (split over tokens, partial sums added by torch).
* :func:`collapse_forward`: ``u = sum_i pre_i X_i``. Backward: ``dX_i = pre_i du`` and
  ``dpre_i = <du, X_i>`` in one pass.
* :func:`mix_forward`: ``X' = res @ X + post (x) f`` (``res`` multiplies from the left,
  ``X'_i = sum_j res[i, j] X_j``; HF's ``comb^T``): reads X and f once, writes X' once.
  Backward, one pass reading ``dX'``, X and f: ``dX = res^T dX'``, ``df = post^T dX'``,
  ``dpost_i = <dX'_i, f>``, ``dres[i, j] = <dX'_i, X_j>``.

Per token the coefficients (pre ``[n]``, post ``[n]``, res ``[n, n]``) are a few registers; the
``n x n`` mix is an in-register broadcast-and-reduce over a ``[NP, NP, BC]`` tile (``n`` is at
most :data:`MAX_N`). The reductions over ``C`` of the backward kernels run in a loop inside one
program per token, so nothing but the outputs is written.

Exactness: the projection uses ``tl.dot(..., input_precision="ieee")`` (full fp32 FMA, no TF32:
the coefficients are fp32 by contract), fp64 by broadcast-and-reduce. Everything agrees with the
torch path to fp32 rounding; with bf16 streams the kernels round once (fp32 math, one cast),
where the torch mix rounds ``res`` and ``post`` to bf16 before its bf16 GEMM.

On CPU these kernels run under ``TRITON_INTERPRET=1``, which Triton reads when the kernels are
decorated, i.e. when this module is imported: set it before the first import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

# The mix holds an [NP, NP, BC] tile per program; past 16 streams it would need a tiled
# matmul. ``backend="auto"`` falls back to the torch path above this; "triton" raises.
MAX_N = 16
# Elements of one program's main tile (4 warps: 16-64 per thread).
_TILE_2D = 4096  # collapse: [NP, BC]
_TILE_3D = 8192  # mix: [NP, NP, BC]
_MIN_BC = 16


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _collapse_fwd_kernel(
    x_ptr, pre_ptr, u_ptr, C, N: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr
):
    """Program (token m, channel block): ``u[m, c] = sum_i pre[m, i] x[m, i, c]``."""
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)  # [BC]
    i = tl.arange(0, NP)  # [NP]
    cmask = c < C
    imask = i < N
    pre = tl.load(pre_ptr + m * N + i, mask=imask, other=0.0).to(DT)  # [NP]
    offs = m * N * C + i[:, None] * C + c[None, :]  # [NP, BC]
    x = tl.load(x_ptr + offs, mask=imask[:, None] & cmask[None, :], other=0.0).to(DT)
    u = tl.sum(pre[:, None] * x, axis=0)  # [BC]
    tl.store(u_ptr + m * C + c, u.to(u_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _collapse_bwd_kernel(
    x_ptr,
    pre_ptr,
    du_ptr,
    dx_ptr,
    dpre_ptr,
    C,
    N: tl.constexpr,
    NP: tl.constexpr,
    BC: tl.constexpr,
    DT: tl.constexpr,
):
    """Program (token m): ``dx[m, i] = pre[m, i] du[m]``, ``dpre[m, i] = <du[m], x[m, i]>``."""
    m = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    imask = i < N
    pre = tl.load(pre_ptr + m * N + i, mask=imask, other=0.0).to(DT)  # [NP]
    acc = tl.zeros([NP], dtype=DT)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        mask = imask[:, None] & cmask[None, :]
        offs = m * N * C + i[:, None] * C + c[None, :]  # [NP, BC]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(DT)
        du = tl.load(du_ptr + m * C + c, mask=cmask, other=0.0).to(DT)  # [BC]
        tl.store(dx_ptr + offs, (pre[:, None] * du[None, :]).to(dx_ptr.dtype.element_ty), mask=mask)
        acc += tl.sum(x * du[None, :], axis=1)
    tl.store(dpre_ptr + m * N + i, acc.to(dpre_ptr.dtype.element_ty), mask=imask)


@triton.jit
def _mix_fwd_kernel(
    x_ptr,
    f_ptr,
    post_ptr,
    res_ptr,
    out_ptr,
    C,
    N: tl.constexpr,
    NP: tl.constexpr,
    BC: tl.constexpr,
    DT: tl.constexpr,
):
    """Program (token m, channel block): ``out[i, c] = sum_j res[i, j] x[j, c] + post[i] f[c]``."""
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)  # [BC]
    i = tl.arange(0, NP)
    cmask = c < C
    imask = i < N
    rmask = imask[:, None] & imask[None, :]
    res = tl.load(res_ptr + m * N * N + i[:, None] * N + i[None, :], mask=rmask, other=0.0)
    res = res.to(DT)  # [NP(i), NP(j)]
    post = tl.load(post_ptr + m * N + i, mask=imask, other=0.0).to(DT)  # [NP]
    mask = imask[:, None] & cmask[None, :]
    offs = m * N * C + i[:, None] * C + c[None, :]  # [NP, BC]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(DT)  # [NP(j), BC]
    f = tl.load(f_ptr + m * C + c, mask=cmask, other=0.0).to(DT)  # [BC]
    out = tl.sum(res[:, :, None] * x[None, :, :], axis=1)  # [NP, NP, BC] -> [NP(i), BC]
    out += post[:, None] * f[None, :]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mix_bwd_kernel(
    x_ptr,
    f_ptr,
    post_ptr,
    res_ptr,
    g_ptr,
    dx_ptr,
    df_ptr,
    dpost_ptr,
    dres_ptr,
    C,
    N: tl.constexpr,
    NP: tl.constexpr,
    BC: tl.constexpr,
    DT: tl.constexpr,
):
    """Program (token m): the VJP of the mix for the cotangent ``g = dX'`` (module docstring)."""
    m = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    imask = i < N
    rmask = imask[:, None] & imask[None, :]
    res = tl.load(res_ptr + m * N * N + i[:, None] * N + i[None, :], mask=rmask, other=0.0)
    res = res.to(DT)  # [NP(i), NP(j)]
    post = tl.load(post_ptr + m * N + i, mask=imask, other=0.0).to(DT)  # [NP]
    dres = tl.zeros([NP, NP], dtype=DT)
    dpost = tl.zeros([NP], dtype=DT)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        mask = imask[:, None] & cmask[None, :]
        offs = m * N * C + i[:, None] * C + c[None, :]  # [NP, BC]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(DT)  # [NP(j), BC]
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(DT)  # [NP(i), BC]
        f = tl.load(f_ptr + m * C + c, mask=cmask, other=0.0).to(DT)  # [BC]
        dx = tl.sum(res[:, :, None] * g[:, None, :], axis=0)  # [NP(i), NP(j), BC] -> [NP(j), BC]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        df = tl.sum(post[:, None] * g, axis=0)  # [BC]
        tl.store(df_ptr + m * C + c, df.to(df_ptr.dtype.element_ty), mask=cmask)
        dpost += tl.sum(g * f[None, :], axis=1)
        dres += tl.sum(g[:, None, :] * x[None, :, :], axis=2)  # [NP(i), NP(j), BC] -> [NP, NP]
    tl.store(dpost_ptr + m * N + i, dpost.to(dpost_ptr.dtype.element_ty), mask=imask)
    tl.store(
        dres_ptr + m * N * N + i[:, None] * N + i[None, :],
        dres.to(dres_ptr.dtype.element_ty),
        mask=rmask,
    )


@triton.jit
def _proj_fwd_kernel(
    x_ptr,
    w_ptr,
    acc_ptr,
    ss_ptr,
    M,
    NC,
    COLS,
    K: tl.constexpr,
    KP: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    DT: tl.constexpr,
    DOT: tl.constexpr,
):
    """Program (block of BM tokens, column split): this split's ``x @ w^T`` and ``sum x^2``.

    x: [M, NC] (streams flattened, any float dtype); w: [K, NC]; acc: [splits, M, K];
    ss: [splits, M]. The split owns columns ``[split * COLS, (split + 1) * COLS)``; the
    launcher adds the splits and applies ``1/rms`` (a few ``[M, K]`` ops).
    """
    r = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)  # [BM]
    split = tl.program_id(1).to(tl.int64)
    k = tl.arange(0, KP)  # [KP]
    rmask = r < M
    kmask = k < K
    acc = tl.zeros([BM, KP], dtype=DT)
    ss = tl.zeros([BM], dtype=DT)
    for c0 in range(0, COLS, BK):
        c = split * COLS + c0 + tl.arange(0, BK)
        cmask = c < NC
        x = tl.load(
            x_ptr + r[:, None] * NC + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0
        ).to(DT)  # [BM, BK]
        w = tl.load(
            w_ptr + k[None, :] * NC + c[:, None], mask=cmask[:, None] & kmask[None, :], other=0.0
        ).to(DT)  # [BK, KP] = w^T tile
        if DOT:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)  # [BM, BK, KP] -> [BM, KP]
        ss += tl.sum(x * x, axis=1)
    tl.store(
        acc_ptr + split * M * K + r[:, None] * K + k[None, :],
        acc.to(acc_ptr.dtype.element_ty),
        mask=rmask[:, None] & kmask[None, :],
    )
    tl.store(ss_ptr + split * M + r, ss.to(ss_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _proj_bwd_kernel(
    x_ptr,
    w_ptr,
    gs_ptr,
    coef_ptr,
    gx_ptr,
    gwp_ptr,
    M,
    NC,
    ROWS,
    K: tl.constexpr,
    KP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    DT: tl.constexpr,
    DOT: tl.constexpr,
):
    """Program (column block, token split): one pass over its ``x`` rows.

    ``gx = gs @ w + coef * x`` (stored) and ``gw_part[split] = gs^T @ x`` (its rows only).
    gs: [M, K] = ``g * inv``; coef: [M] (the norm's term); gwp: [splits, K, NC].
    """
    c = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN]
    split = tl.program_id(1).to(tl.int64)
    k = tl.arange(0, KP)
    cmask = c < NC
    kmask = k < K
    w = tl.load(
        w_ptr + k[:, None] * NC + c[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0
    ).to(DT)  # [KP, BN]
    gw = tl.zeros([KP, BN], dtype=DT)
    for r0 in range(0, ROWS, BM):
        r = split * ROWS + r0 + tl.arange(0, BM)  # [BM]
        rmask = r < M
        mask = rmask[:, None] & cmask[None, :]
        offs = r[:, None] * NC + c[None, :]  # [BM, BN]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(DT)
        gs = tl.load(
            gs_ptr + r[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0
        ).to(DT)  # [BM, KP]
        coef = tl.load(coef_ptr + r, mask=rmask, other=0.0).to(DT)  # [BM]
        if DOT:
            gx = tl.dot(gs, w, input_precision="ieee")  # [BM, KP] @ [KP, BN]
            gw = tl.dot(tl.trans(gs), x, gw, input_precision="ieee")  # [KP, BM] @ [BM, BN]
        else:
            gx = tl.sum(gs[:, :, None] * w[None, :, :], axis=1)
            gw += tl.sum(gs[:, :, None] * x[:, None, :], axis=0)
        gx += coef[:, None] * x
        tl.store(gx_ptr + offs, gx.to(gx_ptr.dtype.element_ty), mask=mask)
    tl.store(
        gwp_ptr + split * K * NC + k[:, None] * NC + c[None, :],
        gw.to(gwp_ptr.dtype.element_ty),
        mask=kmask[:, None] & cmask[None, :],
    )


# Set at import: Triton picks interpreter or compiler when it decorates the kernels above.
INTERPRETED: bool = not isinstance(_mix_fwd_kernel, triton.runtime.JITFunction)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


def _compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _tl_dtype(dtype: torch.dtype) -> tl.dtype:
    return tl.float64 if dtype == torch.float64 else tl.float32


def _check(x: torch.Tensor, n: int) -> None:
    if x.is_cuda == INTERPRETED:
        mode = "the interpreter (TRITON_INTERPRET=1)" if INTERPRETED else "compiled mode"
        raise RuntimeError(
            f"mhc triton kernels were imported in {mode} and cannot run on a tensor on {x.device}"
        )
    if not 1 <= n <= MAX_N:
        raise ValueError(f"mhc triton kernels support 1 <= n <= {MAX_N} streams, got n={n}")


def _block_c(C: int, per_c: int, budget: int) -> int:
    """Channel tile: a power of two, the tile's ``per_c * BC`` elements within ``budget``."""
    return max(_MIN_BC, min(triton.next_power_of_2(C), budget // per_c))


def collapse_forward(pre: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``u = sum_i pre_i X_i``. pre: [M, n]; x: [M, n, C] -> u [M, C] in ``x.dtype``."""
    M, n, C = x.shape
    _check(x, n)
    x, pre = x.contiguous(), pre.contiguous()
    u = torch.empty((M, C), dtype=x.dtype, device=x.device)
    if M and C:
        np2 = triton.next_power_of_2(n)
        bc = _block_c(C, np2, _TILE_2D)
        dt = _tl_dtype(_compute_dtype(x, pre))
        _collapse_fwd_kernel[(M, triton.cdiv(C, bc))](
            x, pre, u, C, N=n, NP=np2, BC=bc, DT=dt, num_warps=4
        )
    return u


def collapse_backward(
    pre: torch.Tensor, x: torch.Tensor, du: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """VJP of :func:`collapse_forward`: du [M, C] -> (dpre [M, n] in pre's dtype, dx like x)."""
    M, n, C = x.shape
    _check(x, n)
    x, pre, du = x.contiguous(), pre.contiguous(), du.contiguous()
    dx = torch.empty_like(x)
    cdt = _compute_dtype(x, pre)
    dpre = torch.empty((M, n), dtype=cdt, device=x.device)
    if M:
        if C == 0:
            return dpre.zero_().to(pre.dtype), dx
        np2 = triton.next_power_of_2(n)
        bc = _block_c(C, np2, _TILE_2D)
        _collapse_bwd_kernel[(M,)](
            x, pre, du, dx, dpre, C, N=n, NP=np2, BC=bc, DT=_tl_dtype(cdt), num_warps=4
        )
    return dpre.to(pre.dtype), dx


def mix_forward(
    x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, res: torch.Tensor
) -> torch.Tensor:
    """``X' = res @ X + post (x) f``: x [M, n, C], f [M, C], post [M, n],
    res [M, n, n] -> [M, n, C]."""
    M, n, C = x.shape
    _check(x, n)
    x, f, post, res = x.contiguous(), f.contiguous(), post.contiguous(), res.contiguous()
    out = torch.empty_like(x)
    if M and C:
        np2 = triton.next_power_of_2(n)
        bc = _block_c(C, np2 * np2, _TILE_3D)
        dt = _tl_dtype(_compute_dtype(x, f, post, res))
        _mix_fwd_kernel[(M, triton.cdiv(C, bc))](
            x, f, post, res, out, C, N=n, NP=np2, BC=bc, DT=dt, num_warps=4
        )
    return out


def mix_backward(
    x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, res: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """VJP of :func:`mix_forward` for ``g = dX'`` [M, n, C]: (dx, df, dpost, dres), each in the
    dtype of its input."""
    M, n, C = x.shape
    _check(x, n)
    x, f, post, res, g = (t.contiguous() for t in (x, f, post, res, g))
    cdt = _compute_dtype(x, f, post, res)
    dx = torch.empty_like(x)
    df = torch.empty_like(f)
    dpost = torch.empty((M, n), dtype=cdt, device=x.device)
    dres = torch.empty((M, n, n), dtype=cdt, device=x.device)
    if M:
        if C == 0:
            dpost.zero_()
            dres.zero_()
        else:
            np2 = triton.next_power_of_2(n)
            bc = _block_c(C, np2 * np2, _TILE_3D)
            _mix_bwd_kernel[(M,)](
                x,
                f,
                post,
                res,
                g,
                dx,
                df,
                dpost,
                dres,
                C,
                N=n,
                NP=np2,
                BC=bc,
                DT=_tl_dtype(cdt),
                num_warps=4,
            )
    return dx, df, dpost.to(post.dtype), dres.to(res.dtype)


def _proj_tiles(cdt: torch.dtype, K: int) -> tuple[int, int, bool]:
    """(KP, row/col tile, use tl.dot). ``tl.dot`` needs every dim >= 16; fp64 reduces by
    broadcasting on small tiles instead (a gradcheck path, not a fast one)."""
    if cdt == torch.float64:
        return triton.next_power_of_2(K), 16, False
    return max(16, triton.next_power_of_2(K)), 64, True


# Programs of the projection's forward (token blocks x column splits) and backward (column
# blocks x token splits): enough to fill a large GPU (132 SMs on an H100/H200).
_PROJ_FWD_PROGRAMS = 512
_PROJ_BWD_PROGRAMS = 1024


def rms_project_forward(
    x: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, NC] (any float dtype), w [K, NC] -> (raw [M, K], inv [M]) in ``w.dtype``.

    ``raw = (x @ w^T) * inv``, ``inv = (sum(x^2) / NC + eps)^-1/2`` (as the torch path).
    """
    M, NC = x.shape
    K = w.shape[0]
    _check(x, 1)
    x, w = x.contiguous(), w.contiguous()
    cdt = _compute_dtype(x, w)
    if M == 0:
        return torch.empty((0, K), dtype=w.dtype, device=x.device), torch.empty(
            (0,), dtype=w.dtype, device=x.device
        )
    kp, tile, dot = _proj_tiles(cdt, K)
    bm = bk = tile
    n_row = triton.cdiv(M, bm)
    # NOTE: split the columns while there are few token blocks (M = 8192 gives 128 blocks of
    # 64, under one per SM of an H100), each split keeping >= 4 column tiles.
    splits = max(1, min(triton.cdiv(_PROJ_FWD_PROGRAMS, n_row), triton.cdiv(NC, 4 * bk)))
    cols = triton.cdiv(triton.cdiv(NC, splits), bk) * bk  # columns per split, a multiple of BK
    splits = triton.cdiv(NC, cols)
    acc = torch.empty((splits, M, K), dtype=cdt, device=x.device)
    ss = torch.empty((splits, M), dtype=cdt, device=x.device)
    _proj_fwd_kernel[(n_row, splits)](
        x,
        w,
        acc,
        ss,
        M,
        NC,
        cols,
        K=K,
        KP=kp,
        BM=bm,
        BK=bk,
        DT=_tl_dtype(cdt),
        DOT=dot,
        num_warps=4,
    )
    inv = torch.rsqrt(ss.sum(0) / NC + eps)  # [M]
    raw = acc.sum(0).mul_(inv[:, None])  # [M, K]
    return raw.to(w.dtype), inv.to(w.dtype)


def rms_project_backward(
    x: torch.Tensor, w: torch.Tensor, inv: torch.Tensor, raw: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """VJP of :func:`rms_project_forward` for ``g = d raw`` [M, K]: (dx like x, dw like w).

    ``raw = (x @ w^T) * inv`` with ``inv = (mean(x^2) + eps)^-1/2``:
    ``dx = (g * inv) @ w + coef * x`` with ``coef = -inv^2 / NC * sum_k g * raw``;
    ``dw = (g * inv)^T @ x``.
    """
    M, NC = x.shape
    K = w.shape[0]
    _check(x, 1)
    x, w = x.contiguous(), w.contiguous()
    cdt = _compute_dtype(x, w)
    g, raw, inv = g.to(cdt), raw.to(cdt), inv.to(cdt)
    gs = (g * inv[:, None]).contiguous()  # [M, K]
    coef = ((g * raw).sum(-1) * inv.square() / -NC).contiguous()  # [M]
    dx = torch.empty_like(x)
    if M == 0:
        return dx, torch.zeros_like(w)
    kp, tile, dot = _proj_tiles(cdt, K)
    bm = 32 if dot else 16
    bn = 2 * tile if dot else 16
    n_col = triton.cdiv(NC, bn)
    n_row_blocks = triton.cdiv(M, bm)
    splits = max(1, min(n_row_blocks, triton.cdiv(_PROJ_BWD_PROGRAMS, n_col)))
    rows = triton.cdiv(n_row_blocks, splits) * bm  # tokens per split, a multiple of BM
    splits = triton.cdiv(M, rows)
    gw_part = torch.empty((splits, K, NC), dtype=cdt, device=x.device)
    _proj_bwd_kernel[(n_col, splits)](
        x,
        w,
        gs,
        coef,
        dx,
        gw_part,
        M,
        NC,
        rows,
        K=K,
        KP=kp,
        BM=bm,
        BN=bn,
        DT=_tl_dtype(cdt),
        DOT=dot,
        num_warps=4,
    )
    return dx, gw_part.sum(0).to(w.dtype)


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


class CollapseTritonFunction(torch.autograd.Function):
    """``u = sum_i pre_i X_i`` (pre [M, n], x [M, n, C]); saves pre and x."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(pre, x)
        return collapse_forward(pre, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, du: torch.Tensor):  # type: ignore[override]
        pre, x = ctx.saved_tensors
        return collapse_backward(pre, x, du)


class MixTritonFunction(torch.autograd.Function):
    """``X' = res @ X + post (x) f`` (x [M, n, C], f [M, C], post [M, n], res [M, n, n])."""

    @staticmethod
    def forward(ctx, x, f, post, res):  # type: ignore[override]
        ctx.save_for_backward(x, f, post, res)
        return mix_forward(x, f, post, res)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, f, post, res = ctx.saved_tensors
        return mix_backward(x, f, post, res, g)


class RMSProjectTritonFunction(torch.autograd.Function):
    """``raw = RMSNorm_unweighted(x) @ w^T`` (x [M, NC], w [K, NC]); saves x, w, inv, raw."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        raw, inv = rms_project_forward(x, w, eps)
        ctx.save_for_backward(x, w, inv, raw)
        return raw

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w, inv, raw = ctx.saved_tensors
        dx, dw = rms_project_backward(x, w, inv, raw, g)
        return dx, dw, None
