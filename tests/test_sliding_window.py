"""Sliding-window attention (Mistral, Qwen2 per-layer windows, Gemma 3's local layers): the mask
against transformers' own, import/export parity with transformers at windows smaller than the
sequence, the in-loop forward == step-by-step compressed decoding with windowed layers, and how
the seam accounts for a windowed layer (not compressed, its window's bytes stored)."""

import math

import pytest
import torch

from unicache_train.compress import IdentityCompressor, UniCacheCompressor, UniCacheConfig
from unicache_train.compress.presets import text_style_baseline
from unicache_train.model import Decoder
from unicache_train.model.attention import sliding_causal_mask
from unicache_train.model.config import ModelConfig
from unicache_train.model.generate import decode_teacher_forced, generate_compressed
from unicache_train.seam import RecordingCompressor
from unicache_train.validation import ConfigError

V = 97
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]


def windowed_model(window: int = 6, layer_types=MIXED, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    cfg = ModelConfig(**COMMON, sliding_window=window, layer_types=layer_types)
    return Decoder(cfg).eval()


def test_mask_is_transformers_sliding_window_causal_mask():
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    fn = and_masks(causal_mask_function, sliding_window_overlay(4))
    for past, T, S in [(0, 9, 9), (5, 3, 8), (7, 1, 8)]:
        ours = sliding_causal_mask(T, S, past, 4, torch.device("cpu"))
        ref = torch.tensor(
            [
                [bool(fn(0, 0, torch.tensor(past + i), torch.tensor(j))) for j in range(S)]
                for i in range(T)
            ]
        )
        assert torch.equal(ours, ref)
    # i - W < j <= i: exactly W keys once the window is full
    assert sliding_causal_mask(10, 10, 0, 4, torch.device("cpu")).sum(1).tolist() == (
        [1, 2, 3] + [4] * 7
    )


def test_window_changes_the_forward_and_matches_plain_cached_decoding():
    model = windowed_model()
    ids = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        full = Decoder(ModelConfig(**COMMON)).eval()
        full.load_state_dict(model.state_dict())
        windowed = model(ids).logits
        assert (windowed - full(ids).logits).abs().max() > 1e-3  # the window binds at T=20 > 6
        # the plain KV cache decodes token by token with the same windows
        from unicache_train.model.kv_cache import KVCache

        cache = KVCache(3)
        steps = [model(ids[:, :7], cache=cache).logits]
        steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), windowed, atol=1e-5, rtol=1e-5)


def _hf_sliding(family: str, window: int, path):
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    base = dict(COMMON, rope_theta=500.0)
    if family == "mistral":
        cfg = MistralConfig(**base, sliding_window=window, tie_word_embeddings=False)
    else:
        cfg = Qwen2Config(
            **base,
            use_sliding_window=True,
            sliding_window=window,
            max_window_layers=1,
            tie_word_embeddings=True,
        )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_import_export_parity_with_a_window_smaller_than_the_sequence(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from unicache_train.checkpoint.hf import export_hf, import_hf

    hf = _hf_sliding(family, 5, tmp_path / "src")
    ours, config = import_hf(tmp_path / "src")
    assert config.sliding_window == 5
    want = [True] * 3 if family == "mistral" else [False, True, True]  # max_window_layers=1
    assert [config.is_sliding_layer(i) for i in range(3)] == want
    ids = torch.randint(0, V, (2, 23))
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(ours(ids).logits, ref, atol=1e-5, rtol=1e-5)
    out = export_hf(ours, tmp_path / "out", family=family)
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, atol=1e-5, rtol=1e-5)
    prompt = ids[:, :4]  # generation runs past the window: the caches must slide
    want_tokens = back.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours.generate(prompt, 12), want_tokens)


def unicache(rate: float, bits: int | None = None) -> UniCacheConfig:
    """The text-style preset removing ``rate`` of the context (as tests/test_inloop.py)."""
    d = text_style_baseline().to_dict()
    d["target_rate"] = rate
    d["quantize"].update(bits=bits)
    return UniCacheConfig.from_dict(d)


