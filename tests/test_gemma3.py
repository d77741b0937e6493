"""The Gemma 3 text family (``gemma3_text``, Gemma3ForCausalLM): import, export and greedy
generation equal to transformers on tiny random configs (its (1 + w) norms, four norms per layer,
GeGLU, scaled embeddings, query_pre_attn_scalar, local RoPE base, interleaved sliding layers,
softcaps, tied embeddings), a few training steps, and compressed decoding == the in-loop forward."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from unicache_train.checkpoint.hf import export_hf, import_hf  # noqa: E402
from unicache_train.checkpoint.hf_config import HFCheckpointError  # noqa: E402
from unicache_train.compress import UniCacheCompressor, UniCacheConfig  # noqa: E402
from unicache_train.compress.presets import text_style_baseline  # noqa: E402
from unicache_train.model import Decoder  # noqa: E402
from unicache_train.model.config import ModelConfig  # noqa: E402
from unicache_train.model.generate import decode_teacher_forced  # noqa: E402
from unicache_train.validation import ConfigError  # noqa: E402

V = 101


def _hf_gemma3(path, **kw):
    """A tiny random Gemma3ForCausalLM with random norm gains, saved with save_pretrained."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        **{
            "vocab_size": V,
            "hidden_size": 48,
            "intermediate_size": 80,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 24,
            "max_position_embeddings": 128,
            "sliding_window": 5,
            "query_pre_attn_scalar": 20,
            "layer_types": [
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 7000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 300.0},
            },
            "pad_token_id": 0,
            "bos_token_id": 2,
            "eos_token_id": 1,
            **kw,
        }
    )
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # zero-init norms would hide a missing "1 +"
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize(
    "caps",
    # attn_logit_softcapping: transformers' Gemma3 attention ignores it (only Gemma 2 applies
    # it), so the import drops it and the logits still match.
    [{}, {"attn_logit_softcapping": 3.0, "final_logit_softcapping": 2.5}],
    ids=["no_softcap", "softcaps"],
)
def test_import_export_generate_match_transformers(caps, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = _hf_gemma3(tmp_path / "src", **caps)
    ours, config = import_hf(tmp_path / "src")
    assert config.block_style == "gemma3" and config.tie_word_embeddings
    assert [config.is_sliding_layer(i) for i in range(4)] == [True, True, False, True]
    assert (config.rope_theta, config.rope_local_theta) == (7000.0, 300.0)
    assert config.attn_logit_softcapping is None
    assert config.final_logit_softcapping == caps.get("final_logit_softcapping")
    ids = torch.randint(0, V, (2, 17))  # longer than the window
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert float((got - ref).abs().max()) <= 1e-5
    out = export_hf(ours, tmp_path / "out", family="gemma3_text")
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        assert float((back(ids).logits - ref).abs().max()) <= 1e-5
    prompt = ids[:, :3]
    want = hf.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(ours.generate(prompt, 10), want)


def test_legacy_rope_keys_import(tmp_path):
    """GGUF conversions and older configs write rope_theta / rope_local_base_freq."""
    import json

    _hf_gemma3(tmp_path / "src")
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=7000.0, rope_local_base_freq=300.0)
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    _, config = import_hf(tmp_path / "src")
    assert (config.rope_theta, config.rope_local_theta) == (7000.0, 300.0)


def gemma_config(**kw) -> ModelConfig:
    return ModelConfig(
        **{
            "vocab_size": V,
            "hidden_size": 48,
            "intermediate_size": 80,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 24,
            "qk_norm": True,
            "block_style": "gemma3",
            "sliding_window": 6,
            "rope_local_theta": 100.0,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 20.0,
            **kw,
        }
    )


