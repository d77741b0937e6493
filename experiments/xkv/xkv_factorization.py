"""xKV's factorisations side by side: time of the fit and what each costs in quality.

``XKVConfig.factorization`` chooses how a group's basis is computed (``"svd"``, the reference;
``"gram"``, the eigendecomposition of the smaller Gram matrix; ``"lowrank"``, a randomized range
finder; see ``unicache_train/compress/xkv/factor.py``), and ``refresh_every > 1`` pools one basis
over the batch and reuses it. This script records one batch's context once, then for every
variant:

* ``fit_ms``: median CPU time of ``XKVCompressor.fit`` on that recording (all groups, K and V;
  variants timed round-robin, so load on a shared machine hits them alike); ``fit_vs_svd``;
* ``rel_err_k`` / ``rel_err_v``: ``||X̂ - X||_F / ||X||_F`` of the factorised context, mean over
  layers, and ``err_excess_k`` / ``err_excess_v``: that error over the SVD's at the same ranks,
  minus 1 (0 = as good as the SVD; the SVD's truncation is optimal, so the excess is >= 0 up
  to round-off);
* ``kl_vs_svd``: mean KL(SVD-compressed || variant-compressed) of the next-token distributions
  on the continuation (the in-loop forward, same splits), beside ``kl_compression``:
  KL(uncompressed || variant-compressed), what the compression itself costs;
* ``kv_reduction``: the stored bytes' reduction (the same ranks, so the same bytes, for every
  per-sample variant).

*Faithful* (the bar the default must meet): ``err_excess`` <= 0.01 for K and V and
``kl_vs_svd`` <= 0.05 x the SVD's ``kl_compression`` (the variant moves the output by less than
a twentieth of what compressing does).

Usage:
  python experiments/xkv/xkv_factorization.py                         # the tiny bench model (random)
  python experiments/xkv/xkv_factorization.py --hf smollm2 --batch-size 4 --seq-len 192 --threads 1
  python experiments/xkv/xkv_factorization.py \
      --checkpoint runs/finetune_compress/pretrain/checkpoints/last.ckpt
  python experiments/xkv/xkv_factorization.py --hf smollm2 --batch-size 4 --seq-len 192 --gradients
      # exact vs causal gradient: cosine of the parameter gradients (xkv_gradient_modes.csv)

Appends one row per variant to ``experiments/xkv/results/xkv_factorization.csv``. Never imported by the
library.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import add_common_arguments, bench_data, load_batches, report

from unicache_train.compress.config import XKVConfig
from unicache_train.compress.xkv import XKVCompressor
from unicache_train.inloop import IGNORE_INDEX, sample_splits, step_generator
from unicache_train.model.config import ModelConfig
from unicache_train.seam import RecordedContext, RecordingCompressor

VARIANTS = {
    "svd": dict(factorization="svd"),
    "gram": dict(factorization="gram"),
    "lowrank": dict(factorization="lowrank"),
    "svd_pooled": dict(factorization="svd", refresh_every=8),
    "gram_pooled": dict(factorization="gram", refresh_every=8),
}


def _model(args):
    """(decoder, tokenizer name) of ``--hf``, ``--checkpoint`` or the tiny bench model."""
    from unicache_train.model import Decoder

    if args.hf:
        from unicache_train.checkpoint.gguf import KNOWN, fetched_dir
        from unicache_train.checkpoint.hf import import_hf

        d = fetched_dir(args.hf) if args.hf in KNOWN else Path(args.hf)
        return import_hf(d)[0].eval(), str(d)
    if args.checkpoint:
        from unicache_train.train.module import LMModule

        module = LMModule.load_from_checkpoint(args.checkpoint, map_location="cpu")
        return module.model.eval(), "byte"
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return Decoder(cfg).eval(), "byte"


def _excess(stats: dict[str, float], ref: dict[str, float], key: str) -> float:
    """stats[key] / ref[key] - 1 (NaN when the key is absent: MLA has no separate values)."""
    return stats.get(key, float("nan")) / ref.get(key, float("nan")) - 1


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean KL(softmax(p) || softmax(q)) over the masked positions."""
    p = F.log_softmax(p_logits[mask].double(), -1)
    q = F.log_softmax(q_logits[mask].double(), -1)
    return float(F.kl_div(q, p, log_target=True, reduction="sum") / max(int(mask.sum()), 1))


