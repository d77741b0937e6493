"""Composite mixing gain of a deep narrow stack: unconstrained HC vs mHC, same seed, same data.

The mHC paper (arXiv 2512.24880, Fig. 3/7) reports a composite forward gain near 3000 for HC at
27B against ~1.6 for mHC. This script trains a deep, narrow decoder briefly under both residual
modes (plus the plain residual for reference) and reports what the monitor measures.

    python experiments/gain_depth/gain_depth_study.py --layers 32 --steps 150
Appends rows to experiments/gain_depth/results/gain_depth_study.csv, writes experiments/gain_depth/results/gain_depth_study.png.
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from pathlib import Path

import torch

from unicache_train.data.config import SyntheticDataConfig
from unicache_train.data.synthetic import synthetic_corpus
from unicache_train.data.tokenizer import ByteTokenizer
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.monitor.gain import mix_stats, rms
from unicache_train.train.module import causal_lm_loss

RESULTS = Path(__file__).resolve().parent / "results"


def batches(seq_len: int, batch_size: int, seed: int):
    tok = ByteTokenizer()
    ds = synthetic_corpus(SyntheticDataConfig(seed=seed, num_stories=400, num_recall=400))
    ids: list[int] = []
    for text in ds["text"]:
        ids += tok.encode(text, add_bos=True, add_eos=True)
    data = torch.tensor(ids)
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
        block = torch.stack([data[s : s + seq_len + 1] for s in starts])
        yield block[:, :-1], block[:, 1:]


def measure(model: Decoder, ids: torch.Tensor) -> dict[str, float]:
    """Composite gain of all residual mixes and the per-layer forward gains on one batch."""
    hcs = [
        getattr(layer, n)
        for layer in model.layers
        for n in ("attn_hc", "ffn_hc")
        if getattr(layer, n, None) is not None
    ]
    for hc in hcs:
        hc.record = True
    norms: list[float] = []
    hooks = [
        layer.register_forward_hook(lambda m, a, o: norms.append(rms(o))) for layer in model.layers
    ]
    with torch.no_grad():
        x0 = rms(model.embed_tokens(ids))
        model(ids)
    for h in hooks:
        h.remove()
    out = {
        "amax_layer_gain": max(b / a for a, b in zip([x0, *norms[:-1]], norms)),
        "final_over_embed": norms[-1] / x0,
    }
    if hcs:
        s = mix_stats([hc.last_coeffs.res for hc in hcs])
        out.update(composite_fwd=s.composite_fwd, composite_bwd=s.composite_bwd)
        for hc in hcs:
            hc.record, hc.last_coeffs = False, None
    return out


def run(mode: str, preset: str, args) -> list[dict[str, float]]:
    torch.manual_seed(args.seed)
    cfg = ModelConfig(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        residual_mode=mode,
        hc_mult=args.n if mode != "residual" else 1,  # a plain residual has one stream
        hc_preset=preset,
    )
    model = Decoder(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = batches(args.seq_len, args.batch_size, args.seed)
    probe_ids, _ = next(batches(args.seq_len, args.batch_size, args.seed + 1))
    rows = []
    for step in range(args.steps + 1):
        if step % args.every == 0:
            rows.append({"step": step, **measure(model, probe_ids)})
        if step == args.steps:
            break
        ids, labels = next(data)
        loss = causal_lm_loss(model(ids).logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rows[-1].setdefault("loss", loss.item())
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--n", type=int, default=4, help="hc_mult (streams)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cases = [
        ("hc", "deepseek_v4", "hc"),
        ("mhc", "deepseek_v4", "mhc deepseek_v4"),
        ("mhc", "paper", "mhc paper"),
        ("residual", "deepseek_v4", "residual"),
    ]
    results = {}
    for mode, preset, label in cases:
        t0 = time.perf_counter()
        results[label] = run(mode, preset, args)
        last = results[label][-1]
        print(
            f"{label:16s} composite_fwd={last.get('composite_fwd', float('nan')):10.4g} "
            f"composite_bwd={last.get('composite_bwd', float('nan')):10.4g} "
            f"max_layer_gain={last['amax_layer_gain']:.3g} "
            f"({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )

    RESULTS.mkdir(exist_ok=True)
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu} x{torch.get_num_threads()} torch {torch.__version__}"
    with (RESULTS / "gain_depth_study.csv").open("a", newline="") as fh:
        w = csv.writer(fh)
        if fh.tell() == 0:
            w.writerow(
                [
                    "case",
                    "layers",
                    "hidden",
                    "n",
                    "steps",
                    "lr",
                    "composite_fwd",
                    "composite_bwd",
                    "max_layer_gain",
                    "final_over_embed",
                    "machine",
                ]
            )
        for label, rows in results.items():
            last = rows[-1]
            w.writerow(
                [
                    label,
                    args.layers,
                    args.hidden,
                    args.n,
                    args.steps,
                    args.lr,
                    last.get("composite_fwd", ""),
                    last.get("composite_bwd", ""),
                    last["amax_layer_gain"],
                    last["final_over_embed"],
                    machine,
                ]
            )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in results.items():
        if "composite_fwd" in rows[0]:
            ax.plot(
                [r["step"] for r in rows], [r["composite_fwd"] for r in rows], "o-", label=label
            )
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("composite forward gain (Amax)")
    ax.set_title(f"{args.layers} layers x 2 mixes, n={args.n}, width {args.hidden}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "gain_depth_study.png", dpi=110)
    print(f"wrote {RESULTS / 'gain_depth_study.png'}")


if __name__ == "__main__":
    main()
