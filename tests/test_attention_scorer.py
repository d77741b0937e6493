"""The attention-regression scorer (compress/attention_scorer.py) and its fit
(train/scorer_fit.py): the target against a loop written apart, the ridge solve against least
squares on the augmented system, the selection's guarantees, export and serving through stock
transformers generate()."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from unicache_train.compress import UniCacheCompressor, UniCacheConfig, presets
from unicache_train.compress.attention_scorer import (
    AttentionScorer,
    num_features,
    read_attention_scorer,
    save_attention_scorer,
    scorer_features,
)
from unicache_train.compress.testing import check_segment, make_input
from unicache_train.data.long_context import LongContextTask, long_context_records
from unicache_train.data.tokenizer import load_tokenizer
from unicache_train.eval.attn_kl import AttentionInputs
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.train.scorer_fit import attention_targets, fit_attention_scorer, spearman

TOK = load_tokenizer("byte")


def tiny_lm(**kw) -> Decoder:
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=TOK.vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return Decoder(ModelConfig(**{**cfg, **kw})).eval()


def test_features_are_rope_invariant_pair_norms_values_and_positions() -> None:
    from unicache_train.ops.rope import apply_rope

    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 6, 8, generator=g)
    v = torch.randn(1, 2, 6, 8, generator=g)
    mask = torch.tensor([[True] * 5 + [False]])
    ang = torch.randn(1, 6, 4, generator=g)
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([ang.sin(), ang.sin()], -1)
    a = scorer_features(k, v, mask)
    b = scorer_features(apply_rope(k, cos, sin), v, mask)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # RoPE leaves the pair norms alone
    assert a.shape == (1, 2, 6, num_features(8))
    assert torch.equal(a[0, 0, 2, :8], v[0, 0, 2])
    assert float(a[0, 1, 3, 8]) == pytest.approx(math.hypot(k[0, 1, 3, 0], k[0, 1, 3, 4]), rel=1e-5)
    torch.testing.assert_close(a[0, 0, 3, 12:], torch.tensor([math.log(4), math.log(2), 1.0]))
    assert (a[0, :, 5] == 0).all()  # outside the context


def _target_by_loop(model, ids: torch.Tensor, n: int) -> dict[int, torch.Tensor]:
    """KVzap's target written out: float64, one (query head, position) at a time."""
    with AttentionInputs(model, model.config.num_hidden_layers) as cap:
        with torch.no_grad():
            model(ids)
    out = {}
    torch.set_grad_enabled(False)
    for layer in model.layers:
        attn = layer.self_attn
        x, rope = cap.inputs[attn.layer_idx]
        qkv = attn.project(x, rope)
        q, k, v = (t.double()[0] for t in (qkv.q, qkv.k, qkv.v))
        H, Hk, D = q.shape[0], k.shape[0], q.shape[-1]
        W = attn.o_proj.weight.double()
        best = torch.zeros(Hk, n, dtype=torch.float64)
        for g in range(H):
            h = g // (H // Hk)
            for i in range(n, ids.shape[1]):
                p = torch.softmax(k[h, : i + 1] @ q[g, i] / math.sqrt(D), 0)
                for t in range(n):
                    w = float(p[t]) * float((W[:, g * D : (g + 1) * D] @ v[h, t]).norm())
                    best[h, t] = max(best[h, t], w)
        out[attn.layer_idx] = best.log()
    torch.set_grad_enabled(True)
    return out


def test_target_is_the_largest_later_attention_times_the_output_norm() -> None:
    model = tiny_lm()
    ids = torch.randint(0, 200, (1, 23))
    got = attention_targets(model, ids, 14, chunk=4)  # several chunks
    want = _target_by_loop(model, ids, 14)
    for layer, (phi, y) in got.items():
        assert phi.shape == (2, 14, num_features(16))
        torch.testing.assert_close(y.double(), want[layer], atol=1e-4, rtol=1e-4)


