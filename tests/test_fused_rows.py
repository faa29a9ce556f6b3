"""Fused CPU row kernels against their references: LRPE feature map, LM loss rows, SimpleRMSNorm,
SiLU gate, GAU/FLASH heads."""

import pytest
import torch

from conftest import model_loss_and_grads, rel_err
from transnormer.modules.lm_loss import linear_cross_entropy
from transnormer.ops import _native
from transnormer.ops.lrpe import FEATURE_KERNELS, lrpe_feature_map, lrpe_feature_map_reference
from transnormer.ops.rowwise import (
    scale_offset_rope,
    scale_offset_rope_reference,
    silu_gate,
    silu_gate_reference,
    silu_split,
    simple_rms_norm,
    simple_rms_norm_reference,
)

needs_kernel = pytest.mark.skipif(_native.load() is None, reason="fused CPU kernels unavailable")


@pytest.fixture
def backend_mode():
    before = _native.backend()
    yield _native.set_backend
    _native.set_backend(before)


def _lrpe_case(T, H, D, *, batch_angles=False, seed=0):
    g = torch.Generator().manual_seed(seed + 31 * T + D)
    B = 2
    x = torch.randn(B, T, H, D, dtype=torch.float64, generator=g)
    ang = torch.randn(B if batch_angles else 1, T, D // 2, dtype=torch.float64, generator=g) * 3
    u = torch.randn(D, dtype=torch.float64, generator=g)
    gy = torch.randn(B, T, H, D, dtype=torch.float64, generator=g)
    return x, ang, u / u.norm(), gy


def _lrpe_grads(fn, x, ang, u, gy, dtype, kernel, scale):
    """Output and gradients for x and the cos/sin tables. The tables are the op's inputs: they are
    computed once here, because torch's fp64 cos can differ by ~1e-8 between two calls on the same
    tensor in some processes (seen with torch 2.13 on this CPU), which would swamp an fp64 test."""
    tdt = torch.float64 if dtype == torch.float64 else torch.float32
    c, s = (t.to(tdt).requires_grad_() for t in _tables(ang))
    x = x.to(dtype).requires_grad_()
    y = fn(x, c, s, None if u is None else u.to(tdt), scale=scale, kernel=kernel)
    return (y, *torch.autograd.grad(y, (x, c, s), gy.to(dtype)))


_TABLES: dict = {}


def _tables(ang):
    key = (tuple(ang.shape), float(ang.sum()))
    if key not in _TABLES:
        _TABLES[key] = (ang.cos(), ang.sin())
    return _TABLES[key]


@pytest.mark.parametrize("kernel", list(FEATURE_KERNELS))
@pytest.mark.parametrize("householder", [True, False])
def test_lrpe_torch_form_matches_reference_fp64(kernel, householder):
    x, ang, u, gy = _lrpe_case(65, 3, 64)
    u = u if householder else None
    ref = _lrpe_grads(lrpe_feature_map_reference, x, ang, u, gy, torch.float64, kernel, 0.7)
    got = _lrpe_grads(lrpe_feature_map, x, ang, u, gy, torch.float64, kernel, 0.7)  # fp64: PyTorch form
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-12


@needs_kernel
@pytest.mark.parametrize("T", [1, 63, 64, 65])
@pytest.mark.parametrize("H,D", [(3, 64), (1, 32), (2, 6), (2, 40)])  # 6, 40: the portable loops
@pytest.mark.parametrize("kernel", ["identity", "elu", "1+elu", "relu"])
def test_lrpe_fused_fp32_matches_reference(backend_mode, T, H, D, kernel):
    backend_mode("native")
    for householder, batch_angles in ((True, False), (False, True)):
        x, ang, u, gy = _lrpe_case(T, H, D, batch_angles=batch_angles)
        u = u if householder else None
        ref = _lrpe_grads(lrpe_feature_map_reference, x, ang, u, gy, torch.float64, kernel, 0.125)
        got = _lrpe_grads(lrpe_feature_map, x, ang, u, gy, torch.float32, kernel, 0.125)
        for a, b in zip(got, ref):
            assert rel_err(a.double(), b) < 2e-6


@needs_kernel
@pytest.mark.parametrize("kernel", ["1+elu", "identity"])
def test_lrpe_fused_bf16_rounds_once(backend_mode, kernel):
    """bf16 in, bf16 out, fp32 inside: the error is bf16 rounding of inputs and outputs, no more."""
    backend_mode("native")
    x, ang, u, gy = _lrpe_case(200, 4, 64)
    x, gy = x.bfloat16().double(), gy.bfloat16().double()  # the reference sees the same inputs
    ref = _lrpe_grads(lrpe_feature_map_reference, x, ang, u, gy, torch.float64, kernel, 1.0)
    got = _lrpe_grads(lrpe_feature_map, x, ang, u, gy, torch.bfloat16, kernel, 1.0)
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    for a, b in zip(got, ref):
        assert rel_err(a.double(), b) < 8e-3


@needs_kernel
def test_lrpe_fused_and_torch_forms_agree_in_a_model_layer(backend_mode):
    from transnormer.layers import NormAttention

    torch.manual_seed(0)
    layer = NormAttention(64, 2, causal=True, chunk_size=16)
    x = torch.randn(2, 37, 64, requires_grad=True)
    out = {}
    for mode in ("torch", "native"):
        backend_mode(mode)
        y, _ = layer(x)
        grads = torch.autograd.grad(y.square().sum(), (x, layer.lrpe.theta))
        out[mode] = (y, *grads)
    for a, b in zip(out["native"], out["torch"]):
        assert rel_err(a, b) < 1e-5


@needs_kernel
def test_lrpe_reads_strided_rows_in_place(backend_mode):
    """q and k are views of one fused qkv projection ([B, T, 3, H, D] unbound): same result."""
    backend_mode("native")
    qkv = torch.randn(2, 9, 3, 4, 16, requires_grad=True)
    ang = torch.randn(2, 9, 8)
    q = qkv.unbind(2)[1]
    assert not q.is_contiguous() and _native.token_rows_ok(q)
    y = lrpe_feature_map(q, ang.cos(), ang.sin(), kernel="1+elu")
    (g,) = torch.autograd.grad(y.sum(), qkv)
    q2 = q.detach().contiguous().requires_grad_()
    y2 = lrpe_feature_map(q2, ang.cos(), ang.sin(), kernel="1+elu")
    (g2,) = torch.autograd.grad(y2.sum(), q2)
    assert torch.equal(y, y2) and torch.equal(g[:, :, 1], g2) and (g[:, :, 0] == 0).all()


def _one_token_rows(B, width, layout, dtype, generator):
    """[B, 1, *width] rows of one token per sequence (a decode step), laid out as a fused
    projection's view (rows at the batch stride, wider than a row) or with the length-1 dim moved
    from the end, which PyTorch calls contiguous although its stride(1) is 1."""
    if layout == "fused":
        return torch.randn(B, 1, 3, *width, generator=generator).to(dtype).unbind(2)[1]
    x = torch.randn(B, *width, 1, generator=generator).to(dtype).movedim(-1, 1)
    assert x.is_contiguous() and x.stride(1) == 1
    return x


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["fused", "transposed"])
def test_lrpe_one_token_of_several_sequences(backend_mode, layout, dtype):
    """T = 1, B > 1: the rows are batch rows, whatever stride PyTorch gives the length-1 dim."""
    backend_mode("native")
    g = torch.Generator().manual_seed(3)
    x = _one_token_rows(3, (4, 16), layout, dtype, g).requires_grad_()
    ang = torch.randn(3, 1, 8, generator=g)
    y = lrpe_feature_map(x, ang.cos(), ang.sin(), kernel="1+elu")
    (gx,) = torch.autograd.grad(y.float().square().sum(), x)
    x64 = x.detach().double().requires_grad_()
    ref = lrpe_feature_map_reference(x64, ang.cos().double(), ang.sin().double(), kernel="1+elu")
    (gref,) = torch.autograd.grad(ref.square().sum(), x64)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(y.double(), ref) < tol and rel_err(gx.double(), gref) < tol


