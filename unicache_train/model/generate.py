"""Decoding on a real compressed KV cache: prefill, compress every layer, decode token by token.

Shape legend: B, P, T, V = batch, prompt tokens, tokens, vocab.

::

    prompt [B, P] ─► prefill (every prompt token is context: full causal attention)
                        └─ each layer, at the seam: context K/V ─► compressor ─► KVSegment
                                                                                   │
    CompressedKVCache (unicache_train.model.compressed_cache): one stored segment per layer
                                                                                   │
    decode step: new token ─► q,k,v ─► cache.attend: [stored segment (+log count) ; decoded K/V]

Decode steps read the cache through one call,
:meth:`~unicache_train.model.compressed_cache.CompressedKVCache.attend` (append the token's K/V
and attend), the same call stock transformers ``generate()`` makes through
:class:`~unicache_train.transformers_cache.CompressedCache`; its ``decode_path`` picks how a
packed segment is read, and the prefill prepares every layer for it (the one dequantization of
a segment happens in the prefill, not in the first decode step).

This is what the in-loop training forward computes in parallel
(docs/architecture.md#in-loop-semantics): for a sample split at ``s``, the logits of positions
``s - 1 .. T - 1`` of ``model(ids, split=s, compressor=c)`` equal :func:`decode_teacher_forced`'s
(tested to 1e-5 in fp32, also with int8, because the packed storage dequantizes to exactly the
values the seam attended).

The prefill goes through the model's compression seam with every prompt token as context, so the
compressor receives exactly the :class:`~unicache_train.seam.CompressionInput` it gets in
training (queries for its observation window included). A sliding-window layer's segment is its
last ``W - 1`` context tokens, unchanged, and decoding slides over them and over the decoded
tokens (:class:`~unicache_train.model.compressed_cache.CompressedKVCache`). Ragged prompts of a
batch are right padded to the longest; padding lies after each sample's split, so causal
attention and the compressor (which only reads context tokens) never see it.

MLA models (:mod:`unicache_train.model.mla`) decode the same way on a compressed *latent* cache
(``CompressedKVCache(latent=True)``): the seam hands the compressor ``[c_kv ‖ k_pe]`` as one KV
head, the stored segment is that latent (merged, quantized once, or xKV factors of the keys
only: the values are its first ``R`` features), and decode steps attend in the absorbed form over
``[segment (+ log count) ; decoded latents]``. :func:`kv_bytes_report` compares its bytes with
the uncompressed latent cache and, for a converted model, with the source GQA cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unicache_train.model.attention import kv_bytes_per_token
from unicache_train.model.compressed_cache import CompressedKVCache, StoredSegment
from unicache_train.model.config import ModelConfig
from unicache_train.model.decoder import Decoder
from unicache_train.seam import KVCompressor, RecordingCompressor

__all__ = [
    "CompressedGeneration",
    "prefill_compressed",
    "decode_teacher_forced",
    "generate_compressed",
    "KVBytesReport",
    "kv_bytes_report",
]


def _as_split(split: int | torch.Tensor, B: int, device: torch.device) -> torch.Tensor:
    if isinstance(split, int):
        return torch.full((B,), split, dtype=torch.long, device=device)
    return split.to(device=device, dtype=torch.long)


@torch.no_grad()
def prefill_compressed(
    model: Decoder,
    input_ids: torch.Tensor,
    split: int | torch.Tensor,
    compressor: KVCompressor,
    *,
    modality_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    cache_dtype_bytes: int = 2,
    decode_path: str = "auto",
) -> tuple[CompressedKVCache, torch.Tensor]:
    """Prefill the prompts ``input_ids[b, :split[b]]`` and compress every layer's cache.

    Args:
        model: a :class:`~unicache_train.model.Decoder`, GQA or MLA (the cache is then the
            compressed latent ``[c_kv ‖ k_pe]``, ``CompressedKVCache(latent=True)``).
        input_ids: [B, P] token ids; only ``[0, split[b])`` of each row is read (the rest may be
            padding or the continuation).
        split: prompt length per sample, an int or [B] (each in ``[1, P]``).
        compressor: the KV compressor (the same object training used).
        modality_ids: [B, P] (default: text).
        inputs_embeds: [B, P, C] prompt embeddings to prefill instead of embedding
            ``input_ids`` (e.g. text with projected image patches at the vision positions,
            :meth:`~unicache_train.model.vlm.VisionLanguageModel.embed`); ``input_ids`` still
            gives the shape and the decoded tokens are embedded as usual.
        cache_dtype_bytes: bytes per element of the deployed floating cache (accounting).
        decode_path: how decode steps read each segment
            (:class:`~unicache_train.model.compressed_cache.CompressedKVCache`; default
            ``"auto"``). Every layer is prepared for it here, at the prefill's dtype: the one
            dequantization (or unpacking) of a segment is paid now, not in the first decode
            step.

    Returns:
        (cache, logits [B, V] of each prompt's last token, i.e. the first generated token's).
    """
    B = input_ids.shape[0]
    split_t = _as_split(split, B, input_ids.device)
    if int(split_t.min()) < 1 or int(split_t.max()) > input_ids.shape[1]:
        raise ValueError(f"split {split_t.tolist()} out of range [1, {input_ids.shape[1]}]")
    P = int(split_t.max())
    ids = input_ids[:, :P]
    mods = modality_ids[:, :P] if modality_ids is not None else None
    capture = RecordingCompressor(compressor)
    last_pos = (split_t - 1)[:, None]  # [B, 1]: only the last prompt token's logits are needed
    if inputs_embeds is not None:
        if tuple(inputs_embeds.shape[:2]) != tuple(input_ids.shape):
            raise ValueError(
                f"inputs_embeds of shape {tuple(inputs_embeds.shape)} do not match input_ids "
                f"{tuple(input_ids.shape)}: expected [B, P, C]"
            )
        embeds = inputs_embeds[:, :P]
        out = model(
            inputs_embeds=embeds,
            modality_ids=mods,
            split=split_t,
            compressor=capture,
            logits_at=last_pos,
        )
    else:
        out = model(ids, modality_ids=mods, split=split_t, compressor=capture, logits_at=last_pos)
    L = model.config.num_hidden_layers
    windows = [model.config.layer_window(i) for i in range(L)]
    latent = model.config.attention_type == "mla"
    cache = CompressedKVCache(
        L, cache_dtype_bytes, windows=windows, latent=latent, decode_path=decode_path
    )
    softcap = None if latent else model.config.attn_logit_softcapping
    for layer_idx, seg in capture.segments.items():
        if capture.pre_rope and seg.quant is not None:
            raise NotImplementedError(
                "packed storage of a pre-RoPE compressor is not supported by the decoding cache"
            )
        # NOTE: the seam rotated a pre-RoPE segment's keys in place of seg.keys after the
        # compressor returned; the recorder kept the object (not a copy): the rotated keys.
        n_ctx = capture.inputs[layer_idx].context_mask.sum(1)
        stored = StoredSegment.from_segment(seg, n_ctx)
        if windows[layer_idx] is not None:
            # The window's context tokens (model/attention.py); the window compares positions.
            stored.positions = seg.positions
        # The decode steps attend in the prefill's dtype (the model's): prepare the layer now.
        dtype = capture.inputs[layer_idx].keys.dtype
        cache.set_segment(layer_idx, stored, dtype=dtype, softcap=softcap)
    cache.stats = out.compression_stats
    return cache, out.logits[:, 0]  # [B, V]


def _decode(
    model: Decoder, cache: CompressedKVCache, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One decode call: tokens, positions [B, t] -> logits [B, t, V]."""
    mods = torch.zeros_like(tokens)
    return model(tokens, positions=positions, modality_ids=mods, cache=cache).logits


