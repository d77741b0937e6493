"""Decode attention over a packed segment (:mod:`unicache_train.ops.decode_attention`): the CPU
packed path and the cache's decode paths equal the reference (dequantize, spread, concatenate,
SDPA), and the Triton kernel equals it under ``TRITON_INTERPRET=1`` (tiny grids).

Tolerances: every path computes in fp32 from the same integers and scales; they differ only in
summation order (BLAS blocking, online-softmax rescaling), so 1e-5 absolute on outputs of
magnitude ~1 is ~100 ulps of slack.
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import INTERPRETER, run_interpreter_tests

from unicache_train.compress.quantize import quantize_symmetric
from unicache_train.model.compressed_cache import CompressedKVCache, StoredSegment
from unicache_train.ops.decode_attention import (
    decode_attention,
    decode_attention_packed,
    decode_attention_reference,
    segment_bias,
)
from unicache_train.seam import QuantizedKV, pack_int4

ATOL = 1e-5


def make_segment(B=2, Hk=3, G=3, M=37, D=48, bits=4, granularity="token_head", seed=0):
    """A packed segment with merged heads (``G < Hk`` maps two heads to one slot), invalid
    tail entries and merge counts > 1; K/V of very different ranges per head."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, G, M, D, generator=g) * torch.linspace(0.5, 3.0, G)[None, :, None, None]
    v = torch.randn(B, G, M, D, generator=g)
    valid = torch.ones(B, M, dtype=torch.bool)
    valid[0, M - 5 :] = False  # sample 0 has 5 padding slots
    counts = torch.ones(B, M) + (torch.rand(B, M, generator=g) < 0.3) * 3.0
    _, kq, ks = quantize_symmetric(k, valid, bits, granularity)
    _, vq, vs = quantize_symmetric(v, valid, bits, granularity)
    if bits == 4:
        kq, vq = pack_int4(kq), pack_int4(vq)
    quant = QuantizedKV(bits, granularity, kq, vq, ks, vs, D)
    head_map = torch.tensor([[0, 1, 2], [0, 0, 1]])[:B, :Hk].clamp(max=G - 1)  # sample 1 merged
    return quant, head_map, counts, valid


