"""Building and running a Trainer from a :class:`RunConfig`: the one place that decides hardware,
strategy, loggers, callbacks and resumption."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger

from unicache_train.revision import write_revision
from unicache_train.train.config import RunConfig
from unicache_train.train.module import LMModule
from unicache_train.train.strategies import destroy_process_group_at_exit, parallelize_model
from unicache_train.validation import ConfigError

log = logging.getLogger(__name__)

# Flags of Lightning's `fabric run` launcher, exported to the processes it starts.
_LAUNCHER_ENV = {
    "LT_ACCELERATOR": "accelerator",
    "LT_STRATEGY": "strategy",
    "LT_DEVICES": "devices",
    "LT_NUM_NODES": "num_nodes",
    "LT_PRECISION": "precision",
}


def apply_launcher_env(config: RunConfig, environ: dict[str, str] | None = None) -> RunConfig:
    """When started by ``fabric run``, its flags (``--accelerator``, ``--strategy``, ``--devices``,
    ``--num-nodes``, ``--precision``) override the recipe's ``train`` section."""
    env = os.environ if environ is None else environ
    if env.get("LT_CLI_USED") != "1":
        return config
    tc = config.train
    for var, name in _LAUNCHER_ENV.items():
        if var not in env:
            continue
        value: Any = env[var]
        if name in ("devices", "num_nodes"):
            value = int(value) if value.lstrip("-").isdigit() else value
        if name == "precision" and value == "32":
            value = "32-true"
        setattr(tc, name, value)
    tc.__post_init__()  # re-validate what the launcher set
    return config


def build_loggers(config: RunConfig, out_dir: Path) -> list[Logger] | bool:
    lc = config.logging
    if lc.logger == "none":
        return False
    if lc.logger == "csv":
        return [CSVLogger(save_dir=str(out_dir), name="csv")]
    if lc.logger == "tensorboard":
        return [TensorBoardLogger(save_dir=str(out_dir), name="tensorboard")]
    # W&B: the environment (WANDB_MODE) wins over the config; offline never asks for a login.
    mode = os.environ.get("WANDB_MODE", lc.wandb_mode)
    os.environ["WANDB_MODE"] = mode
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    logger = WandbLogger(
        project=lc.project,
        name=lc.name,
        tags=list(lc.tags) or None,
        save_dir=str(out_dir),
        offline=mode == "offline",
        mode=mode,
        config=config.to_dict(),
    )
    return [logger]


def _monitors(config: RunConfig) -> list[L.Callback]:
    from unicache_train.monitor import CompressionQualityMonitor, SignalGainMonitor

    mc = config.monitor
    cbs: list[L.Callback] = [CompressionQualityMonitor(mc.compress_every_n_steps)]
    if mc.gain:
        cbs.append(
            SignalGainMonitor(
                mc.gain_every_n_steps,
                mc.gain_threshold,
                mc.gain_stop_after,
                plot=mc.plots,
                baseline_checks=mc.gain_baseline_checks,
            )
        )
    return cbs


