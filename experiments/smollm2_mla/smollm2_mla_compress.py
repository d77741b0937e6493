"""MLA + UniCache stacked on SmolLM2: a healed MLA model (``experiments/smollm2_mla/smollm2_mla.py --save-dir``)
evaluated with UniCache on its latent cache, at KV-bytes reductions counted against the SOURCE
GQA cache (SmolLM2-135M: 3 KV heads x 64 x (K + V) x 16 bit = 768 bytes per token and layer).

The MLA conversion alone gives ``384 / (R + Dr)``; UniCache's share is calibrated on held-out text
(:func:`unicache_train.eval.budget.rate_for_reduction`, bytes measured, the latent counted once)
to reach ``TARGET / (384 / (R + Dr))`` on the latent cache. Recall (8 pairs, held-out seeds) is
decoded on the compressed latent cache (:func:`unicache_train.model.generate.prefill_compressed`
with ``latent=True``), perplexity with the in-loop forward; the source's own uncompressed rows
come from the ``smollm2_mla.py`` CSV.

    python experiments/smollm2_mla/smollm2_mla_compress.py --model runs/smollm2_mla/mla_64+32_weighted \\
        --settings unicache@8 unicache_q4@8 unicache_q4@16
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import yaml

STUDY = yaml.safe_load(
    Path(__file__).with_name("study.yaml").read_text()
)  # the frozen mix + evaluation


def training_data(work: Path, ckpt, **data) -> dict:
    """The study's training mix written under ``work``; its data section (``data`` overrides)."""
    from unicache_train.data.recall_mix import study_training_data

    return study_training_data(STUDY, work, ckpt, **data)


def training_datamodule(work: Path, ckpt, **data):
    """:func:`training_data` as a set-up data module."""
    from unicache_train.data.config import DataConfig
    from unicache_train.data.datamodule import LMDataModule

    dm = LMDataModule(DataConfig(**training_data(work, ckpt, **data)))
    dm.setup()
    return dm


