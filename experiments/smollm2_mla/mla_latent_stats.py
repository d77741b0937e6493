"""Why per-vector int4 fails on a converted MLA latent: per layer, how unevenly the latent
``[c_kv ‖ k_pe]`` of one held-out text block spreads over its features.

    python experiments/smollm2_mla/mla_latent_stats.py --model runs/smollm2_mla/mla_128+32_weighted

For each layer: the median over tokens of ``max|c_kv| / rms(c_kv)`` (a per-vector int4 step is
``max / 7``: with a ratio of ~10 most features round to zero), the largest and the median
per-feature maximum of ``c_kv`` over the tokens, and ``max|k_pe|``. Writes
``experiments/smollm2_mla/results/latent_stats.csv`` (``# command:`` first).
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="STEM of STEM.safetensors + STEM.json")
    ap.add_argument("--checkpoint", default="smollm2", help="the source (its tokenizer)")
    ap.add_argument("--context", type=int, default=192, help="context tokens of the block")
    ap.add_argument(
        "--out", type=Path, default=Path("experiments/smollm2_mla/results/latent_stats.csv")
    )
    args = ap.parse_args(argv)
    from safetensors.torch import load_file

    from unicache_train.checkpoint.gguf import KNOWN, fetch
    from unicache_train.data.reference_text import reference_documents
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.eval.text import text_blocks
    from unicache_train.model import Decoder
    from unicache_train.model.config import ModelConfig
    from unicache_train.seam import IdentityCompressor, RecordingCompressor

    stem = Path(args.model)
    cfg = ModelConfig.from_dict(json.loads(stem.with_suffix(".json").read_text()))
    model = Decoder(cfg)
    model.load_state_dict(load_file(str(stem.with_suffix(".safetensors"))))
    model.eval()
    ckpt = fetch(args.checkpoint) if args.checkpoint in KNOWN else Path(args.checkpoint)
    tok = load_tokenizer(str(ckpt))
    block = text_blocks(tok, reference_documents("heldout"), 256, 1)  # [1, 256]
    rec = RecordingCompressor(IdentityCompressor())
    with torch.no_grad():
        model(block, split=torch.tensor([args.context]), compressor=rec)
    R = cfg.kv_lora_rank
    rows = []
    for layer, seg in sorted(rec.segments.items()):
        lat = seg.keys[0, 0, : args.context].double()  # [M, R + Dr]
        c, pe = lat[:, :R], lat[:, R:]
        per_feature = c.abs().amax(0)  # [R]
        spread = c.abs().amax(1) / c.pow(2).mean(1).sqrt()  # [M] per token
        rows.append(
            {
                "layer": layer,
                "ckv_absmax_over_rms_median": float(spread.median()),
                "ckv_feature_max_top": float(per_feature.max()),
                "ckv_feature_max_median": float(per_feature.median()),
                "kpe_absmax": float(pe.abs().max()),
            }
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        f.write(
            "# command: python experiments/smollm2_mla/mla_latent_stats.py "
            + shlex.join(sys.argv[1:])
            + "\n"
        )
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ratios = sorted(r["ckv_absmax_over_rms_median"] for r in rows)
    print(
        f"{len(rows)} layers: median max|c_kv|/rms per token {ratios[len(ratios) // 2]:.1f} "
        f"(range {ratios[0]:.1f}-{ratios[-1]:.1f}); wrote {args.out}"
    )
    return args.out


if __name__ == "__main__":
    main()
