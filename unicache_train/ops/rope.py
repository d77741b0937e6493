"""Rotary position embedding applied to a tensor (RoFormer, arXiv 2104.09864), rotate-half
layout as in HF Llama.

A pure function of tensors: the model rotates its queries and keys with it
(:mod:`unicache_train.model.rope` builds the cos/sin tables), and compressors that work on
pre-RoPE keys rotate or un-rotate at an entry's position without importing the model.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: ``(x1, x2) -> (-x2, x1)`` on the two halves of the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D] -> [B, H, T, D]. ``(cos, -sin)`` undoes it."""
    cos = cos.unsqueeze(1)  # [B, 1, T, D]
    sin = sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
