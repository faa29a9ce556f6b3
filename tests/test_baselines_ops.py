"""Baseline ops against their dense quadratic formulas (fp64 ≤ 1e-9, forward and gradients)."""

import pytest
import torch

from conftest import rel_err
from transnormer.ops.flash import flash_attn, gau_attn
from transnormer.ops.linear_baselines import (
    cosformer_attn,
    default_num_features,
    draw_favor_projection,
    elu_features,
    favor_features,
    kernel_linear_attn,
    kernel_linear_attn_step,
)
from transnormer.ops.reference_baselines import (
    cosformer_weights_reference,
    favor_weights_reference,
    flash_attn_reference,
    gau_attn_reference,
    kernel_linear_attn_reference,
    ratio_attn_reference,
    softmax_attn_reference,
)
from transnormer.ops.softmax import softmax_attn

TOL = 1e-9


def rand(*shape, requires_grad=True):
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)


def padding(B, T, *, left=False):
    """Row 0 full; row 1 right-padded (or left-padded) by a third."""
    mask = torch.ones(B, T, dtype=torch.bool)
    cut = max(1, T // 3)
    if T > 1:
        if left:
            mask[1, :cut] = False
        else:
            mask[1, T - cut:] = False
    return mask


def assert_parity(out, ref, inputs, tol=TOL, valid=None):
    """Forward and input-gradient parity of out vs ref (valid: [B, T] rows to compare)."""
    if valid is not None:
        sel = valid[..., None] if out.dim() == 3 else valid[..., None, None]
        out, ref = out * sel, ref * sel
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol
    g = torch.randn_like(out)
    ga = torch.autograd.grad((out * g).sum(), inputs, retain_graph=True)
    gb = torch.autograd.grad((ref * g).sum(), inputs, retain_graph=True)
    for a, b in zip(ga, gb):
        # relative to max(1, |b|): with T = 1 the ratio's gradient is a ~1e-10 cancellation
        assert float((a - b).abs().max()) < tol * max(1.0, float(b.abs().max()))


# ------------------------------------------------------------------------------------------------
# linear attention with denominator (1 + elu)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 31, 32, 33, 97])
@pytest.mark.parametrize("denominator", [True, False])
def test_kernel_linear_attn_matches_dense(causal, T, denominator):
    q, k, v = rand(2, T, 2, 8), rand(2, T, 2, 8), rand(2, T, 2, 5)
    mask = padding(2, T, left=causal)  # left padding: causal rows with no visible key → 0, not NaN
    qf, kf = elu_features(q), elu_features(k)
    o, _ = kernel_linear_attn(qf, kf, v, causal=causal, denominator=denominator, chunk_size=16, key_padding_mask=mask)
    ref = kernel_linear_attn_reference(qf, kf, v, causal=causal, denominator=denominator, key_padding_mask=mask)
    assert_parity(o, ref, (q, k, v))


def test_kernel_linear_attn_state_chaining_and_step():
    qf, kf = elu_features(rand(2, 40, 2, 6, requires_grad=False)), elu_features(rand(2, 40, 2, 6, requires_grad=False))
    v = rand(2, 40, 2, 4, requires_grad=False)
    whole, s_whole = kernel_linear_attn(qf, kf, v, causal=True, chunk_size=8, output_final_state=True)
    a, sa = kernel_linear_attn(qf[:, :13], kf[:, :13], v[:, :13], causal=True, chunk_size=8, output_final_state=True)
    outs, state = [a], sa
    for t in range(13, 40):
        o, state = kernel_linear_attn_step(qf[:, t], kf[:, t], v[:, t], state)
        outs.append(o[:, None])
    assert s_whole.shape == (2, 2, 6, 5)  # Σ kᵀv beside Σ k
    assert rel_err(torch.cat(outs, 1), whole) < 1e-12 and rel_err(state, s_whole) < 1e-12


@pytest.mark.parametrize("causal", [True, False])
def test_kernel_linear_attn_fp16_sums_past_fp16_range(causal):
    """The numerator and denominator grow with the keys: in fp16 both passed 65504 near 1k tokens
    and the ratio (a weighted mean of the values, here exactly 1) read inf / inf = NaN."""
    x = torch.ones(1, 1100, 1, 64, dtype=torch.float16, requires_grad=True)
    o, state = kernel_linear_attn(x, x, x, causal=causal, output_final_state=causal)
    assert o.dtype == torch.float16 and bool((o == 1).all())
    o.sum().backward()
    assert torch.isfinite(x.grad).all()
    if causal:
        step, _ = kernel_linear_attn_step(x[:, 0].detach(), x[:, 0].detach(), x[:, 0].detach(), state)
        assert step.dtype == torch.float16 and bool((step == 1).all())


# ------------------------------------------------------------------------------------------------
# Performer (FAVOR+)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [32, 45])
def test_performer_matches_dense_kernel(causal, T):
    proj = draw_favor_projection(24, 8, seed=3).double()
    q, k, v = rand(2, T, 2, 8), rand(2, T, 2, 8), rand(2, T, 2, 5)
    mask = padding(2, T)
    # eps ≈ 0 (it must be > 0): the query stabiliser then cancels to fp64 rounding and the dense,
    # unstabilised kernel is the oracle
    o, _ = kernel_linear_attn(favor_features(q, proj, is_query=True), favor_features(k, proj, is_query=False), v,
                              causal=causal, eps=1e-300, chunk_size=16, key_padding_mask=mask)
    ref = ratio_attn_reference(favor_weights_reference(q, k, proj), v, causal=causal, key_padding_mask=mask, eps=0.0)
    assert_parity(o, ref, (q, k, v))


def test_performer_no_causal_leak_under_large_perturbation():
    """The reference Performer leaks through a sequence-wide key max (peers.md §3.4): ours must not."""
    proj = draw_favor_projection(32, 8, seed=0).double()
    q, k, v = (rand(1, 100, 2, 8, requires_grad=False) for _ in range(3))

    def run(k):
        return kernel_linear_attn(favor_features(q, proj, is_query=True), favor_features(k, proj, is_query=False), v,
                                  causal=True, chunk_size=16)[0]

    base = run(k)
    k2 = k.clone()
    k2[:, 80] *= 20.0
    assert (run(k2)[:, :80] - base[:, :80]).abs().max() == 0.0


def test_favor_estimates_softmax_kernel():
    d = 8
    q, k = torch.randn(1, 1, 1, d, dtype=torch.float64) * 0.5, torch.randn(1, 1, 1, d, dtype=torch.float64) * 0.5
    proj = draw_favor_projection(4096, d, seed=1).double()
    qs = q * d ** -0.25
    # undo the query stabiliser to compare absolute values
    c = (torch.einsum("bthd,md->bthm", qs, proj) - 0.5 * qs.pow(2).sum(-1, keepdim=True)).amax(-1)
    est = (favor_features(q, proj, is_query=True) * favor_features(k, proj, is_query=False)).sum() * torch.exp(c).sum()
    exact = torch.exp((q * k).sum() / d ** 0.5)
    assert abs(float(est / exact) - 1) < 0.05
    assert default_num_features(64) == 266


def test_orthogonal_projection_rows():
    w = draw_favor_projection(20, 8, seed=0)
    blk = w[:8] / w[:8].norm(dim=1, keepdim=True)
    assert torch.allclose(blk @ blk.T, torch.eye(8), atol=1e-5)
    assert torch.equal(w, draw_favor_projection(20, 8, seed=0))
    assert not torch.equal(w, draw_favor_projection(20, 8, seed=1))


# ------------------------------------------------------------------------------------------------
# cosFormer
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [31, 32, 50])
@pytest.mark.parametrize("fixed_m", [True, False])
def test_cosformer_matches_dense(causal, T, fixed_m):
    q, k, v = rand(2, T, 2, 8), rand(2, T, 2, 8), rand(2, T, 2, 5)
    mask = padding(2, T, left=True)
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)  # real positions: padding does not shift them
    M = 64 if fixed_m else mask.sum(-1)
    o = cosformer_attn(q, k, v, positions, M, causal=causal, chunk_size=16, key_padding_mask=mask)
    ref = ratio_attn_reference(cosformer_weights_reference(q, k, positions, M), v, causal=causal,
                               key_padding_mask=mask)
    assert_parity(o, ref, (q, k, v))


