"""Tensor helpers shared by the UniCache steps: per-modality counts, grouped ranks, neighbour
similarity and observation-window attention statistics.

Everything is vectorized over batch, heads and tokens (loops run only over neighbour offsets,
heads or the three modalities) and works with per-sample context lengths: a token takes part
only where ``context_mask`` is True. Statistics that drive discrete decisions are computed
without gradients.

Shape legend: B, H, Hq, T, D, W, O, G = batch, KV heads, query heads, tokens, head dim,
observation window, neighbour offsets, groups.

Source: the UniCache article, §2.3 (within-modality normalization, cross-modal interaction),
§4.2 (redundancy window), §5.3 (alignment tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unicache_train.seam import NUM_MODALITIES

__all__ = [
    "WindowStats",
    "NeighbourSims",
    "check_modalities",
    "modality_counts",
    "grouped_rank",
    "grouped_minmax",
    "neighbour_offsets",
    "neighbour_similarity",
    "window_stats",
    "context_lengths",
]

_EPS = 1e-6


def check_modalities(modality_ids: torch.Tensor, context_mask: torch.Tensor) -> None:
    """Raise if a context token has a modality id outside ``[0, NUM_MODALITIES)``."""
    bad = context_mask & ((modality_ids < 0) | (modality_ids >= NUM_MODALITIES))
    if bool(bad.any()):
        found = sorted(set(modality_ids[bad].tolist()))
        raise ValueError(
            f"modality_ids {found} are not supported; expected 0 text, 1 vision, 2 audio"
        )


def context_lengths(context_mask: torch.Tensor) -> torch.Tensor:
    """context_mask: [B, T] bool -> [B] long, context tokens per sample."""
    return context_mask.sum(1)


def modality_counts(modality_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Tokens per modality where ``mask`` holds.

    Args:
        modality_ids: [B, T] long.
        mask: [B, T] bool.

    Returns:
        [B, NUM_MODALITIES] long.
    """
    onehot = F.one_hot(modality_ids.clamp(0, NUM_MODALITIES - 1), NUM_MODALITIES)  # [B, T, 3]
    return (onehot * mask[..., None]).sum(1)


def grouped_rank(
    key: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """Rank of every element within its (sample, group) by ascending ``key``.

    Ties keep index order (stable sorts), so the result is deterministic. Invalid elements get
    rank ``T`` (after everything).

    Args:
        key: [B, T] float.
        group: [B, T] long in ``[0, num_groups)``.
        valid: [B, T] bool.
        num_groups: G.

    Returns:
        [B, T] long.
    """
    B, T = key.shape
    grp = torch.where(valid, group, num_groups)  # invalid -> sentinel group G
    order = torch.sort(key, dim=1, stable=True).indices  # [B, T] by key
    order = order.gather(1, torch.sort(grp.gather(1, order), dim=1, stable=True).indices)
    sizes = F.one_hot(grp, num_groups + 1).sum(1)  # [B, G + 1]
    start = torch.cumsum(sizes, 1) - sizes  # [B, G + 1] first sorted slot of each group
    slot = torch.arange(T, device=key.device).expand(B, T)
    rank_sorted = slot - start.gather(1, grp.gather(1, order))  # [B, T] rank at sorted slot
    rank = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)
    return torch.where(valid, rank, T)


def grouped_minmax(
    x: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """Min-max normalize ``x`` to [0, 1] within each (sample, group); 0 for constant groups.

    Args:
        x: [B, T] float.
        group: [B, T] long.
        valid: [B, T] bool.

    Returns:
        [B, T] float, 0 where invalid.
    """
    B = x.shape[0]
    grp = torch.where(valid, group, num_groups)
    big = torch.finfo(x.dtype).max
    lo = torch.full((B, num_groups + 1), big, dtype=x.dtype, device=x.device)
    hi = torch.full((B, num_groups + 1), -big, dtype=x.dtype, device=x.device)
    lo = lo.scatter_reduce(1, grp, x, reduce="amin")
    hi = hi.scatter_reduce(1, grp, x, reduce="amax")
    lo_t, hi_t = lo.gather(1, grp), hi.gather(1, grp)
    span = hi_t - lo_t
    out = torch.where(span > _EPS, (x - lo_t) / span.clamp_min(_EPS), torch.zeros_like(x))
    return torch.where(valid, out, torch.zeros_like(x))


@dataclass
class NeighbourSims:
    """Similarity of each token to its neighbours (same sample, same modality, both context).

    Attributes:
        offsets: the O neighbour offsets (token ``t`` is compared with ``t + o``).
        sims: [B, T, O] cosine similarity, mean over KV heads; -inf where not a neighbour.
        valid: [B, T, O] bool.
    """

    offsets: tuple[int, ...]
    sims: torch.Tensor
    valid: torch.Tensor

    @property
    def redundancy(self) -> torch.Tensor:
        """d: [B, T], max similarity to any neighbour, clipped to [0, 1] (0: no neighbour)."""
        d = self.sims.amax(-1) if self.sims.shape[-1] else self.sims.new_zeros(self.sims.shape[:2])
        return torch.nan_to_num(d, neginf=0.0).clamp(0.0, 1.0)


def neighbour_offsets(k: int, frame_stride: int = 0) -> tuple[int, ...]:
    """Offsets ``-k..-1, 1..k``; with ``frame_stride > k`` also ``±j * frame_stride`` for
    ``j = 1..k`` (the same patch in the k previous and next frames of a video)."""
    offs = [o for o in range(-k, k + 1) if o != 0]
    if frame_stride > k:
        offs += [s * j * frame_stride for j in range(1, k + 1) for s in (-1, 1)]
    return tuple(offs)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)


