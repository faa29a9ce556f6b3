"""The bf16 kernels for norm_linear_attn (ops/_native_amx.cpp), causal and bidirectional,
against the fp64 reference. Their products run on AMX tiles or AVX512-BF16 dot products,
whichever the CPU has (ops/_native_amx.h); the same tests hold either engine.

The oracle is the quadratic reference in fp64 on the same bf16-rounded inputs. The kernel rounds
what the PyTorch form under autocast rounds (the state and the score tiles as bf16 operands,
each output row once), so its error is held to that of the PyTorch bf16 form; the state and its
gradient are sums of exact products of bf16 numbers in fp32, held to fp32 accuracy.
"""

import pytest
import torch

from conftest import model_loss_and_grads, needs_bf16_kernel_mark, on_one_and_two_threads, rel_err
from transnormer.ops import _native, norm_linear_attn, norm_linear_attn_reference

needs_bf16_kernel = needs_bf16_kernel_mark()
pytestmark = pytest.mark.usefixtures("bf16_engine")  # each bf16 product engine (conftest.py)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


def _native_macros() -> set[str]:
    """The macros the compiler defines for this CPU (-march=native), as the library was built."""
    import subprocess

    out = subprocess.run([*_native._compiler(), "-march=native", "-dM", "-E", "-x", "c++", "/dev/null"],
                         capture_output=True, text=True, check=True).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


@pytest.mark.skipif(not _native.softmax_f32_ready(), reason="no library built with -march=native on AVX-512 or AVX2")
def test_bf16_engine_is_the_one_the_build_targets():
    """-march=native picks the engine: AMX tiles where the compiler targets AMX-BF16 for this CPU
    (it also needs the OS to enable the tile state), else AVX512-BF16 dot products where it targets
    those, else none; an engine is only ever one the CPU has."""
    macros = _native_macros()
    amx = {"__AMX_TILE__", "__AMX_BF16__", "__AVX512BF16__"} <= macros
    want = 1 if amx else 2 if "__AVX512BF16__" in macros else 0
    assert _native.load().tn_bf16_engine() == want
    try:
        flags = _cpu_flags()
    except OSError:
        flags = None
    if want and flags is not None:
        assert ("amx_bf16" if want == 1 else "avx512_bf16") in flags
    engine, ready = _native.bf16_engine(), _native.bf16_ready()
    if want == 1:  # None where Linux refused the process the tile state
        assert engine in ("amx", None) and ready == (engine == "amx")
    else:
        assert engine == ("avx512-bf16" if want == 2 else None) and ready == (want == 2)


@pytest.fixture
def mode():
    before = _native.backend()
    yield _native.set_backend
    _native.set_backend(before)


def _case(B, T, H, D, E, seed=0):
    g = torch.Generator().manual_seed(seed + T)
    q, k, v = (torch.randn(B, T, H, x, generator=g).mul(0.5).bfloat16() for x in (D, D, E))
    S0 = torch.randn(B, H, D, E, generator=g)
    go = torch.randn(B, T, H, E, generator=g).bfloat16()
    gs = torch.randn(B, H, D, E, generator=g)
    return q, k, v, S0, go, gs


def _run(fn, q, k, v, S0, go, gs, dtype):
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    S0 = S0.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    o, s = fn(q, k, v, S0)
    loss = (o.double() * go.double()).sum() + (s.double() * gs.double()).sum()
    return (o, s, *torch.autograd.grad(loss, (q, k, v, S0)))


def _norm_err(a, b):
    a, b = a.detach().double(), b.detach()
    return float((a - b).norm() / b.norm())


def _ours(chunk):
    return lambda q, k, v, S0: norm_linear_attn(q, k, v, causal=True, chunk_size=chunk, initial_state=S0,
                                                output_final_state=True)


def _reference(q, k, v, S0):
    return norm_linear_attn_reference(q, k, v, causal=True, initial_state=S0)


