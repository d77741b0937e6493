"""KV compression in the training loop: the in-loop forward equals prefill -> compress -> decode
on a real compressed cache, the loss, gradients, KL, curriculum, splits, config, and a tiny fit."""

import csv
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_model_config as shared_tiny_config

from unicache_train.compress import IdentityCompressor, UniCacheCompressor, UniCacheConfig
from unicache_train.compress.presets import text_style_baseline
from unicache_train.data.config import DataConfig, SyntheticDataConfig
from unicache_train.inloop import (
    compression_kl,
    continuation_mask,
    sample_splits,
    step_generator,
)
from unicache_train.model import Decoder
from unicache_train.model.config import ModelConfig
from unicache_train.model.generate import decode_teacher_forced, generate_compressed
from unicache_train.seam import curriculum_scale
from unicache_train.train.config import (
    CompressionTrainConfig,
    LoggingConfig,
    MonitorConfig,
    RunConfig,
    TrainConfig,
)
from unicache_train.train.module import LMModule, causal_lm_loss
from unicache_train.validation import ConfigError


def tiny_model_config(**kw) -> ModelConfig:
    return shared_tiny_config(**{"num_hidden_layers": 3, **kw})


def unicache(
    rate: float = 0.6, bits: int | None = None, granularity: str = "token_head"
) -> UniCacheConfig:
    """Text-only data: the text-style preset removes ``rate`` of the context (no text cap)."""
    d = text_style_baseline().to_dict()
    d["target_rate"] = rate
    d["quantize"].update(bits=bits, granularity=granularity)
    return UniCacheConfig.from_dict(d)


def twin_kv_heads(model: Decoder) -> None:
    """KV head 1 := KV head 0 (keys up to a tiny perturbation) in every layer: heads merge."""
    D = model.config.head_size
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.layers:
            a = layer.self_attn
            noise = 1e-3 * torch.randn(a.k_proj.weight[:D].shape, generator=g)
            a.k_proj.weight[D : 2 * D] = a.k_proj.weight[:D] + noise
            a.v_proj.weight[D : 2 * D] = a.v_proj.weight[:D]


