"""Grouped-query causal self-attention (GQA/MHA) with RoPE, SDPA and the KV-compression seam.

Shape legend: B, T, S, M, H, Hk, D = batch, query tokens, key tokens, segment entries,
query heads, KV heads, head dim.

Three ways through :meth:`Attention.forward`:

1. plain causal attention (training without compression, evaluation);
2. incremental decoding with a :class:`~unicache_train.model.kv_cache.KVCache`, or with a
   :class:`~unicache_train.model.compressed_cache.CompressedKVCache` (a compressed segment per
   layer plus the decoded tokens), read through its ``attend`` only: one call appends the new
   K/V and attends with the segment's ``log(count)`` bias, the window and the softcap;
3. the **compression seam** (``split`` and ``compressor`` given): tokens ``t < split[b]`` are the
   context and attend causally to the full context (prefill); the context K/V are handed to the
   compressor at :meth:`Attention._compress_context`; tokens ``t >= split[b]`` attend to the
   compressed segment (plus ``log(count)`` for merged entries) and causally to each other. This
   is the prefill -> compress -> decode of inference, done in one parallel forward so that
   gradients reach every layer.

Sliding-window layers (``config.layer_window(i)`` = W, Mistral / Gemma 3): query ``i`` sees key
``j`` iff ``i - W < j <= i`` (transformers' ``sliding_window_overlay`` on the causal mask), in all
three modes. Such a layer's cache never holds more than the last ``W - 1`` context tokens when the
first continuation token arrives, so the seam does not hand it to the compressor: its segment is
those ``W - 1`` tokens unchanged (:meth:`Attention._window_segment`), stored bytes = what a
windowed cache holds, ``kv_reduction`` 1 (docs/architecture.md, "Sliding-window layers").
Gemma 3 options: ``query_pre_attn_scalar`` (the softmax scale) and ``attn_logit_softcapping``
(logits -> cap * tanh(logits / cap), computed outside SDPA by :func:`attention_op`).

      x [B,T,C] ─► q,k,v ─► RoPE ─┬──────────── full causal K/V (context queries) ─┐
                                  └─► compressor(context K/V) ─► segment K/V ─────────┤
                                                 continuation causal K/V ─────────────┴─► SDPA
                                                                                         │
                                                                                     o_proj
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from unicache_train.model.config import ModelConfig
from unicache_train.model.kv_cache import KVCache
from unicache_train.model.norm import RMSNorm
from unicache_train.model.rope import apply_rope
from unicache_train.seam import (
    CompressionInput,
    KVCompressor,
    KVSegment,
    RecordingCompressor,
    identity_segment,
    segment_kv_bytes,
    uncompressed_kv_bytes,
)


class QKV(NamedTuple):
    """One attention layer's projections of its input, as attention uses them.

    Attributes:
        q: [B, H, T, D] queries (``q_norm`` when the model has it, then RoPE).
        k: [B, Hk, T, D] keys (``k_norm`` when the model has it, then RoPE): what a cache stores.
        v: [B, Hk, T, D] values.
        k_pre_rope: [B, Hk, T, D] keys after ``k_norm``, before RoPE (what a ``pre_rope``
            compressor reads).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_pre_rope: torch.Tensor