@torch.no_grad()
def decode_teacher_forced(
    model: Decoder,
    input_ids: torch.Tensor,
    split: int | torch.Tensor,
    compressor: KVCompressor,
    *,
    modality_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    decode_path: str = "auto",
) -> tuple[torch.Tensor, CompressedKVCache]:
    """Prefill ``[0, split)``, compress, then feed the continuation one token at a time.

    Args:
        input_ids: [B, T].
        split: int or [B].
        inputs_embeds: [B, T, C] prompt embeddings (see :func:`prefill_compressed`).
        decode_path: see :func:`prefill_compressed`.

    Returns:
        (logits [B, T, V] with NaN before position ``split[b] - 1``, the cache).
    """
    B, T = input_ids.shape
    split_t = _as_split(split, B, input_ids.device)
    cache, first = prefill_compressed(
        model,
        input_ids,
        split_t,
        compressor,
        modality_ids=modality_ids,
        inputs_embeds=inputs_embeds,
        decode_path=decode_path,
    )
    V = first.shape[-1]
    out = torch.full((B, T, V), float("nan"), dtype=first.dtype, device=first.device)
    rows = torch.arange(B, device=input_ids.device)
    out[rows, split_t - 1] = first
    for i in range(T - int(split_t.min())):
        pos = split_t + i  # [B] position of the token fed now
        live = pos < T
        tok = input_ids.gather(1, pos.clamp(max=T - 1)[:, None])  # [B, 1]
        logits = _decode(model, cache, tok, pos[:, None])[:, 0]  # [B, V]
        out[rows[live], pos[live]] = logits[live]
    return out, cache


@dataclass
class CompressedGeneration:
    """Greedy tokens generated on a compressed cache.

    Attributes:
        tokens: [B, N] generated ids (after ``eos_token_id``, a sequence repeats it).
        cache: the cache after generation (``kv_bytes()`` / ``baseline_bytes()``).
    """

    tokens: torch.Tensor
    cache: CompressedKVCache


