"""Shared helpers for the LRA data modules: atomic writes, hashing, argument checks."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..._files import atomic_path, atomic_write_text

PROVENANCES = ("official", "regenerated", "stand-in", "synthetic-fixture")

SIDECAR_NAME = "generation.json"
"""File name of the JSON sidecar our generators write next to their output."""


def atomic_write_lines(path: str | os.PathLike, lines: Iterable[str]) -> None:
    """Stream ``lines`` (each without its newline) to ``path`` atomically, one per line."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line)
            f.write("\n")


GENERATING = ".generating"  # written before a generation's first file, removed after its sidecar


def begin_generation(dest: Path, present: bool, what: str) -> None:
    """Refuse to write a dataset over files in ``dest`` that carry no ``generation.json`` of ours,
    then mark ``dest`` as being generated. Data we did not generate (the official files?) cannot be
    made again, and ``lra prepare`` had replaced them with a small fixture, saying nothing. A
    generation of ours is replaced: its sidecar records the seed and parameters that make it again;
    so is one a kill interrupted (its ``.generating`` mark is there, its sidecar not yet; the
    loaders refuse such a folder). ``present``: whether ``dest`` holds the dataset's files."""
    if present and not (dest / SIDECAR_NAME).is_file() and not (dest / GENERATING).is_file():
        raise ValueError(f"{dest} already holds {what} files without a {SIDECAR_NAME} (the official ones?), "
                         "which would be overwritten: remove them or write to another folder")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / GENERATING).write_text("")


def end_generation(dest: Path, sidecar: dict) -> None:
    """Write the generation's sidecar, then remove the mark :func:`begin_generation` left."""
    write_json(dest / SIDECAR_NAME, sidecar)
    (dest / GENERATING).unlink(missing_ok=True)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON, atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Validate an ``int`` argument (bools rejected) within optional inclusive bounds."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_optional_max_len(max_len: Any) -> int | None:
    if max_len is None:
        return None
    return check_int("max_len", max_len, minimum=1)


def check_seed(seed: Any) -> int:
    return check_int("seed", seed, minimum=0)


def check_provenance(provenance: Any) -> str:
    if provenance not in PROVENANCES:
        raise ValueError(f"provenance must be one of {PROVENANCES}, got {provenance!r}")
    return provenance


def as_dir(name: str, root: Any) -> Path:
    """Validate a directory argument and return it as a :class:`Path`."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike path, got {type(root).__name__}")
    path = Path(root)
    if not path.is_dir():
        raise FileNotFoundError(f"{name}: directory not found: {path}")
    return path


def split_name(split: Any, allowed: tuple[str, ...] = ("train", "val", "test")) -> str:
    """Validate a split name (``"valid"``/``"validation"``/``"eval"`` are accepted for ``"val"``)."""
    if not isinstance(split, str):
        raise TypeError(f"split must be a str, got {type(split).__name__}")
    s = {"valid": "val", "validation": "val", "eval": "val", "dev": "val"}.get(split, split)
    if s not in allowed:
        raise ValueError(f"split must be one of {allowed}, got {split!r}")
    return s


class PackedSequences:
    """Variable-length token sequences stored compactly as ``uint8`` in one buffer.

    Item ``i`` → ``int64[T_i]`` = stored bytes + ``shift`` (e.g. ``shift=1`` maps raw bytes to ids
    ``byte + 1`` so that 0 can be the padding id). ``lengths`` → ``int64[N]``.
    """

    def __init__(self, buffer, offsets, shift: int = 0):
        import numpy as np

        self.buffer = np.asarray(buffer, dtype=np.uint8)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        if (
            self.offsets.ndim != 1
            or self.offsets.size < 1
            or self.offsets[0] != 0
            or self.offsets[-1] != self.buffer.size
        ):
            raise ValueError("offsets must be a 1-D array starting at 0 and ending at len(buffer)")
        self.shift = int(shift)

    @classmethod
    def build(cls, chunks: Iterable, shift: int = 0) -> PackedSequences:
        """From an iterable of ``bytes`` or integer arrays with values 0-255."""
        import numpy as np

        parts = [
            bytes(c) if isinstance(c, (bytes, bytearray)) else np.asarray(c, dtype=np.uint8).tobytes() for c in chunks
        ]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        if parts:
            offsets[1:] = np.cumsum([len(p) for p in parts])
        return cls(np.frombuffer(b"".join(parts), dtype=np.uint8), offsets, shift)

    def __len__(self) -> int:
        return self.offsets.size - 1

    @property
    def lengths(self):
        return self.offsets[1:] - self.offsets[:-1]

    def __getitem__(self, i: int):
        import numpy as np

        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} sequences")
        i %= n
        out = self.buffer[self.offsets[i] : self.offsets[i + 1]].astype(np.int64)
        if self.shift:
            out += self.shift
        return out

    def select(self, idx) -> PackedSequences:
        """A new :class:`PackedSequences` with the items at ``idx`` (in that order)."""
        return PackedSequences.build((self.buffer[self.offsets[i] : self.offsets[i + 1]] for i in idx), self.shift)
