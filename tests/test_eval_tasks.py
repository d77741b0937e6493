"""The real-checkpoint evaluation tasks (recall with the question after the compressed context,
held-out text perplexity), the bytes calibration, span pooling and the training mix."""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from unicache_train.compress import UniCacheCompressor
from unicache_train.compress.config import ImportanceConfig, UniCacheConfig
from unicache_train.compress.importance import pool_scores
from unicache_train.data.recall_mix import EVAL_SEED_FLOOR, write_recall_mix
from unicache_train.data.tokenizer import ByteTokenizer
from unicache_train.eval import (
    RecallTask,
    binomial_stderr,
    recall_records,
    reference_documents,
    run_recall,
    run_text_perplexity,
)
from unicache_train.eval.budget import measured_reduction, rate_for_reduction
from unicache_train.eval.text import text_blocks
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.seam import IdentityCompressor
from unicache_train.validation import ConfigError


def byte_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=259,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return Decoder(cfg).eval()


# ------------------------------------------------------------------------------ recall task
def test_recall_records_are_deterministic_and_seed_dependent():
    task = RecallTask(pairs=6, distractors=2, value_digits=3)
    a, b = recall_records(task, 5, 1_000_001), recall_records(task, 5, 1_000_001)
    c = recall_records(task, 5, 1_000_002)
    assert a == b and a != c
    for r in a:
        lines = r["context"].strip().split("\n")
        assert len(lines) == 6
        kv = dict(line.split(": ") for line in lines)
        assert kv[r["key"]] == r["answer"] and len(r["answer"]) == 3 and r["answer"].isdigit()
        noun = r["key"].split(" ")[1]
        assert sum(k.split(" ")[1] == noun for k in kv) == 3  # asked key + 2 distractors
        assert r["question"].endswith(f"{r['key']}:")


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"pairs": 0}, "pairs"),
        ({"pairs": 4, "distractors": 4}, "distractors"),
        ({"value_digits": 13}, "value_digits"),
        ({"pairs": 2.5}, "pairs"),
    ],
)
def test_recall_task_rejects_bad_values_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"RecallTask.{field}="):
        RecallTask(**kw)


def _reference_greedy(model, tok, rec, n_new):
    """Independent reference: re-run the full uncompressed forward on the whole sequence for
    every generated token (no cache, no seam)."""
    ids = tok.encode(rec["context"], add_bos=True) + tok.encode(rec["question"])
    out = []
    for _ in range(n_new):
        logits = model(torch.tensor([ids])).logits[0, -1]
        nxt = int(logits.argmax())
        out.append(nxt)
        ids.append(nxt)
    return tok.decode(out).lstrip(" ").split("\n")[0].strip()


@torch.no_grad()
def test_recall_with_identity_equals_plain_greedy_decoding_on_ragged_questions():
    model, tok = byte_model(), ByteTokenizer()
    recs = recall_records(RecallTask(pairs=3, value_digits=2), 5, 1_000_007)
    # Byte tokens: questions of different lengths in one batch (keys differ in length).
    assert len({len(r["question"]) for r in recs}) > 1
    got = run_recall(model, tok, recs, IdentityCompressor(), batch_size=5)
    n_new = len(tok.encode(" " + recs[0]["answer"])) + 1
    want = [_reference_greedy(model, tok, r, n_new) for r in recs]
    assert got.predictions == want
    assert got.n == 5 and got.hits == sum(p == r["answer"] for p, r in zip(want, recs))
    assert got.kv_reduction == pytest.approx(1.0)


@torch.no_grad()
def test_recall_reports_the_bytes_of_the_compressed_cache():
    model, tok = byte_model(), ByteTokenizer()
    recs = recall_records(RecallTask(pairs=4, value_digits=2), 4, 1_000_009)
    cfg = UniCacheConfig.from_dict(
        {
            "target_rate": 0.5,
            "rate_scale": 1.0,
            "budget": {"enabled": False},
            "quantize": {"enabled": True, "bits": 8},
        }
    )
    r = run_recall(model, tok, recs, UniCacheCompressor(cfg), batch_size=2)
    assert r.kv_reduction > 2.5  # half the tokens, int8 (+ scales and metadata)


