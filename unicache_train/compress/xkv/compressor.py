"""The xKV compressor: fits on the decoder's recorded context, then serves each layer's
low-rank reconstruction at the seam (see :mod:`unicache_train.compress.xkv`).

Shape legend: B, T, S, M, Hk, D, W, r = batch, tokens of a forward, recorded context tokens,
segment entries, KV heads, head dim, concatenated width, rank.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from unicache_train.compress.config import XKVConfig
from unicache_train.compress.xkv.factor import flatten_heads
from unicache_train.compress.xkv.fit import GroupFit, PooledBases, SideFit, XKVFit, fit_context
from unicache_train.seam import (
    CompressionInput,
    KVCompressor,
    KVSegment,
    LowRankKV,
    RecordedContext,
    ScheduledCompressor,
    curriculum_scale,
    identity_segment,
    segment_kv_bytes,
    uncompressed_kv_bytes,
)
from unicache_train.validation import ConfigError

__all__ = ["XKVCompressor", "token_config_for_xkv"]


class XKVCompressor:
    """Cross-layer SVD compression (xKV) behind the per-layer seam.

    Pass it as any compressor (``model(ids, split=split, compressor=xkv)``, training, evaluation,
    :func:`~unicache_train.model.generate.prefill_compressed`): the decoder sees
    ``cross_layer``, records every layer's context, calls :meth:`fit` and runs the compressed
    pass with the fit in each layer's input (:meth:`unicache_train.model.Decoder.forward`).
    The compressor keeps no state of a forward; between forwards it keeps only its curriculum
    ``rate_scale`` and, in training with ``refresh_every > 1``, the pooled bases.

    Args:
        config: :class:`XKVConfig` (default: groups of 2, rank 25% of the width).
        token_compressor: optional per-token compressor applied first, per group (UniCache with
            head merging and quantization off).
    """

    cross_layer: ClassVar[bool] = True

    def __init__(
        self,
        config: XKVConfig | None = None,
        token_compressor: KVCompressor | None = None,
        *,
        curriculum_steps: int = 0,
    ) -> None:
        self.config = config if config is not None else XKVConfig()
        self.pre_rope = self.config.keys_pre_rope
        self.token_compressor = token_compressor
        if token_compressor is not None:
            _check_token_compressor(token_compressor, self.config)
        if (
            isinstance(curriculum_steps, bool)
            or not isinstance(curriculum_steps, int)
            or (curriculum_steps < 0)
        ):
            raise ValueError(
                f"XKVCompressor.curriculum_steps={curriculum_steps!r} is out of range; allowed an "
                "integer in [0, inf)"
            )
        self.curriculum_steps = curriculum_steps
        #: The scale in force: 1 is the configured rank (moved by :meth:`at_step`).
        self.rate_scale = 1.0
        self._pooled: PooledBases = {}
        self._pooled_step: int | None = None

    def __repr__(self) -> str:
        return f"XKVCompressor({self.config!r}, token_compressor={self.token_compressor!r})"

    # ---------------------------------------------------------------------- curriculum
    def at_step(self, step: int | None) -> float:
        """Move to optimizer step ``step`` of the schedule (None: its end): 0 is no compression,
        1 the configured rank (reduction, fraction or energy move linearly from lossless to the
        setting); the token compressor, if any, moves along its own schedule."""
        self.rate_scale = curriculum_scale(step, self.curriculum_steps)
        if isinstance(self.token_compressor, ScheduledCompressor):
            self.token_compressor.at_step(step)
        return self.rate_scale

    def is_rate_zero(self) -> bool:
        return self.rate_scale == 0.0

    # ---------------------------------------------------------------------- the two passes
    @property
    def records_context(self) -> bool:
        """Whether the next forward needs the recording pass and a fit (not at rate 0, where
        every layer's context is served as is)."""
        return not self.is_rate_zero()

    @property
    def record_with_grad(self) -> bool:
        """Whether the recording pass must record gradients: ``gradient="exact"`` (the loss
        reaches every group member's K/V through every reconstruction); with ``"causal"`` the
        compressed pass rebuilds each layer's factor from its own rows."""
        return not self._causal()

    def _causal(self) -> bool:
        return self.config.gradient == "causal" and self.token_compressor is None

    def fit(self, context: RecordedContext, step: int | None = None) -> XKVFit:
        """Fit every layer group on the recorded context (called by the decoder between its
        recording and its compressed pass).

        Args:
            context: every layer's recorded context.
            step: the optimizer step of a training forward: with ``refresh_every > 1`` the
                pooled bases are reused until ``refresh_every`` steps have passed. None
                (evaluation, inference): every sample gets its own SVD.

        Returns:
            The fit, handed to every layer of the compressed pass in ``CompressionInput.fit``.
        """
        cfg = self.config
        pooled = cfg.refresh_every > 1 and step is not None
        if pooled and (self._pooled_step is None or step - self._pooled_step >= cfg.refresh_every):
            self._pooled, self._pooled_step = {}, step
        return fit_context(
            cfg,
            context,
            rate_scale=self.rate_scale,
            token_compressor=self.token_compressor,
            pooled=self._pooled if pooled else None,
            exact=not self._causal(),
        )

    # ---------------------------------------------------------------------- serving
    def __call__(self, inp: CompressionInput) -> KVSegment:
        if inp.latent and self.token_compressor is not None:
            raise NotImplementedError(
                "xKV with UniCache token compression is implemented for GQA models only"
            )
        fit = inp.fit
        if fit is None:
            if self.is_rate_zero():
                return self._identity(inp)
            raise RuntimeError(
                "XKVCompressor is cross-layer: pass it to Decoder.forward, which records every "
                "layer's context and fits it before any layer is served"
            )
        assert isinstance(fit, XKVFit)
        g, i = fit.groups[inp.layer_idx]
        S = fit.prefill
        valid = g.valid
        vm = valid[..., None]
        cur_k = cur_v = None
        if self._causal():
            cur_k = flatten_heads(inp.keys[:, :, :S]) * vm.to(inp.keys.dtype)
            if g.values is not None:
                cur_v = flatten_heads(inp.values[:, :, :S]) * vm.to(inp.values.dtype)
        a_k = _token_factor(g.keys, i, cur_k, g.seen_k)
        b_k = g.keys.layer_basis(i).mT  # [B, r, Wl]
        a_v = b_v = None
        if g.values is not None:
            a_v = _token_factor(g.values, i, cur_v, g.seen_v)
            b_v = g.values.layer_basis(i).mT
        low = LowRankKV(
            token_k=a_k,
            layer_k=b_k,
            rank_k=g.keys.rank,
            token_v=a_v,
            layer_v=b_v,
            rank_v=g.values.rank if g.values is not None else None,
            num_heads=g.heads,
            head_dim=g.head_dim,
            value_dim=g.value_dim,
            owner=i == 0,
            pre_rope=self.pre_rope,
            group=g.layers,
            rope=fit.rope if self.pre_rope else None,
        )
        k_hat, v_hat = low.reconstruct()
        dtype = inp.keys.dtype
        T = inp.keys.shape[2]
        assignment = g.assignment
        if assignment is None:
            t = torch.arange(T, device=valid.device)
            assignment = torch.where(inp.context_mask, t[None, :], -1)
        elif assignment.shape[1] < T:
            pad = assignment.new_full((assignment.shape[0], T - assignment.shape[1]), -1)
            assignment = torch.cat([assignment, pad], 1)
        seg = KVSegment(
            keys=k_hat.to(dtype),
            values=v_hat.to(inp.values.dtype),
            positions=g.positions,
            modality_ids=g.modality_ids,
            counts=g.counts.to(dtype),
            valid=valid,
            assignment=assignment,
            lowrank=low,
        )
        seg.stats = self._stats(g, i, low, valid, fit.latent)
        return seg

    def _identity(self, inp: CompressionInput) -> KVSegment:
        """Rate 0: the context as is (what the curriculum starts from)."""
        seg = identity_segment(inp, with_assignment=True)
        # The identity's values are the latent's first features (MLA): stored once, as deployed.
        kv = segment_kv_bytes(seg, self.config.cache_dtype_bytes, latent=inp.latent).sum()
        dev = inp.keys.device
        seg.stats = {
            "kv_bytes": kv.float(),
            "kv_reduction": torch.ones((), device=dev),
            "rate_realized": torch.zeros((), device=dev),
        }
        return seg

    @torch.no_grad()
    def _stats(
        self, g: GroupFit, i: int, low: LowRankKV, valid: torch.Tensor, latent: bool
    ) -> dict[str, torch.Tensor]:
        """Per-layer scalars: bytes (factors), ranks, captured energy, reconstruction error."""
        dt = self.config.cache_dtype_bytes
        kv = low.nbytes(valid, dt).sum()  # the factors (seam.stored_kv_bytes' low-rank case)
        base = uncompressed_kv_bytes(
            g.context_tokens, g.heads, g.head_dim, g.value_dim, latent=latent, dtype_bytes=dt
        ).sum()
        n_ctx = g.context_tokens.sum().double().clamp_min(1.0)
        stats: dict[str, torch.Tensor] = {
            "kv_bytes": kv,
            "kv_reduction": base / kv.clamp_min(1.0),
            "rate_realized": 1.0 - valid.sum() / n_ctx,
            "xkv_rank_k": g.keys.rank.double().mean(),
            "xkv_rank_fraction_k": g.keys.rank.double().mean() / g.keys.basis.shape[1],
            "xkv_energy_k": g.keys.energy.double().mean(),
            "xkv_rel_error_k": _rel_error(g.keys, i, low.token_k),
        }
        if g.values is not None:
            stats["xkv_rank_v"] = g.values.rank.double().mean()
            stats["xkv_energy_v"] = g.values.energy.double().mean()
            stats["xkv_rel_error_v"] = _rel_error(g.values, i, low.token_v)
        stats.update(g.token_stats)
        dev = valid.device
        return {k: v.to(device=dev, dtype=torch.float32) for k, v in stats.items()}


def _token_factor(
    side: SideFit, i: int, current: torch.Tensor | None, seen: dict[int, torch.Tensor]
) -> torch.Tensor:
    """A = X V_r [B, M, r] for member i's reconstruction (see ``XKVConfig.gradient``).

    Args:
        side: the group's K or V factors.
        i: the member served now.
        current: [B, M, W_i] member i's own rows in the compressed pass (causal gradient), or
            None (exact: the factor built once by the fit from the recorded rows).
        seen: the rows of the members served earlier in this forward (causal gradient).
    """
    if current is None:
        assert side.token_factor is not None
        return side.token_factor
    seen[i] = current
    parts = []
    for j, x in enumerate(side.x):
        # NOTE: members before i were served earlier in this forward (their compressed-pass rows
        # carry gradient); later members are not computed yet: the recorded constants.
        rows = seen[j] if j <= i and j in seen else x.detach()
        parts.append(rows.float() @ side.layer_basis(j))
    return sum(parts)  # type: ignore[return-value]


def _rel_error(side: SideFit, i: int, token: torch.Tensor | None) -> torch.Tensor:
    """||X̂_i - X_i||_F / ||X_i||_F over the batch (X_i: the rows factorised)."""
    assert token is not None
    x = side.x[i].detach().float()
    x_hat = token.detach() @ side.layer_basis(i).mT
    return (x_hat - x).norm() / x.norm().clamp_min(1e-30)


def token_config_for_xkv(config):
    """``config`` (a :class:`~unicache_train.compress.config.UniCacheConfig`) as the token
    compressor in front of xKV accepts it: head merging and quantization off (the cross-layer SVD
    already removes redundancy between heads, and it factors 16-bit entries). The one place that
    states the rule; :func:`_check_token_compressor` enforces it."""
    d = config.to_dict()
    d["head_merge"]["enabled"] = False
    d["quantize"]["bits"] = None
    return type(config).from_dict(d)


def _check_token_compressor(token: KVCompressor, config: XKVConfig) -> None:
    """The combined mode's constraints (see :mod:`unicache_train.compress.xkv`)."""
    if config.gradient != "exact":
        raise ConfigError(
            f"XKVConfig.gradient={config.gradient!r} is not allowed with a token compressor; "
            "choose 'exact' (the token plan is decided on the gradient-carrying prefill)"
        )
    cfg = getattr(token, "config", None)
    if cfg is None:
        return
    if getattr(getattr(cfg, "head_merge", None), "enabled", False):
        raise ConfigError(
            "UniCacheConfig.head_merge.enabled=True is not allowed under xKV; set it to false "
            "(the cross-layer SVD already removes redundancy between heads)"
        )
    if getattr(getattr(cfg, "quantize", None), "active", False):
        raise ConfigError(
            f"UniCacheConfig.quantize.bits={cfg.quantize.bits!r} is not allowed under xKV; set "
            "it to null (xKV stores its factors in 16 bit)"
        )
