"""Anchors nobody here wrote: NVIDIA kvpress presses on the same model and recall prompts.

Two halves, two environments (kvpress pins transformers < 5.3; the project needs >= 5.8):

1. in the project's venv, write the held-out prompts (the same records, seeds and tokens as
   ``unicache_train.eval.recall``)::

       python scripts/kvpress_baseline.py prompts --out runs/kvpress/prompts.jsonl --num 32

2. in ``.venv-kvpress`` (``scripts/kvpress_env.sh``), run the presses on a model directory
   (the fetched SmolLM2, or one of our HF exports)::

       .venv-kvpress/bin/python scripts/kvpress_baseline.py run \\
           --prompts runs/kvpress/prompts.jsonl --model DIR --name base --reduction 4 \\
           --out experiments/smollm2_compress/results/kvpress.csv

Each prompt: the context (``[bos] + "key: value" lines``) is prefilled with the press active
(kvpress compresses during the prefill forward), then the question is decoded on the compressed
cache and the answer greedily, exactly like our evaluation: the press never sees the question.
A press at ``compression_ratio = 1 - 1/R`` keeps ``1/R`` of the context tokens at the cache's
dtype, so in a 16-bit deployment it stores ``R`` times fewer KV bytes (our rows count int8
scales and metadata as well, so they are at or slightly above their nominal reduction).
Presses: SnapKV, StreamingLLM, Knorm, ExpectedAttention, TOVA, KeyDiff (their default settings).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path


def write_prompts(args) -> None:
    from unicache_train.eval import RecallTask, recall_records

    recs = recall_records(RecallTask(pairs=args.pairs), args.num, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for r in recs:
            f.write(json.dumps({**r, "task": f"recall{args.pairs}", "seed": args.seed}) + "\n")
    print(f"wrote {len(recs)} prompts to {args.out}")


PRESSES = ("SnapKVPress", "StreamingLLMPress", "KnormPress", "ExpectedAttentionPress",
           "TOVAPress", "KeyDiffPress")  # fmt: skip


def run_presses(args) -> None:
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    recs = [json.loads(line) for line in args.prompts.read_text().splitlines()]
    ratio = 1.0 - 1.0 / args.reduction
    new = not args.out.exists()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow([f"# command: {' '.join(sys.argv)}"])
            w.writerow(["model", "press", "compression_ratio", "kv_reduction", "task", "recall",
                        "recall_se", "n", "transformers", "kvpress"])  # fmt: skip
        for name in args.presses:
            press = getattr(kvpress, name)(compression_ratio=ratio)
            hits, t0 = 0, time.time()
            for r in recs:
                ctx = [tok.bos_token_id] + tok.encode(r["context"], add_special_tokens=False)
                q = tok.encode(r["question"], add_special_tokens=False)
                n_ans = len(tok.encode(" " + r["answer"], add_special_tokens=False)) + 1
                with torch.no_grad():
                    cache = DynamicCache()
                    with press(model):
                        model(input_ids=torch.tensor([ctx]), past_key_values=cache)
                    pos = len(ctx)
                    out = model(input_ids=torch.tensor([q]), past_key_values=cache,
                                position_ids=torch.arange(pos, pos + len(q))[None])  # fmt: skip
                    ids = [int(out.logits[0, -1].argmax())]
                    for i in range(n_ans - 1):
                        out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache,
                                    position_ids=torch.tensor([[pos + len(q) + i]]))  # fmt: skip
                        ids.append(int(out.logits[0, -1].argmax()))
                pred = tok.decode(ids, skip_special_tokens=True).lstrip(" ").split("\n")[0].strip()
                hits += int(pred == r["answer"])
            n = len(recs)
            acc = hits / n
            se = math.sqrt(acc * (1 - acc) / n)
            print(f"{args.name} {name} ratio {ratio:.3f}: {acc:.3f} ± {se:.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)  # fmt: skip
            w.writerow([args.name, name, f"{ratio:.4f}", f"{args.reduction:g}", recs[0]["task"],
                        f"{acc:.4f}", f"{se:.4f}", n, _version("transformers"),
                        _version("kvpress")])  # fmt: skip
            f.flush()


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prompts", help="write the held-out recall prompts (project venv)")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--num", type=int, default=32)
    a.add_argument("--pairs", type=int, default=8)
    a.add_argument("--seed", type=int, default=1_000_003)
    b = sub.add_parser("run", help="run the presses (kvpress venv)")
    b.add_argument("--prompts", type=Path, required=True)
    b.add_argument("--model", required=True)
    b.add_argument("--name", required=True, help="row label, e.g. base")
    b.add_argument("--tokenizer", default=None, help="tokenizer dir (default: --model)")
    b.add_argument("--reduction", type=float, default=4.0, help="KV-bytes reduction R > 1")
    b.add_argument("--presses", nargs="+", default=list(PRESSES), choices=PRESSES)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if args.cmd == "prompts":
        write_prompts(args)
    else:
        if not args.reduction > 1:
            p.error(f"--reduction={args.reduction} is out of range; allowed (1, inf)")
        run_presses(args)


if __name__ == "__main__":
    main()
