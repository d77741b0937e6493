"""HF checkpoint import/export: parity with transformers for llama/qwen2/qwen3/mistral, mHC
remote-code export, head-merged export, and clear errors on bad checkpoints."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from unicache_train.checkpoint.head_merge import merge_kv_heads  # noqa: E402
from unicache_train.checkpoint.hf import export_hf, import_hf  # noqa: E402
from unicache_train.checkpoint.hf_config import HFCheckpointError  # noqa: E402
from unicache_train.checkpoint.safetensors_io import load_safetensors_dir  # noqa: E402
from unicache_train.model import Decoder  # noqa: E402
from unicache_train.model.config import ModelConfig  # noqa: E402

V = 97
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _hf_config(family: str, **kw):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = dict(COMMON, rope_theta=500.0)
    if family == "llama":
        return LlamaConfig(**{**base, "tie_word_embeddings": False, **kw})
    if family == "qwen2":
        return Qwen2Config(**{**base, "tie_word_embeddings": True, **kw})
    if family == "qwen3":  # explicit head_dim != hidden / heads
        return Qwen3Config(**{**base, "head_dim": 24, "tie_word_embeddings": False, **kw})
    return MistralConfig(**{**base, "sliding_window": None, "tie_word_embeddings": False, **kw})


def _save_hf(family: str, path, *, max_shard_size=None, **kw):
    """A tiny random HF model with non-trivial norms/biases, saved with save_pretrained."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_hf_config(family, **kw)).eval()
    with torch.no_grad():  # random gains and biases, so that a dropped one shows in the logits
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(path, **extra)
    return hf


