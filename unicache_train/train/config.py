"""The run configuration: the sections a training run adds around the model and the data
(optimisation and hardware, logging, monitoring, in-loop KV compression) and :class:`RunConfig`,
the whole tree. The resolved config is written next to every checkpoint (``config.yaml``) and can
be reloaded with :meth:`RunConfig.load`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from unicache_train.compress.config import UniCacheConfig, XKVConfig
from unicache_train.compress.presets import PRESETS
from unicache_train.data.config import DataConfig
from unicache_train.model.config import ModelConfig
from unicache_train.validation import (
    ConfigBase,
    ConfigError,
    check_choice,
    check_int,
    check_range,
    deep_merge,
)

# Lightning's registered DeepSpeed names (offload variants included); ``deepspeed`` = stage 2.
DEEPSPEED_STRATEGIES = (
    "deepspeed",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
)


@dataclass
class TrainConfig(ConfigBase):
    """Optimisation, schedule, hardware and checkpointing.

    ``strategy`` is a Lightning strategy name (``auto``, ``ddp``, ``fsdp``, ...) or one of
    :data:`DEEPSPEED_STRATEGIES` (``deepspeed`` is ZeRO stage 2 unless ``deepspeed_config`` says
    otherwise). ``deepspeed_config``: a DeepSpeed JSON whose keys override our defaults (merged
    key by key). ``offload_optimizer``: ZeRO-Offload of the optimizer state to CPU (CUDA only).
    ``activation_checkpointing``: recompute each decoder block in the backward pass (see
    :mod:`unicache_train.train.strategies`). ``init_weights``: a ``.safetensors`` file of
    :class:`~unicache_train.model.Decoder` weights (our names) loaded into the model before
    training (fine-tuning an imported HF checkpoint; a resumed checkpoint overrides it).
    """

    max_steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    accumulate_grad_batches: int = 1
    precision: str = "32-true"
    accelerator: str = "auto"
    devices: int | str = 1
    num_nodes: int = 1
    strategy: str = "auto"
    deepspeed_config: str | None = None
    offload_optimizer: bool = False
    activation_checkpointing: bool = False
    val_every_n_steps: int = 50
    limit_val_batches: int = 8
    log_every_n_steps: int = 5
    checkpoint_every_n_steps: int = 100
    out_dir: str = "runs/default"
    resume: str | None = None
    init_weights: str | None = None
    seed: int = 42
    progress_bar: bool = True

    def __post_init__(self) -> None:
        check_int(self, "max_steps", 1)
        check_range(self, "lr", 0, 10, lo_open=True)
        check_range(self, "min_lr_ratio", 0, 1)
        check_int(self, "warmup_steps", 0)
        check_range(self, "weight_decay", 0, 10)
        check_range(self, "beta1", 0, 1, hi_open=True)
        check_range(self, "beta2", 0, 1, hi_open=True)
        check_range(self, "grad_clip", 0)
        check_int(self, "accumulate_grad_batches", 1)
        check_choice(
            self, "precision", ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "64-true")
        )
        check_int(self, "num_nodes", 1)
        if not (self.devices == "auto" or (isinstance(self.devices, int) and self.devices >= 1)):
            raise ConfigError(
                f"TrainConfig.devices={self.devices!r}: expected an integer >= 1 or 'auto'"
            )
        if not isinstance(self.strategy, str) or not self.strategy:
            raise ConfigError(f"TrainConfig.strategy={self.strategy!r}: expected a strategy name")
        if self.strategy.startswith("deepspeed"):
            check_choice(self, "strategy", DEEPSPEED_STRATEGIES)
        ds_config = self.deepspeed_config
        if ds_config is not None and (
            not isinstance(ds_config, str) or not ds_config.endswith(".json")
        ):
            raise ConfigError(
                f"TrainConfig.deepspeed_config={self.deepspeed_config!r}: expected None or the "
                "path of a DeepSpeed JSON config (*.json)"
            )
        for name in ("offload_optimizer", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"TrainConfig.{name}={getattr(self, name)!r}: expected a bool")
        if self.init_weights is not None and (
            not isinstance(self.init_weights, str) or not self.init_weights.endswith(".safetensors")
        ):
            raise ConfigError(
                f"TrainConfig.init_weights={self.init_weights!r}: expected None or the path of "
                "a .safetensors file of Decoder weights"
            )
        check_int(self, "val_every_n_steps", 1)
        check_int(self, "limit_val_batches", 0)
        check_int(self, "log_every_n_steps", 1)
        check_int(self, "checkpoint_every_n_steps", 1)
        check_int(self, "seed", 0)


@dataclass
class LoggingConfig(ConfigBase):
    """Experiment logging. W&B runs offline by default and never prompts for a login."""

    logger: str = "wandb"
    project: str = "unicache_train"
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        check_choice(self, "logger", ("wandb", "csv", "tensorboard", "none"))
        check_choice(self, "wandb_mode", ("offline", "online", "disabled"))


@dataclass
class MonitorConfig(ConfigBase):
    """Signal-gain and compression-quality monitoring (see :mod:`unicache_train.monitor`).

    The gain alarm is relative to the run's own start: each per-layer forward gain (and the
    composite mHC/HC mix gain) alarms, once, when it moves more than ``gain_threshold`` times
    away from the median of its first ``gain_baseline_checks`` checks.
    """

    gain: bool = True
    gain_every_n_steps: int = 50
    gain_threshold: float = 2.0
    gain_baseline_checks: int = 3
    gain_stop_after: int | None = None
    plots: bool = True
    compress_every_n_steps: int = 10

    def __post_init__(self) -> None:
        check_int(self, "gain_every_n_steps", 1)
        check_range(self, "gain_threshold", 1, lo_open=True)
        check_int(self, "gain_baseline_checks", 1)
        if self.gain_stop_after is not None:
            check_int(self, "gain_stop_after", 1)
        check_int(self, "compress_every_n_steps", 1)


COMPRESS_METHODS = ("unicache", "xkv", "unicache+xkv", "none")


@dataclass
class CompressionTrainConfig(ConfigBase):
    """KV compression inside the training loop (docs/architecture.md#in-loop-semantics).

    When ``enabled``, every training step splits each sample at ``s``: tokens ``[0, s)`` are
    prefilled, their K/V are compressed at every layer, and tokens ``[s, T)`` attend to the
    compressed cache (one parallel forward, see :mod:`unicache_train.inloop`).

    Attributes:
        enabled: run the in-loop path (off: the plain causal-LM step, unchanged).
        method: ``"unicache"`` (:class:`~unicache_train.compress.UniCacheCompressor`),
            ``"xkv"`` (cross-layer SVD, :class:`~unicache_train.compress.xkv.XKVCompressor`),
            ``"unicache+xkv"`` (UniCache token compression per layer group, then cross-layer
            SVD of the kept entries; UniCache's head merging and quantization are switched off
            there, see :mod:`unicache_train.compress.xkv`) or ``"none"`` (the identity
            compressor: same splits and loss, nothing compressed; the A/B control).
        preset: the UniCache preset (:mod:`unicache_train.compress.presets`): ``unicache``
            when it is not given, and the base that a mapping's ``unicache`` overrides are merged
            onto (YAML, ``compress.unicache.target_rate=0.5``: :meth:`complete_mapping`).
        unicache: the UniCache configuration (None: the preset's); always a
            :class:`UniCacheConfig` after validation (saved in full next to checkpoints).
        xkv: the xKV configuration (:class:`~unicache_train.compress.config.XKVConfig`), used by
            the methods ``xkv`` and ``unicache+xkv``.
        split: ``"data"``: the data's split (``batch["split"]``, e.g. the answer of a recall
            prompt) where it is >= 0, else a random one; ``"random"``: always random.
        min_context: smallest random split (context tokens); random splits are drawn uniformly
            in ``[min_context, L - 1)`` per sample, ``L`` the sample's length without padding,
            seeded by ``(seed, step)`` so a step is reproducible.
        seed: seed of the random splits.
        loss_on: ``"continuation"``: LM loss on the targets from position ``split - 1`` on (the
            first continuation token is predicted there); ``"all"``: every target.
        kl_weight: weight of ``KL(uncompressed || compressed)`` on continuation positions (the
            uncompressed logits come from the same model without gradient; 0 skips that
            forward).
        kl_temperature: softmax temperature of both distributions (the term is scaled by
            ``T^2`` so its gradient does not shrink with the temperature).
        curriculum_steps: the compressor's ``rate_scale`` rises linearly from 0 to
            ``unicache.rate_scale`` over this many optimizer steps (0: full rate from the start).
        val_compressed: also report validation perplexity through the compressed cache
            (``val/ppl_compressed``, ``compress/ppl_delta``).
        attention_scorer: the fitted attention scorer's file (``unicache.selection.method ==
            "attention"``: :mod:`unicache_train.compress.attention_scorer`, fitted on a frozen
            backbone by :mod:`unicache_train.train.scorer_fit`); read when the compressor is
            built, kept fixed in training.
    """

    enabled: bool = False
    method: str = "unicache"
    preset: str = "default"
    unicache: UniCacheConfig | None = None
    xkv: XKVConfig = field(default_factory=XKVConfig)
    split: str = "data"
    min_context: int = 16
    seed: int = 0
    loss_on: str = "continuation"
    kl_weight: float = 0.0
    kl_temperature: float = 1.0
    curriculum_steps: int = 0
    val_compressed: bool = True
    attention_scorer: str | None = None

    @classmethod
    def complete_mapping(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A mapping's ``unicache`` overrides merged onto its ``preset`` (the preset's settings
        survive an override of one field), before the section is built."""
        preset = data.get("preset", "default")
        if isinstance(data.get("unicache"), dict) and preset in PRESETS:
            data["unicache"] = deep_merge(PRESETS[preset]().to_dict(), data["unicache"])
        return data

    def __post_init__(self) -> None:
        for name in ("enabled", "val_compressed"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"CompressionTrainConfig.{name}={getattr(self, name)!r}: expected a bool"
                )
        check_choice(self, "method", COMPRESS_METHODS)
        check_choice(self, "preset", tuple(PRESETS))
        check_choice(self, "split", ("data", "random"))
        check_int(self, "min_context", 1, 1 << 20)
        check_int(self, "seed", 0)
        check_choice(self, "loss_on", ("continuation", "all"))
        check_range(self, "kl_weight", 0, 1000)
        check_range(self, "kl_temperature", 0, 100, lo_open=True)
        check_int(self, "curriculum_steps", 0)
        if self.unicache is None:
            self.unicache = PRESETS[self.preset]()
        for name, cls in (("unicache", UniCacheConfig), ("xkv", XKVConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(
                    f"CompressionTrainConfig.{name}={getattr(self, name)!r}: expected a "
                    f"{cls.__name__} (a mapping of overrides goes through "
                    "CompressionTrainConfig.from_dict)"
                )
        # (The 'attention' selection's need for a scorer is checked where it is built, by
        # inloop.build_compressor: a serving side passes the scorer object instead of a file.)
        if self.attention_scorer is not None and self.unicache.selection.method != "attention":
            raise ConfigError(
                f"CompressionTrainConfig.attention_scorer={self.attention_scorer!r} is not "
                "allowed with unicache.selection.method="
                f"{self.unicache.selection.method!r}; only the 'attention' selection reads it"
            )
        if self.method == "unicache+xkv" and self.xkv.gradient != "exact":
            raise ConfigError(
                f"CompressionTrainConfig.xkv.gradient={self.xkv.gradient!r} is not allowed with "
                "method 'unicache+xkv'; choose 'exact'"
            )


@dataclass
class RunConfig(ConfigBase):
    """The whole run: model, data, training, logging, monitoring and in-loop KV compression."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    compress: CompressionTrainConfig = field(default_factory=CompressionTrainConfig)

    #: Sections are named by their keys in errors (``unknown field(s) [...] in model``).
    config_path: ClassVar[str | None] = ""
