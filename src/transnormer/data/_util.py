"""Small helpers shared by the data modules: cache location, stable hashing (atomic writes: ``.._files``)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = [
    "default_cache_dir",
    "resolve_cache_dir",
    "stable_unit_hash",
    "sha256_text",
]

CACHE_ENV = "TRANSNORMER_CACHE"


def default_cache_dir() -> Path:
    """``$TRANSNORMER_CACHE`` if set, else ``~/.cache/transnormer`` (not created here)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "transnormer"


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    """The given cache dir (or the default one), created if missing."""
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a path or None, got {type(cache_dir).__name__}")
    path = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    if path.exists() and not path.is_dir():  # (mkdir's FileExistsError named neither the flag nor the variable)
        given = ("cache_dir (--cache-dir)" if cache_dir is not None else f"${CACHE_ENV}" if os.environ.get(CACHE_ENV)
                 else "the default cache")
        raise ValueError(f"{given} {str(path)!r} is not a directory: give a directory for the caches")
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_text(*parts: str) -> str:
    """Hex sha256 over length-prefixed UTF-8 parts (length prefixes keep ``("ab", "c")`` != ``("a", "bc")``)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def stable_unit_hash(*parts: object) -> float:
    """A number in [0, 1) from sha256 of ``parts``: stable across processes and Python versions.

    Python's ``hash()`` is salted per process for ``str`` (PYTHONHASHSEED), so it must not decide splits.
    """
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
