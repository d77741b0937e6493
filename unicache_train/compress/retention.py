"""A learned retention policy, trained in the loop (DMS-like: Łańcucki et al., "Inference-Time
Hyper-Scaling with KV Cache Compression", arXiv 2506.05345).

Dynamic Memory Sparsification lets the model predict, per token and KV head, whether its K/V
stay in the cache; training makes the decision differentiable (Gumbel-sigmoid) and a loss drives
the kept fraction to the target. Ours is the same idea behind the UniCache seam:

* **Logit.** Per layer ``l``, KV head ``h`` and context token ``t``, a linear read of the
  RMS-normalised key: ``z_lht = w_lh . k_hat_lht + b_lh`` (``RetentionPolicy``: ``weight
  [L, H_kv, D]``, ``bias [L, H_kv]``, zeros at init). A segment keeps one token set for all
  heads of a layer (:class:`~unicache_train.seam.KVSegment`), so the heads' logits are averaged:
  ``z_t = prior_scale * (p_t - 1) + mean_h z_lht``, with ``p_t`` in [0, 2] the score of a fixed
  selection (the *prior*: sinks + recent window, :mod:`~unicache_train.compress.sinks_recent`,
  or SnapKV, :mod:`~unicache_train.compress.snapkv`). At init the learned part is 0, so the
  policy ranks exactly as its prior: a sensible training-free scorer, not random, and free.
* **Inference** (the policy in eval mode, or no gradient): the merge/evict step removes the
  lowest ``z`` first until the layer's budget is met (``round(R * n)`` tokens per sample and
  modality), so the byte target is met exactly, with the same budgets, protection and
  quantization as every other scorer, and the same ``rate_realized``/``budget_shortfall`` and
  ``kv_reduction`` accounting.
* **Training** (``SelectionConfig.relaxation``). The gate reads the logit centred on the hard
  selection's threshold, ``zc_t = z_t - theta_b`` (``theta_b`` midway between the lowest kept
  and the highest evicted logit of sample b at the byte target, no gradient): ``alpha_t > 1/2``
  exactly on the tokens inference keeps, from the first step. (Uncentred, the prior's logits
  ``4 (p_t - 1)`` gave a soft kept fraction of 0.27 where the 8x target keeps 0.47 on SmolLM2:
  the relaxed forward dropped far more than inference would, and the budget term moves the
  offset by about ``lr`` per step.)

  - ``"gumbel_sigmoid"`` (DMS): every context token stays in the segment with the soft weight
    ``alpha_t = sigmoid((zc_t + g_t) / tau)``, ``g_t`` logistic noise; attention adds
    ``log(alpha_t)`` to the token's logit (a segment entry's ``count``: a token kept at
    ``alpha`` stands for ``alpha`` of itself), so the loss reaches ``z`` and the model through
    every token, evicted or not. The forward differs from inference (soft vs hard).
  - ``"st_topk"``: a hard selection at the byte target (the forward stores inference's
    bytes), ranked by ``z_t + tau * g_t`` (Gumbel top-k: the noise keeps an evicted token now
    and then), each kept entry's count ``1 + alpha_t - sg(alpha_t)`` with
    ``alpha_t = sigmoid(zc_t / tau)``: a straight-through gate, so the loss reaches the logits
    of the kept tokens only (a token never sampled learns only from the budget term).

  Both add the **budget term** ``budget_weight * mean_b (soft_kept_b - kept_b)^2`` to the
  objective (the ``aux_loss`` stat, which :func:`unicache_train.inloop.inloop_loss` adds), where
  ``soft_kept_b`` is the mean ``alpha`` over sample b's context and ``kept_b`` the fraction the
  hard selection keeps at the byte target: it calibrates the spread of ``zc`` so that the soft
  mass matches the hard selection's.

Stats per layer (logged as ``compress/<name>`` and per layer): ``retention_kept`` (soft kept
fraction in training, the hard one at inference), ``retention_budget_loss`` (unweighted) and
``aux_loss`` (weighted, with gradient in training); ``relaxed`` (1) on a Gumbel-sigmoid training
segment, whose ``rate_realized`` and ``kv_reduction`` describe that soft forward (nothing
removed), not the byte target (the ``st_topk`` forward is the hard one: its bytes are the
target's).

**Parameters are model parameters.** Model code never imports compressors, so the policy is
attached from the compression side: :func:`attach_retention` registers it on the model as the
submodule ``kv_retention`` (``model.kv_retention.weight``/``.bias`` in the state dict, the
optimizer's parameter groups, checkpoints and parameter counts), and the compressor holds a
reference to it (:func:`unicache_train.inloop.build_compressor` does both).
:func:`save_retention` / :func:`load_retention` move the policy through a safetensors file (the
hooks an export and a serving side call; never a pickle).

Shape legend: B, H, T, D, L = batch, KV heads, tokens, head dim, layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from unicache_train.compress.config import SelectionConfig
from unicache_train.compress.grouped import grouped_rank
from unicache_train.compress.sinks_recent import sinks_recent_scores
from unicache_train.compress.snapkv import snapkv_scores
from unicache_train.compress.state import CompressionState
from unicache_train.seam import identity_segment

__all__ = [
    "RetentionPolicy",
    "RetentionScore",
    "RetentionGate",
    "attach_retention",
    "save_retention",
    "load_retention",
    "read_retention",
    "retention_state",
    "RETENTION_FILE",
    "retention_logits",
    "RETENTION_ATTR",
]

#: The name of the policy's submodule on the model (``model.kv_retention``).
RETENTION_ATTR = "kv_retention"

#: The file name an export gives the policy's weights (:func:`save_retention`).
RETENTION_FILE = "kv_retention.safetensors"


class RetentionPolicy(nn.Module):
    """Per layer and KV head, a linear read of the normalised key: the retention logit.

    Args:
        num_layers: L.
        num_kv_heads: H_kv.
        head_dim: D of the keys at the seam.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"RetentionPolicy.{name}={value!r} is out of range; allowed an integer in "
                    "[1, inf)"
                )
        # Zeros: the learned part starts at 0, so the policy ranks exactly as its prior.
        self.weight = nn.Parameter(torch.zeros(num_layers, num_kv_heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(num_layers, num_kv_heads))

    def head_logits(self, layer_idx: int, keys: torch.Tensor) -> torch.Tensor:
        """The learned logit of every token and KV head of one layer.

        Args:
            layer_idx: the decoder layer.
            keys: [B, H, T, D] the seam's keys.

        Returns:
            [B, H, T] float32.
        """
        L, H, D = self.weight.shape
        if not 0 <= layer_idx < L or keys.shape[1] != H or keys.shape[-1] != D:
            raise ValueError(
                f"RetentionPolicy of {L} layers x {H} KV heads x head dim {D} cannot score "
                f"layer {layer_idx} with keys {tuple(keys.shape)}"
            )
        k = keys.float()
        k_hat = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)  # [B, H, T, D]
        w, b = self.weight[layer_idx], self.bias[layer_idx]  # [H, D], [H]
        return torch.einsum("bhtd,hd->bht", k_hat, w) + b[None, :, None]

    @classmethod
    def for_model(cls, model: nn.Module) -> RetentionPolicy:
        """Sized from a :class:`~unicache_train.model.Decoder`'s config (GQA/MHA only)."""
        cfg = getattr(model, "config", None)
        if cfg is None:
            raise ValueError("RetentionPolicy.for_model: the model has no `config`")
        if getattr(cfg, "attention_type", "gqa") != "gqa":
            raise ValueError(
                f"SelectionConfig.method='retention' is not supported with "
                f"ModelConfig.attention_type={cfg.attention_type!r}; allowed ['gqa'] (an MLA "
                "latent cache has one head of another width)"
            )
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_size)


