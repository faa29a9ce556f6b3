"""Text corpora for language modelling, built from one ``--data`` spec string.

A spec is one of

* ``"stdlib"`` (the default): English docstrings of the running Python's standard library
  (:mod:`transnormer.data.stdlib_docs`), cached per Python version, works offline;
* ``"hf:NAME"`` or ``"hf:NAME:CONFIG"``: a dataset loaded with the optional ``datasets`` package; its
  ``text`` column, else its only string column, or the column named by a suffix ``#COLUMN``; its splits
  named as files' are (``train``, ``validation``, ...; others are ignored with a warning);
* a path: a text file (``.txt``, ``.tokens``, ... optionally compressed ``.xz``/``.gz``/``.bz2``) or a
  directory of them (searched recursively; empty or blank files in it are skipped with a warning).

Splits. Files whose name (or a parent directory name, for a directory spec) contains a split word —
``train``/``training``, ``valid``/``validation``/``val``/``dev``, ``test``/``testing`` as a separate word,
a shard number after it allowed, e.g. ``docs.train.txt.xz``, ``wiki.valid.tokens``, ``train.txt``,
``train0.txt``, ``valid/part0.txt`` — form that split. A file spec whose name names a split is loaded
together with its siblings (``docs.train.txt.xz`` also picks up ``docs.valid.txt.xz`` and
``docs.test.txt.xz``; ``train0.txt`` picks up ``valid0.txt``, not ``train1.txt``). A missing
``valid``/``test`` split, or all splits when no file names one, is carved out of the training documents
by :func:`split_documents`.

Documents. Text is cut into documents by :func:`split_into_documents`: at header lines ``= = = ... = = =``
if the text has any (the format of ``/work/shared/data/lm``), else at WikiText article titles
(`` = Title = ``), else at blank lines (paragraphs).
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._files import cache_write_text
from ._util import resolve_cache_dir, sha256_text, stable_unit_hash

__all__ = [
    "SPLITS",
    "Corpus",
    "load_corpus",
    "read_text_file",
    "split_documents",
    "split_into_documents",
    "split_of_name",
]

SPLITS = ("train", "valid", "test")

# Words (after cutting a file name at non-alphanumerics) that name a split.
_SPLIT_WORDS = {
    "train": "train",
    "training": "train",
    "valid": "valid",
    "validation": "valid",
    "val": "valid",
    "dev": "valid",
    "test": "test",
    "testing": "test",
}
_COMPRESSED = {".xz": lzma.open, ".lzma": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}
# Suffixes (before any compression suffix) that a directory scan treats as text.
_TEXT_SUFFIXES = frozenset({".txt", ".text", ".tokens", ".raw"})

_DEFAULT_FRACTIONS = {"path": 0.01, "hf": 0.01, "stdlib": 0.02}
_STDLIB_FORMAT = 1  # bump when extraction changes so old caches are not reused

_HEADER = re.compile(r"^= = = .*$", re.MULTILINE)
_WIKITEXT_TITLE = re.compile(r"^ = [^=\n][^\n]* = $", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n[ \t]*\n(?:[ \t]*\n)*")


@dataclass
class Corpus:
    """Documents of each split.

    Attributes:
        name: human-readable source (``"stdlib"``, a path, ``"hf:wikitext:wikitext-2-raw-v1"``).
        splits: ``{"train": [...], "valid": [...], "test": [...]}``; each a list of documents (str).
        fingerprint: sha256 hex over the split names and document texts; equal fingerprints mean equal
            content, so it keys tokenizer and token caches.
        sources: per split, the files (or other origins) its documents came from.

    Treat a corpus as immutable: the fingerprint is computed once, at construction.
    """

    name: str
    splits: dict[str, list[str]]
    fingerprint: str = ""
    sources: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for split, docs in self.splits.items():
            if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
                raise TypeError(f"splits[{split!r}] must be a list of str")
        if not self.fingerprint:
            self.fingerprint = corpus_fingerprint(self.splits)

    def __getitem__(self, split: str) -> list[str]:
        if split not in self.splits:
            raise KeyError(f"split {split!r} not in corpus {self.name!r}; have {sorted(self.splits)}")
        return self.splits[split]

    def num_chars(self, split: str) -> int:
        return sum(len(d) for d in self[split])

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={len(d)} docs/{self.num_chars(s)} chars" for s, d in self.splits.items())
        return f"Corpus({self.name!r}, {sizes}, fingerprint={self.fingerprint[:12]})"


def corpus_fingerprint(splits: dict[str, list[str]]) -> str:
    """sha256 over split names and document texts (order matters)."""
    parts: list[str] = []
    for split in sorted(splits):
        parts.append(f"<split {split} {len(splits[split])}>")
        parts.extend(splits[split])
    return sha256_text(*parts)


# --------------------------------------------------------------------------------------------- reading


def _strip_compression(name: str) -> tuple[str, str | None]:
    lower = name.lower()
    for suffix in _COMPRESSED:
        if lower.endswith(suffix):
            return name[: -len(suffix)], suffix
    return name, None


def read_text_file(path: str | os.PathLike, *, allow_blank: bool = False) -> str:
    """Read a UTF-8 text file, transparently decompressing ``.xz``/``.lzma``/``.gz``/``.bz2``.

    Line endings are normalised to ``"\\n"`` and a leading BOM is dropped. ``allow_blank``: return an
    empty or blank file's text instead of raising.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is empty or blank (unless ``allow_blank``), not valid UTF-8 (message names the byte offset in the
            decompressed data), or a corrupt compressed stream.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a regular file")
    _, compression = _strip_compression(path.name)
    try:
        if compression is None:
            raw = path.read_bytes()
        else:
            with _COMPRESSED[compression](path, "rb") as f:
                raw = f.read()
    except (lzma.LZMAError, gzip.BadGzipFile, EOFError, OSError) as e:
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise
        raise ValueError(f"{str(path)!r}: cannot decompress ({compression} stream): {e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = " of the decompressed data" if compression else ""
        raise ValueError(
            f"{str(path)!r}: invalid UTF-8 at byte offset {e.start}{where} (byte 0x{raw[e.start]:02x}); "
            "convert the file to UTF-8"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip() and not allow_blank:
        raise ValueError(
            f"{str(path)!r}: file is empty" if not raw else f"{str(path)!r}: file contains only whitespace"
        )
    return text


# ------------------------------------------------------------------------------------------- documents


def split_into_documents(text: str) -> list[str]:
    """Cut ``text`` into documents.

    Rule, first that applies:

    1. lines starting with ``"= = = "`` are headers; each starts a document (header line included);
    2. WikiText article titles (a line `` = Title = `` with a single ``=`` each side) start a document;
    3. otherwise, paragraphs separated by one or more blank lines are documents.

    Text before the first header is a document of its own. Documents are stripped of surrounding blank
    lines (not of leading spaces on their first line: WikiText lines start with a space); blank ones are
    dropped.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    for pattern in (_HEADER, _WIKITEXT_TITLE):
        starts = [m.start() for m in pattern.finditer(text)]
        if starts:
            bounds = ([0] if starts[0] > 0 else []) + starts + [len(text)]
            pieces = (text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
            return [d for d in (_trim(p) for p in pieces) if d]
    return [d for d in (_trim(p) for p in _BLANK_LINES.split(text)) if d]


def _trim(doc: str) -> str:
    # Drop blank lines around the document and trailing spaces, but keep the first line's indentation.
    lines = doc.rstrip().split("\n")
    start = 0
    while start < len(lines) and not lines[start].strip():
        start += 1
    return "\n".join(lines[start:])


def split_documents(
    docs: Sequence[str],
    *,
    seed: int = 0,
    valid_fraction: float = 0.01,
    test_fraction: float = 0.01,
    keys: Sequence[object] | None = None,
) -> dict[str, list[str]]:
    """Deterministic document-level train/valid/test split.

    Each document gets the score ``stable_unit_hash(seed, key)`` (sha256-based, independent of
    ``PYTHONHASHSEED`` and of the platform), where ``key`` is its index unless ``keys`` are given (the
    stdlib corpus keys by module name, so that a module keeps its split when another is added; path
    corpora keep index keys, which earlier runs' splits were made with). Identical documents form one
    group, scored by its first member, and go to one split, so a repeated paragraph (a licence, a
    boilerplate notice) cannot sit in train and in valid; a corpus without repeats splits as with
    one document per group. Groups are taken in score order: ``valid`` until it holds
    ``max(1, round(valid_fraction * n))`` documents, then ``test`` until ``max(1, round(test_fraction * n))``
    (0 when the fraction is 0), the rest ``train``; a group of copies can overshoot by its size. Counts
    (rather than thresholding each score) keep small corpora from ending with an empty split. Each split
    keeps the original document order.

    Returns:
        ``{"train": [...], "valid": [...], "test": [...]}`` (a split with fraction 0 is omitted).
    """
    for name, frac in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
            raise ValueError(f"{name} must be a number in [0, 1), got {frac!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    n = len(docs)
    if keys is None:
        keys = range(n)
    elif len(keys) != n:
        raise ValueError(f"keys has {len(keys)} entries but docs has {n}")
    n_valid = max(1, round(valid_fraction * n)) if valid_fraction > 0 else 0
    n_test = max(1, round(test_fraction * n)) if test_fraction > 0 else 0
    groups: dict[str, list[int]] = {}  # text → indices of its copies, first seen first
    for i, doc in enumerate(docs):
        groups.setdefault(doc, []).append(i)
    if len(groups) < (n_valid > 0) + (n_test > 0) + 1 or n < n_valid + n_test + 1:
        raise ValueError(
            f"cannot split {n} document(s) ({len(groups)} distinct) into train/valid/test: need at least "
            f"{n_valid + n_test + 1} distinct; provide more documents (separate them by blank lines) or "
            "explicit split files"
        )
    order = sorted(groups.values(), key=lambda g: (stable_unit_hash(seed, keys[g[0]]), g[0]))
    assign, taken = {}, {"valid": 0, "test": 0}
    for members in order:
        split = ("valid" if taken["valid"] < n_valid else "test" if taken["test"] < n_test else "train")
        if split != "train":
            taken[split] += len(members)
        assign.update(dict.fromkeys(members, split))
    if all(s != "train" for s in assign.values()):
        raise ValueError(
            f"cannot split {n} document(s) into train/valid/test: the copies of repeated documents leave "
            "no document for train; provide more documents or explicit split files"
        )
    out: dict[str, list[str]] = {"train": []}
    if n_valid:
        out["valid"] = []
    if n_test:
        out["test"] = []
    for i, doc in enumerate(docs):
        out[assign[i]].append(doc)
    return out


# --------------------------------------------------------------------------------------- path corpora


def _split_of_word(word: str) -> str | None:
    """The split a lower-case name word names, a shard number after it allowed (``train0``, ``val2017``:
    such files had been ignored, or the folder refused as having no training file)."""
    return _SPLIT_WORDS.get(word) or _SPLIT_WORDS.get(word.rstrip("0123456789"))


def split_of_name(name: str) -> str | None:
    """The split a file or directory name names (``"docs.train.txt.xz"`` → ``"train"``), else ``None``.

    Raises:
        ValueError: the name contains words of two different splits (e.g. ``train_test.txt``).
    """
    found = {s for s in map(_split_of_word, re.split(r"[^a-z0-9]+", name.lower())) if s}
    if len(found) > 1:
        raise ValueError(f"file name {name!r} names more than one split ({sorted(found)}); rename it")
    return found.pop() if found else None


def _is_text_file(path: Path) -> bool:
    if path.name.startswith(".") or not path.is_file():
        return False
    base, _ = _strip_compression(path.name)
    return Path(base).suffix.lower() in _TEXT_SUFFIXES


def _split_template(name: str) -> tuple[tuple[str, ...], str] | None:
    """``("docs", "{}", "txt"), "train"`` for ``docs.train.txt.xz``: name words with the split word
    replaced and the compression suffix dropped, so that siblings of the same family compare equal
    however each is compressed (``wiki.train.tokens.xz`` beside a plain ``wiki.valid.tokens``)."""
    words = re.split(r"([^a-z0-9]+)", _strip_compression(name)[0].lower())
    split = None
    for i, w in enumerate(words):
        if found := _split_of_word(w):
            split = found
            # the shard number stays in the family's name: train.txt brings valid.txt, not train2.txt,
            # and train0.txt brings valid0.txt
            words[i] = "{}" + ("" if w in _SPLIT_WORDS else w[len(w.rstrip("0123456789")):])
    return (tuple(words), split) if split else None


def _files_by_split(spec_path: Path) -> tuple[dict[str, list[Path]], list[Path]]:
    """Files of each named split, and the unnamed files (``{}`` when no file names a split)."""
    if spec_path.is_file():
        template = _split_template(spec_path.name)
        split_of_name(spec_path.name)  # raises on ambiguous names
        if template is None:
            return {}, [spec_path]
        family: dict[str, list[Path]] = {}
        for sib in sorted(spec_path.parent.iterdir()):
            sib_template = _split_template(sib.name)
            if sib.is_file() and sib_template is not None and sib_template[0] == template[0]:
                family.setdefault(sib_template[1], []).append(sib)
        # One file held both compressed and plain (docs.valid.txt beside docs.valid.txt.xz) is one text
        # twice: keep the copy compressed like the spec file, else refuse to guess. (Files of one split
        # under other names, docs.dev.txt beside docs.valid.txt, are all read, as before.)
        spec_compression = _strip_compression(spec_path.name)[1]
        for split, sibs in family.items():
            by_stem: dict[str, list[Path]] = {}
            for f in sibs:
                by_stem.setdefault(_strip_compression(f.name)[0], []).append(f)  # (PART.x beside part.x: two texts)
            kept: list[Path] = []
            for copies in by_stem.values():
                alike = [f for f in copies if _strip_compression(f.name)[1] == spec_compression]
                if len(copies) > 1 and len(alike) != 1:
                    raise ValueError(
                        f"{str(spec_path)!r}: split {split!r} has {len(copies)} files differing only in "
                        f"compression ({', '.join(f.name for f in copies)}); keep one"
                    )
                kept += alike if len(copies) > 1 else copies
            family[split] = kept
        return family, []
    files = sorted(p for p in spec_path.rglob("*") if _is_text_file(p) and not _hidden(p, spec_path))
    if not files:
        raise ValueError(
            f"directory {str(spec_path)!r} contains no text files "
            f"(looked for {', '.join(sorted(_TEXT_SUFFIXES))}, optionally .xz/.gz/.bz2)"
        )
    _refuse_compression_twins(files, spec_path)
    by_split: dict[str, list[Path]] = {}
    unnamed: list[Path] = []
    for f in files:
        # A split word may be in the file name or in a directory below the spec ("valid/part0.txt").
        rel_parts = f.relative_to(spec_path).parts
        splits = {s for s in (split_of_name(p) for p in rel_parts) if s}
        if len(splits) > 1:
            raise ValueError(f"path {str(f)!r} names more than one split ({sorted(splits)}); rename it")
        if splits:
            by_split.setdefault(splits.pop(), []).append(f)
        else:
            unnamed.append(f)
    return by_split, unnamed


def _refuse_compression_twins(files: list[Path], spec_path: Path) -> None:
    """Refuse one text held both plain and compressed in a directory (``docs.valid.txt`` beside
    ``docs.valid.txt.xz``, left by ``xz -dk``): both were read, every document of it twice."""
    by_stem: dict[tuple[Path, str], list[Path]] = {}
    for f in files:
        # (by the exact name: part.txt and PART.txt are two texts, which had been refused as one)
        by_stem.setdefault((f.parent, _strip_compression(f.name)[0]), []).append(f)
    for copies in by_stem.values():
        if len(copies) > 1:
            raise ValueError(
                f"directory {str(spec_path)!r} has {len(copies)} files differing only in compression "
                f"({', '.join(str(f.relative_to(spec_path)) for f in copies)}): each would be read; keep one"
            )


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _read_documents(files: list[Path], spec_path: Path) -> list[str]:
    """The documents of ``files``. Under a directory spec an empty or blank file (a shard left empty)
    is skipped with a warning; a file spec must hold text."""
    docs: list[str] = []
    blank: list[Path] = []
    for f in files:
        text = read_text_file(f, allow_blank=spec_path.is_dir())
        if not text.strip():
            blank.append(f)
        docs.extend(split_into_documents(text))
    if blank:
        warnings.warn(f"{str(spec_path)!r}: skipping {len(blank)} empty or blank file(s), e.g. {str(blank[0])!r}",
                      stacklevel=4)
    return docs


def _carve_missing(
    splits: dict[str, list[str]], seed: int, valid_fraction: float, test_fraction: float
) -> dict[str, list[str]]:
    """Carve the missing valid/test splits out of train."""
    missing_valid, missing_test = "valid" not in splits, "test" not in splits
    if not (missing_valid or missing_test):
        return splits
    carved = split_documents(
        splits["train"],
        seed=seed,
        valid_fraction=valid_fraction if missing_valid else 0.0,
        test_fraction=test_fraction if missing_test else 0.0,
    )
    # Train loses the carved documents; a split given by file name is kept as it is.
    return {s: carved[s] if s == "train" or s not in splits else splits[s] for s in SPLITS}


def _warn_shared_documents(path: Path, splits: dict[str, list[str]]) -> None:
    """Warn when split files given by name share documents with the training file (leakage)."""
    train = set(splits["train"])
    for s in ("valid", "test"):
        shared = sum(d in train for d in splits.get(s, ()))
        if shared:
            warnings.warn(
                f"{str(path)!r}: {shared} of {len(splits[s])} {s} document(s) also occur in the training "
                "files; their scores will read better than on unseen text",
                stacklevel=4,
            )


def _load_path_corpus(path: Path, seed: int, valid_fraction: float, test_fraction: float) -> Corpus:
    if not path.exists():
        raise FileNotFoundError(f"--data path {str(path)!r} does not exist (nor is it 'stdlib' or 'hf:NAME')")
    if not path.is_file() and not path.is_dir():  # (a pipe such as <(zcat x) had been called a directory)
        raise ValueError(f"--data path {str(path)!r} is neither a regular file nor a directory (a pipe or a "
                         "device?): write the text to a file and give its path")
    by_split, unnamed = _files_by_split(path)
    if by_split:
        if "train" not in by_split:
            raise ValueError(
                f"{str(path)!r}: found {sorted(by_split)} split file(s) but no training file "
                "(a name with the word 'train': train.txt, docs.train.txt, train-0.txt, train0.txt)"
            )
        if unnamed:
            warnings.warn(
                f"{str(path)!r}: ignoring {len(unnamed)} file(s) whose name names no split, e.g. {str(unnamed[0])!r}",
                stacklevel=3,
            )
        splits = {s: _read_documents(by_split[s], path) for s in SPLITS if s in by_split}
        for s, docs in splits.items():
            if not docs:
                raise ValueError(f"{str(path)!r}: split {s!r} has no documents")
        _warn_shared_documents(path, splits)
        splits = _carve_missing(splits, seed, valid_fraction, test_fraction)
        sources = {s: [str(f) for f in by_split.get(s, by_split["train"])] for s in SPLITS}
    else:
        docs = _read_documents(unnamed, path)
        splits = split_documents(docs, seed=seed, valid_fraction=valid_fraction, test_fraction=test_fraction)
        splits = {s: splits.get(s, []) for s in SPLITS}
        sources = {s: [str(f) for f in unnamed] for s in SPLITS}
    return Corpus(name=str(path), splits=splits, sources=sources)


# ----------------------------------------------------------------------------------------- hf corpora


def _load_hf_corpus(spec: str, seed: int, valid_fraction: float, test_fraction: float) -> Corpus:
    rest, hash_sign, column = spec[len("hf:") :].partition("#")
    name, _, config = rest.partition(":")
    if not name or (hash_sign and not column):
        raise ValueError(f"data spec {spec!r}: expected 'hf:NAME', 'hf:NAME:CONFIG' or either with '#COLUMN'")
    try:
        import datasets  # optional dependency, imported only when asked for
    except ImportError as e:
        raise ImportError(
            f"data spec {spec!r} needs the 'datasets' package: pip install datasets "
            "(or pip install 'transnormer[data]')"
        ) from e
    ds = datasets.load_dataset(name, config or None)
    splits: dict[str, list[str]] = {}
    ignored = []
    for hf_split in ds:  # the split names a path's file names use ("val" had been dropped, a valid split carved from train)
        ours = _SPLIT_WORDS.get(hf_split)
        if ours is None or ours in splits:
            ignored.append(hf_split)
            continue
        splits[ours] = _hf_documents(ds[hf_split], f"{spec} [{hf_split}]", column or None)
        if not splits[ours]:
            raise ValueError(f"data spec {spec!r}: split {hf_split!r} has no documents (no non-blank text)")
    if "train" not in splits:
        raise ValueError(f"data spec {spec!r}: the dataset has no 'train' split (has {list(ds)})")
    if ignored:  # a validation split named "eval" had been dropped silently, and a valid split carved from train
        carved = [s for s in SPLITS if s not in splits]
        warnings.warn(
            f"data spec {spec!r}: ignoring split(s) {ignored}, which name no split (train/training, "
            f"valid/validation/val/dev, test/testing) or repeat one"
            + (f"; {' and '.join(carved)} carved from train" if carved else ""),
            stacklevel=3,
        )
    splits = _carve_missing(splits, seed, valid_fraction, test_fraction)
    return Corpus(name=spec, splits=splits, sources={s: [spec] for s in splits})


def _hf_documents(split_ds, where: str, column: str | None = None) -> list[str]:
    """The documents of one split: column ``column``, else ``text``, else the only string column."""
    columns = list(split_ds.column_names)
    if column is not None:
        if column not in columns:
            raise ValueError(f"{where}: no column {column!r} (has {columns})")
    elif "text" in columns:
        column = "text"
    else:
        features = getattr(split_ds, "features", {}) or {}
        strings = [c for c in columns if getattr(features.get(c), "dtype", None) in ("string", "large_string")]
        if not strings:
            raise ValueError(f"{where}: no 'text' column and no string column among {columns}; "
                             "name one with hf:NAME[:CONFIG]#COLUMN")
        if len(strings) > 1:  # the first had been taken: an "id" column before the content trained as text
            raise ValueError(f"{where}: no 'text' column and {len(strings)} string columns {strings}; "
                             "name one with hf:NAME[:CONFIG]#COLUMN")
        column = strings[0]
    rows = [r for r in split_ds[column] if isinstance(r, str)]
    nonblank = [r for r in rows if r.strip()]
    # Line-based datasets (WikiText on the hub: one row per line, each ending in "\n") are joined back
    # into the original text and cut into documents by the usual rule; otherwise a row is a document.
    # A row with a line break before its end is a document of several lines, not a line: the dataset
    # is then one document per row, even if its rows end in "\n".
    line_rows = all("\n" not in r[:-1] for r in nonblank)
    if nonblank and line_rows and sum(r.endswith("\n") for r in nonblank) >= 0.5 * len(nonblank):
        # A blank line is an empty row with no "\n" of its own: give it back, or the paragraph rule
        # (and the text of every document) loses it.
        return split_into_documents("".join(r if r.endswith("\n") else r + "\n" for r in rows))
    return [r.strip() for r in nonblank]


# -------------------------------------------------------------------------------------- stdlib corpus


def _stdlib_cache_file(cache_dir: Path) -> Path:
    impl = sys.implementation.name
    version = ".".join(map(str, sys.version_info[:3]))
    from .stdlib_docs import stdlib_root

    # The stdlib path is part of the key: two installs of the same version may be patched differently.
    root_key = sha256_text(str(stdlib_root()))[:8]
    return cache_dir / "corpora" / f"stdlib-{impl}{version}-{root_key}-v{_STDLIB_FORMAT}.json"


def _stdlib_documents(cache_dir: Path) -> list[tuple[str, str]]:
    from .stdlib_docs import extract_stdlib_documents

    cache_file = _stdlib_cache_file(cache_dir)
    if cache_file.is_file():
        try:
            payload = json.loads(cache_file.read_text(encoding="utf-8"))
            if payload.get("format") == _STDLIB_FORMAT:
                docs = [(str(k), str(t)) for k, t in payload["documents"]]
                if docs and sha256_text(*(k + "\0" + t for k, t in docs)) == payload.get("sha256"):
                    return docs
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or corrupt cache: rebuild it below
    docs = extract_stdlib_documents()
    if not docs:
        raise RuntimeError("found no usable docstrings in the standard library; pass a --data path instead")
    payload = {
        "format": _STDLIB_FORMAT,
        "python": sys.version,
        "documents": [[k, t] for k, t in docs],
        "sha256": sha256_text(*(k + "\0" + t for k, t in docs)),
    }
    cache_write_text(cache_file, json.dumps(payload, ensure_ascii=False))
    return docs


def _load_stdlib_corpus(cache_dir, seed: int, valid_fraction: float, test_fraction: float) -> Corpus:
    docs = _stdlib_documents(resolve_cache_dir(cache_dir))
    # Keyed by module name, not index, so that a module keeps its split when another module is added.
    splits = split_documents(
        [t for _, t in docs],
        keys=[k for k, _ in docs],
        seed=seed,
        valid_fraction=valid_fraction,
        test_fraction=test_fraction,
    )
    splits = {s: splits.get(s, []) for s in SPLITS}
    return Corpus(name="stdlib", splits=splits, sources={s: ["stdlib"] for s in SPLITS})


# ---------------------------------------------------------------------------------------------- entry


def load_corpus(
    spec: str | os.PathLike = "stdlib",
    *,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    valid_fraction: float | None = None,
    test_fraction: float | None = None,
) -> Corpus:
    """Load the corpus named by a ``--data`` spec (see the module docstring).

    Args:
        spec: ``"stdlib"``, ``"hf:NAME[:CONFIG][#COLUMN]"`` or a file/directory path.
        cache_dir: where the stdlib corpus is cached; default ``$TRANSNORMER_CACHE`` or
            ``~/.cache/transnormer``.
        seed: seed of the document-level split (only used for splits that are carved out).
        valid_fraction, test_fraction: share of documents carved out for valid/test when a split is not
            given by file name; default 0.01 (0.02 for ``stdlib``, whose documents are whole modules).

    Returns:
        A :class:`Corpus` with splits ``train``, ``valid`` and ``test``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str or path, got {type(spec).__name__}")
    if not spec.strip():
        raise ValueError("spec must not be empty (use 'stdlib', 'hf:NAME[:CONFIG][#COLUMN]' or a path)")
    kind = "stdlib" if spec == "stdlib" else "hf" if spec.startswith("hf:") else "path"
    vf = _DEFAULT_FRACTIONS[kind] if valid_fraction is None else valid_fraction
    tf = _DEFAULT_FRACTIONS[kind] if test_fraction is None else test_fraction
    for name, frac in (("valid_fraction", vf), ("test_fraction", tf)):
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac < 0.5:
            raise ValueError(f"{name} must be a number in (0, 0.5), got {frac!r}")
    if kind == "stdlib":
        return _load_stdlib_corpus(cache_dir, seed, vf, tf)
    if kind == "hf":
        return _load_hf_corpus(spec, seed, vf, tf)
    return _load_path_corpus(Path(spec).expanduser(), seed, vf, tf)
