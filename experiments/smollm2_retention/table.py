"""The learned-retention study's table (issue 28): every cell with its Wilson interval, the
decisive comparisons at 8x as exact McNemar tests on the same 200 prompts per training seed, and
pooled over the seeds (retention seed k paired with the other arm's seed k) as an exact sign-flip
test clustered by prompt (the same prompts in both seeds are not independent pairs; the
unclustered McNemar p of the concatenated pairs is kept beside it for one release), perplexity
changes with 95% paired bootstrap intervals, the targets, each met or missed with its figure,
and the verdicts the clustering changes.

    python experiments/smollm2_retention/table.py        # -> results.md, results.csv here

Reads ``raw/`` (this study's cells) and the evidence study's ``raw/`` (the cells the two share:
the base, the control fine-tunes, the same prompts and settings), and the kvpress anchor rows
of the evidence study (``kvpress_base.csv``).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from experiments.smollm2_evidence import table as evidence_table  # noqa: E402
from experiments.smollm2_evidence.table import paired, paired_by_seed  # noqa: E402
from unicache_train.eval.stats import (  # noqa: E402
    format_p,
    mcnemar_exact,
    paired_bootstrap_ppl,
    sign_flip_clustered,
    wilson_interval,
)

ARM_TITLE = {
    "base": "(a) base, training-free",
    "control": "(b) control fine-tune (nothing compressed)",
    "unicache_q4": "(c) UniCache + int4 8x in the loop",
    "sinks_recent_q4": "(c) sinks + recent + int4 8x in the loop",
    "snapkv_q4": "(c) SnapKV-style + int4 8x in the loop",
    "retention_q4": "(d) learned retention + int4 8x in the loop",
    "retention_lr300_q4": "(d') the same, policy lr 300x train.lr",
}
FIXED_8X = ["unicache_int4_8x", "sinks_int4_8x", "snapkv_int4_8x"]
COLUMNS = [
    "none",
    "unicache_int4_8x",
    "sinks_int4_8x",
    "snapkv_int4_8x",
    "retention_int4_8x",
    "unicache_int4_16x",
    "sinks_int4_16x",
    "snapkv_int4_16x",
    "retention_int4_16x",
]
OWN_8X = {
    "unicache_q4": "unicache_int4_8x",
    "sinks_recent_q4": "sinks_int4_8x",
    "snapkv_q4": "snapkv_int4_8x",
    "retention_q4": "retention_int4_8x",
    "retention_lr300_q4": "retention_int4_8x",
}


def load(dirs: list[Path]) -> dict[tuple[str, str, str], tuple[list[dict], dict]]:
    """``{(model, task, setting): (rows, meta)}``; the first directory holding a cell wins."""
    cells: dict = {}
    for d in reversed(dirs):
        cells.update(evidence_table.load(d))
    return cells


def arm_of(model: str) -> str:
    return model.rsplit("_seed", 1)[0] if "_seed" in model else model


def _acc(rows: list[dict], meta: dict) -> str:
    hits, n = sum(r["correct"] for r in rows), len(rows)
    lo, hi = wilson_interval(hits, n)
    red = meta.get("kv_reduction")
    tail = f" · {red:.1f}x" if red and abs(red - 1) > 1e-6 else ""
    return f"{hits / n:.2f} [{lo:.2f}, {hi:.2f}]{tail}"


def _cell_row(model: str, task: str, setting: str, cell: tuple[list[dict], dict]) -> dict:
    """One cell of the table as a ``results.csv`` row."""
    rows, meta = cell
    return {
        "kind": "cell",
        "model": model,
        "task": task,
        "setting": setting,
        "hits": sum(r["correct"] for r in rows),
        "n": len(rows),
        "kv_reduction": meta.get("kv_reduction"),
        "weights_sha256": meta.get("weights_sha256"),
    }


def _seeded_tests(
    tests: list[tuple], pooled_label: str, csv_rows: list[dict], **extra
) -> list[str]:
    """``tests``: ``(label, a_rows, b_rows, b_model)`` for each seed of A that has both cells.
    One exact McNemar line per seed, then the pooled one, clustered by prompt, when there are
    several seeds and each met another B model (with one B model used for every seed the
    exchangeability of A and B on a prompt is not the null; the seeds are reported one by
    one)."""
    md = [_test_row(label, *paired(a, b), csv_rows, **extra) for label, a, b, _ in tests]
    b_models = [t[3] for t in tests]
    if len(b_models) > 1 and len(set(b_models)) == len(b_models):
        per_seed = [(a, b) for _, a, b, _ in tests]
        md.append(_pooled_row(pooled_label, per_seed, csv_rows, **extra))
    return md


def _pooled_row(label: str, per_seed: list[tuple], rows: list[dict], **extra) -> str:
    """Both seeds: the sign-flip test on each prompt's difference summed over the seeds
    (``p``), and the McNemar test of the concatenated pairs (``p_unclustered``)."""
    a, b = paired_by_seed(per_seed)
    t = sign_flip_clustered(a, b)
    flat = mcnemar_exact([x for s in a for x in s], [y for s in b for y in s])
    diff = (t.a_hits - t.b_hits) / t.n  # A - B
    rows.append(
        {
            "comparison": label,
            "n": t.n,
            "prompts": t.prompts,
            "a": t.a_hits / t.n,
            "b": t.b_hits / t.n,
            "difference": diff,
            "only_a": t.only_a,
            "only_b": t.only_b,
            "favour_a": t.favour_a,
            "favour_b": t.favour_b,
            "p": t.p_value,
            "p_unclustered": flat.p_value,
            **extra,
        }
    )
    inside = " (inside the noise)" if t.p_value >= 0.05 else ""
    return (
        f"| {label} | {t.n} ({t.prompts} prompts x {t.seeds}) | {t.a_hits / t.n:.3f} | "
        f"{t.b_hits / t.n:.3f} | {100 * diff:+.1f}{inside} | {t.only_a} / {t.only_b} "
        f"(prompts {t.favour_a} / {t.favour_b}) | {format_p(t.p_value)} clustered "
        f"(unclustered McNemar {format_p(flat.p_value)}) |"
    )


def _test_row(label: str, a: list[bool], b: list[bool], rows: list[dict], **extra) -> str:
    t = mcnemar_exact(a, b)
    diff = (t.a_hits - t.b_hits) / t.n  # A - B (McNemar's `difference` is B - A)
    rows.append(
        {
            "comparison": label,
            "n": t.n,
            "a": t.a_hits / t.n,
            "b": t.b_hits / t.n,
            "difference": diff,
            "only_a": t.only_a,
            "only_b": t.only_b,
            "p": t.p_value,
            **extra,
        }
    )
    inside = " (inside the noise)" if t.p_value >= 0.05 else ""
    return (
        f"| {label} | {t.n} | {t.a_hits / t.n:.3f} | {t.b_hits / t.n:.3f} | "
        f"{100 * diff:+.1f}{inside} | {t.only_a} / {t.only_b} | {format_p(t.p_value)} |"
    )


def kvpress_rows(path: Path) -> dict[str, list[dict]]:
    """kvpress anchors on the base at 8x from their CSV (per-prompt JSONL files beside it):
    ``{"kvpress SnapKV+int4": rows, ...}``."""
    out: dict[str, list[dict]] = {}
    evidence = path.parent
    if not path.is_file():
        raise FileNotFoundError(f"kvpress anchors not found: {path} (study.yaml kvpress)")
    with path.open(newline="") as f:
        for r in csv.DictReader(x for x in f if not x.startswith("#")):
            if r.get("press") in ("", "none") or abs(float(r["target_reduction"] or 0) - 8) > 0.1:
                continue
            pred = evidence / r["predictions"]
            if pred.is_file():
                label = f"kvpress {r['press']}+{r['storage']}"
                out[label] = [json.loads(x) for x in pred.read_text().splitlines() if x.strip()]
    return out


def write_table(cfg: dict, out_dir: Path = HERE) -> Path:
    raw = ROOT / cfg["raw_dir"]
    dirs = [raw, *(ROOT / d for d in cfg.get("shared_raw", []))]
    cells = load(dirs)
    order = [
        "base",
        "control",
        "unicache_q4",
        "sinks_recent_q4",
        "snapkv_q4",
        "retention_q4",
        "retention_lr300_q4",
    ]
    models = sorted(
        {m for m, _, _ in cells if arm_of(m) in order},
        key=lambda m: (order.index(arm_of(m)), m),
    )
    md = [
        "# SmolLM2-135M at 8x and 16x fewer KV bytes: learned retention vs fixed selections",
        "",
        "Generated by `python experiments/smollm2_retention/table.py` from the raw per-prompt "
        "files (`raw/`, and `../smollm2_evidence/raw/` for the cells the two studies share). "
        "8-pair key-value recall, 200 held-out prompts (seeds never used in training); 95% "
        "Wilson intervals; `· Nx` is the measured KV-bytes reduction of the cell.",
        "",
        "## Recall, every cell",
        "",
        "| model | " + " | ".join(COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    csv_rows: list[dict] = []
    for m in models:
        line = [m]
        for s in COLUMNS:
            c = cells.get((m, "recall8", s))
            line.append(_acc(*c) if c else "")
            if c:
                csv_rows.append(_cell_row(m, "recall8", s, c))
        md.append("| " + " | ".join(line) + " |")
    md += ["", "## The unseen recall format (sentences, 64 prompts a cell) at 8x", ""]
    md += ["| model | setting | accuracy [95% Wilson] |", "|---|---|---|"]
    for m in models:
        for s in COLUMNS:
            c = cells.get((m, "recall8_sentence", s))
            if c and s != "none" and "_8x" in s:
                md.append(f"| {m} | {s} | {_acc(*c)} |")
    sentence = {}
    for m in models:
        c = cells.get((m, "recall8_sentence", "retention_int4_8x"))
        if c and arm_of(m) in LEARNED:
            k = m.rsplit("_seed", 1)[1]
            b = cells.get((f"control_seed{k}", "recall8_sentence", "sinks_int4_8x"))
            if b:
                sentence[m] = paired(c[0], b[0])
    if sentence:
        md += [
            "",
            "| A vs B (same 64 prompts) | pairs | A | B | A - B (pts) | only A / only B | p |",
        ]
        md += ["|---|---|---|---|---|---|---|"]
        for m, (x, y) in sentence.items():
            k = m.rsplit("_seed", 1)[1]
            label = f"{m} (learned) vs control_seed{k} + sinks_int4_8x, sentence format"
            md.append(_test_row(label, x, y, csv_rows, kind="sentence_test"))
    md += ["", "## Perplexity on held-out prose (King James Bible), 24 blocks", ""]
    md += [
        "| model | setting | ppl | change vs its uncompressed [95% paired bootstrap] |",
        "|---|---|---|---|",
    ]
    for m in models:
        base = cells.get((m, "ppl", "none"))
        for s in COLUMNS:
            c = cells.get((m, "ppl", s))
            if not c:
                continue
            ppl = c[1].get("ppl")
            change = ""
            if base and s != "none":
                bs = paired_bootstrap_ppl(
                    [r["nll"] for r in base[0]],
                    [r["nll"] for r in c[0]],
                    [r["tokens"] for r in c[0]],
                )
                change = f"{100 * bs.change:+.1f}% [{100 * bs.lo:+.1f}, {100 * bs.hi:+.1f}]"
                csv_rows.append(
                    {
                        "kind": "ppl",
                        "model": m,
                        "setting": s,
                        "ppl": ppl,
                        "relative": bs.change,
                        "low": bs.lo,
                        "high": bs.hi,
                    }
                )
            md.append(f"| {m} | {s} | {ppl:.3f} | {change} |")
    md += decisive(cells, models, csv_rows, kvpress_rows(ROOT / cfg["kvpress"]).items())
    md += fixed_vs_control(cells, models, csv_rows)
    md += other_tasks(cells, models, csv_rows)
    md += targets(cells, models, csv_rows)
    md += clustering_changes(csv_rows)
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    keys = sorted({k for r in csv_rows for k in r}, key=lambda k: (k != "kind", k))
    with (out_dir / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(csv_rows)
    return out_dir / "results.md"


def _rows(cells, model: str, setting: str) -> list[dict] | None:
    c = cells.get((model, "recall8", setting))
    return c[0] if c else None


def _seeds(models: list[str], arm: str) -> list[str]:
    return [m for m in models if arm_of(m) == arm]


LEARNED = ("retention_q4", "retention_lr300_q4")


def decisive(cells, models, csv_rows, kvpress) -> list[str]:
    """Each learned arm against (a), (b), (c) and its own prior, at 8x, per seed and pooled."""
    md = [
        "",
        "## The decisive comparisons at 8x (8-pair recall, exact McNemar on the same prompts)",
        "",
        "A = a learned retention arm (+ int4 8x in the loop), evaluated with its policy; B = the "
        "other arm. Seed k of A is paired with seed k of B (or B's only seed); pooled = both "
        "seeds, with the prompt as the unit: the exact sign-flip test on each prompt's "
        "difference summed over the seeds (`unicache_train.eval.stats.sign_flip_clustered`; "
        "'prompts x / y': prompts whose summed difference favours A / B). The unclustered "
        "McNemar p of the 400 concatenated pairs, which counts each prompt twice as if "
        "independent, is shown beside it for one release. The best setting of (a) and (b) is "
        "chosen after the fact (it favours the baseline).",
    ]
    for arm in LEARNED:
        if _seeds(models, arm):
            md += _decisive_arm(arm, cells, models, csv_rows, kvpress)
    return md


def _decisive_arm(learned, cells, models, csv_rows, kvpress) -> list[str]:
    md = [
        "",
        f"### A = {learned} ({ARM_TITLE[learned]})",
        "",
        "| comparison | pairs | A | B | A - B (pts) | only A / only B | p |",
        "|---|---|---|---|---|---|---|",
    ]
    ret = _seeds(models, learned)

    def a_rows(m):
        c = cells.get((m, "recall8", "retention_int4_8x"))
        return c[0] if c else None

    def compare(label: str, b_of, b_models) -> None:
        """``b_of(k)``: B's rows for A's seed k; ``b_models(k)``: B's model."""
        tests = [
            (f"{label}, seed {k}", a_rows(m), b_of(k), b_models(k))
            for k, m in enumerate(ret)
            if a_rows(m) is not None and b_of(k) is not None
        ]
        md.extend(_seeded_tests(tests, f"{label}, pooled", csv_rows, kind="test", arm=learned))

    # (a) the base's best training-free setting at 8x, ours and kvpress's
    base = {
        s: cells[("base", "recall8", s)][0] for s in FIXED_8X if ("base", "recall8", s) in cells
    }
    base.update(kvpress)
    if base:
        best = max(base, key=lambda s: sum(r["correct"] for r in base[s]))
        compare(f"vs (a) base, best training-free ({best})", lambda k: base[best], lambda k: "base")
    # (b) the control fine-tune with its best compressor at 8x (pooled over its seeds)
    ctrl = _seeds(models, "control")
    scores = {
        s: sum(sum(r["correct"] for r in cells[(m, "recall8", s)][0]) for m in ctrl)
        for s in FIXED_8X
        if ctrl and all((m, "recall8", s) in cells for m in ctrl)
    }
    if scores:
        best_c = max(scores, key=scores.get)
        compare(
            f"vs (b) control + {best_c}",
            lambda k: _rows(cells, ctrl[min(k, len(ctrl) - 1)], best_c),
            lambda k: ctrl[min(k, len(ctrl) - 1)],
        )
    # (c) each fixed selection trained in the loop, with its own compressor
    for arm in ("unicache_q4", "sinks_recent_q4", "snapkv_q4"):
        fixed = _seeds(models, arm)
        own = OWN_8X[arm]
        if fixed and all((m, "recall8", own) in cells for m in fixed):
            compare(
                f"vs (c) {arm} in the loop",
                lambda k, f=fixed, o=own: _rows(cells, f[min(k, len(f) - 1)], o),
                lambda k, f=fixed: f[min(k, len(f) - 1)],
            )
    # the learned part itself: the same weights ranked by the prior (sinks + recent)
    if all((m, "recall8", "sinks_int4_8x") in cells for m in ret):
        compare(
            "vs its own prior (same weights, sinks + recent + int4 8x)",
            lambda k: _rows(cells, ret[k], "sinks_int4_8x"),
            lambda k: ret[k],
        )
    return md


