"""MLA: parity with transformers' DeepseekV3, absorbed decoding, latent cache, compression seam,
DeepseekV3 export/import, GQA -> MLA conversion."""

import json

import pytest
import torch

from unicache_train.compress import IdentityCompressor
from unicache_train.model import Decoder, KVCache
from unicache_train.model.attention import kv_bytes_per_token
from unicache_train.model.config import ModelConfig
from unicache_train.model.kv_cache import LatentKVCache, new_kv_cache
from unicache_train.seam import KVSegment, RecordingCompressor

VOCAB = 97


def mla_config(**kw) -> ModelConfig:
    # initializer_range 0.2 gives O(1) logits, so a 1e-5 tolerance is a real check.
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_type="mla",
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_theta=500.0,
        initializer_range=0.2,
    )
    base.update(kw)
    return ModelConfig(**base)


def _hf_deepseek(q_lora_rank, rope_interleave: bool, tie: bool):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=2,
        n_routed_experts=1,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=1,
        rope_interleave=rope_interleave,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        max_position_embeddings=128,
        num_mtp_layers=0,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norm gains, so a wrong eps or a skipped norm shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf


# ------------------------------------------------------------------------ transformers parity
@pytest.mark.parametrize(
    "q_lora_rank,interleave,tie", [(None, True, False), (24, True, True), (24, False, False)]
)
def test_import_export_parity_with_transformers_deepseek_v3(tmp_path, q_lora_rank, interleave, tie):
    """HF -> ours -> HF: logits equal (<= 1e-5) both ways; greedy generation equal."""
    from transformers import DeepseekV3ForCausalLM

    from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3, import_deepseek_v3

    hf = _hf_deepseek(q_lora_rank, interleave, tie)
    hf.save_pretrained(tmp_path / "hf")
    ours = import_deepseek_v3(tmp_path / "hf")
    assert ours.config.q_lora_rank == q_lora_rank
    ids = torch.randint(0, VOCAB, (2, 21))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert ref.abs().mean() > 0.3  # not a vacuous comparison
    # Same ops in the same order (SDPA both sides): ~0 observed; 1e-5 is the contract.
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)

    export_deepseek_v3(ours, tmp_path / "ours")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["rope_interleave"] is True and cfg["first_k_dense_replace"] == 2
    assert isinstance(cfg["n_routed_experts"], int)
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, got, atol=1e-5, rtol=1e-5)
    prompt = ids[:, :6]
    back.generation_config.eos_token_id = None  # 8 free-running tokens (the export's copied
    # generation_config.json would stop at the source's eos, as transformers on the source does)
    hf_gen = back.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 8), hf_gen)


def test_export_roundtrip_state_dict(tmp_path):
    from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3, import_deepseek_v3

    torch.manual_seed(0)
    model = Decoder(mla_config(q_lora_rank=12))
    back = import_deepseek_v3(export_deepseek_v3(model, tmp_path))
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_tied_export_writes_the_head_for_engines_that_never_tie(tmp_path):
    """vLLM's DeepseekV2/V3 never ties lm_head to the embedding and serves an all-zero head when
    the file lacks it (measured: token 0 forever); a tied export writes the head's copy."""
    from safetensors.torch import load_file

    from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3, import_deepseek_v3

    torch.manual_seed(0)
    model = Decoder(mla_config(tie_word_embeddings=True))
    out = export_deepseek_v3(model, tmp_path)
    sd = load_file(str(out / "model.safetensors"))
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    back = import_deepseek_v3(out)
    assert back.lm_head.weight is back.embed_tokens.weight  # still tied after import
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)


