"""Long Range Arena data: generators (ListOps, Pathfinder), loaders for the official formats and
stand-ins, and a uniform dataset API (spec ``lra.md``).

>>> from transnormer.data.lra import prepare, load_lra
>>> prepare("listops", "data/lra", seed=0)                          # doctest: +SKIP
>>> ds = load_lra("listops", "data/lra", "train")                   # doctest: +SKIP
>>> ds.provenance, ds.dataset_id                                    # doctest: +SKIP
('regenerated', 'listops-regen(gen=v1, seed=0)')
>>> loader = torch.utils.data.DataLoader(ds, batch_size=32, collate_fn=ds.collate_fn())  # doctest: +SKIP

Every result computed on this data must carry ``provenance`` and ``dataset_id`` (spec §6).

Names are imported lazily, so generator worker processes (and ``import transnormer.data.lra``)
do not pay for importing torch until the dataset API is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, tuple[str, str]] = {
    # registry / API
    "TASKS": (".registry", "TASKS"),
    "ALIASES": (".registry", "ALIASES"),
    "TaskInfo": (".registry", "TaskInfo"),
    "UserDataRequired": (".registry", "UserDataRequired"),
    "load_lra": (".registry", "load_lra"),
    "prepare": (".registry", "prepare"),
    "task_info": (".registry", "task_info"),
    "LRADataset": (".dataset", "LRADataset"),
    "collate_lra": (".dataset", "collate_lra"),
    "PROVENANCES": ("._common", "PROVENANCES"),
    "SIDECAR_NAME": ("._common", "SIDECAR_NAME"),
    "PackedSequences": ("._common", "PackedSequences"),
    # ListOps
    "ListOpsConfig": (".listops", "ListOpsConfig"),
    "generate_listops": (".listops", "generate_listops"),
    "write_listops": (".listops", "write_listops"),
    "read_listops_tsv": (".listops", "read_listops_tsv"),
    "evaluate": (".listops", "evaluate"),
    "evaluate_tokens": (".listops", "evaluate_tokens"),
    "serialize": (".listops", "serialize"),
    "tokenize": (".listops", "tokenize"),
    "encode_listops": (".listops", "encode"),
    # Pathfinder
    "PathfinderConfig": (".pathfinder", "PathfinderConfig"),
    "PathfinderGeometry": (".pathfinder", "PathfinderGeometry"),
    "pathfinder_config": (".pathfinder", "pathfinder_config"),
    "sample_geometry": (".pathfinder", "sample_geometry"),
    "generate_image": (".pathfinder", "generate_image"),
    "write_pathfinder": (".pathfinder", "write_pathfinder"),
    "read_metadata": (".pathfinder", "read_metadata"),
    "load_pathfinder_split": (".pathfinder", "load_pathfinder_split"),
    # Text / Retrieval / Image
    "read_imdb_folder": (".text", "read_imdb_folder"),
    "load_text_split": (".text", "load_text_split"),
    "read_aan_tsv": (".retrieval", "read_aan_tsv"),
    "load_retrieval_split": (".retrieval", "load_retrieval_split"),
    "load_cifar_split": (".image", "load_cifar_split"),
    "load_fmnist_split": (".image", "load_fmnist_split"),
    "read_idx_images": (".image", "read_idx_images"),
    "read_idx_labels": (".image", "read_idx_labels"),
    "rgb_to_gray": (".image", "rgb_to_gray"),
    "default_fmnist_dir": (".image", "default_fmnist_dir"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover
    from ._common import PROVENANCES, SIDECAR_NAME, PackedSequences  # noqa: F401
    from .dataset import LRADataset, collate_lra  # noqa: F401
    from .image import (  # noqa: F401
        default_fmnist_dir,
        load_cifar_split,
        load_fmnist_split,
        read_idx_images,
        read_idx_labels,
        rgb_to_gray,
    )
    from .listops import (  # noqa: F401
        ListOpsConfig,
        evaluate,
        evaluate_tokens,
        generate_listops,
        read_listops_tsv,
        serialize,
        tokenize,
        write_listops,
    )
    from .listops import encode as encode_listops  # noqa: F401
    from .pathfinder import (  # noqa: F401
        PathfinderConfig,
        PathfinderGeometry,
        generate_image,
        load_pathfinder_split,
        pathfinder_config,
        read_metadata,
        sample_geometry,
        write_pathfinder,
    )
    from .registry import ALIASES, TASKS, TaskInfo, UserDataRequired, load_lra, prepare, task_info  # noqa: F401
    from .retrieval import load_retrieval_split, read_aan_tsv  # noqa: F401
    from .text import load_text_split, read_imdb_folder  # noqa: F401
