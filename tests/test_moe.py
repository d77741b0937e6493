"""DeepSeek MoE FFN: parity with transformers' DeepseekV3 (import, export, reload), the router
against an independent per-token reference, the auxiliary-loss-free bias update, config errors,
and an mHC + MoE model that trains and round-trips through the remote-code export."""

import json

import pytest
import torch
from safetensors.torch import load_file

from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.model.moe import (
    MoE,
    Router,
    expert_loads,
    load_stats,
    moe_layers,
    update_router_bias,
)
from unicache_train.validation import ConfigError

VOCAB = 97


def moe_config(**kw) -> ModelConfig:
    """3 layers (layer 0 dense), 8 experts in 4 groups, top-2 within the best 2 groups."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_type="mla",
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_theta=500.0,
        initializer_range=0.2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    base.update(kw)
    return ModelConfig(**base)


def _hf_deepseek_moe(norm_topk_prob: bool, q_lora_rank=None):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        max_position_embeddings=128,
        num_mtp_layers=0,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # random, nonzero: it must pick
                b.copy_(0.3 * torch.randn_like(b))
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf


# ------------------------------------------------------------------------ transformers parity
@pytest.mark.parametrize("norm_topk_prob,q_lora_rank", [(True, None), (False, 24)])
def test_import_export_parity_with_transformers_deepseek_v3_moe(
    tmp_path, norm_topk_prob, q_lora_rank
):
    """HF MoE checkpoint -> ours: logits equal (<= 1e-5 fp32); ours -> HF files -> transformers
    reload: equal again; the files hold one tensor per expert, as DeepSeek's own."""
    from transformers import DeepseekV3ForCausalLM

    from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3, import_deepseek_v3

    hf = _hf_deepseek_moe(norm_topk_prob, q_lora_rank)
    hf.save_pretrained(tmp_path / "hf")
    ours = import_deepseek_v3(tmp_path / "hf")
    c = ours.config
    assert (c.n_routed_experts, c.first_k_dense_replace, c.n_group, c.topk_group) == (8, 1, 4, 2)
    assert c.norm_topk_prob is norm_topk_prob and c.routed_scaling_factor == 2.5
    assert [type(b.mlp).__name__ for b in ours.layers] == ["SwiGLU", "MoE", "MoE"]
    ids = torch.randint(0, VOCAB, (2, 21))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert ref.abs().mean() > 0.3  # not a vacuous comparison
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # The correction bias takes part: zeroing it changes the routing and the logits.
    with torch.no_grad():
        saved = [m.gate.e_score_correction_bias.clone() for m in moe_layers(ours)]
        for m in moe_layers(ours):
            m.gate.e_score_correction_bias.zero_()
        assert (ours(ids).logits - ref).abs().max() > 1e-3
        for m, b in zip(moe_layers(ours), saved):
            m.gate.e_score_correction_bias.copy_(b)

    export_deepseek_v3(ours, tmp_path / "ours", tokenizer_from="byte")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_routed_experts"] == 8
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    names = load_file(str(tmp_path / "ours" / "model.safetensors")).keys()
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, got, atol=1e-5, rtol=1e-5)


def test_export_import_roundtrip_and_fused_layout(tmp_path):
    """ours -> files -> ours is bit-exact; transformers 5's fused names import to the same."""
    from unicache_train.checkpoint.deepseek_v3 import (
        export_deepseek_v3,
        from_deepseek_v3_state_dict,
        import_deepseek_v3,
        to_deepseek_v3_state_dict,
    )

    torch.manual_seed(0)
    model = Decoder(moe_config(q_lora_rank=12))
    with torch.no_grad():
        for m in moe_layers(model):
            m.gate.e_score_correction_bias.normal_()
    back = import_deepseek_v3(export_deepseek_v3(model, tmp_path, tokenizer_from="byte"))
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The fused (in-memory transformers 5) names, with the interleaved RoPE rows of the export.
    hf_sd = to_deepseek_v3_state_dict(model)
    fused = {k: v for k, v in hf_sd.items() if ".mlp.experts." not in k}
    for i in (1, 2):
        p = f"layers.{i}.mlp.experts."
        fused[f"model.{p}gate_up_proj"] = a[p + "gate_up_proj"]
        fused[f"model.{p}down_proj"] = a[p + "down_proj"]
    sd = from_deepseek_v3_state_dict(fused, model.config, rope_interleave=True)
    for k in a:
        assert torch.equal(sd[k], a[k]), k