def test_export_errors_name_the_field(tmp_path):
    from unicache_train.checkpoint.deepseek_v3 import (
        DeepseekV3ExportError,
        export_deepseek_v3,
        from_deepseek_v3_config,
        to_deepseek_v3_config,
    )

    gqa = Decoder(
        ModelConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(DeepseekV3ExportError, match="attention_type='gqa'"):
        export_deepseek_v3(gqa, tmp_path)
    with pytest.raises(DeepseekV3ExportError, match="attention_bias"):
        export_deepseek_v3(Decoder(mla_config(attention_bias=True)), tmp_path)
    with pytest.raises(DeepseekV3ExportError, match="residual_mode='mhc'"):
        to_deepseek_v3_config(mla_config(residual_mode="mhc", hc_mult=2))
    good = to_deepseek_v3_config(mla_config())
    # MoE layers import (tests/test_moe.py), but not the dense export's placeholder expert.
    with pytest.raises(DeepseekV3ExportError, match="n_routed_experts=1 / n_group=1"):
        from_deepseek_v3_config({**good, "first_k_dense_replace": 1})
    # YaRN (with mscale) imports: tests/test_rope_scaling.py; other types are named.
    longrope = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 500.0}
    with pytest.raises(DeepseekV3ExportError, match="rope_type='longrope' is not implemented"):
        from_deepseek_v3_config({**good, "rope_parameters": longrope})
    with pytest.raises(DeepseekV3ExportError, match="rope_type='su' is not implemented"):
        from_deepseek_v3_config({**good, "rope_parameters": None, "rope_scaling": {"type": "su"}})


# ------------------------------------------------------------------------ decoding and cache
@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_absorbed_decoding_matches_expanded_forward(q_lora_rank):
    torch.manual_seed(0)
    model = Decoder(mla_config(q_lora_rank=q_lora_rank)).eval()
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        full = model(ids).logits  # expanded K/V, causal SDPA
        cache = new_kv_cache(model.config)
        assert isinstance(cache, LatentKVCache)
        steps = [model(ids[:, :1], cache=cache).logits]  # then everything below is absorbed
        steps.append(model(ids[:, 1:6], cache=cache).logits)  # a multi-token absorbed chunk
        for t in range(6, 20):
            steps.append(model(ids[:, t : t + 1], cache=cache).logits)
        prefilled = new_kv_cache(model.config)
        chunks = [model(ids[:, :12], cache=prefilled).logits]  # expanded prefill
        chunks += [model(ids[:, t : t + 1], cache=prefilled).logits for t in range(12, 20)]
    # Absorption reassociates the products (q·W_uk)·c vs q·(W_uk·c): ~5e-6 observed.
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)

    cfg = model.config
    per_tok = kv_bytes_per_token(cfg, bytes_per_element=4)  # fp32 cache
    assert per_tok == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert cache.nbytes() == per_tok * 2 * 20 * cfg.num_hidden_layers  # B=2, T=20
    assert cache.c_kv[0].shape == (2, 1, 20, cfg.kv_lora_rank)
    assert cache.k_pe[0].shape == (2, 1, 20, cfg.qk_rope_head_dim)


def test_generate_uses_latent_cache_and_matches_argmax():
    torch.manual_seed(0)
    model = Decoder(mla_config()).eval()
    prompt = torch.randint(0, VOCAB, (3, 7))
    out = model.generate(prompt, 9)
    with torch.no_grad():
        logits = model(out).logits
    assert torch.equal(logits[:, 6:-1].argmax(-1), out[:, 7:])
    with pytest.raises(TypeError, match="LatentKVCache"):
        model(prompt, cache=KVCache(model.config.num_hidden_layers))


