"""Why a selection keeps (or loses) the answer: what each selection keeps of the queried pair.

For every model and 8x setting of the study, on the first ``--num`` held-out 8-pair recall
prompts (the evaluation's prompts and compressors), the context is prefilled and compressed as
the evaluation does, and the kept token positions of every layer are read from the compressor's
segments. Reported per (model, setting), averaged over layers and prompts:

* ``value_kept``: fraction of the queried value's tokens (the digits the question asks for) kept;
* ``value_whole``: fraction of (prompt, layer) cells that keep every token of that value;
* ``key_kept``: fraction of the queried key's tokens kept;
* ``kept``: fraction of all context tokens kept (the byte target's share);
* for a learned retention policy: ``learned_std`` (std over the context of the learned part of
  the logit, against ``prior_step``, the prior's logit gap between neighbouring tokens),
  ``weight_norm`` and ``overlap_prior`` (Jaccard overlap of its kept set with its prior's, sinks
  + recent, on the same weights).

    python experiments/smollm2_retention/diagnose.py            # -> results/diagnose.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "smollm2_evidence"))

import smollm2_evidence as ev  # noqa: E402

SETTINGS = ["unicache_int4_8x", "sinks_int4_8x", "snapkv_int4_8x", "retention_int4_8x"]


class Recorder:
    """A compressor that records each layer's kept positions (and passes the segment on)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.pre_rope = bool(getattr(inner, "pre_rope", False))
        self.kept: dict[int, list[set[int]]] = {}
        self.learned_std: list[float] = []  # a retention policy: its logit's spread per layer

    def __call__(self, inp):
        seg = self.inner(inp)
        self.kept[inp.layer_idx] = [
            set(seg.positions[b][seg.valid[b]].tolist()) for b in range(seg.positions.shape[0])
        ]
        policy = getattr(self.inner, "retention", None)
        if policy is not None:
            z = policy.head_logits(inp.layer_idx, inp.keys).mean(1)  # [B, T]
            m = inp.context_mask
            self.learned_std += [float(z[b][m[b]].std()) for b in range(z.shape[0])]
        return seg


def spans(tok, record: dict) -> tuple[set[int], set[int], int]:
    """Token positions (BOS counted) of the queried key and of its value in the context."""
    ctx = record["context"]
    line = f"{record['key']}: {record['answer']}"
    start = ctx.index(line)
    colon = start + len(record["key"])
    end = start + len(line)

    def n(text: str) -> int:
        return len(tok.encode(text, add_bos=True))

    a, b, c = n(ctx[:start]), n(ctx[:colon]), n(ctx[:end])
    return set(range(a, b)), set(range(b, c)), n(ctx)


def measure(model, tok, comp, records) -> tuple[dict[str, float], dict[int, list[set[int]]]]:
    from unicache_train.model.generate import prefill_compressed

    rec = Recorder(comp)
    ctx = [tok.encode(r["context"], add_bos=True) for r in records]
    P = max(len(c) for c in ctx)
    ids = torch.full((len(records), P), tok.pad_token_id, dtype=torch.long)
    for b, c in enumerate(ctx):
        ids[b, : len(c)] = torch.tensor(c)
    split = torch.tensor([len(c) for c in ctx])
    with torch.no_grad():
        prefill_compressed(model, ids, split, rec)
    v, whole, k, kept = [], [], [], []
    for b, r in enumerate(records):
        key, val, n = spans(tok, r)
        for sets in rec.kept.values():
            s = sets[b]
            v.append(len(s & val) / len(val))
            whole.append(float(val <= s))
            k.append(len(s & key) / len(key))
            kept.append(len(s) / n)
    mean = lambda x: sum(x) / len(x)  # noqa: E731
    out = {
        "value_kept": mean(v),
        "value_whole": mean(whole),
        "key_kept": mean(k),
        "kept": mean(kept),
    }
    if rec.learned_std:
        sel = comp.config.selection
        out["learned_std"] = mean(rec.learned_std)
        out["prior_step"] = sel.prior_scale / max(1.0, mean([len(c) - 1 for c in ctx]))
        out["weight_norm"] = float(comp.retention.weight.norm())
    return out, rec.kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "diagnose.csv")
    args = ap.parse_args(argv)
    from unicache_train.data.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    cfg = yaml.safe_load((HERE / "study.yaml").read_text())
    rates = {}
    for d in [*cfg.get("shared_raw", []), cfg["raw_dir"]]:
        f = ROOT / d / "calibration.json"
        if f.is_file():
            rates.update(yaml.safe_load(f.read_text()))
    records = ev.records(cfg, "recall8")[: args.num]
    rows = []
    models = ev.find_models(cfg)
    tok = None
    for name, spec in models.items():
        model, path = ev.load_model(spec)
        tok = tok or load_tokenizer(str(path))
        kept_by = {}
        for s in SETTINGS:
            if s not in rates:
                continue
            if s == "retention_int4_8x" and not hasattr(model, "kv_retention"):
                continue  # a model without a policy ranks with its prior: the sinks row
            comp = ev.compressor(cfg, s, rates, model)
            got, kept_by[s] = measure(model, tok, comp, records)
            row = {"model": name, "setting": s, **got}
            if s == "retention_int4_8x":
                prior = kept_by.get("sinks_int4_8x")
                if prior:
                    jac = [
                        len(a & b) / max(1, len(a | b))
                        for layer in kept_by[s]
                        for a, b in zip(kept_by[s][layer], prior[layer])
                    ]
                    row["overlap_prior"] = sum(jac) / len(jac)
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("model", "setting"), k))
    with args.out.open("w", newline="") as f:
        f.write(f"# command: python experiments/smollm2_retention/diagnose.py --num {args.num}\n")
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
