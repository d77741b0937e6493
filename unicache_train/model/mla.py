"""Multi-head Latent Attention (MLA) with decoupled RoPE, HF DeepseekV3 parameter names.

DeepSeek-V2 (arXiv 2405.04434) §2.1, DeepSeek-V3 (arXiv 2412.19437). Numerics follow
transformers' ``DeepseekV3Attention`` (tested to 1e-5); RoPE is our rotate-half layout, and the
exporter permutes the RoPE rows into DeepSeek's interleaved layout
(:mod:`unicache_train.checkpoint.deepseek_v3`).

Shape legend: B, T, S, M, H, C = batch, query tokens, key tokens (cached + new), segment
entries, heads, hidden size; R, Rq, Dn, Dr, Dv = ``kv_lora_rank``, ``q_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``.

::

    x [B,T,C] ─┬─► q_proj (or q_a_proj ─► q_a_layernorm ─► q_b_proj) ─► q_nope [B,H,T,Dn]
               │                                                    └─► q_pe [B,H,T,Dr] ─► RoPE
               └─► kv_a_proj_with_mqa ─┬─► c_kv [B,T,R] ─► kv_a_layernorm ──┐
                                       └─► k_pe [B,T,Dr] ─► RoPE ───────────┤ one k_pe head,
                                                                            │ shared by all heads
        cache = (c_kv, k_pe): R + Dr elements per token per layer ◄─────────┘

    training (expanded): kv_b_proj(c_kv) ─► k_nope [B,H,S,Dn], v [B,H,S,Dv]
                         SDPA([q_nope ‖ q_pe], [k_nope ‖ k_pe], v, causal) ─► o_proj
    decoding (absorbed): q_lat = q_nope · W_uk [B,H,T,R]; MQA over the latent:
                         SDPA([q_lat ‖ q_pe], keys=[c_kv ‖ k_pe], values=c_kv) [B,H,T,R]
                         ─► · W_uvᵀ [B,H,T,Dv] ─► o_proj

with ``W_uk = kv_b_proj.weight[h, :Dn]`` and ``W_uv = kv_b_proj.weight[h, Dn:]`` per head. Both
forms compute ``softmax((q_nope·W_uk c + q_pe·k_pe) · (Dn + Dr)^-1/2)`` and agree to fp32
round-off; the absorbed form never materialises per-head keys, which is MLA's point.

**Compression seam (design decision).** Compressors see the *latent* cache, not per-head K/V:
``keys = [c_kv ‖ k_pe]`` [B, 1, T, R + Dr] (one MQA head; ``k_pe`` post-RoPE unless the compressor
is ``pre_rope``), ``values = c_kv`` [B, 1, T, R], and ``queries = [q_nope·W_uk ‖ q_pe]``
[B, H, T, R + Dr], the absorbed queries, so ``queries · keys`` is exactly the model's attention
logit (up to the constant softmax scale ``(Dn + Dr)^-1/2``, which a compressor's own
``D^-1/2`` does not know). Why: the latent is what inference stores, so token merge/evict and
quantisation act on the real cache and their byte accounting is honest; per-head K/V would be
``H (Dn + Dr + Dv)`` elements per token, a cache MLA never holds. Head merging has nothing to
merge (one latent head). Continuation queries then attend to the compressed segment in the
*expanded* form: ``k_nope = W_uk · keys[..., :R]``, ``k_pe = keys[..., R:]``,
``v = W_uv · values``, which equals absorbed attention on the segment (it is cheaper to train
when ``R > Dn``). At deployment ``values`` is ``keys[..., :R]`` (no second copy): UniCache's
merge/evict and quantization keep it so (the latent is merged once and quantized once,
``KVSegment.latent``), as xKV does (it factorises the keys only); a compressor that changes
``values`` independently of ``keys`` is simulated faithfully here, but its deployed cache holds
(and its byte count counts) both.

**Decoding on a compressed latent cache** (:mod:`unicache_train.model.generate`): the prefill's
segment is stored as the latent (``CompressedKVCache(latent=True)``); each decode step appends
its ``[c_kv ‖ k_pe]`` once and attends in the absorbed form to ``[segment (+ log count) ;
decoded latents]`` (:meth:`MLAttention._decode_compressed`), equal to the in-loop forward's
continuation logits (fp32 round-off; ``tests/test_mla_compressed_decoding.py``).

**RoPE scaling** (``ModelConfig.rope_scaling``, :mod:`unicache_train.model.rope`): ``q_pe`` and
``k_pe`` use the scaled tables (YaRN's attention factor ``a`` is in cos/sin, so the RoPE part of
the logit grows by ``a²`` and the NoPE part does not, as in transformers), and the softmax scale is
``(Dn + Dr)^-1/2 · m(factor, mscale_all_dim)²`` as in transformers' ``DeepseekV3Attention``
(:func:`~unicache_train.model.rope.mla_softmax_mscale`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from unicache_train.model.attention import (
    attend_segment_per_sample,
    gather_rope,
    segment_attention_mask,
    segment_attention_mode,
)
from unicache_train.model.compressed_cache import CompressedKVCache
from unicache_train.model.config import ModelConfig
from unicache_train.model.kv_cache import KVCache, LatentKVCache
from unicache_train.model.norm import RMSNorm
from unicache_train.model.rope import apply_rope, mla_softmax_mscale
from unicache_train.seam import CompressionInput, KVCompressor, KVSegment

# NOTE: DeepSeek (and HF DeepseekV3) build q_a_layernorm / kv_a_layernorm with the default eps
# whatever config.rms_norm_eps says; we match it for checkpoint parity.
LATENT_NORM_EPS = 1e-6

__all__ = ["MLAttention", "LATENT_NORM_EPS"]


class MLAttention(nn.Module):
    """Causal Multi-head Latent Attention with HF DeepseekV3 parameter names.

    Biases follow HF when ``attention_bias`` is set (``q_a_proj``, ``kv_a_proj_with_mqa``,
    ``o_proj``); the DeepseekV3 exporter refuses them because inference stacks ignore them.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        C, H, R = config.hidden_size, self.num_heads, self.kv_lora_rank
        Dn, Dr, Dv = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        bias = config.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(C, H * (Dn + Dr), bias=False)
        else:
            self.q_a_proj = nn.Linear(C, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * (Dn + Dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(C, R + Dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(R, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(R, H * (Dn + Dv), bias=False)
        self.o_proj = nn.Linear(H * Dv, C, bias=bias)
        # DeepSeek YaRN: the softmax scale grows by mscale(factor, mscale_all_dim)^2.
        self.scaling = (Dn + Dr) ** -0.5 * mla_softmax_mscale(config.rope_scaling)

    # ---------------------------------------------------------------------------- projections
    def _queries(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, C] -> q_nope [B, H, T, Dn], q_pe [B, H, T, Dr] (RoPE applied)."""
        B, T, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.num_heads, -1).transpose(1, 2)  # [B, H, T, Dn + Dr]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return q_nope, apply_rope(q_pe, *rope)

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, C] -> c_kv [B, 1, T, R] (normed), k_pe [B, 1, T, Dr] (pre-RoPE)."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        # One "head" axis so that the latent looks like an MQA cache to SDPA and compressors.
        return self.kv_a_layernorm(c_kv)[:, None], k_pe[:, None]

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_uk [H, Dn, R], W_uv [H, Dv, R]."""
        w = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)  # [H, Dn + Dv, R]
        return w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)

    def _expand(
        self, c_k: torch.Tensor, k_pe: torch.Tensor, c_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents -> per-head keys and values.

        Args:
            c_k: [B, 1, S, R] latent the keys are read from.
            k_pe: [B, 1, S, Dr] post-RoPE shared key head.
            c_v: [B, 1, S, R] latent the values are read from (the same tensor as ``c_k``
                except after a compressor that changed them separately).

        Returns:
            k [B, H, S, Dn + Dr], v [B, H, S, Dv].
        """
        B, _, S, _ = c_k.shape
        w_uk, w_uv = self._up_weights()
        if c_v is c_k:  # one GEMM as in HF, then split
            kv = self.kv_b_proj(c_k[:, 0]).view(B, S, self.num_heads, -1).transpose(1, 2)
            k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        else:
            k_nope = torch.einsum("bsr,hdr->bhsd", c_k[:, 0], w_uk)  # [B, H, S, Dn]
            v = torch.einsum("bsr,hdr->bhsd", c_v[:, 0], w_uv)  # [B, H, S, Dv]
        k_pe = k_pe.expand(B, self.num_heads, S, self.qk_rope_head_dim)  # a view, no copy
        return torch.cat([k_nope, k_pe], dim=-1), v

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """Fold kv_b_proj's key part into the query: [B, H, T, Dn] -> q_lat [B, H, T, R]."""
        w_uk, _ = self._up_weights()
        return torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)

    # ---------------------------------------------------------------------------- forward
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
            rope: (cos, sin), each [B, T, Dr], for ``positions``.
            positions: [B, T] absolute positions.
            modality_ids: [B, T].
            cache: a :class:`LatentKVCache`, or a latent
                :class:`~unicache_train.model.compressed_cache.CompressedKVCache` (decoding on a
                compressed context, :mod:`unicache_train.model.generate`); absorbed form.
            split: [B] int, first continuation token per sample (seam, with ``compressor``).
            compressor: the KV compressor called at the seam on the latent cache.
            stats: if given, the segment's stats dict is appended (one per layer).

        Returns:
            [B, T, C].
        """
        B, T, _ = x.shape
        q_nope, q_pe = self._queries(x, rope)  # [B, H, T, Dn], [B, H, T, Dr]
        c_kv, k_pe_raw = self._latents(x)  # [B, 1, T, R], [B, 1, T, Dr]
        k_pe = apply_rope(k_pe_raw, *rope)  # [B, 1, T, Dr]

        if split is not None and compressor is not None:
            segment = self._compress_context(
                q_nope, q_pe, c_kv, k_pe, k_pe_raw, positions, modality_ids, split, compressor, rope
            )
            if stats is not None:
                stats.append(segment.stats)
            out = self._attend_segment(q_nope, q_pe, c_kv, k_pe, segment, split)
        elif cache is not None:
            out = self._decode(q_nope, q_pe, c_kv, k_pe, cache)
        else:
            k, v = self._expand(c_kv, k_pe, c_kv)
            q = torch.cat([q_nope, q_pe], dim=-1)  # [B, H, T, Dn + Dr]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_head_dim)  # [B, T, H*Dv]
        return self.o_proj(out)

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """Append the new latents to the cache and attend; returns [B, H, T, Dv].

        A prefill into an empty cache uses the expanded form (cheaper for long prompts when
        ``R > Dn``, as serving stacks do); every later chunk uses the absorbed form, reading only
        the latent cache. A compressed cache: see :meth:`_decode_compressed`.
        """
        if isinstance(cache, CompressedKVCache):
            return self._decode_compressed(q_nope, q_pe, c_kv, k_pe, cache)
        if not isinstance(cache, LatentKVCache):
            raise TypeError(
                f"MLA decoding reads a LatentKVCache (c_kv + k_pe), got {type(cache).__name__}; "
                "build it with unicache_train.model.kv_cache.new_kv_cache(config)"
            )
        T = q_nope.shape[2]
        past = cache.length(self.layer_idx)
        c_all, pe_all = cache.update(self.layer_idx, c_kv, k_pe)  # [B, 1, S, R], [B, 1, S, Dr]
        if past == 0 and T > 1:
            k, v = self._expand(c_all, pe_all, c_all)
            q = torch.cat([q_nope, q_pe], dim=-1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        mask = None
        if T > 1:  # a chunk of T queries sees every cached key and is causal within itself
            S = c_all.shape[2]
            qi = torch.arange(T, device=c_kv.device)[:, None] + past
            mask = torch.arange(S, device=c_kv.device)[None, :] <= qi  # [T, S]
        return self.attend_absorbed(q_nope, q_pe, torch.cat([c_all, pe_all], dim=-1), c_all, mask)

    def _decode_compressed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        cache: CompressedKVCache,
    ) -> torch.Tensor:
        """Decode on a compressed latent cache: the new latents join the decoded ones, and the
        queries attend (absorbed form) to ``[stored segment (+ log count) ; decoded latents]``
        through :meth:`CompressedKVCache.attend` (which returns the latent output; ``W_uv`` is
        applied here), which is what the seam's continuation queries attend to in the in-loop
        forward (``_attend_segment``, expanded form; equal to fp32 round-off).
        Returns [B, H, T, Dv]."""
        if not cache.latent:
            raise TypeError(
                "MLA decoding on a compressed cache needs a latent one (c_kv ‖ k_pe): build it "
                "with CompressedKVCache(num_layers, latent=True), as "
                "unicache_train.model.generate.prefill_compressed does for an MLA model"
            )
        q = torch.cat([self.absorb_query(q_nope), q_pe], dim=-1)  # [B, H, T, R + Dr]
        latents = torch.cat([c_kv, k_pe], dim=-1)  # [B, 1, T, R + Dr]
        # NOTE: the softmax scale stays (Dn + Dr)^-1/2 (see attend_absorbed).
        o_lat = cache.attend(self.layer_idx, q, latents, c_kv, scale=self.scaling)  # [B,H,T,R]
        return self._values_from_latent(o_lat)

    def attend_absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Absorbed MLA: multi-query attention over the latent cache.

        Args:
            q_nope: [B, H, T, Dn]; q_pe: [B, H, T, Dr] (post-RoPE).
            keys: [B, 1, S, R + Dr] cached ``[c_kv ‖ k_pe]``.
            values: [B, 1, S, R] cached ``c_kv``.
            mask: optional bool [T, S] or additive [B, 1, T, S].

        Returns:
            [B, H, T, Dv].
        """
        q = torch.cat([self.absorb_query(q_nope), q_pe], dim=-1)  # [B, H, T, R + Dr]
        # NOTE: the softmax scale stays (Dn + Dr)^-1/2 although the dot product is R + Dr long:
        # absorption changes how the logit is computed, not its value.
        o_lat = F.scaled_dot_product_attention(
            q,
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=mask,
            scale=self.scaling,
            enable_gqa=True,
        )  # [B, H, T, R]
        return self._values_from_latent(o_lat)

    def _values_from_latent(self, o_lat: torch.Tensor) -> torch.Tensor:
        """The absorbed attention's latent output [B, H, T, R] -> per-head values
        ``o_lat · W_uvᵀ`` [B, H, T, Dv]."""
        _, w_uv = self._up_weights()
        return torch.einsum("bhtr,hvr->bhtv", o_lat, w_uv)  # [B, H, T, Dv]

    # ------------------------------------------------------------------- the compression seam
    def _compress_context(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        k_pe_raw: torch.Tensor,
        positions: torch.Tensor,
        modality_ids: torch.Tensor,
        split: torch.Tensor,
        compressor: KVCompressor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> KVSegment:
        """THE point where the KV compressor is called on MLA's latent cache (one call per layer).

        The compressor sees ``keys = [c_kv ‖ k_pe]`` [B, 1, T, R + Dr], ``values = c_kv``
        [B, 1, T, R] and the absorbed queries [B, H, T, R + Dr] (see the module docstring).
        ``pre_rope`` compressors get ``k_pe`` before RoPE; it is rotated here at the positions
        the segment reports.
        """
        T = c_kv.shape[2]
        context_mask = torch.arange(T, device=c_kv.device)[None, :] < split[:, None]  # [B, T]
        pre_rope = getattr(compressor, "pre_rope", False)
        R = self.kv_lora_rank
        inp = CompressionInput(
            layer_idx=self.layer_idx,
            num_layers=self.num_layers,
            queries=torch.cat([self.absorb_query(q_nope), q_pe], dim=-1),
            keys=torch.cat([c_kv, k_pe_raw if pre_rope else k_pe], dim=-1),
            values=c_kv,
            positions=positions,
            modality_ids=modality_ids,
            context_mask=context_mask,
            latent=True,
        )
        segment = compressor(inp)
        if pre_rope:
            cos, sin = gather_rope(rope, positions, segment.positions)
            seg_pe = apply_rope(segment.keys[..., R:], cos, sin)
            segment.keys = torch.cat([segment.keys[..., :R], seg_pe], dim=-1)
        return segment

    def _attend_segment(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        segment: KVSegment,
        split: torch.Tensor,
    ) -> torch.Tensor:
        """Context queries attend causally to the full context; continuation queries attend to
        the (compressed) latent segment and causally to the continuation. One SDPA call over
        ``M + T`` expanded keys. Returns [B, H, T, Dv]."""
        R, dtype = self.kv_lora_rank, q_nope.dtype
        q = torch.cat([q_nope, q_pe], dim=-1)
        if segment.identity:  # the untouched context: plain causal attention (see Attention)
            k, v = self._expand(c_kv, k_pe, c_kv)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        seg_keys = segment.keys.to(dtype)
        seg_k, seg_v = self._expand(seg_keys[..., :R], seg_keys[..., R:], segment.values.to(dtype))
        k, v = self._expand(c_kv, k_pe, c_kv)
        if segment_attention_mode(q.device) == "per_sample":
            return attend_segment_per_sample(
                q, k, v, seg_k, seg_v, segment, split, scale=self.scaling
            )
        mask = segment_attention_mask(segment, split, q_nope.shape[2], dtype)  # [B, 1, T, M + T]
        return F.scaled_dot_product_attention(
            q,
            torch.cat([seg_k, k], dim=2),
            torch.cat([seg_v, v], dim=2),
            attn_mask=mask,
            scale=self.scaling,
        )
