"""TransNormerConfig: one config for the whole model family (T1/T2 and the baseline layers)."""

from __future__ import annotations

import copy
import math

from transformers import PretrainedConfig

VARIANT_DEFAULTS = {
    # spec §6: what T1 and T2 change, and nothing else
    "t1": {"norm_kernel": "elu", "diag_kernel": "relu", "diag_norm": True},
    "t2": {"norm_kernel": "1+elu", "diag_kernel": "softmax", "diag_norm": False},
}
ABS_POS_TYPES = ("sinusoidal", "learned", "scaled_sinusoid", "none")
POOLING_TYPES = ("mean", "first", "last")
PAIR_ACTIVATION_NAMES = ("relu", "gelu", "tanh")  # the LRA Retrieval head's MLP (dual_encoder.py)
PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")


SAVED_LAYER_TYPES = "mixer_types"  # the key layer_types is saved under (TransNormerConfig.to_dict)


def default_layer_types(num_layers: int) -> list[str]:
    """First ⌊L/2⌋ layers Diag, the rest Norm (spec §6)."""
    return ["diag"] * (num_layers // 2) + ["norm"] * (num_layers - num_layers // 2)


class TransNormerConfig(PretrainedConfig):
    """Configuration of TransNormer-family models.

    ``layer_types`` lists one token mixer per layer (``"diag"``, ``"norm"`` and the baselines
    registered in :mod:`transnormer.layers`), so a comparison changes one field. Kernel and
    Diag weights follow ``variant`` unless ``norm_kernel`` / ``diag_kernel`` / ``diag_norm`` are set.
    ``layer_options`` holds per-layer-type extra keyword options (e.g. FLASH's chunk size).
    """

    model_type = "transnormer"

    def __init__(
        self,
        vocab_size: int = 50265,
        hidden_size: int = 512,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 8,
        diag_num_attention_heads: int | None = None,
        layer_types: list[str] | None = None,
        variant: str = "t2",
        norm_kernel: str | None = None,
        diag_kernel: str | None = None,
        diag_norm: bool | None = None,
        block_size: int = 64,
        chunk_size: int = 64,
        norm_type: str = "simple_rms",
        norm_eps: float | None = None,
        eps_inside_sqrt: bool = False,
        norm_per_head: bool = False,
        ffn_type: str = "glu",
        ffn_hidden_size: int | None = None,
        ffn_act: str = "silu",
        pre_norm: bool = True,
        final_norm: bool | None = None,
        abs_pos: str = "sinusoidal",
        abs_pos_scale: float | None = None,
        scale_embedding: bool = True,
        embed_norm: bool = False,
        max_position_embeddings: int = 512,
        lrpe: str = "householder_rope",
        lrpe_learn_theta: bool = True,
        lrpe_seed: int = 0,
        causal: bool = True,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        initializer: str = "paper",
        initializer_range: float = 0.02,
        classifier_pooling: str = "mean",
        pair_classifier_act: str = "relu",
        classifier_dropout: float | None = None,
        layer_options: dict | None = None,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        pad_token_id: int | None = 0,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.diag_num_attention_heads = diag_num_attention_heads
        self.variant = variant
        self.norm_kernel = norm_kernel
        self.diag_kernel = diag_kernel
        self.diag_norm = diag_norm
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.norm_type = norm_type
        self.norm_eps = norm_eps
        self.eps_inside_sqrt = eps_inside_sqrt
        self.norm_per_head = norm_per_head
        self.ffn_type = ffn_type
        self.ffn_hidden_size = ffn_hidden_size
        self.ffn_act = ffn_act
        self.pre_norm = pre_norm
        self.final_norm = pre_norm if final_norm is None else final_norm
        self.abs_pos = abs_pos
        self.abs_pos_scale = abs_pos_scale  # scaled_sinusoid's initial α₀ (None: d^-1/2; flash-pytorch's is 1)
        self.scale_embedding = scale_embedding
        self.embed_norm = embed_norm
        self.max_position_embeddings = max_position_embeddings
        self.lrpe = lrpe
        self.lrpe_learn_theta = lrpe_learn_theta
        self.lrpe_seed = lrpe_seed
        self.causal = causal
        self.use_cache = use_cache  # forward's use_cache=None in eval mode, for causal models (HF's meaning)
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.initializer = initializer
        self.initializer_range = initializer_range
        self.classifier_pooling = classifier_pooling
        self.pair_classifier_act = pair_classifier_act  # the two-tower head's (dual_encoder.py)
        self.classifier_dropout = classifier_dropout
        # deep: a preset's nested option dicts must not be shared with (and edited through) a config
        self.layer_options = copy.deepcopy(dict(layer_options or {}))
        mixer_types = kwargs.pop(SAVED_LAYER_TYPES, None)  # config.json's name for layer_types (to_dict)
        if layer_types is None:
            layer_types = mixer_types
        if isinstance(layer_types, str):  # list("nn") had made it ['n', 'n']
            raise TypeError(f"layer_types must be a list of layer type names, got the string {layer_types!r}")
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            **kwargs,
        )
        # Set after the base __init__: HF's validator only accepts its own attention names in
        # `layer_types`; ours are checked by validate_layer_type / check() below.
        self.layer_types = list(layer_types) if layer_types is not None else default_layer_types(num_hidden_layers)

    def to_dict(self) -> dict:
        """HF's dict, with ``layer_types`` saved as ``mixer_types``: HF reserves ``layer_types`` for its
        own attention names, and its generic ``PreTrainedConfig`` (Trainer's resume, AutoTokenizer in a
        process that has not imported transnormer) refused a config.json holding ours."""
        out = super().to_dict()
        if "layer_types" in out:
            out[SAVED_LAYER_TYPES] = out.pop("layer_types")
        return out

    # Resolved T1/T2 choices -------------------------------------------------------------
    def resolved(self, key: str):
        value = getattr(self, key)
        return VARIANT_DEFAULTS[self.variant][key] if value is None else value

    def options_for(self, layer_type: str) -> dict:
        """The options of one layer type, as the builders pass them (``causal`` is the model's: see check)."""
        return {k: v for k, v in self.layer_options.get(layer_type, {}).items() if k != "causal"}

    def validate_layer_type(self) -> None:
        """Replaces HF's check (which only knows HF's attention names) with ours."""
        from ..layers import LAYER_TYPES
        from . import layer_builders  # noqa: F401  (registers the core layer types)

        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        for t in self.layer_types:
            if not isinstance(t, str):  # (an unhashable one had failed in the membership test, unnamed)
                raise TypeError(f"layer_types must hold layer type names, got {t!r}")
            if t not in LAYER_TYPES:
                raise ValueError(f"unknown layer type {t!r} in layer_types; known: {sorted(LAYER_TYPES)}")

    def validate(self) -> None:
        """HF's validation (run by save_pretrained), with our layer-type check in place of HF's, and
        ours (:meth:`check`): a config that no model can be built from is not saved."""
        for validator in PretrainedConfig.__class_validators__:
            if validator.__name__ != "validate_layer_type":
                validator(self)
        self.validate_layer_type()
        self.check()

    def check(self) -> None:
        """Raise ValueError/TypeError naming the field for an inconsistent config."""
        from ..modules.ffn import ACTIVATIONS, FFN_TYPES
        from ..modules.norms import NORM_TYPES
        from ..modules.positional import LRPE_TYPES

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "block_size",
                     "chunk_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("diag_num_attention_heads", "ffn_hidden_size"):  # None: derived
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        if self.norm_eps is not None and (isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float))
                                          or not 0 <= self.norm_eps < math.inf):
            raise ValueError(f"norm_eps must be None (each norm's default) or a finite number >= 0, got "
                             f"{self.norm_eps!r}")
        for name in ("dropout", "attention_dropout", "classifier_dropout"):
            value = getattr(self, name)
            if value is None and name == "classifier_dropout":  # None: dropout's
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
        for name in ("pre_norm", "final_norm", "scale_embedding", "embed_norm", "causal", "use_cache", "eps_inside_sqrt",
                     "norm_per_head", "lrpe_learn_theta", "diag_norm", "tie_word_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "diag_norm" and value is None):
                # a string such as "no" would otherwise count as True
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        for name in ("variant", "norm_type", "ffn_type", "ffn_act", "lrpe", "abs_pos", "classifier_pooling",
                     "pair_classifier_act", "initializer", "norm_kernel", "diag_kernel"):
            value = getattr(self, name)  # (a list had failed in a membership test below, unnamed)
            if not isinstance(value, str) and not (value is None and name in ("norm_kernel", "diag_kernel")):
                raise TypeError(f"{name} must be a string, got {type(value).__name__} {value!r}")
        if self.variant not in VARIANT_DEFAULTS:
            raise ValueError(f"variant must be one of {tuple(VARIANT_DEFAULTS)}, got {self.variant!r}")
        self.validate_layer_type()
        # heads split the width only in the attention layers (GAU/FLASH have one head of their own)
        headed = set(self.layer_types) - {"gau", "flash"}
        heads = [self.num_attention_heads] * bool(headed) + (
            [self.diag_num_attention_heads] if self.diag_num_attention_heads and "diag" in headed else [])
        for h in heads:
            if self.hidden_size % h:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by the number of heads ({h})")
        from ..layers import LAYER_TYPES

        if not isinstance(self.layer_options, dict) or not all(isinstance(v, dict) for v in self.layer_options.values()):
            raise TypeError(f"layer_options must map layer types to dicts of options, got {self.layer_options!r}")
        unknown = sorted(set(self.layer_options) - set(LAYER_TYPES))
        if unknown:  # a misspelt type's options would be ignored
            raise ValueError(f"layer_options has unknown layer types {unknown}; known: {sorted(LAYER_TYPES)}")
        for t, options in self.layer_options.items():
            # (norm and diag had taken another value: a causal LM whose mixers saw the next tokens; the
            # others failed naming _build). The model's own value, spelt out, is read as no option.
            if "causal" in options and options["causal"] is not self.causal:
                raise ValueError(f"layer_options[{t!r}]['causal'] = {options['causal']!r}: every mixer follows "
                                 f"the model's causal (config.causal = {self.causal}); set that instead")
        if self.norm_type not in NORM_TYPES:
            raise ValueError(f"norm_type must be one of {NORM_TYPES}, got {self.norm_type!r}")
        if self.causal and self.norm_type == "batch":
            # BatchNorm's training statistics pool every position of the batch, so each position would
            # see the tokens it has to predict.
            raise ValueError("norm_type='batch' needs causal=False: batch statistics mix future tokens into "
                             "every position of a causal model")
        if self.ffn_type not in FFN_TYPES:
            raise ValueError(f"ffn_type must be one of {FFN_TYPES}, got {self.ffn_type!r}")
        if self.ffn_act not in ACTIVATIONS:
            raise ValueError(f"ffn_act must be one of {tuple(ACTIVATIONS)}, got {self.ffn_act!r}")
        if self.lrpe not in LRPE_TYPES:
            raise ValueError(f"lrpe must be one of {LRPE_TYPES}, got {self.lrpe!r}")
        if self.abs_pos not in ABS_POS_TYPES:
            raise ValueError(f"abs_pos must be one of {ABS_POS_TYPES}, got {self.abs_pos!r}")
        a = self.abs_pos_scale
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < math.inf):
            raise ValueError(f"abs_pos_scale must be None (d^-1/2) or a finite number > 0, got {a!r}")
        if a is not None and self.abs_pos != "scaled_sinusoid":  # it would scale nothing
            raise ValueError(f"abs_pos_scale sets scaled_sinusoid's α₀; abs_pos is {self.abs_pos!r}")
        if self.pair_classifier_act not in PAIR_ACTIVATION_NAMES:
            raise ValueError(f"pair_classifier_act must be one of {PAIR_ACTIVATION_NAMES}, got {self.pair_classifier_act!r}")
        if self.classifier_pooling not in POOLING_TYPES:
            raise ValueError(f"classifier_pooling must be one of {POOLING_TYPES}, got {self.classifier_pooling!r}")
        if self.initializer not in ("paper", "normal"):
            raise ValueError(f"initializer must be 'paper' or 'normal', got {self.initializer!r}")
        from ..layers.norm_attention import KERNELS

        if self.resolved("norm_kernel") not in KERNELS:
            raise ValueError(f"norm_kernel must be one of {tuple(KERNELS)}, got {self.norm_kernel!r}")
        if self.resolved("diag_kernel") not in ("softmax", "relu"):
            raise ValueError(f"diag_kernel must be 'softmax' or 'relu', got {self.diag_kernel!r}")
        if isinstance(self.lrpe_seed, bool) or not isinstance(self.lrpe_seed, int):
            raise TypeError(f"lrpe_seed must be an int, got {type(self.lrpe_seed).__name__} {self.lrpe_seed!r}")
        if not 0 <= self.lrpe_seed < 2**32:  # layer i draws from lrpe_seed * 1000 + i, within torch's range
            raise ValueError(f"lrpe_seed must be in [0, 2**32), got {self.lrpe_seed}")
        r = self.initializer_range
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < math.inf:
            raise ValueError(f"initializer_range must be a finite number >= 0, got {r!r}")
        if self.num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {self.num_labels}")
        if self.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"problem_type must be None or one of {PROBLEM_TYPES[1:]}, got {self.problem_type!r}")


