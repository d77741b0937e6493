"""The harness of the training-step overhead benchmarks (``bench_compress_overhead.py``,
``bench_xkv_overhead.py``): cases, batches, round-robin timing, the results table and CSV.

Each benchmark defines its cases (one setup function each, returning a :class:`Case` whose
``step(batch, i)`` runs one full training step) and its run config; this module does the rest the
same way for both:

* the batches are real: the bundled corpus with ``pack=False`` (stories and recall records, the
  split at the recall answers, random elsewhere), as in ``recipes/finetune_compress.yaml``;
* every case warms up on the first ``--warmup`` batches, then the cases are timed round-robin
  (one step of each case in turn), so load on a shared machine hits all of them alike;
* each row reports the median and minimum wall time, the process CPU time (with one thread it is
  close to the unloaded wall time) and their ratios to the case's baseline;
* the rows are appended to ``benchmarks/results/<name>.csv`` after the date, the machine and the
  1-minute load (read after the run: a load above the core count means contended timings).

Never imported by the library.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from unicache_train.data.config import DataConfig, SyntheticDataConfig

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Case:
    """A benchmark case: ``step(batch, i)`` runs one full training step (``i``: the step's
    index, warm-up included).

    Attributes:
        times, cpu_times: wall and process CPU seconds of each timed step.
        svd_times: seconds spent in ``torch.linalg.svd`` per timed step (xKV cases).
        rate_realized, kv_reduction: the compressor's stats of the last step (NaN: none;
            docs/architecture.md#words).
    """

    name: str
    step: Callable[[dict[str, torch.Tensor], int], float]
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    svd_times: list[float] = field(default_factory=list)
    rate_realized: float = float("nan")
    kv_reduction: float = float("nan")
    peak_step_bytes: int | None = None


def measure_peak_step_bytes(case: Case, batch: dict[str, torch.Tensor], i: int) -> int:
    """Peak of the bytes the CPU allocator holds during one step above what it held when the
    step began (activations, gradients, temporaries; the weights and the optimizer state that
    already exist are not counted): ``torch.profiler`` memory events, tracemalloc-style. Run
    after a warm-up step so that the optimizer state exists."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        case.step(batch, i)

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = prof.profiler.kineto_results.experimental_event_tree()
    allocs = [e for e in walk(events) if e.tag == _EventType.Allocation]
    totals = [e.extra_fields.total_allocated for e in allocs]
    return max(totals, default=0)


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The model size, batch and timing flags both benchmarks take."""
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--intermediate-size", type=int, default=352)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def optimizer(module) -> torch.optim.Optimizer:
    """The LightningModule's own optimizer (same groups and settings in every case)."""
    return module.configure_optimizers()["optimizer"]


def bench_data(args, tokenizer: str = "byte") -> DataConfig:
    """The benchmark's data: unpacked rows of the bundled corpus (splits at recall answers)."""
    return DataConfig(
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        pack=False,
        tokenizer=tokenizer,
        synthetic=SyntheticDataConfig(num_stories=200, num_recall=200),
    )


def load_batches(data: DataConfig, n: int) -> list[dict[str, torch.Tensor]]:
    """The first ``n`` training batches (seeded: the same in every run)."""
    from unicache_train.data.datamodule import LMDataModule

    torch.manual_seed(0)
    dm = LMDataModule(data)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def time_round_robin(
    cases: Sequence[Case], batches: Sequence[dict[str, torch.Tensor]], warmup: int, repeats: int
) -> None:
    """Warm every case up, then time ``repeats`` steps of each, one case after the other."""
    for case in cases:  # warm-up: allocator, thread pools, first-call paths
        for i, b in enumerate(batches[:warmup]):
            case.step(b, i)
        case.svd_times.clear()
        print(f"  warmed up {case.name}", flush=True)
    # NOTE: round-robin, one step of each case in turn, so machine noise is shared.
    for r in range(repeats):
        batch = batches[r % len(batches)]
        for case in cases:
            t0, c0 = time.perf_counter(), time.process_time()
            case.step(batch, warmup + r)
            case.times.append(time.perf_counter() - t0)
            case.cpu_times.append(time.process_time() - c0)


def timing_columns(case: Case, ref: Case, ref_label: str) -> dict[str, str]:
    """Median / min wall time, median CPU time and the ratios to ``ref``'s medians
    (``ratio_vs_<ref_label>``, ``cpu_ratio_vs_<ref_label>``)."""
    base, base_cpu = statistics.median(ref.times), statistics.median(ref.cpu_times)
    med, med_cpu = statistics.median(case.times), statistics.median(case.cpu_times)
    return {
        "median_ms": f"{med * 1e3:.1f}",
        "min_ms": f"{min(case.times) * 1e3:.1f}",
        f"ratio_vs_{ref_label}": f"{med / base:.3f}",
        "cpu_median_ms": f"{med_cpu * 1e3:.1f}",
        f"cpu_ratio_vs_{ref_label}": f"{med_cpu / base_cpu:.3f}",
    }


def machine_description(device: str = "cpu") -> str:
    """CPU model, cores, torch version and threads (and the GPU's name for ``device="cuda"``)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads"
    if device == "cuda":
        desc += f", {torch.cuda.get_device_name()}"
    return desc


def report(title: str, rows: list[dict[str, str]], name: str, setup: dict[str, Any]) -> Path:
    """Print the rows under ``title`` and append them to ``benchmarks/results/<name>.csv``.

    Args:
        setup: the run's settings (``layers``, ``batch_size``, ...), columns after the date,
            the machine and the load; the header is written when the file is new.
    """
    print(f"\n{title}")
    print("  ".join(f"{k:>15}" for k in rows[0]))
    for r in rows:
        print("  ".join(f"{v:>15}" for v in r.values()))
    path = RESULTS_DIR / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    # NOTE: read after the run; a load above the core count means the timings were contended.
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    meta = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_description(),
        "load_1min": f"{load:.2f}",
        **setup,
    }
    with path.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(list(meta) + list(rows[0]))
        for r in rows:
            writer.writerow(list(meta.values()) + list(r.values()))
    print(f"appended to {path}")
    return path