def make_queries(B=2, H=6, Hk=3, T=1, S=5, D=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    if S == 0:
        return q, None, None
    return q, torch.randn(B, Hk, S, D, generator=g), torch.randn(B, Hk, S, D, generator=g)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("granularity", ["token_head", "head", "channel"])
@pytest.mark.parametrize("T,S", [(1, 5), (3, 7), (1, 0)])
def test_packed_equals_reference(bits, granularity, T, S):
    quant, head_map, counts, valid = make_segment(bits=bits, granularity=granularity)
    q, kd, vd = make_queries(T=T, S=S)
    ref = decode_attention_reference(q, quant, head_map, counts, valid, kd, vd)
    out = decode_attention_packed(q, quant, head_map, counts, valid, kd, vd)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    # the precomputed bias a cache passes gives the same result
    bias = segment_bias(counts, valid)
    again = decode_attention(q, quant, head_map, counts, valid, kd, vd, backend="packed", bias=bias)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


def test_reference_sees_the_count_bias_and_the_mask():
    """The spec itself: a segment entry with count c weighs like c copies; an invalid one
    not at all (compared with a hand-written softmax over dequantized entries)."""
    quant, head_map, counts, valid = make_segment(B=1, Hk=1, G=1, M=4, D=8, bits=8)
    q, _, _ = make_queries(B=1, H=1, Hk=1, S=0, D=8)
    counts = torch.tensor([[1.0, 3.0, 1.0, 2.0]])
    valid = torch.tensor([[True, True, True, False]])
    out = decode_attention_reference(q, quant, head_map, counts, valid, None, None)
    kf = quant.k_data[0, 0].float() * quant.k_scale[0, 0].float()[:, None]
    vf = quant.v_data[0, 0].float() * quant.v_scale[0, 0].float()[:, None]
    w = torch.exp(kf @ q[0, 0, 0] / 8**0.5) * torch.tensor([1.0, 3.0, 1.0, 0.0])
    torch.testing.assert_close(out[0, 0, 0], (w / w.sum()) @ vf, atol=ATOL, rtol=0)


def test_dispatch_refuses_unknown_and_unavailable_backends():
    quant, head_map, counts, valid = make_segment()
    q, kd, vd = make_queries()
    with pytest.raises(ValueError, match="backend='cuda'"):
        decode_attention(q, quant, head_map, counts, valid, kd, vd, backend="cuda")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        decode_attention(q, quant, head_map, counts, valid, kd, vd, backend="triton")
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention_packed(q[:, :5], quant, head_map, counts, valid, kd, vd)


def stored_segment(quant, head_map, counts, valid) -> StoredSegment:
    """The two-sample, D = 16 packed segment of the cache tests (30 context tokens each)."""
    return StoredSegment(
        head_map=head_map,
        groups=torch.tensor([3, 2]),
        quant=quant,
        keys=None,
        values=None,
        counts=counts,
        valid=valid,
        key_dim=16,
        value_dim=16,
        context_tokens=torch.tensor([30, 30]),
    )


@pytest.mark.parametrize("path", ["packed", "int8", "buffer"])
@pytest.mark.parametrize("bits", [4, 8])
def test_cache_attend_equals_reference_path_over_many_steps(path, bits):
    """CompressedKVCache.attend (decoded tokens appended in place, capacity grown past its
    first 64 slots) == update + attention_bias + SDPA, step after step; the held decoded
    tokens and the byte counts agree too."""
    quant, head_map, counts, valid = make_segment(bits=bits, M=21, D=16)
    seg = stored_segment(quant, head_map, counts, valid)
    fast = CompressedKVCache(1, decode_path=path)
    ref = CompressedKVCache(1, decode_path="reference")
    packed = CompressedKVCache(1, decode_path="packed")  # the working-bytes yardstick
    for cache in (fast, ref, packed):
        cache.set_segment(0, seg)
    g = torch.Generator().manual_seed(3)
    for step in range(70):
        T = 3 if step == 0 else 1
        q = torch.randn(2, 6, T, 16, generator=g)
        k, v = torch.randn(2, 3, T, 16, generator=g), torch.randn(2, 3, T, 16, generator=g)
        a = fast.attend(0, q, k, v)
        b = ref.attend(0, q, k, v)
        packed.attend(0, q, k, v)
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert fast.length(0) == ref.length(0) == 21 + 72
    torch.testing.assert_close(fast.keys[0], ref.keys[0], atol=0, rtol=0)
    assert fast.kv_bytes() == ref.kv_bytes() and fast.decoded_bytes() == ref.decoded_bytes()
    assert ref.working_bytes() == 0
    if path == "buffer":  # the dequantized segment (fp32, 3 KV heads) is a working buffer
        assert fast.working_bytes() >= 2 * 2 * 3 * 21 * 16 * 4
    unpacked = 2 * 2 * 3 * 21 * 16 if (path, bits) == ("int8", 4) else 0  # int8 rows of K, V
    if path != "buffer":
        assert fast.working_bytes() - packed.working_bytes() == unpacked
    with pytest.raises(ValueError, match="decode_path='fast'"):
        CompressedKVCache(1, decode_path="fast")


# ------------------------------------------------------------------------- Triton (interpreter)
@pytest.mark.skipif(INTERPRETER, reason="the parent process launches the interpreter child")
def test_triton_kernel_under_interpreter():
    run_interpreter_tests(__file__, "not gpu and not slow", OMP_NUM_THREADS="1")


@pytest.mark.skipif(not INTERPRETER, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize("bits,granularity", [(4, "token_head"), (8, "head"), (4, "channel")])
@pytest.mark.parametrize("T,S,split", [(1, 5, 16), (2, 3, 8), (1, 0, 64)])
def test_triton_equals_reference(bits, granularity, T, S, split):
    from unicache_train.kernels.decode_attention import decode_attention_triton

    quant, head_map, counts, valid = make_segment(M=37, D=48, bits=bits, granularity=granularity)
    q, kd, vd = make_queries(T=T, S=S, D=48)
    ref = decode_attention_reference(q, quant, head_map, counts, valid, kd, vd)
    out = decode_attention_triton(q, quant, head_map, counts, valid, kd, vd, split_size=split)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
