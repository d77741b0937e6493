"""xKV cross-layer SVD compression: exactness (full rank, group size 1 = per-layer SVD), byte
accounting of the factors, in-loop forward == prefill -> compress -> decode, gradients through
the projection onto the detached basis, MLA, composition with UniCache, config, curriculum."""

import math

import pytest
import torch
from conftest import tiny_model_config

from unicache_train.compress import UniCacheCompressor, UniCacheConfig
from unicache_train.compress.config import XKVConfig
from unicache_train.compress.presets import text_style_baseline
from unicache_train.compress.xkv import XKVCompressor, flatten_heads, layer_groups, select_rank
from unicache_train.inloop import build_compressor, continuation_mask
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.model.generate import decode_teacher_forced, generate_compressed
from unicache_train.train.config import CompressionTrainConfig, RunConfig
from unicache_train.train.module import LMModule
from unicache_train.validation import ConfigError

V = 97


def tiny(**kw) -> Decoder:
    torch.manual_seed(0)
    return Decoder(tiny_model_config(**{"vocab_size": V, "num_hidden_layers": 3, **kw})).eval()


def tiny_mla() -> Decoder:
    return tiny(
        attention_type="mla",
        kv_lora_rank=24,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )


class Capture:
    """Wraps a compressor at the seam (as the evaluation's captures do) and keeps what each
    layer received and returned; ``inner`` lets the decoder find the cross-layer compressor."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.pre_rope = inner.pre_rope
        self.inputs, self.segments = {}, {}

    def __call__(self, inp):
        seg = self.inner(inp)
        self.inputs[inp.layer_idx], self.segments[inp.layer_idx] = inp, seg
        return seg


def text_unicache(rate: float = 0.5) -> UniCacheConfig:
    d = text_style_baseline().to_dict()
    d["target_rate"] = rate
    d["head_merge"]["enabled"] = False
    d["quantize"]["bits"] = None
    return UniCacheConfig.from_dict(d)


# ------------------------------------------------------------------ exactness
def test_layer_groups_are_contiguous() -> None:
    assert layer_groups(5, 2) == [(0, 1), (2, 3), (4,)]
    assert layer_groups(4, 4) == [(0, 1, 2, 3)]
    assert layer_groups(3, 1) == [(0,), (1,), (2,)]


@pytest.mark.parametrize("pre_rope", [True, False])
def test_full_rank_reconstructs_kv_and_the_forward(pre_rope: bool) -> None:
    model = tiny()
    ids = torch.randint(0, V, (2, 40))
    split = torch.tensor([31, 17])
    comp = Capture(
        XKVCompressor(XKVConfig(group_size=2, rank_fraction=1.0, keys_pre_rope=pre_rope))
    )
    with torch.no_grad():
        out = model(ids, split=split, compressor=comp)
        plain = model(ids).logits
    for layer, inp in comp.inputs.items():
        low = comp.segments[layer].lowrank
        k_hat, v_hat = low.reconstruct()  # [B, Hk, S, D], pre-RoPE when pre_rope
        S = k_hat.shape[2]
        ctx = inp.context_mask[:, None, :S, None]
        # fp32 SVD of a [<=31, 64] matrix and its product back: ~1e-6 relative round-off.
        torch.testing.assert_close(k_hat * ctx, inp.keys[:, :, :S] * ctx, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(v_hat * ctx, inp.values[:, :, :S] * ctx, atol=2e-5, rtol=1e-4)
        assert float(comp.segments[layer].stats["xkv_rel_error_k"]) < 1e-5
    cont = continuation_mask(split, 40)
    torch.testing.assert_close(out.logits[cont], plain[cont], atol=1e-5, rtol=1e-5)


def test_group_size_one_is_per_layer_svd() -> None:
    model = tiny()
    ids = torch.randint(0, V, (2, 36))
    split = torch.tensor([30, 21])
    comp = Capture(XKVCompressor(XKVConfig(group_size=1, rank_fraction=0.25)))
    with torch.no_grad():
        model(ids, split=split, compressor=comp)
    for layer, inp in comp.inputs.items():
        low = comp.segments[layer].lowrank
        k_hat, v_hat = low.reconstruct()
        for b in range(2):
            s = int(split[b])
            for x, x_hat in ((inp.keys, k_hat), (inp.values, v_hat)):
                X = flatten_heads(x[b : b + 1, :, :s])[0]  # [s, Hk*D]
                r = round(0.25 * X.shape[1])
                U, sv, Vh = torch.linalg.svd(X, full_matrices=False)
                ref = (U[:, :r] * sv[:r]) @ Vh[:r]  # Eckart-Young: the best rank-r fit
                got = flatten_heads(x_hat[b : b + 1, :, :s])[0]
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
            assert int(low.rank_k[b]) == round(0.25 * 32)


@pytest.mark.parametrize("reduction", [4.0, 8.0])
def test_realized_reduction_equals_configured(reduction: float) -> None:
    """Context 64 tokens, group width 2 layers x 2 heads x 16 = 64: rank
    ``64 * 64 / (reduction * (64 + 64))`` is an integer, so the factors take exactly
    1/reduction."""
    model = tiny(num_hidden_layers=4)
    ids = torch.randint(0, V, (2, 80))
    split = torch.tensor([64, 64])
    comp = XKVCompressor(XKVConfig(group_size=2, rank_mode="reduction", reduction=reduction))
    with torch.no_grad():
        out = model(ids, split=split, compressor=comp)
    kv = sum(float(s["kv_bytes"]) for s in out.compression_stats)
    base = 4 * 2 * 64 * (2 * 2 * 16) * 2  # layers x samples x tokens x (K+V width) x 2 bytes
    assert base / kv == pytest.approx(reduction, abs=0, rel=1e-12)
    assert all(float(s["xkv_rank_k"]) == 64 * 64 / (reduction * 128) for s in out.compression_stats)
    # The decoding cache stores the factors (not the reconstruction) and counts the same bytes.
    _, cache = decode_teacher_forced(model, ids[:, :66], split, comp)
    assert cache.kv_bytes() == int(kv)
    assert cache.baseline_bytes(16) / cache.kv_bytes() == pytest.approx(reduction, rel=1e-12)
    for seg in cache.segments:
        assert seg.keys is None and seg.values is None and seg.lowrank is not None


def test_reduction_rank_is_the_largest_within_budget_for_ragged_contexts() -> None:
    cfg = XKVConfig(rank_mode="reduction", reduction=4.0)
    rows = torch.tensor([13, 50, 200])
    W = 96
    sv = torch.ones(3, W)
    r = select_rank(cfg, sv, W, rows, rows)
    for b in range(3):
        n = int(rows[b])
        budget = n * W / 4.0
        assert int(r[b]) * (n + W) <= budget < (int(r[b]) + 1) * (n + W)


def test_energy_rank_is_the_smallest_reaching_the_threshold() -> None:
    cfg = XKVConfig(rank_mode="energy", energy=0.9)
    sv = torch.tensor([[3.0, 2.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0]])
    r = select_rank(cfg, sv, 4, torch.tensor([10, 10]), torch.tensor([10, 10]))
    # [9, 4, 1, .25] / 14.25: 0.63, 0.91 -> 2; uniform: 0.25 steps -> 4
    assert r.tolist() == [2, 4]


def test_bf16_model_factorises_in_fp32() -> None:
    model = tiny().to(torch.bfloat16)
    ids = torch.randint(0, V, (2, 36))
    split = torch.tensor([30, 21])
    comp = Capture(XKVCompressor(XKVConfig(group_size=3, rank_fraction=1.0)))
    with torch.no_grad():
        out = model(ids, split=split, compressor=comp)
    low = comp.segments[0].lowrank
    assert low.layer_k.dtype == torch.float32 and low.token_k.dtype == torch.float32
    assert comp.segments[0].keys.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()
    # Full rank in fp32 reproduces the factorised (recorded, bf16) rows to fp32 round-off. (The
    # in-loop forward's own bf16 K/V may differ from them by bf16 round-off: the two passes
    # run the context in differently shaped attention calls.)
    group, i = comp.inputs[1].fit.groups[1]
    x = group.keys.x[i].float()  # [B, S, Hk*D], masked
    k_hat = flatten_heads(comp.segments[1].lowrank.reconstruct()[0])
    torch.testing.assert_close(k_hat * (x != 0).any(-1, keepdim=True), x, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ in-loop == inference
CASES = {
    "g2_fraction": dict(group_size=2, rank_fraction=0.25),
    "g3_reduction8": dict(group_size=3, rank_mode="reduction", reduction=8.0),
    "g2_energy": dict(group_size=2, rank_mode="energy", energy=0.8),
    "g2_post_rope": dict(group_size=2, rank_fraction=0.25, keys_pre_rope=False),
    "g2_causal_refresh": dict(group_size=2, rank_fraction=0.25, gradient="causal", refresh_every=4),
}


@pytest.mark.parametrize("case", [*CASES, "unicache+xkv"])
def test_inloop_forward_equals_prefill_compress_decode(case: str) -> None:
    model = tiny()
    ids = torch.randint(0, V, (2, 44))
    split = torch.tensor([29, 18])  # ragged: each sample decodes from its own split
    if case == "unicache+xkv":
        comp = XKVCompressor(
            XKVConfig(group_size=2, rank_mode="reduction", reduction=4.0),
            token_compressor=UniCacheCompressor(text_unicache(0.5)),
        )
    else:
        comp = XKVCompressor(XKVConfig(**CASES[case]))
    with torch.no_grad():
        ref = model(ids, split=split, compressor=comp)
    got, cache = decode_teacher_forced(model, ids, split, comp)
    cont = continuation_mask(split, ids.shape[1])
    assert torch.isnan(got[~cont]).all() and not torch.isnan(got[cont]).any()
    # Both paths fit bit-identical factors (both record the same prefill of the same tokens); the
    # continuation then attends the same numbers in another key layout (SDPA blocking, padding
    # slots): fp32 round-off, ~4e-7 seen, as for UniCache in test_inloop.py.
    torch.testing.assert_close(got[cont], ref.logits[cont], atol=1e-5, rtol=1e-5)
    stat_bytes = sum(float(s["kv_bytes"]) for s in ref.compression_stats)
    assert cache.kv_bytes(include_metadata=False) == int(stat_bytes)
    # Nothing of a forward stays on the compressor: outside its decoder's forward it refuses.
    from unicache_train.compress.testing import make_input

    with pytest.raises(RuntimeError, match="cross-layer"):
        comp(make_input())
    if case == "unicache+xkv":
        removed = [float(s["rate_realized"]) for s in ref.compression_stats]
        assert min(removed) > 0.25
        reduction = cache.baseline_bytes(16) / cache.kv_bytes()
        assert reduction >= 1 / (0.25 + 1e-9)


def test_greedy_generation_on_compressed_cache_matches_inloop_argmax() -> None:
    model = tiny()
    prompts = torch.randint(0, V, (2, 30))
    split = torch.tensor([30, 22])
    comp = XKVCompressor(XKVConfig(group_size=2, rank_mode="reduction", reduction=4.0))
    gen = generate_compressed(model, prompts, split, comp, max_new_tokens=5).tokens
    for b in range(2):
        s = int(split[b])
        seq = torch.cat([prompts[b, :s], gen[b]])[None]
        with torch.no_grad():
            logits = model(seq, split=split[b : b + 1], compressor=comp).logits
        assert torch.equal(logits[0, s - 1 : -1].argmax(-1), gen[b])


def test_inputs_embeds_and_positions_reach_the_prefill() -> None:
    """The decoder records the context with every input it got (e.g. a vision-language
    model's embeddings, explicit positions)."""
    model = tiny()
    ids = torch.randint(0, V, (2, 32))
    split = torch.tensor([20, 26])
    pos = torch.arange(32).expand(2, 32) + torch.tensor([[0], [5]])
    comp = XKVCompressor(XKVConfig(rank_mode="reduction", reduction=4.0))
    with torch.no_grad():
        a = model(ids, positions=pos, split=split, compressor=comp).logits
        b = model(
            inputs_embeds=model.embed_tokens(ids), positions=pos, split=split, compressor=comp
        ).logits
    torch.testing.assert_close(a, b)


def test_compressor_outside_the_decoder_refuses_to_serve() -> None:
    comp = XKVCompressor()
    from unicache_train.compress.testing import make_input

    with pytest.raises(RuntimeError, match="cross-layer"):
        comp(make_input())


# ------------------------------------------------------------------ MLA
def test_mla_latents_share_one_factorisation() -> None:
    model = tiny_mla()
    ids = torch.randint(0, V, (2, 40))
    split = torch.tensor([33, 20])
    full = Capture(XKVCompressor(XKVConfig(group_size=3, rank_fraction=1.0)))
    with torch.no_grad():
        out = model(ids, split=split, compressor=full)
        plain = model(ids).logits
    cont = continuation_mask(split, 40)
    torch.testing.assert_close(out.logits[cont], plain[cont], atol=1e-5, rtol=1e-5)
    seg = full.segments[0]
    assert seg.lowrank.token_v is None  # values (c_kv) are read back from the keys
    R = 24
    torch.testing.assert_close(seg.values, seg.keys[..., :R])
    comp = XKVCompressor(XKVConfig(group_size=3, rank_mode="reduction", reduction=4.0))
    with torch.no_grad():
        out = model(ids, split=split, compressor=comp)
    kv = sum(float(s["kv_bytes"]) for s in out.compression_stats)
    base = 3 * int(split.sum()) * (R + 8) * 2  # the latent c_kv ‖ k_pe once, 16 bit
    assert 0.2 < kv / base <= 0.25


def test_mla_xkv_gradients() -> None:
    model = tiny_mla().train()
    ids = torch.randint(0, V, (2, 40))
    split = torch.tensor([30, 25])
    comp = XKVCompressor(XKVConfig(group_size=3, rank_mode="reduction", reduction=4.0))
    logits = model(ids, split=split, compressor=comp).logits
    logits[:, 30:].float().logsumexp(-1).mean().backward()
    g = model.layers[2].self_attn.kv_a_proj_with_mqa.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


# ------------------------------------------------------------------ gradients
def _continuation_grads(mode: str) -> dict[str, torch.Tensor]:
    model = tiny().train()
    ids = torch.randint(0, V, (3, 48), generator=torch.Generator().manual_seed(3))
    split = torch.tensor([30, 24, 40])
    cfg = XKVConfig(group_size=3, rank_mode="reduction", reduction=4.0, gradient=mode)
    comp = XKVCompressor(cfg)
    logits = model(ids, split=split, compressor=comp).logits
    # Loss on tokens t >= split only: the last layer's context K/V reach it only through the
    # segment, i.e. through the projection onto the detached basis.
    cont = torch.arange(48)[None, :] >= split[:, None]
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4))
    (logits * w)[cont].sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradients_flow_through_the_projection() -> None:
    exact = _continuation_grads("exact")
    causal = _continuation_grads("causal")
    for grads in (exact, causal):
        assert all(torch.isfinite(g).all() for g in grads.values())
        for layer in range(3):
            for proj in ("k_proj", "v_proj"):
                assert grads[f"layers.{layer}.self_attn.{proj}.weight"].abs().sum() > 0

    # The causal gradient drops only the paths from a reconstruction into later group members:
    # the whole gradient stays close to the exact one (cosine 0.974 measured here; the early
    # layers' v_proj lose most, 0.70), the last member's own K/V path is intact.
    def flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([g[k].flatten() for k in sorted(g)])

    cos = torch.nn.functional.cosine_similarity(flat(exact), flat(causal), dim=0)
    assert cos > 0.9, float(cos)


