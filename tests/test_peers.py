"""Peers (bench/peers.py, peers.md): peer LMs build and run, parameter counts match our presets,
our GAU/FLASH blocks reproduce flash_pytorch's with mapped weights, causality probes."""

import copy

import pytest
import torch

pytest.importorskip("flash_pytorch")
pytest.importorskip("performer_pytorch")

from flash_pytorch import FLASH as TheirFLASH  # noqa: E402
from flash_pytorch import GAU as TheirGAU  # noqa: E402
from flash_pytorch.flash_pytorch import ScaleNorm as TheirScaleNorm  # noqa: E402
from rotary_embedding_torch import RotaryEmbedding  # noqa: E402

from conftest import rel_err  # noqa: E402
from transnormer.bench.peers import (  # noqa: E402
    PEER_NAMES,
    block_forward,
    build_peer_model,
    load_flash_pytorch_weights,
    matching_block,
    param_counts,
    peer_versions,
)

TINY_MATCH = {"flash-pytorch": "flash-lm-tiny", "flash-pytorch-gau": "flash-quad-lm-tiny",
              "performer-pytorch": "performer-lm-tiny"}
D, S, T, C, R = 64, 32, 50, 16, 16  # width, qk width, length (not a multiple of C), chunk, RoPE dims


def test_peer_versions():
    v = peer_versions()
    assert v["flash-pytorch"] == "0.1.9" and v["performer-pytorch"] == "1.1.4"
    assert v["torch"] == torch.__version__ and v["python"]


def test_sdpa_and_unknown_names_raise():
    with pytest.raises(ValueError, match="vanilla-lm"):
        build_peer_model("sdpa", seq_len=64)
    with pytest.raises(ValueError, match="unknown peer"):
        build_peer_model("nope", seq_len=64)


@pytest.mark.parametrize("name", PEER_NAMES)
def test_peer_lm_builds_runs_and_matches_params(name):
    from transnormer.bench.train_step import build_bench_model, lm_loss

    model = build_bench_model(f"peer:{name}", 64, None, {"match": TINY_MATCH[name]}).eval()
    assert model.is_peer and model.config.vocab_size == 4096
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    logits = model(ids)
    assert logits.shape == (2, 40, model.config.vocab_size) and torch.isfinite(logits).all()
    assert 0.3 < float(logits.detach().std()) < 3.0  # tied head with our embedding init: O(1) logits
    loss = lm_loss(model, ids)
    loss.backward()
    assert torch.isfinite(loss)
    counts = param_counts(model)
    assert abs(counts["rel_diff"]) < 0.05, counts


@pytest.mark.parametrize("name", PEER_NAMES)
def test_full_size_param_counts_within_5_percent(name):
    model = build_peer_model(name, seq_len=512, vocab_size=32768)
    counts = param_counts(model)
    assert counts["match"] == {"flash-pytorch": "flash-lm", "flash-pytorch-gau": "flash-quad-lm",
                               "performer-pytorch": "performer-lm"}[name]
    assert abs(counts["rel_diff"]) < 0.05, counts


def test_untied_head_is_the_released_layout():
    model = build_peer_model("flash-pytorch", seq_len=64, match="flash-lm-tiny", tie_embedding=False)
    net = model.net
    assert net.to_logits[1].weight is not net.token_emb.weight
    assert model.num_params - model.matched_params > 0.9 * 4096 * 128  # V·d more than ours


# ------------------------------------------------------------------------------------------------
# Block parity with flash_pytorch.GAU / FLASH
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def _randomize(theirs):
    """Trained-like weights at O(1) activations: relu² active on part of the scores (≈half of the
    scores negative), non-zero offsets β and bias, norm gains ≠ 1."""
    for name, p in theirs.named_parameters():
        if "gamma" in name:
            p.normal_(0.0, 0.5)
        elif "beta" in name:
            p.normal_(0.0, 0.3)
        elif "relative_attention_bias" in name:
            p.normal_(0.0, 0.1)
        elif name.startswith("norm"):
            p.normal_(1.0 if name.endswith(("g", "weight")) else 0.0, 0.2)
        elif p.dim() == 2:
            p.normal_(0.0, p.shape[1] ** -0.5)
        else:
            p.normal_(0.0, 0.1)
    return theirs.eval()


