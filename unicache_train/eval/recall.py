"""Key-value recall on a compressed cache, the question decoded after the compressed context.

A record is a list of ``key: value`` lines (the **context**), then a question about one key
(the **question**), then its value (the **answer**)::

    amber falcon: 4821          ┐
    quiet river: 0937           │ context: prefilled, then every layer's K/V is compressed
    ... (pairs lines)           ┘
    What is the value of quiet river?     ┐ question: decoded token by token on the
    quiet river:                          ┘ compressed cache (never compressed itself)
     0937                                   answer: greedy, exact match on the first line

Keys are two common words (an adjective and a noun). ``distractors`` other keys share the
asked key's noun (``amber river``, ``quiet river``), so a model that keeps only the noun's
tokens cannot tell them apart. Values are ``value_digits`` random digits: a tokenizer that
splits numbers into single digits (SmolLM2's does) needs every digit of a value kept, which is
what makes recall break under token eviction.

Records depend only on ``(task, seed, index)``; evaluation seeds must never be used to build
training data (:func:`recall_records` takes the seed explicitly; callers keep them apart).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from unicache_train.eval.stats import binomial_stderr

__all__ = ["RecallTask", "RecallResult", "recall_records", "run_recall"]

_ADJECTIVES = (
    "amber", "brave", "calm", "dark", "eager", "fancy", "gentle", "happy", "icy", "jolly",
    "keen", "lucky", "merry", "noble", "odd", "proud", "quiet", "rapid", "silent", "tiny",
    "vivid", "warm", "young", "bold", "cold", "dry", "early", "fresh", "golden", "hidden",
    "little", "modern",
)  # fmt: skip
_NOUNS = (
    "apple", "bridge", "castle", "desert", "engine", "falcon", "garden", "harbor", "island",
    "jungle", "kettle", "lantern", "meadow", "needle", "orchard", "pencil", "river", "saddle",
    "tower", "valley", "window", "yard", "anchor", "basket", "candle", "dragon", "forest",
    "glacier", "hammer", "mirror", "planet", "rocket",
)  # fmt: skip


@dataclass(frozen=True)
class RecallTask:
    """One difficulty of the recall task.

    Attributes:
        pairs: ``key: value`` lines in the context (1-1024).
        distractors: other keys sharing the asked key's noun (``0 <= distractors < pairs``,
            at most 31).
        value_digits: digits per value (1-12).
    """

    pairs: int = 8
    distractors: int = 0
    value_digits: int = 4

    def __post_init__(self) -> None:
        for name, lo, hi in (("pairs", 1, 1024), ("value_digits", 1, 12)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"RecallTask.{name}={v!r} is out of range; allowed [{lo}, {hi}]")
        d = self.distractors
        hi = min(self.pairs - 1, len(_ADJECTIVES) - 1)
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= hi:
            raise ValueError(f"RecallTask.distractors={d!r} is out of range; allowed [0, {hi}]")

    @property
    def name(self) -> str:
        """``recall8``, ``recall16d3``, ..."""
        return f"recall{self.pairs}" + (f"d{self.distractors}" if self.distractors else "")


def _record(task: RecallTask, rng: random.Random) -> dict[str, str]:
    # The asked key plus its distractors share one noun; the other keys are unique pairs.
    noun = rng.choice(_NOUNS)
    adjs = rng.sample(_ADJECTIVES, task.distractors + 1)
    keys = [f"{a} {noun}" for a in adjs]
    taken = set(keys)
    while len(keys) < task.pairs:
        key = f"{rng.choice(_ADJECTIVES)} {rng.choice([n for n in _NOUNS if n != noun])}"
        if key not in taken:
            taken.add(key)
            keys.append(key)
    asked = keys[0]
    rng.shuffle(keys)
    values = {k: "".join(rng.choice("0123456789") for _ in range(task.value_digits)) for k in keys}
    context = "".join(f"{k}: {values[k]}\n" for k in keys)
    question = f"What is the value of {asked}?\n{asked}:"
    return {"context": context, "question": question, "answer": values[asked], "key": asked}


def recall_records(task: RecallTask, n: int, seed: int) -> list[dict[str, str]]:
    """``n`` records of ``task``; record ``i`` depends only on ``(task, seed, i)``.

    Returns:
        Dicts with ``context``, ``question``, ``answer`` (the digits, no space) and ``key``.
    """
    if n < 1:
        raise ValueError(f"recall_records: n={n} must be >= 1")
    return [
        _record(task, random.Random(f"recall|{task.name}|{task.value_digits}|{seed}|{i}"))
        for i in range(n)
    ]


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
    def bytes_reduction(self) -> float:
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
        records: from :func:`recall_records`.
        compressor: any KV compressor (``IdentityCompressor`` for the uncompressed row).
        batch_size: records per batch (contexts right padded; the question tokens of a batch
            are fed in lockstep, each at its own position).
        progress: show a progress bar.

    Returns:
        :class:`RecallResult`.
    """
    from unicache_train.compress.inference import prefill_compressed

    device = next(model.parameters()).device
    head_dim = model.config.head_size
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
        out.baseline_bytes += cache.baseline_bytes(head_dim)
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
