"""HF-compatible model family: config, base model and task heads; registered with the Auto classes."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .configuration import TransNormerConfig, default_layer_types
from .modeling import (
    TransNormerCache,
    TransNormerForCausalLM,
    TransNormerForMaskedLM,
    TransNormerForSequenceClassification,
    TransNormerModel,
    TransNormerPreTrainedModel,
    pool,
)

AutoConfig.register("transnormer", TransNormerConfig, exist_ok=True)
AutoModel.register(TransNormerConfig, TransNormerModel, exist_ok=True)
AutoModelForCausalLM.register(TransNormerConfig, TransNormerForCausalLM, exist_ok=True)
AutoModelForMaskedLM.register(TransNormerConfig, TransNormerForMaskedLM, exist_ok=True)
AutoModelForSequenceClassification.register(TransNormerConfig, TransNormerForSequenceClassification, exist_ok=True)

# Trainer shifts the labels of its own losses (label smoothing) only for the class names in this
# table, which register() does not fill: smoothed, the causal LM was scored against the current token.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("transnormer", "TransNormerForCausalLM")

__all__ = [
    "TransNormerCache",
    "TransNormerConfig",
    "TransNormerForCausalLM",
    "TransNormerForMaskedLM",
    "TransNormerForSequenceClassification",
    "TransNormerModel",
    "TransNormerPreTrainedModel",
    "default_layer_types",
    "pool",
]
