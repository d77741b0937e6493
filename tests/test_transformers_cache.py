"""The exported compression policy in stock transformers ``generate()``
(:mod:`unicache_train.transformers_cache`) equals our own decoding loop
(:func:`unicache_train.model.generate_compressed`) on the same weights: greedy tokens identical,
per-step logits <= 1e-4, KV bytes equal. Ragged batches (left padding on the transformers side,
right padding on ours) in every case; the check itself is in ``tests/cache_exactness.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cache_exactness as ce  # noqa: E402  (tests/ is on sys.path under pytest's rootdir)

from unicache_train.checkpoint.policy import read_policy  # noqa: E402
from unicache_train.transformers_cache import (  # noqa: E402
    ATTN_IMPLEMENTATION,
    CACHE_ARGUMENT,
    CompressedCache,
)
from unicache_train.validation import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family,policy_name", ce.CASES)
def test_stock_generate_equals_ours(tmp_path, family, policy_name):
    ce.check(tmp_path, family, policy_name)


def test_policy_off_equals_plain_transformers(tmp_path):
    """No compression_config.json: the cache is a plain cache; stock generate without it gives
    the same tokens and logits (the registered attention is plain causal attention)."""
    out = ce.export(tmp_path, "llama", "off")
    assert read_policy(out) is None
    prompts = ce.make_prompts()
    tok, logits, _ = ce.hf_generate(out, prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    P = max(ce.LENS)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = p
        mask[b, P - len(p) :] = 1
    ref = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=ce.NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    assert torch.equal(ref.sequences[:, P:], tok)
    torch.testing.assert_close(torch.stack(ref.logits, 1), logits, atol=1e-4, rtol=0)


def test_second_prefill_and_bad_policy_are_refused(tmp_path):
    out = ce.export(tmp_path, "llama", "unicache_int8")
    cache = CompressedCache.from_pretrained(out)
    k = torch.zeros(1, 2, 5, 16)
    cache.update(k, k, 0)  # prefill of layer 0 recorded, never compressed (no attention call)
    with pytest.raises(RuntimeError, match="prefill the prompt in one call"):
        cache.update(k, k, 0)
    doc = json.loads((out / "compression_config.json").read_text())
    doc["policy"]["method"] = "zip"
    (out / "compression_config.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="policy.method='zip'.*allowed"):
        CompressedCache.from_pretrained(out)
    doc["schema_version"] = 99
    (out / "compression_config.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="schema_version=99"):
        CompressedCache.from_pretrained(out)
    with pytest.raises(FileNotFoundError, match="not an export directory"):
        CompressedCache.from_pretrained(tmp_path / "nowhere")


def test_serving_side_imports_no_lightning():
    code = (
        "import sys, unicache_train.transformers_cache;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning',"
        " 'deepspeed', 'wandb')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# The oldest transformers we support, in its own environment (`make tf-lower`; the kvpress one
# pins the same version).
_LOWER = next(
    (
        p
        for p in (
            ROOT / ".venv-tf-lower" / "bin" / "python",
            ROOT / ".venv-kvpress" / "bin" / "python",
        )
        if p.exists()
    ),
    None,
)


@pytest.mark.skipif(_LOWER is None, reason="no lower-bound transformers env (make tf-lower)")
def test_lower_bound_transformers(tmp_path):
    """transformers 5.2 runs the same exactness check (this package on PYTHONPATH)."""
    version = subprocess.run(
        [str(_LOWER), "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version.startswith("5.2"), version
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(_LOWER), str(ROOT / "tests" / "cache_exactness.py"), "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(": ok ") == 3, proc.stdout
    assert "reuse guard (marked=False): as recorded" in proc.stdout, proc.stdout


def test_cli_generate_from_export(tmp_path, capsys):
    """``unicache-train generate --export DIR --compressed``: stock generate on the export's
    policy; the summary line reports the prompt's KV bytes (fewer than uncompressed)."""
    from unicache_train.cli import main

    out = ce.export(tmp_path, "llama", "unicache_int8")
    prompt = "the cat sat on the mat and looked at the dog for a long while. " * 2
    main(
        [
            "generate",
            "--export",
            str(out),
            "--compressed",
            "true",
            "--prompt",
            prompt,
            "--max_new_tokens",
            "5",
        ]
    )
    cap = capsys.readouterr()
    assert cap.out.startswith(prompt)
    pattern = r"compressed \((\w+)\): ([\d,]+) bytes \(uncompressed 16-bit: ([\d,]+);"
    method, stored, baseline = re.search(pattern, cap.err).groups()
    assert method == "unicache"
    assert 0 < int(stored.replace(",", "")) < int(baseline.replace(",", "")) / 1.5
    main(["generate", "--export", str(out), "--prompt", prompt, "--max_new_tokens", "5"])
    plain = capsys.readouterr()
    stored, baseline = re.search(
        r"uncompressed: ([\d,]+) bytes \(uncompressed 16-bit: ([\d,]+);", plain.err
    ).groups()
    assert stored == baseline and "1.00x fewer" in plain.err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x"])
    assert "exactly one of --checkpoint" in capsys.readouterr().err


