"""Data pipeline: text sources → tokenizer → cached token ids → LM / MLM / classification batches.

Typical causal-LM use::

    from transnormer.data import load_corpus, build_tokenizer, build_token_cache, LMBatchIterator, eval_batches

    corpus = load_corpus("stdlib")                      # or a path, or "hf:wikitext:wikitext-103-raw-v1"
    tok = build_tokenizer(corpus, vocab_size=8192)       # cached by corpus fingerprint + vocab size
    tokens = build_token_cache(corpus, tok)              # {"train": memmap, "valid": ..., "test": ...}
    train = LMBatchIterator(tokens["train"], seq_len=512, batch_size=8, seed=0, rank=0, world_size=1)
    batch = next(train)                                  # {"input_ids": [8, 512], "labels": [8, 512]}
    state = train.state_dict()                           # save with the checkpoint; load_state_dict to resume
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> defining submodule. Imported lazily (PEP 562): ``import transnormer.data.lra`` runs this
# package's __init__ first, and LRA generator workers must not pay for importing torch/tokenizers.
_EXPORTS: dict[str, str] = {
    "ClassificationCollator": ".classification",
    "ClassificationDataset": ".classification",
    "ClassificationExample": ".classification",
    "LabelSet": ".classification",
    "Scores": ".classification",
    "labels_of": ".classification",
    "load_classification_splits": ".classification",
    "read_classification_file": ".classification",
    "SPLITS": ".corpus",
    "Corpus": ".corpus",
    "load_corpus": ".corpus",
    "read_text_file": ".corpus",
    "split_documents": ".corpus",
    "split_into_documents": ".corpus",
    "LMBatchIterator": ".lm",
    "LMWindowDataset": ".lm",
    "count_targets": ".lm",
    "eval_batches": ".lm",
    "MLMCollator": ".mlm",
    "mask_tokens": ".mlm",
    "pad_sequences": ".mlm",
    "default_cache_dir": "._util",
    "build_token_cache": ".token_cache",
    "open_token_split": ".token_cache",
    "token_cache_dir": ".token_cache",
    "token_dtype": ".token_cache",
    "SPECIAL_TOKENS": ".tokenizer",
    "TextTokenizer": ".tokenizer",
    "build_tokenizer": ".tokenizer",
    "load_tokenizer": ".tokenizer",
    "train_bpe": ".tokenizer",
}

if TYPE_CHECKING:  # static analysers and IDEs see ordinary imports
    from ._util import default_cache_dir
    from .classification import (
        ClassificationCollator,
        ClassificationDataset,
        ClassificationExample,
        LabelSet,
        Scores,
        labels_of,
        load_classification_splits,
        read_classification_file,
    )
    from .corpus import SPLITS, Corpus, load_corpus, read_text_file, split_documents, split_into_documents
    from .lm import LMBatchIterator, LMWindowDataset, count_targets, eval_batches
    from .mlm import MLMCollator, mask_tokens, pad_sequences
    from .token_cache import build_token_cache, open_token_split, token_cache_dir, token_dtype
    from .tokenizer import SPECIAL_TOKENS, TextTokenizer, build_tokenizer, load_tokenizer, train_bpe


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # cache: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "SPECIAL_TOKENS",
    "SPLITS",
    "ClassificationCollator",
    "ClassificationDataset",
    "ClassificationExample",
    "Corpus",
    "LMBatchIterator",
    "LMWindowDataset",
    "LabelSet",
    "MLMCollator",
    "Scores",
    "TextTokenizer",
    "build_token_cache",
    "build_tokenizer",
    "count_targets",
    "default_cache_dir",
    "eval_batches",
    "labels_of",
    "load_classification_splits",
    "load_corpus",
    "load_tokenizer",
    "mask_tokens",
    "open_token_split",
    "pad_sequences",
    "read_classification_file",
    "read_text_file",
    "split_documents",
    "split_into_documents",
    "token_cache_dir",
    "token_dtype",
    "train_bpe",
]
