"""The compressed decoding cache: one compressed context segment per layer plus the decoded
tokens' K/V (beside :mod:`unicache_train.model.kv_cache`'s plain caches).

Shape legend: B, Hk, G, M, S, T, D = batch, KV heads, stored head groups, segment entries,
decoded tokens, new tokens of a call, head dim.

::

    CompressedKVCache, per layer:  stored segment (packed int8/int4 + scales when quantized,
                                   one copy per head group, counts, valid)  +  decoded K/V [S]
                                                                                   │
    decode step: new token ─► q,k,v ─► attend(): [segment (+log count) ; decoded K/V]

One way in: :meth:`CompressedKVCache.attend` appends a decode call's K/V and attends, and every
decoder reads the cache through it (our attention, MLA, stock transformers ``generate()`` via
:class:`unicache_train.transformers_cache.CompressedCache`, the evaluations that decode with our
loop). Its ``decode_path`` decides how a segment is read (packed bytes at every step, int8 rows,
or a working buffer dequantized once); the one-time work is done by :meth:`CompressedKVCache.
prepare`, which the prefill triggers when it stores each layer's segment, so the first decode
step dequantizes nothing. ``decode_path="reference"`` (dequantize and concatenate at every step)
is the spec the tests compare the others with; no decoder takes it by default.

Sliding-window layers (``windows[l] = W``): the stored segment is the last ``W - 1`` context
tokens unchanged (the seam never compresses them, model/attention.py), and both the segment and
the decoded tokens slide: query position ``p`` sees an entry at position ``q`` iff
``p - W < q <= p``; decoded tokens that no later query can see are dropped from the cache.

A :class:`StoredSegment` is built from the :class:`~unicache_train.seam.KVSegment` a compressor
returned at the seam during the prefill (:func:`unicache_train.model.generate.prefill_compressed`);
it keeps what a deployed cache would hold: the packed storage, one copy per head group, the
factors of a low-rank (xKV) segment.

MLA (``CompressedKVCache(latent=True)``, :mod:`unicache_train.model.mla`): one "KV head" holding
the latent ``[c_kv ‖ k_pe]`` [B, 1, ., R + Dr]; the values are its first ``R`` features. A latent
segment (UniCache merge/evict + quantization, xKV) is stored once (packed once, or the keys'
factors only) and the decoded tokens' latents once; :meth:`CompressedKVCache.attend` runs MLA's
absorbed attention over ``keys [B, 1, M + S, R + Dr]`` and ``values = keys[..., :R]`` and returns
the latent output [B, H, T, R] (MLA applies ``W_uv``). Bytes: a latent
segment counts ``R + Dr`` elements per entry (plus scales), the uncompressed baseline
``(R + Dr) x 2`` bytes per token per layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from unicache_train.model.attention import attention_op, count_bias
from unicache_train.model.kv_cache import KVCache
from unicache_train.ops.decode_attention import decode_attention, triton_reads
from unicache_train.ops.rope import apply_rope
from unicache_train.seam import (
    KVSegment,
    LowRankKV,
    QuantizedKV,
    dequantize,
    stored_kv_bytes,
    uncompressed_kv_bytes,
)

__all__ = ["DECODE_PATHS", "CompressedKVCache", "StoredSegment"]

#: How :meth:`CompressedKVCache.attend` reads a packed segment (see its docstring).
DECODE_PATHS = ("auto", "packed", "int8", "buffer", "reference")


def _int4_rows(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`unicache_train.seam.unpack_int4` by int8 shifts (sign-extending nibbles): the
    same int8 [..., D], without its int16 temporaries (it runs once per layer per prompt)."""
    s = packed.view(torch.int8)
    return torch.stack([(s << 4) >> 4, s >> 4], -1).flatten(-2)[..., :dim].contiguous()