# ------------------------------------------------------------------------ compression seam
def test_identity_compressor_on_latent_equals_plain_forward():
    torch.manual_seed(0)
    model = Decoder(mla_config())
    ids = torch.randint(0, VOCAB, (3, 24))
    split = torch.tensor([4, 12, 23])
    seen = []

    class Spy(IdentityCompressor):
        def __call__(self, inp):
            seen.append((inp.keys.shape, inp.values.shape, inp.queries.shape))
            return super().__call__(inp)

    plain = model(ids).logits
    seamed = model(ids, split=split, compressor=Spy())
    torch.testing.assert_close(seamed.logits, plain, atol=1e-5, rtol=1e-5)
    cfg = model.config
    R, Dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    assert seen[0] == ((3, 1, 24, R + Dr), (3, 1, 24, R), (3, 4, 24, R + Dr))
    assert len(seamed.compression_stats) == cfg.num_hidden_layers
    plain.sum().backward()  # the seam stays differentiable
    model.zero_grad()
    seamed.logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_seam_absorbed_queries_give_the_model_logits():
    """queries · keys on the latent (what a compressor sees) equal the expanded q · k."""
    from unicache_train.model.rope import apply_rope

    torch.manual_seed(0)
    model = Decoder(mla_config())
    attn = model.layers[0].self_attn
    x = torch.randn(1, 10, 64)
    rope = model.rotary(torch.arange(10)[None], x.dtype)
    q_nope, q_pe = attn._queries(x, rope)  # [1, H, 10, Dn], [1, H, 10, Dr]
    c_kv, k_pe_raw = attn._latents(x)
    k_pe = apply_rope(k_pe_raw, *rope)
    k, _ = attn._expand(c_kv, k_pe, c_kv)  # [1, H, 10, Dn + Dr]
    expanded = torch.cat([q_nope, q_pe], -1) @ k.transpose(-1, -2)
    latent = torch.cat([c_kv, k_pe], -1)  # [1, 1, 10, R + Dr]
    absorbed = torch.cat([attn.absorb_query(q_nope), q_pe], -1) @ latent.transpose(-1, -2)
    torch.testing.assert_close(absorbed, expanded, atol=1e-4, rtol=1e-5)


def test_seam_pre_rope_and_dropping_context():
    """A pre-RoPE identity gives the plain forward; dropping the latent segment changes only the
    continuation."""

    class PreRopeIdentity(IdentityCompressor):
        pre_rope = True

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
    model = Decoder(mla_config())
    ids = torch.randint(0, VOCAB, (2, 16))
    split = torch.tensor([8, 5])
    plain = model(ids).logits
    pre = model(ids, split=split, compressor=PreRopeIdentity()).logits
    torch.testing.assert_close(pre, plain, atol=1e-5, rtol=1e-5)
    dropped = model(ids, split=split, compressor=DropAll()).logits
    torch.testing.assert_close(dropped[0, :8], plain[0, :8], atol=1e-5, rtol=1e-5)
    assert (dropped[0, 8:] - plain[0, 8:]).abs().max() > 1e-3


