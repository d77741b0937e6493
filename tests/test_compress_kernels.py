"""The compressor's fast kernels against their references (issue 20: in-loop overhead).

UniCache: the fast window statistics and the fused merge + gather give bit for bit the
reference's segment and gradients (``unicache_train/compress/kernels.py``). xKV: the Gram and
randomized factorisations span the SVD's subspace (``XKVConfig.factorization``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unicache_train.compress import UniCacheCompressor, UniCacheConfig
from unicache_train.compress.config import XKVConfig
from unicache_train.compress.kernels import reference_kernels, using_reference_kernels
from unicache_train.compress.merge_evict import gather_segment, merge_gather_segment, merge_tokens
from unicache_train.compress.testing import make_input
from unicache_train.compress.window import window_stats
from unicache_train.compress.xkv import gram_basis, lowrank_basis, svd_basis
from unicache_train.validation import ConfigError

# make_input's budgets fall short of the default target rate (caps, protection): not tested here
pytestmark = pytest.mark.filterwarnings(
    "ignore::unicache_train.compress.composer.RateShortfallWarning"
)


def _inputs():
    """Multimodal inputs with merges, an empty and a one-token context, the seam's layout."""
    yield make_input(seed=0)
    yield make_input(seed=1, twin_heads=True, layer_idx=3)
    yield make_input(B=4, T=40, splits=(0, 1, 40, 17), seed=2)  # empty and 1-token contexts
    inp = make_input(B=3, T=64, D=8, splits=(64, 30, 50), seed=3)
    # The seam's K/V are [B, H, T, D] views of [B, T, H, D] projections.
    k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (inp.keys, inp.values))
    yield dataclasses.replace(inp, keys=k, values=v)


def test_reference_switch_nests_and_restores() -> None:
    assert not using_reference_kernels()
    with reference_kernels():
        assert using_reference_kernels()
        with reference_kernels(False):
            assert not using_reference_kernels()
        assert using_reference_kernels()
    assert not using_reference_kernels()


@pytest.mark.parametrize("window", [4, 32, 100])
def test_window_stats_fast_equals_reference(window: int) -> None:
    for inp in _inputs():
        args = (inp.queries, inp.keys, inp.modality_ids, inp.context_mask, window)
        fast = window_stats(*args)
        with reference_kernels():
            ref = window_stats(*args)
        assert torch.equal(fast.attn, ref.attn) and torch.equal(fast.cross, ref.cross)
        assert torch.isfinite(fast.attn).all() and torch.isfinite(fast.cross).all()


@pytest.mark.parametrize("source", ["keys", "kv"])
def test_neighbour_similarity_fast_equals_reference(source: str) -> None:
    from unicache_train.compress.neighbours import neighbour_offsets, neighbour_similarity

    for inp in _inputs():
        for offsets in (neighbour_offsets(4), neighbour_offsets(2, 8), (1, -3, 5, -1)):
            args = (inp.keys, inp.values, inp.modality_ids, inp.context_mask, offsets, source)
            fast = neighbour_similarity(*args)
            with reference_kernels():
                ref = neighbour_similarity(*args)
            assert torch.equal(fast.sims, ref.sims) and torch.equal(fast.valid, ref.valid)


def _run(cfg: UniCacheConfig, inp, reference: bool) -> tuple[dict, tuple[torch.Tensor, ...]]:
    """The segment's fields and the gradients of K and V (fixed random output weights)."""
    k = inp.keys.detach().clone().requires_grad_(True)
    v = inp.values.detach().clone().requires_grad_(True)
    with reference_kernels(reference):
        seg = UniCacheCompressor(cfg)(dataclasses.replace(inp, keys=k, values=v))
    g = torch.Generator().manual_seed(7)
    wk, wv = torch.randn(seg.keys.shape, generator=g), torch.randn(seg.values.shape, generator=g)
    ((seg.keys * wk).sum() + (seg.values * wv).sum()).backward()
    fields = {
        f: getattr(seg, f)
        for f in ("keys", "values", "positions", "modality_ids", "counts", "valid", "assignment")
    }
    fields.update({f"stat/{n}": s for n, s in seg.stats.items()})
    return fields, (k.grad, v.grad)