def test_ridge_fit_is_the_augmented_least_squares_solution_and_reports_heldout_fit() -> None:
    model = tiny_lm()
    recs = long_context_records(LongContextTask(tokens=180), 6, 0, TOK, "train")
    fit = fit_attention_scorer(model, TOK, recs, heldout_every=3, ridge=1e-2)
    assert fit.train_records == 4 and fit.heldout_records == 2
    # The same solve as least squares on [X; sqrt(lambda) I], data gathered apart.
    X = {lay: [] for lay in range(2)}
    Y = {lay: [] for lay in range(2)}
    for j, r in enumerate(recs):
        if j % 3 == 2:
            continue
        c = TOK.encode(r["context"], add_bos=True)
        later = r["question"] + " " + ", ".join(r["answers"]) + "\n"
        later += "\nRepeat the text above exactly:\n" + r["context"]
        feats = attention_targets(model, torch.tensor([c + TOK.encode(later)]), len(c))
        for lay, (phi, y) in feats.items():
            X[lay].append(phi.double())
            Y[lay].append(y.double())
    for lay in range(2):
        x, y = torch.cat(X[lay], 1), torch.cat(Y[lay], 1)  # [H, N, F], [H, N]
        for h in range(2):
            lam = 1e-2 * (x[h] * x[h]).sum(0).mean()
            F = x.shape[-1]
            A = torch.cat([x[h], lam.sqrt() * torch.eye(F, dtype=torch.float64)])
            b = torch.cat([y[h], torch.zeros(F, dtype=torch.float64)])
            w = torch.linalg.lstsq(A, b[:, None]).solution[:, 0]
            torch.testing.assert_close(fit.scorer.weight[lay, h].double(), w, atol=1e-4, rtol=1e-3)
    assert torch.isfinite(fit.r2).all() and torch.isfinite(fit.spearman).all()
    assert (fit.spearman > 0).all()  # better than chance on held-out records, every head


def test_spearman_matches_a_hand_computed_value() -> None:
    a = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    b = torch.tensor([5.0, 6.0, 7.0, 8.0, 7.5])  # ranks 0 1 2 4 3
    d2 = sum((x - y) ** 2 for x, y in zip([0, 1, 2, 3, 4], [0, 1, 2, 4, 3]))
    assert float(spearman(a, b)) == pytest.approx(1 - 6 * d2 / (5 * 24))


@pytest.mark.parametrize("rate", [0.5, 0.8])
def test_selection_keeps_sinks_recent_and_the_top_predictions_at_the_exact_rate(rate) -> None:
    inp = make_input(seed=4)
    inp.modality_ids = torch.zeros_like(inp.modality_ids)
    scorer = AttentionScorer(4, 2, 16)
    with torch.no_grad():
        scorer.weight[0, :, 0] = torch.tensor([1.0, -0.5])  # value feature 0, heads disagree
    d = presets.attention().to_dict()
    d["target_rate"] = rate
    d["selection"] = {**d["selection"], "sinks": 2, "window": 3}
    seg = UniCacheCompressor(UniCacheConfig.from_dict(d), attention_scorer=scorer)(inp)
    check_segment(inp, seg)
    for b in range(3):
        n = int(inp.context_mask[b].sum())
        keep = n - math.floor(rate * n + 0.5)
        kept = sorted(inp.positions[b].tolist().index(p) for p in seg.positions[b][seg.valid[b]])
        assert len(kept) == keep
        pred = torch.stack([inp.values[b, 0, :n, 0], -0.5 * inp.values[b, 1, :n, 0]]).amax(0)
        forced = [0, 1, n - 3, n - 2, n - 1]
        rest = sorted((t for t in range(n) if t not in forced), key=lambda t: (-float(pred[t]), t))
        if keep >= len(forced):
            assert kept == sorted(forced + rest[: keep - 5])
        else:  # a budget below sinks + window keeps the latest of them
            assert kept == forced[-keep:]


def test_scorer_file_round_trip_and_errors(tmp_path: Path) -> None:
    s = AttentionScorer(3, 2, 8)
    with torch.no_grad():
        s.weight.normal_()
    path = save_attention_scorer(s, tmp_path / "s.safetensors")
    r = read_attention_scorer(path, shape=(3, 2, 8))
    assert torch.equal(r.weight, s.weight)
    with pytest.raises(ValueError, match=r"the model has \(4, 2, 8\)"):
        read_attention_scorer(path, shape=(4, 2, 8))
    with pytest.raises(FileNotFoundError):
        read_attention_scorer(tmp_path / "none.safetensors")
    with pytest.raises(ValueError, match="needs an AttentionScorer"):
        UniCacheCompressor(presets.attention())
    with pytest.raises(ValueError, match="AttentionScorer.head_dim=0"):
        AttentionScorer(1, 1, 0)


