"""Rotary position embeddings (RoFormer, arXiv 2104.09864), rotate-half layout as in HF Llama,
with the RoPE scaling types of transformers' ``rope_parameters`` (numerics as its
``modeling_rope_utils``, tested to 1e-5 on logits in ``tests/test_rope_scaling.py``).

Shape legend: B, T, D, F = batch, tokens, rotary dim, ``D / 2`` frequencies; ``L0`` =
``max_position_embeddings``, ``L0'`` = ``original_max_position_embeddings`` (default ``L0``),
``f`` = ``factor``, ``θ`` = ``rope_theta``, ``ω_i = θ^(-2i/D)`` the default frequencies.

=========  ===================================================================  ==============
rope_type  inverse frequencies [F]                                              attention a
=========  ===================================================================  ==============
default    ``ω_i``                                                              1
linear     ``ω_i / f`` (position interpolation, arXiv 2306.15595)               1
dynamic    ``ω_i`` while ``L <= L0``, else ``θ' ^ (-2i/D)`` with                1
           ``θ' = θ (f L / L0 - (f - 1)) ^ (D / (D - 2))``, ``L`` = the
           forward's largest position + 1 (NTK-aware, transformers' ``dynamic``)
llama3     wavelength ``λ_i = 2π / ω_i``: ``ω_i`` if ``λ_i < L0' / high``,      1
           ``ω_i / f`` if ``λ_i > L0' / low``, else the smooth mix
           ``(1 - s) ω_i / f + s ω_i``, ``s = (L0' / λ_i - low) / (high - low)``
yarn       ``ω_i / f`` and ``ω_i`` mixed by a linear ramp over the dimensions   ``a`` (below)
           whose rotation count at ``L0'`` lies between ``beta_slow`` and
           ``beta_fast`` (YaRN, arXiv 2309.00071)
=========  ===================================================================  ==============

YaRN's attention factor ``a`` is ``attention_factor`` if given, else
``m(f, mscale) / m(f, mscale_all_dim)`` when both are set (non-zero), else ``m(f)``, with
``m(f, s) = 0.1 s ln f + 1`` (1 for ``f <= 1``).

**Design: the tables carry ``a``**, as transformers and vLLM build them (cos and sin multiplied
by ``a``, so queries and keys both carry it and the RoPE part of every ``q·k`` grows by ``a²``).
Why not pure rotations with ``a²`` on the queries (the same logits): the cached keys would then
differ from the served model's by ``a``, and a compressor that is not scale-equivariant (UniCache's
quantisation, merging) would decide differently in training than in transformers serving (measured
1.5e-3 / 2.8e-2 logit gaps on int8 / int4+merge vs 1e-6 this way). Inverting a table is therefore
:func:`unicache_train.ops.rope.unapply_rope` (``(cos, -sin) / a²``), not ``(cos, -sin)``. An MLA
model (DeepSeek) also multiplies its softmax scale by :func:`mla_softmax_mscale`,
``m(f, mscale_all_dim)²``, as transformers' ``DeepseekV3Attention``.

**dynamic and the KV cache.** transformers recomputes the frequencies in every forward from the
largest position it sees, so during cached decoding each new token's query and key use the
frequencies of the length reached so far, while cached keys keep those of the forward that wrote
them. We compute the frequencies per forward the same way (on the device, without a host sync),
so cached decoding matches transformers' cached decoding step by step; a full forward at the
final length is a different computation (every key rotated with the final frequencies) once the
length passes ``L0``. One difference: transformers keeps the longest length it has seen
(a shorter forward above ``L0`` reuses it); ours is a function of each forward's positions.
A consumer that rotates a subset of positions later (xKV's fit) gets that subset's frequencies:
identical to the forward's while sequences stay within ``L0``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from unicache_train.model.config import RopeScalingConfig

# NOTE: the rotation itself is a pure function in ops, so that compressors (pre-RoPE keys) use
# it without importing the model; attention imports it from here beside the tables.
from unicache_train.ops.rope import apply_rope, rotate_half

__all__ = [
    "RotaryEmbedding",
    "apply_rope",
    "rotate_half",
    "inv_frequencies",
    "attention_factor",
    "mla_softmax_mscale",
]


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 mscale ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScalingConfig) -> float:
    """YaRN's attention factor ``a`` (1 for every other rope type); see the module table."""
    if scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:  # transformers tests their truth values
        return _mscale(scaling.factor, scaling.mscale) / _mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return _mscale(scaling.factor)