# --------------------------------------------------------------------------------- storage
@dataclass
class StoredSegment:
    """One layer's compressed context as a cache would hold it.

    Attributes:
        head_map: [B, Hk] long, slot in ``G`` of each KV head (head-merged groups share one).
        groups: [B] long, stored head groups per sample.
        quant: packed K/V ``[B, G, M, ...]`` with their scales, or None.
        keys, values: [B, G, M, D] floating K/V when the segment was not quantized, else None.
        counts: [B, M] float, original tokens per entry (attention adds ``log(count)``).
        valid: [B, M] bool.
        context_tokens: [B] long, context length before compression (the byte baseline).
        lowrank: the xKV factors; ``keys``/``values`` are then None and rebuilt on demand
            (keys factorised before RoPE are rotated at ``positions``).
        positions: [B, M] entry positions (read by ``lowrank`` pre-RoPE keys and by a sliding
            window).
        latent: the values are the keys' first ``value_dim`` features (MLA's latent, stored
            once: ``values`` is a view of ``keys``; packed storage holds it in two parts, ``c_kv``
            and ``k_pe`` with their own scales).
        key_dim, value_dim: ``D_k``, ``D_v`` of the attention view (the byte baseline's widths).
    """

    head_map: torch.Tensor
    groups: torch.Tensor
    quant: QuantizedKV | None
    keys: torch.Tensor | None
    values: torch.Tensor | None
    counts: torch.Tensor
    valid: torch.Tensor
    context_tokens: torch.Tensor
    lowrank: LowRankKV | None = None
    positions: torch.Tensor | None = None
    latent: bool = False
    key_dim: int = 0
    value_dim: int = 0

    @classmethod
    def from_segment(cls, seg: KVSegment, context_tokens: torch.Tensor) -> StoredSegment:
        """Keep one copy per head group (plus a head -> slot map); packed storage as is; the
        factors of a low-rank (xKV) segment instead of its reconstruction; a latent segment
        (:attr:`KVSegment.latent`, or low-rank factors of the keys only) once."""
        B, Hk = seg.keys.shape[:2]
        dk, dv = seg.keys.shape[-1], seg.values.shape[-1]
        if seg.lowrank is not None:
            return cls(
                head_map=torch.arange(Hk, device=seg.keys.device).expand(B, Hk),
                groups=torch.full((B,), Hk, dtype=torch.long, device=seg.keys.device),
                quant=None,
                keys=None,
                values=None,
                counts=seg.counts.detach(),
                valid=seg.valid,
                context_tokens=context_tokens,
                lowrank=seg.lowrank.detach(),
                positions=seg.positions,
                latent=seg.latent or seg.lowrank.token_v is None,
                key_dim=dk,
                value_dim=dv,
            )
        if seg.head_groups is None:
            head_map = torch.arange(Hk, device=seg.keys.device).expand(B, Hk)
            order = head_map
            groups = torch.full((B,), Hk, dtype=torch.long, device=seg.keys.device)
        else:
            rep = seg.head_groups == torch.arange(Hk, device=seg.keys.device)  # [B, Hk] stored
            groups = rep.sum(1)
            # Stored heads first, in head order (stable sort), then the members (unused slots).
            order = torch.sort((~rep).long(), dim=1, stable=True).indices  # [B, Hk]
            slot_of = torch.cumsum(rep.long(), 1) - 1  # [B, Hk] slot of a stored head
            head_map = slot_of.gather(1, seg.head_groups)  # [B, Hk]
        G = int(groups.max()) if B else Hk
        idx = order[:, :G]  # [B, G] head stored in each slot

        def take(x: torch.Tensor) -> torch.Tensor:  # [B, Hk, ...] -> [B, G, ...]
            shape = (B, G, *x.shape[2:])
            return x.gather(1, idx.reshape(B, G, *([1] * (x.dim() - 2))).expand(shape))

        quant = keys = values = None
        if seg.quant is not None:
            q = seg.quant
            k_data, k_scale = take(q.k_data), take(q.k_scale)
            v_data, v_scale = take(q.v_data), take(q.v_scale)
            quant = QuantizedKV(
                q.bits,
                q.granularity,
                k_data,
                v_data,
                k_scale,
                v_scale,
                q.head_dim,
                q.value_dim,
                latent=q.latent,
                value_granularity=q.value_granularity,
                group_size=q.group_size,
            )
        elif seg.latent:  # MLA: one latent; the values are a view of its first features
            keys = take(seg.keys.detach())
            values = keys[..., :dv]
        else:
            keys, values = take(seg.keys.detach()), take(seg.values.detach())
        return cls(
            head_map=head_map.contiguous(),
            groups=groups,
            quant=quant,
            keys=keys,
            values=values,
            counts=seg.counts.detach(),
            valid=seg.valid,
            context_tokens=context_tokens,
            latent=seg.latent,
            key_dim=dk,
            value_dim=dv,
        )

    def kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention view: keys, values [B, Hk, M, D] (dequantized, or rebuilt from
        low-rank factors, on the fly)."""
        if self.lowrank is not None:
            return self._reconstruct(dtype)
        if self.quant is not None:
            k, v = dequantize(self.quant)  # [B, G, M, D] float32
        else:
            assert self.keys is not None and self.values is not None
            k, v = self.keys, self.values
        B, Hk = self.head_map.shape

        def spread(x: torch.Tensor) -> torch.Tensor:  # [B, G, M, D] -> [B, Hk, M, D]
            idx = self.head_map[:, :, None, None].expand(B, Hk, *x.shape[2:])
            return x.gather(1, idx).to(dtype)

        return spread(k), spread(v)

    def _reconstruct(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """xKV's selective reconstruction: this layer's K/V from the group's token factor and
        its own factor, then RoPE at the entries' original positions (pre-RoPE keys)."""
        low = self.lowrank
        assert low is not None
        k, v = low.reconstruct()  # [B, Hk, M, D] fp32
        if low.pre_rope:
            if low.rope is None or self.positions is None:
                raise RuntimeError("a pre-RoPE low-rank segment needs its rope and positions")
            cos, sin = low.rope(self.positions, torch.float32)  # [B, M, Dr]
            d = cos.shape[-1]
            if k.shape[-1] != d:  # MLA latent [c_kv ‖ k_pe]: only k_pe is rotated
                k = torch.cat([k[..., :-d], apply_rope(k[..., -d:], cos, sin)], -1)
            else:
                k = apply_rope(k, cos, sin)
        return k.to(dtype), v.to(dtype)

    def payload_bytes(self, cache_dtype_bytes: int = 2) -> int:
        """K/V bytes (:func:`unicache_train.seam.stored_kv_bytes`, as the compressor's own
        ``kv_bytes`` stat counts them): valid entries x stored heads x (payload + scales), for
        K and for V (a latent segment: once); the factors of a low-rank segment."""
        if self.quant is not None:
            dk, dv = self.quant.head_dim, self.quant.value_dim or self.quant.head_dim
        elif self.keys is not None and self.values is not None:
            dk, dv = self.keys.shape[-1], self.values.shape[-1]
        else:
            dk = dv = 0  # low-rank: the factors carry their widths
        stored = stored_kv_bytes(
            self.valid,
            self.groups,
            dk,
            dv,
            quant=self.quant,
            lowrank=self.lowrank,
            latent=self.latent,
            dtype_bytes=cache_dtype_bytes,
        )
        return int(stored.sum().item())

    def metadata_bytes(self) -> int:
        """What a cache stores beside K/V, only when compression made it necessary: per-entry
        merge counts (fp16, exact up to 2048) once any entry stands for several tokens, and the
        head -> slot map (one byte per KV head) once heads were merged."""
        merged_tokens = bool((self.valid & (self.counts > 1)).any())
        merged_heads = bool((self.groups < self.head_map.shape[1]).any())
        counts = 2 * int(self.valid.sum()) if merged_tokens else 0
        return counts + (self.head_map.numel() if merged_heads else 0)

    def baseline_bytes(
        self,
        head_dim: int | None = None,
        value_dim: int | None = None,
        cache_dtype_bytes: int = 2,
        window: int | None = None,
        latent: bool = False,
    ) -> int:
        """The uncompressed 16-bit cache of the same context
        (:func:`unicache_train.seam.uncompressed_kv_bytes`); with a sliding ``window``, the
        ``window - 1`` context tokens such a cache holds at most (not bytes it never stores).

        Args:
            head_dim, value_dim: the widths (default: this segment's ``key_dim``/``value_dim``).
            latent: MLA's latent cache (``head_dim`` elements per token, stored once).
        """
        Hk = self.head_map.shape[1]
        dk = self.key_dim if head_dim is None else head_dim
        dv = (self.value_dim if head_dim is None else head_dim) if value_dim is None else value_dim
        if dk <= 0:
            raise ValueError("baseline_bytes: pass head_dim (this segment does not know its width)")
        held = self.context_tokens if window is None else self.context_tokens.clamp(max=window - 1)
        tokens = int(held.sum())
        return int(
            uncompressed_kv_bytes(tokens, Hk, dk, dv, latent=latent, dtype_bytes=cache_dtype_bytes)
        )


