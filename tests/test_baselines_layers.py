"""Baseline layers: decoding caches, positional biases, Performer features, padding rules, errors."""

import pytest
import torch

from conftest import rel_err, sharpen_gau
from transnormer.layers import (
    FLASH,
    GAU,
    CosFormerAttention,
    DiagAttention,
    LinearAttention,
    NormAttention,
    Performer,
    RelativePositionBias,
    SoftmaxAttention,
)
from transnormer.layers.gau import t5_bucket
from transnormer.models import TransNormerConfig, TransNormerForCausalLM

GATED = dict(expansion=2, qk_dim=16)
DECODE_CASES = {
    "softmax": ("softmax", {}),
    "softmax-rope": ("softmax", {"rope": True}),
    "linear_elu": ("linear_elu", {}),
    "linear_elu-noscale": ("linear_elu", {"denominator": False}),
    "performer": ("performer", {}),
    "cosformer": ("cosformer", {}),
    "gau-fixed": ("gau", {"normalizer": "fixed", "fixed_len": 64, **GATED}),
    "gau-visible-t5": ("gau", {"normalizer": "visible", "rel_bias": "t5", **GATED}),
    "flash": ("flash", {"chunk_size": 8, **GATED}),
    "flash-chunk-ropebias": ("flash", {"chunk_size": 8, "normalizer": "chunk", "rel_bias": "rope_bias", **GATED}),
}


def small_lm(kind, opts, layers=2):
    gated = kind in ("gau", "flash")
    return TransNormerConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, chunk_size=8,
        layer_types=[kind] * layers, layer_options={kind: opts}, dropout=0.0, max_position_embeddings=256,
        norm_type="scale" if gated else "simple_rms", abs_pos="scaled_sinusoid" if gated else "sinusoidal",
    )


def sharpen(model):
    return sharpen_gau(model, beta_std=0.3)


