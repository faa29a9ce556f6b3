"""Attention dilution: the window metric (hand cases), attention maps, and model curves."""

import json

import pytest
import torch
import torch.nn as nn

from conftest import write_small_corpus
from transnormer.analysis import (
    DEFAULT_RS,
    AttentionMap,
    NoAttentionMap,
    attention_map,
    curve_auc,
    dilution_curves,
    locally_accumulated_score,
    plot_dilution_compare,
    run_dilution,
    uniform_reference,
    window_bounds,
)
from transnormer.layers import DiagAttention, NormAttention
from transnormer.models.presets import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _bounds(N, r, mode):
    s, e = window_bounds(N, r, mode)
    return list(zip(s.tolist(), e.tolist(), strict=True))


# ----------------------------------------------------------------------------- windows


def test_window_bounds_hand_cases():
    # N = 5, r = 0.4: rN = 2, h = 1, shift length W = 3
    assert _bounds(5, 0.4, "clip") == [(0, 1), (0, 2), (1, 3), (2, 4), (3, 4)]
    assert _bounds(5, 0.4, "shift") == [(0, 2), (0, 2), (1, 3), (2, 4), (2, 4)]
    assert _bounds(5, 0.4, "causal") == [(0, 0), (0, 1), (0, 2), (1, 3), (2, 4)]
    # r = 0: the window is the token itself in every mode
    for mode in ("clip", "shift", "causal"):
        assert _bounds(5, 0.0, mode) == [(i, i) for i in range(5)]
    # r = 1: clip cuts the ±2 window at the ends, shift covers the whole row, causal all of j ≤ i
    assert _bounds(5, 1.0, "clip") == [(0, 2), (0, 3), (0, 4), (1, 4), (2, 4)]
    assert _bounds(5, 1.0, "shift") == [(0, 4)] * 5
    assert _bounds(5, 1.0, "causal") == [(0, i) for i in range(5)]
    # N = 4, r = 0.5: h = 1, W = 3 (odd windows, even N)
    assert _bounds(4, 0.5, "shift") == [(0, 2), (0, 2), (1, 3), (1, 3)]


def test_window_floor_is_robust_to_float_error():
    # 0.29 * 100 = 28.999999999999996 in floats; the window must still hold ⌊29⌋ previous tokens
    s, e = window_bounds(100, 0.29, "causal")
    assert int(s[50]) == 21 and int(e[50]) == 50
    with pytest.raises(ValueError):
        window_bounds(10, 0.5, "centred")
    with pytest.raises(ValueError):
        window_bounds(10, 1.5, "clip")


def test_hand_matrices():
    N, r = 5, [0.4]
    sink = torch.zeros(N, N)
    sink[:, 0] = 1  # every row attends to token 0
    assert locally_accumulated_score(sink, r, "clip").item() == pytest.approx(2 / 5)  # rows 0, 1 see j=0
    assert locally_accumulated_score(sink, r, "shift").item() == pytest.approx(2 / 5)
    assert locally_accumulated_score(sink, r, "causal").item() == pytest.approx(3 / 5)  # rows 0, 1, 2
    last = torch.zeros(N, N)
    last[:, -1] = 1
    assert locally_accumulated_score(last, r, "clip").item() == pytest.approx(2 / 5)  # rows 3, 4
    assert locally_accumulated_score(last, r, "shift").item() == pytest.approx(2 / 5)  # rows 3 ([2,4]), 4
    assert locally_accumulated_score(last, r, "causal").item() == pytest.approx(1 / 5)  # row 4 only
    uni = torch.full((N, N), 1 / N)
    # window lengths: clip [2,3,3,3,2], shift [3]*5, causal [1,2,3,3,3]
    assert locally_accumulated_score(uni, r, "clip").item() == pytest.approx(13 / 25)
    assert locally_accumulated_score(uni, r, "shift").item() == pytest.approx(15 / 25)
    assert locally_accumulated_score(uni, r, "causal").item() == pytest.approx(12 / 25)
    rows = locally_accumulated_score(uni, r, "clip", reduce=False)
    assert rows.shape == (N, 1) and rows[:, 0].tolist() == pytest.approx([0.4, 0.6, 0.6, 0.6, 0.4])


