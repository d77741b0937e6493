"""KIVI's split quantization (arXiv 2402.02750): keys per channel within groups of ``G``
consecutive segment entries (``granularity="channel_group"``), values per token
(``QuantizeConfig.key_granularity`` / ``value_granularity``).

Checked against an fp64 reference written with plain loops over samples, heads, groups and
features (not the vectorized formula of :func:`quantize_symmetric`); the bytes against a hand
count; the packed CPU decode path against the reference decode; the compressed cache (our loop
and stock transformers ``generate()``) against the in-loop forward / our own loop.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_decode_attention import stored_segment  # tests/ is on sys.path under pytest

from unicache_train.compress import UniCacheCompressor, UniCacheConfig
from unicache_train.compress.config import QuantizeConfig
from unicache_train.compress.presets import text_style_baseline
from unicache_train.compress.quantize import Quantize, quantize_symmetric
from unicache_train.compress.state import CompressionState
from unicache_train.compress.testing import make_input
from unicache_train.model.compressed_cache import CompressedKVCache
from unicache_train.ops.decode_attention import (
    TRITON_GRANULARITIES,
    decode_attention,
    decode_attention_packed,
    decode_attention_reference,
    triton_reads,
)
from unicache_train.seam import (
    QUANT_GRANULARITIES,
    QuantizedKV,
    dequantize,
    pack_int4,
    stored_kv_bytes,
)
from unicache_train.validation import ConfigError

ATOL = 1e-5  # decode paths: same integers and scales, fp32, different summation order


# ------------------------------------------------------------------------- fp64 reference
def reference_channel_group(
    x: torch.Tensor, valid: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loops, fp64: for every sample b, head h, group g of ``group`` consecutive entries and
    feature d, the scale is max |x| over the group's *valid* entries / qmax; each valid entry is
    round(x / scale) * scale (clamped to +-qmax), invalid ones and all-zero groups give 0.

    Returns:
        (scale [B, H, ceil(M / group), D], dequantized [B, H, M, D]), both float64.
    """
    qmax = 2 ** (bits - 1) - 1
    B, H, M, D = x.shape
    n_groups = math.ceil(M / group)
    scale = torch.zeros(B, H, n_groups, D, dtype=torch.float64)
    deq = torch.zeros(B, H, M, D, dtype=torch.float64)
    xd = x.double()
    for b in range(B):
        for h in range(H):
            for g in range(n_groups):
                rows = [m for m in range(g * group, min((g + 1) * group, M)) if bool(valid[b, m])]
                for d in range(D):
                    amax = max((abs(float(xd[b, h, m, d])) for m in rows), default=0.0)
                    s = amax / qmax
                    scale[b, h, g, d] = s
                    for m in rows:
                        if s > 0:
                            q = max(-qmax, min(qmax, round(float(xd[b, h, m, d]) / s)))
                            deq[b, h, m, d] = q * s
    return scale, deq


