"""Config of unicache_train mHC decoders (self-contained; copied next to exported weights).

A Llama-style decoder (GQA attention with RoPE, SwiGLU, RMSNorm; optional q/k/v biases and
Qwen3-style per-head q_norm/k_norm) whose residual is widened to ``hc_mult`` streams mixed by
manifold-constrained hyper-connections (mHC, arXiv 2512.24880) with the numerics of
transformers' ``deepseek_v4`` (``attn_hc``/``ffn_hc``/``hc_head``). With ``n_routed_experts > 0``
the layers from ``first_k_dense_replace`` on have a DeepSeek MoE FFN (DeepseekV3 field names).
"""

from transformers import PretrainedConfig


class UnicacheMhcConfig(PretrainedConfig):
    model_type = "unicache_mhc"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=4096,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_parameters=None,
        rope_scaling=None,
        attention_bias=False,
        attention_dropout=0.0,
        qk_norm=False,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        n_routed_experts=0,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=None,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        # RoPE: v5 ``rope_parameters`` or the legacy ``rope_scaling``; types default, linear,
        # dynamic, llama3, yarn (computed in modeling_unicache_mhc.rope_frequencies).
        rope = dict(rope_parameters or rope_scaling or {})
        self.rope_theta = float(rope.get("rope_theta", rope_theta))
        rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type") or "default"
        rope["rope_theta"] = self.rope_theta
        self.rope_parameters = rope
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.qk_norm = qk_norm
        self.hc_mult = hc_mult
        self.hc_sinkhorn_iters = hc_sinkhorn_iters
        self.hc_eps = hc_eps
        self.n_routed_experts = n_routed_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_shared_experts = n_shared_experts
        self.moe_intermediate_size = moe_intermediate_size or intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )


__all__ = ["UnicacheMhcConfig"]
