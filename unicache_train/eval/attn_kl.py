"""Attention KL between a decoder's uncompressed and compressed forwards (``compress/attn_kl``).

Shape legend: B, H, Hk, T, M, D, C = batch, query heads, KV heads, tokens, segment entries, head
dim, width.

``KL(P_compressed || P_full)`` of each continuation query's attention over the original key
tokens, summed over queries and heads (the caller averages). ``P_full`` is the uncompressed
forward's attention; ``P_compressed`` the compressed forward's, mapped back to tokens: a merged
entry's probability is shared equally by the tokens it stands for (what its ``log(count)`` bias
means), evicted tokens get 0. This direction is finite under eviction (the other one is infinite
as soon as a full query looks at an evicted token) and still charges lost mass ``m`` as
``-log(1 - m)``.

The probabilities are recomputed from each layer's own inputs, captured by forward pre-hooks
(:class:`AttentionInputs`; the model is not modified), through
:meth:`~unicache_train.model.attention.Attention.project` (q/k norms and RoPE included), so the
queries and keys are the ones the forward used. GQA attention only.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from unicache_train.model import Decoder
from unicache_train.model.attention import segment_attention_mask
from unicache_train.seam import KVSegment

__all__ = ["AttentionInputs", "attention_kl_layer", "layer_kls"]

#: One layer's attention input: (x [B, T, C], rope (cos, sin)).
LayerInput = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class AttentionInputs:
    """Forward pre-hooks on the last ``num_layers`` layers' attention (0: none), as a context
    manager: ``inputs[layer_idx]`` keeps each layer's input of the last forward."""

    def __init__(self, model: Decoder, num_layers: int) -> None:
        layers = list(model.layers)[-num_layers:] if num_layers > 0 else []
        self.inputs: dict[int, LayerInput] = {}
        self.handles = [
            layer.self_attn.register_forward_pre_hook(self._hook, with_kwargs=True)
            for layer in layers
        ]

    def _hook(self, module, args, kwargs) -> None:
        x = args[0] if args else kwargs["x"]
        self.inputs[module.layer_idx] = (x.detach(), kwargs["rope"])

    def __enter__(self) -> AttentionInputs:
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def attention_kl_layer(
    attn,
    full_in: LayerInput,
    comp_in: LayerInput,
    seg: KVSegment,
    split: torch.Tensor,
    query_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed ``KL(P_comp || P_full)`` over masked continuation queries x heads, and the count.

    Args:
        attn: the layer's :class:`~unicache_train.model.attention.Attention`.
        full_in, comp_in: (x [B, T, C], rope) of the uncompressed / compressed forward.
        seg: the layer's segment (keys [B, Hk, M, D], counts/valid [B, M], assignment [B, T]).
        split: [B].
        query_mask: [B, T] bool, continuation queries that count.

    Returns:
        (KL sum [], queries x heads counted [] long).
    """
    full, comp = attn.project(*full_in), attn.project(*comp_in)
    q_f, k_f = full.q.float(), full.k.float()  # [B, H, T, D], [B, Hk, T, D]
    q_c, k_c = comp.q.float(), comp.k.float()
    B, H, T, D = q_f.shape
    rep = H // k_f.shape[1]
    scale = D**-0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q_f.device).tril()
    logits_f = (q_f @ k_f.repeat_interleave(rep, 1).transpose(-1, -2)) * scale  # [B, H, T, T]
    p_full = torch.softmax(logits_f.masked_fill(~causal, float("-inf")), -1)
    keys_c = torch.cat([seg.keys.float(), k_c], 2).repeat_interleave(rep, 1)  # [B, H, M + T, D]
    mask = segment_attention_mask(seg, split, T, torch.float32)  # [B, 1, T, M + T]
    p_comp = torch.softmax((q_c @ keys_c.transpose(-1, -2)) * scale + mask, -1)
    M = seg.keys.shape[2]
    # Entries back to tokens: a token's share of its entry is 1/count; evicted tokens get 0.
    assign = seg.assignment
    if assign is None:  # identity layout: entry m is token m
        t = torch.arange(T, device=split.device).expand(B, T)
        assign = torch.where(seg.valid if M == T else t < split[:, None], t, -1)
    ok = assign >= 0  # [B, T] context token kept or merged
    idx = assign.clamp_min(0)
    counts = seg.counts.float().clamp_min(1.0).gather(1, idx)  # [B, T]
    ent = p_comp[..., :M].gather(-1, idx[:, None, None, :].expand(B, H, T, T))  # [B, H, Tq, Tk]
    ctx_key = torch.arange(T, device=split.device)[None, :] < split[:, None]  # [B, T] key side
    tok_ctx = torch.where((ok & ctx_key)[:, None, None, :], ent / counts[:, None, None, :], 0.0)
    tok_cont = torch.where(ctx_key[:, None, None, :], 0.0, p_comp[..., M:])
    p_tok = tok_ctx + tok_cont  # [B, H, T, T] compressed attention on original tokens
    kl = torch.where(
        p_tok > 0, p_tok * (p_tok.clamp_min(1e-30).log() - p_full.clamp_min(1e-30).log()), 0.0
    ).sum(-1)
    qm = query_mask[:, None, :].expand(B, H, T)
    return kl[qm].sum(), qm.sum()


def layer_kls(
    model: Decoder,
    full_inputs: dict[int, LayerInput],
    comp_inputs: dict[int, LayerInput],
    segments: dict[int, KVSegment],
    split: torch.Tensor,
    query_mask: torch.Tensor,
) -> Iterator[tuple[float, int]]:
    """(KL sum, count) of :func:`attention_kl_layer` for every captured layer.

    Args:
        full_inputs, comp_inputs: :attr:`AttentionInputs.inputs` of the two forwards.
        segments: the compressed forward's segments
            (:attr:`~unicache_train.seam.RecordingCompressor.segments`).
        split: [B]; query_mask: [B, T] bool.
    """
    for layer_idx, comp_in in comp_inputs.items():
        kl, n = attention_kl_layer(
            model.layers[layer_idx].self_attn,
            full_inputs[layer_idx],
            comp_in,
            segments[layer_idx],
            split,
            query_mask,
        )
        yield float(kl), int(n)