# ------------------------------------------------------------------------------------------------
# softmax (SDPA)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("left", [True, False])
def test_softmax_attn_matches_dense_with_empty_rows(causal, left):
    q, k, v = rand(2, 23, 2, 8), rand(2, 23, 2, 8), rand(2, 23, 2, 4)
    mask = padding(2, 23, left=left)
    o = softmax_attn(q, k, v, causal=causal, key_padding_mask=mask)
    ref = softmax_attn_reference(q, k, v, causal=causal, key_padding_mask=mask)
    assert_parity(o, ref, (q, k, v))
    assert (o[1][~mask[1]] == 0).all()  # padded queries are zeroed explicitly
    o_nomask = softmax_attn(q, k, v, causal=causal)
    assert rel_err(o_nomask, softmax_attn_reference(q, k, v, causal=causal)) < TOL


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_attn_a_nan_padded_query_leaves_the_real_gradients_finite(causal):
    """Its output was 0, but in the backward its NaN scores times a zero output gradient had put
    NaN into the gradient of every real key and value."""
    q, k, v = (rand(2, 8, 1, 16).detach() for _ in range(3))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    q[1, 5:] = float("nan")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = softmax_attn(q, k, v, causal=causal, key_padding_mask=mask)
    o[mask].sum().backward()
    assert torch.isfinite(o).all() and (o[1, 5:] == 0).all()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v)) and (q.grad[1, 5:] == 0).all()


