"""Tables and paired tests of the SmolLM2 evidence re-measure, from the raw per-prompt files.

Accuracies carry 95% Wilson intervals; differences between two models (or two settings) on the
same prompts carry the exact McNemar p; perplexity changes carry a 95% paired bootstrap interval
over the same blocks (:mod:`unicache_train.eval.stats`). Pooled tests take both training seeds
(control seed k vs compress seed k) with the prompt as the unit: the exact sign-flip test on each
prompt's difference summed over the seeds (``sign_flip_clustered``); the McNemar p of the
concatenated pairs, which counts each prompt once per seed as if independent, is shown beside it
for one release.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from unicache_train.eval.stats import (
    format_p,
    mcnemar_exact,
    paired_bootstrap_ppl,
    sign_flip_clustered,
    wilson_interval,
)

SETTING_TITLE = {
    "none": "uncompressed",
    "unicache_int8_4x": "UniCache int8 4x",
    "unicache_int4_4x": "UniCache int4 4x",
    "unicache_int4_8x": "UniCache int4 8x",
    "int4_plain": "plain int4 (no eviction)",
}


def _read(path: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    meta_path = path.with_suffix(".meta.json")
    return rows, (json.loads(meta_path.read_text()) if meta_path.is_file() else {})


def load(raw: Path) -> dict[tuple[str, str, str], tuple[list[dict], dict]]:
    """``{(model, task, setting): (rows, meta)}`` of every finished cell."""
    out = {}
    for path in sorted(raw.glob("*/*.jsonl")):
        task, _, setting = path.stem.partition("__")
        out[(path.parent.name, task, setting)] = _read(path)
    return out


def _models(cells) -> list[str]:
    names = {m for m, _, _ in cells}
    key = {n: (1 if n.startswith("control") else 2, n) for n in names if n != "base"}
    key["base"] = (0, "")
    return sorted(names, key=lambda n: key.get(n, (3, n)))


def _acc_cell(rows: list[dict], meta: dict) -> str:
    hits, n = sum(r["correct"] for r in rows), len(rows)
    lo, hi = wilson_interval(hits, n)
    red = meta.get("kv_reduction")
    tail = f" · {red:.2f}x" if red and red == red and abs(red - 1) > 1e-6 else ""
    return f"{hits / n:.2f} [{lo:.2f}, {hi:.2f}]{tail}"


def _correct(rows: list[dict]) -> dict[str, bool]:
    return {r["id"]: bool(r["correct"]) for r in rows}


def paired(a_rows, b_rows) -> tuple[list[bool], list[bool]]:
    """Correctness of A and B on the prompt ids both answered, in A's order."""
    a, b = _correct(a_rows), _correct(b_rows)
    ids = [i for i in a if i in b]
    return [a[i] for i in ids], [b[i] for i in ids]


def paired_by_seed(
    per_seed: list[tuple[list[dict], list[dict]]],
) -> tuple[list[list[bool]], list[list[bool]]]:
    """``[(a_rows, b_rows), ...]`` one per seed -> ``(a, b)`` with ``a[k][i]``: A's seed ``k``
    on prompt ``i``, over the prompt ids every seed of both arms answered, in seed 0's A order
    (the input of :func:`sign_flip_clustered`)."""
    maps = [(_correct(x), _correct(y)) for x, y in per_seed]
    ids = [i for i in maps[0][0] if all(i in a and i in b for a, b in maps)]
    return [[a[i] for i in ids] for a, _ in maps], [[b[i] for i in ids] for _, b in maps]


def _pooled_line(label: str, per_seed: list[tuple[list[dict], list[dict]]]) -> str:
    """The pooled row: counts over all (prompt, seed) pairs, p clustered by prompt, and the
    unclustered McNemar p of the concatenated pairs beside it."""
    a, b = paired_by_seed(per_seed)
    t = sign_flip_clustered(a, b)
    flat = mcnemar_exact([x for s in a for x in s], [y for s in b for y in s])
    return (
        f"| {label} | {t.n} ({t.prompts} prompts x {t.seeds}) | {t.a_hits / t.n:.3f} | "
        f"{t.b_hits / t.n:.3f} | {100 * t.difference:+.1f} | {t.only_a} / {t.only_b} | "
        f"{format_p(t.p_value)} clustered by prompt (unclustered McNemar "
        f"{format_p(flat.p_value)}) |"
    )


def _mcnemar_line(label: str, a: list[bool], b: list[bool]) -> str:
    t = mcnemar_exact(a, b)
    return (
        f"| {label} | {t.n} | {t.a_hits / t.n:.3f} | {t.b_hits / t.n:.3f} | "
        f"{100 * t.difference:+.1f} | {t.only_a} / {t.only_b} | {format_p(t.p_value)} |"
    )


