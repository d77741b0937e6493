"""Quality evaluation under KV compression: rows, checks, attention KL, CSV/PNG, logger, CLI."""

import csv
import math
from pathlib import Path

import pytest
import torch

from unicache_train.compress.presets import text_style_baseline
from unicache_train.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    RunConfig,
    SyntheticDataConfig,
)
from unicache_train.data.tokenizer import load_tokenizer
from unicache_train.model import Decoder
from unicache_train.train.evaluate import (
    CSV_COLUMNS,
    CompressionEvalConfig,
    _row,
    evaluate_compression,
    format_table,
    unicache_at_rate,
    write_outputs,
)


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
        rates=[0.0, 0.6], quantize="none", num_recall=4, limit_batches=1, batch_size=4
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
    assert [r["label"] for r in rows] == ["uncompressed", "rate=0", "rate=0.6"]
    assert all(set(CSV_COLUMNS) <= set(r) for r in rows)
    unc, zero, six = rows
    # Rate 0 without quantization is the identity: same perplexity, no KL, full cache.
    assert zero["ppl"] == pytest.approx(unc["ppl"], rel=1e-6)
    assert zero["attn_kl"] == pytest.approx(0.0, abs=1e-6)
    assert zero["output_kl"] == pytest.approx(0.0, abs=1e-6)
    assert zero["kv_bytes_ratio"] == pytest.approx(1.0)
    assert zero["pass"] is True
    # 60% of the context removed: attention really differs and the cache is smaller.
    assert six["attn_kl"] > 1e-3 and six["output_kl"] > 0
    assert 0.3 < six["kv_bytes_ratio"] < 0.6 and six["keep_ratio"] < 0.5
    assert 0.0 <= six["recall_acc"] <= 1.0 and not math.isnan(unc["recall_acc"])
    assert "rate=0.6" in format_table(rows)


def test_logger_gets_compress_metrics(rows_and_logger) -> None:
    _, logger = rows_and_logger
    assert [s for s, _ in logger.rows] == [0, 1]
    names = set(logger.rows[1][1])
    for n in (
        "compress/attn_kl",
        "compress/ppl_delta",
        "compress/recall_acc_delta",
        "compress/kv_bytes_ratio",
        "compress/rate",
    ):
        assert n in names
    assert logger.rows[1][1]["compress/rate"] == pytest.approx(0.6)


def test_csv_and_png_outputs(rows_and_logger, tmp_path: Path) -> None:
    rows, _ = rows_and_logger
    csv_path, png_path = write_outputs(rows, tmp_path, "evalx")
    with csv_path.open() as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == CSV_COLUMNS
        got = list(reader)
    assert [r["label"] for r in got] == ["uncompressed", "rate=0", "rate=0.6"]
    assert {r["pass"] for r in got} <= {"True", "False"}
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 5000


def test_quality_check_thresholds() -> None:
    ok = _row(
        "r",
        0.6,
        8,
        ppl=10.4,
        ppl_plain=10.0,
        acc=0.80,
        acc_plain=0.84,
        attn_kl=0.09,
        output_kl=0.01,
        kv_ratio=0.24,
        keep_ratio=0.4,
    )
    assert (ok["kl_ok"], ok["ppl_ok"], ok["acc_ok"], ok["pass"]) == (True, True, True, True)
    bad = _row(
        "r",
        0.6,
        8,
        ppl=10.6,
        ppl_plain=10.0,
        acc=0.78,
        acc_plain=0.84,
        attn_kl=0.11,
        output_kl=0.01,
        kv_ratio=0.24,
        keep_ratio=0.4,
    )
    assert (bad["kl_ok"], bad["ppl_ok"], bad["acc_ok"], bad["pass"]) == (False, False, False, False)


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
            "--compression.rates",
            "[0.0,0.6]",
            "--compression.quantize",
            "int8",
            "--compression.preset",
            "text_style_baseline",
            "--compression.num_recall",
            "4",
            "--compression.limit_batches",
            "1",
            "--compression.out_dir",
            str(out),
            "--logger",
            "csv",
        ]
    )
    with (out / "compression_eval.csv").open() as fh:
        got = list(csv.DictReader(fh))
    assert [r["label"] for r in got] == ["uncompressed", "rate=0 int8", "rate=0.6 int8"]
    assert float(got[2]["kv_bytes_ratio"]) < 0.3  # int8 + 60% removed: > 3x smaller
    assert (out / "compression_eval.png").is_file()
    metrics = list(out.glob("compression_eval/version_*/metrics.csv"))
    assert metrics and "compress/attn_kl" in metrics[0].read_text().splitlines()[0]
