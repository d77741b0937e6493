"""recall8_tests.csv: the old 8-pair recall on the long-context fine-tunes (recall8.yaml, the
evidence harness) against the base's cells of the evidence study and against each other, exact
McNemar on the same 200 prompts; prints each cell's hits with its Wilson 95% interval.

    python experiments/long_context/recall8_table.py
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path

from unicache_train.eval.stats import mcnemar_exact, wilson_interval

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SETTINGS = ("none", "unicache_int4_4x", "unicache_int4_8x")
MODELS = {
    "base": ROOT / "experiments/smollm2_evidence/raw/base",
    "lc_compress_seed1": HERE / "raw/recall8/lc_compress_seed1",
    "lc_control_seed0": HERE / "raw/recall8/lc_control_seed0",
}
PAIRS = (
    ("lc_compress_seed1", "base"),
    ("lc_control_seed0", "base"),
    ("lc_compress_seed1", "lc_control_seed0"),
)


def correct(folder: Path, setting: str) -> dict[str, bool]:
    path = folder / f"recall8__{setting}.jsonl"
    return {r["id"]: bool(r["correct"]) for r in map(json.loads, path.read_text().splitlines())}


def main() -> None:
    rows = []
    for s in SETTINGS:
        cells = {m: correct(d, s) for m, d in MODELS.items()}
        ids = sorted(cells["base"])
        for m, c in cells.items():
            if sorted(c) != ids:
                raise SystemExit(f"{m} {s}: not the base's {len(ids)} prompts")
            lo, hi = wilson_interval(sum(c.values()), len(c))
            print(f"{s:<17} {m:<18} {sum(c.values())}/{len(c)} [{lo:.2f}, {hi:.2f}]")
        for a, b in PAIRS:
            t = mcnemar_exact([cells[a][i] for i in ids], [cells[b][i] for i in ids])
            rows.append(
                {
                    "setting": s,
                    "a": a,
                    "b": b,
                    "n": t.n,
                    "hits_a": t.a_hits,
                    "hits_b": t.b_hits,
                    "only_a": t.only_a,
                    "only_b": t.only_b,
                    "p_mcnemar": round(t.p_value, 6),
                }
            )
    out = HERE / "recall8_tests.csv"
    fd, tmp = tempfile.mkstemp(dir=HERE, suffix=".tmp")
    with os.fdopen(fd, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
