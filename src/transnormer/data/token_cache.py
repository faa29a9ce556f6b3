"""Token ids of each corpus split, cached on disk as memory-mapped numpy arrays.

Layout (one directory per corpus x tokenizer)::

    <cache_dir>/tokens/<corpus fp[:16]>-<tokenizer fp[:16]>/
        train.bin   train.json   valid.bin   valid.json   test.bin   test.json

``<split>.bin`` is the raw little-endian id stream (``uint16`` when ``vocab_size <= 65536``, else
``uint32``): every document's ids followed by the EOS id, so documents are separated by EOS. The JSON
sidecar records dtype, length, number of documents and both full fingerprints.

A cached split is used only when its sidecar matches the corpus and tokenizer fingerprints and the
``.bin`` has the recorded size and sha256 (read in full at each open: ~0.2 s for 100M tokens);
anything else is rebuilt. Both files are written to temporary files and
moved in place with ``os.replace``, the ``.bin`` first and the sidecar last: the sidecar is the commit
mark, so a build that fails or is interrupted leaves no file that could be mistaken for a cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings
from pathlib import Path

import numpy as np

from .._files import (
    atomic_path,
    atomic_write_text,
    can_create_in,
    file_lock,
    file_sha256,
    no_space_error,
    out_of_space,
    remove_atomic_leftovers,
)
from ._util import resolve_cache_dir

__all__ = ["build_token_cache", "token_cache_dir", "token_dtype", "open_token_split"]

_FORMAT = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id (``< vocab_size``) fits in 16 bits, else ``uint32``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint32 ids")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def token_cache_dir(corpus, tokenizer, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory holding the token cache of ``corpus`` under ``tokenizer`` (not created)."""
    root = resolve_cache_dir(cache_dir)
    return root / "tokens" / f"{corpus.fingerprint[:16]}-{tokenizer.fingerprint[:16]}"


def open_token_split(directory: str | os.PathLike, split: str, *, expect: dict | None = None,
                     verify: bool = True, warn: bool = True) -> np.ndarray | None:
    """Memory-map ``<directory>/<split>.bin`` if its sidecar is valid, else return ``None``.

    Args:
        expect: sidecar entries that must match (e.g. the fingerprints).
        verify: also check the ``.bin`` against the sha256 its sidecar records (caches written
            before the digest was recorded have none). A ``.bin`` changed under the same size (a
            bad disk block, a copy cut and padded) had been read as the cache. ``warn``: say so.

    Returns:
        1-D read-only array of ids, shape ``[num_tokens]``.
    """
    directory = Path(directory)
    meta_path, bin_path = directory / f"{split}.json", directory / f"{split}.bin"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        dtype = np.dtype(meta["dtype"])
        n = int(meta["num_tokens"])
        if meta.get("format") != _FORMAT or any(meta.get(k) != v for k, v in (expect or {}).items()):
            return None
        if bin_path.stat().st_size != n * dtype.itemsize:
            return None
        if verify and meta.get("sha256") is not None and file_sha256(bin_path) != meta["sha256"]:
            if warn:
                warnings.warn(f"token cache: {str(bin_path)!r} does not match the sha256 its sidecar records "
                              "(changed on disk): it is tokenized again where the cache is writable", stacklevel=2)
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if n == 0:  # mmap cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,))


# A point just after "x\n" before a printable ASCII character: byte-level BPE never joins across it.
_LINE_START = re.compile(r"(?<=[!-~]\n)(?=[!-~])")
_PIECE_CHARS = 1 << 17  # a document longer than this is encoded a piece at a time where it can be cut


def _pieces(doc: str, limit: int) -> list[str]:
    """``doc`` cut at line starts into pieces of at least ``limit`` characters (the last may be shorter)."""
    pieces, start = [], 0
    while len(doc) - start > limit:
        cut = _LINE_START.search(doc, start + limit)
        if cut is None:
            break
        pieces.append(doc[start:cut.start()])
        start = cut.start()
    pieces.append(doc[start:])
    return pieces


