"""Import and export HF transformers checkpoints: Llama, Qwen2, Qwen3, Mistral, Gemma 3 (text)
(+ our mHC format).

A checkpoint directory is ``config.json`` plus safetensors (``model.safetensors``, or shards listed
in ``model.safetensors.index.json``). Our parameter names are HF's without the ``model.`` prefix
(``layers.{i}.self_attn.q_proj.weight``, ``embed_tokens.weight``, ...), so the state-dict maps are
near-identity; the work is in checking that the checkpoint means what our decoder computes.

Family differences we map (transformers 5 modeling files):

============  ===========================  ==============================================
family        attention biases             other
============  ===========================  ==============================================
llama         q/k/v/o iff attention_bias   ``mlp_bias`` must be False
qwen2         q/k/v always, o never        ``use_sliding_window``: per-layer ``layer_types``
qwen3         q/k/v/o iff attention_bias   per-head ``q_norm``/``k_norm``; explicit head_dim
mistral       none                         ``sliding_window`` on every layer (null: off)
gemma3_text   q/k/v/o iff attention_bias   (1 + w) norms, 4 per layer, GeGLU, scaled
                                           embeddings, ``query_pre_attn_scalar``, local
                                           layers' RoPE base, softcaps, ``layer_types``
============  ===========================  ==============================================

Sliding windows import into ``ModelConfig.sliding_window`` / ``layer_types`` (a Mistral window
``>= max_position_embeddings`` never binds and imports as none).

Our ``attention_bias`` is q/k/v only, so an imported ``o_proj.bias`` is refused unless it is all
zeros, and export writes zero ``o_proj`` biases (and zero q/k/v biases for Qwen2 when our model
has none): exact, not approximate.

RoPE scaling (``rope_parameters`` / legacy ``rope_scaling``): ``default``, ``linear``, ``dynamic``,
``llama3`` and ``yarn`` import into
:class:`~unicache_train.model.config.RopeScalingConfig` and export
back (:func:`rope_from_hf`, :func:`rope_to_hf`); defaults are resolved as transformers does
(``original_max_position_embeddings``: the top-level field, else the rope dict's, else
``max_position_embeddings``; a YaRN ``factor`` of null: their ratio). Export writes the rope dict
as ``rope_parameters`` and, for a scaled model, also as the legacy ``rope_scaling`` (older
transformers and vLLM read that one).

Anything we cannot represent raises :class:`HFCheckpointError` naming the field or tensor:
unknown ``model_type``/architecture, other RoPE types (``longrope``, ...), partial rotary,
Gemma's bidirectional attention, activations other than the family's, missing / unexpected /
mis-shaped tensors, tensors that are not floating point (integer or quantised weights would be
silently cast), tensors holding NaN or Inf, and
unreadable (truncated or corrupted) safetensors files. Nothing is loaded partially: every tensor
is read and checked before the model is built.

mHC models (``residual_mode="mhc"``, preset ``deepseek_v4``) export to our own HF format:
``model_type = "unicache_mhc"`` with ``configuration_unicache_mhc.py`` and
``modeling_unicache_mhc.py`` copied next to the weights and an ``auto_map``, loaded with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``. Tensor names are ours with
the ``model.`` prefix (``model.layers.{i}.attn_hc.fn``, ``model.hc_head.hc_fn``).

``compression_config.json`` (written when a compression policy is passed) is::

    {"schema_version": 1,            # bump on incompatible changes
     "format": "unicache_compression",
     "library": "unicache_train",
     "policy": {...}}                # the caller's dict, verbatim (JSON-serialisable)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from unicache_train.checkpoint import serving
from unicache_train.checkpoint.integrity import verify, write_manifest
from unicache_train.checkpoint.policy import (  # noqa: F401  (re-exported)
    COMPRESSION_CONFIG,
    COMPRESSION_SCHEMA_VERSION,
    write_compression_config,
)
from unicache_train.model import Decoder
from unicache_train.model.config import ROPE_TYPE_FIELDS, ROPE_TYPES, ModelConfig, RopeScalingConfig
from unicache_train.preflight import available_memory, check_model_fits
from unicache_train.validation import ConfigError

__all__ = [
    "FAMILIES",
    "COMPRESSION_SCHEMA_VERSION",
    "HFCheckpointError",
    "from_hf_config",
    "to_hf_config",
    "rope_from_hf",
    "rope_to_hf",
    "from_hf_state_dict",
    "to_hf_state_dict",
    "load_safetensors_dir",
    "WEIGHT_DTYPES",
    "check_weight",
    "import_hf",
    "export_hf",
    "merge_kv_heads",
]

# model_type -> the CausalLM architecture name transformers registers for it.
FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
MHC_MODEL_TYPE = "unicache_mhc"
MHC_ARCHITECTURE = "UnicacheMhcForCausalLM"
_REMOTE_CODE = Path(__file__).parent / "remote_code"
# Buffers some older checkpoints carry; recomputed by us, never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Dtypes a weight may be stored in. Integer and fp8 tensors are quantised weights (they need
# scales we do not read); casting them to float would give a model that silently computes garbage.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Elements scanned at a time for NaN/Inf: bounds the temporary boolean mask on large embeddings.
_FINITE_CHUNK = 1 << 24


class HFCheckpointError(ValueError):
    """The checkpoint (or model) has a feature the target format or our decoder lacks."""


# ------------------------------------------------------------------------------------ config
def _rope(hf: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """(rope_type, rope_theta, params) from v5 ``rope_parameters`` or legacy ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return rope_type or "default", float(theta), {**legacy, **params}