def fixed_vs_control(cells, models, csv_rows) -> list[str]:
    """Does training with a fixed selection in the loop help that selection? (c) seed k with
    its own compressor against the control seed k with the same compressor, and pooled."""
    md = [
        "",
        "## (c) against (b): a fixed selection in the loop vs the control with the same selection",
        "",
        "| comparison | pairs | A | B | A - B (pts) | only A / only B | p |",
        "|---|---|---|---|---|---|---|",
    ]
    ctrl = _seeds(models, "control")
    for arm in ("unicache_q4", "sinks_recent_q4", "snapkv_q4"):
        own = OWN_8X[arm]
        tests = [
            (f"{m} vs {c}, both + {own}", _rows(cells, m, own), _rows(cells, c, own), c)
            for m, c in zip(_seeds(models, arm), ctrl)  # seed k with seed k
            if _rows(cells, m, own) is not None and _rows(cells, c, own) is not None
        ]
        pooled = f"{arm} vs control, both + {own}, pooled"
        md += _seeded_tests(tests, pooled, csv_rows, kind="fixed_vs_control", arm=arm)
    return md


# The other tasks at 8x: the learned arm with its policy against the control with sinks + recent
# (the learned policy's prior; NOT the control's best recall8 selection, which is SnapKV-style,
# 131 vs 126 of 400), the base with its best (SnapKV-style), and its own weights with the prior.
OTHER_TASKS = ("recall16", "passkey")
# "self": the same weights ranked by the policy's prior (sinks + recent): policy vs weights.
OTHER_B = [("control", "sinks_int4_8x"), ("base", "snapkv_int4_8x"), ("self", "sinks_int4_8x")]


