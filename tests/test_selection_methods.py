"""The fixed selections (StreamingLLM sinks + recent window, SnapKV pooled window attention):
what they keep, against independent references; byte accounting with int4/int8 storage;
composition with budgets and protection; config errors; selection as an in-loop preset.

The method x wrapper invariants run in ``tests/test_compress.py``'s matrix."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from unicache_train.compress import UniCacheCompressor, UniCacheConfig, presets
from unicache_train.compress.config import SelectionConfig
from unicache_train.compress.testing import check_protected_kept, check_segment, make_input
from unicache_train.train.config import CompressionTrainConfig
from unicache_train.validation import ConfigError


def text_input(B: int = 3, T: int = 64, splits=(40, 57, 64), seed: int = 0, **kw):
    """A text-only context (the fixed selections' home ground)."""
    inp = make_input(B=B, T=T, splits=splits, seed=seed, **kw)
    inp.modality_ids = torch.zeros_like(inp.modality_ids)
    return inp


def at(cfg: UniCacheConfig, rate: float, bits: int | None = None) -> UniCacheConfig:
    d = cfg.to_dict()
    d["target_rate"] = rate
    d["quantize"] = {**d["quantize"], "bits": bits}
    return UniCacheConfig.from_dict(d)


def kept_tokens(inp, seg, b: int) -> list[int]:
    """Token indices (within the sample) of sample b's entries, from their positions."""
    pos = inp.positions[b].tolist()
    return sorted(pos.index(p) for p in seg.positions[b][seg.valid[b]].tolist())


# ------------------------------------------------------------------ what each method keeps
@pytest.mark.parametrize("sinks", [0, 4])
def test_sinks_recent_keeps_the_sinks_and_the_most_recent_tokens(sinks: int) -> None:
    inp = text_input()
    rate = 0.7
    d = presets.sinks_recent().to_dict()
    d["selection"]["sinks"] = sinks
    seg = UniCacheCompressor(at(UniCacheConfig.from_dict(d), rate))(inp)
    check_segment(inp, seg)
    for b in range(3):
        n = int(inp.context_mask[b].sum())
        keep = n - math.floor(rate * n + 0.5)
        want = list(range(sinks)) + list(range(n - (keep - sinks), n))
        assert kept_tokens(inp, seg, b) == want, b


def _snapkv_reference(inp, b: int, window: int, kernel: int, keep: int) -> list[int]:
    """SnapKV by hand for one sample: each of the last `window` context queries' softmax over
    the context it sees (causal), averaged over query heads, summed over the window queries,
    divided by the window, averaged over `kernel` neighbours (edges: over the tokens present),
    the window always kept, then the top scores."""
    n = int(inp.context_mask[b].sum())
    q = inp.queries[b, :, :n].double()  # [Hq, n, D]
    k = inp.keys[b, :, :n].double()  # [H, n, D]
    rep = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(rep, 0)
    att = torch.zeros(n, dtype=torch.float64)
    for i in range(n - window, n):
        logits = torch.einsum("hd,hjd->hj", q[:, i], k[:, : i + 1]) / math.sqrt(q.shape[-1])
        att[: i + 1] += torch.softmax(logits, -1).mean(0)
    att /= window
    half = kernel // 2
    pooled = torch.stack([att[max(0, t - half) : t + half + 1].mean() for t in range(n)])
    rest = sorted(range(n - window), key=lambda t: (-float(pooled[t]), t))[: keep - window]
    return sorted(rest + list(range(n - window, n)))


def test_snapkv_keeps_the_window_and_the_top_pooled_attention_like_a_reference() -> None:
    inp = text_input(seed=3)
    # Softer attention than make_input's (whose spikes leave most tokens at ~1e-13, where the
    # order is float noise): every score here is well separated in fp32.
    inp.queries = inp.queries * 0.2
    rate = 0.6
    sel = SelectionConfig(method="snapkv", window=8, kernel=5)
    cfg = UniCacheConfig.from_dict({**presets.snapkv().to_dict(), "selection": sel.to_dict()})
    seg = UniCacheCompressor(at(cfg, rate))(inp)
    check_segment(inp, seg)
    for b in range(3):
        n = int(inp.context_mask[b].sum())
        keep = n - math.floor(rate * n + 0.5)
        assert kept_tokens(inp, seg, b) == _snapkv_reference(inp, b, 8, 5, keep), b


def test_fixed_selections_never_merge_under_their_presets() -> None:
    # make_input's vision/audio keys come in near-duplicate runs: UniCache would merge them.
    inp = make_input()
    for cfg in (presets.sinks_recent(), presets.snapkv()):
        st = UniCacheCompressor(cfg).run(inp)
        assert (st.segment.counts[st.segment.valid] == 1).all()
        assert float(st.segment.stats["merged_fraction"]) == 0.0


# ------------------------------------------------------------------ bytes with int4 / int8
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("method", ["sinks_recent", "snapkv"])
def test_int_storage_bytes_meet_the_byte_target_exactly(method: str, bits: int) -> None:
    """The kept fraction that gives 8x fewer KV bytes at int4 (4x at int8), worked out from the
    storage format by hand: per kept token and KV head, K and V each take D*bits/8 bytes plus
    one fp16 scale; the 16-bit cache takes 2*D each. The realized bytes are exactly that, the
    reduction reaches the target, and one more kept token per sample would miss it."""
    inp = text_input()
    B, H, _, D = inp.keys.shape
    per_token = 2 * H * (D * bits // 8 + 2)  # stored bytes of one kept token (K and V)
    base_token = 2 * H * 2 * D  # 16-bit bytes of one context token
    target = 8.0 if bits == 4 else 4.0
    n = inp.context_mask.sum(1)  # [B]
    # The smallest rate whose rounding keeps at most base / (target * per_token) of each sample.
    rate = max(1.0 - (base_token / (target * per_token)) + 0.5 / float(n.min()), 0.0)
    seg = UniCacheCompressor(at(getattr(presets, method)(), rate, bits))(inp)
    kept = seg.valid.sum(1)  # [B]
    torch.testing.assert_close(kept, n - torch.floor(rate * n + 0.5).long())
    assert float(seg.stats["kv_bytes"]) == float(kept.sum() * per_token)
    reduction = float(seg.stats["kv_reduction"])
    assert reduction >= target
    assert float(n.sum() * base_token) / float((kept.sum() + B) * per_token) < target
    assert float(seg.stats["budget_shortfall"]) == 0.0
    assert seg.quant is not None and seg.quant.bits == bits


# ------------------------------------------------------------------ composition
@pytest.mark.parametrize("method", ["sinks_recent", "snapkv"])
def test_selection_composes_with_budgets_protection_and_spans(method: str) -> None:
    """The full UniCache pipeline with only the scorer swapped: modality budgets set the
    per-modality quotas, alignment tokens are never evicted, merging still runs."""
    cfg = UniCacheConfig.from_dict({"selection": {"method": method}})
    comp = UniCacheCompressor(cfg)
    st = comp.run(make_input(layer_idx=1))
    check_segment(st.inp, st.segment)
    check_protected_kept(st)
    assert st.protected is not None and bool(st.protected.any())
    assert st.modality_rates is not None
    assert float(st.segment.stats["merged_fraction"]) > 0  # the merge band still applies
    fixed = UniCacheCompressor(at(getattr(presets, method)(), cfg.target_rate)).run(make_input(1))
    assert not torch.equal(fixed.segment.valid, st.segment.valid)  # budgets changed the choice


def test_scorer_replaces_only_the_importance_step() -> None:
    comp = UniCacheCompressor(presets.snapkv())
    names = [type(s).__name__ for s in comp.steps]
    assert names == [
        "DynamicFallback",
        "HeadMerge",
        "SnapKV",
        "LayerSchedule",
        "ModalityBudget",
        "AlignmentProtect",
        "MergeEvict",
        "Quantize",
    ]


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("method", "h2o", "['unicache', 'sinks_recent', 'snapkv', 'retention', 'attention']"),
        ("kernel", 4, "1, 3, 5, ..., 63"),
        ("window", 0, "[1, 4096]"),
        ("sinks", -1, "[0, 1024]"),
        ("relaxation", "softmax", "['gumbel_sigmoid', 'st_topk']"),
        ("temperature", 0.0, "(0.0, 10.0]"),
        ("prior", "unicache", "['sinks_recent', 'snapkv']"),
    ],
)
def test_bad_selection_values_raise_naming_field_value_and_range(field, value, allowed) -> None:
    with pytest.raises(ConfigError) as err:
        UniCacheConfig.from_dict({"selection": {field: value}})
    msg = str(err.value)
    assert f"SelectionConfig.{field}={value!r}" in msg and allowed in msg


