"""HF ``config.json`` <-> :class:`~unicache_train.model.config.ModelConfig` for the families we
import and export (the family table and the refusals: :mod:`unicache_train.checkpoint.hf`), and
RoPE scaling (``rope_parameters`` / legacy ``rope_scaling``) <-> ``RopeScalingConfig``."""

from __future__ import annotations

from typing import Any

from unicache_train.model.config import ROPE_TYPE_FIELDS, ROPE_TYPES, ModelConfig, RopeScalingConfig
from unicache_train.preflight import available_memory
from unicache_train.validation import ConfigError

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


class HFCheckpointError(ValueError):
    """The checkpoint (or model) has a feature the target format or our decoder lacks."""


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
    for k in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
    ):
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
    return _model_config(
        hf, attention_bias=bias, qk_norm=model_type == "qwen3", **window
    ), model_type


_REQUIRED_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_OPTIONAL_SIZES = (
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "sliding_window",
    "max_window_layers",
    "sliding_window_pattern",
)


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
        {
            **flat,
            "tie_word_embeddings": hf.get("tie_word_embeddings", True),
            "max_position_embeddings": hf.get("max_position_embeddings", 131_072),
        },
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
_MHC_MOE_FIELDS = (
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
)


def _mhc_moe_config(config: ModelConfig) -> dict[str, Any]:
    """The MoE fields of an mHC export (none for a dense model); expert width resolved."""
    if not config.uses_moe:
        return {}
    out = {k: getattr(config, k) for k in _MHC_MOE_FIELDS}
    out["moe_intermediate_size"] = config.expert_intermediate_size
    return out


def check_family(config: ModelConfig, family: str) -> None:
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
    if not gemma and (
        config.rope_local_theta is not None
        or config.query_pre_attn_scalar is not None
        or config.attn_logit_softcapping is not None
        or config.final_logit_softcapping is not None
    ):
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
    check_family(config, family)
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
            out.update(
                use_sliding_window=True,
                sliding_window=config.sliding_window,
                max_window_layers=types.index("sliding_attention"),
                layer_types=types,
            )
        else:
            out.update(
                use_sliding_window=False,
                sliding_window=None,
                max_window_layers=0,
                layer_types=types,
            )
    if family == "mistral" and not mhc:
        out["sliding_window"] = config.sliding_window if config.has_sliding_layers else None
    if family == "gemma3_text" and not mhc:
        del out["hidden_act"], out["rope_theta"]
        local = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
        out.update(
            hidden_activation="gelu_pytorch_tanh",
            attention_bias=config.attention_bias,
            rope_parameters={
                "full_attention": rope_to_hf(config),
                "sliding_attention": {"rope_type": "default", "rope_theta": float(local)},
            },
            query_pre_attn_scalar=_pre_attn_scalar(config),
            sliding_window=config.sliding_window,
            layer_types=types,
            attn_logit_softcapping=None,
            final_logit_softcapping=config.final_logit_softcapping,
            use_bidirectional_attention=False,
        )
        return out
    if config.rope_scaling.rope_type != "default":
        # Legacy key of older transformers / vLLM (v5 prefers it when present: same content).
        out["rope_scaling"] = {k: v for k, v in out["rope_parameters"].items() if k != "rope_theta"}
    return out
