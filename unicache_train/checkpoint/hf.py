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

from pathlib import Path
from typing import Any

import torch

from unicache_train.checkpoint import serving
from unicache_train.checkpoint.hf_config import HFCheckpointError, from_hf_config, to_hf_config
from unicache_train.checkpoint.hf_weights import (
    ROUTER_SUFFIXES,
    from_hf_state_dict,
    is_hc_param,
    to_hf_state_dict,
)
from unicache_train.checkpoint.integrity import verify
from unicache_train.checkpoint.safetensors_io import load_safetensors_dir, read_config_json
from unicache_train.checkpoint.serving import write_export_dir
from unicache_train.compress.retention import retention_state
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.preflight import check_model_fits

__all__ = ["import_hf", "export_hf", "dtype_name"]

_REMOTE_CODE = Path(__file__).parent / "remote_code"


def import_hf(path: str | Path, *, dtype: torch.dtype | None = None) -> tuple[Decoder, ModelConfig]:
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
        config, family = from_hf_config(read_config_json(path))
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
        names = {
            "fp32": torch.float32,
            "float32": torch.float32,
            "bf16": torch.bfloat16,
            "bfloat16": torch.bfloat16,
            "fp16": torch.float16,
            "float16": torch.float16,
        }
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
    attention_scorer: Any = None,
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
        attention_scorer: the fitted :class:`~unicache_train.compress.attention_scorer.
            AttentionScorer` a policy with ``selection.method="attention"`` ships beside the
            weights.

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
    keep = {k for k in sd if is_hc_param(k) or k.endswith(ROUTER_SUFFIXES)}
    sd = {k: (v if k in keep else v.to(target)) for k, v in sd.items()}
    hf_config = to_hf_config(model.config, family, dtype=str(target).removeprefix("torch."))
    hf_config.update(
        serving.special_token_ids(
            source,
            model.config.vocab_size,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
        )
    )
    code = ("configuration_unicache_mhc.py", "modeling_unicache_mhc.py")
    return write_export_dir(
        out_dir,
        hf_config,
        sd,
        source,
        compression_policy=compression_policy,
        retention=retention_state(model),
        attention_scorer=attention_scorer,
        remote_code=[_REMOTE_CODE / name for name in code] if model.config.uses_streams else (),
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