@pytest.mark.parametrize("preset", ["sinks_recent", "snapkv", "retention"])
def test_selections_are_in_loop_presets(preset: str) -> None:
    cc = CompressionTrainConfig.from_dict(
        dict(enabled=True, preset=preset, unicache={"quantize": {"bits": 4}})
    )
    assert cc.unicache.selection.method == preset
    assert cc.unicache.quantize.bits == 4 and not cc.unicache.merge_evict.merge_threshold < 1.0


# ------------------------------------------------------------------ one token set per layer
@pytest.mark.parametrize("method", ["sinks_recent", "snapkv", "retention", "unicache"])
def test_selection_is_one_token_set_for_every_kv_head(method: str) -> None:
    """Selections are per layer (docs/compression_methods.md#selection-is-per-layer): whatever
    each head would prefer, every KV head's entries are the same context tokens, each head's own
    K/V at those positions. The heads are made to disagree: head 1's keys are head 0's reversed
    in time, and the retention policy reads the two heads with opposite weights."""
    from unicache_train.compress.retention import RetentionPolicy

    inp = text_input(seed=5)
    inp.keys[:, 1] = inp.keys[:, 0].flip(1)
    inp.values[:, 1] = inp.values[:, 0].flip(1)
    retention = None
    if method == "unicache":
        cfg = presets.text_style_baseline()
    else:
        cfg = getattr(presets, method)()
    if method == "retention":
        retention = RetentionPolicy(4, 2, 16).eval()
        with torch.no_grad():
            retention.weight[:, 0].normal_(std=3.0)
            retention.weight[:, 1] = -retention.weight[:, 0]
    d = cfg.to_dict()
    d["head_merge"] = {**d["head_merge"], "enabled": False}
    cfg = at(UniCacheConfig.from_dict(d), 0.6)
    seg = UniCacheCompressor(cfg, retention=retention)(inp)
    check_segment(inp, seg)
    assert seg.valid.shape == seg.positions.shape == seg.keys.shape[:1] + seg.keys.shape[2:3]
    for b in range(3):
        tok = torch.tensor(kept_tokens(inp, seg, b))
        assert 0 < len(tok) < int(inp.context_mask[b].sum())
        entries = seg.valid[b].nonzero().squeeze(1)
        for h in range(2):
            single = seg.counts[b, entries] == 1  # kept (unmerged) entries: the token itself
            got = seg.keys[b, h, entries[single]]
            pos = seg.positions[b, entries[single]].tolist()
            idx = [inp.positions[b].tolist().index(p) for p in pos]
            torch.testing.assert_close(got, inp.keys[b, h, idx].to(got.dtype))


def test_segment_refuses_a_per_head_mask() -> None:
    inp = text_input()
    seg = UniCacheCompressor(at(presets.sinks_recent(), 0.5))(inp)
    H = seg.keys.shape[1]
    with pytest.raises(ValueError, match=r"valid .* must be \[B, M\].*per-head selection"):
        dataclasses.replace(seg, valid=seg.valid[:, None].expand(-1, H, -1))
