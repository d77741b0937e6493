"""UniCache compressor: the shared method x wrapper matrix with invariants, and the model seam.

Methods are configurations of the pipeline (single steps, the full pipeline, presets, the
text-style baseline); wrappers are the ways a compressor is called (directly, through the
per-layer wrapper, at the decoder's attention seam). Every cell checks the structural
invariants, the budget, protection, K/V pairing and finite gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unicache_train.compress import (
    ComposedCompressor,
    IdentityCompressor,
    PerLayerCompressor,
    UniCacheCompressor,
    UniCacheConfig,
    presets,
)
from unicache_train.compress.config import QuantizeConfig
from unicache_train.compress.retention import RetentionPolicy
from unicache_train.compress.state import CompressionState
from unicache_train.compress.testing import (
    check_budget,
    check_kv_paired,
    check_protected_kept,
    check_segment,
    make_input,
)
from unicache_train.model.config import ModelConfig
from unicache_train.model.decoder import Decoder
from unicache_train.seam import CompressionInput, KVSegment


def _only(**enabled: bool) -> UniCacheConfig:
    """Default config with just the named steps enabled (quantization off unless named)."""
    cfg = UniCacheConfig()
    for name in (
        "head_merge",
        "importance",
        "schedule",
        "budget",
        "protect",
        "merge_evict",
        "quantize",
        "fallback",
    ):
        getattr(cfg, name).enabled = enabled.get(name, False)
    return UniCacheConfig.from_dict(cfg.to_dict())


def _no_quant(cfg: UniCacheConfig) -> UniCacheConfig:
    cfg.quantize = QuantizeConfig(bits=None)
    return cfg


METHODS = {
    "head_merge": lambda: _only(head_merge=True),
    "importance_evict": lambda: _only(importance=True, merge_evict=True),
    "schedule_budget": lambda: _only(importance=True, schedule=True, budget=True, merge_evict=True),
    "protect": lambda: _only(
        importance=True, schedule=True, budget=True, protect=True, merge_evict=True
    ),
    "quantize_int8": lambda: _only(quantize=True),
    "quantize_int4_head": lambda: UniCacheConfig(
        quantize=QuantizeConfig(bits=4, granularity="head")
    ),
    "fallback": lambda: UniCacheConfig.from_dict({"fallback": {"enabled": True}}),
    "full_fp": lambda: _no_quant(UniCacheConfig()),
    "full_int8": UniCacheConfig,
    "baseline": presets.text_style_baseline,
    "baseline_pooled": presets.text_style_pooled,
    "long_video": lambda: presets.long_video(patches_per_frame=8),
    "dense_doc_qa": presets.dense_doc_qa,
    "realtime": presets.realtime,
    "curriculum_half": lambda: UniCacheConfig(rate_scale=0.5),
    "sinks_recent_int4": lambda: _bits(presets.sinks_recent(), 4),
    "snapkv_int8": presets.snapkv,
    "snapkv_budget_protect": lambda: UniCacheConfig.from_dict(
        {"selection": {"method": "snapkv"}, "importance": {"enabled": False}}
    ),
    "sinks_recent_full_pipeline": lambda: UniCacheConfig.from_dict(
        {"selection": {"method": "sinks_recent"}}
    ),
    # A learned retention policy (zero-init, so it ranks as its prior): the hard selection of
    # inference, and the straight-through training gate (same entries, counts 1 + (a - sg(a))).
    "retention_eval_int4": lambda: _bits(presets.retention(), 4),
    "retention_full_pipeline_eval": lambda: UniCacheConfig.from_dict(
        {"selection": {"method": "retention", "prior": "snapkv"}}
    ),
    "retention_st_topk_train": lambda: UniCacheConfig.from_dict(
        {
            **presets.retention().to_dict(),
            "selection": {"method": "retention", "relaxation": "st_topk"},
        }
    ),
}


def _bits(cfg: UniCacheConfig, bits: int) -> UniCacheConfig:
    cfg.quantize = QuantizeConfig(bits=bits)
    return cfg


def _compressor(method: str, cfg: UniCacheConfig, H: int = 3, D: int = 16, layers: int = 4):
    """The method's compressor; a retention method gets its own zero-init policy (trained
    methods in train mode, the others in eval mode: the hard selection)."""
    if cfg.selection.method != "retention":
        return UniCacheCompressor(cfg)
    policy = RetentionPolicy(layers, H, D).train(method.endswith("_train"))
    return UniCacheCompressor(cfg, retention=policy)


class Recorder:
    """Wraps a compressor and keeps (input, segment, state) of every call."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.pre_rope = getattr(inner, "pre_rope", False)
        self.calls: list[tuple[CompressionInput, KVSegment, CompressionState | None]] = []

    def __call__(self, inp: CompressionInput) -> KVSegment:
        if isinstance(self.inner, ComposedCompressor):
            state = self.inner.run(inp)
            seg = state.segment
        else:
            state, seg = None, self.inner(inp)
        self.calls.append((inp, seg, state))
        return seg