def test_bf16_export_keeps_the_router_fp32(tmp_path):
    from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3

    model = Decoder(moe_config())
    export_deepseek_v3(model, tmp_path, dtype=torch.bfloat16, tokenizer_from="byte")
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert sd["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert sd["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert sd["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def test_deepseek_v3_errors_name_the_field(tmp_path):
    from unicache_train.checkpoint.deepseek_v3 import (
        DeepseekV3ExportError,
        export_deepseek_v3,
        from_deepseek_v3_config,
        import_deepseek_v3,
        to_deepseek_v3_config,
    )

    with pytest.raises(DeepseekV3ExportError, match="n_shared_experts=0"):
        to_deepseek_v3_config(moe_config(n_shared_experts=0))
    good = to_deepseek_v3_config(moe_config())
    assert from_deepseek_v3_config(good)[0] == moe_config()
    with pytest.raises(DeepseekV3ExportError, match="scoring_func='softmax'"):
        from_deepseek_v3_config({**good, "scoring_func": "softmax"})
    with pytest.raises(DeepseekV3ExportError, match="topk_method='greedy'"):
        from_deepseek_v3_config({**good, "topk_method": "greedy"})
    with pytest.raises(DeepseekV3ExportError, match="moe_layer_freq=2"):
        from_deepseek_v3_config({**good, "moe_layer_freq": 2})
    with pytest.raises(DeepseekV3ExportError, match="n_group=3 must divide"):
        from_deepseek_v3_config({**good, "n_group": 3})
    # A checkpoint missing one expert's projection names it.
    export_deepseek_v3(Decoder(moe_config()), tmp_path, tokenizer_from="byte")
    from safetensors.torch import save_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(DeepseekV3ExportError, match=r"experts\.5\.down_proj\.weight"):
        import_deepseek_v3(tmp_path)
    sd["model.layers.2.mlp.experts.5.down_proj.weight"] = torch.zeros(64, 32)
    sd["model.layers.2.mlp.experts.8.down_proj.weight"] = torch.zeros(64, 32)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(DeepseekV3ExportError, match="expert index 8 is out of range"):
        import_deepseek_v3(tmp_path)


# ------------------------------------------------------------------------------ the router
def _reference_route(x, weight, bias, k, n_group, topk_group, norm, scale):
    """Per-token DeepSeek-V3 routing written from the paper's description with Python lists
    (float64): sigmoid affinities; a group's score is the sum of its two best biased scores;
    keep the topk_group best groups; take the k best biased scores among their experts; weight
    by the unbiased affinities (normalised if ``norm``) times ``scale``."""
    E = weight.shape[0]
    per_group = E // n_group
    out = []
    for t in range(x.shape[0]):
        s = [
            1.0 / (1.0 + torch.exp(-(weight[e].double() @ x[t].double())).item()) for e in range(E)
        ]
        c = [s[e] + float(bias[e]) for e in range(E)]
        groups = []
        for g in range(n_group):
            best2 = sorted(c[g * per_group : (g + 1) * per_group], reverse=True)[:2]
            groups.append((sum(best2), g))
        kept = {g for _, g in sorted(groups, reverse=True)[:topk_group]}
        cand = sorted(((c[e], e) for e in range(E) if e // per_group in kept), reverse=True)
        chosen = [e for _, e in cand[:k]]
        w = [s[e] for e in chosen]
        if norm:
            total = sum(w)
            w = [v / total for v in w]
        out.append({e: v * scale for e, v in zip(chosen, w)})
    return out


@pytest.mark.parametrize(
    "E,k,n_group,topk_group,norm",
    [(8, 2, 4, 2, True), (16, 3, 4, 1, False), (6, 2, 1, 1, True), (8, 4, 2, 1, True)],
)
def test_router_matches_per_token_reference(E, k, n_group, topk_group, norm):
    config = moe_config(
        n_routed_experts=E,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(1)
    router = Router(config)
    router.reset_parameters(0.5)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, 16)
    out = router(x)
    ref = _reference_route(
        x, router.weight, router.e_score_correction_bias, k, n_group, topk_group, norm, 2.5
    )
    for t in range(x.shape[0]):
        got = dict(zip(out.indices[t].tolist(), out.weights[t].tolist()))
        assert got.keys() == ref[t].keys(), t
        for e in got:
            assert got[e] == pytest.approx(ref[t][e], rel=1e-5, abs=1e-6)
    # Non-vacuous: the bias (and the group limit, when there is one) change some choices.
    plain = _reference_route(x, router.weight, torch.zeros(E), k, n_group, topk_group, norm, 2.5)
    assert any(p.keys() != r.keys() for p, r in zip(plain, ref))
    if topk_group < n_group:
        free = _reference_route(
            x, router.weight, router.e_score_correction_bias, k, 1, 1, norm, 2.5
        )
        assert any(f.keys() != r.keys() for f, r in zip(free, ref))


def test_experts_match_per_token_reference_and_every_weight_gets_a_gradient():
    config = moe_config(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=8
    )
    torch.manual_seed(2)
    moe = MoE(config)
    moe.reset_parameters(0.3)
    x = torch.randn(2, 9, 16)
    y = moe(x)  # [2, 9, 16]
    flat = x.reshape(-1, 16)
    r = moe.gate(flat)
    ref = moe.shared_experts(flat).clone()
    for t in range(flat.shape[0]):
        for e, w in zip(r.indices[t].tolist(), r.weights[t].tolist()):
            gate, up = (moe.experts.gate_up_proj[e] @ flat[t]).chunk(2)
            ref[t] += w * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(y.reshape(-1, 16), ref, atol=1e-5, rtol=1e-5)
    y.pow(2).sum().backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert moe.experts.gate_up_proj.grad is not None and moe.experts.down_proj.grad is not None
    used = r.indices.unique()
    assert (moe.experts.down_proj.grad[used].flatten(1).abs().sum(-1) > 0).all()
    assert moe.gate.e_score_correction_bias.grad is None  # a buffer: no gradient


def test_router_runs_in_fp32_under_bf16_autocast():
    config = moe_config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2)
    router = Router(config)
    router.reset_parameters(0.5)
    x = torch.randn(32, 16)
    ref = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(x)
    assert torch.equal(got.indices, ref.indices) and torch.equal(got.weights, ref.weights)


def test_router_stays_fp32_under_bf16():
    model = Decoder(moe_config()).to(torch.bfloat16)
    gate = model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.layers[1].mlp.experts.down_proj.dtype == torch.bfloat16
    assert model(torch.randint(0, VOCAB, (1, 5))).logits.dtype == torch.bfloat16


# ------------------------------------------------------------------------ load balancing
def test_training_forwards_count_loads_and_the_bias_moves_by_sign():
    torch.manual_seed(3)
    model = Decoder(moe_config())
    ids = torch.randint(0, VOCAB, (2, 10))
    model.eval()
    model(ids)
    assert expert_loads(model).sum() == 0  # evaluation does not count
    model.train()
    with torch.no_grad():
        model(ids)
    assert expert_loads(model).sum() == 0  # nor a forward without autograd (a KL reference)
    model(ids)
    loads = expert_loads(model)  # [2, 8]
    assert loads.shape == (2, 8) and (loads.sum(-1) == 20 * 2).all()  # N * k per layer
    before = [m.gate.e_score_correction_bias.clone() for m in moe_layers(model)]
    model.update_router_bias(0.01)
    for m, b, load in zip(moe_layers(model), before, loads.double()):
        expected = b + 0.01 * torch.sign(load.mean() - load)
        torch.testing.assert_close(m.gate.e_score_correction_bias, expected.float())
    assert expert_loads(model).sum() == 0  # counts restart
    with pytest.raises(ValueError, match="expected \\[L_moe, E\\]"):
        update_router_bias(model, 0.01, torch.zeros(3, 8))


def test_bias_updates_balance_a_skewed_router():
    """A router that sends most tokens to experts 0 and 1 is pulled to balance by the bias
    updates alone (at rate 0 it stays skewed)."""
    config = moe_config(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=2, n_group=1, topk_group=1
    )
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(5)).abs()

    def ratios(rate: float) -> list[float]:
        torch.manual_seed(4)
        moe = MoE(config).train()
        moe.reset_parameters(0.3)
        with torch.no_grad():
            moe.gate.weight[:2] += 0.1  # experts 0, 1 favoured by tokens with a positive sum
        out = []
        for _ in range(80):
            moe(x)
            out.append(float(load_stats(expert_loads(moe))["moe/load_max_over_mean"]))
            update_router_bias(moe, rate)
        return out

    balanced, frozen = ratios(0.01), ratios(0.0)
    assert balanced[0] == frozen[0] > 3.0  # max / mean load; 4 = every token on 2 of 8 experts
    assert min(frozen) > 3.0
    assert sum(balanced[-10:]) / 10 < 1.4, balanced[-10:]


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(n_group=3), "n_group=3 must divide n_routed_experts=8"),
        (dict(n_group=8, topk_group=2), "gives 1 expert per group"),
        (dict(topk_group=5), "topk_group=5 is out of range"),
        (dict(num_experts_per_tok=5, topk_group=2), r"allowed \[1, topk_group"),
        (dict(num_experts_per_tok=9, n_group=1, topk_group=1), "num_experts_per_tok=9"),
        (dict(first_k_dense_replace=4), "first_k_dense_replace=4 is out of range"),
        (dict(n_routed_experts=0, router_bias_update_rate=0.001), "no effect"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0"),
        (dict(norm_topk_prob=1), "norm_topk_prob"),
    ],
)
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        moe_config(**kw)


