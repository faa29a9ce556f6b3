"""Checkpoints: written atomically, verified on load, the last N kept.

A checkpoint is a directory ``step-00000100/`` holding
    model.safetensors, config.json (+ generation_config.json)   # HF ``save_pretrained``: loadable as a model
    tokenizer/                                                  # when the run has one
    trainer_state.pt   optimizer, scheduler, RNG states, data position, step, counters
    manifest.json      size and SHA-256 of every file above
It is written into ``.tmp-step-...`` and renamed into place, then ``latest`` (a one-line text
file, itself replaced atomically) points at it. Loading checks the manifest, so a truncated or
corrupt file raises :class:`CheckpointError` naming the file, and
:func:`latest_valid_checkpoint` falls back to the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import torch

from .._files import file_sha256, no_space_error, out_of_space

MANIFEST = "manifest.json"
STATE = "trainer_state.pt"


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or corrupt."""


def rng_state(device: torch.device | None = None) -> dict:
    """The generators a process draws from: Python's, numpy's, torch's CPU one, and the CUDA
    generator of ``device`` when the run is on a GPU (only that one: a state per visible GPU
    could not be restored where fewer are visible, and a CPU run need not touch CUDA at all)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or device is None or device.type != "cuda":
        return
    if isinstance(cuda, (list, tuple)):  # older checkpoints: one state per visible GPU
        index = device.index or 0
        if index >= len(cuda):
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)


def save_checkpoint(root: str | os.PathLike, step: int, model, trainer_state: dict, *, tokenizer=None,
                    keep_last: int = 3, state_dict: dict | None = None) -> Path:
    """Write checkpoint ``root/step-{step:08d}`` atomically and prune to the newest ``keep_last``.

    ``state_dict``: the weights to write, when not ``model``'s own (FSDP: gathered whole)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):  # left by a process killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(".latest-*"):
        stale.unlink(missing_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    tmp.mkdir()
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one line per checkpoint is enough
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        if tokenizer is not None:
            # a causal LM's tokenizer frames HF-side calls (pipelines) as its training text: </s> A
            # (the model itself, not torch.compile's wrapper, which had saved the framing of other models)
            causal = {"causal": True} if type(getattr(model, "_orig_mod", model)).__name__.endswith("ForCausalLM") else {}
            tokenizer.save(tmp / "tokenizer", **causal)  # (other tokenizers, e.g. LRA's vocabularies, take no flag)
        torch.save(trainer_state, tmp / STATE)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        # safetensors writes the weights 0600: teammates could read a checkpoint's config but not load it
        umask = os.umask(0)
        os.umask(umask)
        for p in files:
            os.chmod(p, 0o666 & ~umask)
        manifest = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in files}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1))
        _flush_to_disk(tmp)
        # Overwriting: the old directory is moved aside first and removed only after the new one
        # is in place, so a kill at any instant leaves one complete step-N (the old or the new).
        aside = root / f".old-step-{step:08d}-{_writer_id()}"
        if final.exists():
            os.replace(final, aside)
        os.replace(tmp, final)
        _flush_to_disk(root, recursive=False)  # the rename itself, before anything older is pruned
        shutil.rmtree(aside, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if out_of_space(e):
            raise no_space_error(e, f"checkpoint {final.name} (earlier checkpoints are kept)", root) from e
        raise
    latest_tmp = root / f".latest-{os.getpid()}"
    latest_tmp.write_text(final.name + "\n")
    _flush_to_disk(latest_tmp, recursive=False)
    os.replace(latest_tmp, root / "latest")
    _flush_to_disk(root, recursive=False)
    if keep_last > 0:
        # Keep the one just written and the newest keep_last - 1 before it that verify. A folder
        # named after a later step (a run resumed from an earlier checkpoint, or a corrupt one)
        # is not pruned and does not count: by name alone it could crowd out the new one.
        older = [c for c in list_checkpoints(root) if c.name < final.name]
        keep, drop = [], []
        for c in reversed(older):
            (keep if len(keep) < keep_last - 1 and _verifies(c) else drop).append(c)
        for old in drop:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _flush_to_disk(path: Path, *, recursive: bool = True) -> None:
    """fsync ``path`` (a file, or a folder and, with ``recursive``, everything under it). The renames
    make a checkpoint atomic against a killed process; after a power loss or a node crash the
    kernel may not have written a renamed folder's files yet, and pruning had already removed the
    older checkpoints (with keep_last 1, nothing to fall back to). Folders are skipped where the OS
    cannot open them (Windows)."""
    paths = ([*sorted(path.rglob("*"), reverse=True), path] if recursive and path.is_dir() else [path])
    for p in paths:  # files before the folders that name them
        try:
            fd = os.open(p, os.O_RDONLY)
        except (IsADirectoryError, PermissionError):
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _verifies(path: Path) -> bool:
    # sizes, not hashes: pruning runs at every save, and hashing a large model's older checkpoints
    # each time would cost seconds; a full verification happens where one is loaded
    try:
        verify_checkpoint(path, hashes=False)
        return True
    except CheckpointError:
        return False


ASIDE_STALE_S = 600  # an aside folder this old is a dead writer's, whichever host wrote it


def _writer_id() -> str:
    """pid@host: readers on a shared filesystem can tell this host's writers, whose pid they can
    check, from another host's, whose they cannot ('@' is not in host names)."""
    return f"{os.getpid()}@{socket.gethostname()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _restore_moved_aside(root: Path) -> None:
    """A kill between moving an old step-N aside and renaming the new one in: put the old back.

    Only for a writer that is gone: a live one is between its two renames, and putting its old
    folder back (from an ``eval`` or ``generate`` reading the run meanwhile) made its second rename
    fail and lost the new checkpoint. A writer on another host sharing the filesystem cannot be
    checked by pid: its folder is put back only once it is ``ASIDE_STALE_S`` old (a live writer
    renames the new folder in right after moving the old one aside)."""
    for aside in root.glob(".old-step-*"):
        base, _, host = aside.name[len(".old-"):].partition("@")  # (no host: a folder of older versions)
        name, _, pid = base.rpartition("-")
        final = root / name
        if host and host != socket.gethostname():
            try:
                age = time.time() - aside.stat().st_ctime  # ctime: when it was renamed aside
            except FileNotFoundError:  # its writer finished meanwhile
                continue
            if age < ASIDE_STALE_S:
                continue
        elif pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
            continue
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    _restore_moved_aside(root)
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


ESSENTIAL_FILES = ("model.safetensors", "config.json", STATE)


def verify_checkpoint(path: str | os.PathLike, *, hashes: bool = True) -> dict:
    """Check every file against the manifest; return the manifest or raise CheckpointError.
    ``hashes=False`` checks presence and sizes only (no reading of the files)."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (incomplete write?)")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest {mf} is corrupt: {e}") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(m, dict) and {"size", "sha256"} <= m.keys()
                                              for m in files.values()):
        raise CheckpointError(f"checkpoint manifest {mf} is corrupt: no per-file size and sha256")
    absent = [f for f in ESSENTIAL_FILES if f not in files]
    if absent:
        raise CheckpointError(f"checkpoint {path} lists no {absent} in its manifest (not a training checkpoint)")
    if path.name.startswith("step-") and path.name[5:].isdigit() and manifest.get("step") != int(path.name[5:]):
        raise CheckpointError(f"checkpoint {path} holds step {manifest.get('step')} (copied or renamed?)")
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != meta["size"]:
            raise CheckpointError(f"checkpoint file {f} is truncated or corrupt: {size} bytes, expected {meta['size']}")
        if hashes and file_sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupt: SHA-256 does not match the manifest")
    return manifest


def load_trainer_state(path: str | os.PathLike, *, verify: bool = True, mmap: bool = False) -> dict:
    """Verify checkpoint ``path`` (unless ``verify=False``: a caller that has just verified it) and
    return its trainer state (model weights are loaded separately). ``mmap``: its tensors (the
    optimizer's moments) are mapped, not read, for a caller that reads settings only."""
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    try:
        return torch.load(path / STATE, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise CheckpointError(f"checkpoint file {path / STATE} cannot be read: {e}") from e


def saved_train_configs(model_path: str | os.PathLike) -> list[tuple[dict, str]]:
    """The training configs recorded for a model directory, as ``(config dict, where)``: the one saved
    in the checkpoint itself, then the run's ``train_config.json`` up to three levels above it (a
    checkpoint moved aside by a later run keeps its own); ``[]`` for a bare model directory. Read
    without hashing the checkpoint's files (settings only, from a checkpoint already chosen)."""
    import json

    model_path = Path(model_path)
    found = []
    try:
        found.append((load_trainer_state(model_path, verify=False, mmap=True).get("config") or {}, str(model_path)))
    except (CheckpointError, OSError, ValueError):  # a bare model directory: no trainer state
        pass
    for d in (model_path, *list(model_path.parents)[:3]):
        if (d / "train_config.json").is_file():
            found.append((json.loads((d / "train_config.json").read_text()), str(d)))
            break
    return found


def load_model_weights(model, path: str | os.PathLike) -> None:
    """Load ``model.safetensors`` of a verified checkpoint into ``model`` (strict, ties restored)."""
    from safetensors.torch import load_file

    path = Path(path)
    f = path / "model.safetensors"
    try:
        state = load_file(str(f))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint file {f} cannot be read: {e}") from e
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that differ (another vocabulary or width): its own words, as a ValueError
        raise CheckpointError(f"checkpoint file {f} does not match the model: {e}") from None
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint file {f} does not match the model: missing {missing}, unexpected {unexpected}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def model_tokenizer(model_dir: Path, spec: str | None = None, *, flag: str = "--tokenizer"):
    """The tokenizer of the model in ``model_dir`` (a resolved model directory): its own, in
    ``tokenizer/`` or beside its weights, or ``spec`` (a saved tokenizer or HF name) for a model
    saved without one. Where the model has its own, ``spec`` must be that one (the same fingerprint):
    another tokenizer's ids index other tokens' embeddings, and evaluations and fine-tunes had run
    on with it silently. ``flag`` names ``spec`` in the messages."""
    from ..data.tokenizer import load_tokenizer

    own = _own_tokenizer_dir(model_dir)
    given = tokenizer_from_arg(spec, flag=flag) if spec else None
    if own is None:
        if given is None:
            raise ValueError(f"no tokenizer in {model_dir} (tokenizer/ or tokenizer.json); pass {flag} with the one "
                             "the model was trained with")
        return given
    tok = load_tokenizer(own)
    if given is not None and given.fingerprint != tok.fingerprint:
        raise ValueError(f"{flag} {spec} is not the tokenizer the model in {model_dir} was trained with (saved in "
                         f"{own}): its ids would index other tokens' embeddings; leave {flag} out to use that one")
    return tok


def _own_tokenizer_dir(model_dir: Path) -> Path | None:
    return next((c for c in (model_dir / "tokenizer", model_dir) if (c / "tokenizer.json").is_file()), None)


def tokenizer_from_arg(spec: str | os.PathLike, *, flag: str = "--tokenizer"):
    """A ``--tokenizer`` value: a tokenizer file or folder, a Hugging Face name, or a run, checkpoint
    root or checkpoint folder, which gives the tokenizer saved with its model (such folders had gone on
    to AutoTokenizer, which asked for sentencepiece)."""
    from ..data.tokenizer import load_tokenizer

    path = Path(spec).expanduser()
    if path.is_dir() and not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        try:
            model_dir = resolve_model_dir(path, what=flag)
        except ValueError:
            model_dir = None  # not a model folder: e.g. a sentencepiece-only tokenizer, for AutoTokenizer
        if model_dir is not None:
            own = _own_tokenizer_dir(model_dir)
            if own is None:
                raise ValueError(f"{flag} {str(spec)!r} is a model folder ({model_dir}) saved without a tokenizer; "
                                 "give the tokenizer it was trained with")
            return load_tokenizer(own)
    return load_tokenizer(spec)


def latest_valid_checkpoint(root: str | os.PathLike, log=print) -> Path | None:
    """Newest checkpoint under ``root`` that passes verification (corrupt ones are reported and skipped)."""
    for ckpt in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(ckpt)
            return ckpt
        except CheckpointError as e:
            log(f"warning: skipping {ckpt.name}: {e}")
    return None


def resolve_model_dir(path: str | os.PathLike, *, what: str = "model") -> Path:
    """A model directory, a checkpoint root, or a run directory → the model directory: for the
    last two, the newest checkpoint that verifies (a corrupt one is reported and skipped)."""
    import sys

    path = Path(path)
    for root in (path, path / "checkpoints"):
        # "latest" may be missing after a kill just before it was written: the step folders count
        if (root / "latest").is_file() or list_checkpoints(root):
            ckpt = latest_valid_checkpoint(root, log=lambda msg: print(msg, file=sys.stderr))
            if ckpt is None:
                raise ValueError(f"{what}: no checkpoint under {root} passes verification")
            return ckpt
    if (path / MANIFEST).is_file():  # one checkpoint named directly: verified like the others
        verify_checkpoint(path)
        return path
    if (path / "config.json").is_file():
        return path
    raise ValueError(f"{what}: no model in {path} (expected config.json, or a run/checkpoint directory)")