# ------------------------------------------------------------------------ GQA -> MLA
def _trained_gqa() -> tuple[Decoder, torch.Tensor]:
    """A small GQA model briefly trained on a structured synthetic stream (repeating patterns
    with position-dependent structure), so attention is not random."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1000.0,
    )
    model = Decoder(cfg)
    base = torch.randint(0, VOCAB, (64, 8))
    data = torch.cat([base.repeat(1, 4), torch.randint(0, VOCAB, (64, 8))], dim=1)  # [64, 40]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(60):
        batch = data[(step * 16) % 64 : (step * 16) % 64 + 16]
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), data


def test_conversion_beats_random_init_and_cuts_kv():
    from unicache_train.model.convert_mla import convert_to_mla_with_report

    src, data = _trained_gqa()
    calib, held_out = data[:48], data[48:]
    with torch.no_grad():
        ref = src(held_out).logits
    # Source: 2 KV heads x 16 dims x (K + V) = 64 elements; target 12 + 4 = 16 (4x).
    variants = {
        "svd": {},
        "random": dict(init="random"),
        "unweighted": dict(weighting="none"),
        "drop_rope": dict(rotation="drop"),
    }
    mse = {}
    for name, kw in variants.items():
        mla, report = convert_to_mla_with_report(
            src, calib, kv_lora_rank=12, qk_rope_head_dim=4, **kw
        )
        assert mla.config.attention_type == "mla"
        assert report.kv_elements_before == 64 and report.kv_elements_after == 16
        with torch.no_grad():
            mse[name] = (mla(held_out).logits - ref).pow(2).mean().item()
    # Observed: svd 0.11, random 1.47, unweighted 0.31, drop_rope 0.15.
    assert mse["svd"] < 0.2 * mse["random"], mse
    # The two refinements over plain joint SVD + RoPE removal each pay.
    assert mse["svd"] < 0.6 * mse["unweighted"], mse
    assert mse["svd"] < 0.9 * mse["drop_rope"], mse


def test_conversion_rope_head_is_exact_for_mqa():
    """MQA source, Dr = D: the whole key fits the shared RoPE head, so the converted attention
    logits equal the source's (RoRoPE, frequency ladder, rotate-half layout and the softmax
    scale fix are exact); only values pass through the normed latent. With Dr < D the kept
    frequencies are exactly source frequencies (one rope_theta)."""
    from unicache_train.model.convert_mla import convert_to_mla_with_report
    from unicache_train.model.rope import apply_rope

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.2,
    )
    src = Decoder(cfg).eval()
    ids = torch.randint(0, VOCAB, (8, 24))
    mla, report = convert_to_mla_with_report(src, ids, kv_lora_rank=32, qk_rope_head_dim=16)
    assert report.rope_stride == 1 and report.layers[0].rope_key_energy == pytest.approx(1.0)

    x = torch.randn(1, 24, 32)
    pos = torch.arange(24)[None]
    a, m = src.layers[0].self_attn, mla.layers[0].self_attn
    rope_s, rope_m = src.rotary(pos, x.dtype), mla.rotary(pos, x.dtype)
    with torch.no_grad():
        q = apply_rope(a.q_proj(x).view(1, 24, 2, 16).transpose(1, 2), *rope_s)
        k = apply_rope(a.k_proj(x).view(1, 24, 1, 16).transpose(1, 2), *rope_s)
        ref = q @ k.transpose(-1, -2) / 16**0.5  # [1, 2, 24, 24]
        q_nope, q_pe = m._queries(x, rope_m)
        c_kv, k_pe = m._latents(x)
        keys, _ = m._expand(c_kv, apply_rope(k_pe, *rope_m), c_kv)
        got = torch.cat([q_nope, q_pe], -1) @ keys.transpose(-1, -2) * m.scaling
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        rel = (mla(ids).logits - src(ids).logits).pow(2).mean() / src(ids).logits.pow(2).mean()
    # Values: the per-token RMSNorm of the latent is the one approximation left (~3%).
    assert rel < 0.1, rel

    mla, report = convert_to_mla_with_report(src, ids, kv_lora_rank=8, qk_rope_head_dim=4)
    assert mla.config.rope_theta == pytest.approx(cfg.rope_theta ** (report.rope_stride / 4))
    torch.testing.assert_close(mla.rotary.inv_freq, src.rotary.inv_freq[report.kept_frequencies])


def test_unicache_pipeline_runs_on_the_latent_cache():
    """The full UniCache compressor (merge/evict + int8) accepts MLA's single latent head."""
    from unicache_train.compress import UniCacheCompressor, UniCacheConfig

    torch.manual_seed(0)
    model = Decoder(mla_config(initializer_range=0.02))
    ids = torch.randint(0, VOCAB, (2, 40))
    out = model(ids, split=torch.tensor([30, 24]), compressor=UniCacheCompressor(UniCacheConfig()))
    assert out.compression_stats[0]["rate_realized"] > 0
    out.logits.float().pow(2).mean().backward()
    assert torch.isfinite(model.layers[0].self_attn.kv_a_proj_with_mqa.weight.grad).all()


def test_latent_bytes_count_c_kv_once_in_the_uncompressed_cache():
    """The uncompressed latent cache holds ``c_kv`` once (``kv_bytes_per_token``, the stats'
    baseline); so does an untouched segment, and so does a merged UniCache segment: merging keeps
    V = K[..., :R] (tests/test_mla_compressed_decoding.py decodes on it)."""
    from unicache_train.compress import UniCacheCompressor, UniCacheConfig
    from unicache_train.compress.config import QuantizeConfig

    torch.manual_seed(0)
    cfg = mla_config(initializer_range=0.02)
    R, Dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    assert kv_bytes_per_token(cfg) == (R + Dr) * 2
    model = Decoder(cfg)
    ids = torch.randint(0, VOCAB, (2, 40))
    split = torch.tensor([30, 24])
    n_ctx = int(split.sum())
    plain = QuantizeConfig(bits=None)
    rate0 = UniCacheCompressor(UniCacheConfig(rate_scale=0.0, quantize=plain))
    for st in model(ids, split=split, compressor=rate0).compression_stats:
        assert float(st["kv_bytes"]) == n_ctx * (R + Dr) * 2
        assert float(st["kv_reduction"]) == 1.0
    rec = RecordingCompressor(UniCacheCompressor(UniCacheConfig(quantize=plain)))
    out = model(ids, split=split, compressor=rec)
    for layer, st in enumerate(out.compression_stats):
        entries = int(rec.segments[layer].valid.sum())
        seg = rec.segments[layer]
        assert seg.latent and torch.equal(seg.values, seg.keys[..., :R])
        assert float(st["kv_bytes"]) == entries * (R + Dr) * 2  # the latent once
        want = n_ctx / entries
        assert float(st["kv_reduction"]) == pytest.approx(want, rel=1e-6)


