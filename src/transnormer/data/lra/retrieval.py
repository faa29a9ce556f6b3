"""LRA Retrieval: byte-level AAN citation pairs (spec lra.md §2).

Files: ``new_aan_pairs.train.tsv``, ``new_aan_pairs.eval.tsv``, ``new_aan_pairs.test.tsv`` (in
``root`` or ``root/tsv_data``); no header; five tab-separated columns
``label, id1, id2, text1, text2``; the label is written as a float (``0.0``/``1.0``). A text field
in Python bytes-literal form (``b'...'`` / ``b"..."``) is decoded with :func:`ast.literal_eval`
(literals only, nothing is executed) and must yield ``bytes``; any other field is UTF-8 encoded.
Each document is truncated independently to ``max_len`` bytes (4000) and mapped to ids
``byte + 1`` (0 = padding, vocabulary 257).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np

from ._common import PackedSequences, as_dir, check_optional_max_len, split_name

PAD_ID = 0
VOCAB_SIZE = 257
NUM_CLASSES = 2
DEFAULT_LENGTH = 4000
SPLIT_FILES = {"train": "new_aan_pairs.train.tsv", "val": "new_aan_pairs.eval.tsv", "test": "new_aan_pairs.test.tsv"}


def decode_field(field: str, *, where: str = "") -> bytes:
    """Bytes of a text field: ``b'…'`` literals are evaluated safely, anything else UTF-8 encoded."""
    f = field.strip()
    if len(f) >= 3 and f[0] in "bB" and f[1] in "'\"" and f[-1] == f[1]:
        try:
            value = ast.literal_eval(f)
        except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
            raise ValueError(f"{where}malformed bytes literal ({type(e).__name__}: {e})") from None
        if not isinstance(value, bytes):
            raise ValueError(f"{where}expected a bytes literal, got {type(value).__name__}")
        return value
    return field.encode("utf-8")


def parse_label(text: str, *, where: str = "") -> int:
    """``"0"``/``"1"``/``"0.0"``/``"1.0"`` → 0/1; anything else → ``ValueError``."""
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{where}label must be 0 or 1 (written as a float), got {text!r}") from None
    if v not in (0.0, 1.0):
        raise ValueError(f"{where}label must be 0 or 1 (written as a float), got {text!r}")
    return int(v)


def read_aan_tsv(
    path: str | os.PathLike, *, max_len: int | None = DEFAULT_LENGTH
) -> tuple[PackedSequences, PackedSequences, np.ndarray, list[tuple[str, str]]]:
    """Read one AAN pair file → (ids of text1, ids of text2, labels ``int64[N]``, (id1, id2) pairs).

    Each ids item is ``int64[T ≤ max_len]`` (bytes + 1). Malformed lines raise ``ValueError`` naming the file,
    the 1-based line number and the column.
    """
    max_len = check_optional_max_len(max_len)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Retrieval file not found: {path}")
    docs1: list[bytes] = []
    docs2: list[bytes] = []
    labels: list[int] = []
    ids: list[tuple[str, str]] = []
    with open(path, encoding="utf-8", newline="") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.rstrip("\r\n")
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != 5:
                raise ValueError(
                    f"{path}:{lineno}: expected 5 tab-separated fields (label, id1, id2, text1, text2), got {len(parts)}"
                )
            where = f"{path}:{lineno}: "
            labels.append(parse_label(parts[0].strip(), where=where))
            t1 = decode_field(parts[3], where=where + "text1: ")
            t2 = decode_field(parts[4], where=where + "text2: ")
            docs1.append(t1[:max_len])
            docs2.append(t2[:max_len])
            ids.append((parts[1], parts[2]))
    if not labels:
        raise ValueError(f"{path}: no pairs")
    packed1, packed2 = PackedSequences.build(docs1, shift=1), PackedSequences.build(docs2, shift=1)
    return packed1, packed2, np.asarray(labels, dtype=np.int64), ids


def find_aan_dir(root: str | os.PathLike) -> Path:
    root = as_dir("root", root)
    for cand in (root, root / "tsv_data"):
        if any((cand / f).is_file() for f in SPLIT_FILES.values()):
            return cand
    raise FileNotFoundError(f"no AAN files ({', '.join(SPLIT_FILES.values())}) in {root} or {root / 'tsv_data'}")


def load_retrieval_split(
    root: str | os.PathLike, split: str, *, max_len: int | None = DEFAULT_LENGTH
) -> tuple[PackedSequences, PackedSequences, np.ndarray, dict]:
    """(ids1, ids2, labels, info) of one split (``val`` reads the ``.eval.tsv`` file)."""
    split = split_name(split)
    check_optional_max_len(max_len)
    d = find_aan_dir(root)
    d1, d2, labels, _ = read_aan_tsv(d / SPLIT_FILES[split], max_len=max_len)
    return d1, d2, labels, {"file": str(d / SPLIT_FILES[split])}
