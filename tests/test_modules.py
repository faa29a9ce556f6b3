"""Norms, GLU, positional encodings (spec §3-5)."""

import pytest
import torch

from conftest import run_two_ranks
from transnormer.modules import FFN, GLU, LRPE, LearnedPositions, SimpleRMSNorm, build_ffn, build_lrpe, build_norm


def test_srms_eps_placements():
    x = torch.randn(3, 16, dtype=torch.float64)
    out = SimpleRMSNorm(16, eps=1e-3)(x)
    assert torch.allclose(out, x / (x.norm(dim=-1, keepdim=True) / 4 + 1e-3))
    inside = SimpleRMSNorm(16, eps=1e-3, eps_inside_sqrt=True)(x)
    assert torch.allclose(inside, x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3))
    assert not list(SimpleRMSNorm(16).parameters())


def test_norm_by_name_and_bad_name():
    for name in ("simple_rms", "rms", "layer", "scale", "batch"):
        y = build_norm(name, 8)(torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.bool))
        assert y.shape == (2, 5, 8)
    with pytest.raises(ValueError, match="norm_type"):
        build_norm("groupnorm", 8)


_SYNC_BN_SCRIPT = """
import sys, torch, torch.distributed as dist
from transnormer.modules.norms import MaskedBatchNorm, sync_batch_norm
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
x = torch.randn(4, 6, 8, dtype=torch.float64) * 3 + 1
mask = torch.ones(4, 6, dtype=torch.bool)
mask[0, 4:] = False
mask[2:] = False  # rank 1 holds no valid position in the first step: its statistics are the others'
w = torch.randn(4, 6, 8, dtype=torch.float64)
ref, bn = MaskedBatchNorm(8).double(), MaskedBatchNorm(8).double()
with torch.no_grad():
    ref.weight.normal_(), ref.bias.normal_()
bn.load_state_dict(ref.state_dict())
assert sync_batch_norm(bn) == 1
for step in range(2):
    if step:
        mask[2:, :3] = True
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(xr, mask)
    (y_ref * w).sum().backward()
    mine = slice(2 * rank, 2 * rank + 2)
    y = bn(xs[mine], mask[mine])
    (y * w[mine]).sum().backward()  # the grads of the global sum, summed over the ranks below
    for t in (bn.weight.grad, bn.bias.grad, xs.grad):
        dist.all_reduce(t)
    m = mask[mine, :, None]
    torch.testing.assert_close(y * m, y_ref[mine] * m, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.weight.grad, ref.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.bias.grad, ref.bias.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-12, atol=1e-12)
    bn.zero_grad(), ref.zero_grad()
dist.destroy_process_group()
"""


def test_synced_batch_norm_over_two_processes_is_one_process_with_the_global_batch(tmp_path):
    """sync_batch_norm: outputs, input and parameter gradients and running statistics of 2 gloo
    processes x 2 rows equal one process's on the 4 rows (fp64); a rank with no valid position
    takes the others' statistics."""
    script = tmp_path / "sync_bn.py"
    script.write_text(_SYNC_BN_SCRIPT)
    run_two_ranks([str(script)])


def test_sync_batch_norm_is_refused_for_a_model_without_batch_norm():
    from transnormer.models import TransNormerForCausalLM
    from transnormer.presets import get_config
    from transnormer.train import TrainConfig
    from transnormer.train.distributed import DistInfo, wrap_model

    model = TransNormerForCausalLM(get_config("t2-lm-tiny", num_hidden_layers=1, hidden_size=32,
                                              num_attention_heads=2))
    info = DistInfo()  # one process
    with pytest.raises(ValueError, match="the model has no batch norm"):
        wrap_model(model, info, sync_batch_norm=True)
    with pytest.raises(ValueError, match="sync_batch_norm .* needs norm_type 'batch'"):
        TrainConfig(preset="t2-lm-tiny", sync_batch_norm=True, max_steps=1).check()