@pytest.mark.parametrize("form", ["fp64", "silu", "fp32"])
def test_lrpe_cos_and_sin_of_different_batch(form, backend_mode):
    """cos [B, T, D/2] beside sin [1, T, D/2] passes the checks (each is "[B or 1, ...]"); the fused
    kernel and the reference took it, the PyTorch form failed in torch.stack."""
    dtype = torch.float64 if form == "fp64" else torch.float32
    kernel = "silu" if form == "silu" else "identity"
    x = torch.randn(2, 4, 1, 6, dtype=dtype, requires_grad=True)
    ang = torch.randn(2, 4, 3, dtype=dtype)
    cos, sin = ang.cos().requires_grad_(), ang[:1].sin().requires_grad_()
    backend_mode("torch")
    y = lrpe_feature_map(x, cos, sin, kernel=kernel)
    ref = lrpe_feature_map_reference(x, cos, sin, kernel=kernel)
    assert rel_err(y, ref) < 1e-6
    g = torch.autograd.grad(y.square().sum(), (x, cos, sin))
    gref = torch.autograd.grad(ref.square().sum(), (x, cos, sin))
    assert all(a.shape == b.shape and rel_err(a, b) < 1e-6 for a, b in zip(g, gref, strict=True))


def test_lrpe_bad_shapes():
    x = torch.randn(1, 5, 2, 8)
    c = torch.randn(1, 5, 4)
    with pytest.raises(ValueError, match="D even"):
        lrpe_feature_map(torch.randn(1, 5, 2, 7), c, c)
    with pytest.raises(ValueError, match="cos must be"):
        lrpe_feature_map(x, torch.randn(1, 5, 3), c)
    with pytest.raises(ValueError, match="u must be"):
        lrpe_feature_map(x, c, c, torch.randn(7))
    with pytest.raises(ValueError, match="kernel must be"):
        lrpe_feature_map(x, c, c, kernel="gelu")


# ------------------------------------------------------------------------------------------------
# LM loss rows
# ------------------------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("V", [1, 7, 33, 1000])
def test_xent_rows_match_the_formula(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(37, V, dtype=torch.float64, generator=g) * 4
    labels = torch.randint(0, V, (37,), generator=g)
    valid = torch.rand(37, generator=g) > 0.2
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 4e-3)):
        xin = x.to(dtype)
        # the kernel sees the rounded logits; bf16 then rounds the gradient once more
        lse_in = torch.logsumexp(xin.double(), -1)
        grad_ref = (torch.softmax(xin.double(), -1) - torch.nn.functional.one_hot(labels, V)) * valid[:, None]
        block = xin.clone()
        lse, loss = _native.xent_rows(block, labels, valid, write_grad=True)
        assert rel_err(lse.double(), lse_in) < 1e-6
        assert rel_err(loss.double(), lse_in - xin.double().gather(1, labels[:, None]).squeeze(1)) < 1e-6
        assert rel_err(block.double(), grad_ref) < tol
        assert (block[~valid] == 0).all()
    with pytest.raises(ValueError, match="labels must lie"):
        _native.xent_rows(x.float(), torch.full((37,), V), valid, write_grad=False)


@needs_kernel
@pytest.mark.parametrize("R,C", [(512, 1000), (7, 33), (16, 16), (17, 1), (1, 40)])
def test_transpose_accumulate_is_exact(R, C):
    src = torch.randn(R, C).bfloat16()
    dst = torch.randn(C, R)
    start = dst.clone()
    _native.transpose_acc(src, dst, accumulate=True)
    assert torch.equal(dst, start + src.float().T)
    _native.transpose_acc(src, dst, accumulate=False)
    assert torch.equal(dst, src.float().T)
    with pytest.raises(ValueError, match="transpose_acc needs"):
        _native.transpose_acc(src.float(), dst, accumulate=False)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,C", [(2176, 512), (7, 33), (16, 16), (17, 1), (1, 40), (40, 64)])
def test_cast_transpose_is_the_rounded_transpose(dtype, R, C):
    for src in (torch.randn(R, C), torch.randn(R, C).bfloat16(), torch.randn(3, R, C)):
        got = _native.cast_transpose(src, dtype)
        assert got.is_contiguous() and torch.equal(got, src.transpose(-2, -1).to(dtype))
    with pytest.raises(ValueError, match="contiguous"):
        _native.cast_transpose(torch.randn(4, 6)[:, ::2], dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 17, 64, 1024, 4101])