@pytest.mark.parametrize("case", ["identity", "unicache_0.6", "unicache_0.6_int8"])
def test_inloop_forward_equals_step_by_step_decoding_with_windowed_layers(case):
    model = windowed_model(window=6)
    comp = {
        "identity": IdentityCompressor,
        "unicache_0.6": lambda: UniCacheCompressor(unicache(0.6)),
        "unicache_0.6_int8": lambda: UniCacheCompressor(unicache(0.6, 8)),
    }[case]()
    ids = torch.randint(0, V, (2, 40))
    split = torch.tensor([27, 15])  # contexts longer than the window, continuations too
    with torch.no_grad():
        ref = model(ids, split=split, compressor=comp)
        plain = model(ids).logits
    got, cache = decode_teacher_forced(model, ids, split, comp)
    cont = torch.arange(40)[None, :] >= (split - 1)[:, None]
    assert not torch.isnan(got[cont]).any()
    torch.testing.assert_close(got[cont], ref.logits[cont], atol=1e-5, rtol=1e-5)
    if case == "identity":  # nothing compressed: the in-loop forward is the plain forward
        torch.testing.assert_close(ref.logits, plain, atol=1e-5, rtol=1e-5)
    # windowed layers hold the last W - 1 = 5 context tokens, at a reduction of 1
    per_token = 2 * 2 * 16 * 2  # K and V, 2 KV heads, head dim 16, 16-bit
    for i in (0, 2):
        st = ref.compression_stats[i]
        assert float(st["kv_reduction"]) == 1.0 and float(st["kv_bytes"]) == 2 * 5 * per_token
        assert float(st["rate_realized"]) == 0.0
        assert cache.segments[i].payload_bytes() == 2 * 5 * per_token
    # decoded tokens slide out of the windowed layers' caches
    assert cache.keys[0].shape[2] == 6 and cache.keys[1].shape[2] == 40 - 15  # W; all
    if case != "identity":  # (the identity compressor reports no bytes)
        assert cache.kv_bytes(include_metadata=False) == int(
            sum(float(s["kv_bytes"]) for s in ref.compression_stats)
        )
    # the baseline counts what an uncompressed cache holds: the full layer's whole context, the
    # windowed layers' last W - 1 context tokens
    assert cache.baseline_bytes(16) == (27 + 15 + 2 * 2 * 5) * per_token


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_windows_inloop_equals_decoding_and_counts_quantized_bytes(bits):
    """``quantize.windowed_layers``: a windowed layer stores its window quantized (no token
    removed); continuation queries read the dequantized window in the loop and in decoding."""
    model = windowed_model(window=6)
    cfg = unicache(0.6, bits)
    cfg.quantize.windowed_layers = True
    comp = UniCacheCompressor(cfg)
    plain_comp = UniCacheCompressor(unicache(0.6, bits))
    ids = torch.randint(0, V, (2, 40))
    split = torch.tensor([27, 15])
    with torch.no_grad():
        ref = model(ids, split=split, compressor=comp)
        unquantized = model(ids, split=split, compressor=plain_comp)
    got, cache = decode_teacher_forced(model, ids, split, comp)
    cont = torch.arange(40)[None, :] >= (split - 1)[:, None]
    torch.testing.assert_close(got[cont], ref.logits[cont], atol=1e-5, rtol=1e-5)
    # context queries (prefill) read the unquantized K/V; continuation logits move
    ctx = ~cont
    torch.testing.assert_close(ref.logits[ctx], unquantized.logits[ctx], atol=1e-5, rtol=1e-5)
    assert (ref.logits[cont] - unquantized.logits[cont]).abs().max() > 1e-4
    # bytes, counted independently: 5 window tokens x 2 samples x (K, V) x 2 heads, each a
    # 16-element vector at `bits` plus one fp16 scale
    per_vector = 16 * bits // 8 + 2
    want = 2 * 5 * 2 * 2 * per_vector
    for i in (0, 2):
        st = ref.compression_stats[i]
        assert float(st["kv_bytes"]) == want
        assert float(st["rate_realized"]) == 0.0
        assert float(st["kv_reduction"]) == pytest.approx(2 * 5 * 2 * 2 * 16 * 2 / want)
        assert cache.segments[i].payload_bytes() == want
    assert cache.kv_bytes(include_metadata=False) == int(
        sum(float(s["kv_bytes"]) for s in ref.compression_stats)
    )