def test_masked_batch_norm_ignores_padding():
    bn = build_norm("batch", 4)
    x = torch.randn(2, 6, 4)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 3:] = False
    y1 = bn(x, mask)
    x2 = x.clone()
    x2[1, 3:] = 1e6
    y2 = bn(x2, mask)
    assert torch.allclose(y1[mask], y2[mask])


def test_glu_shapes_and_activation_option():
    g = GLU(512)
    assert g.l1.out_features == 1365
    x = torch.randn(2, 3, 512)
    lin = GLU(512, act="identity")
    lin.load_state_dict(g.state_dict())
    assert not torch.allclose(g(x), lin(x))
    assert torch.allclose(lin(x), lin.l3(lin.l1(x) * lin.l2(x)))
    with pytest.raises(ValueError, match="activation"):
        GLU(8, act="swishy")
    with pytest.raises(ValueError, match="ffn_type"):
        build_ffn("moe", 8, None, "gelu")


def test_lrpe_relative_property_and_householder():
    torch.manual_seed(0)
    lrpe = LRPE(8, seed=3)
    u = lrpe.u
    P = torch.eye(8) - 2 * torch.outer(u, u)
    assert torch.allclose(P, P.T) and torch.allclose(P @ P.T, torch.eye(8), atol=1e-6)
    a, b = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    lrpe = lrpe.double()

    def dot(m, n):
        return (lrpe(a, torch.tensor([[m]])) * lrpe(b, torch.tensor([[n]]))).sum()

    assert torch.allclose(dot(3, 10), dot(100, 107)) and torch.allclose(dot(0, 5), dot(20, 25))
    assert not torch.allclose(dot(0, 5), dot(0, 6))
    # norm preserving
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    y = lrpe(x, torch.arange(5))
    assert torch.allclose(x.norm(dim=-1), y.norm(dim=-1))
    # learnable θ vs fixed
    assert isinstance(LRPE(8).theta, torch.nn.Parameter)
    assert not isinstance(build_lrpe("rope", 8).theta, torch.nn.Parameter)
    assert build_lrpe("none", 8) is None
    with pytest.raises(ValueError, match="lrpe"):
        build_lrpe("alibi", 8)


def test_lrpe_odd_dim_last_channel_untouched():
    lrpe = LRPE(5, householder=False)
    x = torch.randn(1, 4, 1, 5)
    y = lrpe(x, torch.arange(4))
    assert torch.equal(x[..., 4], y[..., 4])


def test_learned_positions_too_long():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LearnedPositions(8, 4)(torch.arange(9))


def test_lrpe_fused_path_equals_definition():
    from transnormer.modules.positional import rotate

    lrpe = LRPE(8, seed=1).double()
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    u = lrpe.u.double()
    px = x - 2 * (x @ u)[..., None] * u  # P x
    want = rotate(px, pos[..., None].double() * lrpe.theta.double()) * 0.5
    assert torch.allclose(lrpe(x, pos, scale=0.5), want, atol=1e-12)


@pytest.mark.parametrize("norm_per_head", [False, True])
def test_norm_attention_batch_norm_ignores_padding(norm_per_head):
    """Spec §12: batch statistics exclude padded positions, also when the norm runs per head."""
    from transnormer.layers import NormAttention

    torch.manual_seed(0)
    layer = NormAttention(16, 2, causal=True, norm_type="batch", norm_per_head=norm_per_head).train()
    x = torch.randn(2, 10, 16)
    y0, _ = layer(x)  # training mode: the batch's own statistics normalise it
    padded = torch.cat([x, 5 * torch.randn(2, 6, 16)], 1)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[:, 10:] = False
    y1, _ = layer(padded, attention_mask=mask)
    assert torch.allclose(y1[:, :10], y0, atol=1e-5)


@pytest.mark.parametrize("name", ["simple_rms", "rms", "scale", "batch"])
def test_norm_rejects_the_wrong_width(name):
    # the gain-free norms used to normalise any width without complaint
    norm = build_norm(name, 8)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 8\]"):
        norm(torch.randn(2, 3, 16))
    assert norm(torch.randn(2, 3, 8)).shape == (2, 3, 8)