def _tiny_generate_setup(tmp_path):
    out = ce.export(tmp_path, "llama", "unicache_int8")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation=ATTN_IMPLEMENTATION
    ).eval()
    ids = torch.randint(3, 50, (1, 20), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    return out, model, ids, kw


def test_second_generate_is_refused_until_reset(tmp_path):
    """A cache that served one generate() refuses the next one (a new prompt on old state gave
    other tokens silently) with a one-line error naming reset(); after reset() it gives the
    first call's tokens again. A hand prefill followed by one generate() stays allowed."""
    out, model, ids, kw = _tiny_generate_setup(tmp_path)
    cache = CompressedCache.from_pretrained(out)
    first = model.generate(ids, **{CACHE_ARGUMENT: cache}, **kw)
    for again in (ids, ids[:, :15], first):  # same, shorter, and longer prompts
        with pytest.raises(RuntimeError, match=r"call cache\.reset\(\)") as err:
            model.generate(again, **{CACHE_ARGUMENT: cache}, **kw)
        assert "\n" not in str(err.value)
    cache.reset()
    assert torch.equal(model.generate(ids, **{CACHE_ARGUMENT: cache}, **kw), first)
    hand = CompressedCache.from_pretrained(out)
    with torch.no_grad():
        model(ids[:, :12], **{CACHE_ARGUMENT: hand})  # the context, compressed here
    cont = model.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE_ARGUMENT: hand}, **kw)
    assert cont.shape == first.shape


def test_reuse_guard_does_what_is_recorded_for_this_version(tmp_path, monkeypatch):
    """A second generate() on a used cache, per version (``cache_exactness.REUSE``; the lower
    bound runs its own row in test_lower_bound_transformers): with this version's private mark
    everything is refused; without it (a later transformers that drops the mark, simulated by
    removing our property) the public signal, a multi-token forward after decoding, still
    refuses every prompt but one exactly one token longer than what the cache saw."""
    assert ce.check_reuse(tmp_path).endswith("as recorded")
    monkeypatch.setattr(CompressedCache, "_is_user_defined", None)  # a plain attribute now
    got = ce.reuse_outcomes(ce.export(tmp_path / "unmarked", "llama", "unicache_int8"))
    assert got == ce.REUSE[(".".join(transformers.__version__.split(".")[:2]), False)]


def test_beam_search_and_chunked_prefill_keep_clear_errors(tmp_path):
    out, model, ids, kw = _tiny_generate_setup(tmp_path)
    with pytest.raises(NotImplementedError, match="does not support beam search"):
        model.generate(
            ids, **{CACHE_ARGUMENT: CompressedCache.from_pretrained(out)}, num_beams=2, **kw
        )
    with pytest.raises(NotImplementedError, match="does not support chunked prefill"):
        model.generate(
            ids,
            **{CACHE_ARGUMENT: CompressedCache.from_pretrained(out)},
            prefill_chunk_size=8,
            **kw,
        )


def test_decode_paths_give_the_reference_tokens(tmp_path):
    """Stock generate() with the packed, int8 and buffer decode paths == the reference path
    (the former per-step dequantize): the same greedy tokens, logits within 1e-4, the same
    stored bytes; the buffer path holds, beyond what the packed path holds, exactly each layer's
    dequantized segment in fp32 (its working buffer), the reference path nothing."""
    out, model, ids, kw = _tiny_generate_setup(tmp_path)
    runs = {}
    for path in ("reference", "packed", "int8", "buffer"):
        cache = CompressedCache.from_pretrained(out, decode_path=path)
        res = model.generate(
            ids, **{CACHE_ARGUMENT: cache}, output_logits=True, return_dict_in_generate=True, **kw
        )
        runs[path] = (res.sequences, torch.stack(res.logits, 1), cache)
    seq_r, log_r, c_r = runs["reference"]
    for path in ("packed", "int8", "buffer"):
        seq, log, c = runs[path]
        assert torch.equal(seq, seq_r), path
        torch.testing.assert_close(log, log_r, atol=1e-4, rtol=0)
        assert c.kv_bytes() == c_r.kv_bytes() and c.decoded_bytes() == c_r.decoded_bytes()
    assert c_r.working_bytes() == 0
    dequantized = sum(
        2 * 4 * seg.head_map.numel() * seg.valid.shape[1] * seg.quant.head_dim
        for seg in runs["buffer"][2].inner.segments
    )
    assert runs["buffer"][2].working_bytes() - runs["packed"][2].working_bytes() == dequantized
    # int8 policy: the int8 path reads the stored rows as they are (no copy)
    assert runs["int8"][2].working_bytes() == runs["packed"][2].working_bytes()


def test_unpadded_prompt_takes_the_causal_kernel_exactly(tmp_path):
    """A prompt without padding is prefilled with SDPA's causal kernel (no explicit mask):
    with no policy, stock generate through the cache == transformers' own SDPA model."""
    out = ce.export(tmp_path, "llama", "off")
    ids = torch.randint(3, 50, (1, 23), generator=torch.Generator().manual_seed(1))
    kw = dict(
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation=ATTN_IMPLEMENTATION
    ).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    a = ours.generate(ids, **{CACHE_ARGUMENT: CompressedCache.from_pretrained(out)}, **kw)
    b = ref.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(
        torch.stack(a.logits, 1), torch.stack(b.logits, 1), atol=1e-5, rtol=0
    )
