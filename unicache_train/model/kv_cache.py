"""Minimal per-layer caches for incremental decoding: K/V (GQA) and latent (MLA)."""

from __future__ import annotations

import torch

from unicache_train.model.config import ModelConfig


class KVCache:
    """Keys (post-RoPE) and values per layer, grown by concatenation along time.

    Shapes: ``[B, Hk, S, D]`` per layer, where S is the number of cached tokens.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def length(self, layer_idx: int = 0) -> int:
        k = self.keys[layer_idx]
        return 0 if k is None else k.shape[2]

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k/v [B, Hk, T, D]; return the full [B, Hk, S, D] tensors of this layer."""
        if self.keys[layer_idx] is None:
            self.keys[layer_idx], self.values[layer_idx] = k, v
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=2)
        return self.keys[layer_idx], self.values[layer_idx]

    def nbytes(self) -> int:
        """Bytes actually held by the cache tensors."""
        total = 0
        for t in (*self.keys, *self.values):
            if t is not None:
                total += t.numel() * t.element_size()
        return total


class LatentKVCache(KVCache):
    """The MLA latent cache (DeepSeek-V2, arXiv 2405.04434): per layer ``c_kv`` (after
    ``kv_a_layernorm``) and the shared ``k_pe`` head (after RoPE), nothing per head.

    Storage reuses :class:`KVCache` with one "head": ``keys`` holds ``c_kv`` [B, 1, S, R] and
    ``values`` holds ``k_pe`` [B, 1, S, Dr], i.e. ``kv_lora_rank + qk_rope_head_dim`` elements per
    token per layer. A distinct type so that MLA attention can refuse a per-head cache.
    """

    @property
    def c_kv(self) -> list[torch.Tensor | None]:
        return self.keys

    @property
    def k_pe(self) -> list[torch.Tensor | None]:
        return self.values


def new_kv_cache(config: ModelConfig) -> KVCache:
    """The decoding cache that ``config``'s attention reads: latent for MLA, K/V for GQA."""
    if config.attention_type == "mla":
        return LatentKVCache(config.num_hidden_layers)
    return KVCache(config.num_hidden_layers)
