"""The compression seam's attention as FlexAttention (``SEGMENT_ATTENTION="flex"``,
``model/attention.py::attend_segment_flex``) against today's two kernels: the dense additive mask
(``segment_attention_mask`` + ``attention_op``) and the per-sample one.

torch's FlexAttention runs on CPU forward-only and unfused (no backward; the eager path also
ignores the block mask's tiles, it applies ``mask_mod`` everywhere). So on CPU:

* values: the eager FlexAttention call itself, under ``no_grad``;
* gradients: the exact ``score_mod``/``mask_mod`` FlexAttention receives, evaluated on the full
  score matrix with autograd (what FlexAttention computes, scores materialised);
* the block mask (which only the fused kernel reads): our tile-bound construction equals
  ``create_block_mask`` over the same ``mask_mod``, index for index; the fused CPU kernel
  (``torch.compile``, ~30 s) under ``-m slow``; fwd+bwd on CUDA under ``-m gpu``.

fp32 throughout; 1e-5: the same softmax over the same keys, only the summation order differs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import unicache_train.model.attention as attn_mod
from unicache_train.compress import UniCacheCompressor, UniCacheConfig
from unicache_train.compress.presets import text_style_baseline
from unicache_train.model import Decoder
from unicache_train.model.attention import (
    attend_segment_flex,
    attend_segment_per_sample,
    attention_op,
    segment_attention_mask,
    segment_attention_mode,
    segment_flex_inputs,
)
from unicache_train.model.config import ModelConfig
from unicache_train.seam import KVSegment

TOL = dict(atol=1e-5, rtol=1e-5)
# Gradients sum over every query: a few ulps more than the outputs.
GRAD_TOL = dict(atol=1e-5, rtol=1e-4)


@pytest.fixture(autouse=True)
def _quiet_unfused_warning():
    # FlexAttention warns once that eager (CPU) runs unfused: that is what these tests run.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def make_case(
    B: int = 4,
    H: int = 4,
    Hk: int = 2,
    T: int = 45,
    M: int = 21,
    D: int = 8,
    Dv: int | None = None,
    splits: tuple[int, ...] = (12, 0, 45, 30),
    seed: int = 0,
    requires_grad: bool = False,
):
    """Random q/k/v [B, H|Hk, T, D], a segment [B, Hk, M, D] with merged entries (counts 1..4),
    padding (invalid) entries in ragged amounts per sample (sample 0: the last third; others at
    random; one all-valid sample) and ``splits`` incl. an empty context and an empty
    continuation."""
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(requires_grad)

    q, k, v = t(B, H, T, D), t(B, Hk, T, D), t(B, Hk, T, Dv)
    seg_k, seg_v = t(B, Hk, M, D), t(B, Hk, M, Dv)
    valid = torch.rand(B, M, generator=g) > 0.3
    valid[0, : M - M // 3], valid[0, M - M // 3 :] = True, False
    valid[-1] = True
    counts = torch.randint(1, 5, (B, M), generator=g).float()
    counts[~valid] = 0.0  # padding entries carry no tokens
    segment = KVSegment(
        keys=seg_k,
        values=seg_v,
        positions=torch.arange(M).expand(B, M),
        modality_ids=torch.zeros(B, M, dtype=torch.long),
        counts=counts,
        valid=valid,
    )
    split = torch.tensor(splits[:B])
    return q, k, v, seg_k, seg_v, segment, split


def dense_path(q, k, v, seg_k, seg_v, segment, split, scale=None, softcap=None):
    """Today's batched kernel: one call over [segment ; sequence] with the dense additive mask."""
    mask = segment_attention_mask(segment, split, q.shape[2], q.dtype)  # [B, 1, T, M + T]
    keys, values = torch.cat([seg_k, k], dim=2), torch.cat([seg_v, v], dim=2)
    return attention_op(q, keys, values, mask=mask, scale=scale, softcap=softcap)


