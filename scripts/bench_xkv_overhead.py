"""Benchmark: a training step with xKV (cross-layer SVD) in the loop vs the same step without.

Mirrors ``bench_compress_overhead.py`` (docs/architecture.md#targets: timings are ratios measured
side by side in one run): the cases share one model (the same weights, copied), the same batches and
the same optimizer settings, and are timed round-robin (one step of each case in turn).

Cases (one setup function each):
  plain              LMModule without compression: forward, LM loss, backward, AdamW step
  inloop_identity    the in-loop step with the identity compressor (splits, the seam's masked
                     attention, continuation loss): what any in-loop method pays before it
                     compresses anything
  xkv_exact          xKV, gradient "exact": phase A (context prefill) with gradient, per-sample
                     fp32 SVD per group, the in-loop forward on the reconstructions
  xkv_causal         xKV, gradient "causal": phase A without gradient
  xkv_refresh        xKV "causal" with a pooled basis refreshed every ``--refresh`` steps
                     (no SVD on the other steps)
  unicache           UniCache at the same KV bytes (rate ``--unicache-rate``, int8), for
                     reference
  plain_kl / xkv_causal_kl / unicache_kl (``--kl``): the same with the KL term; the xKV
                     causal prefill doubles as the KL's uncompressed forward

Also reported: ``svd_ms``, the SVD time per step of the xKV cases (measured by wrapping
``torch.linalg.svd``) and ``kv_bytes_ratio`` of the compressed cases.

Usage:
  OMP_NUM_THREADS=1 python scripts/bench_xkv_overhead.py --threads 1
  python scripts/bench_xkv_overhead.py --ratio 8 --group-size 4 --kl

Appends one row per case to ``scripts/results/bench_xkv_overhead.csv`` with the machine.
Never imported by the library.
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

# NOTE: the same batches, optimizer and machine line as the UniCache overhead benchmark.
from bench_compress_overhead import _data, _optimizer, machine_description  # noqa: E402

from unicache_train.config import (
    CompressionTrainConfig,
    ModelConfig,
    RunConfig,
)
from unicache_train.train.compression import compression_kl
from unicache_train.train.module import LMModule, causal_lm_loss

RESULTS = Path(__file__).resolve().parent / "results" / "bench_xkv_overhead.csv"


class SVDTimer:
    """Counts the wall time spent in ``torch.linalg.svd`` while active (patched in this script
    only; the library is not modified)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = torch.linalg.svd

    def __enter__(self) -> SVDTimer:
        orig = self._orig

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = orig(*a, **k)
            self.seconds += time.perf_counter() - t0
            return out

        torch.linalg.svd = timed
        return self

    def __exit__(self, *exc) -> None:
        torch.linalg.svd = self._orig


@dataclass
class Case:
    """A benchmark case: ``step(batch, i)`` runs one full training step."""

    name: str
    step: Callable[[dict[str, torch.Tensor], int], float]
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    svd_times: list[float] = field(default_factory=list)
    kv_bytes_ratio: float = float("nan")


def _plain(name: str, kl: bool) -> Callable:
    def setup(args, state: dict[str, torch.Tensor]) -> Case:
        module = LMModule(_config(args, "none", enabled=False))
        module.model.load_state_dict(state)
        opt = _optimizer(module)

        def step(batch: dict[str, torch.Tensor], i: int) -> float:
            logits = module(batch)
            loss = causal_lm_loss(logits, batch["labels"])
            if kl:  # the KL's extra no-grad forward, so that the KL cases compare like for like
                with torch.no_grad():
                    ref = module(batch)
                mask = batch["labels"] != -100
                loss = loss + 0.5 * compression_kl(ref, logits, mask)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        return Case(name, step)

    return setup


def _inloop(name: str, method: str, kl: bool = False, **xkv) -> Callable:
    def setup(args, state: dict[str, torch.Tensor]) -> Case:
        module = LMModule(_config(args, method, kl_weight=0.5 if kl else 0.0, **xkv))
        module.model.load_state_dict(state)
        opt = _optimizer(module)
        case = Case(name, lambda b, i: 0.0)

        def step(batch: dict[str, torch.Tensor], i: int) -> float:
            with SVDTimer() as svd:
                loss, logs, _ = module.compressed_loss(batch, step=i)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            case.svd_times.append(svd.seconds)
            case.kv_bytes_ratio = float(logs.get("compress/kv_bytes_ratio", float("nan")))
            return float(loss.detach())

        case.step = step
        return case

    return setup


