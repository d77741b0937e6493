"""KV compression in the training loop: splits, the in-loop loss, the KL term, the curriculum.

Shape legend: B, T, V = batch, tokens, vocab.

One training step with compression (docs/architecture.md#in-loop-semantics)::

    batch ─► splits s [B] (data's split, else seeded random in [min_context, L - 1))
          ─► model(ids, split=s, compressor=c)     tokens < s: prefill, full causal attention
                 │                                  every layer: context K/V ─► compressor
                 │                                  tokens >= s: compressed cache + own causal K/V
                 ▼
          logits [B, T, V] ─► LM loss on targets t >= s - 1 (or all targets)
                           └► + kl_weight * KL(uncompressed || compressed) on the same targets,
                              the uncompressed logits from the same model under no_grad
                              (the same forward with reference_logits=True returns them)

The first continuation token is predicted at position ``s - 1``: a context query, which attends
to the full context (the prefill of inference predicts it the same way). The loss on "the
continuation" therefore starts at ``s - 1``; with ``DataConfig.split_at = "question"`` even the
first answer token is predicted through the compressed cache.

Everything here is a pure function of tensors (plus :func:`build_compressor`), shared by the
LightningModule, the evaluation and the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from unicache_train.model.loss import IGNORE_INDEX, masked_nll  # in __all__: shared by train/eval
from unicache_train.seam import IdentityCompressor, KVCompressor
from unicache_train.train.config import CompressionTrainConfig

__all__ = [
    "IGNORE_INDEX",
    "build_compressor",
    "sample_splits",
    "continuation_mask",
    "masked_lm_loss",
    "masked_nll",
    "compression_kl",
    "InloopLoss",
    "inloop_loss",
    "step_generator",
]


def build_compressor(
    config: CompressionTrainConfig,
    model: torch.nn.Module | None = None,
    *,
    retention: torch.nn.Module | None = None,
    attention_scorer: torch.nn.Module | None = None,
) -> KVCompressor:
    """The compressor a run trains with: UniCache, xKV, UniCache then xKV, or the identity (on
    private copies of the configs), each owning its rate schedule (``curriculum_steps``: the
    trainer calls :meth:`~unicache_train.seam.ScheduledCompressor.at_step`). For
    ``unicache+xkv`` UniCache's head merging and quantization are switched off
    (xKV factorises the kept entries across heads and layers and stores 16-bit factors).

    A learned selection (``unicache.selection.method == "retention"``) has parameters: its
    policy is attached to ``model`` as the submodule ``kv_retention`` (created if the model has
    none; :func:`unicache_train.compress.retention.attach_retention`), so the optimizer,
    checkpoints and parameter counts see it, and the compressor holds a reference to it. Call
    this before the optimizer is built. A serving side passes a standalone policy instead
    (``retention``, e.g. :func:`unicache_train.compress.retention.read_retention`).

    The learned attention-regression scorer (``unicache.selection.method == "attention"``,
    :mod:`unicache_train.compress.attention_scorer`) is fitted on a frozen backbone and passed
    in (``attention_scorer``); it is not a model parameter."""
    if config.method == "none":
        return IdentityCompressor()
    from unicache_train.compress import UniCacheCompressor, UniCacheConfig
    from unicache_train.compress.config import XKVConfig

    cfg = config.unicache
    assert isinstance(cfg, UniCacheConfig)  # resolved by CompressionTrainConfig.__post_init__
    steps = config.curriculum_steps
    if cfg.selection.method == "attention":
        if attention_scorer is None and config.attention_scorer:
            from unicache_train.compress.attention_scorer import read_attention_scorer

            shape = None
            if model is not None:
                c = model.config
                shape = (c.num_hidden_layers, c.num_key_value_heads, c.head_size)
            attention_scorer = read_attention_scorer(config.attention_scorer, shape)
            if model is not None:
                attention_scorer.to(next(model.parameters()).device)
        if config.method != "unicache" or attention_scorer is None:
            raise ValueError(
                "unicache.selection.method='attention' needs compress.method='unicache' (got "
                f"{config.method!r}) and its fitted AttentionScorer: build_compressor(config, "
                "attention_scorer=...) (unicache_train.train.scorer_fit.fit_attention_scorer)"
            )
        return UniCacheCompressor(
            UniCacheConfig.from_dict(cfg.to_dict()),
            attention_scorer=attention_scorer,
            curriculum_steps=steps,
        )
    if cfg.selection.method == "retention":
        if config.method != "unicache":
            raise ValueError(
                f"CompressionTrainConfig.method={config.method!r} does not support "
                "unicache.selection.method='retention'; allowed ['unicache']"
            )
        if retention is not None:
            return UniCacheCompressor(
                UniCacheConfig.from_dict(cfg.to_dict()),
                retention=retention,
                curriculum_steps=steps,
            )
        if model is None:
            raise ValueError(
                "unicache.selection.method='retention' learns parameters: pass the model to "
                "build_compressor(config, model) so its policy is attached there"
            )
        from unicache_train.compress.retention import attach_retention

        policy = attach_retention(model)
        return UniCacheCompressor(
            UniCacheConfig.from_dict(cfg.to_dict()), retention=policy, curriculum_steps=steps
        )
    if config.method == "unicache":
        return UniCacheCompressor(UniCacheConfig.from_dict(cfg.to_dict()), curriculum_steps=steps)
    from unicache_train.compress.xkv import XKVCompressor
    from unicache_train.compress.xkv.compressor import token_config_for_xkv

    assert isinstance(config.xkv, XKVConfig)
    xkv = XKVConfig.from_dict(config.xkv.to_dict())
    if config.method == "xkv":
        return XKVCompressor(xkv, curriculum_steps=steps)
    token_cfg = token_config_for_xkv(UniCacheConfig.from_dict(cfg.to_dict()))
    token = UniCacheCompressor(token_cfg, curriculum_steps=steps)
    return XKVCompressor(xkv, token_compressor=token, curriculum_steps=steps)


def step_generator(seed: int, step: int, rank: int = 0, micro: int = 0) -> torch.Generator:
    """A CPU generator that depends only on ``(seed, step, rank, micro)``: a step's random splits
    are reproducible (resume included), and ranks and accumulated micro-batches draw their own."""
    mixed = (seed * 1_000_003 + step * 8_191 + rank * 131_071 + micro * 524_287) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def sample_splits(
    labels: torch.Tensor,
    data_split: torch.Tensor | None,
    *,
    mode: str = "data",
    min_context: int = 16,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Context/continuation split per sample.

    Args:
        labels: [B, T] shifted targets (``-100`` = ignore); a sample's length ``L`` is one past
            its last labelled position, so random splits never land in right padding.
        data_split: [B] the data's split (-1 = none) or None.
        mode: ``"data"`` (the data's split where >= 1, random elsewhere) or ``"random"``.
        min_context: smallest random split.
        generator: CPU generator of the random draws (see :func:`step_generator`).

    Returns:
        [B] long on ``labels.device``, each in ``[1, T - 1]``: at least one context token and
        one continuation token.
    """
    B, T = labels.shape
    if T < 2:
        raise ValueError(f"in-loop compression needs sequences of >= 2 tokens, got T={T}")
    pos = torch.arange(T, device=labels.device)
    labelled = labels != IGNORE_INDEX  # [B, T]
    length = torch.where(labelled, pos + 1, 0).amax(1).clamp(2, T)  # [B]
    hi = (length - 1).cpu()  # exclusive upper bound of a random split: >= 1 continuation token
    lo = torch.minimum(torch.full_like(hi, min_context), hi - 1).clamp_min(1)
    u = torch.rand(B, generator=generator)
    rand = (lo + (u * (hi - lo).clamp_min(1)).long()).clamp(max=T - 1).to(labels.device)
    if mode == "random" or data_split is None:
        return rand
    ok = (data_split >= 1) & (data_split <= T - 1)
    return torch.where(ok, data_split.to(labels.device), rand)