class CompressedKVCache(KVCache):
    """Decoding cache: a compressed context segment per layer plus the decoded tokens' K/V.

    Every decoder reads it through one call, :meth:`attend` (append this call's K/V and attend
    to ``[segment (+ log count) ; decoded]``): our attention (:mod:`unicache_train.model.
    attention`, sliding windows and Gemma's logit softcap included), MLA's absorbed attention
    (:mod:`unicache_train.model.mla`, a latent cache) and stock transformers ``generate()``
    (:mod:`unicache_train.transformers_cache`). ``update`` is not part of it (it raises): the
    per-step dequantize-and-concatenate survives only as ``decode_path="reference"``, the spec
    the other paths are tested against. :meth:`length` counts attended entries, not positions:
    pass ``positions`` explicitly when decoding (the segment stands for more tokens than it
    holds).

    Each layer's working state (the segment bias, the dequantized or unpacked segment of the
    path that needs one) is built by :meth:`prepare`, which :meth:`set_segment` calls when given
    the decoding dtype, as the prefill does: the first decode step dequantizes nothing. A layer
    set without a dtype is prepared at its first :meth:`attend`.

    Args:
        num_layers: decoder depth.
        cache_dtype_bytes: bytes per element of the deployed floating cache (byte accounting).
        windows: per layer, the sliding window in tokens or None (default: no windows). The
            decoded queries of sample ``b`` are at positions ``context_tokens[b] + n`` (the
            prefill's positions continue), which the window compares with entry positions.
        latent: an MLA model's cache (:mod:`unicache_train.model.mla`): one latent head
            ``[c_kv ‖ k_pe]``, decoded latents held once (``values`` unused), the values
            attention reads are the keys' first ``R`` features, and the baseline is the
            uncompressed latent cache. No sliding windows (MLA has none).
        decode_path: how :meth:`attend` reads a layer's segment: ``"auto"`` (default) takes
            ``"packed"`` for a packed segment on CUDA that the Triton kernel reads (K and V at
            one granularity, ``"token_head"``, ``"head"`` or ``"channel"``:
            :func:`~unicache_train.ops.decode_attention.triton_reads`; any when ``backend`` is
            not ``"auto"``) and ``"buffer"`` everywhere else (chosen
            by measurement: the one path at or above a plain cache's tokens/s on CPU at 2k
            tokens, docs/serving.md); ``"int8"`` unpacks an int4 segment once, in
            :meth:`prepare`, into int8 rows (a working copy twice the packed payload, a quarter
            of an fp32 cache; an int8 segment is read as stored) that each step converts to
            float at full width for BLAS; ``"packed"`` reads the packed bytes at every step
            (:func:`unicache_train.ops.decode_attention`: Triton on CUDA, BLAS on half-width
            unpacked nibbles on CPU; nothing segment-sized is kept); ``"buffer"`` dequantizes
            (or rebuilds from low-rank factors) each layer's segment once, in :meth:`prepare`,
            into a working buffer in the model's dtype that the decoded tokens are appended to
            in place (fastest on CPU, but the buffer is as large as an uncompressed cache in
            that dtype: :meth:`working_bytes` reports it, :meth:`kv_bytes` stays the stored
            bytes); ``"reference"`` dequantizes and concatenates at every step (the spec).
            ``"packed"`` and ``"int8"`` read packed, non-latent segments of equal K/V widths in
            layers without a window or softcap (:meth:`reads_packed`); any other layer takes
            ``"buffer"`` (a windowed layer: the materialized segment, then its sliding decoded
            tokens).
        backend: ``decode_path="packed"``'s kernel (:func:`~unicache_train.ops.
            decode_attention.decode_attention`: ``"auto"``, ``"packed"``, ``"triton"``,
            ``"torch"``).
    """

    def __init__(
        self,
        num_layers: int,
        cache_dtype_bytes: int = 2,
        windows: list[int | None] | None = None,
        latent: bool = False,
        decode_path: str = "auto",
        backend: str = "auto",
    ) -> None:
        super().__init__(num_layers)
        if decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path={decode_path!r}; choose one of {DECODE_PATHS}")
        self.decode_path = decode_path
        self.backend = backend
        #: Per layer, from :meth:`prepare`: the path, the dtype and softcap it was built for, the
        #: segment bias [B, M], and the path's tensors (a preallocated ``[segment ; decoded]``
        #: buffer, a windowed layer's materialized segment, int8 rows).
        self._work: list[dict | None] = [None] * num_layers
        self.latent = latent
        self.segments: list[StoredSegment | None] = [None] * num_layers
        self.cache_dtype_bytes = cache_dtype_bytes
        self.stats: list[dict[str, torch.Tensor]] = []
        self.windows: list[int | None] = [None] * num_layers if windows is None else list(windows)
        if len(self.windows) != num_layers:
            raise ValueError(f"windows has {len(self.windows)} entries for {num_layers} layers")
        if latent and any(w is not None for w in self.windows):
            raise ValueError("a latent (MLA) compressed cache has no sliding windows")
        #: Decoded tokens dropped from the front of a windowed layer (out of every window).
        self.dropped: list[int] = [0] * num_layers

    def set_segment(
        self,
        layer_idx: int,
        segment: StoredSegment,
        *,
        dtype: torch.dtype | None = None,
        softcap: float | None = None,
    ) -> None:
        """Store a layer's compressed segment (the prefill's result).

        Args:
            dtype: the dtype decoding will attend in (the model's); given, the layer is
                :meth:`prepare`\ d now, so the prefill pays its one-time dequantization.
            softcap: the layer's attention logit softcap (Gemma 3), for :meth:`prepare`.
        """
        if self.latent and segment.head_map.shape[1] != 1:
            raise ValueError(
                f"layer {layer_idx}: a latent (MLA) cache stores one latent head, got a segment "
                f"with {segment.head_map.shape[1]} KV heads"
            )
        if self.windows[layer_idx] is not None and segment.positions is None:
            raise ValueError(
                f"layer {layer_idx} has a sliding window: its segment needs entry positions"
            )
        self.segments[layer_idx] = segment
        self._work[layer_idx] = None
        if dtype is not None:
            self.prepare(layer_idx, dtype, softcap=softcap)

    def _segment(self, layer_idx: int) -> StoredSegment:
        seg = self.segments[layer_idx]
        if seg is None:
            raise RuntimeError(f"layer {layer_idx} has no compressed segment: prefill first")
        return seg

    def num_decoded(self, layer_idx: int = 0) -> int:
        """Tokens decoded so far (held or, in a windowed layer, dropped)."""
        return self.dropped[layer_idx] + super().length(layer_idx)

    def length(self, layer_idx: int = 0) -> int:
        """Attended entries of a layer: segment slots + held decoded tokens."""
        return self._segment(layer_idx).valid.shape[1] + super().length(layer_idx)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):  # noqa: D102
        raise TypeError(
            "CompressedKVCache is read through attend(layer_idx, q, k, v, scale=, softcap=), "
            "which appends and attends in one call; update() is not part of its API"
        )

    # ------------------------------------------------------------------ the reference path
    def _hold(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k/v [B, Hk, T, D] to the held decoded tokens (a concatenation); returns them
        [B, Hk, S, D]. A windowed layer first drops the decoded tokens that the next query
        (decoded index ``n``) cannot see: those before ``n - W + 1``. Latent cache: only ``k``
        is held (``values`` stay None)."""
        if self.latent:
            held = self.keys[layer_idx]
            self.keys[layer_idx] = k_dec = k if held is None else torch.cat([held, k], 2)
            return k_dec, k_dec[..., : v.shape[-1]]
        W = self.windows[layer_idx]
        held = self.keys[layer_idx]
        if W is not None and held is not None:
            drop = max(0, self.num_decoded(layer_idx) - W + 1 - self.dropped[layer_idx])
            if drop:
                self.keys[layer_idx] = held[:, :, drop:]
                self.values[layer_idx] = self.values[layer_idx][:, :, drop:]  # type: ignore[index]
                self.dropped[layer_idx] += drop
        return super().update(layer_idx, k, v)  # [B, Hk, S, D]

    def _reference_kv(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode_path="reference"``: append k/v, dequantize the segment, and return
        ``[segment ; held decoded]`` keys/values [B, Hk, M + S, D], at every step.

        Latent cache (MLA): ``k`` is the new latents ``[c_kv ‖ k_pe]`` [B, 1, T, R + Dr] and
        ``v`` their ``c_kv`` [B, 1, T, R]; the decoded values are the held keys' first ``R``
        features (the segment's are its own: the keys' first features for a latent segment,
        whatever a compressor that pulled K and V apart stored else)."""
        k_dec, v_dec = self._hold(layer_idx, k, v)
        k_seg, v_seg = self._segment(layer_idx).kv(k.dtype)  # [B, Hk, M, D]
        return torch.cat([k_seg, k_dec], 2), torch.cat([v_seg, v_dec], 2)

    def _bias(self, layer_idx: int, T: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive bias of the last ``T`` decoded queries over ``[segment ; held decoded]``.

        Segment entries: ``log(count)`` where valid (as the in-loop seam), masked elsewhere;
        decoded tokens: causal. A windowed layer also masks entries and decoded tokens at
        or before ``query position - W``.

        Returns:
            [B, 1, T, M + S] (S: held decoded tokens).
        """
        seg = self._segment(layer_idx)
        W = self.windows[layer_idx]
        B, device = seg.valid.shape[0], seg.valid.device
        S = super().length(layer_idx)  # held decoded tokens
        n = torch.arange(T, device=device) + (self.num_decoded(layer_idx) - T)  # [T] query index
        m = torch.arange(S, device=device) + self.dropped[layer_idx]  # [S] held token index
        neg = torch.finfo(dtype).min
        seg_ok = seg.valid[:, None, :].expand(-1, T, -1)  # [B, T, M]
        dec_ok = m[None, :] <= n[:, None]  # [T, S]
        if W is not None:
            assert seg.positions is not None
            q_pos = seg.context_tokens[:, None] + n[None, :]  # [B, T]
            seg_ok = seg_ok & (seg.positions[:, None, :] > q_pos[:, :, None] - W)
            dec_ok = dec_ok & (m[None, :] > n[:, None] - W)
        seg_bias = count_bias(seg.counts, dtype)[:, None, :]  # [B, 1, M]
        seg_part = torch.where(seg_ok, seg_bias, neg)  # [B, T, M]
        zero = torch.zeros((), dtype=dtype, device=device)  # (a float64 min overflows fp32)
        dec_part = torch.where(dec_ok, zero, neg).expand(B, T, S)
        return torch.cat([seg_part.to(dtype), dec_part], dim=-1)[:, None]

    # ------------------------------------------------------------------------ decoding
    def reads_packed(self, layer_idx: int, softcap: float | None = None) -> bool:
        """Whether the packed paths can read this layer: a packed, non-latent segment with
        equal K/V widths (even), in a layer without a sliding window or logit softcap (the
        packed kernels compute plain softmax attention)."""
        seg = self._segment(layer_idx)
        q = seg.quant
        return (
            q is not None
            and softcap is None
            and not self.latent
            and not q.latent
            and q.value_dim in (None, q.head_dim)
            and q.head_dim % 2 == 0
            and self.windows[layer_idx] is None
        )

    def _path(self, layer_idx: int, softcap: float | None, device: torch.device) -> str:
        """The path a layer takes (see the class docstring): ``"reference"``, ``"packed"``,
        ``"int8"``, ``"buffer"`` or ``"window"`` (a windowed layer's buffer)."""
        if self.decode_path == "reference":
            return "reference"
        if self.reads_packed(layer_idx, softcap) and self.decode_path != "buffer":
            if self.decode_path == "auto":
                quant = self._segment(layer_idx).quant
                assert quant is not None
                # CUDA: the Triton kernel, where it reads the segment's scales (with
                # backend="auto"; K and V at one granularity of its table), else the buffer
                kernel = self.backend != "auto" or triton_reads(quant)
                return "packed" if device.type == "cuda" and kernel else "buffer"
            return self.decode_path
        return "window" if self.windows[layer_idx] is not None else "buffer"

    def prepare(self, layer_idx: int, dtype: torch.dtype, *, softcap: float | None = None) -> None:
        """Build a layer's working state for decoding in ``dtype``: the segment bias and, by
        path, the segment dequantized (or rebuilt from its factors) into a working buffer
        (``"buffer"``), or int4 unpacked into int8 rows (``"int8"``). The one dequantization
        of the layer happens here; :meth:`set_segment` calls it when the prefill passes the
        dtype."""
        seg = self._segment(layer_idx)
        device = seg.valid.device
        path = self._path(layer_idx, softcap, device)
        work: dict = {"path": path, "dtype": dtype, "softcap": softcap, "n": 0, "m": 0}
        work["k"] = work["v"] = work["v_seg"] = work["quant"] = None
        if path != "reference":
            # log(count) of valid entries, -inf elsewhere [B, M] float32 (the reference's bias)
            bias = count_bias(seg.counts.float(), torch.float32)
            work["bias"] = bias.masked_fill(~seg.valid, float("-inf"))
        if path in ("packed", "int8"):
            quant = seg.quant
            assert quant is not None
            if path == "int8" and quant.bits == 4:  # the one unpacking of this layer
                quant = dataclasses.replace(
                    quant,
                    bits=8,
                    k_data=_int4_rows(quant.k_data, quant.head_dim),
                    v_data=_int4_rows(quant.v_data, quant.head_dim),
                )
            work["quant"] = quant
        elif path == "window":
            work["k"], work["v"] = seg.kv(dtype)  # [B, Hk, M, D]: the one dequantization
        elif path == "buffer":
            k_seg, v_seg = seg.kv(dtype)  # [B, Hk, M, D]: the one dequantization of this layer
            M = k_seg.shape[2]
            kb = k_seg.new_empty(*k_seg.shape[:2], M + 64, k_seg.shape[3])
            kb[:, :, :M] = k_seg
            work["k"], work["m"] = kb, M
            if self.latent and torch.equal(v_seg, k_seg[..., : v_seg.shape[-1]]):
                work["dv"] = v_seg.shape[-1]  # the values are the buffer's first features
            elif self.latent:
                work["dv"], work["v_seg"] = v_seg.shape[-1], v_seg
            else:
                vb = v_seg.new_empty(*v_seg.shape[:2], M + 64, v_seg.shape[3])
                vb[:, :, :M] = v_seg
                work["v"] = vb
        self._work[layer_idx] = work

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One decode call of a layer: append the new tokens' K/V and attend.

        Args:
            q: [B, H, T, D] post-RoPE queries; k, v: [B, Hk, T, D] the same tokens' K/V.
                Latent cache (MLA, absorbed): q [B, H, T, R + Dr] the absorbed queries
                ``[q_nope·W_uk ‖ q_pe]``, k [B, 1, T, R + Dr] the new latents
                ``[c_kv ‖ k_pe]``, v [B, 1, T, R] their ``c_kv``.
            scale: softmax scale (default ``D ** -0.5``).
            softcap: logit softcap (``cap * tanh(logits / cap)``, Gemma 3), or None.

        Returns:
            [B, H, T, Dv]: softmax over ``[segment (+ log count, invalid masked) ; decoded
            (causal; a window slides over both)]``, equal to ``decode_path="reference"`` up to
            float rounding (a latent cache: the latent output [B, H, T, R]).
        """
        work = self._work[layer_idx]
        if work is None or work["dtype"] != q.dtype or work["softcap"] != softcap:
            if work is not None and (work["n"] or self.num_decoded(layer_idx)):
                raise ValueError(
                    f"layer {layer_idx} decodes in {q.dtype} with softcap={softcap}, but it was "
                    f"prepared for {work['dtype']} with softcap={work['softcap']} and has "
                    "decoded tokens already"
                )
            self.prepare(layer_idx, q.dtype, softcap=softcap)
            work = self._work[layer_idx]
            assert work is not None
        path = work["path"]
        if path in ("reference", "window"):
            if path == "reference":
                k_all, v_all = self._reference_kv(layer_idx, k, v)  # [B, Hk, M + S, D]
            else:
                k_dec, v_dec = self._hold(layer_idx, k, v)
                k_all, v_all = torch.cat([work["k"], k_dec], 2), torch.cat([work["v"], v_dec], 2)
            bias = self._bias(layer_idx, q.shape[2], q.dtype)  # [B, 1, T, M + S]
            return attention_op(
                q, k_all.to(q.dtype), v_all.to(q.dtype), mask=bias, scale=scale, softcap=softcap
            )
        seg = self._segment(layer_idx)
        k_dec, v_dec = self._append(layer_idx, work, k, v)  # [B, Hk, S, D] views
        if path in ("packed", "int8"):
            return decode_attention(
                q,
                work["quant"],
                seg.head_map,
                seg.counts,
                seg.valid,
                k_dec,
                v_dec,
                scale,
                backend=self.backend,
                bias=work["bias"],
            )
        # "buffer": the segment was dequantized once, the decoded tokens follow it in place.
        M, S, T = int(work["m"]), k_dec.shape[2], q.shape[2]
        if T == 1:  # one query sees every held token: the bias is a prefix of a kept row
            row = work.get("row")
            if row is None or row.shape[-1] < M + S:
                row = torch.zeros(
                    q.shape[0], 1, 1, work["k"].shape[2], dtype=q.dtype, device=q.device
                )
                row[:, 0, 0, :M] = work["bias"].to(q.dtype)
                work["row"] = row
            bias = row[..., : M + S]  # [B, 1, 1, M + S]
        else:
            n = torch.arange(T, device=q.device)[:, None] + (S - T)
            causal = torch.arange(S, device=q.device)[None, :] <= n  # [T, S]
            dec = torch.zeros(T, S, dtype=q.dtype, device=q.device)
            dec = dec.masked_fill(~causal, -torch.inf)
            bias = torch.cat(
                [
                    work["bias"].to(q.dtype)[:, None, None, :].expand(-1, 1, T, -1),
                    dec.expand(q.shape[0], 1, T, S),
                ],
                -1,
            )
        kb = work["k"][:, :, : M + S]  # [B, Hk, M + S, D]
        if not self.latent:
            vb = work["v"][:, :, : M + S]
        elif work["v_seg"] is None:  # MLA: the values are the latents' first R features
            vb = kb[..., : work["dv"]]
        else:
            vb = torch.cat([work["v_seg"], k_dec[..., : work["dv"]]], 2)
        return attention_op(q, kb, vb, mask=bias, scale=scale, softcap=softcap)

    def _append(
        self, layer_idx: int, work: dict, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V after the held ones (capacity doubles when full, so a step copies
        nothing); ``keys``/``values`` stay the held tokens (views; a latent cache holds keys
        only)."""
        M, n, T = int(work["m"]), int(work["n"]), k.shape[2]
        bufs = ("k",) if self.latent else ("k", "v")
        new = {"k": k, "v": v}
        kb = work["k"]
        if kb is None or M + n + T > kb.shape[2]:
            cap = max(2 * (kb.shape[2] - M) if kb is not None else 0, n + T, 64)
            for name in bufs:
                x, old = new[name], work[name]
                grown = x.new_empty(*x.shape[:2], M + cap, x.shape[3])
                if old is not None:
                    grown[:, :, : M + n] = old[:, :, : M + n]
                work[name] = grown
        for name in bufs:
            work[name][:, :, M + n : M + n + T] = new[name]
        work["n"] = n + T
        self.keys[layer_idx] = work["k"][:, :, M : M + n + T]
        if self.latent:
            return self.keys[layer_idx], self.keys[layer_idx][..., : v.shape[-1]]  # type: ignore[index]
        self.values[layer_idx] = work["v"][:, :, M : M + n + T]
        return self.keys[layer_idx], self.values[layer_idx]  # type: ignore[return-value]

    def working_bytes(self) -> int:
        """Bytes held beyond the stored cache (:meth:`kv_bytes` + :meth:`decoded_bytes`): the
        ``"buffer"`` path's dequantized segments, the ``"int8"`` path's unpacked rows, a
        windowed layer's materialized segment and every layer's unused decoded capacity, at
        their real element sizes."""
        total = 0
        for i, work in enumerate(self._work):
            if work is None:
                continue
            seg = self.segments[i]
            quant = work.get("quant")
            if quant is not None and seg is not None and quant is not seg.quant:
                total += quant.k_data.nbytes + quant.v_data.nbytes  # int8 copy
            held = [t for t in (self.keys[i], self.values[i]) if t is not None]
            if work["path"] in ("window", "reference"):  # held decoded tokens: not in a buffer
                held = []
            bufs = [work[n] for n in ("k", "v", "v_seg") if work.get(n) is not None]
            total += sum(t.numel() * t.element_size() for t in bufs)
            total -= sum(t.numel() * t.element_size() for t in held)
        return total

    # ----------------------------------------------------------------------------- bytes
    def kv_bytes(self, include_metadata: bool = True) -> int:
        """Stored bytes of the compressed context, all layers: packed K/V + scales (+ merge counts
        and head maps). Decoded tokens are not included (see :meth:`decoded_bytes`)."""
        total = 0
        for seg in self.segments:
            if seg is not None:
                total += seg.payload_bytes(self.cache_dtype_bytes)
                total += seg.metadata_bytes() if include_metadata else 0
        return total

    def baseline_bytes(self, head_dim: int | None = None, value_dim: int | None = None) -> int:
        """Bytes of the uncompressed 16-bit context cache, all layers (a windowed layer: the
        window's context tokens, what an uncompressed windowed cache holds; a latent cache:
        ``R + Dr`` elements per token per layer, :func:`~unicache_train.model.attention.
        kv_bytes_per_token`).

        Args:
            head_dim, value_dim: ``D_k``, ``D_v`` (MLA: ``R + Dr``, ``R``); default: the widths
                each stored segment was built with (``value_dim`` defaults to ``head_dim``
                when only that is given).
        """
        return sum(
            seg.baseline_bytes(head_dim, value_dim, self.cache_dtype_bytes, window, self.latent)
            for seg, window in zip(self.segments, self.windows)
            if seg is not None
        )

    def decoded_bytes(self) -> int:
        """Decoded tokens' K/V at the cache dtype (they are not compressed; a latent cache
        holds each decoded latent once)."""
        held = [t for t in (*self.keys, *self.values) if t is not None]
        return sum(t.numel() for t in held) * self.cache_dtype_bytes

    def nbytes(self) -> int:
        """Everything the cache holds: compressed context with metadata + decoded tokens."""
        return self.kv_bytes(include_metadata=True) + self.decoded_bytes()
