"""Export MLA decoders as HF ``DeepseekV3ForCausalLM`` checkpoints, and import them back.

The layout is what transformers (and vLLM / SGLang's DeepseekV2/V3 models) load: ``config.json``
plus ``model.safetensors`` with HF names (``model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight``
...). A dense decoder maps onto a DeepseekV3 whose every layer is dense
(``first_k_dense_replace = num_hidden_layers``; the MoE fields are set to a consistent, unused
single expert); an MoE decoder (``n_routed_experts > 0``, :mod:`unicache_train.model.moe`) onto
its MoE layers with the same router fields. No multi-token-prediction layers.

**Expert layout.** Files hold one tensor per expert, ``mlp.experts.{e}.{gate,up,down}_proj.weight``
(DeepSeek's own checkpoints, what vLLM / SGLang and transformers 4.x load; transformers 5 fuses
them on load and splits them again on save). We keep them stacked (``mlp.experts.gate_up_proj
[E, 2I, C]`` = gate rows then up rows, ``mlp.experts.down_proj [E, C, I]``, transformers 5's
in-memory layout): export splits, import stacks (and also accepts the fused names). The router
(``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``) stays fp32 in a cast export, as
transformers keeps it (``_keep_in_fp32_modules_strict``).

**RoPE layout.** We train with rotate-half RoPE (pairs ``(j, j + Dr/2)``); DeepSeek rotates
adjacent pairs ``(2i, 2i + 1)`` (``rope_interleave = True``), and vLLM / SGLang apply the
interleaved rotation to DeepSeek models whatever the config says. Both are the same rotation up
to a fixed permutation of the ``Dr`` RoPE coordinates, applied identically to queries and keys,
so permuting the RoPE rows of ``q_proj``/``q_b_proj`` (per head) and of ``kv_a_proj_with_mqa``
(the ``k_pe`` rows) gives bit-identical attention logits: export always writes the interleaved
layout; import handles both (``rope_interleave`` read from the config).

What cannot be represented raises :class:`DeepseekV3ExportError` naming the field: GQA attention
(per-head RoPE keys; convert first with :func:`unicache_train.model.convert_mla.convert_to_mla`),
hyper-connection streams, attention biases (inference stacks drop them), MoE without shared
experts (DeepseekV3 always has them), and on import a RoPE type other than default / linear /
dynamic / llama3 / yarn (YaRN with ``mscale``/``mscale_all_dim`` imports and exports: the softmax
scale is :func:`unicache_train.model.rope.mla_softmax_mscale`), a router other than
V3's (``scoring_func`` not sigmoid, ``topk_method`` not ``noaux_tc``) and ``moe_layer_freq``
!= 1. Import checks the files as :func:`unicache_train.checkpoint.hf.import_hf` does, with the
same messages: unreadable (truncated, corrupted) safetensors files name the file; missing,
unexpected, mis-shaped, non-float and non-finite tensors are named, with the expected and actual
shapes. Nothing is loaded partially.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from unicache_train.checkpoint import serving
from unicache_train.checkpoint.hf_config import HFCheckpointError, rope_from_hf, rope_to_hf
from unicache_train.checkpoint.hf_weights import check_weight
from unicache_train.checkpoint.safetensors_io import load_safetensors_dir
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig, RopeScalingConfig
from unicache_train.validation import ConfigError

__all__ = [
    "DeepseekV3ExportError",
    "export_deepseek_v3",
    "import_deepseek_v3",
    "to_deepseek_v3_config",
    "from_deepseek_v3_config",
    "to_deepseek_v3_state_dict",
    "from_deepseek_v3_state_dict",
]


class DeepseekV3ExportError(HFCheckpointError):
    """The model or checkpoint has a feature the DeepseekV3 format (or our decoder) lacks, or the
    checkpoint is unreadable (an :class:`HFCheckpointError`, so one ``except`` covers both
    importers)."""


# ------------------------------------------------------------------------------------ config
def _check_exportable(config: ModelConfig) -> None:
    if config.attention_type != "mla":
        raise DeepseekV3ExportError(
            f"ModelConfig.attention_type={config.attention_type!r}: DeepseekV3 has only MLA "
            "attention (one shared RoPE key head, no per-head RoPE keys); convert the model with "
            "unicache_train.model.convert_mla.convert_to_mla first"
        )
    if config.uses_streams:
        raise DeepseekV3ExportError(
            f"ModelConfig.residual_mode={config.residual_mode!r} with hc_mult={config.hc_mult}: "
            "DeepseekV3 has a single residual stream (no hyper-connections); export a model with "
            "residual_mode='residual' or hc_mult=1"
        )
    if config.attention_bias:
        raise DeepseekV3ExportError(
            "ModelConfig.attention_bias=True: vLLM / SGLang build DeepSeek attention without "
            "biases and would silently drop them; export a bias-free model"
        )
    if config.uses_moe and config.n_shared_experts == 0:
        raise DeepseekV3ExportError(
            "ModelConfig.n_shared_experts=0: every DeepseekV3 MoE layer has shared experts "
            "(width moe_intermediate_size * n_shared_experts); export a model with >= 1"
        )


def to_deepseek_v3_config(
    config: ModelConfig,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Our :class:`ModelConfig` -> a DeepseekV3 ``config.json`` dict (all layers dense)."""
    _check_exportable(config)
    L = config.num_hidden_layers
    rope = rope_to_hf(config)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": L,
        "num_attention_heads": config.num_attention_heads,
        # MLA expands K/V to every head: HF's eager path repeats K/V by H / num_key_value_heads.
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        # Dense everywhere: MoE starts at layer L, i.e. never. The expert fields must still be
        # consistent integers (one routed expert in one group, top-1) for config validation.
        "first_k_dense_replace": L,
        "moe_layer_freq": 1,
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": config.intermediate_size,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        **_moe_fields(config),
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_parameters": rope,
        # The legacy key too for a scaled model (older transformers / vLLM read it).
        **(
            {"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}}
            if rope["rope_type"] != "default"
            else {}
        ),
        "rope_theta": float(config.rope_theta),
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": dtype,
    }


