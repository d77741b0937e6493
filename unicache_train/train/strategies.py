"""Parallelism in one place: recompute, (compile,) then sharding.

Model code never knows it will be recomputed or sharded. This module

* applies activation checkpointing to the decoder blocks (:func:`parallelize_model`, called by
  :func:`unicache_train.train.run.fit` on the freshly built model), and
* maps ``train.strategy`` (from the recipe or from ``fabric run --strategy``) to the Lightning
  strategy that shards it (:func:`build_strategy`), with a crash-safe checkpoint writer and a
  ZeRO resume that works on another number of ranks (through DeepSpeed's universal checkpoint,
  :meth:`AtomicDeepSpeedStrategy.load_checkpoint`; docs/multinode.md). Several nodes need nothing
  more: ``fabric run --num-nodes/--node-rank/--main-address/--main-port`` starts the processes.

NOTE: the order is recompute, then compile, then sharding (torchtitan's
``parallelize_llama``): recompute wraps each block's forward, so compiling afterwards traces
the wrapper and keeps the block boundaries as recompute boundaries; the sharding strategy
(DDP / FSDP / ZeRO) comes last and must see the final modules, whose parameter names the
recompute wrapper leaves unchanged (checkpoints stay loadable into a plain ``Decoder``).
There is no compile step yet; it belongs between the two.

DeepSpeed on CPU. Lightning's :class:`DeepSpeedStrategy` refuses a CPU accelerator, yet DeepSpeed
0.19 runs ZeRO 0-3 on CPU over gloo, so :class:`CPUDeepSpeedStrategy` lets CI run the real ZeRO path
with 2 processes. It changes exactly three things (docs/architecture.md#parallelism):

1. ``setup_environment``: skips the CUDA-accelerator check (the rest is ``DDPStrategy``'s);
2. ``setup_distributed``: skips ``_validate_device_index_selection`` (CPU devices have no index);
3. ``deepspeed.initialize(args=Namespace(device_rank=...))`` gets the local rank instead of
   ``root_device.index`` (None on CPU). DeepSpeed's engine treats a negative ``device_rank`` as
   "not distributed" (``world_size = 1``, ``global_rank = 0`` on every rank, so every rank
   would write the rank-0 files of a checkpoint); the local rank keeps its rank bookkeeping
   right and its device ``cpu``.

One more thing it avoids: DeepSpeed's CPU comm backend JIT-compiles a shared-memory collective
op at ``init_distributed`` (about 6 minutes of C++ on a cold cache); the strategy marks that op
unavailable, so no op is built and gloo does the collectives. The optimizer is
``LMModule.configure_optimizers``' ``torch.optim.AdamW`` + ``LambdaLR`` (ZeRO partitions any torch
optimizer with ``zero_allow_untested_optimizer``; DeepSpeedCPUAdam would need an op build).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, Strategy
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.utils.checkpoint import checkpoint

from unicache_train.checkpoint.integrity import manifest_path, verify, write_manifest
from unicache_train.checkpoint.safe_load import (
    UnsafeCheckpointError,
    check_torch_file,
    check_zero_files,
    load_torch_file,
)
from unicache_train.checkpoint.zero import (
    UNIVERSAL_TAG,
    atomic_write,
    publish,
    remove_path,
    temporary_path,
    to_universal_checkpoint,
    zero_world_size,
)
from unicache_train.train.config import RunConfig
from unicache_train.validation import ConfigError, deep_merge

__all__ = [
    "build_strategy",
    "deepspeed_config",
    "parallelize_model",
    "apply_activation_checkpointing",
    "AtomicCheckpointIO",
    "AtomicDeepSpeedStrategy",
    "CPUDeepSpeedStrategy",
    "destroy_process_group_at_exit",
]

log = logging.getLogger(__name__)

# (ZeRO stage, optimizer offload) per Lightning strategy name.
_DEEPSPEED_NAMES = {
    "deepspeed": (2, False),
    "deepspeed_stage_1": (1, False),
    "deepspeed_stage_2": (2, False),
    "deepspeed_stage_2_offload": (2, True),
    "deepspeed_stage_3": (3, False),
    "deepspeed_stage_3_offload": (3, True),
}


# ================================================================================= recompute
class _Recompute:
    """Stands in for a block's ``forward``: runs it under non-reentrant activation checkpointing
    when autograd records, so the backward pass recomputes the block instead of keeping its
    activations. Stored as an instance attribute (not a wrapper module), so parameter names,
    state dicts and ZeRO shards are those of the plain model."""

    def __init__(self, module: nn.Module) -> None:
        self.forward = type(module).forward.__get__(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        first = True

        def run(*a: Any, **kw: Any) -> Any:
            nonlocal first
            if not first:
                # NOTE: the recompute in backward must not repeat side effects: lists passed in
                # are outputs by mutation (the decoder's per-layer compression ``stats``), so
                # the rerun appends to throwaway copies.
                kw = {k: ([] if isinstance(v, list) else v) for k, v in kw.items()}
            first = False
            return self.forward(*a, **kw)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    def __reduce__(self) -> tuple:  # pickle / deepcopy: rebind to the copied block
        return (_Recompute, (self.forward.__self__,))


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute every decoder block (``model.layers[i]``) in the backward pass.

    Saved activations drop from all of every block's intermediates to the block inputs (the
    residual stream ``[B, T, C]`` or ``[B, T, n, C]``) plus one block's intermediates while it
    is recomputed; the price is one more forward per block (about a third more compute).
    Idempotent. Returns the number of blocks wrapped.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `layers` ModuleList to checkpoint")
    for block in layers:
        if not isinstance(block.__dict__.get("forward"), _Recompute):
            block.forward = _Recompute(block)
    return len(layers)


def parallelize_model(model: nn.Module, config: RunConfig) -> nn.Module:
    """Apply the model-side parallelism of ``config.train`` in order: recompute, (compile).

    Sharding comes afterwards from the Lightning strategy of :func:`build_strategy`.
    """
    if config.train.activation_checkpointing:
        n = apply_activation_checkpointing(model)
        log.info("activation checkpointing: %d decoder blocks recompute in backward", n)
    return model


# ================================================================================= process exit
_EXIT_HOOK_REGISTERED = False
_EXIT_DESTROY_TIMEOUT_S = 60.0


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when this process exits, while Python is still alive.

    Without it a rank that leaves without ``destroy_process_group()`` tears gloo down during
    interpreter finalization: gloo's worker threads may still hold the ``AsyncWork`` of a
    collective (ZeRO-3's prefetching all-gathers are asynchronous), whose tensors drop Python
    references then, and taking the GIL in a finalizing interpreter aborts the process
    (SIGABRT, the mechanism of pytorch/pytorch#179291). ``fabric run`` reports any rank that
    dies that way as a failed run, even though every step and checkpoint was done. Seen once in
    CI: a 2-rank ZeRO-3 run whose rank 1 aborted at exit while rank 0 was still drawing its
    gain plot.

    Only on a clean exit: after an uncaught exception the group is left alone, because
    destroying it waits for this rank's pending collectives, which a peer blocked elsewhere
    never completes (measured: a rank failing with an all-gather in flight waited until its
    peer exited; the launcher would see a hung run instead of a failed one). The wait is bounded
    too (``_EXIT_DESTROY_TIMEOUT_S``), after which the exit goes on as without the hook.

    Registered once per process by :func:`unicache_train.train.run.fit` (a recipe may call
    ``fit`` several times and keep using the group between them: it is destroyed at exit only,
    and not at all when the caller has destroyed it already).
    """
    global _EXIT_HOOK_REGISTERED
    if not _EXIT_HOOK_REGISTERED:
        atexit.register(_destroy_process_group)
        _EXIT_HOOK_REGISTERED = True