@torch.no_grad()
def generate_compressed(
    model: Decoder,
    input_ids: torch.Tensor,
    split: int | torch.Tensor,
    compressor: KVCompressor,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    modality_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    decode_path: str = "auto",
) -> CompressedGeneration:
    """Greedy decoding after the prompts ``input_ids[b, :split[b]]``, on the compressed cache.

    Args:
        model: a GQA or MLA decoder (eval mode is the caller's business; no dropout here).
        input_ids: [B, P] right-padded prompts.
        split: prompt lengths, int or [B].
        compressor: the KV compressor.
        max_new_tokens: tokens to generate (N).
        eos_token_id: once emitted, a sequence keeps emitting it.
        modality_ids: [B, P] of the prompts (default: text).
        inputs_embeds: [B, P, C] prompt embeddings (see :func:`prefill_compressed`).
        decode_path: see :func:`prefill_compressed`.

    Returns:
        :class:`CompressedGeneration`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    B = input_ids.shape[0]
    split_t = _as_split(split, B, input_ids.device)
    cache, logits = prefill_compressed(
        model,
        input_ids,
        split_t,
        compressor,
        modality_ids=modality_ids,
        inputs_embeds=inputs_embeds,
        decode_path=decode_path,
    )
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    out = []
    for i in range(max_new_tokens):
        nxt = logits.float().argmax(-1)  # [B]
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        out.append(nxt)
        if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
            break
        logits = _decode(model, cache, nxt[:, None], (split_t + i)[:, None])[:, 0]
    return CompressedGeneration(tokens=torch.stack(out, 1), cache=cache)


@dataclass
class KVBytesReport:
    """Bytes of a compressed context cache against uncompressed 16-bit caches of the same prompts.

    Attributes:
        kv_bytes: what the compressed cache stores for the prompts, all layers (packed
            payload + scales, or xKV factors; with merge counts and head maps when
            ``include_metadata``); decoded tokens are not included.
        baseline_bytes: this model's uncompressed cache of the same prompts (MLA: the latent
            ``R + Dr`` elements per token per layer).
        source_bytes: the uncompressed cache of the ``source`` model the report was asked to
            compare with (e.g. the GQA model an MLA model was converted from), else None.
    """

    kv_bytes: int
    baseline_bytes: int
    source_bytes: int | None = None

    @property
    def reduction(self) -> float:
        """``baseline_bytes / kv_bytes`` (``4.0``: 4x fewer KV bytes than uncompressed)."""
        return self.baseline_bytes / self.kv_bytes if self.kv_bytes else float("nan")

    @property
    def reduction_vs_source(self) -> float | None:
        """``source_bytes / kv_bytes``, or None without a source."""
        if self.source_bytes is None:
            return None
        return self.source_bytes / self.kv_bytes if self.kv_bytes else float("nan")

    def __str__(self) -> str:
        text = (
            f"compressed KV cache {self.kv_bytes:,} bytes; uncompressed {self.baseline_bytes:,}"
            f" ({self.reduction:.2f}x fewer)"
        )
        if self.source_bytes is not None:
            ratio = self.reduction_vs_source
            text += f"; source model's cache {self.source_bytes:,} ({ratio:.2f}x fewer)"
        return text


def kv_bytes_report(
    cache: CompressedKVCache,
    source: ModelConfig | None = None,
    *,
    include_metadata: bool = True,
) -> KVBytesReport:
    """How many KV bytes a prefilled compressed cache stores, against uncompressed caches.

    E.g. an MLA model converted from a GQA one (:func:`~unicache_train.model.convert_mla.
    convert_to_mla`) and compressed with UniCache::

        cache, _ = prefill_compressed(mla_model, ids, split, compressor)
        report = kv_bytes_report(cache, source=gqa_model.config)
        report.reduction_vs_source  # GQA 16-bit K/V bytes / stored latent bytes

    Args:
        cache: from :func:`prefill_compressed` (or ``generate_compressed(...).cache``).
        source: a model config whose uncompressed 16-bit cache of the same prompts is reported
            as ``source_bytes`` (:func:`~unicache_train.model.attention.kv_bytes_per_token` per
            layer; a sliding-window layer holds at most ``W - 1`` context tokens).
        include_metadata: count merge counts and head maps (what a decoding cache must keep).

    Returns:
        :class:`KVBytesReport`.
    """
    segs = [seg for seg in cache.segments if seg is not None]
    if not segs:
        raise ValueError("kv_bytes_report: the cache holds no compressed segment; prefill first")
    source_bytes = None
    if source is not None:
        ctx = segs[0].context_tokens  # [B] prompt tokens per sample (every layer's)
        per_token = kv_bytes_per_token(source, cache.cache_dtype_bytes)
        source_bytes = 0
        for i in range(source.num_hidden_layers):
            W = source.layer_window(i)
            held = ctx if W is None else ctx.clamp(max=W - 1)
            source_bytes += int(held.sum()) * per_token
    return KVBytesReport(
        kv_bytes=cache.kv_bytes(include_metadata=include_metadata),
        baseline_bytes=cache.baseline_bytes(),
        source_bytes=source_bytes,
    )
