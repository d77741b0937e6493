"""The long-context study (issue 36), frozen-backbone part: every setting of study.yaml on the
same held-out prompts, one uncompressed prefill per context (unicache_train.eval.long_context).

    python experiments/long_context/study.py fit-scorer   # scorer.safetensors + scorer_fit.csv
    python experiments/long_context/study.py calibrate    # calibration.json: rate per setting
    python experiments/long_context/study.py run          # raw/<setting>.jsonl (per prompt)
    python experiments/long_context/study.py table        # results.csv, tests.csv, results.md
    python experiments/long_context/study.py finetune --arm compress --seed 0   # the claim's arm
    python experiments/long_context/study.py finetune --arm control --seed 0    # its control
    python experiments/long_context/study.py run --model runs/long_context/compress_seed0/export
    python experiments/long_context/study.py kvpress-prompts   # token ids for the kvpress harness
    python experiments/long_context/study.py perplexity   # raw/ppl/<model>_<setting>.jsonl
    python experiments/long_context/study.py demo         # make demo: the short, labelled table

Every figure of the table recomputes from raw/*.jsonl (``table`` reads nothing else).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent


@contextlib.contextmanager
def _atomic(path: Path):
    """Write ``path`` through a temporary file renamed over it (never half-written)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        yield f
    tmp.replace(path)


def load_study(path: Path) -> dict:
    from unicache_train.validation import load_yaml

    return load_yaml(path.read_text())


def model_and_tokenizer(study: dict):
    from unicache_train.checkpoint.gguf import KNOWN, fetch
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.data.tokenizer import load_tokenizer

    name = study["checkpoint"]
    ckpt = fetch(name) if name in KNOWN else Path(name)
    model, _ = import_hf(ckpt)
    return model.eval(), load_tokenizer(str(ckpt))


def records(study: dict, tok, split: str, n: int, seed: int) -> list[dict]:
    from unicache_train.data.long_context import LongContextTask, long_context_records

    out = []
    for family in study["families"]:
        task = LongContextTask(family=family, tokens=int(study["length"]))
        out += long_context_records(task, n, seed, tok, split=split)
    return out


#: Plain int4 with one scale per (sample, head, feature) over the context (KIVI's per-channel
#: keys, here for K and V alike), per (sample, head), or KIVI's split (keys per feature in groups
#: of 32 tokens, values per token; added after the other rows): the scales' granularity alone,
#: against ``int4``'s one scale per token, head and K/V.
INT4_SCALES = {
    "int4_channel": {"granularity": "channel"},
    "int4_head": {"granularity": "head"},
    "int4_kivi": {
        "key_granularity": "channel_group",
        "value_granularity": "token_head",
        "group_size": 32,
    },
}


#: A method name ending so (``attention_global``) ranks its scores over all layers at once.
GLOBAL_SUFFIX = "_global"


def compressor(method: str, rate: float, scorer=None):
    from unicache_train.compress import UniCacheCompressor, presets
    from unicache_train.eval.budget import unicache_at_rate

    if method == "int4":
        return UniCacheCompressor(unicache_at_rate(presets.sinks_recent(), 0.0, "int4"))
    if method in INT4_SCALES:  # plain int4, its scales at another granularity
        from unicache_train.compress.config import UniCacheConfig

        d = unicache_at_rate(presets.sinks_recent(), 0.0, "int4").to_dict()
        d["quantize"].update(INT4_SCALES[method])
        return UniCacheCompressor(UniCacheConfig.from_dict(d))
    if method == "none":
        from unicache_train.seam import IdentityCompressor

        return IdentityCompressor()
    # "<method>_global": one budget over all layers (schedule.global_budget), KVzip's budget
    glob = method.endswith(GLOBAL_SUFFIX)
    method = method.removesuffix(GLOBAL_SUFFIX)
    base = presets.text_style_baseline() if method == "unicache" else getattr(presets, method)()
    cfg = unicache_at_rate(base, rate, "int4")
    if glob:
        from unicache_train.compress.config import UniCacheConfig

        d = cfg.to_dict()
        d["schedule"]["global_budget"] = True
        cfg = UniCacheConfig.from_dict(d)
    if method == "attention":
        return UniCacheCompressor(cfg, attention_scorer=scorer)
    return UniCacheCompressor(cfg)


def read_scorer(model):
    from unicache_train.compress.attention_scorer import read_attention_scorer

    c = model.config
    return read_attention_scorer(
        HERE / "scorer.safetensors", (c.num_hidden_layers, c.num_key_value_heads, c.head_size)
    )


# ------------------------------------------------------------------------------ commands
def fit_scorer(study: dict) -> None:
    from unicache_train.compress.attention_scorer import save_attention_scorer
    from unicache_train.train.scorer_fit import fit_attention_scorer

    model, tok = model_and_tokenizer(study)
    cfg = study["scorer_fit"]
    recs = records(study, tok, "train", int(cfg["n"]), int(cfg["seed"]))
    fit = fit_attention_scorer(
        model,
        tok,
        recs,
        heldout_every=int(cfg["heldout_every"]),
        ridge=float(cfg["ridge"]),
        repeat=bool(cfg["repeat"]),
        log=lambda m: print(m, flush=True),
    )
    save_attention_scorer(fit.scorer, HERE / "scorer.safetensors")
    with _atomic(HERE / "scorer_fit.csv") as f:
        w = csv.writer(f)
        w.writerow(["layer", "kv_head", "heldout_r2", "heldout_spearman"])
        for layer in range(fit.r2.shape[0]):
            for h in range(fit.r2.shape[1]):
                w.writerow(
                    [
                        layer,
                        h,
                        round(float(fit.r2[layer, h]), 4),
                        round(float(fit.spearman[layer, h]), 4),
                    ]
                )
    print(json.dumps(fit.summary()))
    (HERE / "scorer_fit.json").write_text(json.dumps(fit.summary(), indent=2) + "\n")


