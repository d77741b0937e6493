"""SmolLM2-135M GQA -> MLA at several latent sizes: KV elements per token and layer, held-out
perplexity and recall before and after healing, next to the source fine-tuned the same steps.

MHA2MLA (arXiv 2502.14837) converts SmolLM-135M at latent sizes d_kv = 32 / 16 / 8, i.e. 120 /
72 / 48 cache elements per token and layer against the source's 2 x 3 KV heads x 64 = 384
(-68.75% / -81.25% / -87.5%). Our conversion (:mod:`unicache_train.model.convert_mla`) writes a
DeepseekV3 layout, so a size is ``R+Dr``: the latent ``c_kv`` width R plus ONE shared RoPE key
head of width Dr. The default sizes: 96 (4x), 72 and 48 elements (MHA2MLA's two smallest).

Per size: convert (calibration on training-split text), evaluate, heal ``--heal-steps`` steps on
the main recipe's training mix (recall records from training seeds + real text,
``recipes/smollm2_compress.yaml``), evaluate again. The source is fine-tuned the same steps on the
same batches (the fair reference). Evaluation: continuation perplexity of held-out text blocks
(``--text-blocks`` x 256 tokens, 192 of context) and key-value recall (8 pairs, held-out seeds
>= 1,000,000), uncompressed, with standard errors.

    python experiments/smollm2_mla/smollm2_mla.py                                  # ~40 min on 2 idle cores
    python experiments/smollm2_mla/smollm2_mla.py --sizes 64+32 --heal-steps 20 --num-recall 16
    python experiments/smollm2_mla/smollm2_mla.py --rope-selection 2norm --out experiments/smollm2_mla/results/2norm.csv

Writes ``--out`` (CSV, ``# command:`` first) and, with ``--save-dir``, each healed MLA model's
state dict + config (``<size>.safetensors``/``.json``) for the MLA + compression and export
follow-ups.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
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


SOURCE_SIZE = "source"


def parse_size(spec: str) -> tuple[int, int]:
    """``"64+32"`` -> (kv_lora_rank 64, qk_rope_head_dim 32)."""
    r, sep, dr = spec.partition("+")
    if not sep or not r.isdigit() or not dr.isdigit() or int(dr) % 2 or int(r) < 1:
        raise SystemExit(
            f"--sizes entry {spec!r} must be R+Dr with R >= 1 and Dr even (e.g. 64+32)"
        )
    return int(r), int(dr)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2", help="known name or local HF directory")
    ap.add_argument("--sizes", nargs="+", default=["64+32", "24+24", "48+24"])
    ap.add_argument("--rope-selection", default="weighted", choices=("weighted", "2norm"))
    ap.add_argument("--heal-steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--calib-seqs", type=int, default=16, help="calibration sequences of 256")
    ap.add_argument("--num-recall", type=int, default=32)
    ap.add_argument("--text-blocks", type=int, default=8)
    ap.add_argument("--no-control", action="store_true", help="skip the source fine-tune")
    ap.add_argument("--out", default="experiments/smollm2_mla/results/mla.csv")
    ap.add_argument("--save-dir", default="runs/smollm2_mla", help="'' to save nothing")
    ap.add_argument("--work-dir", default="runs/smollm2_mla")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes]
    torch.set_num_threads(args.threads)
    command = "python experiments/smollm2_mla/smollm2_mla.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )

    from unicache_train.checkpoint.gguf import KNOWN, fetch
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.data.reference_text import reference_documents
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval import RecallTask, recall_records, run_recall, run_text_perplexity
    from unicache_train.eval.text import text_blocks
    from unicache_train.model import Decoder
    from unicache_train.model.convert_mla import convert_to_mla_with_report, kv_elements_per_token
    from unicache_train.seam import IdentityCompressor
    from unicache_train.train.config import TrainConfig
    from unicache_train.train.loop import endless, train_steps

    t_start = time.time()
    ckpt = fetch(args.checkpoint) if args.checkpoint in KNOWN else Path(args.checkpoint)
    source, _ = import_hf(ckpt)
    tok = load_tokenizer(str(ckpt))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = training_datamodule(work, ckpt, seq_len=args.seq_len, batch_size=args.batch_size)
    train_cfg = TrainConfig(weight_decay=0.0)
    calib = text_blocks(tok, reference_documents("train"), 256, args.calib_seqs)
    blocks = text_blocks(tok, reference_documents("heldout"), STUDY["text_block"], args.text_blocks)
    records = recall_records(
        RecallTask(**STUDY["recall_task"]), args.num_recall, STUDY["recall_seed"]
    )

    def evaluate(model) -> dict:
        text = run_text_perplexity(model, blocks, STUDY["text_context"], IdentityCompressor())
        rec = run_recall(model, tok, records, IdentityCompressor(), batch_size=8)
        return {
            "ppl": text.perplexity,
            "ppl_se": text.ppl_stderr,
            "recall": rec.accuracy,
            "recall_se": rec.stderr,
            "n_recall": rec.n,
        }

    def heal(model, name) -> dict:
        # Same seeded batch order for every model: the loader is rebuilt from the start.
        res = train_steps(
            model,
            endless(data.train_dataloader),
            args.heal_steps,
            args.lr,
            args.warmup,
            train_cfg,
            desc=f"heal {name}",
        )
        return {
            "heal_steps": args.heal_steps,
            "heal_tokens": res.tokens,
            "heal_s": round(res.seconds, 1),
            "final_loss": res.losses[-1] if res.losses else math.nan,
        }

    rows: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    src_elems = kv_elements_per_token(source.config)

    def emit(row: dict) -> None:
        rows.append(row)
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with out.open("w", newline="") as f:
            f.write(f"# command: {command}\n")
            w = csv.DictWriter(f, fieldnames=keys, restval="")
            w.writeheader()
            w.writerows(rows)
        print(
            {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()},
            f"[{time.time() - t_start:.0f}s]",
            flush=True,
        )

    base = {
        "model": "SmolLM2-135M GQA",
        "size": SOURCE_SIZE,
        "kv_elements": src_elems,
        "kv_reduction": 1.0,
        "rope_selection": "",
        "rope_stride": "",
    }
    emit({**base, "stage": "before", "heal_steps": 0, **evaluate(source)})
    for R, Dr in sizes:
        t0 = time.time()
        mla, report = convert_to_mla_with_report(
            source, calib, R, Dr, rope_selection=args.rope_selection
        )
        conv_s = time.time() - t0
        elems = kv_elements_per_token(mla.config)
        meta = {
            "model": "SmolLM2-135M MLA",
            "size": f"{R}+{Dr}",
            "kv_elements": elems,
            "kv_reduction": src_elems / elems,
            "rope_selection": args.rope_selection,
            "rope_stride": report.rope_stride,
            "convert_s": round(conv_s, 1),
        }
        emit({**meta, "stage": "converted", "heal_steps": 0, **evaluate(mla)})
        if args.heal_steps == 0:  # conversion only (e.g. what the construction alone costs)
            continue
        info = heal(mla, f"{R}+{Dr}")
        emit({**meta, "stage": "healed", **info, **evaluate(mla)})
        if args.save_dir:
            from safetensors.torch import save_file

            d = Path(args.save_dir)
            d.mkdir(parents=True, exist_ok=True)
            stem = f"mla_{R}+{Dr}_{args.rope_selection}"
            # clone: tied embeddings share storage, which safetensors refuses
            save_file(
                {k: v.detach().clone().contiguous() for k, v in mla.state_dict().items()},
                str(d / f"{stem}.safetensors"),
            )
            (d / f"{stem}.json").write_text(json.dumps(mla.config.to_dict(), indent=1))
        del mla
        if not args.no_control and (R, Dr) == sizes[0]:
            # The fair reference (the source fine-tuned the same steps), right after the first
            # size so that a cut-short run still compares it.
            control = Decoder(source.config)
            control.load_state_dict(source.state_dict())
            info = heal(control, "source")
            emit({**base, "stage": "fine-tuned", **info, **evaluate(control)})
            del control
    print(f"done in {time.time() - t_start:.0f}s; {out}")
    return rows


if __name__ == "__main__":
    main()