# ------------------------------------------------------------------------------------------------
# GAU (FLASH-Quad) and FLASH
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalizer", ["seq_len", "fixed", "visible", "none"])
def test_gau_attn_matches_dense(causal, normalizer):
    T = 21
    q, k, v = rand(2, T, 8), rand(2, T, 8), rand(2, T, 6)
    bias = rand(2, T, T) * 0.1
    mask = padding(2, T, left=True)
    o = gau_attn(q, k, v, causal=causal, normalizer=normalizer, fixed_len=16, bias=bias, key_padding_mask=mask)
    ref = gau_attn_reference(q, k, v, causal=causal, normalizer=normalizer, fixed_len=16, bias=bias,
                             key_padding_mask=mask)
    assert_parity(o, ref, (q, k, v, bias))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalizer", ["visible", "chunk", "none"])
@pytest.mark.parametrize("T", [7, 48, 50])
def test_flash_attn_matches_dense_formula(causal, normalizer, T):
    C = 16
    ql, kl, qg, kg, v = rand(2, T, 8), rand(2, T, 8), rand(2, T, 8), rand(2, T, 8), rand(2, T, 6)
    bias = rand(C, C) * 0.1
    mask = padding(2, T)  # FLASH chunks by index: right padding (the model moves left padding)
    kw = dict(causal=causal, chunk_size=C, normalizer=normalizer, local_bias=bias, key_padding_mask=mask)
    o = flash_attn(ql, kl, qg, kg, v, **kw)
    ref = flash_attn_reference(ql, kl, qg, kg, v, **kw)
    assert_parity(o, ref, (ql, kl, qg, kg, v, bias))


@pytest.mark.parametrize("prefix_by", ["matmul", "cumsum"])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("normalizer", ["visible", "chunk", "none"])
def test_flash_causal_global_prefix_forms(monkeypatch, prefix_by, padded, normalizer):
    """The causal prefix over chunks: a [G, G] product for few chunks, a cumsum beyond; both exact,
    with and without padding (no padding and T a multiple of C: the no-mask fast path)."""
    import transnormer.ops.flash as flash_mod

    monkeypatch.setattr(flash_mod, "_PREFIX_MATMUL_MAX_CHUNKS", 64 if prefix_by == "matmul" else 0)
    T, C = 64, 8
    ql, kl, qg, kg, v = rand(2, T, 8), rand(2, T, 8), rand(2, T, 8), rand(2, T, 8), rand(2, T, 6)
    kw = dict(causal=True, chunk_size=C, normalizer=normalizer, key_padding_mask=padding(2, T) if padded else None)
    o = flash_attn(ql, kl, qg, kg, v, **kw)
    ref = flash_attn_reference(ql, kl, qg, kg, v, **kw)
    assert_parity(o, ref, (ql, kl, qg, kg, v))


@pytest.mark.parametrize("prefix_by", ["matmul", "cumsum"])
@pytest.mark.parametrize("normalizer", ["visible", "chunk", "none"])
@pytest.mark.parametrize("T, C", [(8, 8), (64, 8), (63, 21)])
def test_flash_explicit_backward_matches_autograd_form_and_formula(monkeypatch, prefix_by, normalizer, T, C):
    """_CausalFlashCore (causal, whole chunks, no padding) against the autograd form it replaces
    and the dense formula: outputs and the gradients of all five heads and of the local bias."""
    import transnormer.ops.flash as flash_mod

    monkeypatch.setattr(flash_mod, "_PREFIX_MATMUL_MAX_CHUNKS", 64 if prefix_by == "matmul" else 0)
    ql, kl, qg, kg, v = rand(2, T, 8), rand(2, T, 8), rand(2, T, 8), rand(2, T, 8), rand(2, T, 6)
    bias = rand(C, C) * 0.1
    kw = dict(causal=True, chunk_size=C, normalizer=normalizer, local_bias=bias)
    inputs = (ql, kl, qg, kg, v, bias)
    o = flash_attn(ql, kl, qg, kg, v, **kw)
    assert o.grad_fn is not None and "CausalFlashCore" in type(o.grad_fn).__name__
    assert_parity(o, flash_attn_reference(ql, kl, qg, kg, v, **kw), inputs)
    monkeypatch.setattr(flash_mod, "_EXPLICIT_BACKWARD", False)
    assert_parity(o, flash_attn(ql, kl, qg, kg, v, **kw), inputs, tol=1e-12)


