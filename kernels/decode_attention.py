"""Triton decode attention over a packed (int8/int4) segment plus the decoded tokens' K/V.

Installed as ``unicache_train.kernels.decode_attention``; the functional API is
:func:`unicache_train.ops.decode_attention.decode_attention` (``backend="triton"``), whose
``decode_attention_reference`` is the spec this kernel is tested against (formulas there).

Shape legend: ``B, H, Hk, G, T, M, S, D, NS = batch, query heads, KV heads, stored head slots,
new queries, segment entries, decoded tokens, head dim, segment splits``; ``HALF = D / 2`` (the
kernel works on the even and odd features: an int4 byte holds one of each, low nibble first).

Grid ``(B * H * T, NS + 1)``: program ``(row, s)`` owns one query (sample, head, new token) and
either segment split ``s < NS`` (entries ``[s * split, (s + 1) * split)``, walked in blocks of
``BLOCK_M``) or, for ``s == NS``, the decoded tokens it may see (``n <= S - T + t``). Per block:
the packed bytes are loaded once (``[BLOCK_M, HALF]`` uint8 or two int8 column sets), unpacked
and sign-extended in registers, dotted with the query's even and odd halves (channel key scales
are folded into the query), scaled per entry (token_head) or per head, biased by the
precomputed ``log(count)`` (``-inf`` on invalid slots), and folded into one online softmax whose
accumulator takes the per-entry value scales with the weights (channel / head value scales at
the end). The head map of merged heads is one scalar load (``slot = head_map[b, h // R]``):
merged heads read the same packed rows, nothing is spread. Each program writes its running max,
denominator and unnormalized output; the split-K combine (``NS + 1`` partials per row, a
log-sum-exp merge) is a few PyTorch ops in the launcher.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unicache_train.ops.decode_attention import (
    TRITON_GRANULARITIES,
    check_decode_inputs,
    segment_bias,
    triton_reads,
    triton_refusal,
)
from unicache_train.seam import QuantizedKV

#: GRAN of the kernel: 0 token_head, 1 head, 2 channel (K and V share it; split K/V
#: granularities and ``"channel_group"`` are not read here: ``decode_attention``'s ``"auto"``
#: takes the PyTorch packed path for them).
_GRANULARITY = {g: i for i, g in enumerate(TRITON_GRANULARITIES)}
_NEG = -1.0e30  # finite "minus infinity" for the running max (exp(-inf - -inf) would be NaN)


@triton.jit
def _unpack(ptr, row_off, offs_j, mask, BITS: tl.constexpr):
    """Even and odd features [BLOCK_M, HALF] (fp32) of packed rows ``row_off`` [BLOCK_M, 1]."""
    if BITS == 4:
        byte = tl.load(ptr + row_off + offs_j[None, :], mask=mask, other=0).to(tl.int32)
        lo = byte & 15
        hi = (byte >> 4) & 15
        lo = tl.where(lo > 7, lo - 16, lo)
        hi = tl.where(hi > 7, hi - 16, hi)
    else:
        lo = tl.load(ptr + row_off + 2 * offs_j[None, :], mask=mask, other=0).to(tl.int32)
        hi = tl.load(ptr + row_off + 2 * offs_j[None, :] + 1, mask=mask, other=0).to(tl.int32)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    kd_ptr,
    vd_ptr,
    ks_ptr,
    vs_ptr,
    map_ptr,
    bias_ptr,
    kdec_ptr,
    vdec_ptr,
    m_out,
    l_out,
    acc_out,
    H,
    T,
    M,
    S,
    HK,
    R,
    SPLIT,
    NS,
    scale,
    s_db,
    s_dg,
    s_dm,  # packed data strides (batch, slot, entry); K and V alike
    s_sb,
    s_sg,  # scale strides (batch, slot); the entry / channel stride is 1
    s_eb,
    s_eh,
    s_es,  # decoded K/V strides (batch, KV head, token)
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BITS: tl.constexpr,
    GRAN: tl.constexpr,
):
    row = tl.program_id(0)  # (b * H + h) * T + t
    split = tl.program_id(1)
    t = row % T
    h = (row // T) % H
    b = row // (T * H)
    hk = h // R
    offs_j = tl.arange(0, HALF_P)
    jmask = offs_j < HALF
    q_base = q_ptr + row * (2 * HALF)
    q_e = tl.load(q_base + 2 * offs_j, mask=jmask, other=0.0).to(tl.float32) * scale
    q_o = tl.load(q_base + 2 * offs_j + 1, mask=jmask, other=0.0).to(tl.float32) * scale
    m_i = tl.full((), _NEG, tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc_e = tl.zeros((HALF_P,), tl.float32)
    acc_o = tl.zeros((HALF_P,), tl.float32)
    if split < NS:  # a segment split: packed rows of slot head_map[b, hk]
        slot = tl.load(map_ptr + b * HK + hk)
        sc_base = b * s_sb + slot * s_sg
        if GRAN == 2:  # channel key scales fold into the query
            q_e = q_e * tl.load(ks_ptr + sc_base + 2 * offs_j, mask=jmask, other=0.0).to(tl.float32)
            q_o = q_o * tl.load(ks_ptr + sc_base + 2 * offs_j + 1, mask=jmask, other=0.0).to(
                tl.float32
            )
        data_base = b * s_db + slot * s_dg
        lo_m = split * SPLIT
        hi_m = tl.minimum(lo_m + SPLIT, M)
        for start in range(lo_m, hi_m, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            mmask = offs_m < hi_m
            mask2 = mmask[:, None] & jmask[None, :]
            row_off = data_base + offs_m[:, None] * s_dm
            k_e, k_o = _unpack(kd_ptr, row_off, offs_j, mask2, BITS)
            logit = tl.sum(k_e * q_e[None, :] + k_o * q_o[None, :], axis=1)  # [BLOCK_M]
            if GRAN == 0:
                ks = tl.load(ks_ptr + sc_base + offs_m, mask=mmask, other=1.0).to(tl.float32)
                logit = logit * tl.where(ks > 0, ks, 1.0)
            elif GRAN == 1:
                ks = tl.load(ks_ptr + sc_base).to(tl.float32)
                logit = logit * tl.where(ks > 0, ks, 1.0)
            bias = tl.load(bias_ptr + b * M + offs_m, mask=mmask, other=float("-inf"))
            logit = tl.where(mmask, logit + bias, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logit, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(logit - m_new)  # [BLOCK_M]
            l_i = l_i * alpha + tl.sum(p, axis=0)
            if GRAN == 0:  # per-entry value scales ride on the weights
                vs = tl.load(vs_ptr + sc_base + offs_m, mask=mmask, other=1.0).to(tl.float32)
                p = p * tl.where(vs > 0, vs, 1.0)
            v_e, v_o = _unpack(vd_ptr, row_off, offs_j, mask2, BITS)
            acc_e = acc_e * alpha + tl.sum(p[:, None] * v_e, axis=0)
            acc_o = acc_o * alpha + tl.sum(p[:, None] * v_o, axis=0)
            m_i = m_new
        if GRAN == 1:
            vs = tl.load(vs_ptr + sc_base).to(tl.float32)
            vs = tl.where(vs > 0, vs, 1.0)
            acc_e = acc_e * vs
            acc_o = acc_o * vs
        elif GRAN == 2:
            acc_e = acc_e * tl.load(vs_ptr + sc_base + 2 * offs_j, mask=jmask, other=0.0).to(
                tl.float32
            )
            acc_o = acc_o * tl.load(vs_ptr + sc_base + 2 * offs_j + 1, mask=jmask, other=0.0).to(
                tl.float32
            )
    else:  # the decoded tokens (16/32-bit), causal: n <= S - T + t
        n_end = S - T + t + 1
        dec_base = b * s_eb + hk * s_eh
        for start in range(0, n_end, BLOCK_M):
            offs_n = start + tl.arange(0, BLOCK_M)
            nmask = offs_n < n_end
            mask2 = nmask[:, None] & jmask[None, :]
            off = dec_base + offs_n[:, None] * s_es + 2 * offs_j[None, :]
            k_e = tl.load(kdec_ptr + off, mask=mask2, other=0.0).to(tl.float32)
            k_o = tl.load(kdec_ptr + off + 1, mask=mask2, other=0.0).to(tl.float32)
            logit = tl.sum(k_e * q_e[None, :] + k_o * q_o[None, :], axis=1)
            logit = tl.where(nmask, logit, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logit, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(logit - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            v_e = tl.load(vdec_ptr + off, mask=mask2, other=0.0).to(tl.float32)
            v_o = tl.load(vdec_ptr + off + 1, mask=mask2, other=0.0).to(tl.float32)
            acc_e = acc_e * alpha + tl.sum(p[:, None] * v_e, axis=0)
            acc_o = acc_o * alpha + tl.sum(p[:, None] * v_o, axis=0)
            m_i = m_new
    part = row * (NS + 1) + split
    tl.store(m_out + part, m_i)
    tl.store(l_out + part, l_i)
    tl.store(acc_out + part * (2 * HALF) + 2 * offs_j, acc_e, mask=jmask)
    tl.store(acc_out + part * (2 * HALF) + 2 * offs_j + 1, acc_o, mask=jmask)


def _split_size(M: int, rows: int, device: torch.device, block_m: int) -> int:
    """Entries per segment split: enough programs for ~2 waves of the device's SMs."""
    on_gpu = device.type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 4
    splits = max(1, -(-2 * sms // max(rows, 1)))
    size = -(-max(M, 1) // splits)
    return max(block_m, -(-size // block_m) * block_m)


def decode_attention_triton(
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
    split_size: int | None = None,
    block_m: int = 32,
) -> torch.Tensor:
    """Launcher: same arguments and result as
    :func:`~unicache_train.ops.decode_attention.decode_attention_reference`.

    Args:
        bias: precomputed :func:`~unicache_train.ops.decode_attention.segment_bias` [B, M].
        split_size: segment entries per split-K program (default: ~2 waves of the SMs).
        block_m: entries per inner block (a power of two).

    Raises:
        ValueError: an odd head dim (the kernel reads even/odd feature pairs), or scales the
            kernel does not read (K and V at different granularities, ``"channel_group"``).
    """
    check_decode_inputs(q, quant, head_map, k_dec, v_dec)
    B, H, T, D = q.shape
    if D % 2:
        raise ValueError(f"decode_attention_triton: head dim {D} must be even")
    if not triton_reads(quant):
        raise ValueError(f"decode_attention_triton: {triton_refusal(quant)}")
    Hk = head_map.shape[1]
    M = quant.k_data.shape[2]
    scale = D**-0.5 if scale is None else float(scale)
    if bias is None:
        bias = segment_bias(counts, valid)
    bias = bias.float().contiguous()
    kd, vd = quant.k_data.contiguous(), quant.v_data.contiguous()
    ks, vs = quant.k_scale.contiguous(), quant.v_scale.contiguous()
    if k_dec is None or k_dec.shape[2] == 0:
        k_dec = v_dec = q.new_zeros(B, Hk, 0, D)
    if k_dec.stride(-1) != 1 or v_dec.stride() != k_dec.stride():
        k_dec, v_dec = k_dec.contiguous(), v_dec.contiguous()
    S = k_dec.shape[2]
    rows = B * H * T
    split = split_size or _split_size(M, rows, q.device, block_m)
    NS = max(1, -(-M // split))
    qc = q.contiguous()
    m_part = torch.empty(rows, NS + 1, device=q.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    acc = torch.empty(rows, NS + 1, D, device=q.device, dtype=torch.float32)
    half = D // 2
    _decode_attention_kernel[(rows, NS + 1)](
        qc,
        kd,
        vd,
        ks,
        vs,
        head_map.contiguous(),
        bias,
        k_dec,
        v_dec,
        m_part,
        l_part,
        acc,
        H,
        T,
        M,
        S,
        Hk,
        H // Hk,
        split,
        NS,
        scale,
        kd.stride(0),
        kd.stride(1),
        kd.stride(2),
        ks.stride(0),
        ks.stride(1),
        k_dec.stride(0),
        k_dec.stride(1),
        k_dec.stride(2),
        HALF=half,
        HALF_P=triton.next_power_of_2(half),
        BLOCK_M=block_m,
        BITS=quant.bits,
        GRAN=_GRANULARITY[quant.granularity],
    )
    # split-K combine: a log-sum-exp merge of the NS + 1 partial softmaxes of each row
    mx = m_part.amax(1, keepdim=True)  # [rows, 1]
    w = torch.exp(m_part - mx)  # [rows, NS + 1]
    out = (acc * w[..., None]).sum(1) / (l_part * w).sum(1, keepdim=True)  # [rows, D]
    return out.reshape(B, H, T, D).to(q.dtype)
