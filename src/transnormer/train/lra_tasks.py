"""Long Range Arena as a training task: ``--task cls --data lra:TASK[:ROOT]``.

    cfg = TrainConfig(task="cls", preset="t2-lra-listops-tiny", data="lra:listops:data/lra", seq_len=2048, ...)
    train(cfg)                                   # the loop calls build_lra_task_data(cfg, info, autocast)

* ``TASK``: an LRA task or alias (``listops``, ``text``, ``retrieval``, ``image``, ``image-fmnist32``,
  ``pathfinder``, ``pathx`` ...; :data:`transnormer.data.lra.TASKS`).
* ``ROOT``: the data folder. Default: ``data/lra`` (the ``transnormer lra prepare`` default output,
  relative to the working directory) for every task except ``image-fmnist32``, whose default is
  ``../shared/data/lra/fashion-mnist`` relative to the working directory, else relative to the repository.
* ``cfg.seq_len`` truncates each sequence (each document for Retrieval), capped at the task
  length; truncation of any example is reported once. ``cfg.cls_read_kwargs`` are passed to
  :func:`~transnormer.data.lra.load_lra` (e.g. ``{"provenance": "stand-in", "name": "bbc"}``,
  ``{"val_from": "train"}``).

Batches are step-indexed (:class:`~transnormer.data.sampler.StepBatchSampler`: batch k is a pure
function of (seed, k), rank-sharded, resumable). ``evaluate(model, split, max_batches)`` returns
loss, accuracy (+ F1, MCC), ``majority_accuracy`` (predicting the train split's most frequent
class) and the data labels ``data_provenance`` / ``dataset_id`` (lra.md §6), so every eval log line
says which data it came from.

Retrieval needs the two-tower model (:mod:`transnormer.models.dual_encoder`). ``TaskData.extra``
carries ``model_factory`` for it, which the training loop and ``transnormer eval`` use.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .distributed import DistInfo
from .evaluate import evaluate_classifier
from .tasks import ClsBatches, TaskData

DEFAULT_ROOT = "data/lra"
VOCAB_FILE = "lra_vocab.json"


# ----------------------------------------------------------------------------------------- spec parsing
def parse_lra_spec(spec: str) -> tuple[str, str | None]:
    """``"lra:TASK[:ROOT]"`` → (canonical task name, ROOT or None)."""
    from ..data.lra import task_info

    if not isinstance(spec, str) or not spec.startswith("lra:"):
        raise ValueError(f"data: an LRA spec looks like 'lra:TASK[:ROOT]', got {spec!r}")
    parts = spec.split(":", 2)
    if len(parts) < 2 or not parts[1]:
        raise ValueError(f"data: {spec!r} names no LRA task; use 'lra:TASK[:ROOT]'")
    task = task_info(parts[1]).name
    root = parts[2] if len(parts) == 3 and parts[2] else None
    return task, root


def default_root(task: str) -> str | None:
    """Where the data of ``task`` is looked for when the spec gives no ROOT (None = the loader's default)."""
    if task == "image-fmnist32":
        from ..data.lra.image import default_fmnist_dir

        return str(default_fmnist_dir())  # the rule `lra prepare` checks with
    return DEFAULT_ROOT


# ----------------------------------------------------------------------------------------- tokenizer stand-in
class LRAVocab:
    """What the loop needs of a tokenizer: ``vocab_size``, ``pad_id`` and ``save(dir)``.

    LRA inputs arrive as token ids (ListOps symbols, bytes, pixel intensities), so there is nothing
    to encode; ``save`` writes ``lra_vocab.json`` with the task, sizes and the data labels.
    """

    def __init__(self, task: str, vocab_size: int, pad_id: int, *, dataset_id: str = "", provenance: str = ""):
        self.task, self.vocab_size, self.pad_id = task, int(vocab_size), int(pad_id)
        self.dataset_id, self.provenance = dataset_id, provenance
        self.bos_id = self.eos_id = self.mask_id = None
        self.special_ids = [self.pad_id]

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / VOCAB_FILE).write_text(json.dumps({
            "task": self.task, "vocab_size": self.vocab_size, "pad_id": self.pad_id,
            "data_provenance": self.provenance, "dataset_id": self.dataset_id}, indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> LRAVocab:
        meta = json.loads((Path(path) / VOCAB_FILE).read_text())
        return cls(meta["task"], meta["vocab_size"], meta["pad_id"], dataset_id=meta.get("dataset_id", ""),
                   provenance=meta.get("data_provenance", ""))

    def __repr__(self) -> str:
        return f"LRAVocab(task={self.task!r}, vocab_size={self.vocab_size}, pad_id={self.pad_id})"


# ----------------------------------------------------------------------------------------- provenance
def provenance_record(ds) -> dict:
    """The lra.md §6 labels of a loaded split: provenance, dataset id, and (when recorded) generator
    version, seed, sample counts and SHA-256 of the data files."""
    rec = {"data_provenance": ds.provenance, "dataset_id": ds.dataset_id, "lra_task": ds.task}
    side = ds.info.get("sidecar") if isinstance(ds.info, dict) else None
    if isinstance(side, dict):
        for k in ("generator", "generator_version", "seed", "counts", "sha256", "config"):
            if k in side:
                rec[k] = side[k]
        if "n_images" in side and "counts" not in side:
            rec["n_images"] = side["n_images"]
    for k in ("dir", "file", "gray_rule", "sha256", "source_dir", "val_from"):
        if isinstance(ds.info, dict) and k in ds.info and k not in rec:
            rec[k] = ds.info[k]
    if "sha256" not in rec:  # lra.md §6.4: hash the files the split was read from, where they are few
        files = _source_files(ds)
        if files:
            from ..data.lra._common import sha256_file

            rec["sha256"] = {f.name: sha256_file(f) for f in files}
    return rec


def _source_files(ds) -> list[Path]:
    info = ds.info if isinstance(ds.info, dict) else {}
    if info.get("file") and Path(info["file"]).is_file():
        return [Path(info["file"])]
    if ds.task == "image-fmnist32" and info.get("dir"):
        from ..data.lra.image import FMNIST_FILES

        return [Path(info["dir"]) / f for pair in FMNIST_FILES.values() for f in pair if (Path(info["dir"]) / f).is_file()]
    if ds.task == "image" and info.get("dir"):
        d = Path(info["dir"])
        return sorted(p for p in d.glob("*_batch*") if p.is_file())
    if ds.task == "listops" and info.get("dir"):  # the split's own TSV (official files carry no sidecar)
        from ..data.lra.listops import SPLIT_FILES

        f = Path(info["dir"]) / SPLIT_FILES[ds.split]
        return [f] if f.is_file() else []
    if ds.task.startswith(("pathfinder", "pathx")) and info.get("dir"):  # the metadata lists, not the PNGs
        return sorted(p for p in (Path(info["dir"]) / "metadata").glob("*.npy") if p.is_file())
    return []  # aclImdb: 50k small files; not hashed


# ----------------------------------------------------------------------------------------- models
def is_pair_task(task: str) -> bool:
    from ..data.lra import task_info

    return task_info(task).pair


def _is_dual_encoder_dir(path: str | os.PathLike) -> bool:
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    archs = json.loads(f.read_text()).get("architectures") or []
    return "TransNormerDualEncoderForSequenceClassification" in archs


def build_lra_model(cfg, vocab_size: int, num_labels: int | None, special_ids: dict, *, pair: bool | None = None):
    """The model for an LRA run: the loop's usual classifier, or the two-tower model for pair tasks."""
    from . import loop

    if pair is None:
        pair = is_pair_task(parse_lra_spec(cfg.data)[0])
    if not pair:
        return loop.build_model_for(cfg, vocab_size, num_labels, special_ids)
    from ..models.dual_encoder import TransNormerDualEncoderForSequenceClassification as Dual

    if cfg.init_from:
        if not _is_dual_encoder_dir(cfg.init_from):
            raise ValueError(f"init_from: {cfg.init_from} is not a two-tower (Retrieval) model; "
                             "the pair task needs TransNormerDualEncoderForSequenceClassification weights")
        return Dual.from_pretrained(cfg.init_from, config=loop.init_config(Path(cfg.init_from), cfg, vocab_size, num_labels))
    return Dual(loop.model_config_for(cfg, vocab_size, num_labels, special_ids))


# ----------------------------------------------------------------------------------------- data
def _seq_lengths(seq) -> np.ndarray | None:
    lengths = getattr(seq, "lengths", None)
    if lengths is not None:
        return np.asarray(lengths)
    if isinstance(seq, np.ndarray) and seq.ndim == 2:
        return np.full(len(seq), seq.shape[1])
    res = getattr(seq, "resolution", None)
    if res is not None:
        return np.full(len(seq), int(res) ** 2)
    return None


def load_split(task: str, root: str | None, split: str, max_len: int | None, options: dict | None = None):
    """:func:`~transnormer.data.lra.load_lra` with this module's root default and truncation rule."""
    from ..data.lra import load_lra, task_info

    info_t = task_info(task)
    root = default_root(task) if root is None else root
    opts = dict(options or {})
    varied = task in ("listops", "text", "retrieval")  # sequences of varying length (the others: images)
    if varied:
        # load at the task's own length (so truncation to a shorter run length can be counted),
        # then truncate per item
        ds = load_lra(task, root, split, **opts)
    else:
        ds = load_lra(task, root, split, max_len=max_len if max_len and max_len < info_t.length else None, **opts)
    if max_len is not None and (ds.max_len is None or ds.max_len > max_len):
        ds.max_len = max_len
    # The result's label says so where the inputs are not the task's: images (one fixed length) are cut
    # by any max_len below it, sequences of varying length only if one is longer (a ListOps run at 2,000
    # reads its expressions whole if none is longer, though the task pads to 2,048).
    if max_len is not None and max_len < info_t.length and (not varied or count_truncated(ds, max_len)):
        ds.dataset_id = f"{ds.dataset_id}, cut to {max_len}"
    return ds


def full_length(seq_len: int | None, task: str) -> bool:
    """Whether ``seq_len`` reaches the task's length (``None``: the task's own). How results written before
    they recorded ``subset`` (and labelled a cut only by their ``dataset_id``) are read."""
    from ..data.lra import task_info

    return seq_len is None or seq_len >= task_info(task).length


def comparable_to_published(result: dict) -> bool:
    """Whether one split's result (:func:`evaluate_split`'s metrics) can stand beside published LRA
    numbers (spec §6): official data, no sequence cut (``dataset_id`` says ", cut to N"), and scored
    over the whole split (a ``--max-batches`` / ``--test-batches`` subset is another sample)."""
    return (result.get("data_provenance") == "official" and ", cut to " not in str(result.get("dataset_id", ""))
            and not result.get("subset", False))


def count_truncated(ds, max_len: int | None) -> int:
    if max_len is None:
        return 0
    n = 0
    for seq in (ds.inputs, ds.inputs_2):
        if seq is None:
            continue
        lengths = _seq_lengths(seq)
        if lengths is not None:
            n += int((lengths > max_len).sum())
    return n


def _labels_of(ds) -> np.ndarray:
    return np.asarray(ds.labels, dtype=np.int64)


def majority_class(ds) -> int:
    """Most frequent label of a split (ties → the smaller class id)."""
    return int(np.bincount(_labels_of(ds), minlength=ds.num_classes).argmax())


def evaluate_split(model, spec: str, split: str = "test", *, max_len: int | None = None, batch_size: int = 32,
                   max_batches: int | None = None, info: DistInfo | None = None, autocast=None,
                   options: dict | None = None) -> tuple[dict, dict]:
    """Evaluate ``model`` on one split of ``spec`` (``lra:TASK[:ROOT]``) without building a training run.

    Returns (metrics with ``data_provenance`` / ``dataset_id`` / ``majority_accuracy`` (train-majority class),
    provenance record of the evaluated split).
    """
    from contextlib import nullcontext

    from ..data.lra import task_info

    task, root = parse_lra_spec(spec)
    info = info or DistInfo()
    autocast = autocast or nullcontext
    max_len = min(max_len, task_info(task).length) if max_len else task_info(task).length
    ds = load_split(task, root, split, max_len, options)
    majority = majority_class(load_split(task, root, "train", max_len, options))
    res = evaluate_classifier(model, ds, ds.collate_fn(), info, batch_size, max_batches, autocast,
                              majority_class=majority)
    rec = {**provenance_record(ds), "root": root if root is not None else default_root(task), "max_len": max_len,
           "truncated": count_truncated(ds, max_len), "n_split": len(ds)}
    return {**res, "data_provenance": ds.provenance, "dataset_id": ds.dataset_id, "eval_split": _split_read(ds),
            "n_split": len(ds), "subset": res["n"] < len(ds), **_split_note(ds)}, rec


def _split_read(ds) -> str:
    """The split whose data ``ds`` holds: Text's official validation split is its test split (a report
    must not choose among runs by it; it had been recorded as "val", and the guard never fired)."""
    val_from = ds.info.get("val_from") if isinstance(ds.info, dict) else None
    return "test" if ds.split == "val" and val_from == "test" else ds.split


def _split_note(ds) -> dict:
    """{"note": ...} where the loader says what a split really is (Text: validation = the test split)."""
    note = ds.info.get("note") if isinstance(ds.info, dict) else None
    return {"note": note} if note else {}


def build_lra_task_data(cfg, info: DistInfo, autocast) -> TaskData:
    """TaskData for ``cfg.data == "lra:TASK[:ROOT]"`` (called by ``tasks.build_task_data``)."""
    from ..data.lra import task_info

    task, root = parse_lra_spec(cfg.data)
    info_t = task_info(task)
    max_len = min(int(cfg.seq_len), info_t.length) if cfg.seq_len else info_t.length
    options = dict(cfg.cls_read_kwargs or {})
    train_ds = load_split(task, root, "train", max_len, options)
    n_trunc = count_truncated(train_ds, max_len)
    if n_trunc and cfg.no_truncate:
        raise ValueError(f"lra:{task}: {n_trunc} training sequence(s) are longer than seq_len={max_len} and "
                         "no_truncate is set (--no-truncate)")
    if n_trunc and info.is_main:
        print(f"lra:{task}: truncating {n_trunc} training sequence(s) to seq_len={max_len} "
              f"(task length {info_t.length}); pass --seq-len {info_t.length} for the full task")
    collate = train_ds.collate_fn()
    counts = np.bincount(_labels_of(train_ds), minlength=info_t.num_classes)
    majority = majority_class(train_ds)
    prov = provenance_record(train_ds)
    splits = {"train": train_ds}

    def get_split(split: str):
        from ..data.lra._common import split_name

        s = split_name(split)
        if s not in splits:
            splits[s] = load_split(task, root, s, max_len, options)
            n = count_truncated(splits[s], max_len)
            if n and cfg.no_truncate:
                raise ValueError(f"lra:{task}: {n} {s} sequence(s) are longer than seq_len={max_len} and "
                                 "no_truncate is set (--no-truncate)")
        return splits[s]

    labels_out = {"data_provenance": train_ds.provenance, "dataset_id": train_ds.dataset_id}

    def evaluate(model, split: str = "val", max_batches: int | None = None) -> dict:
        ds = get_split(split)
        res = evaluate_classifier(model, ds, collate, info, cfg.batch_size, max_batches, autocast,
                                  majority_class=majority)
        return {**res, **labels_out, "eval_split": _split_read(ds), **_split_note(ds)}

    tok = LRAVocab(task, info_t.vocab_size, info_t.pad_id, dataset_id=train_ds.dataset_id,
                   provenance=train_ds.provenance)
    per_item = max_len * (2 if info_t.pair else 1)
    extra = {
        **prov,
        "lra_task": task,
        "root": root if root is not None else default_root(task),
        "max_len": max_len,
        "task_length": info_t.length,
        "truncated_train": n_trunc,
        # what the run's summary records of its training data (summary.json "train_data")
        "train_record": {**prov, "n_train": len(train_ds), "truncated": n_trunc,
                         "label_counts": [int(c) for c in counts]},
        "n_train": len(train_ds),
        "train_label_counts": [int(c) for c in counts],
        "majority_class": majority,
        "pair": info_t.pair,
        "pooling": info_t.pooling,
        "model_factory": build_lra_model,
    }
    return TaskData(tok, ClsBatches(train_ds, collate, cfg.batch_size, info, cfg.seed), evaluate, cfg.batch_size * per_item,
                    num_labels=info_t.num_classes, extra=extra)