def test_flash_explicit_backward_under_bf16_autocast_equals_autograd_form(monkeypatch):
    """Same products and roundings: under autocast the explicit backward reproduces the local
    branch's gradients (dQl, dKl, d bias) bit for bit. The global branch's prefix sums its fp32
    terms in another order (a one-pass scan on CPU, a [G, G] product in the autograd form), and
    dV rounds its two branch terms once together: those agree to bf16 rounding."""
    import transnormer.ops.flash as flash_mod

    T, C = 256, 64
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, T, 32, generator=g).bfloat16().requires_grad_() for _ in range(4)]
    v = torch.randn(1, T, 48, generator=g).bfloat16().requires_grad_()
    bias = (torch.randn(C, C, generator=g) * 0.1).requires_grad_()
    gy = torch.randn(1, T, 48, generator=g).bfloat16()
    results = []
    for explicit in (True, False):
        monkeypatch.setattr(flash_mod, "_EXPLICIT_BACKWARD", explicit)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o = flash_attn(*xs, v, causal=True, chunk_size=C, local_bias=bias)
        results.append((o, *torch.autograd.grad(o, (*xs, v, bias), gy)))
    for i, (a, b) in enumerate(zip(*results)):
        assert a.dtype == b.dtype
        if i in (1, 2, 6):  # dQl, dKl, d bias
            assert torch.equal(a, b)
        else:
            assert rel_err(a.double(), b.double()) < 1e-2


