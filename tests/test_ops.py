"""Fast ops against their quadratic references (spec §1.1, §2, §13)."""

import pytest
import torch

from conftest import rel_err
from transnormer.ops import (
    block_attn,
    block_attn_reference,
    norm_linear_attn,
    norm_linear_attn_reference,
    norm_linear_attn_step,
    softmax_attn,
)
from transnormer.ops.lrpe import lrpe_feature_map


def qkv(B, T, H, D, E=None, dtype=torch.float64, positive=False, requires_grad=False):
    E = E or D
    q, k, v = torch.randn(B, T, H, D, dtype=dtype), torch.randn(B, T, H, D, dtype=dtype), torch.randn(B, T, H, E, dtype=dtype)
    if positive:
        q, k = 1 + torch.nn.functional.elu(q), 1 + torch.nn.functional.elu(k)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_causal_chunked_matches_reference_fp64(T, chunk, backend):
    if chunk == 1 and T == 1000:
        pytest.skip("chunk 1 at T=1000 is slow and covered by smaller T")
    q, k, v = qkv(2, T, 2, 8, 6, requires_grad=True)
    S0 = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    o, s = norm_linear_attn(q, k, v, causal=True, chunk_size=chunk, initial_state=S0, output_final_state=True)
    o_ref, s_ref = norm_linear_attn_reference(q, k, v, causal=True, initial_state=S0)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10
    g = torch.randn_like(o)
    grads = torch.autograd.grad((o * g).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((o_ref * g).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_causal_chunked_gpu_scan_matches_reference_fp64(T, monkeypatch):
    """The PyTorch form with the scan used off CPU (one cumsum, ops/_chunked.py): forward, final
    state and every gradient, the initial state's included, against the quadratic reference."""
    from transnormer.ops import _chunked, _native

    monkeypatch.setattr(_chunked, "_exclusive_scan", _chunked._exclusive_scan_cumsum)
    monkeypatch.setattr(_native, "_mode", "torch")
    q, k, v = qkv(2, T, 2, 8, 6, requires_grad=True)
    S0 = torch.randn(2, 2, 8, 6, dtype=torch.float64, requires_grad=True)
    o, s = norm_linear_attn(q, k, v, causal=True, chunk_size=16, initial_state=S0, output_final_state=True)
    o_ref, s_ref = norm_linear_attn_reference(q, k, v, causal=True, initial_state=S0)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10
    go, gs = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad((o * go).sum() + (s * gs).sum(), (q, k, v, S0))
    grads_ref = torch.autograd.grad((o_ref * go).sum() + (s_ref * gs).sum(), (q, k, v, S0))
    for a, b in zip(grads, grads_ref):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
def test_causal_chunked_fp32_within_1e4(T, backend):
    q, k, v = qkv(1, T, 2, 64, dtype=torch.float32, positive=True)
    o, _ = norm_linear_attn(q, k, v, causal=True)
    o_ref, _ = norm_linear_attn_reference(q.double(), k.double(), v.double(), causal=True)
    assert rel_err(o.double(), o_ref) < 1e-4


def test_chunk_equal_to_length_and_longer(backend):
    q, k, v = qkv(1, 50, 1, 4)
    ref, _ = norm_linear_attn_reference(q, k, v, causal=True)
    for c in (50, 200):
        o, _ = norm_linear_attn(q, k, v, causal=True, chunk_size=c)
        assert rel_err(o, ref) < 1e-12


def test_second_derivatives_raise_rather_than_read_zero(backend):
    # once_differentiable had let autograd.grad(..., allow_unused=True), hvp and hessian read a zero
    # second derivative through the hand-written backwards
    q, k, v = qkv(1, 7, 2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="has no second derivative"):
        torch.autograd.grad(norm_linear_attn(q, k, v, causal=True)[0].pow(2).sum(), (q,), create_graph=True)
    u = torch.randn_like(q)

    def hvp(fn):
        return torch.autograd.functional.hvp(lambda q: fn(q, k, v, causal=False)[0].pow(2).sum(), q, u)[1]

    if backend == "native":
        with pytest.raises(RuntimeError, match="has no second derivative"):
            hvp(norm_linear_attn)
    else:  # the bidirectional PyTorch form is two products: twice differentiable, as the reference
        torch.testing.assert_close(hvp(norm_linear_attn), hvp(norm_linear_attn_reference))


def test_gradcheck_small(backend):
    q, k, v = qkv(1, 7, 2, 3, requires_grad=True)
    S0 = torch.randn(1, 2, 3, 3, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, S0):
        o, s = norm_linear_attn(q, k, v, causal=True, chunk_size=3, initial_state=S0, output_final_state=True)
        return o, s

    assert torch.autograd.gradcheck(f, (q, k, v, S0))
    assert torch.autograd.gradcheck(lambda q, k, v: norm_linear_attn(q, k, v, causal=False)[0], (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: block_attn(q, k, v, block_size=3, causal=True, kernel="softmax"), (q, k, v))
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.autograd.gradcheck(
        lambda q, k, v: block_attn(q, k, v, block_size=4, causal=False, kernel="relu", key_padding_mask=mask), (q, k, v))


def test_bidirectional_equals_reference_with_padding():
    q, k, v = qkv(2, 37, 3, 8)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, 30:] = False
    o, s = norm_linear_attn(q, k, v, causal=False, key_padding_mask=mask, output_final_state=True)
    o_ref, s_ref = norm_linear_attn_reference(q, k, v, causal=False, key_padding_mask=mask)
    assert rel_err(o, o_ref) < 1e-12 and rel_err(s, s_ref) < 1e-12
    # padded keys contribute nothing: equals running the short sequence alone
    o_short, _ = norm_linear_attn(q[1:, :30], k[1:, :30], v[1:, :30], causal=False)
    assert rel_err(o[1:, :30], o_short) < 1e-12


@pytest.mark.parametrize("split", [0, 1, 17, 64, 99, 100])
def test_state_chaining_any_split(split, backend):
    q, k, v = qkv(2, 100, 2, 8)
    whole, s_whole = norm_linear_attn(q, k, v, causal=True, chunk_size=16, output_final_state=True)
    a, sa = norm_linear_attn(q[:, :split], k[:, :split], v[:, :split], causal=True, chunk_size=16, output_final_state=True)
    b, sb = norm_linear_attn(q[:, split:], k[:, split:], v[:, split:], causal=True, chunk_size=16,
                             initial_state=sa, output_final_state=True)
    assert rel_err(torch.cat([a, b], 1), whole) < 1e-12
    assert rel_err(sb, s_whole) < 1e-12


def test_step_loop_equals_parallel_and_masks(backend):
    q, k, v = qkv(2, 40, 2, 8)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :5] = False  # left padding in row 0
    o_par, s_par = norm_linear_attn(q, k, v, causal=True, key_padding_mask=mask, output_final_state=True)
    state, outs = None, []
    for t in range(40):
        o, state = norm_linear_attn_step(q[:, t], k[:, t], v[:, t], state, key_padding_mask=mask[:, t])
        outs.append(o)
    assert rel_err(torch.stack(outs, 1), o_par) < 1e-12
    assert rel_err(state, s_par) < 1e-12


@pytest.mark.parametrize("causal", [True, False])
def test_bf16_state_kept_in_fp32(causal, backend):
    """The returned state is fp32: the kernels' exact fp32 sum; the PyTorch form's fp32 sum of
    per-chunk products that its bf16 GEMMs round (docs/ARCHITECTURE.md, Precision)."""
    # (heads of 32: the bf16 kernels tile D and E by 32, and backend "native" refuses what they cannot)
    q, k, v = qkv(1, 130, 2, 32, dtype=torch.bfloat16, positive=True)
    o, s = norm_linear_attn(q, k, v, causal=causal, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    ref, _ = norm_linear_attn_reference(q.double(), k.double(), v.double(), causal=causal)
    assert rel_err(o.double(), ref) < 3e-2
    limit = 1e-5 if backend == "native" else 5e-3
    assert rel_err(s.double(), torch.einsum("bthd,bthe->bhde", k.double(), v.double())) < limit


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,w", [(1, 4), (63, 16), (64, 16), (65, 16), (70, 64), (10, 64)])
def test_block_attn_matches_reference(kernel, causal, T, w):
    q, k, v = qkv(2, T, 2, 8, 5, requires_grad=True)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, max(1, T - 7):] = False  # right padding
    if T > 3:
        mask[0, :3] = False  # leading padding: rows with no allowed key in causal mode
    o = block_attn(q, k, v, block_size=w, causal=causal, kernel=kernel, key_padding_mask=mask)
    ref = block_attn_reference(q, k, v, block_size=w, causal=causal, kernel=kernel, key_padding_mask=mask)
    assert torch.isfinite(o).all()
    assert rel_err(o, ref) < 1e-10
    g = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad((o * g).sum(), (q, k, v)), torch.autograd.grad((ref * g).sum(), (q, k, v))):
        assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,w", [(1, 4), (63, 16), (65, 16), (70, 64)])
