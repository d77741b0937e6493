"""RMSNorm (weighted module and unweighted functional form)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Root-mean-square normalisation over the last dim, computed in fp32.

    Args:
        x: [..., C] activations of any float dtype.
        eps: added to the mean square before the square root.
        weight: optional [C] gain.

    Returns:
        [..., C] in the dtype of ``x``.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        # NOTE: the gain multiplies in the input dtype, as in HF Llama, for bit-parity on import.
        return weight * h.to(dtype)
    return h.to(dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain (Zhang & Sennrich, arXiv 1910.07467)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)
