"""The compressor's reference kernels, kept selectable beside the fast ones.

A few hot per-layer ops of UniCache have two implementations that give bit-for-bit the same
segment and the same gradients (``tests/test_compress_kernels.py`` checks it on fixed seeds):

* :func:`~unicache_train.compress.window.window_stats`: the causal window mask is an additive
  ``0 / -inf`` bias and the rows of missing window queries are zeroed by a multiply (the
  reference: a broadcast ``masked_fill`` and ``nan_to_num``, 10x slower on CPU);
* :class:`~unicache_train.compress.merge_evict.MergeEvict`: the weighted means are computed for
  the entries that absorb tokens only and the kept rows are gathered once
  (:func:`~unicache_train.compress.merge_evict.merge_gather_segment`; the reference folds every
  token of ``[B, H, T, D]`` with :func:`~unicache_train.compress.merge_evict.merge_tokens`, then
  gathers with :func:`~unicache_train.compress.merge_evict.gather_segment`; the fused path runs
  on CPU only, accelerators keep the sync-free reference); its plan skips the
  protection rounds when no protected token was picked (the reference recomputes the same
  neighbours there).

* :func:`~unicache_train.compress.neighbours.neighbour_similarity`: offsets ``o`` and ``-o``
  share their dot products (the same token pairs; the reference computes both).

The reference path exists for the equality tests and for ``benchmarks/bench_compress_overhead.py
--compare-kernels``, which times both in one run. Not thread-safe (a process-wide switch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["reference_kernels", "using_reference_kernels"]

_REFERENCE = False


def using_reference_kernels() -> bool:
    """True inside :func:`reference_kernels`."""
    return _REFERENCE


@contextmanager
def reference_kernels(enabled: bool = True) -> Iterator[None]:
    """Run the compressor's reference kernels instead of the fast ones inside the block."""
    global _REFERENCE
    before, _REFERENCE = _REFERENCE, bool(enabled)
    try:
        yield
    finally:
        _REFERENCE = before