@needs_bf16_kernel
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("H,D,E,chunk", [(2, 64, 64, 64), (3, 32, 96, 32), (1, 128, 64, 128), (2, 128, 64, 32)])
def test_kernel_matches_fp64_reference_as_well_as_the_torch_form(mode, T, H, D, E, chunk):
    case = _case(2, T, H, D, E)
    mode("native")
    got = _run(_ours(chunk), *case, torch.bfloat16)
    mode("torch")
    torch_form = _run(_ours(chunk), *case, torch.bfloat16)
    ref = _run(_reference, *case, torch.float64)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    for name, a, b, t in zip(("o", "state", "dq", "dk", "dv", "dS0"), got, ref, torch_form):
        if name in ("state", "dS0"):
            assert rel_err(a.double(), b) < 1e-5, name  # fp32 sums of exact bf16 products
        else:
            assert rel_err(a.double(), b) < 2e-2, name
            err, torch_err = _norm_err(a, b), _norm_err(t, b)  # over all elements: steadier than the max
            assert err < 1.25 * torch_err + 1e-4, (name, err, torch_err)


@needs_bf16_kernel
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200, 1100])
@pytest.mark.parametrize("H,D,E", [(2, 64, 64), (3, 32, 96), (1, 128, 32)])
def test_bidirectional_kernel_matches_fp64_reference_as_well_as_the_torch_form(mode, monkeypatch, T, H, D, E):
    calls = []
    real = _native.native_bidir_linear_attn
    monkeypatch.setattr(_native, "native_bidir_linear_attn", lambda *a: calls.append(1) or real(*a))

    def ours(q, k, v, S0):
        return norm_linear_attn(q, k, v, causal=False, initial_state=S0, output_final_state=True)

    case = _case(2, T, H, D, E)
    mode("native")
    got = _run(ours, *case, torch.bfloat16)
    assert calls
    mode("torch")
    torch_form = _run(ours, *case, torch.bfloat16)
    ref = _run(lambda q, k, v, S0: norm_linear_attn_reference(q, k, v, causal=False, initial_state=S0), *case,
               torch.float64)
    for name, a, b, t in zip(("o", "state", "dq", "dk", "dv", "dS0"), got, ref, torch_form):
        if name in ("state", "dS0"):
            assert rel_err(a.double(), b) < 1e-5, name
        else:
            assert rel_err(a.double(), b) < 2e-2, name
            assert _norm_err(a, b) < 1.25 * _norm_err(t, b) + 1e-4, name