def _destroy_process_group(timeout_s: float | None = None) -> bool:
    """The exit hook. Returns whether it destroyed the group (tests)."""
    import sys
    import threading

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception ends this process
        return False
    done = threading.Event()
    destroyed: list[bool] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
            destroyed.append(True)
        finally:
            done.set()

    threading.Thread(target=destroy, name="destroy_process_group", daemon=True).start()
    done.wait(_EXIT_DESTROY_TIMEOUT_S if timeout_s is None else timeout_s)
    return bool(destroyed)


# ================================================================================= checkpoint IO
class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to ``NAME.tmp`` in the target directory, fsync, then ``os.replace``.

    Lightning's own ``_atomic_save`` stages the bytes in the system temp directory and moves
    them (a copy across file systems), so a kill can leave a truncated ``last.ckpt``; here the
    rename is on one file system and atomic.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        atomic_write(Path(path), lambda tmp: torch.save(checkpoint, tmp))
        write_manifest(Path(path))  # NAME.sha256, checked by every load

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        remove_path(manifest_path(Path(path)))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # Resume (``trainer.fit(ckpt_path=...)``) reads plain data only, whatever the caller
        # asks: a checkpoint whose pickle would call code is refused, nothing run. A file that
        # differs from its checksum manifest is refused too.
        verify(Path(path))
        if map_location is None:
            map_location = lambda storage, loc: storage  # noqa: E731 - Lightning's default
        return load_torch_file(path, map_location=map_location)


class AtomicDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy, with ZeRO directories written under ``NAME.tmp`` and
    renamed into place once every rank's shard is on disk, and ZeRO checkpoints that resume on
    another number of ranks (through DeepSpeed's universal checkpoint; see
    :meth:`load_checkpoint`)."""

    def save_checkpoint(
        self, checkpoint: dict, filepath: Any, storage_options: Any | None = None
    ) -> None:
        path = Path(self.broadcast(str(filepath)))
        tmp = temporary_path(path)
        if self.is_global_zero:
            remove_path(tmp)  # left by a killed run
        self.barrier("zero_ckpt_tmp_clean")
        super().save_checkpoint(checkpoint, tmp, storage_options)  # every rank writes its shard
        self.barrier("zero_ckpt_written")
        if self.is_global_zero:
            write_manifest(tmp)  # tmp/unicache_manifest.json: every shard's size and SHA-256
            publish(tmp, path)
        self.barrier("zero_ckpt_published")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """Restore a ``.ckpt`` file or a ZeRO directory (weights, and when fitting the optimizer).

        A ZeRO directory written by another number of ranks is resumed through DeepSpeed's
        universal checkpoint: global rank 0 converts it (once, inside the directory:
        :func:`unicache_train.checkpoint.zero.to_universal_checkpoint`), every rank then loads
        its own slice of the unsharded fp32 weights, AdamW moments and step with the engine's
        ``load_universal_checkpoint`` switched on for this one load. The directory must be
        readable by every rank (a shared file system on several nodes, as for any ZeRO resume).
        """
        path = Path(checkpoint_path)
        module = self.lightning_module
        fitting = module is None or module.trainer.state.fn == TrainerFn.FITTING
        if fitting and path.is_dir() and not (self.load_full_weights and self.zero_stage_3):
            saved = zero_world_size(path)
            if saved != self.world_size:
                return self._load_resharded(path, saved)
        # NOTE: before super(). DeepSpeed's engine unpickles ZeRO files with weights_only=False;
        # each file it will read must first load as plain data.
        if path.is_dir():
            check_zero_files(path)
        elif path.is_file():
            check_torch_file(path, deepspeed=True)
        return super().load_checkpoint(checkpoint_path, weights_only=True)

    def _load_resharded(self, path: Path, saved: int) -> dict:
        """:meth:`load_checkpoint` of a ZeRO directory written by ``saved`` ranks.

        Rank 0 converts it and checks every file DeepSpeed will unpickle (the shards, then the
        universal copy), so the other ranks read only files rank 0 has checked.
        """
        module = self.lightning_module
        frozen = [n for n, p in module.named_parameters() if not p.requires_grad] if module else []
        if self.zero_stage_3 and frozen:
            raise RuntimeError(
                f"{path}: resuming a ZeRO-3 checkpoint written by {saved} ranks on "
                f"{self.world_size} needs every parameter in the optimizer; this model has frozen "
                f"parameters ({', '.join(frozen[:3])}, ...), which DeepSpeed's universal "
                "checkpoint does not carry under ZeRO-3. Resume on the same number of ranks, or "
                "use ZeRO stage 1/2"
            )
        error: Exception | None = None
        if self.is_global_zero:
            log.warning(
                "%s was written by %d ranks; this run has %d: converting it to a "
                "universal checkpoint",
                path,
                saved,
                self.world_size,
            )
            try:
                to_universal_checkpoint(path)
            except Exception as err:  # every rank must hear of it, not wait at a barrier
                error = err
        message = self.broadcast(None if error is None else f"{type(error).__name__}: {error}")
        if isinstance(error, UnsafeCheckpointError):
            raise error
        if message is not None:
            raise RuntimeError(
                f"{path} is a ZeRO checkpoint sharded over {saved} ranks; this run has "
                f"{self.world_size}, and converting it to a universal checkpoint (to re-shard "
                f"it) failed on global rank 0: {message}. Resume on {saved} ranks, or "
                "consolidate the weights (unicache_train.checkpoint.zero."
                "consolidate_zero_checkpoint) and start a new run from them (the optimizer "
                "state is then lost)"
            ) from error
        engine = self.deepspeed_engine
        engine._config.load_universal_checkpoint = True
        try:
            client_state = super().load_checkpoint(path, weights_only=True)
        finally:
            engine._config.load_universal_checkpoint = False
        if self.zero_stage_3:
            _repair_zero3_universal_load(engine, path)
        if module is not None:
            _restore_non_optimizer_state(module, path)
        log.info("resumed %s (written by %d ranks) on %d ranks", path, saved, self.world_size)
        return client_state


def _non_optimizer_state(module: nn.Module) -> list[str]:
    """State-dict keys the optimizer does not hold: frozen parameters and persistent buffers
    (e.g. an MoE router's bias)."""
    # NOTE: every name of a tied parameter (lm_head.weight is embed_tokens.weight): the
    # optimizer holds it under one.
    trainable = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    return [k for k in module.state_dict() if k not in trainable]


def _restore_non_optimizer_state(module: nn.Module, path: Path) -> None:
    """After a universal load: frozen parameters and persistent buffers from the saved module
    state (rank 0's model-states file; whole tensors, except ZeRO-3 parameters, which
    :meth:`AtomicDeepSpeedStrategy._load_resharded` refuses when frozen).

    NOTE: the universal loader restores what the optimizer holds and skips the module state
    dict; without this, a frozen tower or a buffer would silently keep its fresh value.
    """
    keys = _non_optimizer_state(module)
    if not keys:
        return
    files = sorted((path / UNIVERSAL_TAG).glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise RuntimeError(f"{path / UNIVERSAL_TAG}: no model-states file")
    saved = load_torch_file(files[0], map_location="cpu", deepspeed=True)["module"]
    missing = [k for k in keys if k not in saved]
    if missing:
        raise RuntimeError(f"{files[0]}: no saved value for {missing[:5]}")
    state = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for k in keys:
            if state[k].shape != saved[k].shape:
                raise RuntimeError(
                    f"{files[0]}: {k} has shape {tuple(saved[k].shape)}, "
                    f"the model {tuple(state[k].shape)}"
                )
            state[k].copy_(saved[k])


def _repair_zero3_universal_load(engine: Any, path: Path) -> None:
    """ZeRO-3 universal load (DeepSpeed 0.19): undo two slips of its loader.

    NOTE: (1) it copies the hyper-parameters of the saved *first* param group into every group;
    ``LMModule`` has two (weight decay on matrices, none on gains, embeddings and
    hyper-connection coefficients), so the second would start decaying (measured: the loss one
    step after the resume off by 2.7e-4): each group gets its own back from
    ``zero/optimizer_state.pt`` (one per group, in order). (2) It gives every
    sub-group's AdamW state the *same* ``step`` tensor, which ``torch.optim.AdamW`` increments in
    place once per sub-group per step, so the bias correction runs ahead (measured: the loss one
    step after the resume off by 7.8e-3): each state gets its own copy.
    """
    saved = load_torch_file(
        path / UNIVERSAL_TAG / "zero" / "optimizer_state.pt", map_location="cpu", deepspeed=True
    )
    groups = saved["param_groups"]
    base = engine.optimizer.optimizer
    if len(groups) != len(base.param_groups):
        raise RuntimeError(
            f"{path}: {len(groups)} saved optimizer param groups, {len(base.param_groups)} now"
        )
    for group, saved_group in zip(base.param_groups, groups):
        for key, value in saved_group.items():
            if key != "params":
                group[key] = value
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


class CPUDeepSpeedStrategy(AtomicDeepSpeedStrategy):
    """DeepSpeed ZeRO on CPU processes over gloo, fp32 or bf16 autocast (see the module doc
    for the three overrides). For tests and CI: the real ZeRO code path, no GPU."""

    strategy_name = "deepspeed_cpu"

    def __init__(
        self, *args: Any, process_group_backend: str | None = "gloo", **kwargs: Any
    ) -> None:
        super().__init__(*args, process_group_backend=process_group_backend, **kwargs)

    def setup_environment(self) -> None:
        # (1) DeepSpeedStrategy.setup_environment only adds the CUDA check.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        # (2) DeepSpeedStrategy.setup_distributed minus the device-index validation.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _init_deepspeed_distributed(self) -> None:
        import deepspeed.ops

        # NOTE: before deepspeed.init_distributed. On CPU its comm backend would JIT-compile a
        # shared-memory collective op (~6 min of C++ on a cold cache, and we build no ops);
        # DeepSpeed documents this dict as editable. gloo does the collectives instead.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        super()._init_deepspeed_distributed()

    @property
    def _device_rank(self) -> int:
        # (3) root_device.index is None on CPU.
        return self.local_rank

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model: nn.Module) -> None:
        import deepspeed

        assert isinstance(self.config, dict)
        # (3) again, for validate / test / predict outside fit; otherwise Lightning's method.
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16", "torch_autocast"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config.update(
                {
                    "zero_allow_untested_optimizer": self.config["zero_allow_untested_optimizer"],
                    "zero_optimization": self.config["zero_optimization"],
                }
            )
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )


# ================================================================================= selection
def _on_cpu(accelerator: str) -> bool:
    if accelerator == "cpu":
        return True
    return accelerator == "auto" and not torch.cuda.is_available()


def deepspeed_config(config: RunConfig) -> dict[str, Any]:
    """The DeepSpeed JSON for ``config.train``: our defaults, then ``train.deepspeed_config``.

    Defaults: the ZeRO stage of the strategy name (``deepspeed`` = 2), contiguous gradients,
    reduce-scatter and all-gather partitions with 200M-element buckets (DeepSpeed's advice for
    models up to a few billion parameters), ``overlap_comm`` on CUDA (it overlaps NCCL with the
    backward pass; gloo on CPU gains nothing), optimizer offload to pinned CPU memory when asked
    (``train.offload_optimizer`` or a ``*_offload`` name), and ``zero_allow_untested_optimizer``
    because our optimizer is ``torch.optim.AdamW`` (ZeRO wraps any torch optimizer; "untested"
    only means not one of DeepSpeed's fused ones, which would need op builds). Lightning fills in
    ``gradient_accumulation_steps``, ``gradient_clipping`` and the bf16/fp16 sections from the
    Trainer's flags; ``train_micro_batch_size_per_gpu`` is ``data.batch_size`` so that Lightning
    does not build the train loader early to guess it (which drops the loader's resume state).
    ``precision=bf16-mixed`` becomes DeepSpeed's ``torch_autocast`` (fp32 parameters, bf16
    matmuls), not its ``bf16`` mode (bf16 parameters): see the note in the code.
    """
    tc = config.train
    stage, offload = _DEEPSPEED_NAMES[tc.strategy]
    offload = offload or tc.offload_optimizer
    on_cuda = not _on_cpu(tc.accelerator)
    bucket = 200_000_000
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": on_cuda,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": bucket,
        "reduce_bucket_size": bucket,
    }
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": bucket // 4,
                "stage3_param_persistence_threshold": 100_000,
                "stage3_max_live_parameters": 1_000_000_000,
                "stage3_max_reuse_distance": 1_000_000_000,
                # Gather the full weights at save time only when asked: we consolidate offline.
                "stage3_gather_16bit_weights_on_model_save": False,
            }
        )
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
    ds: dict[str, Any] = {
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": config.data.batch_size,
        "steps_per_print": 1_000_000,  # Lightning logs; keep DeepSpeed's console quiet
        "wall_clock_breakdown": False,
    }
    if tc.precision == "bf16-mixed":
        # NOTE: DeepSpeed's own "bf16" mode (what Lightning would switch on) stores every parameter
        # in bf16, the mHC ones included, which must stay fp32 (docs/architecture.md#mhc). Its
        # torch-autocast mode keeps the parameters and optimizer fp32 and runs the matmuls (and the
        # Linear gradients' reduce) in bf16; an explicit "bf16" key stops Lightning.
        ds["bf16"] = {"enabled": False}
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if tc.deepspeed_config is not None:
        path = Path(tc.deepspeed_config)
        if not path.is_file():
            raise ConfigError(f"TrainConfig.deepspeed_config={tc.deepspeed_config!r}: no such file")
        try:
            user = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"TrainConfig.deepspeed_config={str(path)!r}: invalid JSON ({err})"
            ) from err
        if not isinstance(user, dict):
            raise ConfigError(f"TrainConfig.deepspeed_config={str(path)!r}: expected an object")
        if "gradient_accumulation_steps" in user:
            raise ConfigError(
                f"TrainConfig.deepspeed_config={str(path)!r} sets gradient_accumulation_steps; "
                "use train.accumulate_grad_batches (Lightning passes it to DeepSpeed)"
            )
        ds = deep_merge(ds, user)
    return ds


