"""The compressor contract: what attention hands a KV compressor and what it gets back.

A compressor is a pure function of tensors, called inside the autograd graph at one named point
of attention (``Attention._compress_context``). It sees one layer's context K/V and returns a
*segment*: the compressed context cache that the continuation tokens attend to. Training (one
parallel forward over context + continuation) and inference (prefill, compress, decode) call the
same function, so what the model learns to tolerate is exactly what it meets when deployed.

Shapes: ``B, H, T, D, M`` = batch, KV heads, tokens, head dim, entries kept in the segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

__all__ = ["KVSegment", "CompressionInput", "KVCompressor", "IdentityCompressor"]


@dataclass
class CompressionInput:
    """One layer's context, as seen at the compression seam.

    Attributes:
        layer_idx: index of the decoder layer.
        num_layers: depth of the decoder (for layer schedules).
        queries: [B, H_q, T, D] post-RoPE queries (for observation-window attention statistics).
        keys: [B, H_kv, T, D] keys (post-RoPE unless the compressor sets ``pre_rope = True``).
        values: [B, H_kv, T, D].
        positions: [B, T] original token positions.
        modality_ids: [B, T] 0 text, 1 vision, 2 audio.
        context_mask: [B, T] bool, True for context tokens (``t < split``); only these may enter
            the segment.
    """

    layer_idx: int
    num_layers: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    modality_ids: torch.Tensor
    context_mask: torch.Tensor


@dataclass
class KVSegment:
    """A (compressed) context cache for one layer.

    Attributes:
        keys: [B, H_kv, M, D] (post-RoPE unless produced by a ``pre_rope`` compressor).
        values: [B, H_kv, M, D].
        positions: [B, M] original position of each entry (merged entries: the position chosen
            by the merge rule).
        modality_ids: [B, M].
        counts: [B, M] float, how many original tokens an entry stands for (1 for kept tokens);
            attention adds ``log(count)`` to the entry's logit, as token merging does.
        valid: [B, M] bool; invalid entries are padding and never attended.
        stats: scalar diagnostics for logging (``keep_ratio``, ``kv_bytes_ratio``, ...).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    modality_ids: torch.Tensor
    counts: torch.Tensor
    valid: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class KVCompressor(Protocol):
    """Anything callable as ``compressor(inp) -> KVSegment``."""

    pre_rope: bool

    def __call__(self, inp: CompressionInput) -> KVSegment: ...


class IdentityCompressor:
    """Keeps every context token unchanged (rate 0). The in-loop forward with this compressor
    computes exactly the plain causal forward: the reference every real compressor is tested
    against."""

    pre_rope = False

    def __call__(self, inp: CompressionInput) -> KVSegment:
        counts = torch.ones_like(inp.positions, dtype=inp.keys.dtype)
        return KVSegment(
            keys=inp.keys,
            values=inp.values,
            positions=inp.positions,
            modality_ids=inp.modality_ids,
            counts=counts,
            valid=inp.context_mask,
        )
