"""The softmax-attention kernels (bf16 on AMX tiles or AVX512-BF16: ops/_native_softmax_amx.cpp;
fp32 on AVX-512 or AVX2: ops/_native_softmax.cpp) against the fp64 dense references: vanilla attention
(``softmax_attn``) and DiagAttention's blocks (``block_attn``).

The oracle is the dense quadratic formula in fp64 on the same inputs. The fp32 kernel is held
to fp32 accuracy. The bf16 kernel rounds as FlashAttention-2 does (bf16 operands P and dS, fp32 accumulation and softmax, one
rounding per output), so each output's error is held to that of the explicit PyTorch form under
autocast (bf16 products, fp32 softmax), and to 5e-3 overall (about one bf16 rounding). PyTorch's
CPU SDPA backward runs its products in fp32 and is more accurate than either, and ~5x slower.
"""

import pytest
import torch

from conftest import model_loss_and_grads, needs_bf16_kernel_mark, on_one_and_two_threads, rel_err
from transnormer.ops import _native, block_attn, block_attn_reference
from transnormer.ops.reference_baselines import softmax_attn_reference
from transnormer.ops.softmax import softmax_attn

needs_bf16_kernel = needs_bf16_kernel_mark()
pytestmark = pytest.mark.usefixtures("bf16_engine")  # each bf16 product engine (conftest.py)


needs_f32 = pytest.mark.skipif(not _native.softmax_f32_ready(),
                               reason="no fp32 softmax kernel (needs AVX-512 or AVX2 with FMA, and a C++ compiler)")
needs_avx512 = pytest.mark.skipif(not _native._build_flag("tn_rows_avx512"), reason="a library built without AVX-512")