def mods_densely(q, k, v, seg_k, seg_v, segment, split, scale=None, softcap=None):
    """FlexAttention's computation with its scores materialised, differentiable on CPU: the
    ``score_mod`` and ``mask_mod`` that ``attend_segment_flex`` hands to FlexAttention, evaluated
    on every (b, h, q, kv) by broadcasting index tensors (each mod is elementwise)."""
    fx = segment_flex_inputs(k, v, seg_k, seg_v, segment, split, q.dtype, softcap=softcap)
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    keys, values = fx.keys.repeat_interleave(rep, 1), fx.values.repeat_interleave(rep, 1)
    S = keys.shape[2]
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    qi = torch.arange(T)[None, None, :, None]
    kv = torch.arange(S)[None, None, None, :]
    scores = q @ keys.transpose(-1, -2) * (D**-0.5 if scale is None else scale)  # [B, H, T, S]
    scores = fx.score_mod(scores, b, h, qi, kv)
    scores = scores.masked_fill(~fx.mask_mod(b, h, qi, kv), float("-inf"))
    return F.softmax(scores, dim=-1) @ values


CASES = {
    # name: (make_case kwargs, scale, softcap)
    "gqa": ({}, None, None),
    # MHA, a softmax scale, value head != query head (MLA's shapes)
    "mha_scale_dv": (dict(H=2, Hk=2, Dv=6), 0.3, None),
    "softcap": ({}, None, 2.0),
    "long_ragged": (dict(T=301, M=140, splits=(129, 300, 7, 256)), None, None),
}


@pytest.mark.parametrize("name", CASES)
def test_flex_forward_equals_dense_mask_and_per_sample(name: str) -> None:
    kw, scale, softcap = CASES[name]
    q, k, v, seg_k, seg_v, segment, split = make_case(**kw)
    H, Hk = q.shape[1], k.shape[1]
    with torch.no_grad():
        flex = attend_segment_flex(
            q, k, v, seg_k, seg_v, segment, split, scale=scale, softcap=softcap, enable_gqa=H != Hk
        )
        dense = dense_path(q, k, v, seg_k, seg_v, segment, split, scale, softcap)
        torch.testing.assert_close(flex, dense, **TOL)
        if softcap is None:  # the per-sample kernel has no softcap (the layer takes the mask)
            per = attend_segment_per_sample(
                q, k, v, seg_k, seg_v, segment, split, scale=scale, enable_gqa=H != Hk
            )
            torch.testing.assert_close(flex, per, **TOL)
        # The materialised mods (used for the gradients below) are the same function.
        torch.testing.assert_close(
            mods_densely(q, k, v, seg_k, seg_v, segment, split, scale, softcap), flex, **TOL
        )


@pytest.mark.parametrize("name", ["gqa", "softcap", "long_ragged"])
def test_flex_mods_gradients_equal_dense_mask_and_per_sample(name: str) -> None:
    """Gradients of q, k, v and the segment's K/V under a random cotangent."""
    kw, scale, softcap = CASES[name]
    grads = {}
    for path in ("flex_mods", "dense", "per_sample"):
        if path == "per_sample" and softcap is not None:
            continue
        q, k, v, seg_k, seg_v, segment, split = make_case(**kw, requires_grad=True)
        args = (q, k, v, seg_k, seg_v, segment, split)
        if path == "flex_mods":
            out = mods_densely(*args, scale, softcap)
        elif path == "dense":
            out = dense_path(*args, scale, softcap)
        else:
            out = attend_segment_per_sample(*args, scale=scale, enable_gqa=True)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        out.backward(cot)
        grads[path] = [x.grad for x in (q, k, v, seg_k, seg_v)]
    for path in set(grads) - {"flex_mods"}:
        for a, b in zip(grads["flex_mods"], grads[path], strict=True):
            assert a.abs().sum() > 0
            torch.testing.assert_close(a, b, **GRAD_TOL)