def _load_hf(path, **kw):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_import_export_roundtrip_matches_transformers(family, tmp_path):
    hf = _save_hf(family, tmp_path / "src")
    ours, config = import_hf(tmp_path / "src")
    assert config.qk_norm == (family == "qwen3")
    assert config.attention_bias == (family == "qwen2")
    ids = torch.randint(0, V, (2, 19))
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(ours(ids).logits, ref, atol=1e-5, rtol=1e-5)

    out = export_hf(ours, tmp_path / "out", family=family)
    back = _load_hf(out)
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, atol=1e-5, rtol=1e-5)
    prompt = ids[:, :5]
    want = back.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours.generate(prompt, 6), want)
    # from_hf(to_hf(sd)) == sd
    again, _ = import_hf(out)
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_sharded_import_and_bf16_export(tmp_path):
    hf = _save_hf("llama", tmp_path / "src", max_shard_size="20KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    ours, _ = import_hf(tmp_path / "src")
    ids = torch.randint(0, V, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
    out = export_hf(
        ours,
        tmp_path / "bf16",
        family="llama",
        dtype="bf16",
        compression_policy={"preset": "default", "rate": 0.6},
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    policy = json.loads((out / "compression_config.json").read_text())
    assert policy["schema_version"] == 1 and policy["policy"]["rate"] == 0.6
    back = _load_hf(out)
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not list(out.glob("*.bin"))
    # A shard that lacks a tensor its index lists (an interrupted download) is named.
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    from safetensors.torch import load_file, save_file

    part = load_file(str(tmp_path / "src" / shard))
    part.pop(name)
    save_file(part, str(tmp_path / "src" / shard))
    with pytest.raises(HFCheckpointError, match=f"absent from the shard.*{name}"):
        import_hf(tmp_path / "src")


def _mhc_model() -> Decoder:
    torch.manual_seed(0)
    cfg = ModelConfig(
        **COMMON,
        residual_mode="mhc",
        hc_mult=4,
        hc_sinkhorn_iters=5,
        qk_norm=True,
        attention_bias=True,
        tie_word_embeddings=False,
    )
    model = Decoder(cfg).eval()
    with torch.no_grad():  # move off the init point so every coefficient matters
        for name, p in model.named_parameters():
            if any(s in name for s in ("base", "scale", "bias", "norm")):
                p.add_(0.3 * torch.randn_like(p))
    return model


def test_mhc_export_loads_with_trust_remote_code(tmp_path):
    ours = _mhc_model()
    out = export_hf(ours, tmp_path / "mhc")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "unicache_mhc" and "auto_map" in cfg
    src = (out / "modeling_unicache_mhc.py").read_text()
    imports = [ln for ln in src.splitlines() if ln.startswith(("import ", "from "))]
    assert not any("unicache_train" in ln for ln in imports), imports  # self-contained
    back = _load_hf(out, trust_remote_code=True)
    assert back.model.layers[0].attn_hc.fn.shape == (24, 256)
    ids = torch.randint(0, V, (2, 17))
    with torch.no_grad():
        ref = ours(ids).logits
        torch.testing.assert_close(back(ids).logits, ref, atol=1e-5, rtol=1e-5)
    prompt = ids[:, :5]
    want = ours.generate(prompt, 6)
    lengths = []
    hook = back.model.register_forward_pre_hook(
        lambda m, a, kw: lengths.append((kw.get("input_ids") if a == () else a[0]).shape[1]),
        with_kwargs=True,
    )
    assert torch.equal(back.generate(prompt, max_new_tokens=6, do_sample=False), want)
    assert lengths[1:] and set(lengths[1:]) == {1}  # decoding steps used the K/V cache
    hook.remove()
    assert torch.equal(
        back.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False), want
    )
    again, config = import_hf(out)  # our own format imports back
    assert config.uses_streams
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref, atol=0, rtol=0)


def test_head_merged_export_is_exact_for_merged_kv(tmp_path):
    torch.manual_seed(0)
    model = Decoder(
        ModelConfig(
            **dict(COMMON, num_attention_heads=8, num_key_value_heads=4), tie_word_embeddings=False
        )
    ).eval()
    groups = [[[0, 2], [1, 3]], [[0, 1], [2, 3]]]
    merged = merge_kv_heads(model, groups).eval()
    assert merged.config.num_key_value_heads == 2
    # Reference: the source model with each group's K/V rows replaced by the group average.
    ref = Decoder(model.config).eval()
    ref.load_state_dict(model.state_dict())
    D = model.config.head_size
    with torch.no_grad():
        for li, layer_groups in enumerate(groups):
            attn = ref.layers[li].self_attn
            for proj in (attn.k_proj, attn.v_proj):
                w = proj.weight.view(4, D, -1)
                for g in layer_groups:
                    w[g] = w[g].mean(0, keepdim=True)
    ids = torch.randint(0, V, (2, 13))
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(merged(ids).logits, want, atol=1e-5, rtol=1e-5)
    out = export_hf(merged, tmp_path / "merged", family="llama")
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    with torch.no_grad():
        torch.testing.assert_close(_load_hf(out)(ids).logits, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(HFCheckpointError, match="unequal sizes"):
        merge_kv_heads(model, [[[0], [1, 2, 3]], [[0, 1], [2, 3]]])


# ------------------------------------------------------------------------------- errors
@pytest.fixture
def llama_dir(tmp_path):
    _save_hf("llama", tmp_path / "m")
    return tmp_path / "m"


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_tensors(path, fn):
    from safetensors.torch import save_file

    sd = load_safetensors_dir(path)
    save_file(fn(dict(sd)), str(path / "model.safetensors"), metadata={"format": "pt"})


def test_truncated_safetensors_is_a_clear_error(llama_dir):
    f = llama_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(HFCheckpointError, match="corrupted or truncated"):
        import_hf(llama_dir)
    f.write_bytes(b"\x00" * 8 + b"garbage")
    with pytest.raises(HFCheckpointError, match="corrupted or truncated"):
        import_hf(llama_dir)


def test_missing_tensor_is_named(llama_dir):
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_tensors(llama_dir, lambda sd: {k: v for k, v in sd.items() if k != name})
    with pytest.raises(HFCheckpointError, match=name.replace(".", r"\.")):
        import_hf(llama_dir)


def test_wrong_shape_is_named(llama_dir):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_tensors(llama_dir, lambda sd: {**sd, name: sd[name][:-1]})
    with pytest.raises(HFCheckpointError, match=rf"{name}.*shape \[31, 64\].*\[32, 64\]"):
        import_hf(llama_dir)


def test_unknown_model_type_and_architecture(llama_dir):
    _edit_config(llama_dir, model_type="gpt_neox")
    with pytest.raises(HFCheckpointError, match="model_type='gpt_neox'"):
        import_hf(llama_dir)
    _edit_config(llama_dir, model_type="llama", architectures=["LlamaForSequenceClassification"])
    with pytest.raises(HFCheckpointError, match="architectures"):
        import_hf(llama_dir)


@pytest.mark.parametrize(
    "changes, match",
    [
        # Scaled RoPE (linear/dynamic/llama3/yarn) imports: tests/test_rope_scaling.py.
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 500.0, "factor": 4.0}},
            "rope_type='longrope' is not implemented",
        ),
        (
            {"rope_scaling": {"type": "su", "factor": 2.0}, "rope_parameters": None},
            "rope_type='su' is not implemented",
        ),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_config_options(llama_dir, changes, match):
    _edit_config(llama_dir, **changes)
    with pytest.raises(HFCheckpointError, match=match):
        import_hf(llama_dir)


def test_sliding_window_imports_into_the_config(tmp_path):
    # (parity with transformers at windows smaller than the sequence: tests/test_sliding_window.py)
    _save_hf("mistral", tmp_path / "m")
    _edit_config(tmp_path / "m", sliding_window=64)
    assert import_hf(tmp_path / "m")[1].sliding_window == 64
    _edit_config(tmp_path / "m", sliding_window=4096)  # >= max_position_embeddings: inert
    assert import_hf(tmp_path / "m")[1].sliding_window is None
    _save_hf("qwen2", tmp_path / "q")
    _edit_config(
        tmp_path / "q",
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        layer_types=None,
    )
    config = import_hf(tmp_path / "q")[1]
    assert config.sliding_window == 8 and config.layer_types == [
        "full_attention",
        "sliding_attention",
    ]


def test_export_refuses_what_the_family_cannot_hold(tmp_path):
    qk = Decoder(ModelConfig(**COMMON, qk_norm=True))
    with pytest.raises(HFCheckpointError, match="qk_norm"):
        export_hf(qk, tmp_path / "a", family="llama")
    biased = Decoder(ModelConfig(**COMMON, attention_bias=True))
    with pytest.raises(HFCheckpointError, match="Mistral attention has no biases"):
        export_hf(biased, tmp_path / "b", family="mistral")
    paper = Decoder(ModelConfig(**COMMON, residual_mode="mhc", hc_preset="paper"))
    with pytest.raises(HFCheckpointError, match="deepseek_v4"):
        export_hf(paper, tmp_path / "c")


# ------------------------------------------------------------------------------- recipe
def test_finetune_hf_recipe_trains_mhc_and_exports(tmp_path):
    import importlib

    from safetensors.torch import load_file

    _save_hf("llama", tmp_path / "src", vocab_size=300)
    recipe = importlib.import_module("recipes.finetune_hf")
    out = tmp_path / "run"
    trainer = recipe.main(
        [
            "--checkpoint_dir",
            str(tmp_path / "src"),
            "hf.mhc=true",
            "hf.hc_mult=2",
            f"hf.export_dir={tmp_path / 'export'}",
            "hf.export_dtype=fp32",
            f"train.out_dir={out}",
            "train.max_steps=2",
            "train.warmup_steps=0",
            "train.lr=0.001",
            "train.accelerator=cpu",
            "train.resume=null",
            "train.val_every_n_steps=1",
            "train.limit_val_batches=1",
            "train.progress_bar=false",
            "logging.logger=none",
            "monitor.gain=false",
            "monitor.plots=false",
            "data.seq_len=32",
            "data.batch_size=2",
            "data.synthetic.num_stories=20",
            "data.synthetic.num_recall=0",
        ]
    )
    assert trainer.global_step == 2
    init = load_file(str(out / "init_weights.safetensors"))
    ours, config = import_hf(tmp_path / "export")
    assert config.uses_streams and config.hc_mult == 2
    moved = ours.state_dict()["layers.0.mlp.up_proj.weight"] - init["layers.0.mlp.up_proj.weight"]
    assert moved.abs().max() > 0  # the fine-tuned weights were exported, not the init
    back = _load_hf(tmp_path / "export", trust_remote_code=True)
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids).logits, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- CLI
def _write_ckpt(path, model_cfg: ModelConfig, **run):
    from unicache_train.train.config import RunConfig

    torch.manual_seed(0)
    model = Decoder(model_cfg).eval()
    config = RunConfig(model=model_cfg, **run)
    torch.save(
        {
            "hyper_parameters": {"config": config.to_dict()},
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        },
        path,
    )
    return model


