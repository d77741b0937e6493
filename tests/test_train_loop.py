"""The plain training loop (unicache_train/train/loop.py): the LM objective and the in-loop
compression objective, checked against losses computed here from the plain forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.seam import IdentityCompressor
from unicache_train.train.config import TrainConfig
from unicache_train.train.loop import endless, train_steps

V = 61


def _model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(
        ModelConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 20), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], 1)
    labels[2, 15:] = -100  # right padding
    return {"input_ids": ids, "labels": labels, "split": torch.tensor([7, 12, -1])}


def test_lm_steps_match_the_plain_cross_entropy_and_count_tokens():
    model, batch = _model(), _batch()
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    want = F.cross_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1), ignore_index=-100)
    res = train_steps(model, iter([batch] * 4), 4, 1e-2, 0, TrainConfig())
    assert abs(res.losses[0] - float(want)) < 1e-5
    assert res.losses[-1] < res.losses[0]  # it trains
    assert res.tokens == 4 * int((batch["labels"] != -100).sum()) and not model.training


def test_compressed_steps_put_the_loss_on_the_continuation():
    """Identity compression: the in-loop forward is the plain forward, so the first loss is the
    cross-entropy of the continuation targets (t >= split - 1) of the plain logits; the sample
    without a data split gets a seeded random one of at least min_context tokens."""
    model, batch = _model(), _batch()
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    res = train_steps(
        model,
        endless(lambda: [batch]),
        1,
        1e-2,
        0,
        TrainConfig(),
        compressor=IdentityCompressor(),
        min_context=4,
        seed=3,
    )
    labels, t = batch["labels"].clone(), torch.arange(20)
    losses = []
    for split2 in range(4, 15):  # the random split of sample 2 is one of these
        split = torch.tensor([7, 12, split2])
        lab = torch.where(t[None] >= (split[:, None] - 1), labels, -100)
        losses.append(
            float(F.cross_entropy(logits.reshape(-1, V), lab.reshape(-1), ignore_index=-100))
        )
    assert min(abs(x - res.losses[0]) for x in losses) < 1e-5
    full = float(F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100))
    assert abs(full - res.losses[0]) > 1e-3  # not the whole-sequence loss
