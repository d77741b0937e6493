"""Recall of the bundled synthetic task (the tiny models), decoded on a real compressed cache.

The prompts are the synthetic corpus' recall examples
(:func:`~unicache_train.data.synthetic.recall_examples`: facts, filler, a question; the answer
follows the prompt). Each prompt is prefilled, every layer's K/V compressed, and the answer
decoded greedily token by token on the compressed cache
(:func:`~unicache_train.model.generate.generate_compressed`), then scored by exact match
(:func:`~unicache_train.data.synthetic.score_recall`). Real checkpoints use the harder task of
:mod:`unicache_train.eval.recall` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unicache_train.data.config import SyntheticDataConfig
from unicache_train.model import Decoder
from unicache_train.seam import KVCompressor

__all__ = ["synthetic_recall_records", "recall_accuracy"]


def synthetic_recall_records(
    synthetic: SyntheticDataConfig, n: int, seed: int
) -> list[dict[str, Any]]:
    """``n`` recall prompts of the synthetic task, in the data's format (facts, questions and
    filler as ``synthetic`` says), drawn from ``seed``.

    Returns:
        Dicts with ``prompt`` (ends before the answer) and ``answer``.
    """
    from unicache_train.data.synthetic import recall_examples

    return list(
        recall_examples(
            n,
            seed,
            synthetic.recall_num_facts,
            synthetic.recall_num_questions,
            synthetic.recall_num_filler,
        )
    )


@torch.no_grad()
def recall_accuracy(
    model: Decoder,
    tokenizer,
    records: Sequence[dict[str, Any]],
    compressor: KVCompressor,
    batch_size: int = 16,
) -> tuple[float, float, list[str]]:
    """Greedy answers decoded on the compressed cache; exact-match accuracy.

    Args:
        model: a GQA decoder.
        tokenizer: our tokenizer API (``encode(text, add_bos=)``, ``decode``, ``pad_token_id``,
            ``eos_token_id``).
        records: from :func:`synthetic_recall_records`.
        compressor: any KV compressor (``IdentityCompressor`` for the uncompressed reference).
        batch_size: prompts decoded together (right padded).

    Returns:
        (accuracy in [0, 1], KV reduction of the compressed prompt caches: uncompressed 16-bit
        bytes / stored bytes, predictions).
    """
    from unicache_train.data.synthetic import score_recall
    from unicache_train.model.generate import generate_compressed

    device = next(model.parameters()).device
    preds: list[str] = []
    kv, base = 0, 0
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        prompts = [tokenizer.encode(r["prompt"], add_bos=True) for r in chunk]
        n_new = max(len(tokenizer.encode(r["answer"])) for r in chunk) + 1
        P = max(len(p) for p in prompts)
        ids = torch.full((len(chunk), P), tokenizer.pad_token_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        split = torch.tensor([len(p) for p in prompts])
        gen = generate_compressed(
            model,
            ids.to(device),
            split.to(device),
            compressor,
            n_new,
            eos_token_id=tokenizer.eos_token_id,
        )
        preds += [tokenizer.decode(row.tolist()) for row in gen.tokens]
        kv += gen.cache.kv_bytes()
        base += gen.cache.baseline_bytes()  # widths from the segments (MLA: latent)
    acc = score_recall(preds, [r["answer"] for r in records])
    return acc, base / kv if kv else float("nan"), preds