class Attention(nn.Module):
    """Causal GQA self-attention with HF Llama parameter names."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_size
        C, H, Hk, D = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(C, H * D, bias=bias)
        self.k_proj = nn.Linear(C, Hk * D, bias=bias)
        self.v_proj = nn.Linear(C, Hk * D, bias=bias)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        # Qwen3 / Gemma 3: per-head RMSNorm over D on queries and keys, before RoPE (HF names).
        gemma = config.block_style == "gemma3"
        self.q_norm = RMSNorm(D, config.rms_norm_eps, gemma) if config.qk_norm else None
        self.k_norm = RMSNorm(D, config.rms_norm_eps, gemma) if config.qk_norm else None
        #: Sliding window of this layer in tokens, or None (full causal attention).
        self.window = config.layer_window(layer_idx)
        #: Softmax scale (None: SDPA's 1/sqrt(D)); Gemma 3: query_pre_attn_scalar**-0.5.
        self.scale = (
            None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar**-0.5
        )
        self.softcap = config.attn_logit_softcapping

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        modality_ids: torch.Tensor,
        cache: KVCache | None = None,
        split: torch.Tensor | None = None,
        compressor: KVCompressor | None = None,
        stats: list[dict[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Args:
            x: [B, T, C] normalised hidden states.
            rope: (cos, sin), each [B, T, D], for ``positions``.
            positions: [B, T] absolute positions.
            modality_ids: [B, T].
            cache: decoding cache (mode 2).
            split: [B] int, first continuation token per sample (mode 3, with ``compressor``).
            compressor: the KV compressor called at the seam (mode 3).
            stats: if given, the segment's stats dict is appended (one per layer).

        Returns:
            [B, T, C].
        """
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        qkv = self.project(x, rope)
        q_rot, k_rot, v, k = qkv.q, qkv.k, qkv.v, qkv.k_pre_rope

        if split is not None and compressor is not None and self.window is not None:
            # A windowed layer is not compressed (its cache is bounded by the window): the
            # segment is the last W - 1 context tokens as they are, and attention over
            # [segment ; continuation] under the window is the windowed causal attention.
            segment = self._window_segment(
                q_rot, k_rot, v, positions, modality_ids, split, compressor
            )
            if stats is not None:
                stats.append(segment.stats)
            mask = sliding_causal_mask(T, T, 0, self.window, x.device)
            out = self._attend(q_rot, k_rot, v, mask=mask)
            if not segment.identity:
                # Quantized window (``quantize.windowed_layers``): continuation queries read the
                # stored context (entry t = token t; tokens before the window are outside every
                # continuation query's window anyway), context queries their own K/V (prefill).
                ctx = (torch.arange(T, device=x.device)[None, :] < split[:, None])[:, None, :, None]
                k_st = torch.where(ctx, segment.keys.to(k_rot.dtype), k_rot)  # [B, Hk, T, D]
                v_st = torch.where(ctx, segment.values.to(v.dtype), v)
                out = torch.where(ctx, out, self._attend(q_rot, k_st, v_st, mask=mask))
        elif split is not None and compressor is not None:
            segment = self._compress_context(
                q_rot, k, k_rot, v, positions, modality_ids, split, compressor, rope
            )
            if stats is not None:
                stats.append(segment.stats)
            out = self._attend_segment(q_rot, k_rot, v, segment, split)
        elif cache is not None and hasattr(cache, "attend"):
            # A compressed cache (model/compressed_cache.py) appends and attends in one call:
            # [segment (+ log count) ; decoded], a window sliding over both, this layer's
            # scale and softcap. (Duck-typed: compressed_cache imports this module.)
            out = cache.attend(
                self.layer_idx, q_rot, k_rot, v, scale=self.scale, softcap=self.softcap
            )
        elif cache is not None:
            past = cache.length(self.layer_idx)
            k_all, v_all = cache.update(self.layer_idx, k_rot, v)  # [B, Hk, S, D]
            # A chunk of T new queries sees all S - T cached keys and is causal within itself.
            mask = None
            if T > 1 or self.window is not None:
                mask = sliding_causal_mask(T, k_all.shape[2], past, self.window, x.device)
            out = self._attend(q_rot, k_all, v_all, mask=mask)
        elif self.window is not None:
            out = self._attend(
                q_rot, k_rot, v, mask=sliding_causal_mask(T, T, 0, self.window, x.device)
            )
        else:
            out = self._attend(q_rot, k_rot, v, is_causal=True)
        out = out.transpose(1, 2).reshape(B, T, H * D)  # [B, T, H*D]
        return self.o_proj(out)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> QKV:
        """The queries, keys and values this layer attends with (the one place they are
        computed: the forward and every analysis, e.g. attention KL, call this).

        Args:
            x: [B, T, C] normalised hidden states (the block's ``input_layernorm`` output).
            rope: (cos, sin), each [B, T, D], for the tokens' positions.

        Returns:
            :class:`QKV`: q [B, H, T, D], k [B, Hk, T, D] (post-RoPE), v [B, Hk, T, D],
            k_pre_rope [B, Hk, T, D].
        """
        B, T, _ = x.shape
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D)  # [B, T, H, D]
        k = self.k_proj(x).view(B, T, Hk, D)  # [B, T, Hk, D]
        if self.q_norm is not None:
            # Qwen3: per-head RMSNorm over D, before RoPE.
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)  # [B, H, T, D]
        k = k.transpose(1, 2)  # [B, Hk, T, D]
        v = self.v_proj(x).view(B, T, Hk, D).transpose(1, 2)  # [B, Hk, T, D]
        cos, sin = rope
        return QKV(q=apply_rope(q, cos, sin), k=apply_rope(k, cos, sin), v=v, k_pre_rope=k)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """:func:`attention_op` with this layer's scale and softcap: q [B, H, T, D], k/v
        [B, Hk, S, D], mask bool (True = attend) or additive, [T, S] or [B, 1, T, S] ->
        [B, H, T, D]."""
        return attention_op(
            q, k, v, mask=mask, is_causal=is_causal, scale=self.scale, softcap=self.softcap
        )

    # ------------------------------------------------------------------- the compression seam
    def _window_segment(
        self,
        q_rot: torch.Tensor,
        k_rot: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        modality_ids: torch.Tensor,
        split: torch.Tensor,
        compressor: KVCompressor,
    ) -> KVSegment:
        """A sliding-window layer's segment: the last ``W - 1`` context tokens, unchanged (or
        quantized, when the compressor has ``compress_window`` and it returns a segment:
        UniCache with ``quantize.windowed_layers``; no token is ever removed).

        When the first continuation token (position ``split``) arrives, a window-``W`` cache
        holds the context tokens ``split - W + 1 .. split - 1`` and never any earlier one, so
        nothing else could be stored or compressed. Their bytes are the stored bytes and also
        the baseline (``kv_reduction`` 1): the layer does not count bytes it never stores. A
        :class:`~unicache_train.seam.RecordingCompressor` (the prefill of compressed decoding)
        records the segment as if its compressor had returned it; the compressor itself is not
        called.

        Returns:
            :class:`KVSegment` over all ``T`` tokens, ``valid`` [B, T] the window's context
            tokens, ``stats`` with ``kv_bytes`` (0-dim), ``kv_reduction`` (1) and
            ``rate_realized`` (0).
        """
        W = self.window
        assert W is not None
        T = k_rot.shape[2]
        t = torch.arange(T, device=k_rot.device)[None, :]
        context_mask = t < split[:, None]  # [B, T]
        inp = CompressionInput(
            layer_idx=self.layer_idx,
            num_layers=self.num_layers,
            queries=q_rot,
            keys=k_rot,
            values=v,
            positions=positions,
            modality_ids=modality_ids,
            context_mask=context_mask,
        )
        in_window = context_mask & (t > split[:, None] - W)  # [B, T]
        quantize = getattr(compressor, "compress_window", None)
        segment = None
        if quantize is not None:
            segment = quantize(dataclasses.replace(inp, context_mask=in_window))
        if segment is None:
            segment = identity_segment(inp)
            segment.valid = in_window
            kv = segment_kv_bytes(segment).sum()
            # rate_realized 0: the compressor removed nothing (the window bounds the cache).
            segment.stats = {
                "kv_bytes": kv,
                "kv_reduction": torch.ones_like(kv),
                "rate_realized": torch.zeros_like(kv),
            }
        if isinstance(compressor, RecordingCompressor):
            compressor.inputs[self.layer_idx] = inp
            compressor.segments[self.layer_idx] = segment
        return segment

    def _compress_context(
        self,
        q_rot: torch.Tensor,
        k: torch.Tensor,
        k_rot: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        modality_ids: torch.Tensor,
        split: torch.Tensor,
        compressor: KVCompressor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> KVSegment:
        """THE point where the KV compressor is called (one call per layer per forward).

        The compressor receives this layer's keys/values of the whole sequence plus a
        ``context_mask`` (``t < split``) and must only emit context tokens. Keys are post-RoPE
        (what a standard cache stores) unless the compressor declares ``pre_rope = True``
        (e.g. cross-layer SVD works on pre-RoPE keys): then RoPE is applied here to the
        segment at the positions the compressor reports.
        """
        T = k.shape[2]
        context_mask = torch.arange(T, device=k.device)[None, :] < split[:, None]  # [B, T]
        pre_rope = getattr(compressor, "pre_rope", False)
        inp = CompressionInput(
            layer_idx=self.layer_idx,
            num_layers=self.num_layers,
            queries=q_rot,
            keys=k if pre_rope else k_rot,
            values=v,
            positions=positions,
            modality_ids=modality_ids,
            context_mask=context_mask,
        )
        segment = compressor(inp)
        if pre_rope:
            cos, sin = gather_rope(rope, positions, segment.positions)
            segment.keys = apply_rope(segment.keys, cos, sin)
        return segment

    def _attend_segment(
        self,
        q_rot: torch.Tensor,
        k_rot: torch.Tensor,
        v: torch.Tensor,
        segment: KVSegment,
        split: torch.Tensor,
    ) -> torch.Tensor:
        """Context queries attend causally to the full context; continuation queries attend to
        the segment and causally to the continuation (kernel: :func:`segment_attention_mode`).

        Returns:
            [B, H, T, D].
        """
        gqa = self.num_kv_heads != q_rot.shape[1]
        if segment.identity:
            # The context's own K/V, untouched: [segment ; continuation] is the causal sequence,
            # and the causal kernel skips the masked blocks the general mask cannot.
            return self._attend(q_rot, k_rot, v, is_causal=True)
        seg_k, seg_v = segment.keys.to(k_rot.dtype), segment.values.to(v.dtype)
        mode = segment_attention_mode(q_rot.device)
        if mode == "flex":
            return attend_segment_flex(
                q_rot,
                k_rot,
                v,
                seg_k,
                seg_v,
                segment,
                split,
                scale=self.scale,
                softcap=self.softcap,
                enable_gqa=gqa,
            )
        if mode == "per_sample" and self.softcap is None:
            return attend_segment_per_sample(
                q_rot, k_rot, v, seg_k, seg_v, segment, split, scale=self.scale, enable_gqa=gqa
            )
        mask = segment_attention_mask(segment, split, q_rot.shape[2], q_rot.dtype)
        keys = torch.cat([seg_k, k_rot], dim=2)  # [B, Hk, M + T, D]
        values = torch.cat([seg_v, v], dim=2)  # [B, Hk, M + T, D]
        return self._attend(q_rot, keys, values, mask=mask)


def sliding_causal_mask(
    T: int, S: int, past: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """Boolean mask of ``T`` queries at positions ``past .. past + T - 1`` over ``S`` keys at
    positions ``0 .. S - 1``: key ``j`` visible from query ``i`` iff ``j <= i`` and, with a
    window, ``i - window < j`` (transformers' ``sliding_window_overlay``).

    Returns:
        [T, S] bool, True = attend.
    """
    i = torch.arange(T, device=device)[:, None] + past
    j = torch.arange(S, device=device)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (j > i - window)
    return mask


def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention: SDPA, or (with ``softcap``) the explicit form with the logits capped
    to ``softcap * tanh(logits / softcap)`` before the mask (Gemma's ``attn_logit_softcapping``;
    softmax in fp32 as transformers' eager attention).

    Args:
        q: [B, H, T, D]; k: [B, Hk, S, D]; v: [B, Hk, S, Dv] (H a multiple of Hk).
        mask: bool (True = attend) or additive float, broadcastable to [B, H, T, S].
        is_causal: causal over ``T == S`` (instead of a mask).
        scale: logit scale (None: 1/sqrt(D)).

    Returns:
        [B, H, T, Dv].
    """
    gqa = k.shape[1] != q.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.matmul(q, k.transpose(-1, -2)) * s  # [B, H, T, S]
    logits = torch.tanh(logits / softcap) * softcap
    if is_causal:
        mask = sliding_causal_mask(q.shape[2], k.shape[2], 0, None, q.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        else:
            logits = logits + mask
    probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def count_bias(counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logit bias of segment entries: ``log(count)`` (0 for a kept token), as token merging
    does (an entry standing for ``n`` agreeing tokens gets their summed attention weight).

    A count below 1 is a token kept softly (a learned retention gate in training,
    ``unicache_train.compress.retention``): its weight ``alpha`` in (0, 1) lowers its logit by
    ``-log(alpha)``, differentiably.

    Args:
        counts: [..., M] float, original tokens per entry (:attr:`KVSegment.counts`).
        dtype: dtype of the attention logits.

    Returns:
        [..., M] in ``dtype``.
    """
    return torch.log(counts.clamp_min(1e-20)).to(dtype)


#: How the seam's attention runs (see :func:`segment_attention_mode`): ``"auto"``,
#: ``"batched"``, ``"per_sample"`` or ``"flex"``.
SEGMENT_ATTENTION = "auto"


def segment_attention_mode(device: torch.device) -> str:
    """``"batched"``: one SDPA call over ``[segment ; sequence]`` with a dense additive mask (GPU
    kernels take masks at full speed and dislike many small launches). ``"per_sample"``: per
    sample, a causal SDPA for the context rows and a masked one for the continuation rows over
    ``[valid segment ; continuation]`` only: on CPU the dense mask costs ``T x (M + T)`` work
    without the causal kernel's block skipping, which made the in-loop step 1.35x the plain one
    at width 128 with nothing compressed. ``"flex"``: one FlexAttention call
    (:func:`attend_segment_flex`) with a block mask built from the split and ``valid`` (no dense
    mask: at 8k tokens and ``M = T`` the fp32 mask is 0.5 GiB per sample) and the ``log(count)``
    bias as a ``score_mod``; compiled on CUDA; on CPU torch's FlexAttention is forward-only and
    unfused (tests, ``no_grad``). ``"auto"``: per-sample on CPU, flex on CUDA, batched elsewhere.
    (MLA's seam, ``model/mla.py``, knows ``"per_sample"`` and otherwise takes the batched mask.)"""
    if SEGMENT_ATTENTION not in ("auto", "batched", "per_sample", "flex"):
        raise ValueError(
            f"SEGMENT_ATTENTION={SEGMENT_ATTENTION!r}; choose 'auto', 'batched', 'per_sample' "
            "or 'flex'"
        )
    if SEGMENT_ATTENTION != "auto":
        return SEGMENT_ATTENTION
    return {"cpu": "per_sample", "cuda": "flex"}.get(device.type, "batched")


def attend_segment_per_sample(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg_k: torch.Tensor,
    seg_v: torch.Tensor,
    segment: KVSegment,
    split: torch.Tensor,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The seam's attention sample by sample, with no masked-out work beyond the segment's.

    Sample ``b``: context rows ``t < s`` attend causally to ``[0, t]`` (the causal kernel);
    continuation rows attend to the valid segment entries (``log(count)`` bias) and causally to
    ``[s, t]``. Same result as the batched masked call (tested within 1e-5).

    Args:
        q: [B, H, T, Dq]; k: [B, Hk, T, Dq]; v: [B, Hk, T, Dv] (the sequence, post-RoPE).
        seg_k: [B, Hk, M, Dq], seg_v: [B, Hk, M, Dv] (the segment, in the attention dtype).
        segment: for ``valid``/``counts`` [B, M].
        split: [B].

    Returns:
        [B, H, T, Dv].
    """
    T = q.shape[2]
    # NOTE: unbind/split (not slicing): their backward is one stack/cat, where every slice's
    # backward would zero-fill a full-size gradient and add into it.
    qs, ks, vs, sks, svs = (x.unbind(0) for x in (q, k, v, seg_k, seg_v))
    outs = []
    for b, s in enumerate(split.tolist()):
        s = min(max(int(s), 0), T)
        # [1, H, ., D] pieces: SDPA's fused CPU kernels (GQA included) want a batch dim.
        (qc, qn), (kc, kn), (vc, vn) = (
            x[None].split([s, T - s], dim=2) for x in (qs[b], ks[b], vs[b])
        )
        parts = []
        if s > 0:  # context rows: plain causal attention over the context
            parts.append(
                F.scaled_dot_product_attention(
                    qc, kc, vc, is_causal=True, scale=scale, enable_gqa=enable_gqa
                )
            )
        if s < T:  # continuation rows: [valid segment (log-count bias) ; causal continuation]
            keep = segment.valid[b]  # [M]
            sk, sv = sks[b][None, :, keep], svs[b][None, :, keep]  # [1, Hk, M_b, D]
            C, M_b = T - s, sk.shape[2]
            bias = count_bias(segment.counts[b, keep], q.dtype)  # [M_b]
            t = torch.arange(C, device=q.device)
            causal = torch.where(t[None, :] <= t[:, None], 0.0, torch.finfo(q.dtype).min)
            mask = torch.cat([bias.expand(C, M_b), causal.to(q.dtype)], dim=-1)  # [C, M_b + C]
            parts.append(
                F.scaled_dot_product_attention(
                    qn,
                    torch.cat([sk, kn], dim=2),
                    torch.cat([sv, vn], dim=2),
                    attn_mask=mask,
                    scale=scale,
                    enable_gqa=enable_gqa,
                )
            )
        outs.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(outs, dim=0)


def segment_attention_mask(
    segment: KVSegment, split: torch.Tensor, T: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask of the seam's one SDPA call over ``[segment ; full sequence]`` keys.

    Context queries attend causally to the full context; continuation queries attend to the
    valid segment entries (with ``log(count)`` added for merged entries) and causally to the
    continuation. Shared by GQA and MLA attention.

    Args:
        segment: the compressed context (``counts``/``valid`` [B, M]).
        split: [B] first continuation token per sample.
        T: sequence length.
        dtype: dtype of the attention logits.

    Returns:
        [B, 1, T, M + T] additive mask (0 or ``log(count)`` where allowed, dtype min elsewhere).
    """
    device = split.device
    t = torch.arange(T, device=device)
    is_cont = t[None, :] >= split[:, None]  # [B, T] query is a continuation token
    # Segment part [B, T, M]: continuation queries only, valid entries only.
    seg_ok = is_cont[:, :, None] & segment.valid[:, None, :]
    seg_bias = count_bias(segment.counts, dtype)  # [B, M]
    # Full-sequence part [B, T, T]: causal; a continuation query skips the raw context,
    # which it sees only through the segment.
    causal = t[None, :] <= t[:, None]  # [T, T]
    key_is_cont = t[None, :] >= split[:, None]  # [B, T]
    full_ok = causal[None] & (~is_cont[:, :, None] | key_is_cont[:, None, :])
    neg = torch.finfo(dtype).min
    seg_mask = torch.where(seg_ok, seg_bias[:, None, :], neg)  # [B, T, M]
    # (built in ``dtype``: a float32 intermediate cannot hold float64's min)
    full_mask = torch.where(full_ok, torch.zeros((), dtype=dtype, device=device), neg)  # [B,T,T]
    return torch.cat([seg_mask, full_mask], dim=-1)[:, None]  # [B, 1, T, M + T]


#: FlexAttention's tile (queries x keys) of the seam's block mask; the segment is padded to a
#: multiple of it so that no key tile holds both segment entries and sequence tokens.
FLEX_BLOCK_SIZE = 128


class SegmentFlex(NamedTuple):
    """Everything one FlexAttention call over ``[segment ; sequence]`` keys takes
    (:func:`segment_flex_inputs`). ``Mp`` = ``M`` rounded up to :data:`FLEX_BLOCK_SIZE`.

    Attributes:
        keys: [B, Hk, Mp + T, Dq] the segment (padded with zero entries) then the sequence.
        values: [B, Hk, Mp + T, Dv].
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score``: the softcap (if any), then
            ``log(count)`` on segment entries (0 on sequence keys).
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool``: the seam's visibility (True = attend).
        block_mask: the tiles of ``mask_mod`` that hold a visible pair (partial) and those where
            every pair is visible (full), computed from ``split`` and ``valid`` per tile.
    """

    keys: torch.Tensor
    values: torch.Tensor
    score_mod: Callable
    mask_mod: Callable
    block_mask: BlockMask


def segment_flex_inputs(
    k: torch.Tensor,
    v: torch.Tensor,
    seg_k: torch.Tensor,
    seg_v: torch.Tensor,
    segment: KVSegment,
    split: torch.Tensor,
    dtype: torch.dtype,
    softcap: float | None = None,
    block_size: int = FLEX_BLOCK_SIZE,
) -> SegmentFlex:
    """The seam of :func:`segment_attention_mask` as FlexAttention's keys, ``score_mod``,
    ``mask_mod`` and block mask, with no ``[T, M + T]`` tensor anywhere.

    Key ``kv`` < ``Mp`` is segment entry ``kv``: visible from query ``q`` iff ``q >= split[b]``
    and the entry is valid (the padding to ``Mp`` is invalid); score + ``log(count)``. Key
    ``kv >= Mp`` is sequence token ``j = kv - Mp``: visible iff ``j <= q`` and (``q < split[b]``
    or ``j >= split[b]``): context queries see the causal context, continuation queries the
    causal continuation. Every query sees itself, so no row is empty.

    Args:
        k: [B, Hk, T, Dq]; v: [B, Hk, T, Dv] (the sequence, post-RoPE).
        seg_k: [B, Hk, M, Dq], seg_v: [B, Hk, M, Dv] (the segment, in the attention dtype).
        segment: for ``valid``/``counts`` [B, M].
        split: [B] first continuation token per sample (clamped to ``[0, T]``).
        dtype: dtype of the attention logits: ``log(count)`` is rounded to it, as in the dense
            mask, then added in fp32 (FlexAttention's score dtype).
        softcap: ``attn_logit_softcapping`` (logits -> cap * tanh(logits / cap) before the bias,
            as :func:`attention_op`), or None.
        block_size: the block mask's tile.

    Returns:
        :class:`SegmentFlex`.
    """
    B, _, T, _ = k.shape
    M = seg_k.shape[2]
    Mp = -(-M // block_size) * block_size
    pad = Mp - M
    device = k.device
    split = split.to(device=device, dtype=torch.long).clamp(0, T)  # [B]
    # [B, Mp + T] per key: valid (padding entries not) and the additive bias (0 on tokens).
    valid = F.pad(segment.valid.to(torch.bool), (0, pad))  # [B, Mp]
    key_valid = torch.cat([valid, valid.new_ones(B, T)], dim=1)
    seg_bias = F.pad(count_bias(segment.counts, dtype).float(), (0, pad))  # [B, Mp]
    key_bias = torch.cat([seg_bias, seg_bias.new_zeros(B, T)], dim=1)
    # [Mp + T] per key: its token position, -1 on segment entries.
    # NOTE: the mods read only captured tensors, no Python int (such as Mp): a compiled
    # FlexAttention guards on a closure's ints and would recompile whenever M changes.
    key_pos = torch.cat([torch.full((Mp,), -1, device=device), torch.arange(T, device=device)])
    keys = torch.cat([F.pad(seg_k, (0, 0, 0, pad)), k], dim=2)  # [B, Hk, Mp + T, Dq]
    values = torch.cat([F.pad(seg_v, (0, 0, 0, pad)), v], dim=2)  # [B, Hk, Mp + T, Dv]

    def mask_mod(b, h, q_idx, kv_idx):
        s = split[b]
        j = key_pos[kv_idx]
        cont = q_idx >= s
        seg = j < 0
        return (seg & cont & key_valid[b, kv_idx]) | (~seg & (j <= q_idx) & (~cont | (j >= s)))

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = torch.tanh(score / softcap) * softcap
        return score + key_bias[b, kv_idx]

    block_mask = _segment_block_mask(valid, split, T, block_size, mask_mod)
    return SegmentFlex(keys, values, score_mod, mask_mod, block_mask)


def _segment_block_mask(
    valid: torch.Tensor, split: torch.Tensor, T: int, bs: int, mask_mod: Callable
) -> BlockMask:
    """The seam's :class:`BlockMask` from tile bounds, without evaluating ``mask_mod`` per pair
    (``create_block_mask`` would materialise the [B, T, Mp + T] mask it reduces; the test checks
    this function against it).

    A tile is *partial* (``mask_mod`` applied) if some pair in it is visible and *full* (mask
    skipped, ``score_mod`` still applied) if every pair is; tiles reaching past ``T`` are never
    full (``create_block_mask`` pads them with masked pairs).

    Args:
        valid: [B, Mp] bool, ``Mp`` a multiple of ``bs``.
        split: [B] long in ``[0, T]``.

    Returns:
        BlockMask over ``T`` queries and ``Mp + T`` keys, batch ``B``, heads broadcast.
    """
    B, Mp = valid.shape
    nq, ns = -(-T // bs), Mp // bs
    s = split[:, None, None]  # [B, 1, 1]
    start = torch.arange(nq, device=valid.device) * bs  # [nq] first token of a tile
    last = (start + bs).clamp(max=T) - 1  # [nq] last token of a tile
    inside = start + bs <= T  # [nq] the tile does not reach past T
    q0, q1, q_in = start[None, :, None], last[None, :, None], inside[None, :, None]
    # Segment tiles [B, nq, ns]: continuation queries x valid entries.
    v_any = valid.view(B, ns, bs).any(-1)[:, None, :]
    v_all = valid.view(B, ns, bs).all(-1)[:, None, :]
    seg_any = (q1 >= s) & v_any
    seg_full = (q0 >= s) & v_all & q_in
    # Sequence tiles [B, nq, nq]: keys j0..j1 against queries q0..q1.
    j0, j1, j_in = start[None, None, :], last[None, None, :], inside[None, None, :]
    ctx_last = torch.minimum(q1, s - 1)  # last context query of the tile
    cont_first_key = torch.maximum(j0, s)  # first continuation key of the tile
    tok_any = ((q0 <= ctx_last) & (j0 <= ctx_last)) | (
        (torch.maximum(q0, s) <= q1) & (cont_first_key <= j1) & (cont_first_key <= q1)
    )
    tok_full = (j1 <= q0) & ((q1 < s) | (j0 >= s)) & q_in & j_in
    any_ = torch.cat([seg_any, tok_any], dim=-1)[:, None]  # [B, 1, nq, ns + nq]
    full = torch.cat([seg_full, tok_full], dim=-1)[:, None]
    partial = any_ & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # count per row, then the tiles' indices (those present first, ascending): torch's order
        blocks = blocks.to(torch.int32)
        idx = torch.argsort(blocks, dim=-1, descending=True, stable=True)
        return blocks.sum(-1, dtype=torch.int32), idx.to(torch.int32)

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(T, Mp + T)
    )


@functools.cache
def _compiled_flex_attention() -> Callable:
    """``torch.compile(flex_attention)``, built on first use (no compile at import): the fused
    kernel that skips masked tiles and never materialises the scores."""
    return torch.compile(flex_attention)


def attend_segment_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg_k: torch.Tensor,
    seg_v: torch.Tensor,
    segment: KVSegment,
    split: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The seam's attention as one FlexAttention call (same result as
    :func:`segment_attention_mask` + :func:`attention_op`; ``tests/test_flex_seam.py``).

    On CUDA the call is compiled (fused, masked tiles skipped). On CPU torch runs FlexAttention
    eagerly, forward only (the unfused reference: it materialises the scores and ignores the
    block mask's sparsity), so this mode on CPU is for tests under ``no_grad``.

    Args:
        q: [B, H, T, Dq]; k: [B, Hk, T, Dq]; v: [B, Hk, T, Dv] (the sequence, post-RoPE).
        seg_k: [B, Hk, M, Dq], seg_v: [B, Hk, M, Dv] (the segment, in the attention dtype).
        segment: for ``valid``/``counts`` [B, M].
        split: [B].
        scale: logit scale (None: 1/sqrt(Dq)).
        softcap: ``attn_logit_softcapping`` or None.
        enable_gqa: H a multiple of Hk.

    Returns:
        [B, H, T, Dv].

    Raises:
        NotImplementedError: on CPU with inputs that require grad (torch's FlexAttention has no
            CPU backward).
    """
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, seg_k, seg_v)):
            raise NotImplementedError(
                f"SEGMENT_ATTENTION='flex' on CPU: FlexAttention in torch {torch.__version__} has "
                "no CPU backward; use 'per_sample' (the CPU default) or 'batched', or call under "
                "torch.no_grad()"
            )
        # NOTE: torch refuses CPU inputs that require grad even under no_grad.
        q, k, v, seg_k, seg_v = (t.detach() for t in (q, k, v, seg_k, seg_v))
    fx = segment_flex_inputs(k, v, seg_k, seg_v, segment, split, q.dtype, softcap=softcap)
    kernel = _compiled_flex_attention() if q.device.type == "cuda" else flex_attention
    return kernel(
        q,
        fx.keys,
        fx.values,
        score_mod=fx.score_mod,
        block_mask=fx.block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def gather_rope(
    rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, seg_positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, T, D] at ``positions`` [B, T] -> cos/sin [B, M, D] at ``seg_positions``.

    Positions of a training sequence are ``arange(T)`` shifted per sample, so the entry for a
    segment position is found by offset from the sample's first position.
    """
    cos, sin = rope
    idx = (seg_positions - positions[:, :1]).clamp(0, cos.shape[1] - 1)  # [B, M]
    idx = idx[..., None].expand(-1, -1, cos.shape[-1])
    return cos.gather(1, idx), sin.gather(1, idx)


def kv_bytes_per_token(config: ModelConfig, bytes_per_element: int = 2) -> int:
    """KV-cache bytes per token per layer of an uncompressed cache
    (:func:`unicache_train.seam.uncompressed_kv_bytes`): MLA stores its latent
    ``[c_kv ‖ k_pe]`` once, GQA its K and V per KV head."""
    if config.attention_type == "mla":
        width = config.kv_lora_rank + config.qk_rope_head_dim
        return int(
            uncompressed_kv_bytes(
                1, 1, width, config.kv_lora_rank, latent=True, dtype_bytes=bytes_per_element
            )
        )
    hd = config.head_size
    return int(
        uncompressed_kv_bytes(1, config.num_key_value_heads, hd, hd, dtype_bytes=bytes_per_element)
    )


__all__ = [
    "Attention",
    "FLEX_BLOCK_SIZE",
    "QKV",
    "SegmentFlex",
    "attend_segment_flex",
    "attend_segment_per_sample",
    "attention_op",
    "count_bias",
    "kv_bytes_per_token",
    "segment_attention_mask",
    "segment_attention_mode",
    "segment_flex_inputs",
    "sliding_causal_mask",
]
