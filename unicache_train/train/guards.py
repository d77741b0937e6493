"""The non-finite guard: a run whose loss or weights stop being finite ends in one line, before
anything non-finite reaches a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch

from unicache_train.checkpoint.integrity import NonFiniteError, first_non_finite

__all__ = ["NonFiniteGuard"]


class NonFiniteGuard(L.Callback):
    """Stop training with :class:`NonFiniteError` when the loss of a step is NaN/inf, naming the
    step, the loss and the first non-finite parameter; and refuse to write a checkpoint whose
    weights are not finite.

    NOTE: Lightning runs checkpoint callbacks after every other callback, so the step's check
    here comes before that step's save: the checkpoints on disk stay the last finite ones. Every
    rank takes the same decision (a reduced flag), so no rank waits on a stopped one.
    """

    def __init__(self, ckpt_dir: str | Path | None = None) -> None:
        self.ckpt_dir = None if ckpt_dir is None else Path(ckpt_dir)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        bad = not bool(torch.isfinite(loss.detach()).all())
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            raise self._error(trainer, pl_module, f"the loss is {float(loss.detach()):g}")

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        name = first_non_finite(pl_module.named_parameters())
        if name is not None:
            raise self._error(trainer, pl_module, f"parameter {name} is not finite", name)

    def _error(
        self, trainer: L.Trainer, pl_module: L.LightningModule, what: str, name: str | None = None
    ) -> NonFiniteError:
        if name is None:
            name = first_non_finite(pl_module.named_parameters())
        first = f"first non-finite parameter: {name}" if name else "every parameter is finite"
        where = f"; the last checkpoints in {self.ckpt_dir} are intact" if self.ckpt_dir else ""
        return NonFiniteError(
            f"training stopped at step {trainer.global_step}: {what} ({first}); nothing from "
            f"this step was saved{where} (lower train.lr or set train.grad_clip)"
        )