@pytest.mark.parametrize("gemm", ["onednn", "mkl"])
def test_flash_explicit_backward_fp32_with_the_prefix_kernel_is_within_1e5(monkeypatch, gemm):
    """fp32 runs the core with the one-pass prefix kernel (where it is built), its twelve chunk
    products on the native GEMM where fp32 leaves MKL, else on torch.bmm: forward and gradients
    against the fp64 dense formula."""
    from transnormer.ops import _native

    monkeypatch.setenv("TRANSNORMER_FP32_GEMM", gemm)
    calls = []
    real = _native.bmm
    monkeypatch.setattr(_native, "bmm", lambda *a, **k: calls.append(1) or real(*a, **k))
    T, C = 192, 32
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, T, 16, generator=g, dtype=torch.float64) for _ in range(4)]
    xs.append(torch.randn(2, T, 24, generator=g, dtype=torch.float64))
    bias = torch.randn(C, C, generator=g, dtype=torch.float64) * 0.1
    kw = dict(causal=True, chunk_size=C)
    got_in = [x.float().requires_grad_() for x in (*xs, bias)]
    ref_in = [x.clone().requires_grad_() for x in (*xs, bias)]
    o = flash_attn(*got_in[:5], local_bias=got_in[5], **kw)
    ref = flash_attn_reference(*ref_in[:5], local_bias=ref_in[5], **kw)
    gy = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    assert rel_err(o.double(), ref) < 1e-5
    for a, b in zip(torch.autograd.grad(o, got_in, gy.float()), torch.autograd.grad(ref, ref_in, gy)):
        assert rel_err(a.double(), b) < 1e-5
    native = gemm == "onednn" and _native.rows_usable(torch.float32, o.device) and _native.bmm_ready()
    assert len(calls) == (12 if native else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G, n", [(1, 5), (16, 300), (70, 33)])
def test_chunk_prefix_kernel_matches_its_torch_forms(dtype, G, n):
    """_native.chunk_prefix (forward and adjoint) against _prefix / _prefix_adjoint in fp64 on the
    same (rounded) input: fp32 to 1e-6, bf16 to its one rounding."""
    from transnormer.ops import _native
    from transnormer.ops.flash import _chunk_scales, _prefix, _prefix_adjoint

    if not _native.rows_usable(dtype, torch.device("cpu")):
        pytest.skip("fused CPU kernels unavailable")
    x = torch.randn(2, G, n).to(dtype)
    scales = _chunk_scales(torch.full((1, G), 8.0), causal=True, normalizer="visible", C=8)[0]
    for reverse, ref_fn in ((False, _prefix), (True, _prefix_adjoint)):
        got = _native.chunk_prefix(x, scales, reverse=reverse)
        ref = ref_fn(x.double(), scales.double())
        assert got.dtype == dtype
        assert rel_err(got.double(), ref) < (1e-6 if dtype == torch.float32 else 4e-3)
    # states near the top of the range: the unscaled running sum had overflowed in fp32 (inf
    # entries) where every scaled prefix is finite
    big = (torch.rand(2, G, n, dtype=torch.float64) * 1e37).to(dtype)
    got = _native.chunk_prefix(big, scales, reverse=False)
    ref = _prefix(big.double(), scales.double())
    assert torch.isfinite(got).all() and rel_err(got.double(), ref) < (1e-6 if dtype == torch.float32 else 4e-3)


def test_flash_under_bf16_autocast_close_to_fp64():
    T, C = 200, 32
    ql, kl, qg, kg, v = (torch.randn(1, T, 16, dtype=torch.float64) for _ in range(5))
    ref = flash_attn_reference(ql, kl, qg, kg, v, causal=True, chunk_size=C)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = flash_attn(*(x.float() for x in (ql, kl, qg, kg, v)), causal=True, chunk_size=C)
    assert rel_err(o.double(), ref) < 3e-2


@pytest.mark.parametrize("causal", [True, False])
def test_flash_fp32_within_1e5(causal):
    T, C = 300, 64
    ql, kl, qg, kg = (torch.randn(1, T, 32) for _ in range(4))
    v = torch.randn(1, T, 16)
    o = flash_attn(ql, kl, qg, kg, v, causal=causal, chunk_size=C)
    ref = flash_attn_reference(*(x.double() for x in (ql, kl, qg, kg, v)), causal=causal, chunk_size=C)
    assert rel_err(o.double(), ref) < 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_flash_one_chunk_without_global_equals_gau(causal):
    """flash.md §5.3: with C = T and the global branch off, FLASH is GAU with N_q = C."""
    T = 24
    q, k, v = rand(2, T, 8), rand(2, T, 8), rand(2, T, 6)
    bias = rand(T, T) * 0.1
    mask = padding(2, T)
    o = flash_attn(q, k, q, k, v, causal=causal, chunk_size=T, local_bias=bias, key_padding_mask=mask,
                   global_branch=False)
    ref = gau_attn(q, k, v, causal=causal, normalizer="fixed", fixed_len=T, bias=bias, key_padding_mask=mask)
    assert_parity(o, ref, (q, k, v, bias), tol=1e-12)


def test_flash_noncausal_global_is_full_bilinear_attention():
    """flash.md §5.4: the non-causal global branch is Q (Kᵀ V) / T_v over all chunks."""
    T = 50
    qg, kg, v = rand(2, T, 8), rand(2, T, 8), rand(2, T, 6)
    mask = padding(2, T)
    o = flash_attn(qg, kg, qg, kg, v, causal=False, chunk_size=16, key_padding_mask=mask, local_branch=False)
    m = mask[..., None].double()
    ref = qg @ ((kg * m).transpose(1, 2) @ (v * m)) / mask.sum(-1)[:, None, None]
    assert rel_err(o, ref) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_flash_padded_values_do_not_reach_real_tokens(causal):
    """Spec §4.3 zeroes V at masked positions: a NaN or Inf there (an uninitialised pad) stays there."""
    torch.manual_seed(0)
    xs = [torch.randn(1, 20, 4) for _ in range(5)]
    mask = torch.ones(1, 20, dtype=torch.bool)
    mask[0, 15:] = False
    clean = flash_attn(*xs, causal=causal, chunk_size=8, key_padding_mask=mask)
    xs[4][0, 15:] = float("nan")
    out = flash_attn(*xs, causal=causal, chunk_size=8, key_padding_mask=mask)
    assert torch.equal(out[:, :15], clean[:, :15])
    quad = gau_attn(xs[0], xs[1], xs[4], causal=causal, key_padding_mask=mask)
    assert torch.isfinite(quad[:, :15]).all()


def test_performer_works_at_large_head_dims():
    """Key exponents are capped one by one, not shifted by the worst case over ω (28 at d_h = 128,
    110 at 256): that shift had pushed the denominators under eps, or every feature to 0."""
    from transnormer.layers import Performer

    for head_dim in (128, 256):
        torch.manual_seed(0)
        x = torch.randn(2, 64, 2 * head_dim)
        a = Performer(2 * head_dim, 2, causal=False).eval()
        b = Performer(2 * head_dim, 2, causal=False, eps=1e-30).eval()
        b.load_state_dict(a.state_dict())
        ya, yb = (m(x)[0] - m.out_proj.bias for m in (a, b))
        assert ya.norm() > 0 and rel_err(ya, yb) < 1e-4


def test_eps_zero_divides_exactly_and_negative_eps_is_refused():
    from transnormer.layers import LinearAttention

    with pytest.raises(ValueError, match="eps must be a number >= 0"):
        LinearAttention(16, 2, causal=True, eps=-1e-6)
    q = torch.rand(1, 5, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="eps must be a number >= 0 with a denominator"):
        kernel_linear_attn(q, q, q, causal=True, eps=-1.0)
    mask = torch.tensor([[False, False, True, True, True]])  # left padding: rows 0-1 see no key
    o, _ = kernel_linear_attn(q, q, q, causal=True, eps=0.0, key_padding_mask=mask)
    ref = kernel_linear_attn_reference(q, q, q, causal=True, eps=0.0, key_padding_mask=mask)
    assert torch.equal(o[:, :2], torch.zeros_like(o[:, :2])) and rel_err(o, ref) < 1e-12
    assert torch.allclose(o[:, 2], q[:, 2])  # one visible key: exactly its value


def test_performer_is_the_exact_favor_ratio_at_any_scale():
    # eps = 1e-6 added to FAVOR+'s denominator pulled outputs towards 0 once |q|, |k| grew: the key
    # features are not rescaled (that would leak the future), so the denominator fell below eps.
    # At causal position 0 the ratio is exactly v_0 whatever the features.
    from transnormer.layers import Performer

    torch.manual_seed(0)
    layer = Performer(256, 4, causal=True).double().eval()
    x = 4.0 * torch.randn(1, 6, 256, dtype=torch.float64)
    with torch.no_grad():
        q, k, v = layer._project(x)
        o = layer(x)[0]
        v0 = layer.out_proj(v[:, :1].reshape(1, 1, 256))
    assert rel_err(o[:, :1], v0) < 1e-12


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_causal_softmax_with_a_non_positive_scale_has_no_nan_rows(scale):
    # SDPA's is_causal path returned NaN rows for scale <= 0 on CPU
    q, k, v = (torch.randn(1, 5, 2, 8, dtype=torch.float64) for _ in range(3))
    o = softmax_attn(q, k, v, causal=True, scale=scale)
    assert rel_err(o, softmax_attn_reference(q, k, v, causal=True, scale=scale)) < 1e-12
    from transnormer.ops import block_attn
    from transnormer.ops.reference import block_attn_reference

    for dtype in (torch.float32, torch.float64):  # block_attn's SDPA path (2 of 8 rows had been finite)
        q, k, v = (torch.randn(2, 100, 2, 16, dtype=dtype) for _ in range(3))
        o = block_attn(q, k, v, causal=True, block_size=64, scale=scale)
        assert rel_err(o, block_attn_reference(q, k, v, causal=True, block_size=64, scale=scale)) < 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_attention_with_zero_width_keys_is_uniform(causal):
    # D = 0 raised ZeroDivisionError computing the default scale D^-1/2; every score is 0 there
    q, v = torch.randn(1, 5, 2, 0, dtype=torch.float64), torch.randn(1, 5, 2, 8, dtype=torch.float64)
    o = softmax_attn(q, q, v, causal=causal)
    want = v.cumsum(1) / torch.arange(1, 6, dtype=v.dtype)[:, None, None] if causal else v.mean(1, keepdim=True)
    assert rel_err(o, want.expand_as(o)) < 1e-12


def test_cosformer_max_len_must_be_positive():
    from transnormer.ops.linear_baselines import cosformer_attn

    q = torch.rand(1, 4, 1, 8)
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        cosformer_attn(q, q, q, causal=True, positions=torch.arange(4)[None], max_len=0)


def test_cosformer_row_lengths_with_an_empty_row():
    """max_len as row lengths (mask.sum(1)) with an all-padding row: M = 0 made that row's angles NaN,
    and the NaN reached the shared projection's gradient even with the row masked out of the loss."""
    from transnormer.ops.linear_baselines import cosformer_attn

    torch.manual_seed(0)
    x, W = torch.randn(2, 5, 4, dtype=torch.float64), torch.nn.Linear(4, 4).double()
    mask = torch.tensor([[False] * 5, [True] * 5])
    q = W(x).view(2, 5, 1, 4)
    o = cosformer_attn(q, q, q, torch.arange(5).expand(2, 5), mask.sum(1), causal=False, key_padding_mask=mask)
    (o * mask[:, :, None, None]).sum().backward()
    assert torch.isfinite(o).all() and torch.isfinite(W.weight.grad).all()
    alone = cosformer_attn(q[1:], q[1:], q[1:], torch.arange(5)[None], 5, causal=False)
    assert rel_err(o[1:], alone) < 1e-12
    with pytest.raises(ValueError, match="max_len must be >= 1 in every row with tokens, got 0.5 in row 1"):
        cosformer_attn(q, q, q, torch.zeros(2, 5), torch.tensor([5.0, 0.5]), causal=False)


def _x(*shape):
    return torch.randn(*shape)


@pytest.mark.parametrize("args,match", [
    ((_x(2, 5, 4), _x(1, 5, 4), _x(1, 5, 3)), "k must have q's \\[B, T\\] = \\(2, 5\\)"),  # had broadcast
    ((_x(2, 5, 4), _x(2, 5, 4), _x(2, 4, 3)), "v must have q's \\[B, T\\]"),
    ((_x(2, 5, 4), _x(2, 5, 6), _x(2, 5, 3)), "k must have q's width 4"),
])
def test_gau_attn_refuses_mismatched_shapes(args, match):
    with pytest.raises(ValueError, match=match):
        gau_attn(*args, causal=False)


@pytest.mark.parametrize("shapes,match", [
    (((2, 6, 4),) * 4 + ((2, 4, 3),), "v must have q_local's \\[B, T\\]"),
    (((2, 6, 4),) * 4 + ((1, 6, 3),), "v must have q_local's \\[B, T\\]"),
    (((2, 6, 4), (2, 6, 4), (2, 6, 6), (2, 6, 6), (2, 6, 3)), "q_global must have q_local's width 4"),
])
def test_flash_attn_refuses_mismatched_shapes(shapes, match):
    with pytest.raises(ValueError, match=match):
        flash_attn(*(torch.randn(*sh) for sh in shapes), causal=True, chunk_size=2)


def test_gau_and_flash_refuse_what_they_cannot_compute():
    q = torch.randn(2, 6, 4)
    with pytest.raises(ValueError, match="fixed_len must be >= 1"):  # 0 had given inf, -3 negated the scores
        gau_attn(q, q, q, causal=True, normalizer="fixed", fixed_len=0)
    with pytest.raises(ValueError, match=r"bias must have shape \[T, T\] or \[B, T, T\]"):  # [T] had broadcast
        gau_attn(q, q, q, causal=True, bias=torch.zeros(6))
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):  # had been a matmul's dtype error
        gau_attn(q, q.double(), q, causal=True)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        gau_attn(q, q, q, causal=True, dropout_p=-0.5)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        flash_attn(q, q, q, q, q, causal=True, chunk_size=2, dropout_p=2.0)
    left = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="FLASH cuts blocks by index and needs right-padded rows"):  # flash.md §4.6
        flash_attn(q, q, q, q, q, causal=True, chunk_size=2, key_padding_mask=left)
    gau_attn(q, q, q, causal=True, key_padding_mask=left)  # GAU accepts left padding (§4.6)
    gau_attn(q, q, q, causal=True, normalizer="visible", fixed_len=None)  # read only by "fixed"