@pytest.mark.parametrize("rescale", ["k", "kv", "none"])
@pytest.mark.parametrize("bits", [None, 4])
def test_unicache_segment_and_gradients_are_bit_identical(rescale: str, bits: int | None) -> None:
    d = UniCacheConfig().to_dict()
    d["merge_evict"]["merge_rescale"] = rescale
    d["quantize"]["bits"] = bits
    cfg = UniCacheConfig.from_dict(d)
    merged = 0
    for inp in _inputs():
        fast, fast_g = _run(cfg, inp, False)
        ref, ref_g = _run(cfg, inp, True)
        assert fast.keys() == ref.keys()
        for name in ref:
            assert torch.equal(fast[name], ref[name]), name
        for a, b in zip(fast_g, ref_g):
            assert torch.equal(a, b)
        merged += int((fast["counts"] > 1).sum())
    assert merged > 0  # the merge path ran, not only the no-merge shortcut


def test_merge_gather_equals_merge_then_gather() -> None:
    from unicache_train.compress.merge_evict import TokenPlan

    g = torch.Generator().manual_seed(0)
    B, H, T, D = 3, 2, 12, 4
    keys, values = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, 6, generator=g)
    ctx = torch.arange(T)[None, :] < torch.tensor([12, 7, 0])[:, None]
    t = torch.arange(T).expand(B, T)
    target = torch.where(t % 4 == 1, t - 1, t)  # every fourth token merged into its left one
    target = torch.where(t % 4 == 3, -1, target)  # and one evicted
    target = torch.where(ctx, target, -1)
    kept = ctx & (target == t)
    plan = TokenPlan(
        kept=kept,
        merged=ctx & (target >= 0) & ~kept,
        evicted=ctx & (target < 0),
        target=target,
        requested=torch.zeros(B, 3, dtype=torch.long),
        shortfall=torch.zeros(B, 3, dtype=torch.long),
    )
    scores = torch.randn(B, T, generator=g)
    pos, mod = t + 3, torch.zeros(B, T, dtype=torch.long)
    for rule in ("k", "kv", "none"):
        ref = gather_segment(*merge_tokens(keys, values, plan, scores, ctx, rule), plan, pos, mod)
        fast = merge_gather_segment(keys, values, plan, scores, ctx, pos, mod, rule)
        for f in ("keys", "values", "positions", "modality_ids", "counts", "valid", "assignment"):
            assert torch.equal(getattr(fast, f), getattr(ref, f)), (rule, f)
        assert int((fast.counts > 1).sum()) == 5  # samples 0 and 1 merged tokens
    with pytest.raises(ValueError, match="rescale='v'"):
        merge_gather_segment(keys, values, plan, scores, ctx, pos, mod, "v")


# ------------------------------------------------------------------ xKV factorisations
def _projector(basis: torch.Tensor, r: int) -> torch.Tensor:
    v = basis[..., :r].double()
    return v @ v.mT


