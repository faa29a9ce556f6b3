"""ListOps: clean-room generator, label evaluator, tokeniser and loader (spec lra.md §2, §4.1).

An expression is a tree whose leaves are digits 0-9 and whose inner nodes apply one of
``[MIN``, ``[MAX``, ``[MED`` (floor of the median; the even-count median is the mean of the two
middle values) or ``[SM`` (sum modulo 10) to 2-10 children.

Internally a tree is held in its *token form* (prefix order, parentheses deleted, ``]`` written
``X``), which is exactly what the model sees: ``( ( ( ( [MAX 2 ) 9 ) 4 ) ] )`` has the token form
``[MAX 2 9 4 X`` and the ids ``[13, 4, 11, 6, 16]``. The token form is injective, so it serves for
structural deduplication and the official string can be rebuilt from it (:func:`serialize`).

Files (official layout): ``basic_train.tsv``, ``basic_val.tsv``, ``basic_test.tsv``, each with the
header ``Source<TAB>Target``; our generator adds ``generation.json`` (version, seed, parameters,
counts, statistics, SHA-256 of the TSVs).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from ._common import (
    PackedSequences,
    as_dir,
    atomic_write_lines,
    begin_generation,
    check_int,
    check_seed,
    end_generation,
    sha256_file,
    split_name,
)

GENERATOR_VERSION = "v1"
"""Bumped whenever the sampled sequence for a given seed and config could change."""

CHUNK_SIZE = 256
"""Accepted trees per independently seeded chunk (part of the v1 stream definition)."""

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
PAD, UNK = "<pad>", "<unk>"
CLOSE = "X"
VOCAB: tuple[str, ...] = (PAD, UNK, *(str(d) for d in range(10)), *OPERATORS, CLOSE)
"""Token vocabulary: pad=0, unk=1, digits 0-9 = 2..11, [MIN/[MAX/[MED/[SM = 12..15, X = 16."""
TOKEN_TO_ID: dict[str, int] = {t: i for i, t in enumerate(VOCAB)}
PAD_ID = 0
UNK_ID = 1
DIGIT0_ID = TOKEN_TO_ID["0"]
OP0_ID = TOKEN_TO_ID[OPERATORS[0]]
CLOSE_ID = TOKEN_TO_ID[CLOSE]
VOCAB_SIZE = len(VOCAB)
NUM_CLASSES = 10

SPLIT_FILES = {"train": "basic_train.tsv", "val": "basic_val.tsv", "test": "basic_test.tsv"}
HEADER = "Source\tTarget"


@dataclass(frozen=True)
class ListOpsConfig:
    """Generator parameters; the defaults are the official LRA ones (spec §4.1).

    ``min_length < len < max_length`` (both exclusive), where ``len`` counts operator tokens,
    digits and closing brackets, not parentheses (= the length of the token form).
    """

    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500
    max_length: int = 2000
    operator_prob: float = 0.25
    n_train: int = 96_000
    n_val: int = 2_000
    n_test: int = 2_000

    def __post_init__(self) -> None:
        check_int("max_depth", self.max_depth, minimum=1)
        check_int("max_args", self.max_args, minimum=2)
        check_int("min_length", self.min_length, minimum=0)
        check_int("max_length", self.max_length, minimum=2)
        if self.max_length - self.min_length < 2:
            raise ValueError(
                f"min_length < len < max_length is empty: min_length={self.min_length}, max_length={self.max_length}"
            )
        p = self.operator_prob
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"operator_prob must be a float in [0, 1], got {p!r}")
        for name in ("n_train", "n_val", "n_test"):
            check_int(name, getattr(self, name), minimum=0)
        # Trees the parameters admit must reach min_length < len < max_length, or generation
        # would sample forever: the longest tree (every node an operator of max_args children down
        # to max_depth, where nodes are leaves) and the shortest (a leaf, or with p = 1 binary
        # operators down to max_depth).
        longest = shortest = 1
        for _ in range(self.max_depth - 1):
            longest = 2 + self.max_args * longest
            shortest = 2 + 2 * shortest if p >= 1 else 1
        if p > 0 and longest <= self.min_length or p == 0 and self.min_length >= 1:
            raise ValueError(f"no tree is longer than min_length={self.min_length}: the longest these parameters "
                             f"make has {longest if p > 0 else 1} tokens (max_depth={self.max_depth}, "
                             f"max_args={self.max_args}, operator_prob={p})")
        if shortest >= self.max_length:
            raise ValueError(f"no tree is shorter than max_length={self.max_length}: the shortest these parameters "
                             f"make has {shortest} tokens (operator_prob={p}, max_depth={self.max_depth})")

    @property
    def n_total(self) -> int:
        return self.n_train + self.n_val + self.n_test

    def is_official(self) -> bool:
        """True when the tree distribution (not the counts) matches the official parameters."""
        d = ListOpsConfig()
        return all(
            getattr(self, f) == getattr(d, f)
            for f in ("max_depth", "max_args", "min_length", "max_length", "operator_prob")
        )


# --------------------------------------------------------------------------- sampling


def _chunk_rng(seed: int, chunk: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(chunk,))))


def _sample_chunk(seed: int, chunk: int, cfg: ListOpsConfig, n_accept: int) -> tuple[list[bytes], int]:
    """Sample roots until ``n_accept`` are accepted; returns (token forms as bytes, attempts).

    The random stream of chunk ``c`` is a numpy PCG64 seeded with ``SeedSequence(seed,
    spawn_key=(c,))``, consumed as float64 uniforms u in [0, 1) in blocks; integer draws are
    ``lo + floor(u * n)``. Per node, in order (spec §4.1): u (only if depth < max_depth); a leaf
    (u > p) then draws its value; an operator draws k in 2..max_args, generates its k children,
    then draws the operator. A root is abandoned as soon as its length provably reaches
    ``max_length`` (tokens so far + one closing bracket per open operator).
    """
    rng = _chunk_rng(seed, chunk)
    block = 1 << 16
    buf = rng.random(block).tolist()
    i = 0
    max_depth, p = cfg.max_depth, float(cfg.operator_prob)
    n_k = cfg.max_args - 1
    lo, hi = cfg.min_length, cfg.max_length
    margin = max_depth + 3  # uniforms one loop iteration can consume: u, value, one op per close
    accepted: list[bytes] = []
    attempts = 0
    while len(accepted) < n_accept:
        attempts += 1
        out: list[int] = []
        rem: list[int] = []  # children still to generate, per open operator
        opos: list[int] = []  # index of each open operator's placeholder in `out`
        depth = 1
        ok = True
        while True:
            if i >= block - margin:
                buf = buf[i:] + rng.random(block).tolist()
                block = len(buf)
                i = 0
            if depth < max_depth:
                u = buf[i]
                i += 1
            else:
                u = 1.0
            if u > p or depth >= max_depth:  # a node at max_depth is a leaf (also when p = 1)
                out.append(DIGIT0_ID + int(buf[i] * 10))
                i += 1
                while rem:
                    rem[-1] -= 1
                    if rem[-1]:
                        break
                    rem.pop()
                    out[opos.pop()] = OP0_ID + int(buf[i] * 4)
                    i += 1
                    out.append(CLOSE_ID)
                    depth -= 1
                else:
                    break  # the root is complete
            else:
                rem.append(2 + int(buf[i] * n_k))
                i += 1
                opos.append(len(out))
                out.append(0)  # operator placeholder, drawn when the node closes
                depth += 1
            if len(out) + len(rem) >= hi:
                ok = False
                break
        if ok and lo < len(out) < hi:
            accepted.append(bytes(out))
        if attempts >= 1_000_000 and len(accepted) * 10_000 < attempts:
            raise RuntimeError(f"ListOps: {len(accepted)} of {attempts} sampled trees fell in min_length < len < "
                               f"max_length ({lo}, {hi}); these parameters almost never make an acceptable tree")
    return accepted, attempts


def _chunk_worker(args: tuple[int, int, ListOpsConfig, int]) -> tuple[list[bytes], int]:
    return _sample_chunk(*args)


@dataclass
class ListOpsSample:
    """One generated expression: ``tokens`` = token ids [T] (``T`` = spec length), ``label`` 0-9."""

    tokens: bytes
    label: int

    @property
    def source(self) -> str:
        """The official bracketed string (``Source`` column)."""
        return serialize(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class ListOpsGeneration:
    """Result of :func:`generate_listops`: the deduplicated samples in generation order + stats."""

    samples: list[ListOpsSample]
    attempts: int
    accepted: int
    duplicates: int
    chunks: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.attempts, 1)


def generate_listops(
    n: int | None = None, *, seed: int, config: ListOpsConfig | None = None, workers: int = 1
) -> ListOpsGeneration:
    """Generate ``n`` distinct expressions (default ``config.n_total``) deterministically.

    The output depends only on ``seed``, the tree parameters of ``config`` and
    :data:`GENERATOR_VERSION`, not on ``workers`` (chunks are independently seeded and merged in
    chunk order); the first ``n`` samples for a larger ``n`` are the same. Duplicates (structural
    equality = equal token form, compared through a 128-bit BLAKE2b digest) are dropped, keeping
    the first occurrence.
    """
    cfg = config if config is not None else ListOpsConfig()
    if not isinstance(cfg, ListOpsConfig):
        raise TypeError(f"config must be a ListOpsConfig, got {type(cfg).__name__}")
    seed = check_seed(seed)
    n = cfg.n_total if n is None else check_int("n", n, minimum=0)
    workers = check_int("workers", workers, minimum=1)
    seen: set[bytes] = set()
    samples: list[ListOpsSample] = []
    attempts = accepted = duplicates = used_chunks = 0
    next_chunk = 0
    pool = None
    try:
        while len(samples) < n:
            missing = n - len(samples)
            n_chunks = max(1, math.ceil(missing / CHUNK_SIZE))
            if workers > 1:
                n_chunks = max(n_chunks, workers)
            tasks = [(seed, c, cfg, CHUNK_SIZE) for c in range(next_chunk, next_chunk + n_chunks)]
            next_chunk += n_chunks
            if workers > 1 and len(tasks) > 1:
                if pool is None:
                    import multiprocessing as mp

                    pool = mp.get_context("spawn").Pool(min(workers, os.cpu_count() or 1))
                results: Iterator[tuple[list[bytes], int]] = pool.imap(_chunk_worker, tasks)
            else:
                results = map(_chunk_worker, tasks)
            before = len(samples)
            for trees, n_att in results:
                if len(samples) >= n:  # a chunk only a pool of workers computed: not counted, so the
                    continue           # counts (and generation.json) do not depend on ``workers``
                used_chunks += 1
                attempts += n_att
                accepted += len(trees)  # every tree the chunk accepted, as its attempts count every root
                for t in trees:
                    if len(samples) >= n:
                        break
                    key = hashlib.blake2b(t, digest_size=16).digest()
                    if key in seen:
                        duplicates += 1
                        continue
                    seen.add(key)
                    samples.append(ListOpsSample(t, evaluate_tokens(t)))
            if len(samples) == before:
                raise RuntimeError(
                    f"ListOps: {n_chunks * CHUNK_SIZE} accepted trees in a row were all duplicates; the parameters "
                    f"(min_length={cfg.min_length}, max_length={cfg.max_length}, max_depth={cfg.max_depth}, "
                    f"max_args={cfg.max_args}) admit fewer than n={n} distinct trees"
                )
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return ListOpsGeneration(samples, attempts, accepted, duplicates, used_chunks)


# --------------------------------------------------------------------------- labels / strings


def apply_op(op: str, values: Sequence[int]) -> int:
    """Apply a ListOps operator (``"[MIN"``, ``"[MAX"``, ``"[MED"``, ``"[SM"``) to digit values."""
    if not values:
        raise ValueError(f"operator {op} needs at least one argument")
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[MED":
        s = sorted(values)
        m = len(s) // 2
        return s[m] if len(s) % 2 else (s[m - 1] + s[m]) // 2
    if op == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {op!r}; expected one of {OPERATORS}")


def evaluate_tokens(tokens: Sequence[int] | bytes) -> int:
    """Evaluate a token-form expression (ids as in :data:`VOCAB`) to its label 0-9."""
    stack: list[list[int]] = []
    ops: list[str] = []
    result: int | None = None
    for pos, t in enumerate(tokens):
        if result is not None:
            raise ValueError(f"trailing token at position {pos} after a complete expression")
        if DIGIT0_ID <= t < DIGIT0_ID + 10:
            v = t - DIGIT0_ID
            if stack:
                stack[-1].append(v)
            else:
                result = v
        elif OP0_ID <= t < OP0_ID + len(OPERATORS):
            ops.append(VOCAB[t])
            stack.append([])
        elif t == CLOSE_ID:
            if not stack:
                raise ValueError(f"unbalanced closing bracket at position {pos}")
            v = apply_op(ops.pop(), stack.pop())
            if stack:
                stack[-1].append(v)
            else:
                result = v
        else:
            raise ValueError(f"invalid token id {t} at position {pos}")
    if result is None:
        raise ValueError("incomplete expression (unclosed operator or empty input)")
    return result


def evaluate(source: str) -> int:
    """Evaluate an official bracketed ``Source`` string (or its token form) to its label."""
    return evaluate_tokens(encode(source, strict=True))


def serialize(tokens: Sequence[int] | bytes) -> str:
    """Rebuild the official string from a token form (spec §4.1 serialisation).

    Operator node with children c1..ck → ``( `` × (k+1) ``op c1 ) c2 ) … ck ) ] )``, i.e. the
    left-nested pairs (((op, c1), c2) …, ck) paired with ``]``.
    """
    frames: list[tuple[str, list[str]]] = []
    out: str | None = None
    for pos, t in enumerate(tokens):
        if out is not None:
            raise ValueError(f"trailing token at position {pos} after a complete expression")
        if DIGIT0_ID <= t < DIGIT0_ID + 10:
            s = VOCAB[t]
        elif OP0_ID <= t < OP0_ID + len(OPERATORS):
            frames.append((VOCAB[t], []))
            continue
        elif t == CLOSE_ID:
            if not frames:
                raise ValueError(f"unbalanced closing bracket at position {pos}")
            op, children = frames.pop()
            if not children:
                raise ValueError(f"operator {op} without arguments at position {pos}")
            s = "( " * (len(children) + 1) + op + " " + " ) ".join(children) + " ) ] )"
        else:
            raise ValueError(f"invalid token id {t} at position {pos}")
        if frames:
            frames[-1][1].append(s)
        else:
            out = s
    if out is None:
        raise ValueError("incomplete expression (unclosed operator or empty input)")
    return out


def tree_depth(tokens: Sequence[int] | bytes) -> int:
    """Depth of a token-form tree (a lone digit has depth 1)."""
    depth = best = 0
    for t in tokens:
        if OP0_ID <= t < OP0_ID + len(OPERATORS):
            depth += 1
            best = max(best, depth)
        elif t == CLOSE_ID:
            depth -= 1
        else:
            best = max(best, depth + 1)
    return best


# --------------------------------------------------------------------------- tokeniser


def tokenize(source: str) -> list[str]:
    """Spec §2 tokenisation: split on whitespace, delete ``(`` and ``)``, map ``]`` to ``X``."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a str, got {type(source).__name__}")
    return [CLOSE if t == "]" else t for t in source.split() if t not in ("(", ")")]