def test_windowed_layers_are_not_handed_to_the_compressor():
    model = windowed_model(window=6)
    seen = []

    class Spy(IdentityCompressor):
        def __call__(self, inp):
            seen.append(inp.layer_idx)
            return super().__call__(inp)

    rec = RecordingCompressor(Spy())
    ids = torch.randint(0, V, (1, 20))
    with torch.no_grad():
        model(ids, split=torch.tensor([12]), compressor=rec)
    assert seen == [1]  # the full-attention layer only
    assert sorted(rec.segments) == [0, 1, 2]  # the recorder still has every layer's segment
    assert rec.segments[0].valid[0].nonzero().flatten().tolist() == list(range(7, 12))


def test_greedy_generation_on_compressed_cache_with_windows_matches_inloop():
    model = windowed_model(window=5)
    prompts = torch.randint(0, V, (2, 24))
    split = torch.tensor([24, 17])
    comp = UniCacheCompressor(unicache(0.6, 8))
    gen = generate_compressed(model, prompts, split, comp, max_new_tokens=9).tokens
    for b in range(2):
        s = int(split[b])
        seq = torch.cat([prompts[b, :s], gen[b]])[None]
        with torch.no_grad():
            logits = model(seq, split=split[b : b + 1], compressor=comp).logits
        assert torch.equal(logits[0, s - 1 : -1].argmax(-1), gen[b])


def test_training_step_through_windowed_layers_has_gradients():
    model = windowed_model(window=4).train()
    ids = torch.randint(0, V, (2, 16))
    out = model(ids, split=torch.tensor([9, 12]), compressor=UniCacheCompressor(unicache(0.5)))
    loss = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    assert math.isfinite(float(loss))
    assert all(layer.self_attn.q_proj.weight.grad.abs().sum() > 0 for layer in model.layers)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"layer_types": ["full_attention"] * 2}, "layer_types"),
        ({"layer_types": ["sliding_attention"] * 3}, "sliding_window is None"),
        ({"sliding_window": 4, "layer_types": ["local"] * 3}, "allowed entries"),
    ],
)
def test_window_config_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**COMMON, **kw})


def test_export_refuses_a_window_the_family_cannot_hold(tmp_path):
    from unicache_train.checkpoint.hf import export_hf
    from unicache_train.checkpoint.hf_config import HFCheckpointError

    with pytest.raises(HFCheckpointError, match="llama has no sliding window"):
        export_hf(windowed_model(), tmp_path / "a", family="llama")
    with pytest.raises(HFCheckpointError, match="mistral slides every layer"):
        export_hf(windowed_model(), tmp_path / "b", family="mistral")
    torch.manual_seed(0)
    mhc = Decoder(ModelConfig(**COMMON, sliding_window=6, residual_mode="mhc"))
    with pytest.raises(HFCheckpointError, match="mHC remote code has no sliding-window"):
        export_hf(mhc, tmp_path / "c")


def test_transformers_compressed_cache_refuses_windowed_exports(tmp_path):
    from unicache_train.checkpoint.hf import export_hf
    from unicache_train.transformers_cache import CompressedCache

    out = export_hf(windowed_model(), tmp_path / "q", family="qwen2", tokenizer_from="byte")
    with pytest.raises(NotImplementedError, match="sliding-window layers"):
        CompressedCache.from_pretrained(out)


def test_lightning_module_compressed_loss_with_windowed_layers():
    """The training objective (LMModule.compressed_loss, KL term, metrics) runs on a windowed
    model; the windowed layers log kv_reduction 1 and rate 0, the full layer compresses."""
    from unicache_train.monitor.metrics import compression_metrics
    from unicache_train.train.config import CompressionTrainConfig, RunConfig
    from unicache_train.train.module import LMModule

    cfg = RunConfig(
        model=ModelConfig(**COMMON, sliding_window=6, layer_types=MIXED),
        compress=CompressionTrainConfig(enabled=True, unicache=unicache(0.6, 8), kl_weight=0.5),
    )
    torch.manual_seed(0)
    m = LMModule(cfg)
    ids = torch.randint(0, V, (2, 33))
    b = {
        "input_ids": ids[:, :-1],
        "labels": ids[:, 1:],
        "split": torch.tensor([20, 14]),
        "modality_ids": torch.zeros(2, 32, dtype=torch.long),
    }
    loss, _, per_layer = m.compressed_loss(b, step=0)
    loss.backward()
    assert math.isfinite(float(loss))
    metrics = compression_metrics(per_layer)
    assert metrics["compress/kv_reduction/layer_00"] == 1.0
    assert metrics["compress/kv_reduction/layer_01"] > 2.0
    assert metrics["compress/rate_realized/layer_02"] == 0.0
