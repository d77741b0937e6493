"""Key-value recall on a compressed cache, the question decoded after the compressed context.

A record (:mod:`unicache_train.data.recall_task`) is ``key: value`` lines (the **context**), a
question about one key and its value (the **answer**)::

    amber falcon: 4821          ┐
    quiet river: 0937           │ context: prefilled, then every layer's K/V is compressed
    ... (pairs lines)           ┘
    What is the value of quiet river?     ┐ question: decoded token by token on the
    quiet river:                          ┘ compressed cache (never compressed itself)
     0937                                   answer: greedy, exact match on the first line

Evaluation seeds must never be used to build training data
(:data:`~unicache_train.data.recall_mix.EVAL_SEED_FLOOR`). The bundled synthetic task of the
tiny models is decoded by :mod:`unicache_train.eval.synthetic_recall`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from unicache_train.eval.stats import binomial_stderr

__all__ = ["RecallResult", "run_recall"]


@dataclass
class RecallResult:
    """Exact-match accuracy on compressed caches, with the bytes those caches stored.

    Attributes:
        hits, n: correct answers and prompts.
        kv_bytes: bytes of the compressed context caches (packed storage, scales, metadata).
        baseline_bytes: bytes of the same contexts in an uncompressed 16-bit cache.
        predictions: the decoded answers (first line, stripped).
    """

    hits: int = 0
    n: int = 0
    kv_bytes: int = 0
    baseline_bytes: int = 0
    predictions: list[str] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.hits / self.n if self.n else float("nan")

    @property
    def stderr(self) -> float:
        return binomial_stderr(self.hits, self.n) if self.n else float("nan")

    @property
    def kv_reduction(self) -> float:
        """Uncompressed 16-bit bytes / stored bytes (``4.0`` = 4x fewer KV bytes)."""
        return self.baseline_bytes / self.kv_bytes if self.kv_bytes else float("nan")


@torch.no_grad()
def run_recall(
    model,
    tokenizer,
    records: Sequence[dict[str, str]],
    compressor,
    *,
    batch_size: int = 16,
    progress: bool = False,
) -> RecallResult:
    """Prefill each context, compress it, decode the question and then the answer greedily.

    Args:
        model: a GQA :class:`~unicache_train.model.Decoder` (eval mode).
        tokenizer: our tokenizer API (``encode(text, add_bos=)``, ``decode``, ``pad_token_id``).
        records: from :func:`~unicache_train.data.recall_task.recall_records`.
        compressor: any KV compressor (``IdentityCompressor`` for the uncompressed row).
        batch_size: records per batch (contexts right padded; the question tokens of a batch
            are fed in lockstep, each at its own position).
        progress: show a progress bar.

    Returns:
        :class:`RecallResult`.
    """
    from unicache_train.model.generate import prefill_compressed

    device = next(model.parameters()).device
    out = RecallResult()
    starts = range(0, len(records), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="recall", leave=False)
    for start in starts:
        chunk = records[start : start + batch_size]
        B = len(chunk)
        ctx = [tokenizer.encode(r["context"], add_bos=True) for r in chunk]
        qs = [tokenizer.encode(r["question"]) for r in chunk]
        n_ans = max(len(tokenizer.encode(" " + r["answer"])) for r in chunk) + 1
        P = max(len(c) for c in ctx)
        ids = torch.full((B, P), tokenizer.pad_token_id, dtype=torch.long)
        for b, c in enumerate(ctx):
            ids[b, : len(c)] = torch.tensor(c)
        split = torch.tensor([len(c) for c in ctx], device=device)
        cache, _ = prefill_compressed(model, ids.to(device), split, compressor)
        out.kv_bytes += cache.kv_bytes()
        out.baseline_bytes += cache.baseline_bytes()  # widths from the segments (MLA: latent)
        qlen = [len(q) for q in qs]
        answers: list[list[int]] = [[] for _ in range(B)]
        prev = torch.zeros(B, dtype=torch.long, device=device)
        zeros = torch.zeros(B, 1, dtype=torch.long, device=device)
        for i in range(max(qlen) + n_ans - 1):
            feed = torch.tensor(
                [qs[b][i] if i < qlen[b] else int(prev[b]) for b in range(B)], device=device
            )
            logits = model(
                feed[:, None], positions=(split + i)[:, None], modality_ids=zeros, cache=cache
            ).logits[:, 0]
            prev = logits.float().argmax(-1)
            for b in range(B):
                if qlen[b] - 1 <= i < qlen[b] - 1 + n_ans:
                    answers[b].append(int(prev[b]))
        for b, r in enumerate(chunk):
            text = tokenizer.decode(answers[b]).lstrip(" ").split("\n")[0].strip()
            out.predictions.append(text)
            out.hits += int(text == r["answer"])
            out.n += 1
    return out
