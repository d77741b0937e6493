"""Symmetric per-head quantization of the compressed segment (UniCache article §6.3, §9 pitfall 3).

Quantization runs last, after token compression (quantization noise would otherwise disturb the
importance estimates). ``x ~= q * scale`` with ``scale = max|x| / qmax``, ``qmax = 127`` (int8)
or 7 (int4), ``q = round(x / scale)`` clamped to ``[-qmax, qmax]``. The scale is taken

* ``granularity="token_head"`` (default): per (sample, head, entry) vector, separately for K and
  V: one scale per D values, so neither an outlier token nor a loud head can spoil another
  vector's precision (KV caches mix heads and tokens of very different ranges);
* ``granularity="head"``: per (sample, head) over all valid entries of the segment, separately
  for K and V (the source's "per-head"); padding entries are excluded from the max;
* ``granularity="channel"``: per (sample, head, feature) over the valid entries (KIVI's
  per-channel keys): for caches whose features differ by orders of magnitude (an MLA latent
  from a PCA conversion: its leading features ~10x the median one), where a per-vector scale
  rounds the quiet features to zero at int4;
* ``granularity="channel_group"``: per (sample, head, feature) and group of ``group_size``
  consecutive segment entries (the last group may be shorter), over the group's valid entries:
  per-channel scales that one outlier token (an attention sink, far louder than the rest of a
  long segment) spoils for its own group only. Scales ``[B, H, ceil(M / G), D]``.

K and V may take different granularities (``QuantizeConfig.key_granularity`` /
``value_granularity``, None: ``granularity``). KIVI's split (Liu et al., arXiv 2402.02750) is
keys ``"channel_group"`` and values ``"token_head"``: keys have a few loud channels, values do
not, and attention mixes values token by token. (KIVI's quantizer is asymmetric, with a zero
point, and keeps the most recent tokens in full precision; ours stays symmetric, and the decoded
tokens are never quantized.) An MLA latent segment (values = the keys' first features) is one
tensor: both of its parts take the keys' granularity.

Never a global scale: the source's pitfall is exactly one head's range flattening another's.
Scales are stored (and applied) in ``scale_dtype`` (fp16 by default). In the training loop the
dequantized values pass gradients straight through (STE: the forward sees ``q * scale`` exactly,
the backward is the identity). Storage: int8 tensors, or int4 packed two per byte (low nibble
first, :func:`unicache_train.seam.pack_int4`); :func:`unicache_train.seam.stored_kv_bytes`
counts those bytes plus the scales, one copy per head group, against the uncompressed 16-bit
cache (:func:`unicache_train.seam.uncompressed_kv_bytes`) in the ``kv_reduction`` stat.

Shape legend: B, H, M, D = batch, KV heads, segment entries, head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from unicache_train.compress.config import QuantizeConfig
from unicache_train.compress.state import CompressionState
from unicache_train.seam import QUANT_GRANULARITIES, QuantizedKV, broadcast_scale, pack_int4

__all__ = ["Quantize", "quantize_symmetric"]

_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize_symmetric(
    x: torch.Tensor,
    valid: torch.Tensor,
    bits: int = 8,
    granularity: str = "token_head",
    scale_dtype: torch.dtype = torch.float16,
    group_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fake-quantize with a straight-through gradient.

    Args:
        x: [B, H, M, D].
        valid: [B, M] bool (padding is zeroed and excluded from every scale's max).
        bits: 8 or 4.
        granularity: ``"token_head"``, ``"head"``, ``"channel"`` or ``"channel_group"``.
        scale_dtype: storage dtype of the scales.
        group_size: G, consecutive entries per group of ``"channel_group"`` (>= 1; ignored by
            the other granularities).

    Returns:
        (x_q [B, H, M, D] in x's dtype, forward ``q * scale`` and identity gradient;
        q int8 [B, H, M, D]; scale [B, H, M], [B, H], [B, H, D] or [B, H, ceil(M / G), D] in
        ``scale_dtype``).
    """
    qmax = _qmax(bits)
    vm = valid[:, None, :, None]
    xf = x.detach().float() * vm
    B, H, M, D = xf.shape
    if granularity == "token_head":
        amax = xf.abs().amax(-1)  # [B, H, M]
    elif granularity == "channel":  # [B, H, D]
        amax = xf.abs().amax(2) if xf.shape[2] else xf.new_zeros(*xf.shape[:2], xf.shape[3])
    elif granularity == "channel_group":  # [B, H, ceil(M / G), D]
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(
                f"quantize_symmetric: group_size={group_size!r} is out of range; allowed "
                "integers in [1, inf]"
            )
        groups = -(-M // group_size)
        # zero rows pad the last group (|x| >= 0: they never raise a group's max)
        xa = F.pad(xf.abs(), (0, 0, 0, groups * group_size - M))  # [B, H, groups * G, D]
        amax = xa.view(B, H, groups, group_size, D).amax(3)
    elif granularity == "head":
        amax = xf.abs().amax(dim=(2, 3)) if xf.shape[2] else xf.new_zeros(xf.shape[:2])
    else:
        raise ValueError(
            f"quantize_symmetric: granularity={granularity!r} is not allowed; choose one of "
            f"{list(QUANT_GRANULARITIES)}"
        )
    finfo = torch.finfo(scale_dtype)
    scale = (amax / qmax).clamp(max=finfo.max).to(scale_dtype)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero vector (or underflow): q = 0
    s_b = broadcast_scale(s, granularity, group_size, M)
    q = torch.round(xf / s_b).clamp(-qmax, qmax)
    deq = (q * s_b).to(x.dtype)
    # STE: the forward value is exactly `deq`, the gradient w.r.t. x is the identity.
    x_q = deq + (x - x.detach())
    return x_q, q.to(torch.int8), scale


@dataclass
class Quantize(QuantizeConfig):
    """Pipeline step (last): quantize the segment's K and V, attach the packed storage.

    Makes the identity segment first when no earlier step emitted one. K takes
    :attr:`effective_key_granularity`, V :attr:`effective_value_granularity` (the stored
    :class:`~unicache_train.seam.QuantizedKV` records both, and ``group_size`` when either is
    ``"channel_group"``). An MLA latent segment
    (:attr:`~unicache_train.seam.KVSegment.latent`: values = the keys' first features) is
    quantized once, ``c_kv`` and ``k_pe`` each with their own scales (the RoPE key's range is
    often far above the normed ``c_kv``'s), both at the keys' granularity (there is no separate
    value tensor), and its values stay the dequantized keys' first features
    (:attr:`~unicache_train.seam.QuantizedKV.latent`).
    """

    stage: ClassVar[int] = 7
    runs_at_rate_zero: ClassVar[bool] = True  # rate 0 with int8 still stores int8

    def __call__(self, state: CompressionState) -> CompressionState:
        if not self.active:
            return state
        seg = state.segment if state.segment is not None else state.identity_segment()
        sdt = _DTYPES[self.scale_dtype]
        bits = int(self.bits)  # type: ignore[arg-type]
        dv = seg.values.shape[-1]
        kg, G = self.effective_key_granularity, self.group_size
        if seg.latent:  # MLA: the latent once, c_kv and k_pe with their own scales
            c, cq, cs = quantize_symmetric(seg.keys[..., :dv], seg.valid, bits, kg, sdt, G)
            pe, pq, ps = quantize_symmetric(seg.keys[..., dv:], seg.valid, bits, kg, sdt, G)
            if bits == 4:
                cq, pq = pack_int4(cq), pack_int4(pq)
            seg.keys = torch.cat([c, pe], -1)
            seg.values = seg.keys[..., :dv]
            seg.quant = QuantizedKV(
                bits,
                kg,
                pq,
                cq,
                ps,
                cs,
                seg.keys.shape[-1],
                dv,
                latent=True,
                group_size=G if kg == "channel_group" else None,
            )
            state.segment = seg
            return state
        vg = self.effective_value_granularity
        seg.keys, kq, ks = quantize_symmetric(seg.keys, seg.valid, bits, kg, sdt, G)
        seg.values, vq, vs = quantize_symmetric(seg.values, seg.valid, bits, vg, sdt, G)
        if bits == 4:
            kq, vq = pack_int4(kq), pack_int4(vq)
        dk, dv = seg.keys.shape[-1], seg.values.shape[-1]
        seg.quant = QuantizedKV(
            bits=bits,
            granularity=kg,
            k_data=kq,
            v_data=vq,
            k_scale=ks,
            v_scale=vs,
            head_dim=dk,
            value_dim=dv if dv != dk else None,
            value_granularity=vg if vg != kg else None,
            group_size=G if "channel_group" in (kg, vg) else None,
        )
        state.segment = seg
        return state