def decode(model, ids, prompt_len, mask=None):
    out = model(ids[:, :prompt_len], attention_mask=None if mask is None else mask[:, :prompt_len], use_cache=True)
    cache, logits = out.past_key_values, [out.logits]
    for t in range(prompt_len, ids.shape[1]):
        step_mask = None if mask is None else mask[:, :t + 1]
        out = model(ids[:, t:t + 1], attention_mask=step_mask, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_equals_full_forward(case):
    """Prefill + token-by-token logits == the full forward; prompts end before/on/after chunk 8."""
    torch.manual_seed(0)
    kind, opts = DECODE_CASES[case]
    model = sharpen(TransNormerForCausalLM(small_lm(kind, opts))).eval()
    x = torch.randint(0, 97, (2, 20))
    full = model(x).logits
    for prompt_len in (5, 8, 9, 16):
        assert torch.allclose(decode(model, x, prompt_len), full, atol=1e-4), prompt_len


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_multi_token_continuation_with_cache(case):
    """A cached call with T > 1 (prefill 7, then 9 at once across chunk 8/16, then steps)."""
    torch.manual_seed(0)
    kind, opts = DECODE_CASES[case]
    model = sharpen(TransNormerForCausalLM(small_lm(kind, opts))).eval()
    x = torch.randint(0, 97, (2, 20))
    full = model(x).logits
    logits, cache = [], None
    for a, b in ((0, 7), (7, 16), (16, 17), (17, 20)):
        out = model(x[:, a:b], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits)
    assert torch.allclose(torch.cat(logits, 1), full, atol=1e-4)


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_padded_batch_equals_each_row_alone(case):
    """Left-padded prompts of different lengths: after the prefill the rows hold padding holes."""
    torch.manual_seed(0)
    kind, opts = DECODE_CASES[case]
    model = sharpen(TransNormerForCausalLM(small_lm(kind, opts))).eval()
    a, b = torch.randint(3, 97, (1, 22)), torch.randint(3, 97, (1, 17))
    ids = torch.zeros(2, 22, dtype=torch.long)
    mask = torch.ones(2, 22, dtype=torch.long)
    ids[0], ids[1, 5:], mask[1, :5] = a[0], b[0], 0  # row 1: 5 pads, prompt of 6 real tokens
    got = decode(model, ids, 11, mask)
    assert torch.allclose(got[0], model(a).logits[0], atol=1e-4)
    assert torch.allclose(got[1, 5:], model(b).logits[0], atol=1e-4)


def test_performer_layer_no_causal_leak():
    torch.manual_seed(0)
    layer = Performer(32, 4, causal=True, chunk_size=16).double().eval()
    x = torch.randn(1, 100, 32, dtype=torch.float64)
    base, _ = layer(x)
    x2 = x.clone()
    x2[:, 80] *= 20.0
    assert (layer(x2)[0][:, :80] - base[:, :80]).abs().max() == 0.0


def test_performer_redraw_seeded_and_saved():
    layer = Performer(32, 4, causal=False, feature_seed=5, redraw_interval=3)
    assert layer.num_features == int(8 * torch.log(torch.tensor(8.0)))
    p0 = layer.proj.clone()
    layer.redraw_features(seed=123)
    p123 = layer.proj.clone()
    layer.redraw_features(seed=123)
    assert torch.equal(layer.proj, p123) and not torch.equal(p123, p0)
    # interval: a redraw before the 4th training call, none in eval
    fresh = Performer(32, 4, causal=False, feature_seed=5, redraw_interval=3)
    assert torch.equal(fresh.proj, p0)
    x = torch.randn(1, 6, 32)
    fresh.eval()
    for _ in range(5):
        fresh(x)
    assert torch.equal(fresh.proj, p0)
    fresh.train()
    for _ in range(3):
        fresh(x)
    assert torch.equal(fresh.proj, p0)
    fresh(x)
    assert not torch.equal(fresh.proj, p0) and int(fresh.num_redraws) == 1
    # the projection is a buffer: a state_dict round trip reproduces outputs exactly
    other = Performer(32, 4, causal=False, feature_seed=99).eval()
    other.load_state_dict(fresh.state_dict())
    fresh.eval()
    assert torch.equal(other(x)[0], fresh(x)[0])


def test_softmax_fully_masked_rows_zero_not_nan():
    layer = SoftmaxAttention(16, 2, causal=True).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1] = False  # a row with no real token at all
    y, _ = layer(x, attention_mask=mask)
    assert torch.isfinite(y).all()
    assert torch.allclose(y[1], layer.out_proj.bias.expand(7, 16))  # core output exactly 0
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_rope_softmax_is_relative():
    """With RoPE, shifting all positions leaves outputs unchanged."""
    layer = SoftmaxAttention(16, 2, causal=True, rope=True).double()
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    pos = torch.arange(9)[None]
    assert rel_err(layer(x, positions=pos + 37)[0], layer(x, positions=pos)[0]) < 1e-10


def test_relative_bias_kinds():
    bias = RelativePositionBias("toeplitz", 8, causal=False)
    pos = torch.arange(20)[None]
    b = bias(pos, pos, 20)[0]
    i, j = 3, 11
    assert b[i, j] == bias.w[j - i + 511] and b[j, i] == bias.w[i - j + 511]
    moving = RelativePositionBias("toeplitz_moving", 8, causal=False)
    moving.load_state_dict(bias.state_dict())
    assert torch.equal(moving(pos, pos, 512), bias(pos, pos, 512))  # identical at n = 512
    # beyond 512 the row switches to the RoPE bias, which depends on offsets only
    long = bias(pos, pos, torch.tensor([[600]]))[0]
    assert torch.allclose(long, bias._rope_bias(pos, pos)[0])
    shifted = bias._rope_bias(pos + 100, pos + 100)[0]
    assert torch.allclose(long, shifted, atol=1e-6)
    nb = t5_bucket(torch.arange(-300, 301), causal=False)
    assert nb.min() == 0 and nb.max() == 31 and nb[300] == 0
    cb = t5_bucket(-torch.arange(0, 300), causal=True)
    assert (cb[1:] >= cb[:-1]).all() and cb.max() == 31


def test_unused_rope_bias_params_still_get_gradients():
    """Training at ≤ 512 never uses a, b: they get zero gradients (DDP needs every parameter)."""
    layer = GAU(16, causal=True, normalizer="fixed", qk_dim=8).train()
    layer(torch.randn(1, 10, 16))[0].sum().backward()
    assert all(p.grad is not None for p in layer.parameters())
    assert layer.rel_bias.a.grad.abs().max() == 0