def test_binomial_stderr():
    assert binomial_stderr(37, 100) == pytest.approx(math.sqrt(0.37 * 0.63 / 100))
    assert binomial_stderr(0, 10) == 0.0
    with pytest.raises(ValueError):
        binomial_stderr(3, 2)


# ------------------------------------------------------------------------------ text
def test_reference_text_is_split_into_disjoint_train_and_heldout_parts():
    train, held = reference_documents("train"), reference_documents("heldout")
    assert train and held and not set(train) & set(held)
    assert sum(map(len, held)) > 50_000  # enough held-out prose to score


@torch.no_grad()
def test_text_perplexity_matches_a_manual_cross_entropy_and_identity_changes_nothing():
    model, tok = byte_model(), ByteTokenizer()
    blocks = text_blocks(tok, reference_documents("heldout"), 40, max_blocks=3)
    assert blocks.shape == (3, 40)
    plain = run_text_perplexity(model, blocks, 30, None, batch_size=2)
    logits = model(blocks).logits[:, 29:39]
    manual = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 30:].reshape(-1))
    assert plain.tokens == 30 and plain.nll == pytest.approx(float(manual), rel=1e-5)
    ident = run_text_perplexity(model, blocks, 30, IdentityCompressor(), batch_size=3)
    assert ident.perplexity == pytest.approx(plain.perplexity, rel=1e-5)


# ------------------------------------------------------------------------------ calibration
@torch.no_grad()
def test_rate_for_reduction_reaches_the_measured_bytes_target():
    model, tok = byte_model(), ByteTokenizer()
    ids = text_blocks(tok, reference_documents("heldout"), 64, max_blocks=2)
    split = torch.full((2,), 48)

    def make(rate):
        return UniCacheCompressor(
            UniCacheConfig.from_dict(
                {
                    "target_rate": rate,
                    "rate_scale": 1.0,
                    "budget": {"enabled": False},
                    "quantize": {"enabled": True, "bits": 8},
                }
            )
        )

    rate, got = rate_for_reduction(model, ids, split, make, 4.0)
    assert got >= 4.0 and 0.3 < rate < 0.9
    assert measured_reduction(model, ids, split, make(rate)) == pytest.approx(got)
    assert measured_reduction(model, ids, split, make(max(rate - 0.05, 0.0))) < 4.0


