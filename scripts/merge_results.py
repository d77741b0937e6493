"""Merge ``results.csv`` files of compression studies into one table, CSV and plot.

    python scripts/merge_results.py runs/sm_base/results.csv runs/sm_control/results.csv \\
        runs/sm_compress/results.csv --out experiments/smollm2_compress/results

Each input keeps its own ``# command:`` lines, copied into the merged CSV's header. A row whose
(model, method, target_reduction, task) an earlier input already gave is dropped (an uncompressed
row every study repeats, say), and the drop is printed.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from unicache_train.eval.report import read_results, write_results


def read_kvpress(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def kvpress_row(r: dict[str, str]) -> dict:
    """A kvpress_baseline row as a study row (no perplexity: NaN)."""
    nan = float("nan")
    return {
        "model": r["model"],
        "method": f"kvpress:{r['press'].removesuffix('Press')}",
        "target_reduction": float(r["kv_reduction"]),
        "rate": float(r["compression_ratio"]),
        "kv_reduction": float(r["kv_reduction"]),
        "task": r["task"],
        "recall": float(r["recall"]),
        "recall_se": float(r["recall_se"]),
        "n": float(r["n"]),
        "ppl": nan,
        "ppl_se": nan,
        "ppl_delta": nan,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kvpress", type=Path, nargs="*", default=[], help="kvpress_baseline CSVs")
    p.add_argument(
        "--kvpress-models",
        nargs="*",
        default=None,
        help="keep only kvpress rows of these models (an older CSV may hold other fine-tunes)",
    )
    a = p.parse_args()
    rows, header = [], [f"command: python scripts/merge_results.py {' '.join(sys.argv[1:])}"]
    seen: set[tuple] = set()
    for path in a.inputs:
        for row in read_results(path):
            key = (row["model"], row["method"], str(row["target_reduction"]), row["task"])
            if key in seen:
                print(f"{path}: dropped a second {key} row")
                continue
            seen.add(key)
            rows.append(row)
        header += [
            f"{path}: {line[2:].strip()}"
            for line in path.read_text().splitlines()
            if line.startswith("# ")
        ]
    for path in a.kvpress:
        header += [
            f"{path}: {line[2:].strip()}"
            for line in path.read_text().splitlines()
            if line.startswith("# ")
        ]
        rows += [
            kvpress_row(r)
            for r in read_kvpress(path)
            if a.kvpress_models is None or r["model"] in a.kvpress_models
        ]
    write_results(rows, a.out, header)
    print((a.out / "results.md").read_text())


if __name__ == "__main__":
    main()