def other_tasks(cells, models, csv_rows) -> list[str]:
    """16-pair recall and the passkey task: every cell, then the learned arm (lr 300x) against
    the control + sinks (its prior's selection, not the control's best 8-pair one), the base +
    SnapKV-style and its own weights ranked by its prior, at 8x (seed k with seed k, pooled)."""
    present = [t for t in OTHER_TASKS if any(k[1] == t for k in cells)]
    if not present:
        return []
    md = [
        "",
        "## 16-pair recall and the passkey task at 8x",
        "",
        "| task | model | setting | accuracy [95% Wilson] |",
        "|---|---|---|---|",
    ]
    for t in present:
        for m in models:
            for s in COLUMNS:
                c = cells.get((m, t, s))
                if c:
                    md.append(f"| {t} | {m} | {s} | {_acc(*c)} |")
                    csv_rows.append(_cell_row(m, t, s, c))
    md += [
        "",
        "| A vs B (same prompts) | pairs | A | B | A - B (pts) | only A / only B | p |",
        "|---|---|---|---|---|---|---|",
    ]
    learned = _seeds(models, "retention_lr300_q4")
    for t in present:
        for arm, setting in OTHER_B:
            bs = _seeds(models, arm)
            tests = []
            for k, m in enumerate(learned):
                a = cells.get((m, t, "retention_int4_8x"))
                b_model = m if arm == "self" else (bs[min(k, len(bs) - 1)] if bs else None)
                b = cells.get((b_model, t, setting)) if b_model else None
                if a and b:
                    tests.append((f"{t}: {m} vs {b_model} + {setting}", a[0], b[0], b_model))
            other = "its own weights" if arm == "self" else arm
            pooled = f"{t}: retention_lr300_q4 vs {other} + {setting}, pooled"
            md += _seeded_tests(tests, pooled, csv_rows, kind="other_test", task=t)
    md += [
        "",
        "Each model at 8x as a share of its own uncompressed accuracy on the same prompts:",
        "",
    ]
    for t in present:
        for m in models:
            u = cells.get((m, t, "none"))
            for s in COLUMNS[1:]:
                c = cells.get((m, t, s))
                if u and c and sum(r["correct"] for r in u[0]):
                    share = sum(r["correct"] for r in c[0]) / sum(r["correct"] for r in u[0])
                    md.append(f"- {t}, {m}, {s}: {share:.0%} of its uncompressed")
    return md


