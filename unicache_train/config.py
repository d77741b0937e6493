"""Typed, validated run configuration.

Every knob of a run lives in this tree of dataclasses. Field names follow the inference stack
(HF transformers: ``hidden_size``, ``num_key_value_heads``, ``hc_mult``, ...), so import and export
are near-identity maps. Each dataclass validates itself in ``__post_init__`` and raises
:class:`ConfigError` naming the field, the offending value and the allowed range.

The resolved config is written next to every checkpoint (``config.yaml``) and can be reloaded
with :meth:`RunConfig.load`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from unicache_train.compress.config import UniCacheConfig, XKVConfig

__all__ = [
    "ConfigError",
    "load_yaml",
    "ModelConfig",
    "DataConfig",
    "SyntheticDataConfig",
    "TrainConfig",
    "LoggingConfig",
    "MonitorConfig",
    "CompressionTrainConfig",
    "RunConfig",
]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, value and allowed range."""


# --------------------------------------------------------------------------------- YAML
class _YAMLLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads every usual number notation as a number.

    PyYAML implements YAML 1.1, whose float pattern needs a dot and a signed exponent: ``1e-4``,
    ``1E-4``, ``1e4`` and ``-.5`` come back as *strings* there (then refused as "expected a
    number"). YAML 1.2 and every other parser read them as floats; so do we.
    """


_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?)$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse YAML text (a config file or one ``section.field=value`` override's value) with
    :class:`_YAMLLoader`: ``1e-4``, ``1E-4``, ``.5``, ``-.5``, ``1_000`` are numbers."""
    return yaml.load(text, Loader=_YAMLLoader)  # noqa: S506 (a SafeLoader subclass)


# --------------------------------------------------------------------------------- validators
def _interval(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    """The allowed range as text: ``[0, 1)``, ``(0, inf)``."""
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    lo_s = "-inf" if lo is None else lo
    hi_s = "inf" if hi is None else hi
    return f"{left}{lo_s}, {hi_s}{right}"


def _range(
    obj: Any,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open=False,
    hi_open=False,
) -> None:
    """``getattr(obj, name)`` must be a finite number in the range (inf and NaN are refused:
    no config field of ours means anything at infinity)."""
    value = getattr(obj, name)
    cls = type(obj).__name__
    allowed = _interval(lo, hi, lo_open, hi_open)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"{cls}.{name}={value!r}: expected a number in {allowed}, got {type(value).__name__}"
        )
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if not math.isfinite(value) or bad_lo or bad_hi:
        raise ConfigError(f"{cls}.{name}={value!r} is out of range; allowed {allowed}")


def _int(obj: Any, name: str, lo: int | None = None, hi: int | None = None) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{type(obj).__name__}.{name}={value!r}: expected an integer in "
            f"{_interval(lo, hi, False, False)}"
        )
    _range(obj, name, lo, hi)


def _choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ConfigError(
            f"{type(obj).__name__}.{name}={value!r} is not allowed; choose one of {list(choices)}"
        )


