"""RoPE scaling (linear / dynamic / llama3 / yarn): our tables and logits against transformers'
own modules, import and export for llama / qwen2 / mHC / DeepseekV3, dynamic RoPE under a KV
cache, and config validation.

Tiny random models built with transformers (no hub). ``initializer_range=0.2`` gives O(1)
logits, so the 1e-5 tolerance is a real check; every model's context is short
(``max_position_embeddings`` 32 or 64, original 16/32) so the sequences pass it cheaply.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from unicache_train.checkpoint.hf import export_hf, import_hf  # noqa: E402
from unicache_train.checkpoint.hf_config import HFCheckpointError  # noqa: E402
from unicache_train.model import Decoder  # noqa: E402
from unicache_train.model.config import ModelConfig, RopeScalingConfig  # noqa: E402
from unicache_train.model.kv_cache import new_kv_cache  # noqa: E402
from unicache_train.model.rope import (  # noqa: E402
    RotaryEmbedding,
    attention_factor,
    inv_frequencies,
    mla_softmax_mscale,
)
from unicache_train.validation import ConfigError  # noqa: E402

V = 260  # the byte tokenizer's vocabulary: exports carry a tokenizer
# fp32 logits, same formulas in the same op order: observed max |diff| 0 on O(1) logits.
TOL = dict(atol=1e-5, rtol=1e-5)
# Head dim 16, theta 1e4: with llama3's original context 32 its three bands are all populated
# (wavelengths 6.3 < 8 kept, 19.9 mixed, >= 62.8 / factor); YaRN's (16 = 64 / factor) keeps
# dimension 0 and interpolates the others.
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}
LLAMA = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def _hf_llama(rope: dict, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**LLAMA, **kw}, rope_parameters={**rope, "rope_theta": 10000.0})
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _load_hf(path, **kw):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _hf_cache_field() -> str:
    """transformers >= 5.x names the K/V cache ``cache``; older versions ``past_key_values``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _rope_dict(path) -> dict:
    return json.loads((path / "config.json").read_text())["rope_parameters"]


# ------------------------------------------------------------------------ tables, directly
@pytest.mark.parametrize("name", ["linear", "llama3", "yarn"])
def test_inv_frequencies_equal_transformers_init_functions(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**ROPES[name], "rope_theta": 10000.0}
    cfg = LlamaConfig(**LLAMA, rope_parameters=dict(rope))
    ref, ref_factor = ROPE_INIT_FUNCTIONS[name](cfg, "cpu")
    ours = RopeScalingConfig(**{k: v for k, v in rope.items() if k != "rope_theta"})
    got = inv_frequencies(16, 10000.0, ours, LLAMA["max_position_embeddings"])
    assert torch.equal(got, ref)
    assert attention_factor(ours) == pytest.approx(ref_factor, rel=1e-12)
    default = inv_frequencies(16, 10000.0)
    assert not torch.allclose(got, default)  # the scaling changes the table


def test_dynamic_table_grows_with_the_longest_position_only_past_max_position():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(**LLAMA, rope_parameters={**ROPES["dynamic"], "rope_theta": 10000.0})
    rot = RotaryEmbedding(16, 10000.0, RopeScalingConfig(**ROPES["dynamic"]), 64)
    for length in (10, 64, 65, 200):
        pos = torch.arange(length)[None]
        ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=torch.tensor(length))
        freqs = (pos.float()[..., None] * ref)[0]
        cos, sin = rot(pos, torch.float32)
        torch.testing.assert_close(cos[0], torch.cat([freqs, freqs], -1).cos(), atol=0, rtol=0)
        torch.testing.assert_close(sin[0], torch.cat([freqs, freqs], -1).sin(), atol=0, rtol=0)
    short, _ = rot(torch.arange(64)[None], torch.float32)
    plain, _ = RotaryEmbedding(16, 10000.0)(torch.arange(64)[None], torch.float32)
    assert torch.equal(short, plain)  # up to max_position_embeddings: the default table


def test_tables_are_rotations_times_yarn_factor_and_unapply_inverts_them():
    """cos^2 + sin^2 = a^2 (YaRN's attention factor, 1 otherwise), as transformers' tables; the
    inverse that xKV and the serving cache use to get pre-RoPE keys back undoes apply_rope."""
    from unicache_train.ops.rope import apply_rope, unapply_rope

    k = torch.randn(2, 3, 100, 16)
    for rope in ROPES.values():
        rot = RotaryEmbedding(16, 10000.0, RopeScalingConfig(**rope), 64)
        cos, sin = rot(torch.arange(100).expand(2, 100), torch.float32)
        a = attention_factor(rot.scaling)
        assert a == rot.attention_scaling
        torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, a * a))
        torch.testing.assert_close(unapply_rope(apply_rope(k, cos, sin), cos, sin), k)
    assert attention_factor(RopeScalingConfig(**ROPES["yarn"])) == pytest.approx(
        0.1 * torch.log(torch.tensor(4.0)).item() + 1
    )