@pytest.mark.parametrize("e,s", [(64, 32), (40, 24)])
def test_projection_gradient_kernels_write_the_transposed_copy(dtype, N, e, s):
    """silu_mul_bwd / silu_split_bwd with dpre_t: the same d(pre), d(bias) and do as without it, and
    dpre_t exactly d(pre)ᵀ (N = 1024: whole 64-byte blocks, the streamed stores; 4101: ragged)."""
    W = 2 * e + s
    pre = torch.randn(N, W, dtype=dtype)
    bias = torch.randn(W)
    o, dy, dv = (torch.randn(N, e, dtype=dtype) for _ in range(3))
    dz = torch.randn(N, s, dtype=dtype)
    plain, both = torch.empty(N, W, dtype=dtype), torch.empty(N, W, dtype=dtype)
    dpre_t = torch.full((W, N), float("nan"), dtype=dtype)
    ref = _native.silu_mul_bwd(pre[:, :e], bias[:e], o, dy, plain[:, :e], bias_grad=True)
    got = _native.silu_mul_bwd(pre[:, :e], bias[:e], o, dy, both[:, :e], bias_grad=True, dpre_t=dpre_t[:e])
    ref += _native.silu_split_bwd(pre[:, e:], [dv, dz], [e, s], bias[e:], bias_grad=True, dpre=plain[:, e:])
    got += _native.silu_split_bwd(pre[:, e:], [dv, dz], [e, s], bias[e:], bias_grad=True, dpre=both[:, e:],
                                  dpre_t=dpre_t[e:])
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert torch.equal(plain, both) and torch.equal(dpre_t, plain.T)
    with pytest.raises(ValueError, match="dpre_t must be"):
        _native.silu_mul_bwd(pre[:, :e], bias[:e], o, dy, both[:, :e], bias_grad=False, dpre_t=dpre_t[:e].T)
    with pytest.raises(TypeError, match="dpre_t must be"):
        _native.silu_mul_bwd(pre[:, :e], bias[:e], o, dy, both[:, :e], bias_grad=False,
                             dpre_t=dpre_t[:e].to(torch.float64))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,C", [(3, 16), (2, 24), (4, 256), (1, 1), (2, 40)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_relu2_kernels_equal_the_pytorch_form(dtype, n, C, with_bias):
    """FLASH's local branch between its products: r, a = r², aᵀ forward and dS = 2 r dA backward,
    bit for bit as PyTorch's element-wise ops compute them."""
    scores = torch.randn(n, C, C, dtype=dtype)
    scores[0, -1, 0] = float("nan")  # a NaN score stays NaN, as torch.relu keeps it
    bias = torch.randn(C, C) if with_bias else None
    r, a, at = _native.relu2_fwd(scores, bias, causal=True)
    full = scores + bias.to(dtype) if with_bias else scores
    r0 = torch.relu(full).masked_fill_(~torch.ones(C, C, dtype=torch.bool).tril(), 0.0)
    a0 = r0 * r0

    def same(x, y):  # bit-equal, NaN where NaN
        return torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) and torch.equal(x.isnan(), y.isnan())

    assert same(r, r0) and same(a, a0) and same(at, a0.transpose(1, 2)) and at.is_contiguous()
    da = torch.randn(n, C, C, dtype=dtype)
    want = da.clone().mul_(r0).mul_(2.0)
    assert same(_native.relu2_bwd_(da, r0), want)


@needs_kernel
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("V,N,chunk", [(33, 50, 16), (1000, 300, 128), (1000, 7, 1000)])
def test_linear_cross_entropy_fused_equals_torch_form(backend_mode, autocast, V, N, chunk):
    torch.manual_seed(V + N)
    w = (torch.randn(V, 48) * 0.3).requires_grad_()
    h = torch.randn(N, 48).requires_grad_()
    labels = torch.randint(0, V, (N,))
    labels[::5] = -100
    out = {}
    for mode in ("torch", "native"):
        backend_mode(mode)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = linear_cross_entropy(h, w, labels, chunk_size=chunk)
        out[mode] = (loss, *torch.autograd.grad(loss, (h, w)))
    for a, b in zip(out["native"], out["torch"]):
        assert rel_err(a, b) < (2e-3 if autocast else 1e-5)


# ------------------------------------------------------------------------------------------------
# SimpleRMSNorm and the SiLU gate
# ------------------------------------------------------------------------------------------------
def _grads(fn, x, gy, dtype):
    x = x.to(dtype).requires_grad_()
    y = fn(x)
    return y, *torch.autograd.grad(y, x, gy.to(dtype))


@needs_kernel
@pytest.mark.parametrize("D", [1, 5, 16, 512, 515])  # vector tails and a single lane
@pytest.mark.parametrize("inside", [False, True])
def test_simple_rms_norm_fused_matches_reference(backend_mode, D, inside):
    backend_mode("native")
    g = torch.Generator().manual_seed(D)
    x = torch.randn(3, 65, D, dtype=torch.float64, generator=g) * 3
    x[0, 0] = 0.0  # a zero row: output 0, gradient dy / eps (outside) with no NaN
    gy = torch.randn(3, 65, D, dtype=torch.float64, generator=g)
    ref = _grads(lambda t: simple_rms_norm_reference(t, 1e-6, inside), x, gy, torch.float64)
    assert torch.isfinite(ref[1]).all()
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        xin, gin = x.to(dtype).double(), gy.to(dtype).double()
        ref = _grads(lambda t: simple_rms_norm_reference(t, 1e-6, inside), xin, gin, torch.float64)
        got = _grads(lambda t: simple_rms_norm(t, 1e-6, inside), xin, gin, dtype)
        assert got[0].dtype == dtype
        for a, b in zip(got, ref):
            assert rel_err(a.double(), b) < tol


def test_simple_rms_norm_torch_form_is_the_reference(backend_mode):
    backend_mode("torch")
    x = torch.randn(4, 33, dtype=torch.float64)
    assert torch.equal(simple_rms_norm(x, 1e-8), simple_rms_norm_reference(x, 1e-8, False))