@pytest.fixture
def mode():
    before = _native.backend()
    yield _native.set_backend
    _native.set_backend(before)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The windows the kernel was called with."""
    calls = []
    real = _native.native_softmax_attn
    monkeypatch.setattr(_native, "native_softmax_attn",
                        lambda *a, **kw: calls.append(kw.get("window", 0)) or real(*a, **kw))
    return calls


def _case(B, T, H, D, E, seed=0):
    g = torch.Generator().manual_seed(seed + T)
    q, k, v = (torch.randn(B, T, H, x, generator=g).bfloat16() for x in (D, D, E))
    go = torch.randn(B, T, H, E, generator=g).bfloat16()
    return q, k, v, go


def _run(fn, q, k, v, go, dtype):
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    return (o, *torch.autograd.grad((o.double() * go.double()).sum(), (q, k, v)))


def _norm_err(a, b):
    a, b = a.detach().double(), b.detach()
    if b.norm() == 0:
        return float(a.norm())
    return float((a - b).norm() / b.norm())


def _autocast_form(q, k, v, *, causal, window=0):
    """softmax(q kᵀ / √D) v as PyTorch runs it under bf16 autocast: bf16 products, fp32 softmax."""
    T = q.shape[1]
    i = torch.arange(T)
    allowed = i[None, :] <= i[:, None] if causal else torch.ones(T, T, dtype=torch.bool)
    if window:
        allowed = allowed & (i[None, :] // window == i[:, None] // window)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    p = torch.softmax(s.float().masked_fill(~allowed, float("-inf")), -1).to(q.dtype)
    return torch.einsum("bhij,bjhe->bihe", p, v)


def _check(got, ref, torch_form):
    for name, a, b, t in zip(("o", "dq", "dk", "dv"), got, ref, torch_form):
        assert a.dtype == torch.bfloat16, name
        err, torch_err = _norm_err(a, b), _norm_err(t, b)  # over all elements: steadier than the max
        assert err < 1.25 * torch_err + 1e-4 and err < 5e-3, (name, err, torch_err)
        if b.abs().max() > 0:
            assert rel_err(a.double(), b) < 2e-2, name


@needs_bf16_kernel
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("H,D,E", [(2, 64, 64), (3, 32, 96), (1, 128, 32)])
def test_vanilla_attention_matches_fp64_reference_as_well_as_the_autocast_form(mode, kernel_calls, T, causal, H, D, E):
    case = _case(2, T, H, D, E)

    def fn(q, k, v):
        return softmax_attn(q, k, v, causal=causal)

    mode("auto")
    got = _run(fn, *case, torch.bfloat16)
    assert kernel_calls == [0]
    torch_form = _run(lambda q, k, v: _autocast_form(q, k, v, causal=causal), *case, torch.bfloat16)
    ref = _run(lambda q, k, v: softmax_attn_reference(q, k, v, causal=causal), *case, torch.float64)
    _check(got, ref, torch_form)


@needs_bf16_kernel
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200, 301])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [32, 64, 96, 128])
def test_block_attention_matches_fp64_reference_as_well_as_the_torch_form(mode, kernel_calls, T, causal, block):
    case = _case(2, T, 2, 64, 64)

    def fn(q, k, v):
        return block_attn(q, k, v, block_size=block, causal=causal)

    mode("auto")
    got = _run(fn, *case, torch.bfloat16)
    # whole blocks run as sequences of their own (window 0), as does a single block; a ragged
    # last block keeps the windowed walk
    assert kernel_calls == [block if T > block and T % block else 0]
    mode("torch")
    torch_form = _run(fn, *case, torch.bfloat16)
    ref = _run(lambda q, k, v: block_attn_reference(q, k, v, block_size=block, causal=causal), *case, torch.float64)
    _check(got, ref, torch_form)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16_kernel), torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_whole_blocks_as_sequences_equal_the_windowed_kernel(mode, kernel_calls, dtype, causal):
    """block_attn over whole blocks runs each block as a sequence of its own; the windowed walk
    over the same rows is the same arithmetic, so outputs and gradients agree bit for bit."""
    if not _native.softmax_usable(*(torch.zeros(1, 64, 1, 64, dtype=dtype) for _ in range(3)), window=64):
        pytest.skip("no fused softmax kernel for this dtype here")
    q, k, v, go = _case(2, 192, 3, 64, 64)
    mode("auto")
    blocks = _run(lambda q, k, v: block_attn(q, k, v, block_size=64, causal=causal), q, k, v, go, dtype)
    windowed = _run(lambda q, k, v: _native.native_softmax_attn(q, k, v, causal=causal, scale=0.125, window=64),
                    q, k, v, go, dtype)
    assert kernel_calls == [0, 64]
    for a, b in zip(blocks, windowed):
        assert torch.equal(a, b)


@needs_bf16_kernel
def test_inputs_the_kernel_does_not_take_run_the_torch_forms(mode, kernel_calls):
    mode("auto")
    q = torch.randn(2, 100, 2, 64).bfloat16()
    mask = torch.ones(2, 100, dtype=torch.bool)
    mask[1, 90:] = False
    softmax_attn(q, q, q, causal=True, key_padding_mask=mask)
    softmax_attn(q, q, q, causal=True, dropout_p=0.1)
    softmax_attn(q, q, q, causal=True, scale=-1.0)  # the kernel's running max assumes scale > 0
    softmax_attn(q, q, q, causal=True, scale=1e-46)  # 0 as the kernels' fp32: it had failed in the kernel
    softmax_attn(q.double(), q.double(), q.double(), causal=True)
    block_attn(q.float(), q.float(), q.float(), block_size=32, causal=True)  # fp32 windows: multiples of 64
    softmax_attn(q[..., :48], q[..., :48], q[..., :48], causal=True)  # D not a multiple of 32
    block_attn(q, q, q, block_size=48, causal=True)  # window not a multiple of 32
    r = q[:, :96]  # whole blocks that are not whole tiles: padded to a tile each, they ran 2-7x slower
    block_attn(r, r, r, block_size=16, causal=True)
    block_attn(r.float(), r.float(), r.float(), block_size=32, causal=False)
    block_attn(q, q, q, block_size=64, causal=True, key_padding_mask=mask)
    block_attn(q, q, q, block_size=64, causal=True, kernel="relu")
    assert kernel_calls == []
    mode("torch")
    softmax_attn(q, q, q, causal=True)
    assert kernel_calls == []


@pytest.mark.parametrize("window", [0, 64])
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16_kernel),
                                   pytest.param(torch.float32, marks=needs_f32)])
def test_same_result_on_one_and_two_threads(dtype, window):
    q, k, v, go = (x.to(dtype) for x in _case(2, 200, 3, 64, 32))

    def run():
        return _run(lambda q, k, v: _native.native_softmax_attn(q, k, v, causal=True, scale=0.125, window=window),
                    q, k, v, go, dtype)

    one, two = on_one_and_two_threads(run)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@needs_bf16_kernel
def test_views_of_a_fused_projection_are_read_in_place():
    qkv = torch.randn(2, 130, 3, 2, 64).bfloat16()  # [B, T, 3, H, D] as a fused q/k/v projection gives
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous() and _native.token_rows_ok(q)
    strided = _native.native_softmax_attn(q, k, v, causal=True, scale=0.125)
    packed = _native.native_softmax_attn(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, scale=0.125)
    assert torch.equal(strided, packed)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16_kernel),
                                   pytest.param(torch.float32, marks=needs_f32)])
@pytest.mark.parametrize("layout", ["fused", "transposed"])
def test_one_token_of_several_sequences(layout, dtype):
    """T = 1, B > 1: rows are batch rows, read at the batch stride. A fused projection's views have
    rows wider than H·D; [B, H, D, 1] with its last dim moved to 1 is "contiguous" to PyTorch with
    stride(1) = 1."""
    g = torch.Generator().manual_seed(0)
    B, H, D = 3, 2, 64
    if layout == "fused":
        q, k, v = torch.randn(B, 1, 3, H, D, generator=g).to(dtype).unbind(2)
    else:
        q, k, v = (torch.randn(B, H, D, 1, generator=g).to(dtype).movedim(-1, 1) for _ in range(3))
        assert q.is_contiguous() and q.stride(1) == 1
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = _native.native_softmax_attn(q, k, v, causal=True, scale=0.125)
    go = torch.randn(B, 1, H, D, generator=g).to(dtype)
    grads = torch.autograd.grad(o, (q, k, v), go)
    # one key per query: o = v, dv = do, and the softmax's gradient (zero but for rounding) for q and k;
    # rows read from the wrong place would be other sequences' values
    torch.testing.assert_close(o, v.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[2], go, rtol=1e-6, atol=1e-6)
    assert grads[0].abs().max() < 1e-3 and grads[1].abs().max() < 1e-3


@needs_bf16_kernel
def test_kernel_rejects_shapes_it_cannot_tile():
    for bad in (1e-46, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be finite and > 0 in fp32"):
            _native.native_softmax_attn(torch.zeros(1, 64, 1, 64), torch.zeros(1, 64, 1, 64),
                                        torch.zeros(1, 64, 1, 64), causal=True, scale=bad)
    q = torch.zeros(1, 64, 1, 48, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"failed \(code 1\)"):
        _native.native_softmax_attn(q, q, q, causal=True, scale=0.1)
    q = torch.zeros(1, 200, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"failed \(code 1\)"):
        _native.native_softmax_attn(q, q, q, causal=True, scale=0.1, window=80)


@needs_bf16_kernel
def test_large_scores_do_not_overflow():
    """Scores far beyond exp's range (the online max keeps every exponent <= 0)."""
    q, k, v, go = _case(1, 150, 2, 64, 64)
    q, k = q * 30, k * 30
    got = _run(lambda q, k, v: softmax_attn(q, k, v, causal=True), q, k, v, go, torch.bfloat16)
    ref = _run(lambda q, k, v: softmax_attn_reference(q, k, v, causal=True), q, k, v, go, torch.float64)
    assert all(torch.isfinite(t).all() for t in got)
    assert rel_err(got[0].double(), ref[0]) < 2e-2
    for g, r in zip(got[1:], ref[1:]):  # the backward flushes P below 2^-125 (tn::exp2_bits)
        assert rel_err(g.double(), r) < 3e-2


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=needs_f32),
                                   pytest.param(torch.bfloat16, marks=needs_bf16_kernel)])
