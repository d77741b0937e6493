"""Rotary position embedding applied to a tensor (RoFormer, arXiv 2104.09864), rotate-half
layout as in HF Llama.

A pure function of tensors: the model rotates its queries and keys with it
(:mod:`unicache_train.model.rope` builds the cos/sin tables), and compressors that work on
pre-RoPE keys rotate (:func:`apply_rope`) or un-rotate (:func:`unapply_rope`) at an entry's
position without importing the model. A table is a rotation ``R`` scaled by YaRN's attention
factor ``a`` (1 for every other RoPE type): ``cos² + sin² = a²``, as transformers builds it.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rotate_half", "unapply_rope"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: ``(x1, x2) -> (-x2, x1)`` on the two halves of the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D] -> [B, H, T, D] (:func:`unapply_rope` undoes it)."""
    cos = cos.unsqueeze(1)  # [B, 1, T, D]
    sin = sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`apply_rope` with the same tables: x: [B, H, T, D] post-RoPE;
    cos/sin: [B, T, D] -> [B, H, T, D] pre-RoPE.

    The table is ``a R`` (``a`` = 1, or YaRN's attention factor): its inverse is
    ``(a R)^T / a^2``, i.e. ``(cos, -sin)`` divided by ``cos² + sin² = a²``.
    """
    norm = (cos * cos + sin * sin).unsqueeze(1)  # [B, 1, T, D], a^2 (1 up to round-off)
    return apply_rope(x, cos, -sin) / norm