@pytest.mark.parametrize("N", [100, 101])
def test_uniform_attention_gives_r(N):
    rs = torch.tensor(DEFAULT_RS, dtype=torch.float64)
    P = torch.full((3, N, N), 1.0 / N)  # leading dims are averaged
    # shift: L = min(N, 2⌊rN/2⌋+1)/N, so |L − r| ≤ 1/N (the odd window vs rN)
    L = locally_accumulated_score(P, DEFAULT_RS, "shift")
    assert (L - rs).abs().max() <= 1 / N + 1e-12
    # clip: rows near the ends lose part of their window: L = (2h+1)/N − h(h+1)/N² = r − r²/4 + O(1/N)
    L = locally_accumulated_score(P, DEFAULT_RS, "clip")
    h = torch.tensor([int(r * N / 2 + 1e-9) for r in DEFAULT_RS], dtype=torch.float64)
    assert torch.allclose(L, (2 * h + 1) / N - h * (h + 1) / N**2, atol=1e-12)
    assert (L - (rs - rs**2 / 4)).abs().max() <= 2 / N
    assert uniform_reference(N, DEFAULT_RS, "shift") == pytest.approx(
        locally_accumulated_score(P[0], DEFAULT_RS, "shift").tolist())


@pytest.mark.parametrize("mode", ["clip", "shift", "causal"])
def test_identity_gives_one(mode):
    L = locally_accumulated_score(torch.eye(37).expand(2, 3, 37, 37), DEFAULT_RS, mode)
    assert torch.allclose(L, torch.ones_like(L))  # r = 0 included: the window always holds i


def test_auc():
    assert curve_auc([0, 0.5, 1], [0, 0.5, 1]) == pytest.approx(0.5)
    assert curve_auc(DEFAULT_RS, [1.0] * len(DEFAULT_RS)) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- attention maps


def _x(B=2, T=40, d=32):
    return torch.randn(B, T, d)


def test_softmax_diag_map_reproduces_layer_output():
    layer = DiagAttention(32, 4, causal=True, kernel="softmax", block_size=16).eval()
    x = _x()
    amap = attention_map(layer, x)
    assert amap.kind == "softmax" and not amap.flagged and amap.weights.shape == (2, 4, 40, 40)
    P = amap.weights
    assert torch.allclose(P.sum(-1), torch.ones(2, 4, 40, dtype=P.dtype))
    blk = torch.arange(40) // 16
    assert (P[..., blk[:, None] != blk[None, :]] == 0).all() and (P.triu(1) == 0).all()
    # the map is the layer's own weights: out_proj(P V) is its output
    _, _, v = layer.featurize(x, torch.arange(40).expand(2, 40))
    o = torch.einsum("bhij,bjhe->bihe", P.float(), v).reshape(2, 40, 32)
    assert torch.allclose(layer.out_proj(o), layer(x)[0], atol=1e-5)


def test_diag_map_refuses_left_padding_as_the_layer_does():
    layer = DiagAttention(32, 4, causal=True, kernel="softmax", block_size=16).eval()
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :3] = False  # left-padded: blocks cut by index would not be the unpadded sequence's
    for fn in (lambda: layer(_x(), attention_mask=mask), lambda: attention_map(layer, _x(), attention_mask=mask)):
        with pytest.raises(ValueError, match="needs right-padded rows"):
            fn()


def test_rela_and_norm_maps():
    x = _x()
    rela = attention_map(DiagAttention(32, 4, causal=False, kernel="relu", block_size=16), x)
    sums = rela.weights.sum(-1)
    assert rela.kind == "rela" and (rela.weights >= 0).all()
    assert ((sums - 1).abs() < 1e-9).logical_or(sums == 0).all()  # row-normalised, dead rows stay 0
    for kernel, causal in [("elu", True), ("1+elu", False)]:
        layer = NormAttention(32, 4, causal=causal, kernel=kernel, lrpe="none")
        amap = attention_map(layer, x)
        q, k, _ = layer.featurize(x, torch.arange(40).expand(2, 40))
        s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double())
        if causal:
            s = s.tril()
        assert torch.allclose(amap.weights, s.abs() / s.abs().sum(-1, keepdim=True))
        # elu features give negative scores (flagged); 1+elu without LRPE gives positive ones
        assert amap.flagged == (kernel == "elu") and (amap.kind == "linear_abs") == (kernel == "elu")


