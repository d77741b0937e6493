"""Execution: merge redundant tokens, evict unimportant ones, keep the rest (UniCache article
§6.1, §6.2, §5.3).

Budget first, thresholds as priorities. Per sample and modality m with rate ``R_m`` (from the
budget step), u unprotected and p protected context tokens, the step removes exactly

    round(R_m * u) + round(discount * R_m * p)

tokens (so the number of emitted entries matches the budget to within one token), never all
tokens of a modality. Which tokens go is decided by the source's redundancy bands, used as
removal priorities (lower tier goes first, lower importance score first within a tier):

* tier 0, ``d > merge_threshold`` (0.8) and a *more important* neighbour above the threshold:
  redundant -> merged into a neighbour. The most important token of a redundant cluster is
  the cluster's anchor and is not in tier 0 (else a whole cluster could go with nothing left
  to merge into);
* tier 1, ``evict_threshold < d <= merge_threshold`` (0.5-0.8): the evict band;
* tier 2, everything else (anchors included), only when the budget still asks for more.

A removed token is **merged** into its most similar *kept* neighbour (same modality, within
the neighbour window) if that similarity exceeds ``merge_threshold``, else **evicted**.
Protected (alignment) tokens have their own quota ``round(discount * R_m * p)``, are removable
only from tier 0 and only by merging; a protected token picked without a kept similar
neighbour is restored and replaced by another token of the same modality (unprotected first,
then a mergeable protected one; never a token a protected merge lands on), for a few rounds.
So protected tokens are never evicted and the budget still holds; if a modality runs out of
removable tokens the budget falls short (``TokenPlan.shortfall``, logged, never forced).

Merging (K and V together, same weights): the entry of a kept token j that absorbs a set S of
tokens is ``x = sum_i w_i x_i / sum_i w_i`` over ``{j} + S`` with ``w_i = exp(s_i)`` (a softmax of
the importance scores inside the group), per head, for K and for V. ``merge_rescale`` then says
which of the two averages is rescaled to the weighted mean norm of its members:

* ``"k"`` (default): keys only. Averaging shrinks vectors and would lower the merged entry's
  attention logits; values are left as the average, because attention sums them: with the
  ``log(count)`` bias and agreeing keys, ``count * exp(q.k) * mean(v)`` *is* the sum over the
  members (exact when the weights are equal), and any rescale of V inflates the output (two
  orthogonal unit values: by sqrt(2)).
* ``"kv"``: keys and values (the article's §6.2 "L2 re-normalisation of merged K/V").
* ``"none"``: plain weighted averages.

The default was chosen by measurement (``scripts/merge_rule_study.py``, README): attention
output error against the unmerged tokens and perplexity after compression on real caches.
The entry keeps j's position and modality and carries ``count = |S| + 1``, which attention
turns into a ``log(count)`` logit bias. Entries that absorb nothing are bit-for-bit the input.
Selection is discrete (no gradient); the kept and merged values carry gradients.

Shape legend: B, H, T, D, M, O = batch, KV heads, tokens, head dim, emitted entries, offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from unicache_train.compress.config import MERGE_RESCALE_RULES, MergeEvictConfig
from unicache_train.compress.grouped import grouped_rank
from unicache_train.compress.modality import modality_counts
from unicache_train.compress.neighbours import NeighbourSims
from unicache_train.compress.state import CompressionState
from unicache_train.seam import NUM_MODALITIES, KVSegment

__all__ = ["MergeEvict", "TokenPlan", "plan_tokens", "merge_tokens", "gather_segment"]


@dataclass
class TokenPlan:
    """Discrete decisions for every token.

    Attributes:
        kept: [B, T] bool, tokens that become entries.
        merged: [B, T] bool, removed tokens merged into ``target``.
        evicted: [B, T] bool, removed tokens dropped.
        target: [B, T] long, the token index whose entry each token ends in (itself when kept,
            its merge target when merged, -1 when evicted or not context).
        requested: [B, 3] long, tokens the budget asked each modality to remove.
        shortfall: [B, 3] long, requested minus removed (> 0 only when a modality ran out of
            removable tokens: protection and "never empty a modality" win over the budget).
    """

    kept: torch.Tensor
    merged: torch.Tensor
    evicted: torch.Tensor
    target: torch.Tensor
    requested: torch.Tensor
    shortfall: torch.Tensor


_ROUNDS = 3  # restore/replace refinement rounds (a loop over rounds, not over tokens)


def _round(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x + 0.5).long()  # half-up: deterministic, unlike round-half-even


def _best_neighbour(
    neigh: NeighbourSims, kept: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Most similar neighbour among the ``kept`` [B, T] tokens with similarity > threshold.

    Returns:
        (has [B, T] bool, index [B, T] long token index, valid where ``has``).
    """
    B, T = kept.shape
    if not neigh.offsets:
        return torch.zeros_like(kept), torch.zeros_like(kept, dtype=torch.long)
    offs = torch.tensor(neigh.offsets, device=kept.device)  # [O]
    t = torch.arange(T, device=kept.device)
    nb = t[:, None] + offs[None, :]  # [T, O] neighbour token index
    nb_kept = kept.gather(1, nb.clamp(0, T - 1).reshape(1, -1).expand(B, -1)).view(B, T, -1)
    ok = neigh.valid & nb_kept & (neigh.sims > threshold)  # [B, T, O]
    best, arg = torch.where(ok, neigh.sims, float("-inf")).max(-1)
    return torch.isfinite(best), (t[None, :] + offs[arg]).clamp(0, T - 1)


