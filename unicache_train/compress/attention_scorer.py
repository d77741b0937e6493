"""A learned scorer regressed to the attention a token will receive (KVzap / Locret style).

KVzap (arXiv 2601.07891) and Locret (arXiv 2410.01805) train, per layer, a small map from what
the cache sees of a token to how much later queries will attend to it, with the backbone frozen
(forwards only), and evict the tokens predicted to matter least. Ours, per layer ``l`` and KV
head ``h``, is linear in features of the token's own key and value::

    phi(t) = [ v_t (D) ; |k_t| per RoPE pair (D/2) ; log(1 + t) ; log(n - t) ; 1 ]
    s_lht  = w_lh . phi_lh(t)                     (the predicted log target, :func:`target`)

The key enters through the norms of its rotary pairs, which RoPE leaves unchanged (the seam's
keys are post-RoPE; the phase would tie the map to positions), ``t`` is the token's rank in the
context and ``n`` the context length. The target (fitted in
:mod:`unicache_train.train.scorer_fit`, closed-form ridge from streamed ``X^T X``) is KVzap's:
the log of the largest attention the token receives from any later position and query head of
its group, times the norm of what it writes, ``||W_O^g v_t||``.

As a selection (``SelectionConfig.method="attention"``): per layer the heads' scores are
reduced by their maximum (a segment keeps one token set for every head:
docs/compression_methods.md#selection-is-per-layer), the first ``sinks`` and the last
``window`` context tokens always kept (score 2; a budget smaller than both keeps the latest of
them), the rest ranked by the prediction (percentiles
in [0, 1)); the merge/evict step then removes the lowest until the layer's budget is met, so a
byte target is met exactly as for every other scorer (rates calibrated on measured bytes).

Shape legend: B, H, T, D, F, L = batch, KV heads, tokens, head dim, features, layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from unicache_train.compress.config import SelectionConfig
from unicache_train.compress.grouped import grouped_rank
from unicache_train.compress.state import CompressionState

__all__ = [
    "AttentionScorer",
    "AttentionScore",
    "scorer_features",
    "num_features",
    "save_attention_scorer",
    "read_attention_scorer",
    "ALWAYS_KEPT_SCORE",
    "ATTENTION_SCORER_FILE",
]

#: The file name an export gives the scorer's weights (:func:`save_attention_scorer`).
ATTENTION_SCORER_FILE = "kv_attention_scorer.safetensors"

#: Score of a sink or recent-window token: above every ranked token's (in [0, 1)).
ALWAYS_KEPT_SCORE = 2.0


def num_features(head_dim: int) -> int:
    """F for a head dim: value (D), key pair norms (D/2), two position features, a bias."""
    return head_dim + head_dim // 2 + 3


def scorer_features(
    keys: torch.Tensor, values: torch.Tensor, context_mask: torch.Tensor
) -> torch.Tensor:
    """The features of every token and KV head (module docstring).

    Args:
        keys: [B, H, T, D] post-RoPE keys (the rotary pairs are ``(i, i + D/2)``, as
            :func:`unicache_train.ops.rope.apply_rope` rotates them).
        values: [B, H, T, D].
        context_mask: [B, T] bool.

    Returns:
        [B, H, T, F] float32 (zeros outside the context).
    """
    k, v = keys.float(), values.float()
    D = k.shape[-1]
    half = D // 2
    pair = torch.sqrt(k[..., :half] ** 2 + k[..., half : 2 * half] ** 2)  # [B, H, T, D/2]
    rank = (torch.cumsum(context_mask.long(), 1) - 1).clamp_min(0).float()  # [B, T]
    n = context_mask.sum(1, keepdim=True).float()
    pos = torch.stack([torch.log1p(rank), torch.log((n - rank).clamp_min(1.0))], -1)  # [B,T,2]
    B, H, T, _ = k.shape
    ones = torch.ones(B, H, T, 1, dtype=torch.float32, device=k.device)
    phi = torch.cat([v, pair, pos[:, None].expand(B, H, T, 2), ones], -1)
    return phi * context_mask[:, None, :, None]


class AttentionScorer(nn.Module):
    """Per layer and KV head, the linear map of :func:`scorer_features` to the predicted log
    attention (zeros: every token scores alike, ties kept in token order).

    Args:
        num_layers, num_kv_heads, head_dim: the model's L, H_kv, D.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"AttentionScorer.{name}={value!r} is out of range; allowed an integer in "
                    "[1, inf)"
                )
        self.head_dim = head_dim
        self.weight = nn.Parameter(
            torch.zeros(num_layers, num_kv_heads, num_features(head_dim)), requires_grad=False
        )

    def head_scores(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """[B, H, T] predicted log attention of every token and KV head of one layer."""
        L, H, F = self.weight.shape
        if not 0 <= layer_idx < L or keys.shape[1] != H or keys.shape[-1] != self.head_dim:
            raise ValueError(
                f"AttentionScorer of {L} layers x {H} KV heads x head dim {self.head_dim} cannot "
                f"score layer {layer_idx} with keys of shape {tuple(keys.shape)}"
            )
        phi = scorer_features(keys, values, mask)  # [B, H, T, F]
        return torch.einsum("bhtf,hf->bht", phi, self.weight[layer_idx].float())


def _always_kept(mask: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """[B, T] bool: the first ``sinks`` and the last ``window`` context tokens."""
    n = mask.sum(1, keepdim=True)
    order = torch.cumsum(mask.long(), 1) - 1  # [B, T] context rank
    return mask & ((order < sinks) | (order >= n - window))


def scores_for_selection(
    state: CompressionState, scorer: AttentionScorer, sinks: int, window: int
) -> torch.Tensor:
    """[B, T] in [0, 2]: sinks and the recent window 2, the rest their percentile rank of the
    heads' largest prediction, 0 outside the context."""
    mask = state.context_mask
    pred = scorer.head_scores(state.inp.layer_idx, state.keys, state.values, mask).amax(1)
    rank = grouped_rank(pred, torch.zeros_like(state.modality_ids), mask, 1).float()
    n = mask.sum(1, keepdim=True)
    pct = rank / (n - 1).clamp_min(1).float()
    always = _always_kept(mask, sinks, window)
    s = torch.where(always, torch.full_like(pct, ALWAYS_KEPT_SCORE), pct.clamp(max=0.999))
    return torch.where(mask, s, torch.zeros_like(s))


def global_scores(
    state: CompressionState, scorer: AttentionScorer, sinks: int, window: int
) -> torch.Tensor:
    """[B, T] the heads' largest predicted log attention, ``+inf`` for sinks and the recent
    window: one scale for every layer (``ScheduleConfig.global_budget``). Within a layer it
    orders the tokens as :func:`scores_for_selection` does."""
    mask = state.context_mask
    pred = scorer.head_scores(state.inp.layer_idx, state.keys, state.values, mask).amax(1)
    inf = torch.full_like(pred, float("inf"))
    return torch.where(_always_kept(mask, sinks, window), inf, pred.float())


@dataclass
class AttentionScore(SelectionConfig):
    """Pipeline step (the scorer): ``state.scores`` from the learned attention regression."""

    stage: ClassVar[int] = 2
    scorer: AttentionScorer | None = field(default=None, repr=False)

    @torch.no_grad()
    def __call__(self, state: CompressionState) -> CompressionState:
        if self.scorer is None:
            raise ValueError(
                "SelectionConfig.method='attention' needs its AttentionScorer: fit one with "
                "unicache_train.train.scorer_fit.fit_attention_scorer or read one with "
                "read_attention_scorer"
            )
        state.scores = scores_for_selection(state, self.scorer, self.sinks, self.window)
        return state

    @torch.no_grad()
    def global_scores(self, state: CompressionState) -> torch.Tensor:
        """[B, T] on the scale shared by all layers (:func:`global_scores`)."""
        if self.scorer is None:
            raise ValueError("SelectionConfig.method='attention' needs its AttentionScorer")
        return global_scores(state, self.scorer, self.sinks, self.window)


def save_attention_scorer(scorer: AttentionScorer, path: str | Path) -> Path:
    """Write the scorer's weights (safetensors, atomically): ``weight`` [L, H_kv, F] and
    ``head_dim``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(
        {"weight": scorer.weight.detach().float().contiguous()},
        str(tmp),
        metadata={"head_dim": str(scorer.head_dim), "format": "unicache_attention_scorer/1"},
    )
    tmp.replace(path)
    return path


def read_attention_scorer(
    path: str | Path, shape: tuple[int, int, int] | None = None
) -> AttentionScorer:
    """Read :func:`save_attention_scorer`'s file; ``shape`` (L, H_kv, D) is checked when given.

    Raises:
        FileNotFoundError, ValueError: a missing file, or one of another shape or format.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no attention scorer file")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != "unicache_attention_scorer/1":
            raise ValueError(f"{path}: not an attention scorer file (format {meta.get('format')})")
        w = f.get_tensor("weight")
    D = int(meta["head_dim"])
    L, H, F = w.shape
    if F != num_features(D):
        raise ValueError(f"{path}: weight has {F} features, head dim {D} needs {num_features(D)}")
    if shape is not None and tuple(shape) != (L, H, D):
        raise ValueError(
            f"{path}: an attention scorer of (layers, KV heads, head dim) = {(L, H, D)}, the "
            f"model has {tuple(shape)}"
        )
    scorer = AttentionScorer(L, H, D)
    with torch.no_grad():
        scorer.weight.copy_(w)
    return scorer.eval()