def setups(args) -> list[Callable]:
    out = [
        _plain("plain", False),
        _inloop("inloop_identity", "none"),
        _inloop("xkv_exact", "xkv", gradient="exact"),
        _inloop("xkv_causal", "xkv", gradient="causal"),
        _inloop("xkv_refresh", "xkv", gradient="causal", refresh_every=args.refresh),
        _inloop("unicache", "unicache"),
    ]
    if args.kl:
        out += [
            _plain("plain_kl", True),
            _inloop("xkv_causal_kl", "xkv", kl=True, gradient="causal"),
            _inloop("unicache_kl", "unicache", kl=True),
        ]
    return out


def _config(args, method: str, enabled: bool = True, kl_weight: float = 0.0, **xkv) -> RunConfig:
    return RunConfig(
        model=ModelConfig(
            vocab_size=260,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        data=_data(args),
        compress=CompressionTrainConfig(
            enabled=enabled,
            method=method,
            preset="text_style_baseline",
            unicache={"target_rate": args.unicache_rate, "quantize": {"bits": 8}},
            xkv={"group_size": args.group_size, "rank_mode": "ratio", "ratio": args.ratio, **xkv},
            min_context=32,
            kl_weight=kl_weight,
        ),
    )


def run(args) -> list[Case]:
    from unicache_train.data.datamodule import LMDataModule

    torch.manual_seed(0)
    dm = LMDataModule(_data(args))
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    batches = [next(it) for _ in range(args.batches)]
    state = LMModule(_config(args, "none", enabled=False)).model.state_dict()
    cases = [setup(args, state) for setup in setups(args)]
    for case in cases:  # warm-up: allocator, thread pools, first-call paths
        for i, b in enumerate(batches[: args.warmup]):
            case.step(b, i)
        case.svd_times.clear()
        print(f"  warmed up {case.name}", flush=True)
    # NOTE: round-robin, one step of each case in turn, so machine noise is shared.
    for r in range(args.repeats):
        batch = batches[r % len(batches)]
        for case in cases:
            t0, c0 = time.perf_counter(), time.process_time()
            case.step(batch, args.warmup + r)
            case.times.append(time.perf_counter() - t0)
            case.cpu_times.append(time.process_time() - c0)
    return cases


def report(args, cases: list[Case]) -> None:
    by = {c.name: c for c in cases}
    rows = []
    for c in cases:
        ref = by["plain_kl" if c.name.endswith("_kl") else "plain"]
        base, base_cpu = statistics.median(ref.times), statistics.median(ref.cpu_times)
        med, med_cpu = statistics.median(c.times), statistics.median(c.cpu_times)
        svd = statistics.median(c.svd_times) * 1e3 if c.svd_times else float("nan")
        rows.append(
            {
                "case": c.name,
                "baseline": ref.name,
                "median_ms": f"{med * 1e3:.1f}",
                "min_ms": f"{min(c.times) * 1e3:.1f}",
                "ratio_vs_baseline": f"{med / base:.3f}",
                "cpu_median_ms": f"{med_cpu * 1e3:.1f}",
                "cpu_ratio_vs_baseline": f"{med_cpu / base_cpu:.3f}",
                "svd_ms": f"{svd:.1f}",
                "kv_bytes_ratio": f"{c.kv_bytes_ratio:.3f}",
            }
        )
    print(
        f"\ntraining step, {args.layers} layers x {args.hidden_size}, B={args.batch_size}, "
        f"T={args.seq_len}, xKV ratio {args.ratio:g}x group {args.group_size}, "
        f"UniCache rate {args.unicache_rate} int8, {args.repeats} repeats (round-robin)"
    )
    print("  ".join(f"{k:>15}" for k in rows[0]))
    for r in rows:
        print("  ".join(f"{v:>15}" for v in r.values()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    new = not RESULTS.exists()
    # NOTE: read after the run; a load above the core count means the timings were contended.
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    head = ["date", "machine", "load_1min", "layers", "hidden_size", "batch_size", "seq_len",
            "ratio", "group_size", "refresh", "unicache_rate", "repeats"]  # fmt: skip
    meta = [
        dt.datetime.now().isoformat(timespec="seconds"), machine_description(), f"{load:.2f}",
        args.layers, args.hidden_size, args.batch_size, args.seq_len, args.ratio,
        args.group_size, args.refresh, args.unicache_rate, args.repeats,
    ]  # fmt: skip
    with RESULTS.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(head + list(rows[0]))
        for r in rows:
            writer.writerow(meta + list(r.values()))
    print(f"appended to {RESULTS}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--intermediate-size", type=int, default=352)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ratio", type=float, default=4.0, help="xKV KV-bytes reduction")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--refresh", type=int, default=8, help="refresh_every of xkv_refresh")
    p.add_argument("--unicache-rate", type=float, default=0.58,
                   help="UniCache rate of the reference case (0.58 + int8: ~4.2x)")  # fmt: skip
    p.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--kl", action="store_true", help="also the cases with the KL term")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report(args, run(args))


if __name__ == "__main__":
    main()
