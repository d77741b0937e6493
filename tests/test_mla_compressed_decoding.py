"""Compressed decoding of MLA models (issue 18 item 2): prefill, compress the latent cache
``[c_kv ‖ k_pe]``, decode token by token on it, equal to the in-loop compressed forward; the
latent is stored (and counted) once, its values are its first ``R`` features throughout."""

import math

import pytest
import torch

from unicache_train.compress import IdentityCompressor, UniCacheCompressor, UniCacheConfig
from unicache_train.compress.config import XKVConfig
from unicache_train.compress.merge_evict import TokenPlan, merge_tokens
from unicache_train.compress.presets import text_style_baseline
from unicache_train.compress.xkv import XKVCompressor
from unicache_train.inloop import continuation_mask
from unicache_train.model import Decoder
from unicache_train.model.compressed_cache import CompressedKVCache
from unicache_train.model.config import ModelConfig
from unicache_train.model.generate import (
    decode_teacher_forced,
    generate_compressed,
    kv_bytes_report,
    prefill_compressed,
)
from unicache_train.seam import RecordingCompressor

VOCAB = 97
R, DR = 16, 8  # kv_lora_rank, qk_rope_head_dim: the latent is R + DR = 24 wide
LAYERS = 3


def mla_model(seed: int = 0) -> Decoder:
    # initializer_range 0.1: logits of std ~0.8 (|max| ~3), so 1e-5 is a real check.
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_type="mla",
        kv_lora_rank=R,
        qk_nope_head_dim=8,
        qk_rope_head_dim=DR,
        v_head_dim=12,
        rope_theta=500.0,
        initializer_range=0.1,
    )
    return Decoder(cfg).eval()


def unicache(
    rate: float, bits: int | None = None, granularity: str = "token_head", head_merge: bool = True
) -> UniCacheConfig:
    """Text-only data: the text-style preset removes ``rate`` of the context (no text cap)."""
    d = text_style_baseline().to_dict()
    d["target_rate"] = rate
    d["quantize"].update(bits=bits, granularity=granularity)
    d["head_merge"]["enabled"] = head_merge
    return UniCacheConfig.from_dict(d)


CASES = {
    "identity": lambda: IdentityCompressor(),
    "unicache_0.6": lambda: UniCacheCompressor(unicache(0.6)),
    "unicache_0.6_int8": lambda: UniCacheCompressor(unicache(0.6, 8)),
    "unicache_0.6_int4_head_scale": lambda: UniCacheCompressor(unicache(0.6, 4, "head")),
    "xkv": lambda: XKVCompressor(XKVConfig(group_size=3, rank_mode="reduction", reduction=4.0)),
    "xkv_post_rope": lambda: XKVCompressor(
        XKVConfig(group_size=3, rank_mode="reduction", reduction=4.0, keys_pre_rope=False)
    ),
}


