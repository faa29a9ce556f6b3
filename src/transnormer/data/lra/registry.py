"""Task registry, :func:`load_lra` and :func:`prepare` for the LRA tasks (spec lra.md §1, §5, §6)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import image as _image
from . import listops as _listops
from . import pathfinder as _pf
from . import retrieval as _retrieval
from . import text as _text
from ._common import (
    GENERATING,
    SIDECAR_NAME,
    as_dir,
    check_int,
    check_optional_max_len,
    check_provenance,
    check_seed,
    sha256_file,
    split_name,
    write_json,
)
from .dataset import LRADataset


@dataclass(frozen=True)
class TaskInfo:
    """Per-task metadata.

    ``length``: model sequence length (per document for pair tasks); ``pooling``: ``"mean"`` or
    ``"last"`` (last *valid* token); ``pair``: two documents per item (Retrieval);
    ``source``: ``"generated"`` (by :func:`prepare`), ``"user"`` (user-provided files) or
    ``"stand-in"`` (provided next to the repository).
    """

    name: str
    length: int
    num_classes: int
    pooling: str
    pair: bool
    vocab_size: int
    pad_id: int
    source: str
    description: str


TASKS: dict[str, TaskInfo] = {
    "listops": TaskInfo(
        "listops",
        2048,
        10,
        "mean",
        False,
        _listops.VOCAB_SIZE,
        _listops.PAD_ID,
        "generated",
        "ListOps expressions (≤ 1999 tokens, padded to 2048 in the authors' runs)",
    ),
    "text": TaskInfo(
        "text", 4096, 2, "mean", False, _text.VOCAB_SIZE, _text.PAD_ID, "user", "IMDB sentiment, bytes (aclImdb layout)"
    ),
    "retrieval": TaskInfo(
        "retrieval",
        4000,
        2,
        "mean",
        True,
        _retrieval.VOCAB_SIZE,
        _retrieval.PAD_ID,
        "user",
        "AAN citation pairs, bytes, 4000 per document",
    ),
    "image": TaskInfo(
        "image", 1024, 10, "mean", False, _image.VOCAB_SIZE, 0, "user", "CIFAR-10 greyscale 32x32 (cifar-10-batches-py)"
    ),
    "image-fmnist32": TaskInfo(
        "image-fmnist32",
        1024,
        10,
        "mean",
        False,
        _image.VOCAB_SIZE,
        0,
        "stand-in",
        "Fashion-MNIST padded to 32x32 (stand-in for Image)",
    ),
    "pathfinder": TaskInfo(
        "pathfinder", 1024, 2, "last", False, _pf.VOCAB_SIZE, 0, "generated", "Pathfinder 32x32, curv_contour_length_14"
    ),
    "pathfinder64": TaskInfo(
        "pathfinder64",
        4096,
        2,
        "last",
        False,
        _pf.VOCAB_SIZE,
        0,
        "generated",
        "Pathfinder 64x64, curv_contour_length_14 (parameters interpolated [I])",
    ),
    "pathx": TaskInfo(
        "pathx",
        16384,
        2,
        "last",
        False,
        _pf.VOCAB_SIZE,
        0,
        "generated",
        "Path-X: Pathfinder 128x128, curv_contour_length_14 (pooling not given by the authors; last as Pathfinder [D])",
    ),
}
"""Registry of LRA tasks. Image/Pathfinder ``pad_id`` 0 is also intensity 0: those inputs have a
fixed length, so padding never occurs (the attention mask is all True)."""

ALIASES = {
    "pathfinder32": "pathfinder",
    "path-x": "pathx",
    "pathx128": "pathx",
    "pathfinder128": "pathx",
    "fmnist": "image-fmnist32",
    "cifar10": "image",
    "imdb": "text",
    "aan": "retrieval",
}
_PF_RESOLUTION = {"pathfinder": 32, "pathfinder64": 64, "pathx": 128}


class UserDataRequired(RuntimeError):
    """Raised by :func:`prepare` for tasks whose data cannot be generated offline."""


def task_info(task: str) -> TaskInfo:
    """Registry entry for ``task`` (aliases such as ``pathfinder32`` or ``path-x`` accepted)."""
    if not isinstance(task, str):
        raise TypeError(f"task must be a str, got {type(task).__name__}")
    name = ALIASES.get(task, task)
    if name not in TASKS:
        raise ValueError(f"unknown LRA task {task!r}; known: {sorted(TASKS)} (aliases: {sorted(ALIASES)})")
    return TASKS[name]


def _read_sidecar(folder: Path, generator: str) -> dict | None:
    if (folder / GENERATING).is_file():  # without its sidecar it would read as the official files
        raise ValueError(f"{folder}: an interrupted generation (its {GENERATING} marker is there); run "
                         "`transnormer lra prepare` again")
    p = folder / SIDECAR_NAME
    if not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: invalid JSON ({e})") from None
    return meta if isinstance(meta, dict) and meta.get("generator") == generator else None


def _verify_sidecar(folder: Path, meta: dict, files: dict[str, str], *, split: str | None = None,
                    rows: int | None = None) -> None:
    """The generator's record must describe the files being read (lra.md §6.4): each of ``files``
    ({path relative to ``folder``: its sha256 in the record}) that exists is hashed and compared,
    and ``rows`` against the split's recorded count. A file edited or replaced after generation
    raises instead of being reported with the record's label, counts and hashes."""
    for rel, want in files.items():
        f = folder / rel
        if isinstance(want, str) and f.is_file() and sha256_file(f) != want:
            raise ValueError(f"{f} is not the file the generator wrote (its SHA-256 differs from {SIDECAR_NAME}); "
                             f"regenerate it with `transnormer lra prepare`, or remove {folder / SIDECAR_NAME} and "
                             "label the data with provenance=...")
    counts = meta.get("counts")
    if rows is not None and isinstance(counts, dict) and split in counts and counts[split] != rows:
        raise ValueError(f"{folder}: the {split} split has {rows} rows but {SIDECAR_NAME} records {counts[split]}")


