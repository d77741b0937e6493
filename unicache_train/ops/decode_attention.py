"""Decode attention over a packed (int8/int4) compressed segment plus the decoded tokens' K/V.

One decode step of :class:`~unicache_train.model.compressed_cache.CompressedKVCache` attends to
``[segment ; decoded tokens]``: the segment is the compressed prompt as the cache stores it
(:class:`~unicache_train.seam.QuantizedKV`: packed integers with their scales, one copy per
stored head group), the decoded tokens are floating K/V. Per query head ``h`` of sample ``b``::

    slot  = head_map[b, h // R]                        (R = H / Hk, GQA; merged heads share a slot)
    k_m   = q_int(k_data[b, slot, m]) * k_scale         (per token-head, head, channel or
                                                        channel and group of entries)
    logit = scale * <q, k_m> + log(count[b, m])         (masked where not valid[b, m])
    logit over decoded token s: scale * <q, k_dec[s]>   (causal: query t sees s <= S - T + t)
    out   = softmax over [segment ; decoded] of logits, applied to [v_m ; v_dec]

Three implementations, one contract:

- :func:`decode_attention_reference`: the spec (today's path): dequantize the whole segment,
  spread it to the KV heads, concatenate the decoded tokens, one SDPA with an additive bias.
- :func:`decode_attention_packed`: the CPU path. It reads the packed bytes at every step
  without building the reference's ``[B, H, M + S, D]`` spread, concatenated copies: per KV head
  the nibbles become two half-width float tensors (even and odd features, one layer's transient)
  that go straight into BLAS; per-token scales factor out of the feature sums, channel scales fold
  into the query (keys) and the output (values), so every granularity is the same two matmuls.
  K and V may have different granularities (KIVI's split). Grouped channel scales
  (``"channel_group"``: one per feature for each group of ``group_size`` entries) cannot fold
  into one query: for the keys the query is scaled once per group (``[groups, n, D]``, one
  batched matmul, each group's copy dotted with that group's entries only), and the values'
  per-group partial outputs take their group's channel scales before they are summed.
  (A ``torch.compile``d unpack-inside-the-reduction version was measured first: 11.5 ms per layer
  at M = 2000 against 1.6 ms for this one, 1 thread; inductor does not reach BLAS speed on these
  reductions.)
- ``unicache_train.kernels.decode_attention``: one Triton kernel for CUDA (unpack and scale in
  registers, one online softmax, split-K over the segment), tested against the reference under
  ``TRITON_INTERPRET=1``. It reads K and V at one shared granularity of
  :data:`TRITON_GRANULARITIES` (:func:`triton_reads`): not split K/V granularities, not
  ``"channel_group"``.

:func:`decode_attention` dispatches (``backend="auto"``: Triton on CUDA where it reads the
segment, the packed path elsewhere; an explicit backend that cannot run raises).

Shape legend: B, H, Hk, G, T, M, S, D = batch, query heads, KV heads, stored head slots, new
queries, segment entries, decoded tokens, head dim (``Dp``: packed bytes per entry, ``D / 2``
for int4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unicache_train.seam import QuantizedKV, dequantize

__all__ = [
    "TRITON_GRANULARITIES",
    "check_decode_inputs",
    "decode_attention",
    "decode_attention_packed",
    "decode_attention_reference",
    "segment_bias",
    "triton_reads",
    "triton_refusal",
    "unpack_pairs",
]

BACKENDS = ("auto", "torch", "packed", "triton")

#: The granularities the Triton kernel reads (its ``_GRANULARITY`` table is built from this),
#: K and V at the same one.
TRITON_GRANULARITIES = ("token_head", "head", "channel")


def triton_reads(quant: QuantizedKV) -> bool:
    """Whether the Triton kernel reads ``quant``'s scales: K and V at one granularity of
    :data:`TRITON_GRANULARITIES`."""
    return quant.granularity in TRITON_GRANULARITIES and quant.v_granularity == quant.granularity


def triton_refusal(quant: QuantizedKV) -> str:
    """Why the Triton kernel cannot read ``quant`` (the error of an explicit ``"triton"``)."""
    return (
        f"the Triton decode kernel reads K and V at one shared granularity of "
        f"{list(TRITON_GRANULARITIES)}; this segment has keys {quant.granularity!r}, values "
        f"{quant.v_granularity!r} (group_size={quant.group_size}): use backend='auto' or "
        "'packed' (the PyTorch packed path reads every granularity) or 'torch'"
    )


def segment_bias(counts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``log(count)`` of valid entries, ``-inf`` elsewhere: [B, M] float32."""
    bias = torch.log(counts.float().clamp_min(1.0))
    return bias.masked_fill(~valid, float("-inf"))


