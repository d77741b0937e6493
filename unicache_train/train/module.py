"""The LightningModule: causal-LM training of a :class:`~unicache_train.model.Decoder`."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn

from unicache_train.config import RunConfig
from unicache_train.model import Decoder

IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy.

    Args:
        logits: [B, T, V].
        labels: [B, T] next-token targets (already shifted), ``-100`` = ignore.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LMModule(L.LightningModule):
    """Trains the decoder with AdamW, warmup + cosine LR and validation perplexity.

    The resolved :class:`RunConfig` is stored in the checkpoint's hyper-parameters (``config``),
    so a checkpoint alone rebuilds the model (see :func:`unicache_train.checkpoint.load_checkpoint`).
    """

    def __init__(self, config: RunConfig | dict[str, Any]) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = RunConfig.from_dict(config)
        self.config = config
        self.save_hyperparameters({"config": config.to_dict()})
        self.model = Decoder(config.model)

    # ---------------------------------------------------------------------------- steps
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["input_ids"], modality_ids=batch.get("modality_ids")).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = causal_lm_loss(self(batch), batch["labels"])
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch)
        labels = batch["labels"]
        tokens = (labels != IGNORE_INDEX).sum()
        nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                              ignore_index=IGNORE_INDEX, reduction="sum")
        # Token-weighted mean across batches and ranks (not a mean of batch means).
        self._val_nll += nll.detach()
        self._val_tokens += tokens

    def on_validation_epoch_start(self) -> None:
        self._val_nll = torch.zeros((), device=self.device)
        self._val_tokens = torch.zeros((), device=self.device, dtype=torch.long)

    def on_validation_epoch_end(self) -> None:
        nll, tokens = self._val_nll, self._val_tokens.float()
        if self.trainer.world_size > 1:
            nll = self.trainer.strategy.reduce(nll, reduce_op="sum")
            tokens = self.trainer.strategy.reduce(tokens, reduce_op="sum")
        loss = nll / tokens.clamp_min(1)
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss.clamp_max(30)), sync_dist=False)

    # ---------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["world_size"] = self.trainer.world_size

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("world_size")
        if saved is not None and self._trainer is not None and saved != self.trainer.world_size:
            rank_zero_warn(
                f"resuming a checkpoint written with world_size={saved} on world_size="
                f"{self.trainer.world_size}: the global batch and the data order change "
                f"(per-device batch is kept); the loss curve will not continue exactly"
            )

    # ---------------------------------------------------------------------------- optimiser
    def configure_optimizers(self) -> dict[str, Any]:
        tc = self.config.train
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            # Matrices decay; gains, biases, embeddings and hyper-connection coefficients do not.
            is_hc = "_hc." in name or name.startswith("hc_head.")
            if p.ndim >= 2 and "embed_tokens" not in name and not is_hc:
                decay.append(p)
            else:
                no_decay.append(p)
        groups = [
            {"params": decay, "weight_decay": tc.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
