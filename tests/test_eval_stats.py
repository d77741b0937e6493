"""Paired statistics of the evaluation (checked against values computed by hand in the comments)
and the batched recall path (the same predictions as one prompt at a time)."""

import itertools
import json
import math
import random

import pytest
import torch

from unicache_train.compress import UniCacheCompressor
from unicache_train.compress.config import UniCacheConfig
from unicache_train.data.tokenizer import ByteTokenizer
from unicache_train.eval import RecallTask, recall_records
from unicache_train.eval.recall import run_recall, run_recall_stepwise, write_predictions
from unicache_train.eval.stats import (
    drop_difference_clustered,
    format_p,
    mcnemar_exact,
    paired_bootstrap_ppl,
    sign_flip_clustered,
    wilson_interval,
)
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.seam import IdentityCompressor


# ------------------------------------------------------------------------------ Wilson
def test_wilson_interval_of_zero_hits_has_a_real_upper_bound():
    # 0/32, z = 1.959964, z² = 3.8414588: centre = z²/2n = 0.0600228,
    # half = z sqrt(z²/4n²) = z²/2n = 0.0600228, denominator 1 + z²/n = 1.1200456,
    # so [0, 0.1200456 / 1.1200456] = [0, 0.1071792]: not "0.00 ± 0.00".
    lo, hi = wilson_interval(0, 32)
    assert lo == 0.0
    assert hi == pytest.approx(0.1071792, abs=1e-7)


def test_wilson_interval_matches_the_hand_computed_value_at_27_of_32():
    # p = 0.84375; p(1-p)/n = 0.0041198730; z²/4n² = 0.0009378562; sqrt(sum) = 0.0711177;
    # half = z x 0.0711177 = 0.1393882; centre = p + z²/2n = 0.9037728; denominator 1.1200456;
    # lo = 0.7643846 / 1.1200456 = 0.6824585, hi = 1.0431610 / 1.1200456 = 0.9313558.
    lo, hi = wilson_interval(27, 32)
    assert lo == pytest.approx(0.6824585, abs=1e-7)
    assert hi == pytest.approx(0.9313558, abs=1e-7)


def test_wilson_interval_is_symmetric_and_refuses_bad_counts():
    lo, hi = wilson_interval(5, 20)
    lo2, hi2 = wilson_interval(15, 20)
    assert lo == pytest.approx(1 - hi2) and hi == pytest.approx(1 - lo2)
    assert wilson_interval(20, 20)[1] == 1.0
    with pytest.raises(ValueError, match="hits=21, n=20"):
        wilson_interval(21, 20)
    with pytest.raises(ValueError, match="z="):
        wilson_interval(1, 2, z=0.0)


# ------------------------------------------------------------------------------ McNemar
def _pairs(only_a: int, only_b: int, both: int = 5, neither: int = 4):
    a = [True] * only_a + [False] * only_b + [True] * both + [False] * neither
    b = [False] * only_a + [True] * only_b + [True] * both + [False] * neither
    return a, b


def test_mcnemar_exact_matches_the_binomial_tail_by_hand():
    # 3 vs 10 discordant pairs: P[X <= 3], X ~ Bin(13, 1/2) = (1 + 13 + 78 + 286) / 8192
    # = 378 / 8192 = 0.046142578125; two-sided p = 0.09228515625.
    t = mcnemar_exact(*_pairs(3, 10))
    assert (t.only_a, t.only_b, t.n) == (3, 10, 22)
    assert t.p_value == pytest.approx(0.09228515625, rel=1e-12)
    assert t.difference == pytest.approx((15 - 8) / 22)
    # 0 vs 6: 2 / 2**6 = 0.03125; concordant pairs do not enter.
    assert mcnemar_exact(*_pairs(0, 6, both=100)).p_value == pytest.approx(0.03125)
    # 2 vs 2: 2 (1 + 4 + 6) / 16 > 1 -> 1; no discordant pair -> 1.
    assert mcnemar_exact(*_pairs(2, 2)).p_value == 1.0
    assert mcnemar_exact(*_pairs(0, 0)).p_value == 1.0


def test_mcnemar_is_symmetric_in_its_arguments_and_refuses_unpaired_lists():
    a, b = _pairs(4, 12)
    assert mcnemar_exact(a, b).p_value == mcnemar_exact(b, a).p_value
    with pytest.raises(ValueError, match="got 3 and 2"):
        mcnemar_exact([True, False, True], [True, False])


