"""Which norm rescale should a merged KV entry get? Measured on the real caches of a model.

UniCache merges a redundant token into a kept neighbour as the importance-weighted average of
their K and of their V, and attention adds ``log(count)`` to the merged entry's logit. The
source rescales both averages to the members' mean norm; with the log-count bias the plain
average of V is exact for agreeing keys. Rules compared (``MergeEvictConfig.merge_rescale``):

  (a) ``kv``: rescale K and V (the source, §6.2);  (b) ``k``: rescale K, average V;
  (c) ``none``: plain averages.

One more variant, measured here only (not a config option): (b') rule ``k`` with *equal* member
weights instead of the importance softmax (the script zeroes the scores the merge sees; the
selection still uses them). With equal weights and identical keys the merged V is exact; with
importance weights it leans towards the more important member.

Model: ``--checkpoint`` (one of our Lightning checkpoints) or, by default, the tiny recipe
model (``recipes/pretrain_tiny.yaml`` sizes and data) pretrained here for ``--steps`` steps
with a plain loop (cached under ``runs/merge_rule_study/``). Per rule and target rate:

* attention-output error per layer: the decoder's own in-loop forward with a recording
  compressor captures every layer's real post-RoPE queries, keys and values and its segment;
  for each continuation query, attention written out here over ``[segment (log-count bias) ;
  causal continuation]`` is compared with attention over ``[original context ; causal
  continuation]`` (``rel_err``, mean over queries, heads and samples of
  ``|o_comp - o_ref| / |o_ref|``), and with attention over the context tokens the segment
  stands for, evicted tokens left out (``rel_err_merged``: the merging error alone);
* quality after compression: :func:`unicache_train.eval.sweep.evaluate_compression` on the
  validation split (continuation perplexity, output KL, attention KL of the last layers), called
  per batch and token-weighted over batches, so that ``d_nll_vs_b`` / ``d_output_kl_vs_b`` (the
  paired difference of the continuation NLL per token / output KL to rule (b)) come with a
  standard error over batches (``*_se``).

Pipeline: the default preset with head merging and quantization off (both act the same under
every rule and would only add to every row). The text-only tiny model meets the default text
cap (0.40), so the realized rate (``realized_rate``: context tokens removed) is shown beside the
target.

    OMP_NUM_THREADS=1 python experiments/merge_rule/merge_rule_study.py [--steps 300] [--rates 0.3 0.6]
Writes experiments/merge_rule/results/merge_rule_study.csv (one row per rule x rate x layer, plus a ``mean``
row per rule x rate that carries the quality columns).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import math
import platform
import time
from pathlib import Path

import torch

import unicache_train.compress.merge_evict as merge_evict
from unicache_train.compress import UniCacheCompressor, UniCacheConfig
from unicache_train.data.datamodule import LMDataModule
from unicache_train.eval.sweep import CompressionEvalConfig, evaluate_compression
from unicache_train.inloop import continuation_mask, sample_splits, step_generator
from unicache_train.model import Decoder
from unicache_train.seam import CompressionInput, KVSegment
from unicache_train.train.config import RunConfig
from unicache_train.train.module import IGNORE_INDEX, causal_lm_loss, warmup_cosine

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
RULES = {"a": "kv", "b": "k", "c": "none", "b'": "k"}  # b': equal merge weights
COLUMNS = (
    "rule",
    "merge_rescale",
    "target_rate",
    "layer",
    "realized_rate",
    "merged_fraction",
    "evicted_fraction",
    "rel_err",
    "rel_err_merged",
    "ppl",
    "ppl_delta",
    "output_kl",
    "attn_kl",
    "d_nll_vs_b",
    "d_nll_se",
    "d_output_kl_vs_b",
    "d_output_kl_se",
    "train_steps",
    "val_batches",
)


# --------------------------------------------------------------------------------- the model
def pretrained_tiny(steps: int, seed: int) -> tuple[Decoder, RunConfig]:
    """The tiny recipe model trained for ``steps`` steps (AdamW, the recipe's lr and warmup,
    cosine decay); the weights are cached by step count and seed."""
    cfg = RunConfig.load(ROOT / "recipes" / "pretrain_tiny.yaml")
    torch.manual_seed(seed)
    model = Decoder(cfg.model)
    cache = ROOT / "runs" / "merge_rule_study" / f"tiny_{steps}steps_seed{seed}.pt"
    if cache.is_file():
        model.load_state_dict(torch.load(cache, map_location="cpu", weights_only=True))
        return model.eval(), cfg
    dm = LMDataModule(cfg.data)
    loader = dm.train_dataloader()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.1)
    model.train()
    t0, step = time.perf_counter(), 0
    while step < steps:
        for batch in loader:
            if step >= steps:
                break
            for g in opt.param_groups:
                g["lr"] = cfg.train.lr * warmup_cosine(step, cfg.train.warmup_steps, steps, 0.1)
            loss = causal_lm_loss(model(batch["input_ids"]).logits, batch["labels"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 50 == 0 or step == steps:
                print(
                    f"step {step}/{steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)",
                    flush=True,
                )
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), cache)
    return model.eval(), cfg


def load_model(args) -> tuple[Decoder, RunConfig]:
    if args.checkpoint:
        from unicache_train.checkpoint.lightning_ckpt import load_checkpoint

        return load_checkpoint(args.checkpoint)
    return pretrained_tiny(args.steps, args.seed)


# --------------------------------------------------------------------------------- settings
def study_config(rule: str, rate: float) -> UniCacheConfig:
    """The default preset at ``rate`` with merge rule ``rule``; head merge and quantization off."""
    d = UniCacheConfig(target_rate=rate).to_dict()
    d["head_merge"]["enabled"] = False
    d["quantize"] = {**d["quantize"], "enabled": False, "bits": None}
    d["merge_evict"]["merge_rescale"] = rule
    return UniCacheConfig.from_dict(d)


class Recorder:
    """Wraps a compressor and keeps each layer's input and segment of the last forward."""

    pre_rope = False

    def __init__(self, inner: UniCacheCompressor) -> None:
        self.inner = inner
        self.calls: dict[int, tuple[CompressionInput, KVSegment]] = {}

    def __call__(self, inp: CompressionInput) -> KVSegment:
        seg = self.inner(inp)
        self.calls[inp.layer_idx] = (inp, seg)
        return seg