@pytest.mark.parametrize("causal", [True, False])
def test_scores_beyond_the_range_of_a_log_sum_exp(mode, kernel_calls, dtype, causal):
    """|scale · score| past 2^31: a log-sum-exp in fp32 rounds to a multiple of more than 128 there,
    so a P recomputed from it overflowed (the backward returned NaN from a scale of 1e8). The
    softmax is then one-hot: O and dV are those of the largest score, and dQ, dK stay finite (their
    exact value is 0; what is left is rounding times the scale, as in any delta-form backward)."""
    q, k, v, go = _case(2, 130, 2, 64, 64)
    for scale in (1e8, 1e9, 1e20):
        fn = lambda q, k, v, s=scale: softmax_attn(q, k, v, causal=causal, scale=s)  # noqa: E731
        got = _run(fn, q, k, v, go, dtype)
        ref = _run(lambda q, k, v, s=scale: softmax_attn_reference(q, k, v, causal=causal, scale=s),
                   q, k, v, go, torch.float64)
        assert all(torch.isfinite(t).all() for t in got), scale
        assert rel_err(got[0].double(), ref[0]) < 1e-6, scale  # v rows, picked exactly
        # dV sums the dO rows of the queries that pick each key: one bf16 rounding of that sum
        assert rel_err(got[3].double(), ref[3]) < (1e-6 if dtype == torch.float32 else 4e-3), scale
    assert len(kernel_calls) == 3