@torch.no_grad()
def run(args) -> list[dict[str, str]]:
    model, tok = _model(args)
    data = bench_data(args, tok)
    batch = load_batches(data, 1)[0]
    ids, labels = batch["input_ids"], batch["labels"]
    T = ids.shape[1]
    split = sample_splits(
        labels, batch.get("split"), min_context=32, generator=step_generator(0, 10_000)
    )
    comps = {
        name: XKVCompressor(
            XKVConfig(
                group_size=args.group_size, rank_mode="reduction", reduction=args.reduction, **kw
            )
        )
        for name, kw in VARIANTS.items()
    }
    rec = RecordingCompressor(pre_rope=True)
    model(ids[:, : int(split.max())], split=split, compressor=rec)
    context = RecordedContext(rec.inputs, rec.segments, int(split.max()), model.rotary)
    times: dict[str, list[float]] = {n: [] for n in comps}
    for r in range(args.repeats + 1):  # round-robin; the first round warms up
        for name, comp in comps.items():
            c0 = time.process_time()
            comp.fit(context, step=r if comp.config.refresh_every > 1 else None)
            if r:
                times[name].append(time.process_time() - c0)
    plain = model(ids).logits
    cont = (torch.arange(T)[None, :] >= split[:, None] - 1) & (labels != IGNORE_INDEX)
    outs = {}
    for name, comp in comps.items():
        comp._pooled, comp._pooled_step = {}, None  # a fresh pooled basis of this batch
        out = model(ids, split=split, compressor=comp, step=0)
        stats = out.compression_stats
        st = {
            k: statistics.fmean(float(s[k]) for s in stats)
            for k in stats[0]
            if k.startswith("xkv_")
        }
        # the forward's reduction: every layer's uncompressed bytes over every layer's stored
        stored = sum(float(s["kv_bytes"]) for s in stats)
        st["kv_reduction"] = sum(float(s["kv_bytes"] * s["kv_reduction"]) for s in stats) / stored
        outs[name] = (out.logits, st)
    ref_logits, ref_stats = outs["svd"]
    ref_kl = _kl(plain, ref_logits, cont)
    ref_fit = statistics.median(times["svd"])
    rows = []
    for name, (logits, st) in outs.items():
        fit = statistics.median(times[name])
        kl_svd = _kl(ref_logits, logits, cont)
        row = {
            "variant": name,
            "fit_ms": f"{fit * 1e3:.1f}",
            "fit_vs_svd": f"{fit / ref_fit:.3f}",
            "rel_err_k": f"{st['xkv_rel_error_k']:.5f}",
            "rel_err_v": f"{st.get('xkv_rel_error_v', float('nan')):.5f}",
            "err_excess_k": f"{_excess(st, ref_stats, 'xkv_rel_error_k'):.2e}",
            "err_excess_v": f"{_excess(st, ref_stats, 'xkv_rel_error_v'):.2e}",
            "kl_vs_svd": f"{kl_svd:.3e}",
            "kl_compression": f"{_kl(plain, logits, cont):.4e}",
            "kl_vs_svd_over_compression": f"{kl_svd / max(ref_kl, 1e-30):.3e}",
            "kv_reduction": f"{st['kv_reduction']:.2f}",
        }
        rows.append(row)
    return rows