RESIDUAL_MODES = ("residual", "mhc", "hc")
#: ModelConfig.hc_mult's default (deepseek_v4's): the streams of an mHC model unless set.
HC_MULT_DEFAULT = 4
HC_PRESETS = ("deepseek_v4", "paper")
ATTENTION_TYPES = ("gqa", "mla")
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
class ModelConfig:
    """Decoder architecture (HF field names).

    ``residual_mode`` selects the residual connection: ``residual`` (plain pre-norm), ``mhc``
    (manifold-constrained hyper-connections, arXiv 2512.24880, with ``hc_preset``) or ``hc``
    (unconstrained Hyper-Connections, arXiv 2409.19606, kept for comparisons). ``hc_mult`` is the
    number of residual streams; ``hc_mult=1`` is the plain residual.
    """

    vocab_size: int = 260
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    attention_bias: bool = False
    # Qwen3: RMSNorm over head_dim of each query/key head before RoPE (``q_norm``/``k_norm``).
    qk_norm: bool = False
    attention_type: str = "gqa"
    # Hyper-connections (names as in transformers' deepseek_v4).
    residual_mode: str = "residual"
    hc_mult: int = HC_MULT_DEFAULT
    hc_preset: str = "deepseek_v4"
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hc_init: str = "default"
    # MLA (names as in transformers' deepseek_v3); used when attention_type == "mla".
    q_lora_rank: int | None = None
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32

    def __post_init__(self) -> None:
        _int(self, "vocab_size", 2)
        _int(self, "hidden_size", 1)
        _int(self, "intermediate_size", 1)
        _int(self, "num_hidden_layers", 1)
        _int(self, "num_attention_heads", 1)
        _int(self, "num_key_value_heads", 1, self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"ModelConfig.num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"ModelConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; set head_dim explicitly"
            )
        if self.head_dim is not None:
            _int(self, "head_dim", 2)
        if self.head_size % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_size} must be even (RoPE pairs)")
        _int(self, "max_position_embeddings", 1)
        _range(self, "rope_theta", 0, lo_open=True)
        _range(self, "rms_norm_eps", 0, 1, lo_open=True)
        _range(self, "initializer_range", 0, 1, lo_open=True)
        _choice(self, "attention_type", ATTENTION_TYPES)
        if not isinstance(self.qk_norm, bool):
            raise ConfigError(f"ModelConfig.qk_norm={self.qk_norm!r}: expected a bool")
        if self.qk_norm and self.attention_type == "mla":
            raise ConfigError(
                "ModelConfig.qk_norm=True is a GQA option (Qwen3's per-head q_norm/k_norm); "
                "not allowed with attention_type='mla'"
            )
        _choice(self, "residual_mode", RESIDUAL_MODES)
        _int(self, "hc_mult", 1, 64)
        if self.residual_mode == "residual" and self.hc_mult not in (1, HC_MULT_DEFAULT):
            # NOTE: the default (4) stays valid with a plain residual: every saved config of a
            # plain model carries it. Any other value was meant to widen the residual.
            raise ConfigError(
                f"ModelConfig.hc_mult={self.hc_mult} has no effect with residual_mode='residual' "
                "(a plain residual has one stream); set residual_mode to 'mhc' or 'hc' for "
                f"{self.hc_mult} streams, or hc_mult to 1"
            )
        _choice(self, "hc_preset", HC_PRESETS)
        _int(self, "hc_sinkhorn_iters", 1, 1000)
        _range(self, "hc_eps", 0, 1)
        _choice(self, "hc_init", ("default", "identity"))
        if self.q_lora_rank is not None:
            _int(self, "q_lora_rank", 1)
        _int(self, "kv_lora_rank", 1)
        _int(self, "qk_nope_head_dim", 0)
        _int(self, "qk_rope_head_dim", 2)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"ModelConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        _int(self, "v_head_dim", 1)

    @property
    def head_size(self) -> int:
        """Attention head dim: ``head_dim`` if set, else ``hidden_size // num_attention_heads``.

        ``head_dim`` stays ``None`` when derived so that changing ``hidden_size`` (e.g. from the
        command line) re-derives it.
        """
        return (
            self.head_dim
            if self.head_dim is not None
            else (self.hidden_size // self.num_attention_heads)
        )

    @property
    def uses_streams(self) -> bool:
        """True when the residual is widened to ``hc_mult`` streams (mHC or HC with n > 1)."""
        return self.residual_mode != "residual" and self.hc_mult > 1


@dataclass
class SyntheticDataConfig:
    """The bundled synthetic corpus: grammar stories and key-value recall prompts.

    See :mod:`unicache_train.data.synthetic`. Stories have ``story_min_sentences`` to
    ``story_max_sentences`` sentences (~50 bytes each; defaults give 330-770 bytes). A recall
    record has about ``11.7 * recall_num_facts + 40 * recall_num_filler + 24.6 *
    recall_num_questions`` bytes (defaults: 200-255, within ``seq_len = 256`` byte tokens).
    """

    seed: int = 1234
    num_stories: int = 2000
    num_recall: int = 2000
    recall_num_facts: int = 12
    recall_num_questions: int = 2
    recall_num_filler: int = 1
    story_min_sentences: int = 8
    story_max_sentences: int = 14

    def __post_init__(self) -> None:
        _int(self, "seed", 0)
        _int(self, "num_stories", 0)
        _int(self, "num_recall", 0)
        if self.num_stories + self.num_recall == 0:
            raise ConfigError("SyntheticDataConfig: num_stories + num_recall must be >= 1")
        _int(self, "recall_num_facts", 1, 10_000)
        _int(self, "recall_num_questions", 1, self.recall_num_facts)
        _int(self, "recall_num_filler", 0, 10_000)
        _int(self, "story_min_sentences", 4, 1000)
        _int(self, "story_max_sentences", self.story_min_sentences, 1000)


@dataclass
class DataConfig:
    """Where the tokens come from and how they are batched.

    ``source`` is ``"synthetic"`` (the bundled corpus, no download) or a path / glob / list of
    local ``.txt``, ``.jsonl``/``.json`` or ``.parquet`` files read with HF ``datasets``.
    ``tokenizer`` is ``"byte"`` (byte-level, needs no files) or a local HF tokenizer directory.
    ``.txt`` files give one document per file (``text_sample_by="document"``), per line or per
    blank-line separated paragraph.

    ``pack=False`` keeps one record per row; records with a ``split_char`` column (the synthetic
    recall prompts, or a local file that has one) get the token index of their split: the first
    answer token (``split_at="answer"``) or the first question token (``split_at="question"``,
    so the question too attends to the compressed context). ``prompt_loss=False`` puts labels
    only on the continuation (``-100`` before position ``split - 1``, whose label is the first
    continuation token).
    """

    source: str | list[str] = "synthetic"
    text_field: str = "text"
    tokenizer: str = "byte"
    seq_len: int = 256
    batch_size: int = 8
    val_fraction: float = 0.05
    pack: bool = True
    num_workers: int = 0
    seed: int = 0
    text_sample_by: str = "document"
    split_at: str = "answer"
    prompt_loss: bool = True
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("DataConfig.source is empty; use 'synthetic' or a path/glob")
        if isinstance(self.source, (list, tuple)):
            bad = [s for s in self.source if not isinstance(s, str) or not s]
            if bad:
                raise ConfigError(
                    f"DataConfig.source={self.source!r}: every entry must be a non-empty path "
                    f"or glob string; bad entries: {bad!r}"
                )
            self.source = list(self.source)
        elif not isinstance(self.source, str):
            raise ConfigError(
                f"DataConfig.source={self.source!r}: expected 'synthetic', a path/glob or a list"
            )
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(f"DataConfig.text_field={self.text_field!r}: expected a column name")
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError(
                f"DataConfig.tokenizer={self.tokenizer!r}: expected 'byte' or a local directory"
            )
        _int(self, "seq_len", 2, 1 << 20)
        _int(self, "batch_size", 1)
        _range(self, "val_fraction", 0, 1, hi_open=True)
        _int(self, "num_workers", 0, 256)
        _int(self, "seed", 0)
        _choice(self, "text_sample_by", ("document", "line", "paragraph"))
        _choice(self, "split_at", ("answer", "question"))
        if not isinstance(self.prompt_loss, bool):
            raise ConfigError(f"DataConfig.prompt_loss={self.prompt_loss!r}: expected a bool")


@dataclass
class TrainConfig:
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
        _int(self, "max_steps", 1)
        _range(self, "lr", 0, 10, lo_open=True)
        _range(self, "min_lr_ratio", 0, 1)
        _int(self, "warmup_steps", 0)
        _range(self, "weight_decay", 0, 10)
        _range(self, "beta1", 0, 1, hi_open=True)
        _range(self, "beta2", 0, 1, hi_open=True)
        _range(self, "grad_clip", 0)
        _int(self, "accumulate_grad_batches", 1)
        _choice(
            self, "precision", ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "64-true")
        )
        _int(self, "num_nodes", 1)
        if not (self.devices == "auto" or (isinstance(self.devices, int) and self.devices >= 1)):
            raise ConfigError(
                f"TrainConfig.devices={self.devices!r}: expected an integer >= 1 or 'auto'"
            )
        if not isinstance(self.strategy, str) or not self.strategy:
            raise ConfigError(f"TrainConfig.strategy={self.strategy!r}: expected a strategy name")
        if self.strategy.startswith("deepspeed"):
            _choice(self, "strategy", DEEPSPEED_STRATEGIES)
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
        _int(self, "val_every_n_steps", 1)
        _int(self, "limit_val_batches", 0)
        _int(self, "log_every_n_steps", 1)
        _int(self, "checkpoint_every_n_steps", 1)
        _int(self, "seed", 0)


