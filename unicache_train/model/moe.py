"""DeepSeek MoE feed-forward: routed + shared experts, the DeepSeek-V3 router, and the
auxiliary-loss-free load balancing of the router bias.

Shape legend: N, C, E, k, G, I = tokens (batch x time flattened), hidden size, routed experts
(``n_routed_experts``), experts per token (``num_experts_per_tok``), expert groups (``n_group``),
expert width (``moe_intermediate_size``).

Papers:
    DeepSeekMoE (fine-grained + shared experts): Dai et al., https://arxiv.org/abs/2401.06066
    DeepSeek-V3 (sigmoid router, group-limited routing, auxiliary-loss-free balancing):
    https://arxiv.org/abs/2412.19437, sec. 2.1.2
    Reference numerics: ``transformers.models.deepseek_v3`` (``DeepseekV3TopkRouter``,
    ``DeepseekV3Experts``, ``DeepseekV3MoE``); parameter names and layouts are theirs.

::

    x [N, C] ──┬─► gate: s = sigmoid(x W^T) [N, E]  (fp32)
               │     choice = s + e_score_correction_bias        (the bias picks, never weighs)
               │     group score = sum of the top-2 choices of each of G groups  [N, G]
               │     keep the topk_group best groups, mask the others' experts to -inf
               │     idx = top-k(choice) [N, k];  w = s[idx] (/ sum, if norm_topk_prob) * scale
               ├─► experts: y = sum_j w_j SwiGLU_{idx_j}(x)                          [N, C]
               └─► shared_experts: SwiGLU of width I * n_shared_experts (every token) [N, C]
                                                                   out = routed + shared

Balancing (DeepSeek-V3): the router bias is a buffer, not trained by gradient. Each training
forward counts the tokens sent to every expert (``expert_load``); after every optimizer step the
training loop calls :func:`update_router_bias`: ``bias_i += rate * sign(mean(load) - load_i)``
(an overloaded expert becomes less likely to be picked) and the counts restart.

Experts are one module holding stacked weights (``gate_up_proj [E, 2I, C]``, ``down_proj
[E, C, I]``, transformers 5's in-memory layout): an expert-parallel engine shards dim 0. This
file imports nothing distributed; summing loads over ranks is the caller's job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from unicache_train.model.config import ModelConfig
from unicache_train.model.mhc import Fp32Params
from unicache_train.model.mlp import SwiGLU

__all__ = [
    "RouterOutput",
    "Router",
    "Experts",
    "MoE",
    "moe_layers",
    "expert_loads",
    "reset_expert_loads",
    "update_router_bias",
    "load_stats",
]


@dataclass
class RouterOutput:
    """What the router hands the experts.

    Attributes:
        weights: [N, k] fp32 combine weights (after normalisation and ``routed_scaling_factor``).
        indices: [N, k] long, the selected experts.
        scores: [N, E] fp32 sigmoid affinities (before the correction bias).
    """

    weights: torch.Tensor
    indices: torch.Tensor
    scores: torch.Tensor


class Router(Fp32Params):
    """DeepSeek-V3 top-k router (HF name: ``mlp.gate``).

    ``weight [E, C]`` and the buffer ``e_score_correction_bias [E]`` stay fp32 when the model is
    cast to bf16 (as transformers' ``_keep_in_fp32_modules_strict``): the bias moves by
    ``router_bias_update_rate`` (1e-3) per step, below bf16's resolution near 1.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E, C = config.n_routed_experts, config.hidden_size
        self.n_experts = E
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(E, C))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)
        nn.init.zeros_(self.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """x: [N, C] -> :class:`RouterOutput` (every tensor fp32 but the indices)."""
        N = x.shape[0]
        G = self.n_group
        # NOTE: autocast off: under bf16 autocast the linear would run in bf16 and near-tied
        # experts would be picked by rounding (transformers' router has that flaw).
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())  # [N, E]
        scores = logits.sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()  # [N, E], selection only
        if self.topk_group < G:
            grouped = choice.view(N, G, self.n_experts // G)  # [N, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices  # [N, g]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, -1)  # [N, E]
        indices = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [N, k]
        weights = scores.gather(1, indices)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return RouterOutput(weights * self.routed_scaling_factor, indices, scores)

    def extra_repr(self) -> str:
        return (
            f"experts={self.n_experts}, top_k={self.top_k}, n_group={self.n_group}, "
            f"topk_group={self.topk_group}"
        )


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights (transformers 5 layout; names ``mlp.experts.*``).

    Attributes:
        gate_up_proj: [E, 2I, C], rows ``[:I]`` the gate projection, ``[I:]`` the up projection.
        down_proj: [E, C, I].
    """

    def __init__(self, n_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        E, C, I = n_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, C))
        self.down_proj = nn.Parameter(torch.empty(E, C, I))

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std)

    def forward(
        self,
        x: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sum of each token's selected experts, weighted.

        Args:
            x: [N, C] tokens.
            indices: [N, k] long, selected experts.
            weights: [N, k] their combine weights (fp32).
            counts: [E] tokens per expert (``bincount(indices)``), when the caller has it.

        Returns:
            [N, C] in ``x.dtype``.
        """
        E = self.gate_up_proj.shape[0]
        k = indices.shape[1]
        flat = indices.reshape(-1)  # [N*k] slot -> expert
        order = flat.argsort(stable=True)  # [N*k] slots grouped by expert, ascending
        if counts is None:
            counts = torch.bincount(flat, minlength=E)
        token = order // k  # [N*k] the token of each sorted slot
        h = x[token]  # [N*k, C]
        # NOTE: every expert runs, an empty one on zero rows: each weight is in the graph and
        # gets a (zero) gradient, which DDP without find_unused_parameters requires.
        out = []
        for e, h_e in enumerate(h.split(counts.tolist())):  # one host sync per layer
            gate, up = F.linear(h_e, self.gate_up_proj[e]).chunk(2, dim=-1)  # [n_e, I] each
            out.append(F.linear(F.silu(gate) * up, self.down_proj[e]))  # [n_e, C]
        y = torch.cat(out) * weights.reshape(-1)[order, None]  # [N*k, C], fp32 weights
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))  # [N, C]

    def extra_repr(self) -> str:
        E, C, I = self.down_proj.shape
        return f"experts={E}, hidden={C}, intermediate={I}"