def kvpress_section(out_dir: Path, cells) -> list[str]:
    """The kvpress anchors (``kvpress_<model>.csv`` + per-prompt ``.jsonl``, written by the
    kvpress harness in its own environment on our prompt files), each row with its Wilson
    interval and, where we ran the same model, an exact McNemar test against our UniCache int4
    row at the same target reduction (and whether the weights' sha256 match)."""
    ours = {4.0: "unicache_int4_4x", 8.0: "unicache_int4_8x"}
    md: list[str] = []
    for path in sorted(out_dir.glob("kvpress_*.csv")):
        with path.open(newline="") as f:
            rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
        if not rows:
            continue
        if not md:
            md += [
                "### kvpress anchors (same prompts; bytes counted with our accounting)",
                "",
                "| model | press | storage | KV-bytes reduction | accuracy [95% Wilson] | "
                "vs ours (UniCache int4, same target): ours - anchor, only anchor / only "
                "ours, p | same weights |",
                "|---|---|---|---|---|---|---|",
            ]
        for r in rows:
            hits, n = int(r["hits"]), int(r["n"])
            lo, hi = wilson_interval(hits, n)
            test, same = "", ""
            target = float(r["target_reduction"]) if r.get("target_reduction") else None
            mine = cells.get((r["model"], r["task"], ours.get(target, "")))
            if r.get("press") == "none":  # no press: 16 bits = our uncompressed, int4 = plain
                plain = {"16bit": "none", "int4": "int4_plain"}.get(r.get("storage", ""))
                mine = cells.get((r["model"], r["task"], plain or ""))
            pred = out_dir / r.get("predictions", "")
            if mine and pred.is_file():
                theirs = [json.loads(x) for x in pred.read_text().splitlines() if x.strip()]
                a, b = paired(theirs, mine[0])
                t = mcnemar_exact(a, b)
                test = (
                    f"{100 * t.difference:+.1f} pts, {t.only_a} / {t.only_b}, {format_p(t.p_value)}"
                )
                same = "yes" if mine[1].get("weights_sha256") == r.get("weights_sha256") else "NO"
            md.append(
                f"| {r['model']} | {r['press']} | {r['storage']} | "
                f"{float(r['kv_reduction']):.2f}x | {hits / n:.2f} [{lo:.2f}, {hi:.2f}] "
                f"(n={n}) | {test} | {same} |"
            )
    return md + ([""] if md else [])