@pytest.mark.parametrize("mode", ["exact", "causal", "unicache+xkv"])
def test_activation_recompute_gives_the_same_gradients(mode: str) -> None:
    from unicache_train.train.strategies import apply_activation_checkpointing

    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(5))
    split = torch.tensor([28, 19])
    grads = []
    for recompute in (False, True):
        model = tiny().train()
        if recompute:
            apply_activation_checkpointing(model)
        cfg = XKVConfig(
            group_size=2,
            rank_mode="reduction",
            reduction=4.0,
            gradient="causal" if mode == "causal" else "exact",
        )
        tok = UniCacheCompressor(text_unicache(0.5)) if mode == "unicache+xkv" else None
        comp = XKVCompressor(cfg, token_compressor=tok)
        logits = model(ids, split=split, compressor=comp).logits
        w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(6))
        (logits * w).sum().backward()  # the recompute replays the inputs (fit included)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_module_step_with_xkv_and_kl_reuses_the_prefill() -> None:
    cfg = RunConfig(
        model=ModelConfig(
            vocab_size=V,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        compress=CompressionTrainConfig(
            enabled=True,
            method="xkv",
            xkv=XKVConfig(rank_mode="reduction", reduction=4.0, gradient="causal"),
            kl_weight=0.5,
            min_context=8,
        ),
    )
    torch.manual_seed(0)
    module = LMModule(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (3, 41), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone()}
    calls = []  # passes through the decoder stack
    handle = module.model.layers[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    loss, logs, per_layer = module.compressed_loss(batch, step=0)
    handle.remove()
    # The recording pass (full length, doubles as the KL reference) + the in-loop pass; no third.
    assert len(calls) == 2
    loss.backward()
    assert torch.isfinite(loss) and float(logs["train/kl"]) > 0
    assert 4.0 - 1e-6 <= float(logs["compress/kv_reduction"]) < 5.0
    assert all(
        torch.isfinite(p.grad).all() for p in module.model.parameters() if p.grad is not None
    )
    # Nothing of the step stays on the compressor (step and reference are forward arguments).
    assert not {"step", "keep_reference", "reference_logits"} & set(vars(module.compressor))


def test_kl_reference_from_the_prefill_is_the_plain_forward() -> None:
    model = tiny()
    ids = torch.randint(0, V, (2, 30))
    split = torch.tensor([20, 12])
    comp = XKVCompressor(XKVConfig(gradient="causal"))
    with torch.no_grad():
        out = model(ids, split=split, compressor=comp, reference_logits=True)
        plain = model(ids).logits
    torch.testing.assert_close(out.reference_logits, plain, atol=1e-5, rtol=1e-5)


def test_pooled_basis_is_refreshed_every_k_steps() -> None:
    model = tiny()
    ids = torch.randint(0, V, (2, 30))
    split = torch.tensor([20, 12])
    comp = XKVCompressor(XKVConfig(refresh_every=3))
    with torch.no_grad():
        a = model(ids, split=split, compressor=comp, step=0).logits
        bases = dict(comp._pooled)
        model(ids[[1, 0]], split=split[[1, 0]], compressor=comp, step=2)
        assert all(comp._pooled[k] is bases[k] for k in bases)  # reused
        model(ids[[1, 0]], split=split[[1, 0]], compressor=comp, step=3)
        assert all(comp._pooled[k] is not bases[k] for k in bases)  # refreshed
        # evaluation (no step): each sample's own SVD again
        b = model(ids, split=split, compressor=comp).logits
    assert not torch.allclose(a, b)


# ------------------------------------------------------------------ curriculum and config
def test_rate_scale_zero_is_the_identity_and_scales_the_rank() -> None:
    model = tiny()
    ids = torch.randint(0, V, (2, 30))
    split = torch.tensor([20, 12])
    comp = XKVCompressor(XKVConfig(rank_mode="reduction", reduction=8.0), curriculum_steps=2)
    assert comp.at_step(0) == 0.0
    with torch.no_grad():
        out = model(ids, split=split, compressor=comp)
        plain = model(ids).logits
    torch.testing.assert_close(out.logits, plain, atol=1e-5, rtol=1e-5)
    assert all(float(s["kv_reduction"]) == 1.0 for s in out.compression_stats)
    cfg = XKVConfig(rank_mode="reduction", reduction=8.0)
    rows = torch.tensor([100])
    half = select_rank(cfg, torch.ones(1, 64), 64, rows, rows, scale=0.5)
    assert int(half) == int(100 * 64 / (4.5 * 164))
    assert comp.at_step(1) == 0.5 and comp.at_step(None) == 1.0
    with pytest.raises(ValueError, match="curriculum_steps=-1"):
        XKVCompressor(curriculum_steps=-1)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(group_size=5), r"XKVConfig.group_size=5 is out of range; allowed \[1, 4\]"),
        (dict(group_size=0), "group_size=0"),
        (dict(rank_fraction=0.0), r"rank_fraction=0.0 is out of range; allowed \(0.0, 1.0\]"),
        (dict(energy=1.5), "energy=1.5"),
        (dict(reduction=0.5), r"reduction=0.5 is out of range; allowed \[1.0, 64.0\]"),
        (dict(rank_mode="ratio"), "rank_mode='ratio' is not allowed"),
        (dict(rank_mode="svd"), "rank_mode='svd' is not allowed"),
        (dict(gradient="none"), "gradient='none'"),
        (dict(refresh_every=0), "refresh_every=0"),
        (dict(keys_pre_rope="yes"), "keys_pre_rope='yes'"),
    ],
)
def test_config_errors_name_field_value_and_range(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        XKVConfig(**kw)


def test_train_config_methods() -> None:
    cc = CompressionTrainConfig.from_dict(dict(enabled=True, method="xkv", xkv={"group_size": 4}))
    assert isinstance(cc.xkv, XKVConfig) and cc.xkv.group_size == 4
    comp = build_compressor(cc)
    assert isinstance(comp, XKVCompressor) and comp.config is not cc.xkv
    both = build_compressor(CompressionTrainConfig(enabled=True, method="unicache+xkv"))
    assert both.token_compressor.config.head_merge.enabled is False
    assert not both.token_compressor.config.quantize.active
    with pytest.raises(ConfigError, match="gradient='causal' is not allowed with method"):
        CompressionTrainConfig.from_dict(dict(method="unicache+xkv", xkv={"gradient": "causal"}))
    with pytest.raises(ConfigError, match="unknown field"):
        CompressionTrainConfig.from_dict(dict(method="xkv", xkv={"rank": 3}))
    with pytest.raises(ConfigError, match="head_merge.enabled=True is not allowed under xKV"):
        XKVCompressor(token_compressor=UniCacheCompressor(UniCacheConfig()))
    rc = RunConfig(compress=cc)
    assert RunConfig.from_dict(rc.to_dict()).compress.xkv == cc.xkv


# ------------------------------------------------------------------ evaluation
def test_evaluation_rows_at_equal_kv_bytes(tmp_path) -> None:
    from unicache_train.data.config import DataConfig, SyntheticDataConfig
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval.report import format_table, write_outputs
    from unicache_train.eval.sweep import CompressionEvalConfig, evaluate_compression

    data = DataConfig(
        seq_len=96,
        batch_size=4,
        pack=False,
        val_fraction=0.25,
        synthetic=SyntheticDataConfig(
            num_stories=8, num_recall=8, recall_num_facts=3, recall_num_filler=0
        ),
    )
    model = tiny(vocab_size=260, num_hidden_layers=2)
    opts = CompressionEvalConfig(
        rates=[],
        xkv_reductions=[4.0, 8.0],
        xkv={"group_size": 2},
        xkv_token_rate=0.5,
        quantize="int8",
        num_recall=4,
        limit_batches=1,
        batch_size=4,
    )
    rows = evaluate_compression(model, load_tokenizer("byte"), data, text_style_baseline(), opts)
    labels = [r["label"] for r in rows]
    assert labels[0] == "uncompressed" and labels[1] == "xkv 4x g2"
    assert labels[2] == "unicache 0.5 + xkv 4x g2" and labels[3].startswith("unicache @4x rate=")
    by = {r["label"]: r for r in rows}
    for red in (4, 8):
        x = by[f"xkv {red}x g2"]
        u = next(r for r in rows if r["label"].startswith(f"unicache @{red}x"))
        # Measured on the real decoding caches of the recall prompts: factors / packed int8.
        assert red <= x["kv_reduction"] < red / 0.6
        assert u["kv_reduction"] >= red / 1.15 and u["method"] == "unicache"
        assert x["target_reduction"] == red
        assert x["method"] == "xkv" and math.isnan(x["rate"]) and x["output_kl"] > 0
        assert not math.isnan(x["attn_kl"]) and 0 <= x["recall_acc"] <= 1
    assert "xkv 8x g2" in format_table(rows)
    _, png = write_outputs(rows, tmp_path, "xkv_eval")
    assert png.stat().st_size > 5000


# ------------------------------------------------------------------ alignment analysis
def test_alignment_measures() -> None:
    from unicache_train.compress.xkv.alignment import (
        linear_cka,
        principal_angles,
        subspace_overlap,
        token_subspace,
    )

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 16, generator=g)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g))
    u = token_subspace(x, 4)
    # Another layer's features = a rotation of these: the same token subspace (overlap 1,
    # angles 0), CKA 1; CKA is scale-invariant.
    assert subspace_overlap(u, token_subspace(2.0 * x @ q, 4)) == pytest.approx(1.0, abs=1e-4)
    assert linear_cka(x, x @ q) == pytest.approx(1.0, abs=1e-6)
    assert float(principal_angles(u, u).max()) < 1e-3
    assert linear_cka(x, 3.0 * x) == pytest.approx(1.0, abs=1e-9)
    # Orthogonal token subspaces: overlap 0.
    e = torch.eye(40)
    assert subspace_overlap(e[:, :4], e[:, 4:8]) == pytest.approx(0.0)
    y = torch.randn(40, 16, generator=g)
    assert linear_cka(x, y) < 0.6