@needs_bf16_kernel
def test_kernel_runs_for_bf16_and_pads_short_sequences(mode, monkeypatch):
    """bf16 with D, E, chunk multiples of 32 takes the kernel; a short sequence is one chunk of T
    rounded up to 32 rows (not a padded chunk_size: scratch grows with the chunk squared)."""
    calls = []
    real = _native.native_causal_linear_attn
    monkeypatch.setattr(_native, "native_causal_linear_attn", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    mode("auto")
    for T, chunk, used in ((5, 64, 32), (40, 4096, 64), (300, 128, 128)):
        q = torch.randn(1, T, 2, 32).mul(0.5).bfloat16()
        o, _ = norm_linear_attn(q, q, q, causal=True, chunk_size=chunk)
        assert calls.pop() == {"chunk": used}
        ref, _ = norm_linear_attn_reference(q.double(), q.double(), q.double(), causal=True)
        assert rel_err(o.double(), ref) < 2e-2
    for D, chunk in ((48, 64), (32, 48)):  # not multiples of 32: the PyTorch form
        q = torch.randn(1, 70, 2, D).bfloat16()
        o, _ = norm_linear_attn(q, q, q, causal=True, chunk_size=chunk)
        ref, _ = norm_linear_attn_reference(q.double(), q.double(), q.double(), causal=True)
        assert rel_err(o.double(), ref) < 2e-2
    assert not calls


@needs_bf16_kernel
@pytest.mark.parametrize("causal,T", [(True, 300), (False, 300), (False, 1100)])
def test_same_result_on_one_and_two_threads(mode, causal, T):
    """Heads are split over threads and each head is walked in the same order: bitwise equal."""
    mode("native")
    case = _case(2, T, 3, 64, 32)

    def run(q, k, v, S0):
        return norm_linear_attn(q, k, v, causal=causal, initial_state=S0, output_final_state=True)

    one, two = on_one_and_two_threads(lambda: _run(run, *case, torch.bfloat16))
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@needs_bf16_kernel
def test_native_mode_raises_for_bf16_shapes_no_kernel_takes(mode):
    mode("native")
    q = torch.randn(1, 70, 2, 48).bfloat16()
    with pytest.raises(RuntimeError, match="multiples of 32"):
        norm_linear_attn(q, q, q, causal=True)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        norm_linear_attn(q, q, q, causal=False)


@needs_bf16_kernel
def test_strided_inputs_no_state_and_unused_outputs(mode):
    mode("native")
    x = torch.randn(2, 3, 130, 64).mul(0.5).bfloat16()  # [B, H, T, D]: permuted views below
    q, k, v = (x.permute(0, 2, 1, 3) * s for s in (1.0, 0.5, 2.0))
    q.requires_grad_()
    o, fin = norm_linear_attn(q, k, v, causal=True)
    assert fin is None
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = norm_linear_attn_reference(qd, kd, vd, causal=True)
    assert rel_err(o.double(), ref) < 1e-2
    (gq,) = torch.autograd.grad(o.float().sum(), q)
    (gq_ref,) = torch.autograd.grad(ref.sum(), qd)
    assert rel_err(gq.double(), gq_ref) < 1e-2


@needs_bf16_kernel
def test_kernel_rejects_shapes_it_cannot_tile():
    q = torch.zeros(1, 64, 1, 48, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"failed \(code 1\)"):
        _native.native_causal_linear_attn(q, q, q, None, chunk=64)


@needs_bf16_kernel
def test_t2_model_under_autocast_takes_the_kernel_and_agrees(mode, monkeypatch):
    """A T2 LM with 32-wide heads under bf16 autocast: the same loss and gradients as the PyTorch
    form up to bf16 rounding, and the bf16 kernel did run."""
    from transnormer.presets import build_model

    calls = []
    real = _native.native_causal_linear_attn
    monkeypatch.setattr(_native, "native_causal_linear_attn",
                        lambda q, *a, **kw: calls.append(q.dtype) or real(q, *a, **kw))
    model = build_model("t2-lm-tiny", vocab_size=300, dropout=0.0)
    ids = torch.randint(0, 300, (2, 70))
    out = {}
    for m in ("torch", "auto"):
        mode(m)
        out[m] = model_loss_and_grads(model, ids, amp=True)
    assert torch.bfloat16 in calls
    assert abs(out["auto"][0] - out["torch"][0]) < 1e-2 * abs(out["torch"][0])
    g, g_ref = out["auto"][1], out["torch"][1]
    assert float((g - g_ref).norm() / g_ref.norm()) < 3e-2


@needs_bf16_kernel
@pytest.mark.parametrize("causal", [True, False])
def test_outputs_streamed_from_the_products_equal_the_tiled_path(causal):
    # bf16 outputs on 64-byte lines are written from the dot-product engine's accumulators; one
    # element off the line boundary they go through the fp32 tile and a conversion pass: the
    # same values, bit for bit (T = 100: a short last chunk)
    from transnormer.ops._native import _call, _ptr

    B, T, H, D, c = 1, 100, 2, 64, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, generator=g).mul_(0.3).bfloat16() for _ in range(4))
    n = B * T * H * D

    def outputs(aligned: bool):
        bufs = [torch.zeros(n + 1, dtype=torch.bfloat16) for _ in range(4)]
        o, dq, dk, dv = (b[:n] if aligned else b[1:] for b in bufs)
        fin, dS = torch.zeros(B, H, D, D), torch.zeros(B, H, D, D)
        tail = (c,) if causal else ()
        kind = "causal" if causal else "bidir"
        _call(f"tn_{kind}_fwd", torch.bfloat16, _ptr(q), _ptr(k), _ptr(v), _ptr(o), None, _ptr(fin), B, T, H, D, D, *tail)
        state = None if causal else fin  # the causal backward takes the initial state, the other the final
        _call(f"tn_{kind}_bwd", torch.bfloat16, _ptr(q), _ptr(k), _ptr(v), _ptr(do), _ptr(state), None, _ptr(dq),
              _ptr(dk), _ptr(dv), _ptr(dS), B, T, H, D, D, *tail)
        return o, dq, dk, dv, fin, dS

    for a, b in zip(outputs(True), outputs(False)):
        assert torch.equal(a, b)