@pytest.mark.parametrize("padded", [False, True])
def test_block_attn_explicit_softmax_path(monkeypatch, causal, T, w, padded):
    """The bf16 CPU route (explicit matmuls + fp32 softmax) forced on fp64 against the reference."""
    import transnormer.ops.block as block_mod

    monkeypatch.setattr(block_mod, "_SDPA_CPU_DTYPES", ())
    q, k, v = qkv(2, T, 2, 8, 5, requires_grad=True)
    mask = None
    if padded:
        mask = torch.ones(2, T, dtype=torch.bool)
        mask[1, max(1, T - 7):] = False
        if T > 3:
            mask[0, :3] = False
    o = block_attn(q, k, v, block_size=w, causal=causal, key_padding_mask=mask)
    ref = block_attn_reference(q, k, v, block_size=w, causal=causal, key_padding_mask=mask)
    assert torch.isfinite(o).all() and rel_err(o, ref) < 1e-10
    g = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad((o * g).sum(), (q, k, v)), torch.autograd.grad((ref * g).sum(), (q, k, v))):
        assert torch.isfinite(a).all() and (a - b).abs().max() < 1e-10


def test_block_attn_bf16_close_to_reference():
    q, k, v = qkv(1, 130, 2, 16, dtype=torch.float32)
    o = block_attn(q.bfloat16(), k.bfloat16(), v.bfloat16(), block_size=64, causal=True)
    ref = block_attn_reference(q.double(), k.double(), v.double(), block_size=64, causal=True)
    assert o.dtype == torch.bfloat16 and rel_err(o.double(), ref) < 3e-2