def test_norm_map_respects_padding():
    layer = NormAttention(32, 4, causal=False, kernel="1+elu", lrpe="none")
    x = _x()
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, 30:] = False
    P = attention_map(layer, x, mask).weights
    assert (P[0, :, :, 30:] == 0).all()
    assert torch.allclose(P[0, :, :30, :30], attention_map(layer, x[:1, :30]).weights[0])


class _Uniform(nn.Module):
    causal = False

    def forward(self, x, *, attention_mask=None, positions=None, cache=None, use_cache=False):
        return x, None

    def attention_weights(self, x, attention_mask, positions):
        B, T, _ = x.shape
        return torch.full((B, 2, T, T), 1.0 / T)


class _Opaque(_Uniform):
    attention_weights = None


class _Toy(nn.Module):
    """Minimal model shape: blocks with a ``.mixer``, called as the real blocks call it."""

    def __init__(self, mixers):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.layers = nn.ModuleList(nn.Module() for _ in mixers)
        for block, m in zip(self.layers, mixers, strict=True):
            block.mixer = m

    def forward(self, input_ids, attention_mask=None):
        x = self.emb(input_ids)
        pos = torch.arange(x.shape[1]).expand(x.shape[:2])
        for block in self.layers:
            x = x + block.mixer(x, attention_mask=attention_mask, positions=pos)[0]
        return x


def test_generic_fallback_and_skip():
    model = _Toy([_Uniform(), _Opaque()])
    with pytest.raises(NoAttentionMap):
        attention_map(_Opaque(), torch.randn(1, 4, 8))
    assert isinstance(attention_map(_Uniform(), torch.randn(1, 4, 8)), AttentionMap)
    with pytest.warns(UserWarning, match="skipping layer 1"):
        res = dilution_curves(model, torch.randint(0, 50, (2, 20)), mode="shift")
    assert [s["index"] for s in res["skipped"]] == [1] and "attention_weights" in res["skipped"][0]["reason"]
    (layer,) = res["layers"]
    assert layer["kind"] == "layer" and layer["curve"] == pytest.approx(res["uniform_reference"])


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize("preset", ["t1-lm-tiny", "t2-lm-tiny", "t2-roberta-tiny"])
def test_model_curves(preset):
    torch.manual_seed(0)
    model = build_model(preset)
    ids = torch.randint(0, model.config.vocab_size, (2, 96))
    res = dilution_curves(model, ids, mode="clip")
    assert len(res["layers"]) == model.config.num_hidden_layers and not res["skipped"]
    assert res["causal"] == model.config.causal
    for layer in res["layers"]:
        c = torch.tensor(layer["curve"])
        assert c.shape == (len(DEFAULT_RS),)
        assert (c >= -1e-12).all() and (c <= 1 + 1e-9).all()
        assert (c.diff() >= -1e-12).all(), f"{preset} layer {layer['index']} not monotone"
        assert 0 <= layer["auc"] <= 1
        if layer["layer_type"] == "diag":
            assert not layer["flagged"]
            assert layer["kind"] == ("rela" if preset.startswith("t1") else "softmax")
        if layer["layer_type"] == "norm" and preset.startswith("t1"):
            assert layer["flagged"] and layer["kind"] == "linear_abs" and layer["negative_fraction"] > 0.1
    assert model.training  # restored after the capture


def test_padded_batch_matches_unpadded():
    torch.manual_seed(0)
    model = build_model("t2-lm-tiny")
    ids = torch.randint(3, 4096, (1, 64))
    ref = dilution_curves(model, ids, mode="causal")
    left = torch.cat([torch.zeros(1, 16, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 16), torch.ones(1, 64)], 1).long()
    pad = dilution_curves(model, left, mask, mode="causal")
    for a, b in zip(ref["layers"], pad["layers"], strict=True):
        assert a["curve"] == pytest.approx(b["curve"], abs=1e-5)


