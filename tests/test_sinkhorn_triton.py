"""Triton Sinkhorn kernels vs the torch reference.

On CPU the kernels run under the Triton interpreter (~1000x slower than compiled, so the grids
are tiny: a few matrices, 3-5 iterations). ``TRITON_INTERPRET=1`` must be set before *triton*
is imported (its own ``tl.sum``/``tl.max`` are ``@jit`` functions decorated at import), which a
test module cannot guarantee in a shared pytest process. So the interpreter tests (marked
``interp`` below) run in a child pytest process started with the variable set, by
``test_interpreter_tests_in_subprocess``; in the parent they are skipped, and nothing leaks into
other tests. Run this file with ``TRITON_INTERPRET=1`` in the environment and they run directly.

GPU tests (``-m gpu``) use the compiled kernels at real sizes and skip without CUDA.

Tolerances: the interpreter evaluates the kernels with numpy in fp32 (fp64 for fp64 input), the
same formulas as the reference, so forward and gradient agree to fp32 rounding: 1e-6 on values
and gradients of magnitude ~1 (observed <= 2.5e-7). Compiled on GPU, FMA contraction and
warp-shuffle reduction orders add rounding: 1e-5 there; ``paper`` gradients at 20 iterations:
1e-4, the conditioning of its final rounding step near convergence (see
tests/test_sinkhorn.py's docstring; two correct fp32 evaluations differ by up to 2e-5).
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from triton_interp import INTERPRETER, run_interpreter_tests  # noqa: E402  (tests/ on sys.path)

from unicache_train.ops import sinkhorn, sinkhorn_reference  # noqa: E402

VARIANTS = ["deepseek_v4", "paper"]
ATOL = 1e-6  # interpreter, fp32: see module docstring
GPU_ATOL = 1e-5  # compiled, fp32: see module docstring
PAPER_GPU_GRAD_ATOL = 1e-4  # compiled, fp32, paper gradients at 20 iterations: see docstring
interp = pytest.mark.skipif(
    not INTERPRETER, reason="runs under TRITON_INTERPRET=1 in test_interpreter_tests_in_subprocess"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tk():
    """The kernel module, imported under the interpreter (only requested by ``interp`` tests)."""
    mod = importlib.import_module("unicache_train.kernels.sinkhorn")
    assert mod.INTERPRETED, "TRITON_INTERPRET=1 was set after the kernels were imported"
    return mod


def test_interpreter_tests_in_subprocess():
    run_interpreter_tests(__file__, "not gpu")


def _logits(shape, scale=2.0, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _grads(fn, x, cot):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    (g,) = torch.autograd.grad(y, x, cot)
    return y.detach(), g


# --------------------------------------------------------------------------------------------
# interpreter (CPU)
# --------------------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_forward_and_grad_vs_reference(tk, variant, n):
    iters = 3 + n % 3  # 3..5
    x = _logits((7, n, n), seed=n)
    cot = _logits((7, n, n), scale=1.0, seed=10 + n)  # random: ones_like would give ~0 gradient
    # Through the public op: dispatch, launcher and kernels.
    y, g = _grads(lambda z: sinkhorn(z, iters, 1e-6, variant, backend="triton"), x, cot)
    y_ref, g_ref = _grads(lambda z: sinkhorn_reference(z, iters, 1e-6, variant), x, cot)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)
    assert g.abs().max() > 1e-3  # not vacuous


@interp
@pytest.mark.parametrize("variant", VARIANTS)
def test_leading_dims_tails_and_eps(tk, variant):
    # 36 matrices in leading dims [4, 9]: several backward programs (BLOCK = 16 at n = 4) and a
    # partial last block; eps = 0 exercises the padding/tail guards (denominators of 1 there,
    # never 0/0).
    x = _logits((4, 9, 4, 4), seed=3)
    cot = _logits((4, 9, 4, 4), scale=1.0, seed=4)
    for eps in (0.0, 1e-3):
        y, g = _grads(lambda z, e=eps: tk.sinkhorn_triton(z, 3, e, variant), x, cot)
        y_ref, g_ref = _grads(lambda z, e=eps: sinkhorn_reference(z, 3, e, variant), x, cot)
        torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)
    x = _logits((37, 3, 3), seed=5)
    cot = _logits((37, 3, 3), scale=1.0, seed=6)
    _, g = _grads(lambda z: tk.sinkhorn_triton(z, 3, 1e-6, variant), x, cot)
    _, g_ref = _grads(lambda z: sinkhorn_reference(z, 3, 1e-6, variant), x, cot)
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)


@interp
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradcheck_fp64(tk, variant):
    # fp64 in -> the kernels compute in fp64. eps = 0.1 makes the eps terms visible to finite
    # differences; n = 3 exercises the padded (NP = 4) path.
    x = _logits((1, 3, 3), seed=7, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: tk.sinkhorn_triton(z, 2, 0.1, variant), (x,))


@interp
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_torch_backend_on_extreme_inputs(tk, variant):
    # +-1e4 logits and -inf entries: finite output and gradient, equal to the torch backend
    # (which handles exact zeros the same way; autograd through the reference can be NaN here).
    x = _logits((6, 4, 4), scale=1.0, seed=8)
    x[:3] *= 1e4
    x[3:, :, 1] = float("-inf")
    cot = _logits((6, 4, 4), scale=1.0, seed=9)
    y, g = _grads(lambda z: tk.sinkhorn_triton(z, 5, 1e-6, variant), x, cot)
    y_t, g_t = _grads(lambda z: sinkhorn(z, 5, 1e-6, variant, backend="torch"), x, cot)
    assert torch.isfinite(y).all() and torch.isfinite(g).all()
    torch.testing.assert_close(y, y_t, atol=ATOL, rtol=0)
    # Rows of zeros get cotangents up to 1/eps per step before they are masked: 1e-5 absolute
    # on gradients that are still ~1 (observed ~1e-7).
    torch.testing.assert_close(g, g_t, atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("scale", [1.0, 100.0, 1e4])
def test_paper_doubly_stochastic_at_any_logit_scale(tk, scale):
    # As the torch backend (tests/test_sinkhorn.py): log-domain iterations and the final
    # rounding keep rows and columns at 1 where exp(x - max) used to underflow to zero columns.
    x = _logits((6, 4, 4), scale=scale, seed=12)
    cot = _logits((6, 4, 4), scale=1.0, seed=13)
    y, g = _grads(lambda z: tk.sinkhorn_triton(z, 5, 1e-6, "paper"), x, cot)
    assert torch.isfinite(y).all() and (y >= 0).all() and torch.isfinite(g).all()
    assert (y.sum(-1) - 1).abs().max() <= 1e-5 and (y.sum(-2) - 1).abs().max() <= 1e-5
    y_t, g_t = _grads(lambda z: sinkhorn(z, 5, 1e-6, "paper", backend="torch"), x, cot)
    torch.testing.assert_close(y, y_t, atol=ATOL, rtol=0)
    torch.testing.assert_close(g, g_t, atol=ATOL, rtol=0)


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input(tk, dtype):
    x = _logits((5, 4, 4), dtype=dtype)
    cot = _logits((5, 4, 4), scale=1.0, seed=11)
    y, g = _grads(lambda z: tk.sinkhorn_triton(z, 4, 1e-6, "deepseek_v4"), x, cot)
    y_ref, g_ref = _grads(lambda z: sinkhorn_reference(z, 4, 1e-6, "deepseek_v4"), x, cot)
    assert y.dtype == torch.float32 and g.dtype == dtype
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)  # fp32 compute from the same input
    # One final rounding to the input dtype (bf16: 2^-8 relative).
    torch.testing.assert_close(g.float(), g_ref.float(), atol=1e-2, rtol=1e-2)


@interp
def test_saves_only_the_input(tk):
    x = _logits((5, 4, 4)).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tk.sinkhorn_triton(x, 3)
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr()


@interp
def test_empty_and_argument_errors(tk):
    x = torch.zeros(0, 4, 4, requires_grad=True)
    y = tk.sinkhorn_triton(x, 3)
    y.sum().backward()
    assert y.shape == (0, 4, 4) and x.grad.shape == (0, 4, 4)
    with pytest.raises(ValueError, match="iters must be an int >= 1, got 0"):
        tk.sinkhorn_triton(torch.zeros(2, 3, 3), 0)
    with pytest.raises(ValueError, match="n <= 64, got n=65"):
        tk.sinkhorn_forward(torch.zeros(1, 65, 65), 1, 1e-6, "paper")


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    real = importlib.import_module("unicache_train.kernels.sinkhorn")
    x = _logits((3, 4, 4))
    if real.INTERPRETED:  # the interpreter run: covered by test_forward_and_grad_vs_reference
        torch.testing.assert_close(sinkhorn(x, 3, backend="triton"), sinkhorn_reference(x, 3))
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs a CUDA tensor, got device cpu"):
        sinkhorn(x, backend="triton")
    # Set after the kernels were decorated in compiled mode: too late, and said so.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="imported before"):
        sinkhorn(x, backend="triton")
    with pytest.raises(RuntimeError, match="cannot run on a tensor on cpu"):
        real.sinkhorn_triton(x, 3)


# --------------------------------------------------------------------------------------------
# GPU (compiled kernels, real sizes)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [3, 4, 8, 16])
def test_gpu_vs_reference(variant, n):
    x = _logits((32768 if n == 4 else 4099, n, n), seed=n).cuda()
    cot = _logits(tuple(x.shape), scale=1.0, seed=20 + n).cuda()
    y, g = _grads(lambda z: sinkhorn(z, 20, 1e-6, variant, backend="triton"), x, cot)
    y_ref, g_ref = _grads(lambda z: sinkhorn_reference(z, 20, 1e-6, variant), x, cot)
    torch.testing.assert_close(y, y_ref, atol=GPU_ATOL, rtol=0)
    grad_atol = PAPER_GPU_GRAD_ATOL if variant == "paper" else GPU_ATOL
    torch.testing.assert_close(g, g_ref, atol=grad_atol, rtol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_bf16_auto_and_extremes(variant):
    x = _logits((32768, 4, 4), dtype=torch.bfloat16).cuda()
    cot = _logits((32768, 4, 4), scale=1.0, seed=31).cuda()
    y, g = _grads(lambda z: sinkhorn(z, 20, 1e-6, variant), x, cot)  # auto -> triton on CUDA
    y_t, g_t = _grads(lambda z: sinkhorn(z, 20, 1e-6, variant, backend="torch"), x, cot)
    assert y.dtype == torch.float32 and g.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_t, atol=GPU_ATOL, rtol=0)
    torch.testing.assert_close(g.float(), g_t.float(), atol=1e-2, rtol=1e-2)
    big = _logits((4096, 4, 4), scale=1e4, seed=32).cuda()
    yb, gb = _grads(lambda z: sinkhorn(z, 20, 1e-6, variant), big, cot[:4096].float())
    assert torch.isfinite(yb).all() and torch.isfinite(gb).all()
    if variant == "paper":  # doubly stochastic for any finite input
        assert (yb.sum(-1) - 1).abs().max() <= 1e-5 and (yb.sum(-2) - 1).abs().max() <= 1e-5


@pytest.mark.gpu
@needs_cuda
def test_gpu_gradcheck_fp64():
    for variant in VARIANTS:
        x = _logits((3, 3, 3), seed=41, dtype=torch.float64).cuda().requires_grad_(True)
        assert torch.autograd.gradcheck(
            lambda z, v=variant: sinkhorn(z, 4, 0.1, v, backend="triton"), (x,)
        )
