"""The fused chunked LM-head loss against F.cross_entropy on materialised logits."""

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from transnormer.models import TransNormerConfig, TransNormerForCausalLM, TransNormerForMaskedLM
from transnormer.modules import lm_loss
from transnormer.modules.lm_loss import linear_cross_entropy
from transnormer.ops import _native, dense


@pytest.mark.parametrize("N", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("chunk", [1, 64, 1000])
def test_matches_unfused_loss_and_grads_fp64(N, chunk):
    h = torch.randn(N, 16, dtype=torch.float64, requires_grad=True)
    W = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (N,))
    labels[1::3] = -100  # some ignored rows (none when N == 1)
    got = linear_cross_entropy(h, W, labels, chunk_size=chunk)
    ref = F.cross_entropy(h @ W.T, labels, ignore_index=-100)
    assert rel_err(got, ref) < 1e-12
    for a, b in zip(torch.autograd.grad(got * 1.7, (h, W)), torch.autograd.grad(ref * 1.7, (h, W))):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("form", ["native", "torch"])
@pytest.mark.parametrize("offset", [300.0, 1e4, -1e4])
def test_the_loss_keeps_its_digits_at_large_logits(form, offset):
    """The loss term was lse − target with lse rounded to fp32 first: logits ~1e4 lost the loss's
    low digits (relative error 1e-5 to 1e-4, both forms; F.cross_entropy holds 1e-8)."""
    if form == "native" and _native.load() is None:
        pytest.skip("fused CPU kernels unavailable")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 33, dtype=torch.float64, generator=g) + offset
    labels = torch.randint(0, 33, (7,), generator=g)
    before = _native.backend()
    try:
        _native.set_backend(form)
        got = linear_cross_entropy(torch.eye(7), logits.float().t().contiguous(), labels)  # h = I: logits = Wᵀ
    finally:
        _native.set_backend(before)
    ref = F.cross_entropy(logits.float().double(), labels)  # the exact loss of the fp32 logits
    assert rel_err(got.double(), ref) < 1e-6


