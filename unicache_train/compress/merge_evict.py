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

The default was chosen by measurement (``experiments/merge_rule/merge_rule_study.py``):
attention output error against the unmerged tokens and perplexity after compression on real caches.
The entry keeps j's position and modality and carries ``count = |S| + 1``, which attention
turns into a ``log(count)`` logit bias. Entries that absorb nothing are bit-for-bit the input.
Selection is discrete (no gradient); the kept and merged values carry gradients.

On CPU the pipeline step runs :func:`merge_gather_segment`, which computes the means for the
merging tokens only and gathers the kept rows once: bit for bit :func:`merge_tokens` followed by
:func:`gather_segment` (the reference path, ``compress/kernels.py``, kept on accelerators, where
the fused path's two extra host syncs would cost more than the folds), without
``[B, H, T, D]`` work when few tokens merge (text: mostly evictions).

Shape legend: B, H, T, D, M, O = batch, KV heads, tokens, head dim, emitted entries, offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from unicache_train.compress.config import MERGE_RESCALE_RULES, MergeEvictConfig
from unicache_train.compress.grouped import grouped_rank
from unicache_train.compress.kernels import using_reference_kernels
from unicache_train.compress.modality import modality_counts
from unicache_train.compress.neighbours import NeighbourSims
from unicache_train.compress.state import CompressionState
from unicache_train.seam import NUM_MODALITIES, KVSegment

__all__ = [
    "MergeEvict",
    "TokenPlan",
    "plan_tokens",
    "merge_tokens",
    "gather_segment",
    "merge_gather_segment",
]


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
    # NOTE: with no protected token picked (protection off, or none in the quotas) nothing is
    # restored: the rounds and the stranded check would only recompute the same neighbours.
    rounds = _ROUNDS if using_reference_kernels() or bool((sel & prot).any()) else 0
    for _ in range(rounds):
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
    if rounds:
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


def _merge_weights(
    plan: TokenPlan, scores: torch.Tensor, context_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merge's slots and weights (shared by :func:`merge_tokens` and
    :func:`merge_gather_segment`).

    Returns:
        slot [B, T] long (each token's entry, ``T`` = the dump slot of evicted and non-context
        tokens), w [B, T] merge weights ``exp(s - max s)`` (0 outside the context),
        counts [B, T + 1] tokens per slot, den [B, T + 1] weight per slot.
    """
    B, T = context_mask.shape
    dev = context_mask.device
    slot = torch.where(plan.target >= 0, plan.target, T)  # [B, T]; T is a dump slot
    s = scores.detach().float()
    top = torch.where(context_mask, s, float("-inf")).amax(1, keepdim=True)
    s = s - torch.where(torch.isfinite(top), top, 0.0)  # stable exp; empty contexts -> 0
    w = torch.where(context_mask, s.exp(), torch.zeros_like(s))  # [B, T]
    counts = torch.zeros(B, T + 1, device=dev).scatter_add(1, slot, context_mask.float())
    den = torch.zeros(B, T + 1, device=dev).scatter_add(1, slot, w)
    return slot, w, counts, den


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
    slot, w, counts, den = _merge_weights(plan, scores, context_mask)
    many = (counts[:, :T] > 1)[:, None, :, None]  # [B, 1, T, 1] entries that absorbed tokens

    den_ = den[:, None, :T].clamp_min(1e-30)  # [B, 1, T]

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
    order, valid, assignment = _segment_order(plan)
    vmask = valid[:, None, :, None].to(keys.dtype)
    return KVSegment(
        keys=_take(keys, order) * vmask,
        values=_take(values, order) * vmask,
        positions=positions.gather(1, order),
        modality_ids=modality_ids.gather(1, order),
        counts=torch.where(valid, counts.gather(1, order), 1.0).to(keys.dtype),
        valid=valid,
        assignment=assignment,
    )


def _first_rows(select: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected tokens of each sample in token order, padded to the batch's largest count.

    Args:
        select: [B, T] bool.

    Returns:
        (index [B, N] long: the selected tokens first, then unselected ones as padding (all
        distinct), valid [B, N] bool), ``N = max_b select[b].sum()`` (a device sync).
    """
    B, T = select.shape
    t = torch.arange(T, device=select.device).expand(B, T)
    n = select.sum(1)  # [B]
    N = int(n.max()) if B else 0
    index = torch.sort(torch.where(select, t, T + t), dim=1).indices[:, :N]  # [B, N]
    return index, torch.arange(N, device=select.device)[None, :] < n[:, None]


def _segment_order(plan: TokenPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [B, M]: the kept tokens in token order, valid [B, M], assignment [B, T])."""
    B, T = plan.kept.shape
    order, valid = _first_rows(plan.kept)
    M = order.shape[1]
    entry_of = torch.full((B, T), -1, dtype=torch.long, device=order.device)
    entry_of.scatter_(1, order, torch.where(valid, torch.arange(M, device=order.device), -1))
    assignment = torch.where(plan.target >= 0, entry_of.gather(1, plan.target.clamp_min(0)), -1)
    return order, valid, assignment


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], index [B, N] -> [B, H, N, D] (the rows at index, every head).

    The seam's K/V are views of ``[B, T, H, D]`` projections: those are read as ``B * T`` rows
    of ``H * D`` (one ``index_select``, several times faster than a strided ``gather`` on CPU;
    the same values, returned as a ``[B, N, H, D]`` layout viewed ``[B, H, N, D]``).
    """
    B, H, T, D = x.shape
    N = index.shape[1]
    rows = x.transpose(1, 2)
    if rows.is_contiguous():
        flat = (index + torch.arange(B, device=index.device)[:, None] * T).flatten()
        return rows.reshape(B * T, H * D).index_select(0, flat).view(B, N, H, D).transpose(1, 2)
    return x.gather(2, index[:, None, :, None].expand(B, H, N, D))


def merge_gather_segment(
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: TokenPlan,
    scores: torch.Tensor,
    context_mask: torch.Tensor,
    positions: torch.Tensor,
    modality_ids: torch.Tensor,
    rescale: str = MergeEvictConfig.merge_rescale,
) -> KVSegment:
    """:func:`merge_tokens` then :func:`gather_segment`, bit for bit, without ``[B, H, T, D]``
    work: the weighted means are computed over the tokens of the entries that absorb tokens
    only (in token order, so every sum adds the same terms in the same order), and the kept
    rows are gathered once.

    Args:
        keys: [B, H, T, D]; values: [B, H, T, Dv] (not MLA's latent: see ``merge_tokens``).
        plan, scores, context_mask, rescale: as :func:`merge_tokens`.
        positions, modality_ids: [B, T].

    Returns:
        :class:`KVSegment`, equal to ``gather_segment(*merge_tokens(...), plan, ...)``
        (values and gradients).
    """
    if rescale not in MERGE_RESCALE_RULES:
        raise ValueError(
            f"merge_gather_segment: rescale={rescale!r} is not allowed; choose one of "
            f"{list(MERGE_RESCALE_RULES)}"
        )
    B, H, T, _ = keys.shape
    dev = keys.device
    slot, w, counts, den = _merge_weights(plan, scores, context_mask)
    order, valid, assignment = _segment_order(plan)  # [B, M]
    vmask = valid[:, None, :, None].to(keys.dtype)
    seg_counts = torch.where(valid, counts.gather(1, order), 1.0).to(keys.dtype)
    many = counts[:, :T] > 1  # [B, T] entries that absorb tokens (their anchor is kept)
    anchors, anchor_ok = _first_rows(many)  # [B, Q]
    Q = anchors.shape[1]
    if Q > 0:
        # The merging tokens: every context token whose entry absorbs tokens (anchors included).
        member = context_mask & torch.cat([many, many.new_zeros(B, 1)], 1).gather(1, slot)
        rows, row_ok = _first_rows(member)  # [B, P], in token order
        entry = torch.full((B, T + 1), Q, dtype=torch.long, device=dev)  # token -> anchor rank
        entry.scatter_(1, anchors, torch.where(anchor_ok, torch.arange(Q, device=dev), Q))
        dest = torch.where(row_ok, entry.gather(1, slot.gather(1, rows)), Q)  # [B, P]; Q: dump
        w_rows = w.gather(1, rows)  # [B, P]
        den_q = den.gather(1, anchors)[:, None, :].clamp_min(1e-30)  # [B, 1, Q]

        at = entry.gather(1, order).clamp(max=Q - 1)  # [B, M] each entry's anchor rank
        is_anchor = many.gather(1, order)[:, None, :, None]  # [B, 1, M, 1]

        def fold(x: torch.Tensor, to_norm: bool) -> torch.Tensor:
            D = x.shape[-1]
            idx = dest[:, None, :, None].expand(B, H, dest.shape[1], D)
            # NOTE: x is read three times, in merge_tokens' order (weighted sum, norms, the
            # untouched rows), so that autograd adds x's three gradient terms in the same order.
            wx = _take(x, rows).float() * w_rows[:, None, :, None]  # [B, H, P, D]
            num = torch.zeros(B, H, Q + 1, D, device=dev).scatter_add(2, idx, wx)[:, :, :Q]
            mean = num / den_q[..., None]  # [B, H, Q, D]
            if to_norm:
                norm = _take(x, rows).float().norm(dim=-1) * w_rows[:, None, :]  # [B, H, P]
                tnorm = torch.zeros(B, H, Q + 1, device=dev).scatter_add(2, idx[..., 0], norm)
                scale = (tnorm[:, :, :Q] / den_q) / mean.norm(dim=-1).clamp_min(1e-12)
                mean = mean * scale[..., None]
            return torch.where(is_anchor, _take(mean.to(x.dtype), at), _take(x, order))

        k_seg = fold(keys, rescale in ("k", "kv"))
        v_seg = fold(values, rescale == "kv")
    else:
        k_seg, v_seg = _take(keys, order), _take(values, order)
    return KVSegment(
        keys=k_seg * vmask,
        values=v_seg * vmask,
        positions=positions.gather(1, order),
        modality_ids=modality_ids.gather(1, order),
        counts=seg_counts,
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
        # NOTE: the fused path sizes its compact tensors on the host (two more device syncs
        # per layer): taken on CPU, where it saves the [B, H, T, D] work; accelerators keep
        # the sync-free folds.
        if latent or using_reference_kernels() or state.keys.device.type != "cpu":
            k, v, counts = merge_tokens(
                state.keys,
                state.values,
                plan,
                scores,
                mask,
                rescale=self.merge_rescale,
                latent=latent,
            )
            seg = gather_segment(k, v, counts, plan, state.inp.positions, state.modality_ids)
        else:  # the same segment, without [B, H, T, D] work (compress/kernels.py)
            seg = merge_gather_segment(
                state.keys,
                state.values,
                plan,
                scores,
                mask,
                state.inp.positions,
                state.modality_ids,
                rescale=self.merge_rescale,
            )
        if latent:
            seg.values, seg.latent = seg.keys[..., : v.shape[-1]], True
        seg.head_groups = state.head_groups
        state.plan = plan
        state.segment = seg
        return state
