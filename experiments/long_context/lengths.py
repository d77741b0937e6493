"""Step 1 of the long-context study: the base's uncompressed accuracy per task family at several
context lengths, to pick the lengths where it is well above chance (issue 36).

    python experiments/long_context/lengths.py --lengths 512 1024 2048 --n 40

Writes one per-prompt JSONL per (family, length) to experiments/long_context/raw/lengths/ and
the table experiments/long_context/lengths.csv (accuracy, its standard error, Wilson 95%
interval, mean context tokens, seconds); rows of other (family, length) cells already in the
table are kept, so a new length adds to it. Evaluation seeds only (>= 1,000,000): the records are
long_context_records(task, n, seed=1_000_011 + length, split="eval") on the King James haystack.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import time
from pathlib import Path

import torch

from unicache_train.checkpoint.gguf import fetch
from unicache_train.checkpoint.hf import import_hf
from unicache_train.data.long_context import FAMILIES, LongContextTask, long_context_records
from unicache_train.data.tokenizer import load_tokenizer
from unicache_train.eval.long_context import run_long_context
from unicache_train.eval.recall import write_predictions
from unicache_train.eval.stats import binomial_stderr, wilson_interval
from unicache_train.seam import IdentityCompressor

HERE = Path(__file__).parent


@contextlib.contextmanager
def _atomic(path: Path):
    """Write ``path`` through a temporary file renamed over it (never half-written)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        yield f
    tmp.replace(path)


def _read_rows(path: Path) -> list[dict]:
    """The table's rows so far (none if it does not exist yet)."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "lengths.csv")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = fetch("smollm2")
    tok = load_tokenizer(str(ckpt))
    model, _ = import_hf(ckpt)
    model.eval()
    rows = _read_rows(args.out)
    for length in args.lengths:
        for family in args.families:
            task = LongContextTask(family=family, tokens=length)
            recs = long_context_records(task, args.n, 1_000_011 + length, tok, split="eval")
            t0 = time.time()
            res, _ = run_long_context(
                model, tok, recs, {"none": IdentityCompressor()}, batch_size=args.batch_size
            )
            r = res["none"]
            write_predictions(
                r.rows,
                HERE / "raw" / "lengths" / f"{task.name}.jsonl",
                model="base",
                setting="none",
            )
            lo, hi = wilson_interval(r.hits, r.n)
            row = {
                "family": family,
                "length": length,
                "n": r.n,
                "hits": r.hits,
                "accuracy": round(r.accuracy, 4),
                "stderr": round(binomial_stderr(r.hits, r.n), 4),
                "wilson_lo": round(lo, 4),
                "wilson_hi": round(hi, 4),
                "mean_tokens": round(sum(x["tokens"] for x in r.rows) / r.n, 1),
                "seconds": round(time.time() - t0, 1),
            }
            rows = [x for x in rows if (x["family"], int(x["length"])) != (family, length)]
            rows.append(row)
            rows.sort(key=lambda x: (int(x["length"]), FAMILIES.index(x["family"])))
            print(json.dumps(row), flush=True)
            with _atomic(args.out) as f:
                w = csv.DictWriter(f, fieldnames=list(row))
                w.writeheader()
                w.writerows(rows)


if __name__ == "__main__":
    main()
