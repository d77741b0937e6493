"""Why the learned attention scorer loses to sinks + recent at 16x (issue 36): does the scorer,
or the question itself, single out the needle?

For held-out prompts of the study (the first ``--n`` of each family, evaluation seeds), one
prefill of context + question records every layer's keys, values and queries. Per layer:

* ``kept_<method>``: share of the needle value tokens (the 7-digit numbers the question asks
  for) that the method's 16x segment keeps (the study's compressors and calibrated rates);
* ``pct_scorer``: the needles' mean percentile among the context tokens under the scorer's
  prediction (heads reduced by max, as the selection does); 0.5 is chance, 1 the top;
* ``pct_question``: the same under the attention the question's tokens pay to each context token
  (max over question tokens and query heads): what a query-aware selection would see;
* ``pct_answer``: the same under the attention of the answer's tokens (teacher-forced: the
  tokens that copy the value): Locret's target, the attention from the response;
* ``rho``: Spearman correlation, over the context tokens, of the scorer's prediction with the
  answer's attention.

    python experiments/long_context/diagnose.py --n 6      # diagnose.csv, diagnose.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import study as S  # noqa: E402  (the study's own loaders: one definition of each setting)


def _pct(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[T] percentile rank in [0, 1] of each entry among the ``mask`` entries (ties: average)."""
    v = x[mask]
    order = v.argsort().argsort().float()
    out = torch.full_like(x, float("nan"))
    out[mask] = order / max(len(v) - 1, 1)
    return out


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def needle_tokens(tok, context: str, values: list[str]) -> list[int]:
    """Token positions (BOS at 0) of each value's characters in ``context``."""
    out: list[int] = []
    for v in values:
        start = context.find(v)
        if start < 0:
            continue
        a = len(tok.encode(context[:start], add_bos=True))
        b = len(tok.encode(context[: start + len(v)], add_bos=True))
        out += list(range(a, b))
    return out


def main(argv: list[str]) -> None:
    from unicache_train.seam import RecordingCompressor

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=6, help="prompts per family")
    ap.add_argument("--reduction", type=int, default=16)
    ap.add_argument("--config", type=Path, default=HERE / "study.yaml")
    args = ap.parse_args(argv)
    study = S.load_study(args.config)
    torch.set_num_threads(int(study.get("threads", 2)))
    model, tok = S.model_and_tokenizer(study)
    cal = json.loads((HERE / "calibration.json").read_text())
    scorer = S.read_scorer(model)
    methods = ["sinks_recent", "attention"]
    comps = {m: S.compressor(m, cal[f"{m}@{args.reduction}"]["rate"], scorer) for m in methods}
    ev = study["eval"]
    recs = S.records(study, tok, "eval", int(ev["n"]), int(ev["seed"]))
    by_family: dict[str, list[dict]] = {}
    for r in recs:
        by_family.setdefault(r["family"], []).append(r)
    chosen = [r for fam in study["families"] for r in by_family[fam][: args.n]]
    rows = []
    for k, r in enumerate(chosen, 1):
        ctx = tok.encode(r["context"], add_bos=True)
        q = tok.encode(r["question"])
        a = tok.encode(" " + ", ".join(r["answers"]))
        ids = torch.tensor([ctx + q + a])
        split = torch.tensor([len(ctx)])
        capture = RecordingCompressor()
        with torch.no_grad():
            model(ids, split=split, compressor=capture, logits_at=(split - 1)[:, None])
        needles = needle_tokens(tok, r["context"], list(r["answers"]))
        if not needles:
            continue
        nd = torch.tensor(needles)
        for layer, inp in sorted(capture.inputs.items()):
            mask = inp.context_mask[0]
            T = mask.shape[0]
            row = {"id": r["id"], "family": r["family"], "layer": layer, "needles": len(needles)}
            for m, comp in comps.items():
                seg = comp(inp)
                kept = set(seg.positions[0][seg.valid[0]].tolist())
                row[f"kept_{m}"] = sum(t in kept for t in needles) / len(needles)
            pred = scorer.head_scores(layer, inp.keys, inp.values, inp.context_mask).amax(1)[0]
            # attention of the question's / the answer's tokens to every context token: max over
            # those tokens and the query heads
            qh = inp.queries[0, :, len(ctx) :]  # [Hq, Tq + Ta, D]
            kh = inp.keys[0].repeat_interleave(qh.shape[0] // inp.keys.shape[1], 0)  # [Hq, T, D]
            logits = qh.float() @ kh.float().transpose(-1, -2) / qh.shape[-1] ** 0.5
            causal = torch.arange(T)[None, :] <= (len(ctx) + torch.arange(qh.shape[1]))[:, None]
            att = logits.masked_fill(~causal[None], float("-inf")).softmax(-1)
            qatt = att[:, : len(q)].amax(dim=(0, 1))  # [T]
            aatt = att[:, len(q) :].amax(dim=(0, 1))
            row["pct_scorer"] = float(_pct(pred.float(), mask)[nd].mean())
            row["pct_question"] = float(_pct(qatt, mask)[nd].mean())
            row["pct_answer"] = float(_pct(aatt, mask)[nd].mean())
            row["rho"] = _spearman(pred.float()[mask], aatt[mask])
            rows.append(row)
        print(f"{k}/{len(chosen)} {r['id']}", flush=True)
    import csv

    with (HERE / "diagnose.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    keys = [c for c in rows[0] if c.startswith(("kept_", "pct_")) or c == "rho"]
    summary = {
        "prompts": len({r["id"] for r in rows}),
        "layers": len({r["layer"] for r in rows}),
        "reduction": args.reduction,
        "mean": {c: sum(r[c] for r in rows) / len(rows) for c in keys},
        "by_layer": {
            c: [
                round(
                    sum(r[c] for r in rows if r["layer"] == layer)
                    / sum(1 for r in rows if r["layer"] == layer),
                    4,
                )
                for layer in sorted({r["layer"] for r in rows})
            ]
            for c in keys
        },
    }
    (HERE / "diagnose.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["mean"], indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