def _moe_fields(config: ModelConfig) -> dict[str, Any]:
    """The MoE fields of an MoE decoder (empty for a dense one, which keeps the unused single
    expert above). ``topk_method``/``scoring_func``: DeepSeek-V3's own config.json names, which
    vLLM / SGLang read (``noaux_tc`` creates ``e_score_correction_bias``)."""
    if not config.uses_moe:
        return {}
    return {
        "first_k_dense_replace": config.first_k_dense_replace,
        "n_routed_experts": config.n_routed_experts,
        "n_shared_experts": config.n_shared_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "moe_intermediate_size": config.expert_intermediate_size,
        "routed_scaling_factor": float(config.routed_scaling_factor),
        "norm_topk_prob": config.norm_topk_prob,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    }


def _from_moe_fields(hf: dict[str, Any], L: int) -> dict[str, Any]:
    """ModelConfig MoE kwargs of a DeepseekV3 config.json (transformers' defaults where a field
    is absent); ``{}`` when every layer is dense."""
    first_dense = hf.get("first_k_dense_replace", 3)
    if first_dense is None:
        raise DeepseekV3ExportError(
            "first_k_dense_replace=None: expected an integer (the number of leading dense layers)"
        )
    first_dense = int(first_dense)
    if first_dense >= L:
        return {}
    freq = hf.get("moe_layer_freq", 1)
    if freq not in (None, 1):
        raise DeepseekV3ExportError(
            f"moe_layer_freq={freq!r}: only every layer from first_k_dense_replace on being MoE "
            "(moe_layer_freq=1, transformers' rule) is implemented"
        )
    for name, ours in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(name, ours) != ours:
            raise DeepseekV3ExportError(
                f"{name}={hf[name]!r}: only DeepSeek-V3's router ({name}={ours!r}) is implemented"
            )
    return dict(
        n_routed_experts=hf.get("n_routed_experts", 256),
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        n_shared_experts=hf.get("n_shared_experts", 1),
        moe_intermediate_size=hf.get("moe_intermediate_size", 2048),
        first_k_dense_replace=first_dense,
        n_group=hf.get("n_group", 8),
        topk_group=hf.get("topk_group", 4),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
    )


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScalingConfig]:
    """(rope_theta, RopeScalingConfig) of a DeepseekV3 config (v5 ``rope_parameters`` or legacy
    ``rope_scaling``), refusing the one DeepSeek case our config cannot hold: transformers'
    ``DeepseekV3Attention`` applies the softmax mscale for ANY scaled type with a non-zero
    ``mscale_all_dim``, our config only for yarn."""
    theta, scaling = rope_from_hf(hf, DeepseekV3ExportError)
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if scaling.rope_type not in ("default", "yarn") and params.get("mscale_all_dim"):
        raise DeepseekV3ExportError(
            f"rope_parameters.mscale_all_dim={params['mscale_all_dim']!r} with rope_type="
            f"{scaling.rope_type!r}: DeepSeek's softmax mscale is implemented for 'yarn' only"
        )
    return theta, scaling