def _wrap(name: str, comp):
    if name == "direct":
        return comp
    if name == "per_layer":  # layer 0 uncompressed, the others through `comp`
        return PerLayerCompressor(default=comp, overrides={0: IdentityCompressor()})
    raise ValueError(name)


def _check_state(state: CompressionState | None, cfg: UniCacheConfig) -> None:
    if state is None:
        return
    check_protected_kept(state)
    if state.modality_rates is not None and state.plan is not None:
        check_budget(state)
    if state.segment is not None and state.segment.quant is None:
        check_kv_paired(state)
    if state.head_groups is not None:  # members hold the same K and V
        seg = state.segment
        for b in range(seg.keys.shape[0]):
            for h, g in enumerate(state.head_groups[b].tolist()):
                assert torch.equal(seg.keys[b, h], seg.keys[b, g])
                assert torch.equal(seg.values[b, h], seg.values[b, g])


@pytest.mark.parametrize("wrapper", ["direct", "per_layer"])
@pytest.mark.parametrize("method", list(METHODS))
def test_matrix_direct(method: str, wrapper: str) -> None:
    cfg = METHODS[method]()
    rec = Recorder(_compressor(method, cfg))
    comp = _wrap(wrapper, rec)
    for layer in (0, 1, 3):
        inp = make_input(layer_idx=layer, H=3, twin_heads=True, requires_grad=True, seed=layer)
        seg = comp(inp)
        check_segment(inp, seg)
        # Gradients reach K and V through kept, merged and quantized entries, and are finite.
        v = seg.valid[:, None, :, None]
        g = torch.randn(seg.keys.shape, generator=torch.Generator().manual_seed(1))
        loss = (seg.keys * g * v).sum() + (seg.values * g * v).sum()
        gk, gv = torch.autograd.grad(loss, (inp.keys, inp.values))
        assert torch.isfinite(gk).all() and torch.isfinite(gv).all()
        assert gk.abs().sum() > 0 and gv.abs().sum() > 0
    expected_calls = 3 if wrapper == "direct" else 2
    assert len(rec.calls) == expected_calls
    for _, _, state in rec.calls:
        _check_state(state, cfg)