def _data(B=2, H=3, M=37, D=8, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """K-like data: features of very different ranges, one outlier (sink) token, padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, M, D, generator=g) * torch.logspace(-1, 1, D)
    x[:, :, 0] *= 30.0  # an attention-sink-like outlier token
    valid = torch.ones(B, M, dtype=torch.bool)
    valid[0, M - 5 :] = False  # sample 0: a whole trailing group of padding when G divides 32
    if B > 1:
        valid[1, 3] = False  # a hole inside a group
    return x, valid


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [1, 8, 10, 64])  # 10: ragged last group; 64 > M: one group
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_channel_group_matches_the_loop_reference(bits, group, scale_dtype):
    x, valid = _data()
    B, H, M, D = x.shape
    x_q, q, scale = quantize_symmetric(x, valid, bits, "channel_group", scale_dtype, group)
    ref_scale, ref_deq = reference_channel_group(x, valid, bits, group)
    assert scale.shape == (B, H, math.ceil(M / group), D) and scale.dtype == scale_dtype
    assert q.dtype == torch.int8 and q.shape == x.shape
    # the stored scale is the reference's, rounded to its dtype: relative error <= eps, and at
    # most half the smallest fp16 subnormal (2**-25) below fp16's normal range
    qmax = 2 ** (bits - 1) - 1
    eps = 2.0**-11 if scale_dtype == torch.float16 else 2.0**-24
    sub = 2.0**-25 if scale_dtype == torch.float16 else 0.0
    delta = (scale.double() - ref_scale).abs()
    assert bool((delta <= ref_scale * eps + sub).all())
    # within half a step of the input on valid entries, plus what the scale's rounding moves:
    # err <= s/2 + qmax * |s - s_stored| (unclamped: s_stored / 2; clamped: qmax * (s - s_st))
    steps = ref_scale.repeat_interleave(group, 2)[:, :, :M]  # [B, H, M, D]
    bound = steps * (0.5 + qmax * eps) + qmax * sub + 1e-12
    err = (x_q.double() - x.double()).abs()
    vm = valid[:, None, :, None].expand_as(x)
    assert bool((err[vm] <= bound[vm]).all())
    # and within a step of the reference dequantization (a tie may round the other way)
    assert bool(((x_q.double() - ref_deq).abs() <= bound + steps / 2).all())
    # each group's loudest entry of a feature takes the top level: the scale is its max
    n_groups = math.ceil(M / group)
    qa = q.abs().masked_fill(~vm, 0).long()
    qa = torch.nn.functional.pad(qa, (0, 0, 0, n_groups * group - M))
    top = qa.view(B, H, n_groups, group, D).amax(3)  # [B, H, groups, D]
    normal = ref_scale > torch.finfo(scale_dtype).tiny  # (a subnormal scale rounds coarsely)
    assert bool((top[normal] >= qmax - 1).all()) and int(q.abs().max()) <= qmax
    # invalid entries: zero, q = 0
    assert bool((x_q[~vm] == 0).all()) and bool((q[~vm] == 0).all())


def test_invalid_entries_are_excluded_from_the_scales():
    x, valid = _data(B=1, H=1, M=16, D=4)
    valid[0, 5] = False
    loud = x.clone()
    loud[0, 0, 5] = 1e4  # an enormous padding entry inside group 0 (G = 8)
    _, _, s_plain = quantize_symmetric(x, valid, 4, "channel_group", group_size=8)
    x_q, q, s_loud = quantize_symmetric(loud, valid, 4, "channel_group", group_size=8)
    assert torch.equal(s_plain, s_loud)
    assert float(x_q[0, 0, 5].abs().max()) == 0.0 and int(q[0, 0, 5].abs().max()) == 0


def test_an_all_zero_group_quantizes_to_zero():
    x, valid = _data(B=1, H=2, M=24, D=4)
    x[:, :, 8:16] = 0.0  # group 1 (G = 8) all zero
    x_q, q, scale = quantize_symmetric(x, valid, 4, "channel_group", group_size=8)
    assert bool((scale[:, :, 1] == 0).all())
    assert bool((q[:, :, 8:16] == 0).all()) and bool((x_q[:, :, 8:16] == 0).all())
    assert bool(torch.isfinite(x_q).all())
    # an all-padding group (sample 0, entries 32..36 of 37 with G = 8): scale 0, q = 0
    x2, valid2 = _data(B=2, H=1, M=37, D=4)
    _, q2, s2 = quantize_symmetric(x2, valid2, 8, "channel_group", group_size=8)
    assert bool((s2[0, :, 4] == 0).all()) and bool((q2[0, :, 32:] == 0).all())
    assert bool((s2[1, :, 4] > 0).all())


def test_an_empty_segment_and_a_bad_group_size():
    x = torch.zeros(2, 3, 0, 8)
    valid = torch.zeros(2, 0, dtype=torch.bool)
    x_q, q, scale = quantize_symmetric(x, valid, 4, "channel_group", group_size=4)
    assert x_q.shape == q.shape == x.shape and scale.shape == (2, 3, 0, 8)
    with pytest.raises(ValueError, match="group_size=0"):
        quantize_symmetric(
            torch.zeros(1, 1, 4, 2),
            torch.ones(1, 4, dtype=torch.bool),
            4,
            "channel_group",
            group_size=0,
        )
    with pytest.raises(ValueError, match="granularity='tensor'"):
        quantize_symmetric(torch.zeros(1, 1, 4, 2), torch.ones(1, 4, dtype=torch.bool), 4, "tensor")


def test_the_straight_through_gradient_is_the_identity():
    x, valid = _data(B=1, H=1, M=12, D=4)
    x.requires_grad_(True)
    x_q, _, _ = quantize_symmetric(x, valid, 4, "channel_group", group_size=5)
    x_q.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


# -------------------------------------------------------------------------------- the step
def _state(seed: int = 0) -> CompressionState:
    return CompressionState.from_input(make_input(seed=seed), 0.0)


@pytest.mark.parametrize("bits", [4, 8])
def test_kivi_split_keys_channel_group_values_token_head(bits):
    """K per channel in groups of G, V per token: each within half a step of its fp64
    reference, stored with its own granularity, dequantized from the packed storage exactly as
    the forward saw it."""
    G = 16
    st = _state()
    k0, v0, valid = st.keys.clone(), st.values.clone(), st.inp.context_mask
    step = Quantize(
        bits=bits, key_granularity="channel_group", value_granularity="token_head", group_size=G
    )
    seg = step(st).segment
    assert seg is not None and seg.quant is not None
    quant = seg.quant
    assert (quant.granularity, quant.v_granularity, quant.group_size) == (
        "channel_group",
        "token_head",
        G,
    )
    B, H, T, D = k0.shape
    assert quant.k_scale.shape == (B, H, math.ceil(T / G), D)
    assert quant.v_scale.shape == (B, H, T)
    # keys: the loop reference
    ref_scale, ref_deq = reference_channel_group(k0, valid, bits, G)
    torch.testing.assert_close(quant.k_scale, ref_scale.half(), atol=0, rtol=0)
    steps = ref_scale.repeat_interleave(G, 2)[:, :, :T]
    vm = valid[:, None, :, None].expand_as(k0)
    err = (seg.keys.double() - k0.double()).abs()
    assert bool((err[vm] <= steps[vm] * (0.5 + 2**bits * 2.0**-10)).all())
    # values: one scale per (token, head) vector, by hand
    qmax = 2 ** (bits - 1) - 1
    v_step = (v0.double() * vm).abs().amax(-1, keepdim=True) / qmax  # [B, H, T, 1]
    v_err = (seg.values.double() - v0.double()).abs()
    assert bool((v_err[vm] <= v_step.expand_as(v0)[vm] * (0.5 + 2**bits * 2.0**-10)).all())
    # the packed storage dequantizes to what the forward attended
    k_deq, v_deq = dequantize(quant)
    torch.testing.assert_close(k_deq, seg.keys.float(), atol=0, rtol=0)
    torch.testing.assert_close(v_deq, seg.values.float(), atol=0, rtol=0)


def test_defaults_are_bit_identical_to_token_head():
    """No key/value granularity: exactly ``granularity`` for both (the stored record too)."""
    for bits, gran in [(4, "token_head"), (8, "token_head"), (4, "head"), (8, "channel")]:
        a = Quantize(bits=bits, granularity=gran)(_state(1)).segment
        b = Quantize(bits=bits, granularity=gran, key_granularity=gran, value_granularity=gran)(
            _state(1)
        ).segment
        assert a is not None and b is not None and a.quant is not None and b.quant is not None
        for name in ("keys", "values"):
            assert torch.equal(getattr(a, name), getattr(b, name))
        for name in ("k_data", "v_data", "k_scale", "v_scale"):
            assert torch.equal(getattr(a.quant, name), getattr(b.quant, name))
        assert (a.quant.value_granularity, a.quant.group_size) == (None, None)
        assert (b.quant.value_granularity, b.quant.group_size) == (None, None)
        assert a.quant.granularity == b.quant.granularity == gran
    default = Quantize()(_state(2)).segment
    explicit = Quantize(bits=8, granularity="token_head")(_state(2)).segment
    assert default is not None and explicit is not None
    assert torch.equal(default.keys, explicit.keys) and torch.equal(default.values, explicit.values)
    assert torch.equal(default.quant.k_scale, explicit.quant.k_scale)  # type: ignore[union-attr]
    assert default.quant.granularity == "token_head"  # type: ignore[union-attr]
    assert default.quant.value_granularity is None  # type: ignore[union-attr]
    assert default.quant.group_size is None  # type: ignore[union-attr]


# -------------------------------------------------------------------------------- bytes
def test_stored_bytes_against_a_hand_count():
    """B=2, 2 stored heads, M=37 entries of D=8, int4, fp16 scales; keys channel_group G=8,
    values token_head. Sample 0 has 32 valid entries, sample 1 all 37.

    K: payload 37 or 32 entries x 4 bytes (8 nibbles) per head + ceil(n / 8) x 8 fp16 scales
    per head; V: n x (4 + 2) bytes per head.
      sample 0: K 2*32*4 + 2*4*8*2 = 256 + 128 = 384; V 2*32*6 = 384 -> 768
      sample 1: K 2*37*4 + 2*5*8*2 = 296 + 160 = 456; V 2*37*6 = 444 -> 900
    """
    B, H, M, D = 2, 2, 37, 8
    x = torch.randn(B, H, M, D, generator=torch.Generator().manual_seed(0))
    valid = torch.ones(B, M, dtype=torch.bool)
    valid[0, 32:] = False
    _, kq, ks = quantize_symmetric(x, valid, 4, "channel_group", group_size=8)
    _, vq, vs = quantize_symmetric(x, valid, 4, "token_head")
    quant = QuantizedKV(
        4,
        "channel_group",
        pack_int4(kq),
        pack_int4(vq),
        ks,
        vs,
        D,
        value_granularity="token_head",
        group_size=8,
    )
    got = stored_kv_bytes(valid, torch.tensor([2, 2]), D, D, quant=quant)
    assert got.tolist() == [768.0, 900.0]
    # both channel_group (G = 10): K and V each n x 4 + ceil(n / 10) x 8 x 2 bytes per head
    #   sample 0: 2 * (2*32*4 + 2*4*16) = 2 * (256 + 128) = 768
    #   sample 1: 2 * (2*37*4 + 2*4*16) = 2 * (296 + 128) = 848
    _, kq, ks = quantize_symmetric(x, valid, 4, "channel_group", group_size=10)
    both = QuantizedKV(4, "channel_group", pack_int4(kq), pack_int4(kq), ks, ks, D, group_size=10)
    assert stored_kv_bytes(valid, torch.tensor([2, 2]), D, D, quant=both).tolist() == [768.0, 848.0]
    # one stored head (merged) halves it; no valid entry: no bytes
    none = torch.zeros(B, M, dtype=torch.bool)
    assert stored_kv_bytes(none, torch.tensor([1, 1]), D, D, quant=both).tolist() == [0.0, 0.0]
    assert stored_kv_bytes(valid, torch.tensor([1, 1]), D, D, quant=both).tolist() == [384.0, 424.0]


@pytest.mark.filterwarnings("ignore::unicache_train.compress.composer.RateShortfallWarning")
def test_the_step_reports_those_bytes_in_its_stats():
    """The pipeline's ``kv_bytes`` stat (the batch's stored bytes) counts the split scales."""
    cfg = UniCacheConfig.from_dict(
        {
            "head_merge": {"enabled": False},
            "quantize": {
                "bits": 4,
                "key_granularity": "channel_group",
                "value_granularity": "token_head",
                "group_size": 8,
            },
        }
    )
    inp = make_input(seed=4)
    seg = UniCacheCompressor(cfg)(inp)
    assert seg.quant is not None and seg.quant.group_size == 8
    n = seg.valid.sum(1).double()
    H, D = seg.keys.shape[1], seg.keys.shape[-1]
    by_hand = H * n * (D // 2) + H * torch.ceil(n / 8) * D * 2  # keys
    by_hand = by_hand + H * n * (D // 2 + 2)  # values
    # the stat is the batch's sum
    torch.testing.assert_close(seg.stats["kv_bytes"].double(), by_hand.sum(), atol=0, rtol=0)


# -------------------------------------------------------------------------------- config
def test_config_fields_validation_and_round_trip():
    cfg = QuantizeConfig.from_dict(
        {"bits": 4, "key_granularity": "channel_group", "value_granularity": "token_head"}
    )
    assert (cfg.key_granularity, cfg.value_granularity, cfg.group_size) == (
        "channel_group",
        "token_head",
        32,
    )
    assert (cfg.effective_key_granularity, cfg.effective_value_granularity) == (
        "channel_group",
        "token_head",
    )
    assert QuantizeConfig.from_dict(cfg.to_dict()) == cfg
    # an old serialized dict (no new keys) loads to today's behaviour
    old = {
        "enabled": True,
        "bits": 8,
        "granularity": "head",
        "scale_dtype": "float16",
        "windowed_layers": False,
    }
    legacy = QuantizeConfig.from_dict(old)
    assert (legacy.effective_key_granularity, legacy.effective_value_granularity) == (
        "head",
        "head",
    )
    assert legacy.key_granularity is None and legacy.value_granularity is None
    assert QuantizeConfig(granularity="channel_group").effective_value_granularity == (
        "channel_group"
    )
    assert set(QuantizeConfig._GRANULARITIES) == set(QUANT_GRANULARITIES)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("group_size", 0, "[1, 65536]"),
        ("group_size", -3, "[1, 65536]"),
        ("group_size", 1 << 17, "[1, 65536]"),
        ("group_size", 2.5, "[1, 65536]"),
        ("granularity", "group", "'channel_group'"),
        ("key_granularity", "per_channel", "'channel_group'"),
        ("value_granularity", "tensor", "None"),
    ],
)
def test_config_errors_name_field_value_and_range(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        QuantizeConfig(**{field: value})
    msg = str(err.value)
    assert f"QuantizeConfig.{field}={value!r}" in msg and allowed in msg, msg
    with pytest.raises(ConfigError, match=f"{field}"):
        UniCacheConfig.from_dict({"quantize": {field: value}})


def test_quantized_kv_refuses_a_channel_group_without_a_group_size():
    z = torch.zeros(1, 1, 4, 2, dtype=torch.int8)
    s = torch.zeros(1, 1, 1, 2)
    with pytest.raises(ValueError, match="group_size"):
        QuantizedKV(8, "channel_group", z, z, s, s, 2)
    with pytest.raises(ValueError, match="value_granularity='tensor'"):
        QuantizedKV(8, "token_head", z, z, s[..., 0], s[..., 0], 2, value_granularity="tensor")


# ------------------------------------------------------------------------------- decoding
def make_split_segment(kg, vg, group=8, B=2, G=3, M=37, D=48, bits=4, seed=0):
    """As tests/test_decode_attention.py's segment (merged heads in sample 1, 5 padding slots
    in sample 0, counts > 1), with K and V at their own granularities."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, G, M, D, generator=g) * torch.linspace(0.5, 3.0, G)[None, :, None, None]
    k = k * torch.logspace(-1, 1, D)  # channels of different ranges (where KIVI helps)
    v = torch.randn(B, G, M, D, generator=g)
    valid = torch.ones(B, M, dtype=torch.bool)
    valid[0, M - 5 :] = False
    counts = torch.ones(B, M) + (torch.rand(B, M, generator=g) < 0.3) * 3.0
    _, kq, ks = quantize_symmetric(k, valid, bits, kg, group_size=group)
    _, vq, vs = quantize_symmetric(v, valid, bits, vg, group_size=group)
    if bits == 4:
        kq, vq = pack_int4(kq), pack_int4(vq)
    uses_groups = "channel_group" in (kg, vg)
    quant = QuantizedKV(
        bits,
        kg,
        kq,
        vq,
        ks,
        vs,
        D,
        value_granularity=None if vg == kg else vg,
        group_size=group if uses_groups else None,
    )
    head_map = torch.tensor([[0, 1, 2], [0, 0, 1]])[:B]
    return quant, head_map, counts, valid