def mla_softmax_mscale(scaling: RopeScalingConfig) -> float:
    """DeepSeek's softmax-scale multiplier ``m(f, mscale_all_dim)²`` for MLA (1 when unset).

    transformers' ``DeepseekV3Attention`` applies it for any non-default ``rope_type`` with a
    non-zero ``mscale_all_dim``; our config lets only ``yarn`` carry ``mscale_all_dim``.
    """
    if scaling.rope_type == "default" or not scaling.mscale_all_dim:
        return 1.0
    return _mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def _default_inv_freq(dim: int, theta: float | torch.Tensor, device=None) -> torch.Tensor:
    """``θ^(-2i/D)`` [F] in fp32 (transformers' op order: int64 arange, cast, divide)."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta**exponent)


def _yarn_inv_freq(
    dim: int, theta: float, scaling: RopeScalingConfig, original_max: int
) -> torch.Tensor:
    """YaRN's frequencies [F]: interpolation ``ω / f`` below the ramp, extrapolation ``ω`` above."""

    def correction_dim(rotations: float) -> float:
        # The dimension whose frequency turns `rotations` times over the original context.
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp (transformers' guard against division by zero)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)  # [F]
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (fast dims keep ω), 0: interpolate (slow dims get ω / f)
    return interpolation * (1 - keep) + extrapolation * keep


def _llama3_inv_freq(
    dim: int, theta: float, scaling: RopeScalingConfig, original_max: int
) -> torch.Tensor:
    """Llama 3.1's frequencies [F]: high band kept, low band / factor, smooth mix between."""
    inv_freq = _default_inv_freq(dim, theta)
    f, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    low_freq_wavelen, high_freq_wavelen = original_max / low, original_max / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / f, inv_freq)
    smooth = (original_max / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / f + smooth * out
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, out)


def inv_frequencies(
    dim: int,
    theta: float,
    scaling: RopeScalingConfig | None = None,
    max_position_embeddings: int | None = None,
) -> torch.Tensor:
    """The static inverse frequencies [F] (fp32) of a RoPE table.

    ``dynamic`` returns its frequencies up to ``max_position_embeddings`` (the default ones);
    :class:`RotaryEmbedding` rescales them per forward beyond.

    Args:
        dim: D, the rotary dim (even).
        theta: ``rope_theta``.
        scaling: the scaling config (None: default RoPE).
        max_position_embeddings: L0; needed by ``llama3``/``yarn`` when
            ``original_max_position_embeddings`` is None.
    """
    scaling = scaling or RopeScalingConfig()
    kind = scaling.rope_type
    original_max = scaling.original_max_position_embeddings or max_position_embeddings
    if kind in ("llama3", "yarn") and original_max is None:
        raise ValueError(
            f"rope_type={kind!r} needs original_max_position_embeddings or max_position_embeddings"
        )
    if kind == "linear":
        return _default_inv_freq(dim, theta) / scaling.factor
    if kind == "llama3":
        return _llama3_inv_freq(dim, theta, scaling, original_max)
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, original_max)
    return _default_inv_freq(dim, theta)  # default, and dynamic within L0


class RotaryEmbedding(nn.Module):
    """Produces cos/sin tables for integer positions: ``a R`` with ``a`` = YaRN's attention
    factor (:attr:`attention_scaling`, 1 for the other types), as transformers' tables.

    Positions are explicit (``[B, T]``) because compressed caches keep each token's ORIGINAL
    position: a kept or merged context token is rotated where it stood in the input.

    Args:
        dim: D, the rotary dim (head dim; ``qk_rope_head_dim`` for MLA).
        theta: ``rope_theta``.
        scaling: RoPE scaling (None: default RoPE).
        max_position_embeddings: L0 (``dynamic`` scales beyond it; ``llama3``/``yarn`` default
            their original context to it).
    """

    def __init__(
        self,
        dim: int,
        theta: float = 10000.0,
        scaling: RopeScalingConfig | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.theta = dim, float(theta)
        self.scaling = scaling or RopeScalingConfig()
        if self.scaling.rope_type == "dynamic" and max_position_embeddings is None:
            raise ValueError("rope_type='dynamic' needs max_position_embeddings")
        self.max_position_embeddings = max_position_embeddings
        self.attention_scaling = attention_factor(self.scaling)
        inv_freq = inv_frequencies(dim, theta, self.scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """[F] NTK frequencies for L = max(positions) + 1 (the default ones while L <= L0);
        fp32 in transformers' op order, computed on the device (no host sync)."""
        L0, f = self.max_position_embeddings, self.scaling.factor
        length = positions.max() + 1  # 0-dim long tensor
        grown = torch.maximum(length, torch.tensor(L0, dtype=length.dtype, device=length.device))
        base = self.theta * ((f * grown / L0) - (f - 1)) ** (self.dim / (self.dim - 2))
        scaled = _default_inv_freq(self.dim, base, positions.device)
        return torch.where(length > L0, scaled, self.inv_freq)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [B, T] -> (cos, sin), each [B, T, D] (times :attr:`attention_scaling`)."""
        inv_freq = self.inv_freq
        if self.scaling.rope_type == "dynamic" and positions.numel():
            inv_freq = self._dynamic_inv_freq(positions)
        freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # YaRN: in fp32 before the cast, as transformers
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
