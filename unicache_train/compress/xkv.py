"""xKV: cross-layer SVD compression of the KV cache.

Chang et al., "xKV: Cross-Layer SVD for KV-Cache Compression" (arXiv 2503.18893);
docs/architecture.md#xkv. Observation: the dominant singular vectors of adjacent layers' KV
caches are aligned (see :mod:`unicache_train.compress.xkv_alignment`), so one token-side basis
serves a group of layers.

Shape legend: B, T, S, M, G, Hk, D, W, r = batch, tokens of a forward, prefilled tokens
(``max(split)``), segment entries, layers in a group, KV heads, head dim, concatenated width
(``G * Hk * D``), rank.

Per group of G contiguous layers, per sample, separately for keys (pre-RoPE) and values::

    X = [X_l0 ‖ X_l1 ‖ ...]          [M, W]   context rows of the group's layers, side by side
    X ≈ U_r Σ_r V_rᵀ                           fp32 SVD, V_r detached (the basis)
    A   = X V_r          = U_r Σ_r   [M, r]   token-side factor, shared by the group
    B_l = V_r[rows of l]ᵀ            [r, Hk*D] per-layer factor
    X̂_l = A B_l                               reconstruction on demand (RoPE after it)

    stored: r (M + W) elements instead of M W (``LowRankKV.nbytes``; the owner layer counts A)

Rank: ``rank_fraction`` of W, an ``energy`` threshold, or the largest rank within ``1 / ratio``
of the uncompressed 16-bit cache counting both factors (:func:`select_rank`).

**Why a two-phase forward.** The seam calls the compressor layer by layer, but a group's SVD
needs all of its layers' context K/V. Context rows never depend on the compressed cache, so
:meth:`XKVCompressor.prepare` first prefills the context through every layer with a recording
compressor (the plain causal computation, exactly inference's prefill), fits every group, and
the in-loop forward that follows gets each layer's reconstruction from the compressor::

    phase A  model(ids[:, :S], split, recorder)  ─► per layer: context K (pre-RoPE), V
             per group: SVD (no grad) ─► basis V_r;  A = X V_r (grad through X)
    phase B  model(ids, split, xkv)  ─► layer l: segment = X̂_l (RoPE applied by the seam)
                                        continuation attends to it, as decoding does

Gradients flow through the projection onto the detached basis (the SVD itself is never
differentiated: its backward is ill-conditioned at close singular values). ``gradient="exact"``
runs phase A with gradients, so the loss reaches every group member's K/V through every
reconstruction (phase A costs one more prefill forward and backward). ``gradient="causal"``
runs phase A without gradient; layer l's reconstruction then uses phase B's own K/V of the
group's layers up to l and phase A's (constant) K/V of the later ones: the same numbers, a
gradient without the paths into later group members, and phase A is free when the KL term's
uncompressed forward doubles as it.

**With UniCache token compression** (``token_compressor``): tokens first, then cross-layer SVD on
the kept entries. The SVD needs the same rows in every layer of a group, so the token plan is
decided once per group: UniCache runs on a virtual layer whose KV heads are all the group's
heads (importance, redundancy, merging over the whole group; rate of the group's middle layer),
then the kept and merged entries of each layer are factorised. SVD first would not pay: a
token dropped by one layer but kept by another still costs its row of A. Head merging and
quantization of the UniCache part must be off (the SVD already removes cross-head redundancy;
factors are stored in 16 bit). Needs ``gradient="exact"``; GQA models only.

**With MLA** the seam hands over the latent cache ``[c_kv ‖ k_pe]`` as one head: xKV factorises
the latents of the group's layers jointly (MLA first, then cross-layer sharing, as the source
says) and the values (``c_kv``) are read back from the reconstructed keys, stored once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from unicache_train.compress.config import XKVConfig
from unicache_train.ops.rope import apply_rope
from unicache_train.seam import (
    CompressionInput,
    KVCompressor,
    KVSegment,
    LowRankKV,
    RecordingCompressor,
    identity_segment,
)
from unicache_train.validation import ConfigError

__all__ = [
    "XKVCompressor",
    "layer_groups",
    "select_rank",
    "svd_basis",
    "flatten_heads",
]


def layer_groups(num_layers: int, group_size: int) -> list[tuple[int, ...]]:
    """Contiguous groups ``(0..G-1), (G..2G-1), ...``; the last may be shorter."""
    starts = range(0, num_layers, group_size)
    return [tuple(range(s, min(s + group_size, num_layers))) for s in starts]


def flatten_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H*D]."""
    return x.transpose(1, 2).flatten(2)


