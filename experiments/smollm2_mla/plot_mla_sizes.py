"""Plot SmolLM2 -> MLA at several latent sizes: held-out perplexity and recall against the KV
elements per token and layer, converted and healed, beside the source and the source fine-tuned
the same steps (the rows of ``experiments/smollm2_mla/smollm2_mla.py``).

    python experiments/smollm2_mla/plot_mla_sizes.py experiments/smollm2_mla/results/mla*.csv \\
        --out experiments/smollm2_mla/results/mla_sizes.png

Rows of the same (size, rope selection, stage, steps) in several files: the last one wins;
files that are not ``smollm2_mla.py`` tables (``mla_compress*.csv``) are skipped.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def read_rows(paths: list[Path]) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for path in paths:
        lines = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]
        reader = csv.DictReader(lines)
        if not {"size", "stage", "kv_elements"} <= set(reader.fieldnames or ()):
            print(f"{path}: not a smollm2_mla.py table; skipped")
            continue
        for r in reader:
            rows[(r["size"], r["rope_selection"], r["stage"], r["heal_steps"])] = r
    return list(rows.values())


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csvs", nargs="+", type=Path)
    ap.add_argument(
        "--out", type=Path, default=Path("experiments/smollm2_mla/results/mla_sizes.png")
    )
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(args.csvs)
    fig, (ax_p, ax_r) = plt.subplots(1, 2, figsize=(11, 5))
    markers = {"converted": "o", "healed": "s", "before": "*", "fine-tuned": "D"}
    palette = iter(["tab:blue", "tab:purple", "tab:cyan", "tab:olive", "tab:brown", "tab:pink"])
    fixed = {
        ("converted", "weighted"): "tab:red",
        ("converted", "2norm"): "tab:orange",
        ("before", ""): "black",
    }
    # Conversions with no fewer KV elements than the source (full latent rank: what the shared
    # RoPE head alone costs) are a diagnostic of their own, not a point on the size curve.
    src = max((float(r["kv_elements"]) for r in rows if r["size"] == "source"), default=1e9)
    for r in rows:
        if r["stage"] == "converted" and float(r["kv_elements"]) >= src:
            r["stage"] = "full rank"
    markers["full rank"] = "x"
    fixed[("full rank", "weighted")] = "tab:gray"
    groups = sorted(
        {(r["stage"], r["rope_selection"], int(r["heal_steps"])) for r in rows},
        key=lambda g: (list(markers).index(g[0]), g[1], g[2]),
    )
    for stage, selection, steps in groups:
        sel = [
            r
            for r in rows
            if (r["stage"], r["rope_selection"], int(r["heal_steps"])) == (stage, selection, steps)
        ]
        sel.sort(key=lambda r: float(r["kv_elements"]))
        marker = markers[stage]
        color = fixed.get((stage, selection)) or (
            "tab:green" if stage == "fine-tuned" else next(palette)
        )
        label = {
            "converted": "MLA, converted",
            "before": "source (GQA)",
            "full rank": "MLA, converted at full latent rank",
            "fine-tuned": f"source + {steps} steps",
            "healed": f"MLA, healed {steps} steps",
        }[stage]
        if selection == "2norm":  # MHA2MLA's 2-norm RoPE selection
            label = f"{label} (2-norm RoPE)"
        if stage == "fine-tuned" and steps != 30:
            color = "darkgreen"
        x = [float(r["kv_elements"]) for r in sel]
        for ax, key in ((ax_p, "ppl"), (ax_r, "recall")):
            y = [float(r[key]) for r in sel]
            err = [float(r[f"{key}_se"] or 0) for r in sel]
            ax.errorbar(
                x,
                y,
                yerr=err,
                fmt=marker,
                color=color,
                label=label,
                capsize=3,
                linestyle="none" if stage in ("before", "fine-tuned") else "-",
            )
        for r in sel:
            if r["size"] != "source":
                ax_p.annotate(
                    r["size"],
                    (float(r["kv_elements"]), float(r["ppl"])),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
    ax_p.set_yscale("log")
    ax_p.set_ylabel("held-out perplexity (log)")
    ax_r.set_ylabel("8-pair recall (held-out seeds)")
    ax_r.set_ylim(-0.05, 1.05)
    for ax in (ax_p, ax_r):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV elements per token and layer (log2)")
        ax.grid(alpha=0.3)
    handles, labels_ = ax_r.get_legend_handles_labels()
    fig.legend(handles, labels_, fontsize=8, loc="lower center", ncol=4, frameon=False)
    fig.suptitle("SmolLM2-135M GQA -> MLA: error bars are standard errors")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