def _check_override(provenance: str | None, meta: dict | None, task: str) -> None:
    """Files our generator wrote (their generation.json matched) are never official (lra.md §6.2):
    an override may only make them a stand-in or fixture."""
    if meta is not None and provenance == "official":
        raise ValueError(f"provenance='official' for {task} data our generator wrote (its {SIDECAR_NAME} was verified, "
                         f"seed {meta.get('seed')}): regenerated data must not share a column with published numbers")


def _unlabelled_id(task: str, default: str, provenance: str, name: str | None) -> str:
    if provenance == "stand-in":
        return f"{task}-{name or 'custom'} (stand-in)"
    if provenance == "synthetic-fixture":
        return f"{task}-{name or 'fixture'} (synthetic-fixture)"
    if provenance == "regenerated":
        return f"{task}-{name or 'regen'} (regenerated)"
    return default


def load_lra(
    task: str,
    root: str | os.PathLike | None = None,
    split: str = "train",
    *,
    max_len: int | None = None,
    provenance: str | None = None,
    name: str | None = None,
    **options: Any,
) -> LRADataset:
    """Load one split of an LRA task as an :class:`LRADataset`.

    ``root`` is the data folder: the LRA release folder (containing ``listops-1000/``,
    ``pathfinder32/``, ``tsv_data/``), or the task folder itself, or a folder containing
    ``aclImdb`` / ``cifar-10-batches-py``; for ``image-fmnist32`` it defaults to the shared stand-in
    folder. ``split``: ``train`` | ``val`` | ``test``. ``max_len`` truncates each sequence (default:
    the task length; ListOps is never truncated by default).

    ``provenance`` overrides the detected provenance (e.g. ``"stand-in"`` for a non-IMDB corpus in
    the aclImdb layout; ``name`` then names it: ``text-<name> (stand-in)``). Without it: files with
    our ``generation.json`` are ``regenerated`` (or ``synthetic-fixture`` for non-official
    generator parameters), Fashion-MNIST is ``stand-in``, anything else is assumed ``official``.

    Task options: ``text``: ``val_from`` (``"test"`` official / ``"train"``), ``val_fraction``,
    ``val_seed``; ``image``: ``gray_rule`` (``"tf"`` / ``"round"``); ``image-fmnist32``:
    ``strict_counts``; Pathfinder tasks: ``difficulty``, ``split_mode`` (``"position"`` /
    ``"random"``), ``split_seed`` (42), ``preload``.
    """
    info_t = task_info(task)
    t = info_t.name
    split = split_name(split)
    max_len = check_optional_max_len(max_len)
    if provenance is not None:
        check_provenance(provenance)
    if name is not None and provenance in (None, "official"):
        # the name labels other data; without a provenance it was dropped and the data called official
        raise ValueError(f"name {name!r} labels data that is not the official set: give it with provenance "
                         "('stand-in', 'synthetic-fixture' or 'regenerated')")
    if root is None and t != "image-fmnist32":
        raise ValueError(f"root is required for task {t!r} (the folder with its data files)")

    def take(allowed: tuple[str, ...]) -> dict:
        extra = set(options) - set(allowed)
        if extra:
            raise TypeError(f"unexpected option(s) for task {t!r}: {sorted(extra)}; allowed: {list(allowed)}")
        return options

    common = {
        "task": t,
        "split": split,
        "vocab_size": info_t.vocab_size,
        "pad_id": info_t.pad_id,
        "num_classes": info_t.num_classes,
    }
    if t == "listops":
        take(())
        ids, labels, folder = _listops.load_listops_split(root, split, max_len=max_len)
        meta = _read_sidecar(folder, "transnormer.data.lra.listops")
        if meta is not None:
            name_ = _listops.SPLIT_FILES[split]
            _verify_sidecar(folder, meta, {name_: (meta.get("sha256") or {}).get(name_)}, split=split,
                            rows=len(labels))
            cfg = _listops.read_sidecar_config(meta)
            prov = "regenerated" if cfg.is_official() else "synthetic-fixture"
            did = meta.get("dataset_id") or _listops.listops_dataset_id(int(meta["seed"]), cfg)
        else:
            prov, did = "official", "listops (official LRA files)"
        _check_override(provenance, meta, t)
        if provenance is not None and provenance != prov:
            prov, did = provenance, _unlabelled_id(t, did, provenance, name)
        return LRADataset(
            inputs=ids,
            labels=labels,
            provenance=prov,
            dataset_id=did,
            max_len=max_len,
            info={"dir": str(folder), "sidecar": meta},
            **common,
        )
    if t == "text":
        opts = take(("val_from", "val_fraction", "val_seed"))
        L = max_len or info_t.length
        ids, labels, info = _text.load_text_split(root, split, max_len=L, **opts)
        prov = provenance or "official"
        did = _unlabelled_id(t, f"text-imdb(bytes, L={L})", prov, name)
        return LRADataset(inputs=ids, labels=labels, provenance=prov, dataset_id=did, max_len=L, info=info, **common)
    if t == "retrieval":
        take(())
        L = max_len or info_t.length
        d1, d2, labels, info = _retrieval.load_retrieval_split(root, split, max_len=L)
        prov = provenance or "official"
        did = _unlabelled_id(t, f"retrieval-aan(bytes, L={L})", prov, name)
        return LRADataset(
            inputs=d1, inputs_2=d2, labels=labels, provenance=prov, dataset_id=did, max_len=L, info=info, **common
        )
    if t == "image":
        opts = take(("gray_rule",))
        rule = opts.get("gray_rule", "tf")
        x, labels = _image.load_cifar_split(root, split, gray_rule=rule)
        cifar_dir = str(_image.find_cifar_dir(root))  # its files' SHA-256 go into the results (lra.md §6.4)
        prov = provenance or "official"
        did = _unlabelled_id(t, f"image-cifar10-gray(rule={rule})", prov, name)
        return LRADataset(
            inputs=x,
            labels=labels,
            provenance=prov,
            dataset_id=did,
            max_len=max_len,
            info={"gray_rule": rule, "dir": cifar_dir},
            **common,
        )
    if t == "image-fmnist32":
        if provenance == "official":  # it is not LRA's Image (CIFAR-10): it had counted in the LRA average
            raise ValueError("provenance: image-fmnist32 is a stand-in for LRA's Image task (lra.md §5), not its "
                             "official data; label it 'stand-in' (the default) or another name")
        opts = take(("strict_counts",))
        x, labels, info = _image.load_fmnist_split(root, split, **opts)
        prov = provenance or "stand-in"
        did = "image-fmnist32 (stand-in)" if prov == "stand-in" else _unlabelled_id(t, "image-fmnist32", prov, name)
        return LRADataset(
            inputs=x, labels=labels, provenance=prov, dataset_id=did, max_len=max_len, info=info, **common
        )
    # Pathfinder family
    opts = dict(take(("difficulty", "split_mode", "split_seed", "preload")))
    res = _PF_RESOLUTION[t]
    named = opts.pop("difficulty", None)
    difficulty = _pf.DIFFICULTIES.get(named or "hard", named or "hard")
    if difficulty not in _pf.CONTOUR_LENGTHS:  # (it had been a missing-folder error naming a path)
        raise ValueError(f"difficulty must be one of {sorted(_pf.DIFFICULTIES)} or {sorted(_pf.CONTOUR_LENGTHS)}, "
                         f"got {named!r}")
    if "split_seed" in opts:
        opts["split_seed"] = check_int("split_seed", opts["split_seed"], minimum=0)
    images, labels, info = _pf.load_pathfinder_split(root, split, resolution=res, difficulty=difficulty, **opts)
    read = Path(info["dir"]).name
    if read in _pf.CONTOUR_LENGTHS and read != difficulty:
        # root was the difficulty folder itself (the CLI's way to another level): its label is that
        # folder's, not the default's (an easy set had been labelled the hard LRA one)
        if named is not None:
            raise ValueError(f"root {str(root)!r} is the {read} folder, but difficulty {named!r} was asked for")
        difficulty = read
    meta = _read_sidecar(Path(info["dir"]), "transnormer.data.lra.pathfinder")
    if meta is not None:  # the per-batch metadata files are small; the PNGs' digests are not re-derived
        listed = (meta.get("sha256") or {}).get("metadata") or {}
        found = {f"metadata/{p.name}" for p in (Path(info["dir"]) / "metadata").glob("*.npy")}
        if found - set(listed):  # an earlier, larger generation left batches behind: read, they would mix in
            raise ValueError(f"{info['dir']}: metadata files {sorted(found - set(listed))[:5]} are not in its "
                             f"{SIDECAR_NAME}; they come from another generation. Regenerate into an empty folder")
        if set(listed) - found:  # a batch lost since: the rest would be read under the record's label and id
            raise ValueError(f"{info['dir']}: metadata files {sorted(set(listed) - found)[:5]} listed in its "
                             f"{SIDECAR_NAME} are missing; regenerate with `transnormer lra prepare`")
        _verify_sidecar(Path(info["dir"]), meta, listed)
        # our generator writes no empty image (the official set's one empty PNG is its own quirk), so
        # every recorded image must be read: a short count would also move images between the splits
        want = meta.get("n_images")
        if isinstance(want, int) and (info["skipped_empty"] or info["n_total"] != want):
            raise ValueError(f"{info['dir']}: {info['n_total']} readable images ({info['skipped_empty']} empty) where "
                             f"its {SIDECAR_NAME} records {want}; regenerate with `transnormer lra prepare`")
        # regenerated only from the official generator's parameters (ListOps likewise); our 64-pixel
        # interpolation or changed parameters are a fixture of their own
        official = _pf.official_parameters(meta["config"]) if isinstance(meta.get("config"), dict) else False
        prov, did = ("regenerated" if official else "synthetic-fixture"), meta.get("dataset_id", f"pathfinder{res}-regen")
    else:
        prov, did = "official", f"{'pathx128' if res == 128 else f'pathfinder{res}'}-{difficulty} (official LRA files)"
    _check_override(provenance, meta, t)
    if provenance is not None and provenance != prov:
        prov, did = provenance, _unlabelled_id(t, did, provenance, name)
    info["sidecar"] = meta
    return LRADataset(
        inputs=images, labels=labels, provenance=prov, dataset_id=did, max_len=max_len, info=info, **common
    )


