"""Serve a fine-tuned export with stock transformers ``generate()``, with and without the KV
compression it was tuned for (:class:`unicache_train.transformers_cache.CompressedCache`).

Two measurements, one CSV (``benchmarks/results/bench_serving.csv``):

1. ``recall``: the key-value recall prompts of the real-checkpoint study (held-out seed), the
   context prefilled and compressed, the question fed after it, the answer decoded greedily,
   all through stock transformers; and the same records through our own decoding loop
   (:func:`unicache_train.eval.recall.run_recall`) on the same weights. Reports accuracy with its
   standard error, the prompts' KV bytes, and how many predictions the two paths share.
2. ``speed``: one long prompt (a 32-pair recall context), ``--new-tokens`` generated greedily;
   prefill seconds and decode tokens/s, compressed vs uncompressed, ``--repeats`` interleaved.

Usage::

    python benchmarks/bench_serving.py --export runs/sm_compress_q4/compress/export --threads 2
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from pathlib import Path

import torch
from bench_common import RESULTS_DIR


def _recall_hf(model, tok, records, compressed: bool, export: Path):
    """Stock transformers: context prefilled (and compressed), question + answer generated."""
    from transformers import DynamicCache

    from unicache_train.transformers_cache import CACHE_ARGUMENT, CompressedCache

    preds, kv, base = [], 0, 0
    cfg = model.config
    from unicache_train.serve import prompt_kv_bytes

    per_token = prompt_kv_bytes(cfg, 1)  # uncompressed 16-bit K/V bytes of one token
    for r in records:
        ctx = torch.tensor([tok.encode(r["context"], add_bos=True)])
        q = torch.tensor([tok.encode(r["question"])])
        n_ans = len(tok.encode(" " + r["answer"])) + 1
        cache = CompressedCache.from_pretrained(export) if compressed else DynamicCache()
        with torch.no_grad():
            model(ctx, **{CACHE_ARGUMENT: cache})  # prefill: the context is compressed here
            full = torch.cat([ctx, q], 1)
            out = model.generate(full, attention_mask=torch.ones_like(full),
                                 **{CACHE_ARGUMENT: cache}, max_new_tokens=n_ans,
                                 do_sample=False, temperature=None, top_p=None, top_k=None,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
        text = tok.decode(out[0, full.shape[1]:].tolist()).lstrip(" ").split("\n")[0].strip()
        preds.append(text)
        base += per_token * ctx.shape[1]
        kv += cache.kv_bytes() if compressed else per_token * ctx.shape[1]
    return preds, kv, base


def _speed(model, tok, export: Path, prompt_ids, new_tokens: int, compressed: bool):
    from transformers import DynamicCache

    from unicache_train.transformers_cache import CACHE_ARGUMENT, CompressedCache

    cache = CompressedCache.from_pretrained(export) if compressed else DynamicCache()
    kw = dict(do_sample=False, temperature=None, top_p=None, top_k=None,
              pad_token_id=tok.pad_token_id)  # fmt: skip
    with torch.no_grad():
        t0 = time.perf_counter()
        model(prompt_ids, **{CACHE_ARGUMENT: cache})
        t1 = time.perf_counter()
        full = torch.cat([prompt_ids, prompt_ids[:, -1:]], 1)  # one token to start decoding
        out = model.generate(full, attention_mask=torch.ones_like(full), **{CACHE_ARGUMENT: cache},
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t2 = time.perf_counter()
    n = out.shape[1] - full.shape[1]
    return t1 - t0, n / (t2 - t1), cache


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--export", required=True, help="export directory with compression_config.json")
    p.add_argument("--n", type=int, default=32, help="recall records")
    p.add_argument("--seed", type=int, default=1000003, help="held-out record seed")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS_DIR / "bench_serving.csv"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tqdm.auto import tqdm

    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.checkpoint.policy import compressor_from_policy, read_policy
    from unicache_train.data.recall_task import RecallTask, recall_records
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval.recall import run_recall
    from unicache_train.serve import load_export

    export = Path(args.export)
    policy = read_policy(export)
    if policy is None:
        raise SystemExit(f"{export} has no compression_config.json: nothing to compare")
    tok = load_tokenizer(str(export))
    records = recall_records(RecallTask(pairs=args.pairs), args.n, args.seed)
    rows = []

    def se(acc: float, n: int) -> float:
        return math.sqrt(max(acc * (1 - acc), 0.0) / n)

    # 1. recall: stock transformers (compressed / not) and our decoding loop (compressed)
    ours_model, _ = import_hf(export)
    ours_model.eval()
    ours = run_recall(ours_model, tok, records, compressor_from_policy(policy), batch_size=8)
    del ours_model
    for compressed in (False, True):
        model, _ = load_export(export, compressed=compressed)
        t0 = time.perf_counter()
        preds, kv, base = _recall_hf(model, tok, tqdm(records, desc=f"recall c={compressed}"),
                                     compressed, export)  # fmt: skip
        secs = time.perf_counter() - t0
        acc = sum(p == r["answer"] for p, r in zip(preds, records)) / len(records)
        same = sum(a == b for a, b in zip(preds, ours.predictions)) if compressed else ""
        rows.append(dict(measure="recall", path="transformers", compressed=compressed,
                         method=policy["method"] if compressed else "none", n=len(records),
                         accuracy=round(acc, 4), stderr=round(se(acc, len(records)), 4),
                         kv_bytes=kv, baseline_bytes=base, reduction=round(base / kv, 3),
                         same_as_ours=same, seconds=round(secs, 1)))  # fmt: skip
    acc = ours.accuracy
    rows.append(dict(measure="recall", path="unicache_train", compressed=True,
                     method=policy["method"], n=ours.n, accuracy=round(acc, 4),
                     stderr=round(se(acc, ours.n), 4), kv_bytes=ours.kv_bytes,
                     baseline_bytes=ours.baseline_bytes,
                     reduction=round(ours.baseline_bytes / ours.kv_bytes, 3)))  # fmt: skip

    # 2. speed: a long prompt, decode tokens/s, interleaved repeats
    long_ctx = recall_records(RecallTask(pairs=32), 1, args.seed + 1)[0]["context"]
    ids = torch.tensor([tok.encode(long_ctx, add_bos=True)])
    models = {c: load_export(export, compressed=c)[0] for c in (False, True)}
    timings: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    caches = {}
    for _ in tqdm(range(args.repeats), desc="speed"):
        for c in (False, True):
            pre, tps, caches[c] = _speed(models[c], tok, export, ids, args.new_tokens, c)
            timings[c].append((pre, tps))
    base_tps = statistics.median(t[1] for t in timings[False])
    cfg = models[False].config
    from unicache_train.serve import prompt_kv_bytes

    per_token = prompt_kv_bytes(cfg, 1)  # uncompressed 16-bit K/V bytes of one token
    for c in (False, True):
        pre = statistics.median(t[0] for t in timings[c])
        tps = statistics.median(t[1] for t in timings[c])
        kv = caches[c].kv_bytes() if c else per_token * ids.shape[1]
        rows.append(dict(measure="speed", path="transformers", compressed=c,
                         method=policy["method"] if c else "none", n=args.repeats,
                         kv_bytes=kv, baseline_bytes=per_token * ids.shape[1],
                         reduction=round(per_token * ids.shape[1] / kv, 3),
                         prompt_tokens=ids.shape[1], new_tokens=args.new_tokens,
                         prefill_s=round(pre, 3), decode_tokens_per_s=round(tps, 2),
                         decode_speed_ratio=round(tps / base_tps, 3),
                         threads=args.threads))  # fmt: skip

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[-1]).index(k)
                    if k in rows[-1] else 100 + sorted({k for r in rows for k in r}).index(k))
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(r)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
