"""Gated feed-forward (Shazeer, arXiv 2002.05202), HF Llama parameter names: SwiGLU, or GeGLU
with the tanh GELU (Gemma's ``gelu_pytorch_tanh``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (HF ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


#: Gate activations by HF ``hidden_act`` name.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class SwiGLU(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``act`` SiLU (SwiGLU) or tanh-GELU (GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"act={act!r}: choose one of {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[act]
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., C] -> [..., C]."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