def test_sinusoid_layouts():
    from transnormer.modules import sinusoidal_table

    p = torch.arange(7.0)[None]
    d = 10
    for layout, theta in (("fairseq", 10000.0 ** (-torch.arange(5.0) / 4)),
                          ("transformer", 10000.0 ** (-2 * torch.arange(5.0) / d))):
        ang = p[0, :, None] * theta
        want = torch.cat((ang.sin(), ang.cos()), -1)
        assert torch.allclose(sinusoidal_table(p, d, layout)[0], want, atol=1e-5)
        # an fp64 model's table is computed in fp64 (an fp32 one had left its oracle runs 1e-6 apart)
        i = torch.arange(5, dtype=torch.float64)
        ang64 = p[0, :, None].double() * 10000.0 ** (-(i / 4 if layout == "fairseq" else 2 * i / d))
        want64 = torch.cat((ang64.sin(), ang64.cos()), -1)
        got64 = sinusoidal_table(p.long(), d, layout, torch.float64)[0]
        assert got64.dtype == torch.float64 and torch.allclose(got64, want64, atol=1e-12, rtol=0)
    assert sinusoidal_table(p, 11, "transformer")[..., -1].abs().max() == 0  # odd width: a zero column
    with pytest.raises(ValueError, match="layout"):
        sinusoidal_table(p, d, "rotary")
    from transnormer.modules.positional import SinusoidalPositions

    pos = SinusoidalPositions(d, learnable_scale=0.5).double()
    assert pos(p.long(), torch.float64).dtype == torch.float64
    assert torch.equal(SinusoidalPositions(d)(p.long(), torch.bfloat16), SinusoidalPositions(d)(p.long()))


def test_scaled_sinusoid_follows_flash_frequencies():
    # flash.md §1.3: θ_i = 10000^{-2i/d} times a learnable scalar starting at d^{-1/2}
    from transnormer.models import TransNormerConfig, TransNormerModel

    cfg = TransNormerConfig(vocab_size=11, hidden_size=16, num_hidden_layers=1, num_attention_heads=1,
                            layer_types=["flash"], abs_pos="scaled_sinusoid", max_position_embeddings=32)
    pos = TransNormerModel(cfg).embed_positions
    p = torch.arange(5)[None]
    ang = p[0, :, None].float() * 10000.0 ** (-2 * torch.arange(8.0) / 16)
    want = torch.cat((ang.sin(), ang.cos()), -1) / 4.0
    assert torch.allclose(pos(p)[0], want, atol=1e-6)


def test_norm_attention_in_fp16_keeps_its_unnormalised_output_in_fp32():
    """NormAttention has no denominator: its output grows with the keys (9.3e4 here) until the
    norm takes the scale out. A .half() layer at 8k tokens had NaN in 1,499 of 8,192 rows."""
    from transnormer.layers import NormAttention

    torch.manual_seed(0)
    layer = NormAttention(64, 1, causal=True, lrpe="none")
    x = torch.randn(1, 8192, 64)
    with torch.no_grad():
        ref = layer.double()(x.double())[0]
    layer = layer.half()
    xh = x.half().requires_grad_()
    o = layer(xh)[0]
    o.float().sum().backward()
    assert o.dtype == torch.float16 and torch.isfinite(o).all() and torch.isfinite(xh.grad).all()
    assert float((o.detach().double() - ref).norm() / ref.norm()) < 2e-3


@pytest.mark.parametrize("norm_type", ["simple_rms", "rms", "layer", "scale", "batch"])
@pytest.mark.parametrize("per_head", [False, True])
def test_norm_attention_in_fp16_with_every_norm(norm_type, per_head):
    """The fp32 output reaches a half-precision norm: PyTorch's CPU layer norm had refused it
    ("mixed dtype (CPU)") in a .half() model."""
    from transnormer.layers import NormAttention

    torch.manual_seed(0)
    layer = NormAttention(32, 2, causal=True, lrpe="none", norm_type=norm_type, norm_per_head=per_head)
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        ref = layer.double()(x.double())[0]
    o = layer.half()(x.half())[0]
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
    assert float((o.detach().double() - ref).norm() / ref.norm()) < 5e-3


