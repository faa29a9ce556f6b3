"""ops/dense.py: fp32 linear layers on oneDNN (where MKL takes its AVX2 path) against F.linear."""

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from transnormer.ops import _native, dense

has_op = pytest.mark.skipif(not dense.onednn_available(), reason="this PyTorch has no oneDNN inner product")


@pytest.fixture
def onednn(monkeypatch):
    """Force the oneDNN path and count its products."""
    monkeypatch.setenv("TRANSNORMER_FP32_GEMM", "onednn")
    calls = []
    real = dense._inner
    monkeypatch.setattr(dense, "_inner", lambda *a: calls.append(a[0].shape) or real(*a))
    return calls


@has_op
@pytest.mark.parametrize("shape", [(1, 48), (3, 65, 48), (2, 1, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_f_linear_forward_and_gradients(onednn, shape, bias):
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(33, 48, requires_grad=True)
    b = torch.randn(33, requires_grad=True) if bias else None
    go = torch.randn(*shape[:-1], 33)
    y = dense.linear(x, w, b)
    assert len(onednn) == 1  # the forward ran on oneDNN
    params = (x, w) + ((b,) if bias else ())
    got = (y, *torch.autograd.grad(y, params, go))
    assert len(onednn) == 3  # and both gradient products
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_() if bias else None
    yd = F.linear(xd, wd, bd)
    ref = (yd, *torch.autograd.grad(yd, (xd, wd) + ((bd,) if bias else ()), go.double()))
    for a, r in zip(got, ref):
        assert a.dtype == torch.float32 and a.shape == r.shape and rel_err(a.double(), r) < 1e-5


@has_op
def test_only_the_gradients_asked_for_are_computed(onednn):
    x, w = torch.randn(5, 16), torch.randn(8, 16, requires_grad=True)
    y = dense.linear(x, w)
    (dw,) = torch.autograd.grad(y.sum(), (w,))
    assert len(onednn) == 2 and torch.allclose(dw, torch.ones(5, 8).t() @ x, rtol=1e-5, atol=1e-5)


@has_op
def test_mm_t_and_the_other_dtypes(onednn):
    a, w = torch.randn(7, 24), torch.randn(10, 24)
    assert rel_err(dense.mm_t(a, w).double(), a.double() @ w.double().t()) < 1e-6 and len(onednn) == 1
    for dt in (torch.float64, torch.bfloat16):  # F.linear / torch.mm, not oneDNN
        assert torch.equal(dense.linear(a.to(dt), w.to(dt)), F.linear(a.to(dt), w.to(dt)))
        assert torch.equal(dense.mm_t(a.to(dt), w.to(dt)), torch.mm(a.to(dt), w.to(dt).t()))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: F.linear's cast and product
        assert dense.linear(a, w).dtype == torch.bfloat16
    assert len(onednn) == 1


@has_op
def test_the_choice_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("TRANSNORMER_FP32_GEMM", "mkl")
    assert not dense.onednn_fp32()
    calls = []
    monkeypatch.setattr(dense, "_inner", lambda *a: calls.append(1))
    assert torch.equal(dense.linear(torch.ones(2, 3), torch.ones(4, 3)), torch.full((2, 4), 3.0)) and not calls
    monkeypatch.setenv("TRANSNORMER_FP32_GEMM", "onednn")
    from transnormer.ops import _native

    before = _native.backend()
    try:
        _native.set_backend("torch")  # the plain PyTorch forms everywhere
        assert not dense.onednn_fp32()
    finally:
        _native.set_backend(before)
    monkeypatch.setenv("TRANSNORMER_FP32_GEMM", "fast")
    with pytest.raises(ValueError, match="TRANSNORMER_FP32_GEMM"):
        dense.onednn_fp32()


@has_op
def test_linear_module_keeps_nn_linear_parameters_and_state_dict(onednn):
    from torch import nn

    from transnormer.modules.linear import Linear

    m = Linear(6, 4)
    assert isinstance(m, nn.Linear) and set(m.state_dict()) == {"weight", "bias"}
    x = torch.randn(3, 6, requires_grad=True)
    y = m(x)
    got = torch.autograd.grad(y.sum(), (x, m.weight, m.bias))
    assert len(onednn) == 3
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, m.weight, m.bias))
    yd = F.linear(xd, wd, bd)
    ref = torch.autograd.grad(yd.sum(), (xd, wd, bd))
    assert rel_err(y.double(), yd) < 1e-6 and all(rel_err(a.double(), r) < 1e-6 for a, r in zip(got, ref))


@has_op
def test_a_double_backward_is_right(onednn):
    # a create_graph backward runs PyTorch's products: second derivatives (gradient penalties, Hessian-
    # vector products) are those of F.linear. (once_differentiable had raised on .backward() but let
    # autograd.grad(..., allow_unused=True) and hvp read zeros.)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    b = torch.randn(3, requires_grad=True)

    def second(fn):
        gx, gw = torch.autograd.grad(fn(x, w, b).pow(3).sum(), (x, w), create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum() + (gw * gw.detach()).sum(), (x, w, b))

    for got, ref in zip(second(dense.linear), second(F.linear), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    xt = torch.randn(8, 4).t().requires_grad_()  # a non-contiguous input, saved as it is
    (gx,) = torch.autograd.grad(dense.linear(xt, w, b).pow(2).sum(), (xt,), create_graph=True)
    (ref,) = torch.autograd.grad(F.linear(xt, w, b).pow(2).sum(), (xt,), create_graph=True)
    torch.testing.assert_close(torch.autograd.grad(gx.sum(), w)[0], torch.autograd.grad(ref.sum(), w)[0])


@has_op
def test_the_glu_input_side_runs_its_products_on_onednn(onednn, monkeypatch):
    """ops/_projection.py under the fused GLU gate (and its F.linear-free fallback): forward, dx and
    dW on oneDNN, equal to the composed fp64 form."""
    from transnormer.ops import _native
    from transnormer.ops.rowwise import projected_silu_gate

    x = torch.randn(2, 37, 24, requires_grad=True)
    w1, w2 = (torch.randn(40, 24).mul_(0.2).requires_grad_() for _ in range(2))
    b1, b2 = (torch.randn(40).requires_grad_() for _ in range(2))
    go = torch.randn(2, 37, 40)
    for mode in ("fused", "fallback"):  # _ProjectedSiluGate (needs the kernels), else linear + gate
        onednn.clear()
        if mode == "fallback":
            monkeypatch.setattr(_native, "rows_usable", lambda *a: False)
        elif _native.load() is None:
            continue
        y = projected_silu_gate(x, w1, w2, b1, b2)
        got = (y, *torch.autograd.grad(y, (x, w1, w2), go))
        assert len(onednn) == 3, mode
        xd, w1d, w2d, b1d, b2d = (t.detach().double().requires_grad_() for t in (x, w1, w2, b1, b2))
        yd = F.silu(F.linear(xd, w1d, b1d)) * F.linear(xd, w2d, b2d)
        ref = (yd, *torch.autograd.grad(yd, (xd, w1d, w2d), go.double()))
        for a, r in zip(got, ref):
            assert rel_err(a.double(), r) < 1e-5, mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dense_rows_copies_transposed_views_exactly(monkeypatch, dtype):
    native = []
    real = _native.cast_transpose
    monkeypatch.setattr(_native, "cast_transpose", lambda w, dt: native.append(w.shape) or real(w, dt))
    a = torch.randn(37, 70).to(dtype)
    assert dense.dense_rows(a) is a  # already contiguous: no copy
    for view in (a.t(), a[:, ::2], a.t()[3:20]):
        got = dense.dense_rows(view)
        assert got.is_contiguous() and got.dtype == dtype and torch.equal(got, view)
    # only the plain transpose of an fp32/bf16 matrix takes the native pass
    assert native == ([(37, 70)] if _native.rows_usable(dtype, a.device) else [])
    b = torch.randn(2, 5, 6).to(dtype).transpose(1, 2)
    assert torch.equal(dense.dense_rows(b), b.contiguous())
    # a tensor autograd tracks keeps its history (the native copy would drop it)
    c = torch.randn(6, 4, dtype=dtype, requires_grad=True)
    dense.dense_rows(c.t()).sum().backward()
    assert torch.equal(c.grad, torch.ones_like(c))


@has_op
@pytest.mark.parametrize("fused", [True, False])
def test_mm_t_add_with_and_without_the_fused_sum(monkeypatch, fused):
    if not fused:  # a PyTorch whose inner product has no binary post-op
        monkeypatch.setattr(dense, "_linear_binary", lambda: None)
    a, w, c = torch.randn(9, 24), torch.randn(13, 24), torch.randn(9, 13)
    got = dense.mm_t_add(a, w, c)
    assert rel_err(got.double(), c.double() + a.double() @ w.double().t()) < 1e-6


@has_op
def test_the_fp32_gemm_probe_also_times_onednn(monkeypatch):
    # the bench's limit is the faster of PyTorch's matmul and oneDNN's product, whatever the routing
    from transnormer.bench import timing

    monkeypatch.setenv("TRANSNORMER_FP32_GEMM", "mkl")
    calls = []
    real = dense.inner
    monkeypatch.setattr(dense, "inner", lambda a, w: calls.append(a.shape) or real(a, w))
    assert timing.gemm_gflops(64, torch.float32, repeat=1, min_time=0.0) > 0 and calls
    calls.clear()
    assert timing.gemm_gflops(64, torch.bfloat16, repeat=1, min_time=0.0) > 0 and not calls


def test_the_gemm_probe_reads_the_fastest_run_over_its_min_time(monkeypatch):
    # a limit: a slow spell inside the probe must not lower it
    from transnormer.bench import timing

    seen = []

    def fake(fn, **kw):
        seen.append(kw)
        return {"median_s": 2.0, "min_s": 0.5, "iqr_s": 0.0, "n": 3}

    monkeypatch.setattr(timing, "measure", fake)
    assert timing.gemm_gflops(100, torch.bfloat16, repeat=3, min_time=0.25) == pytest.approx(2 * 100**3 / 0.5 / 1e9)
    assert seen == [{"warmup": 2, "repeat": 3, "min_time": 0.25}]


needs_bmm_kernel = pytest.mark.skipif(not _native.rows_usable(torch.float32, torch.device("cpu")),
                                      reason="fused CPU kernels unavailable")


@needs_bmm_kernel
# M: every remainder of its 6-row blocks (7, 63, 13: 1 and 3 rows, spread over the last two blocks;
# 8, 64: 2 and 4, spread too; 65: 5, a block of its own)
@pytest.mark.parametrize("n, M, K, N", [(1, 1, 1, 1), (3, 7, 5, 17), (2, 63, 64, 65), (1, 65, 1, 64), (4, 13, 0, 9),
                                        (2, 8, 3, 16), (1, 64, 64, 64)])
@pytest.mark.parametrize("a_layout", ["rows", "transposed"])
def test_native_bmm_matches_fp64_for_any_left_operand_layout(n, M, K, N, a_layout):
    """_native.bmm against the fp64 product: a as rows or as a transposed view (read through its
    strides), b with a row stride wider than N, out a slot of a larger tensor; then accumulated."""
    a = torch.randn(n, M, K) if a_layout == "rows" else torch.randn(n, K, M).transpose(1, 2)
    b = torch.randn(n, K, N + 3)[..., :N]
    store = torch.full((2, n, M, N), 7.0)
    out = _native.bmm(a, b, store[1])
    ref = a.double() @ b.double()
    assert out.data_ptr() == store[1].data_ptr() and torch.equal(store[0], torch.full_like(store[0], 7.0))
    assert (out.double() - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max())
    _native.bmm(a, b, out, accumulate=True)
    assert (out.double() - 2 * ref).abs().max() <= 2e-5 * max(1.0, ref.abs().max())


@needs_bmm_kernel
def test_native_bmm_does_not_depend_on_the_thread_count():
    """A lone product is split into bands of rows over the threads, each element still summed in
    order by one thread: bit-equal on 1 and 2 threads."""
    before = torch.get_num_threads()
    a, b = torch.randn(1, 50, 33), torch.randn(1, 33, 40)
    try:
        torch.set_num_threads(1)
        one = _native.bmm(a, b)
        torch.set_num_threads(2)
        two = _native.bmm(a, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_bmm_kernel
def test_native_bmm_rejects_what_it_cannot_read():
    a, b = torch.randn(2, 4, 3), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="b must be"):
        _native.bmm(a, b.transpose(1, 2).contiguous().transpose(1, 2))  # column stride 5
    with pytest.raises(ValueError, match="b must be"):
        _native.bmm(a, torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match="out must be"):
        _native.bmm(a, b, torch.empty(2, 5, 4).transpose(1, 2))
    with pytest.raises(ValueError, match="accumulate"):
        _native.bmm(a, b, accumulate=True)
    with pytest.raises(TypeError, match="one dtype"):
        _native.bmm(a, b, torch.empty(2, 4, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32"):
        _native.bmm(a.double(), b.double())
    with pytest.raises(ValueError, match="CPU tensors"):  # a device pointer must never reach the kernel
        _native.bmm(a, b, torch.empty(2, 4, 5, device="meta"))


@needs_bmm_kernel
@pytest.mark.parametrize("choice", ["onednn", "mkl"])
def test_dense_bmm_takes_the_native_gemm_where_fp32_leaves_mkl(monkeypatch, choice):
    """dense.bmm runs the native GEMM when TRANSNORMER_FP32_GEMM says fp32 leaves MKL and it can
    read the operands; otherwise (MKL chosen, a transposed right operand, another dtype, autocast,
    tensors autograd tracks) torch.bmm / baddbmm_. Same products either way."""
    monkeypatch.setenv("TRANSNORMER_FP32_GEMM", choice)
    calls = []
    real = _native.bmm
    monkeypatch.setattr(_native, "bmm", lambda *a, **k: calls.append(1) or real(*a, **k))
    a, b = torch.randn(3, 9, 6), torch.randn(3, 6, 11)
    ref = a.double() @ b.double()
    out = dense.bmm(a, b)
    native = choice == "onednn" and _native.bmm_ready()
    assert len(calls) == int(native) and rel_err(out.double(), ref) < 1e-6
    assert dense.bmm(a, b, out, accumulate=True) is out and rel_err(out.double(), 2 * ref) < 1e-6
    assert len(calls) == 2 * int(native)
    calls.clear()
    assert rel_err(dense.bmm(a, b.transpose(1, 2).contiguous().transpose(1, 2)).double(), ref) < 1e-6
    assert torch.equal(dense.bmm(a.double(), b.double()), torch.bmm(a.double(), b.double()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dense.bmm(a, b).dtype == torch.bfloat16
    y = dense.bmm(a.requires_grad_(), b)
    assert y.requires_grad and not calls
    with pytest.raises(ValueError, match="accumulate"):
        dense.bmm(a.detach(), b, accumulate=True)
