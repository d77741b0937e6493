"""The learned retention policy (compress/retention.py): it starts as its fixed prior, its
parameters are model parameters, gradients reach it and the model through both relaxations,
the budget term drives the kept fraction to the target, the hard selection of inference meets
the byte target exactly, and it trains under Lightning with its metrics logged."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_model_config

from unicache_train.compress import UniCacheCompressor, UniCacheConfig, presets
from unicache_train.compress.retention import RetentionPolicy, attach_retention
from unicache_train.compress.testing import check_segment, make_input
from unicache_train.data.config import DataConfig, SyntheticDataConfig
from unicache_train.inloop import build_compressor
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.train.config import (
    CompressionTrainConfig,
    LoggingConfig,
    MonitorConfig,
    RunConfig,
    TrainConfig,
)
from unicache_train.train.module import LMModule


def retention_cfg(rate: float = 0.6, bits: int | None = 8, **selection) -> UniCacheConfig:
    d = presets.retention().to_dict()
    d["target_rate"] = rate
    d["quantize"] = {**d["quantize"], "bits": bits}
    d["selection"] = {**d["selection"], **selection}
    return UniCacheConfig.from_dict(d)


def tiny_model() -> ModelConfig:
    return tiny_model_config()


def module(**compress) -> LMModule:
    cfg = RunConfig(
        model=tiny_model(),
        compress=CompressionTrainConfig.from_dict(
            {"enabled": True, "preset": "retention", **compress}
        ),
    )
    torch.manual_seed(0)
    return LMModule(cfg)


def batch(B: int = 4, T: int = 48, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (B, T + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone(), "split": torch.full((B,), 32)}


def kept(seg, b: int) -> list[int]:
    return seg.positions[b][seg.valid[b]].tolist()


# ------------------------------------------------------------------ init: the prior's ranking
@pytest.mark.parametrize("prior", ["sinks_recent", "snapkv"])
def test_init_ranking_equals_the_fixed_prior_and_training_moves_it(prior: str) -> None:
    inp = make_input(H=2, D=16, num_layers=4, layer_idx=2)
    inp.modality_ids = torch.zeros_like(inp.modality_ids)
    fixed = getattr(presets, prior)().to_dict()
    fixed["target_rate"] = 0.7
    ref = UniCacheCompressor(UniCacheConfig.from_dict(fixed))(inp)
    policy = RetentionPolicy(4, 2, 16).eval()
    with torch.no_grad():
        policy.bias.normal_()  # a per-head constant moves every token alike: no reordering
    learned = UniCacheCompressor(retention_cfg(0.7, prior=prior), retention=policy)(inp)
    for b in range(3):
        assert kept(learned, b) == kept(ref, b)
    with torch.no_grad():  # a trained key read does reorder (so the check above can fail)
        policy.weight.normal_(std=3.0)
    moved = UniCacheCompressor(retention_cfg(0.7, prior=prior), retention=policy)(inp)
    assert any(kept(moved, b) != kept(ref, b) for b in range(3))


# ------------------------------------------------------------------ parameters of the model
def test_policy_is_a_model_parameter_saved_optimized_and_reloaded() -> None:
    m = module()
    assert isinstance(m.model.kv_retention, RetentionPolicy)
    assert m.model.kv_retention.weight.shape == (2, 2, 16)
    sd = m.state_dict()
    assert "model.kv_retention.weight" in sd and "model.kv_retention.bias" in sd
    opt = m.configure_optimizers()["optimizer"]
    pol = [
        g for g in opt.param_groups if any(p is m.model.kv_retention.weight for p in g["params"])
    ]
    assert len(pol) == 1 and {id(p) for p in pol[0]["params"]} == {
        id(m.model.kv_retention.weight),
        id(m.model.kv_retention.bias),
    }  # its own group: lr_scale x train.lr, no decay towards the zero init
    assert pol[0]["weight_decay"] == 0.0
    assert pol[0]["initial_lr"] == pytest.approx(30.0 * m.config.train.lr)
    assert m.compressor.retention is m.model.kv_retention
    with torch.no_grad():
        m.model.kv_retention.weight.normal_()
    again = module()
    again.load_state_dict(m.state_dict(), strict=True)
    assert torch.equal(again.model.kv_retention.weight, m.model.kv_retention.weight)
    # Attaching twice reuses the model's policy (e.g. a compressor rebuilt for evaluation).
    assert attach_retention(again.model) is again.model.kv_retention


def test_retention_needs_the_model_and_a_gqa_cache() -> None:
    cc = CompressionTrainConfig(enabled=True, preset="retention")
    with pytest.raises(ValueError, match="pass the model to build_compressor"):
        build_compressor(cc)
    with pytest.raises(ValueError, match="needs a RetentionPolicy"):
        UniCacheCompressor(retention_cfg())
    mla = Decoder(ModelConfig(attention_type="mla", num_hidden_layers=1))
    with pytest.raises(ValueError, match="attention_type='mla'"):
        build_compressor(cc, mla)


# ------------------------------------------------------------------ gradients
@pytest.mark.parametrize("relaxation", ["gumbel_sigmoid", "st_topk"])
def test_lm_loss_gradients_reach_the_retention_logits_and_the_model(relaxation: str) -> None:
    m = module(unicache={"selection": {"relaxation": relaxation}})
    loss, logs, per_layer = m.compressed_loss(batch(), step=0)
    lm = logs["train/lm_loss"]
    assert "aux_loss" in per_layer[0] and torch.isfinite(loss)
    assert float(loss) > float(lm)  # the budget term is in the objective
    # The LM term alone (not only the budget term) reaches the policy and the keys.
    res_lm = loss - torch.stack([s["aux_loss"] for s in per_layer]).mean()
    pol = m.model.kv_retention
    gw, gb = torch.autograd.grad(res_lm, (pol.weight, pol.bias), retain_graph=True)
    assert torch.isfinite(gw).all() and float(gw.abs().sum()) > 0
    loss.backward()
    for layer in m.model.layers:
        g = layer.self_attn.k_proj.weight.grad
        assert g is not None and torch.isfinite(g).all() and float(g.abs().sum()) > 0
    assert float(pol.bias.grad.abs().sum()) > 0


def test_gumbel_training_segment_weights_every_context_token_softly() -> None:
    torch.manual_seed(0)  # the gate's noise
    policy = RetentionPolicy(4, 2, 16).train()
    inp = make_input(H=2, D=16, requires_grad=True)
    seg = UniCacheCompressor(retention_cfg(bits=None), retention=policy)(inp)
    ctx = inp.context_mask
    assert torch.equal(seg.valid, ctx)  # nothing removed in the relaxed forward
    c = seg.counts[ctx]
    # sigmoid of a sink's logit (+4 / 0.5 + noise) may round to 1.0 in fp32
    assert (c > 0).all() and (c <= 1).all() and float((c < 0.5).float().mean()) > 0.3
    assert c.requires_grad
    assert float(seg.stats["relaxed"]) == 1.0 and float(seg.stats["rate_realized"]) == 0.0
    policy.eval()  # inference: the hard selection at the target rate, counts 1
    hard = UniCacheCompressor(retention_cfg(bits=None), retention=policy)(inp)
    check_segment(inp, hard)
    assert float(hard.stats["rate_realized"]) > 0.55 and "relaxed" not in hard.stats


def test_rate_zero_stays_the_plain_forward_and_keeps_the_policy_in_the_graph() -> None:
    """A curriculum at rate 0: the loss is the plain model's exactly, and the policy still gets
    a (zero) gradient, so DDP without find_unused_parameters does not fail on it."""
    from unicache_train.model.loss import causal_lm_loss

    m = module(loss_on="all", unicache={"rate_scale": 0.0, "quantize": {"bits": None}})
    b = batch()
    loss, _, per_layer = m.compressed_loss(b, step=0)
    torch.testing.assert_close(loss, causal_lm_loss(m(b), b["labels"]), rtol=0, atol=0)
    assert all(float(s["rate_realized"]) == 0.0 for s in per_layer)
    loss.backward()
    g = m.model.kv_retention.weight.grad
    assert g is not None and float(g.abs().sum()) == 0.0


def test_soft_counts_agree_across_the_seam_kernels(monkeypatch) -> None:
    """A Gumbel-sigmoid training segment (counts in (0, 1), attention adds log(alpha)) through
    the CPU per-sample kernel and the batched dense-mask kernel: same logits and gradients, the
    policy's included (1e-5: fp32, only the summation order differs)."""
    import unicache_train.model.attention as attn_mod

    torch.manual_seed(0)
    model = Decoder(tiny_model()).train()
    comp = build_compressor(CompressionTrainConfig(enabled=True, preset="retention"), model)
    with torch.no_grad():
        model.kv_retention.weight.normal_()
    ids = torch.randint(0, 97, (3, 40))
    split = torch.tensor([12, 25, 39])
    results = {}
    for mode in ("batched", "per_sample"):
        monkeypatch.setattr(attn_mod, "SEGMENT_ATTENTION", mode)
        model.zero_grad()
        torch.manual_seed(1)  # the same gate noise in both
        out = model(ids, split=split, compressor=comp)
        assert float(out.compression_stats[0]["relaxed"]) == 1.0
        out.logits.square().mean().backward()
        results[mode] = (out.logits.detach(), [p.grad.clone() for p in model.parameters()])
    (lb, gb), (lp, gp) = results["batched"], results["per_sample"]
    torch.testing.assert_close(lp, lb, atol=1e-5, rtol=1e-5)
    assert float(model.kv_retention.weight.grad.abs().sum()) > 0
    for a, b in zip(gp, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ the budget term
@pytest.mark.parametrize("relaxation", ["gumbel_sigmoid", "st_topk"])
def test_soft_kept_fraction_starts_and_stays_at_the_target_whatever_the_offset(
    relaxation: str,
) -> None:
    """The gate is centred on the hard selection's threshold, so an offset of the logits (bias
    +4 or -4: everything or nothing kept softly when uncentred) does not move the soft kept
    fraction off the byte target's (0.4 at rate 0.6) even at the first step, and 40 AdamW steps
    of the in-loop objective keep it near (measured on this toy: 0.48-0.51 Gumbel-sigmoid,
    0.42 straight-through; the task loss pulls evicted tokens' gates up, the budget term back)."""
    sel = {"relaxation": relaxation, "budget_weight": 10.0}
    for bias in (4.0, -4.0):
        m = module(unicache={"target_rate": 0.6, "selection": sel})
        with torch.no_grad():
            m.model.kv_retention.bias.fill_(bias)
        opt = torch.optim.AdamW(m.parameters(), lr=0.05)
        torch.manual_seed(0)
        history = []
        for step in range(40):
            loss, logs, _ = m.compressed_loss(batch(seed=step), step=step)
            opt.zero_grad()
            loss.backward()
            opt.step()
            history.append(float(logs["compress/retention_kept"]))
        target = 1.0 - float(logs["compress/rate_realized"]) if relaxation == "st_topk" else 0.4
        assert abs(history[0] - target) < 0.1, (bias, history[0])
        assert abs(sum(history[-5:]) / 5 - target) < 0.12, (bias, history[-5:])


# ------------------------------------------------------------------ inference bytes
def test_inference_selection_meets_the_byte_target_exactly_in_the_model() -> None:
    """A trained-looking (random) policy in eval mode, int4 storage, the rate that gives 8x fewer
    KV bytes: every layer keeps exactly ``n - round(R n)`` context tokens of every sample, the
    stored bytes are exactly that many tokens' int4 payload + fp16 scales, the reduction
    reaches 8 and one more token per sample would miss it."""
    cfg = tiny_model()
    model = Decoder(cfg).eval()
    policy = attach_retention(model).eval()
    with torch.no_grad():
        policy.weight.normal_(std=2.0)
    H, D = cfg.num_key_value_heads, cfg.head_size
    per_token, base_token = 2 * H * (D // 2 + 2), 2 * H * 2 * D
    split = torch.tensor([30, 41, 47])
    rate = 1.0 - base_token / (8.0 * per_token) + 0.5 / 30
    comp = UniCacheCompressor(retention_cfg(rate, bits=4), retention=policy)
    ids = torch.randint(0, 97, (3, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, split=split, compressor=comp)
    n = split.double()
    want_kept = n - torch.floor(rate * n + 0.5)
    for stats in out.compression_stats:
        assert float(stats["kv_bytes"]) == float(want_kept.sum() * per_token)
        assert float(stats["budget_shortfall"]) == 0.0
        assert float(stats["kv_reduction"]) >= 8.0
        assert float((n * base_token).sum() / ((want_kept + 1) * per_token).sum()) < 8.0
        torch.testing.assert_close(
            float(stats["retention_kept"]), float((want_kept / n).mean()), rtol=0, atol=1e-6
        )


# ------------------------------------------------------------------ Lightning
def test_tiny_fit_trains_the_policy_and_logs_its_metrics(tmp_path: Path) -> None:
    from unicache_train.train.run import fit

    cfg = RunConfig(
        model=ModelConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        data=DataConfig(
            seq_len=96,
            batch_size=4,
            pack=False,
            val_fraction=0.2,
            synthetic=SyntheticDataConfig(
                num_stories=12, num_recall=12, recall_num_facts=3, recall_num_filler=0
            ),
        ),
        train=TrainConfig(
            max_steps=3,
            warmup_steps=1,
            val_every_n_steps=3,
            limit_val_batches=1,
            checkpoint_every_n_steps=3,
            accelerator="cpu",
            devices=1,
            out_dir=str(tmp_path),
            progress_bar=False,
            log_every_n_steps=1,
        ),
        logging=LoggingConfig(logger="csv"),
        monitor=MonitorConfig(gain=False, compress_every_n_steps=1),
        compress=CompressionTrainConfig.from_dict(
            {"enabled": True, "preset": "retention", "unicache": {"quantize": {"bits": 4}}}
        ),
    )
    trainer = fit(cfg)
    assert trainer.global_step == 3
    rows = []
    for f in tmp_path.glob("csv/version_*/metrics.csv"):
        with f.open() as fh:
            rows += list(csv.DictReader(fh))
    cols = {k for r in rows for k, v in r.items() if v not in (None, "")}
    for name in (
        "train/aux_loss",
        "compress/aux_loss",
        "compress/retention_kept",
        "compress/retention_budget_loss",
        "compress/retention_kept/layer_00",
        "compress/retention_kept/layer_01",
        "compress/retention_budget_loss/layer_01",
        "val/ppl_compressed",
    ):
        assert name in cols, name
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    w = ckpt["state_dict"]["model.kv_retention.weight"]
    assert w.shape == (2, 1, 16) and float(w.abs().sum()) > 0  # trained away from its zero init
    # Validation runs the hard selection at the byte target (eval mode).
    ratios = [float(r["compress/ppl_delta"]) for r in rows if r.get("compress/ppl_delta")]
    assert ratios and all(math.isfinite(x) for x in ratios)
    # The checkpoint exports with the policy's weights beside the model, as trained.
    from safetensors.torch import load_file

    from unicache_train.checkpoint.export import export_checkpoint

    out = export_checkpoint(tmp_path / "checkpoints" / "last.ckpt", tmp_path / "export")
    got = load_file(str(out / "kv_retention.safetensors"))
    assert torch.equal(got["weight"], w.float())


# ------------------------------------------------------------------ decoding and the file hook
def test_compressed_decoding_with_the_policy_equals_the_inloop_forward(tmp_path: Path) -> None:
    """Prefill, compress with the (random, eval-mode) policy, decode token by token: the logits
    equal the in-loop forward's and the cache holds the bytes the stats counted, also after the
    policy went through its safetensors file into a fresh model."""
    from unicache_train.compress.retention import load_retention, save_retention
    from unicache_train.inloop import continuation_mask
    from unicache_train.model.generate import decode_teacher_forced

    torch.manual_seed(0)
    model = Decoder(tiny_model()).eval()
    with torch.no_grad():
        attach_retention(model).weight.normal_(std=2.0)
    file = save_retention(model, tmp_path / "kv_retention.safetensors")
    fresh = Decoder(tiny_model()).eval()
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if "kv_retention" not in k})
    policy = load_retention(fresh, file).eval()
    assert torch.equal(policy.weight, model.kv_retention.weight)
    comp = UniCacheCompressor(retention_cfg(0.6, bits=4), retention=policy)
    ids = torch.randint(0, 97, (2, 44))
    split = torch.tensor([29, 18])
    with torch.no_grad():
        ref = model(ids, split=split, compressor=comp)
    got, cache = decode_teacher_forced(fresh, ids, split, comp)
    cont = continuation_mask(split, ids.shape[1])
    # fp32, the same math over another key layout: the in-loop tolerance (tests/test_inloop.py).
    torch.testing.assert_close(got[cont], ref.logits[cont], atol=1e-5, rtol=1e-5)
    assert cache.kv_bytes(include_metadata=False) == int(
        sum(float(s["kv_bytes"]) for s in ref.compression_stats)
    )
    with pytest.raises(ValueError, match="do not fit"):
        load_retention(Decoder(ModelConfig(vocab_size=97, num_hidden_layers=3)), file)


# ------------------------------------------------------------------ DeepSpeed ZeRO (2 processes)
@pytest.mark.slow
def test_zero2_trains_the_policy_and_consolidates_it(tmp_path: Path) -> None:
    """ZeRO-2 on 2 CPU processes (tests/test_deepspeed.py's harness): the policy's parameters
    are sharded, trained and consolidated like every model parameter."""
    pytest.importorskip("deepspeed")

    from distributed_runs import MODEL, fabric_run, failure_report, run_overrides

    from unicache_train.checkpoint.zero import consolidate_zero_checkpoint

    args = run_overrides(
        tmp_path / "run",
        "compress.enabled=true",
        "compress.preset=retention",
        "compress.unicache.quantize.bits=4",
        batch_size=2,
        steps=3,
        checkpoint_every=3,
    )
    assert MODEL[0] in args
    proc = fabric_run(2, tmp_path / "record.jsonl", args, strategy="deepspeed_stage_2")
    assert proc.returncode == 0, failure_report(proc)
    state = consolidate_zero_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    w = state["model.kv_retention.weight"]
    assert w.shape == (2, 2, 16) and float(w.abs().sum()) > 0  # trained from its zero init


# ------------------------------------------------------------------ export and serving
def _export_with_policy(tmp_path: Path) -> tuple[Decoder, Path]:
    from unicache_train.checkpoint.hf import export_hf
    from unicache_train.checkpoint.policy import policy_of

    torch.manual_seed(0)
    model = Decoder(tiny_model()).eval()
    with torch.no_grad():
        attach_retention(model).weight.normal_(std=2.0)
    cc = CompressionTrainConfig.from_dict(
        {"enabled": True, "preset": "retention", "unicache": {"quantize": {"bits": 4}}}
    )
    out = tmp_path / "export"
    with pytest.warns(UserWarning, match="tokenizer"):
        export_hf(model, out, compression_policy=policy_of(cc))
    return model, out


def test_export_carries_the_policy_beside_the_weights_and_serving_reads_it(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file

    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.checkpoint.policy import compressor_from_policy, read_policy

    model, out = _export_with_policy(tmp_path)
    assert not any("kv_retention" in k for k in load_file(str(out / "model.safetensors")))
    doc = json.loads((out / "compression_config.json").read_text())
    assert doc["policy"]["retention"] == {"file": "kv_retention.safetensors"}
    policy = read_policy(out)
    comp = compressor_from_policy(policy, out)
    assert not comp.retention.training  # inference: the hard selection at the byte target
    assert torch.equal(comp.retention.weight, model.kv_retention.weight)
    assert torch.equal(comp.retention.bias, model.kv_retention.bias)
    # The imported model is the plain decoder (the policy lives beside it, in the compressor),
    # and compressing with the file's policy equals compressing with the model's own.
    imported, _ = import_hf(out)
    ids = torch.randint(0, 97, (2, 40))
    split = torch.tensor([30, 24])
    own = UniCacheCompressor(
        UniCacheConfig.from_dict(policy["unicache"]), retention=model.kv_retention
    )
    with torch.no_grad():
        a = imported.eval()(ids, split=split, compressor=comp)
        b = model(ids, split=split, compressor=own)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    # A policy that needs the weights cannot be served without the directory.
    from unicache_train.validation import ConfigError

    with pytest.raises(ConfigError, match="needs its weights"):
        compressor_from_policy(policy)
    with pytest.raises(ConfigError, match="does not fit"):
        compressor_from_policy(policy, out, shape=(3, 1, 16))


@pytest.mark.parametrize(
    "entry,match",
    [
        ({"file": "../model.safetensors"}, "not allowed"),
        ({"file": "/etc/passwd.safetensors"}, "not allowed"),
        ({"file": "missing.safetensors"}, "does not exist"),
        ({"file": "kv_retention.safetensors", "code": "x"}, "needs"),
        (None, "needs"),
    ],
)
def test_hostile_or_broken_retention_entries_are_refused(tmp_path: Path, entry, match) -> None:
    import json

    from unicache_train.checkpoint.policy import read_policy
    from unicache_train.validation import ConfigError

    _, out = _export_with_policy(tmp_path)
    file = out / "compression_config.json"
    doc = json.loads(file.read_text())
    if entry is None:
        del doc["policy"]["retention"]
    else:
        doc["policy"]["retention"] = entry
    file.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=match):
        read_policy(out)


def test_bad_retention_files_and_policies_are_refused(tmp_path: Path) -> None:
    import json

    from safetensors.torch import save_file

    from unicache_train.checkpoint.hf import export_hf
    from unicache_train.checkpoint.policy import compressor_from_policy, policy_of, read_policy
    from unicache_train.compress.retention import read_retention
    from unicache_train.validation import ConfigError

    _, out = _export_with_policy(tmp_path)
    file = out / "kv_retention.safetensors"
    policy = read_policy(out)
    save_file({"weight": torch.full((2, 1, 16), float("nan")), "bias": torch.zeros(2, 1)}, file)
    with pytest.raises(ConfigError, match="NaN"):
        compressor_from_policy(policy, out)
    save_file({"weight": torch.zeros(2, 1, 16)}, file)
    with pytest.raises(ValueError, match="bias"):
        read_retention(file)
    file.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_retention(file)
    # A retention entry on a policy that does not select with it is refused, not ignored.
    doc = json.loads((out / "compression_config.json").read_text())
    doc["policy"]["unicache"]["selection"]["method"] = "sinks_recent"
    (out / "compression_config.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="not 'retention'"):
        read_policy(out)
    # Exporting a retention policy from a model that has none names the problem.
    cc = CompressionTrainConfig.from_dict({"enabled": True, "preset": "retention"})
    with pytest.raises(ValueError, match="has none"):
        export_hf(Decoder(tiny_model()), tmp_path / "other", compression_policy=policy_of(cc))