@pytest.mark.parametrize(
    "method",
    [
        "full_int8",
        "full_fp",
        "baseline",
        "protect",
        "fallback",
        "long_video",
        "sinks_recent_int4",
        "snapkv_int8",
        "retention_eval_int4",
        "retention_st_topk_train",
    ],
)
def test_matrix_seam(method: str) -> None:
    """The same invariants on the inputs the decoder's attention seam really produces."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig(num_hidden_layers=3))
    B, T = 3, 48
    ids = torch.randint(0, 260, (B, T))
    mod = torch.zeros(B, T, dtype=torch.long)
    mod[:, 4:28], mod[:, 28:36] = 1, 2
    split = torch.tensor([17, 33, 47])
    rec = Recorder(
        _compressor(
            method,
            METHODS[method](),
            H=model.config.num_key_value_heads,
            D=model.config.head_size,
            layers=3,
        )
    )
    out = model(ids, modality_ids=mod, split=split, compressor=rec)
    assert len(rec.calls) == 3 and len(out.compression_stats) == 3
    for inp, seg, state in rec.calls:
        check_segment(inp, seg)
        _check_state(state, rec.inner.config)
    loss = out.logits[:, -12:].float().logsumexp(-1).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0
    for stats in out.compression_stats:
        for key in (
            "rate_realized",
            "kv_bytes",
            "kv_reduction",
            "merged_fraction",
            "evicted_fraction",
            "heads_merged",
            "rate_realized/vision",
        ):
            assert key in stats and torch.isfinite(stats[key])


# ----------------------------------------------------------------------------- invariants
def test_rate_zero_is_identity_bit_for_bit() -> None:
    inp = make_input(H=3, twin_heads=True)
    for cfg in (
        UniCacheConfig(rate_scale=0.0, quantize=QuantizeConfig(bits=None)),
        UniCacheConfig(target_rate=0.0, quantize=QuantizeConfig(bits=16)),
    ):
        seg = UniCacheCompressor(cfg)(inp)
        assert seg.keys is inp.keys and seg.values is inp.values  # not even a copy
        assert torch.equal(seg.valid, inp.context_mask)
        assert torch.equal(seg.counts, torch.ones_like(seg.counts))
        assert float(seg.stats["rate_realized"]) == 0.0
        assert float(seg.stats["heads_merged"]) == 0.0
        assert float(seg.stats["kv_reduction"]) == 1.0


def test_rate_zero_with_int8_keeps_structure_quantizes_values() -> None:
    inp = make_input(requires_grad=True)
    seg = UniCacheCompressor(UniCacheConfig(rate_scale=0.0))(inp)
    assert torch.equal(seg.valid, inp.context_mask)
    assert not torch.equal(seg.keys, inp.keys)
    err = (seg.keys - inp.keys)[inp.context_mask[:, None].expand_as(inp.keys[..., 0])]
    assert err.abs().max() <= inp.keys.abs().max() / 127 * 0.51
    D = inp.keys.shape[-1]
    assert float(seg.stats["kv_reduction"]) == pytest.approx(2 * D / (D + 2))
    # Straight-through: the gradient of the dequantized values is the identity.
    g = torch.randn_like(seg.keys)
    (gk,) = torch.autograd.grad((seg.keys * g).sum(), inp.keys)
    ctx = inp.context_mask[:, None, :, None].expand_as(g)
    assert torch.equal(gk[ctx], g[ctx])


def test_model_rate_zero_logits_bit_for_bit_and_backprop() -> None:
    torch.manual_seed(0)
    model = Decoder(ModelConfig())
    B, T = 3, 40
    ids = torch.randint(0, 260, (B, T))
    mod = torch.randint(0, 3, (B, T))
    split = torch.tensor([9, 25, 39])
    plain = model(ids, modality_ids=mod).logits
    zero = UniCacheCompressor(UniCacheConfig(rate_scale=0.0, quantize=QuantizeConfig(bits=None)))
    out = model(ids, modality_ids=mod, split=split, compressor=zero).logits
    assert torch.equal(plain, out)
    # The real pipeline runs, changes the continuation's logits only (context queries see the
    # full context; SDPA's reduction length differs, hence a tolerance), and backprops.
    full = model(ids, modality_ids=mod, split=split, compressor=UniCacheCompressor())
    ctx = torch.arange(T)[None, :] < split[:, None]
    torch.testing.assert_close(full.logits[ctx], plain[ctx], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(full.logits[~ctx], plain[~ctx])
    full.logits.float().square().mean().backward()
    g = model.layers[1].self_attn.v_proj.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


def test_per_sample_lengths_match_single_sample_runs() -> None:
    """Each sample is compressed as if it were alone (per-sample rates and head groups)."""
    cfg = _no_quant(UniCacheConfig())
    inp = make_input(H=3, twin_heads=True, splits=(1, 30, 56))
    seg = UniCacheCompressor(cfg)(inp)
    check_segment(inp, seg)
    assert int(seg.valid[0].sum()) == 1  # a one-token context keeps its token
    for b in range(3):
        one = CompressionInput(
            **{
                f.name: (
                    getattr(inp, f.name)[b : b + 1]
                    if isinstance(getattr(inp, f.name), torch.Tensor)
                    else getattr(inp, f.name)
                )
                for f in dataclasses.fields(inp)
            }
        )
        s1 = UniCacheCompressor(cfg)(one)
        n = int(seg.valid[b].sum())
        assert int(s1.valid[0].sum()) == n
        assert torch.equal(s1.positions[0, :n], seg.positions[b, :n])
        torch.testing.assert_close(s1.keys[0, :, :n], seg.keys[b, :, :n])
        torch.testing.assert_close(s1.values[0, :, :n], seg.values[b, :, :n])


def test_empty_context_sample() -> None:
    inp = make_input(splits=(0, 20, 56))
    seg = UniCacheCompressor()(inp)
    check_segment(inp, seg)
    assert int(seg.valid[0].sum()) == 0
    assert all(torch.isfinite(v) for v in seg.stats.values())


def test_audio_is_a_generic_modality_and_bad_ids_raise() -> None:
    inp = make_input()
    seg = UniCacheCompressor()(inp)
    assert {"rate_realized/text", "rate_realized/vision", "rate_realized/audio"} <= set(seg.stats)
    bad = make_input()
    bad.modality_ids[0, 3] = 3
    with pytest.raises(ValueError, match="modality_ids"):
        UniCacheCompressor()(bad)


def test_realized_rates_follow_layer_schedule_and_modalities() -> None:
    """Per layer: the requested layer rate is the schedule's, the modality rates average to it
    (token-weighted, when no cap binds), and the emitted entries match the budget."""
    from unicache_train.compress.schedule import layer_rate

    cfg = _no_quant(UniCacheConfig())
    cfg.budget.text_cap = cfg.budget.vision_cap = cfg.budget.audio_cap = 0.95
    cfg.protect.enabled = False
    cfg = UniCacheConfig.from_dict(cfg.to_dict())
    for layer in range(4):
        state = UniCacheCompressor(cfg).run(make_input(layer_idx=layer, seed=layer))
        want = layer_rate(layer, 4, torch.full((3,), 0.6))
        torch.testing.assert_close(state.layer_rate, want)
        ctx, mod = state.inp.context_mask, state.inp.modality_ids
        n = torch.stack([(ctx & (mod == m)).sum(1) for m in range(3)], 1).float()
        mean = (state.modality_rates * n).sum(1) / n.sum(1)
        torch.testing.assert_close(mean, want, rtol=1e-5, atol=1e-5)
        check_budget(state)
        removed = 1.0 - state.segment.valid.sum(1).float() / ctx.sum(1).float()
        assert (removed - want).abs().max() <= 3.0 / 21  # within a token per modality


def test_merge_of_k_only_would_be_caught() -> None:
    """The K/V pairing check fails on a segment whose values were not merged."""
    state = UniCacheCompressor(_no_quant(UniCacheConfig())).run(make_input())
    assert check_kv_paired(state) > 0  # merges happened and K, V both match
    seg = state.segment
    broken = dataclasses.replace(seg, values=seg.values.clone())
    # Simulate the bug: merged entries keep the anchor token's own value.
    for b in range(seg.keys.shape[0]):
        for e in torch.nonzero(seg.valid[b] & (seg.counts[b] > 1)).flatten().tolist():
            t = int(seg.positions[b, e] - state.inp.positions[b, 0])
            broken.values[b, :, e] = state.values[b, :, t]
    state.segment = broken
    with pytest.raises(AssertionError):
        check_kv_paired(state)


def test_mla_latent_cache_seam() -> None:
    """On MLA the compressor sees the latent cache (one head, values narrower than keys):
    rate 0 is still bit-for-bit, and the full pipeline with int4 runs and backprops."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig(attention_type="mla", num_hidden_layers=2))
    B, T = 2, 40
    ids = torch.randint(0, 260, (B, T))
    mod = torch.zeros(B, T, dtype=torch.long)
    mod[:, 4:24] = 1
    split = torch.tensor([20, 39])
    plain = model(ids, modality_ids=mod).logits
    zero = UniCacheCompressor(UniCacheConfig(rate_scale=0.0, quantize=QuantizeConfig(bits=None)))
    assert torch.equal(model(ids, modality_ids=mod, split=split, compressor=zero).logits, plain)
    rec = Recorder(UniCacheCompressor(UniCacheConfig(quantize=QuantizeConfig(bits=4))))
    out = model(ids, modality_ids=mod, split=split, compressor=rec)
    for inp, seg, state in rec.calls:
        assert inp.values.shape[-1] < inp.keys.shape[-1]
        check_segment(inp, seg)
        check_protected_kept(state)
        check_budget(state)
    out.logits.float().square().mean().backward()
    g = model.layers[0].self_attn.kv_a_proj_with_mqa.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


def test_curriculum_moves_rate_scale_on_one_instance() -> None:
    """A compressor's own schedule starts at rate 0 (identity) and raises the rate on the same
    instance, without writing into its config."""
    inp = make_input(H=3, twin_heads=True)
    cfg = UniCacheConfig(quantize=QuantizeConfig(bits=None))
    comp = UniCacheCompressor(cfg, curriculum_steps=4)
    assert comp.at_step(0) == 0.0 and comp(inp).keys is inp.keys
    removed = []
    for step in (1, 2, 4):
        assert comp.at_step(step) == step / 4
        seg = comp(inp)
        check_segment(inp, seg)
        removed.append(float(seg.stats["rate_realized"]))
    assert removed[0] < removed[1] < removed[2]
    assert comp.at_step(None) == 1.0 and comp.config.rate_scale == 1.0
    with pytest.raises(ValueError, match="curriculum_steps=-1"):
        UniCacheCompressor(curriculum_steps=-1)
