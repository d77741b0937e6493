"""Sinkhorn-Knopp projection onto (approximately) doubly-stochastic matrices, for mHC.

mHC (manifold-constrained hyper-connections, DeepSeek, https://arxiv.org/abs/2512.24880) mixes
``n`` residual streams with a matrix projected onto the Birkhoff polytope by a fixed number of
Sinkhorn-Knopp iterations. This module is the functional API, the pure-PyTorch reference (the spec,
imported by the tests and the benchmark) and the CPU path.

Shape legend: ``M, n = number of matrices (all leading dims flattened), streams``.

Variants (``S = iters``, every denominator carries ``+ eps``)::

    deepseek_v4:  A = softmax(x, dim=-1) + eps     # as transformers' DeepseekV4HyperConnection
                  A = col_norm(A)
                  repeat S-1 times: A = col_norm(row_norm(A))     -> 2S-1 normalizations
    paper:        A = exp(x - max(x))              # max over the matrix (scale invariance)
                  repeat S times:   A = row_norm(col_norm(A))     -> 2S normalizations

    col_norm(A) = A / (A.sum(-2, keepdim=True) + eps)
    row_norm(A) = A / (A.sum(-1, keepdim=True) + eps)

``paper`` follows the paper's Eq. ``M(t) = T_r(T_c(M(t-1)))`` from ``M(0) = exp(H_res)`` (§4.2):
column normalization first, row normalization last, so the result is row-stochastic up to
``eps`` and column-stochastic up to the convergence residual. ``deepseek_v4`` ends on a column
normalization; transformers consumes ``comb`` transposed (``combᵀ X``), so both presets end on
the rows of the matrix that multiplies the streams.

Backends:

* ``"torch"``: :class:`_SinkhornFunction`, an ``autograd.Function`` that saves only the input
  and recomputes the iterations in backward, with a hand-written VJP (no autograd inside). It
  works in place on a ``[n, n, M]`` layout (matrix index innermost), so every op is a long
  unit-stride vector op. Exact: equal to autograd through :func:`sinkhorn_reference` up to fp32
  rounding (closer to the fp64 gradient than that reference, in the tests). Measured on the
  benchmark case (64k matrices, n=4, 20 iters, one thread): ~8x faster than eager autograd
  through the loop and ~4x faster than ``torch.compile`` of the naive formula, without its
  warm-up (up to ~70 s here on a cold cache) or recompiles on new batch sizes, so there is no
  compiled backend; see ``scripts/bench_sinkhorn.py`` for the caveat on oversubscribed
  machines.
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
  Autograd through the reference is not: rows of exact zeros (exp underflow in ``paper`` at
  +-1e4, an all ``-inf`` column) make it compute 0 * inf = NaN; the VJP here gives the limit
  (their contribution is 0) and matches the reference wherever the reference is finite.
* The last normalized axis sums to ``s / (s + eps)`` of its pre-normalization sum ``s``, i.e.
  to 1 within ``eps / s``. ``deepseek_v4`` columns: measured <= 1.3e-6 from 1 for every input
  class tested, +-1e4 and ``-inf`` included (the softmax ``+ eps`` keeps entries positive).
  ``paper`` rows: <= 3e-6 with ``-inf`` entries, but ``exp(x - max)`` is 0 for logits ~88 or
  more below the matrix max, a row (or column) of zeros stays zero, and a row whose mass stays
  near ``eps`` sums to less than 1: logits with a spread of hundreds (e.g. +-1e4) are far from
  doubly stochastic in this variant (as in the reference formula); the output is still finite,
  in [0, 1].
* The other axis carries the convergence residual of a fixed ``iters``, the same in the
  reference (worst |sum - 1| over 20k random matrices, both variants, 20 iters): logits of std
  0.1: 1.3e-6; std 1: 1.5e-3 for n = 4..16 (1.1e-2 at n = 2); std 2..8: 2e-2 to 3e-1
  (near-permutation matrices converge slowly; some zero patterns admit no doubly-stochastic
  scaling at all). mHC's small logit scales (alpha = 0.01 at init) sit in the converged regime;
  more ``iters`` shrink the residual.
* ``-inf`` logits mean a zero entry. ``deepseek_v4``: a row that is entirely ``-inf`` has no
  softmax and gives NaN, as in transformers. ``paper``: an all ``-inf`` matrix gives zeros
  (``eps > 0``). NaN and ``+inf`` inputs propagate NaN (``check_finite=True`` raises instead).
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


def _validate(
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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _num_steps(iters: int, variant: str) -> int:
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
        eps: added to every denominator (and, for ``deepseek_v4``, to the softmax).
        variant: ``"deepseek_v4"`` or ``"paper"``.

    Returns:
        [..., n, n] in fp32 (fp64 for fp64 input).
    """
    _validate(logits, iters, eps, variant)
    x = logits.to(_compute_dtype(logits.dtype))
    if variant == "deepseek_v4":
        a = torch.softmax(x, dim=-1) + eps
        a = a / (a.sum(dim=-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            a = a / (a.sum(dim=-1, keepdim=True) + eps)
            a = a / (a.sum(dim=-2, keepdim=True) + eps)
        return a
    # Sinkhorn is invariant to a global scale of exp(x) (up to eps), so the per-matrix max is
    # subtracted: logits of 1e4 do not overflow. An all -inf matrix has no finite max: use 0.
    m = x.amax(dim=(-2, -1), keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    a = torch.exp(x - m)
    for _ in range(iters):
        a = a / (a.sum(dim=-2, keepdim=True) + eps)  # T_c
        a = a / (a.sum(dim=-1, keepdim=True) + eps)  # T_r
    return a


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


def _init_t(
    xt: torch.Tensor, eps: float, variant: str, keep: bool
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A0 (fresh, iterated in place) and, with ``keep``, what the input VJP needs."""
    if variant == "deepseek_v4":
        p = _softmax_t(xt)
        if keep:
            return p + eps, (p,)
        return p.add_(eps), ()
    m = torch.amax(xt, dim=(0, 1), keepdim=True)  # [1, 1, M]
    finite = torch.isfinite(m)
    e = torch.exp(xt - torch.where(finite, m, torch.zeros_like(m)))
    return e, ((m, finite) if keep else ())


def _forward_t(
    xt: torch.Tensor, n_steps: int, eps: float, variant: str, keep: bool
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """Runs the iterations in place; with ``keep`` also returns the per-step [n, M] denominators.

    The denominators are 2*iters/n times the input, alive only during backward. They are
    allocated one per step on purpose: each stays under glibc's mmap threshold and is recycled
    across calls, where a single [steps, n, M] buffer is mmapped and page-faulted anew on every
    call (measured 8x slower per step on the benchmark case).
    """
    a, aux = _init_t(xt, eps, variant, keep)
    n, m = a.shape[0], a.shape[2]
    dens: list[torch.Tensor] = []
    buf = torch.empty((n, m), dtype=a.dtype, device=a.device)
    for k in range(n_steps):
        if keep:
            buf = torch.empty((n, m), dtype=a.dtype, device=a.device)
            dens.append(buf)
        d = _sum_t(a, k % 2, buf).add_(eps)  # even k: column sums (over rows), odd k: row sums
        a.div_(d)
    return a, aux, dens


def _backward_t(
    xt: torch.Tensor, gt: torch.Tensor, n_steps: int, eps: float, variant: str
) -> torch.Tensor:
    """VJP of the whole projection in T layout; ``gt`` is overwritten with the result.

    One normalization ``B = A / d`` with ``d = sum_axis(A) + eps`` has the VJP
    ``gA = (gB - s) / d`` with ``s = sum_axis(gB * B)``. We carry ``u = g * iterate`` instead of
    ``g``: then ``uA = gA * A = (gB - s) * B = uB - s * B`` and ``s = sum_axis(uB)``, i.e. one
    reduction and one fused multiply-subtract per step, no division. Walking back, the step's
    input is recovered as ``A = B * d`` (one rounding per step; the gradient stays as close to
    the fp64 truth as autograd through the reference is, see the tests), so backward holds one
    [n, n, M] iterate and the [n, M] denominators instead of every iterate.

    Carrying ``u`` also keeps exact zeros harmless: where an iterate is 0 (exp underflow in
    ``paper``, ``-inf`` logits) ``u`` stays exactly 0, while ``g`` of a row of zeros grows by
    1/eps per step and autograd through the reference turns 0 * inf into NaN. Wherever that
    reference is finite the two agree.
    """
    a, aux, dens = _forward_t(xt, n_steps, eps, variant, keep=True)
    n, m = a.shape[0], a.shape[2]
    buf = torch.empty((n, m), dtype=a.dtype, device=a.device)
    u = gt.mul_(a)
    for k in range(n_steps - 1, -1, -1):
        axis = k % 2
        u.addcmul_(_sum_t(u, axis, buf), a, value=-1.0)
        if k > 0:
            a.mul_(dens[k].unsqueeze(axis))  # NOTE: after step k's VJP, which needs B_k = a.
    # Now u = g0 * A0 with A0 the initial matrix.
    if variant == "deepseek_v4":
        # A0 = p + eps and the softmax VJP gx = p * (g0 - sum_j g0 p): with t = p * g0 =
        # u * p / A0, gx = t - p * sum_j t.
        (p,) = aux
        q = p / (p + eps)
        if eps == 0:
            q.masked_fill_(p == 0, 0.0)  # p / p with p = 0: a zero entry, no gradient
        t = q.mul_(u)
        return t.addcmul_(_sum_t(t, 1, buf), p, value=-1.0)
    # A0 = e = exp(x - max): gx = g0 * e = u, exactly.
    mx, finite = aux
    # Gradient through the subtracted max, as autograd through amax gives it: -sum(gx) shared
    # evenly by the entries equal to the max (only where the max was finite). Tiny (O(eps)) but
    # it keeps the VJP exact for any eps.
    tie = (xt == mx) & finite
    count = tie.sum(dim=(0, 1), keepdim=True).clamp_min_(1)
    total = u.sum(dim=(0, 1), keepdim=True)
    return u.sub_(tie * (total / count))


class _SinkhornFunction(torch.autograd.Function):
    """Sinkhorn with an exact recompute backward; saves only the input logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float, variant: str) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(logits)
        ctx.cfg = (iters, eps, variant)
        dtype = _compute_dtype(logits.dtype)
        if logits.numel() == 0:
            return torch.empty(logits.shape, dtype=dtype, device=logits.device)
        xt = _to_t(logits, dtype)
        a, _, _ = _forward_t(xt, _num_steps(iters, variant), eps, variant, keep=False)
        return _from_t(a, logits.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (logits,) = ctx.saved_tensors
        iters, eps, variant = ctx.cfg
        if logits.numel() == 0:
            return torch.zeros_like(logits), None, None, None
        dtype = _compute_dtype(logits.dtype)
        xt = _to_t(logits, dtype)
        gt = _to_t(grad_out, dtype)
        gx = _backward_t(xt, gt, _num_steps(iters, variant), eps, variant)
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
        eps: >= 0, added to every denominator (``deepseek_v4``: also to the softmax;
            transformers' ``hc_eps``).
        variant: ``"deepseek_v4"`` (transformers' ``DeepseekV4HyperConnection``, to fp32
            rounding) or ``"paper"`` (``M(t) = T_r(T_c(M(t-1)))`` from ``exp(logits - max)``);
            formulas in the module docstring.
        backend: ``"auto"`` (Triton on CUDA if importable, else torch), ``"torch"`` or
            ``"triton"`` (raises ``RuntimeError`` if it cannot run).
        check_finite: raise ``ValueError`` if ``logits`` holds NaN or ``+inf`` (synchronizes on
            CUDA). Without it NaN propagates to the output. ``-inf`` is always allowed.

    Returns:
        [..., n, n] fp32 (fp64 for fp64 input): the last normalized axis sums to 1 within
        ``~eps``, the other within the convergence residual (module docstring).

    Raises:
        ValueError: bad ``iters``/``eps``/``variant``/``backend``/shape, or non-finite logits with
            ``check_finite``.
        RuntimeError: ``backend="triton"`` that cannot run here.
    """
    _validate(logits, iters, eps, variant, backend)
    if check_finite:
        _check_finite(logits)
    eps = float(eps)
    resolved = _resolve_backend(logits, backend)
    if resolved == "triton":
        return _triton_kernels().SinkhornTritonFunction.apply(logits, iters, eps, variant)
    return _SinkhornFunction.apply(logits, iters, eps, variant)