# ------------------------------------------------------------------------------ clustered
def _brute_force_sign_flip(a, b) -> float:
    # Written apart from the library: every one of the 2^n sign vectors over all prompts
    # (zeros included: flipping a zero changes nothing), counting |Σ s_i d_i| >= |Σ d_i|.
    d = [sum(int(y[i]) - int(x[i]) for x, y in zip(a, b)) for i in range(len(a[0]))]
    t = abs(sum(d))
    hits = sum(
        abs(sum(s * x for s, x in zip(signs, d))) >= t
        for signs in itertools.product((1, -1), repeat=len(d))
    )
    return hits / 2 ** len(d)


def _random_seeds(rng: random.Random, seeds: int, prompts: int):
    # Correlated seeds, as in the studies: a prompt's difficulty is shared by every seed.
    easy = [rng.random() for _ in range(prompts)]
    a = [[rng.random() < e for e in easy] for _ in range(seeds)]
    b = [[rng.random() < e + 0.15 for e in easy] for _ in range(seeds)]
    return a, b


@pytest.mark.parametrize("seeds", [1, 2, 3])
def test_sign_flip_clustered_equals_brute_force_enumeration(seeds):
    rng = random.Random(seeds)
    for _ in range(40):
        a, b = _random_seeds(rng, seeds, rng.randint(1, 12))
        t = sign_flip_clustered(a, b)
        assert t.p_value == pytest.approx(_brute_force_sign_flip(a, b), rel=1e-12, abs=0)


def test_sign_flip_clustered_with_one_seed_is_the_exact_mcnemar_test():
    rng = random.Random(0)
    for _ in range(200):
        (a,), (b,) = _random_seeds(rng, 1, rng.randint(1, 300))
        t, m = sign_flip_clustered([a], [b]), mcnemar_exact(a, b)
        assert t.p_value == pytest.approx(m.p_value, rel=1e-12)
        assert (t.only_a, t.only_b, t.favour_a, t.favour_b) == (m.only_a, m.only_b) * 2
        assert t.difference == pytest.approx(m.difference)


def test_a_repeated_seed_adds_no_evidence_where_concatenated_pairs_do():
    # 3 vs 10 discordant prompts: McNemar p = 0.0923 (hand value above). The same results twice
    # as a "second seed": the concatenated 6 vs 20 pairs give p = 0.0094, the clustered test
    # keeps 0.0923 (every d_i doubles, the sign-flip distribution scales with it).
    a, b = _pairs(3, 10)
    assert sign_flip_clustered([a, a], [b, b]).p_value == pytest.approx(0.09228515625)
    assert mcnemar_exact(a + a, b + b).p_value < 0.01


def test_sign_flip_clustered_by_hand_with_prompts_that_cancel_within():
    # Four prompts, two seeds: d = (+2, +1, 0, -1) (the third prompt: A and B each right once,
    # on different seeds). T = 2; the 8 sign vectors over the magnitudes (2, 1, 1) give the
    # sums 4, 2, 2, 0, 0, -2, -2, -4, of which 6 have |T*| >= 2: p = 0.75. The concatenated
    # McNemar test sees 2 vs 4 discordant pairs instead.
    a = [[False, False, True, True], [False, True, False, True]]
    b = [[True, True, False, False], [True, True, True, True]]
    t = sign_flip_clustered(a, b)
    assert (t.prompts, t.seeds, t.n) == (4, 2, 8)
    assert (t.only_a, t.only_b, t.favour_a, t.favour_b) == (2, 4, 1, 2)
    assert t.p_value == pytest.approx(0.75)
    assert sign_flip_clustered(a, a).p_value == 1.0


def test_sign_flip_clustered_refuses_ragged_or_unmatched_seeds():
    with pytest.raises(ValueError, match="got 2 and 1"):
        sign_flip_clustered([[True], [False]], [[True]])
    with pytest.raises(ValueError, match=r"lengths \[2, 1, 2, 2\]"):
        sign_flip_clustered([[True, False], [True]], [[True, True], [False, False]])
    with pytest.raises(ValueError, match="seeds"):
        sign_flip_clustered([], [])