def test_convert_recipe_config_loads():
    import importlib
    from pathlib import Path

    from unicache_train.validation import ConfigError

    path = Path(__file__).resolve().parents[1] / "recipes" / "convert_to_mla.py"
    recipe = importlib.import_module("recipes.convert_to_mla")
    cfg = recipe.RecipeConfig.load(path.with_suffix(".yaml"), ["convert.heal_steps=3"])
    assert cfg.convert.heal_steps == 3 and cfg.run.model.attention_type == "gqa"
    with pytest.raises(ConfigError, match="weighting"):
        recipe.RecipeConfig.load(path.with_suffix(".yaml"), ["convert.weighting=pca"])


def test_2norm_rope_selection_picks_the_ladder_of_largest_q_k_norms():
    """``rope_selection="2norm"`` (MHA2MLA's criterion, restricted to one geometric ladder):
    the chosen stride maximises sum over layers, heads and kept frequencies of
    ``sqrt(E|q_h,i|²) sqrt(E|k_g,i|²)``, recomputed here from the projections on the same
    calibration inputs; a planted loud frequency moves the choice to a ladder through it."""
    from unicache_train.model.convert_mla import convert_to_mla_with_report

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
    )
    src = Decoder(cfg).eval()
    D, F = cfg.head_size, cfg.head_size // 2  # 8, 4
    with torch.no_grad():  # frequency 3 (coordinates 3 and 7) loud in every head
        for layer in src.layers:
            for w in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight):
                w.view(-1, D, 32)[:, [3, 3 + F]] *= 6.0
    ids = torch.randint(0, VOCAB, (4, 16))
    inputs = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda _m, args, kwargs, i=i: inputs.__setitem__(i, (args[0] if args else kwargs["x"])),
            with_kwargs=True,
        )
        for i, layer in enumerate(src.layers)
    ]
    with torch.no_grad():
        src(ids)
    for h in hooks:
        h.remove()
    score = torch.zeros(F, dtype=torch.float64)
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    for i, layer in enumerate(src.layers):
        x = inputs[i].detach().double().reshape(-1, 32)
        q = (x @ layer.self_attn.q_proj.weight.detach().double().T).view(-1, 4, D)
        k = (x @ layer.self_attn.k_proj.weight.detach().double().T).view(-1, 2, D)
        eq = (q[..., :F] ** 2 + q[..., F:] ** 2).mean(0)  # [H, F]
        ek = (k[..., :F] ** 2 + k[..., F:] ** 2).mean(0)  # [Hk, F]
        score += (eq.sqrt() * ek.sqrt().repeat_interleave(G, 0)).sum(0)
    kept = 2  # Dr = 4
    strides = range(1, (F - 1) // (kept - 1) + 1)
    want = max(strides, key=lambda s: float(score[torch.arange(kept) * s].sum()))
    _, report = convert_to_mla_with_report(
        src, ids, kv_lora_rank=8, qk_rope_head_dim=4, rope_selection="2norm"
    )
    assert report.rope_stride == want == 3 and report.kept_frequencies == [0, 3]
    with pytest.raises(ValueError, match="rope_selection='best'.*weighted"):
        convert_to_mla_with_report(src, ids, 8, 4, rope_selection="best")
