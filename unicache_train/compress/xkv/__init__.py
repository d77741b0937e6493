"""xKV: cross-layer SVD compression of the KV cache.

Chang et al., "xKV: Cross-Layer SVD for KV-Cache Compression" (arXiv 2503.18893);
docs/architecture.md#xkv. Observation: the dominant singular vectors of adjacent layers' KV
caches are aligned (see :mod:`unicache_train.compress.xkv.alignment`), so one token-side basis
serves a group of layers.

Shape legend: B, T, S, M, G, Hk, D, W, r = batch, tokens of a forward, prefilled tokens
(``max(split)``), segment entries, layers in a group, KV heads, head dim, concatenated width
(``G * Hk * D``), rank.

Per group of G contiguous layers, per sample, separately for keys (pre-RoPE) and values::

    X = [X_l0 ‖ X_l1 ‖ ...]          [M, W]   context rows of the group's layers, side by side
    X ≈ U_r Σ_r V_rᵀ                           fp32, V_r detached (the basis; XKVConfig.
                                               factorization: Gram eigh, SVD, randomized)
    A   = X V_r          = U_r Σ_r   [M, r]   token-side factor, shared by the group
    B_l = V_r[rows of l]ᵀ            [r, Hk*D] per-layer factor
    X̂_l = A B_l                               reconstruction on demand (RoPE after it)

    stored: r (M + W) elements instead of M W (``LowRankKV.nbytes``; the owner layer counts A)

Rank: ``rank_fraction`` of W, an ``energy`` threshold, or the largest rank within
``1 / reduction`` of the uncompressed 16-bit cache counting both factors (:func:`select_rank`).

**Why two passes.** The seam calls the compressor layer by layer, but a group's SVD needs all
of its layers' context K/V. Context rows never depend on the compressed cache, so the decoder
(:meth:`unicache_train.model.Decoder.forward`) first runs a recording pass over the context
(the plain causal computation, exactly inference's prefill), hands what it recorded to
:meth:`XKVCompressor.fit` (pure: no model access), then runs the compressed pass, where each
layer's input carries the fit and the compressor serves that layer's reconstruction::

    recording   decoder stack on [:S] with a recording compressor ─► per layer: context K
                (pre-RoPE), V;  per group: SVD (no grad) ─► basis V_r;  A = X V_r (grad via X)
    compressed  decoder stack on [:T], inp.fit = the fit ─► layer l: segment = X̂_l (RoPE
                applied by the seam); the continuation attends to it, as decoding does

Gradients flow through the projection onto the detached basis (the SVD itself is never
differentiated: its backward is ill-conditioned at close singular values). ``gradient="exact"``
records with gradients, so the loss reaches every group member's K/V through every
reconstruction (the recording pass costs one more prefill forward and backward).
``gradient="causal"`` records without gradient; layer l's reconstruction then uses the
compressed pass's own K/V of the group's layers up to l and the recorded (constant) K/V of the
later ones: the same numbers, a gradient without the paths into later group members, and the
recording pass is free when the KL term's uncompressed forward doubles as it (the decoder then
records the whole sequence and returns its logits as ``DecoderOutput.reference_logits``).

**With UniCache token compression** (``token_compressor``): tokens first, then cross-layer SVD on
the kept entries. The SVD needs the same rows in every layer of a group, so the token plan is
decided once per group: UniCache runs on a virtual layer whose KV heads are all the group's
heads (importance, redundancy, merging over the whole group; rate of the group's middle layer),
then the kept and merged entries of each layer are factorised. SVD first would not pay: a
token dropped by one layer but kept by another still costs its row of A. Head merging and
quantization of the UniCache part must be off (the SVD already removes cross-head redundancy;
factors are stored in 16 bit). Needs ``gradient="exact"``; GQA models only.

**With MLA** the seam hands over the latent cache ``[c_kv ‖ k_pe]`` as one head: xKV factorises
the latents of the group's layers jointly (MLA first, then cross-layer sharing, as the source
says) and the values (``c_kv``) are read back from the reconstructed keys, stored once.

Modules: :mod:`~unicache_train.compress.xkv.factor` (the pure factorisation functions),
:mod:`~unicache_train.compress.xkv.fit` (every group's factors from the recorded context),
:mod:`~unicache_train.compress.xkv.compressor` (:class:`XKVCompressor`: the fit, the serving),
:mod:`~unicache_train.compress.xkv.alignment` (the cross-layer alignment measures).
"""

from unicache_train.compress.xkv.compressor import XKVCompressor
from unicache_train.compress.xkv.factor import (
    flatten_heads,
    gram_basis,
    layer_groups,
    lowrank_basis,
    pooled_svd_basis,
    select_rank,
    svd_basis,
)
from unicache_train.compress.xkv.fit import XKVFit, fit_context

__all__ = [
    "XKVCompressor",
    "XKVFit",
    "fit_context",
    "layer_groups",
    "select_rank",
    "svd_basis",
    "gram_basis",
    "lowrank_basis",
    "pooled_svd_basis",
    "flatten_heads",
]
