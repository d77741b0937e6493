"""One compressed decoding path (issue 37 item 1): every decoder of this package (our GQA
attention with or without sliding windows or Gemma's logit softcap, MLA's absorbed attention)
reads a :class:`~unicache_train.model.compressed_cache.CompressedKVCache` through ``attend``
only; each decode path gives the in-loop forward's (and the reference path's) logits on our own
loop; the one-time dequantization is paid in the prefill, never in a decode step.
(Stock transformers ``generate()``: tests/test_transformers_cache.py.)"""

import pytest
import torch

import unicache_train.model.compressed_cache as cc
import unicache_train.ops.decode_attention as ops
from unicache_train.compress import UniCacheCompressor, UniCacheConfig
from unicache_train.compress.config import XKVConfig
from unicache_train.compress.presets import snapkv, text_style_baseline
from unicache_train.compress.xkv import XKVCompressor
from unicache_train.model import Decoder
from unicache_train.model.compressed_cache import CompressedKVCache, StoredSegment
from unicache_train.model.config import ModelConfig
from unicache_train.model.generate import decode_teacher_forced, generate_compressed
from unicache_train.model.generate import prefill_compressed as prefill

V = 97
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=500.0,
    initializer_range=0.1,  # logits of std ~1: 1e-5 is a real check
)
GEMMA = dict(
    head_dim=16,
    qk_norm=True,
    block_style="gemma3",
    sliding_window=6,
    rope_local_theta=100.0,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=20.0,
)
MODELS = {
    "gqa": dict(),
    "windowed": GEMMA,
    "softcap": dict(GEMMA, attn_logit_softcapping=0.5),
    "mla": dict(
        num_key_value_heads=4,
        attention_type="mla",
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
    ),
}
PATHS = ("auto", "packed", "int8", "buffer")


def model_of(kind: str) -> Decoder:
    torch.manual_seed(0)
    return Decoder(ModelConfig(**{**COMMON, **MODELS[kind]})).eval()


def unicache(bits: int) -> UniCacheCompressor:
    d = text_style_baseline().to_dict()
    d["target_rate"] = 0.6
    d["quantize"].update(bits=bits)
    return UniCacheCompressor(UniCacheConfig.from_dict(d))


COMPRESSORS = {
    "int4": lambda: unicache(4),
    "int8": lambda: unicache(8),
    "xkv": lambda: XKVCompressor(XKVConfig(group_size=3, rank_mode="reduction", reduction=4.0)),
    "global": lambda: global_snapkv(),
}


def global_snapkv() -> UniCacheCompressor:
    """SnapKV with one budget over all layers, int4 (a cross-layer compressor)."""
    d = snapkv().to_dict()
    d["target_rate"] = 0.6
    d["selection"]["window"] = 4
    d["schedule"]["global_budget"] = True
    d["quantize"].update(bits=4)
    return UniCacheCompressor(UniCacheConfig.from_dict(d))


class Counter:
    """Counts calls of the functions that turn a stored segment into float K/V or int8 rows."""

    def __init__(self, monkeypatch) -> None:
        self.calls: dict[str, int] = {}
        for owner, name in [
            (StoredSegment, "kv"),
            (StoredSegment, "_reconstruct"),
            (cc, "dequantize"),
            (cc, "_int4_rows"),
            (ops, "dequantize"),
            (CompressedKVCache, "prepare"),
        ]:
            self._wrap(monkeypatch, owner, name)

    def _wrap(self, monkeypatch, owner, name: str) -> None:
        fn = getattr(owner, name)
        self.calls[name] = 0

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    def total(self) -> int:
        return sum(self.calls.values())


