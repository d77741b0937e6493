"""Experiment: pretraining steps until the tiny byte-level decoder solves key-value recall.

The compression targets (docs/architecture.md#targets) compare recall accuracy with and without a
compressed cache, which only means something once the uncompressed model recalls at all. This script
trains the tiny recipe model (``recipes/pretrain_tiny.yaml`` sizes) on recall records only, with
every question supervised, and prints the teacher-forced exact-match accuracy of the answers on 64
held-out records every ``--eval-every`` steps.

Variants:
  --format natural   ``Q: what is KEY? A: VALUE`` (the bundled corpus' format)
  --format cue       ``Q: what is KEY?\\nKEY: VALUE``: the answer follows the same ``\\nKEY: `` as
                     its fact line, so a plain induction head (copy what followed the last match)
                     solves it
  --key-length N     keys of N upper-case letters (the corpus uses 4 lower-case letters)

Usage:
  OMP_NUM_THREADS=1 python experiments/recall_learnability/recall_learnability.py --format cue --key-length 1 --steps 1000
Appends one row per evaluation to ``experiments/recall_learnability/results/recall_learnability.csv``. Never imported by
the library.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import random
import string
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from unicache_train.data import synthetic
from unicache_train.data.tokenizer import ByteTokenizer
from unicache_train.model.config import ModelConfig
from unicache_train.model.decoder import Decoder

#: Key letters; "Q" is left out: it starts the question lines.
LETTERS = string.ascii_uppercase.replace("Q", "")

RESULTS = Path(__file__).resolve().parent / "results" / "recall_learnability.csv"


def records(n: int, seed: int, args) -> list[dict]:
    """Recall records in the chosen format (keys re-drawn with the chosen length)."""
    out = []
    for i, r in enumerate(synthetic.recall_examples(n, seed, args.facts, args.questions, 0)):
        rng = random.Random(f"{seed}-{i}")
        keys: dict[str, str] = {}
        for k in _fact_keys(r):  # unique new keys, one per fact, in order
            new = k
            while new == k or new in keys.values():
                new = "".join(rng.choices(LETTERS, k=args.key_length))
            keys[k] = new
        ctx = r["text"][: r["question_char"]]
        for old, new in keys.items():
            ctx = ctx.replace(f"{old}: ", f"{new}: ")
        if args.format == "cue":
            qa = [
                (f"Q: what is {keys[k]}?\n{keys[k]}: ", v)
                for k, v in zip(r["questions"], r["answers"])
            ]
        else:
            qa = [(f"Q: what is {keys[k]}? A: ", v) for k, v in zip(r["questions"], r["answers"])]
        text = ctx + "\n".join(q + a for q, a in qa)
        out.append({"text": text, "prompt": ctx + qa[0][0], "answer": qa[0][1]})
    return out


def _fact_keys(r: dict) -> list[str]:
    lines = r["text"][: r["question_char"]].splitlines()
    return [ln.split(": ", 1)[0] for ln in lines if ": " in ln]


def batch(recs: list[dict], tok: ByteTokenizer, T: int):
    """ids/labels [B, T] and the (first, last+1) label positions of each first answer."""
    ids = torch.full((len(recs), T), tok.pad_token_id)
    labels = torch.full((len(recs), T), -100)
    spans = []
    for i, r in enumerate(recs):
        t = tok.encode(r["text"], add_bos=True)[:T]
        ids[i, : len(t)] = torch.tensor(t)
        labels[i, : len(t) - 1] = torch.tensor(t[1:])
        p, a = len(tok.encode(r["prompt"], add_bos=True)), len(tok.encode(r["answer"]))
        spans.append((p - 1, p - 1 + a))
    return ids, labels, spans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=("natural", "cue"), default="natural")
    p.add_argument("--key-length", type=int, default=4)
    p.add_argument("--facts", type=int, default=8)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = ByteTokenizer()
    model = Decoder(
        ModelConfig(
            vocab_size=260,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    held_out = batch(records(64, 7, args), tok, args.seq_len)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    new_file = not RESULTS.exists()
    t0 = time.perf_counter()
    with open(RESULTS, "a", newline="") as f:
        w = csv.writer(f)
        if new_file:
            w.writerow(
                [
                    "date",
                    "format",
                    "key_length",
                    "facts",
                    "questions",
                    "lr",
                    "step",
                    "train_loss",
                    "answer_exact_match",
                    "seconds",
                ]
            )
        for step in range(args.steps):
            ids, labels, _ = batch(records(args.batch_size, 1000 + step, args), tok, args.seq_len)
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, (step + 1) / 30)
            loss = F.cross_entropy(
                model(ids).logits.flatten(0, 1), labels.flatten(), ignore_index=-100
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if (step + 1) % args.eval_every == 0:
                with torch.no_grad():
                    ids, labels, spans = held_out
                    pred = model(ids).logits.argmax(-1)
                    ok = sum(
                        bool((pred[i, a:b] == labels[i, a:b]).all())
                        for i, (a, b) in enumerate(spans)
                    )
                acc = ok / len(spans)
                secs = time.perf_counter() - t0
                print(
                    f"step {step + 1:5d}  loss {loss.item():.3f}  answer exact match {acc:.2f}"
                    f"  {secs:.0f}s",
                    flush=True,
                )
                w.writerow(
                    [
                        dt.datetime.now().isoformat(timespec="seconds"),
                        args.format,
                        args.key_length,
                        args.facts,
                        args.questions,
                        args.lr,
                        step + 1,
                        f"{loss.item():.4f}",
                        f"{acc:.3f}",
                        f"{secs:.0f}",
                    ]
                )
                f.flush()


if __name__ == "__main__":
    main()
