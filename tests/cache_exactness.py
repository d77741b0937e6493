"""Shared by ``tests/test_transformers_cache.py`` and its lower-bound run: tiny exports of each
family with a compression policy, stock transformers ``generate()`` with
:class:`~unicache_train.transformers_cache.CompressedCache`, our own decoding loop on the same
weights. No pytest here: ``python tests/cache_exactness.py --out DIR`` runs the check in another
environment (the oldest transformers we support).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

from unicache_train.checkpoint.hf import export_hf, import_hf
from unicache_train.checkpoint.policy import compressor_from_policy, policy_of, read_policy
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.model.generate import decode_teacher_forced, generate_compressed
from unicache_train.train.config import CompressionTrainConfig
from unicache_train.transformers_cache import (
    ATTN_IMPLEMENTATION,
    CACHE_ARGUMENT,
    CompressedCache,
)

V = 260  # the byte tokenizer's vocabulary: the exports carry a tokenizer
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LENS = [40, 29, 35]  # a ragged batch
NEW = 6

# name -> CompressionTrainConfig kwargs (None: no compression_config.json at all)
POLICIES = {
    "unicache_int8": dict(
        method="unicache", preset="text_style_baseline", unicache={"quantize": {"bits": 8}}
    ),
    "unicache_int4_merge": dict(
        method="unicache", preset="default", unicache={"quantize": {"bits": 4}}
    ),
    # a learned retention policy (random weights, exported beside the model) with int4 storage
    "retention_int4": dict(
        method="unicache", preset="retention", unicache={"quantize": {"bits": 4}}
    ),
    # one budget over all layers (a cross-layer compressor: the cache records every layer first)
    "snapkv_global_int4": dict(
        method="unicache",
        preset="snapkv",
        unicache={"quantize": {"bits": 4}, "schedule": {"global_budget": True}},
    ),
    "xkv": dict(method="xkv"),
    "unicache+xkv": dict(method="unicache+xkv", preset="text_style_baseline"),
    "off": None,
}


def make_model(family: str) -> Decoder:
    torch.manual_seed(0)
    extra: dict = {}
    if family == "qwen2":
        extra = dict(attention_bias=True, tie_word_embeddings=True)
    elif family == "qwen3":
        extra = dict(qk_norm=True)
    elif family == "mhc":
        extra = dict(residual_mode="mhc", hc_mult=4, hc_sinkhorn_iters=5, qk_norm=True)
    model = Decoder(ModelConfig(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # off the init point: varied greedy tokens
            if any(s in name for s in ("base", "scale", "norm")):
                p.add_(0.3 * torch.randn_like(p))
            elif p.dim() == 2:
                p.mul_(4.0)
        for layer in model.layers:  # two near-identical KV heads: head merging has work to do
            attn = layer.self_attn
            D = model.config.head_size
            for proj in (attn.k_proj, attn.v_proj):
                proj.weight[D : 2 * D] = proj.weight[:D] + 0.01 * torch.randn_like(proj.weight[:D])
    return model


def export(tmp_path: Path, family: str, policy_name: str) -> Path:
    model = make_model(family)
    if policy_name.startswith("retention"):
        from unicache_train.compress.retention import attach_retention

        with torch.no_grad():  # off its zero init: the learned part changes the ranking
            policy = attach_retention(model)
            policy.weight.normal_(std=2.0)
            policy.bias.normal_(std=1.0)
    kw = POLICIES[policy_name]
    cc = None if kw is None else CompressionTrainConfig.from_dict({"enabled": True, **kw})
    policy = None if cc is None else policy_of(cc)
    out = tmp_path / f"{family}_{policy_name}"
    export_hf(
        model,
        out,
        family="llama" if family == "mhc" else family,
        compression_policy=policy,
        tokenizer_from="byte",
    )
    return out


def make_prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, V, (n,), generator=g) for n in LENS]


def hf_generate(out: Path, prompts: list[torch.Tensor], cache=None):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation=ATTN_IMPLEMENTATION, trust_remote_code=True
    ).eval()
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):  # left padding, as transformers generates
        ids[b, P - len(p) :] = p
        mask[b, P - len(p) :] = 1
    cache = CompressedCache.from_pretrained(out) if cache is None else cache
    res = hf.generate(
        ids,
        attention_mask=mask,
        **{CACHE_ARGUMENT: cache},
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return res.sequences[:, P:], torch.stack(res.logits, 1), cache


def ours(out: Path, prompts: list[torch.Tensor]):
    model, _ = import_hf(out)
    model.eval()
    policy = read_policy(out)
    lens = torch.tensor([len(p) for p in prompts])
    P = int(lens.max())
    ids = torch.zeros(len(prompts), P + NEW, dtype=torch.long)
    for b, p in enumerate(prompts):  # right padding, as our decoding loop takes it
        ids[b, : len(p)] = p
    gen = generate_compressed(model, ids[:, :P], lens, compressor_from_policy(policy, out), NEW)
    for b, n in enumerate(lens.tolist()):
        ids[b, n : n + NEW] = gen.tokens[b]
    logits, _ = decode_teacher_forced(model, ids, lens, compressor_from_policy(policy, out))
    steps = torch.stack([logits[b, n - 1 : n - 1 + NEW] for b, n in enumerate(lens.tolist())])
    return gen.tokens, steps, gen.cache


CASES = [("llama", p) for p in POLICIES] + [
    ("qwen2", "unicache_int8"),
    ("qwen3", "unicache_int4_merge"),
    ("mistral", "xkv"),
    ("mhc", "unicache_int8"),
    ("mhc", "xkv"),
    ("mhc", "retention_int4"),
]


def check(tmp_path: Path, family: str, policy_name: str) -> dict[str, float]:
    """Export, generate both ways, assert equality; returns the measured differences."""
    out = export(tmp_path, family, policy_name)
    prompts = make_prompts()
    tok_hf, logits_hf, cache = hf_generate(out, prompts)
    tok_ours, logits_ours, ours_cache = ours(out, prompts)
    assert torch.equal(tok_hf, tok_ours), (tok_hf.tolist(), tok_ours.tolist())
    assert len(set(tok_ours.flatten().tolist())) > 1  # not a degenerate constant output
    diff = float((logits_hf - logits_ours).abs().max())
    assert diff <= 1e-4, diff
    assert cache.kv_bytes() == ours_cache.kv_bytes(), (cache.kv_bytes(), ours_cache.kv_bytes())
    D = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    Hk, L = COMMON["num_key_value_heads"], COMMON["num_hidden_layers"]
    baseline = 2 * L * Hk * D * 2 * sum(LENS)  # K and V, 16-bit, every prompt token
    assert cache.baseline_bytes(D) == ours_cache.baseline_bytes(D) == baseline
    if POLICIES[policy_name] is None:
        assert cache.kv_bytes() == baseline
    else:
        assert cache.kv_bytes() < baseline / 1.5, (cache.kv_bytes(), baseline)
    if policy_name == "unicache_int4_merge":  # the near-identical heads were merged somewhere
        assert any(bool((s.groups < Hk).any()) for s in cache.inner.segments)
    return {"max_logit_diff": diff, "kv_bytes": cache.kv_bytes(), "baseline_bytes": baseline}


# What a second generate() on a cache that already served one does, per transformers version
# (the reuse guard, unicache_train/transformers_cache.py). Two signals exist: the public one,
# a multi-token forward into a cache that decoded (``CompressedCache._update``), and the private
# mark ``cache._is_user_defined = True`` that generate() sets on a caller's cache from some
# version after 5.2 (5.25 does; 5.2 does not). A new prompt exactly one token longer than what
# the cache has seen cannot be told from a continuation by the cache (it sees K/V, not ids):
# without the mark it continues. The keys: (transformers major.minor, marked).
REUSE = {
    ("5.25", True): dict(same="refused", shorter="refused", one_more="refused", longer="refused"),
    # a later transformers that stopped marking: the public signal still refuses these
    ("5.25", False): dict(same="refused", shorter="refused", one_more="runs", longer="refused"),
    # 5.2 never marks; a prompt no longer than what was seen fails inside generate() (an empty
    # cache_position, IndexError) before any forward
    ("5.2", False): dict(
        same="IndexError", shorter="IndexError", one_more="runs", longer="refused"
    ),
}


def reuse_outcomes(out: Path) -> dict[str, str]:
    """Each case on a fresh cache that served one generate(): 'refused' (our RuntimeError
    naming reset()), 'runs', or the name of the error transformers raised."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation=ATTN_IMPLEMENTATION
    ).eval()
    ids = torch.randint(3, 50, (1, 20), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    other = torch.randint(3, 50, (1, 40), generator=torch.Generator().manual_seed(1))
    outcomes = {}
    for case in ("same", "shorter", "one_more", "longer"):
        cache = CompressedCache.from_pretrained(out)
        model.generate(ids, **{CACHE_ARGUMENT: cache}, **kw)  # the cache saw 20 + 3 tokens
        again = {"same": ids, "shorter": ids[:, :15], "longer": other}.get(case, other[:, :24])
        try:
            model.generate(again, **{CACHE_ARGUMENT: cache}, **kw)
            outcomes[case] = "runs"
        except RuntimeError as err:
            outcomes[case] = "refused" if "call cache.reset()" in str(err) else "RuntimeError"
        except Exception as err:  # noqa: BLE001 (recorded: what transformers raised)
            outcomes[case] = type(err).__name__
    return outcomes


def marks_caller_cache() -> bool:
    """Whether this transformers' generate() marks a caller's cache (``_is_user_defined``)."""
    import inspect

    from transformers.generation import utils

    return "_is_user_defined = True" in inspect.getsource(utils)


def check_reuse(tmp_path: Path) -> str:
    """Assert this version's row of :data:`REUSE`; returns a one-line report."""
    key = (".".join(transformers.__version__.split(".")[:2]), marks_caller_cache())
    if key not in REUSE:
        raise AssertionError(f"no REUSE row for transformers {key}: record what happens")
    got = reuse_outcomes(export(tmp_path, "llama", "unicache_int8"))
    assert got == REUSE[key], (key, got)
    return f"transformers {transformers.__version__} reuse guard (marked={key[1]}): as recorded"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="scratch directory for the exports")
    p.add_argument(
        "--cases",
        default="llama:unicache_int8,llama:xkv,mhc:unicache_int8",
        help="family:policy,... (default: three of CASES)",
    )
    args = p.parse_args(argv)
    for case in args.cases.split(","):
        family, policy_name = case.split(":")
        got = check(Path(args.out), family, policy_name)
        print(f"transformers {transformers.__version__} {case}: ok {got}")
    print(check_reuse(Path(args.out)))


if __name__ == "__main__":
    sys.exit(main())