def from_deepseek_v3_config(hf: dict[str, Any]) -> tuple[ModelConfig, bool]:
    """A DeepseekV3 ``config.json`` dict -> (our :class:`ModelConfig`, ``rope_interleave``)."""
    if hf.get("model_type") != "deepseek_v3":
        raise DeepseekV3ExportError(f"model_type={hf.get('model_type')!r}: expected 'deepseek_v3'")
    L = int(hf["num_hidden_layers"])
    moe = _from_moe_fields(hf, L)
    if hf.get("hidden_act", "silu") != "silu":
        raise DeepseekV3ExportError(f"hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU)")
    theta, rope_scaling = _rope(hf)
    H = int(hf["num_attention_heads"])
    C = int(hf["hidden_size"])
    dr = int(hf["qk_rope_head_dim"])
    # head_dim is unused by MLA; keep it derived when that is valid.
    head_dim = None if C % H == 0 and (C // H) % 2 == 0 else dr
    try:
        config = ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=C,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=L,
            num_attention_heads=H,
            num_key_value_heads=H,
            head_dim=head_dim,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            attention_bias=bool(hf.get("attention_bias", False)),
            attention_type="mla",
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=dr,
            v_head_dim=int(hf["v_head_dim"]),
            **moe,
        )
    except ConfigError as err:
        raise DeepseekV3ExportError(f"config.json is not representable: {err}") from err
    return config, bool(hf.get("rope_interleave", True))


# ------------------------------------------------------------------------------- state dict
def _rope_perm(dr: int) -> torch.Tensor:
    """ours[j] = interleaved[perm[j]]: rotate-half pair (j, j + Dr/2) is pair (2j, 2j + 1)."""
    return torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])


def _permute_rope_rows(
    sd: dict[str, torch.Tensor], config: ModelConfig, perm: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Reorder the RoPE rows of every q projection (per head) and of ``k_pe``: w[rope] = w[perm]."""
    H, R = config.num_attention_heads, config.kv_lora_rank
    Dn, Dr = config.qk_nope_head_dim, config.qk_rope_head_dim
    out = dict(sd)
    for name, w in sd.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            w = w.view(H, Dn + Dr, -1)
            w = torch.cat([w[:, :Dn], w[:, Dn:][:, perm]], dim=1).reshape(H * (Dn + Dr), -1)
        elif name.endswith(
            ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")
        ):
            w = torch.cat([w[:R], w[R:][perm]], dim=0)
        out[name] = w
    return out


def to_deepseek_v3_state_dict(model: Decoder) -> dict[str, torch.Tensor]:
    """Our state dict -> HF DeepseekV3 names, RoPE rows in DeepSeek's interleaved layout."""
    config = model.config
    _check_exportable(config)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    # NOTE: a tied model keeps ``lm_head.weight`` in the file too (a copy of the embedding):
    # transformers re-ties it on load either way, but vLLM's DeepseekV2/V3 never ties and
    # serves an all-zero head, silently, when the file lacks it (experiments/vllm/results/).
    inverse = torch.argsort(_rope_perm(config.qk_rope_head_dim))
    sd = _permute_rope_rows(sd, config, inverse)
    sd = _split_experts(sd)
    return {
        (k if k == "lm_head.weight" else f"model.{k}"): v.cpu().contiguous().clone()
        for k, v in sd.items()
    }


_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
# model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight: one tensor per expert (files).
_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$"
)