# --------------------------------------------------------------- llama: import and export
@pytest.mark.parametrize("name", list(ROPES))
def test_llama_rope_scaling_import_export_matches_transformers(name, tmp_path):
    """HF -> ours -> HF at a length past max_position_embeddings (64) and past the original
    context (32): logits equal both ways, the rope dict survives the round trip, and the
    scaling is not a no-op on these weights."""
    hf = _hf_llama(ROPES[name])
    hf.save_pretrained(tmp_path / "src")
    ours, config = import_hf(tmp_path / "src")
    assert config.rope_scaling.rope_type == name
    ids = torch.randint(0, V, (2, 80))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert ref.abs().mean() > 0.3  # not a vacuous comparison
    torch.testing.assert_close(got, ref, **TOL)
    plain = Decoder(ModelConfig(**LLAMA, rope_theta=10000.0))
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (plain(ids).logits - ref).abs().max() > 1e-2  # the scaling matters here

    out = export_hf(ours, tmp_path / "out", family="llama", tokenizer_from="byte")
    written = _rope_dict(out)
    src = {k: v for k, v in _rope_dict(tmp_path / "src").items() if k != "truncate"}
    assert {k: written[k] for k in src} == src
    legacy = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert legacy["rope_type"] == name  # what older transformers / vLLM read
    back = _load_hf(out)
    assert back.config.rope_parameters["rope_type"] == name
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, **TOL)
    again, config2 = import_hf(out)
    assert config2 == config