def calibrate(study: dict, only: list[str] | None = None) -> None:
    """Per (method, reduction) the smallest rate whose measured reduction on the calibration
    contexts reaches the target (bisection on compress-only passes over one recording).
    ``only``: these methods, the other entries of calibration.json kept as they are."""
    from unicache_train.compress.config import MAX_RATE
    from unicache_train.eval.long_context import sample_kv_bytes, segments_for
    from unicache_train.seam import RecordingCompressor

    model, tok = model_and_tokenizer(study)
    cal = study["calibration"]
    recs = records(study, tok, "train", int(cal["n"]), int(cal["seed"]))
    ctx = [tok.encode(r["context"], add_bos=True) for r in recs]
    P = max(map(len, ctx))
    ids = torch.full((len(ctx), P), tok.pad_token_id)
    for b, c in enumerate(ctx):
        ids[b, : len(c)] = torch.tensor(c)
    split = torch.tensor([len(c) for c in ctx])
    capture = RecordingCompressor()
    with torch.no_grad():
        model(ids, split=split, compressor=capture, logits_at=(split - 1)[:, None])
    scorer = read_scorer(model) if _needs_scorer(study) else None

    def reduction(method: str, rate: float) -> float:
        with torch.no_grad():
            kv, base = sample_kv_bytes(
                segments_for(capture.inputs, compressor(method, rate, scorer))
            )
        return sum(base) / sum(kv)

    out = {"int4": {"rate": 0.0, "reduction": reduction("int4", 0.0)}}
    methods = study["methods"]
    if only:
        out = json.loads((HERE / "calibration.json").read_text())
        methods = [m for m in methods if m in only]
    for method in methods:
        for red in study["reductions"]:
            lo, hi = 0.0, MAX_RATE
            if reduction(method, hi) < red:
                out[f"{method}@{red}"] = {"rate": hi, "reduction": reduction(method, hi)}
                continue
            for _ in range(int(cal["iters"])):
                mid = 0.5 * (lo + hi)
                if reduction(method, mid) >= red:
                    hi = mid
                else:
                    lo = mid
            out[f"{method}@{red}"] = {"rate": hi, "reduction": reduction(method, hi)}
            print(
                f"{method}@{red}: rate {hi:.4f}, measured {out[f'{method}@{red}']['reduction']:.3f}x"
            )
    (HERE / "calibration.json").write_text(json.dumps(out, indent=2) + "\n")


def _needs_scorer(study: dict) -> bool:
    return any(m.removesuffix(GLOBAL_SUFFIX) == "attention" for m in study["methods"])


def _mode_prefix(setting: str) -> str:
    """``"aware:"`` of ``"aware:snapkv@16"``; ``""`` for the primary (query-agnostic) mode."""
    return setting.split(":", 1)[0] + ":" if ":" in setting else ""


def run(
    study: dict, only: list[str] | None, model_dir=None, label=None, mode: str = "agnostic"
) -> None:
    """Every setting on the held-out prompts (raw/<model>_<setting>.jsonl); a mode other than
    the primary ``agnostic`` prefixes its settings (``aware:snapkv@16``, ``questions:none``)."""
    from unicache_train.eval.long_context import run_long_context
    from unicache_train.eval.recall import write_predictions

    torch.set_num_threads(int(study.get("threads", 2)))
    name, model, tok, settings = _model_and_settings(study, only, model_dir, label)
    ev = study["eval"]
    recs = records(study, tok, "eval", int(ev["n"]), int(ev["seed"]))
    t0 = time.time()
    res, timing = run_long_context(
        model,
        tok,
        recs,
        settings,
        mode=mode,
        batch_size=int(study["batch_size"]),
        on_batch=lambda d, n: print(f"[{time.time() - t0:.0f}s] batch {d}/{n}", flush=True),
    )
    raw = HERE / "raw"
    label_ = name
    prefix = "" if mode == "agnostic" else f"{mode}:"
    res = {prefix + k: v for k, v in res.items()}
    for name, r in res.items():
        write_predictions(r.rows, raw / f"{label_}_{name}.jsonl", model=label_, setting=name)
        print(f"{name}: {r.hits}/{r.n} = {r.accuracy:.3f}, {r.kv_reduction:.2f}x", flush=True)
    print(json.dumps({**timing, "settings": len(settings), "prompts": len(recs)}))


def _row_order(row: dict) -> tuple:
    """Table order: the base first, then by model, mode, none / int4 / the rest, reduction."""
    order = {"none": 0, "int4": 1}
    return (
        row["model"] != "base",
        row["model"],
        _mode_prefix(row["setting"]),
        order.get(row["setting"].split(":")[-1], 2),
        float(row["kv_reduction"]),
        row["setting"],
    )


def _model_and_settings(study: dict, only, model_dir, label):
    """The model's label (``base``, ``label`` or the export's run folder), the model, its
    tokenizer and the settings to evaluate (all of :func:`_settings`, or ``only`` these)."""
    name = "base"
    if model_dir is not None:
        study = {**study, "checkpoint": str(model_dir)}
        name = label or Path(model_dir).parent.name
    model, tok = model_and_tokenizer(study)
    scorer = read_scorer(model) if _needs_scorer(study) else None
    settings = _settings(study, scorer)
    if only:
        settings = {k: v for k, v in settings.items() if k in only}
    return name, model, tok, settings


def _settings(study: dict, scorer) -> dict:
    """Every setting of the study: none, int4, and each method at each reduction (its rate
    from calibration.json)."""
    cal = json.loads((HERE / "calibration.json").read_text())
    settings = {"none": compressor("none", 0.0), "int4": compressor("int4", 0.0)}
    settings.update({name: compressor(name, 0.0) for name in INT4_SCALES})
    for method in study["methods"]:
        for red in study["reductions"]:
            key = f"{method}@{red}"
            settings[key] = compressor(method, cal[key]["rate"], scorer)
    return settings


