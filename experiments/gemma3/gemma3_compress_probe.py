"""Training-free KV compression on the real Gemma 3 270M: what the sliding-window layers leave
to compress.

Gemma 3 270M has 18 layers, 15 of them local (window 512). A windowed layer's cache is bounded by
its window, so the seam does not compress it and counts its window's bytes as stored and as the
baseline (docs/architecture.md, "Sliding-window layers"). This probe measures, on the key-value
recall task (held-out seeds; the question decoded after the compressed context), the recall and
the KV-bytes reduction of UniCache on the 3 global layers, per global layer and for the whole
cache.

    python experiments/gemma3/gemma3_compress_probe.py [--n 16] [--out DIR/compress_probe.csv]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16, help="recall records per setting")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--out", default="experiments/gemma3/results/compress_probe.csv")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--settings",
        default="none,int8@0.5,int4@0.5",
        help="comma-separated: none, or QUANT@RATE with QUANT in none/int8/int4 "
        "(UniCache text preset at removal RATE)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from unicache_train.checkpoint.gguf import fetched_dir
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.compress import UniCacheCompressor
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval import RecallTask, recall_records, run_recall
    from unicache_train.eval.budget import text_unicache
    from unicache_train.model.generate import prefill_compressed
    from unicache_train.seam import IdentityCompressor

    ckpt = fetched_dir("gemma3")
    model, config = import_hf(ckpt)
    tok = load_tokenizer(str(ckpt))
    records = recall_records(RecallTask(pairs=args.pairs), args.n, 1_000_003)
    settings = {}
    for spec in args.settings.split(","):
        if spec == "none":
            settings["none"] = IdentityCompressor
            continue
        quant, _, rate = spec.partition("@")
        settings[f"unicache {quant} rate {float(rate)}"] = lambda q=quant, r=float(rate): (
            UniCacheCompressor(text_unicache(r, 0, q))
        )
    full = [i for i in range(config.num_hidden_layers) if not config.is_sliding_layer(i)]
    rows = []
    for name, build in settings.items():
        t0 = time.time()
        r = run_recall(model, tok, records, build(), batch_size=8)
        # per-layer bytes of one batch's cache: global layers vs the windowed ones
        ctx = [tok.encode(rec["context"], add_bos=True) for rec in records[:8]]
        P = max(len(c) for c in ctx)
        ids = torch.full((len(ctx), P), tok.pad_token_id, dtype=torch.long)
        for b, c in enumerate(ctx):
            ids[b, : len(c)] = torch.tensor(c)
        split = torch.tensor([len(c) for c in ctx])
        cache, _ = prefill_compressed(model, ids, split, build())
        hd = config.head_size
        g_stored = sum(cache.segments[i].payload_bytes() for i in full)
        g_base = sum(cache.segments[i].baseline_bytes(hd, hd) for i in full)
        rows.append(
            {
                "model": "gemma-3-270m (Q4_K_M, dequantized)",
                "setting": name,
                "recall": r.accuracy,
                "recall_se": r.stderr,
                "n": r.n,
                "kv_reduction_whole_cache": r.kv_reduction,
                "kv_reduction_global_layers": g_base / max(g_stored, 1),
                "context_tokens_mean": float(split.float().mean()),
                "seconds": round(time.time() - t0, 1),
            }
        )
        print(rows[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        f.write(
            "# command: "
            + " ".join(
                ["python experiments/gemma3/gemma3_compress_probe.py", *(argv or sys.argv[1:])]
            )
            + "\n"
        )
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
