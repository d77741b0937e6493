"""Benchmark: peak memory of one training step, with and without activation checkpointing,
for the plain residual (mHC with ``hc_mult`` n = 1) and mHC with n = 4.

What is measured (CPU; on CUDA the same numbers come from ``torch.cuda.max_memory_allocated``):

* ``static``: bytes of the parameters and the AdamW state (exp_avg, exp_avg_sq) that live
  across steps, counted tensor by tensor (tied weights once).
* ``act@fwd``: tensor bytes allocated during the step and still alive when the forward pass
  ends: what autograd keeps for the backward (saved activations, the logits) plus the loss.
* ``peak``: ``static`` + the highest live total of the tensor bytes allocated during the step
  (forward, backward, gradients, the optimizer update). Gradients are set to None before the
  step, so they count as new allocations.

Both come from the CPU allocator itself, tracemalloc-style: with ``torch.profiler`` memory
profiling on, every allocation event carries the allocator's running total of the bytes it
has handed out since profiling began and not yet seen freed (``total_allocated``); the maximum
of that total over the step is the step's peak above the pre-existing tensors. Allocator
caching and Python objects are not included, as with ``max_memory_allocated`` on CUDA.

``step_ratio`` is the median step time (no profiler) over the same case without recompute:
the price of recomputing every block in backward (the ideal is ~4/3: one more forward).

Usage:
  python benchmarks/bench_memory.py                   # hidden 128, 4 layers, B 4, T 256
  python benchmarks/bench_memory.py --hidden 512 --layers 8 --batch 8 --seq 512

Prints a table and appends one row per case to ``benchmarks/results/bench_memory.csv`` with the
machine. Never imported by the library.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.train.module import causal_lm_loss
from unicache_train.train.strategies import apply_activation_checkpointing

RESULTS = Path(__file__).resolve().parent / "results" / "bench_memory.csv"
MiB = 1 << 20


@dataclass
class Result:
    hc_mult: int
    recompute: bool
    params: int
    static: int
    act_fwd: int
    peak: int
    step_s: float
    step_ratio: float = 1.0


def build(args: argparse.Namespace, n: int, recompute: bool):
    """One case: model, optimizer, batch and the training step."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 8 / 3) // 16 * 16,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        residual_mode="mhc",
        hc_mult=n,
    )
    model = Decoder(cfg)
    if recompute:
        apply_activation_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]  # [B, T]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with record_function("bench_forward"):
            loss = causal_lm_loss(model(inputs).logits, labels)
        loss.backward()
        opt.step()

    return model, opt, step


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def measure_memory(args: argparse.Namespace, n: int, recompute: bool):
    """Build a case, warm it up, and measure its memory; returns (Result, step)."""
    model, opt, step = build(args, n, recompute)
    step()  # warm-up: creates the AdamW state
    opt.zero_grad(set_to_none=True)
    params = tensor_bytes(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    static = params + tensor_bytes(state)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    allocs = sorted(
        (e for e in nodes if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns
    )
    fwd_end = max(e.end_time_ns for e in nodes if e.name == "bench_forward")
    live = [(e.start_time_ns, e.extra_fields.total_allocated) for e in allocs]
    # Frees are allocation events too (negative size): the last event before the forward ends
    # carries the live total at that moment.
    act_fwd = [total for t, total in live if t <= fwd_end][-1] if live else 0
    peak = static + max((total for _, total in live), default=0)
    return Result(n, recompute, params, static, act_fwd, peak, 0.0), step


def machine() -> str:
    return (
        f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    ).replace("  ", " ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=0, help="default: ~8/3 hidden")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hc", type=int, nargs="+", default=[1, 4])
    p.add_argument("--no-csv", action="store_true")
    args = p.parse_args()

    cases = [measure_memory(args, n, rc) for n in args.hc for rc in (False, True)]
    # Timed round-robin (one step of each case in turn), so load on a shared machine hits all.
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(args.repeats):
        for (_, step), ts in zip(cases, times):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
    results = [r for r, _ in cases]
    for r, ts in zip(results, times):
        r.step_s = statistics.median(ts)
    off = {r.hc_mult: r for r in results if not r.recompute}
    for r in results:
        r.step_ratio = r.step_s / off[r.hc_mult].step_s

    shape = f"hidden {args.hidden}, {args.layers} layers, B {args.batch}, T {args.seq}, fp32, AdamW"
    print(f"peak memory of one training step ({shape}); MiB")
    header = (
        f"{'n':>3} {'recompute':>9} {'params':>8} {'static':>8} {'act@fwd':>9} "
        f"{'peak':>8} {'peak vs off':>11} {'step_ratio':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        rel = r.peak / off[r.hc_mult].peak
        print(
            f"{r.hc_mult:>3} {str(r.recompute):>9} {r.params / MiB:8.2f} {r.static / MiB:8.2f} "
            f"{r.act_fwd / MiB:9.2f} {r.peak / MiB:8.2f} {rel:11.2f} {r.step_ratio:10.2f}"
        )
    if args.no_csv:
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    new = not RESULTS.exists()
    stamp = dt.datetime.now().isoformat(timespec="seconds")
    with RESULTS.open("a", newline="") as fh:
        w = csv.writer(fh)
        if new:
            w.writerow(
                [
                    "time",
                    "machine",
                    "hidden",
                    "layers",
                    "batch",
                    "seq",
                    "hc_mult",
                    "recompute",
                    "params_mib",
                    "static_mib",
                    "act_fwd_mib",
                    "peak_mib",
                    "step_s",
                    "step_ratio",
                ]
            )
        for r in results:
            w.writerow(
                [
                    stamp,
                    machine(),
                    args.hidden,
                    args.layers,
                    args.batch,
                    args.seq,
                    r.hc_mult,
                    r.recompute,
                    f"{r.params / MiB:.3f}",
                    f"{r.static / MiB:.3f}",
                    f"{r.act_fwd / MiB:.3f}",
                    f"{r.peak / MiB:.3f}",
                    f"{r.step_s:.4f}",
                    f"{r.step_ratio:.3f}",
                ]
            )
    print(f"appended {len(results)} rows to {RESULTS}")


if __name__ == "__main__":
    main()
