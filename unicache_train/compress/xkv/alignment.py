"""Cross-layer alignment of the KV cache: the observation xKV rests on (arXiv 2503.18893 §3).

xKV shares one *token-side* basis across a group of layers (:mod:`unicache_train.compress.xkv`),
which pays only if the layers' caches span similar token subspaces. For the context of a sample,
layer l's keys are a matrix ``X_l [M, W_l]`` (tokens x flattened heads; pre-RoPE by default,
as xKV factorises them). Two measures between layers a and b, per sample, averaged:

* **subspace overlap** of the dominant left singular vectors: with ``U_a, U_b [M, r]`` the top-r
  left singular vectors, ``||U_aᵀ U_b||_F² / r`` = the mean squared cosine of the r principal
  angles between the two token subspaces; 1 = the same subspace, ``r / M`` expected for random
  subspaces (reported as the baseline);
* **linear CKA** (Kornblith et al. 2019, arXiv 1905.00414) of the token-centred matrices:
  ``||X_bᵀ X_a||_F² / (||X_aᵀ X_a||_F ||X_bᵀ X_b||_F)``, 1 when the token Gram matrices agree up
  to scale.

Shape legend: B, T, M, L, W = batch, tokens, context tokens, layers, flattened KV width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unicache_train.compress.xkv.factor import flatten_heads
from unicache_train.seam import RecordingCompressor

__all__ = [
    "collect_context_kv",
    "token_subspace",
    "subspace_overlap",
    "principal_angles",
    "linear_cka",
    "LayerAlignment",
    "layer_alignment",
]


@torch.no_grad()
def collect_context_kv(
    model,
    input_ids: torch.Tensor,
    split: torch.Tensor | None = None,
    *,
    modality_ids: torch.Tensor | None = None,
    pre_rope: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Every layer's context keys and values, as the compression seam sees them.

    Args:
        model: a :class:`~unicache_train.model.Decoder`.
        input_ids: [B, T].
        split: [B] context lengths (default: the whole sequence).
        pre_rope: keys before RoPE (xKV) or after.

    Returns:
        (keys, values: per layer [B, T, W] fp32 (MLA: the latent ``c_kv ‖ k_pe`` and ``c_kv``),
        context mask [B, T]).
    """
    B, T = input_ids.shape
    if split is None:
        split = torch.full((B,), T, dtype=torch.long, device=input_ids.device)
    rec = RecordingCompressor(pre_rope=pre_rope)
    model(input_ids, modality_ids=modality_ids, split=split, compressor=rec)
    layers = sorted(rec.inputs)
    keys = [flatten_heads(rec.inputs[i].keys).float() for i in layers]
    values = [flatten_heads(rec.inputs[i].values).float() for i in layers]
    return keys, values, rec.inputs[layers[0]].context_mask


def token_subspace(x: torch.Tensor, rank: int) -> torch.Tensor:
    """x: [M, W] -> the top-``rank`` left singular vectors [M, r] (fp32, r <= min(M, W))."""
    u, _, _ = torch.linalg.svd(x.float(), full_matrices=False)
    return u[:, : min(rank, u.shape[1])]


def principal_angles(u_a: torch.Tensor, u_b: torch.Tensor) -> torch.Tensor:
    """Principal angles (radians, increasing) between the spans of orthonormal [M, r] bases."""
    cos = torch.linalg.svdvals(u_a.mT @ u_b).clamp(-1.0, 1.0)
    return torch.arccos(cos).sort().values


def subspace_overlap(u_a: torch.Tensor, u_b: torch.Tensor) -> float:
    """Mean squared cosine of the principal angles: ``||U_aᵀ U_b||_F² / r`` in [0, 1]."""
    r = min(u_a.shape[1], u_b.shape[1])
    return float((u_a.mT @ u_b).square().sum() / max(r, 1))


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of [M, W_x] and [M, W_y] (rows = the same tokens), token-centred."""
    x = x.double() - x.double().mean(0, keepdim=True)
    y = y.double() - y.double().mean(0, keepdim=True)
    num = (y.mT @ x).square().sum()
    den = torch.linalg.matrix_norm(x.mT @ x) * torch.linalg.matrix_norm(y.mT @ y)
    return float(num / den.clamp_min(1e-300))


@dataclass
class LayerAlignment:
    """Layer x layer alignment of one model on some data (means over samples).

    Attributes:
        overlap_k, overlap_v: [L, L] subspace overlap of the top-r token subspaces.
        cka_k, cka_v: [L, L] linear CKA.
        rank: r used for the subspaces (``rank_fraction`` x the keys' width, for K and V).
        random_overlap: ``r / M`` averaged over samples: two random r-dim subspaces.
        samples: samples averaged.
    """

    overlap_k: torch.Tensor
    overlap_v: torch.Tensor
    cka_k: torch.Tensor
    cka_v: torch.Tensor
    rank: int
    random_overlap: float
    samples: int

    def summary(self) -> dict[str, float]:
        """Adjacent-layer and distant (>= 2 apart) means of each matrix, and the baseline."""
        L = self.overlap_k.shape[0]
        i, j = torch.triu_indices(L, L, 1)
        adj = (j - i) == 1
        out: dict[str, float] = {"layers": float(L), "rank": float(self.rank)}
        for name in ("overlap_k", "overlap_v", "cka_k", "cka_v"):
            m = getattr(self, name)[i, j]
            out[f"{name}_adjacent"] = float(m[adj].mean()) if adj.any() else float("nan")
            far = ~adj
            out[f"{name}_distant"] = float(m[far].mean()) if far.any() else float("nan")
        out["random_overlap"] = self.random_overlap
        return out


@torch.no_grad()
def layer_alignment(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    context_mask: torch.Tensor,
    rank_fraction: float = 0.25,
) -> LayerAlignment:
    """The alignment matrices of :func:`collect_context_kv`'s output.

    Args:
        keys, values: per layer [B, T, W].
        context_mask: [B, T] bool.
        rank_fraction: r = ``round(rank_fraction * W_k)`` (at most M), for keys and values.
    """
    L = len(keys)
    B = context_mask.shape[0]
    acc = {n: torch.zeros(L, L, dtype=torch.float64) for n in ("ok", "ov", "ck", "cv")}
    rank = max(1, round(rank_fraction * keys[0].shape[-1]))
    rand = 0.0
    for b in range(B):
        m = context_mask[b]
        M = int(m.sum())
        if M < 2:
            continue
        ks = [k[b, m] for k in keys]
        vs = [v[b, m] for v in values]
        uk = [token_subspace(x, rank) for x in ks]
        uv = [token_subspace(x, rank) for x in vs]
        rand += min(rank, M) / M
        for a in range(L):
            for c in range(L):
                acc["ok"][a, c] += subspace_overlap(uk[a], uk[c])
                acc["ov"][a, c] += subspace_overlap(uv[a], uv[c])
                acc["ck"][a, c] += linear_cka(ks[a], ks[c])
                acc["cv"][a, c] += linear_cka(vs[a], vs[c])
    n = max(sum(int(context_mask[b].sum()) >= 2 for b in range(B)), 1)
    return LayerAlignment(
        overlap_k=(acc["ok"] / n).float(),
        overlap_v=(acc["ov"] / n).float(),
        cka_k=(acc["ck"] / n).float(),
        cka_v=(acc["cv"] / n).float(),
        rank=rank,
        random_overlap=rand / n,
        samples=n,
    )