def perplexity(study: dict, only: list[str] | None, model_dir=None, label=None) -> None:
    """Held-out perplexity at each setting: windows of the evaluation haystack's prose (the
    King James Bible, evaluation seeds), the first ``length - scored`` tokens compressed
    query-agnostically, the last ``scored`` teacher-forced on the compressed cache
    (unicache_train.eval.long_context.continuation_nll). raw/ppl/<model>_<setting>.jsonl."""
    from unicache_train.data.long_context import prose_windows
    from unicache_train.eval.long_context import continuation_nll

    name, model, tok, settings = _model_and_settings(study, only, model_dir, label)
    cfg = study["perplexity"]
    length, scored = int(study["length"]), int(cfg["scored"])
    wins = prose_windows(tok, int(cfg["n"]), length, int(cfg["seed"]), split="eval")
    t0 = time.time()
    res = continuation_nll(
        model,
        [w["ids"] for w in wins],
        length - scored,
        settings,
        ids=[w["id"] for w in wins],
        batch_size=int(study["batch_size"]),
        progress=True,
    )
    raw = HERE / "raw" / "ppl"
    raw.mkdir(parents=True, exist_ok=True)
    for setting, rows in res.items():
        with _atomic(raw / f"{name}_{setting}.jsonl") as f:
            for r in rows:
                f.write(json.dumps({"model": name, "setting": setting, **r}) + "\n")
        nll, n = sum(r["nll"] for r in rows), sum(r["tokens"] for r in rows)
        red = sum(r["baseline_bytes"] for r in rows) / sum(r["kv_bytes"] for r in rows)
        print(f"{setting}: ppl {math.exp(nll / n):.3f}, {red:.2f}x", flush=True)
    print(json.dumps({"seconds": round(time.time() - t0, 1), "windows": len(wins)}))