@dataclass
class LoggingConfig:
    """Experiment logging. W&B runs offline by default and never prompts for a login."""

    logger: str = "wandb"
    project: str = "unicache_train"
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        _choice(self, "logger", ("wandb", "csv", "tensorboard", "none"))
        _choice(self, "wandb_mode", ("offline", "online", "disabled"))


@dataclass
class MonitorConfig:
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
        _int(self, "gain_every_n_steps", 1)
        _range(self, "gain_threshold", 1, lo_open=True)
        _int(self, "gain_baseline_checks", 1)
        if self.gain_stop_after is not None:
            _int(self, "gain_stop_after", 1)
        _int(self, "compress_every_n_steps", 1)


COMPRESS_METHODS = ("unicache", "xkv", "unicache+xkv", "none")


@dataclass
class CompressionTrainConfig:
    """KV compression inside the training loop (docs/architecture.md#in-loop-semantics).

    When ``enabled``, every training step splits each sample at ``s``: tokens ``[0, s)`` are
    prefilled, their K/V are compressed at every layer, and tokens ``[s, T)`` attend to the
    compressed cache (one parallel forward, see :mod:`unicache_train.train.compression`).

    Attributes:
        enabled: run the in-loop path (off: the plain causal-LM step, unchanged).
        method: ``"unicache"`` (:class:`~unicache_train.compress.UniCacheCompressor`),
            ``"xkv"`` (cross-layer SVD, :class:`~unicache_train.compress.xkv.XKVCompressor`),
            ``"unicache+xkv"`` (UniCache token compression per layer group, then cross-layer
            SVD of the kept entries; UniCache's head merging and quantization are switched off
            there, see :mod:`unicache_train.compress.xkv`) or ``"none"`` (the identity
            compressor: same splits and loss, nothing compressed; the A/B control).
        preset: UniCache preset the ``unicache`` overrides apply to (see
            :mod:`unicache_train.compress.presets`).
        unicache: the UniCache configuration. A mapping (YAML) is deep-merged onto ``preset``;
            a :class:`UniCacheConfig` is used as is; None is the preset. Always a resolved
            :class:`UniCacheConfig` after validation (saved in full next to checkpoints).
        xkv: the xKV configuration (:class:`~unicache_train.compress.config.XKVConfig`): a
            mapping (YAML) of overrides of its defaults, an ``XKVConfig``, or None (the
            defaults). Always a resolved ``XKVConfig`` after validation; used by the methods
            ``xkv`` and ``unicache+xkv``.
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
    """

    enabled: bool = False
    method: str = "unicache"
    preset: str = "default"
    # NOTE: mapping first, so a parser reading this annotation (jsonargparse) keeps a YAML/JSON
    # mapping as a mapping, which is then merged onto the preset instead of replacing it.
    unicache: dict[str, Any] | UniCacheConfig | None = None
    xkv: dict[str, Any] | XKVConfig | None = None
    split: str = "data"
    min_context: int = 16
    seed: int = 0
    loss_on: str = "continuation"
    kl_weight: float = 0.0
    kl_temperature: float = 1.0
    curriculum_steps: int = 0
    val_compressed: bool = True

    def __post_init__(self) -> None:
        # NOTE: imported here: compress/config.py builds on this module's validators.
        from unicache_train.compress.config import UniCacheConfig, XKVConfig
        from unicache_train.compress.presets import PRESETS

        for name in ("enabled", "val_compressed"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"CompressionTrainConfig.{name}={getattr(self, name)!r}: expected a bool"
                )
        _choice(self, "method", COMPRESS_METHODS)
        _choice(self, "preset", tuple(PRESETS))
        _choice(self, "split", ("data", "random"))
        _int(self, "min_context", 1, 1 << 20)
        _int(self, "seed", 0)
        _choice(self, "loss_on", ("continuation", "all"))
        _range(self, "kl_weight", 0, 1000)
        _range(self, "kl_temperature", 0, 100, lo_open=True)
        _int(self, "curriculum_steps", 0)
        if self.unicache is None or isinstance(self.unicache, dict):
            base = PRESETS[self.preset]().to_dict()
            self.unicache = UniCacheConfig.from_dict(deep_merge(base, self.unicache or {}))
        elif not isinstance(self.unicache, UniCacheConfig):
            raise ConfigError(
                f"CompressionTrainConfig.unicache={self.unicache!r}: expected a mapping or a "
                "UniCacheConfig"
            )
        if self.xkv is None or isinstance(self.xkv, dict):
            self.xkv = XKVConfig.from_dict(self.xkv or {})
        elif not isinstance(self.xkv, XKVConfig):
            raise ConfigError(
                f"CompressionTrainConfig.xkv={self.xkv!r}: expected a mapping or an XKVConfig"
            )
        if self.method == "unicache+xkv" and self.xkv.gradient != "exact":
            raise ConfigError(
                f"CompressionTrainConfig.xkv.gradient={self.xkv.gradient!r} is not allowed with "
                "method 'unicache+xkv'; choose 'exact'"
            )


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``, recursing into nested mappings."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


