"""xKV's factorisation: layer groups, flattened heads, the fp32 SVD basis, the rank.

Pure functions of tensors (arXiv 2503.18893 §3-4). Shape legend: B, M, H, D, W, K, r = batch,
rows (context tokens or kept entries), KV heads, head dim, concatenated width, ``min(M, W)``,
rank.
"""

from __future__ import annotations

import torch

from unicache_train.compress.config import XKVConfig

__all__ = [
    "layer_groups",
    "flatten_heads",
    "svd_basis",
    "pooled_svd_basis",
    "select_rank",
    "rank_mask",
]


def layer_groups(num_layers: int, group_size: int) -> list[tuple[int, ...]]:
    """Contiguous groups ``(0..G-1), (G..2G-1), ...``; the last may be shorter."""
    starts = range(0, num_layers, group_size)
    return [tuple(range(s, min(s + group_size, num_layers))) for s in starts]


def flatten_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H*D]."""
    return x.transpose(1, 2).flatten(2)


@torch.no_grad()
def svd_basis(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 SVD of each sample's valid rows.

    Args:
        x: [B, M, W] (any float dtype).
        valid: [B, M] bool; invalid rows are zeroed (zero rows leave the right singular vectors
            of the valid rows unchanged).

    Returns:
        (basis [B, W, K] right singular vectors by decreasing singular value, singular values
        [B, K]), ``K = min(M, W)``, fp32, no gradient.
    """
    xf = x.detach().float() * valid[..., None]
    _, s, vh = torch.linalg.svd(xf, full_matrices=False)
    return vh.mT, s


@torch.no_grad()
def pooled_svd_basis(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One basis for the whole batch: SVD of every sample's valid rows stacked.

    Returns:
        (basis [W, K], singular values [K]), fp32.
    """
    xf = (x.detach().float() * valid[..., None]).flatten(0, 1)  # [B*M, W]
    _, s, vh = torch.linalg.svd(xf, full_matrices=False)
    return vh.mT, s


def select_rank(
    config: XKVConfig,
    sv: torch.Tensor,
    width: int,
    rows: torch.Tensor,
    context_tokens: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """Rank per sample.

    Args:
        config: ``rank_mode`` and its value.
        sv: [B, K] singular values (decreasing).
        width: W, the concatenated width of the group.
        rows: [B] entries factorised (context tokens, or the entries kept by token compression).
        context_tokens: [B] context tokens before any compression (the byte baseline).
        scale: curriculum factor in [0, 1]; 0 is full rank, 1 the configured setting.

    Returns:
        [B] long in ``[1, min(rows, K)]`` (``min_rank`` permitting): ``fraction``:
        ``round(f * W)``; ``energy``: the smallest r with ``sum_{i<r} s_i^2 >= e * sum s_i^2``;
        ``reduction``: the largest r with ``r (rows + W) <= context_tokens * W / reduction``.
    """
    B, K = sv.shape
    dev = sv.device
    rows = rows.to(dev)
    if config.rank_mode == "fraction":
        f = 1.0 - scale * (1.0 - config.rank_fraction)
        r = torch.full((B,), round(f * width), dtype=torch.long, device=dev)
    elif config.rank_mode == "energy":
        e = 1.0 - scale * (1.0 - config.energy)
        power = sv.double() ** 2
        cum = power.cumsum(1) / power.sum(1, keepdim=True).clamp_min(1e-300)
        # NOTE: a small slack so that e = 1 keeps the rank of the data, not round-off dust.
        r = (cum < e - 1e-9).sum(1) + 1
    else:
        q = 1.0 + scale * (config.reduction - 1.0)
        budget = context_tokens.to(dev).double() * width / q
        r = torch.floor(budget / (rows.double() + width) + 1e-9).long()
    cap = torch.clamp(rows.long(), max=min(K, width)).clamp_min(1)
    return torch.minimum(r.clamp_min(config.min_rank), cap)


def rank_mask(rank: torch.Tensor, r_max: int) -> torch.Tensor:
    """[B] ranks -> [B, 1, r_max] float mask of the kept columns."""
    cols = torch.arange(r_max, device=rank.device)
    return (cols[None, :] < rank[:, None]).float()[:, None, :]
