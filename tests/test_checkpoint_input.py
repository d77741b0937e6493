"""Checkpoint input checks: importers refuse non-finite and non-float weights, truncated files and
mis-shaped tensors with a message naming the file or tensor; ``merge_kv_heads`` refuses a merge it
cannot do exactly (``qk_norm``)."""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from unicache_train.checkpoint.deepseek_v3 import (
    DeepseekV3ExportError,
    export_deepseek_v3,
    import_deepseek_v3,
)
from unicache_train.checkpoint.head_merge import merge_kv_heads
from unicache_train.checkpoint.hf import export_hf, import_hf
from unicache_train.checkpoint.hf_config import HFCheckpointError
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig

V = 97
GQA = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
MLA = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    attention_type="mla",
    q_lora_rank=12,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=64,
)


def _rewrite(path, fn):
    """Change the weights on purpose: the export's checksum manifest goes with the old file, so
    that what is tested is the importer's own check of the new one."""
    f = path / "model.safetensors"
    save_file(fn(load_file(str(f))), str(f), metadata={"format": "pt"})
    (path / "unicache_manifest.json").unlink(missing_ok=True)


@pytest.fixture
def llama_dir(tmp_path):
    torch.manual_seed(0)
    return export_hf(Decoder(ModelConfig(**GQA)), tmp_path / "llama", family="llama")


@pytest.fixture
def deepseek_dir(tmp_path):
    torch.manual_seed(0)
    return export_deepseek_v3(Decoder(ModelConfig(**MLA)), tmp_path / "dsv3")


# ------------------------------------------------------------------------- import_hf: values
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_import_hf_refuses_non_finite_weight_naming_it(llama_dir, bad):
    name = "model.layers.1.mlp.down_proj.weight"

    def poison(sd):
        sd[name] = sd[name].clone()
        sd[name][3, 5] = bad
        return sd

    _rewrite(llama_dir, poison)
    kind = "1 NaN and 0 Inf" if bad != bad else "0 NaN and 1 Inf"
    with pytest.raises(HFCheckpointError, match=re.escape(f"tensor {name!r} has {kind} values")):
        import_hf(llama_dir)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.float8_e4m3fn])
def test_import_hf_refuses_non_float_weight_naming_dtype(llama_dir, dtype):
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(llama_dir, lambda sd: {**sd, name: (sd[name] * 100).to(dtype)})
    short = str(dtype).removeprefix("torch.")
    with pytest.raises(
        HFCheckpointError,
        match=re.escape(
            f"tensor {name!r} has dtype {short}; allowed dtypes: "
            "['float32', 'bfloat16', 'float16', 'float64']"
        ),
    ):
        import_hf(llama_dir)


def test_import_hf_still_accepts_half_precision(llama_dir):
    ids = torch.randint(0, V, (1, 9))
    want, _ = import_hf(llama_dir)
    _rewrite(llama_dir, lambda sd: {k: v.to(torch.bfloat16) for k, v in sd.items()})
    got, _ = import_hf(llama_dir)
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, want(ids).logits, atol=0.1, rtol=0.1)


# ---------------------------------------------------------------------- merge_kv_heads, qk_norm
def _qk_norm_model(seed=0):
    torch.manual_seed(seed)
    model = Decoder(
        ModelConfig(
            **{**GQA, "num_attention_heads": 8, "num_key_value_heads": 4},
            qk_norm=True,
            attention_bias=True,
        )
    ).eval()
    with torch.no_grad():  # non-trivial norm gains: a skipped or mis-merged norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def test_merge_kv_heads_refuses_distinct_heads_under_qk_norm():
    model = _qk_norm_model()
    with pytest.raises(
        HFCheckpointError, match=r"layer 0 group \[0, 2\] has K projections that differ .*qk_norm"
    ):
        merge_kv_heads(model, [[[0, 2], [1, 3]], [[0, 1], [2, 3]]])


def _post_norm_keys(attn, x):
    """The keys attention sees for one layer, before RoPE: [B, T, Hk, D], computed directly."""
    B, T, _ = x.shape
    D = attn.head_dim
    k = (x @ attn.k_proj.weight.T + attn.k_proj.bias).view(B, T, -1, D)
    rms = torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + attn.k_norm.eps)
    return k * rms * attn.k_norm.weight