def test_run_dilution_writes_files(tmp_path):
    out = run_dilution(["t1-lm-tiny", "t2-lm-tiny"], None, tmp_path, seq_len=64, batch_size=1, mode="shift")
    names = sorted(p.split("/")[-1] for p in out["files"])
    assert names == sorted(["dilution_t1-lm-tiny_shift.json", "dilution_t1-lm-tiny_shift.png",
                            "dilution_t2-lm-tiny_shift.json", "dilution_t2-lm-tiny_shift.png",
                            "dilution_compare_shift.png", "dilution_summary_shift.json"])
    summary = json.loads((tmp_path / "dilution_summary_shift.json").read_text())
    assert summary["t1-lm-tiny"]["flagged"] == [2, 3] and set(summary["t2-lm-tiny"]["auc"]) == {"0", "1", "2", "3"}
    with pytest.raises(ValueError):
        plot_dilution_compare({}, tmp_path / "x.png")


def test_run_dilution_refuses_a_model_with_no_scorable_layer(tmp_path):
    """FLASH's layers give no attention matrix: every one was skipped with a warning and the
    model's result was an empty AUC table, written as if it were a finding."""
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="flash-lm-tiny has no layer with an attention"):
        run_dilution(["flash-lm-tiny"], None, tmp_path, seq_len=32, batch_size=1)


def test_empty_window_fractions_or_model_lists_are_refused(tmp_path):
    # a torch stack error, and an empty summary written as if it were a finding
    with pytest.raises(ValueError, match="rs must hold"):
        locally_accumulated_score(torch.full((1, 4, 4), 0.25), rs=[])
    with pytest.raises(ValueError, match="models must name"):
        run_dilution([], None, tmp_path)
    # the ids run_dilution draws: 0 had been "input_ids must be a non-empty [B, T] tensor"
    for kw, match in (({"batch_size": 0}, "batch_size must be >= 1"), ({"seq_len": 0}, "seq_len must be >= 1")):
        with pytest.raises(ValueError, match=match):
            run_dilution(["t2-lm-tiny"], None, tmp_path, **kw)
    assert not list(tmp_path.iterdir())


def test_attention_maps_refuse_a_wrong_width_as_the_layers_do():
    # the map had failed in its projection's matmul with a shape error naming no argument
    from transnormer.analysis import attention_map
    from transnormer.layers import LAYER_TYPES
    from transnormer.presets import get_config

    cfg = get_config("t2-lm-tiny", hidden_size=32, num_attention_heads=2)
    x = torch.randn(1, 4, 64)
    for kind in ("norm", "diag", "softmax", "linear_elu"):
        layer = LAYER_TYPES[kind](cfg, 0)
        with pytest.raises(ValueError, match=r"x must be \[B, T, 32\], got \(1, 4, 64\)"):
            layer(x)
        with pytest.raises(ValueError, match=r"x must be \[B, T, 32\], got \(1, 4, 64\)"):
            attention_map(layer, x)


def test_dilution_cli_seeds_the_presets_it_builds(tmp_path, capsys):
    from transnormer.cli import main

    aucs, data = [], write_small_corpus(tmp_path / "data")
    for run in ("a", "b"):
        assert main(["analyze", "dilution", "--models", "t1-lm-tiny", "--data", data, "--seq-len", "32", "--samples", "1",
                     "--vocab-size", "300", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / run)]) == 0
        aucs.append(json.loads((tmp_path / run / "dilution_summary_clip.json").read_text())["t1-lm-tiny"]["auc"])
    assert aucs[0] == aucs[1]  # had read 0.4739, then 0.5118


