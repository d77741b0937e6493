"""Evaluation without a Trainer: perplexity of a model on a data split."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unicache_train.model import Decoder
from unicache_train.train.module import IGNORE_INDEX


@dataclass
class EvalResult:
    loss: float
    ppl: float
    tokens: int
    batches: int


@torch.no_grad()
def evaluate_perplexity(model: Decoder, loader, limit_batches: int | None = None) -> EvalResult:
    """Token-weighted mean next-token NLL and perplexity over ``loader``'s batches."""
    model.eval()
    device = next(model.parameters()).device
    nll, tokens, batches = 0.0, 0, 0
    for batch in loader:
        if limit_batches is not None and batches >= limit_batches:
            break
        ids = batch["input_ids"].to(device)
        labels = batch["labels"].to(device)
        logits = model(ids, modality_ids=batch.get("modality_ids", None)).logits
        nll += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum").item()
        tokens += int((labels != IGNORE_INDEX).sum())
        batches += 1
    if tokens == 0:
        raise ValueError("evaluation saw no target tokens: is the validation split empty?")
    loss = nll / tokens
    return EvalResult(loss=loss, ppl=math.exp(min(loss, 50.0)), tokens=tokens, batches=batches)
