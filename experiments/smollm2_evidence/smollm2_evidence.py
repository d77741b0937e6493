"""SmolLM2 evidence re-measure (issue 27): base, control and compression-aware fine-tunes (two
training seeds per arm), 8-pair recall at n = 200 per cell, an unseen recall format, passkey
retrieval in ~1,600 tokens of prose, and perplexity on text held out by source, every cell's
per-prompt (per-block) results kept, every headline difference with its paired test.

    python experiments/smollm2_evidence/smollm2_evidence.py run     # resumable: skips done cells
    python experiments/smollm2_evidence/smollm2_evidence.py table   # results.md / results.csv

``run`` finds the models (``<evidence_dir>/<arm>_seed<k>/<arm>/export``) before every cell, so
fine-tunes that finish while it runs join; cells run in ``order`` (the YAML), each across all
models found, so the headline cells are complete first. Raw files: ``raw/<model>/<task>__
<setting>.jsonl`` (one row per prompt: id, answer, prediction, correct; or per block: nll,
tokens) with a ``.meta.json`` beside (bytes, seconds, the weights' path and sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIG = HERE / "evidence.yaml"


def load_config(path: Path = CONFIG) -> dict:
    return yaml.safe_load(path.read_text())


# ------------------------------------------------------------------------------ models
def find_models(cfg: dict) -> dict[str, Path | str]:
    """``{"base": name, "control_seed0": export dir, ...}``: the fine-tunes exported so far.

    An arm is a name (runs ``<evidence_dir>/<arm>_seed<k>``, export ``<arm>/export``) or a
    mapping ``{name, dir, kind}`` (runs ``<dir>/<name>_seed<k>``, export ``<kind>/export``)."""
    models: dict[str, Path | str] = {"base": cfg["checkpoint"]}
    for arm in cfg["arms"]:
        if isinstance(arm, str):
            arm = {"name": arm, "dir": cfg["evidence_dir"], "kind": arm}
        for run in sorted((ROOT / arm["dir"]).glob(f"{arm['name']}_seed*")):
            export = run / arm["kind"] / "export"
            if (export / "config.json").is_file() and (export / "model.safetensors").is_file():
                models[run.name] = export
    return models


def weights_sha(path: Path) -> str:
    digest = hashlib.sha256()
    with (path / "model.safetensors").open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def load_model(spec: Path | str):
    from unicache_train.checkpoint.gguf import KNOWN, fetch
    from unicache_train.checkpoint.hf import import_hf

    path = fetch(spec) if isinstance(spec, str) and spec in KNOWN else Path(spec)
    model, _ = import_hf(path)
    retention = path / "kv_retention.safetensors"
    if retention.is_file():  # a learned retention policy exported beside the weights
        from unicache_train.compress.retention import load_retention

        load_retention(model, retention)
    return model.float().eval(), path


# ------------------------------------------------------------------------------ settings
def calibrate(cfg: dict, model, tok, raw: Path) -> dict[str, float]:
    """Removal rate per UniCache setting at its target reduction, on the base (cached)."""
    from unicache_train.data.eval_text import eval_documents
    from unicache_train.eval.budget import rate_for_reduction, unicache_compressor
    from unicache_train.eval.text import text_blocks

    path = raw / "calibration.json"
    rates = {}
    for shared in cfg.get("shared_raw", []):  # the same setting keeps the same rate
        file = ROOT / shared / "calibration.json"
        if file.is_file():
            rates.update(json.loads(file.read_text()))
    rates.update(json.loads(path.read_text()) if path.is_file() else {})
    todo = [n for n, s in cfg["settings"].items() if "reduction" in s and n not in rates]
    if not todo:
        return rates
    c = cfg["calibration"]
    # NOTE: calibration blocks come from the end of the chapter order, never scored below.
    docs = eval_documents()[::-1]
    ids = text_blocks(tok, docs, c["block"], c["blocks"])
    split = torch.full((ids.shape[0],), c["context"], dtype=torch.long)
    for name in todo:
        s = cfg["settings"][name]
        rate, got = rate_for_reduction(
            model,
            ids,
            split,
            lambda r, s=s: unicache_compressor(setting_config(s, r), model),
            float(s["reduction"]),
        )
        rates[name] = rate
        print(f"  {name}: rate {rate:.4f}, calibrated reduction {got:.2f}x", flush=True)
        raw.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rates, indent=1))  # after each: resumable
    return rates


def setting_config(s: dict, rate: float):
    """A setting's UniCache config at ``rate``: text-style UniCache, or a fixed / learned
    selection (``selection: sinks_recent | snapkv | retention``), with ``quantize`` storage."""
    from unicache_train.eval.budget import selection_unicache, text_unicache

    if s.get("selection"):
        return selection_unicache(s["selection"], rate, s["quantize"])
    return text_unicache(rate, 0, s["quantize"])


def compressor(cfg: dict, name: str, rates: dict[str, float], model=None):
    """A setting's compressor; a retention setting uses ``model``'s policy (its prior, sinks +
    recent, for a model trained without one)."""
    from unicache_train.eval.budget import unicache_compressor
    from unicache_train.seam import IdentityCompressor

    s = cfg["settings"][name]
    if not s:
        return IdentityCompressor()
    rate = rates[name] if "reduction" in s else float(s["rate"])
    return unicache_compressor(setting_config(s, rate), model)


# ------------------------------------------------------------------------------ tasks
def records(cfg: dict, task: str) -> list[dict]:
    from unicache_train.data.eval_text import eval_documents
    from unicache_train.data.recall_mix import EVAL_SEED_FLOOR
    from unicache_train.data.recall_task import RecallTask, passkey_records, recall_records

    t = cfg["tasks"][task]
    if int(t["seed"]) < EVAL_SEED_FLOOR:
        raise ValueError(f"tasks.{task}.seed={t['seed']} is out of range; >= {EVAL_SEED_FLOOR}")
    if t["kind"] == "passkey":
        return passkey_records(
            eval_documents(), int(t["n"]), int(t["seed"]), context_chars=int(t["context_chars"])
        )
    rt = RecallTask(pairs=int(t["pairs"]), style=t.get("style", "colon"))
    return recall_records(rt, int(t["n"]), int(t["seed"]))


def ppl_blocks(cfg: dict, tok) -> torch.Tensor:
    from unicache_train.data.eval_text import eval_documents
    from unicache_train.eval.text import text_blocks

    p = cfg["perplexity"]
    return text_blocks(tok, eval_documents(), int(p["block"]), int(p["blocks"]))


def write_jsonl(path: Path, rows: list[dict], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1))
    tmp.replace(path)  # NOTE: last, so a present .jsonl means a finished cell


def run_cell(cfg, task, setting, model, tok, rates, out: Path, meta: dict) -> str:
    from unicache_train.eval.recall import run_recall
    from unicache_train.eval.text import run_text_perplexity

    t0 = time.time()
    comp = compressor(cfg, setting, rates, model)
    if task == "ppl":
        blocks = ppl_blocks(cfg, tok)
        res = run_text_perplexity(model, blocks, int(cfg["perplexity"]["context"]), comp)
        rows = [
            {"block": i, "nll": s, "tokens": n}
            for i, (s, n) in enumerate(zip(res.block_nll_sum, res.block_tokens))
        ]
        info = {"ppl": res.perplexity}
        summary = f"ppl {res.perplexity:.3f}"
    else:
        recs = records(cfg, task)
        res = run_recall(model, tok, recs, comp, batch_size=int(cfg["batch_size"]))
        rows = res.rows
        lo, hi = res.interval
        info = {
            "hits": res.hits,
            "n": res.n,
            "kv_reduction": res.kv_reduction,
            "kv_bytes": res.kv_bytes,
            "baseline_bytes": res.baseline_bytes,
        }
        summary = f"{res.hits}/{res.n} [{lo:.2f}, {hi:.2f}] at {res.kv_reduction:.2f}x"
    seconds = time.time() - t0
    write_jsonl(
        out,
        rows,
        {
            **meta,
            **info,
            "task": task,
            "setting": setting,
            "rate": rates.get(setting),
            "seconds": seconds,
        },
    )
    return f"{summary} ({seconds:.0f}s)"


def run(cfg: dict) -> None:
    from unicache_train.data.tokenizer import load_tokenizer

    torch.set_num_threads(int(cfg["threads"]))
    raw = ROOT / cfg["raw_dir"]
    loaded: dict = {}

    def get(name: str, spec):
        if loaded.get("name") != name:
            loaded.clear()
            model, path = load_model(spec)
            sha = weights_sha(path)
            loaded.update(name=name, model=model, path=path, sha=sha)
        return loaded["model"], loaded["path"], loaded["sha"]

    base_model, base_path, _ = get("base", cfg["checkpoint"])
    tok = load_tokenizer(str(base_path))
    rates = calibrate(cfg, base_model, tok, raw)
    shared = [ROOT / d for d in cfg.get("shared_raw", [])]

    def done(m: str, task: str, s: str) -> bool:
        return any((d / m / f"{task}__{s}.jsonl").is_file() for d in [raw, *shared])

    while True:
        models = find_models(cfg)
        # A cell is [task, setting] (every model) or [task, setting, [model prefixes]].
        todo = [
            (cell[0], cell[1], m)
            for cell in cfg["order"]
            for m in models
            if (len(cell) < 3 or any(m.startswith(p) for p in cell[2]))
            and not done(m, cell[0], cell[1])
        ]
        if not todo:
            missing = sorted(set(cfg.get("expect", [])) - set(models))
            if not missing:
                break
            print(f"[{time.strftime('%H:%M:%S')}] waiting for {missing}", flush=True)
            time.sleep(60)
            continue
        task, setting, name = todo[0]
        model, path, sha = get(name, models[name])
        meta = {"model": name, "weights": str(path), "weights_sha256": sha}
        msg = run_cell(
            cfg, task, setting, model, tok, rates, raw / name / f"{task}__{setting}.jsonl", meta
        )
        print(
            f"[{time.strftime('%H:%M:%S')}] {name:<15} {task:<17} {setting:<17} {msg}", flush=True
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["run", "table", "prompts"])
    ap.add_argument("--config", type=Path, default=CONFIG)
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    if args.command == "run":
        run(cfg)
    elif args.command == "prompts":
        from unicache_train.eval.prompts import write_prompts

        for task in cfg["tasks"]:
            print(write_prompts(records(cfg, task), HERE / f"prompts_{task}.jsonl"))
    else:
        from table import write_table

        write_table(cfg, ROOT / cfg["raw_dir"], HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
