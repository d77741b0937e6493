"""Residual -> (m)HC swap: retrofit a trained plain-residual decoder without changing its function.

Shape legend: B, T, n, C = batch, tokens, residual streams (``hc_mult``), hidden size.

:func:`convert_to_mhc` builds the same decoder with ``n`` residual streams, copies every weight,
and initialises the new connection modules with ``hc_init="identity"`` (see
:class:`~unicache_train.model.mhc.HyperConnection`): all scales 0 (coefficients independent of
the input), ``pre = 1/n``, ``post = 1``, ``res`` uniform ``1/n`` (mHC) or ``I`` (HC), head
``pre = 1/n`` (``deepseek_v4``: up to a factor ``1 - O(L eps)`` carried by the streams, see
"Exactness" below).

Why the converted model computes the source's function (induction over sub-layers):

* Entry: the embeddings enter as ``n`` copies, so every stream equals the residual ``h_0``.
* Step: if ``X_i = h`` for all ``i`` (``h`` the plain model's residual at that point), then
  ``u = sum_i pre_i X_i = (sum_i pre_i) h = h``, so the branch sees exactly the plain model's
  input and returns ``f = F(h)``; stream ``i`` becomes
  ``post_i f + sum_j res[i, j] X_j = f + (sum_j res[i, j]) h = h + F(h)``, because every row of
  ``res`` sums to 1 (doubly stochastic, or ``I`` for HC). All streams again equal the plain
  model's next residual.
* Exit: the head collapses with ``pre = 1/n``: ``sum_i h / n = h``, then the same final norm and
  LM head.

Exactness (measured on SmolLM2-135M, 30 layers, logits up to 37,
``experiments/smollm2_mhc/smollm2_mhc_retrofit.py``): ``post = 2 sigmoid(b_post)`` and
``deepseek_v4``'s
``pre = sigmoid(b_pre) + eps`` take any value through their biases, but no bias reaches a row sum
of 1 for ``deepseek_v4``'s ``res``: its Sinkhorn divides by ``sum + eps`` to the last
normalization, so the rows of any ``res`` sum to ``s / (s + eps) < 1`` (``r = 1 - 2^-20`` in fp32
for the uniform one, eps = 1e-6). With ``post = 1`` every sub-layer then carried the residual
times ``r``, discounting early contributions against late ones by up to ``r^(2L)``: SmolLM2's
last residual was off by 2.5e-4 relative and its logits by 4e-3 (the same in fp64, and 0 in fp32
with ``hc_eps = 0``, so it is this term and not rounding). The conversion therefore lets the
streams carry the deficit: entering sub-layer ``k`` as ``c_k h`` (``c_0 = 1``), the connection
gets ``sum(pre) = 1 / c_k`` and ``post = c_{k+1} = r c_k``
(:meth:`~unicache_train.model.mhc.HyperConnection.init_identity`), and the head
``pre = 1 / (n c_{2L})``. Each branch then sees exactly the plain residual and the head returns
it: what is left is fp32 rounding of the biases and of the ``n``-term sums (SmolLM2, 5 prompts:
1.1e-4 on logits up to 37, against 9.3e-5 between the plain model in fp32 and in fp64; ``paper``
and HC, whose ``pre = 1/n``, ``post = 1`` and rows are exact in fp32, keep the streams bitwise
equal to the plain residual and differ by 1.3e-5 at the head). In fp64 the fp32-stored biases
and the fp32 ``r`` leave ~5e-8 per sub-layer (1.7e-4 on SmolLM2's logits).
``tests/test_mhc_retrofit.py`` bounds the fp32 error by twice the plain model's own.

Leaving the identity point: the equal streams give every stream the same gradient, so training
must break the symmetry through the scales (``d/ds = sum raw * dL/dz``, where ``raw`` differs per
stream thanks to the random ``fn``, inert while the scales are 0); ``fn`` gets gradients once
the scales are non-zero, and ``res`` once the streams differ (a uniform doubly-stochastic ``res``
acting on equal streams only matters through its row sums, which Sinkhorn pins to 1).
"""

from __future__ import annotations

import dataclasses

import torch

from unicache_train.model.config import HC_PRESETS, ModelConfig
from unicache_train.model.decoder import Decoder

__all__ = ["convert_to_mhc"]


def convert_to_mhc(
    model: Decoder,
    hc_mult: int = 4,
    preset: str = "deepseek_v4",
    *,
    residual_mode: str = "mhc",
) -> Decoder:
    """Return a copy of ``model`` with ``hc_mult`` residual streams computing the same function.

    Args:
        model: a plain-residual :class:`Decoder` (``residual_mode="residual"`` or ``hc_mult=1``).
        hc_mult: number of residual streams ``n``.
        preset: mHC preset, ``"deepseek_v4"`` or ``"paper"`` (ignored by ``residual_mode="hc"``).
        residual_mode: ``"mhc"`` (default) or ``"hc"`` (unconstrained, for comparisons).

    Returns:
        A new :class:`Decoder` on the source's device, in the source's dtype (connection
        parameters fp32), in the source's train/eval mode. The source is not modified. The
        new ``fn`` symmetry breakers draw from the global RNG: seed it for reproducibility.

    Raises:
        ValueError: the source already has several streams, or an argument is out of range.
    """
    src: ModelConfig = model.config
    if src.uses_streams:
        raise ValueError(
            f"convert_to_mhc: the source already uses residual_mode={src.residual_mode!r} with "
            f"hc_mult={src.hc_mult}; convert a plain residual model"
        )
    if residual_mode not in ("mhc", "hc"):
        raise ValueError(f"convert_to_mhc: residual_mode={residual_mode!r}; choose 'mhc' or 'hc'")
    if preset not in HC_PRESETS:
        raise ValueError(f"convert_to_mhc: preset={preset!r}; choose one of {list(HC_PRESETS)}")
    # dataclasses.replace re-runs ModelConfig validation (e.g. hc_mult range).
    config = dataclasses.replace(
        src, residual_mode=residual_mode, hc_mult=hc_mult, hc_preset=preset, hc_init="identity"
    )
    ref = model.embed_tokens.weight
    with torch.device(ref.device):
        new = Decoder(config)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    new_keys = {k for k in missing if _is_hc_param(k)}
    if unexpected or set(missing) != new_keys:
        raise RuntimeError(
            f"convert_to_mhc: state dicts do not line up (missing {sorted(set(missing) - new_keys)}"
            f", unexpected {sorted(unexpected)})"
        )
    # The identity point, exact for deepseek_v4's eps terms (module doc): chain the carries.
    carry = 1.0
    for layer in new.layers:
        for hc in (layer.attn_hc, layer.ffn_hc):
            carry = hc.init_identity(carry)
    new.hc_head.init_identity(carry)
    new.to(dtype=ref.dtype)  # connection parameters stay fp32 (HyperConnection._apply)
    return new.train(model.training)


def _is_hc_param(key: str) -> bool:
    return ".attn_hc." in key or ".ffn_hc." in key or key.startswith("hc_head.")
