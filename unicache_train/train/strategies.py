"""Parallelism in one place: which Lightning strategy a run uses.

Model code never knows it will be sharded; this module maps ``train.strategy`` (from the recipe
or from ``fabric run --strategy``) to a Lightning strategy object or name.
"""

from __future__ import annotations

from lightning.pytorch.strategies import Strategy

from unicache_train.config import RunConfig


def build_strategy(config: RunConfig) -> str | Strategy:
    """The strategy for ``config.train`` (a Lightning strategy name passes through)."""
    return config.train.strategy
