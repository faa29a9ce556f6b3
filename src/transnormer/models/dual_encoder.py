"""Two-tower classifier for LRA Retrieval (lra.md §1, §7): one shared encoder, pooled per document.

    x₁ = pool(encoder(doc₁)), x₂ = pool(encoder(doc₂))          # mean over each document's valid tokens
    logits = MLP([x₁, x₂, x₁ ⊙ x₂, x₁ − x₂])                    # Linear(4d → d), act, dropout, Linear(d → C)

Both documents go through the encoder in one call (stacked along the batch, padded to a common
length), as the S4-lineage pipeline the authors used does, so batch-norm statistics cover both.
Each document is truncated and padded independently; padding never enters the pooling or the
masked batch statistics. The MLP shape follows the S4-lineage ``RetrievalHead`` (4d → d → C); its
activation is ``config.pair_classifier_act`` (default ``"relu"`` [I]; ``--set pair_classifier_act=gelu``).

HF-compatible: a :class:`~transformers.PreTrainedModel` with :class:`TransNormerConfig`, so
``save_pretrained`` / ``from_pretrained`` round-trip (load it with this class; the Auto
sequence-classification mapping keeps pointing at the single-tower model).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.utils import can_return_tuple

from ..layers.base import padding_mask
from .configuration import TransNormerConfig
from .modeling import TransNormerModel, TransNormerPreTrainedModel, head_loss, pool

PAIR_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


def _pad_cols(x: torch.Tensor, length: int, value) -> torch.Tensor:
    if x.shape[1] == length:
        return x
    return F.pad(x, (0, length - x.shape[1]), value=value)


class TransNormerDualEncoderForSequenceClassification(TransNormerPreTrainedModel):
    """forward(input_ids [B, T₁], attention_mask [B, T₁], input_ids_2 [B, T₂], attention_mask_2 [B, T₂],
    labels [B]) → ``SequenceClassifierOutput`` (logits [B, num_labels], cross-entropy loss)."""

    def __init__(self, config: TransNormerConfig):
        super().__init__(config)
        act = config.pair_classifier_act
        if act not in PAIR_ACTIVATIONS:
            raise ValueError(f"pair_classifier_act must be one of {tuple(PAIR_ACTIVATIONS)}, got {act!r}")
        self.num_labels = config.num_labels
        self.model = TransNormerModel(config)
        d = config.hidden_size
        p = config.classifier_dropout if config.classifier_dropout is not None else config.dropout
        self.classifier = nn.Sequential(nn.Linear(4 * d, d), PAIR_ACTIVATIONS[act](), nn.Dropout(p),
                                        nn.Linear(d, config.num_labels))
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] → [B, d]: the encoder, then ``config.classifier_pooling`` over valid tokens."""
        h = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                       return_dict=True).last_hidden_state
        return pool(h, attention_mask, self.config.classifier_pooling)

    def encode_pair(self, input_ids, attention_mask, input_ids_2, attention_mask_2):
        """Both documents through the shared encoder in one call → (x₁ [B, d], x₂ [B, d])."""
        if input_ids is None or input_ids_2 is None:
            raise ValueError("the two-tower model needs input_ids and input_ids_2")
        B = input_ids.shape[0]
        if input_ids_2.shape[0] != B:
            raise ValueError(f"input_ids has {B} rows but input_ids_2 has {input_ids_2.shape[0]}")
        for name, ids_, mask_ in (("attention_mask", input_ids, attention_mask),
                                  ("attention_mask_2", input_ids_2, attention_mask_2)):
            # each mask is padded to the common length below: one of another shape would count pads as
            # real tokens (or drop real ones) where the one-tower model refuses it
            if mask_ is not None and tuple(mask_.shape) != tuple(ids_.shape):
                raise ValueError(f"{name} must have its input_ids' shape {tuple(ids_.shape)}, "
                                 f"got {tuple(mask_.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask_2 is None:
            attention_mask_2 = torch.ones_like(input_ids_2, dtype=torch.bool)
        T = max(input_ids.shape[1], input_ids_2.shape[1])
        # the columns added are masked: any id in the vocabulary does (a pad_token_id outside it, which
        # HF only warns about, had been refused as the user's ids)
        ids = torch.cat([_pad_cols(input_ids, T, 0), _pad_cols(input_ids_2, T, 0)], 0)
        # checked as the one-tower model checks its mask (.bool() had read an additive 0 / -inf mask as
        # real tokens where the pads are)
        mask = torch.cat([_pad_cols(padding_mask(attention_mask), T, False),
                          _pad_cols(padding_mask(attention_mask_2, "attention_mask_2"), T, False)], 0)
        pooled = self.encode(ids, mask)
        return pooled[:B], pooled[B:]

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, input_ids_2=None, attention_mask_2=None, labels=None,
                return_dict=None, **kwargs) -> SequenceClassifierOutput:
        x1, x2 = self.encode_pair(input_ids, attention_mask, input_ids_2, attention_mask_2)
        logits = self.classifier(torch.cat([x1, x2, x1 * x2, x1 - x2], -1))
        loss = None if labels is None else head_loss(self.config, logits, labels, kwargs.get("num_items_in_batch"))
        return SequenceClassifierOutput(loss=loss, logits=logits)
