"""Uniform LRA API: TASKS, prepare, load_lra, LRADataset and the collate function."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest
import torch

import transnormer.data.lra as lra
from transnormer.data.lra import LRADataset, collate_lra, load_lra, prepare


def test_tasks_registry():
    assert {"listops", "text", "retrieval", "image", "image-fmnist32", "pathfinder", "pathx"} <= set(lra.TASKS)
    t = lra.TASKS
    assert (t["listops"].length, t["listops"].num_classes, t["listops"].pooling) == (2048, 10, "mean")
    assert (t["text"].length, t["retrieval"].length, t["retrieval"].pair) == (4096, 4000, True)
    assert (t["image"].length, t["image"].num_classes) == (1024, 10)
    assert (t["pathfinder"].length, t["pathfinder"].num_classes, t["pathfinder"].pooling) == (1024, 2, "last")
    assert t["pathx"].length == 16384
    assert all(info.pooling in ("mean", "last") for info in t.values())
    assert sum(info.pair for info in t.values()) == 1
    assert lra.task_info("pathfinder32") is t["pathfinder"] and lra.task_info("path-x") is t["pathx"]
    with pytest.raises(ValueError, match="unknown LRA task 'lisops'"):
        lra.task_info("lisops")


def test_prepare_and_load_listops(tmp_path):
    out = prepare("listops", tmp_path, seed=3, n_train=40, n_val=8, n_test=8, min_length=10, max_length=60)
    assert out["status"] == "generated" and out["provenance"] == "synthetic-fixture"
    assert out["dataset_id"].startswith("listops-fixture(gen=v1, seed=3")
    ds = load_lra("listops", tmp_path, "train")
    assert isinstance(ds, LRADataset) and len(ds) == 40
    assert (ds.vocab_size, ds.pad_id, ds.num_classes, ds.pair) == (17, 0, 10, False)
    assert ds.provenance == "synthetic-fixture" and ds.dataset_id == out["dataset_id"]
    item = ds[0]
    assert item["input_ids"].dtype == torch.long and item["input_ids"].dim() == 1
    assert 10 < item["input_ids"].numel() < 60 and isinstance(item["label"], int)
    assert int(item["input_ids"].min()) >= 2  # no pad/unk inside generated data
    loader = torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=ds.collate_fn(pad_to_multiple_of=16))
    batch = next(iter(loader))
    B, T = batch["input_ids"].shape
    assert B == 8 and T % 16 == 0 and batch["attention_mask"].dtype == torch.bool
    lengths = batch["attention_mask"].sum(1)
    for b in range(B):
        n = int(lengths[b])
        assert torch.equal(batch["input_ids"][b, :n], ds[b]["input_ids"])
        assert not batch["attention_mask"][b, n:].any() and (batch["input_ids"][b, n:] == 0).all()
    assert batch["labels"].tolist() == [ds[b]["label"] for b in range(B)]
    short = load_lra("listops", tmp_path / "listops-1000", "test", max_len=5)
    assert max(short[i]["input_ids"].numel() for i in range(len(short))) == 5
    # data our generator wrote never passes as official (lra.md §6.2); another label may be given
    with pytest.raises(ValueError, match="must not share a column with published numbers"):
        load_lra("listops", tmp_path, "val", provenance="official")
    assert load_lra("listops", tmp_path, "val", provenance="stand-in").provenance == "stand-in"


def test_prepare_listops_official_params_small(tmp_path):
    out = prepare("listops", tmp_path, seed=0, n_train=10, n_val=2, n_test=2)
    assert out["provenance"] == "regenerated"
    assert out["dataset_id"] == "listops-regen(gen=v1, seed=0, n=10/2/2)"
    ds = load_lra("listops", tmp_path, "test")
    assert ds.provenance == "regenerated" and len(ds) == 2
    assert all(500 < ds[i]["input_ids"].numel() < 2000 for i in range(2))
    side = json.loads((tmp_path / "listops-1000" / "generation.json").read_text())
    assert side["seed"] == 0 and side["official_parameters"] is True


def test_official_listops_without_sidecar(tmp_path):
    (tmp_path / "basic_test.tsv").write_text("Source\tTarget\n( ( ( [SM 4 ) 9 ) ] )\t3\n")
    ds = load_lra("listops", tmp_path, "test")
    assert ds.provenance == "official" and ds[0]["label"] == 3
    assert ds[0]["input_ids"].tolist() == lra.encode_listops("[SM 4 9 ]".replace("]", "X"))


def test_prepare_and_load_pathfinder(tmp_path):
    out = prepare("pathfinder", tmp_path, seed=1, n_images=20, batch_size=10)
    assert out["dataset_id"] == "pathfinder32-hard-regen(gen=v2, seed=1, n=20)"
    ds = load_lra("pathfinder", tmp_path, "train")
    assert len(ds) == 16 and ds.provenance == "regenerated" and ds.dataset_id == out["dataset_id"]
    assert (ds.vocab_size, ds.num_classes) == (256, 2) and lra.TASKS["pathfinder"].pooling == "last"
    batch = ds.collate_fn()([ds[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, 1024) and batch["attention_mask"].all()
    rnd = load_lra("pathfinder32", tmp_path, "test", split_mode="random", preload=True)
    assert len(rnd) == 2
    with pytest.raises(ValueError, match="n_images"):
        prepare("pathfinder", tmp_path, n_train=16)
    with pytest.raises(ValueError, match="cannot be honoured"):  # all three had been summed and split 80/10/10
        prepare("pathfinder", tmp_path, n_train=2, n_val=4, n_test=4)
    with pytest.raises(TypeError, match="unexpected option"):
        load_lra("pathfinder", tmp_path, "train", gray_rule="tf")


def test_prepare_user_data_tasks(tmp_path):
    for task in ("text", "retrieval", "image"):
        with pytest.raises(lra.UserDataRequired, match="user-provided"):
            prepare(task, tmp_path)
    with pytest.raises(TypeError, match="seed"):
        prepare("listops", tmp_path, seed=1.5)
    with pytest.raises(ValueError, match="root is required"):
        load_lra("text", None, "train")
    with pytest.raises(ValueError, match="provenance"):
        load_lra("listops", tmp_path, "train", provenance="made-up")


def _idx(path, magic, dims, payload):
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">i" + "i" * len(dims), magic, *dims) + payload)


def test_fmnist_stand_in_via_api(tmp_path):
    src = tmp_path / "fm"
    src.mkdir()
    for part, n in (("train", 30), ("test", 10)):
        img, lab = lra.image.FMNIST_FILES[part]
        _idx(src / img, 2051, (n, 28, 28), bytes(range(256)) * (n * 784 // 256) + bytes(n * 784 % 256))
        _idx(src / lab, 2049, (n,), bytes(i % 10 for i in range(n)))
    out = prepare("image-fmnist32", tmp_path / "out", data_dir=src, strict_counts=False)
    assert out["status"] == "stand-in-ready" and out["sidecar"]["counts"] == {"train": 27, "val": 3, "test": 10}
    assert (tmp_path / "out" / "image-fmnist32.json").is_file()
    ds = load_lra("image-fmnist32", src, "val", strict_counts=False)
    assert ds.provenance == "stand-in" and ds.dataset_id == "image-fmnist32 (stand-in)"
    assert len(ds) == 3 and ds[0]["input_ids"].shape == (1024,)


def test_retrieval_pairs_and_text_via_api(tmp_path):
    rows = ["1.0\ta\tb\tb'first doc'\tb'second, longer document'\n", "0.0\tc\td\tb'x'\tplain\n"]
    (tmp_path / "new_aan_pairs.test.tsv").write_text("".join(rows))
    ds = load_lra("retrieval", tmp_path, "test")
    assert ds.pair and ds.provenance == "official" and ds.dataset_id == "retrieval-aan(bytes, L=4000)"
    batch = collate_lra([ds[0], ds[1]], pad_id=ds.pad_id)
    assert set(batch) == {"input_ids", "attention_mask", "input_ids_2", "attention_mask_2", "labels"}
    assert batch["attention_mask"].sum(1).tolist() == [9, 1]
    assert batch["attention_mask_2"].sum(1).tolist() == [23, 5]
    assert batch["labels"].tolist() == [1, 0]
    for part in ("train", "test"):
        for cls in ("pos", "neg"):
            d = tmp_path / "aclImdb" / part / cls
            d.mkdir(parents=True)
            (d / "0_1.txt").write_text(f"{part} {cls} review")
    text = load_lra("text", tmp_path, "val", provenance="stand-in", name="tiny")
    assert text.dataset_id == "text-tiny (stand-in)" and len(text) == 2 and text.vocab_size == 257
    # a name without a provenance was dropped and the data labelled official
    with pytest.raises(ValueError, match="name 'bbc' labels data that is not the official set"):
        load_lra("text", tmp_path, "val", name="bbc")


def test_collate_validation():
    a = {"input_ids": torch.tensor([3, 4, 5]), "label": 1}
    b = {"input_ids": torch.tensor([6]), "label": 0}
    out = collate_lra([a, b], pad_id=0, pad_to=4)
    assert out["input_ids"].tolist() == [[3, 4, 5, 0], [6, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[True, True, True, False], [True, False, False, False]]
    with pytest.raises(ValueError, match="pad_to=2 is shorter"):
        collate_lra([a, b], pad_to=2)
    with pytest.raises(ValueError, match="non-empty"):
        collate_lra([])
    with pytest.raises(TypeError, match=r"batch\[1\]\['input_ids'\]"):
        collate_lra([a, {"input_ids": [1, 2], "label": 0}])
    with pytest.raises(ValueError, match="input_ids_2"):
        collate_lra([a, {**b, "input_ids_2": torch.tensor([1])}])


def test_dataset_validation():
    with pytest.raises(ValueError, match="labels must lie"):
        LRADataset(
            task="x",
            split="train",
            inputs=[np.zeros(3)],
            labels=np.array([5]),
            vocab_size=4,
            pad_id=0,
            num_classes=2,
            provenance="official",
            dataset_id="x",
        )
    ds = LRADataset(
        task="x",
        split="train",
        inputs=[np.arange(3)],
        labels=np.array([1]),
        vocab_size=4,
        pad_id=0,
        num_classes=2,
        provenance="synthetic-fixture",
        dataset_id="x",
    )
    with pytest.raises(IndexError):
        ds[1]
    assert ds[-1]["input_ids"].tolist() == [0, 1, 2] and ds.label_counts().tolist() == [0, 1]


def test_the_fmnist_stand_in_is_never_official(tmp_path):
    # labelled official it had filled Image's place in "LRA average (five tasks, official data)"
    from transnormer.cli_lra import results_table

    with pytest.raises(ValueError, match="image-fmnist32 is a stand-in for LRA's Image task"):
        load_lra("image-fmnist32", tmp_path, "test", provenance="official")
    recs = [{"task": t, "data_provenance": "official", "dataset_id": t, "preset": f"t2-lra-{t}",
             "test": {"accuracy": 0.5}} for t in ("listops", "text", "retrieval", "image-fmnist32", "pathfinder")]
    table = results_table(recs, "test")
    assert "LRA average" not in table and "avg over" in table