def encode(source: str, *, strict: bool = False) -> list[int]:
    """Token ids of ``source`` (unknown tokens → ``<unk>``, or ``ValueError`` when ``strict``)."""
    ids = []
    for t in tokenize(source):
        i = TOKEN_TO_ID.get(t)
        if i is None or i < DIGIT0_ID:
            if strict:
                raise ValueError(f"unknown ListOps token {t!r}")
            i = UNK_ID
        ids.append(i)
    return ids


def decode(ids: Sequence[int]) -> str:
    """Space-joined tokens for ids (padding dropped)."""
    return " ".join(VOCAB[i] for i in ids if i != PAD_ID)


# --------------------------------------------------------------------------- files


def _split_counts(cfg: ListOpsConfig) -> dict[str, int]:
    return {"train": cfg.n_train, "val": cfg.n_val, "test": cfg.n_test}


def write_listops(
    out_dir: str | os.PathLike, *, seed: int, config: ListOpsConfig | None = None, workers: int = 1
) -> dict:
    """Generate the three splits and write the official TSVs plus ``generation.json``.

    Samples are deduplicated in generation order, then the first ``n_train`` go to train, the next
    ``n_val`` to val and the next ``n_test`` to test. Every file is written atomically. Returns the
    sidecar dict.
    """
    cfg = config if config is not None else ListOpsConfig()
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"out_dir must be a str or os.PathLike path, got {type(out_dir).__name__}")
    out = Path(out_dir)
    begin_generation(out, any((out / f).exists() for f in SPLIT_FILES.values()), "ListOps")
    gen = generate_listops(seed=seed, config=cfg, workers=workers)
    counts = _split_counts(cfg)
    bounds = {}
    start = 0
    for s in ("train", "val", "test"):
        bounds[s] = (start, start + counts[s])
        start += counts[s]
    files = {}
    for s, (a, b) in bounds.items():
        path = out / SPLIT_FILES[s]
        atomic_write_lines(path, [HEADER, *(f"{x.source}\t{x.label}" for x in gen.samples[a:b])])
        files[SPLIT_FILES[s]] = sha256_file(path)
    lengths = np.array([x.length for x in gen.samples], dtype=np.int64)
    labels = np.bincount([x.label for x in gen.samples], minlength=10)
    meta = {
        "task": "listops",
        "generator": "transnormer.data.lra.listops",
        "generator_version": GENERATOR_VERSION,
        "chunk_size": CHUNK_SIZE,
        "seed": seed,
        "config": asdict(cfg),
        "official_parameters": cfg.is_official(),
        "counts": counts,
        "attempts": gen.attempts,
        "accepted": gen.accepted,
        "duplicates_dropped": gen.duplicates,
        "acceptance_rate": round(gen.acceptance_rate, 6),
        "length": {
            "min": int(lengths.min()) if lengths.size else None,
            "max": int(lengths.max()) if lengths.size else None,
            "mean": float(lengths.mean()) if lengths.size else None,
            "median": float(np.median(lengths)) if lengths.size else None,
        },
        "label_counts": [int(c) for c in labels],
        "sha256": files,
        "dataset_id": listops_dataset_id(seed, cfg),
    }
    end_generation(out, meta)
    return meta