def test_causal_toeplitz_switch_is_prefix_consistent():
    """Causal GAU rows pick toeplitz/rope_bias by their visible length: decodable past 512."""
    torch.manual_seed(0)
    layer = GAU(16, causal=True, normalizer="fixed", fixed_len=512, qk_dim=8).double().eval()
    with torch.no_grad():
        layer.gamma.normal_()
    x = torch.randn(1, 530, 16, dtype=torch.float64)
    full, _ = layer(x)
    prefix, _ = layer(x[:, :515])
    assert rel_err(prefix, full[:, :515]) < 1e-12


def test_flash_one_chunk_no_global_equals_gau_layer():
    """flash.md §5.3 at layer level: C = T, global off ≡ GAU with N_q = C, same heads/weights."""
    torch.manual_seed(0)
    T = 24
    for causal in (True, False):
        flash = FLASH(16, causal=causal, chunk_size=T, global_branch=False, qk_dim=8).double()
        gau = GAU(16, causal=causal, normalizer="fixed", fixed_len=T, qk_dim=8).double()
        with torch.no_grad():
            for name in ("proj.weight", "proj.bias", "out_proj.weight", "out_proj.bias", "rel_bias.w"):
                gau.get_parameter(name).copy_(flash.get_parameter(name))
            flash.gamma.normal_()
            gau.gamma.copy_(flash.gamma[:2])
            gau.beta.copy_(flash.beta[:2])
        x = torch.randn(2, T, 16, dtype=torch.float64)
        assert rel_err(flash(x)[0], gau(x)[0]) < 1e-12


def test_gau_parameter_count_about_3de():
    d = 64
    gau = GAU(d, causal=False)  # e = 2d = 128, s = 128
    e, s = 2 * d, 128
    core = d * (2 * e + s) + e * d
    n = sum(p.numel() for p in gau.parameters())
    assert core <= n <= core + (2 * e + s) + d + 4 * s + 1023 + 2 * s + 10


def test_gau_accepts_left_padding():
    torch.manual_seed(0)
    layer = GAU(16, causal=False, qk_dim=8).double().eval()
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    ref, _ = layer(x)
    xp = torch.cat([torch.randn(1, 5, 16, dtype=torch.float64), x], 1)
    mask = torch.ones(1, 17, dtype=torch.bool)
    mask[:, :5] = False
    out, _ = layer(xp, attention_mask=mask)
    assert rel_err(out[:, 5:], ref) < 1e-12


def test_errors():
    x = torch.randn(1, 6, 16)
    with pytest.raises(ValueError, match="seq_len"):
        GAU(16, causal=True, normalizer="seq_len", qk_dim=8)(x, use_cache=True)
    with pytest.raises(ValueError, match="toeplitz_moving"):
        GAU(16, causal=True, normalizer="fixed", rel_bias="toeplitz_moving", qk_dim=8)(x, use_cache=True)
    with pytest.raises(ValueError, match="right-padded"):
        FLASH(16, causal=False, chunk_size=4, qk_dim=8)(x, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="max_len"):
        CosFormerAttention(16, 2, causal=True, max_len=4)(x)
    with pytest.raises(ValueError, match="max_len"):
        CosFormerAttention(16, 2, causal=True, max_len=None)
    with pytest.raises(ValueError, match="normalizer"):
        GAU(16, causal=False, normalizer="chunk")
    with pytest.raises(ValueError, match="normalizer"):
        FLASH(16, causal=False, normalizer="seq_len")
    with pytest.raises(ValueError, match="rel_bias"):
        GAU(16, causal=False, rel_bias="alibi")
    with pytest.raises(ValueError, match="rope"):
        GAU(16, causal=False, rope="partial:3")
    with pytest.raises(TypeError, match="layer_options\\['performer'\\]"):
        TransNormerForCausalLM(small_lm("performer", {"nb_features": 8}))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "bf16-input"])
