"""The GPU check: one script, one GPU (H200), under 8 minutes, one CSV per section.

Sections (each guarded: a failure becomes a row with ``status=error`` and the script goes on; a
summary table is printed at the end):

1. ``gpu_tests.csv``     the ``gpu``-marked tests (``pytest -m gpu -q tests``): pass/fail counts.
2. ``gpu_sinkhorn.csv``  Sinkhorn fwd+bwd at 8k / 32k / 128k tokens (one n x n matrix per token),
                         n = 4 and 8: naive eager (``sinkhorn_reference``, the baseline), our
                         torch op (``backend="torch"``), our Triton kernel (``backend="triton"``),
                         ``torch.compile`` of the naive formula.
3. ``gpu_mhc.csv``       mHC step overhead vs the plain residual at widths 2048 and 4096: a
                         4-layer ``x + SwiGLU(RMSNorm(x))`` stack wired as the plain residual, our
                         ``HyperConnection`` and transformers' ``DeepseekV4HyperConnection`` (the
                         stacks of ``bench_mhc_overhead.py``), fwd+bwd, bf16. Ours runs as
                         ``ours`` (``backend="auto"``: the fused Triton kernels on CUDA) and
                         ``ours_unfused`` (``backend="torch"``); the fused row's note holds
                         its time over the unfused one.
4. ``gpu_compress.csv``  the in-loop compression training step on SmolLM2-135M in bf16 (autocast,
                         as Lightning's ``bf16-mixed``): plain step vs UniCache in the loop vs
                         xKV in the loop (the configs of ``bench_compress_overhead.py``).
5. ``gpu_seam.csv``      the compression seam's attention (``[segment ; sequence]`` with the
                         ``log(count)`` bias, batched dense-mask, per-sample and FlexAttention
                         paths of ``model/attention.py``) vs plain causal SDPA at 2k and 8k
                         tokens: fwd+bwd time and peak memory
                         (``torch.cuda.max_memory_allocated``). The dry run checks the flex path's
                         forward only (no CPU backward in torch) and records it as skipped.
6. ``gpu_serving.csv``   compressed serving. ``kernel`` rows: one decode step's attention at 8k
                         and 32k contexts, batch 1 and 16, a Llama-3-8B attention shape (32
                         query heads, 8 KV heads, head dim 128, bf16): SDPA (FlashAttention
                         backend where it takes the call) over a plain 16-bit cache vs our Triton
                         kernel over the same context stored UniCache-int4 (packed, per
                         token-head scales, 6% of entries merged away: the 4x policy) vs the
                         reference (dequantize, then SDPA). ``generate`` rows: stock
                         ``generate()`` tokens/s on SmolLM2-135M with an 8k prompt (its context
                         limit), batch 1 and 16, DynamicCache vs ``CompressedCache`` with the
                         packed path (``benchmarks/bench_serving.py export-base``'s policy).
                         The dry run: 64-entry contexts, the kernel under the interpreter, a
                         tiny random Llama export with the same policy.
7. ``gpu_retention.csv`` the learned-retention comparison at 8x with the budget the CPU could
                         not afford: the main recipe (``recipes/smollm2_compress.py``) on the GPU,
                         a control fine-tune and a learned retention + int4 8x fine-tune of
                         ``RETENTION_STEPS`` steps each (the CPU study ran 30), then 8-pair
                         recall (n = 200, held-out seeds) and held-out perplexity of both with
                         sinks + recent, SnapKV-style and the learned policy at 8x. One row per
                         (model, setting). Needs SmolLM2 fetched (else skipped). The dry run:
                         the same recipe on a tiny random export (2 steps, 2 prompts) on CPU.

Conventions (benchmarks/bench_common.py, benchmarks/bench_sinkhorn.py): every ratio is against a
baseline timed in the same run; the cases of one setting are timed round-robin (one repeat of each
in turn) after a warm-up; the median (and min) over repeats is reported; on GPU each repeat is
timed with CUDA events around ``inner`` back-to-back steps. Each CSV starts with a
``# command:`` line and a ``# machine:`` line, then the header; the files are rewritten per run.

``--dry-run`` runs the same code paths on CPU at tiny sizes (64 tokens, width 64, one repeat, a
tiny random decoder instead of SmolLM2, the Triton kernel under ``TRITON_INTERPRET=1`` with 3
Sinkhorn iterations, ``torch.compile(backend="eager")`` so no C++ toolchain is compiled) and
writes into ``--out`` (default: a new temporary directory; never ``scripts/results``).

Usage:
  python scripts/gpu_check.py                      # on a GPU machine -> scripts/results/gpu_*.csv
  python scripts/gpu_check.py --dry-run            # on CPU -> a temporary directory
  python scripts/gpu_check.py --sections sinkhorn seam --out /tmp/gpu

Without CUDA and without ``--dry-run`` it exits with status 2. Never imported by the library.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
RESULTS_DIR = SCRIPTS / "results"
SECTIONS = ("tests", "sinkhorn", "mhc", "compress", "seam", "serving", "retention")
#: Section 7's fine-tune length on the GPU (the CPU study: 30 steps per arm).
RETENTION_STEPS = 300

# Columns of each CSV (after ``status`` and before ``error``); the test checks them.
COLUMNS = {
    "tests": "passed failed skipped errors deselected returncode wall_s pytest_args".split(),
    "sinkhorn": "tokens n iters variant case median_ms min_ms speedup_vs_naive warmup_s "
    "note".split(),
    "mhc": "width tokens layers n dtype case median_ms min_ms ratio_vs_plain overhead_vs_plain "
    "note".split(),
    "compress": "model precision batch_size seq_len case median_ms min_ms ratio_vs_plain "
    "rate_realized kv_reduction note".split(),
    "seam": "tokens batch_size heads kv_heads head_dim segment_entries dtype case median_ms min_ms "
    "ratio_vs_plain peak_mib peak_ratio_vs_plain note".split(),
    "serving": "kind context batch_size heads kv_heads head_dim dtype case median_ms min_ms "
    "ratio_vs_plain tokens_per_s kv_mib note".split(),
    "retention": "model method target_reduction kv_reduction steps task recall recall_se n ppl "
    "ppl_delta wall_s note".split(),
}
# The ratio columns that must be finite on an ``ok`` row.
RATIO_COLUMNS = {
    "sinkhorn": ["speedup_vs_naive"],
    "mhc": ["ratio_vs_plain"],
    "compress": ["ratio_vs_plain"],
    "seam": ["ratio_vs_plain"],
    "serving": ["ratio_vs_plain"],
}


@dataclass
class Sizes:
    """Every size the sections use: the GPU run's or the dry run's."""

    sinkhorn_tokens: Sequence[int]
    sinkhorn_ns: Sequence[int]
    sinkhorn_iters: int
    mhc_widths: Sequence[int]
    mhc_tokens: int
    mhc_layers: int
    compress_batch: int
    compress_seq: int
    compress_batches: int
    seam_tokens: Sequence[int]
    seam_batch: int
    serving_contexts: Sequence[int]
    serving_batches: Sequence[int]
    serving_shape: tuple[int, int, int]  # (query heads, KV heads, head dim) of the kernel rows
    serving_prompt: int  # generate rows: prompt tokens
    serving_new_tokens: int
    warmup: int
    repeats: int
    inner: int  # steps per timed repeat (amortises launch latency on GPU)


GPU_SIZES = Sizes(
    sinkhorn_tokens=(8192, 32768, 131072),
    sinkhorn_ns=(4, 8),
    sinkhorn_iters=20,
    mhc_widths=(2048, 4096),
    mhc_tokens=8192,
    mhc_layers=4,
    compress_batch=8,
    compress_seq=512,
    compress_batches=4,
    seam_tokens=(2048, 8192),
    seam_batch=2,
    serving_contexts=(8192, 32768),
    serving_batches=(1, 16),
    serving_shape=(32, 8, 128),
    serving_prompt=8000,
    serving_new_tokens=32,
    warmup=2,
    repeats=7,
    inner=5,
)
DRY_SIZES = Sizes(
    sinkhorn_tokens=(64,),
    sinkhorn_ns=(4, 8),
    sinkhorn_iters=3,  # the Triton interpreter runs numpy op by op: seconds per iteration
    mhc_widths=(64,),
    mhc_tokens=16,  # the fused case runs under the Triton interpreter: one program per token
    mhc_layers=2,
    compress_batch=2,
    compress_seq=64,
    compress_batches=1,
    seam_tokens=(64,),
    seam_batch=2,
    serving_contexts=(64,),
    serving_batches=(1, 2),
    serving_shape=(4, 2, 16),
    serving_prompt=48,
    serving_new_tokens=3,
    warmup=1,
    repeats=1,
    inner=1,
)


class Skip(Exception):  # noqa: N818 (a section that cannot run here, with the reason)
    """A section or case that cannot run here; the message is recorded as the reason."""


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


@dataclass
class Timed:
    """One timed case: ``step()`` runs one full fwd+bwd (or training step)."""

    name: str
    step: Callable[[], object]
    note: str = ""
    times_ms: list[float] = field(default_factory=list)
    warmup_s: float = float("nan")
    peak_bytes: float = float("nan")
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.times_ms)

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]


def time_cases(
    cases: Sequence[Timed],
    device: torch.device,
    warmup: int,
    repeats: int,
    inner: int,
    peak: bool = False,
) -> None:
    """Warm each case up (a failing case records its error and drops out), optionally measure
    its peak memory over one step, then time ``repeats`` repeats round-robin, one repeat of
    each case in turn, so machine noise hits all of them alike."""
    for case in cases:
        try:
            t0 = time.perf_counter()
            for _ in range(max(warmup, 1)):
                case.step()
            _sync(device)
            case.warmup_s = time.perf_counter() - t0
            if peak and device.type == "cuda":
                # NOTE: after the warm-up (allocator caches and autotuning done), relative to
                # what is allocated before the step (the inputs and weights).
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                case.step()
                _sync(device)
                case.peak_bytes = torch.cuda.max_memory_allocated(device) - base
        except Exception as exc:  # noqa: BLE001 (recorded as the case's row; the run goes on)
            case.error = _error_text(exc)
            print(f"    {case.name}: {case.error}", flush=True)
    live = [c for c in cases if not c.error]
    for _ in range(repeats):
        for case in live:
            if case.error:
                continue
            try:
                case.times_ms.append(_time_one(case, device, inner))
            except Exception as exc:  # noqa: BLE001
                case.error = _error_text(exc)


def _time_one(case: Timed, device: torch.device, inner: int) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sync(device)
        start.record()
        for _ in range(inner):
            case.step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        case.step()
    return (time.perf_counter() - t0) * 1e3 / inner


def _fmt(x: float, digits: int = 3) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _timing_row(case: Timed, base: Timed | None, ratio_key: str, inverse: bool = False) -> dict:
    """status, median/min and the ratio to ``base`` (``inverse``: base/case, a speedup)."""
    if not case.ok:
        return {"status": "error", "error": case.error or "no timings"}
    ratio = float("nan")
    if base is not None and base.ok:
        ratio = base.median / case.median if inverse else case.median / base.median
    return {
        "status": "ok",
        "median_ms": _fmt(case.median),
        "min_ms": _fmt(min(case.times_ms)),
        ratio_key: _fmt(ratio),
    }


# --------------------------------------------------------------------------------------------
# 1. the gpu-marked tests
# --------------------------------------------------------------------------------------------


def _gpu_test_files() -> list[str]:
    """The test files that mark tests ``gpu`` (the dry run collects only these: collecting the
    whole suite imports every test module, ~20 s on one CPU thread)."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").glob("test_*.py")
        if "mark.gpu" in p.read_text(encoding="utf-8")
    )