def build_strategy(config: RunConfig) -> str | Strategy:
    """The Lightning strategy for ``config.train``.

    ``deepspeed*`` names become an :class:`AtomicDeepSpeedStrategy` (CUDA) or a
    :class:`CPUDeepSpeedStrategy` (CPU: gloo; fp32 or bf16 autocast) configured by
    :func:`deepspeed_config`; any other name (``auto``, ``ddp``, ``fsdp``, ...) passes through
    to Lightning.

    Raises:
        ConfigError: DeepSpeed on CPU with a precision other than ``32-true`` / ``bf16-mixed``
            or with optimizer offload (DeepSpeedCPUAdam needs a C++ op build), or a bad
            ``deepspeed_config``.
    """
    tc = config.train
    if tc.strategy not in _DEEPSPEED_NAMES:
        if tc.deepspeed_config is not None:
            log.warning("train.deepspeed_config is ignored with strategy=%r", tc.strategy)
        return tc.strategy
    ds_config = deepspeed_config(config)
    if not _on_cpu(tc.accelerator):
        if tc.precision in ("32-true", "32"):
            log.warning(
                "DeepSpeed on CUDA in fp32: set train.precision=bf16-mixed for bf16 matmuls "
                "(parameters and optimizer state stay fp32, see deepspeed_config)"
            )
        return AtomicDeepSpeedStrategy(config=ds_config)
    if tc.precision not in ("32-true", "32", "bf16-mixed"):
        raise ConfigError(
            f"TrainConfig.precision={tc.precision!r} with strategy={tc.strategy!r} on CPU: "
            "DeepSpeed on CPU runs 32-true or bf16-mixed (autocast) only"
        )
    if "offload_optimizer" in ds_config["zero_optimization"]:
        raise ConfigError(
            f"TrainConfig: optimizer offload (strategy={tc.strategy!r}, offload_optimizer="
            f"{tc.offload_optimizer}) needs a CUDA device; on CPU the optimizer already lives "
            "in CPU memory"
        )
    return CPUDeepSpeedStrategy(config=ds_config)
