"""RMSNorm (weighted module and unweighted functional form)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(
    x: torch.Tensor, eps: float, weight: torch.Tensor | None = None, unit_offset: bool = False
) -> torch.Tensor:
    """Root-mean-square normalisation over the last dim, computed in fp32.

    Args:
        x: [..., C] activations of any float dtype.
        eps: added to the mean square before the square root.
        weight: optional [C] gain.
        unit_offset: Gemma's form: the gain is ``1 + weight`` and multiplies in fp32 before the
            cast back (Llama multiplies ``weight`` after the cast).

    Returns:
        [..., C] in the dtype of ``x``.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        gain = 1.0 if weight is None else 1.0 + weight.float()
        return (h * gain).to(dtype)
    if weight is not None:
        # NOTE: the gain multiplies in the input dtype, as in HF Llama, for bit-parity on import.
        return weight * h.to(dtype)
    return h.to(dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain (Zhang & Sennrich, arXiv 1910.07467).

    ``unit_offset=True`` is Gemma's parametrisation: gain ``1 + weight``, ``weight`` starting at
    zero (HF ``Gemma3RMSNorm``)."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim] (dtype of x)."""
        return rms_norm(x, self.eps, self.weight, self.unit_offset)