def write_table(cfg: dict, raw: Path, out_dir: Path) -> Path:
    cells = load(raw)
    models = _models(cells)
    settings = list(cfg["settings"])
    md: list[str] = []
    csv_rows: list[dict] = []

    # ---- accuracy tables, one per task
    for task in cfg["tasks"]:
        present = [s for s in settings if any((m, task, s) in cells for m in models)]
        if not present:
            continue
        md += [
            f"### {task}: accuracy [95% Wilson interval] · measured KV-bytes reduction",
            "",
            "| model | " + " | ".join(SETTING_TITLE.get(s, s) for s in present) + " |",
            "|---" * (len(present) + 1) + "|",
        ]
        for m in models:
            line = [m]
            for s in present:
                if (m, task, s) in cells:
                    rows, meta = cells[(m, task, s)]
                    line.append(f"{_acc_cell(rows, meta)} (n={len(rows)})")
                    hits = sum(r["correct"] for r in rows)
                    lo, hi = wilson_interval(hits, len(rows))
                    csv_rows.append(
                        {
                            "model": m,
                            "task": task,
                            "setting": s,
                            "n": len(rows),
                            "hits": hits,
                            "accuracy": hits / len(rows),
                            "lo": lo,
                            "hi": hi,
                            "kv_reduction": meta.get("kv_reduction"),
                            "weights_sha256": meta.get("weights_sha256"),
                        }
                    )
                else:
                    line.append("not run")
            md.append("| " + " | ".join(line) + " |")
        md.append("")

    # ---- perplexity: each model's change vs its own uncompressed run
    present = [s for s in settings if any((m, "ppl", s) in cells for m in models)]
    if present:
        md += [
            "### held-out perplexity (King James Bible, by source): ppl, change vs the same "
            "model uncompressed [95% paired bootstrap]",
            "",
            "| model | " + " | ".join(SETTING_TITLE.get(s, s) for s in present) + " |",
            "|---" * (len(present) + 1) + "|",
        ]
        for m in models:
            line = [m]
            ref = cells.get((m, "ppl", "none"))
            for s in present:
                if (m, "ppl", s) not in cells:
                    line.append("not run")
                    continue
                rows, _ = cells[(m, "ppl", s)]
                if s == "none" or ref is None:
                    ppl = paired_bootstrap_ppl(
                        [r["nll"] for r in rows],
                        [r["nll"] for r in rows],
                        [r["tokens"] for r in rows],
                    ).ppl_a
                    line.append(f"{ppl:.2f}")
                    csv_rows.append(
                        {"model": m, "task": "ppl", "setting": s, "n": len(rows), "ppl": ppl}
                    )
                    continue
                r = paired_bootstrap_ppl(
                    [x["nll"] for x in ref[0]],
                    [x["nll"] for x in rows],
                    [x["tokens"] for x in rows],
                )
                line.append(
                    f"{r.ppl_b:.2f} ({100 * r.change:+.1f}% [{100 * r.lo:+.1f}, {100 * r.hi:+.1f}])"
                )
                csv_rows.append(
                    {
                        "model": m,
                        "task": "ppl",
                        "setting": s,
                        "n": len(rows),
                        "ppl": r.ppl_b,
                        "ppl_change": r.change,
                        "lo": r.lo,
                        "hi": r.hi,
                    }
                )
            md.append("| " + " | ".join(line) + " |")
        md.append("")

    # ---- paired tests: compress vs control (per seed, pooled), each vs base
    seeds = sorted({m.split("_seed")[1] for m in models if "_seed" in m})
    md += [
        "### paired tests (exact McNemar, same prompts): A vs B, difference = B - A",
        "",
        "Pooled rows: both seeds, the p of the exact sign-flip test on each prompt's difference "
        "summed over the seeds (the same prompts in both seeds are not independent pairs); the "
        "unclustered McNemar p of the concatenated pairs is kept beside it for one release.",
        "",
        "| task · setting: A vs B | pairs | acc A | acc B | B - A (points) | only A / only B | p |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in cfg["tasks"]:
        for s in settings:
            per_seed = []
            for k in seeds:
                a, b = (
                    cells.get((f"control_seed{k}", task, s)),
                    cells.get((f"compress_seed{k}", task, s)),
                )
                if a and b:
                    x, y = paired(a[0], b[0])
                    md.append(
                        _mcnemar_line(f"{task} · {s}: control_seed{k} vs compress_seed{k}", x, y)
                    )
                    per_seed.append((a[0], b[0]))
            if len(per_seed) > 1:
                md.append(
                    _pooled_line(f"**{task} · {s}: control vs compress, pooled seeds**", per_seed)
                )
            base = cells.get(("base", task, s))
            for m in models:
                if m != "base" and base and (m, task, s) in cells:
                    md.append(
                        _mcnemar_line(
                            f"{task} · {s}: base vs {m}", *paired(base[0], cells[(m, task, s)][0])
                        )
                    )
    # the same bytes bought with fewer bits only vs with eviction too, same model and prompts
    for task in cfg["tasks"]:
        for m in models:
            a, b = cells.get((m, task, "int4_plain")), cells.get((m, task, "unicache_int4_4x"))
            if a and b:
                md.append(
                    _mcnemar_line(
                        f"{task} · {m}: int4_plain vs unicache_int4_4x", *paired(a[0], b[0])
                    )
                )
    # what compression costs each model: uncompressed vs compressed, same model and prompts
    for task in cfg["tasks"]:
        for m in models:
            ref = cells.get((m, task, "none"))
            for s in settings:
                if s != "none" and ref and (m, task, s) in cells:
                    md.append(
                        _mcnemar_line(
                            f"{task} · {m}: none vs {s}", *paired(ref[0], cells[(m, task, s)][0])
                        )
                    )
    md.append("")
    # perplexity: compressed ppl of compress vs control on the same blocks
    lines = []
    for s in settings:
        for k in seeds:
            a, b = (
                cells.get((f"control_seed{k}", "ppl", s)),
                cells.get((f"compress_seed{k}", "ppl", s)),
            )
            if a and b:
                r = paired_bootstrap_ppl(
                    [x["nll"] for x in a[0]], [x["nll"] for x in b[0]], [x["tokens"] for x in a[0]]
                )
                lines.append(
                    f"| {s}: control_seed{k} vs compress_seed{k} | {r.ppl_a:.2f} | "
                    f"{r.ppl_b:.2f} | {100 * r.change:+.1f}% [{100 * r.lo:+.1f}, "
                    f"{100 * r.hi:+.1f}] |"
                )
    if lines:
        md += [
            "### perplexity, compress vs control under the same setting (95% paired bootstrap)",
            "",
            "| setting: A vs B | ppl A | ppl B | B / A - 1 |",
            "|---|---|---|---|",
            *lines,
            "",
        ]

    md += kvpress_section(out_dir, cells)

    # ---- the weights every row ran on
    md += ["### weights", "", "| model | path | sha256 (model.safetensors) |", "|---|---|---|"]
    for m in models:
        meta = next((v[1] for k, v in cells.items() if k[0] == m and v[1]), {})
        md.append(f"| {m} | {meta.get('weights', '?')} | {meta.get('weights_sha256', '?')[:16]} |")
    md.append("")
    out_md = out_dir / "results.md"
    out_md.write_text("\n".join(md))
    keys = sorted(
        {k for r in csv_rows for k in r},
        # the first row's order, then the other keys by name (a set's order changes per run)
        key=lambda k: (list(csv_rows[0]).index(k) if k in csv_rows[0] else 99, k),
    )
    with (out_dir / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(csv_rows)
    print(out_md.read_text())
    return out_md