def attach_retention(model: nn.Module) -> RetentionPolicy:
    """The model's retention policy, registered as ``model.kv_retention`` if it has none yet.

    Registering it on the model makes its parameters model parameters: in the state dict, in
    the optimizer's groups (which read ``model.named_parameters()``), in checkpoints and in the
    parameter counts. Call it before the optimizer is built and before a checkpoint that holds
    ``kv_retention.*`` is loaded.
    """
    policy = getattr(model, RETENTION_ATTR, None)
    if policy is None:
        policy = RetentionPolicy.for_model(model)
        ref = next(model.parameters(), None)
        if ref is not None:
            policy.to(device=ref.device)
        model.add_module(RETENTION_ATTR, policy)
    if not isinstance(policy, RetentionPolicy):
        raise ValueError(
            f"model.{RETENTION_ATTR} is a {type(policy).__name__}, not a RetentionPolicy"
        )
    return policy


def save_retention(model: nn.Module, path: str | Path) -> Path:
    """Write the model's retention policy to a safetensors file (``weight``, ``bias``; never a
    pickle): the hook an export calls to ship the policy beside the model's weights.

    Raises:
        ValueError: the model has no ``kv_retention``.
    """
    from safetensors.torch import save_file

    policy = getattr(model, RETENTION_ATTR, None)
    if not isinstance(policy, RetentionPolicy):
        raise ValueError(f"save_retention: the model has no {RETENTION_ATTR} RetentionPolicy")
    path = Path(path)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in policy.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "unicache_retention"})
    return path


