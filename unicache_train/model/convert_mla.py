"""GQA -> MLA conversion: turn a trained GQA/MHA decoder into a DeepseekV3-style MLA decoder.

After TransMLA (Meng et al., arXiv 2502.07864: RoRoPE, balanced joint K/V PCA) and MHA2MLA
(Ji et al., arXiv 2502.14837: partial RoPE by frequency contribution, joint K/V SVD), with a
DeepseekV3-loadable target: ONE shared ``k_pe`` head, a normed latent ``c_kv``, standard RoPE.

Shape legend: N, C, H, Hk, G, D, F = calibration tokens, hidden size, query heads, KV heads,
query heads per KV head, source head dim, source RoPE frequencies (``D / 2``); R, Dr =
``kv_lora_rank``, ``qk_rope_head_dim``. A frequency ``i`` of a rotate-half head is the pair of
coordinates ``(i, i + F)``, written as one complex number ``z = x_i + j x_{i+F}``: RoPE multiplies
it by ``exp(j θ_i t)``.

Per layer (weights in float64, statistics from the layer's attention inputs on a calibration
batch, gathered with forward pre-hooks in two passes):

1. **Shared RoPE head (RoRoPE, complex form).** RoPE commutes with any *complex-linear* map
   across KV heads at one frequency, so for frequency ``i`` the top eigenvector ``u_i`` of the
   key covariance ``E[z zᴴ]`` [Hk, Hk] gives a principal key ``p = u_iᴴ z`` that still rotates
   exactly; query head ``h`` (KV group ``g``) reads it through ``conj(u_i[g]) · q_h``. (TransMLA
   uses a real PCA over the two coordinates; the complex one also aligns heads whose pairs differ
   by a phase, which trained heads do.) ``Dr / 2`` frequencies go into ``k_pe``.
2. **Which frequencies.** One ``rope_theta`` serves the whole MLA model, and its ``Dr / 2``
   frequencies form a geometric ladder from 1 rad/token, so the kept set must be
   ``{0, s, 2s, ...}`` for a stride ``s`` with ``rope_theta' = rope_theta^(s Dr / D)`` (exact, no
   interpolation). ``s`` maximises, summed over layers and query heads, the logit error removed:
   ``‖q_h,i‖ (‖k_g,i‖ - ‖k_g,i - u[g] p‖) · sqrt(1 - |c_h,i|²)`` (MHA2MLA's 2-norm criterion
   weighted by what losing the rotation costs, see 3.).
3. **NoPE part.** Everything not in ``k_pe`` (other frequencies, and the non-principal
   remainder ``z - u[g] p`` of kept ones) becomes position-free: ``qk_nope_head_dim = D``,
   ``k_nope_h`` = the remainder key of head ``h``'s KV group. Dropping RoPE replaces the rotation
   ``exp(jθ_iΔ)`` by a constant; instead of 1 (MHA2MLA) we use its attention-weighted mean
   ``c_h,i = E[exp(jθ_iΔ)]`` (Δ = key - query position, weights ``p_ts |q_t,i|² |k_s,i|²`` from the
   source's own attention on the calibration batch), the least-squares best constant, folded into
   the query: ``q_nope_h,i = conj(c_h,i) q_h,i``. Fast frequencies whose phase averages out get
   small queries instead of a wrong, un-rotated logit; the residual error
   ``E|exp(jθΔ) - c|² = 1 - |c|²`` is the first approximation.
4. **Latent (joint K/V PCA).** The NoPE keys and the values of all KV heads are stacked
   ``[2 Hk D, C]`` and each group is weighted by a first-order output sensitivity
   (``weighting="output"``): keys by ``(Σ_h σ_h² / D · E[q_h q_hᵀ])^½`` (a key error moves the
   logit by ``q·δk / √D`` and the output by about the spread ``σ_h`` of ``o_proj``-projected
   values), values by ``(Σ_h W_o,hᵀ W_o,h)^½`` (what ``o_proj`` makes of a value error). This
   generalises TransMLA's K/V balancing. ``kv_a_proj_with_mqa``'s latent rows are the top-R
   principal directions of the weighted outputs over the calibration inputs (activation-aware
   SVD); rank R is the second approximation.
5. **Through the norm.** DeepseekV3 puts an RMSNorm on the latent (``kv_a_layernorm``), a
   per-token rescaling no linear map undoes. ``kv_b_proj`` is therefore fitted by least squares
   (second pass over the calibration batch) from the *normed* latent to the exact NoPE keys and
   values, which is optimal given the latent directions; what remains is the third approximation.
6. Queries are scaled by ``sqrt((D + Dr) / D)`` (MLA's softmax scale is ``(Dn + Dr)^-½``);
   ``o_proj``, norms, MLP and embeddings are copied; ``q_lora_rank = None``.

Practical notes. The RoPE budget dominates: on the recipe's tiny model (2 KV heads x 32 dims,
128 elements/token/layer, 4x target) ``R=24, Dr=8`` converts to ppl ~10 before healing while
``R=16, Dr=16`` gives ~2.6-3.0 (source ~1.9), because everything outside ``k_pe`` loses its
rotation; the latent keeps >96% of the weighted K/V energy either way. The mean rotation ``c`` is
measured at the calibration length: calibrate on sequences as long as the deployment context.
Calibration activations are reduced to ``[C, C]`` / ``[C, R]`` moments on the fly (two forward
passes), so memory does not grow with the calibration set.

``init="random"`` keeps every non-attention weight and draws fresh MLA attention weights: the
baseline that shows what the SVD init is worth before and after healing.

KV elements per token per layer drop from ``2 Hk D`` to ``R + Dr``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from unicache_train.model.attention import kv_bytes_per_token
from unicache_train.model.config import ModelConfig
from unicache_train.model.decoder import Decoder
from unicache_train.model.mla import LATENT_NORM_EPS

__all__ = [
    "MLAConversionReport",
    "convert_to_mla",
    "convert_to_mla_with_report",
    "kv_elements_per_token",
    "mla_config_from",
]

WEIGHTINGS = ("output", "none")
ROPE_SELECTIONS = ("weighted", "2norm")
INITS = ("svd", "random")
ROTATIONS = ("mean", "drop")


@dataclass
class LayerReport:
    """Diagnostics of one converted layer (fractions in [0, 1])."""

    layer: int
    rope_key_energy: float  # kept-frequency key energy carried by the shared k_pe head
    latent_energy: float  # weighted NoPE-K/V energy inside the top-R latent directions
    k_fit_error: float  # relative LS error of the NoPE keys from the normed latent
    v_fit_error: float  # relative LS error of the values from the normed latent


@dataclass
class MLAConversionReport:
    """What the conversion chose and how much it kept."""

    init: str
    rope_stride: int
    rope_theta: float
    kept_frequencies: list[int]
    kv_elements_before: int
    kv_elements_after: int
    layers: list[LayerReport] = field(default_factory=list)

    @property
    def kv_reduction(self) -> float:
        return self.kv_elements_before / self.kv_elements_after


def kv_elements_per_token(config: ModelConfig) -> int:
    """Cache elements per token per layer (K+V for GQA, ``c_kv`` + ``k_pe`` for MLA)."""
    return kv_bytes_per_token(config, bytes_per_element=1)


def mla_config_from(
    config: ModelConfig, kv_lora_rank: int, qk_rope_head_dim: int, rope_theta: float | None = None
) -> ModelConfig:
    """The MLA config a GQA ``config`` converts to (``qk_nope_head_dim = v_head_dim = D``)."""
    D = config.head_size
    return dataclasses.replace(
        config,
        attention_type="mla",
        num_key_value_heads=config.num_attention_heads,  # MLA expands K/V to every head
        q_lora_rank=None,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=D,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=D,
        rope_theta=config.rope_theta if rope_theta is None else rope_theta,
    )


def convert_to_mla(
    model: Decoder,
    calib_ids: torch.Tensor,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    *,
    init: str = "svd",
    weighting: str = "output",
    rotation: str = "mean",
    rope_selection: str = "weighted",
    ridge: float = 1e-6,
    batch_size: int = 8,
    seed: int = 0,
) -> Decoder:
    """Convert a GQA/MHA :class:`Decoder` to MLA (see the module docstring for the method).

    Args:
        model: the source decoder (``attention_type="gqa"``, no attention bias); not modified.
        calib_ids: [B, T] calibration token ids (a few thousand tokens of in-domain text).
        kv_lora_rank: R, the latent width.
        qk_rope_head_dim: Dr, the shared RoPE key head width (even, at most the source head dim).
        init: ``"svd"`` (the method) or ``"random"`` (fresh MLA attention, the baseline).
        weighting: ``"output"`` (sensitivity-weighted joint K/V PCA) or ``"none"`` (plain).
        rotation: ``"mean"`` (attention-weighted expected rotation replaces RoPE in the NoPE
            part) or ``"drop"`` (plain RoPE removal, as in MHA2MLA).
        rope_selection: how the RoPE stride is scored: ``"weighted"`` (the logit error removed,
            step 2 of the module docstring) or ``"2norm"`` (MHA2MLA's S_2-norm criterion: the
            summed ``‖q_h,i‖ ‖k_g,i‖`` of the kept frequencies). MHA2MLA keeps each head's own
            top frequencies; a DeepseekV3 ``k_pe`` needs one geometric ladder, so here either
            criterion picks among the ladders ``{0, s, 2s, ...}``.
        ridge: ridge of the ``kv_b_proj`` least-squares fit, relative to the latent's scale.
        batch_size: calibration sequences per forward pass.
        seed: seed of the random init (the global RNG is left untouched).

    Returns:
        A new MLA :class:`Decoder` on the source's device and dtype, in eval mode.
    """
    return convert_to_mla_with_report(
        model,
        calib_ids,
        kv_lora_rank,
        qk_rope_head_dim,
        init=init,
        weighting=weighting,
        rotation=rotation,
        rope_selection=rope_selection,
        ridge=ridge,
        batch_size=batch_size,
        seed=seed,
    )[0]


@torch.no_grad()
def convert_to_mla_with_report(
    model: Decoder,
    calib_ids: torch.Tensor,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    *,
    init: str = "svd",
    weighting: str = "output",
    rotation: str = "mean",
    rope_selection: str = "weighted",
    ridge: float = 1e-6,
    batch_size: int = 8,
    seed: int = 0,
) -> tuple[Decoder, MLAConversionReport]:
    """:func:`convert_to_mla`, also returning an :class:`MLAConversionReport`."""
    src = model.config
    Hk, D = src.num_key_value_heads, src.head_size
    R, Dr = kv_lora_rank, qk_rope_head_dim
    if src.attention_type != "gqa":
        raise ValueError(f"ModelConfig.attention_type={src.attention_type!r}: source must be 'gqa'")
    if src.attention_bias:
        raise ValueError(
            "ModelConfig.attention_bias=True: biased K/V are not supported "
            "(MLA's kv_b_proj has no bias)"
        )
    if init not in INITS:
        raise ValueError(f"init={init!r}: choose one of {list(INITS)}")
    if src.rope_scaling.rope_type != "default" and init != "random":
        # NOTE: the frequency selection below assumes the default ladder rope_theta^(-2i/D);
        # scaled tables (llama3 bands, yarn ramp, dynamic) are not a geometric ladder.
        raise ValueError(
            f"ModelConfig.rope_scaling.rope_type={src.rope_scaling.rope_type!r}: conversion to "
            "MLA is implemented for default RoPE only (init='random' keeps the scaling)"
        )
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r}: choose one of {list(ROTATIONS)}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting={weighting!r}: choose one of {list(WEIGHTINGS)}")
    if rope_selection not in ROPE_SELECTIONS:
        raise ValueError(
            f"rope_selection={rope_selection!r}: choose one of {list(ROPE_SELECTIONS)}"
        )
    if not (isinstance(Dr, int) and 2 <= Dr <= D and Dr % 2 == 0):
        raise ValueError(f"qk_rope_head_dim={Dr} must be even and in [2, head_dim={D}]")
    if not (isinstance(R, int) and 1 <= R <= 2 * Hk * D):
        raise ValueError(
            f"kv_lora_rank={R} must be in [1, 2 * num_key_value_heads * head_dim = {2 * Hk * D}]"
        )
    if calib_ids.ndim != 2:
        raise ValueError(f"calib_ids must be [B, T] token ids, got shape {tuple(calib_ids.shape)}")
    param = next(model.parameters())
    before = kv_elements_per_token(src)

    if init == "random":
        target = mla_config_from(src, R, Dr)
        new = _fresh_decoder(target, seed)
        _copy_non_attention(model, new)
        report = MLAConversionReport(
            init, D // Dr, src.rope_theta, [], before, kv_elements_per_token(target)
        )
        return new.to(param.device, param.dtype).eval(), report

    theta_i = src.rope_theta ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)
    layers = [_LayerPlan.from_attention(layer.self_attn, theta_i) for layer in model.layers]
    # Pass 1: input second moments and attention-weighted rotation statistics per layer.
    _run_with_inputs(
        model, calib_ids, batch_size, lambda i, x, positions: layers[i].observe(x, positions)
    )

    # RoPE head: per-layer gains per frequency, then one stride for the whole model.
    gains = torch.stack([plan.rope_gains(rotation, rope_selection) for plan in layers]).sum(0)
    stride = _best_stride(gains, D // 2, Dr // 2)
    kept = [m * stride for m in range(Dr // 2)]
    theta_new = float(src.rope_theta ** (stride * Dr / D))
    target = mla_config_from(src, R, Dr, rope_theta=theta_new)

    for plan in layers:
        plan.plan_latent(kept, R, Dr, weighting)
    # Pass 2: least-squares fit of kv_b_proj from the normed latent.
    for plan in layers:
        plan.scc = torch.zeros(R, R, dtype=torch.float64, device=param.device)
        plan.sxc = torch.zeros(src.hidden_size, R, dtype=torch.float64, device=param.device)

    def add_latent_moments(i: int, x: torch.Tensor, positions: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        c = layers[i].normed_latent(x)
        layers[i].scc += c.T @ c
        layers[i].sxc += x.T @ c

    _run_with_inputs(model, calib_ids, batch_size, add_latent_moments)

    new = _fresh_decoder(target, seed).to(param.device, torch.float64)
    _copy_non_attention(model, new)
    report = MLAConversionReport(
        init, stride, theta_new, kept, before, kv_elements_per_token(target)
    )
    for idx, (plan, layer) in enumerate(zip(layers, new.layers)):
        report.layers.append(plan.write(layer.self_attn, ridge, idx))
    return new.to(param.device, param.dtype).eval(), report


# ----------------------------------------------------------------------------- calibration
def _run_with_inputs(
    model: Decoder,
    calib_ids: torch.Tensor,
    batch_size: int,
    fn: Callable[[int, torch.Tensor, torch.Tensor], None],
) -> None:
    """Run ``model`` on ``calib_ids`` and call ``fn(layer_idx, x [B, T, C] float64, positions
    [B, T])`` with every layer's attention input (the output of its ``input_layernorm``)."""
    was_training = model.training
    model.eval()
    handles = []
    for i, layer in enumerate(model.layers):

        def hook(_module, args, kwargs, i=i):
            x = args[0] if args else kwargs["x"]
            fn(i, x.double(), kwargs["positions"])

        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        device = next(model.parameters()).device
        for chunk in calib_ids.split(batch_size):
            model(chunk.to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


def _fresh_decoder(config: ModelConfig, seed: int) -> Decoder:
    """A newly initialised decoder, without consuming the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Decoder(config)


def _best_stride(gains: torch.Tensor, F: int, kept: int) -> int:
    """The stride s maximising the gain of frequencies {0, s, ..., (kept - 1) s} (all < F)."""
    max_stride = F - 1 if kept == 1 else (F - 1) // (kept - 1)
    scores = [float(gains[torch.arange(kept) * s].sum()) for s in range(1, max_stride + 1)]
    return 1 + max(range(len(scores)), key=scores.__getitem__)


def _copy_non_attention(src: Decoder, dst: Decoder) -> None:
    """Everything but the attention projections: embeddings, norms, MLPs, LM head, HC modules."""
    state = {k: v for k, v in src.state_dict().items() if ".self_attn." not in k}
    missing, unexpected = dst.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(".self_attn." in k for k in missing), missing


def _complex(w: torch.Tensor) -> torch.Tensor:
    """Rotate-half rows [..., D, C] -> complex rows [..., F, C] (row i is x_i + j x_{i+F})."""
    F = w.shape[-2] // 2
    return torch.complex(w[..., :F, :], w[..., F:, :])


def _real(z: torch.Tensor) -> torch.Tensor:
    """Complex rows [..., F, C] -> rotate-half rows [..., D, C]."""
    return torch.cat([z.real, z.imag], dim=-2)


def _sqrtm_psd(m: torch.Tensor) -> torch.Tensor:
    evals, evecs = torch.linalg.eigh(m)
    return (evecs * evals.clamp_min(0).sqrt()) @ evecs.T


@dataclass
class _LayerPlan:
    """One layer's source weights (float64), calibration statistics and conversion choices.

    :meth:`observe` accumulates statistics, :meth:`rope_gains` sets the RoRoPE directions ``u``
    (and ``lam``, ``kdiag``, ``c``), :meth:`plan_latent` the new projections, :meth:`write`
    fits ``kv_b_proj`` and copies everything into an ``MLAttention``.
    """

    wq: torch.Tensor  # [H, D, C]
    wk: torch.Tensor  # [Hk, D, C]
    wv: torch.Tensor  # [Hk, D, C]
    wo: torch.Tensor  # [C, H, D]
    theta: torch.Tensor  # [F] source RoPE frequencies
    n: int = 0
    sxx: torch.Tensor | None = None  # [C, C] sum of x xᵀ
    sx: torch.Tensor | None = None  # [C] sum of x
    rot_num: torch.Tensor | None = None  # [H, F] complex, sum of w exp(jθΔ)
    rot_den: torch.Tensor | None = None  # [H, F] sum of w
    scc: torch.Tensor | None = None  # [R, R] sum of ĉ ĉᵀ
    sxc: torch.Tensor | None = None  # [C, R] sum of x ĉᵀ

    @classmethod
    def from_attention(cls, attn: torch.nn.Module, theta: torch.Tensor) -> _LayerPlan:
        H, Hk, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        w = attn.q_proj.weight
        return cls(
            wq=w.detach().double().view(H, D, -1),
            wk=attn.k_proj.weight.detach().double().view(Hk, D, -1),
            wv=attn.v_proj.weight.detach().double().view(Hk, D, -1),
            wo=attn.o_proj.weight.detach().double().view(-1, H, D),
            theta=theta.to(w.device),
        )

    @property
    def group(self) -> torch.Tensor:
        """[H] the KV head each query head reads."""
        H, Hk = self.wq.shape[0], self.wk.shape[0]
        return torch.arange(H, device=self.wq.device) // (H // Hk)

    @property
    def cov(self) -> torch.Tensor:
        """[C, C] E[x xᵀ] over the calibration tokens."""
        return self.sxx / self.n

    def observe(self, x: torch.Tensor, positions: torch.Tensor) -> None:
        """Accumulate statistics of one calibration chunk: x [B, T, C], positions [B, T]."""
        B, T, C = x.shape
        H, D, _ = self.wq.shape
        flat = x.reshape(-1, C)
        if self.sxx is None:
            self.sxx = torch.zeros(C, C, dtype=x.dtype, device=x.device)
            self.sx = torch.zeros(C, dtype=x.dtype, device=x.device)
            self.rot_num = torch.zeros(H, D // 2, dtype=torch.complex128, device=x.device)
            self.rot_den = torch.zeros(H, D // 2, dtype=x.dtype, device=x.device)
        self.sxx += flat.T @ flat
        self.sx += flat.sum(0)
        self.n += flat.shape[0]
        # The source's own attention probabilities p [B, H, T, S] (causal, RoPE).
        q = torch.einsum("btc,hdc->bhtd", x, self.wq)  # [B, H, T, D]
        k = torch.einsum("btc,gdc->bgtd", x, self.wk)[:, self.group]  # [B, H, T, D]
        phase = positions.double()[..., None] * self.theta  # [B, T, F]
        rot = torch.polar(torch.ones_like(phase), phase)[:, None]  # [B, 1, T, F]
        qz = _complex(q.transpose(-1, -2)).transpose(-1, -2)  # [B, H, T, F]
        kz = _complex(k.transpose(-1, -2)).transpose(-1, -2)  # [B, H, T, F]
        # Rotate-half dot product = sum over frequencies of Re(conj(q) k), after RoPE.
        logits = torch.einsum("bhtf,bhsf->bhts", torch.conj(qz * rot), kz * rot).real / D**0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        # Weighted mean rotation per head and frequency: w = p |q_t,i|² |k_s,i|², Δ = s - t.
        # Contract over keys first (p @ ...), so nothing [B, H, T, S, F] is materialised.
        q2, k2 = qz.abs() ** 2, kz.abs() ** 2  # [B, H, T, F]
        self.rot_num += (q2 * torch.conj(rot) * (p.to(qz.dtype) @ (k2 * rot))).sum((0, 2))
        self.rot_den += (q2 * (p @ k2)).sum((0, 2))

    def mean_rotation(self, rotation: str) -> torch.Tensor:
        """[H, F] complex constant replacing RoPE's rotation in the NoPE part."""
        if rotation == "drop":
            return torch.ones_like(self.rot_num)
        return self.rot_num / self.rot_den.clamp_min(1e-30)

    def rope_gains(self, rotation: str, selection: str = "weighted") -> torch.Tensor:
        """[F] score of putting frequency i's principal key into k_pe: the logit error removed
        (``selection="weighted"``) or MHA2MLA's 2-norm ``sum_h ‖q_h,i‖ ‖k_g,i‖``
        (``"2norm"``); also stores the per-frequency principal directions ``u`` [F, Hk] and key
        covariances."""
        zk, zq = _complex(self.wk), _complex(self.wq)  # [Hk, F, C], [H, F, C]
        cov = self.cov.to(zk.dtype)
        kcov = torch.einsum("gic,cd,hid->igh", zk, cov, zk.conj())  # [F, Hk, Hk] E[z zᴴ]
        evals, evecs = torch.linalg.eigh(kcov)
        self.u, self.lam = evecs[..., -1], evals[..., -1].clamp_min(0)  # [F, Hk], [F]
        self.kdiag = kcov.diagonal(dim1=-2, dim2=-1).real.clamp_min(0)  # [F, Hk]
        q_energy = torch.einsum("hic,cd,hid->ih", zq, cov, zq.conj()).real.clamp_min(0)  # [F, H]
        g = self.group
        k_all = self.kdiag[:, g]  # [F, H]
        k_res = (k_all - self.lam[:, None] * self.u[:, g].abs() ** 2).clamp_min(0)
        self.c = self.mean_rotation(rotation)  # [H, F]
        # RMS of what replacing exp(jθΔ) by c costs: E|exp(jθΔ) - c|² = 1 - |m|² for the mean
        # c = m, and 2 - 2 Re(m) for c = 1.
        m = self.mean_rotation("mean")
        cost = (2 - 2 * m.real) if rotation == "drop" else (1 - m.abs() ** 2)
        cost = cost.clamp_min(0).sqrt()
        if selection == "2norm":
            return (q_energy.sqrt() * k_all.sqrt()).sum(1)
        return (q_energy.sqrt() * (k_all.sqrt() - k_res.sqrt()) * cost.T).sum(1)

    def plan_latent(self, kept: list[int], R: int, Dr: int, weighting: str) -> None:
        """Split keys into the shared RoPE head and the NoPE remainder; choose the latent."""
        H, D, C = self.wq.shape
        Hk = self.wk.shape[0]
        alpha = math.sqrt((D + Dr) / D)
        zk, zq = _complex(self.wk), _complex(self.wq)  # [Hk, F, C], [H, F, C]
        g = self.group
        pe_k = torch.zeros(Dr // 2, C, dtype=zk.dtype, device=zk.device)
        pe_q = torch.zeros(H, Dr // 2, C, dtype=zk.dtype, device=zk.device)
        zk_res = zk.clone()
        for m, i in enumerate(kept):
            u = self.u[i]  # [Hk]
            p = torch.einsum("g,gc->c", u.conj(), zk[:, i])  # principal key row [C]
            pe_k[m] = p
            zk_res[:, i] -= u[:, None] * p
            pe_q[:, m] = alpha * u[g].conj()[:, None] * zq[:, i]
        self.k_pe_rows = _real(pe_k)  # [Dr, C] rotate-half layout
        self.q_pe_rows = _real(pe_q)  # [H, Dr, C]
        # NoPE queries carry the constant that replaces the rotation (see the module docstring).
        self.q_nope_rows = alpha * _real(self.c.conj()[..., None] * zq)  # [H, D, C]
        self.wk_nope = _real(zk_res)  # [Hk, D, C]
        kept_energy = self.kdiag[kept].sum()
        self.rope_key_energy = float(self.lam[kept].sum() / kept_energy.clamp_min(1e-30))

        cov = self.cov
        if weighting == "output":
            wo = self.wo.permute(1, 0, 2)  # [H, C, D]
            # The spread of the values, not their mean, turns a logit error into an output error.
            mu = self.sx / self.n
            ccov = cov - torch.outer(mu, mu)
            vcov = torch.einsum("gdc,ce,gfe->gdf", self.wv, ccov, self.wv)  # [Hk, D, D]
            # Effective NoPE queries: alpha^2 / (D + Dr) = 1 / D, the source's logit scale.
            qn = self.q_nope_rows
            qcov = torch.einsum("hdc,ce,hfe->hdf", qn, cov, qn) * D / (D + Dr)  # [H, D, D]
            sigma2 = torch.einsum("hcd,hde,hce->h", wo, vcov[g], wo)  # [H] Var|W_o,h v|
            gk = torch.zeros(Hk, D, D, dtype=cov.dtype, device=cov.device)
            gv = torch.zeros_like(gk)
            gk.index_add_(0, g, sigma2[:, None, None] / D * qcov)
            gv.index_add_(0, g, wo.transpose(1, 2) @ wo)
            pk = torch.stack([_sqrtm_psd(m) for m in gk])
            pv = torch.stack([_sqrtm_psd(m) for m in gv])
        else:
            pk = pv = torch.eye(D, dtype=cov.dtype, device=cov.device).expand(Hk, D, D)
        wy = torch.cat([pk @ self.wk_nope, pv @ self.wv], dim=1).reshape(2 * Hk * D, C)
        evals, evecs = torch.linalg.eigh(wy @ cov @ wy.T)  # ascending
        top = evecs[:, -R:].flip(-1)  # [2 Hk D, R]
        self.latent_energy = float(evals[-R:].sum() / evals.sum().clamp_min(1e-30))
        a = top.T @ wy  # [R, C]
        # Unit mean-square latent, so kv_a_layernorm's eps is negligible and c is O(1).
        self.wa = a / evals[-R:].clamp_min(0).mean().sqrt().clamp_min(1e-30)

    def normed_latent(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C] -> kv_a_layernorm(x @ Aᵀ) with a unit gain [N, R]."""
        c = x @ self.wa.T
        return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + LATENT_NORM_EPS)

    def write(self, attn: torch.nn.Module, ridge: float, layer: int) -> LayerReport:
        """Fit kv_b_proj and write every MLA projection of ``attn`` (an ``MLAttention``)."""
        H, D, C = self.wq.shape
        R = self.wa.shape[0]
        g = self.group
        scc, sxc, cov = self.scc / self.n, self.sxc / self.n, self.cov
        reg = ridge * scc.diagonal().mean() * torch.eye(R, dtype=scc.dtype, device=scc.device)
        solve = torch.linalg.solve(scc + reg, sxc.T)  # [R, C]: B = W S_xc S_cc^-1
        bk = self.wk_nope @ solve.T  # [Hk, D, R]
        bv = self.wv @ solve.T  # [Hk, D, R]

        def rel_err(w: torch.Tensor, b: torch.Tensor) -> float:
            total = torch.einsum("gdc,ce,gde->", w, cov, w)
            fit = torch.einsum("gdr,rc,gdc->", b, sxc.T, w)
            resid = total - 2 * fit + torch.einsum("gdr,rs,gds->", b, scc, b)
            return float(resid.clamp_min(0) / total.clamp_min(1e-30))

        q = torch.cat([self.q_nope_rows, self.q_pe_rows], dim=1)  # [H, D + Dr, C]
        attn.q_proj.weight.copy_(q.reshape(-1, C))
        attn.kv_a_proj_with_mqa.weight.copy_(torch.cat([self.wa, self.k_pe_rows], dim=0))
        attn.kv_a_layernorm.weight.fill_(1.0)
        attn.kv_b_proj.weight.copy_(torch.cat([bk[g], bv[g]], dim=1).reshape(-1, R))
        attn.o_proj.weight.copy_(self.wo.reshape(C, -1))
        return LayerReport(
            layer,
            self.rope_key_energy,
            self.latent_energy,
            rel_err(self.wk_nope, bk),
            rel_err(self.wv, bv),
        )
