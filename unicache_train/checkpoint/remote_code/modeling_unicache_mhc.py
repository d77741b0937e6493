"""unicache_train mHC decoder for HF transformers (self-contained remote code).

Shape legend: B, T, S, n, C, H, Hk, D = batch, query tokens, key tokens, residual streams
(``hc_mult``), hidden size, query heads, KV heads, head dim.

Llama-style blocks (GQA + RoPE rotate-half, SwiGLU, RMSNorm; optional q/k/v biases and per-head
q_norm/k_norm) with the residual widened to ``n`` streams ``X [B, T, n, C]``; each sub-layer has a
hyper-connection with the numerics of transformers' ``deepseek_v4`` preset::

    raw  = RMSNorm_unweighted(flatten(X)) @ fn.T       -> pre [n], post [n], res [n, n]
    pre  = sigmoid(raw_pre * s0 + b_pre) + eps
    post = 2 sigmoid(raw_post * s1 + b_post)
    comb = sinkhorn(softmax(raw_res * s2 + b_res) + eps)   (column norm, then (iters-1) x row, col)
    X'   = post (x) F(norm(sum_i pre_i X_i)) + comb^T X

Embeddings enter as n copies; ``hc_head`` collapses the streams before the final norm.
Hyper-connection parameters are kept in fp32 (``_keep_in_fp32_modules``).

With ``n_routed_experts > 0`` the FFN of layers ``>= first_k_dense_replace`` is a DeepSeek MoE
(as deepseek_v4 pairs mHC with MoE; router numerics of transformers' deepseek_v3): sigmoid
scores, ``e_score_correction_bias`` added for the choice only, group-limited top-k (keep the
``topk_group`` of ``n_group`` groups with the best top-2 sums), weights = the chosen scores
(normalised if ``norm_topk_prob``) times ``routed_scaling_factor``; plus shared experts of width
``moe_intermediate_size * n_shared_experts``. Experts are stacked: ``experts.gate_up_proj
[E, 2I, C]`` (gate rows, then up rows), ``experts.down_proj [E, C, I]``. The router stays fp32.

Generation: ``GenerationMixin`` with a ``DynamicCache`` K/V cache (``use_cache=True``) or
without one (``use_cache=False``: the full prefix is recomputed every step). Padding via a 2-D
``attention_mask`` is honoured for the keys; positions are ``arange`` (left padding shifts them,
as in a model without padding-aware position ids).

RoPE scaling (``config.rope_parameters``): ``default``, ``linear``, ``dynamic``, ``llama3`` and
``yarn`` with transformers' numerics (:func:`rope_frequencies`); YaRN's attention factor scales
cos and sin, as transformers does. ``dynamic`` rescales per forward from the largest position.

This file must not import unicache_train: it ships next to the exported weights.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as _init
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_unicache_mhc import UnicacheMhcConfig

# transformers >= 5.x names the K/V cache ``cache``; older versions ``past_key_values``.
_CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else ("past_key_values")
)


def rms_norm(x, eps, weight=None):
    """[..., C] -> [..., C]; fp32 statistics, gain applied in the input dtype (as HF Llama)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(dtype) if weight is None else weight * h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.eps, self.weight)


