"""Serve an export with stock transformers, with or without the compression it was tuned for.

``unicache-train generate --export DIR [--compressed]`` and ``benchmarks/bench_serving.py`` call
:func:`generate_from_export`; the cache itself is
:class:`unicache_train.transformers_cache.CompressedCache`. Imports transformers and torch
only (no Lightning).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "GenerationResult",
    "load_export",
    "generate_from_export",
    "prompt_kv_bytes",
    "check_positions",
]


@dataclass
class GenerationResult:
    """What one ``generate`` call produced and what its cache held.

    Attributes:
        text: the decoded continuation of each prompt (a list for a batch, a str for one).
        tokens: [B, N] generated ids.
        prompt_tokens: prompt length of each sample (without padding).
        kv_bytes: stored bytes of the prompts' KV cache, all layers (compressed: packed
            payload + scales + metadata; uncompressed: 16-bit K/V).
        baseline_bytes: the uncompressed 16-bit cache of the same prompts.
        seconds: wall time of the ``generate`` call (prefill + decoding).
        compressed: whether the export's policy was applied.
        method: the policy's method (``"none"`` when absent or not applied).
    """

    text: Any
    tokens: torch.Tensor
    prompt_tokens: list[int]
    kv_bytes: int
    baseline_bytes: int
    seconds: float
    compressed: bool
    method: str

    @property
    def tokens_per_second(self) -> float:
        return self.tokens.numel() / max(self.seconds, 1e-9)

    @property
    def reduction(self) -> float:
        """Uncompressed / stored KV bytes of the prompts (1.0 uncompressed)."""
        return self.baseline_bytes / max(self.kv_bytes, 1)

    def summary(self) -> str:
        kind = f"compressed ({self.method})" if self.compressed else "uncompressed"
        return (
            f"KV cache of the prompt, {kind}: {self.kv_bytes:,} bytes "
            f"(uncompressed 16-bit: {self.baseline_bytes:,}; {self.reduction:.2f}x fewer); "
            f"{self.tokens.numel()} tokens in {self.seconds:.2f} s "
            f"({self.tokens_per_second:.1f} tokens/s)"
        )


def load_export(
    export: str | Path,
    *,
    compressed: bool,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
):
    """(model, tokenizer) of an export directory; with ``compressed`` the model attends through
    the compressed cache's registered attention.

    The directory is checked first (:func:`unicache_train.checkpoint.trust.check_export_dir`):
    its checksum manifest, safetensors weights, a tokenizer, and remote code, which runs only
    when it is our own mHC code (byte-equal to the package's copy) or ``trust_remote_code``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unicache_train.checkpoint.trust import check_export_dir
    from unicache_train.transformers_cache import ATTN_IMPLEMENTATION

    export = Path(export)
    remote = check_export_dir(export, trust_remote_code=trust_remote_code)
    attn = ATTN_IMPLEMENTATION if compressed else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(
        export,
        attn_implementation=attn,
        trust_remote_code=remote,
        dtype=dtype,
        use_safetensors=True,
    ).eval()
    tok = AutoTokenizer.from_pretrained(export, trust_remote_code=trust_remote_code)
    return model, tok


def check_positions(
    prompt_tokens: int, max_new_tokens: int, positions: int | None, source: Any
) -> None:
    """Refuse a prompt that, with the tokens to generate, needs more positions than the model
    has (``max_position_embeddings``; None: unbounded).

    Raises:
        ConfigError: naming the prompt's tokens, ``max_new_tokens`` and the limit.
    """
    from unicache_train.validation import ConfigError

    if positions is not None and prompt_tokens + max_new_tokens > positions:
        raise ConfigError(
            f"generate --prompt: {prompt_tokens} tokens + --max_new_tokens {max_new_tokens} "
            f"exceed the {positions} positions of {source} (max_position_embeddings); shorten "
            "the prompt or generate fewer tokens"
        )


def prompt_kv_bytes(config: Any, prompt_tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of an uncompressed K/V cache of ``prompt_tokens`` tokens (all layers, K and V; an
    MLA model's latent ``c_kv ‖ k_pe`` once, as ``model.attention.kv_bytes_per_token``)."""
    kind = getattr(config, "attention_type", None)  # ours; HF MLA configs carry kv_lora_rank
    if kind == "mla" or (kind is None and getattr(config, "kv_lora_rank", None)):
        width = config.kv_lora_rank + config.qk_rope_head_dim
        return config.num_hidden_layers * width * dtype_bytes * prompt_tokens
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype_bytes * prompt_tokens


@torch.no_grad()
def generate_from_export(
    export: str | Path,
    prompt: str | list[str],
    *,
    compressed: bool = False,
    chat: bool = False,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    model_and_tokenizer: tuple[Any, Any] | None = None,
    trust_remote_code: bool = False,
) -> GenerationResult:
    """Generate with stock ``model.generate`` from an export directory.

    Args:
        export: the export directory.
        prompt: one prompt or a batch (left-padded).
        compressed: apply the export's ``compression_config.json`` (absent: a plain cache).
        chat: wrap each prompt in the export's chat template as a user turn.
        max_new_tokens, temperature, top_k, seed: decoding (greedy when temperature is 0).
        model_and_tokenizer: reuse an already loaded pair (:func:`load_export`).
        trust_remote_code: run the export's own code even when it is not ours
            (:func:`load_export`).

    Raises:
        ConfigError: a prompt plus ``max_new_tokens`` longer than the model's positions.
    """
    from transformers import DynamicCache

    from unicache_train.transformers_cache import CACHE_ARGUMENT, CompressedCache

    model, tok = model_and_tokenizer or load_export(
        export, compressed=compressed, trust_remote_code=trust_remote_code
    )
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"--chat: the export {export} has no chat template")
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)
    lens = enc["attention_mask"].sum(1).tolist()
    check_positions(
        max(lens), max_new_tokens, getattr(model.config, "max_position_embeddings", None), export
    )
    if compressed:
        cache = CompressedCache.from_pretrained(export)
        method = (cache.policy or {}).get("method", "none")
    else:
        cache, method = DynamicCache(), "none"
    sample = temperature > 0
    torch.manual_seed(seed)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=tok.pad_token_id)
    if sample:
        kwargs.update(temperature=temperature, top_k=top_k or 0)
    else:  # greedy: silence the export's sampling defaults
        kwargs.update(temperature=None, top_p=None, top_k=None)
    t0 = time.perf_counter()
    out = model.generate(**enc, **{CACHE_ARGUMENT: cache}, **kwargs)
    seconds = time.perf_counter() - t0
    new = out[:, enc["input_ids"].shape[1] :]
    texts = tok.batch_decode(new, skip_special_tokens=True)
    baseline = prompt_kv_bytes(model.config, sum(lens))
    kv = cache.kv_bytes() if compressed else baseline
    return GenerationResult(
        text=texts[0] if isinstance(prompt, str) else texts,
        tokens=new,
        prompt_tokens=lens,
        kv_bytes=kv,
        baseline_bytes=baseline,
        seconds=seconds,
        compressed=compressed,
        method=method,
    )