COMBOS = [
    ("channel_group", "token_head"),  # KIVI
    ("channel_group", "channel_group"),
    ("token_head", "channel_group"),
    ("channel", "token_head"),
    ("head", "channel"),
    ("token_head", "head"),
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kg,vg", COMBOS)
@pytest.mark.parametrize("group", [1, 8, 10, 64])
@pytest.mark.parametrize("T,S", [(1, 5), (3, 7), (1, 0)])
def test_packed_decode_equals_the_reference(bits, kg, vg, group, T, S):
    quant, head_map, counts, valid = make_split_segment(kg, vg, group, bits=bits)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, T, 48, generator=g)
    kd = vd = None
    if S:
        kd, vd = torch.randn(2, 3, S, 48, generator=g), torch.randn(2, 3, S, 48, generator=g)
    ref = decode_attention_reference(q, quant, head_map, counts, valid, kd, vd)
    out = decode_attention_packed(q, quant, head_map, counts, valid, kd, vd)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    # on CPU "auto" is the packed path
    auto = decode_attention(q, quant, head_map, counts, valid, kd, vd)
    torch.testing.assert_close(auto, out, atol=0, rtol=0)


def test_packed_decode_with_one_slot_per_head():
    """The batched (unmerged) branch of the packed path: head_map the identity."""
    quant, _, counts, valid = make_split_segment("channel_group", "token_head", 10)
    head_map = torch.arange(3).expand(2, 3)
    q = torch.randn(2, 6, 2, 48, generator=torch.Generator().manual_seed(2))
    ref = decode_attention_reference(q, quant, head_map, counts, valid, None, None)
    out = decode_attention_packed(q, quant, head_map, counts, valid, None, None)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_the_triton_kernel_reads_only_one_shared_granularity():
    """Split or grouped scales are not in the kernel's table: ``auto`` falls back to the
    PyTorch packed path (on CUDA), an explicit ``backend="triton"`` refuses with the reason."""
    assert TRITON_GRANULARITIES == ("token_head", "head", "channel")
    for kg, vg in COMBOS:
        quant, head_map, counts, valid = make_split_segment(kg, vg, 8, M=9, D=8)
        assert not triton_reads(quant)
        q = torch.randn(2, 6, 1, 8)
        with pytest.raises(ValueError, match="Triton decode kernel"):
            decode_attention(q, quant, head_map, counts, valid, None, None, backend="triton")
    for gran in TRITON_GRANULARITIES:
        quant, *_ = make_split_segment(gran, gran, 8, M=9, D=8)
        assert triton_reads(quant)


