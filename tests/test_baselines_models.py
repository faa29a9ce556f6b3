"""Baseline presets at model level: causality, padding invariance, 8k tokens, presets, flags."""

import pytest
import torch

from conftest import sharpen_gau
from transnormer.layers import LinearAttention
from transnormer.models import TransNormerForCausalLM, TransNormerModel
from transnormer.models.baseline_presets import GATED_BASELINES, LINEAR_BASELINES
from transnormer.presets import PRESETS, build_model, count_parameters, get_config

STEMS = [*LINEAR_BASELINES, *GATED_BASELINES, "flash-tn", "linear-elu-noscale"]
CAUSAL = [f"{s}-lm-tiny" for s in STEMS]
BIDIRECTIONAL = [f"{s}-roberta-tiny" for s in STEMS]




def tiny_model(name, **kw):
    torch.manual_seed(0)
    return sharpen_gau(build_model(name, vocab_size=97, dropout=0.0, attention_dropout=0.0, **kw)).eval()


@pytest.mark.parametrize("name", CAUSAL)
def test_causality_across_chunk_boundaries(name):
    """Tokens after t are resampled (one batch row per t): logits ≤ t must not move."""
    model = tiny_model(name)  # chunks and FLASH's C are 32
    ts = (0, 31, 32, 33, 64)
    x = torch.randint(0, 97, (1, 70)).repeat(len(ts) + 1, 1)
    for row, t in enumerate(ts, start=1):
        x[row, t + 1:] = torch.randint(0, 97, (69 - t,))
    out = model(x).logits
    for row, t in enumerate(ts, start=1):
        assert torch.allclose(out[row, :t + 1], out[0, :t + 1], atol=1e-5), t


@pytest.mark.parametrize("name", BIDIRECTIONAL)
def test_padding_invariance(name):
    """One batch: right, left and both-sided padding of the same 45 tokens (crossing C = 32)."""
    model = tiny_model(name)
    body = model.model
    x = torch.randint(3, 97, (1, 45))
    ref = body(x).last_hidden_state[0]
    L = 45 + 20
    placements = (0, 20, 1, 13)  # leading pads per row; the rest of the 20 trail
    ids = torch.zeros(len(placements), L, dtype=torch.long)
    mask = torch.zeros(len(placements), L, dtype=torch.bool)
    for row, lead in enumerate(placements):
        ids[row, lead:lead + 45], mask[row, lead:lead + 45] = x[0], True
    out = body(ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(out).all()
    for row, lead in enumerate(placements):
        assert torch.allclose(out[row, lead:lead + 45], ref, atol=1e-5), lead


@pytest.mark.parametrize("name", CAUSAL + BIDIRECTIONAL)
def test_8k_tokens_finite_outputs_and_gradients(name):
    """Every preset's layer type at T = 8192 (fp32): finite outputs and gradients.

    Cheap: width 32-64, 1-2 layers, s = 32; softmax runs on SDPA, GAU is quadratic by design.
    """
    cfg = get_config(name)
    kind = cfg.layer_types[0]
    opts = dict(cfg.layer_options)
    quadratic = kind in ("softmax", "gau")
    if kind in ("gau", "flash"):
        opts[kind] = {**opts.get(kind, {}), "qk_dim": 32}
    layers = 1 if quadratic else 2
    torch.manual_seed(0)
    model = build_model(name, vocab_size=97, hidden_size=32 if quadratic else 64, num_attention_heads=2,
                        num_hidden_layers=layers, layer_types=[kind] * layers, layer_options=opts, chunk_size=64,
                        max_position_embeddings=8192, dropout=0.0, attention_dropout=0.0)
    x = torch.randint(3, 97, (1, 8192))
    logits = model(x).logits
    assert torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_noscale_flag_reaches_a_bare_numerator():
    """linear-elu-noscale: the denominator is gone and nothing normalises in its place."""
    cfg = get_config("linear-elu-noscale-lm")
    assert cfg.layer_options == {"linear_elu": {"denominator": False}}
    assert build_model("linear-elu-lm-tiny", vocab_size=97).model.layers[0].mixer.denominator is True
    model = build_model("linear-elu-noscale-lm-tiny", vocab_size=97)
    mixers = [b.mixer for b in model.model.layers]
    assert all(isinstance(m, LinearAttention) and m.denominator is False for m in mixers)
    mixer = mixers[0].double()
    x = torch.randn(1, 9, mixer.hidden_size, dtype=torch.float64)
    qf, kf, v = mixer.featurize(x, torch.arange(9)[None])
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * torch.ones(9, 9, dtype=torch.float64).tril()
    num = torch.einsum("bhij,bjhe->bihe", s, v).reshape(1, 9, -1)
    assert torch.allclose(mixer(x)[0], mixer.out_proj(num))  # no norm, no ratio: the raw causal sum


def test_preset_parameter_counts_within_5_percent():
    ref = {"lm": count_parameters("t2-lm"), "roberta": count_parameters("t2-roberta")}
    assert abs(ref["lm"] - 155.98e6) < 0.01e6
    for stem in STEMS:
        for suffix in ("lm", "roberta"):
            n = count_parameters(f"{stem}-{suffix}")
            assert abs(n - ref[suffix]) / ref[suffix] < 0.05, (stem, suffix, n)


def test_preset_shapes():
    for task in ("lm", "roberta"):
        for stem in STEMS:
            for sfx in ("", "-tiny"):
                assert f"{stem}-{task}{sfx}" in PRESETS
    t2, fq = get_config("t2-lm"), get_config("flash-quad-lm")
    assert fq.num_hidden_layers == 2 * t2.num_hidden_layers and fq.norm_type == "scale"
    assert fq.layer_options["gau"]["normalizer"] == "fixed" and fq.layer_options["gau"]["fixed_len"] == 512
    assert get_config("flash-quad-roberta").layer_options["gau"]["normalizer"] == "seq_len"
    assert get_config("flash-lm").layer_options["flash"]["chunk_size"] == 256
    assert get_config("flash-lm-tiny").num_hidden_layers == 2 * get_config("t2-lm-tiny").num_hidden_layers
    m = build_model("flash-lm-tiny", vocab_size=97)
    assert all(b.ffn is None for b in m.model.layers)  # a GAU replaces attention + FFN
    # everything but the layer types is shared with T2 for the softmax/linear baselines
    a, b = get_config("vanilla-roberta").to_dict(), get_config("t2-roberta").to_dict()
    diff = {k for k in a if a[k] != b.get(k)} - {"mixer_types", "transformers_version"}
    assert not diff, diff


@pytest.mark.parametrize("name", ["performer-lm-tiny", "flash-roberta-tiny"])
def test_save_load_exact(tmp_path, name):
    model = tiny_model(name)
    x = torch.randint(0, 97, (2, 40))
    ref = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(x).logits, ref)