def test_module_arguments_are_checked_at_construction():
    # a negative eps had flipped SimpleRMSNorm's sign (-16777216 for ones), a NaN one made every
    # output NaN; the others were accepted until (or through) the first forward
    from transnormer.modules.norms import MaskedBatchNorm, ScaleNorm

    for name in ("simple_rms", "rms", "layer", "scale", "batch"):
        for eps in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
                build_norm(name, 8, eps=eps)
    with pytest.raises(ValueError, match="eps must be"):
        ScaleNorm(8, eps=-1e-5)
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\]"):
        MaskedBatchNorm(8, momentum=5)
    with pytest.raises(ValueError, match="pairing must be"):
        LRPE(8, pairing="bogus")
    for call, name in ((lambda: LRPE(0), "head_dim"), (lambda: LearnedPositions(0, 4), "max_positions"),
                       (lambda: LearnedPositions(4, 0), "dim"), (lambda: GLU(8, hidden=0), "hidden"),
                       (lambda: FFN(8, hidden=0), "hidden")):
        with pytest.raises(ValueError, match=f"{name} must be >= 1"):
            call()


def test_masked_batch_norm_checks_the_mask_and_needs_two_positions():
    from transnormer.modules.norms import MaskedBatchNorm

    bn = MaskedBatchNorm(4).train()
    x = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match=r"mask must have the shape of x without its last dim, \(3, 2\)"):
        bn(x, torch.ones(2, 3, dtype=torch.bool))  # [T, B]: had picked other positions silently
    # one valid position: no spread to measure. It had zeroed the output (var 0) and pulled
    # running_var towards 0; now the running statistics serve, as for no valid position
    mask = torch.zeros(3, 2, dtype=torch.bool)
    mask[1, 0] = True
    y = bn(x, mask)
    assert torch.equal(bn.running_var, torch.ones(4)) and torch.equal(bn.running_mean, torch.zeros(4))
    torch.testing.assert_close(y, x * torch.rsqrt(torch.tensor(1 + bn.eps)))


@pytest.mark.parametrize("cast", ["half", "default_dtype"])
def test_masked_batch_norm_keeps_its_running_statistics_in_fp32(cast):
    # after NormAttention's core (no denominator) the running variance passes fp16's 65504: model.half()
    # (or building under an fp16 default dtype, as from_pretrained(dtype=float16) does) had made it inf,
    # and the norm then gave only its bias (and NaN after an fp16 training step)
    from transnormer.modules.norms import MaskedBatchNorm

    torch.manual_seed(0)
    bn = MaskedBatchNorm(4)
    x = torch.randn(8, 16, 4) * 1000
    for _ in range(60):
        bn(x)
    bn.eval()
    want = bn(x[:1, :3])
    if cast == "half":
        half = MaskedBatchNorm(4)
        half.load_state_dict(bn.state_dict())
        half = half.half()
    else:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float16)
        try:
            half = MaskedBatchNorm(4)
        finally:
            torch.set_default_dtype(previous)
        half.load_state_dict(bn.state_dict())
    assert half.running_var.dtype == torch.float32 and torch.isfinite(half.running_var).all()
    half.eval()
    torch.testing.assert_close(half(x[:1, :3].half()).float(), want, atol=2e-2, rtol=1e-2)
    half.train()
    half(x.half())
    assert torch.isfinite(half.running_var).all() and torch.isfinite(half.running_mean).all()
    assert half.double().running_var.dtype == torch.float64  # a cast up still applies
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:  # and an fp64 model built under an fp64 default keeps fp64 statistics
        assert MaskedBatchNorm(4).running_var.dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