@needs_kernel
@pytest.mark.parametrize("D", [6, 16])  # the scalar loop and the vector path
def test_elu_feature_map_and_silu_keep_relative_precision_near_zero_and_far_below(backend_mode, D):
    """elu(v) = e^v - 1 took 1 from e^v: for small |v| the relative error grew as 1/|v| (0 for
    |v| ~ 1e-20, 1.4e-2 at 1e-6; PyTorch's expm1 holds 1e-7). And e^x below e^-87 was clamped to
    e^-87: silu(-88), a normal fp32 value, came out 2.7x too large (scalar loops)."""
    import math

    backend_mode("native")
    v = torch.tensor([-1e-20, -1e-7, -1e-3, -0.3, -0.4, -1.0, -5.0, -30.0], dtype=torch.float64)
    x = v.repeat_interleave(D).view(len(v), 1, 1, D).float().requires_grad_()
    y = lrpe_feature_map(x, torch.ones(1, 1, D // 2), torch.zeros(1, 1, D // 2), None, kernel="elu")
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    want = torch.tensor([math.expm1(t) for t in v.tolist()], dtype=torch.float64)
    assert rel_err(y[:, 0, 0, 0].double() / want, torch.ones_like(want)) < 3e-7
    assert rel_err(dx[:, 0, 0, 0].double() / v.exp(), torch.ones_like(want)) < 3e-7
    a = torch.tensor([-88.0, -80.0, -20.0, 3.0], dtype=torch.float64)
    F_ = D + 1
    ab = torch.ones(len(a), 2 * F_)
    ab[:, :F_] = a[:, None].float()
    h = silu_gate(ab)
    assert rel_err(h[:, 0].double() / (a * torch.sigmoid(a)), torch.ones_like(a)) < 3e-7
    assert rel_err(h[:, -1].double() / (a * torch.sigmoid(a)), torch.ones_like(a)) < 3e-7
    assert silu_gate(torch.tensor([[-1e4, 1.0]])).item() == 0.0


def _srms_fp64(x, eps, inside, gain=1.0):
    """The norm's formula in fp64 with no rescaling: fp32 rows up to 3.4e38 square within range."""
    ms = x.pow(2).mean(-1, keepdim=True)
    return gain * (x * torch.rsqrt(ms + eps) if inside else x / (ms.sqrt() + eps))


@pytest.mark.parametrize("form", ["native", "torch"])
@pytest.mark.parametrize("inside", [False, True])
def test_simple_rms_norm_and_scale_norm_hold_at_every_scale(backend_mode, form, inside):
    """Rows of RMS 1e-30 to 1e37: in fp32 the old forms lost dx from about 1e13 (coefficients
    like s³/D underflow; 10% off at 1e13), returned 0 past about 1.8e19/√D (the sum of squares
    overflows), and with a tiny ε lost rows below about 1e-19 (it underflows)."""
    from transnormer.ops.rowwise import scale_norm

    if form == "native" and _native.load() is None:
        pytest.skip("fused CPU kernels unavailable")
    backend_mode(form)
    g = torch.Generator().manual_seed(7)
    mags = torch.tensor([1e-30, 1e-10, 1.0, 1e12, 1e13, 1e15, 1e18, 1e20, 1e30, 1e37], dtype=torch.float64)
    x = torch.randn(len(mags), 64, dtype=torch.float64, generator=g) * mags[:, None]
    gy = torch.randn(len(mags), 64, dtype=torch.float64, generator=g)
    for dtype, tol in [(torch.float32, 1e-6)] + ([(torch.bfloat16, 1e-2)] if form == "native" else []):
        xin = x.to(dtype).double()  # the inputs as the low precision holds them
        gin = gy.to(dtype).double()
        # ε 1e-30: the scale of rows down to 1e-30 rests on their own sum of squares, which
        # underflowed in fp32 below ~1e-19; ScaleNorm: ε inside
        cases = [(1e-8, inside, None), (1e-30, inside, None)] + ([(1e-5, True, 0.7)] if inside else [])
        for eps, ins, gain in cases:
            xt, xr = xin.to(dtype).requires_grad_(), xin.clone().requires_grad_()
            if gain is None:
                y = simple_rms_norm(xt, eps, ins)
                (dx,) = torch.autograd.grad(y, xt, gin.to(dtype))
            else:
                gt = torch.tensor(gain, requires_grad=True)
                y = scale_norm(xt, gt, eps)
                dx, dgain = torch.autograd.grad(y, (xt, gt), gin.to(dtype))
            y_ref = _srms_fp64(xr, eps, ins, 1.0 if gain is None else gain)
            (dx_ref,) = torch.autograd.grad(y_ref, xr, gin)
            for r in range(len(mags)):  # row by row: one bad row must not hide behind the others
                assert rel_err(y[r].double(), y_ref[r]) < tol, (gain, dtype, mags[r].item())
                assert rel_err(dx[r].double(), dx_ref[r]) < tol, (gain, dtype, mags[r].item())
            if gain is not None:  # d gain = Σ dy·y/g
                assert rel_err(dgain.double(), (gin * y_ref).sum() / gain) < tol


@needs_kernel
@pytest.mark.parametrize("F_", [1, 7, 16, 1365])
def test_silu_gate_fused_matches_reference(backend_mode, F_):
    backend_mode("native")
    g = torch.Generator().manual_seed(F_)
    ab = torch.randn(2, 63, 2 * F_, dtype=torch.float64, generator=g) * 4  # both sigmoid branches, large |a|
    gh = torch.randn(2, 63, F_, dtype=torch.float64, generator=g)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        abin, ghin = ab.to(dtype).double(), gh.to(dtype).double()
        ref = _grads(silu_gate_reference, abin, ghin, torch.float64)
        got = _grads(silu_gate, abin, ghin, dtype)
        for a, b in zip(got, ref):
            assert rel_err(a.double(), b) < tol


def test_silu_gate_needs_an_even_width():
    with pytest.raises(ValueError, match="even last dim"):
        silu_gate(torch.randn(2, 5))


@needs_kernel
def test_glu_merged_projection_equals_two_linears(backend_mode):
    from transnormer.modules.ffn import GLU

    torch.manual_seed(0)
    glu = GLU(24, 40)
    x = torch.randn(3, 11, 24, requires_grad=True)
    out = {}
    for mode in ("torch", "native"):
        backend_mode(mode)
        y = glu(x)
        out[mode] = (y, *torch.autograd.grad(y.square().sum(), (x, glu.l1.weight, glu.l2.bias)))
    y_plain = glu.l3(torch.nn.functional.silu(glu.l1(x)) * glu.l2(x))
    assert rel_err(out["torch"][0], y_plain) < 1e-6
    for a, b in zip(out["native"], out["torch"]):
        assert rel_err(a, b) < 1e-5


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,F_", [(1, 16), (17, 40), (64, 24), (1024, 48), (4101, 8)])
def test_silu_gate_kernel_with_bias_and_transposed_copy(dtype, N, F_):
    """The gate with its two biases (fp32, added before the activation) against the formula, and
    the transposed copy of d(ab) exactly d(ab)ᵀ (N = 1024: whole streamed lines; 4101: ragged)."""
    g = torch.Generator().manual_seed(N + F_)
    ab = (torch.randn(N, 2 * F_, generator=g) * 3).to(dtype)
    bias = torch.randn(2 * F_, generator=g)
    dh = torch.randn(N, F_, generator=g).to(dtype)
    h = _native.silu_gate_fwd(ab, bias)
    x = (ab.double() + bias.double()).requires_grad_()
    ref = torch.nn.functional.silu(x[:, :F_]) * x[:, F_:]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(h.double(), ref) < tol
    (want,) = torch.autograd.grad(ref, x, dh.double())
    dab_t = torch.full((2 * F_, N), float("nan"), dtype=dtype)
    dab, db = _native.silu_gate_bwd(ab, dh, bias, bias_grad=True, dab_t=dab_t)
    assert rel_err(dab.double(), want) < tol and rel_err(db.double(), want.sum(0)) < tol
    assert torch.equal(dab_t, dab.T)
    plain, none = _native.silu_gate_bwd(ab, dh, bias)
    assert torch.equal(plain, dab) and none is None


@needs_kernel
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-input"])
def test_glu_projected_gate_matches_the_composed_form(monkeypatch, backend_mode, mode):
    """GLU's input side through _ProjectedSiluGate (one product on [W1 | W2]ᵀ, biases in the gate,
    d(ab)ᵀ for the weights' gradient) against F.linear on the concatenated weights and the gate:
    output and the gradients of x and of every parameter."""
    import transnormer.ops.rowwise as rowwise
    from transnormer.modules.ffn import GLU

    backend_mode("native")  # the fused form wherever it applies, whatever "auto" would choose
    torch.manual_seed(0)
    glu = GLU(48, 72)
    x = torch.randn(2, 37, 48)
    gy = torch.randn(2, 37, 48)
    results = []
    for fused in (True, False):
        calls = []
        original = rowwise._ProjectedSiluGate.apply
        monkeypatch.setattr(rowwise._ProjectedSiluGate, "apply", lambda *a, _c=calls, _f=original: _c.append(1) or _f(*a))
        if not fused:
            monkeypatch.setattr(rowwise, "fused_projection_ok", lambda *a: False)
        xi = (x.bfloat16() if mode == "bf16-input" else x.clone()).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32"):
            y = glu(xi)
        grads = torch.autograd.grad(y, [xi, *glu.parameters()], gy.to(y.dtype))
        assert len(calls) == int(fused) and xi.grad is None and grads[0].dtype == xi.dtype
        results.append((y, *grads))
    tol = 1e-5 if mode == "fp32" else 2e-2
    for a, b in zip(*results):
        assert rel_err(a.double(), b.double()) < tol


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_glu_projected_gate_bad_shapes(backend_mode, mode):
    """Mismatched weights or biases raise on both paths (the kernel would read past a short bias)."""
    from transnormer.ops.rowwise import projected_silu_gate

    backend_mode(mode)
    x, w, b = torch.randn(2, 3, 8), torch.randn(4, 8), torch.randn(4)
    with pytest.raises(ValueError, match="b2 must be"):
        projected_silu_gate(x, w, w, b, torch.randn(1))
    with pytest.raises(ValueError, match="b1 must be"):
        projected_silu_gate(x, w, w, torch.randn(3), torch.randn(5))
    with pytest.raises(ValueError, match="w1 and w2"):
        projected_silu_gate(x, w, torch.randn(6, 8), b, b)
    with pytest.raises(ValueError, match="w1 and w2"):
        projected_silu_gate(x, torch.randn(4, 7), torch.randn(4, 7), b, b)
    with pytest.raises(ValueError, match="both be given"):
        projected_silu_gate(x, w, w, b, None)
    assert projected_silu_gate(x, w, w, None, None).shape == (2, 3, 4)


# ------------------------------------------------------------------------------------------------
# GAU / FLASH query-key heads: RoPE(z * gamma_h + beta_h)
# ------------------------------------------------------------------------------------------------
def _heads_grads(fn, z, gamma, beta, cos, sin, gy, dtype):
    z = z.to(dtype).requires_grad_()
    gamma, beta = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    y = fn(z, gamma, beta, cos, sin)
    return (y, *torch.autograd.grad(y, (z, gamma, beta), gy.to(y.dtype)))


@needs_kernel
@pytest.mark.parametrize("T", [1, 63, 65])
@pytest.mark.parametrize("s,P", [(128, 64), (64, 16), (7, 3), (8, 0)])  # full, partial, odd width, no rotation
def test_scale_offset_rope_fused_matches_reference(backend_mode, T, s, P):
    backend_mode("native")
    g = torch.Generator().manual_seed(T + s + P)
    B, n = 2, 4
    proj = torch.randn(B, T, 3 * s, dtype=torch.float64, generator=g)  # z is a strided slice, as in the layer
    gamma, beta = (torch.randn(n, s, dtype=torch.float64, generator=g) for _ in range(2))
    ang = torch.randn(1, T, P, dtype=torch.float64, generator=g) * 3
    cos, sin = ang.cos(), ang.sin()
    gy = torch.randn(B, T, n, s, dtype=torch.float64, generator=g)
    z = proj[..., s:2 * s]
    ref = _heads_grads(scale_offset_rope_reference, z, gamma, beta, cos, sin, gy, torch.float64)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
        zin = z.to(dtype).double()  # the reference sees the rounded z
        ref = _heads_grads(scale_offset_rope_reference, zin, gamma, beta, cos, sin, gy, torch.float64)
        got = _heads_grads(scale_offset_rope, z.to(dtype), gamma.float(), beta.float(), cos.float(), sin.float(), gy,
                           dtype)
        assert got[0].dtype == torch.float32 and got[1].dtype == dtype
        for a, b in zip(got, ref):
            assert rel_err(a.double(), b) < tol


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["fused", "transposed"])
def test_scale_offset_rope_one_token_of_several_sequences(backend_mode, layout, dtype):
    """T = 1, B > 1 (FLASH decoding a batch): z's rows are read at the batch stride."""
    backend_mode("native")
    g = torch.Generator().manual_seed(4)
    B, n, s, P = 3, 4, 32, 8
    z = _one_token_rows(B, (s,), layout, dtype, g)
    gamma, beta = torch.randn(n, s, generator=g), torch.randn(n, s, generator=g)
    ang = torch.randn(B, 1, P, generator=g)
    gy = torch.randn(B, 1, n, s, generator=g)
    got = _heads_grads(scale_offset_rope, z, gamma, beta, ang.cos(), ang.sin(), gy, dtype)
    ref = _heads_grads(scale_offset_rope_reference, z.double(), gamma.double(), beta.double(), ang.cos().double(),
                       ang.sin().double(), gy, torch.float64)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in zip(got, ref):
        assert rel_err(a.double(), b) < tol


@needs_kernel
@pytest.mark.parametrize("zdtype", [torch.float32, torch.bfloat16])
def test_scale_offset_rope_bf16_heads_are_the_fp32_heads_rounded_once(backend_mode, zdtype):
    """out_dtype=bf16 (FLASH under autocast): the fp32 heads rounded, bit for bit, both on the
    kernel and on the PyTorch form; backward from bf16 head gradients equals it from the same
    gradients in fp32."""
    g = torch.Generator().manual_seed(5)
    B, T, n, s, P = 2, 19, 4, 24, 8
    z = torch.randn(B, T, s, generator=g).to(zdtype)
    gamma, beta = torch.randn(n, s, generator=g), torch.randn(n, s, generator=g)
    cos, sin = torch.randn(1, T, P, generator=g), torch.randn(1, T, P, generator=g)
    gy = torch.randn(B, T, n, s, generator=g).bfloat16()
    for mode in ("native", "torch"):
        backend_mode(mode)
        outs = []
        for out_dtype in (torch.bfloat16, None):
            zz, gm, bt = (t.clone().requires_grad_() for t in (z, gamma, beta))
            h = scale_offset_rope(zz, gm, bt, cos, sin, out_dtype=out_dtype)
            outs.append((h, *torch.autograd.grad(h, (zz, gm, bt), gy.to(h.dtype))))
        (h16, *g16), (h32, *g32) = outs
        assert h16.dtype == torch.bfloat16 and torch.equal(h16, h32.to(torch.bfloat16))
        for a, b in zip(g16, g32):
            assert torch.equal(a, b)


@needs_kernel
def test_fused_heads_are_stored_head_major(backend_mode):
    """Each head of the fused output is one contiguous [T, s] block per row (FLASH's chunked
    products read it in place), with the [B, T, n, s] shape and values of the PyTorch form."""
    backend_mode("native")
    z, gamma, beta = torch.randn(1, 9, 16), torch.randn(4, 16), torch.randn(4, 16)
    cos, sin = torch.randn(1, 9, 4), torch.randn(1, 9, 4)
    h = scale_offset_rope(z, gamma, beta, cos, sin)
    assert h.shape == (1, 9, 4, 16) and all(h[:, :, i].is_contiguous() for i in range(4))
    assert rel_err(h, scale_offset_rope_reference(z, gamma, beta, cos, sin)) < 1e-6


def test_scale_offset_rope_torch_form_in_fp64_is_the_reference():
    z = torch.randn(2, 5, 16, dtype=torch.float64)
    gamma, beta = torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    cos, sin = torch.randn(1, 5, 6, dtype=torch.float64), torch.randn(1, 5, 6, dtype=torch.float64)
    assert torch.equal(scale_offset_rope(z, gamma, beta, cos, sin), scale_offset_rope_reference(z, gamma, beta, cos, sin))
    with pytest.raises(ValueError, match="gamma and beta"):
        scale_offset_rope(z, gamma[:, :8], beta, cos, sin)
    with pytest.raises(ValueError, match="cos must be"):
        scale_offset_rope(z, gamma, beta, torch.randn(1, 5, 9), sin)


@needs_kernel
def test_gau_heads_fused_equal_the_rotate_half_form(backend_mode):
    """The FLASH layer's heads through the fused op == the LRPE rotate() path it replaced."""
    from transnormer.layers.gau import FLASH
    from transnormer.modules.positional import rotate

    torch.manual_seed(0)
    layer = FLASH(32, causal=True, chunk_size=8, qk_dim=16, rope="partial:8")
    x = torch.randn(2, 13, 32)
    pos = torch.arange(13).expand(2, 13)
    backend_mode("native")
    _, _, heads = layer.project(x, pos)
    z = torch.nn.functional.silu(layer.proj(x))[..., -16:]
    angles = pos[..., None].float() * layer.rope.theta
    old = rotate(z[:, :, None, :] * layer.gamma + layer.beta, angles, "half")
    assert rel_err(heads, old) < 1e-6


@needs_kernel
@pytest.mark.parametrize("widths", [[16, 16, 8], [7, 1, 33], [40]])
def test_silu_split_fused_matches_reference(backend_mode, widths):
    backend_mode("native")
    g = torch.Generator().manual_seed(sum(widths))
    pre = torch.randn(2, 37, sum(widths), dtype=torch.float64, generator=g) * 4
    grads = [torch.randn(2, 37, w, dtype=torch.float64, generator=g) for w in widths]
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        p_ref = pre.to(dtype).double().requires_grad_()
        ref = torch.nn.functional.silu(p_ref).split(widths, -1)
        (d_ref,) = torch.autograd.grad(ref, p_ref, grads)
        p = pre.to(dtype).requires_grad_()
        outs = silu_split(p, widths)
        assert all(o.is_contiguous() and o.dtype == dtype for o in outs)
        (d,) = torch.autograd.grad(outs, p, [x.to(dtype) for x in grads])
        for a, b in zip((*outs, d), (*ref, d_ref)):
            assert rel_err(a.double(), b) < tol


@needs_kernel
@pytest.mark.parametrize("widths", [[16, 16, 8], [7, 1, 33]])
def test_silu_split_with_bias_matches_reference(backend_mode, widths):
    """The projection's bias added inside the fused SiLU (fp32, one rounding): outputs, d(pre) and
    d(bias), the latter summed in fixed row parts (37 rows over 8 parts: uneven ones)."""
    backend_mode("native")
    W = sum(widths)
    g = torch.Generator().manual_seed(W)
    pre = torch.randn(1, 37, W, dtype=torch.float64, generator=g) * 4
    bias = torch.randn(W, generator=g)
    grads = [torch.randn(1, 37, w, dtype=torch.float64, generator=g) for w in widths]
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        p_ref, b_ref = pre.to(dtype).double().requires_grad_(), bias.double().requires_grad_()
        ref = torch.nn.functional.silu(p_ref + b_ref).split(widths, -1)
        d_ref = torch.autograd.grad(ref, (p_ref, b_ref), grads)
        p, b = pre.to(dtype).requires_grad_(), bias.clone().requires_grad_()
        outs = silu_split(p, widths, b)
        assert all(o.is_contiguous() and o.dtype == dtype for o in outs)
        d = torch.autograd.grad(outs, (p, b), [x.to(dtype) for x in grads])
        assert d[1].dtype == torch.float32
        for a, r in zip((*outs, *d), (*ref, *d_ref)):
            assert rel_err(a.double(), r) < tol
    backend_mode("torch")  # the PyTorch form computes the same thing
    p, b = pre.float(), bias
    for a, r in zip(silu_split(p, widths, b), torch.nn.functional.silu(p + b).split(widths, -1)):
        assert torch.equal(a, r)
    with pytest.raises(ValueError, match="bias must have shape"):
        silu_split(p, widths, b[:-1])


@needs_kernel
def test_silu_split_unused_group_gets_no_gradient(backend_mode):
    backend_mode("native")
    pre = torch.randn(3, 10, requires_grad=True)
    u, v = silu_split(pre, [6, 4])
    (d,) = torch.autograd.grad(u.sum(), pre)
    assert (d[:, 6:] == 0).all()
    ref = torch.autograd.grad(torch.nn.functional.silu(pre)[:, :6].sum(), pre)[0]
    assert rel_err(d, ref) < 1e-6
    with pytest.raises(ValueError, match="widths must be positive"):
        silu_split(pre, [6, 5])


# ------------------------------------------------------------------------------------------------
# Whole models: the fused kernels change no result beyond rounding
# ------------------------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("preset", ["t2-lm-tiny", "t1-lm-tiny", "flash-lm-tiny", "flash-quad-lm-tiny", "vanilla-lm-tiny",
                                    "t2-roberta-tiny"])
