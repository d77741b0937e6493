"""Fitting the attention-regression scorer (:mod:`unicache_train.compress.attention_scorer`) on a
frozen backbone: forwards only, closed-form ridge from streamed ``X^T X``.

Per training text (a long-context record: its context, then its question and answer
teacher-forced, then a repeat-the-context pass as KVzip does) one forward; per layer the
queries/keys/values are recomputed from the layer's own input
(:meth:`~unicache_train.model.attention.Attention.project`, the one place they are computed) and
the target of context token ``t`` and KV head ``h`` is::

    y_lht = log( max_{g in group(h), i >= n} softmax_i(q_gi . k_h / sqrt(D))_t * ||W_O^g v_ht|| )

the largest attention any later position ``i`` (question, answer, repeat) and query head ``g``
of the group pays the token, times the norm of what the token writes through that head's slice
of the output projection (KVzap's target). Features are :func:`~unicache_train.compress.
attention_scorer.scorer_features` of the context's own K/V (the prefill's: causal, so the same
as what the seam sees at inference). Per (layer, head) the normal equations ``X^T X``, ``X^T y``
are summed over the training records and solved with a ridge ``lambda * mean(diag(X^T X))``;
a held-out share of the records (by index, never fitted) gives the fit's R^2 and its rank
correlation with the target (Spearman, per record and head, averaged).

Model code is not modified: forward pre-hooks capture each attention layer's input.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from unicache_train.compress.attention_scorer import (
    AttentionScorer,
    num_features,
    scorer_features,
)

__all__ = ["REPEAT_PROMPT", "ScorerFit", "attention_targets", "fit_attention_scorer", "spearman"]

#: The repeat pass (KVzip): the context is asked back after the question and answer.
REPEAT_PROMPT = "\nRepeat the text above exactly:\n"


@dataclass
class ScorerFit:
    """A fitted scorer and how well it predicts the target on held-out records.

    Attributes:
        scorer: the :class:`AttentionScorer`.
        r2: [L, H] held-out R^2 per layer and KV head.
        spearman: [L, H] held-out rank correlation with the target (mean over records).
        train_records, heldout_records, train_tokens: what went in.
        seconds: wall time.
    """

    scorer: AttentionScorer
    r2: torch.Tensor
    spearman: torch.Tensor
    train_records: int
    heldout_records: int
    train_tokens: int
    seconds: float
    ridge: float = 1e-3
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        return {
            "r2_mean": float(self.r2.mean()),
            "r2_min": float(self.r2.min()),
            "spearman_mean": float(self.spearman.mean()),
            "spearman_min": float(self.spearman.min()),
            "train_records": self.train_records,
            "heldout_records": self.heldout_records,
            "train_tokens": self.train_tokens,
            "seconds": round(self.seconds, 1),
        }


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rank correlation of ``a`` and ``b`` [..., N] along the last dim (ties broken by index)."""
    ra = a.argsort(-1).argsort(-1).double()
    rb = b.argsort(-1).argsort(-1).double()
    ra = ra - ra.mean(-1, keepdim=True)
    rb = rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1)).clamp_min(1e-12)