@pytest.mark.parametrize("T, C, rel_bias", [(64, 16, "toeplitz"), (96, 32, "none"), (16, 16, "toeplitz")])
def test_flash_layer_fused_mixer_matches_composed_ops(monkeypatch, native_kernels, dtype, T, C, rel_bias):
    """A causal FLASH layer through _CausalFlashMixer (the projection inside, its gradient's
    transposed copy written by the kernels; the gate read from the pre-activation, u never
    written) against the same layer through F.linear, silu_split, the heads, the core and u * o:
    output and the gradients of x and of every parameter. bf16-input: a bf16 x under autocast,
    as a pre-norm block feeds it."""
    import transnormer.ops.flash as flash_mod

    torch.manual_seed(0)
    layer = FLASH(48, causal=True, chunk_size=C, qk_dim=32, rel_bias=rel_bias)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # non-zero biases, β, and a non-trivial bias table
    x = torch.randn(2, T, 48)
    gy = torch.randn(2, T, 48)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(flash_mod, "_FUSED_MIXER", fused)
        calls = []
        monkeypatch.setattr(flash_mod._CausalFlashMixer, "apply", _counting(flash_mod._CausalFlashMixer.apply, calls))
        xi = (x.bfloat16() if dtype == "bf16-input" else x.clone()).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != "fp32"):
            y, _ = layer(xi)
        params = [p for p in layer.parameters() if p.requires_grad]
        grads = torch.autograd.grad(y, [xi, *params], gy.to(y.dtype), allow_unused=True)
        assert len(calls) == int(fused)
        results.append((y, *grads))
    tol = 1e-5 if dtype == "fp32" else 2e-2
    for a, b in zip(*results):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert rel_err(a.double(), b.double()) < tol


def _counting(fn, calls):
    def wrapped(*args):
        calls.append(1)
        return fn(*args)
    return wrapped


def test_flash_layer_projects_once_when_the_fused_mixer_does_not_apply(monkeypatch):
    """The fallback (here: the PyTorch kernel backend) projects once: the fast-path check does not
    project (it once did, and the fallback's second projection doubled the layer's FLOPs)."""
    import transnormer.layers.gau as gau_mod
    from transnormer.ops import _native

    calls = []
    real = gau_mod.linear

    def linear(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gau_mod, "linear", linear)
    before = _native.backend()
    _native.set_backend("torch")
    try:
        layer = FLASH(32, causal=True, chunk_size=8, qk_dim=16)
        layer(torch.randn(1, 16, 32))
    finally:
        _native.set_backend(before)
    assert len(calls) == 1


def _mixer_with_a_cache(name, d=16):
    from transnormer.layers import DiagAttention, LinearAttention, NormAttention
    return {"norm": lambda: NormAttention(d, 2, causal=True, chunk_size=2),
            "linear_elu": lambda: LinearAttention(d, 2, causal=True),
            "diag": lambda: DiagAttention(d, 2, causal=True, block_size=8),
            "softmax": lambda: SoftmaxAttention(d, 2, causal=True),
            "gau": lambda: GAU(d, causal=True, qk_dim=8, normalizer="visible"),
            "flash": lambda: FLASH(d, causal=True, qk_dim=8, chunk_size=8),
            "performer": lambda: Performer(d, 2, causal=True),
            "cosformer": lambda: CosFormerAttention(d, 2, causal=True, max_len=16)}[name]()


@pytest.mark.parametrize("name", ["norm", "linear_elu", "diag", "softmax", "gau", "flash", "performer", "cosformer"])
def test_every_mixer_reads_a_cache_given_with_use_cache_false(name):
    # layers/base.py: a given cache is read; use_cache only says whether the new one is returned
    # (Diag, softmax, GAU and FLASH used to drop it and attend as if there were no prefix)
    torch.manual_seed(0)
    layer = _mixer_with_a_cache(name).double().eval()
    x, pos = torch.randn(1, 6, 16, dtype=torch.float64), torch.arange(6)[None]
    with torch.no_grad():
        full, _ = layer(x, positions=pos)
        _, cache = layer(x[:, :4], positions=pos[:, :4], use_cache=True)
        out, returned = layer(x[:, 4:], positions=pos[:, 4:], cache=cache, use_cache=False)
    assert returned is None and torch.allclose(out, full[:, 4:], atol=1e-12)


@pytest.mark.parametrize("name", ["norm", "linear_elu", "diag", "softmax", "gau", "flash", "performer", "cosformer"])
def test_every_mixer_takes_positions_of_one_row(name):
    """positions [1, T] and [T] pass the shape check; Diag, FLASH (with a cache), cosFormer and GAU
    had then failed inside (a scatter or a broadcast of [T] against [B, T])."""
    torch.manual_seed(0)
    layer = _mixer_with_a_cache(name).double().eval()
    x, pos = torch.randn(2, 6, 16, dtype=torch.float64), torch.arange(6)
    with torch.no_grad():
        want, want_cache = layer(x, positions=pos.expand(2, 6), use_cache=True)
        for given in (pos, pos[None]):
            out, cache = layer(x, positions=given, use_cache=True)
            assert torch.equal(out, want)
            step, _ = layer(x[:, :1], positions=torch.tensor([6]), cache=cache, use_cache=True)
            ref, _ = layer(x[:, :1], positions=torch.full((2, 1), 6), cache=want_cache, use_cache=True)
            assert torch.equal(step, ref)


