"""The decoder: embeddings, pre-norm blocks, final norm, LM head. Pure PyTorch.

Shape legend: B, T, n, C, V = batch, tokens, residual streams (``hc_mult``), hidden size, vocab.

Block (residual mode ``residual``)::

    x ─┬─► input_layernorm ─► self_attn ─► (+) ─┬─► post_attention_layernorm ─► mlp ─► (+) ─► x'
       └────────────────────────────────────────┘└───────────────────────────────────────┘

Block (``block_style="gemma3"``, Gemma 3: four (1 + w) RMSNorms, tanh-GELU GeGLU ``mlp``)::

    x ─┬─► input_layernorm ─► self_attn ─► post_attention_layernorm ─► (+) ─┬─►
       └────────────────────────────────────────────────────────────────────┘│
       ┌─────────────────────────────────────────────────────────────────────┘
    ───┴─► pre_feedforward_layernorm ─► mlp ─► post_feedforward_layernorm ─► (+) ─► x'

with embeddings scaled by ``sqrt(hidden_size)`` (in the weight dtype, as transformers), the
sliding layers' RoPE at ``rope_local_theta`` and the logits capped by ``final_logit_softcapping``.

``mlp`` is a SwiGLU, or from layer ``first_k_dense_replace`` on (``n_routed_experts > 0``) a
DeepSeek MoE FFN (:mod:`unicache_train.model.moe`); either is a sub-layer ``[.., C] -> [.., C]``.

With hyper-connections (``residual_mode`` ``mhc``/``hc``, ``hc_mult = n > 1``) the residual is
``[B, T, n, C]``: each sub-layer's connection module (``attn_hc``, ``ffn_hc``) collapses the
streams into the branch input, runs the branch (norm + sub-layer) and mixes the branch output
back into the streams (see :mod:`unicache_train.model.mhc`). Embeddings enter as n copies;
``hc_head`` collapses the streams before the final norm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from unicache_train.model.attention import Attention
from unicache_train.model.config import ModelConfig
from unicache_train.model.kv_cache import KVCache, new_kv_cache
from unicache_train.model.mlp import SwiGLU
from unicache_train.model.moe import MoE, expert_loads, update_router_bias
from unicache_train.model.norm import RMSNorm
from unicache_train.model.rope import RotaryEmbedding
from unicache_train.seam import (
    CompressionInput,
    CrossLayerCompressor,
    KVCompressor,
    KVSegment,
    RecordedContext,
    RecordingCompressor,
    find_cross_layer,
)

Branch = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DecoderOutput:
    """What a forward returns.

    Attributes:
        logits: [B, T, V] ([B, K, V] with ``logits_at``).
        compression_stats: one stats dict per layer (the segment's
            :attr:`~unicache_train.seam.KVSegment.stats`: ``rate_realized``, ``kv_bytes``,
            ``kv_reduction``, ...) when a compressor ran, else empty.
        reference_logits: [B, T, V] the uncompressed forward's logits (no gradient) when asked.
    """

    logits: torch.Tensor
    compression_stats: list[dict[str, torch.Tensor]] = field(default_factory=list)
    reference_logits: torch.Tensor | None = None


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
        gemma = config.block_style == "gemma3"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma)
        if config.attention_type == "mla":
            from unicache_train.model.mla import MLAttention

            self.self_attn: nn.Module = MLAttention(config, layer_idx)
        else:
            self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma)
        # Gemma 3: norms after attention and around the FFN (post_attention_layernorm then
        # normalises the attention output instead of the FFN input).
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, True)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, True)
        # DeepSeek MoE FFN from layer first_k_dense_replace on (see model/moe.py).
        self.mlp: nn.Module = (
            MoE(config)
            if config.is_moe_layer(layer_idx)
            else SwiGLU(
                config.hidden_size,
                config.intermediate_size,
                "gelu_pytorch_tanh" if gemma else "silu",
            )
        )
        self.attn_hc, self.ffn_hc = build_connections(config)

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        """x: [B, T, C] (plain residual) or [B, T, n, C] (hyper-connections) -> same shape."""

        def attn(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(self.input_layernorm(h), **attn_kwargs)

        def mlp(h: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.post_attention_layernorm(h))

        if self.pre_feedforward_layernorm is not None:  # Gemma 3
            assert self.post_feedforward_layernorm is not None
            x = x + self.post_attention_layernorm(attn(x))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

        if self.attn_hc is None:
            x = x + attn(x)
            return x + mlp(x)
        x = self.attn_hc(x, attn)
        return self.ffn_hc(x, mlp)


class Decoder(nn.Module):
    """A decoder-only LM: GQA/MHA (or MLA) attention, SwiGLU (or DeepSeek MoE) FFN, RMSNorm,
    RoPE, optional mHC."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.hc_head: nn.Module | None = None
        if config.uses_streams:
            from unicache_train.model.mhc import HyperHead

            self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.block_style == "gemma3")
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        rope_dim = config.qk_rope_head_dim if config.attention_type == "mla" else config.head_size
        self.rotary = RotaryEmbedding(
            rope_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        # Gemma 3: the sliding layers' own RoPE base (unscaled, as transformers' default there).
        self.rotary_local: RotaryEmbedding | None = None
        if config.rope_local_theta is not None and config.has_sliding_layers:
            self.rotary_local = RotaryEmbedding(
                rope_dim, config.rope_local_theta, None, config.max_position_embeddings
            )
        self.reset_parameters()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        """GPT-style init: N(0, initializer_range) for linear/embedding weights, zeros for biases.

        Norm gains start at one; hyper-connection modules initialise themselves; MoE routers and
        stacked expert weights get the same normal init (router bias zero).
        """
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, MoE):
                module.reset_parameters(std)

    @property
    def num_streams(self) -> int:
        return self.config.hc_mult if self.config.uses_streams else 1

    def update_router_bias(self, rate: float, loads: torch.Tensor | None = None) -> None:
        """One auxiliary-loss-free balancing step of every MoE router, then reset the loads
        (:func:`unicache_train.model.moe.update_router_bias`; ``loads`` [L_moe, E], default:
        :meth:`expert_loads`)."""
        update_router_bias(self, rate, loads)

    def expert_loads(self) -> torch.Tensor:
        """[L_moe, E] tokens routed to each expert by the training forwards since the last
        update (this process only)."""
        return expert_loads(self)

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
        reference_logits: bool = False,
        step: int | None = None,
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
            compressor: the KV compressor called at the attention seam. For a cross-layer one
                (xKV, :class:`~unicache_train.seam.CrossLayerCompressor`) this forward runs two
                passes: it records every layer's context, asks the compressor to fit it, then
                runs the compressed pass with the fit (:meth:`_fit_cross_layer`).
            logits_at: [B, K] long positions whose logits are wanted (default: every position).
                The LM head is applied to those positions only: a prefill that needs the last
                prompt token's logits skips the ``T x V`` head product (a third of a 135M
                model's FLOPs at its 49k vocabulary).
            reference_logits: also return the uncompressed forward's logits (no gradient), e.g.
                the KL term's reference; needs ``compressor``. They come from the recording
                pass of a cross-layer compressor when it records without gradient, else from
                one more forward without compression.
            step: the optimizer step of a training forward, passed to a cross-layer
                compressor's fit (its basis refresh schedule); None in evaluation and inference.

        Returns:
            :class:`DecoderOutput` with logits [B, T, V] ([B, K, V] with ``logits_at``).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] or inputs_embeds [B, T, C]")
        if (split is None) != (compressor is None):
            raise ValueError("split and compressor go together: pass both or neither")
        if split is not None and cache is not None:
            raise ValueError("the in-loop compression forward does not use a decoding cache")
        if reference_logits and compressor is None:
            raise ValueError(
                "reference_logits=True needs split and compressor: the reference is the "
                "uncompressed forward beside the compressed one"
            )
        if split is not None:
            ref = input_ids if inputs_embeds is None else inputs_embeds
            check_split(split, ref.shape[0], ref.shape[1])
        x = self.token_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        if positions is None:
            start = cache.length() if cache is not None else 0
            positions = torch.arange(start, start + T, device=x.device).expand(B, T)
        if modality_ids is None:
            modality_ids = torch.zeros(B, T, dtype=torch.long, device=x.device)
        reference = None
        cross = find_cross_layer(compressor)
        if cross is not None and self.config.has_sliding_layers:
            raise NotImplementedError(
                "a cross-layer compressor (xKV) on a model with sliding-window layers is not "
                "implemented (windowed layers are not compressed, model/attention.py)"
            )
        if cross is not None and cross.records_context:
            assert split is not None and compressor is not None
            compressor, reference = self._fit_cross_layer(
                cross,
                compressor,
                x,
                positions,
                modality_ids,
                split,
                step,
                reference_logits,
                logits_at,
            )
        out = self._stack(x, positions, modality_ids, cache, split, compressor, logits_at)
        if reference_logits:
            if reference is None:
                # NOTE: the same weights without gradient, not a frozen copy: the target moves
                # with the model, as self-distillation to the uncompressed forward intends.
                # no_grad also keeps the per-layer gains of SignalGainMonitor on the compressed
                # forward: its probe ignores forwards that do not record autograd.
                with torch.no_grad():
                    reference = self._stack(x, positions, modality_ids, logits_at=logits_at).logits
            out.reference_logits = reference
        return out

    def token_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T] -> [B, T, C]; Gemma 3 scales them by ``sqrt(hidden_size)``
        rounded to the weight dtype (as transformers' ``Gemma3TextScaledWordEmbedding``)."""
        x = self.embed_tokens(input_ids)
        if self.config.block_style == "gemma3":
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype, device=x.device)
        return x

    def _fit_cross_layer(
        self,
        cross: CrossLayerCompressor,
        compressor: KVCompressor,
        x: torch.Tensor,
        positions: torch.Tensor,
        modality_ids: torch.Tensor,
        split: torch.Tensor,
        step: int | None,
        want_reference: bool,
        logits_at: torch.Tensor | None,
    ) -> tuple[KVCompressor, torch.Tensor | None]:
        """The recording pass and the fit of a cross-layer compressor (xKV).

        ::

            recording  stack(x[:, :S], split, RecordingCompressor) ─► every layer's context K/V
            fit        cross.fit(RecordedContext, step)            ─► the fit (no model access)
            compressed stack(x, split, compressor), each layer's CompressionInput.fit = the fit

        Context rows never depend on the compressed cache, so the recording pass computes the
        same context as the compressed one (and as inference's prefill). When it records without
        gradient and the uncompressed logits are wanted, it runs over the whole sequence: its
        logits are the plain forward's, the KL reference for free.

        Returns:
            (the compressor of the compressed pass, the reference logits or None).
        """
        T = x.shape[1]
        S = int(split.max())
        full = want_reference and not cross.record_with_grad
        L = T if full else S
        rec = RecordingCompressor(pre_rope=cross.pre_rope)
        with torch.set_grad_enabled(torch.is_grad_enabled() and cross.record_with_grad):
            out = self._stack(
                x[:, :L],
                positions[:, :L],
                modality_ids[:, :L],
                None,
                split,
                rec,
                logits_at if full else None,
                head=full,
            )
        fit = cross.fit(RecordedContext(rec.inputs, rec.segments, S, self.rotary), step=step)
        return _WithFit(compressor, fit), (out.logits if full else None)

    def _stack(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        modality_ids: torch.Tensor,
        cache: KVCache | None = None,
        split: torch.Tensor | None = None,
        compressor: KVCompressor | None = None,
        logits_at: torch.Tensor | None = None,
        head: bool = True,
    ) -> DecoderOutput:
        """The blocks, the final norm and the LM head on embeddings x [B, T, C] (``head=False``:
        the blocks only, for a pass whose logits nobody reads; the logits are then empty)."""
        B, T = x.shape[:2]
        rope = self.rotary(positions, x.dtype)
        rope_local = rope if self.rotary_local is None else self.rotary_local(positions, x.dtype)
        stats: list[dict[str, torch.Tensor]] = []
        kwargs = dict(
            positions=positions,
            modality_ids=modality_ids,
            cache=cache,
            split=split,
            compressor=compressor,
            stats=stats,
        )
        if self.hc_head is not None:
            x = x.unsqueeze(2).expand(B, T, self.num_streams, x.shape[-1])  # [B, T, n, C]
        for i, layer in enumerate(self.layers):
            x = layer(x, rope=rope_local if self.config.is_sliding_layer(i) else rope, **kwargs)
        if not head:
            return DecoderOutput(logits=x.new_empty(0), compression_stats=stats)
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
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return DecoderOutput(logits=logits, compression_stats=stats)

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
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or (max_new_tokens < 0)
        ):
            raise ValueError(
                f"max_new_tokens={max_new_tokens!r} is out of range; allowed an integer in [0, inf)"
            )
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature={temperature!r} is out of range; allowed [0, inf)")
        if top_k is not None and (
            isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1)
        ):
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


class _WithFit:
    """The compressor of a cross-layer compressor's compressed pass: every layer's input
    carries the fit of this forward (:attr:`CompressionInput.fit`)."""

    def __init__(self, compressor: KVCompressor, fit: object) -> None:
        self.compressor = compressor
        self.fit = fit
        self.pre_rope = bool(getattr(compressor, "pre_rope", False))

    def __call__(self, inp: CompressionInput) -> KVSegment:
        return self.compressor(dataclasses.replace(inp, fit=self.fit))


def _pick(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """logits: [B, V] -> next token ids [B]."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