def test_averaged_rows_are_not_averaged_keys_under_qk_norm():
    # Why the refusal: averaging two heads' K rows, then k_norm, is not the average of their
    # normalised keys (what an exact merge must attend to).
    model = _qk_norm_model()
    attn = model.layers[0].self_attn
    x = torch.randn(2, 7, GQA["hidden_size"])
    with torch.no_grad():
        keys = _post_norm_keys(attn, x)  # [B, T, Hk, D]
        want = keys[:, :, [0, 2]].mean(2)
        w = attn.k_proj.weight.view(4, -1, GQA["hidden_size"])
        b = attn.k_proj.bias.view(4, -1)
        k = x @ w[[0, 2]].mean(0).T + b[[0, 2]].mean(0)
        got = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + attn.k_norm.eps)
        got = got * attn.k_norm.weight
    assert (got - want).abs().max() > 0.1 * want.abs().max()


def test_merge_kv_heads_is_exact_under_qk_norm_for_identical_k_heads():
    model = _qk_norm_model()
    groups = [[[0, 2], [1, 3]], [[0, 1], [2, 3]]]
    D = model.config.head_size
    with torch.no_grad():  # each group's K heads share their projection; V heads stay distinct
        for li, layer_groups in enumerate(groups):
            k = model.layers[li].self_attn.k_proj
            w, b = k.weight.view(4, D, -1), k.bias.view(4, D)
            for g in layer_groups:
                w[g] = w[g[0]].clone()
                b[g] = b[g[0]].clone()
    merged = merge_kv_heads(model, groups).eval()
    assert merged.config.num_key_value_heads == 2
    # Reference: the source model with each group's V rows replaced by the group average (its
    # K heads are already equal, so their keys are their own average).
    ref = Decoder(model.config).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for li, layer_groups in enumerate(groups):
            v = ref.layers[li].self_attn.v_proj
            w, b = v.weight.view(4, D, -1), v.bias.view(4, D)
            for g in layer_groups:
                w[g] = w[g].mean(0, keepdim=True)
                b[g] = b[g].mean(0, keepdim=True)
        ids = torch.randint(0, V, (2, 11))
        torch.testing.assert_close(merged(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------- import_deepseek_v3
def test_import_deepseek_v3_truncated_file_names_it(deepseek_dir):
    f = deepseek_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(
        DeepseekV3ExportError,
        match=re.escape(f"{f}: cannot read the safetensors file") + ".*corrupted or truncated",
    ):
        import_deepseek_v3(deepseek_dir)


def test_import_deepseek_v3_mis_shaped_q_b_proj_names_it(deepseek_dir):
    name = "model.layers.1.self_attn.q_b_proj.weight"
    _rewrite(deepseek_dir, lambda sd: {**sd, name: sd[name][:-3]})
    with pytest.raises(
        DeepseekV3ExportError,
        match=re.escape(f"tensor {name!r} has shape [61, 12]; config.json implies [64, 12]"),
    ):
        import_deepseek_v3(deepseek_dir)


def test_import_deepseek_v3_missing_and_unexpected_are_named(deepseek_dir):
    gone = "model.layers.0.mlp.up_proj.weight"
    _rewrite(
        deepseek_dir,
        lambda sd: {
            **{k: v for k, v in sd.items() if k != gone},
            "model.extra.weight": torch.zeros(2),
        },
    )
    with pytest.raises(
        DeepseekV3ExportError,
        match=re.escape(f"missing [{gone!r}], unexpected ['model.extra.weight']"),
    ):
        import_deepseek_v3(deepseek_dir)


def test_import_deepseek_v3_refuses_nan_and_integer_weights(deepseek_dir):
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    f = deepseek_dir / "model.safetensors"
    good = f.read_bytes()
    _rewrite(deepseek_dir, lambda sd: {**sd, name: sd[name] * float("nan")})
    with pytest.raises(DeepseekV3ExportError, match=re.escape(f"tensor {name!r} has ")):
        import_deepseek_v3(deepseek_dir)
    f.write_bytes(good)
    _rewrite(deepseek_dir, lambda sd: {**sd, name: sd[name].to(torch.int32)})
    with pytest.raises(DeepseekV3ExportError, match="has dtype int32; allowed dtypes"):
        import_deepseek_v3(deepseek_dir)
    f.write_bytes(good)
    assert import_deepseek_v3(deepseek_dir).config.attention_type == "mla"


def test_deepseek_v3_errors_are_hf_checkpoint_errors():
    assert issubclass(DeepseekV3ExportError, HFCheckpointError)