def test_block_attn_padded_key_takes_no_softmax_mass():
    q, k, v = qkv(1, 10, 1, 4)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 8:] = False
    o = block_attn(q, k, v, block_size=16, causal=False, key_padding_mask=mask)
    o_short = block_attn(q[:, :8], k[:, :8], v[:, :8], block_size=16, causal=False)
    assert rel_err(o[:, :8], o_short) < 1e-12
    # the ragged last block (T=10, w=4) is masked too: block [8,10) sees only its 2 keys
    o2 = block_attn(q, k, v, block_size=4, causal=False)
    o_last = block_attn(q[:, 8:], k[:, 8:], v[:, 8:], block_size=4, causal=False)
    assert rel_err(o2[:, 8:], o_last) < 1e-12


def test_reference_returns_weights():
    q, k, v = qkv(1, 9, 2, 4)
    o, p = block_attn_reference(q, k, v, block_size=4, causal=True, return_weights=True)
    assert p.shape == (1, 2, 9, 9)
    assert torch.allclose(p.sum(-1), torch.ones(1, 2, 9, dtype=p.dtype))
    _, _, s = norm_linear_attn_reference(q, k, v, causal=True, return_weights=True)
    assert s.shape == (1, 2, 9, 9) and (s.triu(1) == 0).all()