def build_trainer(config: RunConfig, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    tc = config.train
    out_dir = Path(tc.out_dir)
    ckpt_cb = ModelCheckpoint(
        dirpath=str(out_dir / "checkpoints"),
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=tc.checkpoint_every_n_steps,
        save_last=True,
        save_top_k=-1,
        # NOTE: last.ckpt is replaced, never versioned (last-v1.ckpt): a run resumed from a
        # copied or moved folder, or after a corrupt last.ckpt, keeps one name to resume from.
        enable_version_counter=False,
    )
    from unicache_train.train.guards import NonFiniteGuard

    cbs: list[L.Callback] = [
        ckpt_cb,
        NonFiniteGuard(out_dir / "checkpoints"),
        *_monitors(config),
        *(callbacks or []),
    ]
    loggers = build_loggers(config, out_dir)
    if loggers:
        cbs.append(LearningRateMonitor(logging_interval="step"))
    if tc.progress_bar:
        from lightning.pytorch.callbacks import RichProgressBar

        cbs.append(RichProgressBar(leave=True))
    from unicache_train.train.strategies import AtomicCheckpointIO, build_strategy

    return L.Trainer(
        accelerator=tc.accelerator,
        devices=tc.devices,
        num_nodes=tc.num_nodes,
        strategy=build_strategy(config),
        plugins=[AtomicCheckpointIO()],  # last.ckpt is never a half-written file
        precision=tc.precision,
        max_steps=tc.max_steps,
        max_epochs=-1,
        gradient_clip_val=tc.grad_clip or None,
        accumulate_grad_batches=tc.accumulate_grad_batches,
        val_check_interval=tc.val_every_n_steps,
        check_val_every_n_epoch=None,
        limit_val_batches=tc.limit_val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=tc.log_every_n_steps,
        default_root_dir=str(out_dir),
        logger=loggers,
        callbacks=cbs,
        enable_progress_bar=tc.progress_bar,
        enable_model_summary=False,
    )


def resolve_resume(config: RunConfig) -> str | None:
    """``train.resume``: None (fresh run), ``"auto"`` (the run's ``last.ckpt`` if present) or a
    checkpoint path (must exist; a ``.ckpt`` file or a ZeRO checkpoint directory).

    With ``"auto"``, rank 0 first deletes what a killed run left half-written (``*.tmp``); then
    the newest *intact* checkpoint wins (:mod:`unicache_train.checkpoint.resume`): ``last.ckpt``,
    ``last.ckpt.old`` (a ZeRO directory swap caught between its two renames), then the newest
    ``stepNNNNNN.ckpt``. Each newer one skipped (corrupt, truncated, missing) is reported in one
    line saying which checkpoint is used instead.

    Raises:
        IntegrityError: checkpoints exist but none is intact (a silent restart from step 0 would
            lose the run; set ``train.resume=null`` to start over).
    """
    from unicache_train.checkpoint.integrity import IntegrityError
    from unicache_train.checkpoint.resume import newest_intact_checkpoint
    from unicache_train.checkpoint.zero import remove_stale_temporaries

    resume = config.train.resume
    if resume is None:
        return None
    if resume == "auto":
        ckpt_dir = Path(config.train.out_dir) / "checkpoints"
        if int(os.environ.get("RANK", 0)) == 0:
            for path in remove_stale_temporaries(ckpt_dir):
                log.warning("removed %s, left half-written by an interrupted run", path)
        found, skipped = newest_intact_checkpoint(ckpt_dir)
        if skipped and found is None:
            raise IntegrityError(
                f"{ckpt_dir}: no intact checkpoint to resume from ({skipped[0][1]}; "
                f"{len(skipped)} checked); set train.resume=null to start over"
            )
        for path, why in skipped:
            log.warning("not resuming from %s: %s; resuming from %s instead", path.name, why, found)
        return str(found) if found is not None else None
    if not Path(resume).exists():
        raise ConfigError(f"TrainConfig.resume={resume!r}: no such checkpoint file")
    return resume


class InitFromCheckpoint(L.Callback):
    """Start a run from another run's weights (a ``.ckpt`` of :func:`fit` or ``fit_vlm``),
    strictly: every ``model.*`` tensor must match.

    Loads in ``setup``, before Lightning restores a resumed run's own checkpoint, so resuming
    the new run keeps its progress. The file is read as plain data (runs no code).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from unicache_train.checkpoint.lightning_ckpt import check_state_dict, read_checkpoint

        ckpt = read_checkpoint(self.path)
        state = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
        expected = {
            k: tuple(v.shape) for k, v in pl_module.state_dict().items() if k.startswith("model.")
        }
        check_state_dict(state, expected, self.path, "this run's model")
        pl_module.load_state_dict(state, strict=True)


def preflight(config: RunConfig) -> None:
    """Before any work: the model fits in memory, and ``out_dir`` and its ``checkpoints``
    folder are writable with room for one checkpoint (weights + AdamW moments).

    Raises:
        ConfigError: the model would not fit (the estimate named).
        WriteError: a folder is not writable or too full (named, with the cause).
    """
    from unicache_train.preflight import check_model_fits, check_output_dir, checkpoint_bytes

    check_model_fits(config.model, "model")
    if int(os.environ.get("RANK", 0)) == 0:
        out_dir = Path(config.train.out_dir)
        check_output_dir(out_dir, what="train.out_dir")
        check_output_dir(
            out_dir / "checkpoints", checkpoint_bytes(config.model), what="checkpoint folder"
        )


def check_resume_fits(path: str | Path, module: L.LightningModule) -> None:
    """A checkpoint file to resume from must hold this run's tensors, every one of its shape
    (else one line naming the file and the first differences, not a strict-load traceback)."""
    from unicache_train.checkpoint.lightning_ckpt import check_state_dict, read_checkpoint

    ckpt = read_checkpoint(path, mmap=True)
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    check_state_dict(ckpt["state_dict"], expected, path, "this run's model")


def fit(config: RunConfig, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    """Train (or resume) a model as the config says; return the finished Trainer.

    After ``fit`` returns in a distributed run (``fabric run``, ``train.devices > 1``; DDP or
    DeepSpeed), on every rank:

    * the default process group is still initialized: ``fit`` never destroys it, so the caller
      may run collectives on it (``all_reduce``, ``all_gather``, ``barrier``: every rank must
      make the same calls, as always) and may call ``fit`` again in the same process (e.g. a
      second stage, or more steps with ``train.resume=auto``), which reuses the group;
    * every rank has finished its last step and the final checkpoint
      (``<out_dir>/checkpoints/last.ckpt``) is complete on disk for every rank: the strategy's
      save ends with its own barrier; files that only rank 0 writes after that (plots, the W&B
      run) are rank 0's, so other ranks read them only after a ``barrier`` of their own;
    * the group is destroyed once, at interpreter exit, and only after a clean exit
      (:func:`~unicache_train.train.strategies.destroy_process_group_at_exit`); a caller may
      destroy it earlier itself (then it may not call ``fit`` again).

    Tested in ``tests/test_train.py::test_after_fit_a_distributed_caller_keeps_the_group``
    (2 ranks: an all-reduce and a barrier after ``fit``, the checkpoint visible to both, a
    second ``fit`` resuming from it).
    """
    from unicache_train.data.datamodule import LMDataModule

    config = apply_launcher_env(config)
    L.seed_everything(config.train.seed, workers=True, verbose=False)
    out_dir = Path(config.train.out_dir)
    preflight(config)
    ckpt_path = resolve_resume(config)
    datamodule = LMDataModule(config.data)
    module = LMModule(config)
    if ckpt_path is not None and Path(ckpt_path).is_file():
        check_resume_fits(ckpt_path, module)
    parallelize_model(module.model, config)  # recompute (then compile); sharding: the strategy
    trainer = build_trainer(config, callbacks)
    if trainer.is_global_zero:
        config.save(out_dir / "config.yaml")
        write_revision(out_dir / "revision.json")  # the code that ran: unicache_train.revision
    destroy_process_group_at_exit()  # a distributed run's group: see the function
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    finally:
        finish_wandb()
    return trainer


def finish_wandb() -> None:
    """Close the W&B run and wait until its files are complete on disk.

    So the next fit in this process starts its own run, and whoever reads the run directory
    when :func:`fit` returns reads all of it. ``wandb.finish()`` alone returns before the W&B
    service process (wandb-core) has necessarily written the run's file: measured, 4 of 30 short
    offline fits returned with a 7-byte ``.wandb`` file, complete a second later.
    ``wandb.teardown()`` stops that process and waits for it to exit, so every file it wrote
    is closed; the next run starts a new one (about a second).
    """
    wandb = sys.modules.get("wandb")
    if wandb is None:
        return
    if getattr(wandb, "run", None) is not None:
        wandb.finish()
    wandb.teardown()
