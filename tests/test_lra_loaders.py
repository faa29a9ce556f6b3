"""Loaders for the official/offline formats on small synthetic files (spec lra.md §2, §5)."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from transnormer.data.lra import image as im
from transnormer.data.lra import retrieval as rt
from transnormer.data.lra import text as tx

# ----------------------------------------------------------------------------- aclImdb


def _imdb(root: Path) -> Path:
    base = root / "aclImdb"
    docs = {
        ("train", "pos"): ["great film", "loved it <br /> a lot", "x" * 5000],
        ("train", "neg"): ["awful", "naïve plot"],
        ("test", "pos"): ["fine"],
        ("test", "neg"): ["bad", "worse", "worst"],
    }
    for (part, cls), texts in docs.items():
        d = base / part / cls
        d.mkdir(parents=True)
        for i, t in enumerate(texts):
            (d / f"{10 - i}_{7 if cls == 'pos' else 2}.txt").write_text(t, encoding="utf-8")
    (base / "train" / "unsup").mkdir()
    (base / "train" / "unsup" / "0_0.txt").write_text("ignored")
    return base


def test_imdb_layout(tmp_path):
    _imdb(tmp_path)
    ids, labels, info = tx.load_text_split(tmp_path, "train", max_len=4096)
    assert labels.tolist() == [0, 0, 1, 1, 1]  # neg first, unsup ignored
    # natural order of names inside a class: 9_2.txt before 10_2.txt
    assert tx.decode_ids(ids[0]) == "naïve plot".encode()
    assert ids[0].dtype == np.int64 and ids[0].min() >= 1  # id = byte + 1, 0 is padding
    assert tx.decode_ids(ids[2]) == b"x" * 4096  # truncated to L
    assert tx.decode_ids(ids[3]) == b"loved it <br /> a lot" and tx.decode_ids(ids[4]) == b"great film"
    val, vlab, vinfo = tx.load_text_split(tmp_path, "val")
    assert len(val) == 4 and "test split" in vinfo["note"]
    tr, trl, _ = tx.load_text_split(tmp_path / "aclImdb", "train", val_from="train", val_fraction=0.2)
    va, val_l, _ = tx.load_text_split(tmp_path, "val", val_from="train", val_fraction=0.2)
    assert len(tr) + len(va) == 5 and len(va) == 1
    assert tx.encode_bytes(b"ab").tolist() == [98, 99]


@pytest.mark.parametrize("max_len", [0, -1, 2.5])
def test_byte_readers_refuse_a_max_len_that_is_not_positive(tmp_path, max_len):
    # 0 had meant no limit and -1 had cut the last byte off, in the readers called directly
    _imdb(tmp_path)
    p = tmp_path / "pairs.tsv"
    p.write_text("1\ta\tb\tabc\tdef\n", encoding="utf-8")
    for call in (lambda: tx.encode_bytes(b"abc", max_len),
                 lambda: tx.read_imdb_folder(tmp_path / "aclImdb", "test", max_len=max_len),
                 lambda: rt.read_aan_tsv(p, max_len=max_len)):
        with pytest.raises((ValueError, TypeError), match="max_len"):
            call()


def test_imdb_errors(tmp_path):
    base = _imdb(tmp_path)
    (base / "test" / "neg" / "99_1.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(ValueError, match="99_1.txt: not valid UTF-8"):
        tx.load_text_split(tmp_path, "test")
    with pytest.raises(FileNotFoundError, match="aclImdb"):
        tx.find_imdb_dir(tmp_path / "aclImdb" / "train" / "pos")
    with pytest.raises(ValueError, match="val_from"):
        tx.load_text_split(tmp_path, "val", val_from="dev")
    with pytest.raises(ValueError, match="split"):
        tx.load_text_split(tmp_path, "unsup")


# ----------------------------------------------------------------------------- AAN TSV


def _aan_line(label, t1, t2):
    return f"{label}\tid_a\tid_b\t{t1}\t{t2}\n"


def test_aan_tsv(tmp_path):
    lines = [
        _aan_line("1.0", repr(b"Title\\n with a tab \t escaped \xc3\xa9 and 'quotes'"), "plain text"),
        _aan_line("0.0", 'b"double \\" quoted"', repr(b"y" * 5000)),
        _aan_line("1", "b''", "naïve"),
    ]
    p = tmp_path / "new_aan_pairs.train.tsv"
    p.write_text("".join(lines), encoding="utf-8")
    d1, d2, labels, ids = rt.read_aan_tsv(p, max_len=4000)
    assert labels.tolist() == [1, 0, 1]
    assert ids[0] == ("id_a", "id_b")
    assert tx.decode_ids(d1[0]) == b"Title\\n with a tab \t escaped \xc3\xa9 and 'quotes'"
    assert tx.decode_ids(d2[0]) == b"plain text"
    assert tx.decode_ids(d1[1]) == b'double " quoted'
    assert len(d2[1]) == 4000  # each document truncated independently
    assert len(d1[2]) == 0 and tx.decode_ids(d2[2]) == "naïve".encode()
    # the tsv_data sub-folder of the release is found; "val" reads the .eval file
    (tmp_path / "tsv_data").mkdir()
    os.replace(p, tmp_path / "tsv_data" / "new_aan_pairs.eval.tsv")
    a, b, lab, info = rt.load_retrieval_split(tmp_path, "val", max_len=10)
    assert len(a) == 3 and max(len(a[i]) for i in range(3)) <= 10 and info["file"].endswith("eval.tsv")


@pytest.mark.parametrize(
    "line, match",
    [
        (_aan_line("2.0", "a", "b"), r"x\.tsv:2: label must be 0 or 1"),
        (_aan_line("yes", "a", "b"), r"x\.tsv:2: label must be 0 or 1"),
        ("1.0\tid\tb'a'\tb'b'\n", r"x\.tsv:2: expected 5 tab-separated fields"),
        (_aan_line("1.0", "b'abc' + b'd'", "b"), r"x\.tsv:2: text1: malformed bytes literal"),
        (_aan_line("1.0", "a", "b'\\x'"), r"x\.tsv:2: text2: malformed bytes literal"),
        (_aan_line("1.0", "a", "b'__import__(\"os\")'"), None),  # stays a literal: harmless bytes
    ],
)
def test_aan_errors(tmp_path, line, match):
    p = tmp_path / "x.tsv"
    p.write_text(_aan_line("0.0", "ok", "ok") + line)
    if match is None:
        d1, d2, labels, _ = rt.read_aan_tsv(p)
        assert tx.decode_ids(d2[1]) == b'__import__("os")'
        return
    with pytest.raises(ValueError, match=match):
        rt.read_aan_tsv(p)


# ----------------------------------------------------------------------------- CIFAR-10


def _cifar(root: Path, n_per_batch=10, seed=0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    d = root / "cifar-10-batches-py"
    d.mkdir()
    all_x, all_y = [], []
    for name in (*im.CIFAR_TRAIN_FILES, im.CIFAR_TEST_FILE):
        x = rng.integers(0, 256, size=(n_per_batch, 3072), dtype=np.uint8)
        y = rng.integers(0, 10, size=n_per_batch).tolist()
        with open(d / name, "wb") as f:
            pickle.dump(
                {b"batch_label": b"x", b"data": x, b"labels": y, b"filenames": [b"a.png"] * n_per_batch}, f, protocol=2
            )
        all_x.append(x)
        all_y.append(y)
    return np.concatenate(all_x), np.concatenate(all_y)


def _gray_reference(x: np.ndarray) -> np.ndarray:
    r, g, b = (x[:, k * 1024 : (k + 1) * 1024].astype(np.float64) for k in range(3))
    return 0.2989 * r + 0.5870 * g + 0.1140 * b


def test_cifar_batches(tmp_path):
    x, y = _cifar(tmp_path)
    tr, trl = im.load_cifar_split(tmp_path, "train")
    va, val = im.load_cifar_split(tmp_path / "cifar-10-batches-py", "val")
    te, tel = im.load_cifar_split(tmp_path, "test", gray_rule="round")
    assert tr.shape == (45, 1024) and va.shape == (5, 1024) and te.shape == (10, 1024)
    assert trl.tolist() == y[:45].tolist() and val.tolist() == y[45:50].tolist() and tel.tolist() == y[50:].tolist()
    exact = _gray_reference(x[:50])
    assert np.abs(np.concatenate([tr, va]).astype(float) - exact).max() <= 1.0
    assert np.array_equal(te, np.rint(_gray_reference(x[50:])).astype(np.uint8))
    white = np.full((1, 3072), 255, np.uint8)
    assert im.rgb_to_gray(white, "tf")[0, 0] == 255 and im.rgb_to_gray(white, "round")[0, 0] == 255
    px = np.zeros((1, 3072), np.uint8)
    px[0, 0], px[0, 1024], px[0, 2048] = 100, 150, 200  # 140.74 → 141 both ways
    assert im.rgb_to_gray(px, "tf")[0, 0] == 141 and im.rgb_to_gray(px, "round")[0, 0] == 141


def test_cifar_errors(tmp_path):
    _cifar(tmp_path)
    d = tmp_path / "cifar-10-batches-py"
    with open(d / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((3, 3072), np.uint8), b"labels": [1, 2]}, f, protocol=2)
    with pytest.raises(ValueError, match=r"test_batch: 'labels' must have 3 entries"):
        im.load_cifar_split(tmp_path, "test")
    with open(d / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 12]}, f, protocol=2)
    with pytest.raises(ValueError, match=r"test_batch: 'labels' must be integers 0-9"):
        im.load_cifar_split(tmp_path, "test")
    with open(d / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 1000), np.uint8), b"labels": [1, 2]}, f, protocol=2)
    with pytest.raises(ValueError, match=r"uint8\[N, 3072\]"):
        im.load_cifar_split(tmp_path, "test")
    # a pickle that would run code is refused, not executed
    with open(d / "test_batch", "wb") as f:
        pickle.dump({b"data": os.getcwd, b"labels": []}, f, protocol=2)
    with pytest.raises(ValueError, match="refusing to load"):
        im.load_cifar_split(tmp_path, "test")
    with pytest.raises(ValueError, match="gray_rule"):
        im.load_cifar_split(tmp_path, "train", gray_rule="avg")


# ----------------------------------------------------------------------------- Fashion-MNIST idx


def _idx(path: Path, magic: int, dims: tuple[int, ...], payload: bytes) -> None:
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">i" + "i" * len(dims), magic, *dims) + payload)


def _fmnist(root: Path, n_train=20, n_test=10, seed=0):
    rng = np.random.default_rng(seed)
    data = {}
    for part, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, size=n, dtype=np.uint8)
        img_name, lab_name = im.FMNIST_FILES[part]
        _idx(root / img_name, 2051, (n, 28, 28), x.tobytes())
        _idx(root / lab_name, 2049, (n,), y.tobytes())
        data[part] = (x, y)
    return data


def test_fmnist_idx(tmp_path):
    data = _fmnist(tmp_path)
    x, y, info = im.load_fmnist_split(tmp_path, "train", strict_counts=False)
    assert x.shape == (18, 1024) and x.dtype == np.uint8 and y.tolist() == data["train"][1][:18].tolist()
    grid = x.reshape(-1, 32, 32)
    assert not grid[:, :2].any() and not grid[:, -2:].any() and not grid[:, :, :2].any() and not grid[:, :, -2:].any()
    assert np.array_equal(grid[:, 2:30, 2:30], data["train"][0][:18])
    xv, yv, _ = im.load_fmnist_split(tmp_path, "val", strict_counts=False)
    assert len(yv) == 2 and np.array_equal(xv.reshape(-1, 32, 32)[:, 2:30, 2:30], data["train"][0][18:])
    xt, yt, _ = im.load_fmnist_split(tmp_path, "test", strict_counts=False)
    assert len(yt) == 10
    with pytest.raises(ValueError, match="header count 20 != expected 60000"):
        im.load_fmnist_split(tmp_path, "train")  # official counts enforced by default


def test_fmnist_errors(tmp_path):
    _fmnist(tmp_path)
    img, lab = tmp_path / im.FMNIST_FILES["train"][0], tmp_path / im.FMNIST_FILES["train"][1]
    _idx(img, 2049, (20, 28, 28), bytes(20 * 784))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte\.gz: bad magic number 2049"):
        im.read_idx_images(img)
    _idx(img, 2051, (21, 28, 28), bytes(20 * 784))
    with pytest.raises(ValueError, match=r"15680 pixel bytes, header says 21"):
        im.read_idx_images(img)
    _idx(lab, 2049, (3,), bytes([1, 2, 10]))
    with pytest.raises(ValueError, match=r"label 10 at index 2 outside 0-9"):
        im.read_idx_labels(lab)
    _idx(lab, 2051, (3,), bytes([1, 2, 3]))
    with pytest.raises(ValueError, match="bad magic number 2051"):
        im.read_idx_labels(lab)
    _idx(img, 2051, (3, 28, 28), bytes(3 * 784))
    _idx(lab, 2049, (4,), bytes(4))
    with pytest.raises(ValueError, match="has 3 images but .* has 4 labels"):
        im.load_fmnist_split(tmp_path, "train", strict_counts=False)
    img.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="not a readable gzip"):
        im.read_idx_images(img)
    with pytest.raises(FileNotFoundError, match="data_dir"):
        im.load_fmnist_split(tmp_path / "missing", "test")


def test_write_idx_round_trip(tmp_path):
    x = np.arange(2 * 28 * 28, dtype=np.uint64).astype(np.uint8).reshape(2, 28, 28)
    im.write_idx_gz(tmp_path / "i.gz", tmp_path / "l.gz", x, np.array([3, 4]))
    assert np.array_equal(im.read_idx_images(tmp_path / "i.gz", expected_count=2), x)
    assert im.read_idx_labels(tmp_path / "l.gz").tolist() == [3, 4]


@pytest.mark.skipif(
    not (im.default_fmnist_dir() / "t10k-labels-idx1-ubyte.gz").is_file(), reason="shared Fashion-MNIST absent"
)
def test_real_fmnist_test_split_if_present():
    x, y, _ = im.load_fmnist_split(None, "test")
    assert x.shape == (10_000, 1024) and np.bincount(y, minlength=10).tolist() == [1000] * 10


def test_cifar_results_record_the_files_sha256(tmp_path):
    # lra.md §6.4: the registry never passed the folder, so the image task's record had no hashes
    from transnormer.data.lra import load_lra
    from transnormer.train.lra_tasks import _source_files

    _cifar(tmp_path)
    ds = load_lra("image", tmp_path, "train")
    names = sorted(p.name for p in _source_files(ds))
    assert names and all("_batch" in n for n in names)