def rope_from_hf(
    hf: dict[str, Any], error: type[ValueError] = HFCheckpointError
) -> tuple[float, RopeScalingConfig]:
    """(``rope_theta``, :class:`RopeScalingConfig`) from an HF ``config.json`` dict.

    Reads only the keys the ``rope_type`` uses (transformers ignores the others, with a
    warning) and resolves defaults as transformers does: ``original_max_position_embeddings``
    from the top level (transformers gives it priority), else the rope dict, else
    ``max_position_embeddings``; a YaRN ``factor`` of null is their ratio; YaRN's ``beta_fast`` /
    ``beta_slow`` of null or 0 are 32 / 1.

    Args:
        hf: the ``config.json`` dict (v5 ``rope_parameters`` or legacy ``rope_scaling``).
        error: the exception class to raise (the DeepseekV3 importer passes its own).

    Raises:
        error: a ``rope_type`` we do not compute, a missing required key, or a value
            :class:`RopeScalingConfig` refuses (the message names the key and value).
    """
    rope_type, theta, params = _rope(hf)
    if rope_type not in ROPE_TYPES:
        raise error(
            f"config.json rope_parameters.rope_type={rope_type!r} is not implemented; "
            f"supported: {list(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, RopeScalingConfig()
    used = ROPE_TYPE_FIELDS[rope_type]
    kw: dict[str, Any] = {k: params[k] for k in used if params.get(k) is not None}
    max_pos = int(hf.get("max_position_embeddings", 4096))
    if "original_max_position_embeddings" in used:
        original = hf.get("original_max_position_embeddings")
        if original is None:
            original = params.get("original_max_position_embeddings") or max_pos
        kw["original_max_position_embeddings"] = int(original)
    if rope_type == "yarn":
        if kw.get("factor") is None:
            kw["factor"] = max_pos / kw["original_max_position_embeddings"]
        kw["beta_fast"] = params.get("beta_fast") or 32.0
        kw["beta_slow"] = params.get("beta_slow") or 1.0
    required = ["factor"] + (["low_freq_factor", "high_freq_factor"] * (rope_type == "llama3"))
    missing = [k for k in required if k not in kw]
    if missing:
        raise error(
            f"config.json rope_parameters (rope_type={rope_type!r}) lacks {missing}; "
            f"{rope_type} reads {list(used)}"
        )
    for k in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim", "attention_factor"):
        if isinstance(kw.get(k), int) and not isinstance(kw[k], bool):
            kw[k] = float(kw[k])  # JSON writes 8.0 as 8 sometimes; our fields are floats
    try:
        return theta, RopeScalingConfig(rope_type=rope_type, **kw)
    except ConfigError as err:
        raise error(f"config.json rope_parameters is not representable: {err}") from err


def rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Our RoPE fields -> the HF ``rope_parameters`` dict (``rope_type``, ``rope_theta`` and the
    keys that type reads; ``original_max_position_embeddings`` resolved, ``truncate`` written
    only when False, its transformers default being True)."""
    scaling = config.rope_scaling
    out: dict[str, Any] = {"rope_type": scaling.rope_type, "rope_theta": float(config.rope_theta)}
    for name in ROPE_TYPE_FIELDS[scaling.rope_type]:
        value = getattr(scaling, name)
        if name == "original_max_position_embeddings" and value is None:
            value = config.max_position_embeddings
        if value is None or (name == "truncate" and value):
            continue
        out[name] = value
    return out


def from_hf_config(hf: dict[str, Any]) -> tuple[ModelConfig, str]:
    """An HF ``config.json`` dict -> (our :class:`ModelConfig`, family).

    Raises:
        HFCheckpointError: unknown family, an option our decoder does not implement, or a size
            field that is missing or not a whole number (named, with its value).
    """
    _check_size_fields(hf)
    model_type = hf.get("model_type")
    if model_type == MHC_MODEL_TYPE:
        return _from_mhc_config(hf), MHC_MODEL_TYPE
    if model_type not in FAMILIES:
        raise HFCheckpointError(
            f"config.json model_type={model_type!r} is not supported; supported: "
            f"{sorted(FAMILIES)} (and {MHC_MODEL_TYPE!r}, our mHC export)"
        )
    archs = hf.get("architectures") or [FAMILIES[model_type]]
    if FAMILIES[model_type] not in archs:
        raise HFCheckpointError(
            f"config.json architectures={archs!r}: expected {FAMILIES[model_type]!r} for "
            f"model_type={model_type!r} (only causal-LM checkpoints can be imported)"
        )
    if model_type == "gemma3_text":
        return _from_gemma3_config(hf), model_type
    _check_common(hf)
    bias = bool(hf.get("attention_bias", False))
    if model_type == "qwen2":
        bias = True  # Qwen2 has q/k/v biases whatever the config says (and no o_proj bias).
    elif model_type == "mistral":
        bias = False
    if model_type == "llama" and hf.get("mlp_bias", False):
        raise HFCheckpointError("config.json mlp_bias=True: our SwiGLU MLP has no biases")
    window: dict[str, Any] = {}
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window", False):
        # transformers: sliding_window only with use_sliding_window; layer_types given, else
        # sliding from layer max_window_layers on.
        w = hf.get("sliding_window")
        L = int(hf["num_hidden_layers"])
        if w is not None:
            first = int(hf.get("max_window_layers", L))
            types = hf.get("layer_types") or [
                "sliding_attention" if i >= first else "full_attention" for i in range(L)
            ]
            window = {"sliding_window": int(w), "layer_types": list(types)}
    if model_type == "mistral":
        w = hf.get("sliding_window")
        if w is not None and int(w) < int(hf.get("max_position_embeddings", 4096)):
            window = {"sliding_window": int(w)}  # every layer (transformers' Mistral)
    return _model_config(hf, attention_bias=bias, qk_norm=model_type == "qwen3",
                         **window), model_type  # fmt: skip


_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings",
                   "sliding_window", "max_window_layers", "sliding_window_pattern")


def _check_size_fields(hf: Any) -> None:
    """Every size field of an HF config is a whole number (``1e9`` counts; ``"abc"``, ``2.5``,
    ``[1]`` do not) and the required ones are present; else one line naming the field."""
    if not isinstance(hf, dict):
        raise HFCheckpointError(f"config.json: expected a JSON object, got {type(hf).__name__}")
    for name in _REQUIRED_SIZES + _OPTIONAL_SIZES:
        if name not in hf or (hf[name] is None and name in _OPTIONAL_SIZES):
            if name in _REQUIRED_SIZES and hf.get("model_type") != "deepseek_v3":
                raise HFCheckpointError(f"config.json lacks the required field {name!r}")
            continue
        value = hf[name]
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        least = 1 if name in _REQUIRED_SIZES else 0
        if isinstance(value, bool) or not whole or value < least:
            raise HFCheckpointError(
                f"config.json {name}={value!r}: expected a whole number >= {least}"
            )
    # NOTE: before anything sized by these fields is built (a per-layer list of 1e9 entries
    # hangs as surely as the weights would): every layer holds at least a C x C query projection.
    L, C = int(hf.get("num_hidden_layers") or 0), int(hf.get("hidden_size") or 0)
    if L * C * C * 4 > available_memory():
        raise HFCheckpointError(
            f"config.json num_hidden_layers={L}, hidden_size={C}: at least {L * C * C:.3g} "
            f"parameters ({L * C * C * 4 / 2**30:,.1f} GiB in fp32), more than the "
            f"{available_memory() / 2**30:,.1f} GiB of memory available"
        )


def _from_gemma3_config(hf: dict[str, Any]) -> ModelConfig:
    """A ``gemma3_text`` config (v5 per-layer-type ``rope_parameters`` or the legacy
    ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``) -> our Gemma 3 config."""
    if hf.get("use_bidirectional_attention"):
        raise HFCheckpointError(
            "config.json use_bidirectional_attention=True: only causal Gemma 3 is implemented"
        )
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise HFCheckpointError(
            f"config.json hidden_activation={act!r}: only 'gelu_pytorch_tanh' (Gemma's GeGLU)"
        )
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {"rope_type": "default"})
        local = dict(params.get("sliding_attention") or {"rope_type": "default"})
        full.setdefault("rope_theta", 1_000_000.0)
        local.setdefault("rope_theta", 10_000.0)
        legacy = {}
    else:  # legacy keys (GGUF conversions, older configs)
        full = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 1_000_000.0)}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
        legacy = {"rope_scaling": hf.get("rope_scaling")}
    if (local.get("rope_type") or "default") != "default":
        raise HFCheckpointError(
            f"config.json rope_parameters.sliding_attention={local!r}: only the default RoPE is "
            "implemented on Gemma 3's sliding layers"
        )
    flat = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    flat.update(rope_parameters=full, **legacy)
    _check_common({**flat, "hidden_act": "silu"})  # rope and partial rotary checks
    L = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern") or 6)
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)
    ]
    window = hf.get("sliding_window")
    if window is None:
        types = ["full_attention"] * L
    return _model_config(
        {**flat, "tie_word_embeddings": hf.get("tie_word_embeddings", True),
         "max_position_embeddings": hf.get("max_position_embeddings", 131_072)},
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        block_style="gemma3",
        sliding_window=None if window is None else int(window),
        layer_types=list(types),
        rope_local_theta=float(local["rope_theta"]),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        # NOTE: transformers' Gemma3Attention never passes attn_logit_softcapping to its
        # attention (only Gemma 2 does): the served model computes without it, and so do we.
        final_logit_softcapping=_opt_float(hf.get("final_logit_softcapping")),
    )


def _pre_attn_scalar(config: ModelConfig) -> int:
    """Gemma 3's ``query_pre_attn_scalar`` (an int in transformers' config; ours: None means
    head_dim, the same scale)."""
    value = config.query_pre_attn_scalar
    if value is None:
        return config.head_size
    if not float(value).is_integer():
        raise HFCheckpointError(
            f"ModelConfig.query_pre_attn_scalar={value}: gemma3_text stores an integer"
        )
    return int(value)


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


def _check_common(hf: dict[str, Any]) -> None:
    _, _, params = _rope(hf)
    rope_from_hf(hf)  # raises on a rope type or rope key we cannot represent
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFCheckpointError(
            f"config.json partial_rotary_factor={partial}: only full-head RoPE is implemented"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFCheckpointError(f"config.json hidden_act={act!r}: only 'silu' (SwiGLU)")


def _model_config(hf: dict[str, Any], **extra: Any) -> ModelConfig:
    theta, rope_scaling = rope_from_hf(hf)
    H = int(hf["num_attention_heads"])
    C = int(hf["hidden_size"])
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) == C // H and C % H == 0:
        head_dim = None  # derived: keep it derived so that a resized model re-derives it
    try:
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=C,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=H,
            num_key_value_heads=int(hf.get("num_key_value_heads") or H),
            head_dim=None if head_dim is None else int(head_dim),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            **extra,
        )
    except KeyError as err:
        raise HFCheckpointError(f"config.json lacks the required field {err.args[0]!r}") from err
    except ConfigError as err:
        raise HFCheckpointError(f"config.json is not representable: {err}") from err


def _from_mhc_config(hf: dict[str, Any]) -> ModelConfig:
    _check_common(hf)
    # MoE FFN fields (absent in dense exports: n_routed_experts = 0).
    moe = {k: hf[k] for k in _MHC_MOE_FIELDS if k in hf and hf.get("n_routed_experts")}
    return _model_config(
        hf,
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=bool(hf.get("qk_norm", False)),
        residual_mode="mhc",
        hc_preset="deepseek_v4",
        hc_mult=int(hf["hc_mult"]),
        hc_sinkhorn_iters=int(hf["hc_sinkhorn_iters"]),
        hc_eps=float(hf["hc_eps"]),
        **moe,
    )


# ModelConfig's MoE fields our mHC format writes to config.json (same names, as DeepseekV3).
_MHC_MOE_FIELDS = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                   "moe_intermediate_size", "first_k_dense_replace", "n_group", "topk_group",
                   "norm_topk_prob", "routed_scaling_factor")  # fmt: skip


def _mhc_moe_config(config: ModelConfig) -> dict[str, Any]:
    """The MoE fields of an mHC export (none for a dense model); expert width resolved."""
    if not config.uses_moe:
        return {}
    out = {k: getattr(config, k) for k in _MHC_MOE_FIELDS}
    out["moe_intermediate_size"] = config.expert_intermediate_size
    return out


def _check_family(config: ModelConfig, family: str) -> None:
    if config.attention_type != "gqa":
        raise HFCheckpointError(
            f"ModelConfig.attention_type={config.attention_type!r}: MLA models export with "
            "unicache_train.checkpoint.deepseek_v3.export_deepseek_v3 (--format deepseek_v3)"
        )
    if config.uses_moe and not config.uses_streams:
        raise HFCheckpointError(
            f"ModelConfig.n_routed_experts={config.n_routed_experts}: family={family!r} has no "
            "DeepSeek MoE FFN; an MoE model exports as deepseek_v3 (MLA attention) or, with "
            "mHC streams, as our unicache_mhc format"
        )
    if config.uses_streams:
        if config.has_sliding_layers:
            raise HFCheckpointError(
                f"ModelConfig.sliding_window={config.sliding_window}: our mHC remote code has no "
                "sliding-window attention; an mHC model exports with full attention only"
            )
        if config.residual_mode != "mhc" or config.hc_preset != "deepseek_v4":
            raise HFCheckpointError(
                f"ModelConfig.residual_mode={config.residual_mode!r}, hc_preset="
                f"{config.hc_preset!r}: only mHC with the 'deepseek_v4' preset has an HF format"
            )
        return
    if family not in FAMILIES:
        raise HFCheckpointError(f"family={family!r}: choose one of {sorted(FAMILIES)}")
    gemma = family == "gemma3_text"
    if gemma and config.attn_logit_softcapping is not None:
        raise HFCheckpointError(
            f"ModelConfig.attn_logit_softcapping={config.attn_logit_softcapping}: transformers' "
            "Gemma3ForCausalLM ignores attn_logit_softcapping, so the export would compute "
            "without it; train without it (None) to export as gemma3_text"
        )
    if (config.block_style == "gemma3") != gemma:
        raise HFCheckpointError(
            f"ModelConfig.block_style={config.block_style!r} cannot be written as "
            f"family={family!r} (the Gemma 3 block exists in, and only in, gemma3_text)"
        )
    if not gemma and (config.rope_local_theta is not None or config.query_pre_attn_scalar
                      is not None or config.attn_logit_softcapping is not None
                      or config.final_logit_softcapping is not None):  # fmt: skip
        raise HFCheckpointError(
            f"family={family!r} has no rope_local_theta, query_pre_attn_scalar or softcapping "
            "(Gemma 3 options); export as 'gemma3_text'"
        )
    if config.qk_norm != (family in ("qwen3", "gemma3_text")):
        raise HFCheckpointError(
            f"ModelConfig.qk_norm={config.qk_norm} cannot be written as family={family!r} "
            "(q_norm/k_norm exist in, and only in, qwen3 and gemma3_text)"
        )
    sliding = [config.is_sliding_layer(i) for i in range(config.num_hidden_layers)]
    if any(sliding) and family == "llama":
        raise HFCheckpointError(
            f"ModelConfig.sliding_window={config.sliding_window}: llama has no sliding window; "
            "export as 'mistral' (every layer), 'qwen2'/'qwen3' or 'gemma3_text' (per layer)"
        )
    if any(sliding) and family == "mistral" and not all(sliding):
        raise HFCheckpointError(
            f"ModelConfig.layer_types={config.layer_types}: mistral slides every layer or none; "
            "export per-layer windows as 'qwen2'/'qwen3'"
        )
    if config.attention_bias and family == "mistral":
        raise HFCheckpointError(
            "ModelConfig.attention_bias=True: Mistral attention has no biases; export as "
            "'qwen2' (q/k/v biases) or 'llama'"
        )


def to_hf_config(
    config: ModelConfig,
    family: str = "llama",
    *,
    dtype: str = "float32",
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """Our :class:`ModelConfig` -> an HF ``config.json`` dict (``family`` ignored for mHC models,
    which always get our ``unicache_mhc`` remote-code format)."""
    _check_family(config, family)
    mhc = config.uses_streams
    model_type = MHC_MODEL_TYPE if mhc else family
    out: dict[str, Any] = {
        "architectures": [MHC_ARCHITECTURE if mhc else FAMILIES[family]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        # v5 reads rope_parameters; vLLM / older transformers read rope_theta (and rope_scaling).
        "rope_parameters": rope_to_hf(config),
        "rope_theta": float(config.rope_theta),
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": dtype,
    }
    if mhc:
        out.update(
            attention_bias=config.attention_bias,
            qk_norm=config.qk_norm,
            hc_mult=config.hc_mult,
            hc_sinkhorn_iters=config.hc_sinkhorn_iters,
            hc_eps=config.hc_eps,
            **_mhc_moe_config(config),
            auto_map={
                "AutoConfig": "configuration_unicache_mhc.UnicacheMhcConfig",
                "AutoModelForCausalLM": f"modeling_unicache_mhc.{MHC_ARCHITECTURE}",
            },
        )
    elif family in ("llama", "qwen3", "gemma3_text"):
        # NOTE: True also gives o_proj a bias in these families; export writes it as zeros.
        out["attention_bias"] = config.attention_bias
        if family == "llama":
            out["mlp_bias"] = False
    types = [
        "sliding_attention" if config.is_sliding_layer(i) else "full_attention"
        for i in range(config.num_hidden_layers)
    ]
    if family in ("qwen2", "qwen3") and not mhc:
        if config.has_sliding_layers:
            out.update(use_sliding_window=True, sliding_window=config.sliding_window,
                       max_window_layers=types.index("sliding_attention"), layer_types=types)
        else:
            out.update(use_sliding_window=False, sliding_window=None, max_window_layers=0,
                       layer_types=types)
    if family == "mistral" and not mhc:
        out["sliding_window"] = config.sliding_window if config.has_sliding_layers else None
    if family == "gemma3_text" and not mhc:
        del out["hidden_act"], out["rope_theta"]
        local = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
        out.update(
            hidden_activation="gelu_pytorch_tanh",
            attention_bias=config.attention_bias,
            rope_parameters={"full_attention": rope_to_hf(config),
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": float(local)}},
            query_pre_attn_scalar=_pre_attn_scalar(config),
            sliding_window=config.sliding_window,
            layer_types=types,
            attn_logit_softcapping=None,
            final_logit_softcapping=config.final_logit_softcapping,
            use_bidirectional_attention=False,
        )  # fmt: skip
        return out
    if config.rope_scaling.rope_type != "default":
        # Legacy key of older transformers / vLLM (v5 prefers it when present: same content).
        out["rope_scaling"] = {k: v for k, v in out["rope_parameters"].items() if k != "rope_theta"}
    return out


# ------------------------------------------------------------------------------- state dict
def check_weight(
    name: str, w: torch.Tensor, error: type[ValueError] = HFCheckpointError
) -> None:
    """Refuse a checkpoint tensor that our float decoder would misread.

    Args:
        name: the tensor's name in the checkpoint (quoted in the message).
        w: the tensor, any shape.
        error: the exception class to raise (importers of other formats pass their own).

    Raises:
        error: ``w`` is not one of :data:`WEIGHT_DTYPES`, or holds NaN / Inf (a NaN weight makes
            every logit NaN; the message counts the bad values).
    """
    if w.dtype not in WEIGHT_DTYPES:
        allowed = [str(d).removeprefix("torch.") for d in WEIGHT_DTYPES]
        raise error(
            f"tensor {name!r} has dtype {str(w.dtype).removeprefix('torch.')}; allowed dtypes: "
            f"{allowed} (integer or quantised weights cannot be imported)"
        )
    nan = inf = 0
    for chunk in w.detach().reshape(-1).split(_FINITE_CHUNK):
        if not bool(torch.isfinite(chunk).all()):
            nan += int(torch.isnan(chunk).sum())
            inf += int(torch.isinf(chunk).sum())
    if nan or inf:
        raise error(
            f"tensor {name!r} has {nan} NaN and {inf} Inf values of {w.numel()}; weights must be "
            "finite (the checkpoint is corrupted or was saved after a diverged step)"
        )


def _expected_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = Decoder(config)
    return {k: v.shape for k, v in model.state_dict().items()}


def from_hf_state_dict(
    hf_sd: dict[str, torch.Tensor], config: ModelConfig, family: str
) -> dict[str, torch.Tensor]:
    """HF tensors -> our state dict, checked tensor by tensor against ``config``.

    Raises:
        HFCheckpointError: a tensor is missing, unexpected, has the wrong shape, is not floating
            point or holds NaN/Inf (the message names it), or a bias we do not model is non-zero.
    """
    expected = _expected_shapes(config)
    sd: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for name, w in hf_sd.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        check_weight(name, w)
        ours = name if name == "lm_head.weight" else name.removeprefix("model.")
        if ours.endswith("self_attn.o_proj.bias"):
            if bool(w.any()):
                raise HFCheckpointError(
                    f"tensor {name!r} is non-zero: our attention has no o_proj bias "
                    f"(config attention_bias=True in {family!r} adds one)"
                )
            continue
        if ours not in expected or (name != "lm_head.weight" and not name.startswith("model.")):
            unexpected.append(name)
            continue
        if w.shape != expected[ours]:
            raise HFCheckpointError(
                f"tensor {name!r} has shape {list(w.shape)}; config.json implies "
                f"{list(expected[ours])}"
            )
        sd[ours] = w
    if config.tie_word_embeddings:
        if "lm_head.weight" in sd and "embed_tokens.weight" in sd and not torch.equal(
            sd["lm_head.weight"], sd["embed_tokens.weight"]
        ):
            raise HFCheckpointError(
                "tie_word_embeddings=True but 'lm_head.weight' differs from "
                "'model.embed_tokens.weight'"
            )
        if "embed_tokens.weight" in sd:
            sd["lm_head.weight"] = sd["embed_tokens.weight"]
    missing = sorted(
        ("model." + k if k != "lm_head.weight" else k) for k in set(expected) - set(sd)
    )
    if unexpected or missing:
        raise HFCheckpointError(
            f"tensors do not match config.json (family {family!r}): missing {missing}, "
            f"unexpected {sorted(unexpected)}"
        )
    return sd


def to_hf_state_dict(model: Decoder, family: str = "llama") -> dict[str, torch.Tensor]:
    """Our decoder -> HF tensor names for ``family`` (or our mHC format), contiguous CPU copies."""
    config = model.config
    _check_family(config, family)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # HF re-ties it to the embedding on load
    out = {
        (k if k == "lm_head.weight" else f"model.{k}"): v.cpu().contiguous().clone()
        for k, v in sd.items()
    }
    if config.uses_streams:
        return out
    C, D = config.hidden_size, config.head_size
    H, Hk = config.num_attention_heads, config.num_key_value_heads
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        dtype = out[p + "q_proj.weight"].dtype
        if family == "qwen2" and not config.attention_bias:
            # Qwen2 always has q/k/v biases: zeros are exact.
            out[p + "q_proj.bias"] = torch.zeros(H * D, dtype=dtype)
            out[p + "k_proj.bias"] = torch.zeros(Hk * D, dtype=dtype)
            out[p + "v_proj.bias"] = torch.zeros(Hk * D, dtype=dtype)
        if family in ("llama", "qwen3", "gemma3_text") and config.attention_bias:
            out[p + "o_proj.bias"] = torch.zeros(C, dtype=dtype)
    return out


# ---------------------------------------------------------------------------------- files
def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise HFCheckpointError(f"safetensors file not found: {file}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise HFCheckpointError(
            f"{file}: cannot read the safetensors file ({err}); it is corrupted or truncated"
        ) from err


def load_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (single file or sharded with an index).

    With an index, each shard is read completely and every tensor the index lists must be in
    the shard it names (a truncated download is caught here, not as a missing weight later).
    Pickle files (``*.bin``) are never read.
    """
    path = Path(path)
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return _read_safetensors(single)
    if not index.is_file():
        hint = " (pickle .bin checkpoints are not read)" if any(path.glob("*.bin")) else ""
        raise FileNotFoundError(
            f"{path}: no model.safetensors or model.safetensors.index.json{hint}"
        )
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise HFCheckpointError(f"{index}: not a valid safetensors index ({err})") from err
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        part = _read_safetensors(path / shard)
        listed = {k for k, v in weight_map.items() if v == shard}
        absent = sorted(listed - set(part))
        if absent:
            raise HFCheckpointError(
                f"{path / shard}: tensors listed in the index are absent from the shard: "
                f"{absent[:8]}{' ...' if len(absent) > 8 else ''}"
            )
        tensors.update(part)
    return tensors


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise HFCheckpointError(f"{config_file}: invalid JSON ({err})") from err