def _their_flash(causal, norm, **kw):
    return _randomize(TheirFLASH(dim=D, group_size=C, query_key_dim=S, causal=causal,
                                 rotary_pos_emb=RotaryEmbedding(R), norm_klass=norm, **kw))


def _their_gau(causal, norm):
    return _randomize(TheirGAU(dim=D, query_key_dim=S, causal=causal, norm_klass=norm))


def _mask():
    m = torch.ones(3, T, dtype=torch.bool)
    m[1, 37:] = False  # right padding, inside chunk 2
    m[2, 16:] = False  # ends exactly at a chunk boundary
    return m


NORMS = [torch.nn.LayerNorm, TheirScaleNorm]


def _err(ours, theirs, x, mask=None, *, their_norm=False):
    """max|Δ| / max|Δ_ref| of the mixer contributions (block output − x, so the residual does not
    dilute the error) at valid positions. ``their_norm``: feed our mixer their normalised input."""
    sel = slice(None) if mask is None else mask
    ref = theirs(x, mask=mask) - x
    if their_norm:
        out, _ = ours.mixer(theirs.norm(x), attention_mask=mask)
    else:
        out = block_forward(ours, x, mask) - x
    return rel_err(out[sel], ref[sel])


def _assert_same_function_fp64(ours, theirs, x, mask=None):
    """float64 on both sides agrees to rounding, with either norm (our ScaleNorm reduces fp64 input
    in fp64; the 1e-6 once allowed for an fp32 reduction let a mapping wrong by 8e-7 pass)."""
    assert _err(ours, theirs, x, mask) < 1e-12
    if not isinstance(theirs.norm, torch.nn.LayerNorm):
        assert _err(ours, theirs, x, mask, their_norm=True) < 1e-12


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("norm", NORMS, ids=["layernorm", "scalenorm"])
def test_flash_block_parity(causal, norm):
    theirs = _their_flash(causal, norm)
    ours = matching_block(theirs)
    assert ours.mixer.rope.head_dim == R and ours.mixer.rel_bias.kind == "t5"
    # float64 copy first: their rotary embedding caches its angle table in the dtype of the first call
    theirs64 = copy.deepcopy(theirs).double()
    ours64 = matching_block(theirs64)
    x = torch.randn(3, T, D)
    assert _err(ours, theirs, x) < 1e-5  # observed ≤ 1e-6
    _assert_same_function_fp64(ours64, theirs64, x.double())
    if causal:  # right padding: their 1/C and masked keys are ours exactly
        assert _err(ours, theirs, x, _mask()) < 1e-5
        _assert_same_function_fp64(ours64, theirs64, x.double(), _mask())


def test_flash_noncausal_padding_differs_only_in_global_normaliser():
    """Theirs divides the global branch by the padded length T, ours by the valid count T_v
    (peers.md §3.2). Folding T_v/T into our global query head (one row) makes them equal."""
    theirs = _their_flash(False, torch.nn.LayerNorm).double()
    ours = matching_block(theirs)
    x = torch.randn(1, T, D, dtype=torch.float64)
    m = torch.ones(1, T, dtype=torch.bool)
    m[0, 37:] = False
    assert _err(ours, theirs, x, m) > 1e-2  # the documented difference
    with torch.no_grad():
        ours.mixer.gamma[2] *= 37 / T  # global query head (ours: ql, kl, qg, kg)
        ours.mixer.beta[2] *= 37 / T
    assert _err(ours, theirs, x, m) < 1e-12


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("norm", NORMS, ids=["layernorm", "scalenorm"])
def test_gau_block_parity(causal, norm):
    theirs = _their_gau(causal, norm)
    ours = matching_block(theirs, seq_len=T)
    assert ours.mixer.normalizer == "fixed" and ours.mixer.fixed_len == T and ours.mixer.rope is None
    x, m = torch.randn(3, T, D), _mask()
    assert _err(ours, theirs, x) < 1e-5
    # with padding too: both divide by the tensor length T (their 1/T counts padding)
    assert _err(ours, theirs, x, m) < 1e-5
    theirs64 = theirs.double()
    ours64 = matching_block(theirs64, seq_len=T)
    _assert_same_function_fp64(ours64, theirs64, x.double())
    _assert_same_function_fp64(ours64, theirs64, x.double(), m)


