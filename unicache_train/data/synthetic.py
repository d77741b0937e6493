"""The bundled synthetic corpus: grammar stories and key-value recall prompts.

Generated deterministically from a seed: no download, no files. Every record draws from its own
``random.Random`` keyed by ``(kind, seed, index)``, so a corpus of ``n`` records is a prefix of the
corpus of ``n + 1`` records, and results do not depend on ``PYTHONHASHSEED`` or on the order in
which records are generated.

Two kinds of records, both built so that a model gains from long context (which is what a
compressed KV cache must preserve):

* **stories** (:func:`stories`): a small stochastic grammar over people, places and objects with
  attributes. Objects are put somewhere in the first sentences and recalled near the end, after
  filler and distractor sentences (``"Mira hid the blue key in the cellar. ... Later, Mira went
  back to the cellar to find the blue key."``): predicting ``blue key`` / ``the cellar`` at the end
  needs the beginning. With the defaults (8-14 sentences) a story has 330-770 bytes (mean 540)
  and its objects recur up to 130-650 characters after they were introduced (median 410; over
  200 in 97% of stories).
* **key-value recall** (:func:`recall_examples`): ``key: value`` facts (random 4-letter keys;
  3-4 digit numbers or words as values), optionally interleaved with filler sentences, then
  questions ``Q: what is <key>? A: <value>`` about facts from the first half of the list. Each
  record carries ``split_char``, the character offset of the first answer (``prompt =
  text[:split_char]``), and ``question_char``, the offset of the first question. Length in bytes
  is about ``11.7 * num_facts + 40 * num_filler + 24.6 * num_questions``; with the defaults (12
  facts, 1 filler, 2 questions) records have 200-255 bytes and fit ``seq_len = 256`` byte tokens.

:func:`score_recall` is the exact-match accuracy the evaluation code uses.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Iterator, Sequence
from typing import Any

import datasets

from unicache_train.data.config import SyntheticDataConfig

__all__ = [
    "PEOPLE",
    "PLACES",
    "OBJECTS",
    "ATTRIBUTES",
    "VALUE_WORDS",
    "stories",
    "recall_examples",
    "synthetic_corpus",
    "score_recall",
]

PEOPLE = (
    "Mira",
    "Tomas",
    "Ana",
    "Jonah",
    "Leila",
    "Oskar",
    "Priya",
    "Kenji",
    "Sofia",
    "Emeka",
    "Ines",
    "Ravi",
    "Greta",
    "Yusuf",
    "Lena",
    "Marco",
    "Nadia",
    "Felix",
    "Hana",
    "Dario",
    "Elif",
    "Bruno",
    "Zara",
    "Pavel",
    "Chloe",
    "Idris",
    "Maya",
    "Soren",
    "Talia",
    "Viktor",
    "Amara",
    "Niko",
    "Rosa",
    "Theo",
    "Uma",
    "Wren",
    "Yara",
    "Omar",
    "Kira",
    "Luca",
)
PLACES = (
    "the cellar",
    "the garden",
    "the old mill",
    "the library",
    "the attic",
    "the bakery",
    "the barn",
    "the kitchen",
    "the workshop",
    "the chapel",
    "the tower",
    "the greenhouse",
    "the boathouse",
    "the shed",
    "the museum",
    "the school",
    "the station",
    "the forest",
    "the orchard",
    "the lighthouse",
)
OBJECTS = (
    "key",
    "lamp",
    "box",
    "map",
    "coin",
    "book",
    "ring",
    "hat",
    "cup",
    "letter",
    "clock",
    "knife",
    "bell",
    "jar",
    "rope",
    "kite",
    "flute",
    "shell",
    "stone",
    "scarf",
)
ATTRIBUTES = (
    "blue",
    "red",
    "green",
    "silver",
    "golden",
    "wooden",
    "small",
    "old",
    "heavy",
    "broken",
    "striped",
    "copper",
    "white",
    "black",
    "tiny",
    "glass",
)
VALUE_WORDS = (
    "river",
    "apple",
    "tiger",
    "cloud",
    "stone",
    "maple",
    "piano",
    "candle",
    "falcon",
    "harbor",
    "lemon",
    "violet",
    "copper",
    "meadow",
    "rocket",
    "saddle",
    "tulip",
    "walnut",
    "zebra",
    "anchor",
    "bishop",
    "cactus",
    "dragon",
    "ember",
    "fossil",
    "glacier",
    "hazel",
    "igloo",
    "jasper",
    "kettle",
    "lantern",
    "marble",
    "nectar",
    "oyster",
    "pepper",
    "quartz",
    "raven",
    "sierra",
    "thistle",
    "umber",
    "velvet",
    "willow",
    "yarrow",
    "acorn",
    "basil",
    "cobalt",
    "dune",
    "fern",
    "ginger",
    "heron",
)

# Sentence templates. {p}/{q}: people; {o}: "<attribute> <object>"; {l}: place.
_STASH = (
    "{p} put the {o} in {l}.",
    "{p} hid the {o} in {l}.",
    "{p} left the {o} in {l} before the storm.",
    "{p} carried the {o} to {l} and set it down there.",
    "On a quiet morning, {p} locked the {o} away in {l}.",
)
_CALLBACK = (
    "Later, {p} went back to {l} to find the {o}.",
    "{q} asked {p} where the {o} was, and {p} said it was in {l}.",
    "{p} remembered that the {o} was still in {l}.",
    "When {p} returned to {l}, the {o} was still there.",
    "Much later, {q} found the {o} in {l}, right where {p} had left it.",
)
_DISTRACTOR = (
    "{x} dropped a {a} {n} near {l}.",
    "{x} sold a {a} {n} at the market.",
    "{x} lost a {a} {n} on the way to {l}.",
)
_FILLER = (
    "The {w} lasted all {t}.",
    "{x} walked to {l} and talked with {y}.",
    "A {animal} ran across the road.",
    "{x} read a long book about {topic}.",
    "Nobody said much during {meal}.",
    "{x} and {y} played cards until it was dark.",
    "The bells in the town rang {k} times.",
    "{x} made tea and looked out of the window.",
    "For a while, nothing happened at all.",
)
_OPENING = (
    "{p} lived near {l} with {q}.",
    "Once upon a time, {p} and {q} moved to a town near {l}.",
    "{p} and {q} were old friends who worked near {l}.",
)
_ENDING = (
    "In the end, {p} gave the {o} to {q}.",
    "That night, everyone slept well.",
    "And so the {o} stayed in {l} for a long time.",
)
_SLOTS = {
    "w": ("rain", "wind", "snow", "fog", "heat"),
    "t": ("morning", "afternoon", "evening", "night", "day"),
    "animal": ("fox", "dog", "cat", "goat", "hare", "deer"),
    "topic": ("ships", "stars", "birds", "old kings", "rivers", "clocks"),
    "meal": ("breakfast", "lunch", "dinner", "supper"),
    "k": ("two", "three", "five", "seven", "twelve"),
}


def _rng(kind: str, seed: int, index: int) -> random.Random:
    # A str seed is hashed with SHA-512 by random.Random: stable across runs and processes.
    return random.Random(f"unicache:{kind}:{seed}:{index}")


def _filler(rng: random.Random, people: Sequence[str], places: Sequence[str]) -> str:
    x, y = rng.sample(people, 2)
    slots = {name: rng.choice(options) for name, options in _SLOTS.items()}
    return rng.choice(_FILLER).format(x=x, y=y, l=rng.choice(places), **slots)


def _story(rng: random.Random, min_sentences: int, max_sentences: int) -> str:
    target = rng.randint(min_sentences, max_sentences)
    cast = rng.sample(PEOPLE, 5)  # two protagonists, three minor characters
    heroes, extras = cast[:2], cast[2:]
    places = rng.sample(PLACES, 5)
    n_items = 2 if target >= 10 else 1
    nouns = rng.sample(OBJECTS, n_items + 2)  # the rest are distractor nouns, never "the ..."
    items = [
        (f"{rng.choice(ATTRIBUTES)} {nouns[i]}", heroes[i % 2], places[1 + i])
        for i in range(n_items)
    ]
    head = [rng.choice(_OPENING).format(p=heroes[0], q=heroes[1], l=places[0])]
    head += [rng.choice(_STASH).format(p=p, o=o, l=loc) for o, p, loc in items]
    # The middle separates each object from its recall; callbacks land in its second half or
    # after it, so the gap is at least half the middle.
    n_middle = max(2, target - len(head) - n_items - 1)
    middle = []
    for _ in range(n_middle):
        if rng.random() < 0.25:
            middle.append(
                rng.choice(_DISTRACTOR).format(
                    x=rng.choice(extras),
                    a=rng.choice(ATTRIBUTES),
                    n=rng.choice(nouns[n_items:]),
                    l=rng.choice(places),
                )
            )
        else:
            middle.append(_filler(rng, extras + heroes, places))
    for o, p, loc in items:
        q = heroes[1] if p == heroes[0] else heroes[0]
        pos = rng.randint(n_middle // 2 + 1, len(middle))
        middle.insert(pos, rng.choice(_CALLBACK).format(p=p, q=q, o=o, l=loc))
    o, p, loc = items[0]
    q = heroes[1] if p == heroes[0] else heroes[0]
    tail = [rng.choice(_ENDING).format(p=p, q=q, o=o, l=loc)]
    return " ".join(head + middle + tail)


def stories(n: int, seed: int, min_sentences: int = 8, max_sentences: int = 14) -> Iterator[str]:
    """Yield ``n`` grammar stories whose objects recur at long range.

    Args:
        n: number of stories.
        seed: corpus seed; story ``i`` depends only on ``(seed, i)``.
        min_sentences: fewest sentences in a story (>= 4).
        max_sentences: most sentences (about 50 bytes each).

    Yields:
        Story texts of roughly ``50 * sentences`` bytes.
    """
    if not 4 <= min_sentences <= max_sentences:
        raise ValueError(
            f"need 4 <= min_sentences <= max_sentences, got {min_sentences}, {max_sentences}"
        )
    for i in range(n):
        yield _story(_rng("story", seed, i), min_sentences, max_sentences)


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(4))


def _value(rng: random.Random) -> str:
    if rng.random() < 0.5:
        digits = rng.choice((3, 4))
        return str(rng.randint(10 ** (digits - 1), 10**digits - 1))
    return rng.choice(VALUE_WORDS)


def _recall(
    rng: random.Random, num_facts: int, num_questions: int, num_filler: int
) -> dict[str, Any]:
    # Unique keys, so every question has one answer; values are unique too while the pool of
    # ~9,950 values lasts (a few retries, then a repeat is accepted).
    keys: list[str] = []
    seen: set[str] = set()
    while len(keys) < num_facts:
        k = _key(rng)
        if k not in seen:
            keys.append(k)
            seen.add(k)
    values: list[str] = []
    seen = set()
    for _ in range(num_facts):
        for _attempt in range(50):
            v = _value(rng)
            if v not in seen:
                break
        values.append(v)
        seen.add(v)
    lines = [f"{k}: {v}" for k, v in zip(keys, values)]
    people = rng.sample(PEOPLE, 4)
    places = rng.sample(PLACES, 4)
    for _ in range(num_filler):
        lines.insert(rng.randint(0, len(lines)), _filler(rng, people, places))
    # Ask about facts from the first half, so answers sit far back in the context.
    pool = max(num_questions, math.ceil(num_facts / 2))
    asked = rng.sample(range(pool), num_questions)
    context = "\n".join(lines) + "\n"
    question_char = len(context)
    qa = [(f"Q: what is {keys[i]}? A: ", values[i]) for i in asked]
    split_char = question_char + len(qa[0][0])
    text = context + "\n".join(q + a for q, a in qa)
    return {
        "text": text,
        "prompt": text[:split_char],
        "answer": qa[0][1],
        "split_char": split_char,
        "question_char": question_char,
        "questions": [keys[i] for i in asked],
        "answers": [values[i] for i in asked],
    }


def recall_examples(
    n: int, seed: int, num_facts: int = 12, num_questions: int = 2, num_filler: int = 1
) -> Iterator[dict[str, Any]]:
    """Yield ``n`` key-value recall records.

    Args:
        n: number of records.
        seed: corpus seed; record ``i`` depends only on ``(seed, i)``.
        num_facts: ``key: value`` lines per record; controls the length (~11.7 bytes each).
        num_questions: questions per record (<= num_facts), about facts in the first half.
        num_filler: filler sentences (~40 bytes each) inserted at random among the facts.

    Yields:
        Dicts with ``text``; ``prompt`` (= ``text[:split_char]``, ends with ``"A: "``);
        ``answer`` (the first question's value; ``text[split_char:]`` starts with it);
        ``split_char``; ``question_char`` (offset of the first ``"Q: "``); ``questions`` and
        ``answers`` (keys and values of every question, in order).
    """
    if num_facts < 1 or not 1 <= num_questions <= num_facts or num_filler < 0:
        raise ValueError(
            f"need num_facts >= 1, 1 <= num_questions <= num_facts, num_filler >= 0; got "
            f"{num_facts}, {num_questions}, {num_filler}"
        )
    for i in range(n):
        yield _recall(_rng("recall", seed, i), num_facts, num_questions, num_filler)


def synthetic_corpus(cfg: SyntheticDataConfig) -> datasets.Dataset:
    """The bundled corpus as an in-memory HF dataset, stories and recall records interleaved.

    Returns:
        Columns ``text`` (str), ``kind`` (``"story"`` / ``"recall"``), ``split_char`` (int, the
        first answer's character offset; -1 for stories) and ``question_char`` (int, the first
        question's offset; -1 for stories). Row order is a seeded shuffle of both kinds.
    """
    rows: list[tuple[str, str, int, int]] = [
        (t, "story", -1, -1)
        for t in stories(
            cfg.num_stories, cfg.seed, cfg.story_min_sentences, cfg.story_max_sentences
        )
    ]
    for r in recall_examples(
        cfg.num_recall,
        cfg.seed,
        cfg.recall_num_facts,
        cfg.recall_num_questions,
        cfg.recall_num_filler,
    ):
        rows.append((r["text"], "recall", r["split_char"], r["question_char"]))
    _rng("order", cfg.seed, 0).shuffle(rows)
    text, kind, split_char, question_char = (list(c) for c in zip(*rows))
    return datasets.Dataset.from_dict(
        {"text": text, "kind": kind, "split_char": split_char, "question_char": question_char},
        features=datasets.Features(
            {
                "text": datasets.Value("string"),
                "kind": datasets.Value("string"),
                "split_char": datasets.Value("int64"),
                "question_char": datasets.Value("int64"),
            }
        ),
    )


def normalize_answer(text: str) -> str:
    """The answer part of a generation: stripped, cut at the first newline.

    Generation usually runs past the answer (``"4821\\nQ: what is ..."``); the answer line is
    what counts.
    """
    return text.strip().split("\n", 1)[0].strip()


def score_recall(predictions: Sequence[str], answers: Sequence[str]) -> float:
    """Exact-match recall accuracy in [0, 1].

    A prediction matches when its first line, stripped, equals the stripped answer (see
    :func:`normalize_answer`).

    Raises:
        ValueError: the lists differ in length or are empty.
    """
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} answers")
    if not answers:
        raise ValueError("score_recall needs at least one answer")
    hits = sum(normalize_answer(p) == a.strip() for p, a in zip(predictions, answers))
    return hits / len(answers)