def ppl_table(study: dict) -> list[dict]:
    """ppl.csv from raw/ppl/*.jsonl: per model and setting the perplexity of the scored tokens,
    its change against the same model uncompressed on the same windows, and the paired
    bootstrap 95% interval of that change (resampling windows)."""
    from unicache_train.eval.stats import paired_bootstrap_ppl

    raw = HERE / "raw" / "ppl"
    cells = {}
    for path in sorted(raw.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        if rows:
            cells[(rows[0]["model"], rows[0]["setting"])] = rows
    out = []
    for (model, setting), rows in cells.items():
        none = cells.get((model, "none"))
        if not none:
            continue
        ref = {r["id"]: r for r in none}
        t = paired_bootstrap_ppl(
            [ref[r["id"]]["nll"] for r in rows],
            [r["nll"] for r in rows],
            [r["tokens"] for r in rows],
        )
        red = sum(r["baseline_bytes"] for r in rows) / sum(r["kv_bytes"] for r in rows)
        out.append(
            {
                "model": model,
                "setting": setting,
                "kv_reduction": round(red, 3),
                "windows": len(rows),
                "tokens": sum(r["tokens"] for r in rows),
                "ppl": round(t.ppl_b, 4),
                "ppl_uncompressed": round(t.ppl_a, 4),
                "change": round(t.change, 4),
                "change_lo": round(t.lo, 4),
                "change_hi": round(t.hi, 4),
                # the target (perplexity within 5%): met if the whole interval is, missed if
                # none of it is, otherwise the 5% line is inside the noise
                "within_5pct": "met" if t.hi <= 0.05 else "missed" if t.lo > 0.05 else "noise",
            }
        )
    out.sort(key=_row_order)
    if out:
        with _atomic(HERE / "ppl.csv") as f:
            w = csv.DictWriter(f, fieldnames=list(out[0]))
            w.writeheader()
            w.writerows(out)
    return out


def kvpress_prompts(study: dict, out: Path) -> None:
    """The evaluation prompts as token ids, for the kvpress harness's venv (which runs without
    our package): per record ``context_ids`` (``[bos] + context``), ``question_ids``,
    ``answers`` and ``max_new``, exactly what :func:`~unicache_train.eval.long_context.
    run_long_context` feeds and generates in the query-agnostic mode, so a no-press row there
    must reproduce our uncompressed row token for token."""
    from unicache_train.checkpoint.gguf import KNOWN, fetch
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval.long_context import ANSWER_MARGIN

    name = str(study["checkpoint"])
    tok = load_tokenizer(str(fetch(name) if name in KNOWN else Path(name)))
    ev = study["eval"]
    recs = records(study, tok, "eval", int(ev["n"]), int(ev["seed"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    with _atomic(out) as f:
        for r in recs:
            row = {
                "id": r["id"],
                "task": r["task"],
                "family": r["family"],
                "context_ids": tok.encode(r["context"], add_bos=True),
                "question_ids": tok.encode(r["question"]),
                "answers": list(r["answers"]),
                "max_new": len(tok.encode(" " + ", ".join(r["answers"]))) + ANSWER_MARGIN,
            }
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(recs)} prompts as token ids to {out}")


def run_label(study: dict, arm: str, seed: int, data_seed: int | None = None) -> str:
    """The run's folder and model label: ``{arm}_seed{S}``, with ``_data{K}`` when the data
    order is not the study's pinned ``finetune.data_seed``."""
    pinned = int(study["finetune"]["data_seed"])
    suffix = "" if data_seed is None or int(data_seed) == pinned else f"_data{int(data_seed)}"
    return f"{arm}_seed{seed}{suffix}"


#: The fine-tune arm with the scorer's one budget over all layers in the loop.
GLOBAL_ARM = "compress" + GLOBAL_SUFFIX
#: The fine-tuned arms: the scorer + int4 in the loop with a budget per layer (``compress``) or
#: one budget over all layers (:data:`GLOBAL_ARM`), and the control (nothing compressed).
FINETUNE_ARMS = ("compress", GLOBAL_ARM, "control")


def finetune_spec(study: dict, arm: str, seed: int, data_seed: int | None = None):
    """The :class:`~unicache_train.train.finetune.FinetuneSpec` of one arm and seed, from the
    frozen ``finetune`` section: the compression-aware fine-tune (``compress``: the fitted scorer
    + int4 in the loop at the ``finetune.reduction`` setting's calibrated rate, the keep ratio
    ramped from 1 over ``curriculum_steps``, KL to the uncompressed forward on the answer; with
    ``compress_global`` the scorer ranks over all layers at once, at ``attention_global``'s rate)
    or its control (``control``: the same data, splits, steps and loss, nothing compressed).
    ``data_seed`` (None: the pinned ``finetune.data_seed``) orders the data; ``seed`` seeds the
    rest (``train.seed``, ``compress.seed``)."""
    from unicache_train.train.finetune import FinetuneSpec
    from unicache_train.validation import ConfigError

    if arm not in FINETUNE_ARMS:
        raise ConfigError(
            f"finetune --arm={arm!r} is not allowed; choose one of {', '.join(FINETUNE_ARMS)}"
        )
    ft = study["finetune"]
    cal = json.loads((HERE / "calibration.json").read_text())
    compress = {"enabled": True, "method": "none"}
    if arm != "control":
        # compress_global: the scorer ranks over all layers at once (schedule.global_budget),
        # at that setting's own calibrated rate (the same measured bytes as attention@16's)
        glob = arm == GLOBAL_ARM
        setting = f"attention{GLOBAL_SUFFIX if glob else ''}@{ft['reduction']}"
        unicache = {"target_rate": cal[setting]["rate"], "quantize": {"bits": 4}}
        if glob:
            unicache["schedule"] = {"global_budget": True}
        compress = {
            "enabled": True,
            "method": "unicache",
            "preset": "attention",
            "attention_scorer": str(HERE / "scorer.safetensors"),
            "unicache": unicache,
        }
    return FinetuneSpec.from_dict(
        {
            "checkpoint": study["checkpoint"],
            "out_dir": str(Path(ft["out_dir"]) / run_label(study, arm, seed, data_seed)),
            "seed": seed,
            "data_seed": int(ft["data_seed"] if data_seed is None else data_seed),
            "steps": int(ft["steps"]),
            "mix": {
                "kind": "long_context",
                "tasks": list(study["families"]),
                "length": int(ft["length"]),
                "records": int(ft["records"]),
                "seed": int(ft["seed"]),
            },
            "compress": {**compress, "seed": seed, **ft.get("compress", {})},
            "run": ft["run"],
        }
    )


def finetune(study: dict, arm: str, seed: int, data_seed: int | None = None) -> None:
    """Run :func:`finetune_spec`'s spec through the library's fine-tune; the export (with the
    scorer beside the weights for the compress arm) lands in ``<out_dir>/export``."""
    from unicache_train.train.finetune import finetune as run_finetune

    result = run_finetune(finetune_spec(study, arm, seed, data_seed))
    print(f"{arm} seed {seed}: {result.steps} steps in {result.seconds:.0f}s -> {result.out_dir}")


#: The demo's settings: the uncompressed row, int4 storage alone, the best of our training-free
#: selections at 16x, and the learned scorer with one budget over all layers at 8x and 16x (the
#: claim's setting; with a budget per layer it keeps 3/200 at 16x, step 2 of the study).
DEMO_SETTINGS = ("none", "int4", "sinks_recent@16", "attention_global@8", "attention_global@16")
#: The demo's arms (its labels and folders) and the study's fine-tune arm each one runs.
DEMO_ARMS = {"compress": GLOBAL_ARM, "control": "control"}


def demo_spec(study: dict, arm: str, steps: int, out: Path):
    """The demo's fine-tune of ``arm`` (a :data:`DEMO_ARMS` label): the study's seed-0 spec of
    its arm (:func:`finetune_spec`) with ``steps`` steps, its folder under ``out``, the keep ratio
    ramped over the first half (the study: 30 of 60), warmup and the checkpoint within the run."""
    from unicache_train.train.finetune import FinetuneSpec

    d = finetune_spec(study, DEMO_ARMS[arm], 0).to_dict()
    d["steps"] = steps
    d["out_dir"] = str(out / arm)
    if arm == "compress":
        d["compress"]["curriculum_steps"] = max(1, steps // 2)
    train = d["run"]["train"]
    train["checkpoint_every_n_steps"] = steps
    train["warmup_steps"] = min(int(train["warmup_steps"]), steps)
    return FinetuneSpec.from_dict(d)


def demo(study: dict, out: Path, steps: int, n: int, keep_checkpoints: bool = False) -> list[dict]:
    """The short, labelled version of the study's table (``make demo``, about 13 minutes on 2
    cores): the base, a compression-aware fine-tune (the scorer with one budget over all layers in the
    loop, :data:`DEMO_ARMS`) and its control (``steps`` steps each instead of the
    study's 60, the same spec otherwise), each on the first ``n`` held-out prompts per family
    (a subset of the study's 200) at :data:`DEMO_SETTINGS`. Writes ``<out>/raw/*.jsonl`` (per
    prompt), ``<out>/demo.csv`` and prints the table with Wilson intervals and the claim's
    McNemar test (at this size, expect it inside the noise: the study's figures are the record).
    Each arm's Lightning checkpoints (two 1.6 GB files) are removed once its export is written,
    unless ``keep_checkpoints``: the export is what is evaluated and served.
    """
    from unicache_train.eval.long_context import run_long_context
    from unicache_train.eval.recall import write_predictions
    from unicache_train.eval.stats import mcnemar_exact, wilson_interval
    from unicache_train.train.finetune import finetune as run_finetune
    from unicache_train.validation import ConfigError

    if steps < 1:
        raise ConfigError(f"demo --steps={steps} is out of range; allowed >= 1")
    if n < 1:
        raise ConfigError(f"demo --n={n} is out of range; allowed >= 1 (prompts per family)")
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)

    def evaluate(label: str, model_dir: Path | None) -> dict[str, list[dict]]:
        st = study if model_dir is None else {**study, "checkpoint": str(model_dir)}
        model, tok = model_and_tokenizer(st)
        settings = _settings(study, read_scorer(model))
        settings = {k: settings[k] for k in DEMO_SETTINGS}
        recs = records(study, tok, "eval", n, int(study["eval"]["seed"]))
        print(
            f"[demo] {label}: {len(recs)} held-out prompts x {len(settings)} settings", flush=True
        )
        res, _ = run_long_context(
            model, tok, recs, settings, batch_size=int(study["batch_size"]), progress=True
        )
        for name, r in res.items():
            write_predictions(r.rows, raw / f"{label}_{name}.jsonl", model=label, setting=name)
        return {name: r.rows for name, r in res.items()}

    t0 = time.time()
    cells = {"base": evaluate("base", None)}
    for arm in DEMO_ARMS:
        print(f"[demo] fine-tune, {DEMO_ARMS[arm]} arm: {steps} steps", flush=True)
        result = run_finetune(demo_spec(study, arm, steps, out))
        if not keep_checkpoints and result.export_dir is not None and result.export_dir.is_dir():
            shutil.rmtree(result.checkpoint.parent)
            print(f"[demo] removed {result.checkpoint.parent} (--keep-checkpoints keeps it)")
        cells[arm] = evaluate(arm, result.export_dir)
    rows = []
    for model, by_setting in cells.items():
        for name in DEMO_SETTINGS:
            rs = by_setting[name]
            hits = sum(r["correct"] for r in rs)
            lo, hi = wilson_interval(hits, len(rs))
            kv = sum(r["kv_bytes"] for r in rs)
            rows.append(
                {
                    "model": model,
                    "setting": name,
                    "kv_reduction": round(sum(r["baseline_bytes"] for r in rs) / kv, 2),
                    "hits": hits,
                    "n": len(rs),
                    "accuracy": round(hits / len(rs), 3),
                    "wilson_lo": round(lo, 3),
                    "wilson_hi": round(hi, 3),
                }
            )
    with _atomic(out / "demo.csv") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    labels = {
        "none": "uncompressed",
        "int4": "int4 only",
        "sinks_recent@16": "sinks + recent @16x",
        "attention_global@8": "learned scorer, one budget over layers @8x",
        "attention_global@16": "learned scorer, one budget over layers @16x",
    }
    arms = {"base": "base", "compress": "compression-aware FT", "control": "control FT"}
    print(
        f"\nLong-context demo: SmolLM2-135M, {n} held-out prompts per needle family "
        f"({4 * n} a cell), 1024 tokens, query-agnostic, {steps} fine-tune steps per arm "
        f"(the study: 200 prompts, 60 steps, two seeds; experiments/long_context)\n"
    )
    print("| setting | " + " | ".join(arms.values()) + " |")
    print("|---|" + "---|" * len(arms))
    for name in DEMO_SETTINGS:
        cols = []
        for model in arms:
            r = next(x for x in rows if x["model"] == model and x["setting"] == name)
            cols.append(f"{r['hits']}/{r['n']} [{r['wilson_lo']:.2f}, {r['wilson_hi']:.2f}]")
        red = next(x for x in rows if x["setting"] == name)["kv_reduction"]
        print(f"| {labels[name]} ({red:.1f}x) | " + " | ".join(cols) + " |")
    a, b = cells["compress"]["attention_global@16"], cells["control"]["attention_global@16"]
    t = mcnemar_exact([r["correct"] for r in a], [r["correct"] for r in b])
    print(
        f"\nThe claim at this size (compress vs control, one-budget scorer @16x, exact McNemar): "
        f"{t.a_hits} vs {t.b_hits} of {t.n}, p = {t.p_value:.2g}. "
        f"{time.time() - t0:.0f} s; per prompt: {raw}, table: {out / 'demo.csv'}"
    )
    return rows


def _cells(raw: Path) -> dict[tuple[str, str], list[dict]]:
    cells = {}
    for path in sorted(raw.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        if rows and "setting" in rows[0]:
            cells[(rows[0]["model"], rows[0]["setting"])] = rows
    return cells


def _test(a: list[dict], b: list[dict]) -> dict:
    """Exact McNemar on the same prompts; in the several-questions mode (the questions of a
    context share its compressed cache, so they are not independent pairs) the exact sign-flip
    test clustered by context, ``n`` then counting (context, question) pairs."""
    from unicache_train.eval.stats import mcnemar_exact, sign_flip_clustered

    def key(r):  # a prompt; in the several-questions mode a (context, question) pair
        return r["id"], r.get("question_index", 0)

    bid = {key(r): r["correct"] for r in b}
    questions = sorted({r.get("question_index", 0) for r in a})
    if len(questions) > 1:
        # Contexts carry 1-4 questions: a missing (context, question) is False in both arms,
        # which adds nothing to a context's difference, its hits or its discordant counts.
        ids = sorted({r["id"] for r in a})
        aid = {key(r): r["correct"] for r in a}
        t = sign_flip_clustered(
            [[aid.get((i, q), False) for i in ids] for q in questions],
            [[bid.get((i, q), False) if (i, q) in aid else False for i in ids] for q in questions],
        )
    else:
        t = mcnemar_exact([r["correct"] for r in a], [bid[key(r)] for r in a])
    return {
        "n": len(a),
        "hits_a": t.a_hits,
        "hits_b": t.b_hits,
        "only_a": t.only_a,
        "only_b": t.only_b,
        "p_mcnemar": t.p_value,
    }


def _seed_of(model: str) -> str:
    """``compress_seed1_data1`` -> ``1``; a label without a seed -> ``0``."""
    return model.rsplit("_seed", 1)[-1].split("_", 1)[0] if "_seed" in model else "0"


def _arm_label(model: str) -> str:
    """``compress_global_seed1_data1`` -> ``compress_global``; ``base`` -> ``base``."""
    return model.rsplit("_seed", 1)[0]


def _control_of(model: str, models: list[str]) -> str | None:
    """The control a fine-tuned model is paired with: the control of the same seed (its first
    label in sort order, the pinned data order before any ``_data{K}``)."""
    same = [m for m in models if m.startswith("control_seed") and _seed_of(m) == _seed_of(model)]
    return same[0] if same else None


def _column(cells: dict, model: str, name: str) -> list[bool]:
    """A cell's correctness in prompt order (id, then question index)."""
    rows = sorted(cells[(model, name)], key=lambda r: (r["id"], r.get("question_index", 0)))
    return [bool(r["correct"]) for r in rows]


def _seed_pairs(cells: dict, arm_a: str, arm_b: str, names: list[str]) -> list[tuple[str, str]]:
    """(A model, B model) for each training seed of ``arm_a`` that has every setting in
    ``names``: B is the base, or ``arm_b``'s model of the same seed (its first label in sort
    order, as :func:`_control_of`), which must have every setting too. Pairs by seed, so a seed
    missing on one side drops out instead of shifting the pairing."""

    def seeds_of(arm: str) -> list[str]:
        return sorted({m for m, _ in cells if m.startswith(f"{arm}_seed")})

    def has(model: str) -> bool:
        return all((model, n) in cells for n in names)

    pairs = []
    for a in filter(has, seeds_of(arm_a)):
        same = [m for m in seeds_of(arm_b) if _seed_of(m) == _seed_of(a)]
        b = "base" if arm_b == "base" else (same[0] if same else None)
        if b is not None and has(b):
            pairs.append((a, b))
    return pairs


def _same_prompts(cells: dict, keys: list[tuple[str, str]]) -> bool:
    """Whether the cells ``keys`` ((model, setting)) hold the same prompts: a pooled test needs
    them, and a subset cell (a sanity row on 50 of the 200 prompts) is left out of it."""
    return len({frozenset(r["id"] for r in cells[k]) for k in keys}) <= 1


def _clustered_counts(t) -> dict:
    """A pooled test's columns in tests.csv (a ``ClusteredPaired``): ``only_a``/``only_b`` count
    (prompt, seed) pairs with only one side right, ``favour_a``/``favour_b`` the prompts whose
    difference summed over the seeds favours each side (what the sign-flip test reads)."""
    return {
        "n": t.prompts,
        "hits_a": t.a_hits,
        "hits_b": t.b_hits,
        "only_a": t.only_a,
        "only_b": t.only_b,
        "p_mcnemar": t.p_value,
        "favour_a": t.favour_a,
        "favour_b": t.favour_b,
    }


def _drop_counts(t) -> dict:
    """A drop test's columns in tests.csv (a ``DropDifference``): each side's hits in both
    settings, its drop, the prompts favouring each side and the sign-flip p."""
    return {
        "n": t.prompts,
        "hits_a": t.a_compressed,
        "hits_b": t.b_compressed,
        "full_a": t.a_full,
        "full_b": t.b_full,
        "drop_a": t.a_drop,
        "drop_b": t.b_drop,
        "p_mcnemar": t.p_value,
        "favour_a": t.favour_a,
        "favour_b": t.favour_b,
    }


#: (our setting on the compression-aware arm, the best training-free anchor on the control):
#: the claim against what a training-free method gets from the same training, at equal bytes.
ANCHOR_ON_CONTROL = ("attention_global@16", "kvpress_KVzip_int4@16")


def _anchor_on_control_tests(cells: dict) -> list[dict]:
    """The claim against the best training-free anchor (:data:`ANCHOR_ON_CONTROL`), paired by
    seed and pooled (exact sign-flip clustered by prompt): :data:`GLOBAL_ARM` with its scorer vs
    the control read through KVzip + int4, both at 16x fewer KV bytes (the claim); and, on the
    same weights, each fine-tuned arm's scorer vs KVzip (whether what the fine-tune learned is
    specific to the scorer it was trained with)."""
    from unicache_train.eval.stats import sign_flip_clustered

    ours, anchor = ANCHOR_ON_CONTROL
    claim = [
        (a, b) for a, b in _seed_pairs(cells, GLOBAL_ARM, "control", [ours]) if (b, anchor) in cells
    ]
    models = sorted({m for m, _ in cells})
    same = {
        arm: [
            m
            for m in models
            if m.startswith(f"{arm}_seed") and (m, ours) in cells and (m, anchor) in cells
        ]
        for arm in (GLOBAL_ARM, "control")
    }
    comparisons = [
        ("fine-tune + scorer vs control + best anchor", claim, f"control seeds {anchor}")
    ]
    comparisons += [
        ("scorer vs best anchor, same weights", [(m, m) for m in ms], f"{arm} seeds {anchor}")
        for arm, ms in same.items()
    ]
    out = []
    for what, seeds, b_label in comparisons:
        keys = [k for a, b in seeds for k in ((a, ours), (b, anchor))]
        if len(seeds) < 2 or not _same_prompts(cells, keys):
            continue
        t = sign_flip_clustered(
            [_column(cells, a, ours) for a, _ in seeds],
            [_column(cells, b, anchor) for _, b in seeds],
        )
        arm = _arm_label(seeds[0][0])
        out.append(
            {
                "comparison": f"{what}, pooled, clustered by prompt",
                "a": f"{arm} seeds {len(seeds)} {ours}",
                "b": b_label,
                **_clustered_counts(t),
            }
        )
    out += _margin_over_anchor_test(cells, same[GLOBAL_ARM], same["control"])
    return out


def _margin_over_anchor_test(cells: dict, tuned: list[str], controls: list[str]) -> list[dict]:
    """Whether the compression-aware fine-tune widens its scorer's margin over the best anchor
    more than the control's training does: per prompt, (scorer - KVzip) on the fine-tune's
    weights against (scorer - KVzip) on the control's, pooled over seeds and clustered by
    prompt (:func:`~unicache_train.eval.stats.drop_difference_clustered` with the anchor as the
    "full" setting, so a negative drop is a scorer ahead of KVzip). ``tuned`` and ``controls``:
    the models that have both settings; each tuned model is paired with its seed's control
    (:func:`_control_of`)."""
    from unicache_train.eval.stats import drop_difference_clustered

    ours, anchor = ANCHOR_ON_CONTROL
    seeds = [(m, c) for m in tuned if (c := _control_of(m, controls)) is not None]
    keys = [(m, n) for p in seeds for m in p for n in (ours, anchor)]
    if len(seeds) < 2 or not _same_prompts(cells, keys):
        return []
    t = drop_difference_clustered(
        [_column(cells, x, anchor) for x, _ in seeds],
        [_column(cells, x, ours) for x, _ in seeds],
        [_column(cells, y, anchor) for _, y in seeds],
        [_column(cells, y, ours) for _, y in seeds],
    )
    return [
        {
            "comparison": "scorer's margin over the best anchor, fine-tune vs control, pooled, "
            "clustered by prompt",
            "a": f"{GLOBAL_ARM} seeds {len(seeds)} {ours} - {anchor}",
            "b": f"control seeds {ours} - {anchor}",
            **_drop_counts(t),
        }
    ]


def _pooled_tests(cells: dict) -> list[dict]:
    """The fine-tuned arms pooled over their training seeds, clustered by prompt (exact
    sign-flip, :func:`~unicache_train.eval.stats.sign_flip_clustered`): compress vs control, and
    each arm vs the base, on every setting that two or more seeds of both sides have, paired by
    seed (:func:`_seed_pairs`; the :data:`GLOBAL_ARM` also against the per-layer ``compress``
    arm)."""
    from unicache_train.eval.stats import sign_flip_clustered

    out = []
    settings = sorted({name for _, name in cells})
    pairs = [("compress", "control"), ("compress", "base"), ("control", "base")]
    pairs += [(GLOBAL_ARM, "control"), (GLOBAL_ARM, "base"), (GLOBAL_ARM, "compress")]
    for arm_a, arm_b in pairs:
        for name in settings:
            seeds = _seed_pairs(cells, arm_a, arm_b, [name])
            if len(seeds) < 2 or not _same_prompts(cells, [(m, name) for p in seeds for m in p]):
                continue
            t = sign_flip_clustered(
                [_column(cells, a, name) for a, _ in seeds],
                [_column(cells, b, name) for _, b in seeds],
            )
            out.append(
                {
                    "comparison": "pooled over seeds, clustered by prompt",
                    "a": f"{arm_a} seeds {len(seeds)} {name}",
                    "b": f"{arm_b} {name}" if arm_b == "base" else f"{arm_b} seeds {name}",
                    **_clustered_counts(t),
                }
            )
    return out


def _drop_tests(cells: dict) -> list[dict]:
    """What compression costs each fine-tuned arm against the control and the base, pooled over
    seeds and clustered by prompt (:func:`~unicache_train.eval.stats.drop_difference_clustered`):
    per compressed setting, the arm's uncompressed hits minus its compressed hits against the
    other's, so an arm better everywhere by the same margin does not count as tolerating
    compression better. Paired by seed (:func:`_seed_pairs`); query-agnostic settings only (the
    other modes have their own ``none``)."""
    from unicache_train.eval.stats import drop_difference_clustered

    out = []
    names = sorted({n for _, n in cells if n != "none" and _mode_prefix(n) == ""})
    pairs = [(GLOBAL_ARM, "control"), ("compress", "control"), (GLOBAL_ARM, "base")]
    pairs.append(("control", "base"))
    for arm_a, arm_b in pairs:
        for name in names:
            seeds = _seed_pairs(cells, arm_a, arm_b, ["none", name])
            keys = [(m, n) for p in seeds for m in p for n in ("none", name)]
            if not seeds or not _same_prompts(cells, keys):
                continue
            t = drop_difference_clustered(
                [_column(cells, a, "none") for a, _ in seeds],
                [_column(cells, a, name) for a, _ in seeds],
                [_column(cells, b, "none") for _, b in seeds],
                [_column(cells, b, name) for _, b in seeds],
            )
            out.append(
                {
                    "comparison": "drop under compression, pooled over seeds, clustered by prompt",
                    "a": f"{arm_a} seeds {len(seeds)} {name}",
                    "b": f"{arm_b} {name}" if arm_b == "base" else f"{arm_b} seeds {name}",
                    **_drop_counts(t),
                }
            )
    return out


def table(study: dict) -> None:
    """results.csv (a row per model and setting), tests.csv (exact McNemar on the same
    prompts: the scorer against each anchor at the same reduction, per model; the fine-tuned
    arms against the base and the control of the same seed with the same setting; pooled over
    seeds, clustered by prompt, where two seeds exist: ``p_mcnemar`` is then the sign-flip
    test's p; what compression costs each fine-tuned arm against the control's and the base's
    cost, :func:`_drop_tests`, its ``favour_a``/``favour_b`` the prompts favouring each), from
    raw/*.jsonl only."""
    from unicache_train.eval.stats import wilson_interval

    cells = _cells(HERE / "raw")
    fams = study["families"]
    out = []
    for (model, name), rows in cells.items():
        none = cells.get((model, _mode_prefix(name) + "none"), [])
        kv = sum(r["kv_bytes"] for r in rows)
        base = sum(r["baseline_bytes"] for r in rows)
        hits = sum(r["correct"] for r in rows)
        lo, hi = wilson_interval(hits, len(rows))

        def acc(rs, f):
            sel = [r["correct"] for r in rs if r["family"] == f]
            return sum(sel) / len(sel) if sel else float("nan")

        rel = [acc(rows, f) / acc(none, f) for f in fams if none and acc(none, f) > 0]
        out.append(
            {
                "model": model,
                "setting": name,
                "kv_reduction": round(base / kv, 3),
                "n": len(rows),
                "hits": hits,
                "accuracy": round(hits / len(rows), 4),
                "wilson_lo": round(lo, 4),
                "wilson_hi": round(hi, 4),
                **{f"acc_{f}": round(acc(rows, f), 4) for f in fams},
                "relative_to_uncompressed": round(sum(rel) / len(rel), 4) if rel else "",
            }
        )
    out.sort(key=_row_order)
    with _atomic(HERE / "results.csv") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)
    tests = []

    def pair(comparison: str, a: tuple[str, str], b: tuple[str, str]) -> None:
        """Append the paired test of cells ``a`` and ``b`` ((model, setting)) if both exist."""
        if a in cells and b in cells:
            tests.append(
                {
                    "comparison": comparison,
                    "a": " ".join(a),
                    "b": " ".join(b),
                    **_test(cells[a], cells[b]),
                }
            )

    anchors = [m for m in study["methods"] if m.removesuffix(GLOBAL_SUFFIX) != "attention"]
    models = sorted({m for m, _ in cells})
    modes = sorted({_mode_prefix(n) for _, n in cells})
    for model, mode in ((m, p) for m in models for p in modes):
        for red in study["reductions"]:
            # ours (study.yaml methods) and kvpress's presses (experiments/kvpress harness)
            names = [f"{mode}{m}@{red}" for m in anchors] + sorted(
                n
                for m, n in cells
                if m == model and n.startswith(f"{mode}kvpress_") and n.endswith(f"@{red}")
            )
            for name in names:
                pair("scorer vs anchor", (model, f"{mode}attention@{red}"), (model, name))
                glob = (model, f"{mode}attention{GLOBAL_SUFFIX}@{red}")
                if not name.split(":")[-1].startswith("snapkv" + GLOBAL_SUFFIX):
                    pair("scorer, one budget over layers, vs anchor", glob, (model, name))
            for m in study["methods"]:  # ours: the same scores, one budget vs per layer
                if m.endswith(GLOBAL_SUFFIX):
                    per_layer = (model, f"{mode}{m.removesuffix(GLOBAL_SUFFIX)}@{red}")
                    glob = (model, f"{mode}{m}@{red}")
                    pair("ablation: one budget for all layers vs per layer", glob, per_layer)
    for model in models:  # int4's scales at another granularity, the same 4-bit codes
        for name in INT4_SCALES:
            pair("int4 scales: another granularity vs per token", (model, name), (model, "int4"))
    for model, name in sorted(cells):
        if name.startswith("kvpress_") and "_int4@" in name:
            # what eviction costs on top of the same int4 storage
            pair("anchor vs int4 only", (model, name), (model, "int4"))
    for model, name in sorted(cells):  # equal bytes: fewer tokens at int4 vs more at 16 bits
        if name.startswith("kvpress_") and "_int4@" in name:
            wide = (model, name.replace("_int4@", "_16bit@"))
            pair("storage at equal bytes: int4 vs 16-bit", (model, name), wide)
    for model, name in sorted(cells):  # KVzip's budget over all layers vs the same per layer
        if "kvpress_KVzipLayerwise_" in name:
            glob = (model, name.replace("KVzipLayerwise", "KVzip"))
            pair("ablation: one budget for all layers vs per layer", glob, (model, name))
    for model in models:
        ours, theirs = cells.get((model, "none")), cells.get((model, "kvpress_none"))
        if ours and theirs:  # the sanity row: kvpress's harness reproduces our uncompressed row
            same = {r["id"]: r["prediction"] for r in ours}
            pair("sanity: kvpress no-press vs ours", (model, "kvpress_none"), (model, "none"))
            tests[-1]["predictions_differ"] = sum(same[r["id"]] != r["prediction"] for r in theirs)
    for model in models:
        if model == "base":
            continue
        for m2, name in list(cells):
            if m2 != model:
                continue
            for other in ("base", _control_of(model, models)):
                if other != model:
                    pair("fine-tune vs reference", (model, name), (other, name))
    tests += _pooled_tests(cells)
    tests += _drop_tests(cells)
    tests += _anchor_on_control_tests(cells)
    for r in ppl_table(study):
        print(r)
    if tests:
        fields = list(dict.fromkeys(k for t in tests for k in t))
        with _atomic(HERE / "tests.csv") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(tests)
    for r in out:
        print(r)
    for t in tests:
        print(t)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "command",
        choices=[
            "fit-scorer",
            "calibrate",
            "run",
            "table",
            "finetune",
            "kvpress-prompts",
            "perplexity",
            "demo",
        ],
    )
    ap.add_argument(
        "--out", type=Path, help="kvpress-prompts: the JSONL to write; demo: its folder"
    )
    ap.add_argument("--steps", type=int, default=12, help="demo: fine-tune steps per arm")
    ap.add_argument("--n", type=int, default=8, help="demo: held-out prompts per family")
    ap.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="demo: keep each arm's Lightning checkpoints (by default only the export stays)",
    )
    ap.add_argument("--arm", default="compress")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--data-seed", type=int, help="finetune: the data order (default: finetune.data_seed)"
    )
    ap.add_argument("--model", help="run, perplexity: evaluate this export instead of the base")
    ap.add_argument("--label", help="run, perplexity: the model's label (default: its folder)")
    ap.add_argument(
        "--mode",
        default="agnostic",
        choices=["agnostic", "questions", "aware"],
        help="run: query-agnostic (primary), several questions on one compressed context, or "
        "query-aware (the question in the compressed prefill)",
    )
    ap.add_argument("--config", type=Path, default=HERE / "study.yaml")
    ap.add_argument(
        "--only", nargs="*", help="run, perplexity: these settings only; calibrate: these methods"
    )
    args = ap.parse_args(argv)
    study = load_study(args.config)
    torch.set_num_threads(int(study.get("threads", 2)))
    if args.command == "fit-scorer":
        fit_scorer(study)
    elif args.command == "calibrate":
        calibrate(study, args.only)
    elif args.command == "run":
        run(study, args.only, args.model, args.label, args.mode)
    elif args.command == "finetune":
        finetune(study, args.arm, args.seed, args.data_seed)
    elif args.command == "demo":
        demo(
            study,
            args.out or Path("runs/long_context/demo"),
            args.steps,
            args.n,
            keep_checkpoints=args.keep_checkpoints,
        )
    elif args.command == "perplexity":
        perplexity(study, args.only, args.model, args.label)
    elif args.command == "kvpress-prompts":
        kvpress_prompts(study, args.out or Path("runs/long_context/kvpress_prompts.jsonl"))
    else:
        table(study)


if __name__ == "__main__":
    main(sys.argv[1:])