@torch.no_grad()
def plan_tokens(
    scores: torch.Tensor,
    neigh: NeighbourSims,
    modality_ids: torch.Tensor,
    context_mask: torch.Tensor,
    rates: torch.Tensor,
    protected: torch.Tensor,
    discount: float,
    merge_threshold: float = 0.8,
    evict_threshold: float = 0.5,
) -> TokenPlan:
    """Decide which tokens are kept, merged or evicted (see module docstring).

    Args:
        scores: [B, T] importance (higher = more important).
        neigh: neighbour similarities of the current K/V.
        modality_ids: [B, T]; context_mask: [B, T] bool.
        rates: [B, 3] rate per modality.
        protected: [B, T] bool alignment tokens.
        discount: rate multiplier of protected tokens.

    Returns:
        :class:`TokenPlan`.
    """
    B, T = scores.shape
    G = NUM_MODALITIES
    mask, prot = context_mask, protected & context_mask
    mod = modality_ids.clamp(0, G - 1)
    u = modality_counts(mod, mask & ~prot)  # [B, 3]
    p = modality_counts(mod, prot)
    n = u + p
    d = neigh.redundancy  # [B, T]
    # Tier 0 holds the redundant tokens that have a *more important* near-duplicate neighbour
    # (higher score, ties to the earlier token): the top token of every redundant cluster is
    # its anchor and stays out of tier 0, so a cluster is never removed as a whole with
    # nothing left to merge into.
    s = scores.float()
    has_nb, nb = _best_neighbour(neigh, mask, merge_threshold)
    t_idx = torch.arange(T, device=mask.device).expand(B, T)
    s_nb = s.gather(1, nb)
    dominated = has_nb & ((s_nb > s) | ((s_nb == s) & (nb < t_idx)))
    tier0 = mask & (d > merge_threshold) & dominated
    anchor = mask & (d > merge_threshold) & ~dominated
    # Quotas: unprotected at R, protected at discount * R and only mergeable ones.
    r_u = _round(rates * u)
    r_p = _round(discount * rates * p)
    requested = r_u + r_p
    a_p = torch.minimum(r_p, modality_counts(mod, prot & tier0))
    r_u = torch.minimum(u, r_u + (r_p - a_p))  # a protected shortfall moves to unprotected
    excess = (r_u + a_p - (n - 1).clamp_min(0)).clamp_min(0)  # never empty a modality
    cut = torch.minimum(excess, r_u)
    r_u, a_p = r_u - cut, a_p - (excess - cut)

    evict_band = mask & (d > evict_threshold) & ~tier0 & ~anchor
    tier = torch.where(tier0, 0, torch.where(evict_band, 1, 2)).float()
    key = tier * 16.0 + s  # |scores| < 8: tiers never interleave
    group = mod * 2 + prot.long()  # (modality, protected) sub-groups
    rank = grouped_rank(key, group, mask, 2 * G)
    quota = torch.stack([r_u, a_p], -1).reshape(B, 2 * G)  # [B, 6] in group order
    removable = mask & (~prot | tier0)
    sel = removable & (rank < quota.gather(1, group))

    # A protected token is removed only by merging into a kept neighbour. Those picked
    # without one are restored and replaced: unprotected tokens first, then other mergeable
    # protected tokens, never a token a protected merge lands on. A few refinement rounds
    # (each can strand a replacement whose neighbour was also picked), then restore the rest.
    blocked = torch.zeros_like(mask)
    for _ in range(_ROUNDS):
        has, tgt = _best_neighbour(neigh, mask & ~sel, merge_threshold)
        restored = sel & prot & ~has
        if not bool(restored.any()):
            break
        sel, blocked = sel & ~restored, blocked | restored
        has, tgt = _best_neighbour(neigh, mask & ~sel, merge_threshold)
        anchored = sel & has & prot
        hits = torch.zeros(B, T, dtype=torch.long, device=mask.device)
        is_anchor = hits.scatter_add(1, torch.where(anchored, tgt, 0), anchored.long()) > 0
        free = mask & ~sel & ~is_anchor
        cand_u = free & ~prot
        cand_p = free & prot & tier0 & ~blocked & has
        key2 = torch.where(cand_u, key, key + 64.0)  # unprotected replacements first
        rank2 = grouped_rank(key2, mod, cand_u | cand_p, G)
        sel = sel | ((cand_u | cand_p) & (rank2 < modality_counts(mod, restored).gather(1, mod)))
    has, _ = _best_neighbour(neigh, mask & ~sel, merge_threshold)
    sel = sel & ~(prot & ~has)  # still stranded: protection wins over the budget

    kept = mask & ~sel
    has, tgt = _best_neighbour(neigh, kept, merge_threshold)
    merged, evicted = sel & has, sel & ~has
    target = torch.where(kept, t_idx, torch.where(merged, tgt, -1))
    shortfall = (requested - modality_counts(mod, sel)).clamp_min(0)
    return TokenPlan(
        kept=kept,
        merged=merged,
        evicted=evicted,
        target=target,
        requested=requested,
        shortfall=shortfall,
    )