# ------------------------------------------------------------------ in-loop == step by step
@pytest.mark.parametrize("case", list(CASES) + ["unicache_0.6_int8@batched"])
def test_teacher_forced_decoding_equals_inloop_forward(case: str, monkeypatch) -> None:
    if case.endswith("@batched"):  # the seam's GPU kernel (one masked SDPA call), here on CPU
        monkeypatch.setattr("unicache_train.model.attention.SEGMENT_ATTENTION", "batched")
        case = case.split("@")[0]
    model = mla_model()
    ids = torch.randint(0, VOCAB, (2, 44))
    split = torch.tensor([29, 18])  # ragged: each sample decodes from its own split
    comp = CASES[case]()
    with torch.no_grad():
        ref = model(ids, split=split, compressor=comp)
        plain = model(ids).logits
    got, cache = decode_teacher_forced(model, ids, split, comp)
    cont = continuation_mask(split, ids.shape[1])  # positions split-1 .. T-1
    assert torch.isnan(got[~cont]).all() and not torch.isnan(got[cont]).any()
    assert float(ref.logits[cont].abs().max()) > 1.0  # O(1) logits: 1e-5 is a real tolerance
    # fp32; decoding attends in MLA's absorbed form, the in-loop seam in the expanded form
    # ((q·W_uk)·c vs q·(W_uk·c)) over other shapes: <= 3.2e-6 seen.
    assert float((got[cont] - ref.logits[cont]).abs().max()) <= 1e-5
    # ... while the compression itself moves the logits by far more than that.
    moved = float((ref.logits[cont] - plain[cont]).abs().max())
    assert moved < 1e-5 if case == "identity" else moved > 1e-2
    assert cache.latent and all(seg.head_map.shape[1] == 1 for seg in cache.segments)
    for seg in cache.segments:  # the stored latent's values are its first R features
        k, v = seg.kv(torch.float32)
        assert k.shape[-1] == R + DR and torch.equal(v, k[..., :R])
    if case == "identity":
        return
    # The cache holds what the compressor accounted for, the latent once.
    stat_bytes = sum(float(s["kv_bytes"]) for s in ref.compression_stats)
    assert cache.kv_bytes(include_metadata=False) == int(stat_bytes)
    assert all(seg.latent for seg in cache.segments)
    assert cache.baseline_bytes() == LAYERS * int(split.sum()) * (R + DR) * 2
    if case.startswith("unicache"):
        removed = [float(s["rate_realized"]) for s in ref.compression_stats]
        assert sum(removed) / LAYERS > 0.5
    if "int" in case:
        for seg in cache.segments:  # packed once, in two parts: c_kv (R) and k_pe (DR)
            q = seg.quant
            assert q.latent and seg.keys is None
            per = 1 if q.bits == 8 else 2  # values per stored byte
            assert q.v_data.shape[-1] == -(-R // per) and q.k_data.shape[-1] == -(-DR // per)
    if case.startswith("xkv"):
        assert all(
            seg.lowrank is not None and seg.lowrank.token_v is None for seg in cache.segments
        )


def test_greedy_generation_on_the_compressed_latent_cache_matches_inloop_argmax() -> None:
    model = mla_model(1)
    prompts = torch.randint(0, VOCAB, (2, 30))
    split = torch.tensor([30, 22])
    comp = UniCacheCompressor(unicache(0.6, 4))
    gen = generate_compressed(model, prompts, split, comp, max_new_tokens=6).tokens  # [2, 6]
    for b in range(2):
        s = int(split[b])
        seq = torch.cat([prompts[b, :s], gen[b]])[None]
        with torch.no_grad():
            logits = model(seq, split=split[b : b + 1], compressor=comp).logits
        assert torch.equal(logits[0, s - 1 : -1].argmax(-1), gen[b])


# ------------------------------------------------------------------ V = K[..., :R], bytes
def _unpack_by_hand(data: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """Stored integers -> int64 [..., width], written out: int4 low nibble first, two's
    complement."""
    if bits == 8:
        return data.long()
    lo, hi = (data.long() & 15), (data.long() >> 4) & 15
    both = torch.stack([lo, hi], -1).flatten(-2)[..., :width]
    return torch.where(both >= 8, both - 16, both)


@pytest.mark.parametrize(
    "bits,granularity", [(8, "token_head"), (4, "head"), (4, "token_head"), (4, "channel")]
)
def test_stored_latent_is_what_the_inloop_forward_attended_and_its_bytes(bits, granularity):
    """The packed bytes, dequantized by hand, are the in-loop segment's keys, and their first R
    features its values (one quantization of the latent, c_kv and k_pe with their own scales);
    the bytes are counted independently: valid entries x (R + DR) payload elements at the
    storage width, plus one fp16 scale per part (per entry, or per sample with "head")."""
    model = mla_model(2)
    ids = torch.randint(0, VOCAB, (2, 40))
    split = torch.tensor([36, 27])
    comp = UniCacheCompressor(unicache(0.6, bits, granularity))
    rec = RecordingCompressor(comp)
    with torch.no_grad():
        out = model(ids, split=split, compressor=rec)
    cache, _ = prefill_compressed(model, ids, split, comp)
    width = R + DR
    total = 0

    def by_hand(data, scale, w):
        ints = _unpack_by_hand(data, bits, w).double()  # [B, 1, M, w]
        scale = scale.double()
        scale = {
            "token_head": lambda: scale[..., None],
            "channel": lambda: scale[:, :, None, :],
            "head": lambda: scale[:, :, None, None],
        }[granularity]()
        return ints * torch.where(scale > 0, scale, 1.0)

    for layer, st in enumerate(out.compression_stats):
        inloop, stored = rec.segments[layer], cache.segments[layer]
        assert inloop.latent and torch.equal(inloop.values, inloop.keys[..., :R])
        q = stored.quant
        latent = torch.cat([by_hand(q.v_data, q.v_scale, R), by_hand(q.k_data, q.k_scale, DR)], -1)
        vm = inloop.valid[:, None, :, None]
        torch.testing.assert_close(latent * vm, inloop.keys.double() * vm, atol=0, rtol=0)
        torch.testing.assert_close(
            latent[..., :R] * vm, inloop.values.double() * vm, atol=0, rtol=0
        )
        n = int(stored.valid.sum())  # entries kept over the batch
        payload = width if bits == 8 else math.ceil(R / 2) + math.ceil(DR / 2)
        samples = int((stored.valid.sum(1) > 0).sum())  # samples with entries
        # fp16 scales of the two parts (c_kv, k_pe): per entry, per sample, or per feature
        scales = {"token_head": 2 * n, "head": 2 * samples, "channel": width * samples}
        layer_bytes = n * payload + 2 * scales[granularity]
        assert float(st["kv_bytes"]) == layer_bytes == stored.payload_bytes()
        want = int(split.sum()) * width * 2 / layer_bytes  # 16-bit latent / stored
        assert float(st["kv_reduction"]) == pytest.approx(want, rel=1e-6)
        total += layer_bytes + (2 * n if bool((stored.counts > 1).any()) else 0)  # merge counts
    assert cache.kv_bytes() == total


def test_merging_a_latent_keeps_values_the_keys_first_features() -> None:
    """Under every rescale rule the merged values are the merged latent's first features, the
    c_kv part is merged as the values of a GQA cache are (not rescaled under "k") and the
    key-only k_pe part as its keys."""
    g = torch.Generator().manual_seed(0)
    B, T = 2, 10
    keys = torch.randn(B, 1, T, R + DR, generator=g)
    c, pe = keys[..., :R], keys[..., R:]
    ctx = torch.ones(B, T, dtype=torch.bool)
    t = torch.arange(T).expand(B, T)
    target = torch.where(t % 3 == 1, t - 1, t)  # every third token merged into its left one
    kept = target == t
    plan = TokenPlan(
        kept=kept,
        merged=~kept,
        evicted=torch.zeros_like(kept),
        target=target,
        requested=torch.zeros(B, 3, dtype=torch.long),
        shortfall=torch.zeros(B, 3, dtype=torch.long),
    )
    scores = torch.randn(B, T, generator=g)
    for rule in ("k", "kv", "none"):
        k, v, counts = merge_tokens(keys, c, plan, scores, ctx, rule, latent=True)
        assert torch.equal(v, k[..., :R])
        _, v_gqa, _ = merge_tokens(c, c, plan, scores, ctx, rule)  # c_kv as a GQA value
        k_pe, _, _ = merge_tokens(pe, pe, plan, scores, ctx, rule)  # k_pe as a GQA key
        torch.testing.assert_close(k[..., :R], v_gqa, atol=0, rtol=0)
        torch.testing.assert_close(k[..., R:], k_pe, atol=0, rtol=0)
        assert counts[kept].sum() == B * T


# ------------------------------------------------------------------ the byte report
def test_kv_bytes_report_against_the_source_gqa_cache() -> None:
    model = mla_model(3)
    ids = torch.randint(0, VOCAB, (2, 40))
    split = torch.tensor([40, 31])
    comp = UniCacheCompressor(unicache(0.6, 4))
    gen = generate_compressed(model, ids, split, comp, max_new_tokens=2)
    # A GQA source of the same depth: 2 KV heads of width 16, K and V: 128 bytes / token / layer.
    source = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    report = kv_bytes_report(gen.cache, source=source)
    n = int(split.sum())
    assert report.source_bytes == LAYERS * n * 2 * 2 * 16 * 2
    assert report.baseline_bytes == LAYERS * n * (R + DR) * 2
    assert report.kv_bytes == gen.cache.kv_bytes()  # metadata (merge counts) included
    assert report.reduction_vs_source == report.source_bytes / report.kv_bytes > 8.0
    assert "fewer" in str(report)
    assert kv_bytes_report(gen.cache).source_bytes is None
    # Decoded tokens are held once per latent: R + DR elements per token per layer.
    assert gen.cache.decoded_bytes() == LAYERS * 2 * 1 * (R + DR) * 2  # B=2, 1 decoded, 16 bit


# ------------------------------------------------------------------ what is still refused
def test_unsupported_combinations_fail_with_clear_errors() -> None:
    model = mla_model()
    ids = torch.randint(0, VOCAB, (1, 20))
    token = UniCacheCompressor(unicache(0.5, head_merge=False))
    xkv_tokens = XKVCompressor(XKVConfig(group_size=3), token_compressor=token)
    with pytest.raises(NotImplementedError, match="GQA models only"):
        prefill_compressed(model, ids, 16, xkv_tokens)
    cache, _ = prefill_compressed(model, ids, 16, IdentityCompressor())
    gqa_view = CompressedKVCache(LAYERS)  # a per-head cache cannot hold the latent
    gqa_view.segments = cache.segments
    with torch.no_grad(), pytest.raises(TypeError, match="latent=True"):
        model(ids[:, 16:17], positions=torch.tensor([[16]]), cache=gqa_view)
    with pytest.raises(ValueError, match="no sliding windows"):
        CompressedKVCache(LAYERS, windows=[4, None, None], latent=True)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_loud_rope_key_does_not_flatten_the_latent(bits):
    """c_kv and k_pe get their own scales: with k_pe 50x louder than the normed c_kv, each part's
    error stays within half its own step (max |part| / qmax / 2 per entry), where one shared
    scale would round c_kv to a few levels (int4: mostly to zero)."""
    from unicache_train.compress.quantize import Quantize
    from unicache_train.compress.state import CompressionState
    from unicache_train.seam import CompressionInput

    g = torch.Generator().manual_seed(0)
    B, T = 2, 12
    c_kv = torch.randn(B, 1, T, R, generator=g)
    k_pe = 50 * torch.randn(B, 1, T, DR, generator=g)
    keys = torch.cat([c_kv, k_pe], -1)
    inp = CompressionInput(
        layer_idx=0,
        num_layers=1,
        queries=torch.randn(B, 2, T, R + DR, generator=g),
        keys=keys,
        values=keys[..., :R],
        positions=torch.arange(T).expand(B, T),
        modality_ids=torch.zeros(B, T, dtype=torch.long),
        context_mask=torch.ones(B, T, dtype=torch.bool),
        latent=True,
    )
    state = Quantize(bits=bits)(CompressionState.from_input(inp, 0.0))
    seg = state.segment
    qmax = 2 ** (bits - 1) - 1
    for part, got in ((c_kv, seg.keys[..., :R]), (k_pe, seg.keys[..., R:])):
        step = part.abs().amax(-1, keepdim=True) / qmax  # [B, 1, T, 1]
        assert bool(((got - part).abs() <= step / 2 * (1 + 1e-2) + 1e-6).all())
    assert torch.equal(seg.values, seg.keys[..., :R])
    shared = keys.abs().amax(-1, keepdim=True) / qmax  # what one scale per vector would give
    if bits == 4:
        assert float((torch.round(c_kv / shared) == 0).float().mean()) > 0.8
