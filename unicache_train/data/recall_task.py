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

``style="sentence"`` writes the same pairs as sentences (``The amber falcon has the number
4821.``) and asks ``Which number does the quiet river have?`` / ``The quiet river has the
number``: a format the fine-tuning mix never contains, to measure whether tolerance learned on
the ``colon`` format carries over. :func:`passkey_records` is the long-context task: a passkey
hidden at a random depth of real prose.

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

__all__ = ["PASSKEY_TASK", "RecallTask", "passkey_records", "recall_records"]

#: Record formats: ``colon`` (``key: value`` lines, the training format), ``sentence`` (never
#: in a training mix).
STYLES = ("colon", "sentence")

_ADJECTIVES = (
    "amber",
    "brave",
    "calm",
    "dark",
    "eager",
    "fancy",
    "gentle",
    "happy",
    "icy",
    "jolly",
    "keen",
    "lucky",
    "merry",
    "noble",
    "odd",
    "proud",
    "quiet",
    "rapid",
    "silent",
    "tiny",
    "vivid",
    "warm",
    "young",
    "bold",
    "cold",
    "dry",
    "early",
    "fresh",
    "golden",
    "hidden",
    "little",
    "modern",
)
_NOUNS = (
    "apple",
    "bridge",
    "castle",
    "desert",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jungle",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchard",
    "pencil",
    "river",
    "saddle",
    "tower",
    "valley",
    "window",
    "yard",
    "anchor",
    "basket",
    "candle",
    "dragon",
    "forest",
    "glacier",
    "hammer",
    "mirror",
    "planet",
    "rocket",
)


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
    style: str = "colon"

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"RecallTask.style={self.style!r} is not known; allowed {STYLES}")
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
        """``recall8``, ``recall16d3``, ``recall8_sentence``, ... (the default style adds nothing,
        so the training records of the ``colon`` style are the ones they always were)."""
        name = f"recall{self.pairs}" + (f"d{self.distractors}" if self.distractors else "")
        return name if self.style == "colon" else f"{name}_{self.style}"


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
    if task.style == "sentence":
        # NOTE: a format no training mix uses: a value is a sentence's last word, and the
        # question ends where the value starts; the model may close the sentence with a period.
        context = "".join(f"The {k} has the number {values[k]}.\n" for k in keys)
        question = f"Which number does the {asked} have?\nThe {asked} has the number"
        return {
            "context": context,
            "question": question,
            "answer": values[asked],
            "key": asked,
            "trailing": ".",
        }
    context = "".join(f"{k}: {values[k]}\n" for k in keys)
    question = f"What is the value of {asked}?\n{asked}:"
    return {"context": context, "question": question, "answer": values[asked], "key": asked}


def recall_records(task: RecallTask, n: int, seed: int) -> list[dict[str, str]]:
    """``n`` records of ``task``; record ``i`` depends only on ``(task, seed, i)``.

    Returns:
        Dicts with ``context``, ``question``, ``answer`` (the digits, no space), ``key``, and
        ``id`` (``"<task>/<seed>/<i>"``), ``task``, ``seed`` to name the prompt in per-prompt
        files (``trailing``: characters a prediction may end with, e.g. a sentence's period).
    """
    if n < 1:
        raise ValueError(f"recall_records: n={n} must be >= 1")
    out = []
    for i in range(n):
        r = _record(task, random.Random(f"recall|{task.name}|{task.value_digits}|{seed}|{i}"))
        out.append({**r, "id": f"{task.name}/{seed}/{i}", "task": task.name, "seed": seed})
    return out


#: The long-context task's name in per-prompt files.
PASSKEY_TASK = "passkey"


def passkey_records(
    documents: list[str], n: int, seed: int, context_chars: int = 7000, digits: int = 5
) -> list[dict]:
    """Passkey retrieval in real prose (Mohtashami & Jaggi, arXiv 2305.16300): a sentence
    ``The pass key is 48213. Remember it. 48213 is the pass key.`` is put at a random depth
    (a sentence boundary) of about ``context_chars`` characters of ``documents`` (evaluation
    prose: a random run of whole documents from a random start, cut at a sentence end); the
    question ``What is the pass key?`` is decoded after the (compressed) context.

    Args:
        documents: filler prose (e.g. :func:`unicache_train.data.eval_text.eval_documents`).
        n: records.
        seed: record ``i`` depends only on ``(documents, seed, i)``.
        context_chars: filler characters (SmolLM2's tokenizer: about 4.3 characters per token
            on the King James text, so 7,000 characters are about 1,600 tokens).
        digits: passkey digits (1-12).

    Returns:
        Dicts as :func:`recall_records` (``task`` = :data:`PASSKEY_TASK`, ``trailing`` ".").
    """
    if n < 1 or not 1 <= digits <= 12 or context_chars < 200 or not documents:
        raise ValueError(
            f"passkey_records: need n >= 1 (got {n}), digits in [1, 12] (got {digits}), "
            f"context_chars >= 200 (got {context_chars}) and some documents"
        )
    out = []
    for i in range(n):
        rng = random.Random(f"passkey|{context_chars}|{digits}|{seed}|{i}")
        d = rng.randrange(len(documents))
        text = ""
        while len(text) < context_chars:
            text += documents[d % len(documents)] + " "
            d += 1
        text = text[: text.rfind(". ", 0, context_chars) + 1]
        ends = [j + 2 for j in range(len(text) - 1) if text[j : j + 2] == ". "]
        at = rng.choice(ends) if ends else 0
        key = "".join(rng.choice("0123456789") for _ in range(digits))
        key = str(rng.randint(1, 9)) + key[1:]  # no leading zero
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        context = text[:at] + needle + text[at:] + "\n"
        out.append(
            {
                "context": context,
                "question": "What is the pass key?\nThe pass key is",
                "answer": key,
                "key": "pass key",
                "trailing": ".",
                "depth": at / max(len(text), 1),
                "id": f"{PASSKEY_TASK}/{seed}/{i}",
                "task": PASSKEY_TASK,
                "seed": seed,
            }
        )
    return out