def _shift(x: torch.Tensor, o: int, dim: int) -> torch.Tensor:
    """y with ``y[t] = x[t + o]`` along ``dim``, zero (False) outside the sequence."""
    T = x.shape[dim]
    y = torch.zeros_like(x)
    if abs(o) < T:
        if o >= 0:
            y.narrow(dim, 0, T - o).copy_(x.narrow(dim, o, T - o))
        else:
            y.narrow(dim, -o, T + o).copy_(x.narrow(dim, 0, T + o))
    return y


@torch.no_grad()
def neighbour_similarity(
    keys: torch.Tensor,
    values: torch.Tensor,
    modality_ids: torch.Tensor,
    context_mask: torch.Tensor,
    offsets: tuple[int, ...],
    source: str = "keys",
) -> NeighbourSims:
    """Cosine similarity of every token to its neighbours at ``offsets`` (UniCache article §4.2).

    Per KV head the cosine of the key vectors (``source="keys"``) or the mean of the key and
    value cosines (``"kv"``), then the mean over heads. Tokens of another modality, outside the
    context or outside the sequence are not neighbours. Keys are the cached (post-RoPE) keys:
    the cache holds them, so their similarity is what merging two entries would mix.

    Args:
        keys, values: [B, H, T, D].
        modality_ids: [B, T]; context_mask: [B, T] bool.

    Returns:
        :class:`NeighbourSims` with sims [B, T, O].
    """
    kh = _unit(keys.float())  # [B, H, T, D]
    vh = _unit(values.float()) if source == "kv" else None
    T = kh.shape[2]

    def pair_cos(x: torch.Tensor, o: int) -> torch.Tensor:
        # cos(x_t, x_{t+o}) on the overlapping slices only (no shifted copy of [B, H, T, D]),
        # head-averaged, then placed at t: [B, T], 0 where t + o is outside the sequence.
        out = x.new_zeros(x.shape[0], T)
        n = T - abs(o)
        if n > 0:
            a, b = (x[:, :, :n], x[:, :, o:]) if o > 0 else (x[:, :, -o:], x[:, :, :n])
            dots = (a * b).sum(-1).mean(1)  # [B, n]
            if o > 0:
                out[:, :n] = dots
            else:
                out[:, -o:] = dots
        return out

    sims, valid = [], []
    for o in offsets:
        s = pair_cos(kh, o)
        if vh is not None:
            s = 0.5 * (s + pair_cos(vh, o))
        ok = context_mask & _shift(context_mask, o, 1)
        ok &= modality_ids == _shift(modality_ids, o, 1)
        sims.append(torch.where(ok, s, float("-inf")))
        valid.append(ok)
    B, T = modality_ids.shape
    if not offsets:
        empty = keys.new_zeros(B, T, 0, dtype=torch.float32)
        return NeighbourSims((), empty, empty.bool())
    return NeighbourSims(tuple(offsets), torch.stack(sims, -1), torch.stack(valid, -1))


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
    logits = torch.matmul(qw, keys.float().transpose(-1, -2)) * D**-0.5  # [B, H, rep*W, T]
    logits = logits.view(B, H, rep, W, T)
    t = torch.arange(T, device=keys.device)
    see = context_mask[:, None, :] & (t[None, None, :] <= idx[:, :, None]) & row_ok[..., None]
    logits = logits.masked_fill(~see[:, None, None], float("-inf"))  # see: [B, W, T]
    probs = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)  # empty rows -> 0
    A = probs.mean(dim=(1, 2))  # [B, W, T] head-averaged
    attn = A.sum(1)  # [B, T]

    mod_q = modality_ids.gather(1, idx)  # [B, W]
    other = (mod_q[:, :, None] != modality_ids[:, None, :]) & see  # [B, W, T]
    n_from = other.sum(1).clamp_min(1)  # [B, T] other-modality window queries that see t
    share_from = (A * other).sum(1) / n_from  # [B, T]
    share_to_w = (A * other).sum(2) * row_ok  # [B, W]
    share_to = torch.zeros_like(attn).scatter_add(1, idx, share_to_w)
    cross = torch.maximum(share_from, share_to).clamp(0.0, 1.0)
    zero = torch.zeros_like(attn)
    return WindowStats(
        torch.where(context_mask, attn, zero), torch.where(context_mask, cross, zero)
    )