def continuation_mask(split: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] bool, True at the positions whose target is a continuation token (``t >= s - 1``)."""
    t = torch.arange(T, device=split.device)
    return t[None, :] >= (split[:, None] - 1)


def masked_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions where ``mask`` holds.

    Returns 0 (with a graph) when nothing is labelled, so a batch of empty continuations does
    not turn the loss into NaN.
    """
    nll, tokens = masked_nll(logits, labels, mask)
    return nll / tokens.clamp_min(1)


def compression_kl(
    ref_logits: torch.Tensor,
    logits: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``KL(softmax(ref / tau) || softmax(logits / tau)) * tau^2``, mean over masked positions.

    Args:
        ref_logits: [B, T, V] uncompressed logits (no gradient expected).
        logits: [B, T, V] compressed logits.
        mask: [B, T] bool, positions that count (continuation targets, no padding).
        temperature: tau.

    Returns:
        [] scalar, 0 when the mask is empty.
    """
    ref = F.log_softmax(ref_logits[mask].float() / temperature, dim=-1)  # [N, V]
    out = F.log_softmax(logits[mask].float() / temperature, dim=-1)  # [N, V]
    kl = F.kl_div(out, ref, log_target=True, reduction="sum")
    return kl * temperature**2 / max(int(mask.sum()), 1)


@dataclass
class InloopLoss:
    """One batch's in-loop objective (see :func:`inloop_loss`)."""

    loss: torch.Tensor  # [] lm + kl_weight * kl
    lm: torch.Tensor  # [] the LM term
    kl: torch.Tensor | None  # [] the KL term, None when kl_weight is 0
    split: torch.Tensor  # [B] the context/continuation splits used
    targets: torch.Tensor  # [B, T] bool: labelled positions that count in the LM term
    output: Any  # the model's output (logits, compression_stats, ...)
    aux: torch.Tensor | None = None  # [] the compressor's own term (mean over layers), or None


def inloop_loss(
    forward: Callable[..., Any],
    batch: dict[str, torch.Tensor],
    compressor: KVCompressor,
    *,
    generator: torch.Generator,
    split_mode: str = "data",
    min_context: int = 16,
    loss_on: str = "continuation",
    kl_weight: float = 0.0,
    kl_temperature: float = 1.0,
    step: int | None = None,
) -> InloopLoss:
    """The training objective with ``compressor`` in the loop, for one batch: the one definition
    shared by the LightningModule (:meth:`LMModule.compressed_loss
    <unicache_train.train.module.LMModule.compressed_loss>`) and the plain loop
    (:func:`unicache_train.train.loop.train_steps`).

    Per-sample splits (:func:`sample_splits`: the data's where it has one, else drawn from
    ``generator``), one forward ``forward(batch, split=, compressor=, reference_logits=[, step=])``
    with every layer's context K/V compressed, the LM loss on the continuation targets
    (``loss_on="continuation"``) or on all of them (``"all"``), plus ``kl_weight`` times the KL of
    the compressed continuation from the uncompressed one (the reference logits come from the
    same forward), plus the compressor's own differentiable term where it reports one: the
    ``aux_loss`` stat of its segments, already weighted, averaged over the layers that report it
    (a learned retention policy's budget term, :mod:`unicache_train.compress.retention`).

    Args:
        forward: calls the model on a batch with keyword arguments (e.g.
            ``lambda b, **kw: model(b["input_ids"], **kw)``).
        batch: ``input_ids`` and ``labels`` [B, T] (-100 = no loss), optionally ``split`` [B].
        step: the optimizer step, passed on to the model (a cross-layer compressor's refresh
            schedule); None passes nothing.
    """
    if loss_on not in ("continuation", "all"):
        raise ValueError(f"loss_on={loss_on!r} is not allowed; use 'continuation' or 'all'")
    if kl_weight < 0:
        raise ValueError(f"kl_weight={kl_weight} is out of range; allowed >= 0")
    labels = batch["labels"]  # [B, T]
    T = labels.shape[1]
    split = sample_splits(
        labels, batch.get("split"), mode=split_mode, min_context=min_context, generator=generator
    )  # [B]
    kwargs: dict[str, Any] = {
        "split": split,
        "compressor": compressor,
        "reference_logits": kl_weight > 0,
    }
    if step is not None:
        kwargs["step"] = step
    out = forward(batch, **kwargs)
    cont = continuation_mask(split, T)  # [B, T]
    lm = masked_lm_loss(out.logits, labels, cont if loss_on == "continuation" else None)
    mask = cont if loss_on == "continuation" else torch.ones_like(cont)
    loss, kl = lm, None
    if kl_weight > 0:
        kl = compression_kl(
            out.reference_logits, out.logits, cont & (labels != IGNORE_INDEX), kl_temperature
        )
        loss = lm + kl_weight * kl
    terms = [st["aux_loss"] for st in out.compression_stats if "aux_loss" in st]
    aux = torch.stack(terms).mean() if terms else None
    if aux is not None:
        loss = loss + aux
    return InloopLoss(loss, lm, kl, split, mask & (labels != IGNORE_INDEX), out, aux)
