"""Triton kernels, installed as ``unicache_train.kernels``.

Submodules import triton, so they are imported lazily by the ops that use them (e.g.
``unicache_train.ops.sinkhorn`` imports ``unicache_train.kernels.sinkhorn`` on first Triton
use); importing this package has no side effects.
"""