class MoE(nn.Module):
    """DeepSeek MoE FFN (HF ``DeepseekV3MoE``): ``gate`` + ``experts`` + ``shared_experts``.

    Training forwards (``self.training`` with autograd on) add the tokens routed to each expert
    to the buffer ``expert_load [E]`` (int64, not saved), read by :func:`update_router_bias`.
    A block recomputed under activation checkpointing counts its tokens twice, every expert
    alike: the update uses only the sign of ``mean - load`` and the stats only load ratios.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        C, I = config.hidden_size, config.expert_intermediate_size
        self.gate = Router(config)
        self.experts = Experts(config.n_routed_experts, C, I)
        self.shared_experts = (
            SwiGLU(C, I * config.n_shared_experts) if config.n_shared_experts > 0 else None
        )
        self.register_buffer(
            "expert_load", torch.zeros(config.n_routed_experts, dtype=torch.long), persistent=False
        )

    def reset_parameters(self, std: float) -> None:
        """Router and routed experts: N(0, std), zero bias (shared experts are ``nn.Linear``s,
        initialised by the decoder's loop)."""
        self.gate.reset_parameters(std)
        self.experts.reset_parameters(std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., C] -> [..., C]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, C]
        r = self.gate(flat)
        counts = torch.bincount(r.indices.reshape(-1), minlength=self.gate.n_experts)  # [E]
        if self.training and torch.is_grad_enabled():
            self.expert_load += counts
        out = self.experts(flat, r.indices, r.weights, counts).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


# ------------------------------------------------------------------------ load balancing
def moe_layers(model: nn.Module) -> list[MoE]:
    """Every :class:`MoE` of ``model``, in module order (layer order in a decoder)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_loads(model: nn.Module) -> torch.Tensor:
    """[L_moe, E] int64 tokens routed to each expert of each MoE layer since the last reset
    (this process only: sum over data-parallel ranks before :func:`update_router_bias`)."""
    layers = moe_layers(model)
    if not layers:
        return torch.zeros(0, 0, dtype=torch.long)
    return torch.stack([m.expert_load for m in layers])


def reset_expert_loads(model: nn.Module) -> None:
    """Zero every layer's ``expert_load``."""
    for m in moe_layers(model):
        m.expert_load.zero_()


@torch.no_grad()
def update_router_bias(model: nn.Module, rate: float, loads: torch.Tensor | None = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing step, then reset the counts.

    ``bias_i += rate * sign(mean_j load_j - load_i)`` in every MoE layer (a layer that saw no
    token keeps its bias).

    Args:
        model: holds the :class:`MoE` layers.
        rate: the update speed gamma (``ModelConfig.router_bias_update_rate``; DeepSeek-V3 used
            0.001 for most of pre-training); must be finite and >= 0.
        loads: [L_moe, E] counts to use, e.g. :func:`expert_loads` summed over ranks (every rank
            must apply the same update); default: this process's own counts.
    """
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(f"rate={rate!r} is out of range; allowed [0, inf)")
    layers = moe_layers(model)
    if loads is None:
        loads = expert_loads(model)
    if loads.shape[0] != len(layers):
        raise ValueError(
            f"loads has shape {tuple(loads.shape)}: expected [L_moe, E] with L_moe = "
            f"{len(layers)} MoE layers"
        )
    for m, load in zip(layers, loads):
        bias = m.gate.e_score_correction_bias
        load = load.to(device=bias.device, dtype=torch.float64)  # [E]
        if load.sum() > 0:
            bias += (rate * torch.sign(load.mean() - load)).to(bias.dtype)
    reset_expert_loads(model)


def load_stats(loads: torch.Tensor, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Scale-free summaries of expert loads, averaged over MoE layers (metric names ``moe/*``).

    Args:
        loads: [L_moe, E] token counts (:func:`expert_loads`).
        model: when given, also the mean absolute router bias.

    Returns:
        ``moe/load_max_over_mean`` (1 = perfectly balanced; E / k = all tokens on one expert's
        share), ``moe/load_cv`` (std / mean of the loads), ``moe/idle_experts`` (fraction of
        experts that received no token), ``moe/bias_abs_mean``; empty for no MoE layer.
    """
    if loads.numel() == 0:
        return {}
    load = loads.double()  # [L, E]
    mean = load.mean(-1).clamp_min(1e-12)  # [L]
    out = {
        "moe/load_max_over_mean": (load.max(-1).values / mean).mean().float(),
        "moe/load_cv": (load.std(-1, unbiased=False) / mean).mean().float(),
        "moe/idle_experts": (load == 0).double().mean().float(),
    }
    if model is not None:
        biases = [m.gate.e_score_correction_bias.abs().mean() for m in moe_layers(model)]
        out["moe/bias_abs_mean"] = torch.stack(biases).mean()
    return out
