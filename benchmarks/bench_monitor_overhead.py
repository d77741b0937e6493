"""Step-time cost of the signal-gain monitor at its default interval (target <= 5%).

Runs the same tiny mHC training twice per repeat (monitor off / on, alternating, same seed and
data) through the real Trainer, times the fit loop, and reports the median ratio.

    python benchmarks/bench_monitor_overhead.py --steps 100 --repeats 3
Appends to benchmarks/results/bench_monitor_overhead.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from unicache_train.data.config import DataConfig, SyntheticDataConfig
from unicache_train.model.config import ModelConfig
from unicache_train.train.config import LoggingConfig, MonitorConfig, RunConfig, TrainConfig
from unicache_train.train.run import fit

RESULTS = Path(__file__).resolve().parent / "results"


def run_once(gain: bool, every: int, steps: int, out: Path) -> float:
    cfg = RunConfig(
        model=ModelConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            residual_mode="mhc",
            hc_mult=4,
        ),
        data=DataConfig(
            seq_len=128,
            batch_size=8,
            synthetic=SyntheticDataConfig(num_stories=300, num_recall=300),
        ),
        train=TrainConfig(
            max_steps=steps,
            warmup_steps=5,
            val_every_n_steps=10_000,
            limit_val_batches=0,
            checkpoint_every_n_steps=10_000,
            accelerator="cpu",
            out_dir=str(out),
            progress_bar=False,
        ),
        logging=LoggingConfig(logger="none"),
        monitor=MonitorConfig(gain=gain, gain_every_n_steps=every, plots=False),
    )
    t0 = time.perf_counter()
    fit(cfg)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=MonitorConfig().gain_every_n_steps)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        run_once(False, args.every, 5, Path(tmp) / "warm")  # imports, data cache, allocator
        for r in range(args.repeats):
            off.append(run_once(False, args.every, args.steps, Path(tmp) / f"off{r}"))
            on.append(run_once(True, args.every, args.steps, Path(tmp) / f"on{r}"))
    t_off, t_on = statistics.median(off), statistics.median(on)
    ratio = t_on / t_off
    load = os.getloadavg()[0]
    print(f"monitor off {t_off:.2f}s  on (every {args.every}) {t_on:.2f}s  ratio {ratio:.3f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench_monitor_overhead.csv"
    with out.open("a", newline="") as fh:
        w = csv.writer(fh)
        if fh.tell() == 0:
            w.writerow(["steps", "every", "repeats", "off_s", "on_s", "ratio", "machine"])
        w.writerow(
            [
                args.steps,
                args.every,
                args.repeats,
                round(t_off, 3),
                round(t_on, 3),
                round(ratio, 4),
                f"{platform.machine()} threads={torch.get_num_threads()} "
                f"torch={torch.__version__} load1={load:.1f}",
            ]
        )


if __name__ == "__main__":
    main()