def test_cosformer_attn_checks_its_positions():
    q = torch.randn(1, 4, 2, 3)
    with pytest.raises(ValueError, match=r"positions must be \[B or 1, T\] = \[1 or 1, 4\], got \(4,\)"):
        cosformer_attn(q, q, q, causal=True, positions=torch.arange(4), max_len=8)  # had been an IndexError
    with pytest.raises(TypeError, match="positions must be a torch.Tensor"):
        cosformer_attn(q, q, q, causal=True, positions=[[0, 1, 2, 3]], max_len=8)
    # a gap of M or more makes the cos weight of that pair <= 0
    with pytest.raises(ValueError, match=r"cosFormer positions 0 .. 5 \(a gap of 5\) in row 0 >= max_len M = 4"):
        cosformer_attn(q, q, q, causal=True, positions=torch.tensor([[0, 1, 2, 5]]), max_len=4)
    # only the gaps matter to the op: offset positions are fine, and so is padding past M
    shifted = cosformer_attn(q, q, q, causal=True, positions=torch.arange(100, 104)[None], max_len=8)
    assert torch.isfinite(shifted).all()
    mask = torch.tensor([[True, True, True, False]])
    cosformer_attn(q, q, q, causal=True, positions=torch.tensor([[0, 1, 2, 9]]), max_len=3, key_padding_mask=mask)
    with pytest.raises(ValueError, match="positions must be finite"):  # a NaN passed every comparison
        cosformer_attn(q, q, q, causal=True, positions=torch.tensor([[0.0, 1.0, float("nan"), 3.0]]), max_len=8)


