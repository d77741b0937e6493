"""The decoder: embeddings, pre-norm blocks, final norm, LM head. Pure PyTorch.

Shape legend: B, T, n, C, V = batch, tokens, residual streams (``hc_mult``), hidden size, vocab.

Block (residual mode ``residual``)::

    x ─┬─► input_layernorm ─► self_attn ─► (+) ─┬─► post_attention_layernorm ─► mlp ─► (+) ─► x'
       └────────────────────────────────────────┘└───────────────────────────────────────┘

With hyper-connections (``residual_mode`` ``mhc``/``hc``, ``hc_mult = n > 1``) the residual is
``[B, T, n, C]``: each sub-layer's connection module (``attn_hc``, ``ffn_hc``) collapses the
streams into the branch input, runs the branch (norm + sub-layer) and mixes the branch output
back into the streams (see :mod:`unicache_train.model.mhc`). Embeddings enter as n copies;
``hc_head`` collapses the streams before the final norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from unicache_train.config import ModelConfig
from unicache_train.model.attention import Attention
from unicache_train.model.kv_cache import KVCache, new_kv_cache
from unicache_train.model.mlp import SwiGLU
from unicache_train.model.norm import RMSNorm
from unicache_train.model.rope import RotaryEmbedding
from unicache_train.seam import KVCompressor, find_cross_layer

Branch = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DecoderOutput:
    """logits: [B, T, V]; compression: one stats dict per layer when a compressor ran."""

    logits: torch.Tensor
    compression: list[dict[str, torch.Tensor]] = field(default_factory=list)


def build_connections(config: ModelConfig) -> tuple[nn.Module | None, nn.Module | None]:
    """The (attn_hc, ffn_hc) connection modules of one block; (None, None) for a plain residual."""
    if not config.uses_streams:
        return None, None
    from unicache_train.model.mhc import HyperConnection

    return HyperConnection(config), HyperConnection(config)


class Block(nn.Module):
    """One pre-norm decoder layer (HF Llama names; ``attn_hc``/``ffn_hc`` as in deepseek_v4)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attention_type == "mla":
            from unicache_train.model.mla import MLAttention

            self.self_attn: nn.Module = MLAttention(config, layer_idx)
        else:
            self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.attn_hc, self.ffn_hc = build_connections(config)

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        """x: [B, T, C] (plain residual) or [B, T, n, C] (hyper-connections) -> same shape."""

        def attn(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(self.input_layernorm(h), **attn_kwargs)

        def mlp(h: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.post_attention_layernorm(h))

        if self.attn_hc is None:
            x = x + attn(x)
            return x + mlp(x)
        x = self.attn_hc(x, attn)
        return self.ffn_hc(x, mlp)


class Decoder(nn.Module):
    """A decoder-only LM: GQA/MHA (or MLA) attention, SwiGLU, RMSNorm, RoPE, optional mHC."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.hc_head: nn.Module | None = None
        if config.uses_streams:
            from unicache_train.model.mhc import HyperHead

            self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        rope_dim = config.qk_rope_head_dim if config.attention_type == "mla" else config.head_size
        self.rotary = RotaryEmbedding(rope_dim, config.rope_theta)
        self.reset_parameters()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        """GPT-style init: N(0, initializer_range) for linear/embedding weights, zeros for biases.

        Norm gains start at one; hyper-connection modules initialise themselves.
        """
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    @property
    def num_streams(self) -> int:
        return self.config.hc_mult if self.config.uses_streams else 1

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        modality_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        split: torch.Tensor | None = None,
        compressor: KVCompressor | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> DecoderOutput:
        """Run the decoder.

        Args:
            input_ids: [B, T] token ids (or give ``inputs_embeds``).
            inputs_embeds: [B, T, C] embeddings (e.g. projected image patches).
            modality_ids: [B, T] 0 text, 1 vision, 2 audio (default: all text).
            positions: [B, T] absolute positions (default: ``arange`` after the cached tokens).
            cache: KV cache for incremental decoding.
            split: [B] first continuation token of each sample; with ``compressor``, the context
                ``[0, split)`` is prefilled, compressed at every layer, and the continuation
                attends to the compressed cache (see :mod:`unicache_train.model.attention`).
            compressor: the KV compressor called at the attention seam. A cross-layer one
                (xKV, ``cross_layer = True``) is prepared first: the context is prefilled
                through every layer and its factors fitted, then this forward runs with it.
            logits_at: [B, K] long positions whose logits are wanted (default: every position).
                The LM head is applied to those positions only: a prefill that needs the last
                prompt token's logits skips the ``T x V`` head product (a third of a 135M
                model's FLOPs at its 49k vocabulary).

        Returns:
            :class:`DecoderOutput` with logits [B, T, V] ([B, K, V] with ``logits_at``).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] or inputs_embeds [B, T, C]")
        if (split is None) != (compressor is None):
            raise ValueError("split and compressor go together: pass both or neither")
        if split is not None and cache is not None:
            raise ValueError("the in-loop compression forward does not use a decoding cache")
        if split is not None:
            ref = input_ids if inputs_embeds is None else inputs_embeds
            check_split(split, ref.shape[0], ref.shape[1])
        cross = find_cross_layer(compressor) if compressor is not None else None
        if cross is not None and not cross.prepared:
            # NOTE: a cross-layer compressor (xKV) needs every layer's context K/V before the
            # seam asks it for any layer: it first prefills the context through the whole stack
            # (a nested call of this forward with a recording compressor) and fits its factors;
            # then this forward runs with it serving each layer. Context rows never depend on
            # the compressed cache, so both passes compute the same context.
            cross.prepare(self, input_ids, split=split, inputs_embeds=inputs_embeds,
                          modality_ids=modality_ids, positions=positions)
            try:
                return self.forward(input_ids, inputs_embeds=inputs_embeds,
                                    modality_ids=modality_ids, positions=positions, split=split,
                                    compressor=compressor, logits_at=logits_at)
            finally:
                cross.release()
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, C]
        B, T = x.shape[:2]
        if positions is None:
            start = cache.length() if cache is not None else 0
            positions = torch.arange(start, start + T, device=x.device).expand(B, T)
        if modality_ids is None:
            modality_ids = torch.zeros(B, T, dtype=torch.long, device=x.device)
        rope = self.rotary(positions, x.dtype)
        stats: list[dict[str, torch.Tensor]] = []
        kwargs = dict(rope=rope, positions=positions, modality_ids=modality_ids, cache=cache,
                      split=split, compressor=compressor, stats=stats)
        if self.hc_head is not None:
            x = x.unsqueeze(2).expand(B, T, self.num_streams, x.shape[-1])  # [B, T, n, C]
        for layer in self.layers:
            x = layer(x, **kwargs)
        if self.hc_head is not None:
            x = self.hc_head(x)  # [B, T, n, C] -> [B, T, C]
        if logits_at is not None:
            if logits_at.dim() != 2 or logits_at.shape[0] != B or logits_at.dtype != torch.long:
                raise ValueError(
                    f"logits_at of shape {tuple(logits_at.shape)} and dtype {logits_at.dtype}: "
                    f"expected a long tensor [B, K] = [{B}, K] of positions in [0, {T})"
                )
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, C]
        logits = self.lm_head(self.norm(x))  # [B, T or K, V]
        return DecoderOutput(logits=logits, compression=stats)

    # ---------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Greedy (``temperature=0``) or sampled decoding with a KV cache.

        Args:
            input_ids: [B, T] prompts (equal lengths; no padding).
            max_new_tokens: tokens to append.
            temperature: 0 for greedy, else softmax temperature.
            top_k: sample only among the k most likely tokens.
            eos_token_id: stop a sequence once it emits this token (later tokens repeat it).

        Returns:
            [B, T + max_new_tokens] (or shorter when every sequence finished).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
            max_new_tokens < 0
        ):
            raise ValueError(
                f"max_new_tokens={max_new_tokens!r} is out of range; allowed an integer in "
                "[0, inf)"
            )
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature={temperature!r} is out of range; allowed [0, inf)")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or (
            top_k < 1
        )):
            raise ValueError(
                f"top_k={top_k!r} is out of range; allowed None or an integer in [1, inf)"
            )
        cache = new_kv_cache(self.config)  # latent cache for MLA, K/V cache for GQA
        logits = self(input_ids, cache=cache).logits[:, -1]  # [B, V]
        out = input_ids
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            nxt = _pick(logits.float(), temperature, top_k, generator)  # [B]
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            out = torch.cat([out, nxt[:, None]], dim=1)
            if eos_token_id is not None and bool(done.all()):
                break
            logits = self(nxt[:, None], cache=cache).logits[:, -1]
        return out


