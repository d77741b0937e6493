"""Key-value recall on a compressed cache, the question decoded after the compressed context.

A record (:mod:`unicache_train.data.recall_task`) is ``key: value`` lines (the **context**), a
question about one key and its value (the **answer**)::

    amber falcon: 4821          ┐
    quiet river: 0937           │ context: prefilled, then every layer's K/V is compressed
    ... (pairs lines)           ┘
    What is the value of quiet river?     ┐ question: fed on the compressed cache
    quiet river:                          ┘ (never compressed itself)
     0937                                   answer: greedy, exact match on the first line

Batched path (:func:`run_recall`): records are grouped by the token length of their question,
so a batch feeds its whole question in **one** forward on the compressed cache (the question is
known: teacher forcing it token by token computes the same thing, ``tests/test_eval_stats.py``
checks the predictions against :func:`run_recall_stepwise`); each layer's packed segment is
dequantized **once** after the prefill instead of at every decoded token (dequantization is
deterministic, so the attended values are bit-identical). Only the answer is decoded token by
token.

Evaluation seeds must never be used to build training data
(:data:`~unicache_train.data.recall_mix.EVAL_SEED_FLOOR`). The bundled synthetic task of the
tiny models is decoded by :mod:`unicache_train.eval.synthetic_recall`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unicache_train.eval.stats import binomial_stderr, wilson_interval

__all__ = ["RecallResult", "run_recall", "run_recall_stepwise", "write_predictions"]


@dataclass
class RecallResult:
    """Exact-match accuracy on compressed caches, with the bytes those caches stored.

    Attributes:
        hits, n: correct answers and prompts.
        kv_bytes: bytes of the compressed context caches (packed storage, scales, metadata).
        baseline_bytes: bytes of the same contexts in an uncompressed 16-bit cache.
        predictions: the decoded answers (first line, stripped), in record order.
        rows: one dict per record, in record order: ``id``, ``task``, ``answer``,
            ``prediction``, ``correct`` (what :func:`write_predictions` writes).
    """

    hits: int = 0
    n: int = 0
    kv_bytes: int = 0
    baseline_bytes: int = 0
    predictions: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.hits / self.n if self.n else float("nan")

    @property
    def stderr(self) -> float:
        return binomial_stderr(self.hits, self.n) if self.n else float("nan")

    @property
    def interval(self) -> tuple[float, float]:
        """95% Wilson interval of the accuracy (:func:`.stats.wilson_interval`)."""
        return wilson_interval(self.hits, self.n) if self.n else (float("nan"), float("nan"))

    @property
    def correct(self) -> list[bool]:
        """Per record, in record order (what paired tests read)."""
        return [bool(r["correct"]) for r in self.rows]

    @property
    def kv_reduction(self) -> float:
        """Uncompressed 16-bit bytes / stored bytes (``4.0`` = 4x fewer KV bytes)."""
        return self.baseline_bytes / self.kv_bytes if self.kv_bytes else float("nan")

    def _add(self, record: dict, prediction: str) -> None:
        ok = prediction == record["answer"]
        self.predictions.append(prediction)
        self.hits += int(ok)
        self.n += 1
        self.rows.append(
            {
                "id": record.get("id", str(self.n - 1)),
                "task": record.get("task", ""),
                "answer": record["answer"],
                "prediction": prediction,
                "correct": ok,
            }
        )


def write_predictions(rows: Sequence[dict], path: str | Path, **extra) -> Path:
    """Write per-prompt rows (:attr:`RecallResult.rows`) as JSONL, each with ``extra`` fields
    (e.g. ``model=``, ``setting=``) first; written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps({**extra, **r}) + "\n" for r in rows))
    tmp.replace(path)
    return path


def _first_line(tokenizer, ids: list[int], record: dict) -> str:
    """The prediction: the first decoded line, stripped (and of a record's ``trailing``
    characters, e.g. the period closing a sentence-style answer)."""
    text = tokenizer.decode(ids).lstrip(" ").split("\n")[0].strip()
    return text.rstrip(record["trailing"]) if record.get("trailing") else text


def _prefill(model, tokenizer, chunk, compressor, device):
    from unicache_train.model.generate import prefill_compressed

    ctx = [tokenizer.encode(r["context"], add_bos=True) for r in chunk]
    P = max(len(c) for c in ctx)
    ids = torch.full((len(chunk), P), tokenizer.pad_token_id, dtype=torch.long)
    for b, c in enumerate(ctx):
        ids[b, : len(c)] = torch.tensor(c)
    split = torch.tensor([len(c) for c in ctx], device=device)
    cache, _ = prefill_compressed(model, ids.to(device), split, compressor)
    return cache, split


