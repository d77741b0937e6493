"""Statistics of the evaluation: single proportions and paired comparisons.

- :func:`wilson_interval`: a 95% interval for an accuracy ``hits / n`` that stays honest at 0
  and ``n`` (0/32 gives [0, 0.107], not "0.00 ± 0.00"). Wilson, JASA 22 (1927).
- :func:`mcnemar_exact`: two models (or settings) answered the **same** prompts; the exact
  two-sided McNemar test is the binomial test of the discordant pairs ``(b, c)`` against
  ``p = 1/2``. McNemar, Psychometrika 12 (1947); the exact form: Fagerland et al., BMC Med. Res.
  Methodol. 13:91 (2013).
- :func:`sign_flip_clustered`: the same comparison pooled over training seeds, clustered by
  prompt. Seed ``k`` of A against seed ``k`` of B on the same prompts gives ``K`` pairs per
  prompt, and they are not independent (an easy prompt is easy for every seed), so the unit of
  the test is the prompt: its summed difference over the seeds, whose sign is flipped at random
  under the null (a randomization test, Fisher 1935; for clustered data, e.g. Gail et al., Stat.
  Med. 15 (1996)). Computed exactly; with one seed it is the exact McNemar test.
- :func:`drop_difference_clustered`: does compression cost arm A fewer answers than arm B? Per
  prompt, each arm's drop (its uncompressed hits minus its compressed hits, summed over the
  seeds), and the sign-flip test of the difference of the two drops, clustered by prompt as
  above. An arm that is better everywhere (uncompressed too) is not called more tolerant of
  compression by this test; it is by a comparison of compressed accuracies alone.
- :func:`paired_bootstrap_ppl`: the perplexity change between two runs on the **same** text
  blocks, with a percentile interval from resampling blocks (both runs take the same resampled
  blocks). Efron & Tibshirani, An Introduction to the Bootstrap (1993), ch. 13.

Pooled tests across training seeds use :func:`sign_flip_clustered`; an exact McNemar test on
the concatenated pairs of the seeds (each prompt counted once per seed) treats them as
independent and overstates the evidence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ClusteredPaired",
    "DropDifference",
    "McNemar",
    "PairedPPL",
    "binomial_stderr",
    "drop_difference_clustered",
    "format_p",
    "mcnemar_exact",
    "paired_bootstrap_ppl",
    "sign_flip_clustered",
    "wilson_interval",
]

_Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def binomial_stderr(hits: int, n: int) -> float:
    """Standard error of an accuracy ``hits / n`` (binomial, ``sqrt(p (1 - p) / n)``).

    Raises:
        ValueError: ``n < 1`` or ``hits`` outside ``[0, n]``.
    """
    _check_counts(hits, n, "binomial_stderr")
    p = hits / n
    return math.sqrt(p * (1.0 - p) / n)


def _check_counts(hits: int, n: int, who: str) -> None:
    if n < 1 or not 0 <= hits <= n:
        raise ValueError(f"{who}: need 0 <= hits <= n and n >= 1; got hits={hits}, n={n}")


def wilson_interval(hits: int, n: int, z: float = _Z95) -> tuple[float, float]:
    """Wilson score interval of ``hits / n`` (default 95%).

    ``(p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with ``p = hits / n``.

    Raises:
        ValueError: ``n < 1``, ``hits`` outside ``[0, n]`` or ``z <= 0``.
    """
    _check_counts(hits, n, "wilson_interval")
    if not z > 0:
        raise ValueError(f"wilson_interval: z={z!r} is out of range; allowed > 0")
    p = hits / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    denom = 1 + z2 / n
    lo, hi = (centre - half) / denom, (centre + half) / denom
    # The formula gives exactly 0 (hits = 0) and 1 (hits = n) up to rounding: clamp it.
    return (0.0 if hits == 0 else max(lo, 0.0), 1.0 if hits == n else min(hi, 1.0))


@dataclass(frozen=True)
class McNemar:
    """Exact McNemar test of two paired accuracies.

    Attributes:
        n: pairs (prompts answered by both).
        a_hits, b_hits: correct answers of A and of B.
        only_a: A right, B wrong (``b`` in McNemar's table).
        only_b: A wrong, B right (``c``).
        p_value: two-sided exact p (1.0 when there is no discordant pair).
    """

    n: int
    a_hits: int
    b_hits: int
    only_a: int
    only_b: int
    p_value: float

    @property
    def difference(self) -> float:
        """Accuracy of B minus accuracy of A."""
        return (self.b_hits - self.a_hits) / self.n


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> McNemar:
    """Exact two-sided McNemar test: ``p = min(1, 2 P[X <= min(only_a, only_b)])`` with
    ``X ~ Binomial(only_a + only_b, 1/2)``.

    Args:
        a, b: per-prompt correctness of A and B, the same prompts in the same order.

    Raises:
        ValueError: the two lists differ in length or are empty.
    """
    if len(a) != len(b) or not a:
        raise ValueError(
            f"mcnemar_exact: need two equally long, non-empty lists; got {len(a)} and {len(b)}"
        )
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    d = only_a + only_b
    if d == 0:
        p = 1.0
    else:
        k = min(only_a, only_b)
        tail = sum(math.comb(d, i) for i in range(k + 1)) / 2**d
        p = min(1.0, 2.0 * tail)
    return McNemar(len(a), sum(map(bool, a)), sum(map(bool, b)), only_a, only_b, p)


@dataclass(frozen=True)
class ClusteredPaired:
    """Two arms on the same prompts over several seeds, tested with the prompt as the unit.

    Attributes:
        prompts: prompts answered by both arms in every seed.
        seeds: seeds (seed ``k`` of A is paired with seed ``k`` of B).
        a_hits, b_hits: correct answers of A and of B over all (prompt, seed) pairs.
        only_a, only_b: (prompt, seed) pairs with only A right / only B right (McNemar's counts
            on the concatenated pairs).
        favour_a, favour_b: prompts whose difference summed over the seeds favours A / B (the
            prompts that enter the test).
        p_value: two-sided exact sign-flip p (1.0 when no prompt favours either arm).
    """

    prompts: int
    seeds: int
    a_hits: int
    b_hits: int
    only_a: int
    only_b: int
    favour_a: int
    favour_b: int
    p_value: float

    @property
    def n(self) -> int:
        """(prompt, seed) pairs."""
        return self.prompts * self.seeds

    @property
    def difference(self) -> float:
        """Accuracy of B minus accuracy of A over all pairs."""
        return (self.b_hits - self.a_hits) / self.n


def sign_flip_clustered(
    a: Sequence[Sequence[bool]], b: Sequence[Sequence[bool]]
) -> ClusteredPaired:
    """Exact two-sided sign-flip test of paired accuracies, clustered by prompt.

    Per prompt ``i``, ``d_i = Σ_k (b_ki - a_ki)`` (an integer in ``[-K, K]``). Under the null
    that the arms are exchangeable on every prompt (swapping the labels A and B of a prompt, in
    all its seeds at once, leaves the joint distribution unchanged), each ``d_i`` is as likely
    as ``-d_i``, so ``T = Σ_i d_i`` is referred to ``T* = Σ_i s_i |d_i|`` over the ``2^m`` sign
    vectors ``s`` of the ``m`` prompts with ``d_i != 0``: ``p = #{s: |T*| >= |T|} / 2^m``. The
    count is exact (a convolution over the few distinct ``|d_i|``, integer arithmetic), so no
    Monte Carlo error. With one seed ``d_i`` is ``±1`` on the discordant prompts and the test
    is the exact McNemar test (:func:`mcnemar_exact`); a seed that repeats another adds no
    evidence (``d_i`` doubles, the p stays).

    Args:
        a, b: ``a[k][i]``: correctness of A's seed ``k`` on prompt ``i`` (``[K][n]``); the same
            prompts in the same order in every seed and in both arms.

    Raises:
        ValueError: no seed, no prompt, or lists of different lengths.
    """
    if not a or len(a) != len(b):
        raise ValueError(
            f"sign_flip_clustered: need the same number (>= 1) of seeds for A and B; got "
            f"{len(a)} and {len(b)}"
        )
    n = len(a[0])
    lengths = [len(x) for x in (*a, *b)]
    if n == 0 or any(m != n for m in lengths):
        raise ValueError(
            f"sign_flip_clustered: every seed of both arms needs the same non-empty prompts; "
            f"got lengths {lengths}"
        )
    d = [sum(bool(y[i]) - bool(x[i]) for x, y in zip(a, b)) for i in range(n)]  # [n]
    p = _sign_flip_p(d)
    only_a = sum(1 for x, y in zip(a, b) for i in range(n) if x[i] and not y[i])
    only_b = sum(1 for x, y in zip(a, b) for i in range(n) if y[i] and not x[i])
    return ClusteredPaired(
        prompts=n,
        seeds=len(a),
        a_hits=sum(map(bool, (v for x in a for v in x))),
        b_hits=sum(map(bool, (v for y in b for v in y))),
        only_a=only_a,
        only_b=only_b,
        favour_a=sum(1 for x in d if x < 0),
        favour_b=sum(1 for x in d if x > 0),
        p_value=min(1.0, p),
    )


def _sign_flip_p(d: Sequence[int]) -> float:
    """Exact two-sided sign-flip p of the integer per-prompt differences ``d``: the share of the
    ``2^m`` sign vectors of the ``m`` non-zero ``d_i`` with ``|Σ s_i |d_i|| >= |Σ d_i|``."""
    t_obs = abs(sum(d))
    # Distribution of Σ s_i |d_i|: for each magnitude v held by c prompts, v (2j - c) with
    # weight C(c, j); convolve over the magnitudes. {sum: number of sign vectors}.
    dist = {0: 1}
    for v in sorted({abs(x) for x in d if x}):
        c = sum(1 for x in d if abs(x) == v)
        step = {v * (2 * j - c): math.comb(c, j) for j in range(c + 1)}
        dist = _convolve(dist, step)
    total = sum(dist.values())  # 2^m
    return min(1.0, sum(w for s, w in dist.items() if abs(s) >= t_obs) / total)


@dataclass(frozen=True)
class DropDifference:
    """What compression costs two arms on the same prompts, tested with the prompt as the unit.

    Attributes:
        prompts: prompts answered by both arms, uncompressed and compressed, in every seed.
        seeds: seeds per arm (seed ``k`` of A is paired with seed ``k`` of B).
        a_full, a_compressed, b_full, b_compressed: hits over all (prompt, seed) pairs.
        favour_a, favour_b: prompts on which A's drop summed over the seeds is smaller / larger
            than B's (the prompts that enter the test).
        p_value: two-sided exact sign-flip p of the difference of the drops (1.0 when no
            prompt favours either arm).
    """

    prompts: int
    seeds: int
    a_full: int
    a_compressed: int
    b_full: int
    b_compressed: int
    favour_a: int
    favour_b: int
    p_value: float

    @property
    def a_drop(self) -> int:
        """A's hits lost to compression (negative: compression helped)."""
        return self.a_full - self.a_compressed

    @property
    def b_drop(self) -> int:
        return self.b_full - self.b_compressed


def drop_difference_clustered(
    a_full: Sequence[Sequence[bool]],
    a_compressed: Sequence[Sequence[bool]],
    b_full: Sequence[Sequence[bool]],
    b_compressed: Sequence[Sequence[bool]],
) -> DropDifference:
    """Exact sign-flip test that compression costs arm A as many answers as arm B.

    Per prompt ``i``, ``drop_X,i = Σ_k (full_X,ki - compressed_X,ki)`` and
    ``d_i = drop_A,i - drop_B,i`` (an integer in ``[-2K, 2K]``). Under the null that the arms
    are exchangeable on every prompt (swapping A and B on a prompt, in all its seeds and both
    settings at once, leaves the joint distribution unchanged), ``d_i`` is as likely as
    ``-d_i``; the p is exact as in :func:`sign_flip_clustered`.

    Args:
        a_full, a_compressed, b_full, b_compressed: ``x[k][i]``: correctness of seed ``k`` on
            prompt ``i`` (``[K][n]``); the same prompts in the same order everywhere.

    Raises:
        ValueError: no seed, no prompt, or lists of different lengths.
    """
    arms = (a_full, a_compressed, b_full, b_compressed)
    if not a_full or any(len(x) != len(a_full) for x in arms):
        raise ValueError(
            "drop_difference_clustered: need the same number (>= 1) of seeds in all four; got "
            f"{[len(x) for x in arms]}"
        )
    n = len(a_full[0])
    lengths = [len(seed) for x in arms for seed in x]
    if n == 0 or any(m != n for m in lengths):
        raise ValueError(
            "drop_difference_clustered: every seed needs the same non-empty prompts; got "
            f"lengths {lengths}"
        )

    def drop(full, comp, i):
        return sum(bool(f[i]) - bool(c[i]) for f, c in zip(full, comp))

    d = [drop(a_full, a_compressed, i) - drop(b_full, b_compressed, i) for i in range(n)]

    def hits(x):
        return sum(map(bool, (v for seed in x for v in seed)))

    return DropDifference(
        prompts=n,
        seeds=len(a_full),
        a_full=hits(a_full),
        a_compressed=hits(a_compressed),
        b_full=hits(b_full),
        b_compressed=hits(b_compressed),
        favour_a=sum(1 for x in d if x < 0),
        favour_b=sum(1 for x in d if x > 0),
        p_value=_sign_flip_p(d),
    )


def _convolve(x: dict[int, int], y: dict[int, int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for s, w in x.items():
        for t, u in y.items():
            out[s + t] = out.get(s + t, 0) + w * u
    return out


@dataclass(frozen=True)
class PairedPPL:
    """Perplexity of B relative to A on the same blocks, with a bootstrap interval.

    Attributes:
        ppl_a, ppl_b: token-weighted perplexities over all blocks.
        change: ``ppl_b / ppl_a - 1``.
        lo, hi: percentile interval of ``change`` (default 95%).
        blocks: blocks compared.
        resamples: bootstrap resamples.
    """

    ppl_a: float
    ppl_b: float
    change: float
    lo: float
    hi: float
    blocks: int
    resamples: int


def paired_bootstrap_ppl(
    nll_a: Sequence[float],
    nll_b: Sequence[float],
    tokens: Sequence[int],
    *,
    resamples: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> PairedPPL:
    """Paired bootstrap of the perplexity change from per-block summed NLLs.

    Each resample draws ``len(tokens)`` block indices with replacement (the same indices for A
    and B) and computes ``exp((ΣB - ΣA) / Σtokens) - 1`` over them; the interval is the
    resamples' ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles.

    Args:
        nll_a, nll_b: summed NLL (nats) of each block under A and under B.
        tokens: scored tokens of each block.
        resamples: bootstrap resamples (>= 100).
        level: interval coverage in (0, 1).
        seed: the resampling seed (fixed: the interval is reproducible).

    Raises:
        ValueError: lengths differ, fewer than 2 blocks, a block without tokens, or an
            argument out of range.
    """
    import numpy as np

    n = len(tokens)
    if len(nll_a) != n or len(nll_b) != n or n < 2:
        raise ValueError(
            f"paired_bootstrap_ppl: need >= 2 blocks and equal lengths; got {len(nll_a)}, "
            f"{len(nll_b)}, {n}"
        )
    if min(tokens) < 1:
        raise ValueError(f"paired_bootstrap_ppl: every block needs >= 1 token; got {min(tokens)}")
    if resamples < 100:
        raise ValueError(f"paired_bootstrap_ppl: resamples={resamples} is out of range; >= 100")
    if not 0.0 < level < 1.0:
        raise ValueError(f"paired_bootstrap_ppl: level={level!r} is out of range; allowed (0, 1)")
    a = np.asarray(nll_a, dtype=np.float64)
    b = np.asarray(nll_b, dtype=np.float64)
    t = np.asarray(tokens, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # [R, n]
    change = np.expm1((b[idx].sum(1) - a[idx].sum(1)) / t[idx].sum(1))
    lo, hi = np.quantile(change, [(1 - level) / 2, (1 + level) / 2])
    ppl_a = math.exp(a.sum() / t.sum())
    ppl_b = math.exp(b.sum() / t.sum())
    return PairedPPL(ppl_a, ppl_b, ppl_b / ppl_a - 1.0, float(lo), float(hi), n, resamples)


def format_p(p: float) -> str:
    """A p-value for a table: ``p = 0.031``, ``p = 0.0004``, ``p < 1e-6``."""
    if p < 1e-6:
        return "p < 1e-6"
    return f"p = {p:.2g}" if p < 0.001 else f"p = {p:.3f}"