BLOCK_CASES = [
    # (T, M, block size, splits): tile-aligned and ragged T / M / splits, empty context and
    # empty continuation, splits on and off tile boundaries.
    (64, 32, 16, (16, 0, 64, 40)),
    (77, 50, 16, (15, 16, 17, 77)),
    (300, 140, 128, (128, 299, 0, 200)),
    (40, 5, 16, (3, 39, 20, 33)),
]


@pytest.mark.parametrize("T,M,bs,splits", BLOCK_CASES)
def test_block_mask_from_tiles_equals_create_block_mask(T, M, bs, splits) -> None:
    """The fused kernel reads only the block mask's tiles: ours (from tile bounds, no dense mask)
    must list exactly the partial and full tiles that ``create_block_mask`` finds by evaluating
    ``mask_mod`` on every pair, in the same order, in both directions (kv and q indices)."""
    q, k, v, seg_k, seg_v, segment, split = make_case(T=T, M=M, splits=splits)
    # Whole valid tiles (full segment tiles) and whole invalid ones (skipped tiles).
    segment.valid[1, :bs] = True
    segment.valid[2, : min(bs, M)] = False
    fx = segment_flex_inputs(k, v, seg_k, seg_v, segment, split, q.dtype, block_size=bs)
    ref = create_block_mask(
        fx.mask_mod, q.shape[0], None, T, fx.keys.shape[2], device="cpu", BLOCK_SIZE=bs
    )
    ours = fx.block_mask
    assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    # Non-trivial: both partial and full tiles occur, and some tiles are skipped.
    dense = ours.to_dense()
    assert ours.full_kv_num_blocks.sum() > 0 and ours.kv_num_blocks.sum() > 0
    assert (dense == 0).any()


def test_mask_mod_is_the_dense_mask_support() -> None:
    """``mask_mod`` over [segment padded to Mp ; sequence] = where the dense mask is not -inf
    (same positions), and the padding entries Mp - M are never visible."""
    q, k, v, seg_k, seg_v, segment, split = make_case(T=45, M=21)
    fx = segment_flex_inputs(k, v, seg_k, seg_v, segment, split, q.dtype, block_size=16)
    B, T, M, Mp = q.shape[0], q.shape[2], seg_k.shape[2], 32
    got = create_mask(fx.mask_mod, B, None, T, Mp + T, device="cpu")[:, 0]  # [B, T, Mp + T]
    want = segment_attention_mask(segment, split, T, q.dtype)[:, 0] > torch.finfo(q.dtype).min
    assert torch.equal(got[..., :M], want[..., :M])
    assert not got[..., M:Mp].any()
    assert torch.equal(got[..., Mp:], want[..., M:])


def test_flex_on_cpu_fails_loudly_with_autograd_and_runs_without() -> None:
    q, k, v, seg_k, seg_v, segment, split = make_case(requires_grad=True)
    with pytest.raises(NotImplementedError, match="SEGMENT_ATTENTION='flex' on CPU"):
        attend_segment_flex(q, k, v, seg_k, seg_v, segment, split, enable_gqa=True)
    with torch.no_grad():  # leaves that require grad are fine without autograd
        out = attend_segment_flex(q, k, v, seg_k, seg_v, segment, split, enable_gqa=True)
        dense = dense_path(q, k, v, seg_k, seg_v, segment, split)
    torch.testing.assert_close(out, dense, **TOL)


def test_segment_attention_mode(monkeypatch) -> None:
    assert segment_attention_mode(torch.device("cpu")) == "per_sample"
    assert segment_attention_mode(torch.device("cuda")) == "flex"
    assert segment_attention_mode(torch.device("mps")) == "batched"
    monkeypatch.setattr(attn_mod, "SEGMENT_ATTENTION", "flex")
    assert segment_attention_mode(torch.device("cpu")) == "flex"
    monkeypatch.setattr(attn_mod, "SEGMENT_ATTENTION", "dense")
    with pytest.raises(ValueError, match="SEGMENT_ATTENTION='dense'"):
        segment_attention_mode(torch.device("cpu"))


