"""Long Range Arena presets (spec lra.md §3, transnormer.md §6-7) and their training settings.

Registered presets (task ``cls``), for TASK in listops, text, retrieval, image, pathfinder, pathx:

* ``t1-lra-TASK`` / ``t2-lra-TASK``: the authors' per-task TransNormer (``script_lra.py``): first
  ⌊L/2⌋ layers Diag (block 64), the rest Norm, each followed by a plain GELU MLP of ratio r; pre-norm;
  masked BatchNorm (``norm_type="batch"``: statistics over valid positions only, spec §12 item 6) in
  the blocks, inside the attentions (T1: both; T2: NormAttention only) and as the final norm; plain
  RoPE (fixed θ) in both attentions plus sinusoidal absolute positions; non-causal; mean or
  last-valid-token pooling.
  The SRMSNorm variant is the override ``norm_type="simple_rms"`` (``--set norm_type=simple_rms``).
* ``vanilla-lra-TASK``: the same stack with softmax attention (layer type ``softmax``, no RoPE:
  the paper's "Vanilla Transformer" uses absolute positions only) in every layer.
* ``flash-lra-TASK``: FLASH (layer type ``flash``) with twice the layer count (flash.md §7.1:
  "2× the Transformer's layer count"; a GAU block replaces attention + FFN, so no FFN).
* ``*-lra-TASK-tiny``: 2 layers (flash: 4), d = 64, 4 heads, block 32: for CPU tests and demos.

``image`` presets serve the ``image-fmnist32`` stand-in too (same length and vocabulary).
:data:`LRA_TRAINING` holds the per-task optimisation settings the runner
(``transnormer lra train``) uses as defaults.

Deviations / choices [D, I] (documented in docs/lra.md):

* one dropout value for the residual branches and the embedding: the per-task dropout (0, Image
  0.2). The authors additionally used dropout 0.1 after the absolute positions; our config has no
  separate embedding dropout field.
* ``scale_embedding=True``: with our N(0, d^-1/2) embedding init this gives unit-variance token
  embeddings next to unit-amplitude sinusoids, as the S4-lineage ``nn.Embedding`` (N(0, 1)) did [I].
* Retrieval: the two-tower head lives in :mod:`transnormer.models.dual_encoder`; the preset config
  is the shared encoder's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .presets import register_preset

# Vocabulary sizes / pad ids are read from the data registry lazily (no torch needed there, but keep the
# import of this module cheap and independent of the data package at import time).


@dataclass(frozen=True)
class LRAModelRow:
    """One row of lra.md §3 (model part)."""

    length: int
    layers: int
    hidden: int
    diag_heads: int
    norm_heads: int
    ffn_ratio: float
    dropout: float


LRA_MODELS: dict[str, LRAModelRow] = {
    "listops": LRAModelRow(2048, 4, 128, 8, 8, 4, 0.0),
    "text": LRAModelRow(4096, 4, 128, 8, 8, 4, 0.0),
    "retrieval": LRAModelRow(4000, 4, 128, 4, 8, 4, 0.0),
    "image": LRAModelRow(1024, 12, 128, 4, 8, 2, 0.2),
    "pathfinder": LRAModelRow(1024, 4, 128, 8, 8, 1, 0.0),
    "pathx": LRAModelRow(16384, 6, 64, 8, 8, 2.5, 0.0),
}
"""Per-task model shape (lra.md §3). Path-X dropout is not given (n/a): 0 [D]."""

LRA_PRESET_TASKS = tuple(LRA_MODELS)

LRA_TRAINING: dict[str, dict] = {
    # lr, total batch (number of GPUs it was spread over), warmup steps, epochs, dropout: lra.md §3 (C).
    # Shared (C): AdamW, weight decay 0, cosine with warmup, num_training_steps 50,000, no clipping,
    # seed 2222. betas: torch AdamW defaults (the S4-lineage pipeline passes none) [I].
    "listops": {"lr": 1e-4, "batch_size": 128, "gpus": 2, "warmup": 1000, "epochs": 40},
    "text": {"lr": 1e-3, "batch_size": 64, "gpus": 4, "warmup": 80, "epochs": 32},
    "retrieval": {"lr": 1e-3, "batch_size": 64, "gpus": 2, "warmup": 800, "epochs": 20},
    "image": {"lr": 1e-3, "batch_size": 200, "gpus": 2, "warmup": 175, "epochs": 200},
    "pathfinder": {"lr": 5e-4, "batch_size": 128, "gpus": 4, "warmup": 312, "epochs": 200},
    "pathx": {"lr": 1e-4, "batch_size": 64, "gpus": 8, "warmup": None, "epochs": None},  # n/a in the source
}
_SHARED_TRAINING = {
    "weight_decay": 0.0,
    "schedule": "cosine",
    "min_lr_ratio": 0.0,
    "clip": 0.0,
    "seed": 2222,
    "betas": (0.9, 0.999),
    "num_training_steps": 50_000,
    "optimizer": "adamw",
}
for _row in LRA_TRAINING.values():
    for _k, _v in _SHARED_TRAINING.items():
        _row.setdefault(_k, _v)
LRA_TRAINING["image-fmnist32"] = dict(LRA_TRAINING["image"])  # the stand-in uses the Image row (lra.md §5)
"""Per-task training settings (lra.md §3). ``batch_size`` is the total over ``gpus`` GPUs; whether the
authors' framework applied it per GPU or globally is unverified [I]. ``warmup``/``epochs`` ``None``:
not given by the authors (Path-X)."""

TINY_LRA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "diag_num_attention_heads": 4,
            "block_size": 32}


def _task_meta(task: str) -> tuple[int, int, str]:
    from ..data.lra.registry import TASKS

    info = TASKS[task]
    return info.vocab_size, info.pad_id, info.pooling


def lra_config(task: str, variant: str = "t2", *, norm_type: str = "batch", tiny: bool = False, **kw) -> dict:
    """Config kwargs of the TransNormer LRA model for ``task`` (``t1``/``t2``); ``kw`` overrides."""
    if task not in LRA_MODELS:
        raise ValueError(f"no LRA preset for task {task!r}; known: {sorted(LRA_MODELS)}")
    row = LRA_MODELS[task]
    vocab, pad_id, pooling = _task_meta(task)
    cfg = dict(
        vocab_size=vocab,
        pad_token_id=pad_id,
        bos_token_id=None,
        eos_token_id=None,
        hidden_size=row.hidden,
        num_hidden_layers=row.layers,
        num_attention_heads=row.norm_heads,
        diag_num_attention_heads=row.diag_heads,
        variant=variant,
        block_size=64,
        chunk_size=64,
        norm_type=norm_type,
        ffn_type="ffn",
        ffn_act="gelu",
        ffn_hidden_size=int(round(row.ffn_ratio * row.hidden)),
        pre_norm=True,
        final_norm=True,
        abs_pos="sinusoidal",
        scale_embedding=True,
        embed_norm=False,
        max_position_embeddings=row.length,
        lrpe="rope",
        lrpe_learn_theta=False,
        causal=False,
        dropout=row.dropout,
        attention_dropout=0.0,
        classifier_pooling=pooling,
        num_labels=_num_classes(task),
        tie_word_embeddings=False,
    )
    if tiny:
        cfg.update(TINY_LRA)
        cfg["ffn_hidden_size"] = int(round(row.ffn_ratio * TINY_LRA["hidden_size"]))
    cfg.update(kw)
    return cfg


def _num_classes(task: str) -> int:
    from ..data.lra.registry import TASKS

    return TASKS[task].num_classes


def vanilla_lra_config(task: str, *, tiny: bool = False, **kw) -> dict:
    """Softmax attention in every layer, otherwise the TransNormer LRA stack (no RoPE: absolute only)."""
    cfg = lra_config(task, "t2", tiny=tiny)
    cfg["layer_types"] = ["softmax"] * cfg["num_hidden_layers"]
    cfg["diag_num_attention_heads"] = None
    cfg.update(kw)
    return cfg


def flash_lra_config(task: str, *, tiny: bool = False, **kw) -> dict:
    """FLASH with 2× the layers and no FFN (the GAU block replaces attention + FFN).

    Everything outside the token mixer is the TransNormer LRA stack (masked BatchNorm pre-norm, as in
    the authors' ``trans-flash-lra-*`` yamls, flash.md §6). FLASH: e = 2d, s = min(128, d), RoPE +
    Toeplitz bias; a mix of flash.md §6's two presets, chosen [D]: the chunk C = 64 of
    ``tn_baseline`` (the OpenNLPLab ports the TransNormer paper compared against; 32 for ``-tiny``)
    with the global normaliser "visible" of ``paper`` (``tn_baseline``'s 1/C grows with the
    number of chunks, which on LRA's 1k–16k-token inputs is 16–256). Depth and width are the
    TransNormer LRA stack's, doubled in layers, not the yamls' own.
    """
    cfg = lra_config(task, "t2", tiny=tiny)
    layers = 2 * cfg["num_hidden_layers"]
    opts = {"expansion": 2, "qk_dim": min(128, cfg["hidden_size"]), "rel_bias": "toeplitz", "rope": "full",
            "chunk_size": 32 if tiny else 64, "normalizer": "visible"}
    cfg.update(num_hidden_layers=layers, layer_types=["flash"] * layers, diag_num_attention_heads=None,
               layer_options={"flash": opts})
    cfg.update(kw)
    return cfg


def _lra_widths(task: str):
    """derive() of a task's LRA presets: a width given without its FFN keeps lra.md §3's ratio (it had
    kept the preset's absolute FFN width), and FLASH's s stays min(128, d)."""
    def derive(kwargs: dict, overrides: dict) -> None:
        if "hidden_size" not in overrides:
            return
        d = kwargs["hidden_size"]
        if "ffn_hidden_size" not in overrides and kwargs.get("ffn_hidden_size") is not None:
            kwargs["ffn_hidden_size"] = int(round(LRA_MODELS[task].ffn_ratio * d))
        from .presets import current_model_rules

        flash = (kwargs.get("layer_options") or {}).get("flash")
        given = (overrides.get("layer_options") or {}).get("flash") if isinstance(overrides.get("layer_options"),
                                                                                dict) else None
        # (model rules 1: any layer_options given replaced the preset's, and nothing was derived)
        derive_qk = "layer_options" not in overrides if current_model_rules() < 2 else (
            not isinstance(given, dict) or "qk_dim" not in given)
        if isinstance(flash, dict) and derive_qk:
            kwargs["layer_options"] = {**kwargs["layer_options"], "flash": {**flash, "qk_dim": min(128, d)}}

    return derive


def lra_preset_names(task: str | None = None) -> list[str]:
    tasks = LRA_PRESET_TASKS if task is None else (task,)
    return [f"{kind}-lra-{t}{sfx}" for t in tasks for kind in ("t1", "t2", "vanilla", "flash") for sfx in ("", "-tiny")]


for _task in LRA_PRESET_TASKS:
    for _tiny, _sfx in ((False, ""), (True, "-tiny")):
        for _v in ("t1", "t2"):
            register_preset(f"{_v}-lra-{_task}{_sfx}", "cls",
                            lambda t=_task, v=_v, s=_tiny: lra_config(t, v, tiny=s), _lra_widths(_task))
        register_preset(f"vanilla-lra-{_task}{_sfx}", "cls", lambda t=_task, s=_tiny: vanilla_lra_config(t, tiny=s),
                        _lra_widths(_task))
        register_preset(f"flash-lra-{_task}{_sfx}", "cls", lambda t=_task, s=_tiny: flash_lra_config(t, tiny=s),
                        _lra_widths(_task))