def section_tests(ctx: SimpleNamespace) -> list[dict]:
    targets = _gpu_test_files() if ctx.dry_run else ["tests"]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *targets]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=ctx.child_env,
        capture_output=True,
        text=True,
        timeout=ctx.tests_timeout_s,
    )
    wall = time.perf_counter() - t0
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    summary = tail[-1] if tail else ""
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected")}
    for num, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary):
        counts["errors" if word.startswith("error") else word] += int(num)
    # pytest: 0 all passed, 5 nothing collected/selected; anything else is a failure.
    ok = proc.returncode in (0, 5) and counts["failed"] == 0 and counts["errors"] == 0
    print(f"    {summary}", flush=True)
    return [
        {
            "status": "ok" if ok else "failed",
            **{k: str(v) for k, v in counts.items()},
            "returncode": str(proc.returncode),
            "wall_s": f"{wall:.1f}",
            "pytest_args": shlex.join(cmd[1:]),
            "error": "" if ok else summary[:300],
        }
    ]


# --------------------------------------------------------------------------------------------
# 2. Sinkhorn
# --------------------------------------------------------------------------------------------


def _triton_note(ctx: SimpleNamespace) -> str:
    """Why the Triton case cannot run here ('' if it can)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if ctx.device.type == "cuda":
        return ""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA and TRITON_INTERPRET is not 1"
    from unicache_train.kernels import sinkhorn as tk

    if not tk.INTERPRETED:
        return "the kernels were imported before TRITON_INTERPRET=1 was set"
    return ""


def section_sinkhorn(ctx: SimpleNamespace) -> list[dict]:
    from unicache_train.ops import sinkhorn_reference

    s, variant = ctx.sizes, "deepseek_v4"
    iters = s.sinkhorn_iters
    triton_skip = _triton_note(ctx)
    # NOTE: the dry run compiles with the eager backend: it traces the same graph through
    # dynamo without inductor's C++ codegen (~50 s per shape on one CPU thread).
    compile_backend = "eager" if ctx.dry_run else "inductor"
    rows = []
    for n in s.sinkhorn_ns:
        # NOTE: one compiled function per n with a dynamic token count: one compilation (in the
        # first setting's warm-up) instead of one per shape keeps the run inside its 8 minutes.
        compiled = torch.compile(
            lambda z: sinkhorn_reference(z, iters, 1e-6, variant),
            dynamic=True,
            backend=compile_backend,
        )
        for tokens in s.sinkhorn_tokens:
            rows += _sinkhorn_setting(ctx, n, tokens, compiled, triton_skip, compile_backend)
    return rows


def _sinkhorn_setting(
    ctx: SimpleNamespace,
    n: int,
    tokens: int,
    compiled: Callable[[torch.Tensor], torch.Tensor],
    triton_skip: str,
    compile_backend: str,
) -> list[dict]:
    """One (n, tokens) setting: naive eager, our torch op, our Triton kernel, compiled naive."""
    from unicache_train.ops import sinkhorn, sinkhorn_reference

    s, dev, variant = ctx.sizes, ctx.device, "deepseek_v4"
    iters = s.sinkhorn_iters
    rows = []
    gen = torch.Generator().manual_seed(tokens + n)
    x = torch.randn(tokens, n, n, generator=gen).to(dev).requires_grad_(True)
    cot = torch.randn(tokens, n, n, generator=gen).to(dev)

    def fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            x.grad = None
            fn(x).backward(cot)

        return step

    cases = [
        Timed("naive_eager", fwd_bwd(lambda z: sinkhorn_reference(z, iters, 1e-6, variant))),
        Timed("ours_torch", fwd_bwd(lambda z: sinkhorn(z, iters, 1e-6, variant, backend="torch"))),
    ]
    if not triton_skip:
        cases.append(
            Timed(
                "ours_triton",
                fwd_bwd(lambda z: sinkhorn(z, iters, 1e-6, variant, backend="triton")),
                note="TRITON_INTERPRET=1" if dev.type == "cpu" else "",
            )
        )
    cases.append(
        Timed(
            "compile_naive",
            fwd_bwd(compiled),
            note=f"torch.compile(backend={compile_backend!r}, dynamic=True)",
        )
    )
    print(f"  sinkhorn n={n} tokens={tokens}", flush=True)
    time_cases(cases, dev, s.warmup, s.repeats, s.inner)
    head = {"tokens": str(tokens), "n": str(n), "iters": str(iters), "variant": variant}
    for c in cases:
        rows.append(
            {
                **head,
                "case": c.name,
                "warmup_s": _fmt(c.warmup_s, 2),
                "note": c.note,
                **_timing_row(c, cases[0], "speedup_vs_naive", inverse=True),
            }
        )
    if triton_skip:
        rows.append({**head, "case": "ours_triton", "status": "skipped", "note": triton_skip})
    return rows


# --------------------------------------------------------------------------------------------
# 3. mHC overhead
# --------------------------------------------------------------------------------------------


def section_mhc(ctx: SimpleNamespace) -> list[dict]:
    import bench_mhc_overhead as bm  # the stacks: Plain, Ours, HF (transformers' deepseek_v4)

    s, dev, n = ctx.sizes, ctx.device, 4
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    # ``auto`` picks the fused Triton kernels on CUDA; where it does not (the dry run's CPU, or
    # no triton) the fused kernels are timed as their own case when they can run at all.
    auto_fused = dev.type == "cuda" and not _triton_note(ctx)
    fused_case = not auto_fused and not _triton_note(ctx)
    rows = []

    def hc_model(C: int, backend: str) -> torch.nn.Module:
        model = bm.Ours(C, s.mhc_layers, n).to(dev, dtype)
        for hc in model.hcs:
            hc.backend = backend  # HyperConnection.backend: auto | torch | triton
        return model

    for C in s.mhc_widths:
        torch.manual_seed(0)
        x1 = torch.randn(1, s.mhc_tokens, C, device=dev, dtype=dtype)
        xn = x1.unsqueeze(2).expand(1, s.mhc_tokens, n, C).contiguous()  # [1, T, n, C]
        g1, gn = torch.randn_like(x1), torch.randn_like(xn)

        def stack_step(model: torch.nn.Module, x: torch.Tensor, g: torch.Tensor):
            def step() -> None:
                model.zero_grad(set_to_none=True)
                model(x.detach().requires_grad_(True)).backward(g)

            return step

        cases = [
            Timed("plain", stack_step(bm.Plain(C, s.mhc_layers).to(dev, dtype), x1, g1)),
            Timed(
                "ours",
                stack_step(hc_model(C, "auto"), xn, gn),
                note="backend=auto: " + ("fused triton" if auto_fused else "torch path"),
            ),
            Timed("ours_unfused", stack_step(hc_model(C, "torch"), xn, gn), note="backend=torch"),
        ]
        if fused_case:
            cases.append(
                Timed(
                    "ours_fused",
                    stack_step(hc_model(C, "triton"), xn, gn),
                    note="backend=triton" + (" (TRITON_INTERPRET=1)" if dev.type == "cpu" else ""),
                )
            )
        hf_reason = ""
        try:
            hf = bm.HF(C, s.mhc_layers, n).to(dev, dtype)
            cases.append(Timed("transformers_deepseek_v4", stack_step(hf, xn, gn)))
        except ImportError as exc:
            hf_reason = f"not available: {_error_text(exc)}"
        print(f"  mhc C={C}", flush=True)
        time_cases(cases, dev, s.warmup, s.repeats, s.inner)
        head = {
            "width": str(C),
            "tokens": str(s.mhc_tokens),
            "layers": str(s.mhc_layers),
            "n": str(n),
            "dtype": str(dtype).removeprefix("torch."),
        }
        unfused = next(c for c in cases if c.name == "ours_unfused")
        for c in cases:
            row = {**head, "case": c.name, **_timing_row(c, cases[0], "ratio_vs_plain")}
            if row["status"] == "ok":
                row["overhead_vs_plain"] = _fmt(float(row["ratio_vs_plain"]) - 1)
                fused = c.name == "ours_fused" or (c.name == "ours" and auto_fused)
                if fused and unfused.ok:
                    c.note += f"; time / ours_unfused = {_fmt(c.median / unfused.median)}"
            row["note"] = c.note
            rows.append(row)
        if hf_reason:
            rows.append(
                {
                    **head,
                    "case": "transformers_deepseek_v4",
                    "status": "not available",
                    "note": hf_reason,
                }
            )
    return rows


# --------------------------------------------------------------------------------------------
# 4. in-loop compression step on SmolLM2
# --------------------------------------------------------------------------------------------


def section_compress(ctx: SimpleNamespace) -> list[dict]:
    import bench_compress_overhead as bco  # its configs: model, data, UniCache / xKV settings
    from bench_common import load_batches, optimizer

    from unicache_train.checkpoint.gguf import CheckpointNotFetched
    from unicache_train.train.module import LMModule, causal_lm_loss

    s, dev = ctx.sizes, ctx.device
    args = SimpleNamespace(
        hf=None if ctx.dry_run else ctx.hf,
        hidden_size=64,
        intermediate_size=176,
        layers=2,
        batch_size=s.compress_batch,
        seq_len=s.compress_seq,
        rate=0.6,
        bits=8,
        xkv_reduction=4.0,
    )
    if args.hf:
        try:
            bco._hf_dir(args)  # raises with the fetch command when it is absent
        except CheckpointNotFetched as exc:
            raise Skip(_error_text(exc)) from exc
    model_name = args.hf or "tiny random decoder (2 x 64)"
    bf16 = dev.type == "cuda"
    precision = "bf16-mixed" if bf16 else "32-true"
    batches = [
        {k: v.to(dev) for k, v in b.items()}
        for b in load_batches(bco._data(args), s.compress_batches)
    ]
    if args.hf:
        from unicache_train.checkpoint.hf import import_hf

        state = import_hf(bco._hf_dir(args))[0].state_dict()
    else:
        torch.manual_seed(0)
        state = LMModule(bco._config(args, enabled=False)).model.state_dict()

    def autocast():
        if bf16:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def make(name: str, enabled: bool, method: str = "unicache") -> Timed:
        module = LMModule(bco._config(args, enabled=enabled, method=method))
        module.model.load_state_dict(state)
        module.to(dev)
        opt = optimizer(module)
        case = Timed(name, lambda: None)
        counter = iter(range(10**9))

        def step() -> None:
            batch = batches[next(counter) % len(batches)]
            with autocast():
                if enabled:
                    loss, logs, _ = module.compressed_loss(batch, step=10_000)  # past curriculum
                    case.rate_realized = float(logs.get("compress/rate_realized", math.nan))
                    case.kv_reduction = float(logs.get("compress/kv_reduction", math.nan))
                else:
                    loss = causal_lm_loss(module(batch), batch["labels"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        case.step = step
        case.rate_realized = case.kv_reduction = math.nan
        return case

    cases = []
    for name, enabled, method in (
        ("plain", False, "unicache"),
        ("inloop_unicache", True, "unicache"),
        ("inloop_xkv", True, "xkv"),
    ):
        try:
            cases.append(make(name, enabled, method))
        except Exception as exc:  # noqa: BLE001 (recorded as the case's row)
            bad = Timed(name, lambda: None)
            bad.error = _error_text(exc)
            cases.append(bad)
    print(f"  compress {model_name}", flush=True)
    # The step includes the optimizer; inner = 1 (a step is milliseconds to seconds).
    time_cases([c for c in cases if not c.error], dev, s.warmup, s.repeats, 1)
    head = {
        "model": model_name,
        "precision": precision,
        "batch_size": str(s.compress_batch),
        "seq_len": str(s.compress_seq),
    }
    return [
        {
            **head,
            "case": c.name,
            **_timing_row(c, cases[0], "ratio_vs_plain"),
            "rate_realized": _fmt(getattr(c, "rate_realized", math.nan)),
            "kv_reduction": _fmt(getattr(c, "kv_reduction", math.nan), 2),
        }
        for c in cases
    ]


# --------------------------------------------------------------------------------------------
# 5. the seam's attention vs plain causal SDPA
# --------------------------------------------------------------------------------------------


def _synthetic_segment(B: int, Hk: int, M: int, D: int, dev: torch.device, dtype: torch.dtype):
    """A compressed context of ``M`` entries per sample, keys/values [B, Hk, M, D]: the last
    eighth of sample 0's entries are padding (invalid), merged counts 1..3."""
    from unicache_train.seam import KVSegment

    gen = torch.Generator().manual_seed(1)
    valid = torch.ones(B, M, dtype=torch.bool)
    valid[0, M - max(M // 8, 1) :] = False
    return KVSegment(
        keys=torch.randn(B, Hk, M, D, generator=gen).to(dev, dtype),
        values=torch.randn(B, Hk, M, D, generator=gen).to(dev, dtype),
        positions=torch.arange(M).expand(B, M).to(dev),
        modality_ids=torch.zeros(B, M, dtype=torch.long, device=dev),
        counts=torch.randint(1, 4, (B, M), generator=gen).float().to(dev),
        valid=valid.to(dev),
    )


def section_seam(ctx: SimpleNamespace) -> list[dict]:
    return [row for T in ctx.sizes.seam_tokens for row in _seam_setting(ctx, T)]


def _seam_setting(ctx: SimpleNamespace, T: int) -> list[dict]:
    """Plain causal SDPA vs the seam's two attention paths at ``T`` tokens (fwd+bwd)."""
    import torch.nn.functional as F

    from unicache_train.model.attention import (
        FLEX_BLOCK_SIZE,
        attend_segment_flex,
        attend_segment_per_sample,
        segment_attention_mask,
    )

    s, dev = ctx.sizes, ctx.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    B, H, Hk, D = s.seam_batch, 9, 3, 64  # SmolLM2-135M's attention shape
    rows = []
    gen = torch.Generator().manual_seed(T)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dtype).requires_grad_(True)

    q, k, v = leaf(B, H, T, D), leaf(B, Hk, T, D), leaf(B, Hk, T, D)
    cot = torch.randn(B, H, T, D, generator=gen).to(dev, dtype)
    # Half the sequence is context, compressed 2x: M = T / 4 entries, continuation T / 2.
    split = torch.full((B,), T // 2, dtype=torch.long, device=dev)
    M = max(T // 4, 1)
    seg = _synthetic_segment(B, Hk, M, D, dev, dtype)
    seg_k, seg_v = seg.keys.requires_grad_(True), seg.values.requires_grad_(True)

    def grad_step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            for t in (q, k, v, seg_k, seg_v):
                t.grad = None
            fn().backward(cot)

        return step

    def batched() -> torch.Tensor:  # model/attention.py's Attention._attend_segment
        mask = segment_attention_mask(seg, split, T, dtype)  # [B, 1, T, M + T]
        keys, values = torch.cat([seg_k, k], dim=2), torch.cat([seg_v, v], dim=2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def flex() -> torch.Tensor:  # SEGMENT_ATTENTION="flex" (torch.compile'd on CUDA)
        return attend_segment_flex(q, k, v, seg_k, seg_v, seg, split, enable_gqa=True)

    # The masks alone, analytically: the dense one is [B, 1, T, M + T] in the attention dtype;
    # the block mask holds int32 tile counts [B, 1, nq] and indices [B, 1, nq, nk] for the partial
    # and the full tiles, by kv and by q (8 tensors; nq query tiles, nk key tiles).
    dense_mib = B * T * (M + T) * torch.finfo(dtype).bits / 8 / 2**20
    nq = -(-T // FLEX_BLOCK_SIZE)
    nk = -(-M // FLEX_BLOCK_SIZE) + nq
    block_kib = B * (4 * nq * nk + 2 * nq + 2 * nk) * 4 / 2**10
    flex_note = f"FlexAttention, block mask {block_kib:.0f} KiB ({FLEX_BLOCK_SIZE}-token tiles)"
    cases = [
        Timed(
            "plain_causal_sdpa",
            grad_step(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            ),
        ),
        Timed(
            "seam_batched_mask",
            grad_step(batched),
            note=f"dense additive mask [B, 1, T, M + T] {dense_mib:.1f} MiB",
        ),
        Timed(
            "seam_per_sample",
            grad_step(
                lambda: attend_segment_per_sample(
                    q, k, v, seg_k, seg_v, seg, split, enable_gqa=True
                )
            ),
        ),
    ]
    flex_skip, diff = "", math.nan
    if dev.type == "cuda":
        cases.append(Timed("seam_flex", grad_step(flex), note=flex_note))
    else:
        # NOTE: torch's FlexAttention has no CPU backward: the dry run checks the forward (eager,
        # unfused) against the dense mask and records the case as skipped.
        with torch.no_grad():
            diff = (flex() - batched()).abs().max().item()
        flex_skip = (
            f"{flex_note}; no CPU backward in torch: forward max|flex - batched| = {diff:.1e}"
        )
    print(f"  seam T={T}", flush=True)
    time_cases(cases, dev, s.warmup, s.repeats, s.inner, peak=True)
    head = {
        "tokens": str(T),
        "batch_size": str(B),
        "heads": str(H),
        "kv_heads": str(Hk),
        "head_dim": str(D),
        "segment_entries": str(M),
        "dtype": str(dtype).removeprefix("torch."),
    }
    base = cases[0]
    for c in cases:
        row = {**head, "case": c.name, "note": c.note, **_timing_row(c, base, "ratio_vs_plain")}
        if dev.type == "cuda" and row["status"] == "ok":
            row["peak_mib"] = _fmt(c.peak_bytes / 2**20, 1)
            row["peak_ratio_vs_plain"] = _fmt(c.peak_bytes / base.peak_bytes)
        else:
            row["peak_mib"] = row["peak_ratio_vs_plain"] = "nan"
            row["note"] = (c.note + "; " if c.note else "") + "peak memory: CUDA only"
        rows.append(row)
    if flex_skip:
        row = {**head, "case": "seam_flex", "status": "skipped", "note": flex_skip}
        if not diff <= 1e-4:  # fp32: the same softmax over the same keys
            row.update(status="error", error=f"flex forward differs from the dense mask: {diff}")
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# 6. compressed serving: the packed decode kernel and stock generate()
# --------------------------------------------------------------------------------------------


def section_serving(ctx: SimpleNamespace) -> list[dict]:
    rows = []
    for T in ctx.sizes.serving_contexts:
        for B in ctx.sizes.serving_batches:
            rows += _serving_kernel(ctx, T, B)
    return rows + _serving_generate(ctx)


def _packed_context(B: int, Hk: int, T: int, D: int, dev: torch.device, dtype: torch.dtype):
    """A ``T``-token context as the 4x int4 policy stores it: 94% of the entries kept (the
    rest merged away: counts 2 on every 16th entry), int4 with per token-head fp16 scales."""
    from unicache_train.compress.quantize import quantize_symmetric
    from unicache_train.seam import QuantizedKV, pack_int4

    gen = torch.Generator().manual_seed(T + B)
    M = T - T // 16
    k = torch.randn(B, Hk, M, D, generator=gen)
    v = torch.randn(B, Hk, M, D, generator=gen)
    valid = torch.ones(B, M, dtype=torch.bool)
    counts = torch.ones(B, M)
    counts[:, ::16] = 2.0
    _, kq, ks = quantize_symmetric(k, valid, 4)
    _, vq, vs = quantize_symmetric(v, valid, 4)
    quant = QuantizedKV(
        4, "token_head", pack_int4(kq).to(dev), pack_int4(vq).to(dev), ks.to(dev), vs.to(dev), D
    )
    head_map = torch.arange(Hk, device=dev).expand(B, Hk).contiguous()
    return quant, head_map, counts.to(dev), valid.to(dev)


def _serving_kernel(ctx: SimpleNamespace, T: int, B: int) -> list[dict]:
    """One decode step's attention: plain-cache SDPA vs the packed kernel vs the reference."""
    import torch.nn.functional as F

    from unicache_train.ops.decode_attention import (
        decode_attention,
        decode_attention_reference,
        segment_bias,
    )

    s, dev = ctx.sizes, ctx.device
    H, Hk, D = s.serving_shape
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, 1, D, generator=gen).to(dev, dtype)
    k_plain = torch.randn(B, Hk, T, D, generator=gen).to(dev, dtype)
    v_plain = torch.randn(B, Hk, T, D, generator=gen).to(dev, dtype)
    quant, head_map, counts, valid = _packed_context(B, Hk, T, D, dev, dtype)
    S = 16  # decoded tokens already held (16-bit)
    k_dec = torch.randn(B, Hk, S, D, generator=gen).to(dev, dtype)
    v_dec = torch.randn(B, Hk, S, D, generator=gen).to(dev, dtype)
    bias = segment_bias(counts, valid)
    # NOTE: the dry run is on CPU, where backend="triton" refuses: it calls the launcher
    # directly under the interpreter (TRITON_INTERPRET=1 set by main()).
    if dev.type == "cuda":

        def packed() -> torch.Tensor:
            return decode_attention(
                q, quant, head_map, counts, valid, k_dec, v_dec, backend="triton", bias=bias
            )
    else:
        from unicache_train.kernels.decode_attention import decode_attention_triton

        def packed() -> torch.Tensor:
            return decode_attention_triton(
                q, quant, head_map, counts, valid, k_dec, v_dec, bias=bias, split_size=32
            )

    def reference() -> torch.Tensor:
        return decode_attention_reference(q, quant, head_map, counts, valid, k_dec, v_dec)

    def plain() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k_plain, v_plain, enable_gqa=True)

    with torch.no_grad():
        diff = (packed().float() - reference().float()).abs().max().item()
    plain_mib = 2 * k_plain.numel() * 2 / 2**20  # a 16-bit cache
    stored = (quant.k_data, quant.v_data, quant.k_scale, quant.v_scale)
    packed_mib = sum(t.numel() * t.element_size() for t in stored) / 2**20
    cases = [
        Timed("plain_sdpa", plain, note="SDPA over a plain 16-bit cache"),
        Timed("packed_triton", packed, note=f"max|kernel - reference| = {diff:.1e}"),
        Timed("reference", reference, note="dequantize + SDPA"),
    ]
    print(f"  serving kernel T={T} B={B}", flush=True)
    with torch.no_grad():
        time_cases(cases, dev, s.warmup, s.repeats, s.inner)
    head = {
        "kind": "kernel",
        "context": str(T),
        "batch_size": str(B),
        "heads": str(H),
        "kv_heads": str(Hk),
        "head_dim": str(D),
        "dtype": str(dtype).removeprefix("torch."),
    }
    rows = []
    for c in cases:
        row = {
            **head,
            "case": c.name,
            "note": c.note,
            "kv_mib": _fmt(plain_mib if c.name == "plain_sdpa" else packed_mib, 4),
            **_timing_row(c, cases[0], "ratio_vs_plain"),
        }
        if c.name == "packed_triton" and row["status"] == "ok" and not diff <= 2e-2:
            row.update(status="error", error=f"kernel differs from the reference: {diff}")
        rows.append(row)
    return rows


def _serving_generate(ctx: SimpleNamespace) -> list[dict]:
    """Stock generate() tokens/s, DynamicCache vs CompressedCache (packed), batch 1 and 16."""
    from bench_serving import SMOLLM2, export_base, prompt_ids
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from unicache_train.transformers_cache import (
        ATTN_IMPLEMENTATION,
        CACHE_ARGUMENT,
        CompressedCache,
    )

    s, dev = ctx.sizes, ctx.device
    work = Path(tempfile.mkdtemp(prefix="gpu_serving_"))
    if ctx.dry_run:  # a tiny random Llama (SmolLM2's tokenizer when fetched is not needed)
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        src = work / "tiny"
        LlamaForCausalLM(cfg).save_pretrained(src)
        tok = None
    else:
        src = SMOLLM2
        if not (src / "config.json").is_file():
            raise Skip(f"{src} is not fetched (make fetch)")
        tok = AutoTokenizer.from_pretrained(src)
    export = export_base(work / "export", src)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    models = {
        name: AutoModelForCausalLM.from_pretrained(export, attn_implementation=attn, dtype=dtype)
        .to(dev)
        .eval()
        for name, attn in (("plain", "sdpa"), ("compressed", ATTN_IMPLEMENTATION))
    }
    rows = []
    for B in s.serving_batches:
        if tok is None:
            ids = torch.randint(3, 120, (B, s.serving_prompt), generator=torch.Generator())
        else:
            ids = prompt_ids(tok, s.serving_prompt, B)
        ids = ids.to(dev)

        def gen(name: str, ids: torch.Tensor = ids) -> Callable[[], None]:
            def step() -> None:
                cache = (
                    DynamicCache()
                    if name == "plain"
                    else CompressedCache.from_pretrained(export, decode_path="packed")
                )
                with torch.no_grad():
                    models[name].generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        **{CACHE_ARGUMENT: cache},
                        max_new_tokens=s.serving_new_tokens,
                        min_new_tokens=s.serving_new_tokens,
                        do_sample=False,
                        pad_token_id=0,
                    )

            return step

        cases = [
            Timed("plain_dynamic_cache", gen("plain")),
            Timed("compressed_packed", gen("compressed")),
        ]
        print(f"  serving generate P={s.serving_prompt} B={B}", flush=True)
        time_cases(cases, dev, min(s.warmup, 1), max(s.repeats // 2, 1), 1)
        head = {
            "kind": "generate",
            "context": str(s.serving_prompt),
            "batch_size": str(B),
            "dtype": str(dtype).removeprefix("torch."),
        }
        for c in cases:
            note = f"prefill + {s.serving_new_tokens} new tokens per generate()"
            row = {
                **head,
                "case": c.name,
                **_timing_row(c, cases[0], "ratio_vs_plain"),
                "note": note,
            }
            if row["status"] == "ok":
                row["tokens_per_s"] = _fmt(B * s.serving_new_tokens / (c.median / 1e3), 1)
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------
# 7. the learned-retention comparison, longer than the CPU allows
# --------------------------------------------------------------------------------------------


def _tiny_export(work: Path) -> Path:
    """A tiny random Llama export with our byte tokenizer (the dry run's checkpoint)."""
    from unicache_train.checkpoint.hf import export_hf
    from unicache_train.model import Decoder
    from unicache_train.model.config import ModelConfig

    torch.manual_seed(0)
    model = Decoder(
        ModelConfig(
            vocab_size=260,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
    )
    return export_hf(model, work / "tiny", tokenizer_from="byte")


def section_retention(ctx: SimpleNamespace) -> list[dict]:
    from unicache_train.eval.report import read_results

    work = Path(tempfile.mkdtemp(prefix="gpu_retention_"))
    if ctx.dry_run:
        ckpt, steps = str(_tiny_export(work)), 2
        extra = ["study.num_recall=2", "study.text_blocks=2", "data.seq_len=96"]
        extra += ["train.accelerator=cpu", "study.threads=1"]
    else:
        from unicache_train.checkpoint.gguf import fetched_dir

        ckpt, steps = str(fetched_dir("smollm2")), RETENTION_STEPS
        if not (Path(ckpt) / "config.json").is_file():
            raise Skip(f"{ckpt} is not fetched (make fetch)")
        extra = ["study.num_recall=200", "study.text_blocks=24", "train.accelerator=gpu"]
        extra += ["train.precision=bf16-mixed", "study.threads=8", "study.device=cuda"]
    out = work / "run"
    cmd = [
        sys.executable,
        str(REPO / "recipes" / "smollm2_compress.py"),
        f"study.checkpoint={ckpt}",
        f"study.out_dir={out}",
        "study.settings=[sinks_recent_q4@8,snapkv_q4@8,retention_q4@8]",
        "study.finetune=[control,compress]",
        "study.finetune_setting=retention_q4@8",
        "study.evaluate_base=false",
        f"train.max_steps={steps}",
        *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=REPO, env=ctx.child_env, capture_output=True, text=True, timeout=360
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"the recipe exited {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"
        )
    rows = []
    for r in read_results(out / "results.csv"):
        rows.append(
            {
                "status": "ok",
                **{k: r.get(k) for k in COLUMNS["retention"] if k in r},
                "steps": steps,
                "wall_s": f"{wall:.0f}",
                "note": "learned retention + int4 8x in the loop"
                if r["model"].startswith("compress")
                else "",
            }
        )
    return rows


RUNNERS = {
    "tests": section_tests,
    "sinkhorn": section_sinkhorn,
    "mhc": section_mhc,
    "compress": section_compress,
    "seam": section_seam,
    "serving": section_serving,
    "retention": section_retention,
}


def machine_line(device: torch.device) -> str:
    from bench_common import machine_description

    desc = machine_description()
    if device.type == "cuda":
        desc += f", {torch.cuda.get_device_name(device)}"
    return desc


def write_csv(path: Path, section: str, rows: list[dict], command: str, machine: str) -> None:
    """The section's CSV: ``# command:``, ``# machine:``, header, rows (missing cells empty)."""
    header = ["status", *COLUMNS[section], "error"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        f.write(f"# command: {command}\n")
        f.write(f"# machine: {machine}; {dt.datetime.now().isoformat(timespec='seconds')}\n")
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore", restval="")
        writer.writeheader()
        writer.writerows(rows)


def run_section(name: str, ctx: SimpleNamespace) -> dict:
    """Runs one section, always writes its CSV, returns its summary line."""
    print(f"[{name}]", flush=True)
    t0 = time.perf_counter()
    try:
        rows = RUNNERS[name](ctx)
        status = (
            "ok"
            if rows and all(r["status"] in ("ok", "skipped", "not available") for r in rows)
            else "partial"
        )
        if name == "tests" and rows[0]["status"] != "ok":
            status = "failed"
        note = f"{sum(r['status'] == 'ok' for r in rows)}/{len(rows)} rows ok"
    except Skip as exc:
        rows, status, note = [{"status": "skipped", "error": str(exc)}], "skipped", str(exc)
    except Exception as exc:  # noqa: BLE001 (one section's failure must not stop the others)
        traceback.print_exc()
        rows, status, note = (
            [{"status": "error", "error": _error_text(exc)}],
            "error",
            _error_text(exc),
        )
    path = ctx.out / f"gpu_{name}.csv"
    write_csv(path, name, rows, ctx.command, ctx.machine)
    return {
        "section": name,
        "status": status,
        "wall_s": f"{time.perf_counter() - t0:.1f}",
        "csv": str(path),
        "note": note[:100],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the same code paths on CPU at tiny sizes (CI); writes to --out",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the CSVs go (default: scripts/results on GPU, a temp dir in a dry run)",
    )
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument(
        "--hf",
        default="smollm2",
        help="section 4's checkpoint: a fetched name (smollm2) or an HF directory",
    )
    p.add_argument("--tests-timeout-s", type=float, default=180.0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device found (torch.cuda.is_available() is False); to "
            "exercise the script on CPU run `python scripts/gpu_check.py --dry-run "
            "[--out DIR]`",
            file=sys.stderr,
        )
        return 2
    if args.dry_run:
        out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check_dry_"))
        if out.resolve() == RESULTS_DIR.resolve():
            print(
                f"gpu_check: --dry-run must not write into {RESULTS_DIR} (the committed GPU "
                "results); pass another --out or none (a temporary directory)",
                file=sys.stderr,
            )
            return 2
    else:
        out = args.out or RESULTS_DIR
    child_env = dict(os.environ)  # the pytest child sees the caller's environment, unmodified
    if args.dry_run:
        # NOTE: before anything imports triton (its tl.* are jitted at import): the Triton
        # Sinkhorn kernel then runs under the interpreter on CPU.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # bench_common, bench_mhc_overhead, bench_compress_overhead, bench_serving
    sys.path.insert(0, str(REPO / "benchmarks"))
    device = torch.device("cpu" if args.dry_run else "cuda")
    ctx = SimpleNamespace(
        dry_run=args.dry_run,
        device=device,
        sizes=DRY_SIZES if args.dry_run else GPU_SIZES,
        out=out,
        hf=args.hf,
        child_env=child_env,
        tests_timeout_s=args.tests_timeout_s,
        command=shlex.join(["python", "scripts/gpu_check.py", *(argv or sys.argv[1:])]),
        machine=machine_line(device),
    )
    print(f"gpu_check: {ctx.machine}; writing to {out}", flush=True)
    t0 = time.perf_counter()
    summary = [run_section(name, ctx) for name in args.sections]
    print(f"\nsummary ({time.perf_counter() - t0:.0f} s; CSVs in {out})")
    widths = {k: max(len(k), *(len(r[k]) for r in summary)) for k in summary[0]}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for r in summary:
        print("  ".join(r[k].ljust(w) for k, w in widths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
