"""The long-context evaluation engine against the per-setting path, same run, same prompts.

    python benchmarks/bench_long_context.py --contexts 200 --tokens 1024 --settings 10

* **engine**: :func:`unicache_train.eval.long_context.run_long_context` (one uncompressed
  prefill per context serves every setting; batched decoding);
* **per setting**: what the studies did before, one compressed prefill per context *and*
  setting (:func:`unicache_train.eval.recall.run_recall`, batched the same way).

Both decode the same number of answer tokens per prompt. Settings: the identity plus int4
sinks + recent / SnapKV / UniCache at removal rates spread over [0.3, 0.9]. The two paths must
decode the same greedy tokens (``agree``: prompts whose per-setting prediction starts the
engine's). Appends one row to
``benchmarks/results/bench_long_context.csv`` with the seconds of each path, their ratio, the
machine and its 1-minute load. The real checkpoint (SmolLM2-135M) when it is fetched, else
``--model tiny``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent


def settings(n: int) -> dict:
    from unicache_train.compress import UniCacheCompressor, presets
    from unicache_train.eval.budget import unicache_at_rate
    from unicache_train.seam import IdentityCompressor

    out = {"none": IdentityCompressor()}
    methods = ["sinks_recent", "snapkv", "text_style_baseline"]
    rates = [0.3 + 0.6 * i / max(1, (n - 2) // 3) for i in range((n + 1) // 3)]
    i = 0
    while len(out) < n:
        m = methods[i % 3]
        rate = rates[(i // 3) % len(rates)]
        out[f"{m}@{rate:.2f}"] = UniCacheCompressor(
            unicache_at_rate(getattr(presets, m)(), rate, "int4")
        )
        i += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--settings", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2", help="smollm2 (fetched) or tiny")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from unicache_train.data.long_context import LongContextTask, long_context_records
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval.long_context import run_long_context
    from unicache_train.eval.recall import run_recall

    if args.model == "tiny":
        from unicache_train.model import Decoder
        from unicache_train.model.config import ModelConfig

        tok = load_tokenizer("byte")
        torch.manual_seed(0)
        model = Decoder(
            ModelConfig(
                vocab_size=tok.vocab_size,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        ).eval()
        split = "train"
        seed = 7
    else:
        from unicache_train.checkpoint.gguf import fetch
        from unicache_train.checkpoint.hf import import_hf

        ckpt = fetch(args.model)
        model, _ = import_hf(ckpt)
        model.eval()
        tok = load_tokenizer(str(ckpt))
        split, seed = "eval", 1_000_201
    recs = long_context_records(
        LongContextTask(family="niah_single", tokens=args.tokens), args.contexts, seed, tok, split
    )
    sets = settings(args.settings)
    t0 = time.perf_counter()
    res, timing = run_long_context(model, tok, recs, sets, batch_size=args.batch_size)
    engine_s = time.perf_counter() - t0
    # The per-setting path decodes the same answer tokens (run_recall: the answer's tokens + 1;
    # the engine adds ANSWER_MARGIN, so it does slightly more decoding work, not less).
    old = [
        {
            "context": r["context"],
            "question": r["question"],
            "answer": r["answers"][0],
            "id": r["id"],
            "task": r["task"],
        }
        for r in recs
    ]
    t1 = time.perf_counter()
    agree = 0
    for name, comp in sets.items():
        out = run_recall(model, tok, old, comp, batch_size=args.batch_size)
        # The same greedy tokens: the per-setting path's first line (its n_ans tokens) is the
        # start of the engine's (which decodes a few more).
        mine = [row["prediction"].lstrip(" ").split("\n")[0].strip() for row in res[name].rows]
        agree += sum(a.startswith(b) for a, b in zip(mine, out.predictions))
    per_setting_s = time.perf_counter() - t1
    row = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "model": args.model,
        "contexts": args.contexts,
        "tokens": args.tokens,
        "settings": len(sets),
        "engine_s": round(engine_s, 1),
        "engine_prefill_s": round(timing["prefill_s"], 1),
        "per_setting_s": round(per_setting_s, 1),
        "speedup": round(per_setting_s / engine_s, 2),
        "agree": f"{agree}/{len(sets) * len(recs)}",
        "load_1min": round(os.getloadavg()[0], 2),
    }
    print(row)
    path = HERE / "results" / "bench_long_context.csv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        if new:
            w.writeheader()
        w.writerow(row)


if __name__ == "__main__":
    main()