def _attend_only(monkeypatch) -> list[int]:
    """Make the per-step reference path raise and count ``attend`` calls per layer."""
    layers: list[int] = []
    attend = CompressedKVCache.attend

    def counted(self, layer_idx, *args, **kwargs):
        layers.append(layer_idx)
        return attend(self, layer_idx, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("a decoder dequantized and concatenated per step")

    monkeypatch.setattr(CompressedKVCache, "attend", counted)
    monkeypatch.setattr(CompressedKVCache, "_reference_kv", refused)
    return layers


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("comp", list(COMPRESSORS))
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_decoder_reads_through_attend_and_equals_the_inloop_forward(
    kind, comp, path, monkeypatch
):
    """Our loop on each model kind, each compressor, each decode path: the decode steps call
    ``attend`` (one call per layer per token) and never the per-step reference; their logits
    equal the in-loop forward's and ``decode_path="reference"``'s to 1e-5 (fp32)."""
    if comp in ("xkv", "global") and kind in ("windowed", "softcap"):
        pytest.skip("cross-layer compressors on sliding-window models: not implemented")
    model = model_of(kind)
    compressor = COMPRESSORS[comp]()
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(1))
    split = torch.tensor([21, 13])  # longer than the window, ragged
    with torch.no_grad():
        inloop = model(ids, split=split, compressor=compressor).logits
    want, _ = decode_teacher_forced(model, ids, split, compressor, decode_path="reference")
    layers = _attend_only(monkeypatch)
    got, cache = decode_teacher_forced(model, ids, split, compressor, decode_path=path)
    cont = torch.arange(30)[None, :] >= (split - 1)[:, None]
    torch.testing.assert_close(got[cont], inloop[cont], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[cont], want[cont], atol=1e-5, rtol=1e-5)
    steps = 30 - int(split.min())
    assert sorted(layers) == sorted(list(range(3)) * steps)
    taken = {w["path"] for w in cache._work}
    if kind in ("softcap", "mla") or comp == "xkv":  # the packed paths step aside
        assert taken <= {"buffer", "window"}
    if kind in ("windowed", "softcap"):
        assert cache._work[0]["path"] == cache._work[2]["path"] == "window"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", list(MODELS))
def test_the_prefill_pays_the_dequantization_not_the_decode_steps(kind, path, monkeypatch):
    """After the prefill, decode steps (the first included) neither dequantize, rebuild nor
    unpack a segment, nor prepare a layer: zero calls. The reference path, for contrast,
    dequantizes every layer at every step."""
    model = model_of(kind)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(2))
    for p in (path, "reference"):
        cache, logits = prefill(model, ids, torch.tensor([18, 11]), unicache(4), decode_path=p)
        counter = Counter(monkeypatch)
        with torch.no_grad():
            for i in range(3):
                tok = logits.argmax(-1, keepdim=True)  # [B, 1]
                pos = torch.tensor([[18 + i], [11 + i]])
                logits = model(tok, positions=pos, cache=cache).logits[:, 0]
        if p == "reference":
            assert counter.calls["kv"] == 3 * 3
        else:
            assert counter.total() == 0, counter.calls
        monkeypatch.undo()


def test_generated_tokens_agree_across_decode_paths():
    """Greedy generation on our loop: every decode path gives the reference path's tokens."""
    model = model_of("gqa")
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))
    split = torch.tensor([20, 14])
    runs = {
        p: generate_compressed(model, ids, split, unicache(4), 8, decode_path=p)
        for p in (*PATHS, "reference")
    }
    for p in PATHS:
        assert torch.equal(runs[p].tokens, runs["reference"].tokens), p
        assert runs[p].cache.kv_bytes() == runs["reference"].cache.kv_bytes()
        assert runs[p].cache.decoded_bytes() == runs["reference"].cache.decoded_bytes()


def test_update_is_not_part_of_the_compressed_cache_api():
    cache = CompressedKVCache(1)
    with pytest.raises(TypeError, match=r"read through attend\("):
        cache.update(0, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))


def test_softcap_on_a_packed_segment_takes_the_buffer_and_is_applied():
    """A packed segment read with a softcap: even ``decode_path="packed"`` takes the buffer
    (the packed kernels compute plain softmax), equal to the reference with the softcap, and
    not to attention without it."""
    model = model_of("gqa")
    ids = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(4))
    outs = {}
    for p in ("packed", "reference"):
        cache, _ = prefill(model, ids, 16, unicache(4), decode_path=p)
        for i in range(3):
            cache.prepare(i, torch.float32, softcap=0.3)
        g = torch.Generator().manual_seed(5)
        q = torch.randn(1, 4, 1, 16, generator=g)
        k, v = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
        outs[p] = cache.attend(0, q, k, v, scale=0.25, softcap=0.3)
        assert cache._work[0]["path"] == ("buffer" if p == "packed" else "reference")
    torch.testing.assert_close(outs["packed"], outs["reference"], atol=1e-6, rtol=0)
    plain, _ = prefill(model, ids, 16, unicache(4), decode_path="reference")
    assert (plain.attend(0, q, k, v, scale=0.25) - outs["packed"]).abs().max() > 1e-3