def load_retention(model: nn.Module, path: str | Path) -> RetentionPolicy:
    """Attach a retention policy to ``model`` (:func:`attach_retention`) and load it from a
    :func:`save_retention` file, strictly (the shapes must fit the model): the hook a serving
    side calls before ``build_compressor(config, model)``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file's tensors do not fit the model's policy.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"retention policy not found: {path}")
    policy = attach_retention(model)
    state = load_file(str(path))
    want = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != want:
        raise ValueError(f"{path}: retention tensors {got} do not fit the model's {want}")
    policy.load_state_dict(state, strict=True)
    return policy


def retention_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's retention policy as fp32 CPU tensors (``weight``, ``bias``), the form an
    export writes to :data:`RETENTION_FILE`; None when the model has none."""
    policy = getattr(model, RETENTION_ATTR, None)
    if not isinstance(policy, RetentionPolicy):
        return None
    return {k: v.detach().float().cpu().contiguous() for k, v in policy.state_dict().items()}


def read_retention(path: str | Path, shape: tuple[int, int, int] | None = None) -> RetentionPolicy:
    """A standalone :class:`RetentionPolicy` (eval mode) from a :func:`save_retention` file:
    what a serving side holds beside a model that has no ``kv_retention`` submodule (a stock
    transformers model, an export imported with :func:`~unicache_train.checkpoint.hf.import_hf`).

    Args:
        path: the safetensors file.
        shape: ``(layers, kv_heads, head_dim)`` the policy must have (the model it serves);
            None: whatever the file holds.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a retention file (other tensors, other ranks, non-float or non-finite
            values, another shape than ``shape``): one line naming the file and what is wrong.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"retention policy not found: {path}")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
    if set(state) != {"weight", "bias"}:
        raise ValueError(
            f"{path}: tensors {sorted(state)}; a retention policy has ['bias', 'weight']"
        )
    w, b = state["weight"], state["bias"]
    if w.dim() != 3 or b.shape != w.shape[:2] or min(w.shape) < 1:
        raise ValueError(
            f"{path}: weight {list(w.shape)} and bias {list(b.shape)}; expected weight "
            "[layers, kv_heads, head_dim] and bias [layers, kv_heads]"
        )
    if not (w.is_floating_point() and b.is_floating_point()):
        raise ValueError(f"{path}: weight {w.dtype} / bias {b.dtype}; expected floating point")
    if not (torch.isfinite(w).all() and torch.isfinite(b).all()):
        raise ValueError(f"{path}: the retention weights hold NaN or infinite values")
    if shape is not None and tuple(w.shape) != tuple(shape):
        raise ValueError(
            f"{path}: a policy of {tuple(w.shape)} (layers, kv_heads, head_dim) does not fit "
            f"the model's {tuple(shape)}"
        )
    policy = RetentionPolicy(*(int(n) for n in w.shape))
    policy.load_state_dict({"weight": w.float(), "bias": b.float()}, strict=True)
    return policy.eval()


def _prior(state: CompressionState, sel: SelectionConfig) -> torch.Tensor:
    """The fixed selection's score the policy starts from, [B, T] in [0, 2]."""
    if sel.prior == "snapkv":
        return snapkv_scores(state, sel.window, sel.kernel)
    return sinks_recent_scores(state.context_mask, sel.sinks)


