"""Fused mHC Triton kernels (``unicache_train.kernels.mhc``) vs the PyTorch paths.

The three stream passes of a connection (``rms_project``, ``collapse``, ``mix`` in
:mod:`unicache_train.ops.mhc`) and a whole :class:`HyperConnection` with ``backend="triton"`` are
compared with the torch backend and with the naive references, values and every gradient, under
a random cotangent.

On CPU the kernels run under the Triton interpreter (~1000x slower than compiled: tiny shapes).
``TRITON_INTERPRET=1`` must be set before triton is imported, which a test module cannot
guarantee in a shared pytest process; as in ``tests/test_sinkhorn_triton.py`` the interpreter
tests (``interp``) run in a child pytest process started by
``test_interpreter_tests_in_subprocess`` and are skipped in the parent. Run this file with
``TRITON_INTERPRET=1`` in the environment and they run directly; the slow ones only that way
(``TRITON_INTERPRET=1 pytest tests/test_mhc_fused.py -m slow``). GPU tests (``-m gpu``) use the
compiled kernels at real sizes and skip without CUDA.

Tolerances (absolute, on values and gradients of magnitude ~1-10):

* fp64: 1e-12. Same formulas, different summation order only.
* fp32, interpreter: 1e-5 (``mix``/``collapse`` are sums of n products: observed <= 4e-6; the
  projection sums n*C products of randn values, raw ~10: observed <= 2e-5 -> 5e-5 there).
* bf16 streams: the kernels compute in fp32 and round once; compared with the fp32 reference on
  the same (bf16-rounded) inputs within one bf16 ulp (the interpreter truncates where the
  compiled kernels round to nearest: see ``test_bf16_streams_round_once``).
* GPU, fp32: the compiled kernels' FMA contraction and reduction order: 1e-4 (projection 5e-4).
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from triton_interp import INTERPRETER, run_interpreter_tests  # noqa: E402  (tests/ on sys.path)

from unicache_train.model.config import ModelConfig  # noqa: E402
from unicache_train.model.mhc import HyperConnection  # noqa: E402
from unicache_train.model.mlp import SwiGLU  # noqa: E402
from unicache_train.model.norm import RMSNorm  # noqa: E402
from unicache_train.ops import mhc as om  # noqa: E402

interp = pytest.mark.skipif(
    not INTERPRETER, reason="runs under TRITON_INTERPRET=1 in test_interpreter_tests_in_subprocess"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ATOL = {torch.float64: 1e-12, torch.float32: 1e-5}
PROJ_ATOL = {torch.float64: 1e-12, torch.float32: 5e-5}


@pytest.fixture(scope="module")
def tk():
    """The kernel module, imported under the interpreter (only requested by ``interp`` tests)."""
    mod = importlib.import_module("unicache_train.kernels.mhc")
    assert mod.INTERPRETED, "TRITON_INTERPRET=1 was set after the kernels were imported"
    return mod


def test_interpreter_tests_in_subprocess():
    run_interpreter_tests(__file__, "not gpu and not slow", OMP_NUM_THREADS="1")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _inputs(B, T, n, C, dtype, seed=0, device="cpu"):
    """Streams, branch output and coefficients of realistic form (res doubly-stochastic-ish,
    transposed like ``HCCoeffs.res`` of the deepseek_v4 preset: a non-contiguous view)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, n, C, generator=g)
    f = torch.randn(B, T, C, generator=g)
    pre = torch.rand(B, T, n, generator=g) + 0.1
    post = 2 * torch.rand(B, T, n, generator=g)
    res = torch.softmax(torch.randn(B, T, n, n, generator=g), -1).transpose(-1, -2)
    w = torch.randn((2 + n) * n, n * C, generator=g) * 0.1
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    out = {
        "x": x.to(device, dtype),
        "f": f.to(device, dtype),
        "pre": pre.to(device, cdt),
        "post": post.to(device, cdt),
        "res": res.to(device, cdt),
        "w": w.to(device, cdt),
    }
    return {k: v.requires_grad_(True) for k, v in out.items()}


def _value_and_grads(fn, ins: dict, names: list[str], seed: int = 1):
    """fn(**ins) and the gradients of <fn, cot> w.r.t. ``names`` for a random cotangent."""
    y = fn(**ins)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y)
    grads = torch.autograd.grad(y, [ins[k] for k in names], cot)
    return y.detach(), dict(zip(names, grads))