def _has_type(value, hint) -> bool:
    """Whether a JSON value fits a type hint such as ``float`` or ``list[str] | None``."""
    import typing

    kinds = [typing.get_origin(t) or t for t in (typing.get_args(hint) or (hint,))]
    if isinstance(value, bool):  # a bool is an int to isinstance, not to a config
        return bool in kinds
    if isinstance(value, int) and float in kinds:
        return True
    return any(isinstance(value, k) for k in kinds)


# PretrainedConfig's keys that saving writes (not settings of a run), and the types of those it reads
_SAVED_BY_HF = frozenset({"_name_or_path", "architectures", "dtype", "torch_dtype", "model_type",
                          "transformers_version"})  # (torch_dtype: transformers 4's name for dtype)
_HF_FIELD_TYPES = {"num_labels": int, "id2label": dict, "label2id": dict}


def check_overrides(overrides: dict, *, types: bool = True, where: str = "overrides (--set)") -> None:
    """Each override must name a TransNormerConfig field and (``types``) hold a value of its type, as
    JSON gives it: a typo would otherwise be stored as an extra config key that changes nothing, and
    a wrong type would fail deep in the model without naming the field. ``where`` starts the message."""
    import difflib
    import typing

    if not overrides:
        return
    hints = typing.get_type_hints(TransNormerConfig.__init__)
    known = set(hints) | set(TransNormerConfig().to_dict()) | {"num_labels"}  # ours and PretrainedConfig's
    known.discard(SAVED_LAYER_TYPES)  # config.json's name for layer_types, which a preset's own would win over
    for key, value in overrides.items():
        if types and key in _SAVED_BY_HF:  # (dtype=foo had been a traceback; model_type=foo lost on saving)
            raise ValueError(f"{where}: {key!r} is written by Hugging Face when a model is saved, not a setting"
                             + (" (the run's precision is --dtype)" if key in ("dtype", "torch_dtype") else ""))
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise ValueError(f"{where}: {key!r} is not a TransNormerConfig field"
                             + (f"; did you mean {close[0]!r}?" if close else ""))
        if types and key in _HF_FIELD_TYPES and not _has_type(value, _HF_FIELD_TYPES[key]):
            raise ValueError(f"{where}: {key}={value!r} must be {_HF_FIELD_TYPES[key].__name__} (a JSON value)")
        if types and key in hints and not _has_type(value, hints[key]):
            kinds = typing.get_args(hints[key]) or (hints[key],)
            names = " or ".join("null" if k is type(None) else getattr(k, "__name__", str(k)) for k in kinds)
            raise ValueError(f"{where}: {key}={value!r} must be {names} (a JSON value)")
