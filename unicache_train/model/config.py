"""The decoder's configuration: typed, validated, with HF transformers' field names.

Field names follow the inference stack (``hidden_size``, ``num_key_value_heads``, ``hc_mult``,
...), so import and export are near-identity maps. Each dataclass validates itself in
``__post_init__`` and raises :class:`~unicache_train.validation.ConfigError` naming the field, the
offending value and the allowed range. Imports nothing of the compressors or of training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unicache_train.validation import (
    ConfigBase,
    ConfigError,
    build_config,
    check_bool,
    check_choice,
    check_int,
    check_range,
)

RESIDUAL_MODES = ("residual", "mhc", "hc")
#: ModelConfig.hc_mult's default (deepseek_v4's): the streams of an mHC model unless set.
HC_MULT_DEFAULT = 4
HC_PRESETS = ("deepseek_v4", "paper")
ATTENTION_TYPES = ("gqa", "mla")
#: ModelConfig.layer_types entries (transformers' names): causal over every earlier token, or
#: over the last ``sliding_window`` tokens (query i sees key j iff i - window < j <= i).
LAYER_TYPES = ("full_attention", "sliding_attention")
#: ModelConfig.block_style: ``llama`` (pre-norm, RMSNorm gain w, SwiGLU) or ``gemma3`` ((1 + w)
#: RMSNorm, pre+post attention/FFN norms, tanh-GELU GeGLU, embeddings x sqrt(hidden_size)).
BLOCK_STYLES = ("llama", "gemma3")


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
#: Fields of RopeScalingConfig each rope_type reads; every other field must keep its default.
ROPE_TYPE_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
}


@dataclass
class RopeScalingConfig(ConfigBase):
    """RoPE scaling (context extension) with transformers' ``rope_parameters`` names; the maths
    is in :mod:`unicache_train.model.rope`.

    ``rope_type``:

    * ``default``: plain RoPE; no other field may be set.
    * ``linear``: position interpolation (Chen et al., arXiv 2306.15595): every frequency is
      divided by ``factor``.
    * ``dynamic``: NTK-aware scaling whose base grows with the forward's longest position once it
      passes ``max_position_embeddings`` (transformers' ``dynamic``; reads ``factor``).
    * ``llama3``: Llama 3.1's per-band scaling (``factor``, ``low_freq_factor``,
      ``high_freq_factor``, ``original_max_position_embeddings``).
    * ``yarn``: YaRN (Peng et al., arXiv 2309.00071): ``factor``,
      ``original_max_position_embeddings``, ``beta_fast``/``beta_slow`` (the ramp), and the
      attention factor (``attention_factor``, else from ``factor`` with ``mscale`` /
      ``mscale_all_dim``); an MLA model also multiplies its softmax scale by DeepSeek's
      ``mscale(factor, mscale_all_dim)^2``.

    Attributes:
        original_max_position_embeddings: the pre-training context (llama3, yarn); None means
            :attr:`ModelConfig.max_position_embeddings` (transformers' default).
        mscale, mscale_all_dim: YaRN's DeepSeek-style magnitude scales; transformers reads them
            by truth value (None and 0 both mean unset).
        truncate: YaRN rounds its correction range outward (floor / ceil), transformers' default.
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        check_choice(self, "rope_type", ROPE_TYPES)
        used = ROPE_TYPE_FIELDS[self.rope_type]
        for name, f in RopeScalingConfig.__dataclass_fields__.items():
            if name == "rope_type" or name in used or getattr(self, name) == f.default:
                continue
            users = [t for t, names in ROPE_TYPE_FIELDS.items() if name in names]
            raise ConfigError(
                f"RopeScalingConfig.{name}={getattr(self, name)!r} is not read by "
                f"rope_type={self.rope_type!r} (it reads {list(used)}); {name} belongs to "
                f"rope_type {users}: set rope_type, or leave {name} at {f.default!r}"
            )
        check_range(self, "factor", 0, lo_open=True)
        if self.original_max_position_embeddings is not None:
            check_int(self, "original_max_position_embeddings", 1)
        check_range(self, "low_freq_factor", 0, lo_open=True)
        check_range(self, "high_freq_factor", 0, lo_open=True)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"RopeScalingConfig.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor} (llama3's medium band lies between them)"
            )
        check_range(self, "beta_fast", 0, lo_open=True)
        check_range(self, "beta_slow", 0, lo_open=True)
        if self.beta_fast < self.beta_slow:
            raise ConfigError(
                f"RopeScalingConfig.beta_fast={self.beta_fast} must be >= beta_slow="
                f"{self.beta_slow} (YaRN's ramp runs from beta_fast to beta_slow rotations)"
            )
        for name in ("mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                check_range(self, name, 0)
        if self.attention_factor is not None:
            check_range(self, "attention_factor", 0, lo_open=True)
        check_bool(self, "truncate")


@dataclass
class ModelConfig(ConfigBase):
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
    # RoPE scaling (linear / dynamic / llama3 / yarn); default: plain RoPE.
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
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
    # DeepSeek MoE FFN (names as in transformers' deepseek_v3; see model/moe.py). With
    # n_routed_experts = 0 every layer is dense; else layers >= first_k_dense_replace route each
    # token to num_experts_per_tok of n_routed_experts experts (+ n_shared_experts always on).
    n_routed_experts: int = 0
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int | None = None
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # Auxiliary-loss-free balancing (DeepSeek-V3, arXiv 2412.19437 sec. 2.1.2): after every
    # optimizer step e_score_correction_bias += rate * sign(mean load - load); 0 keeps it fixed.
    router_bias_update_rate: float = 0.0
    # Sliding-window attention (Mistral, Qwen2, Gemma 3; transformers' names). A layer of type
    # "sliding_attention" lets query i see key j iff i - sliding_window < j <= i. layer_types
    # None: every layer slides when sliding_window is set (Mistral), else every layer is full.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # Gemma 3 (see model/decoder.py, block_style "gemma3"). rope_local_theta: RoPE base of the
    # sliding layers (Gemma's rope_local_base_freq; None: rope_theta). query_pre_attn_scalar:
    # attention scale query_pre_attn_scalar**-0.5 (None: head_dim**-0.5). Softcaps: logits ->
    # cap * tanh(logits / cap) (None: off).
    block_style: str = "llama"
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        check_int(self, "vocab_size", 2)
        check_int(self, "hidden_size", 1)
        check_int(self, "intermediate_size", 1)
        check_int(self, "num_hidden_layers", 1)
        check_int(self, "num_attention_heads", 1)
        check_int(self, "num_key_value_heads", 1, self.num_attention_heads)
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
            check_int(self, "head_dim", 2)
        if self.head_size % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_size} must be even (RoPE pairs)")
        check_int(self, "max_position_embeddings", 1)
        check_range(self, "rope_theta", 0, lo_open=True)
        if self.rope_scaling is None:  # `rope_scaling: null`, as HF writes "no scaling"
            self.rope_scaling = RopeScalingConfig()
        if isinstance(self.rope_scaling, dict):  # ModelConfig(**config.to_dict())
            self.rope_scaling = build_config(
                RopeScalingConfig, self.rope_scaling, "ModelConfig.rope_scaling"
            )
        if not isinstance(self.rope_scaling, RopeScalingConfig):
            raise ConfigError(
                f"ModelConfig.rope_scaling={self.rope_scaling!r}: expected a RopeScalingConfig, "
                "a mapping of its fields, or None (no scaling)"
            )
        check_range(self, "rms_norm_eps", 0, 1, lo_open=True)
        check_range(self, "initializer_range", 0, 1, lo_open=True)
        check_choice(self, "attention_type", ATTENTION_TYPES)
        if not isinstance(self.qk_norm, bool):
            raise ConfigError(f"ModelConfig.qk_norm={self.qk_norm!r}: expected a bool")
        if self.qk_norm and self.attention_type == "mla":
            raise ConfigError(
                "ModelConfig.qk_norm=True is a GQA option (Qwen3's per-head q_norm/k_norm); "
                "not allowed with attention_type='mla'"
            )
        check_choice(self, "residual_mode", RESIDUAL_MODES)
        check_int(self, "hc_mult", 1, 64)
        if self.residual_mode == "residual" and self.hc_mult not in (1, HC_MULT_DEFAULT):
            # NOTE: the default (4) stays valid with a plain residual: every saved config of a
            # plain model carries it. Any other value was meant to widen the residual.
            raise ConfigError(
                f"ModelConfig.hc_mult={self.hc_mult} has no effect with residual_mode='residual' "
                "(a plain residual has one stream); set residual_mode to 'mhc' or 'hc' for "
                f"{self.hc_mult} streams, or hc_mult to 1"
            )
        check_choice(self, "hc_preset", HC_PRESETS)
        check_int(self, "hc_sinkhorn_iters", 1, 1000)
        check_range(self, "hc_eps", 0, 1)
        check_choice(self, "hc_init", ("default", "identity"))
        if self.q_lora_rank is not None:
            check_int(self, "q_lora_rank", 1)
        check_int(self, "kv_lora_rank", 1)
        check_int(self, "qk_nope_head_dim", 0)
        check_int(self, "qk_rope_head_dim", 2)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"ModelConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        check_int(self, "v_head_dim", 1)
        self._check_moe()
        self._check_window_and_style()

    def _check_window_and_style(self) -> None:
        """The sliding-window and Gemma 3 fields."""
        if self.sliding_window is not None:
            check_int(self, "sliding_window", 1)
        if self.layer_types is not None:
            if not isinstance(self.layer_types, (list, tuple)) or len(self.layer_types) != (
                self.num_hidden_layers
            ):
                raise ConfigError(
                    f"ModelConfig.layer_types={self.layer_types!r}: expected a list of "
                    f"num_hidden_layers={self.num_hidden_layers} entries from {list(LAYER_TYPES)}"
                )
            self.layer_types = list(self.layer_types)
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise ConfigError(
                    f"ModelConfig.layer_types has {bad[:3]}; allowed entries: {list(LAYER_TYPES)}"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ConfigError(
                    "ModelConfig.layer_types has 'sliding_attention' layers but sliding_window "
                    "is None; set sliding_window (the number of tokens a query sees)"
                )
        if self.sliding_window is not None and self.attention_type == "mla":
            raise ConfigError(
                f"ModelConfig.sliding_window={self.sliding_window} is a GQA option; not allowed "
                "with attention_type='mla'"
            )
        check_choice(self, "block_style", BLOCK_STYLES)
        for name in (
            "rope_local_theta",
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
        ):
            if getattr(self, name) is not None:
                check_range(self, name, 0, lo_open=True)
        if self.block_style == "gemma3":
            if not self.qk_norm:
                raise ConfigError(
                    "ModelConfig.block_style='gemma3' needs qk_norm=True (Gemma 3 normalises "
                    "every query and key head)"
                )
            if self.uses_streams or self.uses_moe or self.attention_type != "gqa":
                raise ConfigError(
                    "ModelConfig.block_style='gemma3' is a plain-residual dense GQA block; not "
                    "allowed with residual_mode/hc_mult streams, MoE layers or MLA"
                )

    def is_sliding_layer(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` attends over a sliding window of ``sliding_window``."""
        if self.sliding_window is None:
            return False
        if self.layer_types is None:
            return True
        return self.layer_types[layer_idx] == "sliding_attention"

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` in tokens, or None (full attention)."""
        return self.sliding_window if self.is_sliding_layer(layer_idx) else None

    @property
    def has_sliding_layers(self) -> bool:
        """True when at least one layer attends over a sliding window."""
        return any(self.is_sliding_layer(i) for i in range(self.num_hidden_layers))

    def _check_moe(self) -> None:
        """The MoE fields: types always, their relations when the model has routed experts."""
        check_int(self, "n_routed_experts", 0, 1 << 16)
        check_int(self, "first_k_dense_replace", 0, self.num_hidden_layers)
        check_int(self, "n_shared_experts", 0, 1 << 10)
        if self.moe_intermediate_size is not None:
            check_int(self, "moe_intermediate_size", 1)
        check_bool(self, "norm_topk_prob")
        check_range(self, "routed_scaling_factor", 0, lo_open=True)
        check_range(self, "router_bias_update_rate", 0, 1)
        check_int(self, "n_group", 1)
        check_int(self, "num_experts_per_tok", 1)
        check_int(self, "topk_group", 1, self.n_group)
        E = self.n_routed_experts
        if E == 0:
            if self.router_bias_update_rate > 0:
                raise ConfigError(
                    f"ModelConfig.router_bias_update_rate={self.router_bias_update_rate} has no "
                    "effect with n_routed_experts=0 (no router); set n_routed_experts, or the "
                    "rate to 0"
                )
            return
        check_int(self, "num_experts_per_tok", 1, E)
        if E % self.n_group:
            raise ConfigError(
                f"ModelConfig.n_group={self.n_group} must divide n_routed_experts={E} "
                "(experts are routed in equal groups)"
            )
        if E // self.n_group < 2:
            raise ConfigError(
                f"ModelConfig.n_routed_experts={E} / n_group={self.n_group} gives "
                f"{E // self.n_group} expert per group; allowed >= 2 (a group's score is the sum "
                "of its top-2 expert scores, as in DeepSeek-V3)"
            )
        reachable = self.topk_group * (E // self.n_group)
        if self.num_experts_per_tok > reachable:
            raise ConfigError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} is out of range; "
                f"allowed [1, topk_group * n_routed_experts / n_group] = [1, {reachable}] (the "
                "experts of the topk_group selected groups)"
            )

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
    def expert_intermediate_size(self) -> int:
        """Width of one routed expert: ``moe_intermediate_size``, else ``intermediate_size``."""
        if self.moe_intermediate_size is None:
            return self.intermediate_size
        return self.moe_intermediate_size

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` has the MoE FFN (DeepSeek-V3's rule)."""
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    @property
    def uses_moe(self) -> bool:
        """True when at least one layer has the MoE FFN."""
        return self.is_moe_layer(self.num_hidden_layers - 1)

    @property
    def uses_streams(self) -> bool:
        """True when the residual is widened to ``hc_mult`` streams (mHC or HC with n > 1)."""
        return self.residual_mode != "residual" and self.hc_mult > 1
