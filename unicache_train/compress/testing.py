"""Synthetic inputs and invariant checks for KV compressors.

The shared test matrix (``tests/test_compress*.py``) runs these checks on every method x
wrapper; a new compression step should pass them too. No pytest dependency.
"""

from __future__ import annotations

import torch

from unicache_train.compress.config import MergeEvictConfig
from unicache_train.compress.state import CompressionState
from unicache_train.seam import NUM_MODALITIES, CompressionInput, KVSegment

__all__ = [
    "make_input",
    "check_segment",
    "check_budget",
    "check_protected_kept",
    "check_kv_paired",
    "expected_rel_error",
]


def make_input(
    B: int = 3,
    H: int = 2,
    rep: int = 2,
    T: int = 56,
    D: int = 16,
    splits: tuple[int, ...] = (21, 40, 56),
    layer_idx: int = 0,
    num_layers: int = 4,
    seed: int = 0,
    twin_heads: bool = False,
    requires_grad: bool = False,
) -> CompressionInput:
    """A multimodal context with redundant runs: [text 6][vision 26][audio 10][text ...].

    Vision and audio tokens come in runs of 3-4 near-identical *keys* with independent values,
    so merging happens and a K-only merge would leave detectable values. ``twin_heads`` makes KV
    head 1 a near copy of head 0 (K and V), so head merging triggers.
    """
    g = torch.Generator().manual_seed(seed)
    mod = torch.zeros(T, dtype=torch.long)
    mod[6:32], mod[32:42] = 1, 2
    keys = torch.randn(B, H, T, D, generator=g)
    values = torch.randn(B, H, T, D, generator=g)
    base = torch.randn(B, H, T, D, generator=g)
    run_id = torch.arange(T) // 4  # runs of 4 tokens share a base key
    noise = 0.08 * torch.randn(B, H, T, D, generator=g)
    redundant = mod != 0
    keys = torch.where(redundant[None, None, :, None], base[:, :, run_id] * 2.0 + noise, keys)
    if twin_heads and H > 1:
        keys[:, 1] = keys[:, 0] + 0.01 * torch.randn(B, T, D, generator=g)
        values[:, 1] = values[:, 0] + 0.01 * torch.randn(B, T, D, generator=g)
    queries = torch.randn(B, H * rep, T, D, generator=g)
    # A few text queries look hard at one vision token: cross-modal alignment.
    queries[:, :, -8:] += 3.0 * keys[:, :, 12:13].repeat_interleave(rep, 1)
    split = torch.tensor(splits[:B])
    context_mask = torch.arange(T)[None, :] < split[:, None]
    positions = torch.arange(T).expand(B, T) + torch.arange(B)[:, None] * 7  # per-sample shift
    if requires_grad:
        keys.requires_grad_(True)
        values.requires_grad_(True)
    return CompressionInput(
        layer_idx=layer_idx,
        num_layers=num_layers,
        queries=queries,
        keys=keys,
        values=values,
        positions=positions.clone(),
        modality_ids=mod.expand(B, T).clone(),
        context_mask=context_mask,
    )


def check_segment(inp: CompressionInput, seg: KVSegment) -> None:
    """Structural invariants every compressor output satisfies."""
    B, H, T, D = inp.keys.shape
    M = seg.keys.shape[2]
    assert seg.keys.shape == (B, H, M, D)
    assert seg.values.shape == (B, H, M, inp.values.shape[-1])
    for name in ("positions", "modality_ids", "counts", "valid"):
        assert getattr(seg, name).shape == (B, M), name
    assert seg.valid.dtype == torch.bool
    v = seg.valid
    assert torch.isfinite(
        seg.keys[v.nonzero(as_tuple=True)[0], :, v.nonzero(as_tuple=True)[1]]
    ).all()
    n_ctx = inp.context_mask.sum(1)
    assert (v.sum(1) <= n_ctx).all()
    assert (seg.counts[v] >= 1).all()
    assert (torch.where(v, seg.counts, 0).sum(1) <= n_ctx.to(seg.counts.dtype) + 1e-6).all()
    for b in range(B):
        ctx_pos = set(inp.positions[b][inp.context_mask[b]].tolist())
        pos = seg.positions[b][v[b]].tolist()
        assert set(pos) <= ctx_pos, "an entry carries a position outside the context"
        assert len(set(pos)) == len(pos), "two entries share a position"
        # Entry modality = modality of the token at its position.
        tok = {p: m for p, m in zip(inp.positions[b].tolist(), inp.modality_ids[b].tolist())}
        assert all(tok[p] == m for p, m in zip(pos, seg.modality_ids[b][v[b]].tolist()))
    if seg.assignment is not None:
        a = seg.assignment
        assert a.shape == (B, T)
        assert (a[~inp.context_mask] == -1).all()
        for b in range(B):
            ids = a[b][a[b] >= 0]
            assert (ids < v[b].sum()).all()
            per_entry = torch.bincount(ids, minlength=M)[: int(v[b].sum())]
            assert torch.equal(per_entry.to(seg.counts.dtype), seg.counts[b][v[b]])
            # merged tokens stay inside their modality
            assert torch.equal(inp.modality_ids[b][a[b] >= 0], seg.modality_ids[b][ids])


