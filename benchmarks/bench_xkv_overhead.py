"""Benchmark: a training step with xKV (cross-layer SVD) in the loop vs the same step without.

The harness of ``bench_compress_overhead.py`` (``bench_common.py``; docs/architecture.md#targets:
timings are ratios measured side by side in one run): the cases share one model (the same weights,
copied), the same batches and the same optimizer settings, and are timed round-robin (one step of
each case in turn).

Cases (one setup function each):
  plain              LMModule without compression: forward, LM loss, backward, AdamW step
  inloop_identity    the in-loop step with the identity compressor (splits, the seam's masked
                     attention, continuation loss): what any in-loop method pays before it
                     compresses anything
  xkv_exact          xKV, gradient "exact": the recording pass (context prefill) with
                     gradient, per-sample fp32 basis per group, the in-loop forward on the
                     reconstructions
  xkv_exact_svd      the same with ``factorization="svd"`` (the default before issue 20 was
                     the SVD; now the Gram matrix's eigendecomposition, ``"gram"``)
  xkv_causal         xKV, gradient "causal": the recording pass without gradient
  xkv_refresh        xKV "causal" with a pooled basis refreshed every ``--refresh`` steps
                     (no SVD on the other steps)
  unicache           UniCache at the same KV bytes (rate ``--unicache-rate``, int8), for
                     reference
  plain_kl / xkv_causal_kl / unicache_kl (``--kl``): the same with the KL term; the xKV
                     causal prefill doubles as the KL's uncompressed forward

Also reported: ``svd_ms``, the factorisation time per step of the xKV cases (measured by
wrapping ``torch.linalg.svd``, ``eigh`` and ``qr``) and ``kv_reduction`` of the compressed cases.

Usage:
  OMP_NUM_THREADS=1 python benchmarks/bench_xkv_overhead.py --threads 1
  python benchmarks/bench_xkv_overhead.py --reduction 8 --group-size 4 --kl

Appends one row per case to ``benchmarks/results/bench_xkv_overhead.csv`` with the machine.
Never imported by the library.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from bench_common import (
    Case,
    add_common_arguments,
    bench_data,
    load_batches,
    optimizer,
    report,
    time_round_robin,
    timing_columns,
)

from unicache_train.inloop import compression_kl
from unicache_train.model.config import ModelConfig
from unicache_train.train.config import CompressionTrainConfig, RunConfig
from unicache_train.train.module import LMModule, causal_lm_loss


class SVDTimer:
    """Counts the wall time spent in the basis factorisation while active: ``torch.linalg.svd``,
    ``eigh`` and ``qr`` (whichever ``XKVConfig.factorization`` calls; patched in this script
    only, the library is not modified)."""

    NAMES = ("svd", "eigh", "qr")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = {n: getattr(torch.linalg, n) for n in self.NAMES}

    def __enter__(self) -> SVDTimer:
        def timed(orig):
            def f(*a, **k):
                t0 = time.perf_counter()
                out = orig(*a, **k)
                self.seconds += time.perf_counter() - t0
                return out

            return f

        for n, orig in self._orig.items():
            setattr(torch.linalg, n, timed(orig))
        return self

    def __exit__(self, *exc) -> None:
        for n, orig in self._orig.items():
            setattr(torch.linalg, n, orig)


def _plain(name: str, kl: bool) -> Callable:
    def setup(args, state: dict[str, torch.Tensor]) -> Case:
        module = LMModule(_config(args, "none", enabled=False))
        module.model.load_state_dict(state)
        opt = optimizer(module)

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
        opt = optimizer(module)
        case = Case(name, lambda b, i: 0.0)

        def step(batch: dict[str, torch.Tensor], i: int) -> float:
            with SVDTimer() as svd:
                loss, logs, _ = module.compressed_loss(batch, step=i)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            case.svd_times.append(svd.seconds)
            case.kv_reduction = float(logs.get("compress/kv_reduction", float("nan")))
            return float(loss.detach())

        case.step = step
        return case

    return setup


def setups(args) -> list[Callable]:
    out = [
        _plain("plain", False),
        _inloop("inloop_identity", "none"),
        _inloop("xkv_exact", "xkv", gradient="exact"),
        _inloop("xkv_exact_svd", "xkv", gradient="exact", factorization="svd"),
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
        data=bench_data(args),
        compress=CompressionTrainConfig.from_dict(
            dict(
                enabled=enabled,
                method=method,
                preset="text_style_baseline",
                unicache={"target_rate": args.unicache_rate, "quantize": {"bits": 8}},
                xkv={
                    "group_size": args.group_size,
                    "rank_mode": "reduction",
                    "reduction": args.reduction,
                    **xkv,
                },
                min_context=32,
                kl_weight=kl_weight,
            )
        ),
    )


def run(args) -> list[Case]:
    batches = load_batches(bench_data(args), args.batches)
    state = LMModule(_config(args, "none", enabled=False)).model.state_dict()
    cases = [setup(args, state) for setup in setups(args)]
    time_round_robin(cases, batches, args.warmup, args.repeats)
    return cases


def write_report(args, cases: list[Case]) -> None:
    by = {c.name: c for c in cases}
    rows = []
    for c in cases:
        ref = by["plain_kl" if c.name.endswith("_kl") else "plain"]
        svd = statistics.median(c.svd_times) * 1e3 if c.svd_times else float("nan")
        rows.append(
            {
                "case": c.name,
                "baseline": ref.name,
                **timing_columns(c, ref, "baseline"),
                "svd_ms": f"{svd:.1f}",
                "kv_reduction": f"{c.kv_reduction:.2f}",
            }
        )
    title = (
        f"training step, {args.layers} layers x {args.hidden_size}, B={args.batch_size}, "
        f"T={args.seq_len}, xKV reduction {args.reduction:g}x group {args.group_size}, "
        f"UniCache rate {args.unicache_rate} int8, {args.repeats} repeats (round-robin)"
    )
    setup = {
        "layers": args.layers,
        "hidden_size": args.hidden_size,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "reduction": args.reduction,
        "group_size": args.group_size,
        "refresh": args.refresh,
        "unicache_rate": args.unicache_rate,
        "repeats": args.repeats,
    }
    report(title, rows, "bench_xkv_overhead", setup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(p)
    p.add_argument("--reduction", type=float, default=4.0, help="xKV KV reduction")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--refresh", type=int, default=8, help="refresh_every of xkv_refresh")
    p.add_argument(
        "--unicache-rate",
        type=float,
        default=0.58,
        help="UniCache rate of the reference case (0.58 + int8: ~4.2x)",
    )
    p.add_argument("--kl", action="store_true", help="also the cases with the KL term")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    write_report(args, run(args))


if __name__ == "__main__":
    main()
