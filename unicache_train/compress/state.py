"""The state that flows through the steps of a composed compressor.

A step is any callable ``step(state) -> state`` (a small dataclass whose fields are its
hyperparameters). Steps read what earlier steps left (``scores``, ``layer_rate``, ...) and may
change the layer's K/V (head merge) or emit the segment (merge/evict). Derived statistics
(observation-window attention, neighbour similarity) are computed lazily from the *current*
K/V and cached; a step that changes K/V structurally calls :meth:`CompressionState.invalidate`
so that every later step recomputes them (UniCache article §9 pitfall 1: masks and indices must
follow a structural change).

Shape legend: B, H, T, D = batch, KV heads, tokens, head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from unicache_train.compress.neighbours import (
    NeighbourSims,
    neighbour_offsets,
    neighbour_similarity,
)
from unicache_train.compress.window import WindowStats, window_stats
from unicache_train.seam import CompressionInput, KVSegment, identity_segment

__all__ = ["CompressionState", "CompressionStep"]


@dataclass
class CompressionState:
    """Everything the steps share for one layer call.

    Attributes:
        inp: the untouched input of the call (the *uncompressed* context).
        keys, values: [B, H, T, D] current K/V (after head merge when it ran).
        target: [B] target rate per sample (``target_rate * rate_scale``; the fallback step
            replaces it per sample).
        rate_scale: curriculum factor in [0, 1].
        reference_target: the configured target rate (fixed modality rates are given at it).
        window: observation window W for attention statistics.
        neighbours, frame_stride, similarity: neighbour definition for redundancy / merging.
        head_groups: [B, H] long group id per KV head, None before head merge.
        scores: [B, T] importance, None when not computed.
        logits: [B, T] differentiable retention logits of a learned scorer
            (:mod:`~unicache_train.compress.retention`), None for fixed scorers.
        layer_rate: [B] rate of this layer per sample.
        modality_rates: [B, 3] rate per modality.
        protected: [B, T] bool alignment tokens.
        discount: rate multiplier of protected tokens.
        complexity: [B] fallback complexity (on the uncompressed input).
        plan: the merge/evict decisions (:class:`~unicache_train.compress.merge_evict.TokenPlan`).
        segment: the emitted segment, None until a step emits one.
        stats: extra scalar stats steps want logged.
    """

    inp: CompressionInput
    keys: torch.Tensor
    values: torch.Tensor
    target: torch.Tensor
    rate_scale: float = 1.0
    reference_target: float = 0.6
    window: int = 32
    neighbours: int = 4
    frame_stride: int = 0
    similarity: str = "keys"
    head_groups: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    layer_rate: torch.Tensor | None = None
    modality_rates: torch.Tensor | None = None
    protected: torch.Tensor | None = None
    discount: float = 1.0
    complexity: torch.Tensor | None = None
    plan: Any = None
    segment: KVSegment | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    _window_stats: WindowStats | None = field(default=None, repr=False)
    _neighbour_sims: NeighbourSims | None = field(default=None, repr=False)

    @classmethod
    def from_input(cls, inp: CompressionInput, target: float, **kwargs) -> CompressionState:
        B = inp.keys.shape[0]
        tgt = torch.full((B,), float(target), device=inp.keys.device)
        return cls(inp=inp, keys=inp.keys, values=inp.values, target=tgt, **kwargs)

    @property
    def context_mask(self) -> torch.Tensor:
        return self.inp.context_mask

    @property
    def modality_ids(self) -> torch.Tensor:
        return self.inp.modality_ids

    def window_stats(self) -> WindowStats:
        """Observation-window statistics of the current keys (cached)."""
        if self._window_stats is None:
            self._window_stats = window_stats(
                self.inp.queries, self.keys, self.modality_ids, self.context_mask, self.window
            )
        return self._window_stats

    def neighbour_sims(self) -> NeighbourSims:
        """Neighbour similarity of the current K/V (cached)."""
        if self._neighbour_sims is None:
            offsets = neighbour_offsets(self.neighbours, self.frame_stride)
            self._neighbour_sims = neighbour_similarity(
                self.keys,
                self.values,
                self.modality_ids,
                self.context_mask,
                offsets,
                self.similarity,
            )
        return self._neighbour_sims

    def configure(self, window: int, neighbours: int, frame_stride: int, similarity: str) -> None:
        """Set the statistics' definition; drops cached statistics computed differently."""
        spec = (window, neighbours, frame_stride, similarity)
        if spec != (self.window, self.neighbours, self.frame_stride, self.similarity):
            self.window, self.neighbours, self.frame_stride, self.similarity = spec
            self._window_stats = None
            self._neighbour_sims = None

    def identity_segment(self) -> KVSegment:
        """Every context token of the current K/V as one entry (rate 0 for the token axis).

        With unmerged heads this holds the input tensors themselves, so attention over it is
        bit-for-bit the uncompressed attention.
        """
        return identity_segment(
            self.inp, self.keys, self.values, head_groups=self.head_groups, with_assignment=True
        )

    def invalidate(self) -> None:
        """Drop every statistic derived from K/V (call after a structural change)."""
        self._window_stats = None
        self._neighbour_sims = None
        self.scores = None
        self.logits = None


@runtime_checkable
class CompressionStep(Protocol):
    """A pipeline step. ``stage`` orders the UniCache steps (quantize is last)."""

    stage: ClassVar[int]

    def __call__(self, state: CompressionState) -> CompressionState: ...