def import_hf(
    path: str | Path, *, dtype: torch.dtype | None = None
) -> tuple[Decoder, ModelConfig]:
    """Build our :class:`Decoder` from a local HF checkpoint directory or a ``.gguf`` file.

    Supports ``llama``, ``qwen2``, ``qwen3``, ``mistral`` and our ``unicache_mhc`` export. The
    tokenizer, if the directory has one, loads with
    ``unicache_train.data.tokenizer.load_tokenizer(path)``. The directory is recorded on the
    model as ``model.hf_source_dir``: :func:`export_hf` copies its tokenizer, generation config
    and chat template from there (a converted model is a new module: pass
    ``tokenizer_from=path`` to the export instead).

    Args:
        path: directory with ``config.json`` and safetensors weights, or a ``.gguf`` file of
            one of these families (dequantized by transformers into a cached plain directory,
            :func:`unicache_train.checkpoint.gguf.converted_dir`; tokenizer files included).
        dtype: parameter dtype of the returned model (default fp32; mHC parameters stay fp32).

    Returns:
        (model in eval mode, its :class:`ModelConfig`).

    Raises:
        HFCheckpointError: unsupported family/option, missing/unexpected/mis-shaped tensors,
            non-float or non-finite tensors, unreadable safetensors.
        FileNotFoundError: no config.json or no weights.
    """
    path = Path(path)
    if path.suffix == ".gguf":
        from unicache_train.checkpoint.gguf import converted_dir

        path = converted_dir(path)  # dequantized once into the cache, then read as HF
    verify(path)  # an export's checksum manifest, when it has one
    try:
        config, family = from_hf_config(_read_config(path))
    except HFCheckpointError as err:  # name the directory: "config.json x=..." -> "DIR/config..."
        msg = str(err)
        raise HFCheckpointError(f"{path}/{msg}" if msg.startswith("config.json") else msg) from None
    check_model_fits(config, f"{path / 'config.json'}")  # before anything is allocated
    sd = from_hf_state_dict(load_safetensors_dir(path), config, family)
    model = Decoder(config)
    model.load_state_dict(sd, strict=True)
    if dtype is not None:
        model.to(dtype)
    setattr(model, serving.SOURCE_ATTR, path)  # export takes the tokenizer files from here
    return model.eval(), config


