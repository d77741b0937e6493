"""Merge ``results.csv`` files of compression studies into one table, CSV and plot.

    python scripts/merge_results.py runs/sm_base/results.csv runs/sm_control/results.csv \\
        runs/sm_compress/results.csv --out scripts/results/smollm2

Each input keeps its own ``# command:`` lines, copied into the merged CSV's header. A row whose
(model, method, target_reduction, task) an earlier input already gave is dropped (an uncompressed
row every study repeats, say), and the drop is printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from unicache_train.eval.report import read_results, write_results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
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
        header += [f"{path}: {line[2:].strip()}" for line in path.read_text().splitlines()
                   if line.startswith("# ")]  # fmt: skip
    write_results(rows, a.out, header)
    print((a.out / "results.md").read_text())


if __name__ == "__main__":
    main()
