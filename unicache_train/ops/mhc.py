"""The three stream passes of an mHC connection: norm+projection, pre-collapse, post + mix.

mHC (manifold-constrained hyper-connections, https://arxiv.org/abs/2512.24880; numerics of
transformers' ``DeepseekV4HyperConnection``) wraps every sub-layer ``F`` of a decoder in a
connection that reads the ``n``-stream residual ``X [..., n, C]`` three times per token::

    raw = RMSNorm_unweighted(flatten(X)) @ fn^T      rms_project   [..., n*C] -> [..., K]
    u   = sum_i pre_i X_i                            collapse      -> [..., C]   (F's input)
    X'  = res @ X + post (x) F(u)                    mix           -> [..., n, C]

``res`` multiplies from the LEFT (``X'_i = sum_j res[i, j] X_j``; HF's ``comb`` transposed), as
everywhere in :mod:`unicache_train.model.mhc`. This module is the functional API of the three
passes, their naive PyTorch references (``*_reference``: the spec, imported by the tests) and
the dispatch between two backends:

* ``"torch"``: the CPU path (and the fallback): batched GEMMs on ``[M, ...]`` views with
  hand-written or in-place backward passes that avoid ``[M, n, C]`` temporaries (see each
  function). Agrees with the references to fp32 rounding.
* ``"triton"``: fused kernels (``unicache_train.kernels.mhc``): each pass reads ``X`` once in its
  own dtype (bf16 stays bf16 in memory) and writes its output once; each backward is one pass
  too (formulas in that module). Per connection the forward reads ``X`` 3 times (plus ``f`` once)
  and writes ``X'`` once, where the torch path reads ``X`` 4 times, passes over ``X'`` twice
  (GEMM, then the in-place rank-1 update) and, for bf16 streams, also writes an fp32 copy of
  ``X`` (projection) and an fp32 ``[M, n, C]`` product (collapse). Not yet run on a GPU.
* ``"auto"``: Triton for CUDA tensors when Triton is importable and ``n <= 16``
  (``kernels.mhc.MAX_N``), else torch (logged once on logger ``unicache_train.ops`` when a CUDA
  tensor falls back).

Computation dtype: fp32 for fp16/bf16/fp32 streams, fp64 when any input is fp64 (gradcheck).
Outputs: ``rms_project`` in the weight's dtype (fp32 by contract), ``collapse`` and ``mix`` in
the streams' dtype; gradients in each input's dtype. With bf16 streams the Triton mix rounds once
(fp32 math); the torch mix rounds ``res`` and ``post`` to bf16 before its bf16 GEMM (both within
bf16 rounding of the fp32 result).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os

import torch
from torch.autograd.function import once_differentiable

logger = logging.getLogger("unicache_train.ops")

BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
# kernels.mhc.MAX_N, repeated here so that "auto" can decide without importing triton.
_TRITON_MAX_N = 16

_logged_fallback = False


def _compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


# --------------------------------------------------------------------------------------------
# references (the spec: the formulas as written, autograd for the gradients)
# --------------------------------------------------------------------------------------------


def rms_project_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``input_norm`` (unweighted RMSNorm) then ``F.linear``.

    Args:
        x: [..., N] (N = n*C, the flattened streams), any float dtype.
        weight: [K, N] in the compute dtype.
        eps: RMSNorm epsilon.

    Returns:
        [..., K] in the compute dtype.
    """
    xf = x.to(_compute_dtype(x, weight))
    xn = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return torch.nn.functional.linear(xn, weight.to(xf.dtype))