def test_alignment_of_a_model_and_identical_layers() -> None:
    from unicache_train.compress.xkv.alignment import collect_context_kv, layer_alignment

    model = tiny()
    ids = torch.randint(0, V, (2, 30))
    keys, values, mask = collect_context_kv(model, ids, torch.tensor([30, 20]))
    assert len(keys) == 3 and keys[0].shape == (2, 30, 32) and int(mask.sum()) == 50
    res = layer_alignment(keys, values, mask, rank_fraction=0.25)
    for m in (res.overlap_k, res.overlap_v, res.cka_k, res.cka_v):
        assert m.shape == (3, 3) and torch.allclose(m.diagonal(), torch.ones(3), atol=1e-4)
        assert torch.allclose(m, m.T, atol=1e-5)
    assert res.random_overlap == pytest.approx((8 / 30 + 8 / 20) / 2)
    twin = layer_alignment([keys[0], keys[0]], [values[0], 2 * values[0]], mask)
    assert float(twin.overlap_k[0, 1]) == pytest.approx(1.0, abs=1e-4)
    assert float(twin.cka_v[0, 1]) == pytest.approx(1.0, abs=1e-6)
    s = res.summary()
    assert 0 < s["overlap_k_adjacent"] <= 1 and s["random_overlap"] < s["overlap_k_adjacent"]