@pytest.mark.parametrize(
    "call,exc,word",
    [
        (lambda q, k, v: norm_linear_attn(q[0], k[0], v[0], causal=True), ValueError, "q"),
        (lambda q, k, v: norm_linear_attn(q, k[:, :, :1], v, causal=True), ValueError, "same shape"),
        (lambda q, k, v: norm_linear_attn(q, k, v[:, :, :1], causal=True), ValueError, "heads"),
        (lambda q, k, v: norm_linear_attn(q.long(), k, v, causal=True), TypeError, "floating"),
        (lambda q, k, v: norm_linear_attn(q, k, v, causal=True, chunk_size=0), ValueError, "chunk_size"),
        (lambda q, k, v: norm_linear_attn(q, k, v, causal=True, initial_state=torch.zeros(1)), ValueError, "initial_state"),
        (lambda q, k, v: block_attn(q, k, v, causal=True, block_size=0), ValueError, "block_size"),
        (lambda q, k, v: block_attn(q, k, v, causal=True, kernel="tanh"), ValueError, "kernel"),
        (lambda q, k, v: block_attn(q, k, v, causal=True, key_padding_mask=torch.ones(3, 3)), ValueError, "key_padding_mask"),
        (lambda q, k, v: norm_linear_attn_step(q, k, v, None), ValueError, "[B, H, D]"),
        # dropout_p < 0 had meant no dropout; > 1 and softmax's "do not support dropout" named no argument
        (lambda q, k, v: block_attn(q, k, v, causal=True, kernel="relu", dropout_p=-0.1), ValueError, "dropout_p"),
        (lambda q, k, v: softmax_attn(q, k, v, causal=True, dropout_p=1.5), ValueError, "dropout_p"),
        (lambda q, k, v: softmax_attn(q, k, v, causal=True, dropout_p=True), TypeError, "dropout_p"),
        # a non-finite scale made every output NaN
        (lambda q, k, v: softmax_attn(q, k, v, causal=True, scale=float("nan")), ValueError, "scale must be finite"),
        (lambda q, k, v: block_attn(q, k, v, causal=True, scale=float("inf")), ValueError, "scale must be finite"),
        (lambda q, k, v: block_attn_reference(q, k, v, causal=True, block_size=0), ValueError, "block_size"),
        (lambda q, k, v: lrpe_feature_map(q, [[1.0]], None), TypeError, "cos must be a floating-point"),
        (lambda q, k, v: lrpe_feature_map(q, q[..., 0, :2], None), TypeError, "sin must be a floating-point"),
        (lambda q, k, v: lrpe_feature_map(q, q[..., 0, :2], q[..., 0, :2], scale=float("nan")), ValueError,
         "scale must be finite"),
        (lambda q, k, v: block_attn_reference(q, k, v, causal=True, scale=float("inf")), ValueError,
         "scale must be finite"),
    ],
)
def test_bad_input_errors(call, exc, word):
    q, k, v = qkv(1, 5, 2, 4)
    with pytest.raises(exc, match=word.replace("[", r"\[").replace("]", r"\]")):
        call(q, k, v)


@pytest.mark.parametrize("causal", [True, False])
def test_autocast_leaves_the_op_in_its_inputs_dtype(causal, backend):
    """Under CPU autocast every path (kernels, PyTorch forms, causal or not) computes in the inputs'
    dtype with an fp32 state: the layers, not the op, decide the precision."""
    q, k, v = qkv(2, 64, 2, 32, dtype=torch.float32)
    plain, s_plain = norm_linear_attn(q, k, v, causal=causal, output_final_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = norm_linear_attn(q, k, v, causal=causal, output_final_state=True)
    assert o.dtype == s.dtype == torch.float32
    assert rel_err(o, plain) < 1e-6 and rel_err(s, s_plain) < 1e-6


def test_step_mask_is_checked_and_taken_as_bool():
    from transnormer.ops import norm_linear_attn_step

    q = k = v = torch.ones(2, 1, 2, dtype=torch.float64)
    o, _ = norm_linear_attn_step(q, k, v, None, key_padding_mask=torch.tensor([2, 0]))
    assert torch.equal(o[:, 0], torch.tensor([[2.0, 2.0], [0.0, 0.0]], dtype=torch.float64))  # 2 = valid, not x2
    with pytest.raises(TypeError, match="key_padding_mask must be bool or integer"):
        norm_linear_attn_step(q, k, v, None, key_padding_mask=torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"\[B\] for one step"):
        norm_linear_attn_step(q, k, v, None, key_padding_mask=torch.ones(2, 1, dtype=torch.bool))


def test_step_refuses_mixed_dtypes():
    """As norm_linear_attn does: a k in fp64 had been rounded to q's fp32 without a word."""
    q, k, v = (torch.rand(2, 2, 3) for _ in range(3))
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        norm_linear_attn_step(q, k.double(), v, None)


def test_lrpe_feature_map_refuses_integer_input():
    from transnormer.ops.lrpe import lrpe_feature_map

    cos = sin = torch.ones(1, 5, 2)
    with pytest.raises(TypeError, match="x must be a floating-point torch.Tensor"):
        lrpe_feature_map(torch.ones(1, 5, 2, 4, dtype=torch.long), cos, sin)


@pytest.mark.parametrize("causal", [True, False])
def test_non_finite_values_at_padded_positions_stay_out(causal):
    """Padded keys are masked in every op, also when they hold inf/NaN (k·0 = NaN had reached every
    real query through the state or the 0-weighted sum)."""
    from transnormer.ops import block_attn, softmax_attn

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 70, 2, 16) for _ in range(3))
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, 60:] = False
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, 65], v_bad[1, 66] = float("inf"), float("nan")
    ops = (lambda k, v: norm_linear_attn(q, k, v, causal=causal, key_padding_mask=mask)[0],
           lambda k, v: block_attn(q, k, v, causal=causal, block_size=16, key_padding_mask=mask),
           lambda k, v: softmax_attn(q, k, v, causal=causal, key_padding_mask=mask))
    for op in ops:
        assert torch.equal(op(k_bad, v_bad)[mask], op(k, v)[mask])
    state = torch.zeros(2, 2, 16, 16)
    o, s = norm_linear_attn_step(q[:, 0], k_bad[:, 65], v_bad[:, 66], state, key_padding_mask=torch.tensor([1, 0]))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()


