"""Model surgery on an imported checkpoint: merging KV heads into groups (GQA with fewer KV
heads), with the output projections adjusted so that the merged model computes the same function
where the merged heads agree."""

from __future__ import annotations

import dataclasses

import torch

from unicache_train.checkpoint import serving
from unicache_train.checkpoint.hf_config import HFCheckpointError
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig


def merge_kv_heads(model: Decoder, groups: list[list[list[int]]]) -> Decoder:
    """A copy of ``model`` whose KV heads are merged: fewer ``num_key_value_heads``.

    ``groups[l]`` partitions layer ``l``'s KV heads into ``G`` groups (the same ``G`` for every
    layer); the K and V projection rows (and biases) of a group are averaged into one KV head.
    Query heads are re-ordered so that each merged KV head serves the queries of its members
    (the ``o_proj`` columns follow). Without ``qk_norm`` this is exact: K and V are linear in the
    input and RoPE is linear per position, so averaging the rows gives, at every token, the
    average of the group's keys and values; the result is what our model computes when each
    group's K/V are replaced by their average.

    With ``qk_norm`` (Qwen3) the keys attention sees are ``k_norm(k_proj(x))``, and RMSNorm is
    not linear: the average of RMS-normalised head keys generally has an RMS below one, so no
    K projection followed by ``k_norm`` produces it, and averaging the rows instead (what this
    function would do) gives ``k_norm(mean_h k_h)``, which is not ``mean_h k_norm(k_h)``.
    Exactness is therefore impossible in general, and such merges are refused; the one exact
    case, a group whose K projection rows (and biases) are identical, is accepted (its merged
    head is any member, unchanged). V is never normalised, so V rows may differ.

    Every group must hold the same number of KV heads (GQA needs equal query counts per KV
    head). Export the result with :func:`export_hf` like any GQA model.

    Args:
        model: a GQA :class:`Decoder` with ``H_kv`` KV heads of size ``D``.
        groups: ``[L][G][H_kv / G]`` KV head indices, a partition of ``range(H_kv)`` per layer.

    Returns:
        A new :class:`Decoder` with ``num_key_value_heads = G`` (train/eval mode as ``model``).

    Raises:
        HFCheckpointError: not GQA, groups that are not equal-sized partitions, or (under
            ``qk_norm``) a group whose K projections differ; the message names the layer, the
            group and the largest difference.
    """
    config: ModelConfig = model.config
    if config.attention_type != "gqa":
        raise HFCheckpointError("merge_kv_heads: GQA models only")
    L, Hk, H, D = (
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.num_attention_heads,
        config.head_size,
    )
    if len(groups) != L:
        raise HFCheckpointError(f"merge_kv_heads: {len(groups)} layer groupings for {L} layers")
    G = len(groups[0])
    for li, layer_groups in enumerate(groups):
        flat = sorted(h for g in layer_groups for h in g)
        if len(layer_groups) != G:
            raise HFCheckpointError(
                f"merge_kv_heads: layer {li} has {len(layer_groups)} groups, layer 0 has {G}"
            )
        if flat != list(range(Hk)):
            raise HFCheckpointError(
                f"merge_kv_heads: layer {li} groups {layer_groups} are not a partition of "
                f"range({Hk})"
            )
        if len({len(g) for g in layer_groups}) != 1:
            raise HFCheckpointError(
                f"merge_kv_heads: layer {li} groups {layer_groups} have unequal sizes"
            )
    if config.qk_norm:
        _check_mergeable_under_qk_norm(model, groups)
    new_config = dataclasses.replace(config, num_key_value_heads=G)
    new = Decoder(new_config).to(model.embed_tokens.weight.dtype)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rep = H // Hk  # queries per source KV head
    for li, layer_groups in enumerate(groups):
        p = f"layers.{li}.self_attn."
        q_order = [h * rep + r for g in layer_groups for h in g for r in range(rep)]
        q_idx = torch.cat([torch.arange(q * D, (q + 1) * D) for q in q_order])
        sd[p + "q_proj.weight"] = sd[p + "q_proj.weight"][q_idx]
        if p + "q_proj.bias" in sd:
            sd[p + "q_proj.bias"] = sd[p + "q_proj.bias"][q_idx]
        sd[p + "o_proj.weight"] = sd[p + "o_proj.weight"][:, q_idx]
        for name in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
            if p + name not in sd:
                continue
            w = sd[p + name].view(Hk, D, *sd[p + name].shape[1:])  # [Hk, D, (C)]
            if config.qk_norm and name.startswith("k_proj"):
                # Identical rows (checked above): take one, as a mean of 3 may round.
                merged = [w[g[0]] for g in layer_groups]
            else:
                merged = [w[g].mean(0) for g in layer_groups]
            sd[p + name] = torch.stack(merged).flatten(0, 1)  # [G * D, (C)]
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    new.load_state_dict(sd, strict=not config.tie_word_embeddings)
    if hasattr(model, serving.SOURCE_ATTR):  # same vocabulary: the source's tokenizer still fits
        setattr(new, serving.SOURCE_ATTR, getattr(model, serving.SOURCE_ATTR))
    return new.train(model.training)


def _check_mergeable_under_qk_norm(model: Decoder, groups: list[list[list[int]]]) -> None:
    """Under ``qk_norm`` a merge is exact only when each group's K projections are identical
    (see :func:`merge_kv_heads`); raise naming the first group where they are not."""
    Hk, D = model.config.num_key_value_heads, model.config.head_size
    for li, layer_groups in enumerate(groups):
        attn = model.layers[li].self_attn
        parts = [attn.k_proj.weight.detach().view(Hk, D, -1)]  # [Hk, D, C]
        if attn.k_proj.bias is not None:
            parts.append(attn.k_proj.bias.detach().view(Hk, D, 1))  # [Hk, D, 1]
        rows = torch.cat(parts, dim=-1)  # [Hk, D, C (+1)]
        for g in layer_groups:
            gap = float((rows[g] - rows[g[0]]).abs().max())
            if gap > 0:
                raise HFCheckpointError(
                    f"merge_kv_heads: layer {li} group {g} has K projections that differ (max "
                    f"|difference| {gap:.3g}) under qk_norm=True: keys are RMS-normalised per "
                    "head, and the average of normalised keys is not the normalised key of any "
                    "merged projection, so the merge cannot be exact; merge only heads with "
                    "identical K projections, or a model without qk_norm"
                )
