"""Similarity of each context token to its neighbours: the redundancy signal (UniCache article
§4.2) and the merge targets of merge/evict.

Vectorized over batch, heads and tokens; the loop runs over neighbour offsets only. Neighbours
are tokens of the same sample and modality, both in the context. Computed without gradients
(they drive discrete decisions).

Shape legend: B, H, T, D, O = batch, KV heads, tokens, head dim, neighbour offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unicache_train.compress.kernels import using_reference_kernels

__all__ = ["NeighbourSims", "neighbour_offsets", "neighbour_similarity"]

_EPS = 1e-6


@dataclass
class NeighbourSims:
    """Similarity of each token to its neighbours (same sample, same modality, both context).

    Attributes:
        offsets: the O neighbour offsets (token ``t`` is compared with ``t + o``).
        sims: [B, T, O] cosine similarity, mean over KV heads; -inf where not a neighbour.
        valid: [B, T, O] bool.
    """

    offsets: tuple[int, ...]
    sims: torch.Tensor
    valid: torch.Tensor

    @property
    def redundancy(self) -> torch.Tensor:
        """d: [B, T], max similarity to any neighbour, clipped to [0, 1] (0: no neighbour)."""
        d = self.sims.amax(-1) if self.sims.shape[-1] else self.sims.new_zeros(self.sims.shape[:2])
        return torch.nan_to_num(d, neginf=0.0).clamp(0.0, 1.0)


def neighbour_offsets(k: int, frame_stride: int = 0) -> tuple[int, ...]:
    """Offsets ``-k..-1, 1..k``; with ``frame_stride > k`` also ``±j * frame_stride`` for
    ``j = 1..k`` (the same patch in the k previous and next frames of a video)."""
    offs = [o for o in range(-k, k + 1) if o != 0]
    if frame_stride > k:
        offs += [s * j * frame_stride for j in range(1, k + 1) for s in (-1, 1)]
    return tuple(offs)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)


def _shift(x: torch.Tensor, o: int, dim: int) -> torch.Tensor:
    """y with ``y[t] = x[t + o]`` along ``dim``, zero (False) outside the sequence."""
    T = x.shape[dim]
    y = torch.zeros_like(x)
    if abs(o) < T:
        if o >= 0:
            y.narrow(dim, 0, T - o).copy_(x.narrow(dim, o, T - o))
        else:
            y.narrow(dim, -o, T + o).copy_(x.narrow(dim, 0, T + o))
    return y


@torch.no_grad()
def neighbour_similarity(
    keys: torch.Tensor,
    values: torch.Tensor,
    modality_ids: torch.Tensor,
    context_mask: torch.Tensor,
    offsets: tuple[int, ...],
    source: str = "keys",
) -> NeighbourSims:
    """Cosine similarity of every token to its neighbours at ``offsets`` (UniCache article §4.2).

    Per KV head the cosine of the key vectors (``source="keys"``) or the mean of the key and
    value cosines (``"kv"``), then the mean over heads. Tokens of another modality, outside the
    context or outside the sequence are not neighbours. Keys are the cached (post-RoPE) keys:
    the cache holds them, so their similarity is what merging two entries would mix.

    Args:
        keys, values: [B, H, T, D].
        modality_ids: [B, T]; context_mask: [B, T] bool.

    Returns:
        :class:`NeighbourSims` with sims [B, T, O].
    """
    kh = _unit(keys.float())  # [B, H, T, D]
    vh = _unit(values.float()) if source == "kv" else None
    T = kh.shape[2]

    dots_of: dict[tuple[str, int], torch.Tensor] = {}
    reference = using_reference_kernels()

    def pair_cos(x: torch.Tensor, o: int, name: str) -> torch.Tensor:
        # cos(x_t, x_{t+o}) on the overlapping slices only (no shifted copy of [B, H, T, D]),
        # head-averaged, then placed at t: [B, T], 0 where t + o is outside the sequence.
        out = x.new_zeros(x.shape[0], T)
        n = T - abs(o)
        if n > 0:
            # NOTE: offsets o and -o pair the same tokens (x_t x_{t+|o|}, a product that
            # commutes exactly): computed once, placed twice.
            key = (name, o if reference else abs(o))
            if key not in dots_of:
                a, b = (x[:, :, :n], x[:, :, o:]) if o > 0 else (x[:, :, -o:], x[:, :, :n])
                dots_of[key] = (a * b).sum(-1).mean(1)  # [B, n]
            dots = dots_of[key]
            if o > 0:
                out[:, :n] = dots
            else:
                out[:, -o:] = dots
        return out

    sims, valid = [], []
    for o in offsets:
        s = pair_cos(kh, o, "k")
        if vh is not None:
            s = 0.5 * (s + pair_cos(vh, o, "v"))
        ok = context_mask & _shift(context_mask, o, 1)
        ok &= modality_ids == _shift(modality_ids, o, 1)
        sims.append(torch.where(ok, s, float("-inf")))
        valid.append(ok)
    B, T = modality_ids.shape
    if not offsets:
        empty = keys.new_zeros(B, T, 0, dtype=torch.float32)
        return NeighbourSims((), empty, empty.bool())
    return NeighbourSims(tuple(offsets), torch.stack(sims, -1), torch.stack(valid, -1))