def test_attention_softcap_equals_the_eager_reference():
    """Our attention softcap (Gemma 2's form, transformers' eager_attention_forward) written out
    by hand: logits * scale -> cap * tanh(. / cap) -> window mask -> softmax."""
    torch.manual_seed(0)
    model = Decoder(gemma_config(attn_logit_softcapping=0.5)).eval()
    attn = model.layers[0].self_attn  # sliding, window 6
    x = torch.randn(1, 9, 48)
    rope = model.rotary_local(torch.arange(9)[None], torch.float32)
    qkv = attn.project(x, rope)
    k = qkv.k.repeat_interleave(2, 1)
    v = qkv.v.repeat_interleave(2, 1)
    logits = qkv.q @ k.transpose(-1, -2) * 20.0**-0.5
    logits = 0.5 * torch.tanh(logits / 0.5)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    logits = logits.masked_fill(~((j <= i) & (j > i - 6)), float("-inf"))
    want = attn.o_proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(1, 9, -1))
    got = attn(x, rope, torch.arange(9)[None], torch.zeros(1, 9, dtype=torch.long))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_training_steps_lower_the_loss_and_export(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = Decoder(gemma_config(final_logit_softcapping=4.0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, V, (4, 24))
    losses = []
    for _ in range(6):
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert all(p.grad is not None for p in model.parameters())  # every norm is used
    model.eval()
    out = export_hf(model, tmp_path / "out", family="gemma3_text")
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert float((back(ids).logits - model(ids).logits).abs().max()) <= 1e-5


def test_compressed_decoding_equals_inloop_forward():
    torch.manual_seed(0)
    model = Decoder(gemma_config()).eval()
    d = text_style_baseline().to_dict()
    d["target_rate"] = 0.5
    d["quantize"].update(bits=8)
    comp = UniCacheCompressor(UniCacheConfig.from_dict(d))
    ids = torch.randint(0, V, (2, 30))
    split = torch.tensor([20, 13])
    with torch.no_grad():
        ref = model(ids, split=split, compressor=comp).logits
    got, _ = decode_teacher_forced(model, ids, split, comp)
    cont = torch.arange(30)[None, :] >= (split - 1)[:, None]
    torch.testing.assert_close(got[cont], ref[cont], atol=1e-5, rtol=1e-5)


def test_config_and_export_errors(tmp_path):
    with pytest.raises(ConfigError, match="qk_norm=True"):
        gemma_config(qk_norm=False)
    with pytest.raises(ConfigError, match="block_style"):
        gemma_config(block_style="gemma2")
    with pytest.raises(HFCheckpointError, match="gemma3_text"):
        export_hf(Decoder(gemma_config()), tmp_path / "a", family="qwen3")
    with pytest.raises(HFCheckpointError, match="ignores attn_logit_softcapping"):
        export_hf(
            Decoder(gemma_config(attn_logit_softcapping=5.0)), tmp_path / "b", family="gemma3_text"
        )
    _hf_gemma3(tmp_path / "src")
    import json

    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    cfg["hidden_activation"] = "gelu"
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="hidden_activation='gelu'"):
        import_hf(tmp_path / "src")


# ------------------------------------------------------------------ the real Gemma 3 270M
def _gemma3_dir():
    from unicache_train.checkpoint.gguf import CheckpointNotFetched, fetched_dir

    try:
        return fetched_dir("gemma3")
    except CheckpointNotFetched as err:
        pytest.skip(str(err))


@pytest.mark.slow  # a 270M model with a 262k vocabulary on CPU (about a minute)
@torch.no_grad()
def test_real_gemma3_270m_import_matches_transformers():
    """The Q4_K_M GGUF dequantized by transformers (``unicache-train fetch --name gemma3``):
    our import against transformers' Gemma3ForCausalLM on the same weights, on a prompt longer
    than the 512-token window, and greedy generation."""
    from transformers import AutoModelForCausalLM

    from unicache_train.data.reference_text import reference_documents
    from unicache_train.data.tokenizer import load_tokenizer

    path = _gemma3_dir()
    ours, config = import_hf(path)
    assert (config.num_hidden_layers, config.hidden_size, config.head_size) == (18, 640, 256)
    assert config.sliding_window == 512 and config.block_style == "gemma3"
    assert sum(config.is_sliding_layer(i) for i in range(18)) == 15
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = load_tokenizer(str(path))
    text = "\n\n".join(reference_documents("heldout"))
    ids = torch.tensor([tok.encode(text, add_bos=True)[:600]])  # > the window
    a, b = ours(ids).logits, ref(ids).logits
    assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    prompt = torch.tensor([tok.encode("The capital of France is", add_bos=True)])
    want = ref.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(ours.generate(prompt, 12), want)


@pytest.mark.slow  # the real 270M model on CPU
@torch.no_grad()
def test_real_gemma3_270m_compressed_decoding_equals_inloop_forward():
    """On the real model (15 windowed layers, 3 compressed global ones): one recall record's
    continuation decoded step by step on the compressed cache equals the in-loop forward."""
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval import RecallTask, recall_records
    from unicache_train.eval.budget import text_unicache

    path = _gemma3_dir()
    model, _ = import_hf(path)
    tok = load_tokenizer(str(path))
    rec = recall_records(RecallTask(pairs=8), 1, 1_000_003)[0]
    ctx = tok.encode(rec["context"], add_bos=True)
    ids = torch.tensor([ctx + tok.encode(rec["question"] + " " + rec["answer"])])
    split = torch.tensor([len(ctx)])
    comp = UniCacheCompressor(text_unicache(0.5, 0, "int8"))
    ref = model(ids, split=split, compressor=comp).logits[0, len(ctx) - 1 :]
    got, _ = decode_teacher_forced(model, ids, split, comp)
    got = got[0, len(ctx) - 1 :]
    assert float((got - ref).abs().max()) <= 1e-4 * float(ref.abs().max())  # 7e-7 seen
