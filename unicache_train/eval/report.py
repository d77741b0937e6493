"""Tables, CSVs and plots of compression studies: one row per (model, setting, task).

A row has the columns of :data:`COLUMNS`: the model, the compression method, the KV-bytes
reduction asked for and the one measured on the decoding cache (``uncompressed 16-bit bytes /
stored bytes``), the removal rate, the task, recall with its standard error, perplexity with its
standard error and its change against the same model uncompressed.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "write_results", "read_results", "markdown_table", "plot_results"]

COLUMNS = (
    "model", "method", "target_reduction", "rate", "kv_reduction", "task", "recall",
    "recall_se", "n", "ppl", "ppl_se", "ppl_delta",
)  # fmt: skip
_TEXT = ("model", "method", "task")


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``results.csv`` written by :func:`write_results` (numbers parsed)."""
    rows = []
    with Path(path).open(newline="") as f:
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            rows.append({k: (v if k in _TEXT else float(v)) for k, v in r.items()})
    return rows


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | method | KV bytes reduction (measured) | task | recall ± se | ppl (Δ) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['method']} | {r['kv_reduction']:.2f}x | {r['task']} | "
            f"{r['recall']:.2f} ± {r['recall_se']:.2f} (n={int(r['n'])}) | {r['ppl']:.2f} "
            f"({100 * r['ppl_delta']:+.1f}%) |"
        )
    return "\n".join(lines) + "\n"


def write_results(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, header: Sequence[str] = ()
) -> None:
    """``results.csv`` (``header`` lines first, as ``# ...`` comments), ``results.md`` and
    ``results.png`` in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "results.csv").open("w", newline="") as f:
        for line in header:
            f.write(f"# {line}\n")
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})
    (out_dir / "results.md").write_text(markdown_table(rows))
    plot_results(rows, out_dir / "results.png")


def plot_results(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Recall per task and held-out perplexity against the measured KV-bytes reduction, one
    line per (model, method), each starting at that model's uncompressed point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.4 * (len(tasks) + 1), 3.8))
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
                [p["kv_reduction"] for p in pts], [p["recall"] for p in pts],
                yerr=[p["recall_se"] for p in pts], marker="o", capsize=2,
                label=f"{model} / {method}",
            )  # fmt: skip
            ax.set_title(f"{task}: recall (± se)")
        pts = [base[(model, tasks[0])]] if (model, tasks[0]) in base else []
        pts = sorted(
            pts + [r for r in rs if r["task"] == tasks[0]], key=lambda r: r["kv_reduction"]
        )
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
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
