"""Cross-layer alignment analysis (the observation behind xKV, arXiv 2503.18893 §3).

For each model, the context keys (pre-RoPE) and values of every layer on validation batches of
the bundled corpus, and between every pair of layers: the overlap of the dominant token-side
singular subspaces (mean squared cosine of the principal angles; ``r / M`` for random subspaces)
and linear CKA (:mod:`unicache_train.compress.xkv.alignment`). Writes a heat-map PNG (one row
per model: overlap K, overlap V, CKA K, CKA V), the matrices as CSV and a summary table
(adjacent vs distant layers).

Models:
  * ``--checkpoint``: our tiny checkpoint (default: the finetune_compress recipe's pretrained
    base, ``runs/finetune_compress/pretrain/checkpoints/last.ckpt``);
  * ``--hf-family llama qwen3``: tiny *randomly initialised* HF models built from a config,
    saved with ``save_pretrained`` and loaded through our importer (no hub access here, so no
    pretrained HF weights: this shows what a random network does, not what a trained one does).

Usage:
  OMP_NUM_THREADS=1 python experiments/xkv/xkv_alignment.py
  python experiments/xkv/xkv_alignment.py --checkpoint CKPT --hf-family llama --batches 2

Outputs under ``--out`` (default: ``results/`` beside this script): ``xkv_alignment.png``,
``xkv_alignment.csv`` (long format), ``xkv_alignment_summary.csv``. Never imported by the library.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path

import torch

from unicache_train.compress.xkv.alignment import (
    LayerAlignment,
    collect_context_kv,
    layer_alignment,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CKPT = ROOT / "runs" / "finetune_compress" / "pretrain" / "checkpoints" / "last.ckpt"


def hf_tiny(family: str, tmp: Path, layers: int = 4):
    """A tiny random HF model of ``family`` saved with save_pretrained and imported by us."""
    import transformers

    from unicache_train.checkpoint.hf import import_hf

    common = dict(
        vocab_size=260,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    cfg = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=32),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
    }[family]()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    path = tmp / family
    hf.save_pretrained(path)
    model, _ = import_hf(path)
    return model.eval()


def batches(data_cfg, n: int) -> list[dict[str, torch.Tensor]]:
    from unicache_train.data.datamodule import LMDataModule

    dm = LMDataModule(data_cfg)
    dm.setup("validate")
    out = []
    for b in dm.val_dataloader():
        out.append(b)
        if len(out) >= n:
            break
    return out


def analyse(model, data: list[dict[str, torch.Tensor]], rank_fraction: float) -> LayerAlignment:
    """Alignment over every sample of ``data`` (the whole non-padding sequence is the context)."""
    from unicache_train.inloop import IGNORE_INDEX

    keys, values, masks = None, None, []
    for b in data:
        ids, labels = b["input_ids"], b["labels"]
        T = ids.shape[1]
        pos = torch.arange(T)
        length = torch.where(labels != IGNORE_INDEX, pos + 1, 0).amax(1).clamp(2, T)
        k, v, m = collect_context_kv(model, ids, length)
        keys = k if keys is None else [torch.cat([a, c]) for a, c in zip(keys, k)]
        values = v if values is None else [torch.cat([a, c]) for a, c in zip(values, v)]
        masks.append(m)
    assert keys is not None and values is not None
    return layer_alignment(keys, values, torch.cat(masks), rank_fraction)


def plot(results: dict[str, LayerAlignment], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: before pyplot is imported
    import matplotlib.pyplot as plt

    names = list(results)
    panels = (
        ("overlap_k", "subspace overlap K"),
        ("overlap_v", "subspace overlap V"),
        ("cka_k", "linear CKA K"),
        ("cka_v", "linear CKA V"),
    )
    fig, axes = plt.subplots(len(names), 4, figsize=(16, 3.6 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        res = results[name]
        for col, (attr, title) in enumerate(panels):
            ax = axes[row][col]
            m = getattr(res, attr).numpy()
            im = ax.imshow(m, vmin=0.0, vmax=1.0, cmap="viridis")
            L = m.shape[0]
            for i in range(L):
                for j in range(L):
                    ax.text(
                        j,
                        i,
                        f"{m[i, j]:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="w" if m[i, j] < 0.6 else "k",
                    )
            extra = f" (random {res.random_overlap:.2f})" if attr.startswith("overlap") else ""
            ax.set_title(f"{name}: {title}{extra}", fontsize=9)
            ax.set_xticks(range(L))
            ax.set_yticks(range(L))
            ax.set_xlabel("layer")
            ax.set_ylabel("layer")
            fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(
        "cross-layer alignment of the context KV cache (token-side top-r subspaces, pre-RoPE keys)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_tables(results: dict[str, LayerAlignment], out: Path) -> list[dict]:
    with (out / "xkv_alignment.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["model", "measure", "layer_a", "layer_b", "value"])
        for name, res in results.items():
            for attr in ("overlap_k", "overlap_v", "cka_k", "cka_v"):
                m = getattr(res, attr)
                for i in range(m.shape[0]):
                    for j in range(m.shape[1]):
                        w.writerow([name, attr, i, j, f"{float(m[i, j]):.4f}"])
    rows = [{"model": n, "samples": r.samples, **r.summary()} for n, r in results.items()]
    with (out / "xkv_alignment_summary.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(DEFAULT_CKPT), help="'' to skip")
    p.add_argument("--hf-family", nargs="*", default=["llama", "qwen3"])
    p.add_argument("--batches", type=int, default=2, help="validation batches (16 samples each)")
    p.add_argument("--rank-fraction", type=float, default=0.25)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from unicache_train.data.config import DataConfig

    data_cfg = DataConfig(seq_len=256, batch_size=16, pack=False)
    results: dict[str, LayerAlignment] = {}
    with torch.no_grad():
        if args.checkpoint:
            from unicache_train.checkpoint import load_checkpoint

            model, cfg = load_checkpoint(args.checkpoint)
            data_cfg = DataConfig(**{**cfg.data.__dict__, "pack": False, "batch_size": 16})
            results["ours (trained tiny)"] = analyse(
                model.eval(), batches(data_cfg, args.batches), args.rank_fraction
            )
        data = batches(data_cfg, args.batches)
        with tempfile.TemporaryDirectory() as tmp:
            for fam in args.hf_family:
                model = hf_tiny(fam, Path(tmp))
                results[f"HF {fam} (random init)"] = analyse(model, data, args.rank_fraction)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "xkv_alignment.png")
    rows = write_tables(results, out)
    keys = list(rows[0])
    print("  ".join(f"{k:>22}" for k in keys))
    for r in rows:
        cells = (f"{v:>22.4g}" if isinstance(v, float) else f"{v!s:>22}" for v in r.values())
        print("  ".join(cells))
    print(f"wrote {out / 'xkv_alignment.png'} and the CSVs beside it")


if __name__ == "__main__":
    main()
