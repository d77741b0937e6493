"""Composers: a general list-of-steps compressor, the UniCache pipeline, a per-layer wrapper.

UniCache (the UniCache article's §10 skeleton; docs/architecture.md#unicache-pipeline) runs, in
this fixed order::

    fallback (on the uncompressed input) -> head merge -> importance -> layer rate
        -> modality budgets -> alignment protection -> merge/evict/keep -> quantize

The importance step is one of several scorers (``UniCacheConfig.selection``): attention sinks +
a recent window (StreamingLLM), SnapKV's pooled window attention, or a learned retention policy
(DMS-like, followed by its training gate after merge/evict); docs/compression_methods.md.

Each step is a small dataclass (its fields are its hyperparameters) acting on a shared
:class:`~unicache_train.compress.state.CompressionState`; statistics derived from K/V are
recomputed after any structural change. :class:`ComposedCompressor` takes any list of steps in
stage order, so other methods (e.g. an xKV cross-layer step) plug in as one more step.

Rate 0 (``rate_scale == 0``, or ``target_rate == 0`` with the fallback off), decided at every
call so that a curriculum can start there (``at_step``), short-circuits to the identity:
no head merging and no token removal, the input K/V tensors themselves are returned, so the
in-loop forward is bit-for-bit the plain forward. An active quantizer (bits 4/8) still
runs then: rate 0 with int8 keeps every entry but stores it in int8.

Stats on every segment (scalars, no gradient; the words are docs/architecture.md#words):
``rate_realized`` (context tokens removed, merged or evicted, / context tokens) and
``rate_realized/<modality>`` for the modalities present, ``kv_bytes`` (stored bytes of the batch
for this layer, including scales and head sharing), ``kv_reduction`` (uncompressed 16-bit bytes
/ ``kv_bytes``), ``merged_fraction`` and ``evicted_fraction`` (of context tokens),
``heads_merged`` (KV heads merged away, mean over samples), ``protected_fraction``,
``rate_target`` (mean requested layer rate), ``budget_shortfall`` (tokens the layer rate asked
for but were not removed, / context tokens: whatever withheld them, modality caps, protection or
the rule that never empties a modality), ``budget_cap_withheld`` (the part of it the modality
caps withheld, when the budget step ran) and ``complexity`` (when the fallback ran).

A compressor that falls short of its requested rate by more than :data:`SHORTFALL_WARN` of the
context warns once (:class:`RateShortfallWarning`), e.g. the default preset's text cap (0.40)
against a target of 0.6 on text.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from unicache_train.compress.attention_scorer import AttentionScore, AttentionScorer
from unicache_train.compress.budget import ModalityBudget
from unicache_train.compress.config import MAX_RATE, UniCacheConfig
from unicache_train.compress.fallback import DynamicFallback
from unicache_train.compress.global_budget import fit_layer_rates
from unicache_train.compress.head_merge import HeadMerge
from unicache_train.compress.importance import Importance
from unicache_train.compress.merge_evict import MergeEvict
from unicache_train.compress.modality import check_modalities
from unicache_train.compress.protect import AlignmentProtect
from unicache_train.compress.quantize import Quantize
from unicache_train.compress.retention import RetentionGate, RetentionPolicy, RetentionScore
from unicache_train.compress.schedule import LayerRates, LayerSchedule
from unicache_train.compress.sinks_recent import SinksRecent
from unicache_train.compress.snapkv import SnapKV
from unicache_train.compress.state import CompressionState, CompressionStep
from unicache_train.seam import (
    MODALITY_NAMES,
    CompressionInput,
    IdentityCompressor,
    KVCompressor,
    KVSegment,
    RecordedContext,
    curriculum_scale,
    segment_kv_bytes,
    stored_heads,
    uncompressed_kv_bytes,
)

__all__ = [
    "ComposedCompressor",
    "UniCacheCompressor",
    "PerLayerCompressor",
    "segment_stats",
    "RateShortfallWarning",
    "SHORTFALL_WARN",
]

#: Shortfall (fraction of the context tokens the requested rate asked for but were not removed)
#: above which a compressor warns (once).
SHORTFALL_WARN = 0.01


class RateShortfallWarning(UserWarning):
    """A compressor removes less of the context than its requested rate (e.g. modality caps)."""


class ComposedCompressor:
    """Runs a list of steps on one layer's context and returns the segment.

    Args:
        steps: callables ``state -> state``; if they declare ``stage`` it must not decrease
            (quantization last, fallback first).
        target_rate: default per-sample target before the fallback step.
        rate_scale: the rate scale at the end of the schedule, in [0, 1] (a factor on every
            rate; 0 is the identity).
        curriculum_steps: optimizer steps over which :meth:`at_step` raises the scale linearly
            from 0 to ``rate_scale`` (0: ``rate_scale`` from the start).
        window, neighbours, frame_stride, similarity: definition of the shared statistics
            (observation window, neighbour window); the importance step may override them.
        cache_dtype_bytes: bytes per element of the uncompressed baseline cache.
    """

    pre_rope = False

    def __init__(
        self,
        steps: Sequence[CompressionStep],
        *,
        target_rate: float = 0.6,
        rate_scale: float = 1.0,
        curriculum_steps: int = 0,
        window: int = 32,
        neighbours: int = 4,
        frame_stride: int = 0,
        similarity: str = "keys",
        cache_dtype_bytes: int = 2,
    ) -> None:
        _check_number("target_rate", target_rate, 0.0, MAX_RATE)
        _check_number("rate_scale", rate_scale, 0.0, 1.0)
        for name, value, lo in (
            ("window", window, 1),
            ("neighbours", neighbours, 0),
            ("frame_stride", frame_stride, 0),
            ("curriculum_steps", curriculum_steps, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(
                    f"ComposedCompressor.{name}={value!r} is out of range; allowed an integer "
                    f"in [{lo}, inf)"
                )
        if similarity not in ("keys", "kv"):
            raise ValueError(
                f"ComposedCompressor.similarity={similarity!r} is not allowed; choose one of "
                "['keys', 'kv']"
            )
        if cache_dtype_bytes not in (1, 2, 4):
            raise ValueError(
                f"ComposedCompressor.cache_dtype_bytes={cache_dtype_bytes!r} is not allowed; "
                "choose one of [1, 2, 4]"
            )
        stages = [getattr(s, "stage", None) for s in steps]
        known = [s for s in stages if s is not None]
        if known != sorted(known):
            names = [type(s).__name__ for s in steps]
            raise ValueError(
                f"steps {names} are out of order (stages {stages}); the UniCache "
                "order is fallback, head merge, importance, layer rate, budgets, "
                "protection, merge/evict, quantize"
            )
        self.steps = list(steps)
        self._global = _global_budget_steps(self.steps)
        self.target_rate = target_rate
        self.final_rate_scale = rate_scale
        self.curriculum_steps = curriculum_steps
        #: The scale in force (moved by :meth:`at_step`; the end of the schedule until then).
        self.rate_scale = rate_scale
        self.window, self.neighbours = window, neighbours
        self.frame_stride, self.similarity = frame_stride, similarity
        self.cache_dtype_bytes = cache_dtype_bytes
        self._shortfall_warned = False
        # layer -> the (target_rate, rate_scale) its shortfall was last checked at.
        self._shortfall_checked: dict[int, tuple[float, float]] = {}

    def is_rate_zero(self) -> bool:
        """Rate 0: only steps marked ``runs_at_rate_zero`` (quantization) run."""
        return self.rate_scale == 0 or self.target_rate == 0

    def at_step(self, step: int | None) -> float:
        """Move to optimizer step ``step`` of the rate schedule (None: its end); the scale in
        force from the next call (:class:`~unicache_train.seam.ScheduledCompressor`)."""
        self.rate_scale = curriculum_scale(step, self.curriculum_steps, self.final_rate_scale)
        return self.rate_scale

    # ------------------------------------------------ one budget over layers (global_budget)
    @property
    def cross_layer(self) -> bool:
        """True with ``schedule.global_budget``: a layer's rate depends on every layer's
        scores, so the decoder records the context first
        (:class:`~unicache_train.seam.CrossLayerCompressor`)."""
        return self._global is not None

    @property
    def records_context(self) -> bool:
        return self._global is not None and not self.is_rate_zero()

    @property
    def record_with_grad(self) -> bool:
        return False  # the ranking takes no gradient; the compressed pass differentiates

    def fit(self, context: RecordedContext, step: int | None = None) -> LayerRates:
        """Every layer's rate from one ranking over all recorded layers
        (:func:`~unicache_train.compress.global_budget.fit_layer_rates`)."""
        if self._global is None:
            raise ValueError(
                f"{type(self).__name__}.fit: only a compressor with schedule.global_budget=True "
                "fits on the recorded context"
            )
        prefix, scorer = self._global

        def run_prefix(state: CompressionState) -> CompressionState:
            for s in prefix:
                state = s(state)
            return state

        return fit_layer_rates(
            context, run_prefix, self._new_state, scorer, self.target_rate * self.rate_scale
        )

    def _new_state(self, inp: CompressionInput, target: float | None = None) -> CompressionState:
        return CompressionState.from_input(
            inp,
            self.target_rate * self.rate_scale if target is None else target,
            rate_scale=self.rate_scale,
            reference_target=self.target_rate,
            window=self.window,
            neighbours=self.neighbours,
            frame_stride=self.frame_stride,
            similarity=self.similarity,
        )

    def run(self, inp: CompressionInput) -> CompressionState:
        """All intermediate results (rates, scores, protected tokens, segment) of one call."""
        check_modalities(inp.modality_ids, inp.context_mask)
        state = self._new_state(inp)
        # NOTE: decided per call, so a curriculum may move rate_scale away from 0 at any time.
        zero = self.is_rate_zero()
        for step in self.steps:
            if zero and not getattr(step, "runs_at_rate_zero", False):
                continue
            state = step(state)
        if state.segment is None:
            seg = state.identity_segment()
            # Nothing changed the K/V (rate 0, no head merge, no quantization): attention may
            # take the causal kernel (bit-for-bit the plain forward).
            seg.identity = (
                state.head_groups is None
                and state.keys is state.inp.keys
                and state.values is state.inp.values
            )
            state.segment = seg
        state.segment.stats.update(state.stats)  # the steps' own (a learned selection's)
        state.segment.stats.update(segment_stats(state, self.cache_dtype_bytes))
        self._check_shortfall(inp.layer_idx, state.segment.stats)
        return state

    def _check_shortfall(self, layer_idx: int, stats: dict[str, torch.Tensor]) -> None:
        """Warn once per compressor when a layer removes less than its requested rate.

        Checked on the first call of each layer at each target rate at full scale, not on every
        call: reading the stat syncs the device. While a curriculum ramps ``rate_scale`` (a
        new value every step) nothing is checked; the shortfall that matters is the target's.
        """
        if self._shortfall_warned or "budget_shortfall" not in stats or self.rate_scale < 1.0:
            return
        if "relaxed" in stats:  # a training relaxation keeps every token softly, by design
            return
        key = float(self.target_rate)
        if self._shortfall_checked.get(layer_idx) == key:
            return
        self._shortfall_checked[layer_idx] = key
        short = float(stats["budget_shortfall"])
        if short <= SHORTFALL_WARN:
            return
        self._shortfall_warned = True
        capped = float(stats.get("budget_cap_withheld", torch.zeros(())))
        causes = []
        if capped > 0.005:
            causes.append(
                f"modality caps withheld {capped:.2f}: raise budget.text_cap / vision_cap / "
                f"audio_cap (at most {MAX_RATE}) or lower target_rate"
            )
        if short - capped > 0.005:
            causes.append(
                f"{short - capped:.2f} could not be removed: protected alignment tokens without "
                "a neighbour to merge into, or the last token of a modality"
            )
        warnings.warn(
            f"{type(self).__name__}: layer {layer_idx} was asked to remove "
            f"{float(stats['rate_target']):.2f} of the context tokens but removed "
            f"{float(stats['rate_realized']):.2f} (shortfall {short:.2f}; {'; '.join(causes)}). "
            "Reported as rate_realized and budget_shortfall; warned once per compressor.",
            RateShortfallWarning,
            stacklevel=2,
        )

    def __call__(self, inp: CompressionInput) -> KVSegment:
        return self.run(inp).segment  # type: ignore[return-value]


class UniCacheCompressor(ComposedCompressor):
    """The UniCache pipeline built from a :class:`UniCacheConfig` (defaults:
    docs/architecture.md#unicache-pipeline).

    Callable as ``compressor(inp) -> KVSegment`` at the attention seam; :meth:`run` returns the
    full :class:`CompressionState` for analysis and tests.
    """

    def __init__(
        self,
        config: UniCacheConfig | None = None,
        *,
        retention: RetentionPolicy | None = None,
        attention_scorer: AttentionScorer | None = None,
        curriculum_steps: int = 0,
    ) -> None:
        cfg = config if config is not None else UniCacheConfig()
        self.config = cfg
        sel = cfg.selection
        if (sel.method == "attention") != (attention_scorer is not None):
            raise ValueError(
                f"UniCacheCompressor: selection.method={sel.method!r} "
                + (
                    "needs an AttentionScorer (unicache_train.train.scorer_fit."
                    "fit_attention_scorer, or compress.attention_scorer.read_attention_scorer)"
                    if attention_scorer is None
                    else "takes no AttentionScorer; set selection.method='attention' to use it"
                )
            )
        if (sel.method == "retention") != (retention is not None):
            raise ValueError(
                f"UniCacheCompressor: selection.method={sel.method!r} "
                + (
                    "needs a RetentionPolicy (unicache_train.inloop.build_compressor(config, "
                    "model) attaches one to the model)"
                    if retention is None
                    else "takes no RetentionPolicy; set selection.method='retention' to use it"
                )
            )
        # The scorer (stage 2): UniCache's importance or one of the selections of
        # docs/compression_methods.md; every later step is shared.
        scorer: CompressionStep
        if sel.method == "sinks_recent":
            scorer = SinksRecent(**vars(sel))
        elif sel.method == "snapkv":
            scorer = SnapKV(**vars(sel))
        elif sel.method == "retention":
            scorer = RetentionScore(**vars(sel), policy=retention)
        elif sel.method == "attention":
            scorer = AttentionScore(**vars(sel), scorer=attention_scorer)
        else:
            scorer = Importance(**vars(cfg.importance))
        steps: list[CompressionStep] = [
            DynamicFallback(**vars(cfg.fallback)),
            HeadMerge(**vars(cfg.head_merge)),
            scorer,
            LayerSchedule(**vars(cfg.schedule)),
            ModalityBudget(**vars(cfg.budget)),
            AlignmentProtect(**vars(cfg.protect)),
            MergeEvict(**vars(cfg.merge_evict)),
        ]
        if retention is not None:  # the relaxation and budget term in training
            steps.append(RetentionGate(**vars(sel), policy=retention))
        steps.append(Quantize(**vars(cfg.quantize)))
        self.retention = retention
        self.attention_scorer = attention_scorer
        self._quantize = steps[-1]  # also quantizes sliding windows (compress_window)
        imp = cfg.importance
        super().__init__(
            steps,
            target_rate=cfg.target_rate,
            rate_scale=cfg.rate_scale,
            curriculum_steps=curriculum_steps,
            window=imp.window,
            neighbours=imp.neighbours,
            frame_stride=imp.frame_stride,
            similarity=imp.similarity,
            cache_dtype_bytes=cfg.cache_dtype_bytes,
        )

    def is_rate_zero(self) -> bool:
        # The fallback sets a rate in [min_rate, max_rate] whatever target_rate says.
        return self.rate_scale == 0 or (self.target_rate == 0 and not self.config.fallback.enabled)

    def compress_window(self, inp: CompressionInput) -> KVSegment | None:
        """A sliding-window layer's segment under ``quantize.windowed_layers``.

        The window bounds which tokens such a layer holds, so no token is removed; only the
        precision is reduced, exactly as this compressor quantizes its other segments.

        Args:
            inp: the layer's input with ``context_mask`` [B, T] the window's context tokens.

        Returns:
            The quantized identity segment over all ``T`` tokens (``valid`` = the window) with
            its byte stats, or None when the option is off or quantization is inactive (the
            caller stores the tokens as they are).
        """
        q = self.config.quantize
        if not (q.windowed_layers and q.active):
            return None
        state = CompressionState.from_input(inp, 0.0)
        state = self._quantize(state)
        assert state.segment is not None
        state.segment.stats.update(segment_stats(state, self.cache_dtype_bytes))
        return state.segment

    def __repr__(self) -> str:
        return f"UniCacheCompressor({self.config!r})"


def _global_budget_steps(
    steps: Sequence[CompressionStep],
) -> tuple[list[CompressionStep], CompressionStep] | None:
    """(the steps before the selection, the selection) of a pipeline whose layer schedule has
    ``global_budget``; None without one."""
    sched = [i for i, s in enumerate(steps) if getattr(s, "global_budget", False)]
    if not sched:
        return None
    scorers = [i for i, s in enumerate(steps[: sched[0]]) if hasattr(s, "global_scores")]
    if not scorers:
        names = [type(s).__name__ for s in steps]
        raise ValueError(
            f"schedule.global_budget=True needs a selection step before the layer schedule whose "
            f"scores compare across layers (global_scores: AttentionScore, SnapKV); steps {names}"
        )
    if any(getattr(s, "enabled", False) for s in steps if isinstance(s, DynamicFallback)):
        raise ValueError(
            "schedule.global_budget=True is not allowed with fallback.enabled=True: the fallback "
            "sets each layer's target from that layer alone; set fallback.enabled=False"
        )
    i = scorers[-1]
    return list(steps[:i]), steps[i]


def _check_number(name: str, value: float, lo: float, hi: float) -> None:
    """A ComposedCompressor argument must be a finite number in ``[lo, hi]``."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not (lo <= value <= hi):
        raise ValueError(
            f"ComposedCompressor.{name}={value!r} is out of range; allowed [{lo}, {hi}]"
        )


@dataclass
class PerLayerCompressor:
    """Chooses a compressor per layer: ``overrides[layer_idx]`` or ``default``.

    E.g. keep the first layers uncompressed: ``PerLayerCompressor(UniCacheCompressor(cfg),
    {0: IdentityCompressor()})``. All compressors must agree on ``pre_rope``.
    """

    default: KVCompressor = field(default_factory=IdentityCompressor)
    overrides: dict[int, KVCompressor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        flags = {
            bool(getattr(c, "pre_rope", False)) for c in (self.default, *self.overrides.values())
        }
        if len(flags) > 1:
            raise ValueError("PerLayerCompressor: all compressors must agree on pre_rope")
        self.pre_rope = flags.pop()

    def __call__(self, inp: CompressionInput) -> KVSegment:
        return self.overrides.get(inp.layer_idx, self.default)(inp)


@torch.no_grad()
def segment_stats(state: CompressionState, cache_dtype_bytes: int = 2) -> dict[str, torch.Tensor]:
    """Scalar diagnostics of one layer's segment (see module docstring)."""
    inp, seg = state.inp, state.segment
    assert seg is not None
    ctx = inp.context_mask
    n_ctx = ctx.sum().double().clamp_min(1.0)
    valid = seg.valid
    counts = torch.where(valid, seg.counts.double(), 0.0)
    n_b = ctx.sum(1).double()  # [B] context tokens per sample
    removed = n_b - valid.sum(1).double()  # [B] merged or evicted
    stats: dict[str, torch.Tensor] = {"rate_realized": removed.sum() / n_ctx}
    for m, name in enumerate(MODALITY_NAMES):
        n_m = (ctx & (inp.modality_ids == m)).sum()
        if int(n_m) > 0:
            kept_m = (valid & (seg.modality_ids == m)).sum()
            stats[f"rate_realized/{name}"] = 1.0 - kept_m / n_m.double()
    # MLA: the uncompressed cache holds the latent [c_kv ‖ k_pe] once, and so does a segment
    # whose values are still the keys' first features (seg.latent: the identity, and UniCache's
    # merge and quantization keep V = K[..., :R]); a step that changed K and V apart leaves
    # seg.latent False, and both are then counted (model/mla.py).
    kv = segment_kv_bytes(seg, cache_dtype_bytes).sum()
    H, dk, dv = inp.keys.shape[1], inp.keys.shape[-1], inp.values.shape[-1]
    base = uncompressed_kv_bytes(
        n_b, H, dk, dv, latent=inp.latent, dtype_bytes=cache_dtype_bytes
    ).sum()
    stats["kv_bytes"] = kv
    stats["kv_reduction"] = base / kv.clamp_min(1.0)
    # clamp: a training relaxation's soft counts (< 1) merge nothing
    stats["merged_fraction"] = (counts - valid.double()).clamp_min(0.0).sum() / n_ctx
    stats["evicted_fraction"] = (n_ctx - counts.sum()).clamp_min(0.0) / n_ctx
    heads = stored_heads(seg.head_groups).double() if seg.head_groups is not None else None
    stats["heads_merged"] = (
        (H - heads).mean() if heads is not None else torch.zeros((), dtype=torch.float64)
    )
    prot = state.protected
    stats["protected_fraction"] = (
        (prot & ctx).sum() / n_ctx if prot is not None else (torch.zeros((), dtype=torch.float64))
    )
    rate = (state.layer_rate if state.layer_rate is not None else state.target).double()  # [B]
    stats["rate_target"] = rate.mean()
    # Against the REQUESTED rate: what caps, protection and the never-empty rule withheld.
    asked = torch.floor(rate * n_b + 0.5)  # [B] tokens, rounded as the plan rounds its quotas
    stats["budget_shortfall"] = (asked - removed).clamp_min(0.0).sum() / n_ctx
    if state.modality_rates is not None:
        per_mod = torch.stack(
            [(ctx & (inp.modality_ids == m)).sum(1) for m in range(len(MODALITY_NAMES))], 1
        ).double()  # [B, 3]
        budget = torch.floor((state.modality_rates.double() * per_mod).sum(1) + 0.5)  # [B]
        stats["budget_cap_withheld"] = (asked - budget).clamp_min(0.0).sum() / n_ctx
    if state.complexity is not None:
        stats["complexity"] = state.complexity.double().mean()
    dev = inp.keys.device
    return {k: v.to(device=dev, dtype=torch.float32) for k, v in stats.items()}
