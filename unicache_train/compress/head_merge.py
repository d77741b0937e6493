"""Head merging: KV heads of a layer with similar context K/V share one stored copy.

Source: the UniCache article §3.2 ("cluster the KV heads of a layer, heads whose cosine similarity
exceeds the threshold form a group, the group's KV is averaged into one head"; threshold
0.85-0.92), §3.3 (little room in GQA models with 4-8 KV heads) and §9 pitfall 1 (merging
heads without updating masks and indices).

Definitions (per sample, over its context tokens only):

* similarity of heads i, j: the cosine of their flattened context keys
  ``<K_i, K_j>_F / (|K_i|_F |K_j|_F)`` with ``K_h`` the ``[L, D]`` keys of head h over the L
  context tokens (``similarity="kv"``: the smaller of that and the same cosine of the values).
  RoPE rotates both heads identically per position, so the key cosine is the same pre- and
  post-RoPE.
* groups: greedy complete linkage in head order: head j joins the first existing group all of
  whose members it is more similar to than the threshold, else it starts a new group. The group
  id is its smallest head index (the *leader*, whose slot stores the copy).
* merge: the group's K and V are the plain mean over its members (equal weights: the
  least-squares single representative of the members), K and V with the same weights.

The attention view keeps ``[B, H, T, D]``: every member head receives the group's K/V, so the
GQA query->KV head map stays valid, and ``head_groups`` tells storage (``compact_heads``) and
byte accounting (:func:`unicache_train.seam.stored_heads`) that a group is stored once.
``query_head_groups`` gives the query-head -> stored slot map for a compact cache; the tests
check both views attend identically.

Shape legend: B, H, Hq, G, T, D = batch, KV heads, query heads, groups, tokens, head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from unicache_train.compress.config import HeadMergeConfig
from unicache_train.compress.state import CompressionState
from unicache_train.seam import stored_heads

__all__ = [
    "HeadMerge",
    "head_similarity",
    "cluster_heads",
    "merge_heads",
    "compact_heads",
    "query_head_groups",
]


@torch.no_grad()
def head_similarity(
    keys: torch.Tensor, values: torch.Tensor, context_mask: torch.Tensor, source: str = "keys"
) -> torch.Tensor:
    """Cosine similarity between KV heads over the context (see module docstring).

    Args:
        keys, values: [B, H, T, D].
        context_mask: [B, T] bool.
        source: ``"keys"`` or ``"kv"``.

    Returns:
        [B, H, H] in [-1, 1].
    """

    def cos(x: torch.Tensor) -> torch.Tensor:
        B, H = x.shape[:2]
        flat = (x.float() * context_mask[:, None, :, None]).reshape(B, H, -1)  # [B, H, T*D]
        flat = flat / flat.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        return (flat @ flat.transpose(1, 2)).clamp(-1.0, 1.0)  # [B, H, H]

    sim = cos(keys)
    if source == "kv":
        sim = torch.minimum(sim, cos(values))
    return sim


def cluster_heads(sim: torch.Tensor, threshold: float) -> torch.Tensor:
    """Greedy complete-linkage clustering of heads (loop over heads, vectorized over batch).

    Args:
        sim: [B, H, H] symmetric similarity.
        threshold: a head joins a group only if its similarity to *every* member is
            ``> threshold``.

    Returns:
        [B, H] long group id (the group's smallest head index).
    """
    B, H, _ = sim.shape
    ar = torch.arange(H, device=sim.device)
    groups = ar.expand(B, H).clone()
    for j in range(1, H):
        before = ar < j  # [H] heads already placed
        member = (groups[:, None, :] == ar[None, :, None]) & before  # [B, G, H] g's members
        violates = (member & (sim[:, j, None, :] <= threshold)).any(-1)  # [B, G]
        is_group = (groups == ar) & before  # [B, G] existing leaders
        ok = is_group & ~violates
        first = torch.where(ok, ar, H).amin(-1)  # [B] first compatible group
        groups[:, j] = torch.where(first < H, first, j)
    return groups


def _membership(groups: torch.Tensor) -> torch.Tensor:
    """[B, H] group ids -> [B, H, G=H] float one-hot (head h belongs to group g)."""
    H = groups.shape[1]
    return (groups[..., None] == torch.arange(H, device=groups.device)).float()


def merge_heads(
    keys: torch.Tensor, values: torch.Tensor, groups: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace every head's K and V by its group's mean (differentiable).

    Heads alone in their group are returned bit-for-bit.

    Args:
        keys, values: [B, H, T, D].
        groups: [B, H] long.

    Returns:
        (keys, values), each [B, H, T, D].
    """
    member = _membership(groups)  # [B, H, G]
    size = member.sum(1)  # [B, G]
    weight = member / size.clamp_min(1)[:, None, :]  # [B, H, G] mean weights per group
    alone = (size.gather(1, groups) == 1)[:, :, None, None]  # [B, H, 1, 1]

    def merge(x: torch.Tensor) -> torch.Tensor:
        mean = torch.einsum("bhg,bhtd->bgtd", weight, x.float())  # [B, G, T, D]
        back = torch.einsum("bhg,bgtd->bhtd", member, mean).to(x.dtype)  # [B, H, T, D]
        return torch.where(alone, x, back)

    # NOTE: K and V go through the same grouping and weights (UniCache article §6.2: K/V pairing).
    return merge(keys), merge(values)


def compact_heads(x: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage view: one copy per group.

    Args:
        x: [B, H, M, D] attention view (members identical).
        groups: [B, H] long.

    Returns:
        (x_compact [B, G_max, M, D] with the leaders' rows first and zero padding,
        slot [B, H] long: the compact slot that stores head h's group).
    """
    B, H = groups.shape
    ar = torch.arange(H, device=groups.device)
    leader = groups == ar  # [B, H]
    order = torch.sort((~leader).long(), dim=1, stable=True).indices  # leaders first
    G = int(leader.sum(1).max())
    take = order[:, :G]  # [B, G]
    out = x.gather(1, take[:, :, None, None].expand(B, G, *x.shape[2:]))
    out = out * leader.gather(1, take)[:, :, None, None]  # zero padding slots
    slot_of_leader = torch.empty_like(order).scatter_(1, order, ar.expand(B, H))  # [B, H]
    return out, slot_of_leader.gather(1, groups)


def query_head_groups(slot: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """Compact slot read by each query head (GQA: query head i uses KV head ``i // rep``).

    Args:
        slot: [B, H] from :func:`compact_heads`.

    Returns:
        [B, Hq] long.
    """
    rep = num_query_heads // slot.shape[1]
    return slot.repeat_interleave(rep, dim=1)


@dataclass
class HeadMerge(HeadMergeConfig):
    """Pipeline step: cluster and merge KV heads, then invalidate derived statistics.

    Under a curriculum the effective threshold is ``1 - rate_scale * (1 - threshold)``: no
    merging at ``rate_scale = 0``, the configured threshold at 1.
    """

    stage: ClassVar[int] = 1

    def __call__(self, state: CompressionState) -> CompressionState:
        B, H = state.keys.shape[:2]
        if not self.enabled or H == 1:
            return state
        thr = 1.0 - state.rate_scale * (1.0 - self.threshold)
        sim = head_similarity(state.keys, state.values, state.context_mask, self.similarity)
        groups = cluster_heads(sim, thr)
        state.head_groups = groups
        if bool((stored_heads(groups) < H).any()):
            state.keys, state.values = merge_heads(state.keys, state.values, groups)
            # NOTE: structural change: every K/V statistic must be recomputed downstream.
            state.invalidate()
        return state