def test_alignment_of_an_imported_hf_model(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.compress.xkv.alignment import collect_context_kv, layer_alignment

    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model, _ = import_hf(tmp_path)
    ids = torch.randint(0, V, (2, 40))
    res = layer_alignment(*collect_context_kv(model, ids), rank_fraction=0.25)
    assert res.overlap_k.shape == (3, 3)
    # A random residual network: neighbouring layers read nearly the same residual stream, so
    # their token subspaces overlap far above chance (the xKV premise, trivially here).
    assert float(res.overlap_k[0, 1]) > 2 * res.random_overlap
    comp = XKVCompressor(XKVConfig(group_size=3, rank_mode="reduction", reduction=4.0))
    with torch.no_grad():
        out = model(ids, split=torch.tensor([30, 25]), compressor=comp)
    assert torch.isfinite(out.logits).all()


# ------------------------------------------------------------------ recipe
def _recipe():
    import importlib

    return importlib.import_module("recipes.finetune_xkv")


def test_recipe_config_and_options() -> None:
    recipe = _recipe()
    xopts, ft = recipe.parse_args(["recipe.train_reductions=[8]", "recipe.num_recall=3"])
    assert xopts.train_reductions == [8] and xopts.eval_reductions == [4.0, 8.0]
    assert xopts.num_recall == 3
    with pytest.raises(ConfigError, match="train_reductions"):
        recipe.parse_args(["recipe.train_reductions=[0.5]"])
    assert ft.compress.method == "xkv" and ft.compress.xkv.rank_mode == "reduction"
    sub = recipe.sub_config(ft, "unicache_8x", method="unicache", unicache={"target_rate": 0.8})
    assert sub.compress.method == "unicache" and sub.compress.unicache.target_rate == 0.8
    assert sub.compress.unicache.quantize.bits == 8 and sub.train.out_dir.endswith("unicache_8x")
    sub = recipe.sub_config(ft, "xkv_8x", method="xkv", xkv={"reduction": 8.0})
    assert sub.compress.xkv.reduction == 8.0 and sub.compress.xkv.group_size == 2


@pytest.mark.slow
def test_recipe_runs_from_scratch(tmp_path) -> None:
    recipe = _recipe()
    rows = recipe.main(
        [
            f"train.out_dir={tmp_path}",
            "train.max_steps=2",
            "train.val_every_n_steps=2",
            "train.limit_val_batches=1",
            "train.progress_bar=false",
            "logging.logger=none",
            "data.synthetic.num_stories=40",
            "data.synthetic.num_recall=40",
            "pretrain.train.max_steps=2",
            "pretrain.train.val_every_n_steps=2",
            "pretrain.train.limit_val_batches=1",
            "pretrain.data.synthetic.num_stories=40",
            "pretrain.data.synthetic.num_recall=40",
            "recipe.num_recall=2",
            "recipe.limit_batches=1",
            "recipe.train_reductions=[4]",
        ]
    )
    assert [(r["target_reduction"], r["method"]) for r in rows] == [
        (4.0, "xkv"),
        (4.0, "unicache"),
        (8.0, "xkv"),
        (8.0, "unicache"),
    ]
    assert not math.isnan(rows[0]["ppl_ft_compressed"]) and math.isnan(rows[2]["ppl_ft_compressed"])
    assert (tmp_path / "finetune_xkv.csv").is_file()


def test_export_policy_names_the_xkv_setting() -> None:
    from unicache_train.checkpoint.export import compression_policy_of

    xkv = XKVConfig(reduction=8.0, rank_mode="reduction")
    cfg = RunConfig(compress=CompressionTrainConfig(enabled=True, method="xkv", xkv=xkv))
    policy = compression_policy_of(cfg)
    assert policy["method"] == "xkv" and policy["xkv"]["reduction"] == 8.0
    plain = RunConfig(compress=CompressionTrainConfig(enabled=True))
    assert "xkv" not in compression_policy_of(plain)
