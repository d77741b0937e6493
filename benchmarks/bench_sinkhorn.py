"""Benchmark: Sinkhorn fwd+bwd, our backends vs naive eager, torch.compile and lucidrains.

Targets (docs/architecture.md#targets): on CPU (64k matrices, n=4, 20 iters) at least as fast as
``torch.compile`` of the naive formula with saved bytes <= 2x the input; on GPU (32k) Triton >= 5x
the compiled reference. Timings are ratios measured side by side in one run: the cases are timed
round-robin (one repeat of each case in turn), so load on a shared machine hits all of them.

Cases (one setup function each; ``variant`` in deepseek_v4 / paper):
  naive_eager       autograd through ``sinkhorn_reference`` (the spec, the baseline)
  ours_torch        ``sinkhorn(backend="torch")``: recompute backward, saves only the input
  ours_triton       ``sinkhorn(backend="triton")`` (CUDA only)
  compile_naive     ``torch.compile(sinkhorn_reference)`` (warm-up time reported separately)
  lucidrains_eager  ``hyper_connections``' ``sinkhorn_knopps`` (paper convention, eps ~ 0)
  lucidrains_triton ``hyper_connections``' log-domain ``triton_sinkhorn`` (CUDA only)

Caveat (measured on a shared 2-core VM, load 8-12): eager code with a few hundred ops per
fwd+bwd pays for every OpenMP parallel region when threads are descheduled. With ``--threads 1``
``ours_torch`` is ~8x naive eager and ~4x ``compile_naive``; at 2 threads on the oversubscribed
machine it swung between 0.8x and 3.5x naive (medians; minimums ~4x) while the fused compiled
graph held ~5x. Compare ratios from runs with the same ``--threads`` and look at ``load_1min``.

Usage:
  python benchmarks/bench_sinkhorn.py                       # CPU, 65536 matrices
  python benchmarks/bench_sinkhorn.py --device cuda         # GPU, 32768 matrices
  python benchmarks/bench_sinkhorn.py --matrices 4096 --repeats 3 --no-compile

Appends one row per case to ``benchmarks/results/bench_sinkhorn.csv`` with the machine. Never
imported by the library.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_common import machine_description

from unicache_train.ops import sinkhorn, sinkhorn_reference

RESULTS = Path(__file__).resolve().parent / "results" / "bench_sinkhorn.csv"


@dataclass
class Case:
    """A benchmark case: ``step()`` runs one fwd+bwd; ``forward(x)`` is used for saved bytes."""

    name: str
    variant: str
    forward: Callable[[torch.Tensor], torch.Tensor]
    warmup_s: float = 0.0
    times: list[float] = field(default_factory=list)
    saved_bytes: int = 0
    note: str = ""


# --------------------------------------------------------------------------------------------
# setups
# --------------------------------------------------------------------------------------------


def setup_naive_eager(args, variant: str) -> Case:
    return Case("naive_eager", variant, lambda x: sinkhorn_reference(x, args.iters, 1e-6, variant))


def setup_ours_torch(args, variant: str) -> Case:
    return Case(
        "ours_torch",
        variant,
        lambda x: sinkhorn(x, args.iters, 1e-6, variant, backend="torch"),
    )


def setup_ours_triton(args, variant: str) -> Case | None:
    if args.device != "cuda":
        return None
    return Case(
        "ours_triton",
        variant,
        lambda x: sinkhorn(x, args.iters, 1e-6, variant, backend="triton"),
    )


def setup_compile_naive(args, variant: str) -> Case | None:
    if args.no_compile:
        return None
    # dynamic=False: one fixed shape here; the compiled graph is the naive formula, fused.
    fn = torch.compile(lambda x: sinkhorn_reference(x, args.iters, 1e-6, variant), dynamic=False)
    return Case("compile_naive", variant, fn)


def setup_lucidrains_eager(args, variant: str) -> Case | None:
    if variant != "paper":  # its convention is the paper's (T_r(T_c(.)) from exp), eps ~ 0
        return None
    try:
        from hyper_connections.manifold_constrained_hyper_connections import sinkhorn_knopps
    except ImportError:
        return None
    return Case(
        "lucidrains_eager",
        variant,
        lambda x: sinkhorn_knopps(x, args.iters),
        note="F.normalize (eps 1e-12), column max",
    )


def setup_lucidrains_triton(args, variant: str) -> Case | None:
    if variant != "paper" or args.device != "cuda":
        return None
    try:
        from hyper_connections.triton_sinkhorn import triton_sinkhorn
    except ImportError:
        return None
    return Case(
        "lucidrains_triton",
        variant,
        lambda x: triton_sinkhorn(x, args.iters),
        note="log domain",
    )


SETUPS = [
    setup_naive_eager,
    setup_ours_torch,
    setup_ours_triton,
    setup_compile_naive,
    setup_lucidrains_eager,
    setup_lucidrains_triton,
]


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(case: Case, x: torch.Tensor, cot: torch.Tensor, inner: int) -> None:
    for _ in range(inner):
        x.grad = None
        case.forward(x).backward(cot)


def _saved_bytes(case: Case, x: torch.Tensor) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        case.forward(x)
    return total


def run(args) -> list[Case]:
    device = args.device
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.matrices, args.n, args.n, generator=gen)
    cot = torch.randn(args.matrices, args.n, args.n, generator=gen).to(device)
    x = x0.to(device).requires_grad_(True)
    inner = args.inner or (20 if device == "cuda" else 1)

    cases: list[Case] = []
    for variant in args.variants:
        for setup in SETUPS:
            case = setup(args, variant)
            if case is None:
                continue
            t0 = time.perf_counter()
            _step(case, x, cot, 1)  # warm-up (and compilation)
            _sync(device)
            case.warmup_s = time.perf_counter() - t0
            _step(case, x, cot, 1)
            _sync(device)
            case.saved_bytes = _saved_bytes(case, x)
            cases.append(case)
            print(f"  set up {variant}/{case.name} (warm-up {case.warmup_s:.2f} s)", flush=True)

    # Round-robin repeats: machine noise is shared by every case.
    for _ in range(args.repeats):
        for case in cases:
            _sync(device)
            t0 = time.perf_counter()
            _step(case, x, cot, inner)
            _sync(device)
            case.times.append((time.perf_counter() - t0) / inner * 1e3)
    return cases


def report(args, cases: list[Case]) -> None:
    in_bytes = args.matrices * args.n * args.n * 4
    naive = {c.variant: statistics.median(c.times) for c in cases if c.name == "naive_eager"}
    rows = []
    for c in cases:
        med = statistics.median(c.times)
        rows.append(
            {
                "variant": c.variant,
                "case": c.name,
                "median_ms": f"{med:.2f}",
                "min_ms": f"{min(c.times):.2f}",
                "speedup_vs_naive": f"{naive[c.variant] / med:.2f}",
                "saved_bytes": c.saved_bytes,
                "saved_x_input": f"{c.saved_bytes / in_bytes:.2f}",
                "warmup_s": f"{c.warmup_s:.2f}",
                "note": c.note,
            }
        )
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=f"Sinkhorn fwd+bwd: {args.matrices} matrices, n={args.n}, iters={args.iters}, "
            f"{args.device}, {args.repeats} repeats"
        )
        for key in rows[0]:
            table.add_column(key, justify="left" if key in ("variant", "case", "note") else "right")
        for r in rows:
            table.add_row(*[str(v) for v in r.values()])
        Console(width=160).print(table)
    except ImportError:
        print(" | ".join(rows[0]))
        for r in rows:
            print(" | ".join(str(v) for v in r.values()))

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    new = not RESULTS.exists()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with RESULTS.open("a", newline="") as f:
        writer = csv.writer(f)
        head = ["date", "machine", "device", "load_1min", "matrices", "n", "iters", "repeats"]
        # NOTE: load_1min is read after the run; > cores means the timings were contended.
        if new:
            writer.writerow(head + list(rows[0]))
        meta = [
            dt.datetime.now().isoformat(timespec="seconds"),
            machine_description(args.device),
            args.device,
            f"{load:.2f}",
            args.matrices,
            args.n,
            args.iters,
            args.repeats,
        ]
        for r in rows:
            writer.writerow(meta + list(r.values()))
    print(f"appended {len(rows)} rows to {RESULTS}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--matrices", type=int, default=None, help="65536 on CPU, 32768 on GPU")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--inner", type=int, default=0, help="steps per timed repeat (GPU: 20)")
    p.add_argument("--variants", default="deepseek_v4,paper")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow warm-up)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (default: torch's). On an oversubscribed machine OpenMP barriers "
        "dominate many-op eager code at 2+ threads; 1 thread gives stabler ratios",
    )
    args = p.parse_args()
    args.variants = args.variants.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.matrices is None:
        args.matrices = 32768 if args.device == "cuda" else 65536
    print(machine_description(args.device), flush=True)
    report(args, run(args))


if __name__ == "__main__":
    main()