def test_gau_seq_len_normaliser_equals_theirs_without_padding():
    from transnormer.models.configuration import TransNormerConfig
    from transnormer.models.modeling import TransNormerBlock

    theirs = _their_gau(True, torch.nn.LayerNorm).double()
    config = TransNormerConfig(hidden_size=D, num_hidden_layers=1, layer_types=["gau"], norm_type="layer",
                               dropout=0.0, layer_options={"gau": {"expansion": 2, "qk_dim": S, "rel_bias": "t5",
                                                                  "rope": "none", "normalizer": "seq_len"}})
    ours = TransNormerBlock(config, 0).double().eval()
    load_flash_pytorch_weights(ours, theirs, seq_len=T)
    x = torch.randn(2, T, D, dtype=torch.float64)
    assert _err(ours, theirs, x) < 1e-12


def test_flash_transformer_layer_maps_onto_our_block():
    """A layer of the peer LM itself (ScaleNorm, RoPE on min(32, s) = 32 of s = 128 channels,
    group = our chunk size) once token shift is off, at its released init."""
    model = build_peer_model("flash-pytorch", seq_len=80, match="flash-lm-tiny", shift_tokens=False).eval()
    layer = model.net.layers[0]
    ours = matching_block(layer)
    assert ours.mixer.rope.head_dim == 32 and ours.mixer.s == 128 and ours.mixer.chunk_size == 32
    x = torch.randn(2, 70, 128)
    assert _err(ours, layer, x) < 1e-5


def test_a_post_norm_block_is_refused():
    # flash_pytorch's modules are pre-norm: a post-norm block had loaded and computed another function
    theirs = _their_flash(True, torch.nn.LayerNorm)
    block = matching_block(theirs)
    block.pre_norm = False
    with pytest.raises(ValueError, match="pre-norm: build our block with pre_norm=True"):
        load_flash_pytorch_weights(block, theirs)


def test_a_bidirectional_peer_is_not_benchmarked_as_a_causal_lm():
    from transnormer.bench.train_step import build_bench_model

    with pytest.raises(ValueError, match="is bidirectional: bench train/infer measure causal LM steps"):
        build_bench_model("peer:flash-pytorch", 64, 256, {"match": "flash-roberta-tiny"})
    with pytest.raises(ValueError, match="is bidirectional"):
        build_bench_model("peer:performer-pytorch", 64, 256, {"match": "performer-roberta-tiny"})
    assert build_bench_model("peer:flash-pytorch", 64, 256, {"match": "flash-lm-tiny"}).config.peer_args["causal"]


def test_missing_peer_error_names_the_extra():
    from transnormer.bench.peers import _import_peer

    with pytest.raises(ImportError, match=r"pip install -e '\.\[peers\]'"):
        _import_peer("flash_pytorch_not_installed")


def test_bare_mixer_mapping_and_mismatch_errors():
    theirs = _their_flash(True, torch.nn.LayerNorm)
    block = matching_block(theirs)
    # bare mixer: the pre-norm and residual are the caller's
    load_flash_pytorch_weights(block.mixer, theirs)
    assert _err(block, theirs, torch.randn(2, T, D), their_norm=True) < 1e-5
    with pytest.raises(ValueError, match="shift_tokens"):
        matching_block(_their_flash(True, torch.nn.LayerNorm, shift_tokens=True))
    with pytest.raises(ValueError, match="laplace"):
        matching_block(_their_flash(True, torch.nn.LayerNorm, laplace_attn_fn=True))
    with pytest.raises(ValueError, match="reduce_group"):
        matching_block(_their_flash(False, torch.nn.LayerNorm, reduce_group_non_causal_attn=False))
    with pytest.raises(ValueError, match="seq_len"):
        matching_block(_their_gau(True, torch.nn.LayerNorm))
    with pytest.raises(TypeError, match="GAU"):
        load_flash_pytorch_weights(block, _their_gau(True, torch.nn.LayerNorm), seq_len=T)