def retention_logits(
    state: CompressionState, policy: RetentionPolicy, sel: SelectionConfig
) -> torch.Tensor:
    """``z_t = prior_scale * (p_t - 1) + mean_h z_lht`` (module docstring).

    Returns:
        [B, T] float32, differentiable in the policy and the keys; 0 outside the context.
    """
    prior = _prior(state, sel).float()
    learned = policy.head_logits(state.inp.layer_idx, state.keys).mean(1)  # [B, T]
    z = sel.prior_scale * (prior - 1.0) + learned
    return torch.where(state.context_mask, z, torch.zeros_like(z))


@dataclass
class RetentionScore(SelectionConfig):
    """Pipeline step (the scorer): the retention logits (``state.logits``, with gradient) and
    their percentile rank in the context as ``state.scores`` (a monotone map: the merge/evict
    step needs scores in [0, 1]; ties keep token order)."""

    stage: ClassVar[int] = 2
    runs_at_rate_zero: ClassVar[bool] = True  # see RetentionGate
    policy: RetentionPolicy | None = field(default=None, repr=False)

    def __call__(self, state: CompressionState) -> CompressionState:
        if self.policy is None:
            raise ValueError(
                "SelectionConfig.method='retention' needs its RetentionPolicy: build the "
                "compressor with unicache_train.inloop.build_compressor(config, model)"
            )
        z = retention_logits(state, self.policy, self)
        mask = state.context_mask
        key = z.detach()
        if self.relaxation == "st_topk" and self.policy.training and torch.is_grad_enabled():
            # Gumbel top-k: the training selection samples around the ranking, so a token the
            # policy evicts is kept now and then and its gate learns whether it helps (without
            # the noise an evicted token never gets a task gradient).
            key = key + self.temperature * _logistic_like(key)
        rank = grouped_rank(key, torch.zeros_like(state.modality_ids), mask, 1).float()
        n = mask.sum(1, keepdim=True).float()
        pct = rank / (n - 1).clamp_min(1.0)
        state.scores = torch.where(mask, pct, torch.zeros_like(pct))
        state.logits = z
        return state


def _logistic_like(x: torch.Tensor) -> torch.Tensor:
    """Standard logistic noise (the difference of two Gumbels) of ``x``'s shape."""
    u = torch.rand_like(x).clamp(1e-6, 1.0 - 1e-6)
    return torch.log(u) - torch.log1p(-u)


