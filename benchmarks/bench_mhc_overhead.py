"""Training-step overhead of mHC (n streams) vs the plain residual, ours vs transformers' code.

Target (docs/architecture.md#targets): on CPU a 4-layer MLP stack at B·T = 2048, C = 1024 costs +68%
with transformers' ``deepseek_v4`` mHC code; our target is at most a third of that overhead. Each
case is a stack of ``layers`` sub-layers ``x -> x + SwiGLU(RMSNorm(x))`` wired as (a) the plain
residual, (b) our :class:`~unicache_train.model.mhc.HyperConnection`, (c) transformers'
``DeepseekV4HyperConnection`` with the mixing of ``DeepseekV4DecoderLayer``. Forward + backward of a
random cotangent, warm-up, median of ``--repeats``; all cases in the same run.

    python benchmarks/bench_mhc_overhead.py --widths 256 512 1024
Appends to benchmarks/results/bench_mhc_overhead.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from unicache_train.model.config import ModelConfig
from unicache_train.model.mhc import HyperConnection
from unicache_train.model.mlp import SwiGLU
from unicache_train.model.norm import RMSNorm

RESULTS = Path(__file__).resolve().parent / "results"


class Plain(nn.Module):
    def __init__(self, C: int, layers: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(C) for _ in range(layers))
        self.mlps = nn.ModuleList(SwiGLU(C, 2 * C) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, C]
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        return x


class Ours(Plain):
    def __init__(self, C: int, layers: int, n: int) -> None:
        super().__init__(C, layers)
        cfg = ModelConfig(
            hidden_size=C,
            num_attention_heads=1,
            num_key_value_heads=1,
            residual_mode="mhc",
            hc_mult=n,
        )
        self.hcs = nn.ModuleList(HyperConnection(cfg) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, n, C]
        for norm, mlp, hc in zip(self.norms, self.mlps, self.hcs):
            x = hc(x, lambda h, norm=norm, mlp=mlp: mlp(norm(h)))
        return x


class HF(Plain):
    def __init__(self, C: int, layers: int, n: int) -> None:
        super().__init__(C, layers)
        from transformers import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4HyperConnection,
        )

        cfg = DeepseekV4Config(hidden_size=C, hc_mult=n)
        self.hcs = nn.ModuleList(DeepseekV4HyperConnection(cfg) for _ in range(layers))
        for hc in self.hcs:
            nn.init.normal_(hc.fn, std=0.02)
            nn.init.zeros_(hc.base)
            nn.init.ones_(hc.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, n, C]
        for norm, mlp, hc in zip(self.norms, self.mlps, self.hcs):
            # The mixing of DeepseekV4DecoderLayer, verbatim in structure.
            post, comb, collapsed = hc(x)
            out = mlp(norm(collapsed))
            x = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
        return x


def step_time(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> float:
    """Seconds for one forward + backward of ``model`` at ``x`` with cotangent ``g``."""
    model.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    model(xi).backward(g)
    return time.perf_counter() - t0


def time_cases(
    cases: list[tuple[nn.Module, torch.Tensor]], warmup: int, repeats: int, interleave: bool
) -> list[float]:
    """Median ms per case. ``interleave``: round-robin, one step of each case per repeat (the
    order rotating), so load that comes and goes hits every case alike; else one case after
    another."""
    grads = [torch.randn_like(x) for _, x in cases]
    times: list[list[float]] = [[] for _ in cases]
    if interleave:
        for i in range(warmup + repeats):
            order = [(i + j) % len(cases) for j in range(len(cases))]
            for k in order:
                dt = step_time(cases[k][0], cases[k][1], grads[k])
                if i >= warmup:
                    times[k].append(dt)
    else:
        for k, (model, x) in enumerate(cases):
            for i in range(warmup + repeats):
                dt = step_time(model, x, grads[k])
                if i >= warmup:
                    times[k].append(dt)
    return [statistics.median(t) * 1e3 for t in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--tokens", type=int, default=2048, help="B*T")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="time the cases one after another instead of round-robin",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    machine = (
        f"{platform.processor() or platform.machine()} threads={torch.get_num_threads()} "
        f"torch={torch.__version__} load1={load:.1f} "
        f"{'sequential' if args.sequential else 'round-robin'} repeats={args.repeats}"
    )
    rows = []
    print(
        f"{'C':>6} {'plain ms':>9} {'ours ms':>8} {'hf ms':>8} {'ours +%':>8} {'hf +%':>7} "
        f"{'ours/hf overhead':>17}"
    )
    for C in args.widths:
        x1 = torch.randn(1, args.tokens, C)
        xn = x1.unsqueeze(2).expand(1, args.tokens, args.n, C).contiguous()
        t_plain, t_ours, t_hf = time_cases(
            [
                (Plain(C, args.layers), x1),
                (Ours(C, args.layers, args.n), xn),
                (HF(C, args.layers, args.n), xn),
            ],
            args.warmup,
            args.repeats,
            interleave=not args.sequential,
        )
        o_ours, o_hf = t_ours / t_plain - 1, t_hf / t_plain - 1
        ratio = o_ours / o_hf if o_hf > 0 else float("nan")
        print(
            f"{C:>6} {t_plain:9.1f} {t_ours:8.1f} {t_hf:8.1f} {100 * o_ours:7.0f}% "
            f"{100 * o_hf:6.0f}% {ratio:17.2f}"
        )
        rows.append(
            [
                C,
                args.tokens,
                args.layers,
                args.n,
                t_plain,
                t_ours,
                t_hf,
                o_ours,
                o_hf,
                ratio,
                machine,
            ]
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench_mhc_overhead.csv"
    with out.open("a", newline="") as fh:
        w = csv.writer(fh)
        if fh.tell() == 0:
            w.writerow(
                [
                    "width",
                    "tokens",
                    "layers",
                    "n",
                    "plain_ms",
                    "ours_ms",
                    "hf_ms",
                    "ours_overhead",
                    "hf_overhead",
                    "ours_over_hf_overhead",
                    "machine",
                ]
            )
        w.writerows(rows)
    print(f"appended {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