def merge_tokens(
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: TokenPlan,
    scores: torch.Tensor,
    context_mask: torch.Tensor,
    rescale: str = MergeEvictConfig.merge_rescale,
    latent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold merged tokens into their targets' entries (differentiable in keys and values).

    Args:
        keys: [B, H, T, D]; values: [B, H, T, Dv] (Dv may differ, e.g. MLA's latent cache).
        plan: from :func:`plan_tokens`.
        scores: [B, T] importance (merge weights ``exp(s)``, no gradient).
        context_mask: [B, T] bool.
        rescale: which averages are rescaled to their members' mean norm: ``"k"``, ``"kv"``
            or ``"none"`` (module docstring).
        latent: MLA's latent (``values`` are ``keys[..., :Dv]``, ``[c_kv ‖ k_pe]``): the latent
            is merged once and the returned values are the merged keys' first ``Dv`` features.
            Its ``c_kv`` part is also the values, so it is rescaled only under ``"kv"``; the
            key-only ``k_pe`` part under ``"k"`` and ``"kv"``.

    Returns:
        (keys, values, counts): [B, H, T, D] with every kept token's entry at its own index
        (other rows unchanged, unused), and counts [B, T] float (tokens per entry).
    """
    if rescale not in MERGE_RESCALE_RULES:
        raise ValueError(
            f"merge_tokens: rescale={rescale!r} is not allowed; choose one of "
            f"{list(MERGE_RESCALE_RULES)}"
        )
    B, H, T, _ = keys.shape
    slot = torch.where(plan.target >= 0, plan.target, T)  # [B, T]; T is a dump slot
    s = scores.detach().float()
    top = torch.where(context_mask, s, float("-inf")).amax(1, keepdim=True)
    s = s - torch.where(torch.isfinite(top), top, 0.0)  # stable exp; empty contexts -> 0
    w = torch.where(context_mask, s.exp(), torch.zeros_like(s))  # [B, T]
    counts = torch.zeros(B, T + 1, device=keys.device).scatter_add(1, slot, context_mask.float())
    den = torch.zeros(B, T + 1, device=keys.device).scatter_add(1, slot, w)[:, None, :T]
    many = (counts[:, :T] > 1)[:, None, :, None]  # [B, 1, T, 1] entries that absorbed tokens

    den_ = den.clamp_min(1e-30)  # [B, 1, T]

    def fold(x: torch.Tensor, to_norm: bool) -> torch.Tensor:
        D = x.shape[-1]
        idx = slot[:, None, :, None].expand(B, H, T, D)
        xf = x.float()
        wx = xf * w[:, None, :, None]
        num = torch.zeros(B, H, T + 1, D, device=x.device).scatter_add(2, idx, wx)[:, :, :T]
        mean = num / den_[..., None]  # [B, H, T, D] weighted average per entry
        if to_norm:
            norm = xf.norm(dim=-1) * w[:, None, :]  # [B, H, T]
            tnorm = torch.zeros(B, H, T + 1, device=x.device).scatter_add(2, idx[..., 0], norm)
            scale = (tnorm[:, :, :T] / den_) / mean.norm(dim=-1).clamp_min(1e-12)
            mean = mean * scale[..., None]
        return torch.where(many, mean.to(x.dtype), x)

    # NOTE: K and V use the same plan and weights (UniCache article §6.2: merging K but not V breaks
    # the pairing of keys and values); only the norm rescale differs between them.
    if latent:  # one latent: V = K[..., :Dv] stays true (the values are stored once)
        c, pe = keys.split([values.shape[-1], keys.shape[-1] - values.shape[-1]], dim=-1)
        k = torch.cat([fold(c, rescale == "kv"), fold(pe, rescale in ("k", "kv"))], dim=-1)
        return k, k[..., : values.shape[-1]], counts[:, :T]
    k = fold(keys, rescale in ("k", "kv"))
    v = fold(values, rescale == "kv")
    return k, v, counts[:, :T]


def gather_segment(
    keys: torch.Tensor,
    values: torch.Tensor,
    counts: torch.Tensor,
    plan: TokenPlan,
    positions: torch.Tensor,
    modality_ids: torch.Tensor,
) -> KVSegment:
    """Pack the kept entries, in original token order, into a padded segment.

    Args:
        keys, values: [B, H, T, D] / [B, H, T, Dv] from :func:`merge_tokens`; counts: [B, T].
        plan: the token plan; positions, modality_ids: [B, T].

    Returns:
        :class:`KVSegment` with M = max entries over the batch and ``assignment`` filled.
    """
    B, H, T, _ = keys.shape
    t = torch.arange(T, device=keys.device).expand(B, T)
    n_keep = plan.kept.sum(1)  # [B]
    M = int(n_keep.max()) if B else 0
    order = torch.sort(torch.where(plan.kept, t, T + t), dim=1).indices[:, :M]  # [B, M]
    valid = torch.arange(M, device=keys.device)[None, :] < n_keep[:, None]  # [B, M]
    vmask = valid[:, None, :, None].to(keys.dtype)

    def take(x: torch.Tensor) -> torch.Tensor:
        return x.gather(2, order[:, None, :, None].expand(B, H, M, x.shape[-1])) * vmask

    entry_of = torch.full((B, T), -1, dtype=torch.long, device=keys.device)
    entry_of.scatter_(1, order, torch.where(valid, torch.arange(M, device=keys.device), -1))
    assignment = torch.where(plan.target >= 0, entry_of.gather(1, plan.target.clamp_min(0)), -1)
    return KVSegment(
        keys=take(keys),
        values=take(values),
        positions=positions.gather(1, order),
        modality_ids=modality_ids.gather(1, order),
        counts=torch.where(valid, counts.gather(1, order), 1.0).to(keys.dtype),
        valid=valid,
        assignment=assignment,
    )


@dataclass
class MergeEvict(MergeEvictConfig):
    """Pipeline step: plan, merge and gather the segment (``state.segment``)."""

    stage: ClassVar[int] = 6

    def __call__(self, state: CompressionState) -> CompressionState:
        if not self.enabled:
            return state
        mask = state.context_mask
        scores = (
            state.scores
            if state.scores is not None
            else torch.zeros(mask.shape, device=mask.device)
        )
        rates = state.modality_rates
        if rates is None:  # no budget step: every modality at the layer rate (or target)
            R = state.layer_rate if state.layer_rate is not None else state.target
            rates = R.float()[:, None].expand(-1, NUM_MODALITIES)
        protected = state.protected if state.protected is not None else torch.zeros_like(mask)
        plan = plan_tokens(
            scores,
            state.neighbour_sims(),
            state.modality_ids,
            mask,
            rates,
            protected,
            state.discount,
            self.merge_threshold,
            self.evict_threshold,
        )
        # MLA: the untouched latent input (values = keys[..., :R]) stays one latent.
        inp = state.inp
        latent = inp.latent and state.keys is inp.keys and state.values is inp.values
        k, v, counts = merge_tokens(
            state.keys, state.values, plan, scores, mask, rescale=self.merge_rescale,
            latent=latent,
        )  # fmt: skip
        seg = gather_segment(k, v, counts, plan, state.inp.positions, state.modality_ids)
        if latent:
            seg.values, seg.latent = seg.keys[..., : v.shape[-1]], True
        seg.head_groups = state.head_groups
        state.plan = plan
        state.segment = seg
        return state