class _Inputs:
    """Forward pre-hooks keeping each attention layer's input (x, rope) of the last forward."""

    def __init__(self, model) -> None:
        self.inputs: dict[int, tuple] = {}
        self.handles = [
            layer.self_attn.register_forward_pre_hook(self._hook, with_kwargs=True)
            for layer in model.layers
        ]

    def _hook(self, module, args, kwargs) -> None:
        x = args[0] if args else kwargs["x"]
        self.inputs[module.layer_idx] = (x.detach(), kwargs["rope"])

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def attention_targets(
    model, ids: torch.Tensor, n_ctx: int, chunk: int = 512
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Features and targets of one text's first ``n_ctx`` tokens, every layer.

    Args:
        model: a GQA :class:`~unicache_train.model.Decoder` (eval mode).
        ids: [1, T] the whole text (context first).
        n_ctx: context tokens (the rest are the later positions whose attention counts).
        chunk: later queries per attention block (memory).

    Returns:
        {layer: (features [H, n_ctx, F] float32, target [H, n_ctx] float32)}.
    """
    if ids.shape[0] != 1 or not 0 < n_ctx < ids.shape[1]:
        raise ValueError(f"attention_targets: ids {tuple(ids.shape)} with n_ctx={n_ctx}")
    hooks = _Inputs(model)
    try:
        model(ids, logits_at=torch.zeros(1, 1, dtype=torch.long, device=ids.device))
    finally:
        hooks.close()
    T = ids.shape[1]
    out = {}
    for layer in model.layers:
        attn = layer.self_attn
        x, rope = hooks.inputs[attn.layer_idx]
        qkv = attn.project(x, rope)
        q, k, v = qkv.q.float(), qkv.k.float(), qkv.v.float()  # [1, H, T, D], [1, Hk, T, D]
        H, Hk, D = q.shape[1], k.shape[1], q.shape[-1]
        rep = H // Hk
        scale = attn.scale if attn.scale is not None else D**-0.5
        kk = k.repeat_interleave(rep, 1)[0]  # [H, T, D]
        best = torch.zeros(H, n_ctx, device=q.device)
        for s in range(n_ctx, T, chunk):
            e = min(T, s + chunk)
            logits = torch.einsum("hid,hjd->hij", q[0, :, s:e], kk[:, :e]) * scale
            if attn.softcap is not None:
                logits = attn.softcap * torch.tanh(logits / attn.softcap)
            i = torch.arange(s, e, device=q.device)[:, None]
            j = torch.arange(e, device=q.device)[None, :]
            logits = logits.masked_fill(j > i, float("-inf"))
            p = torch.softmax(logits, -1)[:, :, :n_ctx]  # [H, e - s, n_ctx]
            best = torch.maximum(best, p.amax(1))
        w_o = attn.o_proj.weight.float().view(-1, H, D)  # [C, H, D]
        gram = torch.einsum("chd,che->hde", w_o, w_o)  # [H, D, D] W_O^g^T W_O^g
        vv = v[0].repeat_interleave(rep, 0)[:, :n_ctx]  # [H, n, D]
        sq = torch.einsum("hnd,hde,hne->hn", vv, gram, vv)  # ||W_O^g v||^2
        norm = sq.clamp_min(0).sqrt()  # [H, n]
        target = (best * norm).view(Hk, rep, n_ctx).amax(1)  # [Hk, n]
        mask = torch.ones(1, n_ctx, dtype=torch.bool, device=q.device)
        phi = scorer_features(k[:, :, :n_ctx], v[:, :, :n_ctx], mask)[0]  # [Hk, n, F]
        out[attn.layer_idx] = (phi, torch.log(target.clamp_min(1e-12)))
    return out


def _text(record: dict, repeat: bool) -> tuple[str, str]:
    answer = " " + ", ".join(record["answers"]) + "\n"
    later = record["question"] + answer + (REPEAT_PROMPT + record["context"] if repeat else "")
    return record["context"], later


@torch.no_grad()
def fit_attention_scorer(
    model,
    tokenizer,
    records: Sequence[dict],
    *,
    heldout_every: int = 5,
    ridge: float = 1e-3,
    repeat: bool = True,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> ScorerFit:
    """Fit an :class:`AttentionScorer` on training records (module docstring).

    Args:
        model: the frozen backbone (GQA decoder, eval mode).
        tokenizer: our tokenizer API.
        records: long-context training records (training seeds and haystack:
            :func:`~unicache_train.data.long_context.long_context_records` with
            ``split="train"``).
        heldout_every: every k-th record is held out (R^2, rank correlation), never fitted.
        ridge: ``lambda`` as a fraction of the mean diagonal of ``X^T X``.
        repeat: add the repeat-the-context pass to the later positions.
        progress: a progress bar.
        log: called with a line every 20 records.

    Returns:
        :class:`ScorerFit`.
    """
    if heldout_every < 2:
        raise ValueError(f"heldout_every={heldout_every} is out of range; allowed >= 2")
    if not ridge > 0:
        raise ValueError(f"ridge={ridge} is out of range; allowed (0, inf)")
    for r in records:
        if r.get("split") not in (None, "train"):
            raise ValueError(
                f"record {r.get('id')!r} is from split {r.get('split')!r}: fit on training "
                "records only"
            )
    cfg = model.config
    L, Hk, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_size
    F = num_features(D)
    device = next(model.parameters()).device
    xtx = torch.zeros(L, Hk, F, F, dtype=torch.float64)
    xty = torch.zeros(L, Hk, F, dtype=torch.float64)
    held: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
    t0 = time.time()
    n_train = n_tokens = 0
    it = list(enumerate(records))
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="scorer fit", leave=False)
    for j, r in it:
        ctx, later = _text(r, repeat)
        c_ids = tokenizer.encode(ctx, add_bos=True)
        ids = torch.tensor([c_ids + tokenizer.encode(later)], device=device)
        feats = attention_targets(model, ids, len(c_ids))
        if j % heldout_every == heldout_every - 1:
            held.append({k: (p.half().cpu(), y.cpu()) for k, (p, y) in feats.items()})
            continue
        for layer, (phi, y) in feats.items():
            p64, y64 = phi.double().cpu(), y.double().cpu()
            xtx[layer] += torch.einsum("hnf,hng->hfg", p64, p64)
            xty[layer] += torch.einsum("hnf,hn->hf", p64, y64)
        n_train += 1
        n_tokens += len(c_ids)
        if log is not None and (j + 1) % 20 == 0:
            log(f"scorer fit: {j + 1}/{len(records)} records, {time.time() - t0:.0f}s")
    if n_train == 0:
        raise ValueError("fit_attention_scorer: no training record (all held out)")
    lam = ridge * xtx.diagonal(dim1=-2, dim2=-1).mean(-1)  # [L, H]
    eye = torch.eye(F, dtype=torch.float64)
    w = torch.linalg.solve(xtx + lam[..., None, None] * eye, xty[..., None])[..., 0]  # [L,H,F]
    scorer = AttentionScorer(L, Hk, D)
    with torch.no_grad():
        scorer.weight.copy_(w.float())
    r2 = torch.full((L, Hk), float("nan"))
    rho = torch.full((L, Hk), float("nan"))
    if held:
        sse = torch.zeros(L, Hk, dtype=torch.float64)
        sst = torch.zeros(L, Hk, dtype=torch.float64)
        rhos = torch.zeros(L, Hk, dtype=torch.float64)
        ys = {layer: torch.cat([h[layer][1] for h in held], 1).double() for layer in range(L)}
        for layer in range(L):
            mean = ys[layer].mean(1, keepdim=True)  # [H, 1] held-out mean
            for h in held:
                phi, y = h[layer]
                pred = torch.einsum("hnf,hf->hn", phi.double(), w[layer])
                sse[layer] += ((pred - y.double()) ** 2).sum(1)
                sst[layer] += ((y.double() - mean) ** 2).sum(1)
                rhos[layer] += spearman(pred, y.double())
        r2 = (1 - sse / sst).float()
        rho = (rhos / len(held)).float()
    return ScorerFit(
        scorer=scorer.eval(),
        r2=r2,
        spearman=rho,
        train_records=n_train,
        heldout_records=len(held),
        train_tokens=n_tokens,
        seconds=time.time() - t0,
        ridge=ridge,
        extra={"lambda_mean": float(lam.mean()), "features": F, "repeat": repeat},
    )