def test_relu2_attention_refuses_a_second_derivative():
    # its backward read relu(s) saved without a graph: gradgradcheck failed with a silently wrong Hessian,
    # and once_differentiable still let hvp read a partly wrong one
    q, k, v = (torch.randn(1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="_MaskedRelu2 has no second derivative"):
        torch.autograd.grad(gau_attn(q, k, v, causal=True).pow(2).sum(), (q,), create_graph=True)


def test_flash_attn_refuses_mixed_dtypes_outside_autocast():
    # the fused causal path cast fp64 q/k to v's fp32 silently; the padded path raised a torch error
    q = torch.randn(1, 64, 8, dtype=torch.float64)
    v = torch.randn(1, 64, 16)
    with pytest.raises(TypeError, match="must share one dtype outside autocast"):
        flash_attn(q, q, q, q, v, causal=True, chunk_size=16)
    z = torch.randn(1, 64, 0)  # zero-width heads failed inside a reshape
    with pytest.raises(ValueError, match="q_local must have a width >= 1"):
        flash_attn(z, z, z, z, v, causal=True, chunk_size=16)


@pytest.mark.parametrize("causal", [True, False])
def test_ops_run_shape_only_on_meta_tensors(causal):
    # torch.autocast("meta", ...) and is_autocast_enabled("meta") raise inside PyTorch: these ops had
    # failed with "unsupported scalarType" where softmax_attn and block_attn ran
    from transnormer.ops import norm_linear_attn

    q = torch.empty(2, 130, 2, 8, device="meta")
    o, state = norm_linear_attn(q, q, q, causal=causal, output_final_state=True)
    assert o.shape == (2, 130, 2, 8) and state.shape == (2, 2, 8, 8) and o.device.type == "meta"
    assert kernel_linear_attn(q, q, q, causal=causal)[0].shape == (2, 130, 2, 8)
    x = q[:, :, 0]
    assert flash_attn(x, x, x, x, x, causal=causal, chunk_size=64).shape == (2, 130, 8)


def test_edge_shapes_and_argument_errors_of_the_baseline_ops():
    # a zero-width value at a whole number of chunks: "cannot reshape tensor of 0 elements into [-1, 4, 0]"
    x = torch.randn(2, 8, 4)
    assert flash_attn(x, x, x, x, x.new_zeros(2, 8, 0), causal=True, chunk_size=4).shape == (2, 8, 0)
    # E = 0 with the denominator: the state keeps its key-sum column, [B, H, F, E + 1]
    q = torch.rand(2, 5, 1, 3)
    _, state = kernel_linear_attn(q, q, q[..., :0], causal=True, output_final_state=True)
    assert state.shape == (2, 1, 3, 1)
    torch.testing.assert_close(state[..., 0], q.sum(1))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[B, H, F, E \+ 1\] = \(2, 1, 3, 3\)"):
        kernel_linear_attn(q, q, q[..., :2], causal=True, initial_state=torch.zeros(2, 1, 3, 2))
    with pytest.raises(ValueError, match=r"qf must be a \[B, H, F\] tensor for one step"):  # it had named q
        kernel_linear_attn_step(q, q, q, None)
    with pytest.raises(ValueError, match=r"max_len must be a number or a \[B\] = \[2\] tensor, got shape \(3,\)"):
        cosformer_attn(q, q, q, torch.arange(5)[None], torch.tensor([8.0, 8.0, 8.0]), causal=True)
    with pytest.raises(ValueError, match=r"proj must be an \[m, D\] projection with D = 5"):  # an einsum error
        favor_features(torch.randn(2, 3, 1, 5), draw_favor_projection(4, 4, seed=0), is_query=True)
    with pytest.raises(ValueError, match="head_dim must be >= 1"):  # a ZeroDivisionError
        draw_favor_projection(3, 0, seed=0)