def test_diag_and_flash_refuse_left_padding_when_blocks_matter():
    from transnormer.layers import DiagAttention

    mask = torch.tensor([[False, False] + [True] * 8])
    x = torch.randn(1, 10, 16)
    with pytest.raises(ValueError, match="DiagAttention cuts blocks by index"):  # was silently wrong
        DiagAttention(16, 2, causal=True, block_size=4)(x, attention_mask=mask)
    with pytest.raises(ValueError, match="FLASH cuts blocks by index"):
        FLASH(16, causal=True, qk_dim=8, chunk_size=4)(x, attention_mask=mask)
    DiagAttention(16, 2, causal=True, block_size=16)(x, attention_mask=mask)  # one block: no difference


def test_performer_redraw_leaves_pending_backward_intact():
    # a redraw rewrote the projection in place, which an earlier call's graph had saved
    torch.manual_seed(0)
    layer = Performer(16, 2, causal=True, redraw_interval=2).train()
    x = torch.randn(1, 5, 16, requires_grad=True)
    y1, _ = layer(x)
    layer(x)
    y3, _ = layer(x)  # the third training call draws a new projection
    assert layer.num_redraws.item() >= 1
    (y1.sum() + y3.sum()).backward()
    assert torch.isfinite(x.grad).all()


def test_mixers_check_the_mask_and_positions_shape():
    # an all-true mask of the wrong shape used to be dropped unchecked
    layer = SoftmaxAttention(8, 2, causal=True)
    x = torch.randn(1, 5, 8)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, T\] = \(1, 5\)"):
        layer(x, attention_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="positions must be"):
        layer(x, positions=torch.arange(4)[None])


@pytest.mark.parametrize("make", [lambda: NormAttention(8, 2, causal=True), lambda: DiagAttention(8, 2, causal=True,
                                  block_size=4), lambda: SoftmaxAttention(8, 2, causal=True),
                                  lambda: LinearAttention(8, 2, causal=True), lambda: GAU(8, causal=True, qk_dim=4),
                                  lambda: FLASH(8, causal=True, qk_dim=4, chunk_size=4)])
