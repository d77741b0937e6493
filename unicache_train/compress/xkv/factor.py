"""xKV's factorisation: layer groups, flattened heads, the fp32 basis, the rank.

Pure functions of tensors (arXiv 2503.18893 §3-4). Shape legend: B, M, H, D, W, K, r, q = batch,
rows (context tokens or kept entries), KV heads, head dim, concatenated width, ``min(M, W)``,
rank, sketch width.

Three ways to the basis (``XKVConfig.factorization``; every one returns the right singular
vectors by decreasing singular value, which is all the fit uses):

* ``"svd"``: ``torch.linalg.svd`` of each sample's ``[M, W]`` rows (the reference);
* ``"gram"``: ``torch.linalg.eigh`` of the smaller Gram matrix: ``XᵀX [W, W]`` in fp32 (its
  eigenvectors are the basis; squaring the condition number only blurs directions below
  ``sqrt(eps) ≈ 3.5e-4`` of the largest singular value, under ``1e-7`` of the energy each) or
  ``XXᵀ [M, M]`` in fp64 (then ``V = XᵀU / s``; directions below ``sqrt(eps32)`` of the
  largest singular value are returned as zero columns);
* ``"lowrank"``: a randomized range finder (Halko et al. 2011, arXiv 0909.4061, Alg. 4.4: a
  Gaussian sketch of ``q = r + LOWRANK_OVERSAMPLE`` columns, ``LOWRANK_ITERS`` subspace
  iterations with QR re-orthonormalisation, an SVD of the ``[q, W]`` projection), from a fixed
  seed, so a fit never draws from the global random stream; only the top ``q`` directions
  exist, so it needs a rank known before the factorisation (``rank_mode`` ``"reduction"`` or
  ``"fraction"``).
"""

from __future__ import annotations

import torch

from unicache_train.compress.config import XKVConfig

__all__ = [
    "FACTORIZATIONS",
    "LOWRANK_OVERSAMPLE",
    "LOWRANK_ITERS",
    "layer_groups",
    "flatten_heads",
    "svd_basis",
    "gram_basis",
    "lowrank_basis",
    "pooled_svd_basis",
    "select_rank",
    "rank_mask",
]


#: ``XKVConfig.factorization`` values (module docstring).
FACTORIZATIONS = ("svd", "gram", "lowrank")
#: Columns of the randomized sketch beyond the largest rank of the batch (``"lowrank"``).
LOWRANK_OVERSAMPLE = 10
#: Subspace (power) iterations of the randomized range finder (``"lowrank"``).
LOWRANK_ITERS = 2
_LOWRANK_SEED = 0x5EED


def layer_groups(num_layers: int, group_size: int) -> list[tuple[int, ...]]:
    """Contiguous groups ``(0..G-1), (G..2G-1), ...``; the last may be shorter."""
    starts = range(0, num_layers, group_size)
    return [tuple(range(s, min(s + group_size, num_layers))) for s in starts]


def flatten_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H*D]."""
    return x.transpose(1, 2).flatten(2)


@torch.no_grad()
def svd_basis(
    x: torch.Tensor, valid: torch.Tensor, factorization: str = "svd"
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 basis of each sample's valid rows.

    Args:
        x: [B, M, W] (any float dtype).
        valid: [B, M] bool; invalid rows are zeroed (zero rows leave the right singular vectors
            of the valid rows unchanged).
        factorization: ``"svd"`` or ``"gram"`` (``"lowrank"``: :func:`lowrank_basis`).

    Returns:
        (basis [B, W, K] right singular vectors by decreasing singular value, singular values
        [B, K]), ``K = min(M, W)``, fp32, no gradient.
    """
    xf = x.detach().float() * valid[..., None]
    if factorization == "gram":
        return gram_basis(xf)
    if factorization != "svd":
        raise ValueError(
            f"svd_basis: factorization={factorization!r} is not allowed; choose one of "
            "['svd', 'gram'] (lowrank_basis takes the sketch width)"
        )
    _, s, vh = torch.linalg.svd(xf, full_matrices=False)
    return vh.mT, s


@torch.no_grad()
def gram_basis(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The right singular vectors from an eigendecomposition of the smaller Gram matrix.

    Args:
        xf: [..., M, W] fp32 (rows already masked).

    Returns:
        (basis [..., W, K], singular values [..., K]) by decreasing singular value,
        ``K = min(M, W)``; with ``M < W`` the directions whose singular value is below
        ``sqrt(eps)`` of the largest are returned as zero columns (module docstring).
    """
    M, W = xf.shape[-2:]
    if W <= M:
        evals, evecs = torch.linalg.eigh(xf.mT @ xf)  # ascending
        return evecs.flip(-1), evals.flip(-1).clamp_min(0.0).sqrt()
    # NOTE: fp64 here: V = XᵀU / s divides the eigenvectors' round-off by s, which fp32 would
    # leave at ~1e-5 of a full-rank reconstruction (tests/test_xkv.py asks < 1e-5).
    xd = xf.double()
    evals, u = torch.linalg.eigh(xd @ xd.mT)  # [..., M], [..., M, M]
    sv = evals.flip(-1).clamp_min(0.0).sqrt()
    keep = sv > sv[..., :1] * torch.finfo(torch.float32).eps ** 0.5
    basis = (xd.mT @ u.flip(-1)) / torch.where(keep, sv, 1.0)[..., None, :]  # V = XᵀU / s
    return (basis * keep[..., None, :]).float(), sv.float()


@torch.no_grad()
def lowrank_basis(
    x: torch.Tensor, valid: torch.Tensor, q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``q`` right singular vectors of each sample by a randomized range finder.

    Args:
        x: [B, M, W]; valid: [B, M] bool (invalid rows zeroed).
        q: sketch width (the largest rank needed plus :data:`LOWRANK_OVERSAMPLE`), clipped
            to ``min(M, W)``.

    Returns:
        (basis [B, W, q] by decreasing singular value, the q estimated singular values [B, q]),
        fp32, no gradient; deterministic (fixed seed, the global random stream untouched).
    """
    xf = x.detach().float() * valid[..., None]
    M, W = xf.shape[-2:]
    q = max(1, min(q, M, W))
    gen = torch.Generator(device=xf.device).manual_seed(_LOWRANK_SEED)
    omega = torch.randn(W, q, generator=gen, device=xf.device)
    basis = torch.linalg.qr(xf @ omega).Q  # [B, M, q] range of X
    for _ in range(LOWRANK_ITERS):
        basis = torch.linalg.qr(xf @ torch.linalg.qr(xf.mT @ basis).Q).Q
    _, s, vh = torch.linalg.svd(basis.mT @ xf, full_matrices=False)  # [B, q, W]
    return vh.mT, s


@torch.no_grad()
def pooled_svd_basis(
    x: torch.Tensor, valid: torch.Tensor, factorization: str = "svd"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One basis for the whole batch: SVD of every sample's valid rows stacked (``"gram"``
    and ``"lowrank"``: the eigendecomposition of their ``[W, W]`` Gram matrix).

    Returns:
        (basis [W, K], singular values [K]), fp32.
    """
    xf = (x.detach().float() * valid[..., None]).flatten(0, 1)  # [B*M, W]
    if factorization != "svd":
        return gram_basis(xf)
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