def gradient_agreement(args) -> list[dict[str, str]]:
    """Cosine between the parameter gradients of the in-loop loss (continuation LM loss +
    ``--kl-weight`` x KL) under ``gradient="exact"`` and ``"causal"`` (``--gradients``).

    The causal gradient lets the KL term's uncompressed forward double as xKV's recording pass
    (no extra prefill, no backward through it); the forward numbers are the same, only the
    gradient's paths into later group members differ.
    """
    from unicache_train.inloop import compression_kl, continuation_mask, masked_lm_loss

    model, tok = _model(args)
    model.train()
    batch = load_batches(bench_data(args, tok), 1)[0]
    ids, labels = batch["input_ids"], batch["labels"]
    split = sample_splits(
        labels, batch.get("split"), min_context=32, generator=step_generator(0, 10_000)
    )
    cont = continuation_mask(split, ids.shape[1])
    grads = {}
    for mode in ("exact", "causal"):
        model.zero_grad(set_to_none=True)
        comp = XKVCompressor(
            XKVConfig(
                group_size=args.group_size,
                rank_mode="reduction",
                reduction=args.reduction,
                gradient=mode,
                factorization=args.factorization,
            )
        )
        out = model(ids, split=split, compressor=comp, reference_logits=args.kl_weight > 0)
        loss = masked_lm_loss(out.logits, labels, cont)
        if args.kl_weight > 0:
            targets = cont & (labels != IGNORE_INDEX)
            loss = loss + args.kl_weight * compression_kl(out.reference_logits, out.logits, targets)
        loss.backward()
        grads[mode] = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
    names = sorted(set(grads["exact"]) & set(grads["causal"]))
    flat = {m: torch.cat([grads[m][n].flatten().double() for n in names]) for m in grads}
    per = {
        n: float(
            F.cosine_similarity(
                grads["exact"][n].flatten().double(), grads["causal"][n].flatten().double(), dim=0
            )
        )
        for n in names
    }
    worst = min(per, key=per.get)
    kv = [v for n, v in per.items() if "k_proj" in n or "v_proj" in n]
    return [
        {
            "kl_weight": f"{args.kl_weight:g}",
            "cosine_all": f"{float(F.cosine_similarity(flat['exact'], flat['causal'], dim=0)):.4f}",
            "norm_ratio": f"{float(flat['causal'].norm() / flat['exact'].norm()):.4f}",
            "cosine_kv_proj_min": f"{min(kv):.4f}",
            "cosine_kv_proj_mean": f"{statistics.fmean(kv):.4f}",
            "worst_tensor": worst,
            "worst_cosine": f"{per[worst]:.4f}",
        }
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(p)
    p.add_argument("--hf", default=None, help="a fetched checkpoint name (smollm2) or HF dir")
    p.add_argument("--checkpoint", default=None, help="a Lightning checkpoint of this project")
    p.add_argument("--reduction", type=float, default=4.0)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument(
        "--gradients",
        action="store_true",
        help="instead: cosine of the exact and causal gradients (gradient_agreement)",
    )
    p.add_argument("--kl-weight", type=float, default=0.5, help="--gradients' KL weight")
    p.add_argument("--factorization", default="gram", help="--gradients' factorisation")
    p.set_defaults(repeats=5)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.hf or (Path(args.checkpoint).name if args.checkpoint else "tiny (random)")
    if args.gradients:
        setup = {
            "model": name,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "reduction": args.reduction,
            "group_size": args.group_size,
        }
        report(
            f"xKV exact vs causal gradient, {name}",
            gradient_agreement(args),
            "xkv_gradient_modes",
            setup,
        )
        return
    rows = run(args)
    title = (
        f"xKV factorisations, {name}, B={args.batch_size}, T={args.seq_len}, "
        f"{args.reduction:g}x groups of {args.group_size}, {args.repeats} repeats"
    )
    setup = {
        "model": name,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "reduction": args.reduction,
        "group_size": args.group_size,
        "repeats": args.repeats,
    }
    report(title, rows, "xkv_factorization", setup)


if __name__ == "__main__":
    main()