def test_qwen2_legacy_rope_scaling_yarn_imports(tmp_path):
    """A Qwen2.5-style config.json: legacy ``rope_scaling = {"type": "yarn", ...}`` and a
    top-level ``rope_theta``; transformers reads the same file as the reference."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**LLAMA, "tie_word_embeddings": True}, rope_theta=10000.0)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "q")
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(
        rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    )
    (tmp_path / "q" / "config.json").write_text(json.dumps(raw))
    hf = _load_hf(tmp_path / "q")
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    ours, config = import_hf(tmp_path / "q")
    assert config.rope_scaling == RopeScalingConfig(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16
    )
    ids = torch.randint(0, V, (2, 70))
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(ours(ids).logits, ref, **TOL)
    back = _load_hf(export_hf(ours, tmp_path / "out", family="qwen2", tokenizer_from="byte"))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, **TOL)


def test_mhc_export_computes_rope_scaling_in_remote_code(tmp_path):
    """The mHC format's remote code builds its own tables: llama3, yarn (attention factor on
    cos/sin) and dynamic (past max_position_embeddings) reload to our logits."""
    # NOTE: initializer_range 0.02 here: at 0.2 the mHC remote code differs from ours by
    # ~1.4e-5 with default RoPE already (its own fp32 op order), which is not what this tests.
    ids = torch.randint(0, V, (2, 80))
    mhc = dict(
        LLAMA,
        initializer_range=0.02,
        rope_theta=10000.0,
        residual_mode="mhc",
        hc_mult=2,
        hc_sinkhorn_iters=5,
    )
    torch.manual_seed(0)
    plain = Decoder(ModelConfig(**mhc)).eval()
    for name in ("llama3", "yarn", "dynamic"):
        cfg = ModelConfig(**mhc, rope_scaling=ROPES[name])
        ours = Decoder(cfg).eval()
        ours.load_state_dict(plain.state_dict())
        out = export_hf(ours, tmp_path / name, tokenizer_from="byte")
        back = _load_hf(out, trust_remote_code=True)
        with torch.no_grad():
            got = ours(ids).logits
            torch.testing.assert_close(back(ids).logits, got, **TOL)
            assert (plain(ids).logits - got).abs().max() > 1e-4  # the scaling matters
        assert import_hf(out)[1].rope_scaling == cfg.rope_scaling


# --------------------------------------------------------------------- dynamic + KV cache
def test_dynamic_cached_decoding_matches_transformers_step_by_step(tmp_path):
    """transformers recomputes dynamic frequencies per forward from the largest position, and
    cached keys keep the frequencies of the forward that wrote them. Our decoder does the same,
    so a cached decode that crosses max_position_embeddings (64) equals transformers' step by
    step; it is NOT the full forward at the final length (every key re-rotated), in either."""
    _hf_llama(ROPES["dynamic"]).save_pretrained(tmp_path / "src")
    # NOTE: a fresh transformers model: its dynamic rotary keeps the longest length it has seen.
    hf = _load_hf(tmp_path / "src")
    ours, _ = import_hf(tmp_path / "src")
    ids = torch.randint(0, V, (2, 60))
    steps = 10  # positions 60..69: past 64 from the fifth step on
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        cache = new_kv_cache(ours.config)
        got = ours(ids, cache=cache).logits[:, -1]
        torch.testing.assert_close(got, out.logits[:, -1], **TOL)
        field = _hf_cache_field()
        pkv, seq = getattr(out, field), ids
        for _ in range(steps):
            nxt = got.argmax(-1, keepdim=True)  # [B, 1]
            seq = torch.cat([seq, nxt], 1)
            out = hf(nxt, use_cache=True, **{field: pkv})
            pkv = getattr(out, field)
            got = ours(nxt, cache=cache).logits[:, -1]
            torch.testing.assert_close(got, out.logits[:, -1], **TOL)
        full = ours(seq).logits[:, -1]
    assert (full - got).abs().max() > 1e-3  # cached != full forward past max_position_embeddings
    assert torch.equal(ours.generate(ids, steps)[:, 60:], seq[:, 60:])


# ---------------------------------------------------------------- serving the compression
@pytest.mark.parametrize("policy", ["unicache_int4_merge", "xkv"])
def test_compressed_cache_in_transformers_serves_a_yarn_export_exactly(
    tmp_path, monkeypatch, policy
):
    """The exported compression policy in stock transformers ``generate()`` equals our decoding
    loop on a YaRN model (tokens equal, logits <= 1e-4, bytes equal): keys carry the attention
    factor on both sides, so int4 + merging (not scale-equivariant) decides the same, and xKV's
    pre-RoPE fit inverts the scaled table (:func:`unicache_train.ops.rope.unapply_rope`)."""
    # tests/cache_exactness.py (shared with tests/test_transformers_cache.py; tests/ is on
    # sys.path under pytest's rootdir).
    ce = pytest.importorskip("cache_exactness")

    monkeypatch.setitem(
        ce.COMMON,
        "rope_scaling",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    ce.check(tmp_path, "llama", policy)


def test_unicache_then_xkv_at_full_rank_is_exact_on_a_yarn_model():
    """UniCache (rate 0) then xKV at full rank on pre-RoPE keys: the fit un-rotates the kept,
    post-RoPE keys with the scaled table's true inverse, so the continuation's logits are the
    plain forward's (the old ``(cos, -sin)`` inverse is off by a^2 here: ~4 on these logits)."""
    from unicache_train.inloop import build_compressor, continuation_mask
    from unicache_train.train.config import CompressionTrainConfig

    torch.manual_seed(0)
    model = Decoder(
        ModelConfig(
            **{**LLAMA, "num_hidden_layers": 3}, rope_theta=10000.0, rope_scaling=ROPES["yarn"]
        )
    ).eval()
    comp = build_compressor(
        CompressionTrainConfig.from_dict(
            dict(
                enabled=True,
                method="unicache+xkv",
                preset="text_style_baseline",
                unicache={"target_rate": 0.0},
                xkv={"rank_fraction": 1.0, "keys_pre_rope": True},
            )
        )
    )
    ids = torch.randint(0, V, (2, 40))
    split = torch.tensor([31, 17])
    with torch.no_grad():
        out = model(ids, split=split, compressor=comp).logits
        plain = model(ids).logits
    cont = continuation_mask(split, 40)
    # fp32 SVD and its product back: ~5e-5 on these O(1) logits (default RoPE: the same).
    torch.testing.assert_close(out[cont], plain[cont], atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- DeepseekV3
def _hf_deepseek(rope: dict):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=16,
        v_head_dim=12,
        first_k_dense_replace=2,
        n_routed_experts=1,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=1,
        rope_interleave=True,
        tie_word_embeddings=False,
        rope_parameters={**rope, "rope_theta": 10000.0},
        max_position_embeddings=64,
        num_mtp_layers=0,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(cfg).eval()


@pytest.mark.parametrize(
    "mscale, mscale_all_dim",
    [
        (1.0, 1.0),  # DeepSeek-V3's own: attention factor 1, softmax scale x mscale^2
        (1.0, 0.5),
    ],  # attention factor != 1 too: the RoPE part of the logit changes alone
)
def test_deepseek_v3_yarn_mscale_matches_transformers(tmp_path, mscale, mscale_all_dim):
    from transformers import DeepseekV3ForCausalLM

    from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3, import_deepseek_v3

    rope = dict(
        ROPES["yarn"], mscale=mscale, mscale_all_dim=mscale_all_dim, beta_fast=32.0, beta_slow=1.0
    )
    hf = _hf_deepseek(rope)
    hf.save_pretrained(tmp_path / "hf")
    ours = import_deepseek_v3(tmp_path / "hf")
    scaling = ours.config.rope_scaling
    assert (scaling.mscale, scaling.mscale_all_dim) == (mscale, mscale_all_dim)
    attn = ours.layers[0].self_attn
    assert attn.scaling == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert mla_softmax_mscale(scaling) > 1
    ids = torch.randint(0, V, (2, 80))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert ref.abs().mean() > 0.3
    torch.testing.assert_close(got, ref, **TOL)

    export_deepseek_v3(ours, tmp_path / "ours", tokenizer_from="byte")
    written = _rope_dict(tmp_path / "ours")
    assert written["mscale_all_dim"] == mscale_all_dim and written["rope_type"] == "yarn"
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, **TOL)
    assert import_deepseek_v3(tmp_path / "ours").config == ours.config