def check_split(split: torch.Tensor, B: int, T: int) -> None:
    """Refuse a ``split`` the in-loop forward cannot mean: it must be an integer tensor [B] with
    every entry in ``[0, T]`` (``T``: the whole sequence is context).

    Raises:
        ValueError: naming the value and the allowed shape, dtype or range.
    """
    if not isinstance(split, torch.Tensor):
        raise ValueError(
            f"split={split!r}: expected an integer tensor of shape [B] = [{B}], got "
            f"{type(split).__name__}"
        )
    if split.dtype.is_floating_point or split.dtype.is_complex or split.dtype == torch.bool:
        raise ValueError(
            f"split has dtype {split.dtype}: expected an integer tensor of shape [B] = [{B}] "
            "(the index of each sample's first continuation token)"
        )
    if tuple(split.shape) != (B,):
        raise ValueError(f"split has shape {tuple(split.shape)}: expected [B] = [{B}]")
    if B == 0 or split.device.type != "cpu":
        # NOTE: the range check reads the values; on an accelerator that is a device sync on
        # every training step, so it runs on CPU tensors only (data pipelines build splits on
        # the CPU; sample_splits' own bounds hold elsewhere).
        return
    lo, hi = torch.stack([split.min(), split.max()]).tolist()
    if lo < 0 or hi > T:
        raise ValueError(
            f"split={split.tolist()} is out of range; allowed [0, T] = [0, {T}] per sample"
        )


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None,
          generator: torch.Generator | None) -> torch.Tensor:
    """logits: [B, V] -> next token ids [B]."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
