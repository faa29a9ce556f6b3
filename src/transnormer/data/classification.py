"""Sequence classification data from TSV / CSV / JSON-lines files (GLUE files work as distributed).

Reading (:func:`read_classification_file`):

* format from the suffix: ``.tsv``/``.txt`` tab-separated (no quoting, like GLUE: quotes are text),
  ``.csv`` comma-separated (standard quoting), ``.jsonl``/``.ndjson``/``.json`` one JSON object per line
  (a ``.json`` file holding a JSON array also works);
* header: detected when the first row contains a known column name (or a column name you passed);
  a header-less 4-column file is read as CoLA (``source, label, orig_label, sentence``); other header-less
  files need integer ``text_column``/``label_column`` indices;
* columns, when not given: a text pair among ``sentence1/sentence2``, ``question1/question2``,
  ``question/sentence`` (QNLI), ``#1 String/#2 String`` (MRPC), ``premise/hypothesis``, ``text_a/text_b``;
  else a single text among ``sentence``, ``text``, ...; the label among ``gold_label`` (MNLI/SNLI),
  ``label``, ``Quality`` (MRPC), ``is_duplicate`` (QQP), ... Matching ignores case.
* labels: required, except for files whose name says ``test`` (GLUE test files have none), unless
  ``require_labels`` says otherwise.

Encoding (:class:`ClassificationDataset`): ``<s> A </s>`` or ``<s> A </s> B </s>`` (whichever of BOS/EOS
the tokenizer has). Sequences longer than ``max_length`` are truncated longest-first (default) or rejected
with an error naming the file and line (``truncate=False``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .._files import atomic_write_text
from .mlm import as_ids, check_max_length, pad_sequences

__all__ = [
    "ClassificationCollator",
    "ClassificationDataset",
    "ClassificationExample",
    "LabelSet",
    "load_classification_splits",
    "read_classification_file",
]

_PAIR_COLUMNS = (
    ("sentence1", "sentence2"),
    ("question1", "question2"),
    ("question", "sentence"),
    ("#1 string", "#2 string"),
    ("premise", "hypothesis"),
    ("text_a", "text_b"),
    ("text1", "text2"),
)
_SINGLE_COLUMNS = ("sentence", "text", "review", "content", "document", "text_a", "question")
_LABEL_COLUMNS = ("gold_label", "label", "quality", "is_duplicate", "labels", "class", "category", "target", "score")
_OTHER_KNOWN = ("index", "idx", "id", "#1 id", "#2 id", "qid1", "qid2", "pairid", "promptid", "genre",
                "filename", "year", "old_index", "source1", "source2")  # (the last five: STS-B's)
_KNOWN_COLUMNS = frozenset(
    {c for pair in _PAIR_COLUMNS for c in pair} | set(_SINGLE_COLUMNS) | set(_LABEL_COLUMNS) | set(_OTHER_KNOWN)
)
_COLA_COLUMNS = ("source", "label", "orig_label", "sentence")

ColumnSpec = str | int | None


@dataclass(frozen=True)
class ClassificationExample:
    """One row: ``label`` is the normalised label string (``None`` in unlabelled files)."""

    text: str
    text_pair: str | None
    label: str | None
    source: str
    line: int  # 1-based line where the record starts


def _label_key(value, where: str) -> str:
    """Normalise a label cell: ``1``, ``1.0``, ``"1"`` → ``"1"``; strings are stripped."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return repr(value)
    if isinstance(value, str):
        # a text cell "1.0" (or "01") is the class of "1", as the number 1.0 is (a file mixing them
        # had a class per spelling). "+1" stays as it is: read as "1" it would reorder a +1/-1 label
        # set, and a classifier trained before would score with its classes swapped.
        value = value.strip()
        integral = re.fullmatch(r"([-+]?\d+)\.0*", value) or re.fullmatch(r"(-?\d+)", value)
        return str(int(integral.group(1))) if integral else value
    raise ValueError(f"{where}: label {value!r} must be a string or a number")


