"""A minimal per-layer KV cache for incremental decoding."""

from __future__ import annotations

import torch


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