# ------------------------------------------------------------------------------ span pooling
def test_pool_scores_equals_a_loop_over_windows_within_each_modality():
    torch.manual_seed(0)
    B, T, k = 2, 13, 5
    s = torch.rand(B, T)
    mod = (torch.rand(B, T) > 0.6).long()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 10:] = False
    got = pool_scores(s, mod, mask, k)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                assert got[b, t] == 0
                continue
            win = [
                float(s[b, j])
                for j in range(max(0, t - k // 2), min(T, t + k // 2 + 1))
                if mask[b, j] and mod[b, j] == mod[b, t]
            ]
            assert float(got[b, t]) == pytest.approx(max(win))


def test_pool_must_be_odd():
    with pytest.raises(ConfigError, match="ImportanceConfig.pool=4"):
        ImportanceConfig(pool=4)
    assert ImportanceConfig(pool=7).pool == 7


# ------------------------------------------------------------------------------ training mix
def test_training_mix_marks_question_and_answer_and_refuses_eval_seeds(tmp_path):
    path = write_recall_mix(tmp_path / "mix.jsonl", [RecallTask(pairs=3)], 10, text_fraction=0.5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    recall = [r for r in rows if r["split_char"] >= 0]
    assert len(recall) == 10 and len(rows) == 20
    for r in recall:
        assert r["text"][r["question_char"] :].startswith("What is the value of")
        assert r["text"][r["split_char"] :].strip().isdigit()
    with pytest.raises(ValueError, match="seed=1000000 is out of range"):
        write_recall_mix(tmp_path / "x.jsonl", [RecallTask()], 1, seed=EVAL_SEED_FLOOR)


def test_training_data_does_not_import_the_evaluation():
    """data/ builds the records eval/ runs, never the reverse (no data -> eval import)."""
    code = (
        "import sys, unicache_train.data.recall_mix; "
        "print(sorted(m for m in sys.modules if m.startswith('unicache_train.eval')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@torch.no_grad()
def test_recall_decodes_on_an_xkv_cache_and_reports_its_bytes():
    from unicache_train.compress.config import XKVConfig
    from unicache_train.compress.xkv import XKVCompressor

    model, tok = byte_model(), ByteTokenizer()
    recs = recall_records(RecallTask(pairs=4, value_digits=2), 3, 1_000_011)
    xkv = XKVCompressor(XKVConfig(rank_mode="reduction", reduction=4.0, group_size=2))
    r = run_recall(model, tok, recs, xkv, batch_size=3)
    assert r.n == 3 and 3.0 < r.kv_reduction <= 4.5


def test_cli_fetch_refuses_an_unknown_name(capsys):
    from unicache_train.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["fetch", "--name", "llama-70b"])
    assert exc.value.code == 2
    from unicache_train.checkpoint.gguf import KNOWN

    allowed = sorted(KNOWN)
    assert "smollm2" in allowed
    assert f"fetch --name='llama-70b' is not known; allowed {allowed}" in capsys.readouterr().err


def test_missing_checkpoint_error_names_the_fetch_command(tmp_path):
    from unicache_train.checkpoint.gguf import CheckpointNotFetched, fetched_dir

    with pytest.raises(CheckpointNotFetched, match="unicache-train fetch --name smollm2"):
        fetched_dir("smollm2", root=tmp_path)


def test_results_round_trip_through_csv_and_render(tmp_path):
    from unicache_train.eval.report import read_results, write_results

    rows = [
        {
            "model": "base",
            "method": m,
            "target_reduction": t,
            "rate": r,
            "kv_reduction": k,
            "task": "recall8",
            "recall": a,
            "recall_se": 0.05,
            "n": 32.0,
            "ppl": p,
            "ppl_se": 0.1,
            "ppl_delta": d,
        }
        for m, t, r, k, a, p, d in [
            ("none", 1.0, 0.0, 1.0, 0.4, 10.0, 0.0),
            ("unicache", 4.0, 0.52, 4.04, 0.1, 12.0, 0.2),
        ]
    ]
    write_results(rows, tmp_path, ["command: x"])
    assert (tmp_path / "results.csv").read_text().startswith("# command: x\n")
    assert read_results(tmp_path / "results.csv") == rows
    md = (tmp_path / "results.md").read_text()
    # recall 0.10 of 32 = 3 hits: Wilson [0.033, 0.243] (not "± se", which reads 0.00 at 0/n)
    assert "| base | unicache | 4.04x | recall8 | 0.10 [0.03, 0.24] (n=32) | 12.00 (+20.0%) |" in md
    assert (tmp_path / "results.png").stat().st_size > 0


@torch.no_grad()
def test_logits_at_equals_the_gathered_full_logits_and_checks_its_input():
    model = byte_model()
    ids = torch.randint(0, 259, (2, 12))
    at = torch.tensor([[3, 11], [0, 7]])
    full = model(ids).logits
    got = model(ids, logits_at=at).logits
    assert got.shape == (2, 2, 259)
    torch.testing.assert_close(got, full.gather(1, at[..., None].expand(-1, -1, 259)))
    split = torch.tensor([6, 9])
    comp = model(ids, split=split, compressor=IdentityCompressor()).logits
    torch.testing.assert_close(
        model(ids, split=split, compressor=IdentityCompressor(), logits_at=at).logits,
        comp.gather(1, at[..., None].expand(-1, -1, 259)),
    )
    with pytest.raises(ValueError, match="logits_at of shape"):
        model(ids, logits_at=torch.tensor([3, 4]))


def test_unicache_at_rate_refuses_an_unknown_quantizer():
    from unicache_train.compress.presets import text_style_baseline
    from unicache_train.eval.budget import unicache_at_rate

    with pytest.raises(ValueError, match=r"quantize='int2' is not allowed; choose one of"):
        unicache_at_rate(text_style_baseline(), 0.5, "int2")


def test_text_unicache_sets_and_validates_the_scale_granularity():
    from unicache_train.eval.budget import text_unicache
    from unicache_train.validation import ConfigError

    assert text_unicache(0.5, 0, "int4").quantize.granularity == "token_head"
    cfg = text_unicache(0.5, 0, "int4", "channel")
    assert (cfg.quantize.granularity, cfg.quantize.bits) == ("channel", 4)
    with pytest.raises(ConfigError, match="granularity"):
        text_unicache(0.5, 0, "int4", "tensor")
