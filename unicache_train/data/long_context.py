"""Long-context tasks in the style of RULER (Hsieh et al., arXiv 2404.06654), rebuilt offline.

RULER's synthetic families (NVIDIA/RULER ``scripts/data/synthetic/``), written for a small model
and for KV compression: the **context** (prefilled, then compressed) holds the haystack and the
needles; the **question** is decoded on the compressed cache (query-agnostic: the compressor
never sees it); the **answers** are what the greedy continuation must contain (case-insensitive
containment of every expected value, RULER's ``string_match_all``).

===================  ======================================================================
family               context, question, answers
===================  ======================================================================
``niah_single``      one needle ``One of the special magic numbers for {key} is: {value}.``
                     in prose; asks for ``key``'s number; answers ``[value]``
``niah_multikey``    the needle plus ``distractors`` needles of other keys; asks for one key
``niah_multivalue``  ``values`` needles of one key (different numbers); asks for all of them
``niah_multiquery``  ``queries`` needles of different keys; asks for all of their numbers
``vt``               variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ...
                     (``hops`` assignments) among distractor chains; asks for every variable
                     that holds the value; answers the chain's names
``cwe``              common-words extraction: a numbered list of words where ``common`` words
                     appear ``common_freq`` times and the others ``rare_freq`` times; asks for
                     the most common words; answers those words (no haystack)
===================  ======================================================================

Keys are ``adjective-noun`` words (RULER's word keys), values 7-digit numbers (no leading zero)
or uuids (``value_kind="uuid"``). Needles sit at sentence boundaries at depths spread over the
context: record ``i``'s first needle at a depth drawn in the ``i mod 10``-th tenth, so every
tenth of the context is covered equally often.

**Held out by source.** Haystacks come from :func:`haystack_documents`: ``"train"`` is the
Python Language Reference's training sections (:mod:`unicache_train.data.reference_text`),
``"eval"`` is the King James Bible (:mod:`unicache_train.data.eval_text`, a different source);
training records refuse evaluation seeds (>= :data:`~unicache_train.data.recall_mix.
EVAL_SEED_FLOOR`) and evaluation records refuse training seeds, and :func:`overlap_report`
checks the text itself (200-character windows of one split found verbatim in the other).

Several questions on one context (the cached-document use): every record also lists
``questions``, each with its own ``answers`` (the multi-key family asks every needle's key in
turn, the multi-query family each key alone, ...); the evaluation engine
(:mod:`unicache_train.eval.long_context`) compresses the context once and decodes each of them.

Records depend only on ``(task, split, seed, index)`` and the tokenizer (lengths are counted in
its tokens).
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from unicache_train.data.recall_task import _ADJECTIVES, _NOUNS
from unicache_train.validation import ConfigBase, ConfigError, check_choice, check_int

__all__ = [
    "FAMILIES",
    "SPLITS",
    "LongContextTask",
    "haystack_documents",
    "long_context_records",
    "overlap_report",
    "prose_windows",
    "score_prediction",
    "write_long_context_mix",
]

FAMILIES = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")
SPLITS = ("train", "eval")
#: Haystack source of each split (named in every record).
SOURCES = {"train": "python-language-reference", "eval": "kjv-bible"}

_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
_PREAMBLE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize "
    "them. I will quiz you about the {kind} afterwards.\n"
)
_QUESTION_ONE = (
    "What is the special magic {kind1} for {key} mentioned in the provided text?\n"
    "The special magic {kind1} for {key} mentioned in the provided text is"
)
_QUESTION_ALL = (
    "What are all the special magic {kind} for {keys} mentioned in the provided text?\n"
    "The special magic {kind} for {keys} mentioned in the provided text are"
)
_VT_PREAMBLE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
)
_VT_QUESTION = (
    "Question: Find all variables that are assigned the value {value} in the text above.\n"
    "Answer: According to the chain(s) of variable assignment in the text above, {n} "
    "variables are assigned the value {value}, they are:"
)
_CWE_PREAMBLE = "Below is a numbered list of words. In these words, some appear more often.\n"
_CWE_QUESTION = (
    "Question: What are the {n} most common words in the above list?\n"
    "Answer: The top {n} words that appear most often in the list are:"
)
# Words of the common-words lists: common English nouns and adjectives (one or two tokens).
_CWE_WORDS = tuple(sorted(set(_ADJECTIVES) | set(_NOUNS)))


@dataclass
class LongContextTask(ConfigBase):
    """One long-context task: a family at a context length.

    Attributes:
        family: one of :data:`FAMILIES`.
        tokens: target context length in tokenizer tokens (64-131072); the records' contexts
            are within a few tokens of it (``record["tokens"]`` is the measured length).
        value_kind: ``"number"`` (7 digits) or ``"uuid"`` (the needle families).
        distractors: ``niah_multikey``: needles of other keys (1-16).
        values: ``niah_multivalue``: numbers of the asked key (2-8).
        queries: ``niah_multiquery``: keys asked together (2-8).
        hops: ``vt``: assignments in the asked chain after the first (1-8).
        chains: ``vt``: chains in the context, the asked one included (1-4).
        common: ``cwe``: common words asked for (1-10).
        common_freq, rare_freq: ``cwe``: how often a common / a rare word appears.
    """

    family: str = "niah_single"
    tokens: int = 1024
    value_kind: str = "number"
    distractors: int = 3
    values: int = 4
    queries: int = 2
    hops: int = 4
    chains: int = 2
    common: int = 5
    common_freq: int = 20
    rare_freq: int = 2

    def __post_init__(self) -> None:
        check_choice(self, "family", FAMILIES)
        check_int(self, "tokens", 64, 131072)
        check_choice(self, "value_kind", ("number", "uuid"))
        check_int(self, "distractors", 1, 16)
        check_int(self, "values", 2, 8)
        check_int(self, "queries", 2, 8)
        check_int(self, "hops", 1, 8)
        check_int(self, "chains", 1, 4)
        check_int(self, "common", 1, 10)
        check_int(self, "common_freq", 2, 1000)
        check_int(self, "rare_freq", 1, 1000)
        if self.rare_freq >= self.common_freq:
            raise ConfigError(
                f"LongContextTask.rare_freq={self.rare_freq} is out of range; allowed "
                f"[1, common_freq={self.common_freq})"
            )

    @property
    def name(self) -> str:
        """``family@tokens`` (e.g. ``niah_single@1024``): the task's name in per-prompt files."""
        return f"{self.family}@{self.tokens}"