@pytest.mark.parametrize("causal", [True, False])
def test_fp16_state_sums_past_fp16_range(causal):
    """fp16 inputs: the state (Σ kᵀv, 131072 here) is fp32, and had been read back in fp16 for
    Q S (inf from row 2048 causal, every row bidirectional, the returned state inf too), though
    the output itself (2098) fits fp16."""
    q = torch.full((1, 4096, 1, 16), 1e-3).half()
    k = torch.full((1, 4096, 1, 16), 32.0).half()
    v = torch.ones(1, 4096, 1, 16).half()
    o, state = norm_linear_attn(q, k, v, causal=causal, output_final_state=True)
    ref = norm_linear_attn_reference(q.double(), k.double(), v.double(), causal=causal)[0]
    assert o.dtype == torch.float16 and state.dtype == torch.float32
    assert rel_err(o.double(), ref) < 2e-3 and float(state.max()) == 4096 * 32


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_fp16_block_scores_past_fp16_range_before_scaling(kernel):
    """q·k = 102400 leaves fp16 where the scaled score (12800) fits: the explicit form scaled after
    the product and read inf (NaN out)."""
    torch.manual_seed(0)
    q = k = torch.full((1, 8, 1, 64), 40.0).half()
    v = (0.5 * torch.randn(1, 8, 1, 64)).half()  # relu: Σ 12800 v stays inside fp16
    o = block_attn(q, k, v, block_size=8, causal=False, kernel=kernel)
    ref = block_attn_reference(q.double(), k.double(), v.double(), block_size=8, causal=False, kernel=kernel)
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
    assert rel_err(o.double(), ref) < 2e-3
    with torch.autocast("cpu", dtype=torch.float16):  # which would cast the fp32 products back
        o = block_attn(q, k, v, block_size=8, causal=False, kernel=kernel)
        o32 = block_attn(q.float(), k.float(), v.float(), block_size=8, causal=False, kernel=kernel)  # fp32 in
    for got in (o, o32):
        assert got.dtype == torch.float16 and torch.isfinite(got).all() and rel_err(got.double(), ref) < 2e-3


@pytest.mark.parametrize("causal", [True, False])
def test_an_empty_sequence_stays_in_the_graph(causal):
    """T = 0: the causal form returned a fresh zeros tensor, so a loss over it could not be
    backpropagated (the bidirectional form could)."""
    q, k, v = qkv(2, 0, 2, 4, E=3, requires_grad=True)
    o, state = norm_linear_attn(q, k, v, causal=causal, output_final_state=True)
    assert o.shape == (2, 0, 2, 3) and o.requires_grad and state.shape == (2, 2, 4, 3)
    o.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


def test_simple_rms_norm_of_no_features():
    from transnormer.ops.rowwise import simple_rms_norm

    x = torch.randn(3, 0, requires_grad=True)  # had raised ZeroDivisionError (D^-1/2)
    y = simple_rms_norm(x, 1e-8)
    y.sum().backward()
    assert y.shape == (3, 0) and x.grad.shape == (3, 0)


@pytest.mark.parametrize("G", [0, 1, 3])
@pytest.mark.parametrize("reverse", [False, True])
def test_the_two_prefix_scans_agree_on_any_chunk_count(G, reverse):
    """The cumsum scan (off CPU) against the loop (CPU), with an initial state; G = 0 had left the
    cumsum form one chunk of output where there is none."""
    from transnormer.ops import _chunked

    g = torch.Generator().manual_seed(G)
    x = torch.randn(2, G, 3, 4, dtype=torch.float64, generator=g)
    init = torch.randn(2, 3, 4, dtype=torch.float64, generator=g)
    out_loop, total_loop = _chunked._exclusive_scan(x, init, reverse)
    out_cumsum, total_cumsum = _chunked._exclusive_scan_cumsum(x, init, reverse)
    assert out_cumsum.shape == out_loop.shape == x.shape
    assert torch.allclose(out_cumsum, out_loop) and torch.allclose(total_cumsum, total_loop)
