"""Key-value recall records for real checkpoints: the prompts, answers and their difficulties.

The evaluation (:mod:`unicache_train.eval.recall`, held-out seeds) decodes them on a compressed
cache; the fine-tuning mix (:mod:`unicache_train.data.recall_mix`, training seeds) trains on them.
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
from dataclasses import dataclass

__all__ = ["RecallTask", "recall_records"]

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