def test_export_serves_the_scorer_and_stock_generate_equals_our_decoding(tmp_path: Path) -> None:
    """The scorer travels with the export (kv_attention_scorer.safetensors, named in
    compression_config.json); stock transformers generate() on the export with
    CompressedCache gives our own compressed decoding's greedy tokens."""
    import json

    transformers = pytest.importorskip("transformers")
    from unicache_train.checkpoint.hf import export_hf
    from unicache_train.checkpoint.policy import policy_of
    from unicache_train.model.generate import generate_compressed
    from unicache_train.train.config import CompressionTrainConfig
    from unicache_train.transformers_cache import (
        ATTN_IMPLEMENTATION,
        CACHE_ARGUMENT,
        CompressedCache,
    )

    model = tiny_lm()
    scorer = AttentionScorer(2, 2, 16)
    with torch.no_grad():
        scorer.weight.normal_(std=0.5)
    cc = CompressionTrainConfig.from_dict(
        {
            "enabled": True,
            "preset": "attention",
            "unicache": {"target_rate": 0.6, "quantize": {"bits": 4}},
        }
    )
    out = tmp_path / "export"
    export_hf(
        model, out, compression_policy=policy_of(cc), tokenizer_from="byte", attention_scorer=scorer
    )
    doc = json.loads((out / "compression_config.json").read_text())
    assert doc["policy"]["attention_scorer"] == {"file": "kv_attention_scorer.safetensors"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation=ATTN_IMPLEMENTATION, torch_dtype=torch.float32
    ).eval()
    ids = torch.randint(3, 200, (1, 48))
    cache = CompressedCache.from_pretrained(out)
    with torch.no_grad():
        stock = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            **{CACHE_ARGUMENT: cache},
        )[0, 48:]
    own = UniCacheCompressor(
        UniCacheConfig.from_dict(doc["policy"]["unicache"]), attention_scorer=scorer
    )
    ours = generate_compressed(model, ids, 48, own, 8).tokens[0]
    assert stock.tolist() == ours.tolist()
    assert cache.kv_bytes() < cache.baseline_bytes(16) / 6  # int4 + 60% evicted


def test_a_compression_aware_fine_tune_runs_the_fitted_scorer_in_the_loop(tmp_path: Path) -> None:
    """The claim's training arm on a tiny model: fit the scorer on the frozen backbone, write
    the long-context training mix, fine-tune with the scorer + int4 in the loop, the keep ratio
    ramped from 1 and KL to the uncompressed forward; the scorer stays fixed, the model moves."""
    from unicache_train.data.long_context import write_long_context_mix
    from unicache_train.train.config import RunConfig
    from unicache_train.train.run import fit

    model = tiny_lm()
    recs = long_context_records(LongContextTask(tokens=200), 8, 0, TOK, "train")
    fit_ = fit_attention_scorer(model, TOK, recs[:4], heldout_every=4)
    scorer_file = save_attention_scorer(fit_.scorer, tmp_path / "scorer.safetensors")
    mix = write_long_context_mix(tmp_path / "mix.jsonl", recs)
    with pytest.raises(Exception, match="allowed 'train'"):
        write_long_context_mix(tmp_path / "bad.jsonl", [{**recs[0], "split": "eval"}])
    from safetensors.torch import save_file

    init = tmp_path / "init.safetensors"
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # shared storage: safetensors refuses aliases
    save_file(sd, str(init))
    c = model.config
    cfg = RunConfig.from_dict(
        {
            "model": {
                k: getattr(c, k)
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                )
            },
            "data": {
                "source": str(mix),
                "tokenizer": "byte",
                "seq_len": 320,
                "batch_size": 2,
                "pack": False,
                "split_at": "question",
                "prompt_loss": False,
                "val_fraction": 0.0,
            },
            "train": {
                "max_steps": 3,
                "warmup_steps": 1,
                "accelerator": "cpu",
                "devices": 1,
                "out_dir": str(tmp_path / "run"),
                "progress_bar": False,
                "init_weights": str(init),
                "limit_val_batches": 0,
                "val_every_n_steps": 3,
                "checkpoint_every_n_steps": 3,
                "log_every_n_steps": 1,
            },
            "logging": {"logger": "none"},
            "compress": {
                "enabled": True,
                "preset": "attention",
                "kl_weight": 1.0,
                "curriculum_steps": 2,
                "attention_scorer": str(scorer_file),
                "unicache": {"target_rate": 0.6, "quantize": {"bits": 4}},
            },
        }
    )
    trainer = fit(cfg)
    assert trainer.global_step == 3
    trained = trainer.lightning_module.model
    comp = trainer.lightning_module.compressor
    assert torch.equal(comp.attention_scorer.weight, fit_.scorer.weight)  # fixed in training
    before, after = model.state_dict(), trained.state_dict()
    assert set(before) == set(after)
    assert any(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in before)