@pytest.mark.parametrize("choice", ["onednn", "mkl"])
@pytest.mark.parametrize("N, chunk", [(1, 64), (65, 64), (300, 128)])
def test_fp32_products_on_either_gemm_match_fp64(monkeypatch, choice, N, chunk):
    # TRANSNORMER_FP32_GEMM=onednn: the three products on oneDNN (dW from a transposed gradient block)
    monkeypatch.setenv("TRANSNORMER_FP32_GEMM", choice)
    products = []
    real = dense._inner
    monkeypatch.setattr(dense, "_inner", lambda *a: products.append(a[0].shape) or real(*a))
    h = torch.randn(N, 24, requires_grad=True)
    W = torch.randn(70, 24, requires_grad=True)
    labels = torch.randint(0, 70, (N,))
    labels[1::4] = -100
    got = linear_cross_entropy(h, W, labels, chunk_size=chunk)
    grads = torch.autograd.grad(got * 1.3, (h, W))
    chunks = -(-N // chunk)
    expect_onednn = choice == "onednn" and dense.onednn_fp32() and _native.rows_usable(torch.float32, h.device)
    assert len(products) == (3 * chunks if expect_onednn else 0)
    hd, Wd = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    ref = F.cross_entropy(hd @ Wd.T, labels, ignore_index=-100)
    assert got.dtype == torch.float32 and rel_err(got.double(), ref) < 1e-6
    for a, b in zip(grads, torch.autograd.grad(ref * 1.3, (hd, Wd))):
        assert a.dtype == torch.float32 and rel_err(a.double(), b) < 1e-5


@pytest.mark.skipif(not dense.onednn_available(), reason="this PyTorch has no oneDNN inner product")
def test_onednn_head_with_a_strided_input_a_bf16_weight_or_a_frozen_one(monkeypatch):
    monkeypatch.setenv("TRANSNORMER_FP32_GEMM", "onednn")
    flags = []
    real = lm_loss._default_chunk
    monkeypatch.setattr(lm_loss, "_default_chunk", lambda *a: flags.append(a[2]) or real(*a))
    base = torch.randn(24, 130)
    labels = torch.randint(0, 70, (130,))
    for W in (torch.randn(70, 24).bfloat16().requires_grad_(), torch.randn(70, 24)):
        h = base.t().requires_grad_()  # [130, 24], not contiguous
        got = linear_cross_entropy(h, W, labels)
        wants = (h, W) if W.requires_grad else (h,)
        grads = torch.autograd.grad(got, wants)
        # the default chunk is sized for the path the forward takes (the block's transposed copy)
        assert flags[-1] == (dense.onednn_fp32() and _native.rows_usable(torch.float32, h.device))
        hd, Wd = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
        ref = F.cross_entropy(hd @ Wd.T, labels)
        assert rel_err(got.double(), ref) < 1e-6
        for a, b in zip(grads, torch.autograd.grad(ref, (hd, Wd)[:len(wants)])):
            assert a.dtype == W.dtype if a.shape == W.shape else a.dtype == torch.float32
            assert rel_err(a.double(), b) < (1e-2 if a.dtype == torch.bfloat16 else 1e-5)


def test_default_chunks_fill_the_documented_blocks():
    assert lm_loss._default_chunk(32768) == 2048 and lm_loss._default_chunk(32768, True) == 4096
    assert lm_loss._default_chunk(32768, False, True) == 1024 and lm_loss._default_chunk(2**30, False, True) == 64


def test_all_rows_ignored_is_nan_like_cross_entropy():
    h, W = torch.randn(4, 8), torch.randn(10, 8)
    labels = torch.full((4,), -100)
    assert torch.isnan(linear_cross_entropy(h, W, labels)) and torch.isnan(F.cross_entropy(h @ W.T, labels))


def test_bf16_autocast_close_to_fp32():
    h, W = torch.randn(200, 32, requires_grad=True), torch.randn(300, 32, requires_grad=True)
    labels = torch.randint(0, 300, (200,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, W, labels, chunk_size=64)
    ref = F.cross_entropy(h @ W.T, labels)
    assert got.dtype == torch.float32 and abs(got.item() - ref.item()) < 2e-2 * ref.item()
    gh, gW = torch.autograd.grad(got, (h, W))
    assert gh.dtype == torch.float32 and gW.dtype == torch.float32


def test_bad_input():
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="h must be"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 7), torch.zeros(4, dtype=torch.long))
    for bad in (0, True):  # True had passed as the int 1 and failed in a view()
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), chunk_size=bad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_labels_out_of_range_raise_like_cross_entropy(dtype):
    # a negative label that is not ignore_index used to be scored silently as class 0
    h, W = torch.randn(4, 8, dtype=dtype), torch.randn(10, 8, dtype=dtype)
    for bad in (-1, 10):
        labels = torch.tensor([1, bad, 2, 3])
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
            linear_cross_entropy(h, W, labels)


def test_bool_labels_are_refused_like_cross_entropy():
    # True/False had been scored as classes 1 and 0 (F.cross_entropy refuses a bool target)
    with pytest.raises(ValueError, match="labels must be integer"):
        linear_cross_entropy(torch.randn(3, 8), torch.randn(10, 8), torch.tensor([True, False, True]))


@pytest.mark.parametrize("ignore_index", [-100, 0, 7, 50, -5])
def test_any_ignore_index_is_accepted(ignore_index):
    # an ignore_index at or beyond V used to reach the gather (or the fused rows) as a class index
    h = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    W = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(1, 7, (9,))
    labels[::2] = ignore_index
    got = linear_cross_entropy(h, W, labels, ignore_index=ignore_index, chunk_size=4)
    ref = F.cross_entropy(h @ W.T, labels, ignore_index=ignore_index)
    assert rel_err(got, ref) < 1e-12
    for a, b in zip(torch.autograd.grad(got, (h, W)), torch.autograd.grad(ref, (h, W))):
        assert rel_err(a, b) < 1e-12


def test_ignore_index_beyond_vocab_in_the_fused_bf16_rows():
    h, W = torch.randn(6, 32), torch.randn(40, 32)
    labels = torch.tensor([3, 500, 5, 500, 0, 39])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, W, labels, ignore_index=500)
    ref = F.cross_entropy(h @ W.T, labels, ignore_index=500)
    assert abs(got.item() - ref.item()) < 2e-2 * ref.item()


def _tiny(causal):
    return TransNormerConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             layer_types=["diag", "norm"], causal=causal, block_size=8, chunk_size=8,
                             max_position_embeddings=64, dropout=0.0)


