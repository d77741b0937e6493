"""The kvpress anchor harness (experiments/kvpress/kvpress_baseline.py) restates two things our
package owns, because it runs in kvpress's own venv without it: the fake quantization of a
kept entry and the byte accounting. Both are checked here against the package's own functions;
the press ratios that reach a target reduction are checked by hand. (kvpress itself is not
needed: only the harness's pure functions are imported.)
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from unicache_train.compress.quantize import quantize_symmetric
from unicache_train.seam import QuantizedKV, pack_int4, stored_kv_bytes, uncompressed_kv_bytes

HARNESS = Path(__file__).resolve().parents[1] / "experiments" / "kvpress" / "kvpress_baseline.py"


@pytest.fixture(scope="module")
def kb():
    spec = importlib.util.spec_from_file_location("kvpress_baseline_test", HARNESS)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("bits", [4, 8])
def test_fake_quantize_equals_our_token_head_quantizer(kb, bits) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 17, 64, generator=g) * torch.logspace(-3, 2, 17)[None, None, :, None]
    x[0, 1, 4] = 0.0  # an all-zero vector: q = 0, no division by zero
    ours, _, _ = quantize_symmetric(x, torch.ones(2, 17, dtype=torch.bool), bits, "token_head")
    got = kb.fake_quantize(x, bits)
    assert torch.equal(got, ours)
    assert not torch.equal(got, x)  # it does quantize


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_stored_bytes_equal_our_accounting(kb, bits) -> None:
    """Per kept (token, KV head): K and V at ``bits`` plus one fp16 scale each, as
    :func:`unicache_train.seam.stored_kv_bytes` counts a token_head-quantized segment."""
    B, H, M, D = 1, 3, 11, 64
    valid = torch.ones(B, M, dtype=torch.bool)
    heads = torch.full((B,), H)
    quant = None
    if bits != 16:
        q = torch.zeros(B, H, M, D, dtype=torch.int8)
        data = pack_int4(q) if bits == 4 else q
        scale = torch.ones(B, H, M, dtype=torch.float16)
        quant = QuantizedKV(bits, "token_head", data, data, scale, scale, D)
    ours = float(stored_kv_bytes(valid, heads, D, D, quant=quant).sum())
    assert 2 * M * H * kb.vector_bytes(bits, D) == ours
    assert 2 * M * H * kb.vector_bytes(16, D) == uncompressed_kv_bytes(M, H, D, D)


def test_press_ratios_reach_the_target_at_each_storage(kb) -> None:
    # 256 bytes per (token, head) uncompressed; 68 at int4, 132 at int8 (scales included)
    assert kb.press_ratio(4, 16, 64) == pytest.approx(0.75)
    assert kb.press_ratio(4, 4, 64) == pytest.approx(1 - 256 / (4 * 68))  # 0.059
    assert kb.press_ratio(8, 4, 64) == pytest.approx(1 - 256 / (8 * 68))  # 0.529
    assert kb.press_ratio(8, 8, 64) == pytest.approx(1 - 256 / (8 * 132))  # 0.758
    with pytest.raises(ValueError, match="out of reach"):
        kb.press_ratio(3, 4, 64)  # int4 alone already gives 3.76x


def test_grid_names_are_unique_and_start_with_the_no_press_row(kb) -> None:
    grid = kb.build_grid(["StreamingLLM", "SnapKV"], [4.0, 8.0], [16, 8, 4], plain=True)
    names = [s.name for s in grid]
    assert names[0] == "none_16bit" and grid[0].method == "none"
    assert len(set(names)) == len(names) == 1 + 2 + 2 * 3 * 2
    assert {"none_int4", "none_int8", "SnapKV_int4_8x", "StreamingLLM_16bit_4x"} <= set(names)
    assert next(s for s in grid if s.name == "SnapKV_int4_8x").method == "kvpress:SnapKV+int4"


def test_prompts_refuse_training_seeds_and_carry_unique_ids(kb, tmp_path) -> None:
    args = type("A", (), {"out": tmp_path / "p.jsonl", "num": 5, "pairs": 8, "distractors": 0})
    with pytest.raises(SystemExit):
        kb.write_prompts(type("B", (args,), {"seed": 7}))
    kb.write_prompts(type("C", (args,), {"seed": 1_000_003}))
    recs = kb.read_prompts(tmp_path / "p.jsonl")
    assert len({r["id"] for r in recs}) == 5
    assert all(r["task"] == "recall8" and r["answer"].isdigit() for r in recs)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**recs[0], "id": "x"}) + "\n" + json.dumps({**recs[1], "id": "x"}))
    with pytest.raises(ValueError, match="not unique"):
        kb.read_prompts(bad)


def test_length_batches_group_equal_lengths_only_and_cover_every_prompt(kb) -> None:
    enc = [
        ([0] * c, [0] * q, a)
        for c, q, a in [(5, 3, 2), (6, 3, 2), (5, 3, 2), (5, 4, 2), (5, 3, 2), (5, 3, 3)]
    ]
    batches = kb.length_batches(enc, size=2)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) <= 2 and len({(len(enc[i][0]), len(enc[i][1]), enc[i][2]) for i in b}) == 1
    assert batches[0] == [0, 2] and [4] in batches  # first appearance order, split at size


def test_token_id_prompts_and_the_study_names(kb, tmp_path) -> None:
    from unicache_train.data.long_context import score_prediction

    for pred, answers in [(" 123 and 456", ["123", "456"]), ("ABC", ["abc"]), ("12", ["123"])]:
        assert kb.contains_all(pred, answers) == score_prediction(pred, answers)
    grid = kb.build_grid(["KVzip"], [16.0], [16, 4], plain=True)
    assert [kb.study_setting(s) for s in grid] == [
        "kvpress_none",
        "kvpress_int4",
        "kvpress_KVzip_16bit@16",
        "kvpress_KVzip_int4@16",
    ]
    # The cross-layer budget ablation: KVzip's scores, a uniform fraction evicted per layer,
    # masked head-wise (one prompt at a time) like KVzip itself.
    lw = kb.build_grid(["KVzipLayerwise"], [16.0], [4], plain=False)[-1]  # after no-press
    assert kb.study_setting(lw) == "kvpress_KVzipLayerwise_int4@16"
    assert {"KVzip", "KVzipLayerwise", "KVzipHeadShared"} <= set(kb.MASKED_PRESSES)
    hs = kb.build_grid(["KVzipHeadShared"], [16.0], [4], plain=False)[-1]
    assert kb.study_setting(hs) == "kvpress_KVzipHeadShared_int4@16"
    row = {"id": "a", "task": "t", "context_ids": [1, 2], "question_ids": [3], "answers": ["x"]}
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="lacks \\['max_new'\\]"):
        kb.read_prompts(path)


def test_no_press_and_plain_int4_rows_equal_our_long_context_engine(kb) -> None:
    """The sanity row through the harness's own path (transformers model, DynamicCache, its
    restated int4): on the real checkpoint, the long-context study's token-id prompts give our
    engine's predictions (eval/long_context.py, our Decoder) token for token, uncompressed and
    at plain int4. kvpress itself is not needed (no press)."""
    from unicache_train.checkpoint.gguf import CheckpointNotFetched, fetched_dir

    try:
        ckpt = fetched_dir("smollm2")
    except CheckpointNotFetched as err:  # pragma: no cover - depends on the machine
        pytest.skip(str(err))
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.compress import UniCacheCompressor, presets
    from unicache_train.data.long_context import LongContextTask, long_context_records
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval.budget import unicache_at_rate
    from unicache_train.eval.long_context import ANSWER_MARGIN, run_long_context
    from unicache_train.seam import IdentityCompressor

    tok = load_tokenizer(str(ckpt))
    recs = long_context_records(LongContextTask(tokens=256), 3, 1_000_101, tok, split="eval")
    model, _ = import_hf(ckpt)
    int4 = UniCacheCompressor(unicache_at_rate(presets.sinks_recent(), 0.0, "int4"))  # study's
    ours, _ = run_long_context(
        model.eval(), tok, recs, {"none": IdentityCompressor(), "int4": int4}, batch_size=1
    )
    runner = kb.PressRunner(ckpt, ckpt, threads=2)
    for name, bits in [("none", 16), ("int4", 4)]:
        for r, row in zip(recs, ours[name].rows):
            ctx = tok.encode(r["context"], add_bos=True)
            q = tok.encode(r["question"])
            n = len(tok.encode(" " + ", ".join(r["answers"]))) + ANSWER_MARGIN
            (pred,), kept = runner.answer([ctx], [q], n, None, bits, raw=True)
            assert kept == len(ctx) * 30 * 3  # every K vector, 30 layers x 3 KV heads
            assert pred == row["prediction"], (name, r["id"])
            assert kb.contains_all(pred, r["answers"]) == row["correct"]


def test_head_shared_scores_evict_whole_tokens_of_a_layer(kb) -> None:
    """The per-head ablation: every KV head of a layer gets the layer's mean score, so KVzip's
    bottom-k over (head, token), with a budget that is a multiple of the heads, evicts whole
    tokens, the ones with the lowest mean (checked against a loop over the tokens)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 1, 4, 10, generator=g, dtype=torch.float64)
    before = scores.clone()
    shared = kb.share_over_heads(scores)
    assert shared.shape == scores.shape and torch.equal(scores, before)  # the input untouched
    for layer in range(3):
        mean = [sum(scores[layer, 0, h, t].item() for h in range(4)) / 4 for t in range(10)]
        for h in range(4):
            assert shared[layer, 0, h].tolist() == pytest.approx(mean, rel=1e-12)
        pruned = torch.topk(-shared[layer].reshape(1, -1), 4 * 3, dim=1).indices[0]
        tokens = sorted({int(i) % 10 for i in pruned})
        assert tokens == sorted(sorted(range(10), key=lambda t: mean[t])[:3])