def _dequantize_segments(cache) -> None:
    """Replace each packed (non-latent) segment by its dequantized K/V, once: the decode steps
    then read the same float values without unpacking them again. Bytes are counted before."""
    from unicache_train.seam import dequantize

    for seg in getattr(cache, "segments", []):
        if seg is not None and seg.quant is not None and not seg.latent:
            seg.keys, seg.values = dequantize(seg.quant)  # [B, G, M, D] float32
            seg.quant = None


@torch.no_grad()
def run_recall(
    model,
    tokenizer,
    records: Sequence[dict[str, str]],
    compressor,
    *,
    batch_size: int = 32,
    progress: bool = False,
) -> RecallResult:
    """Prefill each context, compress it, feed the question, decode the answer greedily.

    Args:
        model: a GQA or MLA :class:`~unicache_train.model.Decoder` (eval mode).
        tokenizer: our tokenizer API (``encode(text, add_bos=)``, ``decode``, ``pad_token_id``).
        records: from :func:`~unicache_train.data.recall_task.recall_records` (or any dicts with
            ``context``, ``question``, ``answer``; ``id`` and ``task`` are copied to the rows).
        compressor: any KV compressor (``IdentityCompressor`` for the uncompressed row).
        batch_size: records per batch (contexts right padded), among records whose questions
            have the same token length.
        progress: show a progress bar.

    Returns:
        :class:`RecallResult`, rows in record order.
    """
    device = next(model.parameters()).device
    qs = [tokenizer.encode(r["question"]) for r in records]
    n_ans = [len(tokenizer.encode(" " + r["answer"])) + 1 for r in records]
    # NOTE: batches hold questions of one token length, so the question block has no padding
    # that the answer tokens would attend to.
    order = sorted(range(len(records)), key=lambda i: (len(qs[i]), i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and len(qs[batches[-1][0]]) == len(qs[i]):
            batches[-1].append(i)
        else:
            batches.append([i])
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="recall", leave=False)
    preds: dict[int, str] = {}
    out = RecallResult()
    for idx in batches:
        chunk = [records[i] for i in idx]
        B = len(chunk)
        cache, split = _prefill(model, tokenizer, chunk, compressor, device)
        out.kv_bytes += cache.kv_bytes()
        out.baseline_bytes += cache.baseline_bytes()  # widths from the segments (MLA: latent)
        _dequantize_segments(cache)
        Q = len(qs[idx[0]])
        feed = torch.tensor([qs[i] for i in idx], device=device)  # [B, Q]
        pos = split[:, None] + torch.arange(Q, device=device)  # [B, Q]
        zeros = torch.zeros(B, Q, dtype=torch.long, device=device)
        last = torch.full((B, 1), Q - 1, dtype=torch.long, device=device)
        logits = model(feed, positions=pos, modality_ids=zeros, cache=cache, logits_at=last)
        tok = logits.logits[:, -1].float().argmax(-1)  # [B]
        steps = max(n_ans[i] for i in idx)
        answers = [tok]
        for j in range(1, steps):
            logits = model(
                tok[:, None],
                positions=(split + Q + j - 1)[:, None],
                modality_ids=zeros[:, :1],
                cache=cache,
            ).logits[:, 0]
            tok = logits.float().argmax(-1)
            answers.append(tok)
        ans = torch.stack(answers, 1).tolist()  # [B, steps]
        for b, i in enumerate(idx):
            preds[i] = _first_line(tokenizer, ans[b][: n_ans[i]], records[i])
    for i, r in enumerate(records):
        out._add(r, preds[i])
    return out


@torch.no_grad()
def run_recall_stepwise(
    model, tokenizer, records: Sequence[dict[str, str]], compressor
) -> RecallResult:
    """The reference path: one record at a time, every question token fed on its own, the packed
    cache dequantized at every step (what :func:`run_recall` must reproduce)."""
    device = next(model.parameters()).device
    out = RecallResult()
    for r in records:
        cache, split = _prefill(model, tokenizer, [r], compressor, device)
        q = tokenizer.encode(r["question"])
        n_ans = len(tokenizer.encode(" " + r["answer"])) + 1
        zeros = torch.zeros(1, 1, dtype=torch.long, device=device)
        answer: list[int] = []
        for i in range(len(q) + n_ans - 1):
            t = q[i] if i < len(q) else answer[-1]
            logits = model(
                torch.tensor([[t]], device=device),
                positions=(split + i)[:, None],
                modality_ids=zeros,
                cache=cache,
            ).logits[:, 0]
            if i >= len(q) - 1:
                answer.append(int(logits.float().argmax(-1)))
        out.kv_bytes += cache.kv_bytes()
        out.baseline_bytes += cache.baseline_bytes()
        out._add(r, _first_line(tokenizer, answer, r))
    return out