class LabelSet:
    """Mapping between label names and class indices, fixed by the training file.

    Integer-like labels (``"0"``, ``"1"``, ``"-1"``) are ordered numerically, others alphabetically, so the
    same training labels always give the same indices.
    """

    def __init__(self, names: Iterable[str], origin: str = "built from the training file") -> None:
        names = list(names)
        if not names:
            raise ValueError("names: a label set needs at least one label")
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"label names must be str, got {type(n).__name__} ({n!r})")
        if len(set(names)) != len(names):
            raise ValueError(f"names contains duplicates: {names}")
        self.names = names
        self.origin = origin  # where the names came from, for the message on an unknown label
        self._index = {n: i for i, n in enumerate(names)}

    @classmethod
    def from_examples(cls, examples: Iterable[ClassificationExample]) -> LabelSet:
        """Labels of ``examples`` in canonical order (numeric if all are integers, else alphabetical)."""
        labels = {ex.label for ex in examples if ex.label is not None}
        if not labels:
            raise ValueError("examples: no labelled example to build a label set from")
        spellings: dict[int, list[str]] = {}
        for x in sorted(labels):
            if re.fullmatch(r"[-+]?\d+", x):
                spellings.setdefault(int(x), []).append(x)
        twins = next((v for v in spellings.values() if len(v) > 1), None)
        if twins:  # "+1" is kept as written (_label_key); beside "1" (or "+01") it would be a class of its own
            raise ValueError(f"examples: labels {twins[0]!r} and {twins[1]!r} are one value spelled two ways; "
                             "spell them alike in the data")
        if all(re.fullmatch(r"-?\d+", x) for x in labels):
            return cls(sorted(labels, key=int))
        if _are_scores(labels):  # (labels_of gives Scores for them)
            example = next(x for x in sorted(labels) if not re.fullmatch(r"[-+]?\d+", x))
            raise ValueError(f"examples: the labels are real-valued scores (e.g. {example!r}): a regression "
                             "task, whose labels are Scores (labels_of), not a label set of classes")
        return cls(sorted(labels))

    def index(self, label: str, *, source: str = "", line: int | None = None) -> int:
        """Class index of ``label``; ``ValueError`` naming the file, line and label when unknown."""
        try:
            return self._index[label]
        except KeyError:
            where = f"{source!r}, line {line}: " if source else ""
            raise ValueError(
                f"{where}label {label!r} is not in the label set {self.names} ({self.origin})"
            ) from None

    def __len__(self) -> int:
        return len(self.names)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LabelSet) and other.names == self.names

    def __repr__(self) -> str:
        return f"LabelSet({self.names})"

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.names))

    @property
    def label2id(self) -> dict[str, int]:
        return dict(self._index)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``{"labels": [...]}`` as JSON (atomically)."""
        atomic_write_text(path, json.dumps({"labels": self.names}, indent=1, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> LabelSet:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(data["labels"])
        except FileNotFoundError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{str(path)!r} is not a label-set file: {e}") from e


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_WHOLE = re.compile(r"[-+]?\d+")


def _are_scores(labels: Iterable[str]) -> bool:
    """Every label a number and some not whole (STS-B's 0-5 similarity): scores to regress on, which
    classes would treat as unordered names and cross-entropy as unrelated classes."""
    labels = list(labels)
    return (bool(labels) and all(_NUMBER.fullmatch(x) for x in labels)
            and any(not _WHOLE.fullmatch(x) for x in labels))


class Scores:
    """The labels of a regression task (STS-B): each a real number, the target of one output (HF's
    ``num_labels=1``, ``problem_type="regression"``: MSE). It stands where a :class:`LabelSet` does:
    ``names`` is one output's, and :meth:`index` gives the number itself."""

    names = ["score"]

    def index(self, label: str, *, source: str = "", line: int | None = None) -> float:
        """``label`` as a float; ``ValueError`` naming the file, line and label when it is not a finite number."""
        value = float(label) if _NUMBER.fullmatch(label.strip()) else math.nan
        if not math.isfinite(value):
            where = f"{source!r}, line {line}: " if source else ""
            raise ValueError(f"{where}label {label!r} is not a number, and the labels are regression scores")
        return value

    def __len__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "Scores()"


def labels_of(examples: Iterable[ClassificationExample]) -> LabelSet | Scores:
    """The labels of a training split: :class:`Scores` when they are real-valued scores (every one a
    number, some not whole), else their :class:`LabelSet`."""
    examples = list(examples)
    labels = {ex.label for ex in examples if ex.label is not None}
    if _are_scores(labels):
        return Scores()
    decimals = sorted(x for x in labels if _NUMBER.fullmatch(x) and not _WHOLE.fullmatch(x))
    odd = [ex for ex in examples if ex.label is not None and not _NUMBER.fullmatch(ex.label)]
    labelled = sum(ex.label is not None for ex in examples)
    # A few rows of non-numbers among real-valued scores: a regression file with bad scores (one "NaN"
    # had made a classifier of one class per score value). Classes named by decimals beside word
    # classes of many rows stay classes.
    if decimals and len(odd) <= max(2, labelled // 100):
        bad = odd[0]
        raise ValueError(f"{bad.source!r}, line {bad.line}: label {bad.label!r} is not a number, while the other "
                         f"labels are real-valued scores (e.g. {decimals[0]!r}): fix that row, or leave such rows out "
                         f"(drop_labels=[{bad.label!r}], --drop-label {bad.label})")
    return LabelSet.from_examples(examples)


# ------------------------------------------------------------------------------------------------- reading


def _file_format(path: Path, file_format: str | None) -> str:
    if file_format is not None:
        if file_format not in ("tsv", "csv", "jsonl"):
            raise ValueError(f"file_format must be 'tsv', 'csv' or 'jsonl', got {file_format!r}")
        return file_format
    suffix = path.suffix.lower()
    if suffix in (".tsv", ".txt", ".tab"):
        return "tsv"
    if suffix == ".csv":
        return "csv"
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    raise ValueError(
        f"{str(path)!r}: cannot tell the format from suffix {suffix!r}; pass file_format='tsv'|'csv'|'jsonl'"
    )


def _read_text(path: Path) -> str:
    if not path.exists():
        raise FileNotFoundError(f"classification file {str(path)!r} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{str(path)!r}: invalid UTF-8 at byte offset {e.start}") from None
    if text.startswith("\ufeff"):  # MRPC's files start with a BOM
        text = text[1:]
    if not text.strip():
        raise ValueError(f"{str(path)!r}: file is empty")
    return text


def _records_delimited(path: Path, text: str, fmt: str) -> tuple[list[tuple[int, list[str]]], int]:
    """(start line, cells) for each non-empty row, and the widest row's width."""
    if fmt == "tsv":
        reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[tuple[int, list[str]]] = []
    start = 1
    # csv's default field limit (131,072 characters) would call a long document "malformed"; no field
    # is longer than the text. The limit is process-wide, so it is given back.
    old_limit = csv.field_size_limit(max(csv.field_size_limit(), len(text)))
    try:
        for cells in reader:
            if any(c.strip() for c in cells):
                rows.append((start, cells))
            start = reader.line_num + 1
    except csv.Error as e:
        raise ValueError(f"{str(path)!r}, line {start}: malformed {fmt.upper()} ({e})") from e
    finally:
        csv.field_size_limit(old_limit)
    return rows, max((len(c) for _, c in rows), default=0)


def _records_json(path: Path, text: str) -> list[tuple[int, dict]]:
    stripped = text.lstrip()
    if stripped.startswith("["):  # a JSON array of objects
        try:
            items = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{str(path)!r}: invalid JSON ({e})") from e
        records = list(zip(_array_item_lines(text), items, strict=True))
    else:
        records = []
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                records.append((lineno, json.loads(line)))
            except ValueError as e:
                raise ValueError(f"{str(path)!r}, line {lineno}: invalid JSON ({e.msg})") from None
    for lineno, rec in records:
        if not isinstance(rec, dict):
            raise ValueError(f"{str(path)!r}, line {lineno}: expected a JSON object, got {type(rec).__name__}")
    return records


def _array_item_lines(text: str) -> list[int]:
    """1-based line on which each item of the JSON array ``text`` starts (``text`` is valid JSON)."""
    decoder, lines = json.JSONDecoder(), []
    i, line, counted = text.index("[") + 1, 1, 0
    while True:
        while text[i] in " \t\r\n,":
            i += 1
        if text[i] == "]":
            return lines
        line += text.count("\n", counted, i)
        counted = i
        lines.append(line)
        _, i = decoder.raw_decode(text, i)


def _find(columns: Sequence[str], wanted: str) -> int | None:
    """Index of column ``wanted`` (exact match first, then case-insensitive)."""
    if wanted in columns:
        return list(columns).index(wanted)
    lowered = [c.strip().lower() for c in columns]
    w = wanted.strip().lower()
    return lowered.index(w) if w in lowered else None


def _resolve(columns: Sequence[str], spec: ColumnSpec, what: str, path: Path) -> int | None:
    if spec is None:
        return None
    if isinstance(spec, bool) or not isinstance(spec, (str, int)):
        raise TypeError(f"{what} must be a column name (str) or index (int), got {type(spec).__name__}")
    if isinstance(spec, int):
        if not 0 <= spec < len(columns):
            raise ValueError(f"{str(path)!r}: {what}={spec} is out of range for {len(columns)} columns")
        return spec
    idx = _find(columns, spec)
    if idx is None:
        raise ValueError(f"{str(path)!r}: {what}={spec!r} is not a column (columns: {list(columns)})")
    return idx


def _detect_columns(columns: Sequence[str], path: Path) -> tuple[int, int | None]:
    for a, b in _PAIR_COLUMNS:
        ia, ib = _find(columns, a), _find(columns, b)
        if ia is not None and ib is not None:
            return ia, ib
    for name in _SINGLE_COLUMNS:
        i = _find(columns, name)
        if i is not None:
            return i, None
    raise ValueError(
        f"{str(path)!r}: cannot tell which column holds the text (columns: {list(columns)}); "
        "pass text_column= (CLI: --text-column; and text_pair_column= / --text-pair-column for pairs)"
    )


def _names_split_test(name: str) -> bool:
    words = re.split(r"[^a-z0-9]+", name.lower())
    return "test" in words or "testing" in words


def read_classification_file(
    path: str | os.PathLike,
    *,
    text_column: ColumnSpec = None,
    text_pair_column: ColumnSpec = None,
    label_column: ColumnSpec = None,
    require_labels: bool | None = None,
    has_header: bool | None = None,
    file_format: str | None = None,
    drop_labels: Iterable[str] = (),
    skip_bad_rows: bool = False,
) -> list[ClassificationExample]:
    """Read labelled (or unlabelled) text / text-pair examples (see the module docstring).

    Args:
        path: the file.
        text_column, text_pair_column, label_column: column names (or 0-based indices); auto-detected
            when ``None``. Giving ``text_column`` alone means single-text examples.
        require_labels: ``True``: a missing label column is an error; ``False``: read labels if present;
            ``None`` (default): required unless the file name contains the word ``test``.
        has_header: force header / no header (default: detected).
        file_format: ``"tsv"``, ``"csv"`` or ``"jsonl"`` (default: from the suffix).
        drop_labels: rows with these labels are skipped (e.g. ``("-",)`` for SNLI's no-consensus rows).
        skip_bad_rows: skip delimited rows that lack a needed column instead of raising.

    Raises:
        FileNotFoundError, ValueError: missing file, empty file, invalid UTF-8, malformed row, unknown
            column, missing label column / empty label (messages name the file and line).
    """
    path = Path(path)
    fmt = _file_format(path, file_format)
    text = _read_text(path)
    src = str(path)
    drop = {_label_key(x, "drop_labels") for x in drop_labels}
    if require_labels is None:
        require_labels = not _names_split_test(path.name)
        labels_by_default = True
    else:
        labels_by_default = False

    header_guessed = has_header is None and fmt != "jsonl"
    if fmt == "jsonl":
        records = _records_json(path, text)
        if not any(rec for _, rec in records):  # (it had been "cannot tell which column holds the text (columns: [])")
            raise ValueError(f"{src!r}: no records (an empty JSON array, or only empty objects)")
        keys: list[str] = []
        for _, rec in [r for r in records if r[1]][:100]:  # columns from the first records (JSON objects may omit keys)
            keys.extend(k for k in rec if k not in keys)
        rows = [(lineno, rec) for lineno, rec in records]
        columns = keys
    else:
        delimited, width = _records_delimited(path, text, fmt)
        if not delimited:
            raise ValueError(f"{src!r}: file has no rows")
        first = [c.strip() for c in delimited[0][1]]
        if has_header is None:
            wanted = {
                str(c).strip().lower() for c in (text_column, text_pair_column, label_column) if isinstance(c, str)
            }
            # a row with a number in it is data ("text<TAB>1" in a file without a header), not names
            has_header = (any(c.lower() in _KNOWN_COLUMNS or c.lower() in wanted for c in first)
                          and not any(re.fullmatch(r"[-+]?\d+(?:\.\d*)?", c) for c in first))
        if has_header:
            columns, body = first, delimited[1:]
        elif width == 4 and text_column is None and label_column is None:
            columns, body = list(_COLA_COLUMNS), delimited  # CoLA's in-domain/out-of-domain files
        else:
            columns, body = [str(i) for i in range(width)], delimited
        rows = body
        if not rows:
            raise ValueError(f"{src!r}: file has a header but no data rows")

    text_idx = _resolve(columns, text_column, "text_column", path)
    pair_idx = _resolve(columns, text_pair_column, "text_pair_column", path)
    if text_idx is None:
        if pair_idx is not None:
            raise ValueError("text_pair_column (--text-pair-column) given without text_column (--text-column)")
        text_idx, pair_idx = _detect_columns(columns, path)
    label_idx = _resolve(columns, label_column, "label_column", path)
    if label_idx is None:
        for name in _LABEL_COLUMNS:
            label_idx = _find(columns, name)
            if label_idx is not None:
                break
    if label_idx is None and require_labels:
        hint = " or require_labels=False for an unlabelled file" if labels_by_default else ""
        raise ValueError(
            f"{src!r}: no label column (columns: {list(columns)}; looked for {list(_LABEL_COLUMNS)}); "
            f"pass label_column= (CLI: --label-column){hint}"
        )
    if label_idx is not None and label_idx in (text_idx, pair_idx):
        raise ValueError(f"{src!r}: label column {columns[label_idx]!r} is also a text column")

    examples: list[ClassificationExample] = []
    needed = [i for i in (text_idx, pair_idx, label_idx) if i is not None]
    for lineno, row in rows:
        where = f"{src!r}, line {lineno}"
        if isinstance(row, dict):
            names = [columns[i] for i in needed]
            missing = [n for n in names if n not in row or row[n] is None]
            cells = {i: row.get(columns[i]) for i in needed}
        else:
            missing = [columns[i] for i in needed if i >= len(row)]
            cells = {i: row[i] for i in needed if i < len(row)}
            if any(str(c).strip() for c in row[len(columns):]):  # a delimiter inside the text shifted the cells
                if skip_bad_rows:
                    continue
                raise ValueError(f"{where}: {len(row)} fields, expected {len(columns)} (a delimiter inside a text "
                                 f"field?); skip_bad_rows=True (--skip-bad-rows) skips such rows")
        if label_idx is not None and columns[label_idx] in missing and not require_labels and isinstance(row, dict):
            missing.remove(columns[label_idx])  # optional labels may be absent from some JSON records
        if missing:
            if skip_bad_rows:
                continue
            raise ValueError(f"{where}: missing column(s) {missing} (row has {len(row)} field(s)); "
                             "skip_bad_rows=True (--skip-bad-rows) skips such rows")
        label = None
        if label_idx is not None and cells.get(label_idx) is not None:
            label = _label_key(cells[label_idx], where)
            if label == "":
                if require_labels:
                    raise ValueError(f"{where}: empty label in column {columns[label_idx]!r}")
                label = None
            elif label in drop:
                continue
        texts = []
        for i in (text_idx, pair_idx):
            if i is None:
                texts.append(None)
                continue
            value = cells[i]
            if not isinstance(value, str):
                raise ValueError(f"{where}: column {columns[i]!r} must hold text, got {type(value).__name__}")
            texts.append(value)
        examples.append(ClassificationExample(texts[0], texts[1], label, src, lineno))
    if not examples:
        raise ValueError(f"{src!r}: no examples left to read")
    if header_guessed and not has_header:
        _refuse_header_read_as_example(examples, src)
    return examples


def _refuse_header_read_as_example(examples: list[ClassificationExample], src: str) -> None:
    """A header of names the detection does not know (``tweet<TAB>sentiment``) was read as an example,
    and its label ("sentiment") trained as one more class. Refused where that is plain: the first
    row's label is a word found in no other row, and every other label is a number. Warned where it
    is likely (word labels, each other one found in two rows or more, and the first row's texts
    single words, as column names are): a one-word example of a class seen once is possible."""
    first, rest = examples[0], [ex.label for ex in examples[1:] if ex.label is not None]
    number = re.compile(r"[-+]?\d+(?:\.\d*)?")
    if first.line != 1 or first.label is None or not rest or number.fullmatch(first.label) or first.label in rest:
        return
    counts = Counter(rest)
    names = all(t is None or (t.strip() and not re.search(r"\s", t.strip())) for t in (first.text, first.text_pair))
    if all(number.fullmatch(label) for label in rest):
        raise ValueError(f"{src!r}, line 1: label {first.label!r} looks like a column name (every other label is a "
                         "number); say whether the file has a header: has_header=True/False (--header yes/no)")
    if names and min(counts.values()) >= 2:
        # word labels: a header is likely but a one-word example of a class seen once is possible, so
        # said, not refused (the header had been trained as a class without a word)
        warnings.warn(f"{src!r}, line 1: label {first.label!r} is in no other row and the row's text {first.text!r} "
                      "is one word: if it is a header, say so (has_header=True, --header yes); it is read as an "
                      "example", stacklevel=3)


# ------------------------------------------------------------------------------------------------ encoding


def _truncate_lengths(la: int, lb: int, budget: int) -> tuple[int, int]:
    """Longest-first truncation of two lengths to a total of ``budget``."""
    if la + lb <= budget:
        return la, lb
    if lb == 0:
        return budget, 0
    short, long_ = sorted((la, lb))
    if short <= budget - short:  # trimming the longer one alone suffices
        kept_long = budget - short
        return (kept_long, lb) if la >= lb else (la, kept_long)
    half = budget // 2
    # both trimmed: the longer text keeps the odd token, the second on a tie, as the saved fast
    # tokenizer's LongestFirst does (the first had kept it: a one-token train/serve skew in HF pipelines)
    return (budget - half, half) if la > lb else (half, budget - half)


class ClassificationDataset(torch.utils.data.Dataset):
    """Tokenized classification examples.

    Args:
        examples: from :func:`read_classification_file`.
        tokenizer: a :class:`~transnormer.data.tokenizer.TextTokenizer`.
        label_set: maps labels to class indices (a :class:`LabelSet`), or reads them as numbers
            (:class:`Scores`, regression); examples without a label get no ``labels`` entry.
        max_length: the model's maximum sequence length (special tokens included).
        truncate: truncate longest-first (default) or raise ``ValueError`` naming file and line.

    Item ``i`` is ``{"input_ids": LongTensor[L_i], "labels": int}`` (a float for :class:`Scores`;
    ``labels`` absent when unlabelled).
    """

    def __init__(
        self,
        examples: Sequence[ClassificationExample],
        tokenizer,
        *,
        label_set: LabelSet | Scores | None,
        max_length: int,
        truncate: bool = True,
    ) -> None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if label_set is not None and not isinstance(label_set, (LabelSet, Scores)):
            raise TypeError(f"label_set must be a LabelSet or Scores, got {type(label_set).__name__}")
        examples = list(examples)
        if not examples:
            raise ValueError("examples must not be empty")
        has_pair = any(ex.text_pair is not None for ex in examples)
        bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        if has_pair and not eos:
            raise ValueError("tokenizer has no EOS token to separate a text pair")
        n_special = len(bos) + len(eos) * (2 if has_pair else 1)
        budget = max_length - n_special
        if budget < (2 if has_pair else 1):
            raise ValueError(f"max_length={max_length} leaves no room for text after {n_special} special tokens")

        first = tokenizer.encode_batch([ex.text for ex in examples])
        second = tokenizer.encode_batch([ex.text_pair or "" for ex in examples]) if has_pair else None
        self.input_ids: list[torch.Tensor] = []
        self.labels: list[int | float | None] = []
        self.num_truncated = 0
        for k, ex in enumerate(examples):
            a = first[k]
            b = second[k] if second is not None and ex.text_pair is not None else []
            total = len(a) + len(b) + n_special
            if total > max_length:
                if not truncate:
                    raise ValueError(
                        f"{ex.source!r}, line {ex.line}: {total} tokens exceed max_length={max_length}; "
                        "raise max_length (--seq-len) or let examples be truncated (truncate=True: leave out "
                        "--no-truncate; eval of a run trained with it: --truncate)"
                    )
                la, lb = _truncate_lengths(len(a), len(b), budget)
                a, b = a[:la], b[:lb]
                self.num_truncated += 1
            ids = bos + a + eos + (b + eos if ex.text_pair is not None else [])
            self.input_ids.append(torch.tensor(ids, dtype=torch.long))
            if ex.label is None:
                self.labels.append(None)
            elif label_set is None:
                raise ValueError(f"{ex.source!r}, line {ex.line}: example has a label but no label_set was given")
            else:
                self.labels.append(label_set.index(ex.label, source=ex.source, line=ex.line))
        self.label_set = label_set
        self.max_length = max_length
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def fingerprint(self) -> str:
        """sha256 hex over the items' token ids and labels (computed once): a resumed run checks
        that it goes on over the data it was saved with (edited texts, or a tokenizer trained again
        on them, change the ids)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(torch.tensor([len(x) for x in self.input_ids], dtype=torch.int64).numpy().tobytes())
            h.update(torch.cat(self.input_ids).numpy().tobytes())
            dtype = torch.float64 if isinstance(self.label_set, Scores) else torch.int64
            h.update(torch.tensor([-1 if y is None else y for y in self.labels], dtype=dtype).numpy().tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def __getitem__(self, i: int) -> dict:
        item: dict = {"input_ids": self.input_ids[i]}
        if self.labels[i] is not None:
            item["labels"] = self.labels[i]
        return item


class ClassificationCollator:
    """Right-pad a list of dataset items.

    Returns ``{"input_ids": LongTensor[B, L], "attention_mask": LongTensor[B, L], "labels": LongTensor[B]}``
    (``labels`` only when every item has one; with ``scores``, a FloatTensor of regression targets
    (:class:`Scores`), else class indices, floats refused), ``L`` the longest item (or ``pad_to``).
    """

    def __init__(self, pad_id: int | None, *, pad_to: int | None = None, scores: bool = False) -> None:
        if pad_id is None:
            raise ValueError("pad_id: the tokenizer has no pad token; pass an explicit pad_id")
        if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
            raise ValueError(f"pad_id must be a non-negative int, got {pad_id!r}")
        check_max_length("pad_to", pad_to)
        self.pad_id = pad_id
        self.pad_to = pad_to
        self.scores = scores

    def __call__(self, items: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        if len(items) == 0:
            raise ValueError("items must not be empty")
        ids, mask = pad_sequences([it["input_ids"] for it in items], self.pad_id, max_length=self.pad_to)
        batch = {"input_ids": ids, "attention_mask": mask}
        has = ["labels" in it for it in items]
        if all(has):
            labels = [it["labels"] for it in items]
            if self.scores:  # regression targets (Scores)
                batch["labels"] = torch.tensor(labels, dtype=torch.float32)
            else:
                batch["labels"] = as_ids("labels", labels)  # (int() had made 1.7 class 1)
        elif any(has):
            raise ValueError("items: some items have labels and some do not")
        return batch


def load_classification_splits(
    files: Mapping[str, str | os.PathLike],
    tokenizer,
    *,
    max_length: int,
    truncate: bool = True,
    train_split: str = "train",
    label_set: LabelSet | Scores | None = None,
    label_set_path: str | os.PathLike | None = None,
    **read_kwargs,
) -> tuple[dict[str, ClassificationDataset], LabelSet | Scores]:
    """Read and tokenize several files (``{"train": ..., "valid": ..., "test": ...}``).

    The label set is ``label_set`` if given, else built from ``files[train_split]`` (:func:`labels_of`:
    :class:`Scores` for real-valued scores); a label set is written to ``label_set_path`` when given.
    ``read_kwargs`` go to :func:`read_classification_file`.

    Returns:
        ``({split: dataset}, label_set)``.
    """
    if not isinstance(files, Mapping) or not files:
        raise TypeError("files must be a non-empty mapping split -> path")
    examples = {split: read_classification_file(p, **read_kwargs) for split, p in files.items()}
    if label_set is None:
        if train_split not in examples:
            raise ValueError(f"train_split: {train_split!r} not in files ({sorted(files)}) and no label_set given")
        label_set = labels_of(examples[train_split])
    if label_set_path is not None and isinstance(label_set, LabelSet):
        label_set.save(label_set_path)
    datasets = {
        split: ClassificationDataset(exs, tokenizer, label_set=label_set, max_length=max_length, truncate=truncate)
        for split, exs in examples.items()
    }
    return datasets, label_set
