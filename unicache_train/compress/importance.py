"""Token importance: ``s = w_a*a + w_c*c - w_d*d + w_r*r`` (UniCache article §2.3, §4.2, §4.3).

Signals, per context token of a sample (all in [0, 1], no gradients: they drive discrete
selection):

* a, attention: attention received from the observation window (the last W context queries,
  head-averaged, see :func:`~unicache_train.compress.window.window_stats`), normalized
  **within each modality** as a percentile rank (``rank / (n_m - 1)``; a lone token gets 1).
  Ranks are robust to attention sinks, which would squash a min-max scale to one token.
  UniCache article §2.3: a visual token's attention is diluted by the number of visual tokens, so
  raw or globally normalized scores make the model "read the text and ignore the image";
  ``normalize="global"`` ranks over all context tokens and exists only as that baseline.
* c, cross-modal interaction: the window's cross-modal attention share (to/from the other
  modalities), min-max normalized within the modality (globally for the baseline).
* d, redundancy: the max cosine similarity of the token's key (or K/V) to its k neighbours on
  each side (same modality), clipped to [0, 1]; enters with a minus sign.
* r, recency: ``i / (L - 1)`` for the i-th of L context tokens.

Layer-dependent weights (§4.3): the shallow third of the layers (``3*layer < num_layers``) uses
``w_d = shallow_w_d`` (0.3, more redundancy there), the deep third (``3*layer >= 2*num_layers``)
uses ``w_a = deep_w_a`` (0.5, attention reflects semantics there); other weights unchanged.

Shape legend: B, T = batch, tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from unicache_train.compress.config import ImportanceConfig
from unicache_train.compress.grouped import grouped_minmax, grouped_rank
from unicache_train.compress.state import CompressionState
from unicache_train.seam import NUM_MODALITIES

__all__ = [
    "Importance",
    "layer_weights",
    "recency",
    "normalize_attention",
    "importance_scores",
    "pool_scores",
]


def layer_weights(
    cfg: ImportanceConfig, layer_idx: int, num_layers: int
) -> tuple[float, float, float, float]:
    """(w_a, w_c, w_d, w_r) for a layer: shallow third raises w_d, deep third raises w_a."""
    w_a, w_d = cfg.w_a, cfg.w_d
    if 3 * layer_idx < num_layers:
        w_d = cfg.shallow_w_d
    elif 3 * layer_idx >= 2 * num_layers:
        w_a = cfg.deep_w_a
    return w_a, cfg.w_c, w_d, cfg.w_r


def recency(context_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B, T] float: ``i / (L - 1)`` for the i-th context token, 0 elsewhere."""
    rank = torch.cumsum(context_mask.long(), 1) - 1
    L = context_mask.sum(1, keepdim=True)
    r = rank.float() / (L - 1).clamp_min(1).float()
    return torch.where(context_mask, r, torch.zeros_like(r))


def normalize_attention(
    attn: torch.Tensor,
    modality_ids: torch.Tensor,
    context_mask: torch.Tensor,
    normalize: str = "modality",
) -> torch.Tensor:
    """Percentile rank of ``attn`` within each (sample, modality) or over the whole context.

    Args:
        attn: [B, T] raw attention received.
        modality_ids: [B, T]; context_mask: [B, T] bool.
        normalize: ``"modality"`` or ``"global"``.

    Returns:
        [B, T] in [0, 1], 0 outside the context.
    """
    group = modality_ids if normalize == "modality" else torch.zeros_like(modality_ids)
    rank = grouped_rank(attn, group, context_mask, NUM_MODALITIES).float()
    onehot = torch.nn.functional.one_hot(group.clamp(0, NUM_MODALITIES - 1), NUM_MODALITIES)
    n = (onehot * context_mask[..., None]).sum(1).gather(1, group.clamp(0, NUM_MODALITIES - 1))
    pct = torch.where(n > 1, rank / (n - 1).clamp_min(1).float(), torch.ones_like(rank))
    return torch.where(context_mask, pct, torch.zeros_like(pct))


def importance_scores(cfg: ImportanceConfig, state: CompressionState) -> torch.Tensor:
    """The score ``s`` of every context token of ``state`` (0 outside the context).

    Returns:
        [B, T] float32.
    """
    inp, mask, mod = state.inp, state.context_mask, state.modality_ids
    ws = state.window_stats()
    a = normalize_attention(ws.attn, mod, mask, cfg.normalize)
    group = mod if cfg.normalize == "modality" else torch.zeros_like(mod)
    c = grouped_minmax(ws.cross, group, mask, NUM_MODALITIES)
    d = state.neighbour_sims().redundancy
    r = recency(mask)
    w_a, w_c, w_d, w_r = layer_weights(cfg, inp.layer_idx, inp.num_layers)
    s = w_a * a + w_c * c - w_d * d + w_r * r
    s = torch.where(mask, s, torch.zeros_like(s))
    if cfg.pool > 1:
        s = pool_scores(s, mod, mask, cfg.pool)
    return s


def pool_scores(
    scores: torch.Tensor, modality_ids: torch.Tensor, context_mask: torch.Tensor, kernel: int
) -> torch.Tensor:
    """Each context token takes the max score over the ``kernel`` tokens centred on it.

    Only context tokens of the token's own modality take part (a text span is never lifted by
    a neighbouring image patch). Max rather than mean: a token next to an important one must
    score at least as high, so top-k keeps the span around it whole.

    Args:
        scores: [B, T]; modality_ids: [B, T]; context_mask: [B, T] bool.
        kernel: odd window length.

    Returns:
        [B, T], 0 outside the context.
    """
    neg = torch.finfo(scores.dtype).min
    out = torch.full_like(scores, neg)
    # NOTE: every modality id, not the ones present: finding those would sync the device on
    # the per-layer hot path; an absent modality pools an all-masked row, which is discarded.
    for m in range(NUM_MODALITIES):
        keep = context_mask & (modality_ids == m)
        x = torch.where(keep, scores, torch.full_like(scores, neg))
        pooled = torch.nn.functional.max_pool1d(
            x[:, None], kernel_size=kernel, stride=1, padding=kernel // 2
        )[:, 0]
        out = torch.where(keep, pooled, out)
    return torch.where(context_mask, out, torch.zeros_like(out))


@dataclass
class Importance(ImportanceConfig):
    """Pipeline step: score every context token of the current (head-merged) K/V."""

    stage: ClassVar[int] = 2

    def __call__(self, state: CompressionState) -> CompressionState:
        if self.enabled:
            state.configure(self.window, self.neighbours, self.frame_stride, self.similarity)
            state.scores = importance_scores(self, state)
        return state
