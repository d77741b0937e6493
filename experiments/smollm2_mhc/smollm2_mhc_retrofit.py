"""mHC retrofit of a real checkpoint (SmolLM2-135M-Instruct): conversion error, a short fine-tune
against the plain model with per-layer gain monitoring, held-out quality, overhead, HF export.

    OMP_NUM_THREADS=1 python experiments/smollm2_mhc/smollm2_mhc_retrofit.py --steps 24 > /tmp/mhc_retrofit.log

Stages (every one a library call; results in ``experiments/smollm2_mhc/results/``):

1. ``conversion.csv``: :func:`~unicache_train.model.convert.convert_to_mhc` (``--hc-mult``
   streams, ``--preset``) against the plain model on a few prompts: max |logit difference|, the
   logit scale, greedy agreement (``--new-tokens`` tokens per prompt, KV-cached decoding). Rows
   for the retrofit, the former ``post = 1`` init (deepseek_v4's Sinkhorn ``eps`` discounts the
   residual by ``1 - eps`` per sub-layer), the ``paper`` preset, and the plain model in fp32 vs
   fp64 (the fp32 rounding level the conversion error is compared with).
2. Fine-tune the retrofit and the plain model the same ``--steps`` steps on the same batches
   (the recipe ``recipes/smollm2_compress.yaml``'s training mix: recall records of training seeds
   + real text, ``seq_len`` 192, batch 4, AdamW lr 1e-4 with warm-up, nothing compressed), built
   with :func:`~unicache_train.train.from_hf.prepare_hf_run` and the
   :class:`~unicache_train.train.module.LMModule`'s optimizer, in a plain loop. The two models
   alternate step by step (the order flips every step), so machine load hits both alike.
   Every step is probed by :class:`~unicache_train.monitor.SignalGainMonitor` (per-layer
   forward/backward norm gain, composite mix gain, its alarms); the composite gain of the mixes
   up to each layer (``H_l ... H_1``, :func:`~unicache_train.monitor.amax_gain`) is computed from
   the same recorded coefficients. ``train_steps.csv``: loss, step time, gains per step;
   ``layer_gain.csv``: per step and layer; ``composite_gain.png``.
3. ``overhead.csv``: median step time of mHC / plain (steps after ``--warmup``, the profiled
   step excluded) and the peak bytes one step allocates above its start (``torch.profiler``
   memory events, step ``--warmup``, the optimizer state already built).
4. ``eval.csv``: held-out perplexity (real English, recipe's blocks: 8 x 256 tokens, the last 64
   scored) and key-value recall (recipe's task, seeds >= 1,000,000, accuracy +- binomial standard
   error) of the base, the retrofit fine-tune and the plain fine-tune; nothing compressed.
5. ``export.csv``: the fine-tuned retrofit through :func:`~unicache_train.checkpoint.hf.export_hf`
   (remote code), reloaded with ``transformers`` (``trust_remote_code=True``, local directory):
   max |logit difference| to ours.

Timings are of a shared CPU machine; report ratios, not absolute times. Never imported by the
library.
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import yaml

# NOTE: the step-overhead rows reuse the benchmarks' peak-memory probe (benchmarks/bench_common.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_common import Case, machine_description, measure_peak_step_bytes  # noqa: E402

STUDY = yaml.safe_load(
    Path(__file__).with_name("study.yaml").read_text()
)  # the frozen mix + evaluation


def training_data(work: Path, ckpt, **data) -> dict:
    """The study's training mix written under ``work``; its data section (``data`` overrides)."""
    from unicache_train.data.recall_mix import study_training_data

    return study_training_data(STUDY, work, ckpt, **data)


RECALL_SEED, RECALL_TASK = STUDY["recall_seed"], STUDY["recall_task"]
TEXT_BLOCK, TEXT_BLOCKS, TEXT_CONTEXT = (
    STUDY["text_block"],
    STUDY["text_blocks"],
    STUDY["text_context"],
)