def _split_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked experts (``experts.gate_up_proj [E, 2I, C]``, ``experts.down_proj [E, C, I]``)
    -> one tensor per expert (``experts.{e}.gate_proj.weight [I, C]``, ``up_proj``, ``down_proj
    [C, I]``); other tensors unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if name.endswith(_FUSED[0]):
            prefix = name.removesuffix("gate_up_proj")
            gate, up = w.chunk(2, dim=1)  # [E, I, C] each
            for e in range(w.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif name.endswith(_FUSED[1]):
            prefix = name.removesuffix("down_proj")
            for e in range(w.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = w[e]
        else:
            out[name] = w
    return out


def _stack_experts(hf_sd: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-expert tensors of the decoder's MoE layers -> the stacked ``mlp.experts.gate_up_proj``
    / ``mlp.experts.down_proj`` (checked one by one first); other tensors unchanged.

    Raises:
        DeepseekV3ExportError: a per-expert tensor is mis-shaped, non-float or non-finite, an
            expert lacks a projection, an expert index is out of range, or a layer has both the
            per-expert and the fused names.
    """
    E, C, I = config.n_routed_experts, config.hidden_size, config.expert_intermediate_size
    shapes = {"gate": [I, C], "up": [I, C], "down": [C, I]}
    per_layer: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, w in hf_sd.items():
        m = _PER_EXPERT.match(name)
        if m is None or int(m[1]) >= config.num_hidden_layers or not config.is_moe_layer(int(m[1])):
            out[name] = w  # not ours to stack: dropped (MTP) or reported as unexpected later
            continue
        layer, e, proj = int(m[1]), int(m[2]), m[3]
        if e >= E:
            raise DeepseekV3ExportError(
                f"tensor {name!r}: expert index {e} is out of range; config.json has "
                f"n_routed_experts={E} (allowed 0..{E - 1})"
            )
        check_weight(name, w, DeepseekV3ExportError)
        if list(w.shape) != shapes[proj]:
            raise DeepseekV3ExportError(
                f"tensor {name!r} has shape {list(w.shape)}; config.json implies {shapes[proj]}"
            )
        per_layer.setdefault(layer, {})[(e, proj)] = w
    for layer, got in sorted(per_layer.items()):
        p = f"model.layers.{layer}.mlp.experts."
        if p + "gate_up_proj" in out or p + "down_proj" in out:
            raise DeepseekV3ExportError(
                f"layer {layer} holds both per-expert tensors ({p}{{e}}.*) and fused ones "
                f"({p}gate_up_proj / down_proj); a checkpoint has one layout"
            )
        missing = [
            f"{p}{e}.{proj}_proj.weight"
            for e in range(E)
            for proj in shapes
            if (e, proj) not in got
        ]
        if missing:
            raise DeepseekV3ExportError(
                f"layer {layer} misses expert tensors: {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''} ({len(missing)} of {3 * E})"
            )
        gate = torch.stack([got[(e, "gate")] for e in range(E)])  # [E, I, C]
        up = torch.stack([got[(e, "up")] for e in range(E)])  # [E, I, C]
        out[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, C]
        out[p + "down_proj"] = torch.stack([got[(e, "down")] for e in range(E)])  # [E, C, I]
    return out


def from_deepseek_v3_state_dict(
    hf_sd: dict[str, torch.Tensor], config: ModelConfig, rope_interleave: bool
) -> dict[str, torch.Tensor]:
    """HF DeepseekV3 tensors -> our state dict (MTP layers beyond ``num_hidden_layers`` dropped),
    checked tensor by tensor against ``config`` before any reshape.

    Raises:
        DeepseekV3ExportError: a tensor is missing, unexpected, mis-shaped, not floating point or
            holds NaN/Inf (the message names it, with the expected and actual shapes).
    """
    with torch.device("meta"):
        expected = {k: v.shape for k, v in Decoder(config).state_dict().items()}
    if config.uses_moe:
        hf_sd = _stack_experts(hf_sd, config)
    sd: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for name, w in hf_sd.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= config.num_hidden_layers:
                continue  # multi-token-prediction modules: not part of the decoder
        ours = name if name == "lm_head.weight" else name.removeprefix("model.")
        if ours not in expected or (name != "lm_head.weight" and not name.startswith("model.")):
            unexpected.append(name)
            continue
        check_weight(name, w, DeepseekV3ExportError)
        if w.shape != expected[ours]:
            # NOTE: before the RoPE permutation, whose per-head view would fail on a wrong shape.
            raise DeepseekV3ExportError(
                f"tensor {name!r} has shape {list(w.shape)}; config.json implies "
                f"{list(expected[ours])}"
            )
        sd[ours] = w
    if config.tie_word_embeddings and "embed_tokens.weight" in sd:
        sd.setdefault("lm_head.weight", sd["embed_tokens.weight"])
    missing = sorted(
        ("model." + k if k != "lm_head.weight" else k) for k in set(expected) - set(sd)
    )
    if unexpected or missing:
        raise DeepseekV3ExportError(
            f"tensors do not match config.json (family 'deepseek_v3'): missing {missing}, "
            f"unexpected {sorted(unexpected)}"
        )
    if rope_interleave:
        sd = _permute_rope_rows(sd, config, _rope_perm(config.qk_rope_head_dim))
    return sd


def _is_router(name: str) -> bool:
    """The router's tensors (kept fp32 in a cast export, as transformers keeps them)."""
    return name.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))


# ---------------------------------------------------------------------------------- files
def export_deepseek_v3(
    model: Decoder,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    compression_policy: dict[str, Any] | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    tokenizer_from: Any = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` loadable by
    ``transformers.DeepseekV3ForCausalLM.from_pretrained(out_dir)`` (and ``AutoModelForCausalLM``),
    with the tokenizer, ``generation_config.json`` and chat template a serving stack needs
    (:mod:`unicache_train.checkpoint.serving`; the same rules as
    :func:`~unicache_train.checkpoint.hf.export_hf`).

    Args:
        model: an MLA :class:`Decoder` (``attention_type="mla"``, plain residual, no biases).
        out_dir: directory to create / overwrite.
        dtype: cast the tensors (e.g. ``torch.bfloat16``); default: keep the model's dtype.
        compression_policy: if given, written to ``compression_config.json``.
        bos_token_id, eos_token_id: special ids for the config and generation config; default:
            the tokenizer source's.
        tokenizer_from: the directory whose tokenizer files, ``generation_config.json`` and
            chat template are copied (e.g. the GQA checkpoint a model was converted to MLA
            from), ``"byte"``, or a tokenizer object. Default: ``model.hf_source_dir``
            (recorded by :func:`import_deepseek_v3` and
            :func:`~unicache_train.checkpoint.hf.import_hf`).

    Returns:
        ``out_dir`` as a :class:`Path`.
    """
    source = serving.tokenizer_source(model, tokenizer_from)
    sd = to_deepseek_v3_state_dict(model)
    if dtype is not None:
        sd = {k: (v if _is_router(k) else v.to(dtype)) for k, v in sd.items()}
    dtype_name = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    hf_config = to_deepseek_v3_config(model.config, dtype=dtype_name)
    hf_config.update(
        serving.special_token_ids(
            source,
            model.config.vocab_size,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
        )
    )
    return serving.write_export_dir(
        out_dir,
        hf_config,
        sd,
        source,
        compression_policy=compression_policy,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def import_deepseek_v3(path: str | Path) -> Decoder:
    """Build our MLA :class:`Decoder` from a dense DeepseekV3 checkpoint directory
    (``config.json`` + safetensors, single file or sharded).

    Raises:
        DeepseekV3ExportError: an unsupported option, an unreadable safetensors file (named), or
            a missing / unexpected / mis-shaped / non-float / non-finite tensor (named).
        FileNotFoundError: no config.json or no weights.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise DeepseekV3ExportError(f"{config_file}: invalid JSON ({err})") from err
    config, interleave = from_deepseek_v3_config(hf)
    try:
        tensors = load_safetensors_dir(path)
    except HFCheckpointError as err:  # same message, this importer's class
        raise DeepseekV3ExportError(str(err)) from err
    sd = from_deepseek_v3_state_dict(tensors, config, interleave)
    model = Decoder(config)
    model.load_state_dict(sd, strict=True)
    setattr(model, serving.SOURCE_ATTR, path)  # export takes the tokenizer files from here
    return model.eval()