# ------------------------------------------------------------------ an independent reference
def _stored_kv(seg, b: int, Hk: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``b``'s stored segment as per-KV-head float64 keys/values [Hk, M, D], read from the
    cache's storage by hand: int8 as is, int4 unpacked (two's complement nibbles, low first),
    times the stored scale; head-merged groups spread through ``head_map``."""

    def unpack(data: torch.Tensor, bits: int) -> torch.Tensor:  # [G, M, W] -> [G, M, D]
        if bits == 8:
            return data.double()
        lo, hi = (data & 0x0F).long(), (data >> 4).long()
        nib = torch.stack([lo, hi], -1).flatten(-2)[..., :D]
        return torch.where(nib > 7, nib - 16, nib).double()

    if seg.quant is None:
        k, v = seg.keys[b].double(), seg.values[b].double()  # [G, M, D]
    else:
        q = seg.quant
        ks, vs = q.k_scale[b].double(), q.v_scale[b].double()  # [G, M] or [G]
        if q.granularity == "head":
            ks, vs = (
                ks[:, None].expand(-1, q.k_data.shape[2]),
                vs[:, None].expand(-1, q.v_data.shape[2]),
            )
        if q.granularity == "channel":  # [G, D]: one scale per feature over the entries
            k = unpack(q.k_data[b], q.bits) * ks[:, None, :]
            v = unpack(q.v_data[b], q.bits) * vs[:, None, :]
        else:
            k = unpack(q.k_data[b], q.bits) * ks[..., None]
            v = unpack(q.v_data[b], q.bits) * vs[..., None]
    slot = seg.head_map[b]  # [Hk] stored copy of each KV head
    return k[slot], v[slot]


def handwritten_logits(
    model: Decoder, ids: torch.Tensor, split: torch.Tensor, cache
) -> torch.Tensor:
    """Logits of positions ``split[b] - 1 .. T - 1`` computed by hand, layer by layer, with the
    model's own weights, in float64, over the **stored compressed cache** (NaN elsewhere).

    Position ``s - 1`` is the last prompt token: plain causal attention over the raw context
    (the prefill). A continuation token at ``t >= s`` attends to the layer's stored entries
    (``valid`` ones, ``+ log(count)``; keys stored post-RoPE at their original positions) and
    causally to the continuation's own keys. Shares no code with the model's forward, the
    seam, the compressor or the cache's ``kv()``/``attention_bias``.
    """
    cfg = model.config
    H, Hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size
    eps = cfg.rms_norm_eps
    rep = H // Hk
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()

    def lin(x, layer):
        return x @ layer.weight.double().T + (layer.bias.double() if layer.bias is not None else 0)

    def rope(x, pos):  # x [N, L, D], pos [L]
        ang = pos.double()[:, None] * inv_freq[None, :]  # [L, D/2]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def attend(q, k, v, bias):  # q [H, L, D]; k, v [Hk, S, D]; bias [L, S] (-inf = masked)
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + bias, -1)
        return w @ v  # [H, L, D]

    def run(tokens, pos, layer_prefix):
        """tokens [L] at positions pos [L]; layer_prefix(i) -> (k [Hk, M, D], v, bias [M]) or
        None. Returns the final hidden states [L, C]."""
        h = model.embed_tokens.weight.double()[tokens]  # [L, C]
        L = len(tokens)
        causal = torch.full((L, L), -math.inf, dtype=torch.float64).triu(1)
        for i, block in enumerate(model.layers):
            a = block.self_attn
            x = rms(h, block.input_layernorm.weight)
            q = lin(x, a.q_proj).view(L, H, D).transpose(0, 1)  # [H, L, D]
            k = lin(x, a.k_proj).view(L, Hk, D).transpose(0, 1)
            v = lin(x, a.v_proj).view(L, Hk, D).transpose(0, 1)
            if a.q_norm is not None:
                q, k = rms(q, a.q_norm.weight), rms(k, a.k_norm.weight)
            q, k = rope(q, pos), rope(k, pos)
            prefix = layer_prefix(i)
            if prefix is None:
                o = attend(q, k, v, causal)
            else:
                pk, pv, pb = prefix
                bias = torch.cat([pb[None, :].expand(L, -1), causal], -1)
                o = attend(q, torch.cat([pk, k], 1), torch.cat([pv, v], 1), bias)
            h = h + lin(o.transpose(0, 1).reshape(L, H * D), a.o_proj)
            x = rms(h, block.post_attention_layernorm.weight)
            m = block.mlp
            h = h + lin(
                torch.nn.functional.silu(lin(x, m.gate_proj)) * lin(x, m.up_proj), m.down_proj
            )
        return rms(h, model.norm.weight) @ model.lm_head.weight.double().T  # [L, V]

    B, T = ids.shape
    out = torch.full((B, T, cfg.vocab_size), math.nan, dtype=torch.float64)
    for b in range(B):
        s = int(split[b])
        out[b, s - 1] = run(ids[b, :s], torch.arange(s), lambda i: None)[-1]

        def stored(i, b=b, s=s):
            seg = cache.segments[i]
            k, v = _stored_kv(seg, b, Hk, D)
            valid = seg.valid[b]
            assert int(seg.context_tokens[b]) == s and bool(
                (seg.positions is None) or (seg.positions[b][valid] < s).all()
            )
            bias = torch.where(valid, seg.counts[b].double().clamp_min(1).log(), -math.inf)
            return k, v, bias

        if s < T:
            out[b, s:] = run(ids[b, s:], torch.arange(s, T), stored)
    return out


# ------------------------------------------------------------------ in-loop == step by step
CASES = {
    "identity": (lambda: IdentityCompressor(), False),
    "unicache_0.6": (lambda: UniCacheCompressor(unicache(0.6)), False),
    "unicache_0.6_int8": (lambda: UniCacheCompressor(unicache(0.6, 8)), False),
    "unicache_0.6_int4_head_scale": (
        lambda: UniCacheCompressor(unicache(0.6, 4, granularity="head")),
        False,
    ),
    "unicache_0.6_int8_head_merge": (lambda: UniCacheCompressor(unicache(0.6, 8)), True),
    "unicache_0.6_int4_channel_scale": (
        lambda: UniCacheCompressor(unicache(0.6, 4, granularity="channel")),
        False,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inloop_forward_equals_prefill_compress_decode(case: str) -> None:
    make, twins = CASES[case]
    torch.manual_seed(0)
    model = Decoder(tiny_model_config()).eval()
    if twins:
        twin_kv_heads(model)
    ids = torch.randint(0, 97, (2, 44))
    split = torch.tensor([29, 18])  # ragged: each sample decodes from its own split
    comp = make()
    with torch.no_grad():
        ref = model(ids, split=split, compressor=comp)
    got, cache = decode_teacher_forced(model, ids, split, comp)
    cont = continuation_mask(split, ids.shape[1])  # positions split-1 .. T-1
    assert torch.isnan(got[~cont]).all() and not torch.isnan(got[cont]).any()
    # fp32, the same math over a different key layout (padding slots, SDPA blocking): ~4e-7 seen.
    torch.testing.assert_close(got[cont], ref.logits[cont], atol=1e-5, rtol=1e-5)
    # Independent of the seam: attention written out by hand (float64) over what the cache
    # stores. 1e-5: the model runs in fp32 (logits ~0.1, round-off ~1e-7 relative per op).
    hand = handwritten_logits(model, ids, split, cache)
    assert not torch.isnan(hand[cont]).any() and torch.isnan(hand[~cont]).all()
    torch.testing.assert_close(ref.logits[cont].double(), hand[cont], atol=1e-5, rtol=1e-5)
    if case == "identity":
        return
    # The cache holds what the compressor accounted for: packed bytes + scales, one copy per
    # head group; the rate is real.
    stat_bytes = sum(float(s["kv_bytes"]) for s in ref.compression_stats)
    assert cache.kv_bytes(include_metadata=False) == int(stat_bytes)
    removed = [float(s["rate_realized"]) for s in ref.compression_stats]
    # cosine curve: shallow loses more
    assert sum(removed) / len(removed) > 0.55 and removed[0] > removed[-1]
    reduction = cache.baseline_bytes(model.config.head_size) / cache.kv_bytes()
    assert reduction > {"unicache_0.6": 1 / 0.45, "unicache_0.6_int8": 4.0}.get(case, 5.0)
    if twins:
        assert all(float(s["heads_merged"]) == 1.0 for s in ref.compression_stats)
        assert all(seg.quant.k_data.shape[1] == 1 for seg in cache.segments)  # stored once
    if "int" in case:
        assert all(seg.quant is not None and seg.keys is None for seg in cache.segments)


def test_greedy_generation_on_compressed_cache_matches_inloop_argmax() -> None:
    torch.manual_seed(0)
    model = Decoder(tiny_model_config()).eval()
    prompts = torch.randint(0, 97, (2, 30))
    split = torch.tensor([30, 22])
    comp = UniCacheCompressor(unicache(0.6, 8))
    gen = generate_compressed(model, prompts, split, comp, max_new_tokens=6).tokens  # [2, 6]
    for b in range(2):
        s = int(split[b])
        seq = torch.cat([prompts[b, :s], gen[b]])[None]
        with torch.no_grad():
            logits = model(seq, split=split[b : b + 1], compressor=comp).logits
        assert torch.equal(logits[0, s - 1 : -1].argmax(-1), gen[b])


# ------------------------------------------------------------------ the training objective
def module(**compress) -> LMModule:
    cfg = RunConfig(
        model=tiny_model_config(num_hidden_layers=2),
        compress=CompressionTrainConfig.from_dict({"enabled": True, **compress}),
    )
    torch.manual_seed(0)
    return LMModule(cfg)


def batch(B: int = 3, T: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (B, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, -5:] = -100  # right padding of a short record
    return {
        "input_ids": ids[:, :-1],
        "labels": labels,
        "modality_ids": torch.zeros(B, T, dtype=torch.long),
        "split": torch.tensor([12, -1, 25])[:B],
    }


def test_rate_zero_and_identity_loss_equal_plain_loss() -> None:
    b = batch()
    for kw in ({"method": "none"}, {"unicache": {"rate_scale": 0.0, "quantize": {"bits": None}}}):
        m = module(loss_on="all", **kw)
        plain = causal_lm_loss(m(b), b["labels"])
        loss, logs, _ = m.compressed_loss(b, step=0)
        torch.testing.assert_close(loss, plain, atol=1e-6, rtol=1e-6)
    # Continuation loss = the plain loss restricted to targets from split - 1 on.
    m = module(method="none")
    loss, _, _ = m.compressed_loss(b, step=0)
    split = sample_splits(b["labels"], b["split"], generator=step_generator(0, 0))
    masked = b["labels"].masked_fill(~continuation_mask(split, 40), -100)
    torch.testing.assert_close(loss, causal_lm_loss(m(b), masked), atol=1e-6, rtol=1e-6)


def test_gradients_flow_through_compression_to_every_layer() -> None:
    m = module(unicache=unicache(0.6, 8).to_dict(), kl_weight=0.5)
    loss, logs, per_layer = m.compressed_loss(batch(), step=0)
    removed = [float(s["rate_realized"]) for s in per_layer]
    assert sum(removed) / len(removed) > 0.5  # compression really ran
    loss.backward()
    for i, layer in enumerate(m.model.layers):
        for name in ("k_proj", "v_proj"):
            g = getattr(layer.self_attn, name).weight.grad
            assert g is not None and torch.isfinite(g).all(), (i, name)
            assert float(g.abs().sum()) > 0, (i, name)


def test_kl_term_zero_at_rate_zero_positive_at_rate() -> None:
    b = batch()
    m0 = module(kl_weight=1.0, unicache={"rate_scale": 0.0, "quantize": {"bits": None}})
    _, logs0, _ = m0.compressed_loss(b, step=0)
    assert float(logs0["train/kl"]) == pytest.approx(0.0, abs=1e-7)
    m6 = module(kl_weight=1.0, unicache=unicache(0.6).to_dict())
    loss6, logs6, _ = m6.compressed_loss(b, step=0)
    assert float(logs6["train/kl"]) > 1e-4
    assert float(loss6.detach()) == pytest.approx(
        float(logs6["train/lm_loss"] + logs6["train/kl"]), rel=1e-5
    )
    # Temperature scaling keeps the term's size comparable (tau^2 factor).
    x = torch.randn(2, 5, 11)
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert float(compression_kl(x, x, mask, 2.0)) == pytest.approx(0.0, abs=1e-7)


def test_curriculum_moves_rate_scale() -> None:
    m = module(
        curriculum_steps=10,
        unicache={"quantize": {"bits": None}, "target_rate": 0.6, "budget": {"enabled": False}},
    )
    b = batch()
    seen = []
    for step in (0, 5, 10, 50):
        _, logs, per_layer = m.compressed_loss(b, step=step)
        seen.append(
            (
                float(logs["compress/rate_scale"]),
                m.compressor.rate_scale,
                sum(float(s["rate_realized"]) for s in per_layer) / len(per_layer),
            )
        )
    assert [s[0] for s in seen] == [0.0, 0.5, 1.0, 1.0]
    assert [s[1] for s in seen] == [0.0, 0.5, 1.0, 1.0]
    assert seen[0][2] == 0.0 and seen[1][2] > 0.0 and seen[2][2] > seen[1][2]
    # the compressor owns its schedule: neither the run config nor its own config is edited
    assert m.config.compress.unicache.rate_scale == 1.0
    assert m.compressor.config.rate_scale == 1.0 and m.compressor.curriculum_steps == 10
    assert curriculum_scale(3, 0) == 1.0 and curriculum_scale(3, 6, 0.5) == 0.25
    assert curriculum_scale(None, 6, 0.5) == 0.5  # the end of the schedule


def test_sample_splits_data_random_padding_and_determinism() -> None:
    b = batch(B=3, T=40)
    s1 = sample_splits(b["labels"], b["split"], min_context=8, generator=step_generator(0, 7))
    s2 = sample_splits(b["labels"], b["split"], min_context=8, generator=step_generator(0, 7))
    assert torch.equal(s1, s2)
    assert int(s1[0]) == 12 and int(s1[2]) == 25  # the data's splits
    assert 8 <= int(s1[1]) < 39
    rnd = torch.stack(
        [
            sample_splits(
                b["labels"],
                b["split"],
                mode="random",
                min_context=8,
                generator=step_generator(0, k),
            )
            for k in range(40)
        ]
    )
    assert int(rnd[:, 0].max()) < 35 - 1  # sample 0 has 35 real tokens: never split in padding
    assert int(rnd.min()) >= 8 and len(set(rnd[:, 1].tolist())) > 5
    short = torch.full((1, 40), -100)
    short[0, :3] = 1  # a 3-token record: still one context and one continuation token
    assert 1 <= int(sample_splits(short, None, min_context=16)) <= 2


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "field,value",
    [
        ("method", "svd"),
        ("split", "middle"),
        ("loss_on", "prompt"),
        ("min_context", 0),
        ("kl_weight", -1.0),
        ("kl_temperature", 0.0),
        ("curriculum_steps", -5),
        ("preset", "nope"),
        ("enabled", "yes"),
        ("unicache", {"target_rate": 2.0}),
        ("unicache", {"quantize": {"bits": 3}}),
        ("unicache", {"no_such_step": {}}),
        ("unicache", 0.6),
    ],
)
def test_bad_compress_values_raise(field: str, value) -> None:
    # The message names the field; UniCache errors name the UniCache field (target_rate, bits).
    expected = {"unicache": r"UniCacheConfig|QuantizeConfig|compress\.unicache"}.get(field, field)
    with pytest.raises(ConfigError, match=expected):
        RunConfig.from_dict({"compress": {field: value}})


def test_compress_config_round_trips_and_merges_onto_preset() -> None:
    cfg = RunConfig.from_dict(
        {
            "compress": {
                "enabled": True,
                "preset": "text_style_baseline",
                "unicache": {"target_rate": 0.5, "quantize": {"bits": 4}},
            }
        }
    )
    uc = cfg.compress.unicache
    assert (uc.target_rate, uc.quantize.bits, uc.budget.enabled) == (0.5, 4, False)
    assert uc.quantize.granularity == "token_head"  # untouched fields keep the preset's value
    assert RunConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert RunConfig().compress.enabled is False  # the plain path stays the default


# ------------------------------------------------------------------ a tiny fit
def test_tiny_fit_with_compression_logs_metrics(tmp_path: Path) -> None:
    from unicache_train.train.run import fit

    cfg = RunConfig(
        model=ModelConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        data=DataConfig(
            seq_len=96,
            batch_size=4,
            pack=False,
            synthetic=SyntheticDataConfig(
                num_stories=12, num_recall=12, recall_num_facts=3, recall_num_filler=0
            ),
            val_fraction=0.2,
        ),
        train=TrainConfig(
            max_steps=4,
            warmup_steps=1,
            val_every_n_steps=4,
            limit_val_batches=1,
            checkpoint_every_n_steps=4,
            accelerator="cpu",
            devices=1,
            out_dir=str(tmp_path),
            progress_bar=False,
            log_every_n_steps=1,
        ),
        logging=LoggingConfig(logger="csv"),
        monitor=MonitorConfig(gain=False, compress_every_n_steps=1),
        compress=CompressionTrainConfig.from_dict(
            dict(
                enabled=True,
                preset="text_style_baseline",
                unicache={"target_rate": 0.6},
                curriculum_steps=2,
                kl_weight=0.1,
            )
        ),
    )
    trainer = fit(cfg)
    assert trainer.global_step == 4
    rows = []
    for f in tmp_path.glob("csv/version_*/metrics.csv"):
        with f.open() as fh:
            rows += list(csv.DictReader(fh))
    cols = {k for r in rows for k, v in r.items() if v not in (None, "")}
    for name in (
        "train/loss",
        "train/lm_loss",
        "train/kl",
        "compress/kv_reduction",
        "compress/rate_realized/text",
        "compress/rate_scale",
        "val/ppl",
        "val/ppl_compressed",
        "compress/ppl_delta",
        "compress/kv_reduction/layer_01",
    ):
        assert name in cols, name
    reductions = [float(r["compress/kv_reduction"]) for r in rows if r.get("compress/kv_reduction")]
    assert max(reductions) > 2.0  # int8 + 60% of the context removed once the curriculum is done
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    saved = ckpt["hyper_parameters"]["config"]["compress"]
    assert saved["enabled"] and saved["unicache"]["target_rate"] == 0.6
    assert not any(k.startswith("compressor") for k in ckpt["state_dict"])


@pytest.mark.parametrize("attention_type", ["gqa", "mla"])
def test_identity_segment_takes_causal_kernel_with_the_masked_path_result(
    attention_type: str,
) -> None:
    """An identity segment (the context's own K/V) runs the causal kernel; the general masked
    path over [segment ; sequence] gives the same logits (1e-5: fp32, the two kernels only
    reorder the same softmax sums)."""

    class NotMarkedIdentity(IdentityCompressor):
        def __call__(self, inp):
            seg = super().__call__(inp)
            seg.identity = False
            return seg

    torch.manual_seed(0)
    extra = {}
    if attention_type == "mla":
        extra = dict(
            attention_type="mla",
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        )
    model = Decoder(tiny_model_config(**extra)).eval()
    ids = torch.randint(0, 64, (3, 40))
    split = torch.tensor([10, 25, 39])
    with torch.no_grad():
        plain = model(ids).logits
        fast = model(ids, split=split, compressor=IdentityCompressor()).logits
        masked = model(ids, split=split, compressor=NotMarkedIdentity()).logits
    assert torch.equal(fast, plain)
    torch.testing.assert_close(masked, fast, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention_type", ["gqa", "mla"])
def test_per_sample_segment_attention_equals_batched_masked(
    attention_type: str, monkeypatch
) -> None:
    """The CPU per-sample seam attention and the batched dense-mask call give the same logits and
    gradients under a real compressor (merged entries with log-count bias, evictions, ragged
    splits incl. an empty continuation). 1e-5: fp32, same softmax over the same keys, only the
    summation order differs."""
    import unicache_train.model.attention as attn_mod

    torch.manual_seed(0)
    extra = {}
    if attention_type == "mla":
        extra = dict(
            attention_type="mla",
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        )
    model = Decoder(tiny_model_config(**extra))
    ids = torch.randint(0, 64, (4, 40))
    split = torch.tensor([12, 25, 39, 40])
    comp = UniCacheCompressor(unicache(0.6, bits=8))
    results = {}
    for mode in ("batched", "per_sample"):
        monkeypatch.setattr(attn_mod, "SEGMENT_ATTENTION", mode)
        model.zero_grad()
        logits = model(ids, split=split, compressor=comp).logits
        logits.square().mean().backward()
        results[mode] = (logits.detach(), [p.grad.clone() for p in model.parameters()])
    (lb, gb), (lp, gp) = results["batched"], results["per_sample"]
    torch.testing.assert_close(lp, lb, atol=1e-5, rtol=1e-5)
    for a, b in zip(gp, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_plain_loop_and_lightning_module_share_the_inloop_objective() -> None:
    """``train.loop.train_steps`` (healing / fine-tuning scripts) and ``LMModule`` (recipes)
    compute the same in-loop loss on the same batch, seed and compressor: one objective."""
    from unicache_train.train.loop import train_steps

    b = batch()
    m = module(unicache=unicache(0.6, 8).to_dict(), min_context=8)
    loss, _, per_layer = m.compressed_loss(b, step=0)
    assert sum(float(s["rate_realized"]) for s in per_layer) > 0  # compression ran
    res = train_steps(
        m.model,
        iter([b]),
        1,
        0.0,
        0,
        m.config.train,
        compressor=m.compressor,
        min_context=8,
        seed=m.config.compress.seed,
    )
    assert abs(res.losses[0] - loss.item()) < 1e-6
    cont = continuation_mask(
        sample_splits(b["labels"], b["split"], min_context=8, generator=step_generator(0, 0)), 40
    )
    assert res.tokens == int((cont & (b["labels"] != -100)).sum())
