"""Quality evaluation under KV compression: rows, checks, attention KL, CSV/PNG, logger, CLI."""

import csv
import math
import warnings
from pathlib import Path

import pytest
import torch

from unicache_train.compress import UniCacheCompressor, UniCacheConfig
from unicache_train.compress.composer import RateShortfallWarning
from unicache_train.compress.presets import preset, text_style_baseline
from unicache_train.data.config import DataConfig, SyntheticDataConfig
from unicache_train.data.tokenizer import load_tokenizer
from unicache_train.eval.budget import unicache_at_rate
from unicache_train.eval.report import CSV_COLUMNS, format_table, log_rows, write_outputs
from unicache_train.eval.sweep import (
    CompressionEvalConfig,
    Quality,
    Setting,
    evaluate_compression,
    quality_row,
)
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.train.config import RunConfig
from unicache_train.validation import ConfigError


def tiny_data() -> DataConfig:
    return DataConfig(
        seq_len=96,
        batch_size=4,
        pack=False,
        val_fraction=0.25,
        synthetic=SyntheticDataConfig(
            num_stories=8, num_recall=8, recall_num_facts=3, recall_num_filler=0
        ),
    )


def tiny_model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(
        ModelConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).eval()


class ListLogger:
    """The part of a Lightning logger the evaluation uses."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))


@pytest.fixture(scope="module")
def rows_and_logger():
    logger = ListLogger()
    opts = CompressionEvalConfig(
        rates=[0.0, 0.3, 0.6], quantize="none", num_recall=4, limit_batches=1, batch_size=4
    )
    rows = evaluate_compression(
        tiny_model(),
        load_tokenizer("byte"),
        tiny_data(),
        text_style_baseline(),
        opts,
        logger=logger,
    )
    return rows, logger


def test_rows_columns_and_monotone_quality(rows_and_logger) -> None:
    rows, _ = rows_and_logger
    assert [r["label"] for r in rows] == ["uncompressed", "rate=0", "rate=0.3", "rate=0.6"]
    assert all(set(CSV_COLUMNS) <= set(r) for r in rows)
    unc, zero, three, six = rows
    # Rate 0 without quantization is the identity: same perplexity, no KL, full cache.
    assert zero["ppl"] == pytest.approx(unc["ppl"], rel=1e-6)
    assert zero["attn_kl"] == pytest.approx(0.0, abs=1e-6)
    assert zero["output_kl"] == pytest.approx(0.0, abs=1e-6)
    assert zero["kv_reduction"] == pytest.approx(1.0)
    assert zero["kl_ok"] is True and zero["ppl_ok"] is True
    # This untrained model recalls nothing uncompressed: the recall check cannot measure a
    # drop, so it (and with it the verdict) reads n/a instead of a meaningless pass.
    assert unc["recall_acc"] == 0.0
    assert zero["acc_ok"] is None and zero["pass"] is None
    # 60% of the context removed: attention really differs and the cache is smaller.
    assert six["attn_kl"] > 1e-3 and six["output_kl"] > 0
    assert 1 / 0.6 < six["kv_reduction"] < 1 / 0.3 and six["rate_realized"] > 0.5
    assert 0.0 <= six["recall_acc"] <= 1.0 and not math.isnan(unc["recall_acc"])
    # Monotone in the rate, on one fixed model and the same tokens: more context removed ->
    # fewer realized KV bytes, and attention / output drift away from the uncompressed model.
    # (Perplexity is not asserted: on an untrained model it moves by noise, either way.)
    seq = [zero, three, six]
    assert [r["rate_realized"] for r in seq] == sorted(r["rate_realized"] for r in seq)
    assert zero["kv_reduction"] < three["kv_reduction"] < six["kv_reduction"]
    assert zero["attn_kl"] <= three["attn_kl"] <= six["attn_kl"]
    assert zero["output_kl"] <= three["output_kl"] <= six["output_kl"]
    # The text-style preset has no text cap: what was asked is what was removed.
    for r in seq:
        assert r["rate_realized"] == pytest.approx(r["rate"], abs=0.02)
        assert r["budget_shortfall"] == pytest.approx(0.0, abs=0.02)
    table = format_table(rows)
    assert "rate=0.6" in table and "rate_realized" in table and "n/a" in table


def test_logger_gets_compress_metrics(rows_and_logger) -> None:
    _, logger = rows_and_logger
    assert [s for s, _ in logger.rows] == [0, 1, 2]
    names = set(logger.rows[1][1])
    for n in (
        "compress/attn_kl",
        "compress/ppl_delta",
        "compress/recall_acc_delta",
        "compress/kv_reduction",
        "compress/rate",
        "compress/rate_realized",
        "compress/budget_shortfall",
    ):
        assert n in names
    assert logger.rows[2][1]["compress/rate"] == pytest.approx(0.6)
    assert math.isnan(logger.rows[0][1]["compress/pass"])  # rate 0: n/a, logged as NaN
    assert logger.rows[2][1]["compress/pass"] == 0.0  # rate 0.6: attn KL fails


def test_csv_and_png_outputs(rows_and_logger, tmp_path: Path) -> None:
    rows, _ = rows_and_logger
    csv_path, png_path = write_outputs(rows, tmp_path, "evalx")
    with csv_path.open() as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == CSV_COLUMNS
        got = list(reader)
    assert [r["label"] for r in got] == ["uncompressed", "rate=0", "rate=0.3", "rate=0.6"]
    assert {r["pass"] for r in got} <= {"True", "False", "n/a"}
    assert got[1]["acc_ok"] == "n/a" and float(got[3]["rate_realized"]) > 0.5
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 5000


def _row(acc: float, acc_plain: float, ppl: float, attn_kl: float) -> dict:
    """A row at rate 0.6, int8, against an uncompressed perplexity of 10."""
    q = Quality(
        ppl=ppl,
        recall_acc=acc,
        attn_kl=attn_kl,
        output_kl=0.01,
        kv_reduction=4.2,
        rate_realized=0.6,
    )
    return quality_row(Setting("r", "unicache", 0.6, 8), q, Quality(ppl=10.0, recall_acc=acc_plain))


def test_quality_check_thresholds() -> None:
    ok = _row(acc=0.80, acc_plain=0.84, ppl=10.4, attn_kl=0.09)
    assert (ok["kl_ok"], ok["ppl_ok"], ok["acc_ok"], ok["pass"]) == (True, True, True, True)
    assert ok["rate_realized"] == pytest.approx(0.6) and ok["budget_shortfall"] == 0.0
    bad = _row(acc=0.78, acc_plain=0.84, ppl=10.6, attn_kl=0.11)
    assert (bad["kl_ok"], bad["ppl_ok"], bad["acc_ok"], bad["pass"]) == (False, False, False, False)


def test_recall_check_reads_na_when_it_cannot_measure(tmp_path: Path) -> None:
    """Both accuracies 0 (or no recall at all): "at most 5 points lower" would pass whatever
    compression did, so the recall check and the verdict read n/a, everywhere they show."""
    kw = dict(ppl=10.1, attn_kl=0.01)
    both_zero = _row(acc=0.0, acc_plain=0.0, **kw)
    no_recall = _row(acc=math.nan, acc_plain=math.nan, **kw)
    for row in (both_zero, no_recall):
        assert (row["kl_ok"], row["ppl_ok"], row["acc_ok"], row["pass"]) == (True, True, None, None)
    # A failing check still fails the row: n/a never hides a fail.
    bad_kl = _row(acc=0.0, acc_plain=0.0, **{**kw, "attn_kl": 0.5})
    assert (bad_kl["kl_ok"], bad_kl["acc_ok"], bad_kl["pass"]) == (False, None, False)
    # A model that does recall keeps a real verdict.
    assert _row(acc=0.5, acc_plain=0.52, **kw)["pass"] is True
    line = format_table([both_zero]).splitlines()[-1]
    assert line.split()[-2:] == ["n/a", "n/a"] and "PASS" in line
    csv_path, _ = write_outputs([both_zero], tmp_path, "na")
    with csv_path.open() as fh:
        got = next(csv.DictReader(fh))
    assert (got["acc_ok"], got["pass"], got["kl_ok"]) == ("n/a", "n/a", "True")

    class Sink:
        logged: list = []

        def log_metrics(self, metrics, step):
            self.logged.append(metrics)

    log_rows([both_zero], Sink())
    assert math.isnan(Sink.logged[0]["compress/pass"])


def test_unicache_at_rate_and_bad_options() -> None:
    cfg = unicache_at_rate(text_style_baseline(), 0.3, "int4")
    assert (cfg.target_rate, cfg.quantize.bits, cfg.rate_scale) == (0.3, 4, 1.0)
    assert unicache_at_rate(cfg, 0.5, "none").quantize.active is False
    for bad in (
        {"rates": []},
        {"rates": [1.5]},
        {"rates": [True]},
        {"quantize": "int2"},
        {"preset": "nope"},
        {"num_recall": -1},
        {"attn_kl_layers": 0},
    ):
        with pytest.raises(ConfigError):
            CompressionEvalConfig(**bad)


def test_cli_evaluate_writes_table_csv_png(tmp_path: Path) -> None:
    from unicache_train.cli import main

    model = tiny_model()
    cfg = RunConfig(model=model.config, data=tiny_data())
    ckpt = tmp_path / "tiny.ckpt"
    torch.save(
        {
            "hyper_parameters": {"config": cfg.to_dict()},
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        },
        ckpt,
    )
    out = tmp_path / "eval"
    main(
        [
            "evaluate",
            "--checkpoint",
            str(ckpt),
            "--limit_batches",
            "1",
            "sweep.rates=[0.0,0.6]",
            "sweep.quantize=int8",
            "sweep.preset=text_style_baseline",
            "sweep.num_recall=4",
            "sweep.limit_batches=1",
            f"sweep.out_dir={out}",
            "--logger",
            "csv",
        ]
    )
    with (out / "compression_eval.csv").open() as fh:
        got = list(csv.DictReader(fh))
    assert [r["label"] for r in got] == ["uncompressed", "rate=0 int8", "rate=0.6 int8"]
    assert float(got[2]["kv_reduction"]) > 1 / 0.3  # int8 + 60% removed: > 3x smaller
    assert (out / "compression_eval.png").is_file()
    metrics = list(out.glob("compression_eval/version_*/metrics.csv"))
    assert metrics and "compress/attn_kl" in metrics[0].read_text().splitlines()[0]


# --------------------------------------------------------------------------------- attention KL
def test_attn_kl_under_qk_norm_equals_kl_of_the_forwards_own_attention(monkeypatch) -> None:
    """Qwen3-style q_norm/k_norm: ``attn_kl`` equals the KL of the attention probabilities the
    model's own forwards computed, captured at the SDPA call itself (the queries, keys and
    mask attention really used) and mapped back to tokens here, written out independently."""
    import torch.nn.functional as F

    import unicache_train.model.attention as attn_mod

    torch.manual_seed(0)
    model = Decoder(
        ModelConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            qk_norm=True,
        )
    ).eval()
    with torch.no_grad():  # gains far from 1: the norms change the logits a lot
        for layer in model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 3.0)
            layer.self_attn.k_norm.weight.uniform_(0.5, 3.0)
    B, T = 2, 40
    ids = torch.randint(0, 260, (B, T), generator=torch.Generator().manual_seed(1))
    split = torch.tensor([22, 30])
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "split": split}
    base = text_style_baseline()
    opts = CompressionEvalConfig(
        rates=[0.6], quantize="none", num_recall=0, limit_batches=1, attn_kl_layers=2
    )
    got = evaluate_compression(
        model, load_tokenizer("byte"), tiny_data(), base, opts, loader=[batch]
    )[1]["attn_kl"]

    # Independent reference: what SDPA received (one batched masked call per layer).
    monkeypatch.setattr(attn_mod, "SEGMENT_ATTENTION", "batched")
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((q.detach(), k.detach(), attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    segments = {}
    comp = UniCacheCompressor(unicache_at_rate(base, 0.6, "none"))

    def capture(inp):
        segments[inp.layer_idx] = seg = comp(inp)
        return seg

    with torch.no_grad():
        model(ids)
        full = calls[:]
        calls.clear()
        model(ids, split=split, compressor=capture)
        comp_calls = calls[:]
    assert len(full) == len(comp_calls) == 2

    def probs(q, k, mask, causal):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        logits = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if causal:
            allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
            logits = logits.masked_fill(~allowed, -math.inf)
        else:
            logits = logits + mask.double()
        return logits.softmax(-1)

    total, n = 0.0, 0
    for layer in range(2):
        p_full = probs(*full[layer][:2], None, True)  # [B, H, T, T]
        p_comp = probs(comp_calls[layer][0], comp_calls[layer][1], comp_calls[layer][2], False)
        seg = segments[layer]
        M = seg.keys.shape[2]
        for b in range(B):
            s = int(split[b])
            for h in range(p_full.shape[1]):
                for t in range(s, T):
                    p_tok = torch.zeros(T, dtype=torch.float64)
                    for j in range(s):  # context token -> its entry's share
                        e = int(seg.assignment[b, j])
                        if e >= 0:
                            p_tok[j] = p_comp[b, h, t, e] / float(seg.counts[b, e])
                    p_tok[s : t + 1] = p_comp[b, h, t, M + s : M + t + 1]
                    pf = p_full[b, h, t]
                    nz = p_tok > 0
                    total += float((p_tok[nz] * (p_tok[nz] / pf[nz]).log()).sum())
                    n += 1
    want = total / n
    assert want > 1e-3  # compression really changed attention
    assert got == pytest.approx(want, rel=1e-4, abs=1e-7)


# --------------------------------------------------------------------------------- shortfall
def test_capped_rate_reports_realized_rate_and_shortfall_and_warns_once() -> None:
    """The default preset caps text removal at 0.40: asked for 0.9 on text it removes 0.40. The
    stats, the evaluation rows and their table say so, and the compressor warns once."""
    d = preset("default").to_dict()
    d["target_rate"] = 0.9
    d["quantize"]["bits"] = None
    comp = UniCacheCompressor(UniCacheConfig.from_dict(d))
    model = tiny_model()
    ids = torch.randint(0, 260, (2, 64), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(3):  # three forwards x two layers: still one warning
                out = model(ids, split=torch.tensor([48, 40]), compressor=comp)
    shortfall_warnings = [w for w in caught if issubclass(w.category, RateShortfallWarning)]
    assert len(shortfall_warnings) == 1
    msg = str(shortfall_warnings[0].message)
    assert "removed 0.40" in msg and "budget.text_cap" in msg
    for st in out.compression_stats:  # every layer: the cap, not the schedule, decides
        realized, asked = float(st["rate_realized"]), float(st["rate_target"])
        assert realized == pytest.approx(0.40, abs=0.02)
        assert float(st["budget_shortfall"]) == pytest.approx(asked - realized, abs=0.02)
        assert float(st["budget_cap_withheld"]) == pytest.approx(asked - realized, abs=0.02)
        assert float(st["budget_shortfall"]) > 0.2

    base = preset("default")
    opts = CompressionEvalConfig(
        rates=[0.9], quantize="none", num_recall=0, limit_batches=1, batch_size=4
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = evaluate_compression(model, load_tokenizer("byte"), tiny_data(), base, opts)
    assert sum(issubclass(w.category, RateShortfallWarning) for w in caught) == 1
    row = rows[1]
    assert row["rate"] == 0.9
    assert row["rate_realized"] == pytest.approx(0.40, abs=0.03)
    assert row["budget_shortfall"] == pytest.approx(0.50, abs=0.03)
    header = format_table(rows).splitlines()[0].split()
    assert header[:4] == ["label", "rate", "rate_realized", "budget_shortfall"]


def test_vlm_table_shows_the_realized_rate() -> None:
    """evaluate_vlm's rows and table carry ``rate_realized`` and ``budget_shortfall`` (caps:
    text 0.40, vision 0.80, so 0.9 is out of reach)."""
    from unicache_train.data.scenes import SceneConfig
    from unicache_train.data.tokenizer import ByteTokenizer
    from unicache_train.eval.vlm import VLMEvalConfig, evaluate_vlm, format_vlm_table
    from unicache_train.model.vision import VisionConfig
    from unicache_train.model.vlm import VisionLanguageModel

    torch.manual_seed(0)
    model = VisionLanguageModel(
        ModelConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        VisionConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
    )
    scenes = SceneConfig(image_size=32, cell_size=8, max_shapes=3, max_describe=2)
    opts = VLMEvalConfig(
        rates=[0.9], variants=["unicache"], num_per_task=1, batch_size=4, progress=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RateShortfallWarning)
        rows = evaluate_vlm(model, ByteTokenizer(), scenes, UniCacheConfig(), opts)
    unc, uc = rows
    assert unc["rate_realized"] == 0.0 and math.isnan(unc["budget_shortfall"])
    assert 0.3 < uc["rate_realized"] < 0.85
    assert uc["budget_shortfall"] == pytest.approx(0.9 - uc["rate_realized"])
    header = format_vlm_table(rows).splitlines()[0].split()
    assert header[:5] == ["model", "variant", "rate", "rate_realized", "budget_shortfall"]


def test_finetune_recipe_table_recall_na_and_realized_rate() -> None:
    """The fine-tune recipe's before/after table: ``checks_s6`` reads n/a (not PASS) when the
    base recalls nothing and nothing else fails, and shows the realized rate."""
    import importlib

    fc = importlib.import_module("recipes.finetune_compress")
    unc = dict(
        ppl=10.0, recall_acc=0.0, kv_reduction=1.0, attn_kl=0.0, output_kl=0.0, rate_realized=0.0
    )
    ok = dict(unc, ppl=10.2, kv_reduction=1 / 0.3, attn_kl=0.05, rate_realized=0.4)
    bad = dict(ok, attn_kl=0.2)
    rows = fc.before_after([unc, ok], [unc, bad])
    assert [r["checks_s6"] for r in rows] == ["n/a", "n/a", "fail", "n/a"]
    assert [r["rate_realized"] for r in rows] == [0.0, 0.4, 0.4, 0.0]
    recalls = dict(unc, recall_acc=0.8)
    rows = fc.before_after(
        [recalls, dict(ok, recall_acc=0.79)], [recalls, dict(ok, recall_acc=0.5)]
    )
    assert [r["checks_s6"] for r in rows[1:3]] == ["PASS", "fail"]
