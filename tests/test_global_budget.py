"""One budget over all layers (``ScheduleConfig.global_budget``, compress/global_budget.py):
the drop counts against a loop written apart, the pipeline's segments against the global top set,
exact budgets, the two passes of the decoder, and the errors."""

import pytest
import torch

from unicache_train.compress import UniCacheCompressor, UniCacheConfig, presets
from unicache_train.compress.attention_scorer import AttentionScorer
from unicache_train.compress.config import MAX_RATE, ConfigError
from unicache_train.compress.global_budget import global_drop_counts
from unicache_train.compress.schedule import LayerRates
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.model.generate import prefill_compressed
from unicache_train.seam import RecordedContext, RecordingCompressor


def reference_drops(scores, mask, rate) -> list[list[int]]:
    """Python loops: per sample, each layer's top n - floor(0.95 n) kept; then the lowest
    round(R L n) of the rest, ties by layer then token."""
    B, L, T = scores.shape
    out = []
    for b in range(B):
        ctx = [t for t in range(T) if mask[b, t]]
        n = len(ctx)
        max_drop = int(n * MAX_RATE)
        cands = []
        for l in range(L):
            ranked = sorted(ctx, key=lambda t: (float(scores[b, l, t]), t))
            for t in ranked[:max_drop]:
                if float(scores[b, l, t]) != float("inf"):
                    cands.append((float(scores[b, l, t]), l, t))
        cands.sort()
        k = min(int(float(rate[b]) * L * n + 0.5), len(cands))
        counts = [0] * L
        for _, l, _ in cands[:k]:
            counts[l] += 1
        out.append(counts)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_drop_counts_equal_a_loop_written_apart(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    B, L, T = 3, 4, 23
    scores = torch.randn(B, L, T, generator=g)
    scores[:, 1] += 2.0  # one layer far above the others: it must keep more
    scores[torch.rand(B, L, T, generator=g) < 0.15] = float("inf")
    scores[0, 2] = torch.round(scores[0, 2])  # ties
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 17:] = False  # a shorter sample (padding)
    rate = torch.tensor([0.5, 0.9, 0.93])
    got = global_drop_counts(scores, mask, rate)
    assert got.tolist() == reference_drops(scores, mask, rate)
    assert int(got[0, 1]) < int(got[0, 0])


def test_drop_counts_respect_the_per_layer_cap() -> None:
    """A layer whose tokens all score lowest still keeps n - floor(0.95 n)."""
    scores = torch.zeros(1, 2, 40)
    scores[0, 1] = 10.0
    got = global_drop_counts(scores, torch.ones(1, 40, dtype=torch.bool), torch.tensor([0.5]))
    assert got.tolist() == [[38, 2]]


def tiny(layers: int = 3) -> Decoder:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
    )
    return Decoder(cfg).eval()


def config(method: str, rate: float, bits=None, global_budget: bool = True) -> UniCacheConfig:
    d = getattr(presets, method)().to_dict()
    d["target_rate"] = rate
    d["schedule"]["global_budget"] = global_budget
    d["quantize"].update(bits=bits)
    d["selection"]["window"] = 4  # the observation / recent window: a small part of 40 tokens
    return UniCacheConfig.from_dict(d)


def scorer_for(model: Decoder) -> AttentionScorer:
    c = model.config
    s = AttentionScorer(c.num_hidden_layers, c.num_key_value_heads, c.head_size)
    with torch.no_grad():
        s.weight.normal_(generator=torch.Generator().manual_seed(3))
        s.weight[1] += 1.0  # layer 1's predictions higher: it should keep more
    return s


def compressor(method: str, model: Decoder, rate: float, **kw) -> UniCacheCompressor:
    scorer = scorer_for(model) if method == "attention" else None
    return UniCacheCompressor(config(method, rate, **kw), attention_scorer=scorer)