@needs_avx512
@pytest.mark.parametrize("degree", [5, 7])
def test_exp2_bits_is_exp2_masked_bit_for_bit(degree):
    """tn::exp2_bits (the bf16 backward's exp: 2^n added to the exponent bits) gives exp2_masked's
    (VRNDSCALEPS + VSCALEFPS) bits wherever x > -125: ties, both sides of every integer, the ends;
    at or below -125 it flushes to 0, and NaN stays NaN."""
    ints = torch.arange(-124, 128, dtype=torch.float32)
    eps = torch.tensor([0.0, 1e-7, -1e-7, 0.25, -0.25, 0.5, -0.5, 0.49999997, -0.49999997])
    x = torch.cat([(ints[:, None] + eps).flatten(), torch.linspace(-124.99, 127.0, 100_003),
                   torch.rand(50_000) * -30, torch.tensor([-0.0, 0.0, 127.0, -124.999])])
    x = x[(x > -125) & (x <= 127)].contiguous()
    masked, bits = torch.empty_like(x), torch.empty_like(x)
    _native._call("tn_exp2_pair", torch.float32, _native._ptr(x), _native._ptr(masked), _native._ptr(bits), x.numel(),
                  degree)
    assert torch.equal(bits.view(torch.int32), masked.view(torch.int32))
    assert torch.allclose(bits.double(), torch.exp2(x.double()), rtol=1e-5 if degree == 5 else 1e-7, atol=0)
    y = torch.tensor([-125.0, -126.0, -1000.0, float("-inf"), float("nan"), -3.0])
    out, b = torch.empty_like(y), torch.empty_like(y)
    _native._call("tn_exp2_pair", torch.float32, _native._ptr(y), _native._ptr(out), _native._ptr(b), y.numel(), degree)
    assert (b[:4] == 0).all() and torch.isnan(b[4]) and b[5] == out[5]