def haystack_documents(split: str) -> list[str]:
    """The filler prose of a split: ``"train"`` the Python Language Reference's training
    sections, ``"eval"`` the King James Bible (fetched once, :func:`~unicache_train.data.
    eval_text.fetch_eval_text`)."""
    if split not in SPLITS:
        raise ConfigError(f"split={split!r} is out of range; allowed {list(SPLITS)}")
    if split == "train":
        from unicache_train.data.reference_text import reference_documents

        return [" ".join(d.split()) for d in reference_documents("train")]
    from unicache_train.data.eval_text import eval_documents, fetch_eval_text

    fetch_eval_text()
    return [" ".join(d.split()) for d in eval_documents()]


def _check_seed(split: str, seed: int) -> None:
    from unicache_train.data.recall_mix import EVAL_SEED_FLOOR

    if split == "eval" and seed < EVAL_SEED_FLOOR:
        raise ConfigError(
            f"seed={seed} is out of range for evaluation records; allowed >= {EVAL_SEED_FLOOR} "
            "(smaller seeds build training data)"
        )
    if split == "train" and seed >= EVAL_SEED_FLOOR:
        raise ConfigError(
            f"seed={seed} is out of range for training records; allowed [0, {EVAL_SEED_FLOOR}) "
            "(larger seeds are evaluation seeds)"
        )


# ------------------------------------------------------------------------------ pieces
def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _value(rng: random.Random, kind: str, taken: set[str]) -> str:
    while True:
        if kind == "uuid":
            v = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        else:
            v = str(rng.randint(1_000_000, 9_999_999))
        if v not in taken:
            taken.add(v)
            return v