def _assert_pass_matches(op: str, ins: dict, atol: float, ref: bool = True):
    """The Triton pass equals the torch backend (and the naive reference) in value and grads."""
    calls = {
        "collapse": (
            ["pre", "x"],
            lambda backend: lambda pre, x, **_: om.collapse(pre, x, backend),
            lambda pre, x, **_: om.collapse_reference(pre, x),
        ),
        "mix": (
            ["x", "f", "post", "res"],
            lambda backend: lambda x, f, post, res, **_: om.mix(x, f, post, res, backend),
            lambda x, f, post, res, **_: om.mix_reference(x, f, post, res),
        ),
        "rms_project": (
            ["x", "w"],
            lambda backend: lambda x, w, **_: om.rms_project(x.flatten(-2), w, 1e-6, backend),
            lambda x, w, **_: om.rms_project_reference(x.flatten(-2), w, 1e-6),
        ),
    }
    names, by_backend, reference = calls[op]
    y, g = _value_and_grads(by_backend("triton"), ins, names)
    y_t, g_t = _value_and_grads(by_backend("torch"), ins, names)
    assert y.dtype == y_t.dtype and y.shape == y_t.shape
    torch.testing.assert_close(y, y_t, atol=atol, rtol=0)
    for k in names:
        assert g[k].dtype == ins[k].dtype, k
        torch.testing.assert_close(g[k], g_t[k], atol=atol, rtol=0, msg=f"{op}: d{k}")
        assert g[k].abs().max() > 1e-3, f"{op}: d{k} is ~0, the comparison is vacuous"
    if ref:
        y_r, g_r = _value_and_grads(reference, ins, names)
        torch.testing.assert_close(y, y_r, atol=atol, rtol=0)
        for k in names:
            torch.testing.assert_close(g[k], g_r[k], atol=atol, rtol=0, msg=f"{op}: d{k} vs ref")


# --------------------------------------------------------------------------------------------
# interpreter (CPU)
# --------------------------------------------------------------------------------------------

OPS = ["collapse", "mix", "rms_project"]


@interp
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n,C", [(4, 32), (3, 40)])  # n = 3 pads the streams; C = 40 the tile
def test_pass_matches_torch_and_reference(tk, op, dtype, n, C):
    ins = _inputs(2, 3, n, C, dtype, seed=n + C)
    atol = (PROJ_ATOL if op == "rms_project" else ATOL)[dtype]
    _assert_pass_matches(op, ins, atol)


@interp
@pytest.mark.parametrize("op", OPS)
def test_several_tiles_and_token_splits(tk, op, monkeypatch):
    # Small tiles: the channel loops run 3 tiles with a partial last one (C = 40, BC = 16); the
    # projection forward splits its 160 columns in 2 (80 each, 5 tiles of 16), its backward
    # splits 18 tokens over 2 programs (fp64: 16 tokens per block).
    monkeypatch.setattr(tk, "_TILE_2D", 64)
    monkeypatch.setattr(tk, "_TILE_3D", 256)
    monkeypatch.setattr(tk, "_PROJ_FWD_PROGRAMS", 4)
    monkeypatch.setattr(tk, "_PROJ_BWD_PROGRAMS", 4)
    ins = _inputs(3, 6, 4, 40, torch.float64, seed=3)
    _assert_pass_matches(op, ins, ATOL[torch.float64], ref=False)


@interp
def test_gradcheck_fp64(tk):
    ins = _inputs(1, 2, 2, 3, torch.float64, seed=7)
    x, f, pre, post, res, w = (ins[k] for k in ("x", "f", "pre", "post", "res", "w"))
    kw = dict(eps=1e-6, atol=1e-8, nondet_tol=0.0, fast_mode=True)
    assert torch.autograd.gradcheck(lambda p, z: om.collapse(p, z, "triton"), (pre, x), **kw)
    assert torch.autograd.gradcheck(
        lambda z, a, b, r: om.mix(z, a, b, r, "triton"), (x, f, post, res), **kw
    )
    assert torch.autograd.gradcheck(
        lambda z, m: om.rms_project(z.flatten(-2), m, 1e-6, "triton"), (x, w), **kw
    )