_USER_DATA_HELP = {
    "text": "Text needs user-provided data: the IMDB reviews in the aclImdb layout "
    "(<root>/aclImdb/{train,test}/{pos,neg}/*.txt), or a stand-in corpus in the same layout loaded with "
    "provenance='stand-in'.",
    "retrieval": "Retrieval needs user-provided data: the AAN pair files new_aan_pairs.{train,eval,test}.tsv from the "
    "LRA release (lra_release/tsv_data/), placed in <root> or <root>/tsv_data.",
    "image": "Image needs user-provided data: CIFAR-10 python batches (cifar-10-batches-py/data_batch_1..5, "
    "test_batch) in <root>; offline, use the image-fmnist32 stand-in instead.",
}


def prepare(
    task: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    n_train: int | None = None,
    n_val: int | None = None,
    n_test: int | None = None,
    workers: int = 1,
    **options: Any,
) -> dict:
    """Create (or check) the data of ``task`` under ``out_dir`` and return a summary dict.

    * ``listops``: writes ``out_dir/listops-1000/basic_{train,val,test}.tsv`` + ``generation.json``
      (defaults 96,000 / 2,000 / 2,000; ``n_*`` override; options: ``ListOpsConfig`` fields such as
      ``min_length``/``max_length`` for fixtures).
    * ``pathfinder`` / ``pathfinder64`` / ``pathx``: writes ``out_dir/pathfinder<R>/<difficulty>/``
      (default 200,000 images; split 80/10/10 at load time; ``n_images=`` sets the total, the
      ``n_*`` split sizes are refused; options: ``difficulty``, ``batch_size`` and other ``PathfinderConfig`` fields).
    * ``image-fmnist32``: validates the stand-in files (``data_dir=`` or the default folder) and
      writes ``out_dir/image-fmnist32.json`` with their SHA-256.
    * ``text``, ``retrieval``, ``image``: raise :class:`UserDataRequired` explaining what to provide.

    Returned keys: ``task``, ``status`` (``"generated"`` / ``"stand-in-ready"``), ``path``,
    ``dataset_id``, ``provenance``, ``sidecar`` (the written JSON dict).
    """
    t = task_info(task).name
    seed = check_seed(seed)
    workers = check_int("workers", workers, minimum=1)
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"out_dir must be a str or os.PathLike path, got {type(out_dir).__name__}")
    out = Path(out_dir)
    for nm, v in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
        if v is not None:
            check_int(nm, v, minimum=1)  # 0 had written an empty split, which training then read
    if t in _USER_DATA_HELP:
        raise UserDataRequired(_USER_DATA_HELP[t])
    if t == "listops":
        cfg = _listops.ListOpsConfig()
        over = {k: v for k, v in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)) if v is not None}
        try:
            cfg = replace(cfg, **over, **options)
        except TypeError as e:
            raise TypeError(f"bad ListOps option: {e}") from None
        dest = out / "listops-1000"
        meta = _listops.write_listops(dest, seed=seed, config=cfg, workers=workers)
        prov = "regenerated" if cfg.is_official() else "synthetic-fixture"
        return {
            "task": t,
            "status": "generated",
            "path": str(dest),
            "dataset_id": meta["dataset_id"],
            "provenance": prov,
            "sidecar": meta,
        }
    if t == "image-fmnist32":
        extra = set(options) - {"data_dir", "strict_counts"}
        if extra:
            raise TypeError(f"unexpected option(s) for image-fmnist32: {sorted(extra)}")
        data_dir = options.get("data_dir")
        src = as_dir("data_dir", _image.default_fmnist_dir() if data_dir is None else data_dir)
        strict = options.get("strict_counts", True)
        n_file = {}
        for part, (img_name, lab_name) in _image.FMNIST_FILES.items():
            expected = _image.FMNIST_COUNTS[part] if strict else None
            n_img = len(_image.read_idx_images(src / img_name, expected_count=expected))
            n_lab = len(_image.read_idx_labels(src / lab_name, expected_count=expected))
            if n_img != n_lab:
                raise ValueError(f"{src}: {img_name} has {n_img} images but {lab_name} has {n_lab} labels")
            n_file[part] = n_img
        counts = {
            "train": n_file["train"] - n_file["train"] // 10,
            "val": n_file["train"] // 10,
            "test": n_file["test"],
        }
        files = [f for pair in _image.FMNIST_FILES.values() for f in pair]
        meta = {
            "task": t,
            "source_dir": str(src.resolve()),
            "provenance": "stand-in",
            "dataset_id": "image-fmnist32 (stand-in)",
            "counts": counts,
            "sha256": {f: sha256_file(src / f) for f in files},
            "rule": "pad 2 zero px per side to 32x32, row-major; train = first 54,000, val = last 6,000 of train file",
        }
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "image-fmnist32.json", meta)
        return {
            "task": t,
            "status": "stand-in-ready",
            "path": str(src),
            "dataset_id": meta["dataset_id"],
            "provenance": "stand-in",
            "sidecar": meta,
        }
    # Pathfinder family
    res = _PF_RESOLUTION[t]
    opts = dict(options)
    difficulty = opts.pop("difficulty", "hard")
    n_images = opts.pop("n_images", None)
    if any(v is not None for v in (n_train, n_val, n_test)):  # three sizes it would not keep
        raise ValueError(
            "Pathfinder: pass n_images (n_train/n_val/n_test cannot be honoured: the loader splits the "
            "images 80/10/10 by position, as the official data is split)"
        )
    if n_images is not None:
        # 80/10/10 at load time: under 10 images the validation split is empty (evaluation gave NaN)
        opts["n_images"] = check_int("n_images", n_images, minimum=10)
    try:
        cfg = _pf.pathfinder_config(res, difficulty, **opts)
    except TypeError as e:
        raise TypeError(f"bad Pathfinder option: {e}") from None
    meta = _pf.write_pathfinder(out, seed=seed, config=cfg, workers=workers)
    return {
        "task": t,
        "status": "generated",
        "path": str(_pf.dataset_dir(out, cfg)),
        "dataset_id": meta["dataset_id"],
        "provenance": "regenerated" if meta["official_parameters"] else "synthetic-fixture",
        "sidecar": meta,
    }