def test_plain_gqa_moe_has_no_hf_family():
    from unicache_train.checkpoint.hf_config import HFCheckpointError, to_hf_config

    config = moe_config(attention_type="gqa", num_key_value_heads=2)
    with pytest.raises(HFCheckpointError, match="n_routed_experts=8: family='llama'"):
        to_hf_config(config, "llama")


# ------------------------------------------------------------------------------ mHC + MoE
def test_mhc_moe_trains_balances_and_exports_through_remote_code(tmp_path):
    """A tiny mHC + MoE (GQA) model trains under Lightning with the bias update on (loss falls,
    biases move, moe/* logged), exports as unicache_mhc, reloads with transformers
    (trust_remote_code) and with import_hf to equal logits / weights."""
    from transformers import AutoModelForCausalLM

    from unicache_train.checkpoint.hf import export_hf, import_hf
    from unicache_train.data.config import DataConfig, SyntheticDataConfig
    from unicache_train.train.config import LoggingConfig, MonitorConfig, RunConfig, TrainConfig
    from unicache_train.train.run import fit

    model_cfg = ModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        residual_mode="mhc",
        hc_mult=2,
        hc_sinkhorn_iters=5,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        router_bias_update_rate=0.01,
    )
    config = RunConfig(
        model=model_cfg,
        data=DataConfig(
            seq_len=32, batch_size=4, synthetic=SyntheticDataConfig(num_stories=40, num_recall=40)
        ),
        train=TrainConfig(
            max_steps=12,
            lr=1e-2,
            warmup_steps=2,
            val_every_n_steps=1000,
            limit_val_batches=1,
            checkpoint_every_n_steps=1000,
            accelerator="cpu",
            devices=1,
            out_dir=str(tmp_path / "run"),
            progress_bar=False,
            log_every_n_steps=1,
        ),
        logging=LoggingConfig(logger="csv"),
        monitor=MonitorConfig(gain=False, plots=False),
    )

    import lightning as L

    class Losses(L.Callback):
        def __init__(self):
            self.losses, self.bias = [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            self.bias.append(float(trainer.callback_metrics["moe/bias_abs_mean"]))

    rec = Losses()
    trainer = fit(config, callbacks=[rec])
    assert trainer.global_step == 12
    assert sum(rec.losses[-3:]) / 3 < 0.85 * sum(rec.losses[:3]) / 3, rec.losses
    model = trainer.lightning_module.model.eval()
    bias = model.layers[1].mlp.gate.e_score_correction_bias
    # The update ran after every step (the biases go up and down by 0.01: they may be back at
    # zero at the end), and its stats were logged.
    assert max(rec.bias) > 0 and max(rec.bias) <= 12 * 0.01 + 1e-6
    assert bias.abs().max() <= 12 * 0.01 + 1e-6
    assert "moe/load_max_over_mean" in trainer.callback_metrics
    assert expert_loads(model).sum() == 0  # reset after the last step

    out = export_hf(model, tmp_path / "hf", tokenizer_from="byte")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "unicache_mhc" and cfg["n_routed_experts"] == 4
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    with torch.no_grad():
        ours = model(ids).logits
        hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        torch.testing.assert_close(hf(ids, use_cache=False).logits, ours, atol=1e-5, rtol=1e-5)
    back, back_cfg = import_hf(out)
    for name in (
        "n_routed_experts",
        "num_experts_per_tok",
        "n_shared_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "routed_scaling_factor",
        "hc_mult",
    ):
        assert getattr(back_cfg, name) == getattr(model.config, name), name
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
