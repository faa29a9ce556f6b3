"""Uniform LRA dataset object and the padding collate function."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ._common import check_int, check_provenance


class LRADataset(Dataset):
    """One split of one LRA task; item ``i`` is a dict

    * ``"input_ids"``: ``LongTensor[T]`` (``T ≤ max_len``; no padding inside an item),
    * ``"label"``: ``int`` in ``[0, num_classes)``,
    * ``"input_ids_2"``: ``LongTensor[T2]`` for the pair task (Retrieval) only.

    Attributes: ``task``, ``split``, ``vocab_size``, ``pad_id``, ``num_classes``, ``provenance``
    (``official`` | ``regenerated`` | ``stand-in`` | ``synthetic-fixture``), ``dataset_id`` (e.g.
    ``listops-regen(gen=v1, seed=0)``), ``pair``, ``max_len``, ``info`` (loader details) and
    ``labels`` (``int64[N]``). Use :meth:`collate_fn` for a DataLoader.
    """

    def __init__(
        self,
        *,
        task: str,
        split: str,
        inputs: Sequence,
        labels: np.ndarray,
        vocab_size: int,
        pad_id: int,
        num_classes: int,
        provenance: str,
        dataset_id: str,
        inputs_2: Sequence | None = None,
        max_len: int | None = None,
        info: Mapping[str, Any] | None = None,
    ):
        labels = np.asarray(labels, dtype=np.int64)
        if labels.ndim != 1 or len(labels) != len(inputs):
            raise ValueError(
                f"labels must be int64[N] with N = len(inputs) = {len(inputs)}, got shape {list(labels.shape)}"
            )
        if inputs_2 is not None and len(inputs_2) != len(inputs):
            raise ValueError(f"inputs_2 must have {len(inputs)} items, got {len(inputs_2)}")
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise ValueError(f"labels must lie in [0, {num_classes}), got range [{labels.min()}, {labels.max()}]")
        self.task = task
        self.split = split
        self.inputs = inputs
        self.inputs_2 = inputs_2
        self.labels = labels
        self.vocab_size = check_int("vocab_size", vocab_size, minimum=1)
        self.pad_id = check_int("pad_id", pad_id, minimum=0, maximum=vocab_size - 1)
        self.num_classes = check_int("num_classes", num_classes, minimum=1)
        self.provenance = check_provenance(provenance)
        self.dataset_id = dataset_id
        self.max_len = None if max_len is None else check_int("max_len", max_len, minimum=1)
        self.info = dict(info or {})

    @property
    def pair(self) -> bool:
        return self.inputs_2 is not None

    @property
    def fingerprint(self) -> str:
        """sha256 hex over the task, split, ``dataset_id`` (a generator's seed and settings) and the
        labels: a resumed run checks that it goes on over the data it was saved with. (Not over the
        inputs: a task's splits run to gigabytes, and data regenerated otherwise has another id.)"""
        h = hashlib.sha256(f"{self.task}\0{self.split}\0{self.dataset_id}\0".encode())
        h.update(np.ascontiguousarray(self.labels, dtype=np.int64).tobytes())
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self.labels)

    def _ids(self, seq: Sequence, i: int) -> torch.Tensor:
        x = np.asarray(seq[i])
        if self.max_len is not None:
            x = x[: self.max_len]
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"index must be an int, got {type(i).__name__}")
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} items")
        i = int(i) % n
        item = {"input_ids": self._ids(self.inputs, i), "label": int(self.labels[i])}
        if self.inputs_2 is not None:
            item["input_ids_2"] = self._ids(self.inputs_2, i)
        return item

    def collate_fn(self, *, pad_to: int | None = None, pad_to_multiple_of: int | None = None):
        """:func:`collate_lra` bound to this dataset's ``pad_id``."""
        return functools.partial(collate_lra, pad_id=self.pad_id, pad_to=pad_to, pad_to_multiple_of=pad_to_multiple_of)

    def label_counts(self) -> np.ndarray:
        """``int64[num_classes]`` histogram of the labels."""
        return np.bincount(self.labels, minlength=self.num_classes)

    def __repr__(self) -> str:
        return (
            f"LRADataset(task={self.task!r}, split={self.split!r}, n={len(self)}, dataset_id={self.dataset_id!r}, "
            f"provenance={self.provenance!r})"
        )


def _pad(seqs: list[torch.Tensor], pad_id: int, pad_to: int | None, multiple: int | None, key: str):
    longest = max((int(s.numel()) for s in seqs), default=0)
    length = longest
    if pad_to is not None:
        if pad_to < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest {key} in the batch ({longest})")
        length = pad_to
    if multiple is not None:
        length = -(-length // multiple) * multiple
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = int(s.numel())
        ids[b, :n] = s
        mask[b, :n] = True
    return ids, mask


def collate_lra(
    batch: Sequence[Mapping[str, Any]],
    *,
    pad_id: int = 0,
    pad_to: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Pad a list of items into a batch (right padding).

    Returns ``input_ids`` ``LongTensor[B, T]``, ``attention_mask`` ``BoolTensor[B, T]`` (True =
    valid token), ``labels`` ``LongTensor[B]``, and for pair items ``input_ids_2`` /
    ``attention_mask_2`` ``[B, T2]`` (each document padded independently). ``T`` is the longest
    item, or ``pad_to``, rounded up to a multiple of ``pad_to_multiple_of``.
    """
    if not isinstance(batch, Sequence) or len(batch) == 0:
        raise ValueError("batch must be a non-empty sequence of items")
    check_int("pad_id", pad_id, minimum=0)
    if pad_to is not None:
        check_int("pad_to", pad_to, minimum=1)
    if pad_to_multiple_of is not None:
        check_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1)
    pair = "input_ids_2" in batch[0]
    for j, item in enumerate(batch):
        if not isinstance(item, Mapping) or "input_ids" not in item or "label" not in item:
            raise ValueError(f"batch[{j}] must be a mapping with 'input_ids' and 'label'")
        if ("input_ids_2" in item) != pair:
            raise ValueError(f"batch[{j}]: all items must agree on having 'input_ids_2'")
        x = item["input_ids"]
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.long:
            raise TypeError(f"batch[{j}]['input_ids'] must be a 1-D LongTensor")
    out: dict[str, torch.Tensor] = {}
    out["input_ids"], out["attention_mask"] = _pad(
        [it["input_ids"] for it in batch], pad_id, pad_to, pad_to_multiple_of, "input_ids"
    )
    if pair:
        out["input_ids_2"], out["attention_mask_2"] = _pad(
            [it["input_ids_2"] for it in batch], pad_id, pad_to, pad_to_multiple_of, "input_ids_2"
        )
    out["labels"] = torch.tensor([int(it["label"]) for it in batch], dtype=torch.long)
    return out
