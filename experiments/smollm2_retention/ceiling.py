"""The recall ceiling of question-agnostic eviction at 8x and 16x, from the prompts and the rates.

A selection that decides before the question keeps ``n - round(R n)`` of a prompt's ``n`` context
tokens in each layer (``R``: the calibrated removal rate of the setting, ``raw/calibration.json``;
the bytes measured on every cell agree: ``kv_bytes / (layers x prompts x 204 B)`` is the mean kept
count). If a pair can be answered only when its key tokens and its 4 digit tokens (single tokens
in SmolLM2's tokenizer) are all kept, at most ``w`` pairs fit whole, ``w`` = the largest number of
the prompt's pairs whose tokens sum to no more than the kept count (smallest pairs first), and
since the asked pair is drawn uniformly from the 8 (``data/recall_task.py``), the expected recall
is at most ``mean(w) / 8``. Generous: it gives the whole budget to pair tokens (no sink, no ``:``,
no newline). An assumption, not a theorem: the K/V of a kept token were computed by an
uncompressed prefill and may carry evicted tokens (a merge does so by design), and a selection
may keep different pairs in different layers; the bound counts neither.

    python experiments/smollm2_retention/ceiling.py     # needs `make fetch` (the tokenizer)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from unicache_train.checkpoint.gguf import fetched_dir  # noqa: E402
from unicache_train.data.tokenizer import load_tokenizer  # noqa: E402

PROMPTS = ROOT / "experiments" / "smollm2_evidence" / "prompts_recall8.jsonl"
SETTINGS = ("sinks_int4_8x", "sinks_int4_16x")


def pair_sizes(pieces: list[str]) -> list[int]:
    """Tokens of each pair's key plus its digits, from the context's token pieces (BOS first)."""
    sizes, line = [], []
    for piece in pieces[1:]:
        if piece != "\n":
            line.append(piece)
            continue
        colon = line.index(":")
        digits = [p for p in line[colon + 1 :] if p.strip()]
        if not all(len(d) == 1 and d.isdigit() for d in digits):
            raise ValueError(f"a value is not single-digit tokens: {line}")
        sizes.append(colon + len(digits))
        line = []
    return sizes


def whole_pairs(sizes: list[int], kept: int) -> int:
    """The most pairs whose tokens fit in ``kept`` (smallest first)."""
    used = count = 0
    for size in sorted(sizes):
        if used + size > kept:
            break
        used, count = used + size, count + 1
    return count


def main() -> int:
    tok = load_tokenizer(fetched_dir("smollm2"))
    rates = json.loads((HERE / "raw" / "calibration.json").read_text())
    records = [json.loads(x) for x in PROMPTS.read_text().splitlines() if x.strip()]
    pieces = [[tok.decode([i]) for i in tok.encode(r["context"], add_bos=True)] for r in records]
    sizes = [pair_sizes(p) for p in pieces]
    n = [len(p) for p in pieces]
    print(f"{len(records)} prompts; context tokens (BOS included): mean {statistics.mean(n):.2f}")
    keys = [sum(s) - 4 * len(s) for s in sizes]
    print(
        f"key + digit tokens of the 8 pairs: mean {statistics.mean(map(sum, sizes)):.2f} "
        f"(keys {statistics.mean(keys):.2f} + digits 32); smallest pair {min(map(min, sizes))}"
    )
    for setting in SETTINGS:
        rate = rates[setting]
        kept = [t - round(rate * t) for t in n]
        w = [whole_pairs(s, k) for s, k in zip(sizes, kept)]
        spread = {v: w.count(v) for v in sorted(set(w))}
        print(
            f"{setting}: R = {rate}, kept tokens mean {statistics.mean(kept):.2f} "
            f"(min {min(kept)}, max {max(kept)}); whole pairs at most {spread} (count: prompts); "
            f"recall ceiling {statistics.mean(w) / 8:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
