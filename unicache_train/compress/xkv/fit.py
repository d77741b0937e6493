"""xKV's fit: every layer group's factors from the recorded context (no model access).

The decoder records every layer's context K/V (a :class:`~unicache_train.seam.RecordedContext`)
and hands it to :meth:`XKVCompressor.fit <unicache_train.compress.xkv.XKVCompressor.fit>`,
which calls :func:`fit_context`. The result, an :class:`XKVFit`, reaches every layer of the
compressed pass in :attr:`CompressionInput.fit <unicache_train.seam.CompressionInput.fit>`.

Shape legend: B, S, M, Hk, D, W, r = batch, recorded context tokens, rows factorised (context
tokens, or the entries kept by token compression), KV heads, head dim, concatenated width,
rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from unicache_train.compress.config import XKVConfig
from unicache_train.compress.xkv.factor import (
    LOWRANK_OVERSAMPLE,
    flatten_heads,
    layer_groups,
    lowrank_basis,
    pooled_svd_basis,
    rank_mask,
    select_rank,
    svd_basis,
)
from unicache_train.ops.rope import unapply_rope
from unicache_train.seam import CompressionInput, KVCompressor, RecordedContext

__all__ = ["SideFit", "GroupFit", "XKVFit", "fit_context"]

#: Pooled bases by (group members, "k" or "v"): (basis [W, K], singular values [K]).
PooledBases = dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SideFit:
    """The factors of one of K or V for one group.

    Attributes:
        x: per member layer, [B, M, W_l] rows (masked; with gradient when the recording pass
            had it).
        basis: [B, W, r] detached, zero beyond each sample's rank.
        rank: [B] long.
        energy: [B] share of the squared singular values kept.
        widths, offsets: each member's columns of ``W``.
        token_factor: A = X V_r [B, M, r] computed once per group (exact gradient), else None
            (causal gradient: rebuilt per layer from the compressed pass's own rows).
    """

    x: list[torch.Tensor]
    basis: torch.Tensor
    rank: torch.Tensor
    energy: torch.Tensor
    widths: list[int]
    offsets: list[int]
    token_factor: torch.Tensor | None = None

    def layer_basis(self, i: int) -> torch.Tensor:
        """[B, W_i, r] rows of member i."""
        return self.basis[:, self.offsets[i] : self.offsets[i] + self.widths[i]]


@dataclass
class GroupFit:
    """One layer group's factors and the entries they stand for.

    ``valid``, ``positions``, ``modality_ids``, ``counts`` are [B, M]; ``assignment`` [B, S] is
    the entry of each recorded token (token compression only); ``context_tokens`` [B] the
    context before any compression (the byte baseline). ``seen_k``/``seen_v`` collect, during
    the compressed pass, each member's own rows (causal gradient).
    """

    layers: tuple[int, ...]
    keys: SideFit
    values: SideFit | None  # None: values read from the keys (MLA latent)
    valid: torch.Tensor
    positions: torch.Tensor
    modality_ids: torch.Tensor
    counts: torch.Tensor
    assignment: torch.Tensor | None
    context_tokens: torch.Tensor
    heads: int
    head_dim: int
    value_dim: int
    token_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    seen_k: dict[int, torch.Tensor] = field(default_factory=dict)
    seen_v: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class XKVFit:
    """Every group's factors for one forward.

    Attributes:
        groups: layer -> (its group, its index in the group).
        prefill: S, the recorded context tokens.
        rope: the model's rotary table (positions, dtype -> cos, sin), for pre-RoPE keys.
        latent: the seam handed over MLA's latent cache (values = the keys' first features).
    """

    groups: dict[int, tuple[GroupFit, int]]
    prefill: int
    rope: Any
    latent: bool


def fit_context(
    config: XKVConfig,
    context: RecordedContext,
    *,
    rate_scale: float = 1.0,
    token_compressor: KVCompressor | None = None,
    pooled: PooledBases | None = None,
    exact: bool = True,
) -> XKVFit:
    """Fit every layer group of the recorded context.

    Args:
        config: the xKV configuration (groups, rank rule, ``keys_pre_rope``).
        context: every layer's recorded context (keys pre-RoPE when ``keys_pre_rope``).
        rate_scale: curriculum factor of the rank (see :func:`select_rank`).
        token_compressor: per-token compressor run per group first (UniCache), or None.
        pooled: cache of batch-pooled bases to use and fill (training's ``refresh_every``), or
            None for a per-sample SVD.
        exact: build each group's token-side factor here from the recorded rows (gradient
            ``"exact"``); False leaves it to the compressed pass (``"causal"``).

    Returns:
        :class:`XKVFit`.
    """
    layers = sorted(context.inputs)
    first = context.inputs[layers[0]]
    num_layers = first.num_layers
    if layers != list(range(num_layers)):
        raise RuntimeError(f"xKV's recording saw layers {layers}, expected 0..{num_layers - 1}")
    if first.latent and token_compressor is not None:
        raise NotImplementedError(
            "xKV with UniCache token compression is implemented for GQA models only"
        )
    groups: dict[int, tuple[GroupFit, int]] = {}
    for members in layer_groups(num_layers, config.group_size):
        g = _fit_group(config, context, members, rate_scale, token_compressor, pooled, exact)
        for i, layer in enumerate(members):
            groups[layer] = (g, i)
    return XKVFit(groups, prefill=context.prefill, rope=context.rope, latent=first.latent)


def _fit_group(
    config: XKVConfig,
    context: RecordedContext,
    members: tuple[int, ...],
    rate_scale: float,
    token_compressor: KVCompressor | None,
    pooled: PooledBases | None,
    exact: bool,
) -> GroupFit:
    """One group: its rows (after token compression when given), then K and V factors."""
    keys, values, meta = _group_rows(config, context, members, token_compressor)
    valid, n_ctx = meta["valid"], meta["context_tokens"]
    fit_k = _fit_side(config, keys, valid, n_ctx, (members, "k"), rate_scale, pooled, exact)
    fit_v = None
    if values is not None:
        fit_v = _fit_side(config, values, valid, n_ctx, (members, "v"), rate_scale, pooled, exact)
    head = context.inputs[members[0]]
    return GroupFit(
        layers=members,
        keys=fit_k,
        values=fit_v,
        valid=valid,
        positions=meta["positions"],
        modality_ids=meta["modality_ids"],
        counts=meta["counts"],
        assignment=meta["assignment"],
        context_tokens=n_ctx,
        heads=head.keys.shape[1],
        head_dim=head.keys.shape[-1],
        value_dim=head.values.shape[-1],
        token_stats=meta["stats"],
    )


def _group_rows(
    config: XKVConfig,
    context: RecordedContext,
    members: tuple[int, ...],
    token_compressor: KVCompressor | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, dict[str, Any]]:
    """Per member: keys [B, M, Hk*D] (pre-RoPE if configured), values (None: MLA latent), and
    the entries' metadata (positions, validity, counts, ...)."""
    S = context.prefill
    first = context.inputs[members[0]]
    ctx = first.context_mask[:, :S]
    meta: dict[str, Any] = {
        "valid": ctx,
        "positions": first.positions[:, :S],
        "modality_ids": first.modality_ids[:, :S],
        "counts": torch.ones_like(first.positions[:, :S], dtype=torch.float32),
        "assignment": None,
        "stats": {},
        "context_tokens": first.context_mask.sum(1),
    }
    inputs = context.inputs
    if token_compressor is None:
        keys = [flatten_heads(inputs[m].keys[:, :, :S]) for m in members]
        values = None
        if not first.latent:
            values = [flatten_heads(inputs[m].values[:, :, :S]) for m in members]
        return keys, values, meta
    # Token compression on the virtual layer of all the group's heads (post-RoPE keys, as
    # UniCache scores them: the recorded segments' keys, which the seam rotated), then back to
    # pre-RoPE at each entry's position.
    Hk = first.keys.shape[1]
    mid = members[len(members) // 2]
    vin = CompressionInput(
        layer_idx=mid,
        num_layers=first.num_layers,
        queries=torch.cat([inputs[m].queries[:, :, :S] for m in members], 1),
        keys=torch.cat([context.segments[m].keys[:, :, :S] for m in members], 1),
        values=torch.cat([inputs[m].values[:, :, :S] for m in members], 1),
        positions=first.positions[:, :S],
        modality_ids=first.modality_ids[:, :S],
        context_mask=ctx,
    )
    seg = token_compressor(vin)
    k = seg.keys
    if config.keys_pre_rope:
        cos, sin = context.rope(seg.positions, torch.float32)
        k = unapply_rope(k.float(), cos, sin).to(seg.keys.dtype)  # (a R(p))^-1
    keys = [flatten_heads(k[:, i * Hk : (i + 1) * Hk]) for i in range(len(members))]
    values = [flatten_heads(seg.values[:, i * Hk : (i + 1) * Hk]) for i in range(len(members))]
    meta.update(
        valid=seg.valid,
        positions=seg.positions,
        modality_ids=seg.modality_ids,
        counts=seg.counts.float(),
        assignment=seg.assignment,
        stats={k: v for k, v in seg.stats.items() if k.startswith("rate_realized")},
    )
    return keys, values, meta


def _fit_side(
    config: XKVConfig,
    rows: list[torch.Tensor],
    valid: torch.Tensor,
    context_tokens: torch.Tensor,
    key: tuple[Any, ...],
    rate_scale: float,
    pooled: PooledBases | None,
    exact: bool,
) -> SideFit:
    """The SVD basis, rank and captured energy of one of K or V of a group."""
    widths = [r.shape[-1] for r in rows]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    x = torch.cat(rows, -1) * valid[..., None].to(rows[0].dtype)  # [B, M, W]
    B, M, W = x.shape
    n = valid.sum(1)
    total = None  # [B] squared Frobenius norm, when the singular values are not all there
    if pooled is not None:
        if key not in pooled:
            pooled[key] = pooled_svd_basis(x, valid, config.factorization)
        basis_1, sv_1 = pooled[key]
        basis, sv = basis_1.expand(B, *basis_1.shape), sv_1.expand(B, *sv_1.shape)
        rank = select_rank(config, sv, W, n, context_tokens, rate_scale)
    elif config.factorization == "lowrank":
        # The rank first (reduction and fraction modes never read the singular values), then
        # a sketch just wide enough for it.
        rank = select_rank(config, x.new_zeros(B, min(M, W)), W, n, context_tokens, rate_scale)
        basis, sv = lowrank_basis(x, valid, int(rank.max()) + LOWRANK_OVERSAMPLE)
        rank = torch.minimum(rank, torch.full_like(rank, sv.shape[1]))
        total = (x.detach().double() ** 2).sum((1, 2))
    else:
        basis, sv = svd_basis(x, valid, config.factorization)
        rank = select_rank(config, sv, W, n, context_tokens, rate_scale)
    r_max = int(rank.max())
    basis = basis[..., :r_max] * rank_mask(rank, r_max)  # [B, W, r], zero beyond rank
    power = sv.double() ** 2
    kept = (power[:, :r_max] * rank_mask(rank, r_max)[:, 0].double()).sum(1)
    total = power.sum(1) if total is None else total
    energy = (kept / total.clamp_min(1e-300)).float()
    masked = [r * valid[..., None].to(r.dtype) for r in rows]
    side = SideFit(masked, basis, rank, energy, widths, offsets)
    if exact:
        # NOTE: here, outside any block: an activation-recompute region must redo exactly
        # the ops it did the first time, so a block must not build a factor lazily.
        side.token_factor = sum(x.float() @ side.layer_basis(j) for j, x in enumerate(masked))  # type: ignore[assignment]
    return side