def test_models_agree_with_and_without_the_fused_kernels(backend_mode, preset):
    from transnormer.presets import build_model

    torch.manual_seed(0)
    model = build_model(preset, task="mlm" if "roberta" in preset else "clm", vocab_size=300, dropout=0.0).eval()
    ids = torch.randint(0, 300, (2, 37))
    out = {}
    for mode in ("torch", "auto"):  # auto: every kernel where it applies (bf16 causal op: CPUs with AMX or AVX512-BF16)
        backend_mode(mode)
        out[mode, False] = model_loss_and_grads(model, ids, amp=False)
        out[mode, True] = model_loss_and_grads(model, ids, amp=True)
    for a, b in zip(out["auto", False], out["torch", False]):  # fp32: rounding only
        assert rel_err(a, b) < 1e-5
    ref = out["torch", False][1]
    errs = [float((out[mode, True][1] - ref).norm() / ref.norm()) for mode in ("torch", "auto")]
    assert max(errs) < 0.15  # bf16 autocast: both forms about as far from fp32 (T1 is the least precise)
    assert errs[1] < 1.5 * errs[0] + 1e-3


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [5, 40, 515])  # vector tails
def test_scale_norm_through_the_fused_norm_equals_its_formula(backend_mode, dtype, D):
    """The gain inside the kernel: y, dx and the gain's gradient (summed from the rows' dots)."""
    from transnormer.modules.norms import ScaleNorm

    backend_mode("native")
    norm = ScaleNorm(D, eps=1e-5)
    with torch.no_grad():
        norm.scale.fill_(1.7)
    x = (torch.randn(3, 9, D) * 2).to(dtype).requires_grad_()
    w = torch.randn(3, 9, D, dtype=torch.float64)  # a random projection: Σ y² is constant per row
    y = norm(x)
    gx, gs = torch.autograd.grad((y.double() * w).sum(), (x, norm.scale))
    xr = x.detach().double().requires_grad_()
    sr = norm.scale.detach().double().requires_grad_()
    ref = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * sr
    gxr, gsr = torch.autograd.grad((ref * w).sum(), (xr, sr))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert y.dtype == dtype
    for a, b in ((y, ref), (gx, gxr)):
        assert rel_err(a.double(), b) < tol
    # the gain's gradient is a sum of T·D terms of both signs: its error scales with Σ|term|
    assert abs(float(gs) - float(gsr)) < tol * float((ref.detach() / sr.detach() * w).abs().sum())