def test_chunked_map_evaluation_matches(monkeypatch):
    import transnormer.analysis.dilution as dil

    torch.manual_seed(0)
    model = build_model("t1-lm-tiny")
    ids = torch.randint(0, 4096, (3, 32))
    mask = torch.ones(3, 32, dtype=torch.long)
    mask[1, :10] = 0  # left padding in the middle sample
    full = dilution_curves(model, ids, mask)
    monkeypatch.setattr(dil, "MAP_ELEMENTS_BUDGET", 1)  # one sample per map call
    chunked = dilution_curves(model, ids, mask)
    for a, b in zip(full["layers"], chunked["layers"], strict=True):
        assert a["curve"] == pytest.approx(b["curve"], abs=1e-12)
        # the negative share is of all allowed scores, not a mean over chunks (samples of unequal
        # real length had weighed by sample, so the share moved with the chunking)
        assert a["flagged"] == b["flagged"] and a["negative_fraction"] == pytest.approx(b["negative_fraction"],
                                                                                         abs=1e-12)
        # and so is the note's (it had been the chunk's with the most negative scores, its ReLA
        # share one chunk's: 50.5% beside a pooled 45.7%)
        assert a["note"] == b["note"]
    assert any("of the scores" in a["note"] for a in full["layers"])
    assert any("of rows have no positive score" in a["note"] for a in full["layers"])


def _preset_or_skip(name):
    from transnormer.models.presets import PRESETS, _load_extra_presets

    _load_extra_presets()
    if name not in PRESETS:
        pytest.skip(f"preset {name!r} not registered (baseline layers are added concurrently)")
    torch.manual_seed(0)
    return build_model(name)


@pytest.mark.parametrize("preset", ["vanilla-lm-tiny", "linear-elu-lm-tiny", "performer-lm-tiny",
                                    "cosformer-lm-tiny", "flash-lm-tiny"])
def test_baseline_models(preset):
    from transnormer.analysis import has_attention_map

    model = _preset_or_skip(preset)
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    if not has_attention_map(model.model.layers[0].mixer):
        # e.g. FLASH exposes no single attention matrix: its layers are skipped, not failed
        with pytest.warns(UserWarning):
            res = dilution_curves(model, ids, mode="causal")
        assert len(res["skipped"]) == model.config.num_hidden_layers
        return
    res = dilution_curves(model, ids, mode="causal")
    assert not res["skipped"]
    for layer in res["layers"]:
        c = torch.tensor(layer["curve"])
        assert (c >= -1e-12).all() and (c <= 1 + 1e-9).all() and (c.diff() >= -1e-12).all()
        if preset in ("linear-elu-lm-tiny", "performer-lm-tiny"):
            assert not layer["flagged"] and layer["kind"] == "linear"  # positive features


@pytest.mark.parametrize("preset", ["vanilla-lm-tiny", "linear-elu-lm-tiny"])
def test_baseline_map_reproduces_layer_output(preset):
    model = _preset_or_skip(preset)
    mixer = model.model.layers[0].mixer.eval()
    x = torch.randn(2, 40, model.config.hidden_size)
    P = attention_map(mixer, x).weights.float()
    _, _, v = (mixer.featurize(x, torch.arange(40).expand(2, 40)) if preset.startswith("vanilla")
               else mixer.featurize(x, torch.arange(40).expand(2, 40), None))
    o = torch.einsum("bhij,bjhe->bihe", P, v.float()).reshape(2, 40, -1)
    # linear_elu divides by Σs + eps (eps = 1e-6), the map by Σs: equal to ~1e-6 relative
    assert torch.allclose(mixer.out_proj(o), mixer(x)[0], atol=1e-4)


@pytest.mark.parametrize("preset", ["t1-lm-tiny", "t1-roberta-tiny"])
def test_padded_query_rows_do_not_count_in_the_negative_share(preset):
    """negative_fraction (and so the flag) is over real entries: the padded sample reads as the
    unpadded one (it had read 0.464 for 0.5, and 0.534 for 0.504)."""
    torch.manual_seed(0)
    model = build_model(preset, dropout=0.0).eval()
    ids = torch.randint(3, 4096, (1, 40))
    mask = torch.zeros(1, 40, dtype=torch.long)
    mask[0, :20] = 1  # right padding
    pad = dilution_curves(model, ids, mask, rs=[0.5])
    ref = dilution_curves(model, ids[:, :20], rs=[0.5])
    norm_layers = [(a, b) for a, b in zip(pad["layers"], ref["layers"], strict=True) if a["layer_type"] == "norm"]
    assert norm_layers
    for a, b in norm_layers:
        assert a["negative_fraction"] == pytest.approx(b["negative_fraction"], abs=1e-12)
        assert a["flagged"] == b["flagged"] and a["curve"] == pytest.approx(b["curve"], abs=1e-6)