@pytest.mark.parametrize("method", ["snapkv", "attention"])
def test_segments_keep_the_global_top_set_and_meet_the_budget_exactly(method: str) -> None:
    model = tiny()
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    split = torch.tensor([40, 31])
    comp = compressor(method, model, 0.6)
    assert comp.cross_layer and comp.records_context
    rec = RecordingCompressor(comp)
    with torch.no_grad():
        model(ids, split=split, compressor=rec)
    L = model.config.num_hidden_layers
    # The reference: every layer's global scores on the recorded inputs, one ranking in Python.
    scorer = next(s for s in comp.steps if hasattr(s, "global_scores"))
    scores = torch.stack(
        [scorer.global_scores(comp._new_state(rec.inputs[l])) for l in range(L)], 1
    )
    mask = rec.inputs[0].context_mask
    want = reference_drops(scores, mask, torch.full((2,), 0.6))
    for b in range(2):
        n = int(split[b])
        kept = [int(rec.segments[l].valid[b].sum()) for l in range(L)]
        assert [n - k for k in kept] == want[b]
        assert sum(kept) == L * n - int(0.6 * L * n + 0.5)  # the budget over layers, exactly
        for l in range(L):  # and the kept tokens are the layer's best
            seg = rec.segments[l]
            pos = seg.positions[b][seg.valid[b]].tolist()
            s = scores[b, l, :n]
            best = torch.sort(s, stable=True, descending=False).indices[want[b][l] :]
            assert sorted(pos) == sorted(best.tolist())
    assert len({int(rec.segments[l].valid[0].sum()) for l in range(L)}) > 1  # rates differ


def test_stored_bytes_equal_the_per_layer_budget_at_the_same_rate() -> None:
    model = tiny()
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(2))
    split = torch.tensor([48, 48])
    total = {}
    for glob in (True, False):
        cache, _ = prefill_compressed(
            model, ids, split, compressor("snapkv", model, 0.75, bits=4, global_budget=glob)
        )
        total[glob] = sum(s.payload_bytes() for s in cache.segments)
    assert total[True] == pytest.approx(total[False], rel=0.01)


def test_in_loop_forward_equals_the_compressed_prefill_and_decode() -> None:
    """The decoder's two passes (recording, then compressed) and prefill_compressed + decoding
    give the same continuation logits."""
    from unicache_train.model.generate import decode_teacher_forced

    model = tiny()
    comp = compressor("attention", model, 0.7, bits=4)
    ids = torch.randint(0, 97, (2, 36), generator=torch.Generator().manual_seed(4))
    split = torch.tensor([28, 22])
    with torch.no_grad():
        inloop = model(ids, split=split, compressor=comp).logits
    got, _ = decode_teacher_forced(model, ids, split, comp)
    cont = torch.arange(36)[None, :] >= (split - 1)[:, None]
    torch.testing.assert_close(got[cont], inloop[cont], atol=1e-5, rtol=1e-5)


def test_rate_zero_records_nothing_and_is_the_identity() -> None:
    model = tiny()
    comp = compressor("snapkv", model, 0.0)
    assert comp.cross_layer and not comp.records_context
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a = model(ids, split=torch.tensor([15]), compressor=comp).logits
        b = model(ids).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_errors_name_the_field_and_the_fix() -> None:
    d = presets.snapkv().to_dict()
    d["schedule"].update(global_budget=True, enabled=True)
    with pytest.raises(ConfigError, match="global_budget=True is not allowed with enabled=True"):
        UniCacheConfig.from_dict(d)
    d = presets.sinks_recent().to_dict()
    d["schedule"]["global_budget"] = True
    with pytest.raises(ConfigError, match="selection.method='sinks_recent' is not one"):
        UniCacheConfig.from_dict(d)
    d = presets.snapkv().to_dict()
    d["schedule"]["global_budget"] = True
    d["fallback"]["enabled"] = True
    with pytest.raises(ValueError, match="fallback.enabled=True"):
        UniCacheCompressor(UniCacheConfig.from_dict(d))
    model = tiny()
    comp = compressor("snapkv", model, 0.5)
    rec = RecordingCompressor()
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids, split=torch.tensor([20]), compressor=rec)
    with pytest.raises(ValueError, match="came without the rates of a recording pass"):
        comp(rec.inputs[0])  # one layer alone: no ranking over layers
    fit = comp.fit(RecordedContext(rec.inputs, rec.segments, 20, model.rotary))
    assert isinstance(fit, LayerRates) and sorted(fit.rates) == [0, 1, 2]
    per_layer = compressor("snapkv", model, 0.5, global_budget=False)
    assert not per_layer.cross_layer
    with pytest.raises(ValueError, match="only a compressor with schedule.global_budget"):
        per_layer.fit(None)