@pytest.mark.parametrize("mode", ["native", "torch"])
def test_scale_norm_feeding_autocast_rounds_its_fp32_result_once(backend_mode, mode):
    """A pre-norm ScaleNorm under bf16 autocast returns bf16: its fp32 output rounded, bit for bit;
    the gradients from a bf16 dy equal those of the fp32 output from the same dy."""
    from transnormer.modules.norms import ScaleNorm

    if mode == "native" and _native.load() is None:
        pytest.skip("fused CPU kernels unavailable")
    backend_mode(mode)
    torch.manual_seed(0)
    x = (torch.randn(2, 7, 40) * 3).requires_grad_()
    gy = torch.randn(2, 7, 40).bfloat16()
    norm = ScaleNorm(40, feeds_autocast=True)
    with torch.no_grad():
        norm.scale.fill_(1.3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = norm(x)
    y32 = norm(x)  # outside autocast: fp32
    assert y16.dtype == torch.bfloat16 and y32.dtype == torch.float32
    assert torch.equal(y16, y32.to(torch.bfloat16))
    g16 = torch.autograd.grad(y16, (x, norm.scale), gy)
    g32 = torch.autograd.grad(y32, (x, norm.scale), gy.float())
    for a, b in zip(g16, g32):
        assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("n", [1, 17, 4096 * 3 + 5])  # a lane, a vector tail, several thread blocks
def test_residual_add_of_a_bf16_branch_equals_the_promoting_add(backend_mode, n):
    from transnormer.ops.rowwise import residual_add

    backend_mode("native")
    x = torch.randn(n, requires_grad=True)
    h = torch.randn(n).bfloat16().requires_grad_()
    out = residual_add(x, h)
    assert out.grad_fn is not None and "ResidualAdd" in type(out.grad_fn).__name__
    ref = x + h
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    g = torch.randn(n)
    for a, b in zip(torch.autograd.grad(out, (x, h), g), torch.autograd.grad(ref, (x, h), g)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_scale_norm_torch_form_is_the_reference_and_a_frozen_gain_gets_no_gradient(backend_mode):
    from transnormer.ops.rowwise import scale_norm, scale_norm_reference

    x = torch.randn(4, 33, requires_grad=True)
    gain = torch.tensor(0.8)
    backend_mode("torch")
    assert torch.equal(scale_norm(x, gain, 1e-5), scale_norm_reference(x, gain, 1e-5))
    if _native.load() is not None:
        backend_mode("native")
        y = scale_norm(x, gain, 1e-5)
        (gx,) = torch.autograd.grad(y.sum(), x)  # gain.requires_grad is False: only dx is formed
        assert rel_err(y, scale_norm_reference(x, gain, 1e-5)) < 1e-6 and torch.isfinite(gx).all()


# ------------------------------------------------------------------------------------------------
# Inputs the kernels must not take, and values they must carry
# ------------------------------------------------------------------------------------------------
@needs_kernel
def test_fused_paths_leave_other_devices_to_the_pytorch_form(backend_mode):
    """A table or parameter on another device must not reach the C++ code (it would read a
    foreign pointer): the PyTorch form runs and raises its own error."""
    backend_mode("native")
    z = torch.randn(1, 4, 8)
    gamma = torch.randn(2, 8, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        scale_offset_rope(z, gamma, gamma, torch.randn(1, 4, 4), torch.randn(1, 4, 4)).sum().item()
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises((RuntimeError, NotImplementedError)):
        lrpe_feature_map(x, torch.randn(1, 4, 4, device="meta"), torch.randn(1, 4, 4, device="meta")).sum().item()


@needs_kernel
def test_lrpe_with_a_trainable_householder_vector_uses_the_pytorch_form(backend_mode):
    backend_mode("native")
    x = torch.randn(1, 5, 2, 8)
    c = torch.randn(1, 5, 4)
    u = torch.nn.functional.normalize(torch.randn(8), dim=0).requires_grad_()
    (gu,) = torch.autograd.grad(lrpe_feature_map(x, c.cos(), c.sin(), u).sum(), u)
    assert gu.abs().sum() > 0


@needs_kernel
def test_bf16_stores_keep_nan_and_inf(backend_mode):
    backend_mode("native")
    for n in (16, 5):  # a full vector and a tail
        ab = torch.randn(1, 2 * n).bfloat16()
        ab[0, 0] = float("nan")
        ab[0, n + 1] = float("inf")
        h = silu_gate(ab)
        assert h[0, 0].isnan() and h[0, 1].isinf() and h[0, 2:].isfinite().all()


def test_row_kernels_refuse_other_dtypes():
    if _native.load() is None:
        pytest.skip("fused CPU kernels unavailable")
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        _native.srms_fwd(torch.randn(2, 4, dtype=torch.float64), 1e-6, False)


def test_flash_attn_checks_its_branches_and_keeps_the_value_dtype():
    from transnormer.ops.flash import flash_attn

    q = torch.randn(1, 20, 8)
    with pytest.raises(ValueError, match="at least one of local_branch, global_branch"):
        flash_attn(q, q, q, q, q, causal=True, chunk_size=8, local_branch=False, global_branch=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flash_attn(q, q, q, q, q, causal=True, chunk_size=8).dtype == torch.float32


def test_projected_silu_gate_takes_fp32_biases_with_bf16_weights_on_every_backend():
    # the fused path took them; the PyTorch form's F.linear refused mixed dtypes
    from transnormer.ops import _native, set_kernel_backend
    from transnormer.ops.rowwise import projected_silu_gate

    x = torch.randn(2, 7, 5).bfloat16()
    w1, w2 = torch.randn(3, 5).bfloat16(), torch.randn(3, 5).bfloat16()
    b1, b2 = torch.randn(3), torch.randn(3)
    before = _native.backend()
    try:
        outs = []
        for mode in ("auto", "torch"):
            set_kernel_backend(mode)
            outs.append(projected_silu_gate(x, w1, w2, b1, b2))
    finally:
        set_kernel_backend(before)
    a, b = outs[0].float(), outs[1].float()
    assert outs[1].dtype == torch.bfloat16 and (a - b).abs().max() < 2e-2 * b.abs().max()  # bf16 roundings


def test_block_attn_with_zero_width_heads():
    from transnormer.ops import block_attn, block_attn_reference

    q = torch.zeros(1, 5, 2, 0)
    v = torch.randn(1, 5, 2, 3)
    o = block_attn(q, q, v, block_size=4, causal=True)  # was ZeroDivisionError (scale = D^-1/2)
    assert torch.allclose(o, block_attn_reference(q, q, v, block_size=4, causal=True))


@needs_kernel
def test_auto_skips_the_fused_flash_mixer_on_builds_where_it_ran_slower(monkeypatch, backend_mode):
    """"auto" runs FLASH's composed mixer where it is faster: bf16 on a build without AVX-512, fp32
    on one without AVX2 either (the fused mixer's transposed copies are vector code on AVX2 for
    fp32 only); "native" still runs the fused one; the other row kernels (the SiLU gates, LRPE) are
    fused on every build."""
    from transnormer.ops.flash import flash_mixer_usable
    from transnormer.ops.lrpe import lrpe_feature_map

    cpu = torch.device("cpu")
    x, w, b = torch.randn(1, 4, 8), torch.randn(40, 8), torch.zeros(40)
    for avx512, avx2 in ((False, False), (False, True), (True, True)):
        monkeypatch.setattr(_native, "_build_flags", {"tn_rows_avx512": avx512, "tn_rows_avx2": avx2})
        backend_mode("auto")
        assert _native.rows_usable(torch.float32, cpu, "flash_mixer") is avx2
        assert _native.rows_usable(torch.bfloat16, cpu, "flash_mixer") is avx512
        assert flash_mixer_usable(x, w, b) is avx2
        assert flash_mixer_usable(x.bfloat16(), w.bfloat16(), b) is avx512
        assert _native.rows_usable(torch.float32, cpu) and _native.rows_usable(torch.bfloat16, cpu)
        calls = []
        real = _native._call
        monkeypatch.setattr(_native, "_call", lambda name, *a, _c=calls, _r=real: _c.append(name) or _r(name, *a))
        silu_gate(torch.randn(3, 8))
        silu_split(torch.randn(3, 10), [6, 4])
        T, D = 5, 8
        for dtype in (torch.float32, torch.bfloat16):
            lrpe_feature_map(torch.randn(1, T, 2, D, dtype=dtype), torch.ones(1, T, D // 2),
                             torch.zeros(1, T, D // 2), None, kernel="1+elu")
        assert any("silu_gate" in c for c in calls) and any("silu_split" in c for c in calls)
        assert sum("lrpe" in c for c in calls) == 2, calls
        backend_mode("native")
        assert _native.rows_usable(torch.float32, cpu, "flash_mixer") and flash_mixer_usable(x, w, b)
        monkeypatch.setattr(_native, "_call", real)
