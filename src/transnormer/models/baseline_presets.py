"""Presets of the paper's baselines as ``layer_types`` of the same model family.

Softmax / linear baselines keep everything of the matching TransNormer T2 preset (embedding,
block layout, norms, GLU FFN, head, training dropout) and change only ``layer_types`` (all
layers one type), so a comparison changes one field:

    vanilla-*      softmax (SDPA), no RoPE: the paper's "Vanilla Transformer"
    linear-elu-*   1+elu with denominator (Katharopoulos et al.)
    linear-elu-noscale-*   the same without denominator and without any norm (spec §9, Table 1)
    performer-*    FAVOR+ (⌊d_h ln d_h⌋ orthogonal features, redraw every 1000 training calls)
    cosformer-*    ReLU + cos re-weighting (M = max_position_embeddings causal, row length otherwise)

GAU models follow flash.md §1–§3 ("paper" preset of §6): twice the layers (each GAU replaces
attention + FFN), e = 2d, s = 128, ScaleNorm pre-norm and final ScaleNorm, scaled sinusoid with
α₀ = d^{-1/2} on unscaled embeddings, RoPE + Toeplitz bias:

    flash-quad-*   GAU layers; N_q = seq_len for MLM, fixed (T_fix = 512, the training length)
                   for the LM so that it can decode (flash.md §1.1)
    flash-*        FLASH layers, C = 256, global N_g = visible
    flash-tn-*     flash.md §6 ``tn_baseline``: the numerics of the FLASH the TransNormer paper
                   compared against (OpenNLPLab port): C = 64, global N_g = 1/C, fairseq sinusoid
                   on √d-scaled embeddings; padding masks stay correct. The LM has the port's 10
                   layers (``flash_wiki``; 153.5M parameters, the paper's Table 4 lists 153M)

Dropout: the GAU models keep the T2 presets' training dropout, so a comparison changes only the
mixer: 0.1 on the embedding and the residual branches; on A none in the LM presets and 0.1 in the
RoBERTa ones (``attention_dropout``, as t2-roberta's). This departs from flash.md §1.4, whose
default [D] is dropout on A only: we keep T2's so that the comparison is of mixers alone, and dropout
on A would also take causal FLASH off its fused path (``layers/gau.py``). Set ``attention_dropout``
(and ``dropout=0``) for the spec's default.

The softmax baseline keeps T2's GLU FFN and SRMSNorm, so it isolates the attention rule; the
fairseq ``transformer_lm`` block would be ``ffn_type="ffn", ffn_act="relu", ffn_hidden_size=2048,
norm_type="layer"``, and Transformer+ (RoPE) is ``layer_options={"softmax": {"rope": True}}``.

Every preset has a ``-tiny`` version (width 128, 4 layers — 8 for GAU models — and C = 32 for
FLASH, so chunk boundaries appear in short test inputs).
"""

from __future__ import annotations

from .presets import lm_base, register_preset, roberta_base, tiny

LINEAR_BASELINES = {"vanilla": "softmax", "linear-elu": "linear_elu", "performer": "performer",
                    "cosformer": "cosformer"}
GATED_BASELINES = {"flash-quad": "gau", "flash": "flash"}
NOSCALE = {"linear_elu": {"denominator": False}}


def _layers(kind: str, n: int) -> dict:
    return {"num_hidden_layers": n, "layer_types": [kind] * n}


def _gated(kind: str, *, causal: bool, small: bool) -> dict:
    """Fields that make a preset a FLASH-paper model (flash.md §1.3, §1.4, §6 'paper')."""
    opts = {"expansion": 2, "qk_dim": 128, "rel_bias": "toeplitz", "rope": "full"}
    if kind == "gau":
        opts.update(normalizer="fixed", fixed_len=512) if causal else opts.update(normalizer="seq_len")
    else:
        opts.update(chunk_size=32 if small else 256, normalizer="visible")
    return {"norm_type": "scale", "pre_norm": True, "final_norm": True, "abs_pos": "scaled_sinusoid",
            "scale_embedding": False, "embed_norm": False, "layer_options": {kind: opts}}


def _factory(task: str, kind: str, *, small: bool, options: dict | None = None):
    def make() -> dict:
        base = lm_base if task == "clm" else roberta_base
        depth = base()["num_hidden_layers"]
        if small:
            depth = tiny(base())["num_hidden_layers"]
        gated = kind in GATED_BASELINES.values()
        kw = _layers(kind, 2 * depth if gated else depth)
        if gated:
            kw.update(_gated(kind, causal=task == "clm", small=small))
        if options:
            kw["layer_options"] = {**kw.get("layer_options", {}), **options}
        return tiny(base(), **kw) if small else base(**kw)

    return make


def _tn_baseline(task: str, small: bool):
    flash = _factory(task, "flash", small=small)

    def make() -> dict:
        cfg = flash()
        opts = dict(cfg["layer_options"]["flash"], chunk_size=32 if small else 64, normalizer="chunk")
        cfg.update(layer_options={"flash": opts}, abs_pos="sinusoidal", scale_embedding=True)
        if task == "clm" and not small:
            # the authors' flash_wiki: 10 layers at d = 512 (flash.md §6), 153.5M parameters with
            # our vocabulary, as the paper's Table 4 lists for FLASH (153M; 12 layers: 156.8M)
            cfg.update(_layers("flash", 10))
        return cfg

    return make


def _register_all() -> None:
    for stem, kind in {**LINEAR_BASELINES, **GATED_BASELINES}.items():
        for suffix, task in (("lm", "clm"), ("roberta", "mlm")):
            register_preset(f"{stem}-{suffix}", task, _factory(task, kind, small=False))
            register_preset(f"{stem}-{suffix}-tiny", task, _factory(task, kind, small=True))
    for suffix, task in (("lm", "clm"), ("roberta", "mlm")):
        for small, sfx in ((False, ""), (True, "-tiny")):
            register_preset(f"flash-tn-{suffix}{sfx}", task, _tn_baseline(task, small))
        register_preset(f"linear-elu-noscale-{suffix}", task, _factory(task, "linear_elu", small=False, options=NOSCALE))
        register_preset(f"linear-elu-noscale-{suffix}-tiny", task,
                        _factory(task, "linear_elu", small=True, options=NOSCALE))


_register_all()