# ------------------------------------------------------------------------------ bootstrap
def test_paired_bootstrap_interval_spans_the_per_block_changes_by_hand():
    # Two blocks of 10 tokens: block 0 goes 10 -> 12 nats (change e^0.2 - 1 = 0.221403),
    # block 1 goes 10 -> 9 (e^-0.1 - 1 = -0.095163). A resample is {0,0}, {0,1}, {1,0} or
    # {1,1} (1/4 each), so the 2.5% and 97.5% quantiles are the two single-block changes and the
    # estimate is the pooled one, e^(1/20) - 1 = 0.051271.
    r = paired_bootstrap_ppl([10.0, 10.0], [12.0, 9.0], [10, 10], resamples=4000)
    assert r.change == pytest.approx(math.expm1(0.05))
    assert r.lo == pytest.approx(math.expm1(-0.1))
    assert r.hi == pytest.approx(math.expm1(0.2))
    assert r.ppl_a == pytest.approx(math.e)


def test_paired_bootstrap_of_a_uniform_shift_has_a_zero_width_interval():
    rng = torch.Generator().manual_seed(0)
    tokens = torch.randint(20, 60, (30,), generator=rng).tolist()
    a = [t * float(x) for t, x in zip(tokens, torch.rand(30, generator=rng) + 2)]
    b = [x + 0.03 * t for x, t in zip(a, tokens)]  # +0.03 nats on every token
    r = paired_bootstrap_ppl(a, b, tokens)
    assert r.lo == pytest.approx(math.expm1(0.03)) and r.hi == pytest.approx(math.expm1(0.03))
    same = paired_bootstrap_ppl(a, a, tokens)
    assert same.change == 0.0 and same.lo == 0.0 and same.hi == 0.0


def test_paired_bootstrap_refuses_unpaired_or_empty_blocks():
    with pytest.raises(ValueError, match="equal lengths"):
        paired_bootstrap_ppl([1.0, 2.0], [1.0], [1, 1])
    with pytest.raises(ValueError, match=">= 1 token"):
        paired_bootstrap_ppl([1.0, 2.0], [1.0, 2.0], [1, 0])
    with pytest.raises(ValueError, match="level="):
        paired_bootstrap_ppl([1.0, 2.0], [1.0, 2.0], [1, 1], level=1.5)


def test_format_p_never_prints_zero():
    assert format_p(0.0) == "p < 1e-6"
    assert format_p(0.0312) == "p = 0.031"
    assert format_p(0.00042) == "p = 0.00042"


# ------------------------------------------------------------------------------ batched recall
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


def _unicache(bits: int) -> UniCacheCompressor:
    return UniCacheCompressor(
        UniCacheConfig.from_dict(
            {
                "target_rate": 0.3,
                "rate_scale": 1.0,
                "budget": {"enabled": False},
                "quantize": {"enabled": True, "bits": bits},
            }
        )
    )


@pytest.mark.parametrize(
    "make",
    [IdentityCompressor, lambda: _unicache(8), lambda: _unicache(4)],
    ids=["uncompressed", "unicache_int8", "unicache_int4"],
)
@torch.no_grad()
def test_batched_recall_gives_the_predictions_and_bytes_of_one_prompt_at_a_time(make):
    # A trained-looking answer is not needed: a random model's greedy digits are as sensitive
    # to any change in what the answer attends to.
    model, tok = byte_model(), ByteTokenizer()
    recs = recall_records(RecallTask(pairs=4, value_digits=3), 12, 1_000_011)
    assert len({len(r["question"]) for r in recs}) > 1  # several question lengths: buckets
    fast = run_recall(model, tok, recs, make(), batch_size=5)
    slow = run_recall_stepwise(model, tok, recs, make())
    assert fast.predictions == slow.predictions
    assert [r["id"] for r in fast.rows] == [r["id"] for r in recs]
    assert fast.baseline_bytes == slow.baseline_bytes
    # The cache counts merge counts for a whole batch once any entry of it was merged
    # (CompressedKVCache.metadata_bytes), so stored bytes move slightly with batch composition.
    assert fast.kv_bytes == pytest.approx(slow.kv_bytes, rel=0.01)