def check_budget(state: CompressionState) -> None:
    """Emitted entries per (sample, modality) match the requested budget within one token.

    The budget is ``n - R_m * (u + discount * p)`` entries (u unprotected, p protected tokens),
    at least one. It may fall short only where protection forbids it: then every unprotected
    token of that modality is already gone.
    """
    inp, seg = state.inp, state.segment
    assert seg is not None and state.modality_rates is not None
    prot = state.protected if state.protected is not None else torch.zeros_like(inp.context_mask)
    for b in range(inp.keys.shape[0]):
        for m in range(NUM_MODALITIES):
            in_m = inp.context_mask[b] & (inp.modality_ids[b] == m)
            n = int(in_m.sum())
            if n == 0:
                continue
            p = int((in_m & prot[b]).sum())
            R = float(state.modality_rates[b, m])
            want = max(n - R * ((n - p) + state.discount * p), 1.0)  # never emptied
            got = int((seg.valid[b] & (seg.modality_ids[b] == m)).sum())
            if got > want + 1.0 + 1e-6:
                # Allowed only when nothing unprotected is left that could go: every remaining
                # unprotected entry holds a merged protected token, or is the last one.
                assert seg.assignment is not None
                a = seg.assignment[b]
                holds_protected = set(a[prot[b] & (a >= 0)].tolist())
                pos_to_entry = {
                    int(q): e
                    for e, q in enumerate(seg.positions[b].tolist())
                    if bool(seg.valid[b, e])
                }
                movable = [
                    t
                    for t in torch.nonzero(in_m & ~prot[b]).flatten().tolist()
                    if pos_to_entry.get(int(inp.positions[b, t])) not in (None, *holds_protected)
                ]
                assert not movable or got == 1, (
                    f"sample {b} modality {m}: {got} entries for a budget of {want:.1f} while "
                    f"unprotected tokens {movable} could still be removed"
                )
                continue
            assert abs(got - want) <= 1.0 + 1e-6, (b, m, got, want, R, n, p)


def check_protected_kept(state: CompressionState) -> None:
    """No alignment token is evicted (it is kept or merged into a kept neighbour)."""
    if state.protected is None or state.segment is None or state.segment.assignment is None:
        return
    evicted = state.inp.context_mask & (state.segment.assignment == -1)
    assert not (evicted & state.protected).any()


def check_kv_paired(state: CompressionState, rescale: str | None = None) -> int:
    """Every merged entry's K *and* V are the same importance-weighted average of the same
    member tokens, rescaled to the members' mean norm where the rule says so (a K-only merge
    leaves V at the anchor's value and fails). Whether a merged entry stands for its members
    in attention is checked independently of this formula in ``tests/test_merge_rule.py``.

    Args:
        state: a compressor state with a segment and its ``assignment``.
        rescale: the ``MergeEvictConfig.merge_rescale`` rule the segment was built with
            (None: the default rule).

    Returns:
        the number of merged entries checked.
    """
    rule = MergeEvictConfig().merge_rescale if rescale is None else rescale
    rescaled = {"k": (True, False), "kv": (True, True), "none": (False, False)}[rule]
    seg = state.segment
    assert seg is not None and seg.assignment is not None
    scores = (
        state.scores
        if state.scores is not None
        else torch.zeros_like(seg.assignment, dtype=torch.float32)
    )
    B = seg.keys.shape[0]
    checked = 0
    for b in range(B):
        ctx = state.inp.context_mask[b]
        s = scores[b].float()
        s = s - s[ctx].max() if ctx.any() else s
        for e in torch.nonzero(seg.valid[b] & (seg.counts[b] > 1)).flatten().tolist():
            members = torch.nonzero(seg.assignment[b] == e).flatten()
            w = s[members].exp()
            pairs = ((state.keys, seg.keys), (state.values, seg.values))
            for (src, out), to_norm in zip(pairs, rescaled):
                x = src[b][:, members].float()  # [H, n, D]
                mean = (w[None, :, None] * x).sum(1) / w.sum()
                norm = (w[None, :] * x.norm(dim=-1)).sum(1) / w.sum()
                ref = mean / mean.norm(dim=-1, keepdim=True) * norm[:, None] if to_norm else mean
                torch.testing.assert_close(out[b, :, e].float(), ref, rtol=1e-4, atol=1e-4)
            checked += 1
    return checked


def expected_rel_error(bits: int) -> float:
    """Worst relative error of symmetric quantization of a vector w.r.t. its max."""
    return 0.5 / (2 ** (bits - 1) - 1) + 1e-3
