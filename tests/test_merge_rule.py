"""Merged entries against the tokens they replace, with attention written out by hand.

Independent of the merge formula (``merge_evict.merge_tokens``, ``testing.check_kv_paired``):
the UniCache compressor merges a pair of tokens, then random queries attend over the merged
segment with the ``log(count)`` bias (a softmax written here) and over the original tokens. A
merged entry stands for its members exactly when the two outputs agree.
"""

from __future__ import annotations

import math

import pytest
import torch

from unicache_train.compress import UniCacheCompressor, UniCacheConfig, presets
from unicache_train.compress.config import MergeEvictConfig
from unicache_train.seam import CompressionInput, KVSegment
from unicache_train.validation import ConfigError

T, D, PAIR = 12, 16, (5, 6)  # context tokens, head dim, the two tokens with one key


def _merge_only(rule: str | None, rate: float = 0.1) -> UniCacheConfig:
    """Only the merge/evict step, at a rate that removes one of T tokens (round(0.1 * 12) = 1).

    No importance step: every score is 0, so members weigh the same in the average.
    """
    cfg = UniCacheConfig(target_rate=rate).to_dict()
    for step in ("head_merge", "importance", "schedule", "budget", "protect", "quantize"):
        cfg[step]["enabled"] = False
    if rule is not None:
        cfg["merge_evict"]["merge_rescale"] = rule
    return UniCacheConfig.from_dict(cfg)


def _pair_input(seed: int, other_values: float = 1.0) -> CompressionInput:
    """One sample, one KV head: random keys except tokens 5 and 6, which share one key and
    hold the orthogonal unit values e0 and e1; the other values are random times
    ``other_values``."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 1, T, D, generator=g)
    keys[..., PAIR[1], :] = keys[..., PAIR[0], :]
    values = other_values * torch.randn(1, 1, T, D, generator=g)
    values[..., PAIR[0], :], values[..., PAIR[1], :] = torch.eye(D)[0], torch.eye(D)[1]
    return CompressionInput(
        layer_idx=0,
        num_layers=1,
        queries=torch.randn(1, 1, T, D, generator=g),
        keys=keys,
        values=values,
        positions=torch.arange(T)[None],
        modality_ids=torch.zeros(1, T, dtype=torch.long),
        context_mask=torch.ones(1, T, dtype=torch.bool),
    )


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + bias) v in float64.

    Args:
        q: [Q, D]; k: [N, D]; v: [N, Dv]; bias: [N] additive logit bias.

    Returns:
        [Q, Dv].
    """
    q, k, v, bias = (x.double() for x in (q, k, v, bias))
    return torch.softmax(q @ k.T / math.sqrt(D) + bias, dim=-1) @ v


def _outputs(inp: CompressionInput, seg: KVSegment, queries: torch.Tensor):
    """(exact, merged) attention outputs [Q, D] over the original tokens / the segment."""
    exact = _attend(queries, inp.keys[0, 0], inp.values[0, 0], torch.zeros(T))
    keep = seg.valid[0]
    bias = torch.log(seg.counts[0, keep].float())  # the log(count) bias of a merged entry
    merged = _attend(queries, seg.keys[0, 0, keep], seg.values[0, 0, keep], bias)
    return exact, merged


def _compress(rule: str | None, inp: CompressionInput) -> KVSegment:
    seg = UniCacheCompressor(_merge_only(rule))(inp)
    # The merge really happened: one entry stands for exactly the pair, all else is kept.
    assert int(seg.valid.sum()) == T - 1
    assert sorted(seg.counts[0][seg.valid[0]].tolist()) == [1.0] * (T - 2) + [2.0]
    assert seg.assignment is not None
    assert int(seg.assignment[0, PAIR[0]]) == int(seg.assignment[0, PAIR[1]])
    return seg