# METHOD -> (storage, scale granularity); "_ch": one scale per latent feature over the segment
# (the PCA latent's leading features are ~10x its median one: per-vector int4 scales round the
# quiet features to zero)
QUANT = {
    "unicache": ("int8", "token_head"),
    "unicache_q4": ("int4", "token_head"),
    "unicache_q4_ch": ("int4", "channel"),
    "unicache_ch": ("int8", "channel"),
    "unicache_fp": ("none", "token_head"),
}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="STEM of STEM.safetensors + STEM.json")
    ap.add_argument("--checkpoint", default="smollm2", help="the source (tokenizer, GQA config)")
    ap.add_argument(
        "--settings",
        nargs="+",
        default=["unicache@8", "unicache_q4@8"],
        help=f"METHOD@REDUCTION vs the source GQA cache; METHOD in {list(QUANT)}",
    )
    ap.add_argument(
        "--finetune-steps",
        type=int,
        default=0,
        help="compression-aware fine-tune of N steps with the FIRST setting's "
        "UniCache in the loop (the main recipe's training mix), then every "
        "setting is evaluated again",
    )
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--num-recall", type=int, default=32)
    ap.add_argument("--text-blocks", type=int, default=12)
    ap.add_argument("--label", default=None, help="model column (default: the stem's name)")
    ap.add_argument("--out", default="experiments/smollm2_mla/results/mla_compress.csv")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python experiments/smollm2_mla/smollm2_mla_compress.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    settings = []
    for spec in args.settings:
        method, _, red = spec.partition("@")
        if method not in QUANT or not red.replace(".", "", 1).isdigit() or float(red) <= 1:
            raise SystemExit(
                f"--settings {spec!r}: METHOD@REDUCTION, METHOD in {list(QUANT)}, REDUCTION > 1"
            )
        settings.append((method, float(red)))
    if args.finetune_steps < 0:
        raise SystemExit(f"--finetune-steps={args.finetune_steps} is out of range; allowed >= 0")

    from safetensors.torch import load_file

    from unicache_train.checkpoint.gguf import KNOWN, fetch
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.compress import UniCacheCompressor
    from unicache_train.data.reference_text import reference_documents
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval import RecallTask, recall_records, run_recall, run_text_perplexity
    from unicache_train.eval.budget import rate_for_reduction, text_unicache
    from unicache_train.eval.text import text_blocks
    from unicache_train.model import Decoder
    from unicache_train.model.config import ModelConfig
    from unicache_train.model.convert_mla import kv_elements_per_token
    from unicache_train.seam import IdentityCompressor

    t0 = time.time()
    ckpt = fetch(args.checkpoint) if args.checkpoint in KNOWN else Path(args.checkpoint)
    source, _ = import_hf(ckpt)
    src_elems = kv_elements_per_token(source.config)
    del source
    stem = Path(args.model)
    config = ModelConfig.from_dict(json.loads(stem.with_suffix(".json").read_text()))
    model = Decoder(config)
    model.load_state_dict(load_file(str(stem.with_suffix(".safetensors"))))
    model.eval()
    conv = src_elems / kv_elements_per_token(config)  # the conversion's reduction
    tok = load_tokenizer(str(ckpt))
    blocks = text_blocks(tok, reference_documents("heldout"), STUDY["text_block"], args.text_blocks)
    records = recall_records(
        RecallTask(**STUDY["recall_task"]), args.num_recall, STUDY["recall_seed"]
    )
    calib = blocks[:2]
    split = torch.full((2,), STUDY["text_context"], dtype=torch.long)
    label = args.label or stem.name
    rows: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def emit(row: dict) -> None:
        rows.append(row)
        with out.open("w", newline="") as f:
            f.write(f"# command: {command}\n")
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(row, f"[{time.time() - t0:.0f}s]", flush=True)

    def evaluate(name, target, rate, build) -> None:
        text = run_text_perplexity(model, blocks, STUDY["text_context"], build())
        rec = run_recall(model, tok, records, build(), batch_size=8)
        emit(
            {
                "model": label,
                "setting": name,
                "target_vs_source": target,
                "rate": rate,
                "kv_reduction_vs_latent": rec.kv_reduction,
                "kv_reduction_vs_source": rec.kv_reduction * conv,
                "recall": rec.accuracy,
                "recall_se": rec.stderr,
                "n": rec.n,
                "ppl": text.perplexity,
                "ppl_se": text.ppl_stderr,
            }
        )

    if args.finetune_steps and settings[0][1] / conv <= 1.0:
        raise SystemExit(
            f"--finetune-steps trains with the first setting, {args.settings[0]!r}, which the "
            f"conversion alone already reaches ({conv:.2f}x); put a setting above {conv:.2f}x first"
        )
    calibrated = []  # (name, target, rate, config)
    for method, red in settings:
        on_latent = red / conv
        quant, granularity = QUANT[method]
        if on_latent <= 1.0:
            print(f"{method}@{red}: the conversion alone gives {conv:.2f}x; skipped")
            continue
        with torch.no_grad():
            rate, got = rate_for_reduction(
                model,
                calib,
                split,
                lambda r, q=quant, g=granularity: UniCacheCompressor(text_unicache(r, 0, q, g)),
                on_latent,
            )
        print(
            f"{method}@{red}: rate {rate:.3f}, calibrated {got * conv:.2f}x vs source", flush=True
        )
        calibrated.append(
            (f"{method}@{red:g}", red, rate, text_unicache(rate, 0, quant, granularity))
        )

    def evaluate_all() -> None:
        evaluate("none", conv, 0.0, IdentityCompressor)
        for name, red, rate, cfg in calibrated:
            evaluate(name, red, rate, lambda c=cfg: UniCacheCompressor(c))

    evaluate_all()
    if args.finetune_steps:
        from unicache_train.train.config import TrainConfig
        from unicache_train.train.loop import endless, train_steps

        data = training_datamodule(stem.parent, ckpt)
        name, _, _, cfg = calibrated[0]
        res = train_steps(
            model,
            endless(data.train_dataloader),
            args.finetune_steps,
            args.lr,
            max(1, args.finetune_steps // 8),
            TrainConfig(weight_decay=0.0),
            compressor=UniCacheCompressor(cfg),
            desc=f"fine-tune {name} in loop",
        )
        print(
            f"compression-aware fine-tune: {args.finetune_steps} steps, {res.tokens} tokens, "
            f"{res.seconds:.0f}s",
            flush=True,
        )
        label = f"{label} + {args.finetune_steps} steps {name} in loop"
        evaluate_all()
    return rows


if __name__ == "__main__":
    main()
