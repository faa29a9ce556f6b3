"""Atomic file writes for everything the library leaves on disk: caches, results, reports, figures.

A run that is killed mid-write (Ctrl-C, a job's time limit, a full disk) must not leave a torn
``summary.json`` or ``results.json`` that a later ``report`` or ``--resume`` reads as the truth:
each writer fills a temporary file beside the target and renames it over the target.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text", "atomic_savefig", "cache_write_text",
           "can_create_in", "check_output", "file_lock", "no_space_error", "out_of_space", "read_jsonl",
           "remove_atomic_leftovers", "to_jsonable"]


def check_output(path: str | os.PathLike, flag: str, *, directory: bool = False) -> Path:
    """Refuse, before any work, an output that cannot be written: a file where a folder is wanted
    (or the reverse), a folder above it that is a file, or one that is not writable. Creates
    nothing. Commands had measured or evaluated for minutes and then failed naming a temporary file.

    ``flag`` names the option in the message (e.g. ``"--out"``); ``directory``: ``path`` is a folder."""
    p = Path(path)
    if directory and p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {str(p)!r} is a file; give a folder")
    if not directory and p.is_dir():
        raise ValueError(f"{flag} {str(p)!r} is a folder; give a file name")
    parent = _nearest_existing(p if directory else p.parent)
    if not parent.is_dir():
        raise ValueError(f"{flag} {str(p)!r}: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(p)!r}: {str(parent)!r} is not writable")
    return p


def _nearest_existing(path: Path) -> Path:
    """``path`` if it exists, else its nearest existing parent (where a new file or folder would go)."""
    return next(p for p in (path, *path.parents) if p.exists())


def to_jsonable(obj):
    """Tensors and arrays → lists, non-finite floats → None (strict JSON has no NaN/Infinity: a
    diverged run's summary.json had held a bare NaN), paths → str."""
    import math

    if hasattr(obj, "tolist") and callable(obj.tolist):  # a tensor or array (torch-free here)
        return to_jsonable(obj.detach().cpu().tolist() if hasattr(obj, "detach") else obj.tolist())
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL file. A last line cut short (the writer killed, or the disk full,
    mid-write; or a run still writing) is dropped; any other bad line is a ValueError naming the file
    and the line."""
    import json

    path = Path(path)
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for n, (i, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i} is not a JSON record ({e})") from None
    return records


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 hex digest of a file's bytes, read a block at a time (checkpoints' manifests, token caches)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def can_create_in(folder: str | os.PathLike) -> bool:
    """Whether files can be made in ``folder``: it is writable, or (missing) its nearest existing
    parent is. For caches that may be shared read-only: reading them needs no write access."""
    p = _nearest_existing(Path(folder))
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


# The words writers use for a full disk or quota: OSError's errno, safetensors' Rust IoError and
# torch.save's PytorchStreamWriter (neither of the last two keeps an errno).
_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_SPACE_WORDS = ("No space left", "StorageFull", "Disk quota exceeded", "File too large", "file write failed")


def out_of_space(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says the disk, a quota or a file size limit
    is full."""
    return any((isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS) or any(w in str(e) for w in _NO_SPACE_WORDS)
               for e in _cause_chain(error))


def _cause_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from (``__cause__``, else ``__context__``), each once."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def no_space_error(error: BaseException, what: str, path: str | os.PathLike) -> OSError:
    """A clear OSError for an ``out_of_space`` error: what was being written, where, and why (a full
    disk with the space left there, a quota, or a file size limit), with the cause's errno (the
    writers' own messages name a temporary file, or no path at all)."""
    chain = list(_cause_chain(error))  # the chain's errnos, and words: safetensors keeps no errno
    codes, text = {getattr(e, "errno", None) for e in chain}, " ".join(str(e) for e in chain)
    if errno.EFBIG in codes or "File too large" in text:
        code, why = errno.EFBIG, "a file size limit (ulimit -f) was reached"
    elif errno.EDQUOT in codes or "quota" in text.lower():
        code, why = errno.EDQUOT, "the disk quota is exceeded"
    else:
        try:
            free = shutil.disk_usage(Path(path) if Path(path).is_dir() else Path(path).parent).free / 2**20
            code, why = errno.ENOSPC, f"no space left on the device ({free:.0f} MiB free there)"
        except OSError:
            code, why = errno.ENOSPC, "no space left on the device"
    return OSError(code, f"{why} writing {what}; nothing partial was left", str(path))


def cache_write_text(path: str | os.PathLike, text: str) -> bool:
    """Write a cache entry atomically if its folder can be written; else warn and return False (the
    caller goes on with what it computed: a read-only shared cache costs time, not the run)."""
    path = Path(path)
    if not can_create_in(path.parent):
        import warnings

        warnings.warn(f"cache folder {str(path.parent)!r} is not writable: {path.name} is not cached", stacklevel=2)
        return False
    atomic_write_text(path, text)
    return True


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success it is moved onto ``final`` with ``os.replace``.

    The temporary file lives in the same directory so the rename is atomic (same filesystem): readers see
    either the old file, nothing, or the complete new file, never a half-written one. If the body raises
    (including ``KeyboardInterrupt``) the temporary file is removed and ``final`` is left untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp creates 0600 files; outputs and caches are ordinary files other users may read.
        os.chmod(tmp_path, 0o644)
        os.replace(tmp_path, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def remove_atomic_leftovers(final: str | os.PathLike) -> None:
    """Remove the temporary files :func:`atomic_path` left beside ``final`` in processes killed before
    their cleanup ran (SIGKILL, the OOM killer, a job's time limit). Only for a caller that alone
    writes ``final`` (under its lock): another writer's file in progress has the same name."""
    final = Path(final)
    for leftover in final.parent.glob(f".{glob.escape(final.name)}.*.tmp"):  # atomic_path's mkstemp names
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()


def atomic_write_bytes(final: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``final`` atomically."""
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(final: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``final`` atomically: UTF-8, ``\\n`` line endings on every platform."""
    atomic_write_bytes(final, text.encode("utf-8"))


def atomic_savefig(fig, final: str | os.PathLike, **kwargs) -> Path:
    """``fig.savefig`` to ``final`` atomically; the format comes from ``final``'s suffix."""
    final = Path(final)
    fmt = final.suffix.lstrip(".").lower() or None
    with atomic_path(final) as tmp:
        fig.savefig(tmp, format=fmt, **kwargs)
    return final


@contextlib.contextmanager
def held_alone(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` for the body, or refuse at once (ValueError naming
    ``what`` and the holder's pid) if another process holds it: for work two processes must not do
    side by side (two training runs in one out_dir). Best effort: where the lock file cannot be made
    (a read-only folder) or there is no ``flock`` (Windows) the body runs unlocked."""
    if sys.platform == "win32":  # pragma: no cover - no flock there
        yield
        return
    import fcntl

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError:
        yield
        return
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            raise ValueError(f"{what} is in use by another process{f' (pid {holder})' if holder else ''}") from None
        try:
            f.truncate(0)
            f.write(str(os.getpid()))
            f.flush()
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, what: str | None = None) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if missing) for the body.

    For check-then-build sections that several processes may enter at once (two runs, or ranks
    outside one process group, building the same cache entry): the second waits, then finds the
    first's result. POSIX ``flock``; where it does not exist (Windows) the body runs unlocked.
    ``what`` names the work in the line printed to stderr while waiting (a silent wait for another
    run's minutes of tokenizing looked like a hang).
    """
    if sys.platform == "win32":  # pragma: no cover - no flock there
        yield
        return
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"transnormer: waiting for another process to finish {what or str(path)!s} (lock {str(path)!r})",
                  file=sys.stderr, flush=True)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