def _queries(seed: int, n: int = 64, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_merge_is_exact_for_identical_keys(seed: int) -> None:
    """Two tokens with one key: the default merged entry gives the unmerged attention output."""
    inp = _pair_input(seed)
    exact, merged = _outputs(inp, _compress(None, inp), _queries(seed + 10))
    assert (merged - exact).abs().max().item() <= 1e-6


@pytest.mark.parametrize("rule, is_exact", [("k", True), ("none", True), ("kv", False)])
def test_each_rule_on_identical_keys(rule: str, is_exact: bool) -> None:
    """Averaging V (rules k, none) is exact for identical keys; rescaling V (kv) is not."""
    inp = _pair_input(3)
    exact, merged = _outputs(inp, _compress(rule, inp), _queries(4))
    err = (merged - exact).abs().max().item()
    assert (err <= 1e-6) == is_exact, err


def test_rescaling_values_inflates_the_output() -> None:
    """Rule kv (the source's L2 re-normalisation of K and V) stretches the merged pair's
    contribution by sqrt(2) (the mean of two orthogonal unit values has norm 1/sqrt(2) and is
    rescaled to norm 1). With the other values zero, every query's output is that
    contribution alone: norm ``p / sqrt(2)`` exactly, ``p`` under kv (p: the pair's share)."""
    inp = _pair_input(5, other_values=0.0)
    q = _queries(6)
    exact, merged_kv = _outputs(inp, _compress("kv", inp), q)
    _, merged_k = _outputs(inp, _compress("k", inp), q)
    ratio = merged_kv.norm(dim=-1) / exact.norm(dim=-1)
    torch.testing.assert_close(ratio, torch.full_like(ratio, math.sqrt(2)), rtol=1e-5, atol=0)
    torch.testing.assert_close(merged_k, exact, rtol=0, atol=1e-6)
    # The figure: a query giving the pair a share p = 0.466 reads 0.329 exact, 0.466 kv.
    share = torch.softmax(q.double() @ inp.keys[0, 0].double().T / math.sqrt(D), -1)
    p = share[:, PAIR[0]] + share[:, PAIR[1]]
    torch.testing.assert_close(exact.norm(dim=-1), p / math.sqrt(2), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(merged_kv.norm(dim=-1), p, rtol=1e-5, atol=1e-6)


def test_near_identical_keys_default_beats_rescaled_values() -> None:
    """Keys that agree only approximately (cosine > 0.8, the merge threshold): the default's
    output error is below the rescale-K-and-V rule's on every seed."""
    for seed in range(5):
        inp = _pair_input(seed)
        g = torch.Generator().manual_seed(100 + seed)
        inp.keys[..., PAIR[1], :] += 0.2 * torch.randn(D, generator=g)
        q = _queries(seed + 20)
        errs = {}
        for rule in (None, "kv"):
            exact, merged = _outputs(inp, _compress(rule, inp), q)
            errs[rule] = ((merged - exact).norm(dim=-1) / exact.norm(dim=-1)).mean().item()
        assert errs[None] < errs["kv"], (seed, errs)


def test_merge_rescale_config() -> None:
    """Validated with a message naming field, value and choices; kept by the dict round trip
    and by the presets."""
    with pytest.raises(ConfigError, match=r"MergeEvictConfig\.merge_rescale='v'.*'k'.*'kv'"):
        MergeEvictConfig(merge_rescale="v")
    with pytest.raises(ConfigError, match="merge_rescale"):
        UniCacheConfig.from_dict({"merge_evict": {"merge_rescale": 1}})
    for rule in ("k", "kv", "none"):
        cfg = UniCacheConfig.from_dict({"merge_evict": {"merge_rescale": rule}})
        assert cfg.to_dict()["merge_evict"]["merge_rescale"] == rule
        assert UniCacheConfig.from_dict(cfg.to_dict()).merge_evict.merge_rescale == rule
    for name, make in presets.PRESETS.items():
        assert make().merge_evict.merge_rescale == MergeEvictConfig().merge_rescale, name