@pytest.mark.parametrize("shape", [(3, 40, 16), (3, 12, 32)])  # W <= M, and M < W
def test_gram_basis_spans_the_svd_subspace(shape: tuple[int, int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    B, M, W = shape
    scale = torch.logspace(0, -2, min(M, W))
    x = (torch.randn(B, M, min(M, W), generator=g) * scale) @ torch.randn(min(M, W), W, generator=g)
    valid = torch.ones(B, M, dtype=torch.bool)
    valid[1, M // 2 :] = False  # a ragged sample: zero rows
    ref, s_ref = svd_basis(x, valid, "svd")
    basis, s = svd_basis(x, valid, "gram")
    assert basis.shape == ref.shape and s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, atol=1e-4 * float(s_ref.max()), rtol=1e-3)
    xm = (x * valid[..., None]).double()
    for r in (1, 4):  # within every sample's rank (6 valid rows in sample 1)
        torch.testing.assert_close(_projector(basis, r), _projector(ref, r), atol=2e-4, rtol=0)
    for r in (1, 4, 8, 12):  # beyond a sample's rank the bases differ in its null space only
        rel = (xm @ _projector(basis, r) - xm @ _projector(ref, r)).norm() / xm.norm()
        assert float(rel) < 1e-5, r
    # Full rank: the valid rows come back exactly (to fp32 round-off).
    xm = x * valid[..., None]
    rec = xm @ basis @ basis.mT
    assert float((rec - xm).norm() / xm.norm()) < 1e-5


def test_gram_basis_zeroes_the_null_directions() -> None:
    x = torch.zeros(1, 3, 8)
    x[0, 0, 0], x[0, 1, 1] = 3.0, 2.0  # rank 2 of 3 rows
    basis, s = gram_basis(x)
    assert basis.shape == (1, 8, 3)
    torch.testing.assert_close(s[0], torch.tensor([3.0, 2.0, 0.0]))
    assert torch.equal(basis[0, :, 2], torch.zeros(8))
    assert torch.isfinite(basis).all()


def test_lowrank_basis_is_deterministic_and_leaves_the_global_stream() -> None:
    g = torch.Generator().manual_seed(1)
    B, M, W, r = 2, 60, 24, 4
    # Rank-r signal plus small noise: a clear gap after r.
    x = torch.randn(B, M, r, generator=g) @ torch.randn(r, W, generator=g) * 5
    x = x + 0.01 * torch.randn(B, M, W, generator=g)
    valid = torch.ones(B, M, dtype=torch.bool)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    basis, s = lowrank_basis(x, valid, r + 6)
    assert torch.equal(torch.random.get_rng_state(), before)
    again, _ = lowrank_basis(x, valid, r + 6)
    assert torch.equal(basis, again) and basis.shape == (B, W, r + 6)
    ref, s_ref = svd_basis(x, valid, "svd")
    torch.testing.assert_close(s[:, :r], s_ref[:, :r], rtol=1e-4, atol=0)
    torch.testing.assert_close(_projector(basis, r), _projector(ref, r), atol=1e-4, rtol=0)


def test_factorization_config() -> None:
    assert XKVConfig().factorization == "gram"
    with pytest.raises(ConfigError, match="factorization"):
        XKVConfig(factorization="qr")
    with pytest.raises(ConfigError, match="rank_mode='energy'"):
        XKVConfig(factorization="lowrank", rank_mode="energy")
    with pytest.raises(ValueError, match="lowrank_basis"):
        svd_basis(torch.zeros(1, 2, 2), torch.ones(1, 2, dtype=torch.bool), "lowrank")


@pytest.mark.parametrize("mla", [False, True])
def test_every_factorization_fits_the_same_ranks_in_the_model(mla: bool) -> None:
    """In the model: the same ranks and bytes, the SVD's reconstruction error (Gram: to
    round-off; randomized: within 1%), and the captured energy of the randomized sketch counts
    the whole spectrum (``||X||_F²``), not the sketch's."""
    from unicache_train.compress.xkv import XKVCompressor
    from unicache_train.model import Decoder
    from unicache_train.model.config import ModelConfig

    mla_kw = dict(
        attention_type="mla",
        kv_lora_rank=24,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        **(mla_kw if mla else {}),
    )
    model = Decoder(cfg).eval()
    ids = torch.randint(0, 97, (3, 48), generator=torch.Generator().manual_seed(1))
    split = torch.tensor([40, 25, 33])
    stats = {}
    with torch.no_grad():
        for f in ("svd", "gram", "lowrank"):
            comp = XKVCompressor(XKVConfig(rank_mode="reduction", reduction=3.0, factorization=f))
            stats[f] = model(ids, split=split, compressor=comp).compression_stats
    for f in ("gram", "lowrank"):
        for ref, got in zip(stats["svd"], stats[f]):
            assert torch.equal(ref["kv_bytes"], got["kv_bytes"])
            assert torch.equal(ref["xkv_rank_k"], got["xkv_rank_k"])
            tol = 1e-5 if f == "gram" else 1e-2
            for key in [k for k in ref if k.startswith(("xkv_rel_error", "xkv_energy"))]:
                assert float(got[key]) == pytest.approx(float(ref[key]), rel=tol), (f, key)