@interp
@pytest.mark.parametrize("op", OPS)
def test_bf16_streams_round_once(tk, op):
    ins = _inputs(2, 3, 4, 40, torch.bfloat16, seed=11)
    if op == "collapse":
        y = om.collapse(ins["pre"], ins["x"], "triton")
        y_ref = om.collapse_reference(ins["pre"], ins["x"].float())
    elif op == "mix":
        y = om.mix(ins["x"], ins["f"], ins["post"], ins["res"], "triton")
        y_ref = om.mix_reference(ins["x"].float(), ins["f"].float(), ins["post"], ins["res"])
    else:
        y = om.rms_project(ins["x"].flatten(-2), ins["w"], 1e-6, "triton")
        y_ref = om.rms_project_reference(ins["x"].float().flatten(-2), ins["w"], 1e-6)
    want_dtype = torch.float32 if op == "rms_project" else torch.bfloat16
    assert y.dtype == want_dtype
    # One rounding to bf16 of an fp32 result. Compiled kernels round to nearest (half an ulp,
    # 2^-9 relative); the interpreter's fp32 -> bf16 cast truncates (numpy bit shift, triton
    # 3.x ``cast_impl``): under one ulp, 2^-8 relative to the value's power of two -> 2^-7.
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2**-7, atol=1e-5)
    y.float().square().sum().backward()
    assert ins["x"].grad.dtype == torch.bfloat16 and torch.isfinite(ins["x"].grad).all()


def _stack(n: int, C: int, preset: str, dtype: torch.dtype, backend: str, seed: int = 0):
    cfg = ModelConfig(
        hidden_size=C,
        num_attention_heads=1,
        num_key_value_heads=1,
        residual_mode="mhc",
        hc_mult=n,
        hc_preset=preset,
        hc_sinkhorn_iters=3,
    )
    torch.manual_seed(seed)
    hc = HyperConnection(cfg)
    with torch.no_grad():
        hc.base.normal_(std=0.5)  # away from init, so that every coefficient varies
    hc.backend = backend
    norm, mlp = RMSNorm(C), SwiGLU(C, 2 * C)
    return hc.to(dtype), norm.to(dtype), mlp.to(dtype)