def dtype_name(dtype: torch.dtype | str | None, model: Decoder) -> torch.dtype:
    if dtype is None:
        return model.embed_tokens.weight.dtype
    if isinstance(dtype, str):
        names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
        if dtype not in names:
            raise HFCheckpointError(f"dtype={dtype!r}: choose one of {sorted(names)}")
        return names[dtype]
    return dtype


def export_hf(
    model: Decoder,
    out_dir: str | Path,
    family: str = "llama",
    *,
    dtype: torch.dtype | str | None = None,
    compression_policy: dict[str, Any] | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    tokenizer_from: Any = None,
) -> Path:
    """Write a directory that serves as it is: ``config.json`` + ``model.safetensors`` that
    ``AutoModelForCausalLM.from_pretrained`` loads (mHC models: plus the remote-code files; load
    with ``trust_remote_code=True``), the tokenizer that ``AutoTokenizer.from_pretrained``
    loads, ``generation_config.json`` and the chat template when the source has one
    (:mod:`unicache_train.checkpoint.serving`).

    ``model, _ = import_hf(src); ...; export_hf(model, out)`` takes them from ``src`` (recorded
    by :func:`import_hf`); a model built otherwise (trained from scratch, converted, fine-tuned
    through Lightning) names its tokenizer with ``tokenizer_from``. Without one, a warning says
    the export has no tokenizer.

    Args:
        model: a GQA :class:`Decoder` (plain residual, or mHC with the ``deepseek_v4`` preset).
        out_dir: directory to create / overwrite.
        family: ``llama`` | ``qwen2`` | ``qwen3`` | ``mistral`` (ignored for mHC models).
        dtype: ``"fp32"`` / ``"bf16"`` / a torch dtype; default: the model's dtype. mHC
            connection parameters stay fp32 (as HF keeps deepseek_v4's).
        compression_policy: if given, written to ``compression_config.json`` (see module doc).
        bos_token_id, eos_token_id: special ids for the config and generation config; default:
            the tokenizer source's (its ``config.json``, then ``generation_config.json``, then
            the tokenizer's own).
        tokenizer_from: the checkpoint (or tokenizer) directory whose tokenizer files,
            ``generation_config.json`` and chat template are copied verbatim; ``"byte"`` (our
            byte tokenizer, written in HF form); or a tokenizer object (``save_pretrained``).
            Default: ``model.hf_source_dir``, the directory :func:`import_hf` read.

    Returns:
        ``out_dir`` as a :class:`Path`.

    Raises:
        HFCheckpointError: the model has no form in ``family`` (named field).
        FileNotFoundError: ``tokenizer_from`` is a path that is not a directory.
    """
    source = serving.tokenizer_source(model, tokenizer_from)
    target = dtype_name(dtype, model)
    sd = to_hf_state_dict(model, family)
    # NOTE: the MoE router (gate weight, correction bias) stays fp32 too, as transformers'
    # DeepseekV3 keeps it: the bias moves below bf16's resolution.
    sd = {k: (v if _is_hc(k) or k.endswith(_ROUTER) else v.to(target)) for k, v in sd.items()}
    hf_config = to_hf_config(model.config, family, dtype=str(target).removeprefix("torch."))
    hf_config.update(serving.special_token_ids(
        source, model.config.vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
    ))  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    if model.config.uses_streams:
        for name in ("configuration_unicache_mhc.py", "modeling_unicache_mhc.py"):
            shutil.copyfile(_REMOTE_CODE / name, out / name)
    if compression_policy is not None:
        write_compression_config(compression_policy, out)
    else:  # an earlier export's policy must not outlive it (it would be served with this model)
        (out / COMPRESSION_CONFIG).unlink(missing_ok=True)
    serving.write_serving_files(
        out, source, hf_config, bos_token_id=bos_token_id, eos_token_id=eos_token_id
    )
    write_manifest(out)  # unicache_manifest.json: what serving verifies
    return out


_ROUTER = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")


def _is_hc(name: str) -> bool:
    return ".attn_hc." in name or ".ffn_hc." in name or ".hc_head." in name


# --------------------------------------------------------------------------- head merging
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
    L, Hk, H, D = (config.num_hidden_layers, config.num_key_value_heads,
                   config.num_attention_heads, config.head_size)
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
