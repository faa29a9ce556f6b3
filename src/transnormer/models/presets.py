"""The paper's configurations by name (spec §6-7), plus ``-tiny`` versions for tests and demos.

    get_config("t2-lm")                       # 6 layers, 512 wide, 8 heads, WikiText-103 vocab
    get_config("t2-lm-tiny", vocab_size=4096) # any field can be overridden
    build_model("t1-roberta")                 # the task head follows the preset (LM or MLM)

Other layer types register their presets with :func:`register_preset`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import torch

from .configuration import TransNormerConfig, check_overrides

WIKITEXT103_VOCAB = 267_735
ROBERTA_VOCAB = 50_265

# How a run's model config is made from its settings. 1 (runs saved before 2026-12): layer_options
# given replaced the preset's options of that type, and a --config file's max_position_embeddings
# became max(seq_len, 512) in a causal LM run. 2: layer_options are merged, a file keeps its own
# (raised to seq_len). A run resumes under the rules its checkpoint was made with (train/loop.py).
MODEL_RULES = 2
_rules = contextvars.ContextVar("transnormer_model_rules", default=MODEL_RULES)


@contextlib.contextmanager
def model_rules(version: int):
    """Build model configs under the rules of ``version`` (see :data:`MODEL_RULES`) inside the block."""
    token = _rules.set(version)
    try:
        yield
    finally:
        _rules.reset(token)


def current_model_rules() -> int:
    return _rules.get()


# name -> (task, factory returning config kwargs)
PRESETS: dict[str, tuple[str, Callable[[], dict]]] = {}
# name -> derive(kwargs, overrides): sizes a preset states relative to its width (the LRA presets' FFN
# ratio), made again from the overridden kwargs in place where the overrides do not set them
_DERIVE: dict[str, Callable[[dict, dict], None]] = {}


def register_preset(name: str, task: str, factory: Callable[[], dict],
                    derive: Callable[[dict, dict], None] | None = None) -> None:
    if task not in ("clm", "mlm", "cls"):
        raise ValueError(f"task must be 'clm', 'mlm' or 'cls', got {task!r}")
    PRESETS[name] = (task, factory)
    if derive is not None:
        _DERIVE[name] = derive


def lm_base(**kw) -> dict:
    """Autoregressive LM (spec §6 LM row): pre-norm, √d embedding scale, sinusoidal, tied head."""
    cfg = dict(vocab_size=WIKITEXT103_VOCAB, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
               block_size=64, chunk_size=64, pre_norm=True, abs_pos="sinusoidal", scale_embedding=True,
               causal=True, dropout=0.1, attention_dropout=0.0, max_position_embeddings=512)
    cfg.update(kw)
    return cfg


def roberta_base(**kw) -> dict:
    """RoBERTa-style MLM (spec §6): post-norm, learned positions, LayerNorm on embeddings."""
    cfg = dict(vocab_size=ROBERTA_VOCAB, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
               block_size=64, chunk_size=64, pre_norm=False, final_norm=False, abs_pos="learned",
               scale_embedding=False, embed_norm=True, causal=False, dropout=0.1, attention_dropout=0.1,
               initializer="normal", max_position_embeddings=512)
    cfg.update(kw)
    return cfg


TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, block_size=32, chunk_size=32,
            vocab_size=4096, max_position_embeddings=1024)


def tiny(cfg: dict, **kw) -> dict:
    out = dict(cfg)
    out.update(TINY)
    out.update(kw)
    return out


for _v in ("t1", "t2"):
    register_preset(f"{_v}-lm", "clm", lambda v=_v: lm_base(variant=v))
    register_preset(f"{_v}-roberta", "mlm", lambda v=_v: roberta_base(variant=v))
    register_preset(f"{_v}-lm-tiny", "clm", lambda v=_v: tiny(lm_base(variant=v)))
    register_preset(f"{_v}-roberta-tiny", "mlm", lambda v=_v: tiny(roberta_base(variant=v)))


def preset_task(name: str) -> str:
    _check_name(name)
    return PRESETS[name][0]


def _check_name(name: str) -> None:
    _load_extra_presets()
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")


def _load_extra_presets() -> None:
    """Import modules that register more presets (baselines, LRA), if present."""
    import importlib

    for mod in ("transnormer.models.baseline_presets", "transnormer.models.lra_presets"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def get_config(name: str, **overrides) -> TransNormerConfig:
    """The config of preset ``name`` with ``overrides`` applied. ``layer_options`` is merged into the
    preset's, option by option for each layer type: ``{"flash": {"normalizer": "chunk"}}`` changes one
    option of a FLASH preset, whose other options (its chunk size, qk_dim) had been dropped with it."""
    _check_name(name)
    # a misspelt field would be kept by PretrainedConfig as a loose attribute, and the preset built unchanged
    check_overrides(overrides, types=False, where=f"get_config({name!r})")
    kwargs = PRESETS[name][1]()
    given = overrides.get("layer_options")
    merged = {t: dict(o) for t, o in (kwargs.get("layer_options") or {}).items()}
    kwargs.update(overrides)
    if isinstance(given, dict) and merged and current_model_rules() >= 2:
        for t, o in given.items():
            merged[t] = {**merged.get(t, {}), **o} if isinstance(o, dict) else o  # (not a dict: check() says)
        kwargs["layer_options"] = merged
    if name in _DERIVE:
        _DERIVE[name](kwargs, overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides and "layer_types" in kwargs:
        kinds = set(kwargs["layer_types"])
        if len(kinds) == 1:  # a single-type stack (baselines) stays single-type at the new depth
            kwargs["layer_types"] = [kinds.pop()] * overrides["num_hidden_layers"]
        else:  # a mixed schedule is re-derived (first half Diag, the rest Norm)
            kwargs.pop("layer_types")
    return TransNormerConfig(**kwargs)


def build_model(name_or_config, task: str | None = None, **overrides):
    """Instantiate the model of a preset (or config) with the head for ``task`` (default: the preset's;
    for a config, the head its ``architectures`` names, else a causal or masked LM by ``causal``)."""
    from .modeling import TransNormerForCausalLM, TransNormerForMaskedLM, TransNormerForSequenceClassification

    if isinstance(name_or_config, TransNormerConfig):
        if overrides:  # (they had been ignored)
            raise TypeError(f"build_model takes overrides with a preset name, not with a config: set "
                            f"{sorted(overrides)} on the config")
        config = name_or_config
        named = {"TransNormerForCausalLM": "clm", "TransNormerForMaskedLM": "mlm",
                 "TransNormerForSequenceClassification": "cls"}
        task = task or next((named[a] for a in config.architectures or () if a in named),
                            "clm" if config.causal else "mlm")
    else:
        config = get_config(name_or_config, **overrides)
        task = task or preset_task(name_or_config)
    cls = {"clm": TransNormerForCausalLM, "mlm": TransNormerForMaskedLM, "cls": TransNormerForSequenceClassification}
    if task not in cls:
        raise ValueError(f"task must be one of {tuple(cls)}, got {task!r}")
    return cls[task](config)


def count_parameters(name: str, **overrides) -> int:
    """Trainable parameters of a preset (tied embeddings counted once), built on the meta device."""
    with torch.device("meta"):
        model = build_model(name, **overrides)
    return sum(p.numel() for p in model.parameters())


def preset_table() -> str:
    """A markdown table of every preset with its shape and parameter count."""
    _load_extra_presets()
    rows = ["| preset | task | layers | d | heads (Diag/Norm where they differ) | layer types | params |",
            "|---|---|---|---|---|---|---|"]
    for name in sorted(PRESETS):
        cfg = get_config(name)
        kinds = ",".join(sorted(set(cfg.layer_types)))
        # Diag/Norm heads where they differ (the LRA image and retrieval presets: the Norm count alone had shown)
        diag = cfg.diag_num_attention_heads if "diag" in cfg.layer_types else None
        heads = f"{diag}/{cfg.num_attention_heads}" if diag and diag != cfg.num_attention_heads else cfg.num_attention_heads
        rows.append(f"| {name} | {PRESETS[name][0]} | {cfg.num_hidden_layers} | {cfg.hidden_size} | "
                    f"{heads} | {kinds} | {count_parameters(name) / 1e6:.2f}M |")
    return "\n".join(rows)