@interp
@pytest.mark.parametrize("preset", ["deepseek_v4", "paper"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_hyperconnection_triton_equals_torch(tk, preset, dtype):
    B, T, n, C = 2, 3, 4, 24
    x0 = torch.randn(B, T, n, C, generator=torch.Generator().manual_seed(5)).to(dtype)
    cot = torch.randn(B, T, n, C, generator=torch.Generator().manual_seed(6)).to(dtype)
    got = {}
    for backend in ("triton", "torch"):
        hc, norm, mlp = _stack(n, C, preset, dtype, backend)
        x = x0.clone().requires_grad_(True)
        y = hc(x, lambda h, norm=norm, mlp=mlp: mlp(norm(h)))
        params = dict(hc.named_parameters()) | {f"mlp.{k}": p for k, p in mlp.named_parameters()}
        grads = torch.autograd.grad(y, [x, *params.values()], cot)
        got[backend] = (y.detach(), dict(zip(["x", *params], grads)))
    (y, g), (y_t, g_t) = got["triton"], got["torch"]
    atol = {torch.float64: 1e-11, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(y, y_t, atol=atol, rtol=0)
    for k in g:
        torch.testing.assert_close(g[k], g_t[k], atol=atol, rtol=0, msg=f"d{k}")
    assert g["fn"].abs().max() > 1e-4 and g["x"].abs().max() > 1e-3


@interp
@pytest.mark.slow
def test_decoder_training_steps_equal_torch(tk):
    """Three AdamW steps of a tiny mHC decoder (attention and MLP branches, both connections per
    layer) give the same losses and weights with every connection on Triton as on torch (fp64;
    ~10 s under the interpreter, hence slow)."""
    from unicache_train.model.decoder import Decoder

    cfg = ModelConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        residual_mode="mhc",
        hc_mult=4,
        hc_sinkhorn_iters=3,
    )
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(0))
    runs = {}
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        model = Decoder(cfg).double()
        hcs = [m for m in model.modules() if isinstance(m, HyperConnection)]
        assert len(hcs) == 4
        for hc in hcs:
            hc.backend = backend
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            logits = model(ids).logits  # [B, T, V]
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[backend] = (losses, {k: v.detach() for k, v in model.state_dict().items()})
    (losses, sd), (losses_t, sd_t) = runs["triton"], runs["torch"]
    assert losses == pytest.approx(losses_t, abs=1e-10) and losses[-1] < losses[0]
    for k in sd:
        torch.testing.assert_close(sd[k], sd_t[k], atol=1e-9, rtol=0, msg=k)


@interp
def test_triton_backend_rejects_too_many_streams(tk):
    ins = _inputs(1, 2, 17, 3, torch.float32)
    with pytest.raises(ValueError, match="n <= 16"):
        om.collapse(ins["pre"], ins["x"], "triton")
    # auto on CPU is the torch path, whatever n.
    om.collapse(ins["pre"], ins["x"], "auto")


# --------------------------------------------------------------------------------------------
# dispatch and validation (parent process, no kernel import needed)
# --------------------------------------------------------------------------------------------


def test_auto_on_cpu_is_the_torch_path(monkeypatch):
    def boom():
        raise AssertionError("auto on CPU must not import the Triton kernels")

    monkeypatch.setattr(om, "_triton_kernels", boom)
    ins = _inputs(2, 3, 4, 8, torch.float32)
    om.collapse(ins["pre"], ins["x"])
    om.mix(ins["x"], ins["f"], ins["post"], ins["res"])
    om.rms_project(ins["x"].flatten(-2), ins["w"], 1e-6)
    assert HyperConnection.backend == "auto"


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ins = _inputs(1, 2, 2, 4, torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        om.mix(ins["x"], ins["f"], ins["post"], ins["res"], "triton")


def test_bad_arguments_name_the_argument():
    ins = _inputs(1, 2, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        om.collapse(ins["pre"], ins["x"], "cuda")
    with pytest.raises(ValueError, match=r"mhc.mix: res must be \[..., n, n\]"):
        om.mix(ins["x"], ins["f"], ins["post"], ins["res"][..., :3])
    with pytest.raises(ValueError, match=r"mhc.collapse: pre must be"):
        om.collapse(ins["pre"][..., :3], ins["x"])
    with pytest.raises(ValueError, match=r"weight must be \[K, N=32\]"):
        om.rms_project(ins["x"].flatten(-2), ins["w"][:, :5], 1e-6)
    with pytest.raises(TypeError, match="floating"):
        om.collapse(ins["pre"], ins["x"].long())


# --------------------------------------------------------------------------------------------
# GPU (compiled kernels, real sizes)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("C", [2048, 1000])
def test_gpu_pass_matches_torch(op, C):
    ins = _inputs(2, 512, 4, C, torch.float32, seed=C, device="cuda")
    atol = 5e-4 if op == "rms_project" else 1e-4
    _assert_pass_matches(op, ins, atol, ref=False)


@pytest.mark.gpu
@needs_cuda
def test_gpu_hyperconnection_bf16_auto_is_triton_and_close_to_torch():
    B, T, n, C = 2, 256, 4, 1024
    x0 = torch.randn(B, T, n, C, device="cuda").bfloat16()
    cot = torch.randn(B, T, n, C, device="cuda").bfloat16()
    out = {}
    for backend in ("auto", "torch"):
        hc, norm, mlp = _stack(n, C, "deepseek_v4", torch.bfloat16, backend)
        hc, norm, mlp = hc.cuda(), norm.cuda(), mlp.cuda()
        x = x0.clone().requires_grad_(True)
        y = hc(x, lambda h, norm=norm, mlp=mlp: mlp(norm(h)))
        (gx,) = torch.autograd.grad(y, [x], cot)
        out[backend] = (y.float(), gx.float())
    (y, gx), (y_t, gx_t) = out["auto"], out["torch"]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    # bf16 streams: the torch mix rounds res/post to bf16 before a bf16 GEMM, the kernels round
    # once; the gradient also passes the bf16 MLP at inputs that may differ by one ulp. Relative
    # Frobenius errors: a bf16 ulp is 2^-8 relative; 2^-6 leaves room for a few roundings.
    assert rel(y, y_t) < 2**-6 and rel(gx, gx_t) < 2**-6, (rel(y, y_t), rel(gx, gx_t))
