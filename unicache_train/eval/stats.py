"""Small statistics helpers shared by the evaluation tasks."""

from __future__ import annotations

import math


def binomial_stderr(hits: int, n: int) -> float:
    """Standard error of an accuracy ``hits / n`` (binomial, ``sqrt(p (1 - p) / n)``).

    Raises:
        ValueError: ``n < 1`` or ``hits`` outside ``[0, n]``.
    """
    if n < 1 or not 0 <= hits <= n:
        raise ValueError(f"binomial_stderr: need 0 <= hits <= n and n >= 1; got {hits}, {n}")
    p = hits / n
    return math.sqrt(p * (1.0 - p) / n)
