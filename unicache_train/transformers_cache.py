"""The trained-for KV compression in stock transformers ``generate()``.

A model fine-tuned with compression in the loop is exported with its policy
(``compression_config.json``, :mod:`unicache_train.checkpoint.policy`). :class:`CompressedCache`
reads it and applies exactly that pipeline inside transformers: the prompt's K/V are compressed
after the prefill (UniCache's token plan, head merging, packed int8/int4 storage with its scales,
the ``log(count)`` bias on merged entries; xKV's cross-layer factors; nothing when the policy is
off) and the model decodes on the compressed cache::

    from transformers import AutoModelForCausalLM
    from unicache_train.transformers_cache import ATTN_IMPLEMENTATION, CompressedCache

    model = AutoModelForCausalLM.from_pretrained(DIR, attn_implementation=ATTN_IMPLEMENTATION)
    cache = CompressedCache.from_pretrained(DIR)
    out = model.generate(ids, attention_mask=mask, cache=cache, do_sample=False)
    # (transformers < 5.3: past_key_values=cache; CACHE_ARGUMENT names the right one)
    cache.kv_bytes(), cache.baseline_bytes()          # what the compressed context stores

Two public extension points of transformers carry it, no module is patched:

- the cache interface (:class:`transformers.Cache` with one :class:`CompressedLayer` per
  decoder layer): the prefill's ``update`` keeps the prompt's K/V for full causal attention,
  decode steps append to ``[compressed segment ; decoded tokens]``;
- the attention-function registry (``AttentionInterface``, name :data:`ATTN_IMPLEMENTATION`):
  :func:`compressed_attention` attends with our own mask. In the prefill it is plain causal
  attention (left padding respected) and hands each layer's queries/keys/values to the
  compressor; in decode steps it adds the cache's bias (``log(count)`` on merged entries, invalid
  segment slots masked, causal over decoded tokens). The stock SDPA mask builder is registered
  under the same name, so the prefill receives the padding (left padding in batched prompts).

What ``generate`` does and what our decoding loop (:func:`unicache_train.model.generate_compressed`)
does are the same computation: the compressor receives the same
:class:`~unicache_train.seam.CompressionInput` (each prompt moved to the front of the padded
batch, as our right-padded prefill lays it out) and the decode steps read the same
:class:`~unicache_train.model.compressed_cache.StoredSegment`. Tested in
``tests/test_transformers_cache.py`` (logits <= 1e-4, greedy tokens equal, byte counts equal).

Decode steps read the compressed segment the one way every decoder of this package does,
:meth:`~unicache_train.model.compressed_cache.CompressedKVCache.attend` (our own decoding loop
calls it too). For a packed (int8/int4) segment, ``decode_path="packed"`` reads the packed bytes
at every step (a Triton kernel on CUDA,
:func:`unicache_train.ops.decode_attention.decode_attention_packed` on CPU) and the decoded
tokens go into a preallocated buffer (no per-step concatenation); ``decode_path="buffer"``
dequantizes each layer's segment once into a working buffer (faster on CPU, as large as an
uncompressed cache in the model's dtype; :meth:`CompressedCache.working_bytes`);
``decode_path="int8"`` unpacks an int4 segment once into int8 rows (twice the packed payload)
that BLAS reads at every step; ``"reference"`` dequantizes and concatenates at every step (the
spec). The default, ``"auto"``, takes the packed path on CUDA and the buffer on CPU (measured:
docs/serving.md; int8 and packed save memory at some speed there). The one-time work (buffer,
int8 rows, segment bias) is done when the prefill stores each layer's segment.

One cache serves one prompt (batch): a second ``generate()`` on a cache that already decoded
raises and names :meth:`CompressedCache.reset`. Prefilling by hand and then calling
``generate()`` with the full ids once (transformers' "continue from a cache") is allowed. The
guard has two signals: a multi-token forward into a cache that decoded (public behaviour, every
version), and the mark transformers' ``generate()`` sets on a caller's cache
(``cache._is_user_defined = True``: 5.25 does, 5.2 does not). The cache sees K/V, not ids, so
without the mark a new prompt exactly one token longer than what it has seen is taken as a
continuation; on 5.2 a prompt no longer than that fails inside ``generate()`` (IndexError).
What each version does is recorded and tested (``tests/cache_exactness.py``, ``REUSE``).

Supported: Llama, Qwen2, Qwen3, Mistral exports and our mHC remote-code export, transformers
5.2 (tested in the ``make tf-lower`` or kvpress environment when present) to 5.25 (the
project's). Not supported:
MLA (DeepseekV3) exports, beam search (``reorder_cache``), chunked prefill (the prompt must go in
one forward, as ``generate`` does), sliding-window layers.

Imports torch, transformers and the compression package only (no Lightning).
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from unicache_train.checkpoint.policy import compressor_from_policy, read_policy
from unicache_train.model.compressed_cache import DECODE_PATHS, CompressedKVCache, StoredSegment
from unicache_train.ops.rope import apply_rope, unapply_rope
from unicache_train.seam import (
    CompressionInput,
    KVCompressor,
    RecordedContext,
    find_cross_layer,
    identity_segment,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CACHE_ARGUMENT",
    "CompressedCache",
    "CompressedLayer",
    "compressed_attention",
]

ATTN_IMPLEMENTATION = "unicache_compressed"
# The name ``generate()``/``forward()`` take the cache under: ``cache`` from transformers 5.3
# (``past_key_values`` still works there, with a deprecation warning), ``past_key_values`` before.
CACHE_ARGUMENT = (
    "cache"
    if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters
    else "past_key_values"
)

# The (cache, layer) whose ``update`` ran last: the attention call of that layer follows it
# directly in every supported model's attention forward (q/k/v -> cache.update -> attention).
_ACTIVE: contextvars.ContextVar[tuple[CompressedCache, int] | None] = contextvars.ContextVar(
    "unicache_active_cache", default=None
)


class CompressedLayer(CacheLayerMixin):
    """One decoder layer's view of a :class:`CompressedCache` (state lives in the cache)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: CompressedCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: D102
        return self._cache._update(key_states, value_states, self.layer_idx)

    def get_seq_length(self, *args: Any) -> int:
        return self._cache._seen[self.layer_idx]

    def get_mask_sizes(self, query: Any, *args: Any) -> tuple[int, int]:
        # transformers >= 5.3 passes the query length, 5.2 the cache positions.
        q = query if isinstance(query, int) else int(query.shape[0])
        return self._cache._attended(self.layer_idx) + q, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("CompressedCache does not support beam search")

    def reset(self) -> None:
        self._cache.reset()


