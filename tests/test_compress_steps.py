"""UniCache steps one by one: each method's own definition, its pitfalls and its config."""

from __future__ import annotations

import math

import pytest
import torch

from unicache_train.compress import (
    ComposedCompressor,
    HeadMerge,
    Quantize,
    UniCacheCompressor,
    UniCacheConfig,
    presets,
)
from unicache_train.compress import fallback as fallback_mod
from unicache_train.compress.budget import allocate_rates, modality_density
from unicache_train.compress.config import (
    BudgetConfig,
    FallbackConfig,
    HeadMergeConfig,
    ImportanceConfig,
    MergeEvictConfig,
    ProtectConfig,
    QuantizeConfig,
    ScheduleConfig,
)
from unicache_train.compress.fallback import DynamicFallback, fallback_rate
from unicache_train.compress.grouped import grouped_rank
from unicache_train.compress.head_merge import cluster_heads, compact_heads, query_head_groups
from unicache_train.compress.importance import layer_weights, normalize_attention
from unicache_train.compress.merge_evict import plan_tokens
from unicache_train.compress.neighbours import NeighbourSims, neighbour_offsets
from unicache_train.compress.quantize import quantize_symmetric
from unicache_train.compress.schedule import cosine_curve, layer_rate
from unicache_train.compress.state import CompressionState
from unicache_train.compress.testing import check_segment, make_input
from unicache_train.compress.window import window_stats
from unicache_train.seam import dequantize, pack_int4, segment_kv_bytes, unpack_int4
from unicache_train.validation import ConfigError

NOQ = QuantizeConfig(bits=None)


