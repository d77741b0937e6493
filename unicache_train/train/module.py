"""The LightningModule: causal-LM training of a :class:`~unicache_train.model.Decoder`, with
optional KV compression in the loop (``RunConfig.compress``, see
:mod:`unicache_train.inloop`)."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from unicache_train.inloop import (
    build_compressor,
    continuation_mask,
    inloop_loss,
    masked_nll,
    sample_splits,
    step_generator,
)
from unicache_train.model import Decoder
from unicache_train.model.loss import causal_lm_loss  # re-exported: recipes/scripts import it here
from unicache_train.model.moe import expert_loads, load_stats, update_router_bias
from unicache_train.monitor.metrics import layer_mean_stats
from unicache_train.seam import ScheduledCompressor
from unicache_train.train.config import RunConfig

#: A learned selection's stats also logged per layer (``compress/retention_kept/layer_03``).
RETENTION_LAYER_KEYS = ("retention_kept", "retention_budget_loss")


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LMModule(L.LightningModule):
    """Trains the decoder with AdamW, warmup + cosine LR and validation perplexity.

    With ``config.compress.enabled`` each training step runs the in-loop compression forward
    (docs/architecture.md#in-loop-semantics): per-sample splits, context K/V compressed at every
    layer, loss on the continuation (+ optional KL to the uncompressed forward of the same model),
    the compressor's own rate schedule (``at_step``). Logged: ``train/loss``,
    ``train/lm_loss``, ``train/kl`` (when ``kl_weight > 0``), ``compress/rate_scale`` and the
    compressor's stats over layers (``compress/kv_reduction``, ``compress/rate_realized``,
    ``compress/rate_realized/<modality>``, ...; :func:`~unicache_train.monitor.metrics.
    layer_mean_stats`). Validation reports ``val/loss`` and ``val/ppl`` on
    every target (as without compression) and, on continuation targets, ``val/ppl_continuation``
    (uncompressed), ``val/ppl_compressed`` (at the full rate) and ``compress/ppl_delta`` (relative
    increase, 0.03 = +3%).

    MoE models (``ModelConfig.n_routed_experts > 0``): after every optimizer step the expert
    loads of the step are summed over ranks, every router bias moves by
    ``router_bias_update_rate`` (DeepSeek-V3's auxiliary-loss-free balancing; 0 leaves it) and
    ``moe/load_max_over_mean``, ``moe/load_cv``, ``moe/idle_experts``, ``moe/bias_abs_mean`` are
    logged (:func:`~unicache_train.model.moe.load_stats`).

    The resolved :class:`RunConfig` is stored in the checkpoint's hyper-parameters (``config``),
    so a checkpoint alone rebuilds the model (see
    :func:`unicache_train.checkpoint.load_checkpoint`).
    """

    def __init__(self, config: RunConfig | dict[str, Any]) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = RunConfig.from_dict(config)
        self.config = config
        self.save_hyperparameters({"config": config.to_dict()})
        self.model = self.build_model()
        if config.train.init_weights is not None:
            self._load_init_weights(config.train.init_weights)
        # Not a module: the compressor must not enter the state dict twice. A learned selection's
        # parameters (unicache.selection.method 'retention') are attached to the model by
        # build_compressor as `model.kv_retention`, after the init weights (which lack them)
        # and before the optimizer and any checkpoint load (which hold them).
        self.compressor = (
            build_compressor(config.compress, self.model) if config.compress.enabled else None
        )

    def _load_init_weights(self, path: str) -> None:
        """Start from ``TrainConfig.init_weights`` (e.g. an imported HF checkpoint), strictly."""
        from pathlib import Path

        from safetensors.torch import load_file

        if not Path(path).is_file():
            raise FileNotFoundError(f"TrainConfig.init_weights={path!r}: no such file")
        state = load_file(path)
        if self.config.model.tie_word_embeddings and "embed_tokens.weight" in state:
            state.setdefault("lm_head.weight", state["embed_tokens.weight"])
        self.model.load_state_dict(state, strict=True)

    def build_model(self) -> torch.nn.Module:
        """The trained network (a :class:`Decoder`; subclasses build e.g. a vision-language
        decoder, see :mod:`unicache_train.train.vlm`)."""
        return Decoder(self.config.model)

    # ---------------------------------------------------------------------------- steps
    def model_forward(self, batch: dict[str, torch.Tensor], **kwargs):
        """The model on a batch (``kwargs``: ``split``/``compressor`` of the in-loop path).
        Every step calls the model through here, so a subclass with more inputs (images)
        overrides only this."""
        return self.model(batch["input_ids"], modality_ids=batch.get("modality_ids"), **kwargs)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model_forward(batch).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.compressor is not None:
            return self._compressed_training_step(batch, batch_idx)
        loss = causal_lm_loss(self(batch), batch["labels"])
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def _rate_at(self, step: int | None) -> float:
        """Move the compressor along its own rate schedule (nan: it has none, the identity)."""
        if isinstance(self.compressor, ScheduledCompressor):
            return self.compressor.at_step(step)
        return float("nan")

    def compressed_loss(
        self, batch: dict[str, torch.Tensor], step: int, micro: int = 0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        """The in-loop objective of one batch at optimizer step ``step``.

        Returns:
            (loss [], scalars to log, the per-layer compressor stats).
        """
        cc = self.config.compress
        assert self.compressor is not None
        scale = self._rate_at(step)
        # The decoder returns the uncompressed logits for the KL term (from a cross-layer
        # compressor's recording pass when that is free, else one forward without gradient);
        # the step reaches a cross-layer compressor's fit (its basis refresh schedule).
        res = inloop_loss(
            self.model_forward,
            batch,
            self.compressor,
            generator=step_generator(cc.seed, step, self.global_rank, micro),
            split_mode=cc.split,
            min_context=cc.min_context,
            loss_on=cc.loss_on,
            kl_weight=cc.kl_weight,
            kl_temperature=cc.kl_temperature,
            step=step,
        )
        logs = {"train/lm_loss": res.lm.detach(), "compress/rate_scale": torch.tensor(scale)}
        if res.kl is not None:
            logs["train/kl"] = res.kl.detach()
        if res.aux is not None:  # a learned selection's budget term (compress/aux_loss per layer)
            logs["train/aux_loss"] = res.aux.detach()
        out = res.output
        logs.update(layer_mean_stats(out.compression_stats))
        loss = res.loss
        return loss, logs, out.compression_stats

    def _compressed_training_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        micro = batch_idx % self.config.train.accumulate_grad_batches
        loss, logs, per_layer = self.compressed_loss(batch, self.global_step, micro)
        bs = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bs)
        self.log_dict(logs, batch_size=bs)
        self._record_layer_curves(per_layer)
        return loss

    def _record_layer_curves(self, per_layer: list[dict[str, torch.Tensor]]) -> None:
        """Per-layer curves (``compress/kv_reduction/layer_03``) go to the monitor's sink when
        the trainer has one; the layer means are logged by :meth:`log_dict` already."""
        if self._trainer is None or not per_layer:
            return
        from unicache_train.monitor import CompressionQualityMonitor
        from unicache_train.monitor.callbacks import find_callback
        from unicache_train.monitor.metrics import PER_LAYER_KEYS, compression_metrics

        sink = find_callback(self.trainer, CompressionQualityMonitor)
        # NOTE: only on the steps the sink flushes: turning the stats into floats syncs the device.
        if sink is not None and self.global_step % sink.every_n_steps == 0:
            curves = compression_metrics(per_layer, (*PER_LAYER_KEYS, *RETENTION_LAYER_KEYS))
            sink.record({k: v for k, v in curves.items() if "/layer_" in k})

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch)
        labels = batch["labels"]
        nll, tokens = masked_nll(logits, labels)
        # Token-weighted mean across batches and ranks (not a mean of batch means).
        self._val_nll += nll.detach()
        self._val_tokens += tokens
        if self.compressor is not None and self.config.compress.val_compressed:
            self._validate_compressed(batch, batch_idx, logits)

    def _validate_compressed(
        self, batch: dict[str, torch.Tensor], batch_idx: int, logits: torch.Tensor
    ) -> None:
        """Continuation NLL without and with compression (full rate), on the same splits."""
        cc = self.config.compress
        assert self.compressor is not None
        labels = batch["labels"]
        # Fixed per validation batch (not per step), so successive validations compare.
        gen = step_generator(cc.seed + 1, batch_idx, self.global_rank)
        split = sample_splits(
            labels, batch.get("split"), mode=cc.split, min_context=cc.min_context, generator=gen
        )
        cont = continuation_mask(split, labels.shape[1])
        self._rate_at(None)  # validation measures the end of the schedule
        comp = self.model_forward(batch, split=split, compressor=self.compressor).logits
        nll_plain, n = masked_nll(logits, labels, cont)
        nll_comp, _ = masked_nll(comp, labels, cont)
        self._val_cont += torch.stack([nll_plain.detach(), nll_comp.detach(), n.float()])

    def on_validation_epoch_start(self) -> None:
        self._val_nll = torch.zeros((), device=self.device)
        self._val_tokens = torch.zeros((), device=self.device, dtype=torch.long)
        self._val_cont = torch.zeros(3, device=self.device)  # nll plain, nll compressed, tokens

    def on_validation_epoch_end(self) -> None:
        nll, tokens, cont = self._val_nll, self._val_tokens.float(), self._val_cont
        if self.trainer.world_size > 1:
            nll = self.trainer.strategy.reduce(nll, reduce_op="sum")
            tokens = self.trainer.strategy.reduce(tokens, reduce_op="sum")
            cont = self.trainer.strategy.reduce(cont, reduce_op="sum")
        loss = nll / tokens.clamp_min(1)
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss.clamp_max(30)), sync_dist=False)
        if self.compressor is not None and self.config.compress.val_compressed and cont[2] > 0:
            ppl_plain = torch.exp((cont[0] / cont[2]).clamp_max(30))
            ppl_comp = torch.exp((cont[1] / cont[2]).clamp_max(30))
            self.log("val/ppl_continuation", ppl_plain, sync_dist=False)
            self.log("val/ppl_compressed", ppl_comp, prog_bar=True, sync_dist=False)
            self.log("compress/ppl_delta", ppl_comp / ppl_plain - 1.0, sync_dist=False)

    # ---------------------------------------------------------------------------- MoE balance
    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        optimizer_closure: Any = None,
    ) -> None:
        """The optimizer step (forward and backward run inside it, in the closure), then the
        router bias update of an MoE model."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self._balance_experts()

    def _balance_experts(self) -> None:
        """DeepSeek-V3's bias update from the loads counted since the last optimizer step (all
        micro-batches of the step), and their stats; a no-op without MoE layers."""
        loads = expert_loads(self.model)  # [L_moe, E] this rank's tokens per expert
        if loads.numel() == 0:
            return
        if self._trainer is not None and self.trainer.world_size > 1:
            # NOTE: every rank must apply the same update (the bias is a buffer: DDP does not
            # average it), computed from the load of the global batch.
            loads = self.trainer.strategy.reduce(loads.double(), reduce_op="sum")
        update_router_bias(self.model, self.config.model.router_bias_update_rate, loads)
        self.log_dict(load_stats(loads, self.model))  # the step's loads, the updated biases

    # ---------------------------------------------------------------------------- checkpoints
    def _global_batch(self) -> int:
        """Sequences per optimizer step: per-rank batch x accumulation x ranks."""
        tc = self.config.train
        return self.config.data.batch_size * tc.accumulate_grad_batches * self.trainer.world_size

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["world_size"] = self.trainer.world_size
        checkpoint["global_batch"] = self._global_batch()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("world_size")
        if saved is None or self._trainer is None or saved == self.trainer.world_size:
            return
        # Another world size with the same global batch continues the same curve (the data order
        # carries over, see LMDataModule.resume_sampler); only a changed global batch bends it.
        saved_batch = checkpoint.get("global_batch")
        if saved_batch != self._global_batch():
            rank_zero_warn(
                f"resuming a checkpoint written with world_size={saved} on world_size="
                f"{self.trainer.world_size}: the global batch changes ({saved_batch} -> "
                f"{self._global_batch()} sequences; set data.batch_size or "
                f"train.accumulate_grad_batches to keep it); the loss curve will not continue "
                f"exactly"
            )

    # ---------------------------------------------------------------------------- optimiser
    def configure_optimizers(self) -> dict[str, Any]:
        tc = self.config.train
        decay, no_decay, retention = [], [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            if name.startswith("kv_retention."):  # a learned selection's policy: its own group
                retention.append(p)
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
        if retention:  # lr relative to train.lr (SelectionConfig.lr_scale), no decay to 0
            scale = self.config.compress.unicache.selection.lr_scale
            groups.append({"params": retention, "weight_decay": 0.0, "lr": tc.lr * scale})
        opt = torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