def test_cli_export_hf_and_deepseek_v3(tmp_path):
    from unicache_train.cli import main
    from unicache_train.train.config import CompressionTrainConfig

    model = _write_ckpt(
        tmp_path / "gqa.ckpt", ModelConfig(**COMMON), compress=CompressionTrainConfig(enabled=True)
    )
    main(
        [
            "export",
            "--checkpoint",
            str(tmp_path / "gqa.ckpt"),
            "--format",
            "hf",
            "--family",
            "qwen2",
            "--out",
            str(tmp_path / "hf"),
        ]
    )
    policy = json.loads((tmp_path / "hf" / "compression_config.json").read_text())
    assert policy["schema_version"] == 1 and policy["policy"]["method"] == "unicache"
    ids = torch.randint(0, V, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(
            _load_hf(tmp_path / "hf")(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5
        )
    mla = _write_ckpt(tmp_path / "mla.ckpt", ModelConfig(**COMMON, attention_type="mla"))
    main(
        [
            "export",
            "--checkpoint",
            str(tmp_path / "mla.ckpt"),
            "--format",
            "deepseek_v3",
            "--out",
            str(tmp_path / "ds"),
            "--dtype",
            "bf16",
        ]
    )
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["dtype"] == "bfloat16"
    assert not (tmp_path / "ds" / "compression_config.json").exists()
    with pytest.raises(SystemExit):  # a GQA model has no DeepseekV3 form: a clean CLI error
        main(
            [
                "export",
                "--checkpoint",
                str(tmp_path / "gqa.ckpt"),
                "--format",
                "deepseek_v3",
                "--out",
                str(tmp_path / "bad"),
            ]
        )
    del mla