def _var(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in taken:
            taken.add(v)
            return v


@dataclass
class _Filler:
    """Sentences of a split's prose with their token counts (computed once per tokenizer)."""

    sentences: list[str]
    lengths: list[int]
    starts: list[int] = field(default_factory=list)  # first sentence of each document


_FILLERS: dict[tuple[int, str], _Filler] = {}


def _filler(tokenizer, split: str) -> _Filler:
    key = (id(tokenizer), split)
    if key not in _FILLERS:
        sentences, starts = [], []
        for doc in haystack_documents(split):
            starts.append(len(sentences))
            parts = doc.replace(". ", ".\x00").split("\x00")
            sentences += [p.strip() + " " for p in parts if p.strip()]
        lengths = [len(tokenizer.encode(s)) for s in sentences]
        _FILLERS[key] = _Filler(sentences, lengths, starts)
    return _FILLERS[key]


def _haystack(filler: _Filler, rng: random.Random, budget: int) -> list[str]:
    """Consecutive sentences from a random document start, about ``budget`` tokens."""
    i = rng.choice(filler.starts)
    out, used = [], 0
    n = len(filler.sentences)
    while used < budget:
        out.append(filler.sentences[i % n])
        used += filler.lengths[i % n]
        i += 1
    excess = used - budget
    if excess > 0 and out:  # shorten the last sentence (some run on for hundreds of tokens)
        words = out[-1].split()
        keep = len(words) - round(len(words) * excess / max(filler.lengths[(i - 1) % n], 1))
        out[-1] = " ".join(words[: max(keep, 0)]) + " " if keep > 0 else ""
    return [s for s in out if s]


def _insert(sentences: list[str], items: Sequence[str], depths: Sequence[float]) -> str:
    """Put each item (a needle sentence) at the sentence boundary nearest its depth, a fraction
    of the haystack's characters."""
    ends = [0]
    for sentence in sentences:
        ends.append(ends[-1] + len(sentence))
    total = max(ends[-1], 1)

    def boundary(d: float) -> int:
        return min(range(len(ends)), key=lambda i: abs(ends[i] - d * total))

    slots = sorted((boundary(d), j) for j, d in enumerate(depths))
    out, k = [], 0
    for i in range(len(sentences) + 1):
        while k < len(slots) and slots[k][0] == i:
            out.append(items[slots[k][1]] + " ")
            k += 1
        if i < len(sentences):
            out.append(sentences[i])
    return "".join(out).rstrip() + "\n"


def _depths(rng: random.Random, index: int, n: int) -> list[float]:
    """The first needle in tenth ``index mod 10`` of the context, the others anywhere."""
    first = (index % 10 + rng.random()) / 10
    return [first] + [rng.random() for _ in range(n - 1)]


# ------------------------------------------------------------------------------ records
def _niah(task: LongContextTask, rng, index, filler, tokenizer) -> dict:
    kind = "numbers" if task.value_kind == "number" else "uuids"
    kind1 = kind[:-1]
    keys_taken: set[str] = set()
    vals_taken: set[str] = set()
    asked = _key(rng, keys_taken)
    if task.family == "niah_single":
        needles = [(asked, _value(rng, task.value_kind, vals_taken))]
    elif task.family == "niah_multikey":
        needles = [(asked, _value(rng, task.value_kind, vals_taken))]
        needles += [
            (_key(rng, keys_taken), _value(rng, task.value_kind, vals_taken))
            for _ in range(task.distractors)
        ]
    elif task.family == "niah_multivalue":
        needles = [(asked, _value(rng, task.value_kind, vals_taken)) for _ in range(task.values)]
    else:  # niah_multiquery
        needles = [(asked, _value(rng, task.value_kind, vals_taken))]
        needles += [
            (_key(rng, keys_taken), _value(rng, task.value_kind, vals_taken))
            for _ in range(task.queries - 1)
        ]
    texts = [_NEEDLE.format(kind=kind, key=k, value=v) for k, v in needles]
    preamble = _PREAMBLE.format(kind=kind)
    fixed = len(tokenizer.encode(preamble)) + sum(len(tokenizer.encode(t)) + 1 for t in texts)
    sentences = _haystack(filler, rng, task.tokens - fixed)
    depths = _depths(rng, index, len(texts))
    context = preamble + _insert(sentences, texts, depths)

    def one(key: str) -> dict:
        return {
            "question": _QUESTION_ONE.format(kind1=kind1, key=key),
            "answers": [v for k, v in needles if k == key][:1],
        }

    if task.family in ("niah_single", "niah_multikey"):
        main = one(asked)
        questions = [one(k) for k, _ in needles]
    elif task.family == "niah_multivalue":
        main = {
            "question": _QUESTION_ALL.format(kind=kind, keys=asked),
            "answers": [v for _, v in needles],
        }
        questions = [main]
    else:
        keys = [k for k, _ in needles]
        main = {
            "question": _QUESTION_ALL.format(kind=kind, keys=", ".join(keys)),
            "answers": [v for _, v in needles],
        }
        questions = [one(k) for k in keys]
    return {
        **main,
        "questions": questions,
        "context": context,
        "depths": depths,
        "needles": [list(n) for n in needles],
    }


def _vt(task: LongContextTask, rng, index, filler, tokenizer) -> dict:
    names: set[str] = set()
    vals: set[str] = set()
    chains, texts = [], []
    for _ in range(task.chains):
        value = str(rng.randint(10000, 99999))
        while value in vals:
            value = str(rng.randint(10000, 99999))
        vals.add(value)
        chain = [_var(rng, names) for _ in range(task.hops + 1)]
        chains.append((value, chain))
        texts.append(
            [f"VAR {chain[0]} = {value}."]
            + [f"VAR {chain[j]} = VAR {chain[j - 1]}." for j in range(1, len(chain))]
        )
    # Each chain's statements in order, at increasing depths; chains interleaved.
    items, depths = [], []
    for c, statements in enumerate(texts):
        ds = sorted(_depths(rng, index + c, len(statements)))
        items += statements
        depths += ds
    fixed = len(tokenizer.encode(_VT_PREAMBLE)) + sum(len(tokenizer.encode(t)) + 1 for t in items)
    sentences = _haystack(filler, rng, task.tokens - fixed)
    context = _VT_PREAMBLE + _insert(sentences, items, depths)
    value, chain = chains[0]
    main = {"question": _VT_QUESTION.format(value=value, n=len(chain)), "answers": chain}
    questions = [
        {"question": _VT_QUESTION.format(value=v, n=len(ch)), "answers": ch} for v, ch in chains
    ]
    return {**main, "questions": questions, "context": context, "depths": depths}


def _cwe(task: LongContextTask, rng, index, tokenizer) -> dict:
    words = list(_CWE_WORDS)
    rng.shuffle(words)
    common, rare_pool = words[: task.common], words[task.common :]
    sample = "".join(f"{j + 1}. {w}\n" for j, w in enumerate(words[:40]))
    per_item = len(tokenizer.encode(sample)) / 40  # tokens of a list line, on average
    budget = task.tokens - len(tokenizer.encode(_CWE_PREAMBLE))
    # At least every common word common_freq times and one rare word (a context that short
    # comes out longer than ``tokens``).
    n_items = max(int(budget / per_item), task.common * task.common_freq + task.rare_freq)
    items = [w for w in common for _ in range(task.common_freq)]
    rare = []
    while len(items) + len(rare) < n_items:
        rare += [w for w in rare_pool for _ in range(task.rare_freq)]
    items += rare[: max(0, n_items - len(items))]
    rng.shuffle(items)
    lines = "".join(f"{j + 1}. {w}\n" for j, w in enumerate(items))
    main = {"question": _CWE_QUESTION.format(n=task.common), "answers": list(common)}
    return {**main, "questions": [main], "context": _CWE_PREAMBLE + lines, "depths": []}


def long_context_records(
    task: LongContextTask, n: int, seed: int, tokenizer, split: str = "eval"
) -> list[dict]:
    """``n`` records of ``task`` from ``split``'s haystack; record ``i`` depends only on
    ``(task, split, seed, i)`` and the tokenizer.

    Args:
        task: the family and length.
        n: records (>= 1).
        seed: evaluation seeds >= ``EVAL_SEED_FLOOR`` for ``split="eval"``, training seeds
            below it for ``"train"``.
        tokenizer: our tokenizer API (``encode``); lengths are counted in its tokens.
        split: ``"eval"`` (King James Bible haystack) or ``"train"`` (Python Language
            Reference).

    Returns:
        Dicts with ``context``, ``question``, ``answers`` (what the prediction must contain),
        ``questions`` (each ``{"question", "answers"}``: the several-questions mode), ``id``
        (``"<task>/<split>/<seed>/<i>"``), ``task``, ``family``, ``split``, ``source``,
        ``seed``, ``tokens`` (the context's measured length, BOS not counted), ``depths`` and,
        for the needle families, ``needles`` ([key, value] pairs).
    """
    if n < 1:
        raise ConfigError(f"long_context_records: n={n} is out of range; allowed >= 1")
    _check_seed(split, seed)
    filler = None if task.family == "cwe" else _filler(tokenizer, split)
    out = []
    for i in range(n):
        rng = random.Random(f"long_context|{task.to_dict()}|{split}|{seed}|{i}")
        if task.family == "cwe":
            rec = _cwe(task, rng, i, tokenizer)
        elif task.family == "vt":
            rec = _vt(task, rng, i, filler, tokenizer)
        else:
            rec = _niah(task, rng, i, filler, tokenizer)
        rec.update(
            id=f"{task.name}/{split}/{seed}/{i}",
            task=task.name,
            family=task.family,
            split=split,
            source=SOURCES[split] if task.family != "cwe" else "word-list",
            seed=seed,
            tokens=len(tokenizer.encode(rec["context"])),
        )
        out.append(rec)
    return out


def prose_windows(tokenizer, n: int, tokens: int, seed: int, split: str = "eval") -> list[dict]:
    """``n`` windows of ``split``'s haystack prose, exactly ``tokens`` ids each (``[bos] +``
    consecutive sentences from a seeded document start, cut to length): the held-out text of the
    perplexity-under-compression rows. Window ``i`` depends only on ``(tokens, split, seed, i)``
    and the tokenizer.

    Returns:
        Dicts with ``id`` (``"prose@<tokens>/<split>/<seed>/<i>"``), ``ids``, ``split``,
        ``source``, ``seed``.

    Raises:
        ConfigError: ``n < 1``, ``tokens < 2``, a seed of the other split, an unknown split.
    """
    if n < 1:
        raise ConfigError(f"prose_windows: n={n} is out of range; allowed >= 1")
    if tokens < 2:
        raise ConfigError(f"prose_windows: tokens={tokens} is out of range; allowed >= 2")
    _check_seed(split, seed)
    filler = _filler(tokenizer, split)
    out = []
    for i in range(n):
        rng = random.Random(f"prose|{tokens}|{split}|{seed}|{i}")
        budget = tokens + 64
        while True:
            state = rng.getstate()
            ids = tokenizer.encode("".join(_haystack(filler, rng, budget)), add_bos=True)
            if len(ids) >= tokens:
                break
            rng.setstate(state)  # the same start, a longer run of sentences
            budget *= 2
        out.append(
            {
                "id": f"prose@{tokens}/{split}/{seed}/{i}",
                "ids": ids[:tokens],
                "split": split,
                "source": SOURCES[split],
                "seed": seed,
            }
        )
    return out


def score_prediction(prediction: str, answers: Sequence[str]) -> bool:
    """RULER's ``string_match_all``: every expected value occurs in the prediction
    (case-insensitive)."""
    low = prediction.lower()
    return all(str(a).lower() in low for a in answers)


def overlap_report(window: int = 200, limit_chars: int = 2_000_000) -> dict[str, int]:
    """How much text the two splits' haystacks share verbatim (the held-out-by-source check
    on the text itself): ``window``-character windows of the evaluation haystack (its first
    ``limit_chars`` characters) found in the training haystack, and the other way round.

    Returns:
        ``{"eval_windows_in_train": k, "train_windows_in_eval": k, "eval_chars": ..,
        "train_chars": ..}`` (0 and 0: no shared text at this window).
    """
    from unicache_train.data.eval_text import leaked_windows

    train = haystack_documents("train")
    evaluation = []
    used = 0
    for doc in haystack_documents("eval"):
        if used >= limit_chars:
            break
        evaluation.append(doc)
        used += len(doc)
    return {
        "eval_windows_in_train": sum(leaked_windows(evaluation, train, window)),
        "train_windows_in_eval": sum(leaked_windows(train, evaluation, window)),
        "eval_chars": used,
        "train_chars": sum(len(d) for d in train),
    }


def write_long_context_mix(path: str | Path, records: Sequence[dict]) -> Path:
    """Write training records as the JSONL :class:`~unicache_train.data.datamodule.LMDataModule`
    reads (``split_at: question``): ``text = context + question + " " + answers + "\\n"``,
    ``question_char`` at the question (the in-loop split: the question and answer are decoded
    on the compressed context, as at inference), ``split_char`` at the answer (the loss and the
    KL term cover the answer with ``prompt_loss: false``). Written atomically.

    Raises:
        ConfigError: a record from the evaluation split.
    """
    import json

    rows = []
    for r in records:
        if r.get("split") != "train":
            raise ConfigError(
                f"write_long_context_mix: record {r.get('id')!r} is from split "
                f"{r.get('split')!r}; allowed 'train' (evaluation prompts never train)"
            )
        q = len(r["context"])
        a = q + len(r["question"]) + 1
        text = r["context"] + r["question"] + " " + ", ".join(r["answers"]) + "\n"
        rows.append({"text": text, "question_char": q, "split_char": a, "id": r["id"]})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)
    return path
