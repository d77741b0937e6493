"""One budget over all layers (KVzip's), for selections whose scores compare across layers.

A per-layer budget removes the same fraction ``R`` of the context from every layer. KVzip
(arXiv 2505.23416) instead ranks every (layer, head, token) by one score and removes the lowest
``R`` of all of them, so a layer whose tokens all matter keeps more and a layer that reads
little keeps less. kvpress's ablation of exactly this on our long-context study
(``KVzipLayerwise``: the same scores, the same fraction from every layer) fell from 105 to 65
of 200 prompts at 16x fewer KV bytes (experiments/long_context/README.md, step 5).

Here (``ScheduleConfig.global_budget``) the budget is over layers; within a layer the heads
still share one token set (docs/compression_methods.md#selection-is-per-layer). Per sample with
``n`` context tokens and ``L`` layers:

1. every layer's selection step scores its tokens on a scale shared by all layers
   (``global_scores``: the learned scorer's predicted log attention, SnapKV's pooled attention
   mass); the tokens a selection always keeps (sinks, recent or observation window) score
   ``+inf``;
2. no layer may lose more than ``floor(MAX_RATE * n)`` tokens, so each layer's best
   ``n - floor(MAX_RATE * n)`` are kept whatever the ranking says;
3. of the remaining tokens of all layers, the ``round(R * L * n)`` lowest-scored are removed
   (ties: lower layer, then earlier token, first);
4. layer ``l`` gets the rate ``d_l / n``, with ``d_l`` its removed tokens
   (:class:`~unicache_train.compress.schedule.LayerRates`), and the layer's own pipeline removes
   its ``d_l`` lowest-ranked tokens: the same ones, since its ranking orders them as step 3 did.

Every kept entry of every layer takes the same bytes, so the stored bytes equal a per-layer
budget's at the same ``R`` (up to rounding) and the rates calibrated on measured bytes carry
over. The compressor needs every layer's context before compressing any: it declares itself
cross-layer (:class:`~unicache_train.seam.CrossLayerCompressor`), and the decoder, the
long-context engine and the transformers cache run the recording pass and :func:`fit_layer_rates`
first, as they do for xKV.

Shape legend: B, L, T = batch, layers, tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from unicache_train.compress.config import MAX_RATE
from unicache_train.compress.schedule import LayerRates
from unicache_train.compress.state import CompressionState
from unicache_train.seam import RecordedContext

__all__ = ["global_drop_counts", "fit_layer_rates"]


@torch.no_grad()
def global_drop_counts(
    scores: torch.Tensor, context_mask: torch.Tensor, rate: torch.Tensor
) -> torch.Tensor:
    """Steps 2-3 of the module docstring: how many tokens each layer removes.

    Args:
        scores: [B, L, T] float, one scale for all layers; ``+inf`` for tokens always kept
            (values outside the context are ignored).
        context_mask: [B, T] bool.
        rate: [B] the fraction of all layers' context tokens to remove, in [0, MAX_RATE].

    Returns:
        [B, L] long, tokens removed from each layer.
    """
    B, L, T = scores.shape
    ctx = context_mask[:, None, :].expand(B, L, T)
    n = context_mask.sum(1)  # [B]
    s = torch.where(ctx, scores.float(), torch.full_like(scores, float("inf"), dtype=torch.float))
    # Step 2: each layer's best n - floor(MAX_RATE * n) tokens stay (rank 0 = lowest score).
    max_drop = torch.floor(n.double() * MAX_RATE).long()  # [B]
    order = torch.sort(s, dim=-1, stable=True).indices  # [B, L, T]
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(T, device=s.device).expand(B, L, T))
    candidate = ctx & torch.isfinite(s) & (rank < max_drop[:, None, None])
    # Step 3: the lowest round(R * L * n) candidates of all layers, layer-major on ties.
    flat = torch.where(candidate, s, torch.full_like(s, float("inf"))).reshape(B, L * T)
    k = torch.floor(rate.double() * L * n.double() + 0.5).long()  # [B]
    k = torch.minimum(k, candidate.reshape(B, -1).sum(1))
    pick = torch.sort(flat, dim=-1, stable=True).indices  # [B, L*T]
    take = torch.arange(L * T, device=s.device)[None, :] < k[:, None]  # [B, L*T]
    drop = torch.zeros(B, L * T, dtype=torch.bool, device=s.device)
    drop.scatter_(1, pick, take)
    return drop.view(B, L, T).sum(-1)


@torch.no_grad()
def fit_layer_rates(
    context: RecordedContext,
    prefix: Callable[[CompressionState], CompressionState],
    new_state: Callable[..., CompressionState],
    scorer: object,
    target: float,
) -> LayerRates:
    """Every layer's rate under one budget over the recorded layers (the module docstring).

    Args:
        context: every layer's recorded input (the decoder's recording pass).
        prefix: runs a layer's state through the pipeline's steps before the selection (head
            merging).
        new_state: ``(inp, target) -> CompressionState`` as the compressor builds its states.
        scorer: the selection step; its ``global_scores(state) -> [B, T]`` puts every layer on
            one scale (``+inf``: always kept).
        target: the rate over all layers (``target_rate * rate_scale``).

    Returns:
        :class:`LayerRates` for every recorded layer.
    """
    layers: Sequence[int] = sorted(context.inputs)
    if not layers:
        raise ValueError("global_budget: the recording pass recorded no layer")
    cols = []
    mask = context.inputs[layers[0]].context_mask
    for layer_idx in layers:
        inp = context.inputs[layer_idx]
        if inp.context_mask.shape != mask.shape or not bool((inp.context_mask == mask).all()):
            raise ValueError(
                f"global_budget: layer {layer_idx}'s context differs from layer {layers[0]}'s "
                "(one budget over layers needs the same context tokens in every layer; a "
                "sliding-window model's windowed layers are not compressed at the seam)"
            )
        state = prefix(new_state(inp, target))
        cols.append(scorer.global_scores(state).float())  # type: ignore[attr-defined]
    scores = torch.stack(cols, 1)  # [B, L, T]
    rate = torch.full((mask.shape[0],), min(max(float(target), 0.0), MAX_RATE), device=mask.device)
    drops = global_drop_counts(scores, mask, rate)
    n = mask.sum(1).clamp_min(1).float()
    return LayerRates({layer: drops[:, i].float() / n for i, layer in enumerate(layers)})
