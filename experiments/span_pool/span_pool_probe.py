"""Training-free: does span pooling of UniCache's importance scores keep recall on SmolLM2?

For each KV-bytes reduction and pooling window, calibrate the UniCache rate to the reduction
(int8, text-style preset, bytes measured), then decode key-value recall prompts (question
after the compressed context, held-out seeds). Appends rows to
``experiments/span_pool/results/span_pool_probe.csv``.

    python experiments/span_pool/span_pool_probe.py --num 32 --reductions 2 4 --pools 0 3 7 15
"""

from __future__ import annotations

import argparse
import csv
import platform
import sys
import time
from pathlib import Path

import torch

from unicache_train.checkpoint.gguf import fetch
from unicache_train.checkpoint.hf import import_hf
from unicache_train.compress import UniCacheCompressor
from unicache_train.data.reference_text import reference_documents
from unicache_train.data.tokenizer import load_tokenizer
from unicache_train.eval import RecallTask, recall_records, run_recall
from unicache_train.eval.budget import rate_for_reduction, text_unicache
from unicache_train.eval.text import text_blocks
from unicache_train.seam import IdentityCompressor

OUT = Path(__file__).parent / "results" / "span_pool_probe.csv"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num", type=int, default=32)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--reductions", type=float, nargs="+", default=[2.0, 4.0])
    p.add_argument("--pools", type=int, nargs="+", default=[0, 3, 7, 15])
    p.add_argument("--seed", type=int, default=1_000_003)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ckpt = fetch("smollm2")
    model, _ = import_hf(ckpt)
    tok = load_tokenizer(str(ckpt))
    recs = recall_records(RecallTask(pairs=a.pairs), a.num, a.seed)
    calib = text_blocks(tok, reference_documents("heldout"), 256, 2)
    split = torch.full((2,), 192)
    rows = []
    t0 = time.time()
    r = run_recall(model, tok, recs, IdentityCompressor(), batch_size=16)
    rows.append(("none", 1.0, 0.0, 0, r))
    print(f"none: {r.accuracy:.3f} ± {r.stderr:.3f}  ({time.time() - t0:.0f}s)", flush=True)
    for red in a.reductions:
        for pool in a.pools:

            def make(rate, pool=pool):
                return UniCacheCompressor(text_unicache(rate, pool))

            with torch.no_grad():
                rate, _ = rate_for_reduction(model, calib, split, make, red)
            r = run_recall(model, tok, recs, make(rate), batch_size=16)
            rows.append(("unicache", red, rate, pool, r))
            print(
                f"{red:g}x pool {pool}: rate {rate:.3f} measured {r.kv_reduction:.2f}x "
                f"recall {r.accuracy:.3f} ± {r.stderr:.3f}  ({time.time() - t0:.0f}s)",
                flush=True,
            )
    new = not OUT.exists()
    with OUT.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(
                [
                    "# command: python experiments/span_pool/span_pool_probe.py "
                    + " ".join(sys.argv[1:])
                ]
            )
            w.writerow(
                [
                    "method",
                    "target_reduction",
                    "rate",
                    "pool",
                    "kv_reduction",
                    "task",
                    "recall",
                    "recall_se",
                    "n",
                    "machine",
                ]
            )
        for method, red, rate, pool, r in rows:
            w.writerow(
                [
                    method,
                    red,
                    rate,
                    pool,
                    f"{r.kv_reduction:.3f}",
                    f"recall{a.pairs}",
                    f"{r.accuracy:.4f}",
                    f"{r.stderr:.4f}",
                    r.n,
                    f"{platform.processor() or platform.machine()} threads={a.threads}",
                ]
            )


if __name__ == "__main__":
    main()