def _write_split(
    docs: list[str], tokenizer, bin_path: Path, dtype: np.dtype, batch_docs: int, progress,
    piece_chars: int = _PIECE_CHARS,
) -> tuple[int, int, str]:
    """Write ``docs``' ids, each document followed by EOS, to ``bin_path``: ``(tokens, documents,
    sha256 of the file)``.

    Encoding a whole document at once holds the backend's whole encoding: a one-sentence-per-line file
    with no blank lines is a single document of the whole split (9M characters, 3.8M tokens: 1.5 GB of
    peak memory). Where the tokenizer allows (:attr:`TextTokenizer.splits_at_line_starts`) such a
    document is encoded in pieces of ``piece_chars`` cut at line starts, to the same ids (35 MB, and
    faster); a call encodes at most ``batch_docs`` pieces, and stops adding pieces once it holds
    ``piece_chars`` characters."""
    eos = tokenizer.eos_id
    n_tokens = 0
    digest = hashlib.sha256()
    cuttable = getattr(tokenizer, "splits_at_line_starts", False)

    def batches():  # (piece, whether it ends its document): at most batch_docs pieces and ~piece_chars a call
        pending: list[tuple[str, bool]] = []
        chars = 0
        for doc in docs:
            pieces = _pieces(doc, piece_chars) if cuttable and len(doc) > piece_chars else [doc]
            for i, piece in enumerate(pieces):
                pending.append((piece, i == len(pieces) - 1))
                chars += len(piece)
                if len(pending) == batch_docs or chars >= piece_chars:
                    yield pending
                    pending, chars = [], 0
        if pending:
            yield pending

    with atomic_path(bin_path) as tmp, open(tmp, "wb") as f:
        for batch in batches():
            pieces = []
            for ids, (_, ends) in zip(tokenizer.encode_batch([p for p, _ in batch]), batch, strict=True):
                pieces.append(np.asarray(ids, dtype=np.int64))
                if ends:
                    pieces.append(np.asarray([eos], dtype=np.int64))
            chunk = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
            if chunk.size and (chunk.min() < 0 or chunk.max() >= np.iinfo(dtype).max + 1):
                raise ValueError(f"tokenizer produced id {int(chunk.max())} that does not fit {dtype}")
            data = chunk.astype(dtype).tobytes()
            f.write(data)
            digest.update(data)
            n_tokens += int(chunk.size)
            if progress is not None:
                progress.update(sum(ends for _, ends in batch))
    return n_tokens, len(docs), digest.hexdigest()