@contextlib.contextmanager
def equal_merge_weights(on: bool):
    """Within the block, merging averages members with equal weights (scores seen as 0)."""
    orig = merge_evict.merge_tokens

    def merge_tokens(keys, values, plan, scores, context_mask, rescale="k"):
        return orig(keys, values, plan, torch.zeros_like(scores), context_mask, rescale=rescale)

    if on:
        merge_evict.merge_tokens = merge_tokens
    try:
        yield
    finally:
        merge_evict.merge_tokens = orig


# --------------------------------------------------------------------------------- attention
def _attend(q, k, v, bias) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + bias) v in float64; q [H, Q, D], k [H, N, D], v [H, N, Dv],
    bias [Q, N] -> [H, Q, Dv]."""
    q, k, v = q.double(), k.double(), v.double()
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias.double()
    return torch.softmax(logits, -1) @ v


def _continuation_out(inp: CompressionInput, b: int, s: int, k_ctx, v_ctx, bias_ctx):
    """Attention output [H, C, Dv] of sample ``b``'s continuation queries over ``[context
    entries k_ctx, v_ctx ([Hk, N, D]) with logit bias bias_ctx ([1, N]) ; causal continuation]``.
    """
    H, T = inp.queries.shape[1], inp.queries.shape[2]
    rep = H // inp.keys.shape[1]
    C = T - s
    causal = torch.where(torch.arange(C)[None, :] <= torch.arange(C)[:, None], 0.0, -math.inf)
    k = torch.cat([k_ctx, inp.keys[b, :, s:]], 1).repeat_interleave(rep, 0)  # [H, N + C, D]
    v = torch.cat([v_ctx, inp.values[b, :, s:]], 1).repeat_interleave(rep, 0)
    bias = torch.cat([bias_ctx.expand(C, -1), causal], 1)  # [C, N + C]
    return _attend(inp.queries[b, :, s:], k, v, bias)


def layer_errors(inp: CompressionInput, seg: KVSegment, split: torch.Tensor) -> tuple[float, float]:
    """Mean relative attention-output error of the continuation queries of one layer.

    Returns:
        (against all original context tokens, against the tokens the segment stands for).
    """
    errs_all, errs_merged = [], []
    for b in range(inp.queries.shape[0]):
        s = int(split[b])
        k, v = inp.keys[b, :, :s], inp.values[b, :, :s]  # [Hk, s, D] original context
        ref = _continuation_out(inp, b, s, k, v, torch.zeros(1, s))
        stands = seg.assignment[b, :s] >= 0  # [s] kept or merged (not evicted)
        ref_m = _continuation_out(
            inp, b, s, k[:, stands], v[:, stands], torch.zeros(1, int(stands.sum()))
        )
        keep = seg.valid[b]
        comp = _continuation_out(
            inp,
            b,
            s,
            seg.keys[b][:, keep],
            seg.values[b][:, keep],
            torch.log(seg.counts[b, keep].double())[None],
        )
        errs_all.append(((comp - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)).flatten())
        errs_merged.append(
            ((comp - ref_m).norm(dim=-1) / ref_m.norm(dim=-1).clamp_min(1e-12)).flatten()
        )
    return torch.cat(errs_all).mean().item(), torch.cat(errs_merged).mean().item()


@torch.no_grad()
def attention_stats(model, batch, split, rule: str, rate: float) -> list[dict[str, float]]:
    """Per-layer errors and segment stats of one rule and rate on one batch."""
    rec = Recorder(UniCacheCompressor(study_config(rule, rate)))
    model(batch["input_ids"], modality_ids=batch.get("modality_ids"), split=split, compressor=rec)
    out = []
    for layer in range(model.config.num_hidden_layers):
        inp, seg = rec.calls[layer]
        e_all, e_merged = layer_errors(inp, seg, split)
        out.append(
            {
                "rel_err": e_all,
                "rel_err_merged": e_merged,
                "realized_rate": float(seg.stats["rate_realized"]),
                "merged_fraction": float(seg.stats["merged_fraction"]),
                "evicted_fraction": float(seg.stats["evicted_fraction"]),
            }
        )
    return out


def measure_batch(model, dm, cfg, batch, i: int, rule: str, rates, opts) -> list[dict]:
    """Quality (evaluate_compression on this batch alone) and per-layer attention stats, per
    rate. Batch ``i`` draws its splits from ``split_seed = i`` in both."""
    o = dataclasses.replace(opts, split_seed=i, limit_batches=1)
    rows = evaluate_compression(
        model, dm.tokenizer, cfg.data, study_config(rule, 0.0), o, loader=[batch]
    )
    labels = batch["labels"]
    split = sample_splits(
        labels,
        batch.get("split"),
        min_context=o.min_context,
        generator=step_generator(o.split_seed, 0),
    )  # as evaluate_compression
    T = labels.shape[1]
    labelled = labels != IGNORE_INDEX
    n_tok = int((continuation_mask(split, T) & labelled).sum())  # targets of its NLL and KL
    n_q = int(((torch.arange(T)[None] >= split[:, None]) & labelled).sum())  # its attn-KL queries
    out = []
    for rate, q in zip(rates, rows[1:]):
        out.append(
            {
                "nll": math.log(q["ppl"]),
                "nll_plain": math.log(rows[0]["ppl"]),
                "output_kl": q["output_kl"],
                "attn_kl": q["attn_kl"],
                "n_tok": n_tok,
                "n_q": n_q,
                "layers": attention_stats(model, batch, split, rule, rate),
            }
        )
    return out


def aggregate(per_batch: list[dict], ref: list[dict] | None) -> dict[str, float]:
    """Token-weighted quality over batches (what one evaluate_compression call over all of them
    reports) and the paired difference to the reference rule with its standard error."""
    w = torch.tensor([b["n_tok"] for b in per_batch], dtype=torch.float64)
    wq = torch.tensor([b["n_q"] for b in per_batch], dtype=torch.float64)

    def col(rows, key):
        return torch.tensor([b[key] for b in rows], dtype=torch.float64)

    nll, plain = (col(per_batch, k) @ w / w.sum() for k in ("nll", "nll_plain"))
    out = {
        "ppl": math.exp(nll),
        "ppl_delta": math.exp(nll - plain) - 1.0,
        "output_kl": float(col(per_batch, "output_kl") @ w / w.sum()),
        "attn_kl": float(col(per_batch, "attn_kl") @ wq / wq.sum()),
    }
    if ref is not None:
        n = len(per_batch)
        for key, name in (("nll", "d_nll"), ("output_kl", "d_output_kl")):
            d = col(per_batch, key) - col(ref, key)  # [batches] paired differences
            out[f"{name}_vs_b"] = float(d @ w / w.sum())
            out[f"{name}_se"] = float(d.std() / math.sqrt(n)) if n > 1 else math.nan
    return out


# --------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--checkpoint",
        default=None,
        help="a Lightning .ckpt of ours (default: pretrain the tiny recipe model here)",
    )
    ap.add_argument("--steps", type=int, default=300, help="pretraining steps of the tiny model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.3, 0.6])
    ap.add_argument("--batches", type=int, default=8, help="validation batches (16 x 256)")
    ap.add_argument("--out", default=str(RESULTS / "merge_rule_study.csv"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    model, cfg = load_model(args)
    dm = LMDataModule(cfg.data)
    batches = list(dm.val_dataloader())[: args.batches]
    opts = CompressionEvalConfig(rates=list(args.rates), quantize="none", num_recall=0)
    runs = {}  # rule name -> [batch][rate] measurements
    for name, rule in RULES.items():
        with equal_merge_weights(name == "b'"):
            runs[name] = [
                measure_batch(model, dm, cfg, batch, i, rule, args.rates, opts)
                for i, batch in enumerate(batches)
            ]
        print(f"rule ({name}) {rule} measured ({time.perf_counter() - t0:.0f}s)", flush=True)
    out_rows = []
    L = model.config.num_hidden_layers
    for name, rule in RULES.items():
        for j, rate in enumerate(args.rates):
            per_batch = [b[j] for b in runs[name]]
            ref = [b[j] for b in runs["b"]] if name != "b" else None
            base = {
                "rule": name,
                "merge_rescale": rule,
                "target_rate": rate,
                "train_steps": 0 if args.checkpoint else args.steps,
                "val_batches": len(batches),
            }
            layers = [
                {
                    k: sum(b["layers"][li][k] for b in per_batch) / len(per_batch)
                    for k in per_batch[0]["layers"][0]
                }
                for li in range(L)
            ]
            for li, lay in enumerate(layers):
                out_rows.append({**base, "layer": li, **lay})
            mean = {k: sum(lay[k] for lay in layers) / L for k in layers[0]}
            m = {**base, "layer": "mean", **mean, **aggregate(per_batch, ref)}
            out_rows.append(m)
            print(
                f"({name:2}) {rule:>4} rate {rate:g}: realized {m['realized_rate']:.3f} "
                f"merged {m['merged_fraction']:.3f} rel_err {m['rel_err']:.4f} "
                f"rel_err_merged {m['rel_err_merged']:.5f} ppl {m['ppl']:.4f} "
                f"({100 * m['ppl_delta']:+.2f}%) out_kl {m['output_kl']:.5f} "
                f"d_nll {m.get('d_nll_vs_b', 0.0):+.5f} +- {m.get('d_nll_se', 0.0):.5f}",
                flush=True,
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "OMP_NUM_THREADS=1 python experiments/merge_rule/merge_rule_study.py " + " ".join(
        f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if v is not None and k != "out"
    )
    with out.open("w", newline="") as f:
        f.write(
            f"# {cmd}\n# {platform.processor() or platform.machine()}, torch "
            f"{torch.__version__}, {time.perf_counter() - t0:.0f}s\n"
        )
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for row in out_rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    print(f"wrote {out} ({time.perf_counter() - t0:.0f}s)")


if __name__ == "__main__":
    main()
