"""Rotary position embeddings (RoFormer, arXiv 2104.09864), rotate-half layout as in HF Llama."""

from __future__ import annotations

import torch
from torch import nn

# NOTE: the rotation itself is a pure function in ops, so that compressors (pre-RoPE keys) use
# it without importing the model; attention imports it from here beside the tables.
from unicache_train.ops.rope import apply_rope, rotate_half

__all__ = ["RotaryEmbedding", "apply_rope", "rotate_half"]


class RotaryEmbedding(nn.Module):
    """Produces cos/sin tables for integer positions.

    Positions are explicit (``[B, T]``) because compressed caches keep each token's ORIGINAL
    position: a kept or merged context token is rotated where it stood in the input.
    """

    def __init__(self, dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [B, T] -> (cos, sin), each [B, T, D]."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)