OUT = Path(__file__).resolve().parent / "results"
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "<|im_start|>user\nWhat is the largest planet in the solar system?<|im_end|>\n"
    "<|im_start|>assistant\n",
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="smollm2", help="known name or local HF directory")
    p.add_argument("--hc-mult", type=int, default=4)
    p.add_argument("--preset", default="deepseek_v4", choices=["deepseek_v4", "paper"])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--records-per-task", type=int, default=300)
    p.add_argument("--num-recall", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/smollm2_mhc", help="run dirs, exports (large files)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if args.steps < args.warmup + 2:
        p.error(f"--steps={args.steps} is out of range; allowed >= --warmup + 2")
    return args


def write_csv(path: Path, rows: list[dict[str, Any]], command: str) -> None:
    """``# command: ...`` then a header and the rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        f.write(f"# command: {command}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}", flush=True)


def fmt(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


# ------------------------------------------------------------------------------ 1. conversion
@torch.no_grad()
def conversion_rows(model, tok, args) -> list[dict[str, Any]]:
    """Max |logit diff|, logit scale and greedy agreement of converted variants vs plain."""
    from unicache_train.model.convert import convert_to_mhc

    ids = [torch.tensor([tok.encode(p)]) for p in PROMPTS]
    ref = [model(x).logits for x in ids]
    ref_gen = [model.generate(x, args.new_tokens)[0, x.shape[1] :] for x in ids]
    scale = max(float(r.abs().max()) for r in ref)

    def row(name: str, other, greedy: bool = True, note: str = "") -> dict[str, Any]:
        err = max(
            float((other(x).logits.double() - r.double()).abs().max()) for x, r in zip(ids, ref)
        )
        agree = total = 0
        if greedy:
            for x, want in zip(ids, ref_gen):
                got = other.generate(x, args.new_tokens)[0, x.shape[1] :]
                agree += int((got == want).sum())
                total += len(want)
        print(
            f"  {name}: max|dlogit| {err:.3g} (scale {scale:.1f}), greedy {agree}/{total}",
            flush=True,
        )
        return {
            "variant": name,
            "max_abs_logit_diff": f"{err:.3g}",
            "rel_to_scale": f"{err / scale:.3g}",
            "logit_scale": f"{scale:.2f}",
            "greedy_tokens_equal": agree if greedy else "",
            "greedy_tokens": total or "",
            "prompts": len(PROMPTS),
            "note": note,
        }

    rows = []
    p64 = copy.deepcopy(model).double()
    rows.append(
        row(
            "plain fp32 vs plain fp64",
            p64,
            greedy=False,
            note="the fp32 rounding level (reference)",
        )
    )
    del p64
    torch.manual_seed(args.seed)
    mhc = convert_to_mhc(model, hc_mult=args.hc_mult, preset=args.preset).eval()
    rows.append(
        row(
            f"mhc {args.preset} n={args.hc_mult}",
            mhc,
            note="this library: streams carry the eps deficit",
        )
    )
    if args.preset == "deepseek_v4":
        for layer in mhc.layers:  # the former init: post = 1 at every connection
            for hc in (layer.attn_hc, layer.ffn_hc):
                hc.reset_parameters()
        mhc.hc_head.init_identity(1.0)
        rows.append(
            row(
                f"mhc {args.preset} n={args.hc_mult}, former init (post = 1)",
                mhc,
                note="res rows sum to 1 - eps: residual x (1 - eps) per sub-layer",
            )
        )
        torch.manual_seed(args.seed)
        rows.append(
            row(
                f"mhc paper n={args.hc_mult}",
                convert_to_mhc(model, hc_mult=args.hc_mult, preset="paper").eval(),
                note="res rows sum to 1 (log-domain Sinkhorn + rounding)",
            )
        )
    return rows


# ------------------------------------------------------------------------------ 2. fine-tune
class Trained:
    """One model under fine-tuning: LMModule (model + the library's optimizer), its monitor."""

    def __init__(self, name: str, config) -> None:
        from unicache_train.monitor import SignalGainMonitor
        from unicache_train.train.module import LMModule

        self.name = name
        self.module = LMModule(config)
        self.model = self.module.model.train()
        opt = self.module.configure_optimizers()
        self.opt, self.sched = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
        self.monitor = SignalGainMonitor(every_n_steps=1, plot=False)
        self.trainer = SimpleNamespace(
            global_step=0, loggers=[], should_stop=False, is_global_zero=True
        )
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.peak_bytes = 0

    def step(self, batch: dict[str, torch.Tensor], i: int) -> float:
        """One optimizer step (the monitor's probe armed for it); returns the loss."""
        from unicache_train.model.loss import causal_lm_loss

        self.trainer.global_step = i
        self.monitor.on_train_batch_start(self.trainer, self.model, batch, i)
        loss = causal_lm_loss(self.module(batch), batch["labels"])
        loss.backward()
        self.coeffs = [
            hc.last_coeffs.res for hc in connections(self.model) if hc.last_coeffs is not None
        ]
        self.monitor.on_after_backward(self.trainer, self.model)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.last_loss = float(loss.detach())
        return self.last_loss


def connections(model) -> list:
    return [hc for layer in model.layers for hc in (layer.attn_hc, layer.ffn_hc) if hc is not None]


def prefix_composite(mats: list[torch.Tensor], per_layer: int = 2) -> list[tuple[float, float]]:
    """Composite gains (forward, backward) of ``H_k ... H_1`` after each layer's mixes."""
    from unicache_train.monitor import amax_gain

    out, prod = [], None
    for k, m in enumerate(mats):
        prod = m.double() if prod is None else m.double() @ prod  # [B, T, n, n]
        if (k + 1) % per_layer == 0:
            out.append(amax_gain(prod))
    return out


def finetune(args, ckpt: Path, command: str) -> tuple[Trained, Trained, list, list]:
    from unicache_train.data.datamodule import LMDataModule
    from unicache_train.monitor import mix_stats
    from unicache_train.train.from_hf import prepare_hf_run

    work = Path(args.work)
    run = {
        "data": training_data(
            work,
            ckpt,
            records_per_task=args.records_per_task,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
        ),
        "train": {
            "max_steps": args.steps,
            "lr": args.lr,
            "warmup_steps": 4,
            "weight_decay": 0.0,
            "accelerator": "cpu",
            "devices": 1,
        },
        "logging": {"logger": "csv"},
    }
    cfgs = {}
    for name, mhc in (("mhc", True), ("plain", False)):
        r = copy.deepcopy(run)
        r["train"]["out_dir"] = str(work / name)
        cfgs[name] = prepare_hf_run(
            ckpt, r, mhc=mhc, hc_mult=args.hc_mult, hc_preset=args.preset, seed=args.seed
        )
    torch.manual_seed(args.seed)
    dm = LMDataModule(cfgs["plain"].data)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    batches = [next(it) for _ in range(args.steps)]
    tokens = sum(int(b["input_ids"].numel()) for b in batches)
    print(
        f"fine-tune: {args.steps} steps x {args.batch_size} x {args.seq_len} "
        f"({tokens} tokens), same batches for both models",
        flush=True,
    )
    mhc, plain = Trained("mhc", cfgs["mhc"]), Trained("plain", cfgs["plain"])
    step_rows, layer_rows = [], []
    t_start = time.time()
    for i, batch in enumerate(batches):
        losses = {}
        for m in (mhc, plain) if i % 2 == 0 else (plain, mhc):
            if i == args.warmup:  # profiled (allocator events): measured, not timed
                m.peak_bytes = measure_peak_step_bytes(Case(m.name, step=m.step), batch, i)
                losses[m.name] = m.last_loss
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            losses[m.name] = m.step(batch, i)
            if i >= args.warmup:
                m.times.append(time.perf_counter() - t0)
                m.cpu.append(time.process_time() - c0)
        hist = {m.name: m.monitor.history[-1] for m in (mhc, plain)}
        prefix = prefix_composite(mhc.coeffs)
        full = mix_stats(mhc.coeffs)
        assert math.isclose(prefix[-1][0], full.composite_fwd, rel_tol=1e-9)
        step_rows.append(
            {
                "step": i,
                "loss_mhc": f"{losses['mhc']:.4f}",
                "loss_plain": f"{losses['plain']:.4f}",
                "max_fwd_gain_mhc": fmt(max(hist["mhc"]["fwd"])),
                "max_fwd_gain_plain": fmt(max(hist["plain"]["fwd"])),
                "max_bwd_gain_mhc": fmt(max(hist["mhc"]["bwd"])),
                "max_bwd_gain_plain": fmt(max(hist["plain"]["bwd"])),
                "composite_fwd": f"{full.composite_fwd:.9f}",
                "composite_bwd": f"{full.composite_bwd:.9f}",
                "sinkhorn_residual": f"{full.sinkhorn_residual:.3g}",
                "max_abs_scale": fmt(
                    max(float(hc.scale.detach().abs().max()) for hc in connections(mhc.model))
                ),
            }
        )
        for layer, (cf, cb) in enumerate(prefix):
            layer_rows.append(
                {
                    "step": i,
                    "layer": layer,
                    "fwd_gain_mhc": fmt(hist["mhc"]["fwd"][layer], 6),
                    "fwd_gain_plain": fmt(hist["plain"]["fwd"][layer], 6),
                    "bwd_gain_mhc": fmt(hist["mhc"]["bwd"][layer], 6),
                    "bwd_gain_plain": fmt(hist["plain"]["bwd"][layer], 6),
                    "composite_fwd": f"{cf:.9f}",
                    "composite_bwd": f"{cb:.9f}",
                }
            )
        print(
            f"[{time.time() - t_start:.0f}s] step {i}: loss mhc {losses['mhc']:.4f} plain "
            f"{losses['plain']:.4f}, composite fwd {full.composite_fwd:.6f} bwd "
            f"{full.composite_bwd:.6f}",
            flush=True,
        )
    write_csv(Path(args.out) / "train_steps.csv", step_rows, command)
    write_csv(Path(args.out) / "layer_gain.csv", layer_rows, command)
    return mhc, plain, step_rows, layer_rows


def overhead_rows(mhc: Trained, plain: Trained, args) -> list[dict[str, Any]]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = []
    for m in (mhc, plain):
        rows.append(
            {
                "model": m.name,
                "timed_steps": len(m.times),
                "median_step_s": f"{statistics.median(m.times):.2f}",
                "min_step_s": f"{min(m.times):.2f}",
                "median_cpu_s": f"{statistics.median(m.cpu):.2f}",
                "ratio_vs_plain": f"{statistics.median(m.times) / statistics.median(plain.times):.3f}",
                "cpu_ratio_vs_plain": f"{statistics.median(m.cpu) / statistics.median(plain.cpu):.3f}",
                "peak_step_MiB": f"{m.peak_bytes / 2**20:.0f}",
                "peak_ratio_vs_plain": f"{m.peak_bytes / max(plain.peak_bytes, 1):.3f}",
                "machine": machine_description(),
                "load_1min": f"{load:.2f}",
            }
        )
    return rows


# ------------------------------------------------------------------------------ 4. evaluation
@torch.no_grad()
def evaluate(model, name: str, tok, blocks, records) -> dict[str, Any]:
    from unicache_train.eval import run_recall, run_text_perplexity
    from unicache_train.seam import IdentityCompressor

    t0 = time.time()
    model.eval()
    text = run_text_perplexity(model, blocks, TEXT_CONTEXT, IdentityCompressor())
    rec = run_recall(model, tok, records, IdentityCompressor(), batch_size=8)
    row = {
        "model": name,
        "ppl": f"{text.perplexity:.3f}",
        "ppl_se": f"{text.ppl_stderr:.3f}",
        "ppl_tokens": text.tokens,
        "recall": f"{rec.accuracy:.3f}",
        "recall_se": f"{rec.stderr:.3f}",
        "recall_n": rec.n,
        "recall_task": f"pairs={RECALL_TASK['pairs']} distractors={RECALL_TASK['distractors']}",
        "recall_seed": RECALL_SEED,
    }
    print(
        f"  {name}: ppl {row['ppl']} +- {row['ppl_se']}, recall {row['recall']} +- "
        f"{row['recall_se']} (n={rec.n}) ({time.time() - t0:.0f}s)",
        flush=True,
    )
    return row


# ------------------------------------------------------------------------------ 5. export
@torch.no_grad()
def export_rows(model, tok, ckpt: Path, work: Path) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from unicache_train.checkpoint.hf import export_hf
    from unicache_train.checkpoint.trust import check_export_dir

    out = export_hf(model.eval(), work / "export_mhc", tokenizer_from=ckpt)
    remote = check_export_dir(out)  # our own mHC code, verified byte for byte; nothing else runs
    hf = AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=remote, dtype=torch.float32
    ).eval()
    rows = []
    for prompt in PROMPTS:
        x = torch.tensor([tok.encode(prompt)])
        ours, theirs = model(x).logits, hf(input_ids=x).logits
        err = float((ours.double() - theirs.double()).abs().max())
        rows.append(
            {
                "prompt": prompt.replace("\n", "\\n")[:40],
                "tokens": x.shape[1],
                "max_abs_logit_diff": f"{err:.3g}",
                "logit_scale": f"{float(ours.abs().max()):.2f}",
                "argmax_equal": bool((ours.argmax(-1) == theirs.argmax(-1)).all()),
                "hf_class": type(hf).__name__,
            }
        )
    print(
        f"  export {out}: max|dlogit| vs transformers "
        f"{max(float(r['max_abs_logit_diff']) for r in rows):.3g}",
        flush=True,
    )
    return rows


def plot(layer_rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted({r["step"] for r in layer_rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    cmap = plt.get_cmap("viridis")
    for s in steps:
        rs = [r for r in layer_rows if r["step"] == s]
        c = cmap(s / max(steps[-1], 1))
        axes[0].plot(
            [r["layer"] for r in rs], [float(r["composite_fwd"]) - 1 for r in rs], color=c, lw=1
        )
        axes[1].plot(
            [r["layer"] for r in rs], [float(r["fwd_gain_mhc"]) for r in rs], color=c, lw=1
        )
    last = [r for r in layer_rows if r["step"] == steps[-1]]
    axes[1].plot(
        [r["layer"] for r in last],
        [float(r["fwd_gain_plain"]) for r in last],
        "k--",
        lw=1,
        label=f"plain, step {steps[-1]}",
    )
    axes[0].set(
        xlabel="layer",
        ylabel="composite forward gain - 1",
        title="mHC composite mix gain (H_l...H_1)",
    )
    axes[1].set(
        xlabel="layer", ylabel="rms(out) / rms(in)", title="per-layer norm gain", yscale="log"
    )
    axes[1].legend(fontsize=8)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, steps[-1]))
    fig.colorbar(sm, ax=axes, label="step")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> None:
    from unicache_train.checkpoint.gguf import KNOWN, fetch
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.data.reference_text import reference_documents
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval import RecallTask, recall_records
    from unicache_train.eval.text import text_blocks

    args = parse(argv)
    torch.set_num_threads(args.threads)
    command = "python experiments/smollm2_mhc/smollm2_mhc_retrofit.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    out = Path(args.out)
    t0 = time.time()
    ckpt = fetch(args.checkpoint) if args.checkpoint in KNOWN else Path(args.checkpoint)
    model, _ = import_hf(ckpt)
    tok = load_tokenizer(str(ckpt))
    print(f"[{time.time() - t0:.0f}s] conversion ({machine_description()})", flush=True)
    write_csv(out / "conversion.csv", conversion_rows(model, tok, args), command)

    print(f"[{time.time() - t0:.0f}s] fine-tune", flush=True)
    mhc, plain, _, layer_rows = finetune(args, ckpt, command)
    write_csv(out / "overhead.csv", overhead_rows(mhc, plain, args), command)
    plot(layer_rows, out / "composite_gain.png")

    print(f"[{time.time() - t0:.0f}s] held-out evaluation", flush=True)
    blocks = text_blocks(tok, reference_documents("heldout"), TEXT_BLOCK, TEXT_BLOCKS)
    records = recall_records(RecallTask(**RECALL_TASK), args.num_recall, RECALL_SEED)
    evals = [evaluate(model, "base (plain = retrofit at init)", tok, blocks, records)]
    evals.append(evaluate(mhc.model, f"mhc fine-tune ({args.steps} steps)", tok, blocks, records))
    evals.append(
        evaluate(plain.model, f"plain fine-tune ({args.steps} steps)", tok, blocks, records)
    )
    write_csv(out / "eval.csv", evals, command)

    print(f"[{time.time() - t0:.0f}s] export", flush=True)
    write_csv(out / "export.csv", export_rows(mhc.model, tok, ckpt, Path(args.work)), command)
    print(f"[{time.time() - t0:.0f}s] done", flush=True)


if __name__ == "__main__":
    main()