@pytest.mark.parametrize("cls,causal", [(TransNormerForCausalLM, True), (TransNormerForMaskedLM, False)])
def test_models_give_the_same_loss_and_grads_without_logits(cls, causal):
    model = cls(_tiny(causal)).double()
    ids = torch.randint(0, 97, (2, 30))
    labels = ids.clone()
    if not causal:
        labels[torch.rand(2, 30) > 0.3] = -100
    full = model(input_ids=ids, labels=labels)
    g_full = torch.autograd.grad(full.loss, list(model.parameters()))
    fused = model(input_ids=ids, labels=labels, return_logits=False)
    assert fused.logits is None and rel_err(fused.loss, full.loss) < 1e-12
    g_fused = torch.autograd.grad(fused.loss, list(model.parameters()))
    for a, b in zip(g_fused, g_full):
        assert rel_err(a, b) < 1e-10


def test_second_backward_raises_clearly():
    h, W = torch.randn(5, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    loss = linear_cross_entropy(h, W, torch.randint(0, 10, (5,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="used up"):
        loss.backward()


def test_a_call_under_inference_mode_leaves_training_calls_working():
    """The loss keeps scratch buffers across calls; one first made under inference_mode must still
    be writable by the training steps after it (an evaluation before training)."""
    from transnormer.modules import lm_loss

    lm_loss._SCRATCH.clear()
    h, w = torch.randn(8, 16), torch.randn(32, 16)
    labels = torch.randint(0, 32, (8,))
    with torch.inference_mode():
        evaluated = linear_cross_entropy(h, w, labels)
    h = h.requires_grad_()
    loss = linear_cross_entropy(h, w, labels)
    loss.backward()
    assert torch.equal(loss.detach(), evaluated) and h.grad is not None


@pytest.mark.parametrize("gemm", ["onednn", "mkl"])
@pytest.mark.parametrize("frozen", ["weight", "h"])
def test_only_the_gradient_asked_for_is_computed(monkeypatch, gemm, frozen):
    """A frozen weight gets no dW product, an h that needs no gradient no dh product (on either
    GEMM path); the gradient that is asked for matches F.cross_entropy's in fp64."""
    monkeypatch.setenv("TRANSNORMER_FP32_GEMM", gemm)
    calls = []
    for name in ("mm_t", "mm_t_add"):
        real = getattr(dense, name)
        monkeypatch.setattr(dense, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    real_mm, real_addmm = torch.mm, torch.Tensor.addmm_
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append("mm") or real_mm(*a, **k))
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda *a, **k: calls.append("addmm_") or real_addmm(*a, **k))
    h, W = torch.randn(37, 16, requires_grad=frozen == "weight"), torch.randn(29, 16, requires_grad=frozen == "h")
    labels = torch.randint(0, 29, (37,))
    loss = linear_cross_entropy(h, W, labels, chunk_size=16)  # three chunks
    forward_calls = len(calls)
    leaf = h if frozen == "weight" else W
    (got,) = torch.autograd.grad(loss, (leaf,))
    assert len(calls) == forward_calls  # the products all ran in the forward
    assert forward_calls == 3 * 2  # per chunk: the logits and the one gradient product
    hd, Wd = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    ref = F.cross_entropy(hd @ Wd.T, labels)
    (want,) = torch.autograd.grad(ref, (hd if frozen == "weight" else Wd,))
    assert rel_err(got.double(), want) < 1e-5


@pytest.mark.parametrize("rows", [0, 4])
def test_no_counted_row_gives_zero_gradients_like_cross_entropy(rows):
    """Every row ignored (or no rows): the loss is nan as F.cross_entropy's (0/0), and the
    gradients are zeros as its are, not 0 * inf."""
    h, W = torch.randn(rows, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    labels = torch.full((rows,), -100)
    loss = linear_cross_entropy(h, W, labels)
    gh, gW = torch.autograd.grad(loss, (h, W))
    hr, Wr = h.detach().requires_grad_(), W.detach().requires_grad_()
    ref = F.cross_entropy(hr @ Wr.T, labels)
    rh, rW = torch.autograd.grad(ref, (hr, Wr))
    assert torch.isnan(loss) and torch.isnan(ref)
    assert torch.equal(gh, rh) and torch.equal(gW, rW) and not gW.isnan().any()


def test_a_second_derivative_is_refused_not_zero():
    """The gradients are computed in the forward without a graph: under create_graph=True a
    gradient penalty through them had silently read 0."""
    h, w = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 11, (5,)))
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, h, create_graph=True)
