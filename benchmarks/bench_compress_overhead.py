"""Benchmark: a training step with KV compression in the loop vs the same step without.

Target (docs/architecture.md#targets): step time with compression in the loop <= 1.25x the plain
step, same model, measured side by side in one run. The cases share one model (the same weights,
copied), the same batches and the same optimizer settings, and are timed round-robin (one step of
each case in turn) by the harness of ``bench_common.py``, so load on a shared machine hits all of
them alike.

Cases (one setup function each):
  plain        LMModule without compression: forward, causal-LM loss, backward, AdamW step
  inloop       the in-loop compression step: splits, prefill -> UniCache -> continuation in one
               forward, continuation loss, backward, AdamW step (``kl_weight = 0``)
  inloop_kl    the same plus the KL term (one extra no-grad uncompressed forward)
  inloop_xkv   xKV in the loop (``--xkv``; ``--xkv-kl``: also ``inloop_xkv_kl`` with the KL term)
  *_old        with ``--compare-old``: each in-loop case again on the code before issue 20,
               in the same round-robin: the compressor's reference kernels
               (``unicache_train/compress/kernels.py``: the same numbers, bit for bit) and xKV's
               previous settings (``XKV_OLD``: ``factorization="svd"``); the rows then carry
               ``ratio_vs_old`` and go to ``bench_compress_overhead_old_new.csv`` with the
               command line

The batches are real: the bundled corpus with ``pack=False`` (stories and recall records, the
split at the recall answers, random elsewhere), as in ``recipes/finetune_compress.yaml``.

Usage:
  python benchmarks/bench_compress_overhead.py          # the tiny recipe model, B=16, T=256
  python benchmarks/bench_compress_overhead.py --repeats 9 --batch-size 8 --no-kl
  # the real checkpoint (unicache-train fetch --name smollm2), plus xKV in the loop:
  python benchmarks/bench_compress_overhead.py --hf smollm2 --batch-size 4 --seq-len 192 \
      --no-kl --xkv --repeats 3 --warmup 1 --batches 2 --threads 1

Before/after in one run (issue 20):
  python benchmarks/bench_compress_overhead.py --threads 1 --compare-old --xkv --no-kl --repeats 9

Appends one row per case to ``benchmarks/results/bench_compress_overhead.csv`` with the machine
(``--memory-only``: ``bench_compress_memory.csv``, the peak allocator bytes of one step above
the weights and optimizer state; valid on a loaded machine, unlike the timings).
Never imported by the library.

On a loaded machine use ``--threads 1``: with more threads than free cores every small op waits
at an OpenMP barrier for a descheduled thread (measured here under load 11 on 2 cores: a 66k-element
clamp took 30 ms with 2 threads, 32 us with 1), which inflates the compressor's many small ops
far more than the model's matmuls. ``cpu_median_ms`` (process CPU time) is reported beside the
wall time: with one thread it is close to the unloaded wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from bench_common import (
    Case,
    add_common_arguments,
    bench_data,
    load_batches,
    measure_peak_step_bytes,
    optimizer,
    report,
    time_round_robin,
    timing_columns,
)

from unicache_train.compress.kernels import reference_kernels
from unicache_train.data.config import DataConfig
from unicache_train.model.config import ModelConfig
from unicache_train.train.config import CompressionTrainConfig, RunConfig
from unicache_train.train.module import LMModule, causal_lm_loss


def setup_plain(args, state: dict[str, torch.Tensor]) -> Case:
    module = LMModule(_config(args, enabled=False))
    module.model.load_state_dict(state)
    opt = optimizer(module)

    def step(batch: dict[str, torch.Tensor], i: int) -> float:
        loss = causal_lm_loss(module(batch), batch["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return Case("plain", step)


def _setup_inloop(
    name: str, kl_weight: float, method: str = "unicache", old: bool = False
) -> Callable:
    """A setup of the in-loop step; ``old``: the code before issue 20 (the compressor's
    reference kernels, ``compress/kernels.py``; xKV's previous defaults, ``--xkv-old``)."""

    def setup(args, state: dict[str, torch.Tensor]) -> Case:
        cfg = _config(args, enabled=True, kl_weight=kl_weight, method=method, old=old)
        module = LMModule(cfg)
        module.model.load_state_dict(state)
        opt = optimizer(module)
        case = Case(name, lambda b, i: 0.0)

        def step(batch: dict[str, torch.Tensor], i: int) -> float:
            with reference_kernels(old):
                loss, logs, _ = module.compressed_loss(batch, step=10_000)  # past any curriculum
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            case.rate_realized = float(logs.get("compress/rate_realized", float("nan")))
            case.kv_reduction = float(logs.get("compress/kv_reduction", float("nan")))
            return float(loss.detach())

        case.step = step
        return case

    setup.case_name = name  # type: ignore[attr-defined]
    return setup


SETUPS = [
    setup_plain,
    _setup_inloop("inloop", 0.0),
    _setup_inloop("inloop_old", 0.0, old=True),
    _setup_inloop("inloop_kl", 0.5),
    _setup_inloop("inloop_kl_old", 0.5, old=True),
    _setup_inloop("inloop_xkv", 0.0, "xkv"),
    _setup_inloop("inloop_xkv_old", 0.0, "xkv", old=True),
    _setup_inloop("inloop_xkv_kl", 0.5, "xkv"),
    _setup_inloop("inloop_xkv_kl_old", 0.5, "xkv", old=True),
]


def _hf_dir(args):
    """The checkpoint directory of ``--hf`` (a fetchable name or a local HF directory)."""
    from unicache_train.checkpoint.gguf import KNOWN, fetched_dir

    return fetched_dir(args.hf) if args.hf in KNOWN else Path(args.hf)


def _model_config(args) -> ModelConfig:
    if args.hf:
        import json

        from unicache_train.checkpoint.hf_config import from_hf_config

        return from_hf_config(json.loads((_hf_dir(args) / "config.json").read_text()))[0]
    return ModelConfig(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _data(args) -> DataConfig:
    return bench_data(args, str(_hf_dir(args)) if args.hf else "byte")


#: xKV's settings before issue 20 (``--compare-old``'s ``*_old`` cases): the SVD per sample.
XKV_OLD = {"factorization": "svd", "gradient": "exact"}


def _config(
    args, enabled: bool, kl_weight: float = 0.0, method: str = "unicache", old: bool = False
) -> RunConfig:
    xkv = {"rank_mode": "reduction", "reduction": args.xkv_reduction, **(XKV_OLD if old else {})}
    return RunConfig(
        model=_model_config(args),
        data=_data(args),
        compress=CompressionTrainConfig.from_dict(
            dict(
                enabled=enabled,
                method=method,
                preset="text_style_baseline",
                unicache={"target_rate": args.rate, "quantize": {"bits": args.bits}},
                xkv=xkv,
                min_context=32,
                kl_weight=kl_weight,
            )
        ),
    )


def _wanted(args, setup: Callable) -> bool:
    """Whether a case runs: ``*_kl`` with ``--kl`` (default on), ``*_xkv*`` with ``--xkv``,
    ``*_old`` with ``--compare-old``, and UniCache's cases unless ``--xkv-only``."""
    name = getattr(setup, "case_name", "plain")
    if name == "plain":
        return True
    xkv = "_xkv" in name
    return (
        (args.kl or "_kl" not in name)
        and (args.xkv or not xkv)
        and (args.compare_old or not name.endswith("_old"))
        and (xkv or not args.xkv_only)
        and (not xkv or "_kl" not in name or args.xkv_kl)
    )


def run(args) -> list[Case]:
    batches = load_batches(_data(args), args.batches)
    if args.hf:
        from unicache_train.checkpoint.hf import import_hf

        state = import_hf(_hf_dir(args))[0].state_dict()
    else:
        state = LMModule(_config(args, enabled=False)).model.state_dict()
    cases = [setup(args, state) for setup in SETUPS if _wanted(args, setup)]
    if args.memory or args.memory_only:
        for c in cases:  # one warm-up step first: the optimizer state exists
            c.step(batches[0], 0)
        for c in cases:
            c.peak_step_bytes = measure_peak_step_bytes(c, batches[0], 1)
            print(f"{c.name}: peak {c.peak_step_bytes / 2**20:.1f} MiB above the state", flush=True)
    if not args.memory_only:
        time_round_robin(cases, batches, args.warmup, args.repeats)
    return cases


def write_report(args, cases: list[Case]) -> None:
    plain = next(c for c in cases if c.name == "plain")

    def memory(c: Case) -> dict[str, str]:
        if c.peak_step_bytes is None:
            return {}
        return {
            "peak_step_mib": f"{c.peak_step_bytes / 2**20:.1f}",
            "peak_vs_plain": f"{c.peak_step_bytes / plain.peak_step_bytes:.2f}",
        }

    rows = [
        {
            "case": c.name,
            **({} if args.memory_only else timing_columns(c, plain, "plain")),
            **memory(c),
            **(_vs_old(c, cases) if args.compare_old else {}),
            "rate_realized": f"{c.rate_realized:.3f}",
            "kv_reduction": f"{c.kv_reduction:.2f}",
        }
        for c in cases
    ]
    mc = _model_config(args)
    title = (
        f"training step, {args.hf or 'tiny'}: {mc.num_hidden_layers} layers x "
        f"{mc.hidden_size}, B={args.batch_size}, "
        f"T={args.seq_len}, UniCache text_style_baseline rate {args.rate}, int{args.bits}, "
        + (
            "peak memory of one step (no timing)"
            if args.memory_only
            else f"{args.repeats} repeats (round-robin)"
        )
    )
    setup = {
        "layers": mc.num_hidden_layers if not args.hf else f"{args.hf} ({mc.num_hidden_layers})",
        "hidden_size": mc.hidden_size,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "rate": args.rate,
        "bits": args.bits,
        "repeats": args.repeats,
    }
    name = "bench_compress_memory" if args.memory_only else "bench_compress_overhead"
    if args.compare_old:  # more columns (the old twins, the command): their own CSV
        name = "bench_compress_overhead_old_new"
        setup["threads"] = torch.get_num_threads()
        setup["command"] = "python benchmarks/bench_compress_overhead.py " + " ".join(sys.argv[1:])
    # peak memory rows have their own columns: their own CSV
    report(title, rows, name, setup)


def _vs_old(c: Case, cases: list[Case]) -> dict[str, str]:
    """The step time over its ``*_old`` twin's (medians of the same round-robin run)."""
    twin = next((o for o in cases if o.name == c.name + "_old"), None)
    if twin is None or not c.times:
        return {"ratio_vs_old": "", "cpu_ratio_vs_old": ""}
    wall = statistics.median(c.times) / statistics.median(twin.times)
    cpu = statistics.median(c.cpu_times) / statistics.median(twin.cpu_times)
    return {"ratio_vs_old": f"{wall:.3f}", "cpu_ratio_vs_old": f"{cpu:.3f}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(p)
    p.add_argument("--rate", type=float, default=0.6)
    p.add_argument("--bits", type=int, default=8, choices=(4, 8))
    p.add_argument("--no-kl", dest="kl", action="store_false", help="skip the inloop_kl case")
    p.add_argument("--hf", default=None, help="a fetched checkpoint name (smollm2) or HF dir")
    p.add_argument("--xkv", action="store_true", help="also xKV in the loop (inloop_xkv)")
    p.add_argument(
        "--xkv-only", action="store_true", help="with --xkv: no UniCache cases (plain and xKV only)"
    )
    p.add_argument(
        "--xkv-kl",
        action="store_true",
        help="with --xkv and the KL term: also xKV with KL (inloop_xkv_kl)",
    )
    p.add_argument(
        "--compare-old",
        action="store_true",
        help="also each in-loop case on the code before issue 20 (*_old, timed in "
        "the same round-robin): the compressor's reference kernels "
        "(compress/kernels.py) and xKV's previous defaults (XKV_OLD)",
    )
    p.add_argument("--xkv-reduction", type=float, default=4.0, help="xKV KV reduction")
    p.add_argument(
        "--memory",
        action="store_true",
        help="also the peak allocator bytes of one step (torch.profiler)",
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="only the peak memory (no timing: valid on a loaded machine)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    write_report(args, run(args))


if __name__ == "__main__":
    main()