def test_deepseek_v3_llama3_imports_and_odd_mscale_is_refused(tmp_path):
    from unicache_train.checkpoint.deepseek_v3 import (
        DeepseekV3ExportError,
        from_deepseek_v3_config,
        import_deepseek_v3,
    )

    hf = _hf_deepseek(ROPES["llama3"])
    hf.save_pretrained(tmp_path / "hf")
    ours = import_deepseek_v3(tmp_path / "hf")
    ids = torch.randint(0, V, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, **TOL)
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw["rope_parameters"] = {
        "rope_type": "linear",
        "factor": 2.0,
        "mscale_all_dim": 1.0,
        "rope_theta": 10000.0,
    }
    with pytest.raises(DeepseekV3ExportError, match="mscale_all_dim=1.0 with rope_type='linear'"):
        from_deepseek_v3_config(raw)


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "fields, match",
    [
        ({"rope_type": "longrope"}, r"rope_type='longrope' is not allowed; choose one of"),
        ({"factor": 4.0}, r"factor=4.0 is not read by rope_type='default'"),
        ({"rope_type": "llama3", "beta_fast": 8.0}, r"beta_fast=8.0 is not read by.*'llama3'"),
        ({"rope_type": "linear", "factor": 0.0}, r"factor=0.0 is out of range; allowed \(0, inf\)"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0},
            r"high_freq_factor=4.0 must exceed low_freq_factor=4.0",
        ),
        ({"rope_type": "yarn", "beta_fast": 1.0, "beta_slow": 2.0}, r"beta_fast=1.0 must be >="),
        (
            {"rope_type": "yarn", "original_max_position_embeddings": 0},
            r"original_max_position_embeddings=0 is out of range",
        ),
        ({"rope_type": "yarn", "truncate": "yes"}, r"truncate='yes': expected true or false"),
    ],
)
def test_rope_scaling_config_errors_name_field_value_and_allowed(fields, match):
    with pytest.raises(ConfigError, match=match):
        RopeScalingConfig(**fields)


def test_rope_scaling_round_trips_through_yaml_and_dicts(tmp_path):
    from unicache_train.train.config import RunConfig

    run = RunConfig.from_dict({"model": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}})
    assert isinstance(run.model.rope_scaling, RopeScalingConfig)
    assert RunConfig.load(run.save(tmp_path / "c.yaml")) == run
    assert ModelConfig(**run.model.to_dict()) == run.model
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['kind'\] in model.rope_scaling"):
        RunConfig.from_dict({"model": {"rope_scaling": {"kind": "yarn"}}})
    with pytest.raises(ConfigError, match="ModelConfig.rope_scaling='yarn': expected a"):
        ModelConfig(rope_scaling="yarn")
    assert ModelConfig(rope_scaling=None).rope_scaling == RopeScalingConfig()  # HF's "none"


def test_unsupported_rope_types_and_missing_keys_are_named(tmp_path):
    _hf_llama(ROPES["linear"]).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    raw = json.loads(path.read_text())
    cases = [
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
            r"rope_type='longrope' is not implemented; supported: \['default', 'linear'",
        ),
        (
            {"rope_type": "llama3", "factor": 8.0},
            r"lacks \['low_freq_factor', 'high_freq_factor'\]",
        ),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
            r"not representable: RopeScalingConfig.high_freq_factor=1.0 must exceed",
        ),
    ]
    for rope, match in cases:
        path.write_text(json.dumps({**raw, "rope_parameters": {**rope, "rope_theta": 1e4}}))
        with pytest.raises(HFCheckpointError, match=match):
            import_hf(tmp_path / "m")


def test_mla_conversion_refuses_a_scaled_source():
    from unicache_train.model.convert_mla import convert_to_mla

    model = Decoder(ModelConfig(**LLAMA, rope_scaling=ROPES["llama3"]))
    with pytest.raises(ValueError, match="rope_type='llama3': conversion to MLA"):
        convert_to_mla(model, torch.randint(0, V, (2, 8)), kv_lora_rank=8, qk_rope_head_dim=8)