def test_causal_gau_decode_at_model_level_uses_fixed_normaliser():
    model = tiny_model("flash-quad-lm-tiny")
    x = torch.randint(0, 97, (1, 12))
    full = model(x).logits
    out = model(x[:, :7], use_cache=True)
    cache, logits = out.past_key_values, [out.logits]
    for t in range(7, 12):
        out = model(x[:, t:t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits)
    assert torch.allclose(torch.cat(logits, 1), full, atol=1e-4)
    with pytest.raises(ValueError, match="seq_len"):
        cfg = get_config("flash-quad-lm-tiny", vocab_size=97)
        cfg.layer_options = {"gau": {**cfg.layer_options["gau"], "normalizer": "seq_len"}}
        TransNormerForCausalLM(cfg)(x[:, :3], use_cache=True)


def test_encoder_model_runs_all_bidirectional_types():
    for name in BIDIRECTIONAL:
        out = TransNormerModel(get_config(name, vocab_size=97))(torch.randint(0, 97, (2, 9)))
        assert torch.isfinite(out.last_hidden_state).all()


def test_flash_tn_lm_has_the_ports_ten_layers():
    # flash.md §6: OpenNLPLab's flash_wiki has 10 layers at d = 512; the paper's Table 4 lists 153M
    with torch.device("meta"):
        m = build_model("flash-tn-lm")
    n = sum(p.numel() for p in m.parameters())
    assert m.config.num_hidden_layers == 10 and abs(n / 1e6 - 153) < 1


def test_norm_and_diag_layer_options_override_and_name_themselves():
    # norm/diag options had been passed beside the config's own values: an override was "multiple values"
    # and an unknown option an error that did not name layer_options
    from transnormer.models import TransNormerConfig, TransNormerModel

    cfg = TransNormerConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                            layer_types=["diag", "norm"], chunk_size=64, block_size=16,
                            layer_options={"norm": {"chunk_size": 16}, "diag": {"block_size": 8}})
    model = TransNormerModel(cfg)
    assert model.layers[1].mixer.chunk_size == 16 and model.layers[0].mixer.block_size == 8
    for kind, opts in (("norm", {"chunk_sise": 16}), ("diag", {"dropout": 0.1})):
        cfg.layer_options = {kind: opts}
        with pytest.raises(TypeError, match=rf"layer_options\['{kind}'\]: .*unexpected keyword"):
            TransNormerModel(cfg)
    cfg.layer_types, cfg.layer_options = ["performer"] * 2, {"performer": {"seed": 1.7}}
    with pytest.raises(ValueError, match=r"layer_options\['performer'\]\['seed'\] must be an int"):
        TransNormerModel(cfg)  # had been truncated to 1
