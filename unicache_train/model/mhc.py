"""Hyper-connections: mHC (``deepseek_v4`` and ``paper`` presets) and unconstrained HC.

Shape legend: B, T, n, C, K = batch, tokens, residual streams (``hc_mult``), hidden size,
coefficient logits per token (``K = (2 + n) * n``: n pre, n post, n*n residual mix).

Papers:
    mHC: Xie et al., "mHC: Manifold-Constrained Hyper-Connections", https://arxiv.org/abs/2512.24880
    HC: Zhu et al., "Hyper-Connections", https://arxiv.org/abs/2409.19606
    Reference numerics: ``transformers.models.deepseek_v4`` (``DeepseekV4HyperConnection``, the
    mixing in ``DeepseekV4DecoderLayer``, ``DeepseekV4HyperHead``).

The residual is ``X: [B, T, n, C]``. One :class:`HyperConnection` wraps one sub-layer ``F``
(attention or MLP, with its pre-norm) and computes per token, from ``X`` itself::

    raw  = RMSNorm_unweighted(flatten(X)) @ fn.T          [B, T, K] -> pre [n], post [n], res [n, n]
    X'   = res @ X + post^T F(pre @ X)

Mixing-matrix convention (the one place where rows vs columns matter):

* ``res`` (the paper's ``H_res``) multiplies from the LEFT: ``X'_i = sum_j res[i, j] X_j``; row
  ``i`` holds the weights of output stream ``i``. Every preset stores ``res`` this way, and so does
  :attr:`HCCoeffs.res` (what monitors read: the composite forward gain of a stack is the max
  absolute row sum of ``res_L @ ... @ res_1``).
* HF's ``comb`` is consumed transposed in ``DeepseekV4DecoderLayer``
  (``matmul(comb.transpose(-1, -2), X)``), i.e. ``comb = res^T``: ``comb[j, k]`` is the weight of
  input stream ``j`` in output stream ``k``. The ``deepseek_v4`` preset computes ``comb`` exactly as
  HF (softmax over its last axis, last normalisation over its columns, so each output stream is a
  convex combination of the inputs) and hands on its transpose as ``res``.
* ``paper``: the ``n*n`` residual logits are read row-major as ``H_res[i, j]`` (output ``i``,
  input ``j``), as in the paper's ``mat(x @ phi_res)``.

Parameters (names and shapes as HF deepseek_v4) are kept in fp32 even when the model is cast to
bf16: coefficients and Sinkhorn run in fp32 (autocast off); the streams themselves may be bf16.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from unicache_train.model.config import ModelConfig
from unicache_train.ops import mhc as mhc_ops
from unicache_train.ops.sinkhorn import sinkhorn

__all__ = ["HCCoeffs", "HyperConnection", "HyperHead", "hc_preset_of"]

Branch = Callable[[torch.Tensor], torch.Tensor]

# mHC paper: gating factors alpha initialised to 0.01 (arXiv 2512.24880, training setup).
PAPER_ALPHA_INIT = 0.01
# HC: the tanh dynamic part starts as a small perturbation of the static (residual-like) init.
HC_SCALE_INIT = 0.01

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def hc_preset_of(config: ModelConfig) -> str:
    """The connection flavour of a config: ``deepseek_v4`` | ``paper`` (mHC) or ``hc``."""
    return "hc" if config.residual_mode == "hc" else config.hc_preset


@dataclass
class HCCoeffs:
    """Per-token connection coefficients (fp32).

    Attributes:
        pre: [B, T, n] collapse weights (branch input ``u = sum_i pre_i X_i``).
        post: [B, T, n] expand weights (stream ``i`` receives ``post_i F(u)``).
        res: [B, T, n, n] residual mix in the LEFT-multiplication convention
            (``X'_i = sum_j res[i, j] X_j``; the paper's ``H_res``; HF's ``comb`` transposed).
    """

    pre: torch.Tensor
    post: torch.Tensor
    res: torch.Tensor

    @property
    def comb(self) -> torch.Tensor:
        """[B, T, n, n] HF's ``comb`` (= ``res^T``: ``X'_k = sum_j comb[j, k] X_j``)."""
        return self.res.transpose(-1, -2)

    def detach(self) -> HCCoeffs:
        return HCCoeffs(self.pre.detach(), self.post.detach(), self.res.detach())


class Fp32Params(nn.Module):
    """Keeps this module's parameters (and their grads) fp32 under ``.to(bf16)``/``.half()``.

    HF marks these modules ``_keep_in_fp32_modules_strict``; our equivalent is to intercept
    ``_apply`` (used by ``to``, ``half``, ``bfloat16``, Lightning's ``bf16-true`` precision):
    device moves go through, downcasts to 16-bit floats do not.
    """

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if (
                out.is_floating_point()
                and out.dtype in _LOW_PRECISION
                and (t.dtype not in _LOW_PRECISION)
            ):
                # NOTE: redo the move from the fp32 source, not from ``out``: casting the bf16
                # result back up would keep the bf16 rounding.
                out = t.to(device=out.device)
            return out

        return super()._apply(keep_fp32, recurse)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 streams; fp64 streams stay fp64 (gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rms_project(
    x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto"
) -> torch.Tensor:
    """``RMSNorm_unweighted(flatten(x)) @ weight.T`` (HF's ``input_norm`` then ``F.linear``).

    Args:
        x: [B, T, n, C] streams (any float dtype).
        weight: [K, n*C] projection in the compute dtype (fp32, or fp64 for fp64 streams).
        eps: RMSNorm epsilon (``config.rms_norm_eps``, as HF's ``input_norm``).
        backend: :func:`unicache_train.ops.mhc.rms_project`'s (``auto``: fused Triton on CUDA).

    Returns:
        [B, T, K] raw logits in ``weight.dtype``.
    """
    B, T = x.shape[:2]
    return mhc_ops.rms_project(x.reshape(B, T, -1), weight, eps, backend)  # [B, T, n*C] -> K


def _collapse(pre: torch.Tensor, x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``u = sum_i pre_i X_i``: pre [B, T, n] (compute dtype), x [B, T, n, C] -> [B, T, C].

    :func:`unicache_train.ops.mhc.collapse`: one batched GEMM (torch) or one fused kernel that
    reads X once (Triton, ``auto`` on CUDA).
    """
    return mhc_ops.collapse(pre, x, backend)


def _mix(
    x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, res: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """``X' = res @ X + post (x) f`` (HF: ``post * f + comb^T X``), in ``x.dtype``.

    Args:
        x: [B, T, n, C] streams; f: [B, T, C] branch output; post: [B, T, n]; res: [B, T, n, n].
        backend: :func:`unicache_train.ops.mhc.mix`'s (``auto``: fused Triton on CUDA).

    Returns:
        [B, T, n, C]. torch: one output buffer (``bmm`` then ``baddbmm_`` in place, no
        ``[B, T, n, C]`` temporaries); Triton: one kernel reading X and f once, writing X' once.
    """
    return mhc_ops.mix(x, f, post, res, backend)


def _logit(p: float) -> float:
    """Inverse sigmoid in float64; clamped so that n = 1 (p = 1) stays finite."""
    p = min(max(p, 1e-12), 1.0 - 1e-7)
    return math.log(p / (1.0 - p))


class HyperConnection(Fp32Params):
    """One (m)HC connection around one sub-layer (``attn_hc`` / ``ffn_hc``).

    Presets (``hc_preset_of(config)``):

    * ``deepseek_v4`` (mHC, numerically HF's ``DeepseekV4HyperConnection`` + layer mixing):
      ``pre = sigmoid(raw_pre*s0 + b_pre) + eps``, ``post = 2 sigmoid(raw_post*s1 + b_post)``,
      ``comb = sinkhorn_v4(raw_res*s2 + b_res)`` (softmax + eps, column norm, (iters-1) x (row,
      column) norms), ``X' = post (x) F(u) + comb^T X``.
    * ``paper`` (mHC, arXiv 2512.24880 §4): ``H_pre = sigmoid(a_pre raw_pre + b_pre)``,
      ``H_post = 2 sigmoid(a_post raw_post + b_post)``,
      ``H_res = SinkhornKnopp(exp(a_res raw_res + b_res))``, ``X' = H_res X + H_post^T F(H_pre X)``.
      ``scale`` holds ``(a_pre, a_post, a_res)``.
    * ``hc`` (Hyper-Connections, arXiv 2409.19606, unconstrained): static + tanh dynamic part,
      ``pre = b_pre + s0 tanh(raw_pre)``, ``post = b_post + s1 tanh(raw_post)``,
      ``res = b_res + s2 tanh(raw_res)`` (``res`` is Zhu et al.'s ``A_r^T``). Zhu et al. project
      each per-stream-normalised stream with a shared ``[C]`` vector; we keep mHC's flattened
      ``fn`` (a superset) so that A/B runs differ only in the constraint, not in the parameter
      count. No Sinkhorn: the composite gain is free to grow.

    Init (``config.hc_init``):

    * ``default``: ``deepseek_v4`` follows HF's ``_init_weights`` (``fn ~ N(0, initializer_range)``,
      ``base = 0``, ``scale = 1``) so from-scratch runs match HF's; ``paper`` uses
      ``fn ~ N(0, initializer_range)``, ``a = 0.01`` (paper), ``b_pre = logit(1/n)`` (branch input
      = stream mean), ``b_post = 0`` (``H_post = 1``), ``b_res = 0`` (``H_res`` uniform, the centre
      of the Birkhoff polytope where Sinkhorn's Jacobian is best conditioned); ``hc`` uses Zhu et
      al.'s static init (``pre = 1/n``, ``post = 1``, ``res = I``) with dynamic scales 0.01.
    * ``identity`` (retrofitting a pretrained residual model): scales 0,
      ``fn ~ N(0, initializer_range)`` (symmetry breaker; inert while the scales are 0),
      ``sum(pre) = 1`` (``pre = 1/n``; for ``deepseek_v4`` the ``+eps`` is compensated in
      ``b_pre``), ``post = 1``, ``res`` uniform (mHC) or ``I`` (HC). With equal streams this
      reproduces the residual update, up to ``deepseek_v4``'s ``res`` rows summing to
      ``1 - eps``; :func:`~unicache_train.model.convert.convert_to_mhc` removes that too by
      re-initialising each connection for its depth (:meth:`init_identity`).

    Monitoring: set ``self.record = True`` and each forward stores detached
    :class:`HCCoeffs` in ``self.last_coeffs``; nothing is stored (or computed) otherwise.

    Kernels: ``self.backend`` (class default ``"auto"``: the fused Triton kernels of
    :mod:`unicache_train.ops.mhc` for CUDA streams, the torch path on CPU; ``"torch"`` or
    ``"triton"`` to force one) picks the implementation of the three stream passes (projection,
    collapse, mix). An execution choice, not a model field: it is not saved with the config.
    The first connection of a decoder only ever sees ``n`` copies of the embedding: under mHC
    its ``res`` acts only through its row sums (fixed at 1) and gets no gradient (as in HF).
    """

    backend: str = "auto"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n, C = config.hc_mult, config.hidden_size
        self.hc_mult = n
        self.hidden_size = C
        self.preset = hc_preset_of(config)
        self.init_mode = config.hc_init
        self.hc_sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.init_std = config.initializer_range
        K = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(K, n * C, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(K, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.record = False
        self.last_coeffs: HCCoeffs | None = None
        self.reset_parameters()

    # ------------------------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        n = self.hc_mult
        b_pre, b_post, b_res = self.base.split([n, n, n * n])
        b_res = b_res.view(n, n)
        if self.init_mode == "identity":
            # Symmetry breaker: with all scales 0 the output ignores fn; once the scales move,
            # fn's row differences are what make the streams' coefficients differ (the
            # gradients of equal streams are equal). std 1e-3 makes the streams diverge ~20x
            # slower than the from-scratch std (spread 1e-5 vs 3e-4 after 4 AdamW steps).
            nn.init.normal_(self.fn, std=self.init_std)
            self._set_identity_base(pre_total=1.0, post=1.0)
            return
        nn.init.normal_(self.fn, std=self.init_std)
        if self.preset == "deepseek_v4":
            self.base.zero_()
            self.scale.fill_(1.0)
        elif self.preset == "paper":
            b_pre.fill_(_logit(1.0 / n))
            b_post.zero_()
            b_res.zero_()
            self.scale.fill_(PAPER_ALPHA_INIT)
        else:  # hc
            b_pre.fill_(1.0 / n)
            b_post.fill_(1.0)
            b_res.copy_(torch.eye(n))
            self.scale.fill_(HC_SCALE_INIT)

    @torch.no_grad()
    def _set_identity_base(self, pre_total: float, post: float) -> None:
        """Scales 0 and ``base`` such that ``sum(pre) = pre_total``, every ``post_i = post``, and
        ``res`` constant (uniform for mHC, ``I`` for HC). ``fn`` is left as it is."""
        n = self.hc_mult
        b_pre, b_post, b_res = self.base.split([n, n, n * n])
        b_res = b_res.view(n, n)
        self.scale.zero_()
        if self.preset == "hc":
            b_pre.fill_(pre_total / n)
            b_post.fill_(post)
            b_res.copy_(torch.eye(n))
            return
        # NOTE: deepseek_v4 adds eps after the sigmoid: sigmoid(b) = pre_total/n - eps makes
        # pre = pre_total/n to fp32 rounding. The paper's H_pre has no eps.
        eps = self.hc_eps if self.preset == "deepseek_v4" else 0.0
        b_pre.fill_(_logit(pre_total / n - eps))
        b_post.fill_(_logit(post / 2.0))  # post = 2 sigmoid(b_post); b_post = 0 for post = 1
        b_res.zero_()  # softmax / exp of a constant -> uniform 1/n after Sinkhorn

    @torch.no_grad()
    def init_identity(self, carry: float = 1.0) -> float:
        """Identity init of this connection at its depth in a retrofitted stack (see
        :mod:`unicache_train.model.convert`); leaves ``fn`` (the symmetry breaker) as it is.

        With every stream entering as ``carry * h``, sets scales 0, ``res`` constant,
        ``sum(pre) = 1 / carry`` (the branch sees ``h``) and ``post = carry * r``, so that every
        stream leaves as ``carry * r * (h + F(h))``. ``r`` is the row sum of that ``res`` as
        this module computes it in fp32: 1 for ``paper`` (to rounding) and HC, but
        ``deepseek_v4``'s Sinkhorn divides by ``sum + eps`` to the end, so its rows sum to
        ``s / (s + eps) < 1`` for every input (``1 - 2^-20`` here for eps = 1e-6). No bias
        can lift that below-1 row sum, so the streams carry the deficit instead: chaining
        ``carry = hc.init_identity(carry)`` through the stack makes each branch see exactly the
        plain residual and the residual keep its plain weighting, to fp32 rounding, instead of a
        ``(1 - eps)`` discount per sub-layer (2.5e-4 relative at SmolLM2's last layer).

        Args:
            carry: > 0, the common factor of the incoming streams (1 at the embeddings).

        Returns:
            The outgoing streams' factor ``carry * r``; the next connection's ``carry`` (or
            :meth:`HyperHead.init_identity`'s).

        Raises:
            ValueError: ``carry`` is not finite and positive, or ``carry * r`` is outside the
                range ``post`` (``(0, 2)`` for mHC) or ``pre`` (``> eps * n`` total) can hold.
        """
        if not (math.isfinite(carry) and carry > 0):
            raise ValueError(f"init_identity: carry={carry!r} is out of range; allowed (0, inf)")
        self._set_identity_base(pre_total=1.0, post=1.0)
        n = self.hc_mult
        probe = torch.zeros(1, 1, n, self.hidden_size, device=self.base.device)
        r = float(self.coefficients(probe).res.double().sum(-1).mean())  # [1, 1, n] row sums
        out = carry * r
        low = n * self.hc_eps if self.preset == "deepseek_v4" else 0.0
        if self.preset != "hc" and not (out < 2.0 and 1.0 / carry > low):
            raise ValueError(
                f"init_identity: carry={carry!r} gives post={out!r} and sum(pre)={1 / carry!r}; "
                f"allowed post in (0, 2) and sum(pre) > {low!r} for preset {self.preset!r}"
            )
        self._set_identity_base(pre_total=1.0 / carry, post=out)
        return out

    # ---------------------------------------------------------------------------- coefficients
    def coefficients(self, x: torch.Tensor) -> HCCoeffs:
        """Per-token pre/post/res from the streams.

        Args:
            x: [B, T, n, C] streams.

        Returns:
            :class:`HCCoeffs` (fp32): pre [B, T, n], post [B, T, n], res [B, T, n, n].
        """
        n = self.hc_mult
        # NOTE: autocast off: the coefficients and Sinkhorn are fp32 by contract (HF keeps these
        # modules fp32), also under bf16-mixed.
        cdt = _compute_dtype(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            raw = _rms_project(x, self.fn.to(cdt), self.norm_eps, self.backend)  # [B, T, K]
            raw_pre, raw_post, raw_res = raw.split([n, n, n * n], dim=-1)
            b_pre, b_post, b_res = self.base.to(cdt).split([n, n, n * n])
            s_pre, s_post, s_res = self.scale.to(cdt).unbind(0)
            raw_res = raw_res.unflatten(-1, (n, n))  # [B, T, n*n] -> [B, T, n, n]
            b_res = b_res.view(n, n)
            if self.preset == "hc":
                pre = b_pre + s_pre * torch.tanh(raw_pre)
                post = b_post + s_post * torch.tanh(raw_post)
                res = b_res + s_res * torch.tanh(raw_res)
                return HCCoeffs(pre, post, res)
            logits = raw_res * s_res + b_res  # [B, T, n, n]
            post = 2 * torch.sigmoid(raw_post * s_post + b_post)
            if self.preset == "deepseek_v4":
                pre = torch.sigmoid(raw_pre * s_pre + b_pre) + self.hc_eps
                comb = sinkhorn(logits, self.hc_sinkhorn_iters, self.hc_eps, variant="deepseek_v4")
                return HCCoeffs(pre, post, comb.transpose(-1, -2))  # res = comb^T
            pre = torch.sigmoid(raw_pre * s_pre + b_pre)
            res = sinkhorn(logits, self.hc_sinkhorn_iters, self.hc_eps, variant="paper")
            return HCCoeffs(pre, post, res)

    # --------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, branch: Branch) -> torch.Tensor:
        """Collapse the streams, run the branch, expand and mix back.

        ::

            X [B,T,n,C] ──┬──► flatten ─► RMSNorm ─► @ fn^T ─► pre [n], post [n], res [n,n]
                          │                                    │         │         │
                          ├──► u = sum_i pre_i X_i  ◄──────────┘         │         │
                          │      [B,T,C]                                 │         │
                          │      └─► branch (norm + attn/MLP) ─► f [B,T,C]         │
                          │                                      │                 │
                          │                        post (x) f ◄──┘   [B,T,n,C]     │
                          └──► res @ X  ◄──────────────────────────────────────────┘
                                  [B,T,n,C] ──────────────► (+) ─► X' [B,T,n,C]

        Args:
            x: [B, T, n, C] streams (fp32 or bf16).
            branch: ``h [B, T, C] -> [B, T, C]``, the sub-layer with its pre-norm.

        Returns:
            [B, T, n, C] mixed streams, in ``x.dtype``.
        """
        c = self.coefficients(x)
        if self.record:
            self.last_coeffs = c.detach()
        with torch.autocast(device_type=x.device.type, enabled=False):
            u = _collapse(c.pre, x, self.backend)  # [B, T, C]
        f = branch(u)  # [B, T, C], under the caller's autocast
        with torch.autocast(device_type=x.device.type, enabled=False):
            return _mix(x, f, c.post, c.res, self.backend)  # [B, T, n, C]

    def extra_repr(self) -> str:
        return (
            f"preset={self.preset}, hc_mult={self.hc_mult}, hidden_size={self.hidden_size}, "
            f"sinkhorn_iters={self.hc_sinkhorn_iters}, init={self.init_mode}"
        )


class HyperHead(Fp32Params):
    """Final stream collapse before the last norm; numerically HF's ``DeepseekV4HyperHead``.

    ``pre = sigmoid(raw * hc_scale + hc_base) + hc_eps`` with ``raw = RMSNorm(flatten(X)) @
    hc_fn^T``; output ``sum_i pre_i X_i``. Used for every preset. Init: ``default`` as HF
    (``hc_fn ~ N(0, initializer_range)``, ``hc_base = 0``, ``hc_scale = 1``); ``identity``:
    ``hc_scale = 0`` and ``hc_base = logit(1/n - eps)`` so that ``pre = 1/n`` and equal streams
    collapse to themselves.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n, C = config.hc_mult, config.hidden_size
        self.hc_mult = n
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.init_mode = config.hc_init
        self.init_std = config.initializer_range
        self.hc_fn = nn.Parameter(torch.empty(n, n * C, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))
        self.record = False
        self.last_pre: torch.Tensor | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.init_mode == "identity":
            nn.init.normal_(self.hc_fn, std=self.init_std)
            self.hc_base.fill_(_logit(1.0 / self.hc_mult - self.hc_eps))
            self.hc_scale.zero_()
        else:
            nn.init.normal_(self.hc_fn, std=self.init_std)
            self.hc_base.zero_()
            self.hc_scale.fill_(1.0)

    @torch.no_grad()
    def init_identity(self, carry: float = 1.0) -> None:
        """Identity init for streams that all enter as ``carry * h`` (the last connection's
        :meth:`HyperConnection.init_identity` result): ``hc_scale = 0``, ``pre = 1/(n carry)``,
        so the head returns ``h``. Leaves ``hc_fn`` as it is.

        Raises:
            ValueError: ``carry`` is not finite and positive, or ``1/(n carry) <= hc_eps``.
        """
        n = self.hc_mult
        if not (math.isfinite(carry) and carry > 0 and 1.0 / (n * carry) > self.hc_eps):
            raise ValueError(
                f"HyperHead.init_identity: carry={carry!r} is out of range; allowed (0, inf) "
                f"with 1/(hc_mult * carry) > hc_eps={self.hc_eps!r}"
            )
        self.hc_base.fill_(_logit(1.0 / (n * carry) - self.hc_eps))
        self.hc_scale.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, n, C] -> [B, T, C] (``last_pre`` [B, T, n] stored when ``record``)."""
        cdt = _compute_dtype(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            raw = _rms_project(x, self.hc_fn.to(cdt), self.norm_eps)  # [B, T, n]
            pre = torch.sigmoid(raw * self.hc_scale.to(cdt) + self.hc_base.to(cdt)) + self.hc_eps
            if self.record:
                self.last_pre = pre.detach()
            return _collapse(pre, x)  # [B, T, C]

    def extra_repr(self) -> str:
        return f"hc_mult={self.hc_mult}, init={self.init_mode}"