def build_token_cache(
    corpus,
    tokenizer,
    *,
    cache_dir: str | os.PathLike | None = None,
    splits: tuple[str, ...] | list[str] | None = None,
    rebuild: bool = False,
    batch_docs: int = 64,
    show_progress: bool = False,
) -> dict[str, np.ndarray]:
    """Tokenize ``corpus`` with ``tokenizer`` into the cache (if needed) and memory-map the result.

    Args:
        corpus: a :class:`~transnormer.data.corpus.Corpus`.
        tokenizer: a :class:`~transnormer.data.tokenizer.TextTokenizer` (needs ``eos_id``).
        cache_dir: cache root (default ``$TRANSNORMER_CACHE`` or ``~/.cache/transnormer``).
        splits: which splits (default: all of the corpus).
        rebuild: ignore an existing valid cache and tokenize again.
        batch_docs: documents per ``encode_batch`` call (memory vs. parallelism).

    Returns:
        ``{split: ids}`` with ``ids`` a read-only 1-D ``np.memmap`` of shape ``[num_tokens]``.
    """
    if not hasattr(corpus, "fingerprint") or not isinstance(getattr(corpus, "splits", None), dict):
        raise TypeError(f"corpus must be a Corpus, got {type(corpus).__name__}")
    if not hasattr(tokenizer, "encode_batch") or not hasattr(tokenizer, "fingerprint"):
        raise TypeError(f"tokenizer must be a TextTokenizer, got {type(tokenizer).__name__}")
    if tokenizer.eos_id is None:
        raise ValueError("tokenizer has no EOS token; the token cache separates documents with EOS")
    if isinstance(batch_docs, bool) or not isinstance(batch_docs, int) or batch_docs < 1:
        raise ValueError(f"batch_docs must be a positive int, got {batch_docs!r}")
    if isinstance(splits, str):  # (list("train") had been five one-letter splits, 't' "not a split")
        raise TypeError(f"splits must be a list of split names, got the str {splits!r} (use [{splits!r}])")
    wanted = list(corpus.splits) if splits is None else list(splits)
    for s in wanted:
        if s not in corpus.splits:
            raise ValueError(f"splits: {s!r} is not a split of the corpus (has {sorted(corpus.splits)})")
    directory = token_cache_dir(corpus, tokenizer, cache_dir)
    dtype = token_dtype(tokenizer.vocab_size)
    expect = {
        "corpus_fingerprint": corpus.fingerprint,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "dtype": dtype.str,
    }
    out: dict[str, np.ndarray] = {}
    for split in wanted:
        # One builder at a time per split: a second process building the same entry would otherwise
        # delete the sidecar the first has just committed (below) and make the first fail its read-back.
        arr = None if rebuild else open_token_split(directory, split, expect=expect)
        if arr is None:  # the lock only to build: a cache others made stays readable without write access
            if not can_create_in(directory):
                if open_token_split(directory, split, expect=expect, verify=False) is not None:  # (all but the digest)
                    raise ValueError(f"cache_dir: split {split!r} of the token cache {str(directory)!r} does not "
                                     "match the sha256 its sidecar records (changed on disk), and the cache is not "
                                     "writable; give a writable --cache-dir (or TRANSNORMER_CACHE), or restore "
                                     f"{split}.bin")
                raise ValueError(f"cache_dir: the token cache {str(directory)!r} lacks split {split!r} of this corpus "
                                 "and tokenizer, and is not writable; give a writable --cache-dir "
                                 "(or TRANSNORMER_CACHE)")
            directory.mkdir(parents=True, exist_ok=True)
            with file_lock(directory / f"{split}.lock", f"tokenizing split {split!r} into {str(directory)!r}"):
                arr = _open_or_build(corpus, tokenizer, directory, split, expect, dtype,
                                     rebuild=rebuild, batch_docs=batch_docs, show_progress=show_progress)
        out[split] = arr
    return out


def _open_or_build(corpus, tokenizer, directory: Path, split: str, expect: dict, dtype, *, rebuild: bool,
                   batch_docs: int, show_progress: bool) -> np.ndarray:
    # (again under the lock: another process may have built it meanwhile; a mismatch was said already)
    arr = None if rebuild else open_token_split(directory, split, expect=expect, warn=False)
    if arr is None:
        docs = corpus.splits[split]
        # Remove the commit mark first: if we die mid-build, an older sidecar must not vouch for a
        # .bin that is about to be replaced.
        with contextlib.suppress(FileNotFoundError):
            (directory / f"{split}.json").unlink()
        # a build killed before its cleanup ran left its partial .bin; only the lock holder (us) writes it
        remove_atomic_leftovers(directory / f"{split}.bin")
        progress = None
        if show_progress:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(docs), desc=f"tokenizing {split}", unit="doc")
        try:
            n_tokens, n_docs, sha256 = _write_split(
                docs, tokenizer, directory / f"{split}.bin", dtype, batch_docs, progress
            )
        except OSError as e:
            if out_of_space(e):
                raise no_space_error(e, f"the token cache of split {split!r} (give another --cache-dir)",
                                     directory) from e
            raise
        finally:
            if progress is not None:
                progress.close()
        meta = dict(
            expect,
            format=_FORMAT,
            split=split,
            num_tokens=n_tokens,
            num_docs=n_docs,
            sha256=sha256,
            eos_id=tokenizer.eos_id,
            vocab_size=tokenizer.vocab_size,
            corpus=corpus.name,
            tokenizer=tokenizer.name,
        )
        atomic_write_text(directory / f"{split}.json", json.dumps(meta, indent=1))
        arr = open_token_split(directory, split, expect=expect, verify=False)  # (hashed as it was written)
        if arr is None:  # pragma: no cover - would mean the filesystem lost our write
            raise RuntimeError(f"token cache {str(directory)!r}: {split} unreadable right after writing it")
    return arr