def check_decode_inputs(
    q: torch.Tensor, quant: QuantizedKV, head_map: torch.Tensor, k_dec, v_dec
) -> None:
    if quant.latent or (quant.value_dim not in (None, quant.head_dim)):
        raise NotImplementedError("decode_attention: latent (MLA) or K/V-width-split segments")
    B, H, T, D = q.shape
    if D != quant.head_dim:
        raise ValueError(f"query head dim {D} != segment head_dim {quant.head_dim}")
    Hk = head_map.shape[1]
    if H % Hk:
        raise ValueError(f"{H} query heads are not a multiple of {Hk} KV heads")
    if k_dec is not None and (k_dec.shape[:2] != (B, Hk) or v_dec.shape != k_dec.shape):
        raise ValueError(f"decoded K/V {tuple(k_dec.shape)} do not match B={B}, Hk={Hk}")


def decode_attention_reference(
    q: torch.Tensor,
    quant: QuantizedKV,
    head_map: torch.Tensor,
    counts: torch.Tensor,
    valid: torch.Tensor,
    k_dec: torch.Tensor | None,
    v_dec: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """The spec: dequantize, spread, concatenate, one SDPA with an additive bias.

    Args:
        q: [B, H, T, D] post-RoPE queries.
        quant: the packed segment ``[B, G, M, Dp]`` with its scales.
        head_map: [B, Hk] long, the slot of each KV head.
        counts: [B, M] tokens per entry; valid: [B, M] bool.
        k_dec, v_dec: [B, Hk, S, D] decoded tokens (the last ``T`` are the queries' own), or
            None when nothing was decoded yet.
        scale: softmax scale (default ``D ** -0.5``).

    Returns:
        [B, H, T, D] in ``q``'s dtype.
    """
    check_decode_inputs(q, quant, head_map, k_dec, v_dec)
    B, H, T, D = q.shape
    Hk = head_map.shape[1]
    k, v = dequantize(quant)  # [B, G, M, D] float32
    idx = head_map[:, :, None, None].expand(B, Hk, *k.shape[2:])
    k, v = k.gather(1, idx).to(q.dtype), v.gather(1, idx).to(q.dtype)  # [B, Hk, M, D]
    bias = segment_bias(counts, valid)[:, None, None, :].expand(B, 1, T, -1)  # [B, 1, T, M]
    if k_dec is not None and k_dec.shape[2]:
        S = k_dec.shape[2]
        t = torch.arange(T, device=q.device)[:, None] + (S - T)
        causal = torch.arange(S, device=q.device)[None, :] <= t  # [T, S]
        dec = torch.zeros(T, S, device=q.device).masked_fill(~causal, float("-inf"))
        bias = torch.cat([bias, dec.expand(B, 1, T, S)], -1)
        k, v = torch.cat([k, k_dec.to(q.dtype)], 2), torch.cat([v, v_dec.to(q.dtype)], 2)
    R = H // Hk
    k, v = k.repeat_interleave(R, 1), v.repeat_interleave(R, 1)  # [B, H, M + S, D]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale)


# ---------------------------------------------------------------------------- packed (CPU)
def unpack_pairs(data: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed [..., Dp] -> (even, odd) features [..., D/2] float32 (int4: the low and high
    nibbles of each byte, sign-extended by int8 shifts; int8: the even and odd columns). Two
    half-width tensors instead of one interleaved [..., D] copy: the matmuls take them as is."""
    if bits == 4:
        s = data.view(torch.int8)
        return ((s << 4) >> 4).float(), (s >> 4).float()
    return data[..., 0::2].float(), data[..., 1::2].float()


def _token_and_channel(scale: torch.Tensor, granularity: str, M: int, D: int):
    """Scales of one granularity as (per-entry [B, G, M], per-channel [B, G, D]) factors
    (``"channel_group"``: ones for both, its scales apply per group, :func:`_group_scales`)."""
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # as :func:`~unicache_train.seam.dequantize`
    B, G = s.shape[:2]
    if granularity == "token_head":
        return s, s.new_ones(B, G, D)
    if granularity == "channel":
        return s.new_ones(B, G, M), s
    if granularity == "channel_group":
        return s.new_ones(B, G, M), s.new_ones(B, G, D)
    return s[:, :, None].expand(B, G, M), s.new_ones(B, G, D)


def _group_scales(scale: torch.Tensor, granularity: str) -> torch.Tensor | None:
    """``"channel_group"`` scales [B, G, groups, D] as float32 factors (zero: 1, as
    :func:`~unicache_train.seam.dequantize`); None for the other granularities."""
    if granularity != "channel_group":
        return None
    s = scale.float()
    return torch.where(s > 0, s, torch.ones_like(s))


def _seg_logits(q: torch.Tensor, data: torch.Tensor, bits: int) -> torch.Tensor:
    """``q [..., n, D] @ unpacked(data [..., M, Dp])^T -> [..., n, M]`` (integer keys)."""
    if bits == 8:  # int8 rows convert in one op at full width
        return torch.matmul(q, data.float().transpose(-1, -2))
    ke, ko = unpack_pairs(data, bits)  # [..., M, D/2]
    out = torch.matmul(q[..., 0::2], ke.transpose(-1, -2))
    return out.add_(torch.matmul(q[..., 1::2], ko.transpose(-1, -2)))


def _seg_values(p: torch.Tensor, data: torch.Tensor, bits: int) -> torch.Tensor:
    """``p [..., n, M] @ unpacked(data [..., M, Dp]) -> [..., n, D]`` (integer values)."""
    if bits == 8:
        return torch.matmul(p, data.float())
    ve, vo = unpack_pairs(data, bits)
    return torch.stack([torch.matmul(p, ve), torch.matmul(p, vo)], -1).flatten(-2)


def _whole_groups(
    data: torch.Tensor, bits: int, groups: int, group: int
) -> list[tuple[torch.Tensor, slice]]:
    """Packed ``data [..., M, Dp]`` unpacked into float32 feature sets ``[..., groups, group,
    w]`` (int8: one set of all ``D`` features; int4: the even and the odd ``D/2``,
    :func:`unpack_pairs`) with the features each holds. The packed bytes are padded with zero
    rows to whole groups first (a copy of the bytes, not of floats), so every view is
    contiguous and each matmul below runs as one BLAS batch."""
    pad = groups * group - data.shape[-2]
    if pad:
        data = F.pad(data, (0, 0, 0, pad))  # zero bytes: zero integers in both nibbles
    if bits == 8:
        return [(data.float().unflatten(-2, (groups, group)), slice(None))]
    ke, ko = unpack_pairs(data, bits)
    return [
        (ke.unflatten(-2, (groups, group)), slice(0, None, 2)),
        (ko.unflatten(-2, (groups, group)), slice(1, None, 2)),
    ]


def _seg_logits_grouped(
    q: torch.Tensor, data: torch.Tensor, bits: int, scale: torch.Tensor, group: int
) -> torch.Tensor:
    """:func:`_seg_logits` of keys with grouped channel scales: ``q [..., n, D]``, ``data
    [..., M, Dp]``, ``scale [..., groups, D]`` (``groups = ceil(M / group)``) -> ``[..., n,
    M]``. The query is scaled by each group's channel scales (``[..., groups, n, D]``) and
    dotted with that group's ``group`` entries, all groups in one batched matmul."""
    M, groups = data.shape[-2], scale.shape[-2]
    logits = None
    for kf, sel in _whole_groups(data, bits, groups, group):
        qg = q[..., sel].unsqueeze(-3) * scale[..., sel].unsqueeze(-2)  # [..., groups, n, w]
        lg = torch.matmul(qg, kf.transpose(-1, -2))  # [..., groups, n, group]
        logits = lg if logits is None else logits.add_(lg)
    assert logits is not None
    return logits.transpose(-3, -2).flatten(-2)[..., :M]  # [..., n, M]


def _seg_values_grouped(
    p: torch.Tensor, data: torch.Tensor, bits: int, scale: torch.Tensor, group: int
) -> torch.Tensor:
    """:func:`_seg_values` of values with grouped channel scales: ``p [..., n, M]``, ``data
    [..., M, Dp]``, ``scale [..., groups, D]`` -> ``[..., n, D]``: each group's partial output
    (all groups in one batched matmul) times its channel scales, summed over the groups."""
    M, groups = p.shape[-1], scale.shape[-2]
    pg = F.pad(p, (0, groups * group - M)).unflatten(-1, (groups, group))  # [.., n, groups, group]
    pg = pg.transpose(-3, -2).contiguous()  # [..., groups, n, group]
    outs = []
    for vf, sel in _whole_groups(data, bits, groups, group):
        part = torch.matmul(pg, vf)  # [..., groups, n, w]
        outs.append(part.mul_(scale[..., sel].unsqueeze(-2)).sum(-3))  # [..., n, w]
    return outs[0] if len(outs) == 1 else torch.stack(outs, -1).flatten(-2)


def decode_attention_packed(
    q: torch.Tensor,
    quant: QuantizedKV,
    head_map: torch.Tensor,
    counts: torch.Tensor,
    valid: torch.Tensor,
    k_dec: torch.Tensor | None,
    v_dec: torch.Tensor | None,
    scale: float | None = None,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU path: attention that reads the packed segment at every step.

    Per sample and KV head, int4 keys are unpacked into two half-width float tensors (the even
    and odd features; int8 keys convert at full width) that live for one layer's call only, and
    go straight into BLAS:
    ``logits = (q_even @ K_even^T + q_odd @ K_odd^T) * k_scale``; the values likewise, with their
    per-entry scales folded into the softmax weights and channel scales into the query (keys) or
    the output (values). Nothing segment-sized is kept between steps, and no ``[B, H, M, D]``
    spread copy or ``[segment ; decoded]`` concatenation is made: the decoded tokens join through
    the online-softmax combine (one max, one denominator). K and V are read at their own
    granularities; ``"channel_group"`` scales apply per group of entries
    (:func:`_seg_logits_grouped`, :func:`_seg_values_grouped`).

    Same arguments and result as :func:`decode_attention_reference`; ``bias`` may pass a
    precomputed :func:`segment_bias` (a cache computes it once per prompt).
    """
    check_decode_inputs(q, quant, head_map, k_dec, v_dec)
    B, H, T, D = q.shape
    Hk = head_map.shape[1]
    R = H // Hk
    M = quant.k_data.shape[2]
    scale = D**-0.5 if scale is None else float(scale)
    if bias is None:
        bias = segment_bias(counts, valid)
    kg, vg = quant.granularity, quant.v_granularity
    k_tok, k_ch = _token_and_channel(quant.k_scale, kg, M, D)
    v_tok, v_ch = _token_and_channel(quant.v_scale, vg, M, D)
    k_grp, v_grp = _group_scales(quant.k_scale, kg), _group_scales(quant.v_scale, vg)
    group = quant.group_size or 1  # entries per group of the [B, G, groups, D] grouped scales
    qg = q.float().reshape(B, Hk, R * T, D)  # [B, Hk, RT, D] query heads grouped per KV head
    identity = torch.arange(Hk, device=q.device)
    out = q.new_empty(B, Hk, R * T, D, dtype=torch.float32)
    for b in range(B):  # a sample's packed tensors are contiguous slices
        slot = head_map[b]
        qs = qg[b] * (k_ch[b].index_select(0, slot) * scale)[:, None, :]  # channel key scales
        kd, vd = quant.k_data[b], quant.v_data[b]  # [G, M, Dp]
        if quant.k_data.shape[1] == Hk and bool((slot == identity).all()):
            groups = None  # one slot per head: one batched matmul over the heads
            if k_grp is None:
                logits = _seg_logits(qs, kd, quant.bits)  # [Hk, RT, M]
            else:
                logits = _seg_logits_grouped(qs, kd, quant.bits, k_grp[b], group)
            logits.mul_(k_tok[b][:, None, :])
        else:  # merged heads: the heads of a slot read its rows once, in one matmul
            groups = [(g, (slot == g).nonzero().flatten()) for g in slot.unique().tolist()]
            logits = qs.new_empty(Hk, R * T, M)
            for g, heads in groups:
                rows = qs.index_select(0, heads).reshape(-1, D)  # [n * RT, D]
                if k_grp is None:
                    lg = _seg_logits(rows, kd[g], quant.bits)
                else:
                    lg = _seg_logits_grouped(rows, kd[g], quant.bits, k_grp[b, g], group)
                lg.mul_(k_tok[b, g])
                logits[heads] = lg.view(len(heads), R * T, M)
        logits.add_(bias[b])
        mx = logits.amax(-1)  # [Hk, RT]
        ld = None
        if k_dec is not None and k_dec.shape[2]:
            S = k_dec.shape[2]
            ld = torch.matmul(qg[b], k_dec[b].float().transpose(1, 2)) * scale  # [Hk, RT, S]
            t = (torch.arange(R * T, device=q.device) % T)[:, None] + (S - T)
            ld.masked_fill_(torch.arange(S, device=q.device)[None, :] > t, float("-inf"))
            mx = torch.maximum(mx, ld.amax(-1))
        mx = mx.clamp_min(torch.finfo(torch.float32).min)  # an all-masked row stays finite
        p = logits.sub_(mx[..., None]).exp_()  # [Hk, RT, M]
        den = p.sum(-1)
        ob = out[b]
        if groups is None:
            p.mul_(v_tok[b][:, None, :])  # per-entry value scales fold into the weights
            if v_grp is None:
                pv = _seg_values(p, vd, quant.bits)
            else:
                pv = _seg_values_grouped(p, vd, quant.bits, v_grp[b], group)
            ob.copy_(pv.mul_(v_ch[b][:, None, :]))
        else:
            for g, heads in groups:
                rows = p.index_select(0, heads).mul_(v_tok[b, g]).reshape(-1, M)
                if v_grp is None:
                    og = _seg_values(rows, vd[g], quant.bits)  # [n * RT, D]
                else:
                    og = _seg_values_grouped(rows, vd[g], quant.bits, v_grp[b, g], group)
                ob[heads] = og.mul_(v_ch[b, g]).view(len(heads), R * T, D)
        if ld is not None:
            pd = ld.sub_(mx[..., None]).exp_()  # [Hk, RT, S]
            den = den + pd.sum(-1)
            ob.add_(torch.matmul(pd, v_dec[b].float()))
        ob.div_(den[..., None])
    return out.reshape(B, H, T, D).to(q.dtype)


# ---------------------------------------------------------------------------- dispatch
def decode_attention(
    q: torch.Tensor,
    quant: QuantizedKV,
    head_map: torch.Tensor,
    counts: torch.Tensor,
    valid: torch.Tensor,
    k_dec: torch.Tensor | None,
    v_dec: torch.Tensor | None,
    scale: float | None = None,
    *,
    backend: str = "auto",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over ``[packed segment ; decoded tokens]`` (module docstring).

    Args:
        backend: ``"auto"`` (Triton on CUDA where :func:`triton_reads` the segment's scales,
            ``"packed"`` elsewhere: on CPU, and on CUDA for split K/V granularities or
            ``"channel_group"``), ``"triton"`` (raises without CUDA or Triton, or for scales
            the kernel does not read), ``"packed"`` (:func:`decode_attention_packed`),
            ``"torch"`` (the reference: dequantizes the whole segment).
        bias: optional precomputed :func:`segment_bias` [B, M].

    Returns:
        [B, H, T, D] in ``q``'s dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if q.is_cuda and triton_reads(quant) else "packed"
    if backend == "triton" and not triton_reads(quant):
        raise ValueError(f"decode_attention(backend='triton'): {triton_refusal(quant)}")
    if backend == "torch":
        return decode_attention_reference(q, quant, head_map, counts, valid, k_dec, v_dec, scale)
    if backend == "packed":
        return decode_attention_packed(
            q, quant, head_map, counts, valid, k_dec, v_dec, scale, bias=bias
        )
    if not q.is_cuda:
        raise RuntimeError("decode_attention(backend='triton') needs CUDA tensors")
    from unicache_train.kernels.decode_attention import decode_attention_triton

    return decode_attention_triton(
        q, quant, head_map, counts, valid, k_dec, v_dec, scale, bias=bias
    )