@pytest.mark.parametrize("path", ["packed", "int8", "buffer"])
@pytest.mark.parametrize("bits", [4, 8])
def test_cache_attend_equals_the_reference_path(path, bits):
    """CompressedKVCache.attend over many steps == the reference path, for the KIVI split."""
    quant, head_map, counts, valid = make_split_segment(
        "channel_group", "token_head", 8, M=21, D=16, bits=bits
    )
    seg = stored_segment(quant, head_map, counts, valid)
    fast = CompressedKVCache(1, decode_path=path)
    ref = CompressedKVCache(1, decode_path="reference")
    for cache in (fast, ref):
        cache.set_segment(0, seg)
    g = torch.Generator().manual_seed(3)
    for step in range(12):
        T = 3 if step == 0 else 1
        q = torch.randn(2, 6, T, 16, generator=g)
        k, v = torch.randn(2, 3, T, 16, generator=g), torch.randn(2, 3, T, 16, generator=g)
        torch.testing.assert_close(
            fast.attend(0, q, k, v), ref.attend(0, q, k, v), atol=ATOL, rtol=0
        )
    assert fast.kv_bytes() == ref.kv_bytes()


# ----------------------------------------------------------------- our loop, stock generate
def _kivi_compressor(bits: int = 4, group: int = 4) -> UniCacheCompressor:
    d = text_style_baseline().to_dict()
    d["target_rate"] = 0.6
    d["quantize"].update(
        bits=bits, key_granularity="channel_group", value_granularity="token_head", group_size=group
    )
    return UniCacheCompressor(UniCacheConfig.from_dict(d))


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("path", ["auto", "packed", "buffer"])
def test_compressed_decoding_equals_the_inloop_forward(kind, path):
    """Prefill, store the KIVI-split segment, decode teacher-forced: the logits equal the
    in-loop forward's (what training sees) and the reference path's. MLA's latent takes the
    keys' granularity for both of its parts (``c_kv`` and ``k_pe``)."""
    from test_one_decode_path import model_of

    from unicache_train.model.generate import decode_teacher_forced

    model = model_of(kind)
    compressor = _kivi_compressor()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    split = torch.tensor([21, 13])
    with torch.no_grad():
        inloop = model(ids, split=split, compressor=compressor).logits
    want, _ = decode_teacher_forced(model, ids, split, compressor, decode_path="reference")
    got, cache = decode_teacher_forced(model, ids, split, compressor, decode_path=path)
    cont = torch.arange(30)[None, :] >= (split - 1)[:, None]
    torch.testing.assert_close(got[cont], inloop[cont], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[cont], want[cont], atol=1e-5, rtol=1e-5)
    for seg in cache.segments:
        assert seg is not None and seg.quant is not None
        assert seg.quant.granularity == "channel_group" and seg.quant.group_size == 4
        want_v = None if kind == "mla" else "token_head"
        assert seg.quant.value_granularity == want_v


def test_stock_generate_equals_our_loop(tmp_path, monkeypatch):
    """The KIVI split exported as a compression policy: stock transformers ``generate()`` with
    the compressed cache gives our loop's tokens, logits within 1e-4 and the same KV bytes."""
    pytest.importorskip("transformers")
    import cache_exactness as ce

    policy = dict(
        method="unicache",
        preset="text_style_baseline",
        unicache={
            "quantize": {
                "bits": 4,
                "key_granularity": "channel_group",
                "value_granularity": "token_head",
                "group_size": 8,
            }
        },
    )
    monkeypatch.setitem(ce.POLICIES, "unicache_kivi_int4", policy)
    ce.check(tmp_path, "llama", "unicache_kivi_int4")