def _threshold(z: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """[B] the hard selection's logit threshold: midway between the lowest kept and the
    highest evicted context logit (nothing evicted: ``4 tau`` below the lowest kept, whose gate
    is then ~0.98)."""
    inf = torch.full_like(z, float("inf"))
    low_kept = torch.where(kept & mask, z, inf).amin(1)
    high_evicted = torch.where(mask & ~kept, z, -inf).amax(1)
    low_kept = torch.where(torch.isfinite(low_kept), low_kept, torch.zeros_like(low_kept))
    return torch.where(
        torch.isfinite(high_evicted), 0.5 * (low_kept + high_evicted), low_kept - 4.0 * tau
    )


def _entry_tokens(kept: torch.Tensor, M: int) -> torch.Tensor:
    """[B, T] bool kept tokens -> [B, M] their token indices in token order (the merge/evict
    step's entry order), padding entries pointing at unkept tokens."""
    B, T = kept.shape
    t = torch.arange(T, device=kept.device).expand(B, T)
    return torch.sort(torch.where(kept, t, T + t), dim=1).indices[:, :M]


@dataclass
class RetentionGate(SelectionConfig):
    """Pipeline step after merge/evict: in training, the relaxation and the budget term (module
    docstring); at inference, only the kept-fraction stats of the hard segment. Its stats go to
    ``state.stats`` (the composer adds them to the segment's).

    It runs at rate 0 too (``runs_at_rate_zero``, as does :class:`RetentionScore`), where
    nothing is selected: the segment is left alone (rate 0 stays the identity) and the budget
    term is ``0 * sum(z)``, so the policy's parameters stay in the graph (DDP without
    ``find_unused_parameters`` needs every parameter to get a gradient, also while a curriculum
    holds the rate at 0)."""

    stage: ClassVar[int] = 6
    runs_at_rate_zero: ClassVar[bool] = True
    policy: RetentionPolicy | None = field(default=None, repr=False)

    def __call__(self, state: CompressionState) -> CompressionState:
        z = state.logits
        if z is None:
            return state
        training = self.policy is not None and self.policy.training and torch.is_grad_enabled()
        if state.segment is None:  # nothing selected (rate 0, or merge/evict off): no change
            state.stats["retention_kept"] = torch.ones((), device=z.device)
            if training:
                state.stats["aux_loss"] = 0.0 * z.sum()
            return state
        mask = state.context_mask
        n = mask.sum(1).float().clamp_min(1.0)  # [B]
        seg = state.segment
        kept = seg.valid.sum(1).float() / n  # [B] the hard selection's kept fraction
        if not training:
            state.stats["retention_kept"] = kept.mean().detach()
            return state
        tau = self.temperature
        kept_tok = state.plan.kept if state.plan is not None else mask
        # The gate is centred on the hard selection's threshold (between the lowest kept and
        # the highest evicted logit, no gradient): alpha > 1/2 exactly where inference keeps,
        # so the relaxed forward describes the byte target's selection from the first step.
        zc = z - _threshold(z.detach(), kept_tok, mask, tau)[:, None]
        if self.relaxation == "gumbel_sigmoid":
            alpha = torch.sigmoid((zc + _logistic_like(zc)) / tau)  # [B, T]
            # Every context token, weighted by its gate (attention adds log(alpha)).
            seg = identity_segment(
                state.inp,
                state.keys,
                state.values,
                head_groups=state.head_groups,
                with_assignment=True,
            )
            seg.counts = torch.where(mask, alpha, torch.ones_like(alpha)).to(seg.keys.dtype)
            # The forward removed nothing (every token is weighted instead): the segment's
            # rate_realized and kv_reduction say so; `relaxed` marks it (no shortfall warning).
            state.stats["relaxed"] = torch.ones((), device=z.device)
        else:
            alpha = torch.sigmoid(zc / tau)
            idx = _entry_tokens(kept_tok, seg.valid.shape[1])  # [B, M]
            a = alpha.gather(1, idx)
            gate = torch.where(seg.valid, a - a.detach(), torch.zeros_like(a))
            seg.counts = seg.counts + gate.to(seg.counts.dtype)
        soft = (alpha * mask).sum(1) / n  # [B]
        budget = F.mse_loss(soft, kept.detach())
        state.stats["aux_loss"] = self.budget_weight * budget
        state.stats["retention_budget_loss"] = budget.detach()
        state.stats["retention_kept"] = soft.mean().detach()
        state.segment = seg
        return state
