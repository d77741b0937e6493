"""Observation-window attention statistics: how much attention each context token receives from
the last W context queries, and its cross-modal share (UniCache article §2.3, §5.3).

O(W * T) per head, never the full T x T matrix; computed without gradients. Shape legend:
B, H, Hq, T, D, W = batch, KV heads, query heads, tokens, head dim, observation window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unicache_train.compress.kernels import using_reference_kernels
from unicache_train.compress.modality import context_lengths

__all__ = ["WindowStats", "window_stats"]


@dataclass
class WindowStats:
    """Attention statistics from the observation window (the last W context queries).

    Attributes:
        attn: [B, T] attention each context token receives, summed over the window queries and
            averaged over query heads (the "a" signal before normalization).
        cross: [B, T] cross-modal attention share in [0, 1]: the larger of
            *from*: the mean attention token t receives from each window query of another
            modality that can see it (causally), and
            *to*: for window tokens, the fraction of their own attention that goes to tokens of
            other modalities (0 for tokens outside the window).
    """

    attn: torch.Tensor
    cross: torch.Tensor


@torch.no_grad()
def window_stats(
    queries: torch.Tensor,
    keys: torch.Tensor,
    modality_ids: torch.Tensor,
    context_mask: torch.Tensor,
    window: int,
) -> WindowStats:
    """Observation-window attention of the last ``window`` context queries of each sample.

    Costs O(W * T) per head: the full T x T attention matrix is never formed. Each window query
    attends causally to the context (itself included), as it did in the prefill.

    Args:
        queries: [B, Hq, T, D] post-RoPE queries.
        keys: [B, H, T, D] keys (Hq a multiple of H, GQA).
        modality_ids: [B, T]; context_mask: [B, T] bool.
        window: W.

    Returns:
        :class:`WindowStats`.
    """
    B, Hq, T, D = queries.shape
    H = keys.shape[1]
    W = min(window, T)
    L = context_lengths(context_mask)  # [B]
    # The context is a prefix in the seam, but locate window tokens by context rank so any
    # mask works: window row w holds the context token of rank L - W + w.
    want = L[:, None] - W + torch.arange(W, device=keys.device)  # [B, W] context rank
    row_ok = want >= 0
    # Token index of the context token with rank `want` (searchsorted on the running count).
    idx = torch.searchsorted(torch.cumsum(context_mask.long(), 1), (want + 1).clamp_min(1))
    idx = idx.clamp(max=T - 1)  # [B, W]
    qw = queries.gather(2, idx[:, None, :, None].expand(B, Hq, W, D)).float()  # [B, Hq, W, D]
    rep = Hq // H  # GQA: query heads h*rep .. h*rep+rep-1 read KV head h
    qw = qw.view(B, H, rep * W, D)  # [B, H, rep*W, D]
    logits = torch.matmul(qw, keys.float().transpose(-1, -2)).mul_(D**-0.5)  # [B, H, rep*W, T]
    logits = logits.view(B, H, rep, W, T)
    t = torch.arange(T, device=keys.device)
    visible = context_mask[:, None, :] & (t[None, None, :] <= idx[:, :, None])  # [B, W, T]
    see = visible & row_ok[..., None]
    if using_reference_kernels():
        logits = logits.masked_fill(~see[:, None, None], float("-inf"))
        probs = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)  # empty rows -> 0
        A = probs.mean(dim=(1, 2))  # [B, W, T] head-averaged
    else:
        # The same numbers without the broadcast masked_fill and nan_to_num (10x slower on
        # CPU): an additive 0 / -inf bias (x + 0 == x), and a missing window row (row_ok
        # False) is left unmasked, then zeroed by a multiply, instead of becoming NaN.
        bias = torch.zeros(see.shape, device=keys.device).masked_fill_(
            ~(visible | ~row_ok[..., None]), float("-inf")
        )
        probs = torch.softmax(logits.add_(bias[:, None, None]), -1)
        probs.mul_(row_ok[:, None, None, :, None])
        A = probs.view(B, H * rep, W, T).mean(1)  # [B, W, T]: the same reduction, coalesced
    attn = A.sum(1)  # [B, T]

    mod_q = modality_ids.gather(1, idx)  # [B, W]
    other = (mod_q[:, :, None] != modality_ids[:, None, :]) & see  # [B, W, T]
    n_from = other.sum(1).clamp_min(1)  # [B, T] other-modality window queries that see t
    a_other = A * other
    share_from = a_other.sum(1) / n_from  # [B, T]
    share_to_w = a_other.sum(2) * row_ok  # [B, W]
    share_to = torch.zeros_like(attn).scatter_add(1, idx, share_to_w)
    cross = torch.maximum(share_from, share_to).clamp(0.0, 1.0)
    zero = torch.zeros_like(attn)
    return WindowStats(
        torch.where(context_mask, attn, zero), torch.where(context_mask, cross, zero)
    )
