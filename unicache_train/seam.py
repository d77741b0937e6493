"""The compression seam's contract: what attention hands a KV compressor and what it gets back.

This module imports only torch: the model (:mod:`unicache_train.model`) and the compressors
(:mod:`unicache_train.compress`) both build on it and never on each other.

A compressor is a pure function of tensors, called inside the autograd graph at one named point
of attention (``Attention._compress_context``). It sees one layer's context K/V and returns a
*segment*: the compressed context cache that the continuation tokens attend to. Training (one
parallel forward over context + continuation) and inference (prefill, compress, decode) call the
same function, so what the model learns to tolerate is exactly what it meets when deployed.

Shapes: ``B, H, T, D, M`` = batch, KV heads, tokens, head dim, entries kept in the segment.

Optional segment fields (all default to ``None``; attention ignores them) describe how the entries
are *stored*: ``head_groups`` (KV heads that share one stored copy after head merging),
``assignment`` (which entry each input token went to), ``quant`` (the packed integer storage
whose bytes :func:`stored_kv_bytes` counts) and ``lowrank`` (the low-rank factors of a
cross-layer compressor, xKV, whose bytes it counts instead of the reconstruction). The
``keys``/``values`` a segment carries are always the attention view: ``[B, H_kv, M, D]``
floating point, every member head of a group holding the group's K/V, quantized entries already
dequantized (with a straight-through gradient) and low-rank ones reconstructed.

KV byte accounting lives here too, one function family that every cache of the package calls
(the compressors' stats, the decoding cache, xKV's factors, the model's uncompressed cache):
:func:`uncompressed_kv_bytes`, :func:`stored_kv_bytes`, :func:`segment_kv_bytes`,
:func:`pooled_kv_bytes`. Their words (docs/architecture.md#words): **rate** is the fraction of
context tokens removed; **reduction** (``kv_reduction``) is uncompressed 16-bit bytes / stored
bytes, ``4.0`` = 4x fewer KV bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "KVSegment",
    "CompressionInput",
    "KVCompressor",
    "ScheduledCompressor",
    "curriculum_scale",
    "IdentityCompressor",
    "RecordingCompressor",
    "RecordedContext",
    "CrossLayerCompressor",
    "identity_segment",
    "QuantizedKV",
    "QUANT_GRANULARITIES",
    "LowRankKV",
    "pack_int4",
    "unpack_int4",
    "dequantize",
    "find_cross_layer",
    "kv_width",
    "uncompressed_kv_bytes",
    "stored_heads",
    "stored_kv_bytes",
    "segment_kv_bytes",
    "pooled_kv_bytes",
    "MODALITY_NAMES",
    "NUM_MODALITIES",
]

#: Modality ids used throughout the package: ``modality_ids == i`` means ``MODALITY_NAMES[i]``.
MODALITY_NAMES: tuple[str, ...] = ("text", "vision", "audio")
NUM_MODALITIES = len(MODALITY_NAMES)


#: Scale granularities of :class:`QuantizedKV` (``QuantizeConfig.granularity``'s choices).
QUANT_GRANULARITIES = ("token_head", "head", "channel", "channel_group")


@dataclass
class QuantizedKV:
    """Packed integer storage of a segment's K/V (what an inference cache would hold).

    Symmetric quantization ``x ~= q * scale`` with ``q`` in ``[-qmax, qmax]``,
    ``qmax = 2**(bits-1) - 1``. Rows of invalid (padding) entries hold zeros.

    Attributes:
        bits: 8 or 4.
        granularity: the keys' scales (and the values' unless ``value_granularity`` says
            otherwise): ``"token_head"`` (one scale per token per head), ``"head"`` (one scale
            per head over the whole segment of a sample), ``"channel"`` (one scale per feature
            per head over the segment of a sample) or ``"channel_group"`` (one scale per
            feature per head for each group of ``group_size`` consecutive entries of a sample:
            KIVI's keys).
        k_data: int8 ``[B, H_kv, M, D]`` (bits 8) or uint8 ``[B, H_kv, M, ceil(D/2)]`` (bits 4,
            two values per byte, low nibble first).
        v_data: as ``k_data`` (with the values' last dim).
        k_scale: ``[B, H_kv, M]`` (token_head), ``[B, H_kv]`` (head), ``[B, H_kv, D]``
            (channel) or ``[B, H_kv, ceil(M / group_size), D]`` (channel_group), fp16 or fp32.
        v_scale: as ``k_scale``, at the values' granularity.
        head_dim: D of the keys (needed to unpack an odd D from int4).
        value_dim: D of the values when it differs from the keys' (MLA: latent rank), else None.
        latent: MLA's latent cache ``[c_kv ‖ k_pe]``, stored once in two parts with their own
            scales: ``v_data``/``v_scale`` hold its first ``value_dim`` features (``c_kv``, which
            are also the values), ``k_data``/``k_scale`` the remaining ``head_dim - value_dim``
            (``k_pe``). The dequantized keys are the two parts concatenated, the values a view of
            the first. (One scale over both would let the RoPE key's range, often far above the
            normed ``c_kv``'s, flatten ``c_kv`` to a few levels at int4.) Both parts have
            ``granularity``.
        value_granularity: the values' granularity when it differs from the keys' (KIVI's
            split: keys ``"channel_group"``, values ``"token_head"``), else None.
        group_size: entries per group when either granularity is ``"channel_group"``, else
            None.
    """

    bits: int
    granularity: str
    k_data: torch.Tensor
    v_data: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    head_dim: int
    value_dim: int | None = None
    latent: bool = False
    value_granularity: str | None = None
    group_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("granularity", "value_granularity"):
            value = getattr(self, name)
            if value is not None and value not in QUANT_GRANULARITIES:
                raise ValueError(
                    f"QuantizedKV.{name}={value!r} is not allowed; choose one of "
                    f"{list(QUANT_GRANULARITIES)}"
                )
        if "channel_group" in (self.granularity, self.v_granularity) and not (
            isinstance(self.group_size, int) and self.group_size >= 1
        ):
            raise ValueError(
                f"QuantizedKV.group_size={self.group_size!r}: a 'channel_group' granularity "
                "needs an integer group_size in [1, inf]"
            )

    @property
    def v_granularity(self) -> str:
        """The values' granularity (``value_granularity``, else ``granularity``)."""
        return self.granularity if self.value_granularity is None else self.value_granularity


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [..., D] -> uint8 [..., ceil(D / 2)], low nibble first."""
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    u = (q.to(torch.int16) & 0x0F).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [..., ceil(D / 2)] -> int8 [..., D]."""
    lo = (packed & 0x0F).to(torch.int16)
    hi = (packed >> 4).to(torch.int16)
    both = torch.stack([lo, hi], -1).flatten(-2)[..., :dim]
    return torch.where(both > 7, both - 16, both).to(torch.int8)


def broadcast_scale(
    scale: torch.Tensor,
    granularity: str,
    group_size: int | None = None,
    entries: int | None = None,
) -> torch.Tensor:
    """Scales of one :attr:`QuantizedKV.granularity` (``[B, H, M]`` token_head, ``[B, H]`` head,
    ``[B, H, D]`` channel) as a view that broadcasts against ``[B, H, M, D]`` values; the
    ``[B, H, ceil(M / G), D]`` scales of channel_group (``group_size`` G, ``entries`` M) as a
    ``[B, H, M, D]`` tensor, each group's row repeated over its entries (a copy)."""
    if granularity == "token_head":
        return scale[..., None]
    if granularity == "channel":
        return scale[:, :, None, :]
    if granularity == "channel_group":
        if group_size is None or entries is None:
            raise ValueError("broadcast_scale('channel_group') needs group_size and entries")
        return scale.repeat_interleave(group_size, 2)[:, :, :entries]
    return scale[:, :, None, None]


def dequantize(quant: QuantizedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed storage -> (keys, values) float32 [B, H, M, D] (a latent's values: the keys' first
    ``value_dim`` features, a view)."""

    def one(data: torch.Tensor, scale: torch.Tensor, dim: int, granularity: str) -> torch.Tensor:
        q = unpack_int4(data, dim) if quant.bits == 4 else data
        s = scale.float()
        s = torch.where(s > 0, s, torch.ones_like(s))
        return q.float() * broadcast_scale(s, granularity, quant.group_size, data.shape[2])

    v_dim = quant.value_dim if quant.value_dim is not None else quant.head_dim
    kg, vg = quant.granularity, quant.v_granularity
    if quant.latent:  # [c_kv ‖ k_pe], each part with its own scales (both at ``granularity``)
        c = one(quant.v_data, quant.v_scale, v_dim, kg)
        k = torch.cat([c, one(quant.k_data, quant.k_scale, quant.head_dim - v_dim, kg)], -1)
        return k, k[..., :v_dim]
    k = one(quant.k_data, quant.k_scale, quant.head_dim, kg)
    return k, one(quant.v_data, quant.v_scale, v_dim, vg)


@dataclass
class LowRankKV:
    """Low-rank factors of one layer's segment (xKV, :mod:`unicache_train.compress.xkv`).

    Per sample ``b``, the entries' keys of this layer (flattened over heads) are
    ``token_k[b] @ layer_k[b]`` and likewise the values. The token-side factor is shared by the
    layers of a cross-layer group (the same values on every member's segment; only the group's
    first layer, the ``owner``, counts its bytes); the feature-side factor is this layer's own.
    Columns at or beyond a sample's rank are zero and not counted.

    Attributes:
        token_k: [B, M, r_k] token-side factor of the keys (``U_r Sigma_r``).
        layer_k: [B, r_k, H_kv * D_k] this layer's rows of the feature-side basis, transposed.
        rank_k: [B] long, rank kept per sample.
        token_v, layer_v, rank_v: the values' factors; None when the values are the first
            ``value_dim`` features of the keys (MLA's latent cache: ``values = c_kv``).
        num_heads: H_kv.
        head_dim: D_k.
        value_dim: D_v.
        owner: this layer stores (and counts) the group's token-side factors.
        pre_rope: the keys are factorised before RoPE; whoever reads them rotates them at the
            entries' positions after reconstruction.
        group: the layers sharing the token-side factors.
        rope: the model's rotary embedding (``positions, dtype -> cos, sin``) that rotates the
            reconstructed pre-RoPE keys; None when ``pre_rope`` is False.
    """

    token_k: torch.Tensor
    layer_k: torch.Tensor
    rank_k: torch.Tensor
    token_v: torch.Tensor | None
    layer_v: torch.Tensor | None
    rank_v: torch.Tensor | None
    num_heads: int
    head_dim: int
    value_dim: int
    owner: bool
    pre_rope: bool
    group: tuple[int, ...]
    rope: Any = None

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, H_kv, M, D_k] (pre-RoPE when ``pre_rope``) and values [B, H_kv, M, D_v]."""
        B, M = self.token_k.shape[:2]
        H = self.num_heads
        k = (self.token_k @ self.layer_k).view(B, M, H, self.head_dim).transpose(1, 2)
        if self.token_v is None:
            return k, k[..., : self.value_dim]
        assert self.layer_v is not None
        v = (self.token_v @ self.layer_v).view(B, M, H, self.value_dim).transpose(1, 2)
        return k, v

    def nbytes(self, valid: torch.Tensor, dtype_bytes: int = 2) -> torch.Tensor:
        """Stored bytes per sample: token-side factors (owner only, valid rows x rank) plus this
        layer's feature-side factors (rank x width), for K and for V.

        Args:
            valid: [B, M] bool, the segment's valid entries.

        Returns:
            [B] float64.
        """
        n = valid.sum(1).double()  # [B]
        owner = float(self.owner)
        total = self.rank_k.double() * (owner * n + self.layer_k.shape[-1])
        if self.rank_v is not None and self.layer_v is not None:
            total = total + self.rank_v.double() * (owner * n + self.layer_v.shape[-1])
        return total * dtype_bytes

    def detach(self) -> LowRankKV:
        """The same factors without autograd history (what a cache stores)."""

        def d(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.detach()

        return LowRankKV(
            self.token_k.detach(),
            self.layer_k.detach(),
            self.rank_k,
            d(self.token_v),
            d(self.layer_v),
            self.rank_v,
            self.num_heads,
            self.head_dim,
            self.value_dim,
            self.owner,
            self.pre_rope,
            self.group,
            self.rope,
        )


@dataclass
class CompressionInput:
    """One layer's context, as seen at the compression seam.

    Attributes:
        layer_idx: index of the decoder layer.
        num_layers: depth of the decoder (for layer schedules).
        queries: [B, H_q, T, D] post-RoPE queries (for observation-window attention statistics).
        keys: [B, H_kv, T, D] keys (post-RoPE unless the compressor sets ``pre_rope = True``).
        values: [B, H_kv, T, D].
        positions: [B, T] original token positions.
        modality_ids: [B, T] 0 text, 1 vision, 2 audio.
        context_mask: [B, T] bool, True for context tokens (``t < split``); only these may enter
            the segment.
        latent: True for MLA's latent cache (one KV head ``[c_kv ‖ k_pe]``, values ``c_kv``:
            the keys' first ``D_v`` features, which a deployed cache stores once).
        fit: what a :class:`CrossLayerCompressor` fitted on the recording pass of this forward
            (the decoder sets it on every layer's input of the compressed pass); None
            otherwise.
    """

    layer_idx: int
    num_layers: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    modality_ids: torch.Tensor
    context_mask: torch.Tensor
    latent: bool = False
    fit: Any = None


@dataclass
class KVSegment:
    """A (compressed) context cache for one layer.

    Attributes:
        keys: [B, H_kv, M, D] (post-RoPE unless produced by a ``pre_rope`` compressor).
        values: [B, H_kv, M, D].
        positions: [B, M] original position of each entry (merged entries: the position chosen
            by the merge rule).
        modality_ids: [B, M].
        counts: [B, M] float, how many original tokens an entry stands for (1 for kept tokens);
            attention adds ``log(count)`` to the entry's logit, as token merging does.
        valid: [B, M] bool; invalid entries are padding and never attended.
        stats: scalar diagnostics for logging (``rate_realized``, ``kv_bytes``,
            ``kv_reduction``, ...).
        head_groups: [B, H_kv] long or None. Group id of each KV head after head merging (the
            id is the smallest head index of the group, so ``head_groups[b, g] == g`` marks the
            stored copy). Member heads carry identical K/V; storage counts one copy per group.
            None means every head is stored.
        assignment: [B, T] long or None. For each input token, the entry it went to (kept or
            merged into); -1 for evicted and non-context tokens.
        quant: packed storage when the segment was quantized, else None.
        lowrank: low-rank factors when a cross-layer compressor (xKV) emitted the segment; the
            ``keys``/``values`` are then their reconstruction, and :func:`stored_kv_bytes`
            counts the factors.
        identity: True only when ``keys``/``values`` are the layer's own K/V of all ``T`` input
            tokens untouched, ``valid`` is the context mask and every count is 1: attention over
            the segment then *is* causal attention over the sequence, and the seam takes the
            causal kernel (set by :class:`IdentityCompressor` and :class:`RecordingCompressor`; any
            step that changes the entries must leave it False).
        latent: the values are the keys' first ``D_v`` features (MLA's latent ``[c_kv ‖ k_pe]``
            with ``values = c_kv``), so the segment is stored once (:func:`segment_kv_bytes`
            counts the keys only, a decoding cache keeps no second copy). Set by
            :func:`identity_segment` on a latent input and kept by every step that changes a
            latent's entries without pulling K and V apart (UniCache's merge and quantization);
            False whenever K and V may differ (both are then stored and counted).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    modality_ids: torch.Tensor
    counts: torch.Tensor
    valid: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    head_groups: torch.Tensor | None = None
    assignment: torch.Tensor | None = None
    quant: QuantizedKV | None = None
    lowrank: LowRankKV | None = None
    identity: bool = False
    latent: bool = False

    def __post_init__(self) -> None:
        # Selections are per layer: one token set (positions, counts, valid [B, M]) for every
        # KV head of the layer; a selection that scores per head averages over heads before it
        # ranks (docs/compression_methods.md#selection-is-per-layer). A per-head mask would be
        # silently broadcast by every attention kernel, so it is refused here.
        if self.valid.dim() != 2 or self.positions.dim() != 2:
            raise ValueError(
                f"KVSegment.valid {tuple(self.valid.shape)} and positions "
                f"{tuple(self.positions.shape)} must be [B, M]: a segment keeps one token set for "
                "every KV head of a layer (per-head selection is not supported; see "
                "docs/compression_methods.md#selection-is-per-layer)"
            )


@runtime_checkable
class KVCompressor(Protocol):
    """Anything callable as ``compressor(inp) -> KVSegment``."""

    pre_rope: bool

    def __call__(self, inp: CompressionInput) -> KVSegment: ...


@runtime_checkable
class ScheduledCompressor(KVCompressor, Protocol):
    """A compressor that owns a rate schedule (a curriculum from rate 0 to its configured rate).

    The training loop tells it where it is, and nothing else: the compressor decides its rate and
    never writes it into its config. ``at_step(step)`` moves to optimizer step ``step`` of the
    schedule; ``at_step(None)`` to its end (evaluation, serving). Returns the rate scale in force
    (the factor in [0, 1] applied to every configured rate).
    """

    def at_step(self, step: int | None) -> float: ...


def curriculum_scale(step: int | None, curriculum_steps: int, final: float = 1.0) -> float:
    """A linear schedule's rate scale at optimizer step ``step``: from 0 to ``final`` over
    ``curriculum_steps`` steps (``final`` when ``curriculum_steps`` is 0 or ``step`` is None)."""
    if step is None or curriculum_steps <= 0:
        return final
    return final * min(1.0, max(0, step) / curriculum_steps)


def identity_segment(
    inp: CompressionInput,
    keys: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    *,
    head_groups: torch.Tensor | None = None,
    with_assignment: bool = False,
    identity: bool = False,
    latent: bool | None = None,
) -> KVSegment:
    """Every context token as its own entry (rate 0 on the token axis).

    Args:
        inp: the seam's input (positions, modalities and ``context_mask`` become the entries').
        keys, values: [B, H_kv, T, D] the K/V to store (default: the input's; a step that merged
            heads passes its merged K/V with ``head_groups``).
        head_groups: [B, H_kv] group id per KV head after head merging, or None.
        with_assignment: fill ``assignment`` (token ``t`` went to entry ``t``; -1 outside the
            context).
        identity: mark the segment as the untouched context, so the seam takes the causal
            kernel (only when ``keys``/``values`` are the input's and nothing changes them
            later).
        latent: the values are the keys' first features (:attr:`KVSegment.latent`); default:
            a latent input (``inp.latent``) whose ``keys``/``values`` are the input's own.

    Returns:
        :class:`KVSegment` whose ``keys``/``values`` are the given tensors themselves (no copy),
        every count 1, ``valid`` the context mask.
    """
    keys = inp.keys if keys is None else keys
    values = inp.values if values is None else values
    if latent is None:
        latent = inp.latent and keys is inp.keys and values is inp.values
    assignment = None
    if with_assignment:
        t = torch.arange(inp.positions.shape[1], device=inp.positions.device)
        assignment = torch.where(inp.context_mask, t, -1)  # [B, T]
    return KVSegment(
        keys=keys,
        values=values,
        positions=inp.positions,
        modality_ids=inp.modality_ids,
        counts=torch.ones_like(inp.positions, dtype=keys.dtype),
        valid=inp.context_mask,
        head_groups=head_groups,
        assignment=assignment,
        identity=identity,
        latent=latent,
    )


class IdentityCompressor:
    """Keeps every context token unchanged (rate 0). The in-loop forward with this compressor
    computes exactly the plain causal forward: the reference every real compressor is tested
    against."""

    pre_rope = False

    def __call__(self, inp: CompressionInput) -> KVSegment:
        return identity_segment(inp, identity=True)


class RecordingCompressor:
    """Keeps, per layer, what the seam handed over and the segment that went back.

    With ``inner`` it wraps that compressor (a prefill that stores each layer's segment in a
    decoding cache, an evaluation that inspects them); ``inner`` is the attribute
    :func:`find_cross_layer` looks through. Without, it returns the context unchanged: the
    plain prefill (``identity`` segments, the seam runs causal attention), e.g. the recording
    pass of a cross-layer compressor.

    With ``pre_rope`` the seam rotates the returned segment's keys in place after the call, so
    ``segments[l].keys`` end up post-RoPE while ``inputs[l].keys`` stay pre-RoPE.

    Args:
        inner: the compressor to wrap, or None for the identity.
        pre_rope: whether the seam hands over pre-RoPE keys (default: ``inner``'s, else False).
    """

    def __init__(self, inner: KVCompressor | None = None, *, pre_rope: bool | None = None) -> None:
        self.inner = inner
        if pre_rope is None:
            pre_rope = bool(getattr(inner, "pre_rope", False))
        self.pre_rope = pre_rope
        self.inputs: dict[int, CompressionInput] = {}
        self.segments: dict[int, KVSegment] = {}

    def __call__(self, inp: CompressionInput) -> KVSegment:
        if self.inner is None:
            seg = identity_segment(inp, identity=True)
        else:
            seg = self.inner(inp)
        self.inputs[inp.layer_idx] = inp
        self.segments[inp.layer_idx] = seg
        return seg

    def compress_window(self, inp: CompressionInput) -> KVSegment | None:
        """``inner``'s segment for a sliding-window layer, if it makes one (not recorded here:
        the seam records a windowed layer's segment itself)."""
        fn = getattr(self.inner, "compress_window", None)
        return None if fn is None else fn(inp)


@dataclass
class RecordedContext:
    """Every layer's context as the decoder's recording pass saw it: what a
    :class:`CrossLayerCompressor` fits on.

    Attributes:
        inputs: layer -> the :class:`CompressionInput` the seam handed over (keys pre-RoPE when
            the compressor is ``pre_rope``).
        segments: layer -> the identity segment that went back; the seam rotated a pre-RoPE
            compressor's keys in place, so these keys are post-RoPE.
        prefill: ``S = max(split)``, the tokens recorded as context (the inputs may cover more:
            the whole sequence when the recording pass doubles as the uncompressed forward).
        rope: the model's rotary table, ``(positions [B, M], dtype) -> (cos, sin)`` each
            ``[B, M, D_rope]``: rotates pre-RoPE keys at an entry's position
            (``unicache_train.ops.rope.apply_rope``).
    """

    inputs: dict[int, CompressionInput]
    segments: dict[int, KVSegment]
    prefill: int
    rope: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class CrossLayerCompressor(Protocol):
    """A compressor whose segment of a layer depends on other layers' context K/V (xKV).

    The decoder drives both passes (:meth:`unicache_train.model.Decoder.forward`): when
    ``records_context``, it runs the stack over the context with a
    :class:`RecordingCompressor` (with gradients when ``record_with_grad``), calls
    :meth:`fit` on what it recorded, then runs the compressed pass with the fit in every
    layer's :attr:`CompressionInput.fit`. Otherwise (rate 0) the compressor serves each layer
    without a fit.
    """

    cross_layer: bool
    pre_rope: bool

    @property
    def records_context(self) -> bool: ...

    @property
    def record_with_grad(self) -> bool: ...

    def fit(self, context: RecordedContext, step: int | None = None) -> Any: ...

    def __call__(self, inp: CompressionInput) -> KVSegment: ...


def find_cross_layer(compressor: object) -> CrossLayerCompressor | None:
    """The cross-layer compressor (xKV) behind ``compressor``, or None.

    A cross-layer compressor declares ``cross_layer = True`` (see
    :class:`CrossLayerCompressor`). Wrappers (segment captures such as
    :class:`RecordingCompressor`) expose what they wrap as ``inner`` and are looked through.
    """
    seen = 0
    while compressor is not None and seen < 16:
        if getattr(compressor, "cross_layer", False):
            return compressor  # type: ignore[return-value]
        compressor = getattr(compressor, "inner", None)
        seen += 1
    return None


# --------------------------------------------------------------------------------- KV bytes
def kv_width(key_dim: int, value_dim: int, latent: bool = False) -> int:
    """Elements a token stores per KV head: ``D_k + D_v``, or ``D_k`` alone for MLA's latent
    cache (keys ``[c_kv ‖ k_pe]``, values the keys' first ``D_v`` features, stored once)."""
    return key_dim if latent else key_dim + value_dim


def uncompressed_kv_bytes(
    tokens: torch.Tensor | int,
    heads: int,
    key_dim: int,
    value_dim: int,
    *,
    latent: bool = False,
    dtype_bytes: int = 2,
) -> torch.Tensor | int:
    """Bytes of an uncompressed cache: ``tokens * heads * kv_width * dtype_bytes`` (16-bit by
    default: the numerator of every ``kv_reduction``).

    Args:
        tokens: [B] tokens per sample (a tensor: float64 out) or an int (an int out).
        heads: KV heads (1 for MLA's latent cache).
        key_dim, value_dim: ``D_k``, ``D_v``.
        latent: MLA's latent cache (see :func:`kv_width`).
        dtype_bytes: bytes per element.
    """
    per_token = heads * kv_width(key_dim, value_dim, latent) * dtype_bytes
    if isinstance(tokens, torch.Tensor):
        return tokens.double() * per_token
    return tokens * per_token


def stored_heads(head_groups: torch.Tensor) -> torch.Tensor:
    """[B, H] group id per KV head (the smallest member's index) -> [B] long, the heads
    stored (one copy per group)."""
    H = head_groups.shape[1]
    return (head_groups == torch.arange(H, device=head_groups.device)).sum(1)


def stored_kv_bytes(
    valid: torch.Tensor,
    heads: torch.Tensor,
    key_dim: int,
    value_dim: int,
    *,
    quant: QuantizedKV | None = None,
    lowrank: LowRankKV | None = None,
    latent: bool = False,
    dtype_bytes: int = 2,
) -> torch.Tensor:
    """Stored bytes of one layer's (compressed) context per sample, K then V.

    * low-rank factors (xKV): the factors, not their reconstruction (:meth:`LowRankKV.nbytes`);
    * packed integers, K and V each at its own granularity: valid entries x stored heads x
      (payload at its element size + one scale per vector: ``"token_head"``), or one scale per
      stored head and sample (``"head"``), one per feature of each stored head and sample
      (``"channel"``), or ``ceil(n / group_size)`` x one per feature of each stored head, ``n``
      the sample's valid entries (``"channel_group"``: the groups a cache of the ``n`` kept
      entries holds);
    * floating: valid entries x stored heads x ``D`` x ``dtype_bytes`` (the deployed cache
      dtype, not the fp32 of a CPU run).

    Per-entry metadata (merge counts, positions) is not counted here: one scalar per entry
    against ``2 * H_kv * D`` payload values (:class:`~unicache_train.model.compressed_cache.
    StoredSegment` adds what a decoding cache must keep).

    Args:
        valid: [B, M] bool, the entries.
        heads: [B] stored KV heads per sample (:func:`stored_heads` after head merging).
        key_dim, value_dim: ``D_k``, ``D_v`` of the floating K/V.
        quant: the packed storage, if quantized.
        lowrank: the low-rank factors, if any (they carry their own widths).
        latent: the values are the keys' first ``D_v`` features and are not stored again (MLA's
            latent cache, :attr:`KVSegment.latent`); K and V changed apart are both stored.
            Packed storage says it itself (:attr:`QuantizedKV.latent`: the latent's two parts).
        dtype_bytes: bytes per floating element.

    Returns:
        [B] float64.
    """
    if lowrank is not None:
        return lowrank.nbytes(valid, dtype_bytes)
    n = valid.sum(1).double()  # [B]
    g = heads.double()
    if quant is None:
        return g * n * kv_width(key_dim, value_dim, latent) * dtype_bytes
    total = torch.zeros_like(n)
    # K and V, or a latent's two parts (c_kv, k_pe; both at ``granularity``): each its own
    # payload and scales
    v_gran = quant.granularity if quant.latent else quant.v_granularity
    parts = (
        (quant.k_data, quant.k_scale, quant.granularity),
        (quant.v_data, quant.v_scale, v_gran),
    )
    for data, scale, gran in parts:
        payload = data.shape[-1] * data.element_size()  # bytes per stored vector
        if gran == "token_head":
            total = total + g * n * (payload + scale.element_size())
        elif gran == "channel_group":  # one scale per feature per group of the valid entries
            assert quant.group_size is not None
            groups = torch.ceil(n / quant.group_size)
            total = total + g * n * payload + g * groups * scale.shape[-1] * scale.element_size()
        else:  # per sample and head: one scale ("head") or one per feature ("channel")
            per_head = scale.shape[-1] if gran == "channel" else 1
            total = total + g * n * payload + g * per_head * scale.element_size() * (n > 0)
    return total


def segment_kv_bytes(
    segment: KVSegment, dtype_bytes: int = 2, *, latent: bool | None = None
) -> torch.Tensor:
    """:func:`stored_kv_bytes` of a seam segment (one copy per head group).

    ``latent`` (default: the segment's own :attr:`KVSegment.latent`) counts the keys only: the
    values are their first features and are not stored again.

    Returns:
        [B] float64.
    """
    B, H = segment.keys.shape[:2]
    if latent is None:
        latent = segment.latent
    if segment.head_groups is not None:
        heads = stored_heads(segment.head_groups)
    else:
        heads = torch.full((B,), H, device=segment.valid.device)
    return stored_kv_bytes(
        segment.valid,
        heads,
        segment.keys.shape[-1],
        segment.values.shape[-1],
        quant=segment.quant,
        lowrank=segment.lowrank,
        latent=latent,
        dtype_bytes=dtype_bytes,
    )


def pooled_kv_bytes(
    per_layer: Iterable[Mapping[str, torch.Tensor | float]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored, uncompressed) bytes of one forward, summed over the layers whose stats report
    ``kv_bytes`` (identity segments of a compressor without byte stats are skipped).

    A forward's reduction is ``uncompressed / stored``, not the mean of the layers'
    ``kv_reduction`` (a mean of ratios).

    Args:
        per_layer: one stats dict per layer (``DecoderOutput.compression_stats``), with
            ``kv_bytes`` and ``kv_reduction`` per layer.

    Returns:
        Two 0-dim float64 tensors.
    """
    stored = uncompressed = torch.zeros((), dtype=torch.float64)
    for st in per_layer:
        if "kv_bytes" not in st:
            continue
        kv = torch.as_tensor(st["kv_bytes"]).detach().double()
        reduction = torch.as_tensor(st["kv_reduction"]).detach().double()
        stored = stored.to(kv.device) + kv
        uncompressed = uncompressed.to(kv.device) + kv * reduction
    return stored, uncompressed