def _unflatten_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, H*D] -> [B, H, T, D]."""
    B, T, W = x.shape
    return x.view(B, T, heads, W // heads).transpose(1, 2)


@torch.no_grad()
def svd_basis(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 SVD of each sample's valid rows.

    Args:
        x: [B, M, W] (any float dtype).
        valid: [B, M] bool; invalid rows are zeroed (zero rows leave the right singular vectors
            of the valid rows unchanged).

    Returns:
        (basis [B, W, K] right singular vectors by decreasing singular value, singular values
        [B, K]), ``K = min(M, W)``, fp32, no gradient.
    """
    xf = x.detach().float() * valid[..., None]
    _, s, vh = torch.linalg.svd(xf, full_matrices=False)
    return vh.mT, s


@torch.no_grad()
def pooled_svd_basis(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One basis for the whole batch: SVD of every sample's valid rows stacked.

    Returns:
        (basis [W, K], singular values [K]), fp32.
    """
    xf = (x.detach().float() * valid[..., None]).flatten(0, 1)  # [B*M, W]
    _, s, vh = torch.linalg.svd(xf, full_matrices=False)
    return vh.mT, s


def select_rank(
    config: XKVConfig,
    sv: torch.Tensor,
    width: int,
    rows: torch.Tensor,
    context_tokens: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """Rank per sample.

    Args:
        config: ``rank_mode`` and its value.
        sv: [B, K] singular values (decreasing).
        width: W, the concatenated width of the group.
        rows: [B] entries factorised (context tokens, or the entries kept by token compression).
        context_tokens: [B] context tokens before any compression (the byte baseline).
        scale: curriculum factor in [0, 1]; 0 is full rank, 1 the configured setting.

    Returns:
        [B] long in ``[1, min(rows, K)]`` (``min_rank`` permitting): ``fraction``:
        ``round(f * W)``; ``energy``: the smallest r with ``sum_{i<r} s_i^2 >= e * sum s_i^2``;
        ``ratio``: the largest r with ``r (rows + W) <= context_tokens * W / ratio``.
    """
    B, K = sv.shape
    dev = sv.device
    rows = rows.to(dev)
    if config.rank_mode == "fraction":
        f = 1.0 - scale * (1.0 - config.rank_fraction)
        r = torch.full((B,), round(f * width), dtype=torch.long, device=dev)
    elif config.rank_mode == "energy":
        e = 1.0 - scale * (1.0 - config.energy)
        power = sv.double() ** 2
        cum = power.cumsum(1) / power.sum(1, keepdim=True).clamp_min(1e-300)
        # NOTE: a small slack so that e = 1 keeps the rank of the data, not round-off dust.
        r = (cum < e - 1e-9).sum(1) + 1
    else:
        q = 1.0 + scale * (config.ratio - 1.0)
        budget = context_tokens.to(dev).double() * width / q
        r = torch.floor(budget / (rows.double() + width) + 1e-9).long()
    cap = torch.clamp(rows.long(), max=min(K, width)).clamp_min(1)
    return torch.minimum(r.clamp_min(config.min_rank), cap)


def _rank_mask(rank: torch.Tensor, r_max: int) -> torch.Tensor:
    """[B] ranks -> [B, 1, r_max] float mask of the kept columns."""
    cols = torch.arange(r_max, device=rank.device)
    return (cols[None, :] < rank[:, None]).float()[:, None, :]


# ------------------------------------------------------------------------------ fitted state
@dataclass
class _Side:
    """The factors of one of K or V for one group.

    x: per member layer, [B, M, W_l] rows (masked; phase A, with gradient in exact mode);
    basis: [B, W, r] detached, zero beyond each sample's rank; rank [B]; energy [B] captured.
    """

    x: list[torch.Tensor]
    basis: torch.Tensor
    rank: torch.Tensor
    energy: torch.Tensor
    widths: list[int]
    offsets: list[int]
    token: torch.Tensor | None = None  # A (exact mode), computed once per group

    def layer_basis(self, i: int) -> torch.Tensor:
        """[B, W_i, r] rows of member i."""
        return self.basis[:, self.offsets[i] : self.offsets[i] + self.widths[i]]


@dataclass
class _Group:
    layers: tuple[int, ...]
    keys: _Side
    values: _Side | None  # None: values read from the keys (MLA latent)
    valid: torch.Tensor  # [B, M]
    positions: torch.Tensor  # [B, M]
    modality_ids: torch.Tensor  # [B, M]
    counts: torch.Tensor  # [B, M]
    assignment: torch.Tensor | None  # [B, S] entry of each prefilled token (token compression)
    context_tokens: torch.Tensor  # [B]
    heads: int
    head_dim: int
    value_dim: int
    token_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    seen_k: dict[int, torch.Tensor] = field(default_factory=dict)  # causal: phase-B rows
    seen_v: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Prepared:
    groups: dict[int, tuple[_Group, int]]  # layer -> (group, index in the group)
    identity: bool
    prefill: int  # S


# ------------------------------------------------------------------------------ the compressor
class XKVCompressor:
    """Cross-layer SVD compression (xKV) behind the per-layer seam (see the module docstring).

    Pass it as any compressor (``model(ids, split=split, compressor=xkv)``, training, evaluation,
    :func:`~unicache_train.model.generate.prefill_compressed`): the decoder sees
    ``cross_layer`` and calls :meth:`prepare` and :meth:`release` around the in-loop forward.

    Args:
        config: :class:`XKVConfig` (default: groups of 2, rank 25% of the width).
        token_compressor: optional per-token compressor applied first, per group (UniCache with
            head merging and quantization off).
    """

    cross_layer: ClassVar[bool] = True

    def __init__(
        self, config: XKVConfig | None = None, token_compressor: KVCompressor | None = None
    ) -> None:
        self.config = config if config is not None else XKVConfig()
        self.pre_rope = self.config.keys_pre_rope
        self.token = token_compressor
        if token_compressor is not None:
            _check_token_compressor(token_compressor, self.config)
        self.rate_scale = 1.0
        #: training step of the next forward (None: evaluation/inference; see prepare()).
        self.step: int | None = None
        #: keep phase A's uncompressed logits when they come for free (see prepare()).
        self.keep_reference = False
        self.reference_logits: torch.Tensor | None = None
        self._state: _Prepared | None = None
        self._last: _Prepared | None = None
        self._latent = False
        self._rotary: Any = None
        self._pooled: dict[tuple[int, ...], tuple[Any, Any]] = {}
        self._pooled_step: int | None = None

    def __repr__(self) -> str:
        return f"XKVCompressor({self.config!r}, token_compressor={self.token!r})"

    # ---------------------------------------------------------------------- curriculum
    def set_rate_scale(self, rate_scale: float) -> None:
        """Curriculum: 0 is no compression, 1 the configured rank (ratio, fraction or energy
        move linearly from lossless to the setting); forwarded to the token compressor."""
        if isinstance(rate_scale, bool) or not 0.0 <= float(rate_scale) <= 1.0:
            raise ValueError(f"rate_scale={rate_scale!r} is out of range; allowed [0.0, 1.0]")
        self.rate_scale = float(rate_scale)
        setter = getattr(self.token, "set_rate_scale", None)
        if setter is not None:
            setter(rate_scale)

    def is_rate_zero(self) -> bool:
        return self.rate_scale == 0.0

    def _causal(self) -> bool:
        return self.config.gradient == "causal" and self.token is None

    # ---------------------------------------------------------------------- phase A
    @property
    def prepared(self) -> bool:
        """True between :meth:`prepare` and :meth:`release`."""
        return self._state is not None

    def prepare(
        self,
        model: Any,
        input_ids: torch.Tensor | None = None,
        *,
        split: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        """Prefill the context through every layer and fit every group (phase A).

        Called by :meth:`unicache_train.model.Decoder.forward` before the in-loop forward.
        Training sets :attr:`step` (with ``refresh_every > 1`` the pooled basis is refreshed
        once ``refresh_every`` steps have passed; None, as in evaluation and inference: every
        sample gets its own SVD) and may set :attr:`keep_reference`: when phase A can produce
        the uncompressed logits for free (``gradient="causal"``, no token compressor) it then
        runs over the whole sequence without gradient and leaves them in
        :attr:`reference_logits` [B, T, V] (the plain forward's, for the KL term).

        Args:
            model: the decoder the in-loop forward will run.
            input_ids: [B, T] (or ``inputs_embeds=`` in ``kwargs``).
            split: [B].
            **kwargs: the model's other arguments (``modality_ids``, ``positions``, ...).
        """
        self._state = self._last = None
        self.reference_logits = None
        reference, step = self.keep_reference, self.step
        cfg = self.config
        self._latent = getattr(model.config, "attention_type", "gqa") == "mla"
        if self._latent and self.token is not None:
            raise NotImplementedError(
                "xKV with UniCache token compression is implemented for GQA models only"
            )
        self._rotary = model.rotary
        if self.is_rate_zero():
            self._state = _Prepared({}, identity=True, prefill=0)
            return
        x = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        assert x is not None, "pass input_ids or inputs_embeds"
        T = x.shape[1]
        S = int(split.max())
        causal = cfg.gradient == "causal" and self.token is None
        full = reference and causal
        L = T if full else S
        kw = {k: _prefix(v, T, L) for k, v in kwargs.items()}
        ids = input_ids[:, :L] if input_ids is not None else None
        rec = RecordingCompressor(pre_rope=self.pre_rope)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not causal):
            out = model(ids, split=split, compressor=rec, **kw)
        self._state = self._fit(rec, S, step)
        if full:
            self.reference_logits = out.logits

    def release(self) -> None:
        """End the forward: the next forward prepares again.

        The state stays readable until then, because activation recompute
        (:mod:`unicache_train.train.strategies`) reruns the blocks, and so this compressor's
        serving, during the backward pass that follows the forward.
        """
        self._last, self._state = self._state, None

    # ---------------------------------------------------------------------- fitting
    def _fit(self, rec: RecordingCompressor, S: int, step: int | None) -> _Prepared:
        layers = sorted(rec.inputs)
        num_layers = rec.inputs[layers[0]].num_layers
        if layers != list(range(num_layers)):
            raise RuntimeError(f"xKV phase A saw layers {layers}, expected 0..{num_layers - 1}")
        cfg = self.config
        pooled = cfg.refresh_every > 1 and step is not None
        if pooled and (self._pooled_step is None or step - self._pooled_step >= cfg.refresh_every):
            self._pooled, self._pooled_step = {}, step
        groups: dict[int, tuple[_Group, int]] = {}
        for members in layer_groups(num_layers, cfg.group_size):
            g = self._fit_group(rec, members, S, pooled)
            for i, layer in enumerate(members):
                groups[layer] = (g, i)
        return _Prepared(groups, identity=False, prefill=S)

    def _group_rows(
        self, rec: RecordingCompressor, members: tuple[int, ...], S: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, dict[str, Any]]:
        """Per member: keys [B, M, Hk*D] (pre-RoPE if configured), values, and the entries'
        metadata (positions, validity, counts, ...)."""
        first = rec.inputs[members[0]]
        ctx = first.context_mask[:, :S]
        meta: dict[str, Any] = {
            "valid": ctx,
            "positions": first.positions[:, :S],
            "modality_ids": first.modality_ids[:, :S],
            "counts": torch.ones_like(first.positions[:, :S], dtype=torch.float32),
            "assignment": None,
            "stats": {},
        }
        if self.token is None:
            keys = [flatten_heads(rec.inputs[m].keys[:, :, :S]) for m in members]
            values = None
            if not self._latent:
                values = [flatten_heads(rec.inputs[m].values[:, :, :S]) for m in members]
            return keys, values, meta
        # Token compression on the virtual layer of all the group's heads (post-RoPE keys,
        # as UniCache scores them), then back to pre-RoPE at each entry's position.
        Hk = first.keys.shape[1]
        mid = members[len(members) // 2]
        vin = CompressionInput(
            layer_idx=mid,
            num_layers=first.num_layers,
            queries=torch.cat([rec.inputs[m].queries[:, :, :S] for m in members], 1),
            keys=torch.cat([rec.segments[m].keys[:, :, :S] for m in members], 1),
            values=torch.cat([rec.inputs[m].values[:, :, :S] for m in members], 1),
            positions=first.positions[:, :S],
            modality_ids=first.modality_ids[:, :S],
            context_mask=ctx,
        )
        seg = self.token(vin)
        k = seg.keys
        if self.pre_rope:
            cos, sin = self._rotary(seg.positions, torch.float32)
            k = apply_rope(k.float(), cos, -sin).to(seg.keys.dtype)  # R(p)^-1 = R(-p)
        keys = [flatten_heads(k[:, i * Hk : (i + 1) * Hk]) for i in range(len(members))]
        values = [flatten_heads(seg.values[:, i * Hk : (i + 1) * Hk]) for i in range(len(members))]
        meta.update(
            valid=seg.valid,
            positions=seg.positions,
            modality_ids=seg.modality_ids,
            counts=seg.counts.float(),
            assignment=seg.assignment,
            stats={k: v for k, v in seg.stats.items() if k.startswith("keep_ratio")},
        )
        return keys, values, meta

    def _fit_side(
        self,
        rows: list[torch.Tensor],
        valid: torch.Tensor,
        context_tokens: torch.Tensor,
        key: tuple[Any, ...],
        pooled: bool,
    ) -> _Side:
        cfg = self.config
        widths = [r.shape[-1] for r in rows]
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        x = torch.cat(rows, -1) * valid[..., None].to(rows[0].dtype)  # [B, M, W]
        W = x.shape[-1]
        n = valid.sum(1)
        if pooled:
            if key not in self._pooled:
                self._pooled[key] = pooled_svd_basis(x, valid)
            basis_1, sv_1 = self._pooled[key]
            B = x.shape[0]
            basis, sv = basis_1.expand(B, *basis_1.shape), sv_1.expand(B, *sv_1.shape)
        else:
            basis, sv = svd_basis(x, valid)
        rank = select_rank(cfg, sv, W, n, context_tokens, self.rate_scale)
        r_max = int(rank.max())
        basis = basis[..., :r_max] * _rank_mask(rank, r_max)  # [B, W, r], zero beyond rank
        power = sv.double() ** 2
        kept = (power[:, :r_max] * _rank_mask(rank, r_max)[:, 0].double()).sum(1)
        energy = (kept / power.sum(1).clamp_min(1e-300)).float()
        masked = [r * valid[..., None].to(r.dtype) for r in rows]
        side = _Side(masked, basis, rank, energy, widths, offsets)
        if not self._causal():
            # NOTE: here, outside any block: an activation-recompute region must redo exactly
            # the ops it did the first time, so a block must not build a factor lazily.
            side.token = sum(x.float() @ side.layer_basis(j) for j, x in enumerate(masked))  # type: ignore[assignment]
        return side

    def _fit_group(
        self, rec: RecordingCompressor, members: tuple[int, ...], S: int, pooled: bool
    ) -> _Group:
        keys, values, meta = self._group_rows(rec, members, S)
        first = rec.inputs[members[0]]
        context_tokens = first.context_mask.sum(1)
        valid = meta["valid"]
        k_side = self._fit_side(keys, valid, context_tokens, (members, "k"), pooled)
        v_side = None
        if values is not None:
            v_side = self._fit_side(values, valid, context_tokens, (members, "v"), pooled)
        Hk, D = first.keys.shape[1], first.keys.shape[-1]
        return _Group(
            layers=members,
            keys=k_side,
            values=v_side,
            valid=valid,
            positions=meta["positions"],
            modality_ids=meta["modality_ids"],
            counts=meta["counts"],
            assignment=meta["assignment"],
            context_tokens=context_tokens,
            heads=Hk,
            head_dim=D,
            value_dim=first.values.shape[-1],
            token_stats=meta["stats"],
        )

    # ---------------------------------------------------------------------- phase B (serve)
    def _token_factor(
        self, side: _Side, i: int, current: torch.Tensor | None, seen: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """A = X V_r [B, M, r] for member i's reconstruction (see ``gradient``)."""
        if current is None:  # exact: every member from phase A, computed once per group
            assert side.token is not None
            return side.token
        seen[i] = current
        parts = []
        for j, x in enumerate(side.x):
            # NOTE: members before i were served earlier in this forward (their phase-B rows
            # carry gradient); later members are not computed yet: phase A's constants.
            rows = seen[j] if j <= i and j in seen else x.detach()
            parts.append(rows.float() @ side.layer_basis(j))
        return sum(parts)  # type: ignore[return-value]

    def __call__(self, inp: CompressionInput) -> KVSegment:
        # NOTE: after release() only a recompute of this forward's blocks calls again.
        st = self._state if self._state is not None else self._last
        if st is None:
            raise RuntimeError(
                "XKVCompressor is cross-layer: pass it to Decoder.forward (which prepares it) "
                "or call prepare() first, so that every layer's context is prefilled before "
                "any layer is served"
            )
        if st.identity:
            return self._identity(inp)
        g, i = st.groups[inp.layer_idx]
        S = st.prefill
        causal = self._causal()
        valid = g.valid
        vm = valid[..., None]
        cur_k = cur_v = None
        if causal:
            cur_k = flatten_heads(inp.keys[:, :, :S]) * vm.to(inp.keys.dtype)
            if g.values is not None:
                cur_v = flatten_heads(inp.values[:, :, :S]) * vm.to(inp.values.dtype)
        a_k = self._token_factor(g.keys, i, cur_k, g.seen_k)
        b_k = g.keys.layer_basis(i).mT  # [B, r, Wl]
        a_v = b_v = None
        if g.values is not None:
            a_v = self._token_factor(g.values, i, cur_v, g.seen_v)
            b_v = g.values.layer_basis(i).mT
        low = LowRankKV(
            token_k=a_k, layer_k=b_k, rank_k=g.keys.rank,
            token_v=a_v, layer_v=b_v, rank_v=g.values.rank if g.values is not None else None,
            num_heads=g.heads, head_dim=g.head_dim, value_dim=g.value_dim,
            owner=i == 0, pre_rope=self.pre_rope, group=g.layers,
            rope=self._rotary if self.pre_rope else None,
        )  # fmt: skip
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
        seg.stats = self._stats(g, i, low, valid)
        return seg

    def _identity(self, inp: CompressionInput) -> KVSegment:
        """Rate 0: the context as is (what the curriculum starts from)."""
        seg = identity_segment(inp, with_assignment=True)
        base = self._baseline(
            inp.context_mask.sum(1), inp.keys.shape[1], inp.keys.shape[-1], inp.values.shape[-1]
        ).sum()
        one = torch.ones((), device=inp.keys.device)
        seg.stats = {
            "kv_bytes": base.float().to(one.device),
            "kv_bytes_ratio": one,
            "keep_ratio": one,
        }
        return seg

    def _baseline(self, context_tokens: torch.Tensor, heads: int, dk: int, dv: int) -> torch.Tensor:
        """Uncompressed 16-bit context cache per sample and layer, [B] float64 (MLA: the latent
        ``c_kv ‖ k_pe`` once, as deployed)."""
        width = dk if self._latent else dk + dv
        return context_tokens.double() * heads * width * self.config.cache_dtype_bytes

    @torch.no_grad()
    def _stats(self, g: _Group, i: int, low: LowRankKV, valid: torch.Tensor) -> dict:
        """Per-layer scalars: bytes (factors), ranks, captured energy, reconstruction error."""
        dt = self.config.cache_dtype_bytes
        kv = low.nbytes(valid, dt).sum()
        base = self._baseline(g.context_tokens, g.heads, g.head_dim, g.value_dim).sum()
        n_ctx = g.context_tokens.sum().double().clamp_min(1.0)
        stats: dict[str, torch.Tensor] = {
            "kv_bytes": kv,
            "kv_bytes_ratio": kv / base.clamp_min(1.0),
            "keep_ratio": valid.sum() / n_ctx,
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


def _rel_error(side: _Side, i: int, token: torch.Tensor | None) -> torch.Tensor:
    """||X̂_i - X_i||_F / ||X_i||_F over the batch (X_i: the rows factorised)."""
    assert token is not None
    x = side.x[i].detach().float()
    x_hat = token.detach() @ side.layer_basis(i).mT
    return (x_hat - x).norm() / x.norm().clamp_min(1e-30)


def _prefix(value: Any, T: int, L: int) -> Any:
    """A forward argument cut to the first L tokens when it has a token axis of length T."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == T:
        return value[:, :L]
    return value


def _check_token_compressor(token: KVCompressor, config: XKVConfig) -> None:
    """The combined mode's constraints (see the module docstring)."""
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
