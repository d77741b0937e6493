"""Vision-language training: the run config, the LightningModule and ``fit`` for a
:class:`~unicache_train.model.vlm.VisionLanguageModel`.

:class:`VLMModule` is :class:`~unicache_train.train.module.LMModule` with another model and
batches that carry images: it overrides only ``build_model`` and ``model_forward``, so
the in-loop compression (per-sample splits, loss on the continuation, KL to the uncompressed
forward, rate curriculum), validation perplexity, checkpointing and the optimizer groups are the
text path's, unchanged. Validation adds the teacher-forced exact match of the answer per task
type (``val/answer_acc/<task>``: every answer token is the argmax given the gold prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch

from unicache_train.data.multimodal import MultimodalDataConfig, MultimodalDataModule
from unicache_train.data.scenes import TASKS
from unicache_train.inloop import IGNORE_INDEX
from unicache_train.model.config import ModelConfig
from unicache_train.model.vision import VisionConfig
from unicache_train.model.vlm import VisionLanguageModel
from unicache_train.train.config import (
    CompressionTrainConfig,
    LoggingConfig,
    MonitorConfig,
    TrainConfig,
)
from unicache_train.train.module import LMModule
from unicache_train.validation import ConfigBase, ConfigError
from unicache_train.validation import build_config as _build

__all__ = [
    "VLMRunConfig",
    "VLMModule",
    "fit_vlm",
    "check_vocab",
    "load_vlm_checkpoint",
    "answer_exact_match",
]

_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "vision": VisionConfig,
    "data": MultimodalDataConfig,
    "train": TrainConfig,
    "logging": LoggingConfig,
    "monitor": MonitorConfig,
    "compress": CompressionTrainConfig,
}


@dataclass
class VLMRunConfig(ConfigBase):
    """A vision-language run: :class:`~unicache_train.train.config.RunConfig`'s sections with a
    ``vision`` section and multimodal ``data`` (:class:`MultimodalDataConfig`).

    ``to_dict``, ``save`` and ``load`` (YAML + ``section.field=value`` overrides) are
    :class:`~unicache_train.validation.ConfigBase`'s; ``from_dict`` builds each section itself
    (the vision and multimodal data configs validate nested mappings on their own).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    data: MultimodalDataConfig = field(default_factory=MultimodalDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    compress: CompressionTrainConfig = field(default_factory=CompressionTrainConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"VLMRunConfig.{name}: expected a {cls.__name__} (a mapping)")
        sc = self.data.scenes
        if self.data.source == "synthetic" and sc.image_size != self.vision.image_size:
            raise ConfigError(
                f"data.scenes.image_size={sc.image_size} must equal vision.image_size="
                f"{self.vision.image_size} (the tower's input size)"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> VLMRunConfig:
        """Build from a nested mapping; unknown sections or fields raise naming them."""
        data = dict(data or {})
        unknown = sorted(set(data) - set(_SECTIONS))
        if unknown:
            raise ConfigError(f"unknown section(s) {unknown}; known: {sorted(_SECTIONS)}")
        kwargs = {
            name: _build(_SECTIONS[name], value, name) if isinstance(value, dict) else value
            for name, value in data.items()
        }
        return cls(**kwargs)


def answer_exact_match(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Teacher-forced exact match per row: every labelled target is the argmax.

    Args:
        logits: [B, T, V]; labels: [B, T] (-100 = not scored).

    Returns:
        [B] bool (False for rows without labels).
    """
    scored = labels != IGNORE_INDEX
    hit = (logits.argmax(-1) == labels) | ~scored
    return hit.all(1) & scored.any(1)


class VLMModule(LMModule):
    """:class:`LMModule` for a :class:`VisionLanguageModel` (see the module docstring)."""

    def __init__(self, config: VLMRunConfig | dict[str, Any]) -> None:
        if isinstance(config, dict):
            config = VLMRunConfig.from_dict(config)
        super().__init__(config)  # type: ignore[arg-type]  # duck-typed RunConfig

    def build_model(self) -> VisionLanguageModel:
        model = VisionLanguageModel(self.config.model, self.config.vision)
        path = self.config.vision.init_weights
        if path is not None:  # a pretrained tower (a resumed run's checkpoint overrides it)
            from safetensors.torch import load_file

            if not Path(path).is_file():
                raise FileNotFoundError(f"VisionConfig.init_weights={path!r}: no such file")
            model.vision_tower.load_state_dict(load_file(path), strict=True)
        return model

    def _load_init_weights(self, path: str) -> None:
        """Start from a text decoder's (or a whole VLM's) ``.safetensors`` weights: every decoder
        tensor must load; only the vision tower and the projector may be missing."""
        from safetensors.torch import load_file

        if not Path(path).is_file():
            raise FileNotFoundError(f"TrainConfig.init_weights={path!r}: no such file")
        state = load_file(path)
        if self.config.model.tie_word_embeddings and "embed_tokens.weight" in state:
            state.setdefault("lm_head.weight", state["embed_tokens.weight"])
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith(("vision_tower.", "projector."))]
        if missing or unexpected:
            raise RuntimeError(
                f"TrainConfig.init_weights={path!r} does not fit the decoder: missing {missing}, "
                f"unexpected {unexpected}"
            )

    def model_forward(self, batch: dict[str, torch.Tensor], **kwargs):
        return self.model(
            batch["input_ids"],
            pixel_values=batch.get("pixel_values"),
            image_mask=batch.get("image_mask"),
            modality_ids=batch.get("modality_ids"),
            **kwargs,
        )

    # ---------------------------------------------------------------------------- validation
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = super().forward(batch)
        # NOTE: kept for validation_step, which scores the logits LMModule's step computed
        # (one forward per validation batch instead of two).
        self._last_logits = logits.detach()
        return logits

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self._val_acc = torch.zeros(2, len(TASKS), device=self.device)  # correct, total

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        task = batch.get("task_ids")
        if task is None:
            return
        em = answer_exact_match(self._last_logits, batch["labels"]).float()
        known = task >= 0
        idx = task.clamp_min(0)
        self._val_acc[0].index_add_(0, idx[known], em[known])
        self._val_acc[1].index_add_(0, idx[known], torch.ones_like(em[known]))

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        acc = self._val_acc
        if self.trainer.world_size > 1:
            acc = self.trainer.strategy.reduce(acc, reduce_op="sum")
        for i, task in enumerate(TASKS):
            if acc[1, i] > 0:
                self.log(f"val/answer_acc/{task}", acc[0, i] / acc[1, i], sync_dist=False)
        if acc[1].sum() > 0:
            self.log("val/answer_acc", acc[0].sum() / acc[1].sum(), prog_bar=True, sync_dist=False)


def check_vocab(config: VLMRunConfig, tokenizer) -> None:
    """The model's embedding table must cover the tokenizer's ids."""
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"ModelConfig.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer!r}, data.tokenizer={config.data.tokenizer!r}); set "
            f"model.vocab_size={tokenizer.vocab_size}"
        )


def fit_vlm(config: VLMRunConfig, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    """Train (or resume) a vision-language model as the config says; return the Trainer."""
    from unicache_train.train.run import (
        apply_launcher_env,
        build_trainer,
        finish_wandb,
        preflight,
        resolve_resume,
    )
    from unicache_train.train.strategies import parallelize_model

    config = apply_launcher_env(config)  # type: ignore[arg-type]
    L.seed_everything(config.train.seed, workers=True, verbose=False)
    preflight(config)  # type: ignore[arg-type]
    ckpt_path = resolve_resume(config)  # type: ignore[arg-type]
    vc = config.vision
    datamodule = MultimodalDataModule(config.data, vc.image_size, vc.num_patches)
    check_vocab(config, datamodule.tokenizer)
    module = VLMModule(config)
    parallelize_model(module.model, config)  # type: ignore[arg-type]
    trainer = build_trainer(config, callbacks)  # type: ignore[arg-type]
    if trainer.is_global_zero:
        config.save(Path(config.train.out_dir) / "config.yaml")
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    finally:
        finish_wandb()
    return trainer


def load_vlm_checkpoint(
    path: str | Path, map_location: str = "cpu"
) -> tuple[VisionLanguageModel, VLMRunConfig]:
    """A :class:`VisionLanguageModel` (eval mode) and its config from a ``.ckpt`` of
    :func:`fit_vlm` (the resolved config travels in ``hyper_parameters["config"]``)."""
    from unicache_train.checkpoint.safe_load import load_torch_file

    path = Path(path)
    ckpt = load_torch_file(path, map_location=map_location)  # plain data only: runs no code
    hparams = ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {}
    if "config" not in hparams or "vision" not in hparams["config"]:
        raise ValueError(f"{path}: not a vision-language checkpoint (no config.vision)")
    config = VLMRunConfig.from_dict(hparams["config"])
    model = VisionLanguageModel(config.model, config.vision)
    state = {
        k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")
    }
    model.load_state_dict(state)
    model.eval()
    return model, config
