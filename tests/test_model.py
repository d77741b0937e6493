"""Decoder: parity with transformers' Llama, decoding cache, compression seam, input checks."""

import pytest
import torch
from conftest import tiny_model_config

from unicache_train.compress import IdentityCompressor
from unicache_train.model import Decoder, KVCache

tiny = tiny_model_config


def _llama_pair(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = tiny(tie_word_embeddings=tie, rope_theta=500.0)
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=tie,
        attention_bias=False,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).eval()
    ours = Decoder(cfg).eval()
    from unicache_train.checkpoint.hf_weights import from_hf_state_dict

    # The importer checks every name and shape (see tests/test_hf_checkpoint.py).
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg, "llama"), strict=True)
    return hf, ours


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers_llama(tie):
    hf, ours = _llama_pair(tie)
    ids = torch.randint(0, 97, (2, 33))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    # fp32, same math in a different op order (SDPA vs eager softmax): ~1e-6 observed.
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_incremental_decoding_matches_full_forward():
    torch.manual_seed(0)
    model = Decoder(tiny()).eval()
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache(model.config.num_hidden_layers)
        step = [model(ids[:, :12], cache=cache).logits]
        step.append(model(ids[:, 12:15], cache=cache).logits)  # a multi-token chunk
        for t in range(15, 20):
            step.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(step, 1), full, atol=1e-5, rtol=1e-5)
    from unicache_train.model.attention import kv_bytes_per_token

    per_tok = kv_bytes_per_token(model.config, bytes_per_element=4)  # fp32 cache
    assert per_tok == 2 * 2 * model.config.head_size * 4  # K and V, 2 KV heads
    assert cache.nbytes() == 2 * 20 * per_tok * model.config.num_hidden_layers  # B=2, T=20


def test_generate_greedy_is_argmax_of_full_forward():
    torch.manual_seed(0)
    model = Decoder(tiny()).eval()
    prompt = torch.randint(0, 97, (3, 7))
    out = model.generate(prompt, 9)
    assert out.shape == (3, 16)
    with torch.no_grad():
        logits = model(out).logits
    assert torch.equal(logits[:, 6:-1].argmax(-1), out[:, 7:])


def test_generate_sampling_and_eos():
    torch.manual_seed(0)
    model = Decoder(tiny()).eval()
    prompt = torch.randint(0, 97, (2, 5))
    g = torch.Generator().manual_seed(1)
    a = model.generate(prompt, 6, temperature=1.0, top_k=5, generator=g)
    g = torch.Generator().manual_seed(1)
    b = model.generate(prompt, 6, temperature=1.0, top_k=5, generator=g)
    assert torch.equal(a, b)
    greedy = model.generate(prompt, 1)
    eos = int(greedy[0, -1])
    stopped = model.generate(prompt, 6, eos_token_id=eos)
    assert stopped[0, 5] == eos and (stopped[0, 5:] == eos).all()


def test_identity_compressor_seam_equals_plain_forward():
    torch.manual_seed(0)
    model = Decoder(tiny())
    ids = torch.randint(0, 97, (3, 24))
    split = torch.tensor([4, 12, 23])
    plain = model(ids).logits
    seamed = model(ids, split=split, compressor=IdentityCompressor())
    # Same math, keys concatenated in a different order inside one SDPA call.
    torch.testing.assert_close(seamed.logits, plain, atol=1e-6, rtol=1e-5)
    assert len(seamed.compression_stats) == model.config.num_hidden_layers


def test_seam_drops_context_for_continuation_only():
    """A compressor that keeps nothing changes continuation logits but not context logits."""
    from unicache_train.seam import KVSegment

    class DropAll:
        pre_rope = False

        def __call__(self, inp):
            return KVSegment(
                inp.keys,
                inp.values,
                inp.positions,
                inp.modality_ids,
                torch.ones_like(inp.positions, dtype=inp.keys.dtype),
                torch.zeros_like(inp.context_mask),
            )

    torch.manual_seed(0)
    model = Decoder(tiny())
    ids = torch.randint(0, 97, (1, 16))
    split = torch.tensor([8])
    plain = model(ids).logits
    dropped = model(ids, split=split, compressor=DropAll()).logits
    torch.testing.assert_close(dropped[:, :8], plain[:, :8], atol=1e-6, rtol=1e-5)
    assert (dropped[:, 8:] - plain[:, 8:]).abs().max() > 1e-3


def test_inputs_embeds_and_modality_ids():
    torch.manual_seed(0)
    model = Decoder(tiny())
    ids = torch.randint(0, 97, (2, 10))
    emb = model.embed_tokens(ids)
    mods = torch.randint(0, 3, (2, 10))
    torch.testing.assert_close(
        model(inputs_embeds=emb, modality_ids=mods).logits, model(ids).logits
    )
    with pytest.raises(ValueError, match="exactly one"):
        model(ids, inputs_embeds=emb)
    with pytest.raises(ValueError, match="split and compressor"):
        model(ids, split=torch.tensor([3, 3]))


def test_tied_embeddings_share_storage():
    m = Decoder(tiny(tie_word_embeddings=True))
    assert m.lm_head.weight is m.embed_tokens.weight
    m = Decoder(tiny(tie_word_embeddings=False))
    assert m.lm_head.weight is not m.embed_tokens.weight
