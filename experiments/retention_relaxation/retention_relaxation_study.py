"""Which relaxation trains the learned retention policy better: Gumbel-sigmoid or straight-through
top-k? Measured on a tiny model, on a task where what to keep depends on content, not position.

Task (needle copy): a context of 32 filler tokens (ids 4..39) holds one needle (an id in
40..63) at a random position in [6, 22) (never a sink, never in the recent window); the
continuation is a marker token, and the target is the needle. A 2-layer model learns this
uncompressed (a content match); at rate 0.75 (8 of 32 context tokens kept, 16-bit) the sinks +
recent window selection (StreamingLLM) evicts the needle every time, so the compressed accuracy
of any fine-tune with it in the loop stays near chance (1/24), and only a selection that reads
content can do better.

Arms (same pretrained weights, same data, same steps and seeds; the in-loop objective
``inloop.inloop_loss``; the policy starts at the sinks + recent ranking, so step 0 of every
learned arm *is* the fixed selection):

* ``sinks_recent``: the fixed selection in the loop (the control);
* ``gumbel_sigmoid``: the learned policy, every token soft-weighted in training (DMS);
* ``st_topk``: the learned policy, the hard selection with a straight-through gate.

Reported per arm and seed: needle accuracy and target NLL with the hard selection of inference
(policy in eval mode) on 512 held-out prompts, the kept fraction, the seconds per step. The
pretrained model's uncompressed accuracy is the ceiling.

    OMP_NUM_THREADS=1 python experiments/retention_relaxation/retention_relaxation_study.py \
        [--pretrain-steps 600] [--steps 200] [--seeds 0 1]

Writes ``experiments/retention_relaxation/results/retention_relaxation.csv``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import platform
import time
from pathlib import Path

import torch

from unicache_train.inloop import build_compressor, inloop_loss
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.train.config import CompressionTrainConfig

OUT = Path(__file__).parent / "results" / "retention_relaxation.csv"
VOCAB, FILLER, MARK, CTX = 64, 40, 1, 32
RATE = 0.75


def make_batch(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``n`` needle-copy prompts: [context of 32 filler tokens, one needle at 6..21] [MARK]
    [the needle]. Filler tokens come from [4, FILLER), needles from [FILLER, VOCAB): finding
    the needle is a content match (no induction head needed), and so is keeping it."""
    ids = torch.randint(4, FILLER, (n, CTX + 2), generator=gen)
    pos = torch.randint(6, 22, (n,), generator=gen)
    value = torch.randint(FILLER, VOCAB, (n,), generator=gen)
    ids[torch.arange(n), pos] = value
    ids[:, CTX], ids[:, CTX + 1] = MARK, value
    labels = torch.full_like(ids, -100)
    labels[:, CTX] = value  # predicted at the marker of the continuation
    return {"input_ids": ids, "labels": labels, "split": torch.full((n,), CTX)}


def forward(model: Decoder):
    return lambda b, **kw: model(b["input_ids"], **kw)


def compress_config(selection: str, relaxation: str = "gumbel_sigmoid") -> CompressionTrainConfig:
    sel = {"relaxation": relaxation, "budget_weight": 1.0}
    return CompressionTrainConfig(
        enabled=True,
        preset=selection,
        unicache={"target_rate": RATE, "quantize": {"bits": None}, "selection": sel},
    )


@torch.no_grad()
def evaluate(model: Decoder, compressor, data: dict[str, torch.Tensor]) -> dict[str, float]:
    model.eval()
    out = model(data["input_ids"], split=data["split"], compressor=compressor)
    model.train()
    logits = out.logits[:, CTX].float()
    target = data["labels"][:, CTX]
    nll = torch.nn.functional.cross_entropy(logits, target)
    removed = [float(s.get("rate_realized", 0.0)) for s in out.compression_stats]
    kept = 1.0 - sum(removed) / max(len(removed), 1)
    acc = float((logits.argmax(-1) == target).float().mean())
    return {"accuracy": acc, "nll": float(nll), "kept": kept}


def pretrain(steps: int, seed: int) -> Decoder:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = Decoder(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed + 1000)
    for _ in range(steps):
        b = make_batch(32, gen)
        logits = model(b["input_ids"]).logits[:, CTX].float()
        loss = torch.nn.functional.cross_entropy(logits, b["labels"][:, CTX])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def finetune(
    base: Decoder, cc: CompressionTrainConfig, steps: int, seed: int, policy_lr: float
) -> tuple:
    model = copy.deepcopy(base)
    comp = build_compressor(cc, model)  # attaches model.kv_retention for the learned arms
    policy = list(getattr(model, "kv_retention", torch.nn.Module()).parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("kv_retention.")]
    groups = [{"params": rest, "lr": 1e-3}] + (
        [{"params": policy, "lr": policy_lr}] if policy else []
    )
    opt = torch.optim.AdamW(groups)
    gen = torch.Generator().manual_seed(seed)
    split_gen = torch.Generator().manual_seed(seed + 7)
    t0 = time.perf_counter()
    for _ in range(steps):
        res = inloop_loss(forward(model), make_batch(32, gen), comp, generator=split_gen)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    return model, comp, (time.perf_counter() - t0) / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pretrain-steps", type=int, default=600)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--policy-lr", type=float, default=1e-3, help="the policy's AdamW lr")
    ap.add_argument("--arms", nargs="+", default=["sinks_recent", "gumbel_sigmoid", "st_topk"])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    test = make_batch(512, torch.Generator().manual_seed(12345))
    base = pretrain(args.pretrain_steps, 0)
    ceiling = evaluate(base, build_compressor(CompressionTrainConfig(method="none")), test)
    rows = [{"arm": "uncompressed", "seed": "", "steps": 0, **ceiling, "s_per_step": ""}]
    fixed0 = evaluate(base, build_compressor(compress_config("sinks_recent")), test)
    rows.append(
        {"arm": "sinks_recent_no_finetune", "seed": "", "steps": 0, **fixed0, "s_per_step": ""}
    )
    arms = {
        "sinks_recent": compress_config("sinks_recent"),
        "gumbel_sigmoid": compress_config("retention", "gumbel_sigmoid"),
        "st_topk": compress_config("retention", "st_topk"),
    }
    for seed in args.seeds:
        for arm in args.arms:
            model, comp, sps = finetune(base, arms[arm], args.steps, seed, args.policy_lr)
            row = {
                "arm": arm,
                "seed": seed,
                "steps": args.steps,
                **evaluate(model, comp, test),
                "s_per_step": round(sps, 4),
            }
            rows.append(row)
            print(row, flush=True)
    machine = f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as fh:
        w = csv.DictWriter(
            fh, fieldnames=[*rows[0].keys(), "pretrain_steps", "policy_lr", "machine"]
        )
        w.writeheader()
        for r in rows:
            w.writerow(
                {
                    **r,
                    "pretrain_steps": args.pretrain_steps,
                    "policy_lr": args.policy_lr,
                    "machine": machine.strip(),
                }
            )
    print(f"{'arm':26s} {'seed':>4s} {'acc':>6s} {'nll':>7s} {'kept':>5s} {'s/step':>7s}")
    for r in rows:
        print(
            f"{r['arm']:26s} {r['seed']!s:>4s} {r['accuracy']:6.3f} {r['nll']:7.3f} "
            f"{r['kept']:5.2f} {r['s_per_step']!s:>7s}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