def test_mixers_check_their_input(make):
    # a wrong x had failed deep inside a product ("mat1 and mat2 shapes cannot be multiplied"), float
    # positions inside GAU's bias lookup or a cache's scatter
    layer = make()
    with pytest.raises(ValueError, match=r"x must be \[B, T, 8\], got \(5, 8\)"):
        layer(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"x must be \[B, T, 8\], got \(1, 5, 9\)"):
        layer(torch.randn(1, 5, 9))
    with pytest.raises(TypeError, match="x must be a floating-point tensor, got torch.int64"):
        layer(torch.ones(1, 5, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="positions must be an integer tensor, got torch.float32"):
        layer(torch.randn(1, 4, 8), positions=torch.arange(4.0)[None])


def test_mixer_sizes_are_checked_at_construction():
    for call, name, err in ((lambda: NormAttention(32, 0, causal=True), "num_heads must be >= 1", ValueError),
                            (lambda: NormAttention(32, 4.0, causal=True), "num_heads must be an int", TypeError),
                            (lambda: SoftmaxAttention(32, 4.0, causal=True), "num_heads must be an int", TypeError),
                            (lambda: NormAttention(32, 4, causal=True, chunk_size=0), "chunk_size must be >= 1",
                             ValueError),
                            (lambda: LinearAttention(32, 4, causal=True, chunk_size=0), "chunk_size must be >= 1",
                             ValueError)):
        with pytest.raises(err, match=name):
            call()



@pytest.mark.parametrize("kw,err", [({"normalizer": "fixed", "fixed_len": 0}, ValueError),
                                    ({"normalizer": "fixed", "fixed_len": -8}, ValueError),
                                    ({"normalizer": "fixed", "fixed_len": 8.0}, TypeError),
                                    ({"max_rel_len": 0}, ValueError)])
def test_gau_refuses_bad_lengths(kw, err):
    name = "fixed_len" if "fixed_len" in kw else "max_rel_len"
    with pytest.raises(err, match=name):
        GAU(16, causal=True, qk_dim=8, **kw)


@pytest.mark.parametrize("make", [lambda p: SoftmaxAttention(16, 2, causal=True, attention_dropout=p),
                                  lambda p: GAU(16, causal=True, qk_dim=8, attention_dropout=p),
                                  lambda p: DiagAttention(16, 2, causal=True, attention_dropout=p)])
def test_layers_refuse_an_attention_dropout_outside_0_1(make):
    # a negative rate had meant no dropout without a word
    with pytest.raises(ValueError, match="attention_dropout must be in"):
        make(-0.1)


def test_norm_attention_on_fla_passes_the_core_as_the_spec_says(monkeypatch):
    """impl='fla' (peers.md §3.6): fla's chunk_linear_attn on q̂, k̂ in [B, T, H, e] with scale 1 and no
    denominator. Checked here against a stand-in fla module computing the quadratic reference; the
    parity with the real GPU kernel is test_norm_attention_on_fla_matches_on_gpu."""
    import sys
    import types

    from transnormer.ops import norm_linear_attn_reference

    calls = []

    def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                          head_first=True):  # (2024's default: [B, H, T, e])
        assert head_first is False
        calls.append((tuple(q.shape), scale, normalize, output_final_state))
        o, state = norm_linear_attn_reference(q, k, v, causal=True, initial_state=initial_state)
        return o, state if output_final_state else None

    ops = types.ModuleType("fla.ops.linear_attn")
    ops.chunk_linear_attn = chunk_linear_attn
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.linear_attn", ops)
    torch.manual_seed(0)
    ours = NormAttention(16, 2, causal=True).double()
    fla = NormAttention(16, 2, causal=True, impl="fla").double()
    fla.load_state_dict(ours.state_dict())
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    pos = torch.arange(9)[None]
    torch.testing.assert_close(fla(x)[0], ours(x)[0])
    y, cache = fla(x[:, :5], positions=pos[:, :5], use_cache=True)  # a prefill, then its state continued
    y2, _ = fla(x[:, 5:], positions=pos[:, 5:], cache=cache, use_cache=True)
    torch.testing.assert_close(torch.cat([y, y2], 1), ours(x)[0])
    assert calls[0] == ((2, 9, 2, 8), 1.0, False, False) and calls[1][3] is True
    with pytest.raises(ValueError, match="impl='fla' takes no padding mask"):
        fla(x, attention_mask=torch.tensor([[1] * 9, [1] * 7 + [0] * 2]))
    with pytest.raises(ValueError, match="impl='fla' serves the causal form only"):
        NormAttention(16, 2, causal=False, impl="fla")
    with pytest.raises(ValueError, match="impl must be one of"):
        NormAttention(16, 2, causal=True, impl="triton")


def _fla_on_gpu() -> bool:
    try:
        import fla.ops.linear_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _fla_on_gpu(), reason="needs flash-linear-attention and a CUDA GPU")
def test_norm_attention_on_fla_matches_on_gpu():
    # peers.md §3.6: output and final state against our chunked form, relative error <= 1e-3 in fp32
    torch.manual_seed(0)
    ours = NormAttention(64, 4, causal=True).cuda()
    fla = NormAttention(64, 4, causal=True, impl="fla").cuda()
    fla.load_state_dict(ours.state_dict())
    x = torch.randn(2, 300, 64, device="cuda")
    (a, ca), (b, cb) = ours(x, use_cache=True, positions=torch.arange(300, device="cuda")[None]), \
        fla(x, use_cache=True, positions=torch.arange(300, device="cuda")[None])
    assert rel_err(b, a) <= 1e-3 and rel_err(cb["state"], ca["state"]) <= 1e-3