# ------------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("L", [1, 2, 3, 4, 7, 12, 32, 80])
def test_layer_rates_are_smooth_and_hit_the_source_values(L: int) -> None:
    rates = torch.stack([layer_rate(l, L, 0.6) for l in range(L)])
    assert float(rates.mean()) == pytest.approx(0.6, abs=1e-6)
    if L == 1:
        assert float(rates[0]) == pytest.approx(0.6)
        return
    assert float(rates[0]) == pytest.approx(0.75) and float(rates[-1]) == pytest.approx(0.45)
    if L % 2:
        assert float(rates[L // 2]) == pytest.approx(0.60)
    diffs = rates[1:] - rates[:-1]
    assert (diffs <= 1e-7).all()  # shallow -> deep never increases
    bound = 0.30 * math.pi / (2 * (L - 1))  # max slope of the half cosine
    assert diffs.abs().max() <= bound + 1e-6
    # The pitfall: hard thirds (0.75 / 0.60 / 0.45) jump by 0.15 at a boundary.
    if L >= 7:
        steps = [0.75 if 3 * l < L else 0.45 if 3 * l >= 2 * L else 0.60 for l in range(L)]
        assert max(abs(a - b) for a, b in zip(steps, steps[1:])) > bound


def test_layer_rate_scales_to_target_per_sample() -> None:
    target = torch.tensor([0.3, 0.6, 0.9])
    r0 = layer_rate(0, 8, target)
    torch.testing.assert_close(r0, torch.tensor([0.375, 0.75, 0.95]))  # clipped at MAX_RATE
    assert cosine_curve(3, 0.75, 0.45) == pytest.approx([0.75, 0.60, 0.45])


# --------------------------------------------------------------------------------- budget
def test_budget_inverse_density_weighted_mean_and_caps() -> None:
    counts = torch.tensor([[40, 160, 0], [40, 160, 50]])
    rho = torch.tensor([[1.0, 0.5, 1.0], [1.0, 0.5, 0.8]])
    R = torch.tensor([0.5, 0.5])
    rates = allocate_rates(R, counts, rho, caps=(0.95, 0.95, 0.95))
    # R_m proportional to 1/rho_m, token-weighted mean = R.
    assert float(rates[0, 1] / rates[0, 0]) == pytest.approx(2.0)
    assert float(rates[1, 2] / rates[1, 0]) == pytest.approx(1.25)
    n = counts.float()
    torch.testing.assert_close((rates * n).sum(1) / n.sum(1), R)
    assert float(rates[0, 2]) == 0.0  # absent modality
    # Caps bind: vision clipped to 0.8, the excess moves to text (still under its cap).
    capped = allocate_rates(
        torch.tensor([0.75]), counts[:1], torch.tensor([[1.0, 0.2, 1.0]]), caps=(0.40, 0.80, 0.60)
    )
    assert float(capped[0, 1]) == pytest.approx(0.80)
    assert float(capped[0, 0]) == pytest.approx(min(0.40, (0.75 * 200 - 0.8 * 160) / 40))
    # Everything capped: the caps win over the target.
    short = allocate_rates(
        torch.tensor([0.9]), counts[:1], torch.ones(1, 3), caps=(0.40, 0.80, 0.60)
    )
    torch.testing.assert_close(short[0, :2], torch.tensor([0.40, 0.80]))


def test_budget_fixed_rates_follow_layer_and_rest_shares() -> None:
    counts = torch.tensor([[50, 150, 0]])
    rates = allocate_rates(
        torch.tensor([0.6]),
        counts,
        torch.ones(1, 3),
        (0.4, 0.8, 0.6),
        fixed=(math.nan, 0.7, math.nan),
        fixed_scale=torch.tensor([1.0]),
    )
    assert float(rates[0, 1]) == pytest.approx(0.7)
    assert float(rates[0, 0]) == pytest.approx((0.6 * 200 - 0.7 * 150) / 50)


def test_density_more_similar_means_less_dense() -> None:
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 2, 40, 16
    k = torch.randn(B, H, T, D, generator=g)
    mod = torch.zeros(B, T, dtype=torch.long)
    mod[:, 20:] = 1
    k[:, :, 20:] = k[:, :, 20:21] + 0.05 * torch.randn(B, H, 20, D, generator=g)  # redundant
    rho = modality_density(k, k, mod, torch.ones(B, T, dtype=torch.bool))
    assert float(rho[0, 0]) == pytest.approx(1.0, abs=0.15)  # random: ~orthogonal
    assert float(rho[0, 1]) < 0.1  # near-identical vision tokens
    assert float(rho[0, 2]) == 1.0  # absent


# ------------------------------------------------------------------------------ head merge
def test_cluster_heads_complete_linkage() -> None:
    sim = torch.tensor(
        [
            [1.0, 0.90, 0.50, 0.10],
            [0.90, 1.0, 0.90, 0.10],
            [0.50, 0.90, 1.0, 0.10],
            [0.10, 0.10, 0.10, 1.0],
        ]
    )[None]
    # 2 is close to 1 but not to 0: it may not join {0, 1}.
    assert cluster_heads(sim, 0.88).tolist() == [[0, 0, 2, 3]]
    assert cluster_heads(sim, 0.92).tolist() == [[0, 1, 2, 3]]
    assert cluster_heads(sim, 0.90).tolist() == [[0, 1, 2, 3]]  # strictly above


def test_head_merge_keeps_indices_consistent() -> None:
    """Twin heads 0/1 merge; the attention view, the compact storage with its query-head map,
    the head-group ids and the byte count all agree."""
    inp = make_input(H=4, rep=2, twin_heads=True)
    cfg = UniCacheConfig(quantize=NOQ)
    state = UniCacheCompressor(cfg).run(inp)
    seg = state.segment
    assert seg.head_groups.tolist() == [[0, 0, 2, 3]] * 3
    assert float(seg.stats["heads_merged"]) == 1.0
    compact, slot = compact_heads(seg.keys, seg.head_groups)
    vcompact, _ = compact_heads(seg.values, seg.head_groups)
    assert compact.shape[1] == 3
    qmap = query_head_groups(slot, num_query_heads=8)  # [B, Hq]
    B, Hq, M, D = seg.keys.shape[0], 8, seg.keys.shape[2], seg.keys.shape[3]
    q = torch.randn(B, Hq, 5, D)
    full = torch.nn.functional.scaled_dot_product_attention(
        q,
        seg.keys.repeat_interleave(2, 1),
        seg.values.repeat_interleave(2, 1),
        attn_mask=seg.valid[:, None, None, :],
    )
    gather = qmap[:, :, None, None].expand(B, Hq, M, D)
    kc, vc = compact.gather(1, gather), vcompact.gather(1, gather)
    small = torch.nn.functional.scaled_dot_product_attention(
        q, kc, vc, attn_mask=seg.valid[:, None, None, :]
    )
    torch.testing.assert_close(small, full)
    # Bytes: 3 stored heads of 4.
    unmerged = (
        UniCacheCompressor(
            UniCacheConfig.from_dict({"quantize": {"bits": None}, "head_merge": {"enabled": False}})
        )
        .run(inp)
        .segment
    )
    n_m, n_u = seg.valid.sum(), unmerged.valid.sum()
    ratio = segment_kv_bytes(seg).sum() / segment_kv_bytes(unmerged).sum()
    assert float(ratio) == pytest.approx(3 / 4 * float(n_m) / float(n_u))
    # Token statistics were recomputed on the merged heads (masks/indices follow the change).
    assert state.keys is not inp.keys and torch.equal(state.keys[:, 0], state.keys[:, 1])


def test_head_merge_curriculum_threshold() -> None:
    inp = make_input(H=3, twin_heads=True)
    state = CompressionState.from_input(inp, 0.6, rate_scale=0.0)
    HeadMerge()(state)
    assert state.keys is inp.keys  # rate_scale 0: threshold 1, nothing merges
    state = CompressionState.from_input(inp, 0.6, rate_scale=1.0)
    HeadMerge()(state)
    assert state.head_groups[:, 1].eq(0).all()


# ------------------------------------------------------------------------------ importance
def test_attention_normalized_within_modality_not_globally() -> None:
    # Text tokens get high raw attention, vision tokens diluted low attention.
    attn = torch.tensor([[0.30, 0.20, 0.10, 0.010, 0.020, 0.015, 0.005]])
    mod = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    mask = torch.ones_like(mod, dtype=torch.bool)
    per_mod = normalize_attention(attn, mod, mask, "modality")
    glob = normalize_attention(attn, mod, mask, "global")
    assert float(per_mod[0, 4]) == 1.0 and float(per_mod[0, 0]) == 1.0  # best of each modality
    assert float(glob[0, 4]) < float(glob[0, 2])  # globally, every text token beats it
    assert (glob[0, 3:] <= 0.5).all()  # the whole modality sits in the bottom half


def test_layer_dependent_weights() -> None:
    cfg = ImportanceConfig()
    assert layer_weights(cfg, 0, 6) == (0.4, 0.3, 0.3, 0.1)  # shallow third: w_d 0.3
    assert layer_weights(cfg, 2, 6) == (0.4, 0.3, 0.2, 0.1)  # middle
    assert layer_weights(cfg, 5, 6) == (0.5, 0.3, 0.2, 0.1)  # deep third: w_a 0.5


def test_window_stats_match_brute_force_attention() -> None:
    inp = make_input(T=30, splits=(12, 25, 30), H=2, rep=2)
    W = 8
    ws = window_stats(inp.queries, inp.keys, inp.modality_ids, inp.context_mask, W)
    B, Hq, T, D = inp.queries.shape
    k = inp.keys.repeat_interleave(2, 1)
    for b in range(B):
        L = int(inp.context_mask[b].sum())
        logits = inp.queries[b] @ k[b].transpose(-1, -2) / math.sqrt(D)  # [Hq, T, T] (test only)
        causal = torch.ones(T, T).tril().bool() & inp.context_mask[b][None, :]
        A = logits.masked_fill(~causal, float("-inf")).softmax(-1).mean(0)  # [T, T]
        rows = list(range(max(0, L - W), L))
        torch.testing.assert_close(ws.attn[b, :L], A[rows, :L].sum(0), rtol=1e-4, atol=1e-5)
        assert (ws.attn[b, L:] == 0).all()
        mod = inp.modality_ids[b]
        for t in rows:  # "to" share of window tokens is a lower bound of cross
            to_share = A[t, :L][mod[:L] != mod[t]].sum()
            assert float(ws.cross[b, t]) >= float(to_share) - 1e-5


def test_grouped_rank_matches_brute_force() -> None:
    g = torch.Generator().manual_seed(3)
    key = torch.randn(2, 20, generator=g)
    grp = torch.randint(0, 3, (2, 20), generator=g)
    valid = torch.rand(2, 20, generator=g) > 0.2
    rank = grouped_rank(key, grp, valid, 3)
    for b in range(2):
        for t in range(20):
            if not valid[b, t]:
                assert rank[b, t] == 20
                continue
            same = valid[b] & (grp[b] == grp[b, t])
            assert int(rank[b, t]) == int((same & (key[b] < key[b, t])).sum())


# ---------------------------------------------------------------- protection and execution
def _sims(T: int, pairs: dict[tuple[int, int], float]) -> NeighbourSims:
    offsets = neighbour_offsets(4)
    sims = torch.full((1, T, len(offsets)), float("-inf"))
    valid = torch.zeros(1, T, len(offsets), dtype=torch.bool)
    for i, o in enumerate(offsets):
        for t in range(T):
            if 0 <= t + o < T:
                s = pairs.get((min(t, t + o), max(t, t + o)), 0.0)
                sims[0, t, i], valid[0, t, i] = s, True
    return NeighbourSims(offsets, sims, valid)


def test_protected_tokens_never_evicted_even_when_stranded() -> None:
    """Two protected twins (only similar to each other) are both picked by the quota: neither
    has a kept neighbour, so they stay and unprotected tokens go instead; budget still met."""
    T = 12
    neigh = _sims(T, {(2, 3): 0.95, (6, 7): 0.9})
    protected = torch.zeros(1, T, dtype=torch.bool)
    protected[0, [2, 3]] = True
    scores = torch.linspace(-0.2, 0.8, T)[None]
    scores[0, [2, 3]] = -1.0  # least important: first in line
    mask = torch.ones(1, T, dtype=torch.bool)
    mod = torch.zeros(1, T, dtype=torch.long)
    rates = torch.tensor([[0.5, 0.0, 0.0]])
    plan = plan_tokens(scores, neigh, mod, mask, rates, protected, discount=1.0)
    assert not (plan.evicted & protected).any()
    removed = int((plan.merged | plan.evicted).sum())
    assert removed == 6 and int(plan.shortfall.sum()) == 0
    # Protected tokens that can merge do (into their kept twin), never evicted.
    protected[0, 6] = True
    plan = plan_tokens(scores, neigh, mod, mask, rates, protected, discount=1.0)
    assert not (plan.evicted & protected).any()


def test_plan_tiers_merge_then_evict_band_then_rest() -> None:
    T = 10
    neigh = _sims(T, {(0, 1): 0.95, (4, 5): 0.6})
    scores = torch.zeros(1, T)
    mask = torch.ones(1, T, dtype=torch.bool)
    mod = torch.zeros(1, T, dtype=torch.long)
    none = torch.zeros(1, T, dtype=torch.bool)
    plan = plan_tokens(scores, neigh, mod, mask, torch.tensor([[0.2, 0, 0]]), none, 1.0)
    # 2 removals: the redundant pair goes first (one merges into the other, as tier 0), then
    # the evict band.
    assert int(plan.merged.sum()) == 1 and bool(plan.merged[0, :2].any())
    assert int(plan.evicted.sum()) == 1 and bool(plan.evicted[0, 4:6].any())


def test_gradients_reach_merged_tokens() -> None:
    inp = make_input(requires_grad=True)
    state = UniCacheCompressor(UniCacheConfig(quantize=QuantizeConfig(bits=8))).run(inp)
    seg, plan = state.segment, state.plan
    assert plan.merged.any()
    loss = (seg.keys * seg.valid[:, None, :, None]).square().sum() + seg.values.square().sum()
    gk, gv = torch.autograd.grad(loss, (inp.keys, inp.values))
    merged = plan.merged[:, None, :, None].expand_as(gk)
    assert torch.isfinite(gk).all() and torch.isfinite(gv).all()
    # every merged token receives gradient in K and in V (through the merge and the STE)
    assert (gk.abs().sum(-1)[merged[..., 0]] > 0).all()
    assert (gv.abs().sum(-1)[merged[..., 0]] > 0).all()
    evicted = plan.evicted[:, None, :].expand_as(gk[..., 0])
    assert (gk.abs().sum(-1)[evicted] == 0).all()


def test_long_video_merges_same_patch_across_frames() -> None:
    """Frames of 8 patches: patch p of frame f equals patch p of frame f-1, neighbours within a
    frame are unrelated. Only the frame-stride neighbours find the redundancy."""
    g = torch.Generator().manual_seed(0)
    B, H, P, F, D = 1, 2, 8, 5, 16
    T = 2 + P * F
    frame = torch.randn(B, H, P, D, generator=g)
    keys = torch.randn(B, H, T, D, generator=g)
    keys[:, :, 2:] = frame.repeat(1, 1, F, 1) + 0.01 * torch.randn(B, H, P * F, D, generator=g)
    inp = make_input(B=1, H=2, T=T, splits=(T,))
    inp.keys, inp.values = keys, keys.clone()
    inp.modality_ids = torch.ones(1, T, dtype=torch.long)
    inp.modality_ids[:, :2] = 0
    base = UniCacheCompressor(UniCacheConfig(quantize=NOQ)).run(inp)
    video = UniCacheCompressor(presets.long_video(patches_per_frame=P)).run(inp)
    check_segment(inp, video.segment)
    assert float(video.segment.stats["merged_fraction"]) > 0.5
    assert float(base.segment.stats["merged_fraction"]) == 0.0


# ------------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("granularity", ["token_head", "head", "channel"])
@pytest.mark.parametrize("bits", [8, 4])
def test_per_head_scales_isolate_a_loud_head(bits: int, granularity: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 16, 8, generator=g)
    valid = torch.ones(2, 16, dtype=torch.bool)
    loud = x.clone()
    loud[:, 0] *= 100.0
    q_alone, _, _ = quantize_symmetric(x, valid, bits, granularity)
    q_loud, _, _ = quantize_symmetric(loud, valid, bits, granularity)
    # Head 1 is quantized exactly as if head 0 were quiet.
    assert torch.equal(q_loud[:, 1], q_alone[:, 1])
    qmax = 2 ** (bits - 1) - 1
    amax = {
        "token_head": lambda: x[:, 1].abs().amax(-1, keepdim=True),
        "channel": lambda: x[:, 1].abs().amax(-2, keepdim=True),
        "head": lambda: x[:, 1].abs().amax(dim=(-2, -1), keepdim=True),
    }[granularity]()
    err = (q_loud[:, 1] - x[:, 1]).abs()
    assert (err <= amax / qmax * 0.5 * (1 + 1e-2) + 1e-3).all()
    # A global scale (the pitfall) would wipe head 1 out.
    s_glob = loud.abs().max() / qmax
    glob = (loud[:, 1] / s_glob).round().clamp(-qmax, qmax) * s_glob
    assert (glob - x[:, 1]).abs().mean() > 5 * err.mean()


@pytest.mark.parametrize("bits", [8, 4])
def test_channel_scales_keep_quiet_features_that_a_vector_scale_rounds_away(bits: int) -> None:
    """Features 100x apart (an MLA latent from a PCA conversion: leading directions ~10x the
    median): with ``channel`` every feature's error is within half its own step, where one scale
    per vector rounds the quiet features to zero at int4."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 32, 16, generator=g)
    x[..., :2] *= 100.0  # two loud features
    valid = torch.ones(2, 32, dtype=torch.bool)
    valid[1, 20:] = False  # padding: excluded from the channel maxima
    loud = x.clone()
    loud[1, :, 20:] = 1e4  # what padding holds must not matter
    xq, q, scale = quantize_symmetric(loud, valid, bits, "channel")
    assert scale.shape == (2, 1, 16)
    qmax = 2 ** (bits - 1) - 1
    vm = valid[:, None, :, None]
    step = (x * vm).abs().amax(-2, keepdim=True) / qmax  # [B, 1, 1, D]
    err = ((xq - x) * vm).abs()
    assert bool((err <= step / 2 * (1 + 1e-2) + 1e-6).all())
    assert bool((xq * ~vm == 0).all())
    per_vector, _, _ = quantize_symmetric(x, valid, bits, "token_head")
    quiet = (slice(None), slice(None), slice(None), slice(2, None))
    assert float(((per_vector - x) * vm)[quiet].abs().mean()) > 3 * float(err[quiet].mean())


def test_int4_pack_roundtrip_and_storage_matches_attention_view() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-7, 8, (2, 3, 5, 7), generator=g, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 4
    assert torch.equal(unpack_int4(packed, 7), q)
    inp = make_input()
    for bits, gran in ((4, "token_head"), (8, "head"), (4, "channel")):
        cfg = UniCacheConfig(quantize=QuantizeConfig(bits=bits, granularity=gran))
        seg = UniCacheCompressor(cfg)(inp)
        k, v = dequantize(seg.quant)
        vm = seg.valid[:, None, :, None]
        torch.testing.assert_close(k * vm, seg.keys * vm)
        torch.testing.assert_close(v * vm, seg.values * vm)
        D, H = inp.keys.shape[-1], inp.keys.shape[1]
        n = seg.valid.sum(1).double()
        if gran == "channel":
            want = 2 * H * n * (D // 2) + 2 * H * D * 2 * (n > 0)  # nibbles + fp16 per feature
        elif bits == 4:
            want = 2 * H * n * (D // 2 + 2)  # packed nibbles + one fp16 scale per vector
        else:
            want = 2 * H * n * D + 2 * H * 2 * (n > 0)  # int8 + one fp16 scale per head
        torch.testing.assert_close(segment_kv_bytes(seg), want)
        base = 2 * H * D * 2 * inp.context_mask.sum()
        assert float(seg.stats["kv_reduction"]) == pytest.approx(float(base / want.sum()))


def test_quantize_is_last_and_fallback_is_first() -> None:
    with pytest.raises(ValueError, match="out of order"):
        ComposedCompressor([Quantize(), HeadMerge()])
    with pytest.raises(ValueError, match="out of order"):
        ComposedCompressor([HeadMerge(), DynamicFallback(enabled=True)])


# ------------------------------------------------------------------------------- fallback
def test_fallback_rate_mapping() -> None:
    c = torch.tensor([0.0, 8.0, 12.0, 16.0, 30.0])
    r = fallback_rate(c)
    torch.testing.assert_close(r, torch.tensor([0.75, 0.75, 0.575, 0.40, 0.40]))
    assert (r[1:] <= r[:-1]).all()


def test_fallback_uses_the_uncompressed_input(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    real = fallback_mod.complexity

    def spy(inp, *args, **kwargs):
        seen.append((inp, inp.keys.clone()))
        return real(inp, *args, **kwargs)

    monkeypatch.setattr(fallback_mod, "complexity", spy)
    inp = make_input(H=3, twin_heads=True)
    cfg = UniCacheConfig.from_dict({"fallback": {"enabled": True}, "quantize": {"bits": None}})
    state = UniCacheCompressor(cfg).run(inp)
    assert len(seen) == 1
    got, keys_seen = seen[0]
    assert got is inp and torch.equal(keys_seen, inp.keys)
    assert not torch.equal(keys_seen[:, 1], keys_seen[:, 0])  # raw heads, not merged ones
    assert torch.equal(state.keys[:, 1], state.keys[:, 0])  # ... the pipeline did merge them
    # Its complexity counts every context token of the input, not the segment's entries.
    ctx = inp.context_mask
    text = (ctx & (inp.modality_ids == 0)).sum(1).float()
    other = (ctx & (inp.modality_ids != 0)).sum(1).float()
    assert (state.complexity >= text.log() + other.log() - 1e-5).all()
    assert (state.segment.valid.sum(1) < ctx.sum(1)).all()
    torch.testing.assert_close(state.target, fallback_rate(state.complexity))
    # Running it on an already compressed state is refused.
    late = CompressionState.from_input(inp, 0.6)
    late.keys = late.keys * 1.0
    with pytest.raises(RuntimeError, match="uncompressed"):
        DynamicFallback(enabled=True)(late)


# -------------------------------------------------------------------------------- configs
@pytest.mark.parametrize(
    ("cls", "field", "value", "allowed"),
    [
        (HeadMergeConfig, "threshold", 0.5, "[0.85, 0.92]"),
        (ImportanceConfig, "neighbours", 2, "[4, 8]"),
        (ImportanceConfig, "w_a", 1.5, "[0.0, 1.0]"),
        (ImportanceConfig, "normalize", "none", "['modality', 'global']"),
        (ScheduleConfig, "shallow_rate", 1.2, "[0.0, 0.95]"),
        (BudgetConfig, "vision_cap", -0.1, "[0.0, 0.95]"),
        (BudgetConfig, "text_rate", 0.5, "[0.0, 0.4]"),
        (ProtectConfig, "threshold", 2.0, "[0.0, 1.0]"),
        (ProtectConfig, "discount", -1.0, "[0.0, 1.0]"),
        (MergeEvictConfig, "merge_threshold", 0.3, "[0.5, 1.0]"),
        (MergeEvictConfig, "evict_threshold", 0.9, "[0.0, 0.8]"),
        (QuantizeConfig, "bits", 3, "[4, 8, 16, None]"),
        (
            QuantizeConfig,
            "granularity",
            "tensor",
            "['token_head', 'head', 'channel', 'channel_group']",
        ),
        (FallbackConfig, "lambda_align", -2.0, "[0.0, 10.0]"),
        (FallbackConfig, "max_rate", 0.3, "[0.4, 0.95]"),
        (UniCacheConfig, "target_rate", 0.99, "[0.0, 0.95]"),
        (UniCacheConfig, "rate_scale", 1.5, "[0.0, 1.0]"),
    ],
)
def test_bad_config_values_name_field_value_and_range(cls, field, value, allowed) -> None:
    with pytest.raises(ConfigError) as err:
        cls(**{field: value})
    msg = str(err.value)
    assert f"{cls.__name__}.{field}={value!r}" in msg and allowed in msg


def test_config_roundtrip_unknown_keys_and_presets() -> None:
    cfg = UniCacheConfig.from_dict({"head_merge": {"threshold": 0.9}, "rate_scale": 0.5})
    assert cfg.head_merge.threshold == 0.9
    assert UniCacheConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown field"):
        UniCacheConfig.from_dict({"quantise": {}})
    with pytest.raises(ConfigError, match="unknown field"):
        UniCacheConfig.from_dict({"quantize": {"bitz": 8}})
    assert presets.realtime().head_merge.threshold == 0.85
    assert presets.realtime().target_rate == pytest.approx(0.55)
    assert presets.dense_doc_qa().protect.discount == 0.4
    assert 0.15 <= presets.dense_doc_qa().budget.text_rate <= 0.2
    assert 0.75 <= presets.long_video().budget.vision_rate <= 0.8
    base = presets.text_style_baseline()
    assert base.importance.normalize == "global"
    assert not base.budget.enabled and not base.protect.enabled
    for name in presets.PRESETS:
        assert isinstance(presets.preset(name), UniCacheConfig)
    with pytest.raises(KeyError):
        presets.preset("nope")