class CompressedCache(Cache):
    """A transformers cache that compresses the prompt's K/V with a trained policy.

    Args:
        compressor: the KV compressor (``from_pretrained`` builds it from the export's policy).
        num_layers: decoder depth.
        rope: ``(positions [B, M], dtype) -> (cos, sin)`` of the model's rotary table; needed
            only by compressors that work on pre-RoPE keys (xKV with ``keys_pre_rope``).
        cache_dtype_bytes: bytes per element of the deployed floating cache (byte accounting).
        policy: the policy the compressor came from (kept for ``repr`` and reports).
        decode_path: how decode steps read a packed segment: ``"auto"`` (default: packed on
            CUDA, buffer on CPU), ``"packed"``, ``"int8"``, ``"buffer"`` or ``"reference"``
            (:class:`~unicache_train.model.compressed_cache.CompressedKVCache`).
        backend: the packed path's kernel (``"auto"``: Triton on CUDA, BLAS on CPU).
    """

    def __init__(
        self,
        compressor: KVCompressor,
        num_layers: int,
        *,
        rope: Any = None,
        cache_dtype_bytes: int = 2,
        policy: dict[str, Any] | None = None,
        decode_path: str = "auto",
        backend: str = "auto",
    ) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers} must be >= 1")
        if decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path={decode_path!r}; choose one of {DECODE_PATHS}")
        self.decode_path = decode_path
        self.backend = backend
        super().__init__(layers=[CompressedLayer(self, i) for i in range(num_layers)])
        self.compressor = compressor
        self.cross = find_cross_layer(compressor)
        self.pre_rope = bool(getattr(compressor, "pre_rope", False))
        if self.pre_rope and rope is None:
            raise ValueError("a pre-RoPE compressor needs the model's rotary table (rope=...)")
        self.rope = rope
        self.policy = policy
        self.num_layers = num_layers
        self.cache_dtype_bytes = cache_dtype_bytes
        self.reset()

    # ------------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> CompressedCache:
        """The cache of an export directory: its ``compression_config.json`` (absent: the
        identity, a plain cache) and its ``config.json`` (depth, rotary table).

        Raises:
            ConfigError: a malformed ``compression_config.json``.
            NotImplementedError: an MLA (DeepseekV3) export.
        """
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} does not exist: not an export directory")
        hf = json.loads(config_file.read_text())
        if hf.get("model_type") == "deepseek_v3":
            raise NotImplementedError(
                "CompressedCache does not serve MLA (DeepseekV3) exports: their latent cache is "
                "not compressed at inference yet"
            )
        from unicache_train.checkpoint.hf_config import from_hf_config

        model_config, _ = from_hf_config(hf)
        if model_config.has_sliding_layers:
            raise NotImplementedError(
                f"CompressedCache does not serve exports with sliding-window layers (config.json "
                f"sliding_window={model_config.sliding_window}, layer_types="
                f"{model_config.layer_types}); decode them with "
                "unicache_train.model.generate.generate_compressed"
            )
        policy = read_policy(path)
        compressor = compressor_from_policy(  # a learned retention policy: its file, here
            policy,
            path,
            shape=(
                model_config.num_hidden_layers,
                model_config.num_key_value_heads,
                model_config.head_size,
            ),
        )
        rope = None
        if getattr(compressor, "pre_rope", False):
            from unicache_train.model.rope import RotaryEmbedding

            rope = RotaryEmbedding(
                model_config.head_size,
                model_config.rope_theta,
                model_config.rope_scaling,  # the export's RoPE scaling (yarn, llama3, ...)
                model_config.max_position_embeddings,
            )
        return cls(compressor, model_config.num_hidden_layers, rope=rope, policy=policy, **kwargs)

    def reset(self) -> None:
        """Forget everything (a new prompt)."""
        self.inner = CompressedKVCache(
            self.num_layers,
            self.cache_dtype_bytes,
            decode_path=self.decode_path,
            backend=self.backend,
        )
        self._seen = [0] * self.num_layers
        self._prefill: dict[int, dict[str, Any]] = {}
        self._inputs: dict[int, CompressionInput] = {}
        self.stats: list[dict[str, torch.Tensor]] = []
        self._forwards: int | None = None  # forwards since generate() started (None: unmarked)

    def _has_decoded(self) -> bool:
        return any(
            self.inner.num_decoded(i)
            for i in range(self.num_layers)
            if self.inner.segments[i] is not None
        )

    def _refuse_reuse(self) -> None:
        if self._has_decoded():
            raise RuntimeError(
                "this CompressedCache already served a generate() call (a compressed prompt and "
                "its decoded tokens): call cache.reset() before the next prompt"
            )

    # transformers' generate() marks a cache passed by the caller at its start (5.25:
    # ``cache._is_user_defined = True``; 5.2 does not): a second call on a cache that decoded is
    # a new prompt on old state, which would silently give other tokens. The version-independent
    # signal is in ``_update``: a multi-token forward after decoding (the first forward of
    # another generate()). Per version: tests/cache_exactness.py, REUSE.
    @property
    def _is_user_defined(self) -> bool:
        return self.__dict__.get("_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        if value:
            self._refuse_reuse()
            self._forwards = 0
        self.__dict__["_user_defined"] = value

    def __repr__(self) -> str:
        method = (self.policy or {}).get("method", "none")
        return f"CompressedCache(method={method!r}, layers={self.num_layers})"

    # -------------------------------------------------------------------- transformers API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (prompt + decoded): the next token's position, as transformers expects;
        the attended entries are fewer (see :meth:`kv_bytes`)."""
        return self._seen[layer_idx]

    def _attended(self, layer_idx: int) -> int:
        seg = self.inner.segments[layer_idx]
        return self._seen[layer_idx] if seg is None else self.inner.length(layer_idx)

    def _update(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, Hk, T, D] post-RoPE -> what this call attends to."""
        _ACTIVE.set((self, layer_idx))
        T = k.shape[2]
        if layer_idx == 0 and self._forwards is not None:
            self._forwards += 1
            # Inside one generate() only its first forward may carry several tokens (the
            # prompt, or the new tokens after a hand prefill); a later one is a prefill chunk.
            if self._forwards > 1 and T > 1:
                raise NotImplementedError(
                    "CompressedCache does not support chunked prefill (prefill_chunk_size): the "
                    "prompt must be prefilled in one forward to be compressed"
                )
        if self.inner.segments[layer_idx] is None:
            if layer_idx in self._prefill or self._seen[layer_idx]:
                raise RuntimeError(
                    "CompressedCache got a second forward before the prefill of every layer was "
                    "compressed: prefill the prompt in one call, with attn_implementation="
                    f"{ATTN_IMPLEMENTATION!r} (model.set_attn_implementation)"
                )
            self._prefill[layer_idx] = {"k": k, "v": v}
            self._seen[layer_idx] += T
            return k, v
        if T > 1 and self.inner.num_decoded(layer_idx):
            self._refuse_reuse()
        # A decode call: the attention function appends k/v and attends in one step
        # (:meth:`CompressedKVCache.attend`), so hand them over untouched.
        self._seen[layer_idx] += T
        return k, v

    # --------------------------------------------------------------------- compression
    def _compress_prefill(self, layer_idx: int, q: torch.Tensor, valid: torch.Tensor) -> None:
        """Compress one layer's prompt K/V (or record it, for a cross-layer compressor).

        q: [B, H, P, D] post-RoPE queries; valid: [B, P] bool, real (non-padding) tokens.
        The batch is re-laid out as our right-padded prefill sees it: each prompt's tokens
        first, in order, positions ``0 .. n_b - 1``.
        """
        state = self._prefill.pop(layer_idx)
        k, v = state["k"], state["v"]
        B, _, P, _ = k.shape
        n = valid.sum(1)  # [B]
        if not bool(valid.all()):  # ragged batch (no padding: already in place)
            order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # real first

            def front(x: torch.Tensor) -> torch.Tensor:  # [B, H, P, D] -> real tokens first
                return x.gather(2, order[:, None, :, None].expand_as(x))

            q, k, v = front(q), front(k), front(v)
        positions = torch.arange(P, device=k.device).expand(B, P)
        if self.pre_rope:
            cos, sin = self.rope(positions, torch.float32)
            k = unapply_rope(k.float(), cos, sin).to(v.dtype)  # back to pre-RoPE keys
        inp = CompressionInput(
            layer_idx=layer_idx,
            num_layers=self.num_layers,
            queries=q,
            keys=k,
            values=v,
            positions=positions,
            modality_ids=torch.zeros_like(positions),
            context_mask=positions < n[:, None],
        )
        if self.cross is not None and self.cross.records_context:
            self._inputs[layer_idx] = inp
            if len(self._inputs) == self.num_layers:
                self._fit_and_compress()
            return
        self._store(layer_idx, inp, self.compressor(inp))

    def _fit_and_compress(self) -> None:
        """xKV: fit the cross-layer factors on every layer's prompt, then compress each layer
        with the fit (as the decoder's recording pass + compressed pass do)."""
        assert self.cross is not None
        inputs = self._inputs
        segments = {}
        for i, inp in inputs.items():
            seg = identity_segment(inp, identity=True)
            if self.pre_rope:
                seg.keys = self._rotate(seg.keys, seg.positions)
            segments[i] = seg
        S = int(next(iter(inputs.values())).context_mask.sum(1).max())
        fit = self.cross.fit(RecordedContext(inputs, segments, S, self.rope), step=None)
        for i in range(self.num_layers):
            inp = inputs[i]
            inp_fit = dataclasses.replace(inp, fit=fit)  # as the decoder's compressed pass
            self._store(i, inp_fit, self.compressor(inp_fit))
        self._inputs = {}

    def _rotate(self, keys: torch.Tensor, seg_positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys [B, Hk, M, D] -> rotated at the entries' positions [B, M]."""
        cos, sin = self.rope(seg_positions, keys.dtype)
        return apply_rope(keys, cos, sin)

    def _store(self, layer_idx: int, inp: CompressionInput, seg) -> None:
        if self.pre_rope:
            if seg.quant is not None:
                raise NotImplementedError(
                    "packed storage of a pre-RoPE compressor is not supported by the cache"
                )
            seg.keys = self._rotate(seg.keys, seg.positions)
        n_ctx = inp.context_mask.sum(1)
        # Prepared at the queries' dtype (the decode steps'): the prefill pays the one
        # dequantization or unpacking of the segment, not the first decode step.
        stored = StoredSegment.from_segment(seg, n_ctx)
        self.inner.set_segment(layer_idx, stored, dtype=inp.queries.dtype)
        self.stats.append(seg.stats)

    # ------------------------------------------------------------------------- bytes
    def kv_bytes(self, include_metadata: bool = True) -> int:
        """Stored bytes of the compressed prompt, all layers (packed K/V + scales, merge counts
        and head maps when compression made them necessary); decoded tokens not included."""
        return self.inner.kv_bytes(include_metadata)

    def baseline_bytes(self, head_dim: int, value_dim: int | None = None) -> int:
        """Bytes of the uncompressed 16-bit cache of the same prompts, all layers."""
        return self.inner.baseline_bytes(head_dim, value_dim)

    def decoded_bytes(self) -> int:
        """The decoded tokens' K/V at the cache dtype."""
        return self.inner.decoded_bytes()

    def working_bytes(self) -> int:
        """Bytes held beyond the stored cache: ``decode_path="buffer"``'s dequantized segments
        and unused decoded capacity (:meth:`CompressedKVCache.working_bytes`)."""
        return self.inner.working_bytes()


# -------------------------------------------------------------------------------- attention
def _key_padding(attention_mask: Any, B: int, S: int, device: torch.device) -> torch.Tensor:
    """[B, S] bool, True for keys a sample may attend (from a 2-D padding mask, a 4-D
    boolean/additive mask, or None)."""
    if attention_mask is None:
        return torch.ones(B, S, dtype=torch.bool, device=device)
    m = attention_mask
    if m.dim() == 4:  # the last query row sees every real key of its sample
        row = m[:, 0, -1, -S:]
        return row if row.dtype == torch.bool else row == 0
    return m[:, -S:].bool()


def _attend(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, Hk, S, D], mask [B, 1, T, S] (bool or additive) -> [B, T, H, D]."""
    H, Hk = q.shape[1], k.shape[1]
    if H != Hk:
        k = k.repeat_interleave(H // Hk, dim=1)
        v = v.repeat_interleave(H // Hk, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def compressed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as :data:`ATTN_IMPLEMENTATION`.

    Args:
        query: [B, H, T, D] post-RoPE; key, value: [B, Hk, S, D] (what the cache returned).
        attention_mask: the 2-D padding mask transformers passes through (or a 4-D mask / None).

    Returns:
        ([B, T, H, D], None).
    """
    if dropout and module.training:
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION} attention is for inference (dropout=0)")
    B, _, T, _ = query.shape
    S = key.shape[2]
    active = _ACTIVE.get()
    layer_idx = getattr(module, "layer_idx", None)
    cache = None
    if active is not None and active[1] == layer_idx:
        cache = active[0]
        _ACTIVE.set(None)
    if cache is not None and cache.inner.segments[layer_idx] is not None:
        # key, value: this call's tokens only (``_update``); append and attend in one step.
        softcap = kwargs.get("softcap")
        out = cache.inner.attend(layer_idx, query, key, value, scaling, softcap)  # [B, H, T, D]
        return out.transpose(1, 2).contiguous(), None
    # Plain causal attention over the call's keys (the prefill), padding respected.
    valid = _key_padding(attention_mask, B, S, query.device)  # [B, S]
    if T == S and bool(valid.all()):
        # NOTE: no padding: SDPA's causal kernel (block skipping, no [T, S] mask). With an
        # explicit mask the CPU prefill of a 2k-token prompt spent as long in attention as in
        # all the linear layers.
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            is_causal=True,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        out = out.transpose(1, 2).contiguous()
    else:
        qi = torch.arange(T, device=query.device)[:, None] + (S - T)
        causal = torch.arange(S, device=query.device)[None, :] <= qi  # [T, S]
        mask = causal[None] & valid[:, None, :]  # [B, T, S]
        # A padded query sees no key: let it see itself so that its (unused) row is finite.
        mask = mask | (torch.arange(S, device=query.device)[None, :] == qi)[None]
        out = _attend(module, query, key, value, mask[:, None], scaling)
    if cache is not None:
        cache._compress_prefill(layer_idx, query, valid)
    return out, None


AttentionInterface.register(ATTN_IMPLEMENTATION, compressed_attention)
# The stock SDPA mask builder under our name: the prefill receives the padding as a 4-D mask
# (transformers passes no mask at all to an attention function without one). Decode steps
# ignore it and use the cache's own bias.
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
