"""HF state dicts <-> our :class:`~unicache_train.model.Decoder`'s: names (HF's without the
``model.`` prefix; mHC tensors with it), shapes and dtypes checked tensor by tensor, nothing loaded
partially."""

from __future__ import annotations

import torch

from unicache_train.checkpoint.hf_config import HFCheckpointError, check_family
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig

# Buffers some older checkpoints carry; recomputed by us, never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Dtypes a weight may be stored in. Integer and fp8 tensors are quantised weights (they need
# scales we do not read); casting them to float would give a model that silently computes garbage.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Elements scanned at a time for NaN/Inf: bounds the temporary boolean mask on large embeddings.
_FINITE_CHUNK = 1 << 24


def check_weight(name: str, w: torch.Tensor, error: type[ValueError] = HFCheckpointError) -> None:
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
        if (
            "lm_head.weight" in sd
            and "embed_tokens.weight" in sd
            and not torch.equal(sd["lm_head.weight"], sd["embed_tokens.weight"])
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
    check_family(config, family)
    # NOTE: a learned retention policy (``kv_retention.*``) is not an HF weight: an export
    # writes it to its own file beside the model (checkpoint.serving.write_export_dir).
    sd = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith("kv_retention.")}
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


ROUTER_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")


def is_hc_param(name: str) -> bool:
    return ".attn_hc." in name or ".ffn_hc." in name or ".hc_head." in name
