"""LRA Text: byte-level IMDB sentiment from the ``aclImdb`` folder layout (spec lra.md §2).

Layout: ``aclImdb/{train,test}/{pos,neg}/*.txt`` (label pos = 1, neg = 0; ``train/unsup`` is
ignored). Each review is UTF-8 text; its bytes are truncated to ``max_len`` (4096 for
TransNormer) and mapped to ids ``byte + 1`` so that id 0 stays free for padding
(vocabulary 257).

Official LRA has no Text validation split and validates on test; ``val_from="test"`` (default)
reproduces that (and says so in the dataset info), ``val_from="train"`` carves the last
``val_fraction`` of a fixed shuffle of train instead (train then shrinks accordingly).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ._common import PackedSequences, as_dir, check_int, check_optional_max_len, split_name

PAD_ID = 0
VOCAB_SIZE = 257
NUM_CLASSES = 2
DEFAULT_LENGTH = 4096


def encode_bytes(data: bytes, max_len: int | None = None) -> np.ndarray:
    """Byte string → ids ``int64[T]`` (``byte + 1``), truncated to ``max_len``."""
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    max_len = check_optional_max_len(max_len)  # (0 had meant no limit, a negative one cut the end off)
    arr = np.frombuffer(bytes(data[:max_len]), dtype=np.uint8)
    return arr.astype(np.int64) + 1


def decode_ids(ids) -> bytes:
    """Inverse of :func:`encode_bytes` (padding dropped)."""
    a = np.asarray(ids, dtype=np.int64)
    return bytes((a[a != PAD_ID] - 1).astype(np.uint8).tolist())


def find_imdb_dir(root: str | os.PathLike) -> Path:
    """``root`` itself if it has ``train/`` or ``test/`` with ``pos``/``neg``, else ``root/aclImdb``."""
    root = as_dir("root", root)
    for cand in (root, root / "aclImdb"):
        if any((cand / s / c).is_dir() for s in ("train", "test") for c in ("pos", "neg")):
            return cand
    raise FileNotFoundError(f"no aclImdb layout ({{train,test}}/{{pos,neg}}/*.txt) in {root} or {root / 'aclImdb'}")


_NUM = re.compile(r"(\d+)")


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in _NUM.split(name)]


def read_imdb_folder(
    base: str | os.PathLike, part: str, *, max_len: int | None = DEFAULT_LENGTH
) -> tuple[PackedSequences, np.ndarray]:
    """Read ``base/<part>/{neg,pos}/*.txt`` (sorted by natural file-name order, neg first).

    Returns (ids: item ``i`` is ``int64[T ≤ max_len]`` = bytes + 1; labels ``int64[N]``). Files
    that are not valid UTF-8 raise ``ValueError`` naming the file.
    """
    max_len = check_optional_max_len(max_len)
    base = Path(base)
    ids: list[bytes] = []
    labels: list[int] = []
    for label, cls in ((0, "neg"), (1, "pos")):
        d = base / part / cls
        if not d.is_dir():
            raise FileNotFoundError(f"aclImdb folder missing: {d}")
        names = sorted((p.name for p in d.iterdir() if p.suffix == ".txt"), key=_natural_key)
        for name in names:
            raw = (d / name).read_bytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{d / name}: not valid UTF-8 ({e})") from None
            ids.append(raw[:max_len])
            labels.append(label)
    if not ids:
        raise ValueError(f"{base / part}: no *.txt reviews under neg/ or pos/")
    return PackedSequences.build(ids, shift=1), np.asarray(labels, dtype=np.int64)


def load_text_split(
    root: str | os.PathLike,
    split: str,
    *,
    max_len: int | None = DEFAULT_LENGTH,
    val_from: str = "test",
    val_fraction: float = 0.1,
    val_seed: int = 0,
) -> tuple[PackedSequences, np.ndarray, dict]:
    """(ids, labels, info) for one split of the byte-level IMDB task (see module docstring)."""
    split = split_name(split)
    check_optional_max_len(max_len)
    if val_from not in ("test", "train"):
        raise ValueError(f"val_from must be 'test' (official) or 'train', got {val_from!r}")
    if not (isinstance(val_fraction, float) and 0.0 < val_fraction < 1.0):
        raise ValueError(f"val_fraction must be a float in (0, 1), got {val_fraction!r}")
    check_int("val_seed", val_seed, minimum=0)
    base = find_imdb_dir(root)
    info = {"dir": str(base), "val_from": val_from}
    if split == "test" or (split == "val" and val_from == "test"):
        ids, labels = read_imdb_folder(base, "test", max_len=max_len)
        if split == "val":
            info["note"] = "validation = test split (official LRA behaviour)"
        return ids, labels, info
    ids, labels = read_imdb_folder(base, "train", max_len=max_len)
    if val_from == "test":
        return ids, labels, info
    order = np.random.default_rng(val_seed).permutation(len(ids))
    n_val = max(1, int(round(len(ids) * val_fraction)))
    if n_val >= len(ids):  # (the train split had come back empty, without a word)
        raise ValueError(f"val_fraction={val_fraction} carves {n_val} of the {len(ids)} training reviews for "
                         "validation and leaves none to train on")
    idx = np.sort(order[-n_val:]) if split == "val" else np.sort(order[:-n_val])
    info["note"] = f"validation carved from train ({n_val} reviews, seed {val_seed})"
    return ids.select(idx), labels[idx], info
