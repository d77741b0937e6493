"""Continuation perplexity on real English prose, the context compressed.

The prose is held out **by source**: the King James Bible
(:func:`unicache_train.data.eval_text.eval_documents`), which no training mix contains (the
fine-tuning mix trains on the Python Language Reference; its section split leaks, see
:mod:`unicache_train.data.eval_text`). Per-block losses (:attr:`TextResult.block_nll_sum`)
feed the paired bootstrap of :func:`unicache_train.eval.stats.paired_bootstrap_ppl`.

Each held-out section is tokenized and cut into blocks of ``context + continuation`` tokens;
the context is prefilled and compressed, the continuation is scored. The in-loop forward
(``model(ids, split=context, compressor=c)``) computes exactly what prefill -> compress ->
decode computes (``tests/test_inloop.py``), so it is used here for speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["TextResult", "text_blocks", "run_text_perplexity"]


def text_blocks(
    tokenizer, documents: Sequence[str], block: int, max_blocks: int | None = None
) -> torch.Tensor:
    """Non-overlapping blocks of ``block`` tokens, each from one document (``[bos] + text``).

    Returns:
        [N, block] long.
    """
    rows = []
    for doc in documents:
        ids = tokenizer.encode(doc, add_bos=True)
        for s in range(0, len(ids) - block + 1, block):
            rows.append(ids[s : s + block])
            if max_blocks is not None and len(rows) >= max_blocks:
                return torch.tensor(rows, dtype=torch.long)
    if not rows:
        raise ValueError(f"no document has {block} tokens")
    return torch.tensor(rows, dtype=torch.long)


@dataclass
class TextResult:
    """Token-level negative log-likelihood of the continuations.

    Attributes:
        nll_sum: summed NLL (nats) over ``tokens`` continuation tokens.
        tokens: scored tokens.
        block_nll: per-block mean NLL (for the standard error across blocks).
        block_tokens: per-block scored tokens.
    """

    nll_sum: float = 0.0
    tokens: int = 0
    block_nll: list[float] | None = None
    block_tokens: list[int] | None = None

    @property
    def block_nll_sum(self) -> list[float]:
        """Per-block summed NLL (nats), what a paired bootstrap resamples."""
        return [m * t for m, t in zip(self.block_nll or [], self.block_tokens or [])]

    @property
    def nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    @property
    def ppl_stderr(self) -> float:
        """Delta-method standard error of the perplexity from the spread of block NLLs."""
        b = self.block_nll or []
        if len(b) < 2:
            return float("nan")
        mean = sum(b) / len(b)
        var = sum((x - mean) ** 2 for x in b) / (len(b) - 1)
        return self.perplexity * math.sqrt(var / len(b))


@torch.no_grad()
def run_text_perplexity(
    model,
    blocks: torch.Tensor,
    context: int,
    compressor=None,
    *,
    batch_size: int = 4,
) -> TextResult:
    """Perplexity of ``blocks[:, context:]`` given the (compressed) ``blocks[:, :context]``.

    Args:
        model: a :class:`~unicache_train.model.Decoder`.
        blocks: [N, T] token ids (:func:`text_blocks`).
        context: context tokens per block (``1 <= context < T``).
        compressor: KV compressor of the context (None: the plain causal forward).
        batch_size: blocks per forward.

    Returns:
        :class:`TextResult` (the first continuation token, predicted from the last context
        position, is scored too).
    """
    N, T = blocks.shape
    if not 1 <= context < T:
        raise ValueError(f"context={context} is out of range; allowed [1, {T - 1}]")
    device = next(model.parameters()).device
    res = TextResult(block_nll=[], block_tokens=[])
    for s in range(0, N, batch_size):
        ids = blocks[s : s + batch_size].to(device)
        B = ids.shape[0]
        at = torch.arange(context - 1, T - 1, device=device).expand(B, -1)  # scored positions
        if compressor is None:
            out = model(ids, logits_at=at)
        else:
            split = torch.full((B,), context, dtype=torch.long, device=device)
            out = model(ids, split=split, compressor=compressor, logits_at=at)
        logits = out.logits.float()  # [B, T - context, V]
        nll = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, context:].reshape(-1), reduction="none"
        ).view(B, -1)
        res.nll_sum += float(nll.sum())
        res.tokens += nll.numel()
        res.block_nll.extend(nll.mean(1).tolist())
        res.block_tokens.extend([nll.shape[1]] * B)
    return res