def targets(cells, models, csv_rows) -> list[str]:
    md = [
        "",
        "## Targets (issue 28)",
        "",
        "| target | figure | met? |",
        "|---|---|---|",
    ]
    for m in [m for arm in LEARNED for m in _seeds(models, arm)]:
        for red, need, s in ((8, 0.90, "retention_int4_8x"), (16, 0.75, "retention_int4_16x")):
            c, u = cells.get((m, "recall8", s)), cells.get((m, "recall8", "none"))
            if not (c and u):
                continue
            got = sum(r["correct"] for r in c[0]) / max(1, sum(r["correct"] for r in u[0]))
            md.append(
                f"| {m}: recall at {red}x >= {need:.0%} of its uncompressed | "
                f"{got:.0%} of it | {'met' if got >= need else 'missed'} |"
            )
            csv_rows.append({"kind": "target", "model": m, "setting": s, "ratio": got})
        p, u = cells.get((m, "ppl", "retention_int4_8x")), cells.get((m, "ppl", "none"))
        if p and u:
            rel = p[1]["ppl"] / u[1]["ppl"] - 1
            md.append(
                f"| {m}: held-out perplexity at 8x within 5% | {100 * rel:+.1f}% | "
                f"{'met' if rel <= 0.05 else 'missed'} |"
            )
    # One line per (arm, comparison): the pooled test where there is one, else every seed's
    # test must pass on its own (B was a single model).
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in csv_rows:
        if r.get("kind") == "test":
            base_label = r["comparison"].rsplit(", ", 1)[0]
            groups.setdefault((r["arm"], base_label), []).append(r)
    for (arm, label), rs in groups.items():
        pooled = [r for r in rs if r["comparison"].endswith("pooled")]
        use = pooled or rs
        ok = all(r["p"] < 0.01 and r["difference"] > 0 for r in use)
        figure = "; ".join(
            f"{r['comparison'].rsplit(', ', 1)[1]} {100 * r['difference']:+.1f} pts, "
            f"{format_p(r['p'])}"
            for r in use
        )
        md.append(
            f"| {arm} better than {label.removeprefix('vs ')}, paired p < 0.01 | {figure} | "
            f"{'met' if ok else 'missed'} |"
        )
    # Several comparisons per arm: say which "met" lines survive Bonferroni over the arm's family.
    for arm in sorted({a for a, _ in groups}):
        family = {label: rs for (a, label), rs in groups.items() if a == arm}
        level = 0.01 / len(family)
        kept = [
            label.removeprefix("vs ")
            for label, rs in family.items()
            if all(
                r["p"] < level and r["difference"] > 0
                for r in ([r for r in rs if r["comparison"].endswith("pooled")] or rs)
            )
        ]
        md.append(
            f"\n{arm}: {len(family)} comparisons, so p < {level:.4f} for 0.01 over the family "
            f"(Bonferroni); met at that level: {', '.join(kept) if kept else 'none'}."
        )
    return md