def test_uniform_reference_follows_the_real_lengths_of_padded_samples():
    # the reference used the padded T although each sample is scored at its own length
    from transnormer.analysis.dilution import dilution_curves, uniform_reference

    torch.manual_seed(0)
    model = build_model("t2-roberta-tiny", num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                        vocab_size=64, block_size=8, chunk_size=8).eval()
    ids = torch.randint(3, 64, (2, 32))
    mask = torch.zeros(2, 32, dtype=torch.long)
    mask[0, :8], mask[1, :16] = 1, 1
    res = dilution_curves(model, ids, mask, rs=[0.5, 1.0])
    want = (8 * torch.tensor(uniform_reference(8, [0.5, 1.0]), dtype=torch.float64)
            + 16 * torch.tensor(uniform_reference(16, [0.5, 1.0]), dtype=torch.float64))
    assert res["uniform_reference"] == pytest.approx((want / 24).tolist(), abs=1e-12)
    with pytest.raises(ValueError, match="input_ids must be a non-empty"):
        dilution_curves(model, ids[0])
    with pytest.raises(ValueError, match="no real token"):
        dilution_curves(model, ids, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="rs must hold"):
        dilution_curves(model, ids, rs=[])


def test_a_layer_map_with_rows_above_one_is_normalised():
    """A non-negative map from a layer's attention_weights was used as it came: rows summing to 3
    weighed in as three distributions (its curve then differed with how the samples were chunked)."""

    class _Heavy(_Uniform):
        def attention_weights(self, x, attention_mask, positions):
            B, T, _ = x.shape
            return torch.full((B, 2, T, T), 3.0 / T)

    amap = attention_map(_Heavy(), torch.randn(1, 4, 8))
    assert amap.kind == "layer_normalized" and torch.allclose(amap.weights.sum(-1), torch.ones(1, 2, 4, dtype=amap.weights.dtype))
    assert attention_map(_Uniform(), torch.randn(1, 4, 8)).kind == "layer"


def test_run_dilution_refuses_clashing_names_and_unordered_windows(tmp_path):
    # "runs/t2" and "runs_t2" had written the same files (one model's results lost); an unordered rs
    # gave a negative AUC
    model = build_model("t2-lm-tiny", vocab_size=64, num_hidden_layers=1)
    ids = torch.randint(3, 64, (1, 16))
    with pytest.raises(ValueError, match="would write the same output files"):
        run_dilution({"runs/t2": model, "runs_t2": model}, ids, tmp_path)
    with pytest.raises(ValueError, match="rs must be increasing"):
        dilution_curves(model, ids, rs=[1.0, 0.5, 0.0])


def test_analyze_dilution_keeps_a_presets_position_limit(tmp_path, monkeypatch):
    # cosFormer's re-weighting length M is max_position_embeddings: the CLI had set it to 512 for
    # cosformer-lm-tiny (1024), analysing another model than the preset
    from transnormer import presets
    from transnormer.cli import main

    write_small_corpus(tmp_path, splits=(("train", 200), ("valid", 20), ("test", 20)))
    seen = []

    class Stop(Exception):
        pass

    def spy(name, **kw):
        seen.append(kw["max_position_embeddings"])
        raise Stop

    monkeypatch.setattr(presets, "build_model", spy)
    with pytest.raises(Stop):
        main(["analyze", "dilution", "--models", "cosformer-lm-tiny", "--data", str(tmp_path), "--seq-len", "64",
              "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")])
    assert seen == [presets.get_config("cosformer-lm-tiny").max_position_embeddings] == [1024]
