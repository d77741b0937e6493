"""Benchmark: a training step with KV compression in the loop vs the same step without.

Target (docs/architecture.md#targets): step time with compression in the loop <= 1.25x the plain
step, same model, measured side by side in one run. The cases share one model (the same weights,
copied), the same batches and the same optimizer settings, and are timed round-robin (one step of
each case in turn), so load on a shared machine hits all of them alike.

Cases (one setup function each):
  plain        LMModule without compression: forward, causal-LM loss, backward, AdamW step
  inloop       the in-loop compression step: splits, prefill -> UniCache -> continuation in one
               forward, continuation loss, backward, AdamW step (``kl_weight = 0``)
  inloop_kl    the same plus the KL term (one extra no-grad uncompressed forward)

The batches are real: the bundled corpus with ``pack=False`` (stories and recall records, the
split at the recall answers, random elsewhere), as in ``recipes/finetune_compress.yaml``.

Usage:
  python scripts/bench_compress_overhead.py                    # the tiny recipe model, B=16, T=256
  python scripts/bench_compress_overhead.py --repeats 9 --batch-size 8 --no-kl
  # the real checkpoint (unicache-train fetch --name smollm2), plus xKV in the loop:
  python scripts/bench_compress_overhead.py --hf smollm2 --batch-size 4 --seq-len 192 \
      --no-kl --xkv --repeats 3 --warmup 1 --batches 2 --threads 1

Appends one row per case to ``scripts/results/bench_compress_overhead.csv`` with the machine.
Never imported by the library.

On a loaded machine use ``--threads 1``: with more threads than free cores every small op waits
at an OpenMP barrier for a descheduled thread (measured here under load 11 on 2 cores: a 66k-element
clamp took 30 ms with 2 threads, 32 us with 1), which inflates the compressor's many small ops
far more than the model's matmuls. ``cpu_median_ms`` (process CPU time) is reported beside the
wall time: with one thread it is close to the unloaded wall time.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unicache_train.config import (
    CompressionTrainConfig,
    DataConfig,
    ModelConfig,
    RunConfig,
    SyntheticDataConfig,
)
from unicache_train.train.module import LMModule, causal_lm_loss

RESULTS = Path(__file__).resolve().parent / "results" / "bench_compress_overhead.csv"


@dataclass
class Case:
    """A benchmark case: ``step(batch)`` runs one full training step."""

    name: str
    step: Callable[[dict[str, torch.Tensor]], float]
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    keep_ratio: float = float("nan")
    kv_bytes_ratio: float = float("nan")


def _optimizer(module: LMModule) -> torch.optim.Optimizer:
    return module.configure_optimizers()["optimizer"]


def setup_plain(args, state: dict[str, torch.Tensor]) -> Case:
    module = LMModule(_config(args, enabled=False))
    module.model.load_state_dict(state)
    opt = _optimizer(module)

    def step(batch: dict[str, torch.Tensor]) -> float:
        loss = causal_lm_loss(module(batch), batch["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return Case("plain", step)


def _setup_inloop(name: str, kl_weight: float, method: str = "unicache") -> Callable:
    def setup(args, state: dict[str, torch.Tensor]) -> Case:
        module = LMModule(_config(args, enabled=True, kl_weight=kl_weight, method=method))
        module.model.load_state_dict(state)
        opt = _optimizer(module)
        case = Case(name, lambda b: 0.0)

        def step(batch: dict[str, torch.Tensor]) -> float:
            loss, logs, _ = module.compressed_loss(batch, step=10_000)  # past any curriculum
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            case.keep_ratio = float(logs.get("compress/keep_ratio", float("nan")))
            case.kv_bytes_ratio = float(logs.get("compress/kv_bytes_ratio", float("nan")))
            return float(loss.detach())

        case.step = step
        return case

    return setup


SETUPS = [
    setup_plain,
    _setup_inloop("inloop", 0.0),
    _setup_inloop("inloop_kl", 0.5),
    _setup_inloop("inloop_xkv", 0.0, "xkv"),
]


def _hf_dir(args):
    """The checkpoint directory of ``--hf`` (a fetchable name or a local HF directory)."""
    from unicache_train.checkpoint.gguf import KNOWN, fetched_dir

    return fetched_dir(args.hf) if args.hf in KNOWN else Path(args.hf)


def _model_config(args) -> ModelConfig:
    if args.hf:
        import json

        from unicache_train.checkpoint.hf import from_hf_config

        return from_hf_config(json.loads((_hf_dir(args) / "config.json").read_text()))[0]
    return ModelConfig(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _config(args, enabled: bool, kl_weight: float = 0.0, method: str = "unicache") -> RunConfig:
    return RunConfig(
        model=_model_config(args),
        data=_data(args),
        compress=CompressionTrainConfig(
            enabled=enabled,
            method=method,
            preset="text_style_baseline",
            unicache={"target_rate": args.rate, "quantize": {"bits": args.bits}},
            xkv={"rank_mode": "ratio", "ratio": args.xkv_ratio},
            min_context=32,
            kl_weight=kl_weight,
        ),
    )


def _data(args) -> DataConfig:
    return DataConfig(
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        pack=False,
        tokenizer=str(_hf_dir(args)) if getattr(args, "hf", None) else "byte",
        synthetic=SyntheticDataConfig(num_stories=200, num_recall=200),
    )


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads"


def run(args) -> list[Case]:
    from unicache_train.data.datamodule import LMDataModule

    torch.manual_seed(0)
    dm = LMDataModule(_data(args))
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    batches = [next(it) for _ in range(args.batches)]
    if args.hf:
        from unicache_train.checkpoint.hf import import_hf

        state = import_hf(_hf_dir(args))[0].state_dict()
    else:
        state = LMModule(_config(args, enabled=False)).model.state_dict()
    cases = [setup(args, state) for setup in SETUPS]
    cases = [c for c in cases if args.kl or c.name != "inloop_kl"]
    cases = [c for c in cases if args.xkv or c.name != "inloop_xkv"]
    for case in cases:  # warm-up: allocator, thread pools, first-call paths
        for b in batches[: args.warmup]:
            case.step(b)
        print(f"  warmed up {case.name}", flush=True)
    # NOTE: round-robin, one step of each case in turn, so machine noise is shared.
    for r in range(args.repeats):
        batch = batches[r % len(batches)]
        for case in cases:
            t0, c0 = time.perf_counter(), time.process_time()
            case.step(batch)
            case.times.append(time.perf_counter() - t0)
            case.cpu_times.append(time.process_time() - c0)
    return cases


def report(args, cases: list[Case]) -> None:
    plain = next(c for c in cases if c.name == "plain")
    base, base_cpu = statistics.median(plain.times), statistics.median(plain.cpu_times)
    rows = []
    for c in cases:
        med, med_cpu = statistics.median(c.times), statistics.median(c.cpu_times)
        rows.append(
            {
                "case": c.name,
                "median_ms": f"{med * 1e3:.1f}",
                "min_ms": f"{min(c.times) * 1e3:.1f}",
                "ratio_vs_plain": f"{med / base:.3f}",
                "cpu_median_ms": f"{med_cpu * 1e3:.1f}",
                "cpu_ratio_vs_plain": f"{med_cpu / base_cpu:.3f}",
                "keep_ratio": f"{c.keep_ratio:.3f}",
                "kv_bytes_ratio": f"{c.kv_bytes_ratio:.3f}",
            }
        )
    mc = _model_config(args)
    print(
        f"\ntraining step, {args.hf or 'tiny'}: {mc.num_hidden_layers} layers x "
        f"{mc.hidden_size}, B={args.batch_size}, "
        f"T={args.seq_len}, UniCache text_style_baseline rate {args.rate}, int{args.bits}, "
        f"{args.repeats} repeats (round-robin)"
    )
    print("  ".join(f"{k:>15}" for k in rows[0]))
    for r in rows:
        print("  ".join(f"{v:>15}" for v in r.values()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    new = not RESULTS.exists()
    # NOTE: read after the run; a load above the core count means the timings were contended.
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    head = [
        "date",
        "machine",
        "load_1min",
        "layers",
        "hidden_size",
        "batch_size",
        "seq_len",
        "rate",
        "bits",
        "repeats",
    ]
    meta = [
        dt.datetime.now().isoformat(timespec="seconds"),
        machine_description(),
        f"{load:.2f}",
        mc.num_hidden_layers if not args.hf else f"{args.hf} ({mc.num_hidden_layers})",
        mc.hidden_size,
        args.batch_size,
        args.seq_len,
        args.rate,
        args.bits,
        args.repeats,
    ]
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
    p.add_argument("--rate", type=float, default=0.6)
    p.add_argument("--bits", type=int, default=8, choices=(4, 8))
    p.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-kl", dest="kl", action="store_false", help="skip the inloop_kl case")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--hf", default=None, help="a fetched checkpoint name (smollm2) or HF dir")
    p.add_argument("--xkv", action="store_true", help="also xKV in the loop (inloop_xkv)")
    p.add_argument("--xkv-ratio", type=float, default=4.0, help="xKV KV-bytes reduction")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report(args, run(args))


if __name__ == "__main__":
    main()