def clustering_changes(csv_rows: list[dict]) -> list[str]:
    """Every pooled test whose verdict the clustering by prompt changes, at p < 0.05, p < 0.01
    and, for the decisive comparisons, Bonferroni over the arm's family (0.01 / 6)."""
    families: dict[str, int] = {}
    for r in csv_rows:
        if r.get("kind") == "test" and r["comparison"].endswith("pooled"):
            families[r["arm"]] = families.get(r["arm"], 0) + 1
    md = [
        "",
        "## What clustering by prompt changes",
        "",
        "Pooled tests whose verdict differs between the clustered p (the one used above) and "
        "the unclustered McNemar p of the concatenated pairs (the one of the previous release); "
        "a decisive comparison's family is its arm's comparisons (Bonferroni). "
        "Every other pooled verdict stands.",
        "",
        "| pooled test | A - B (pts) | unclustered p | clustered p | verdict that changes |",
        "|---|---|---|---|---|",
    ]
    n = 0
    for r in csv_rows:
        if "p_unclustered" not in r:
            continue
        levels = [0.05, 0.01]
        if r.get("kind") == "test":
            levels.append(0.01 / max(1, families.get(r["arm"], 1)))
        changed = [
            f"p < {lv:.2g}: {'yes' if r['p_unclustered'] < lv else 'no'} -> "
            f"{'yes' if r['p'] < lv else 'no'}"
            for lv in levels
            if (r["p_unclustered"] < lv) != (r["p"] < lv)
        ]
        if changed:
            n += 1
            who = f"{r['arm']} " if r.get("kind") == "test" else ""
            md.append(
                f"| {who}{r['comparison']} | {100 * r['difference']:+.1f} | "
                f"{format_p(r['p_unclustered'])} | {format_p(r['p'])} | {'; '.join(changed)} |"
            )
    return md if n else md[:4] + ["None."]


def main() -> int:
    cfg = yaml.safe_load((HERE / "study.yaml").read_text())
    print(write_table(cfg).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
