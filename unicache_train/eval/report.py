"""Tables, CSVs, plots and logger metrics of evaluations.

Shared by every evaluation: :func:`text_table` (the one fixed-width text table) and
:func:`write_csv` (the one CSV writer; ``None`` cells, checks that could not measure anything,
are written ``n/a``).

Two row formats:

* **the compression sweep** (:func:`unicache_train.eval.sweep.evaluate_compression`, one row per
  setting, :data:`CSV_COLUMNS`): :func:`format_table`, :func:`write_outputs` (CSV + PNG),
  :func:`log_rows` (``compress/*`` logger metrics);
* **compression studies of real checkpoints** (one row per (model, setting, task),
  :data:`COLUMNS`): the model, the compression method, the KV-bytes reduction asked for and the
  one measured on the decoding cache (``uncompressed 16-bit bytes / stored bytes``), the removal
  rate, the task, recall with its standard error, perplexity with its standard error and its
  change against the same model uncompressed: :func:`write_results`, :func:`read_results`,
  :func:`markdown_table`, :func:`plot_results`.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "text_table",
    "write_csv",
    "CSV_COLUMNS",
    "format_table",
    "write_outputs",
    "plot_sweep",
    "log_rows",
    "COLUMNS",
    "write_results",
    "read_results",
    "markdown_table",
    "plot_results",
]


# --------------------------------------------------------------------------------- shared
def _cell(value: Any, digits: int) -> str:
    if value is None:  # a check that could not be measured
        return "n/a"
    if isinstance(value, bool):
        return "PASS" if value else "fail"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


def text_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, digits: int = 4
) -> str:
    """A fixed-width text table: floats to ``digits`` significant digits (NaN: ``-``), checks
    as ``PASS`` / ``fail`` / ``n/a``, a missing cell empty.

    Args:
        columns: the columns, in order (default: the first row's keys).
    """
    cols = list(columns or (rows[0] if rows else ()))
    cells = [[_cell(r.get(c, ""), digits) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def write_csv(
    path: str | Path,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    *,
    header: Sequence[str] = (),
    float_digits: int | None = None,
    extra: str = "ignore",
) -> Path:
    """Rows to a CSV file with ``columns`` (``None`` written ``n/a``).

    Args:
        header: lines written first, as ``# ...`` comments.
        float_digits: floats to this many significant digits (None: full precision).
        extra: keys of a row outside ``columns``: ``"ignore"`` or ``"raise"``.
    """
    path = Path(path)
    with path.open("w", newline="") as fh:
        for line in header:
            fh.write(f"# {line}\n")
        writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction=extra)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _csv_cell(v, float_digits) for k, v in r.items()})
    return path


def _csv_cell(value: Any, float_digits: int | None) -> Any:
    if value is None:
        return "n/a"
    if float_digits is not None and isinstance(value, float):
        return f"{value:.{float_digits}g}"
    return value


# --------------------------------------------------------------------------------- the sweep
#: ``rate``: the requested target rate; ``rate_realized``: the fraction of context tokens really
#: removed (mean over layers); ``budget_shortfall``: ``rate - rate_realized`` when positive (what
#: modality caps, protection or the layer schedule withheld); ``kv_reduction``: uncompressed
#: 16-bit bytes / stored bytes, measured; ``target_reduction``: the reduction a setting was set up
#: for (NaN for a plain rate). The checks read ``True``, ``False`` or ``None`` (n/a: not
#: measurable, written ``n/a``). Words: docs/architecture.md#words.
CSV_COLUMNS = (
    "label",
    "rate",
    "rate_realized",
    "budget_shortfall",
    "bits",
    "ppl",
    "ppl_uncompressed",
    "ppl_delta",
    "recall_acc",
    "recall_acc_uncompressed",
    "recall_acc_delta",
    "attn_kl",
    "output_kl",
    "kv_reduction",
    "target_reduction",
    "kl_ok",
    "ppl_ok",
    "acc_ok",
    "pass",
    "method",
)

#: The sweep's table columns: the ones a reader compares.
TABLE_COLUMNS = (
    "label",
    "rate",
    "rate_realized",
    "budget_shortfall",
    "ppl",
    "ppl_delta",
    "recall_acc",
    "attn_kl",
    "output_kl",
    "kv_reduction",
    "kl_ok",
    "ppl_ok",
    "acc_ok",
    "pass",
)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """The sweep's rows as a text table (default columns: :data:`TABLE_COLUMNS`)."""
    return text_table(rows, columns or TABLE_COLUMNS)


def write_outputs(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, name: str = "compression_eval"
) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.csv`` (:data:`CSV_COLUMNS`) and ``<name>.png``
    (:func:`plot_sweep`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out / f"{name}.csv", out / f"{name}.png"
    write_csv(csv_path, rows, CSV_COLUMNS)
    plot_sweep(rows, png_path)
    return csv_path, png_path


def _check_value(check: bool | None) -> float:
    """A check as a logged number: 1 pass, 0 fail, NaN n/a."""
    return math.nan if check is None else float(check)


def log_rows(rows: Sequence[dict[str, Any]], logger: Any) -> None:
    """Rows to a logger under the ``compress/`` names, one logger step per compressed row."""
    for step, row in enumerate(r for r in rows if r["label"] != "uncompressed"):
        metrics = {
            "compress/rate": row["rate"],
            "compress/ppl": row["ppl"],
            "compress/ppl_delta": row["ppl_delta"],
            "compress/recall_acc": row["recall_acc"],
            "compress/recall_acc_delta": row["recall_acc_delta"],
            "compress/attn_kl": row["attn_kl"],
            "compress/output_kl": row["output_kl"],
            "compress/kv_reduction": row["kv_reduction"],
            "compress/rate_realized": row["rate_realized"],
            "compress/budget_shortfall": row["budget_shortfall"],
            "compress/pass": _check_value(row["pass"]),
        }
        logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)
    if hasattr(logger, "save"):
        logger.save()


def plot_sweep(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Perplexity and recall accuracy against the rate (uncompressed as dashed lines, KV bytes
    reduction annotated); with xKV rows, also perplexity against the KV bytes reduction."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: before pyplot is imported; no display on servers and CI
    import matplotlib.pyplot as plt

    comp = [r for r in rows if r["label"] != "uncompressed" and not math.isnan(r["rate"])]
    comp = sorted(comp, key=lambda r: r["rate"])
    base = next((r for r in rows if r["label"] == "uncompressed"), None)
    by_bytes = any(r.get("method", "unicache") not in ("unicache", "none") for r in rows)
    fig, axes = plt.subplots(1, 3 if by_bytes else 2, figsize=(15 if by_bytes else 10, 4))
    x = [r["rate"] for r in comp]
    for ax, key, title in (
        (axes[0], "ppl", "perplexity on continuations"),
        (axes[1], "recall_acc", "key-value recall accuracy"),
    ):
        ax.plot(x, [r[key] for r in comp], "o-", label="UniCache")
        if base is not None and not math.isnan(base[key]):
            ax.axhline(base[key], ls="--", color="gray", label="uncompressed")
        for r in comp:
            reduction = r["kv_reduction"]
            if not math.isnan(r[key]) and not math.isnan(reduction):
                ax.annotate(
                    f"{reduction:.1f}x",
                    (r["rate"], r[key]),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                )
        ax.set_xlabel("UniCache target rate (fraction of context tokens removed)")
        ax.set_title(title)
        ax.legend()
    axes[1].set_ylim(-0.02, 1.02)
    if by_bytes:
        ax = axes[2]
        methods = sorted({r.get("method", "unicache") for r in rows} - {"none"})
        for m in methods:
            pts = sorted(
                (r["kv_reduction"], r["ppl"])
                for r in rows
                if r.get("method", "unicache") == m and not math.isnan(r["kv_reduction"])
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=m)
        if base is not None:
            ax.axhline(base["ppl"], ls="--", color="gray", label="uncompressed")
        ax.set_xlabel("KV bytes reduction (x, stored bytes incl. factors / scales)")
        ax.set_title("perplexity at equal KV bytes")
        ax.legend()
    fig.suptitle("quality under KV compression (annotations: KV bytes reduction)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------- studies
COLUMNS = (
    "model",
    "method",
    "target_reduction",
    "rate",
    "kv_reduction",
    "task",
    "recall",
    "recall_se",
    "n",
    "ppl",
    "ppl_se",
    "ppl_delta",
)
_TEXT = ("model", "method", "task")


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``results.csv`` written by :func:`write_results` (numbers parsed)."""
    rows = []
    with Path(path).open(newline="") as f:
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            rows.append({k: (v if k in _TEXT else float(v)) for k, v in r.items()})
    return rows


def _recall_cell(recall: float, n: float) -> str:
    """``0.84 [0.70, 0.92] (n=32)``: the accuracy with its 95% Wilson interval (honest at 0/n,
    where a binomial standard error reads 0.00)."""
    from unicache_train.eval.stats import wilson_interval

    if not n >= 1 or math.isnan(recall):
        return "not measured"
    lo, hi = wilson_interval(round(recall * n), int(n))
    return f"{recall:.2f} [{lo:.2f}, {hi:.2f}] (n={int(n)})"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | method | KV bytes reduction (measured) | task | recall [95% Wilson] | ppl (Δ) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ppl = (
            "not measured"
            if math.isnan(r["ppl"])
            else f"{r['ppl']:.2f} ({100 * r['ppl_delta']:+.1f}%)"
        )
        lines.append(
            f"| {r['model']} | {r['method']} | {r['kv_reduction']:.2f}x | {r['task']} | "
            f"{_recall_cell(r['recall'], r['n'])} | {ppl} |"
        )
    return "\n".join(lines) + "\n"


def write_results(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, header: Sequence[str] = ()
) -> None:
    """``results.csv`` (``header`` lines first, as ``# ...`` comments), ``results.md`` and
    ``results.png`` in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "results.csv", rows, COLUMNS, header=header, float_digits=4, extra="raise")
    (out_dir / "results.md").write_text(markdown_table(rows))
    plot_results(rows, out_dir / "results.png")


def plot_results(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Recall per task and held-out perplexity against the measured KV-bytes reduction, one
    line per (model, method), each starting at that model's uncompressed point; methods named
    ``kvpress:...`` (anchors run elsewhere, recall only) are dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))  # in the order the rows give them
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.4 * (len(tasks) + 1) + 3.2, 4.2))
    for ax in axes:  # one colour per line, the same line the same colour in every panel
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        lines.setdefault((r["model"], r["method"]), []).append(r)
    base = {(r["model"], r["task"]): r for r in rows if r["method"] == "none"}
    for (model, method), rs in sorted(lines.items()):
        if method == "none":
            continue
        for ax, task in zip(axes, tasks):
            pts = [base[(model, task)]] if (model, task) in base else []
            pts = sorted(
                pts + [r for r in rs if r["task"] == task], key=lambda r: r["kv_reduction"]
            )
            ax.errorbar(
                [p["kv_reduction"] for p in pts],
                [p["recall"] for p in pts],
                yerr=[p["recall_se"] for p in pts],
                marker="o",
                capsize=2,
                label=f"{model} / {method}",
                ls="--" if method.startswith("kvpress:") else "-",
            )
            ax.set_title(f"{task}: recall (± se)")
        # perplexity does not depend on the recall task: one task's rows of this line suffice
        first = rs[0]["task"]
        pts = [base[(model, first)]] if (model, first) in base else []
        pts = sorted(pts + [r for r in rs if r["task"] == first], key=lambda r: r["kv_reduction"])
        axes[-1].plot(
            [p["kv_reduction"] for p in pts],
            [p["ppl"] for p in pts],
            marker="o",
            label=f"{model} / {method}",
        )
        axes[-1].set_title("held-out text perplexity")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV bytes reduction (x, measured)")
        ax.grid(alpha=0.3)
    axes[-1].legend(
        *axes[0].get_legend_handles_labels(),
        fontsize=6,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