# ------------------------------------------------------------------------------------------------
# Causality probes (peers.md §2.6, §4)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["flash-pytorch", "flash-pytorch-gau"])
def test_peer_flash_lms_are_causal(name):
    model = build_peer_model(name, seq_len=80, match=TINY_MATCH[name]).eval()  # C = 32; T = 70
    ids = torch.randint(0, 4096, (1, 70))
    for t in (5, 31, 32, 50):
        ids2 = ids.clone()
        ids2[0, t] = (ids2[0, t] + 1) % 4096
        with torch.no_grad():
            diff = (model(ids) - model(ids2))[:, :t].abs().max()
        assert float(diff) == 0.0, (name, t)


def test_performer_causal_leak_is_recorded(record_property):
    """peers.md §3.4: the key-feature stabiliser is a max over the whole sequence plus ε, so a
    large future token changes earlier outputs. Recorded, not asserted; ours must not leak."""
    from performer_pytorch.performer_pytorch import SelfAttention

    from transnormer.layers import Performer

    torch.manual_seed(0)
    x = torch.randn(1, 96, D)
    x2 = x.clone()
    x2[0, 80] *= 20.0
    theirs = SelfAttention(D, causal=True, heads=4, dim_head=D // 4).eval()
    ours = Performer(D, 4, causal=True).eval()
    with torch.no_grad():
        leak = float((theirs(x) - theirs(x2))[:, :80].abs().max())
        scale = float(theirs(x).abs().max())
        our_leak = float((ours(x)[0] - ours(x2)[0])[:, :80].abs().max())
    record_property("performer_pytorch_causal_leak", leak)
    record_property("performer_pytorch_output_scale", scale)
    record_property("transnormer_performer_causal_leak", our_leak)
    print(f"performer-pytorch causal leak {leak:.3g} (output scale {scale:.3g}); ours {our_leak:.3g}")
    assert torch.isfinite(torch.tensor(leak))
    assert our_leak < 1e-6


def test_scaled_sinusoid_equals_flash_pytorch_table():
    # the same frequencies and [sin | cos] layout as flash_pytorch's ScaledSinuEmbedding; only the
    # scalar's initial value differs (ours d^{-1/2}, flash.md §1.3; theirs 1)
    from flash_pytorch.flash_pytorch import ScaledSinuEmbedding

    from transnormer.modules import SinusoidalPositions

    ours, theirs = SinusoidalPositions(D, learnable_scale=1.0, layout="transformer"), ScaledSinuEmbedding(D)
    a, b = ours(torch.arange(T)[None])[0].double(), theirs(torch.zeros(1, T, D)).double()
    angle = torch.arange(T).double()[:, None] / 10000 ** (torch.arange(0, D, 2).double() / D)
    table = torch.cat([angle.sin(), angle.cos()], -1)
    # both tables are fp32: an angle of up to T - 1 radians carries its fp32 frequency's rounding
    # (~T * 6e-8), and the two libraries' sin/cos kernels (libm or SLEEF, by CPU) differ in the last bits
    assert (a - table).abs().max() < 4 * T * 2**-24 and (b - table).abs().max() < 4 * T * 2**-24
    assert rel_err(a, b) < 1e-5


def test_bench_peers_checks_the_outputs_where_the_math_is_the_same():
    from transnormer.bench.suite import _peer_output_verdict

    v = _peer_output_verdict(seq_len=70)
    assert v.startswith("PASS"), v