@pytest.mark.parametrize("causal", ["false", None, 1])
def test_causal_is_a_bool_in_every_layer_and_op(causal):
    # a string "false" had run the causal form, None the bidirectional one: neither was refused
    from transnormer.ops import (
        block_attn,
        block_attn_reference,
        norm_linear_attn,
        norm_linear_attn_reference,
        softmax_attn,
    )
    from transnormer.ops.flash import flash_attn, gau_attn
    from transnormer.ops.linear_baselines import cosformer_attn, kernel_linear_attn

    for cls, args in ((NormAttention, (32, 2)), (DiagAttention, (32, 2)), (SoftmaxAttention, (32, 2)),
                      (LinearAttention, (32, 2)), (Performer, (32, 2)), (GAU, (32,)), (FLASH, (32,))):
        with pytest.raises(TypeError, match=f"causal must be a bool, got {causal!r}"):
            cls(*args, causal=causal)
    q = torch.rand(1, 5, 2, 4)
    s = torch.rand(1, 5, 8)
    for call in (lambda: norm_linear_attn(q, q, q, causal=causal), lambda: block_attn(q, q, q, causal=causal),
                 lambda: norm_linear_attn_reference(q, q, q, causal=causal),
                 lambda: block_attn_reference(q, q, q, causal=causal),
                 lambda: softmax_attn(q, q, q, causal=causal), lambda: kernel_linear_attn(q, q, q, causal=causal),
                 lambda: cosformer_attn(q, q, q, torch.arange(5)[None], 5, causal=causal),
                 lambda: gau_attn(s, s, s, causal=causal), lambda: flash_attn(s, s, s, s, s, causal=causal)):
        with pytest.raises(TypeError, match="causal must be a bool"):
            call()


def test_layer_inputs_and_caches_of_another_batch_are_named():
    # a list mask or positions: AttributeError on .shape; another batch's cache: torch.cat's size error
    torch.manual_seed(0)
    x = torch.randn(2, 4, 32)
    for layer in (NormAttention(32, 2, causal=True), DiagAttention(32, 2, causal=True, block_size=4),
                  SoftmaxAttention(32, 2, causal=True), GAU(32, causal=True, normalizer="visible"),
                  FLASH(32, causal=True, chunk_size=4)):
        layer.eval()
        with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor or None, got list"):
            layer(x, attention_mask=[[1, 1, 1, 1]] * 2)
        with pytest.raises(TypeError, match="positions must be a torch.Tensor or None, got list"):
            layer(x, positions=[0, 1, 2, 3])
        pos = torch.arange(4).expand(2, 4)
        _, cache = layer(x, positions=pos, use_cache=True)
        step = (x[:1, :1], torch.tensor([[4]]))
        if isinstance(layer, NormAttention):
            with pytest.raises(ValueError, match="state must have shape"):
                layer(step[0], positions=step[1], cache=cache, use_cache=True)
        else:
            with pytest.raises(ValueError, match=r"cache\['k'\] holds \(2, .*a cache of another batch"):
                layer(step[0], positions=step[1], cache=cache, use_cache=True)


def test_other_on_off_and_seed_arguments_are_checked():
    from transnormer.modules.norms import build_norm
    from transnormer.ops.linear_baselines import kernel_linear_attn, kernel_linear_attn_step

    with pytest.raises(TypeError, match="eps_inside_sqrt must be a bool, got 'false'"):
        NormAttention(32, 2, causal=True, eps_inside_sqrt="false")
    with pytest.raises(TypeError, match="eps_inside_sqrt must be a bool"):
        build_norm("simple_rms", 8, eps_inside_sqrt=None)
    with pytest.raises(TypeError, match="switch_to_rope must be a bool, got 'no'"):
        GAU(32, causal=True, switch_to_rope="no")
    with pytest.raises(ValueError, match=r"feature_seed must be an int in \[0, 2\*\*43\), got 1.5"):
        Performer(32, 2, causal=True, feature_seed=1.5)
    with pytest.raises(ValueError, match="feature_seed must be an int in"):  # (torch's "Overflow when unpacking")
        Performer(32, 2, causal=True, feature_seed=2**45)
    Performer(32, 2, causal=True, feature_seed=(2**32 - 1) * 1000 + 7)  # the builder's largest
    q = torch.rand(1, 5, 2, 4)
    with pytest.raises(ValueError, match="eps must be a number >= 0 with a denominator, got None"):
        kernel_linear_attn(q, q, q, causal=True, eps=None)
    with pytest.raises(TypeError, match="qf must be a floating-point torch.Tensor, got torch.int64"):
        kernel_linear_attn_step(torch.ones(1, 2, 4, dtype=torch.long), q[:, 0], q[:, 0], None)
