"""A plain single-process training loop (no Lightning Trainer): AdamW with the
:class:`~unicache_train.train.module.LMModule`'s parameter groups, warmup + cosine schedule and
gradient clipping, for short CPU-friendly runs inside a recipe (healing a converted model,
fine-tuning a reference the same number of steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from unicache_train.inloop import inloop_loss, step_generator
from unicache_train.model.loss import causal_lm_loss
from unicache_train.train.config import TrainConfig
from unicache_train.train.module import warmup_cosine

__all__ = ["LoopResult", "endless", "train_steps"]


@dataclass
class LoopResult:
    """Per-step losses, tokens trained on (labelled positions) and wall seconds."""

    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


def endless(loader_fn: Callable[[], Iterable[dict[str, torch.Tensor]]]) -> Iterator[dict]:
    """Batches without end: ``loader_fn()`` is called again (same seeded order) at each epoch
    end."""
    while True:
        empty = True
        for batch in loader_fn():
            empty = False
            yield batch
        if empty:
            raise ValueError("the data loader yielded no batch")


def train_steps(
    model: torch.nn.Module,
    batches: Iterator[dict[str, torch.Tensor]],
    steps: int,
    lr: float,
    warmup: int,
    train: TrainConfig,
    *,
    compressor=None,
    min_context: int = 16,
    seed: int = 0,
    desc: str | None = None,
) -> LoopResult:
    """``steps`` AdamW steps on ``batches`` (``input_ids`` and ``labels`` [B, T]; -100 = no
    loss), leaving the model in eval mode.

    Weight decay ``train.weight_decay`` on matrices except the embeddings, betas, clipping and
    the cosine floor ``train.min_lr_ratio`` from ``train``; the learning rate ``lr`` and warmup
    are given (a healing run's, not the config's pretraining values).

    With ``compressor`` each step is the in-loop objective
    (:func:`unicache_train.inloop.inloop_loss`, the LightningModule's, without its KL term):
    per-sample splits (``batch["split"]`` where the data has one, else sampled; at least
    ``min_context`` context tokens, seeded by ``seed`` and the step), the context's K/V
    compressed at every layer, the loss on the continuation tokens only.

    Args:
        compressor: a KV compressor for compression-aware training, or None (plain LM loss).
        desc: label of the progress bar (tqdm on stderr); None: no bar.
    """
    if steps < 0:
        raise ValueError(f"steps={steps} is out of range; allowed >= 0")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": train.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(train.beta1, train.beta2),
    )
    bar = None
    if desc is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=desc, dynamic_ncols=True)
    out = LoopResult()
    t0 = time.perf_counter()
    model.train()
    for step in range(steps):
        batch = next(batches)
        for group in opt.param_groups:
            group["lr"] = lr * warmup_cosine(step, warmup, steps, train.min_lr_ratio)
        labels = batch["labels"]
        if compressor is None:
            loss = causal_lm_loss(model(batch["input_ids"]).logits, labels)
            counted = int((labels != -100).sum())
        else:
            res = inloop_loss(
                lambda b, **kw: model(b["input_ids"], **kw),
                batch,
                compressor,
                generator=step_generator(seed, step),
                min_context=min_context,
            )
            loss, counted = res.loss, int(res.targets.sum())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if train.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        opt.step()
        out.losses.append(loss.item())
        out.tokens += counted
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{out.losses[-1]:.3f}")
    if bar is not None:
        bar.close()
    out.seconds = time.perf_counter() - t0
    model.eval()
    return out
