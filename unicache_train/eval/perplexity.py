"""Validation perplexity of a decoder without a Trainer (``unicache-train evaluate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from unicache_train.model import Decoder
from unicache_train.model.loss import masked_nll

__all__ = ["EvalResult", "evaluate_perplexity"]


@dataclass
class EvalResult:
    """Token-weighted mean NLL (``loss``, nats), its perplexity, and what was read."""

    loss: float
    ppl: float
    tokens: int
    batches: int


@torch.no_grad()
def evaluate_perplexity(model: Decoder, loader, limit_batches: int | None = None) -> EvalResult:
    """Token-weighted mean next-token NLL and perplexity over ``loader``'s batches.

    Args:
        model: the decoder (set to eval mode here).
        loader: batches with ``input_ids`` and ``labels`` [B, T] (``modality_ids`` optional).
        limit_batches: read at most this many batches (None: all).

    Raises:
        ValueError: no batch had a labelled token.
    """
    model.eval()
    device = next(model.parameters()).device
    nll, tokens, batches = 0.0, 0, 0
    for batch in loader:
        if limit_batches is not None and batches >= limit_batches:
            break
        ids = batch["input_ids"].to(device)
        labels = batch["labels"].to(device)
        logits = model(ids, modality_ids=batch.get("modality_ids", None)).logits
        s, n = masked_nll(logits, labels)
        nll += s.item()
        tokens += int(n)
        batches += 1
    if tokens == 0:
        raise ValueError("evaluation saw no target tokens: is the validation split empty?")
    loss = nll / tokens
    return EvalResult(loss=loss, ppl=math.exp(min(loss, 50.0)), tokens=tokens, batches=batches)