def collapse_reference(pre: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``u = sum_i pre_i X_i``: pre [..., n], x [..., n, C] -> [..., C] in ``x.dtype``."""
    cdt = _compute_dtype(pre, x)
    return (pre.to(cdt).unsqueeze(-1) * x.to(cdt)).sum(-2).to(x.dtype)


def mix_reference(
    x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, res: torch.Tensor
) -> torch.Tensor:
    """``X' = res @ X + post (x) f`` in the compute dtype, cast to ``x.dtype`` once.

    Args:
        x: [..., n, C]; f: [..., C]; post: [..., n]; res: [..., n, n] (``X'_i = sum_j res[i, j]
        X_j``).
    """
    cdt = _compute_dtype(x, f, post, res)
    out = res.to(cdt) @ x.to(cdt) + post.to(cdt).unsqueeze(-1) * f.to(cdt).unsqueeze(-2)
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------
# torch backend
# --------------------------------------------------------------------------------------------


class _RMSProjectTorch(torch.autograd.Function):
    """``raw = RMSNorm_unweighted(x) @ w.T`` with the per-token ``1/rms`` applied after the GEMM.

    ``1/rms`` is a per-token scalar, so it commutes with the projection (DeepSeek's fused kernels
    do the same): no normalised ``[M, n*C]`` copy is written, and the hand-written backward
    writes ``dL/dx`` once (a GEMM) and adds the norm term in place, where autograd through
    norm-then-linear allocates two ``[M, n*C]`` gradients and sums them. On CPU, fresh
    ``[M, n*C]`` buffers (page faults) are the dominant cost of the connection. Agrees with HF's
    norm-then-project to fp32 rounding.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        """x: [M, N] (N = n*C, any float dtype); w: [K, N] -> raw [M, K] in ``w.dtype``."""
        xf = x.to(w.dtype)  # no copy for fp32 streams
        N = xf.shape[-1]
        inv = torch.rsqrt(torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square() / N + eps)
        raw = (xf @ w.t()).mul_(inv)  # [M, N] @ [N, K] -> [M, K]
        ctx.save_for_backward(x, w, inv, raw)
        return raw

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w, inv, raw = ctx.saved_tensors
        xf = x.to(w.dtype)
        N = xf.shape[-1]
        gs = g * inv  # [M, K]: dL/d(x @ w.T)
        gw = gs.t() @ xf  # [K, M] @ [M, N] -> [K, N]
        # d(1/rms)/dx = -(1/rms)^3 x / N, contracted with g * (x @ w.T) = g * raw * rms.
        coef = (g * raw).sum(-1, keepdim=True).mul_(inv.square()).div_(-N)  # [M, 1]
        gx = (gs @ w).addcmul_(xf, coef)  # [M, K] @ [K, N] -> [M, N], + coef * x in place
        return gx.to(x.dtype), gw, None


def _collapse_torch(pre: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """pre [M, n], x [M, n, C] -> [M, C] in ``x.dtype``."""
    M, n, C = x.shape
    if x.dtype == pre.dtype:
        # One batched GEMM reads X once; HF's (pre * X).sum(2) writes an [M, n, C] temporary
        # forward and backward. NOTE: bmm on explicit [M, ...] views, not a 4-D matmul, whose
        # broadcasting path expands and reduces in backward.
        return torch.bmm(pre.reshape(M, 1, n), x).view(M, C)  # [M,1,n] @ [M,n,C]
    # Low-precision streams: HF's expression (fp32 products and sum, one cast) for parity.
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)  # [M,n,1] * [M,n,C] -> [M,C]


def _mix_torch(
    x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, res: torch.Tensor
) -> torch.Tensor:
    """x [M, n, C], f [M, C], post [M, n], res [M, n, n] -> [M, n, C] in ``x.dtype``.

    One output buffer: the GEMM writes ``res @ X`` and the rank-1 ``post (x) f`` is accumulated
    into it in place (``baddbmm_``), whose backward gives ``d post`` and ``d f`` as batched GEMMs,
    without ``[M, n, C]`` temporaries.
    """
    M, n, C = x.shape
    dtype = x.dtype
    out = torch.bmm(res.to(dtype), x)  # [M,n,n] @ [M,n,C]
    # [M,n,1] @ [M,1,C] -> [M,n,C] added in place
    return out.baddbmm_(post.to(dtype).reshape(M, n, 1), f.to(dtype).reshape(M, 1, C))


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------


def _triton_kernels():
    """Imports the Triton kernel module (lazily: importing triton costs seconds)."""
    from unicache_train.kernels import mhc as tk

    return tk


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _resolve_backend(op: str, x: torch.Tensor, n: int, backend: str) -> str:
    global _logged_fallback
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if x.is_cuda and n <= _TRITON_MAX_N and _triton_importable():
            return "triton"
        if x.is_cuda and not _logged_fallback:
            _logged_fallback = True
            why = (
                f"n={n} streams > {_TRITON_MAX_N}"
                if n > _TRITON_MAX_N
                else "Triton is not importable"
            )
            logger.warning(f"{op}: {why}; CUDA tensors use the torch mHC path (correct, slower)")
        return "torch"
    if backend == "triton":
        if not _triton_importable():
            raise RuntimeError(f"{op}: backend='triton' but the triton package is not installed")
        if n > _TRITON_MAX_N:
            raise ValueError(
                f"{op}: backend='triton' supports n <= {_TRITON_MAX_N} streams, got n={n}; "
                "use backend='torch' or 'auto'"
            )
        if not x.is_cuda:
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError(
                    f"{op}: backend='triton' needs a CUDA tensor, got device {x.device}; on CPU "
                    "set TRITON_INTERPRET=1 before the kernels are imported (interpreter, for "
                    "tests), or use backend='torch'"
                )
            if not _triton_kernels().INTERPRETED:
                raise RuntimeError(
                    f"{op}: TRITON_INTERPRET=1 is set but unicache_train.kernels.mhc was imported "
                    "before it was; set it before the first import"
                )
    return backend


def _check_float(op: str, **ts: torch.Tensor) -> None:
    for name, t in ts.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{op}: {name} must be a floating torch.Tensor, got {what}")


def _check_shape(op: str, name: str, t: torch.Tensor, want: tuple[int, ...], legend: str) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{op}: {name} must be {legend} = {list(want)}, got {list(t.shape)}")


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def rms_project(
    x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto"
) -> torch.Tensor:
    """``RMSNorm_unweighted(x) @ weight.T`` (HF's ``input_norm`` then ``F.linear``).

    Args:
        x: [..., N] flattened streams (N = n*C), any float dtype.
        weight: [K, N] in the compute dtype (fp32, or fp64 for fp64 streams).
        eps: RMSNorm epsilon (``config.rms_norm_eps``).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (module docstring).

    Returns:
        [..., K] raw logits in ``weight.dtype``.
    """
    op = "mhc.rms_project"
    _check_float(op, x=x, weight=weight)
    N = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != N:
        raise ValueError(f"{op}: weight must be [K, N={N}], got {list(weight.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), N)  # [M, N]
    # NOTE: the Triton kernels size their tiles by n; the projection has no n, so 1 here.
    if _resolve_backend(op, x, 1, backend) == "triton":
        raw = _triton_kernels().RMSProjectTritonFunction.apply(x2, weight, float(eps))
    else:
        raw = _RMSProjectTorch.apply(x2, weight, float(eps))
    return raw.view(*lead, weight.shape[0])


def collapse(pre: torch.Tensor, x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Pre-collapse ``u = sum_i pre_i X_i`` (the branch input).

    Args:
        pre: [..., n] (compute dtype).
        x: [..., n, C] streams.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (module docstring).

    Returns:
        [..., C] in ``x.dtype``.
    """
    op = "mhc.collapse"
    _check_float(op, pre=pre, x=x)
    if x.dim() < 2:
        raise ValueError(f"{op}: x must be [..., n, C], got {list(x.shape)}")
    *lead, n, C = x.shape
    _check_shape(op, "pre", pre, (*lead, n), "[..., n]")
    M = math.prod(lead)
    x3, pre2 = x.reshape(M, n, C), pre.reshape(M, n)  # [M, n, C], [M, n]
    if _resolve_backend(op, x, n, backend) == "triton":
        u = _triton_kernels().CollapseTritonFunction.apply(pre2, x3)
    else:
        u = _collapse_torch(pre2, x3)
    return u.view(*lead, C)


def mix(
    x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, res: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """Post + residual mix ``X' = res @ X + post (x) f`` (HF: ``post * f + comb^T X``).

    Args:
        x: [..., n, C] streams; f: [..., C] branch output; post: [..., n]; res: [..., n, n]
            (``X'_i = sum_j res[i, j] X_j``).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (module docstring).

    Returns:
        [..., n, C] in ``x.dtype``.
    """
    op = "mhc.mix"
    _check_float(op, x=x, f=f, post=post, res=res)
    if x.dim() < 2:
        raise ValueError(f"{op}: x must be [..., n, C], got {list(x.shape)}")
    *lead, n, C = x.shape
    _check_shape(op, "f", f, (*lead, C), "[..., C]")
    _check_shape(op, "post", post, (*lead, n), "[..., n]")
    _check_shape(op, "res", res, (*lead, n, n), "[..., n, n]")
    M = math.prod(lead)
    x3, f2 = x.reshape(M, n, C), f.reshape(M, C)
    post2, res3 = post.reshape(M, n), res.reshape(M, n, n)
    if _resolve_backend(op, x, n, backend) == "triton":
        out = _triton_kernels().MixTritonFunction.apply(x3, f2, post2, res3)
    else:
        out = _mix_torch(x3, f2, post2, res3)
    return out.view(x.shape)