@dataclass
class RunConfig:
    """The whole run: model, data, training, logging, monitoring and in-loop KV compression."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    compress: CompressionTrainConfig = field(default_factory=CompressionTrainConfig)

    # ----------------------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        return _build(cls, data or {}, "")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        return path

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | None = None) -> RunConfig:
        """Read a YAML config and apply ``section.field=value`` overrides."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        data = load_yaml(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
        apply_overrides(data, overrides or [])
        return cls.from_dict(data)


def pop_config_path(args: list[str], default: str | Path) -> tuple[Path, list[str]]:
    """Split ``--config FILE.yaml`` off command-line arguments.

    Returns:
        (the YAML path, ``default`` when the flag is absent; the other arguments).
    """
    rest = list(args)
    path = Path(default)
    if "--config" in rest:
        i = rest.index("--config")
        if i + 1 >= len(rest):
            raise ConfigError("--config needs a YAML path")
        path = Path(rest[i + 1])
        del rest[i : i + 2]
    return path, rest


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML, :func:`load_yaml`) to a nested
    dict in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        node = data
        parts = key.lstrip("-").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = load_yaml(raw)
    return data


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys with a clear message."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = prefix or "the config"
        raise ConfigError(f"unknown field(s) {unknown} in {where}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        sub = _SUBCONFIGS.get((cls, name))
        if sub is not None and isinstance(value, dict):
            value = _build(sub, value, f"{prefix}.{name}".strip("."))
        kwargs[name] = value
    return cls(**kwargs)


_SUBCONFIGS: dict[tuple[type, str], type] = {
    (RunConfig, "model"): ModelConfig,
    (RunConfig, "data"): DataConfig,
    (RunConfig, "train"): TrainConfig,
    (RunConfig, "logging"): LoggingConfig,
    (RunConfig, "compress"): CompressionTrainConfig,
    (RunConfig, "monitor"): MonitorConfig,
    (DataConfig, "synthetic"): SyntheticDataConfig,
}