@needs_f32
def test_fp32_kernel_exp2_is_exact_to_fp32_flushes_and_masks():
    """The fp32 kernel's exp2 (AVX-512: VSCALEFPS; AVX2: times 2^n built in the exponent bits) against
    fp64 exp2: within 1e-7 relative above -125, at most 2^-125 at or below it (a softmax term that
    small is below fp32's resolution beside the row's largest, ~1), NaN stays NaN, and a lane not
    kept is 0 whatever it holds (+inf and NaN included: the lanes of queries with no visible key)."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-124.99, 127.0, 20_011), torch.rand(5_000, generator=g) * -30,
                   torch.arange(-124, 127, dtype=torch.float32) + 0.5, torch.tensor([-0.0, 0.0, -124.999])])
    x = torch.cat([x, torch.tensor([-125.0, -130.0, -149.5, -1000.0, -3e38, float("-inf"), float("nan")])])
    keep = torch.ones(x.numel(), dtype=torch.uint8)
    got = torch.empty_like(x)
    _native._call("tn_exp2_kernel", torch.float32, _native._ptr(x), _native._ptr(keep), _native._ptr(got), x.numel())
    n = x.numel() - 7
    assert torch.allclose(got[:n].double(), torch.exp2(x[:n].double()), rtol=1e-7, atol=0)
    assert (got[n:n + 6] >= 0).all() and (got[n:n + 6] <= 2.0 ** -125).all() and torch.isnan(got[-1])
    # every 3rd lane dropped, among them +inf and NaN; odd lengths take the partial vector
    y = torch.tensor([1.0, float("inf"), float("nan"), -3.0, float("nan"), 0.5, 2.0, float("inf"), 4.0, 0.0, 7.0])
    keep = (torch.arange(y.numel()) % 3 != 1).to(torch.uint8)
    out = torch.full_like(y, 5.0)
    _native._call("tn_exp2_kernel", torch.float32, _native._ptr(y), _native._ptr(keep), _native._ptr(out), y.numel())
    dropped = keep == 0
    assert (out[dropped] == 0).all()
    kept = ~dropped & ~torch.isnan(y)
    assert torch.allclose(out[kept].double(), torch.exp2(y[kept].double()), rtol=1e-7, atol=0)
    assert torch.isnan(out[2])


@needs_bf16_kernel
@pytest.mark.parametrize("causal", [True, False])
def test_a_nan_input_reaches_the_outputs_and_gradients(mode, kernel_calls, causal):
    """A NaN in q stays NaN through the forward and the backward (their exps keep NaN lanes
    rather than flush them to 0): training must see it, not a finite wrong gradient."""
    mode("native")
    q, k, v, go = _case(1, 96, 2, 64, 64)
    q = q.bfloat16()
    q[0, 70, 1, 3] = float("nan")
    q, k, v = (x.bfloat16().requires_grad_() for x in (q, k, v))
    o = softmax_attn(q, k, v, causal=causal)
    assert kernel_calls and torch.isnan(o[0, 70, 1]).all() and not torch.isnan(o[0, :70]).any()
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), go.bfloat16())
    assert torch.isnan(dq[0, 70, 1]).all() and torch.isnan(dk[0, :71 if causal else 96, 1]).any()
    assert torch.isnan(dv[0, :71 if causal else 96, 1]).all()


def _kernel_vs_torch_model(mode, preset, *, amp):
    """(relative loss error, relative gradient-norm error) of a tiny preset's step on the fused
    kernels ("auto") against its PyTorch forms ("torch"), same weights and tokens."""
    from transnormer.presets import build_model

    model = build_model(preset, vocab_size=300, dropout=0.0, attention_dropout=0.0)
    ids = torch.randint(0, 300, (2, 140))
    out = {}
    for m in ("torch", "auto"):
        mode(m)
        out[m] = model_loss_and_grads(model, ids, amp=amp)
    (loss, g), (loss_ref, g_ref) = out["auto"], out["torch"]
    return abs(loss - loss_ref) / abs(loss_ref), float((g - g_ref).norm() / g_ref.norm())


@needs_bf16_kernel
@pytest.mark.parametrize("preset", ["vanilla-lm-tiny", "t2-lm-tiny"])
def test_models_under_autocast_take_the_kernel_and_agree(mode, kernel_calls, preset):
    """vanilla-lm (softmax attention) and t2-lm (DiagAttention blocks) under bf16 autocast: the same
    loss and gradients as the PyTorch forms up to bf16 rounding, and the kernel did run."""
    loss_err, grad_err = _kernel_vs_torch_model(mode, preset, amp=True)
    assert kernel_calls
    assert loss_err < 1e-2 and grad_err < 3e-2


def _f32_check(got, ref, sdpa):
    for name, a, b, t in zip(("o", "dq", "dk", "dv"), got, ref, sdpa):
        assert a.dtype == torch.float32, name
        if b.abs().max() == 0:  # T = 1, causal: dq = dk = 0 up to rounding
            assert a.abs().max() < 1e-5, name
            continue
        err, sdpa_err = _norm_err(a, b), _norm_err(t, b)
        assert err < 2e-6 and err < 4 * sdpa_err + 1e-7, (name, err, sdpa_err)


@needs_f32
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("H,D,E", [(2, 64, 64), (3, 32, 96), (1, 128, 16), (2, 48, 32)])
def test_fp32_kernel_matches_fp64_reference(mode, kernel_calls, T, causal, H, D, E):
    q, k, v, go = (x.float() for x in _case(2, T, H, D, E))

    def fn(q, k, v):
        return softmax_attn(q, k, v, causal=causal)

    mode("auto")
    got = _run(fn, q, k, v, go, torch.float32)
    assert kernel_calls == [0]
    mode("torch")
    sdpa = _run(fn, q, k, v, go, torch.float32)
    ref = _run(lambda q, k, v: softmax_attn_reference(q, k, v, causal=causal), q, k, v, go, torch.float64)
    _f32_check(got, ref, sdpa)


@needs_f32
@pytest.mark.parametrize("T", [63, 65, 200, 301])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [64, 128])
def test_fp32_block_attention_matches_fp64_reference(mode, kernel_calls, T, causal, block):
    q, k, v, go = (x.float() for x in _case(2, T, 2, 64, 64))

    def fn(q, k, v):
        return block_attn(q, k, v, block_size=block, causal=causal)

    mode("auto")
    got = _run(fn, q, k, v, go, torch.float32)
    assert kernel_calls == [block if T > block else 0]
    mode("torch")
    torch_form = _run(fn, q, k, v, go, torch.float32)
    ref = _run(lambda q, k, v: block_attn_reference(q, k, v, block_size=block, causal=causal), q, k, v, go,
               torch.float64)
    _f32_check(got, ref, torch_form)


@needs_f32
def test_fp32_vanilla_model_agrees_with_sdpa(mode, kernel_calls):
    """vanilla-lm-tiny in fp32: loss and every gradient as with SDPA, to fp32 rounding."""
    loss_err, grad_err = _kernel_vs_torch_model(mode, "vanilla-lm-tiny", amp=False)
    assert kernel_calls
    assert loss_err < 1e-5 and grad_err < 1e-5


@needs_f32
def test_fp32_kernel_stays_accurate_over_many_key_steps():
    """A long row of keys (64 key steps): the online softmax's rescaling must not compound rounding."""
    q, k, v, go = (x.float() for x in _case(1, 4096, 1, 64, 64))
    got = _run(lambda q, k, v: softmax_attn(q, k, v, causal=True), q, k, v, go, torch.float32)
    ref = _run(lambda q, k, v: softmax_attn_reference(q, k, v, causal=True), q, k, v, go, torch.float64)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
        assert _norm_err(a, b) < 2e-6, name


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_kernel)])
def test_one_token_views_and_autocast(dtype):
    """A length-1 view whose token stride PyTorch leaves arbitrary; and fp32 inputs under CPU autocast
    come out in the autocast dtype, as SDPA's do."""
    if not _native.softmax_usable(*(torch.zeros(1, 1, 1, 64, dtype=dtype),) * 3):
        pytest.skip("no softmax kernel for this dtype here")
    x = torch.randn(2, 3, 1, 64).to(dtype).transpose(1, 2)  # [B, 1, H, D], stride(1) = 64
    o = softmax_attn(x, x, x, causal=True)
    assert torch.equal(o, x)  # one key: the output is its value
    q = torch.randn(2, 70, 2, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert softmax_attn(q, q, q, causal=True).dtype == torch.bfloat16
        assert block_attn(q, q, q, block_size=64, causal=True).dtype == torch.bfloat16


@needs_f32
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 63, 65])
def test_bf16_without_bf16_kernel_runs_the_fp32_kernel_on_copies(monkeypatch, causal, T):
    """No bf16 kernel: bf16 attention over all keys takes the fp32 kernel on fp32 copies (SDPA's bf16 form
    ran at a third to a half of its speed there); blocks keep their PyTorch form."""
    monkeypatch.setattr(_native, "bf16_ready", lambda: False)
    dtypes = []
    real = _native.native_softmax_attn
    monkeypatch.setattr(_native, "native_softmax_attn", lambda q, *a, **kw: dtypes.append(q.dtype) or real(q, *a, **kw))
    q, k, v = (torch.randn(2, T, 2, 32, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    o = softmax_attn(q, k, v, causal=causal)
    assert dtypes == [torch.float32] and o.dtype == torch.bfloat16
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = softmax_attn_reference(qd, kd, vd, causal=causal)
    assert rel_err(o.double(), ref) < 5e-3
    go = torch.randn_like(ref)
    for g, r in zip(torch.autograd.grad(o, (q, k, v), go.bfloat16()), torch.autograd.grad(ref, (qd, kd, vd), go)):
        assert g.dtype == torch.bfloat16 and rel_err(g.double(), r) < 2e-2
    monkeypatch.setattr(_native, "bf16_ready", lambda: True)
    assert not _native.softmax_upcast_usable(q, k, v)  # the bf16 kernel runs instead


@needs_f32
@pytest.mark.parametrize("T", [128, 100])  # whole blocks, and a last block of 36
def test_bf16_blocks_without_bf16_kernel_run_the_fp32_kernel_without_avx512(monkeypatch, T):
    """Without AVX-512 (AVX2: bf16 products emulated), block_attn's PyTorch bf16 form ran 10x
    slower than the fp32 kernel on copies (311-400 against 33-37 ms, blocks of 64 at 4k); with
    AVX-512 it was as fast, and blocks keep it. Blocks the kernel cannot tile (32) keep it too."""
    monkeypatch.setattr(_native, "bf16_ready", lambda: False)
    dtypes = []
    real = _native.native_softmax_attn
    monkeypatch.setattr(_native, "native_softmax_attn", lambda q, *a, **kw: dtypes.append(q.dtype) or real(q, *a, **kw))
    monkeypatch.setitem(_native._build_flags, "tn_rows_avx512", False)  # an AVX2 build
    q, k, v = (torch.randn(2, T, 2, 32, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    o = block_attn(q, k, v, block_size=64, causal=True)
    assert dtypes == [torch.float32] and o.dtype == torch.bfloat16
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = block_attn_reference(qd, kd, vd, block_size=64, causal=True)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert rel_err(o.double(), ref) < 5e-3
    go = torch.randn_like(ref)
    for g, r in zip(torch.autograd.grad(o, (q, k, v), go.bfloat16()), torch.autograd.grad(ref, (qd, kd, vd), go)):
        assert g.dtype == torch.bfloat16 and rel_err(g.double(), r) < 2e-2
    block_attn(q, k, v, block_size=32, causal=True)  # not a whole tile: the PyTorch bf16 form
    assert dtypes == [torch.float32]
    monkeypatch.setitem(_native._build_flags, "tn_rows_avx512", True)
    assert not _native.softmax_upcast_usable(q, k, v, window=64) and _native.softmax_upcast_usable(q, k, v)


def test_a_scale_past_the_fp32_range_is_refused_before_any_kernel():
    """3.5e38 is finite in Python but rounds to inf as the kernels' fp32 argument: it had passed the
    check ('finite and > 0 in fp32') and reached them; so had 3.0e38, whose product with log2(e)
    (the kernels' exponent factor) is inf in fp32. The fused path declines them too."""
    ok = _native._kernel_scale_ok
    assert not ok(3.5e38) and not ok(1e39) and not ok(3.0e38) and not ok(1e-46)
    assert ok(2.3e38) and ok(1e-44)
    q = torch.zeros(1, 64, 1, 64)
    for bad in (3.5e38, 3.0e38, 1e39, 1e-46):
        with pytest.raises(ValueError, match="scale must be finite and > 0 in fp32"):
            _native.native_softmax_attn(q, q, q, causal=True, scale=bad)
        assert _native.fused_softmax_attn(q, q, q, causal=True, scale=bad) is None


@needs_f32
def test_a_scale_whose_exponent_factor_overflows_runs_the_torch_form():
    """Scores q·k of ~1e-38 under a scale of 3e38 are ordinary scaled scores, but the kernels' factor
    scale·log2(e) is inf in fp32: every exponent was then NaN (0·inf on each row's max). Such a
    scale runs SDPA, which scales the scores first, and matches the fp64 reference."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 65, 2, 16, generator=g) for _ in range(3))
    q = q * 1e-19
    k = k * 1e-19
    out = softmax_attn(q, k, v, causal=True, scale=3.0e38)
    ref = softmax_attn_reference(q.double(), k.double(), v.double(), causal=True, scale=3.0e38)
    assert torch.isfinite(out).all() and rel_err(out.double(), ref) < 1e-5