@torch.no_grad()
def test_recall_rows_carry_id_answer_prediction_and_correct_to_jsonl(tmp_path):
    model, tok = byte_model(), ByteTokenizer()
    recs = recall_records(RecallTask(pairs=3, value_digits=2), 4, 1_000_013)
    res = run_recall(model, tok, recs, IdentityCompressor())
    path = write_predictions(res.rows, tmp_path / "p.jsonl", model="base", setting="none")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"recall3/1000013/{i}" for i in range(4)]
    assert all(r["model"] == "base" and r["setting"] == "none" for r in rows)
    assert all(r["correct"] == (r["prediction"] == r["answer"]) for r in rows)
    assert sum(r["correct"] for r in rows) == res.hits


@torch.no_grad()
def test_prompts_written_for_another_harness_run_back_to_the_same_predictions(tmp_path):
    from unicache_train.eval.prompts import PROMPT_FIELDS, read_prompts, write_prompts

    model, tok = byte_model(), ByteTokenizer()
    recs = recall_records(RecallTask(pairs=3, value_digits=2, style="sentence"), 4, 1_000_017)
    back = read_prompts(write_prompts(recs, tmp_path / "prompts.jsonl"))
    assert all(set(PROMPT_FIELDS) <= set(r) and r["trailing"] == "." for r in back)
    assert [r["id"] for r in back] == [r["id"] for r in recs]
    a = run_recall(model, tok, recs, IdentityCompressor())
    b = run_recall(model, tok, back, IdentityCompressor())
    assert a.predictions == b.predictions
    with pytest.raises(ValueError, match="lacks \\['id'\\]"):
        write_prompts([{k: v for k, v in recs[0].items() if k != "id"}], tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match="ids repeat"):
        write_prompts([recs[0], recs[0]], tmp_path / "y.jsonl")


# ------------------------------------------------------------------------------ drop difference
def _brute_force_drop_difference(af, ac, bf, bc) -> float:
    # Written apart from the library: swap the arms on every subset of prompts (all seeds and
    # both settings at once) and recompute the total difference of the drops.
    n, k = len(af[0]), len(af)

    def total(swapped):
        t = 0
        for i in range(n):
            xa, xb = ((bf, bc), (af, ac)) if swapped[i] else ((af, ac), (bf, bc))
            for s in range(k):
                t += (int(xa[0][s][i]) - int(xa[1][s][i])) - (int(xb[0][s][i]) - int(xb[1][s][i]))
        return t

    t = abs(total([False] * n))
    swaps = list(itertools.product((False, True), repeat=n))
    return sum(abs(total(sw)) >= t for sw in swaps) / len(swaps)


@pytest.mark.parametrize("seeds", [1, 2])
def test_drop_difference_equals_brute_force_enumeration(seeds):
    rng = random.Random(10 + seeds)
    for _ in range(6):
        af, bf = _random_seeds(rng, seeds, 11)
        ac = [[x and rng.random() < 0.6 for x in s] for s in af]
        bc = [[x and rng.random() < 0.8 for x in s] for s in bf]
        t = drop_difference_clustered(af, ac, bf, bc)
        assert t.p_value == pytest.approx(_brute_force_drop_difference(af, ac, bf, bc), rel=1e-12)


def test_drop_difference_by_hand():
    """Four prompts, one seed. A is right uncompressed on all and keeps 1 compressed (drop 3);
    B is right on 2 and keeps both (drop 0): d = (0, 1, 1, 1), 3 prompts favour B, p = 2/8.
    An arm ahead everywhere by the same margin has the same drop: p = 1."""
    af, ac = [[1, 1, 1, 1]], [[1, 0, 0, 0]]
    bf, bc = [[1, 1, 0, 0]], [[1, 1, 0, 0]]
    t = drop_difference_clustered(af, ac, bf, bc)
    assert (t.a_drop, t.b_drop, t.favour_a, t.favour_b) == (3, 0, 0, 3)
    assert t.p_value == pytest.approx(2 / 8)
    same = drop_difference_clustered([[1, 1, 0]], [[1, 0, 0]], [[1, 1, 1]], [[1, 0, 1]])
    assert same.a_drop == same.b_drop == 1 and same.p_value == 1.0


def test_drop_difference_names_bad_shapes():
    with pytest.raises(ValueError, match="same number"):
        drop_difference_clustered([[1]], [[1]], [[1]], [])
    with pytest.raises(ValueError, match="lengths"):
        drop_difference_clustered([[1, 0]], [[1]], [[1, 0]], [[1, 0]])