def _mscale(factor, mscale=1.0):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(rope, dim, max_position_embeddings, position_ids):
    """rope_parameters -> (inverse frequencies [D/2] fp32, attention factor), as transformers'
    modeling_rope_utils computes them (``dynamic``: for the largest position in position_ids)."""
    kind, theta = rope.get("rope_type", "default"), rope["rope_theta"]
    f = rope.get("factor")
    device = position_ids.device
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (theta**exponent)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / f, 1.0
    if kind == "dynamic":
        L0 = max_position_embeddings
        length = position_ids.max() + 1
        grown = torch.maximum(length, torch.tensor(L0, dtype=length.dtype, device=device))
        base = theta * ((f * grown / L0) - (f - 1)) ** (dim / (dim - 2))
        return torch.where(length > L0, 1.0 / (base**exponent), inv_freq), 1.0
    original = rope.get("original_max_position_embeddings") or max_position_embeddings
    if kind == "llama3":
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > original / low, inv_freq / f, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, (1 - smooth) * out / f + smooth * out, out), 1.0
    if kind == "yarn":
        f = f or max_position_embeddings / original
        attn = rope.get("attention_factor")
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if attn is None:
            attn = (
                _mscale(f, mscale) / _mscale(f, mscale_all_dim)
                if mscale and mscale_all_dim
                else _mscale(f)
            )

        def correction_dim(rotations):
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = correction_dim(rope.get("beta_fast") or 32)
        high = correction_dim(rope.get("beta_slow") or 1)
        if rope.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
        ramp = (
            (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
        ).clamp(0, 1)
        keep = 1 - ramp  # 1: the dimension keeps its frequency, 0: divided by the factor
        return (1.0 / (f * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, float(attn)
    raise ValueError(f"rope_parameters.rope_type={kind!r} is not implemented")


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        C, H, Hk, D = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.H, self.Hk, self.D = H, Hk, D
        bias = config.attention_bias
        self.q_proj = nn.Linear(C, H * D, bias=bias)
        self.k_proj = nn.Linear(C, Hk * D, bias=bias)
        self.v_proj = nn.Linear(C, Hk * D, bias=bias)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, cache):
        """x: [B, T, C]; cos/sin: [B, T, D]; mask: [B, 1, T, S] bool -> [B, T, C]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D)  # [B, T, H, D]
        k = self.k_proj(x).view(B, T, self.Hk, self.D)  # [B, T, Hk, D]
        v = self.v_proj(x).view(B, T, self.Hk, self.D).transpose(1, 2)  # [B, Hk, T, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H|Hk, T, D]
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # [B, Hk, S, D]
        impl = getattr(self.config, "_attn_implementation", None)
        if impl not in (None, "sdpa", "eager") and impl in ALL_ATTENTION_FUNCTIONS:
            # A registered attention function (e.g. a compressed cache's): transformers' interface.
            out, _ = ALL_ATTENTION_FUNCTIONS[impl](
                self, q, k, v, mask, dropout=0.0, scaling=self.D**-0.5
            )  # [B, T, H, D]
            return self.o_proj(out.reshape(B, T, self.H * self.D))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.Hk != self.H)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.H * self.D))


class MLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        C = config.hidden_size
        I = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(C, I, bias=False)
        self.up_proj = nn.Linear(C, I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """DeepSeek-V3 router: x [N, C] -> (weights [N, k] fp32, indices [N, k])."""

    def __init__(self, config):
        super().__init__()
        E = config.n_routed_experts
        self.E, self.k = E, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(E, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))

    def forward(self, x):
        N, G = x.shape[0], self.n_group
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()  # selection only
        if self.topk_group < G:
            grouped = choice.view(N, G, self.E // G)  # [N, G, E/G]
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros(N, G, dtype=torch.bool, device=x.device).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, -1)
        indices = choice.topk(self.k, dim=-1, sorted=False).indices  # [N, k]
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices


class Experts(nn.Module):
    def __init__(self, config):
        super().__init__()
        E, C, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, C))
        self.down_proj = nn.Parameter(torch.zeros(E, C, I))

    def forward(self, x, indices, weights):
        """x: [N, C]; indices, weights: [N, k] -> [N, C]."""
        out = torch.zeros_like(x)
        for e in indices.unique().tolist():
            token, slot = torch.where(indices == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        n_shared = config.n_shared_experts
        self.shared_experts = (
            MLP(config, config.moe_intermediate_size * n_shared) if n_shared > 0 else None
        )

    def forward(self, x):
        """x: [B, T, C] -> [B, T, C]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, C]
        weights, indices = self.gate(flat)
        out = self.experts(flat, indices, weights).view_as(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def sinkhorn_v4(logits, iters, eps):
    """deepseek_v4 Sinkhorn: [..., n, n] logits -> comb (columns sum to 1)."""
    a = torch.softmax(logits, dim=-1) + eps
    a = a / (a.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        a = a / (a.sum(-1, keepdim=True) + eps)
        a = a / (a.sum(-2, keepdim=True) + eps)
    return a


class HyperConnection(nn.Module):
    def __init__(self, config):
        super().__init__()
        n, C = config.hc_mult, config.hidden_size
        self.n = n
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * C))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x, branch):
        """x: [B, T, n, C]; branch: [B, T, C] -> [B, T, C] -> [B, T, n, C]."""
        n = self.n
        B, T = x.shape[:2]
        flat = rms_norm(x.reshape(B, T, -1).float(), self.norm_eps)  # [B, T, n*C]
        raw = flat @ self.fn.float().t()  # [B, T, (2+n)n]
        r_pre, r_post, r_res = raw.split([n, n, n * n], dim=-1)
        b_pre, b_post, b_res = self.base.float().split([n, n, n * n])
        s = self.scale.float()
        pre = torch.sigmoid(r_pre * s[0] + b_pre) + self.hc_eps  # [B, T, n]
        post = 2 * torch.sigmoid(r_post * s[1] + b_post)  # [B, T, n]
        comb = sinkhorn_v4((r_res * s[2] + b_res).unflatten(-1, (n, n)), self.iters, self.hc_eps)
        u = (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)  # [B, T, C]
        f = branch(u)  # [B, T, C]
        mixed = torch.matmul(comb.transpose(-1, -2).to(x.dtype), x)  # [B, T, n, C]
        return post.to(x.dtype).unsqueeze(-1) * f.unsqueeze(2) + mixed


class HyperHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        n, C = config.hc_mult, config.hidden_size
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * C))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        """x: [B, T, n, C] -> [B, T, C]."""
        B, T = x.shape[:2]
        raw = rms_norm(x.reshape(B, T, -1).float(), self.norm_eps) @ self.hc_fn.float().t()
        pre = torch.sigmoid(raw * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.n_routed_experts > 0 and layer_idx >= config.first_k_dense_replace
        self.mlp = MoE(config) if moe else MLP(config)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, x, cos, sin, mask, cache):
        x = self.attn_hc(
            x, lambda h: self.self_attn(self.input_layernorm(h), cos, sin, mask, cache)
        )
        return self.ffn_hc(x, lambda h: self.mlp(self.post_attention_layernorm(h)))


class UnicacheMhcPreTrainedModel(PreTrainedModel):
    config_class = UnicacheMhcConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]
    _keep_in_fp32_modules = [
        "attn_hc",
        "ffn_hc",
        "hc_head",
        "gate.weight",
        "e_score_correction_bias",
    ]
    _keep_in_fp32_modules_strict = [
        "attn_hc",
        "ffn_hc",
        "hc_head",
        "gate.weight",
        "e_score_correction_bias",
    ]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        # transformers' guarded init functions skip tensors loaded from the checkpoint (5.2 runs
        # _init_weights after loading; in-place .normal_() would overwrite the loaded mHC
        # coefficients there).
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            _init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                _init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            _init.ones_(module.weight)
        elif isinstance(module, HyperConnection):
            _init.normal_(module.fn, mean=0.0, std=std)
            _init.zeros_(module.base)
            _init.ones_(module.scale)
        elif isinstance(module, HyperHead):
            _init.normal_(module.hc_fn, mean=0.0, std=std)
            _init.zeros_(module.hc_base)
            _init.ones_(module.hc_scale)
        elif isinstance(module, Router):
            _init.normal_(module.weight, mean=0.0, std=std)
            _init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, Experts):
            _init.normal_(module.gate_up_proj, mean=0.0, std=std)
            _init.normal_(module.down_proj, mean=0.0, std=std)


class UnicacheMhcModel(UnicacheMhcPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def rope(self, position_ids):
        # NOTE: computed per call, not a buffer: from_pretrained builds the model on the meta
        # device and would leave a non-persistent buffer uninitialised.
        c = self.config
        rope = dict(c.rope_parameters or {}, rope_theta=c.rope_theta)
        return rope_frequencies(rope, c.head_dim, c.max_position_embeddings, position_ids)

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        cache=None,
        **kwargs,
    ):
        past_key_values = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, C]
        B, T, C = x.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        cache = past_key_values if use_cache else None
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device).expand(B, T)
        inv_freq, attn_factor = self.rope(position_ids)  # [D/2], YaRN's attention factor
        freqs = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * attn_factor).to(x.dtype)  # [B, T, D]
        sin = (emb.sin() * attn_factor).to(x.dtype)
        S = past + T
        qi = torch.arange(T, device=x.device)[:, None] + past
        mask = (torch.arange(S, device=x.device)[None, :] <= qi)[None, None]  # [1, 1, T, S]
        if attention_mask is not None and attention_mask.dim() == 2:
            mask = mask & attention_mask[:, None, None, -S:].bool()  # [B, 1, T, S]
        n = self.config.hc_mult
        h = x.unsqueeze(2).expand(B, T, n, C)  # [B, T, n, C]
        for layer in self.layers:
            h = layer(h, cos, sin, mask, cache)
        h = self.norm(self.hc_head(h))  # [B, T, C]
        return h, (cache if use_cache else None)


class UnicacheMhcForCausalLM(UnicacheMhcPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = UnicacheMhcModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        cache=None,
        **kwargs,
    ):
        past_key_values = cache if cache is not None else past_key_values
        hidden, cache = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)  # [B, T, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})


__all__ = ["UnicacheMhcForCausalLM", "UnicacheMhcModel", "UnicacheMhcPreTrainedModel"]