def test_model_seam_flex_equals_batched(monkeypatch) -> None:
    """Through the decoder (``Attention._attend_segment``): UniCache in the loop (merged entries,
    evictions, padding) with ragged splits, GQA and the attention softcap (a Gemma option); the
    flex mode's logits = the batched mode's (forward only: no FlexAttention backward on CPU)."""
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_logit_softcapping=3.0,
    )
    model = Decoder(config).eval()
    d = text_style_baseline().to_dict()
    d["target_rate"] = 0.6
    comp = UniCacheCompressor(UniCacheConfig.from_dict(d))
    ids = torch.randint(0, 97, (4, 40))
    split = torch.tensor([12, 25, 39, 40])
    logits = {}
    with torch.no_grad():
        for mode in ("batched", "flex"):
            monkeypatch.setattr(attn_mod, "SEGMENT_ATTENTION", mode)
            logits[mode] = model(ids, split=split, compressor=comp).logits
    torch.testing.assert_close(logits["flex"], logits["batched"], **TOL)


@pytest.mark.slow
def test_compiled_flex_on_cpu_honours_the_block_mask() -> None:
    """The fused CPU kernel (inductor) reads the block mask's tiles, unlike the eager path: with
    128-token tiles, ragged T and M, forward equals the dense mask (~30 s of compile)."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v, seg_k, seg_v, segment, split = make_case(T=301, M=140, splits=(129, 300, 7, 256))
    fx = segment_flex_inputs(k, v, seg_k, seg_v, segment, split, q.dtype)
    with torch.no_grad():
        out = torch.compile(flex_attention)(
            q, fx.keys, fx.values, score_mod=fx.score_mod, block_mask=fx.block_mask, enable_gqa=True
        )
        torch.testing.assert_close(out, dense_path(q, k, v, seg_k, seg_v, segment, split), **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,softcap", [(torch.float32, None), (torch.bfloat16, 2.0)])
def test_flex_on_cuda_matches_dense_mask_fwd_bwd(dtype, softcap) -> None:
    """The compiled kernel, forward and backward, on the GPU: its error against the dense mask
    in fp64 is at most twice the dense path's own error in ``dtype`` plus a floor (fp32 1e-5;
    bf16 4e-3, about one bf16 ulp at 1), relative to each tensor's largest magnitude."""
    floor = 1e-5 if dtype == torch.float32 else 4e-3
    results = {}
    for path, dt in (("ref", torch.float64), ("flex", dtype), ("dense", dtype)):
        q, k, v, seg_k, seg_v, segment, split = make_case(T=301, M=140, splits=(129, 300, 7, 256))
        leaves = [x.detach().to("cuda", dt).requires_grad_(True) for x in (q, k, v, seg_k, seg_v)]
        segment.counts, segment.valid = segment.counts.cuda(), segment.valid.cuda()
        args = (*leaves, segment, split.cuda())
        if path == "flex":
            out = attend_segment_flex(*args, softcap=softcap, enable_gqa=True)
        else:
            out = dense_path(*args, softcap=softcap)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
        out.backward(cot)
        results[path] = [out.detach().double()] + [x.grad.double() for x in leaves]
    names = ("out", "dq", "dk", "dv", "dseg_k", "dseg_v")
    for name, ref, flex, dense in zip(
        names, *(results[p] for p in ("ref", "flex", "dense")), strict=True
    ):
        scale = ref.abs().max()
        err_flex = ((flex - ref).abs().max() / scale).item()
        err_dense = ((dense - ref).abs().max() / scale).item()
        assert err_flex <= 2 * err_dense + floor, (name, err_flex, err_dense)