def listops_dataset_id(seed: int, cfg: ListOpsConfig) -> str:
    """``listops-regen(gen=v1, seed=N)``; non-default parameters/counts are appended."""
    extra = ""
    d = ListOpsConfig()
    if not cfg.is_official():
        extra += f", len=({cfg.min_length},{cfg.max_length}), depth={cfg.max_depth}, args={cfg.max_args}, p={cfg.operator_prob}"
    if (cfg.n_train, cfg.n_val, cfg.n_test) != (d.n_train, d.n_val, d.n_test):
        extra += f", n={cfg.n_train}/{cfg.n_val}/{cfg.n_test}"
    kind = "regen" if cfg.is_official() else "fixture"
    return f"listops-{kind}(gen={GENERATOR_VERSION}, seed={seed}{extra})"


def read_listops_tsv(path: str | os.PathLike, *, strict_tokens: bool = True) -> tuple[list[str], list[int]]:
    """Read one official ListOps TSV → (sources, labels).

    Expects the header ``Source<TAB>Target`` and then ``<expression><TAB><label 0-9>`` per line
    (blank lines are skipped). Raises ``ValueError`` naming the file and the 1-based line number
    for a bad header, a wrong field count, a bad label or (``strict_tokens``) an unknown token.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ListOps file not found: {path}")
    sources: list[str] = []
    labels: list[int] = []
    with open(path, encoding="utf-8", newline="") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.rstrip("\r\n")
            if lineno == 1:
                if line.lstrip("\ufeff") != HEADER:
                    raise ValueError(f"{path}:1: expected header {HEADER!r}, got {line[:80]!r}")
                continue
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected 2 tab-separated fields (Source, Target), got {len(parts)}")
            src, tgt = parts
            try:
                label = int(tgt.strip())
            except ValueError:
                raise ValueError(f"{path}:{lineno}: Target must be an integer 0-9, got {tgt!r}") from None
            if not 0 <= label <= 9:
                raise ValueError(f"{path}:{lineno}: Target must be an integer 0-9, got {label}")
            if not src.strip():
                raise ValueError(f"{path}:{lineno}: empty Source expression")
            if strict_tokens:
                for tok in tokenize(src):
                    if TOKEN_TO_ID.get(tok, UNK_ID) < DIGIT0_ID:
                        raise ValueError(f"{path}:{lineno}: unknown ListOps token {tok!r}")
            sources.append(src)
            labels.append(label)
    if not sources:
        raise ValueError(f"{path}: empty file (expected header {HEADER!r})" if path.stat().st_size == 0
                         else f"{path}: no rows after the header")
    return sources, labels


def find_listops_dir(root: str | os.PathLike) -> Path:
    """The folder holding ``basic_*.tsv``: ``root`` itself or ``root/listops-1000`` (official)."""
    root = as_dir("root", root)
    for cand in (root, root / "listops-1000", root / "listops"):
        if (cand / SPLIT_FILES["train"]).is_file() or (cand / SPLIT_FILES["test"]).is_file():
            return cand
    raise FileNotFoundError(
        f"no ListOps files ({', '.join(SPLIT_FILES.values())}) in {root} or {root / 'listops-1000'}"
    )


def load_listops_split(
    root: str | os.PathLike, split: str, *, max_len: int | None = None
) -> tuple[PackedSequences, np.ndarray, Path]:
    """(token ids: item ``i`` is ``int64[T ≤ max_len]``; labels ``int64[N]``; folder) of one split."""
    split = split_name(split)
    if max_len is not None:
        check_int("max_len", max_len, minimum=1)
    d = find_listops_dir(root)
    sources, labels = read_listops_tsv(d / SPLIT_FILES[split])
    ids = PackedSequences.build(bytes(encode(s)[:max_len]) for s in sources)
    return ids, np.asarray(labels, dtype=np.int64), d


def read_sidecar_config(meta: dict) -> ListOpsConfig:
    """Rebuild the :class:`ListOpsConfig` recorded in a sidecar dict."""
    names = {f.name for f in fields(ListOpsConfig)}
    return ListOpsConfig(**{k: v for k, v in meta.get("config", {}).items() if k in names})
