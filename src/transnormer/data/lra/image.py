"""LRA Image (CIFAR-10, greyscale) and the Fashion-MNIST stand-in ``image-fmnist32`` (spec §2, §5).

CIFAR-10 (``cifar-10-batches-py``): pickles ``data_batch_1`` … ``data_batch_5`` and ``test_batch``,
key ``data`` = ``uint8[N, 3072]`` (R, G, B planes of 32×32, row-major) and ``labels``. The pickles
are read with a restricted unpickler that only reconstructs numpy arrays, lists, dicts and
scalars, so a tampered file cannot run code. Greyscale rule (recorded in the dataset id):

* ``"tf"`` (default): our reading of TF's ``rgb_to_grayscale`` on uint8 input — in float32,
  ``g = Σ w_c · (c / 255)`` with w = (0.2989, 0.5870, 0.1140), then
  ``convert_image_dtype`` back to uint8 = ``trunc(g · 255.5)`` [I, unverified against TF];
* ``"round"``: ``round-half-even(Σ w_c · c)`` in float64.

The two differ by at most one level. Splits: train = first 45,000 training images in file order,
val = last 5,000, test = ``test_batch``: the sizes of TFDS's ``train[:90%]`` / ``train[90%:]``, but
not necessarily the same images [unverified: TFDS orders a split's examples by its own keys when it
prepares it, not by the batch files]. Tokens: the 1024 intensities row-major, vocabulary 256.

Fashion-MNIST stand-in (idx files, gzip): images magic 2051 + count + rows + cols (28, 28),
labels magic 2049 + count; headers are big-endian int32. Images are zero-padded by 2 px on every
side to 32×32 and flattened row-major (1024 tokens, vocabulary 256). Splits: train = first 54,000
of the training file, val = last 6,000 (in general: the last ``N // 10``), test = the 10,000 test
images. Default folder: ``<repo>/../shared/data/lra/fashion-mnist`` (or ``$TRANSNORMER_FMNIST_DIR``).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
from pathlib import Path

import numpy as np

from ._common import as_dir, split_name

VOCAB_SIZE = 256
NUM_CLASSES = 10
LENGTH = 1024
GRAY_WEIGHTS = (0.2989, 0.5870, 0.1140)
GRAY_RULES = ("tf", "round")

CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_FILE = "test_batch"

FMNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
FMNIST_COUNTS = {"train": 60_000, "test": 10_000}
FMNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
IDX_IMAGES_MAGIC = 2051
IDX_LABELS_MAGIC = 2049


# --------------------------------------------------------------------------- CIFAR-10


class _SafeUnpickler(pickle.Unpickler):
    """Allows only what a CIFAR batch pickle needs: numpy array reconstruction (plus the latin-1
    byte-string encoding that Python 3 protocol-2 pickles use)."""

    def find_class(self, module: str, name: str):
        allowed = {
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): np.dtype,
            ("numpy.core.multiarray", "_reconstruct"): _np_reconstruct(),
            ("numpy._core.multiarray", "_reconstruct"): _np_reconstruct(),
            ("numpy.core.multiarray", "scalar"): _np_scalar(),
            ("numpy._core.multiarray", "scalar"): _np_scalar(),
            # protocol-2 pickles written by Python 3 store bytes as _codecs.encode(str, "latin1")
            ("_codecs", "encode"): _codecs_encode,
        }
        try:
            return allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR pickle") from None


def _codecs_encode(obj, encoding="utf-8", errors="strict"):
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8", "ascii"):
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {encoding!r}")
    return obj.encode(encoding, errors)


def _np_reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return _reconstruct


def _np_scalar():
    try:
        from numpy._core.multiarray import scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import scalar  # type: ignore[no-redef]
    return scalar


def read_cifar_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch → (``uint8[N, 3072]``, labels ``int64[N]``), validated."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CIFAR-10 batch not found: {path}")
    try:
        with open(path, "rb") as f:
            obj = _SafeUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"{path}: not a readable CIFAR-10 pickle ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict, got {type(obj).__name__}")
    d = {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in obj.items()}
    for key in ("data", "labels"):
        if key not in d:
            raise ValueError(f"{path}: missing key {key!r} (keys: {sorted(map(str, d))})")
    data = np.asarray(d["data"])
    if data.ndim != 2 or data.shape[1] != 3072 or data.dtype != np.uint8:
        raise ValueError(f"{path}: 'data' must be uint8[N, 3072], got {data.dtype}{list(data.shape)}")
    labels = np.asarray(d["labels"])
    if labels.ndim != 1 or labels.shape[0] != data.shape[0]:
        raise ValueError(f"{path}: 'labels' must have {data.shape[0]} entries, got shape {list(labels.shape)}")
    if labels.size and (not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: 'labels' must be integers 0-9")
    return data, labels.astype(np.int64)


def rgb_to_gray(data: np.ndarray, rule: str = "tf") -> np.ndarray:
    """``uint8[N, 3072]`` (R, G, B planes) → ``uint8[N, 1024]`` with the given rounding rule."""
    if rule not in GRAY_RULES:
        raise ValueError(f"gray_rule must be one of {GRAY_RULES}, got {rule!r}")
    x = np.asarray(data)
    if x.ndim != 2 or x.shape[1] != 3072:
        raise ValueError(f"data must have shape [N, 3072], got {list(x.shape)}")
    r, g, b = x[:, :1024], x[:, 1024:2048], x[:, 2048:]
    if rule == "tf":
        w = np.asarray(GRAY_WEIGHTS, dtype=np.float32)
        s = np.float32(1.0 / 255.0)
        y = (r.astype(np.float32) * s) * w[0] + (g.astype(np.float32) * s) * w[1] + (b.astype(np.float32) * s) * w[2]
        out = np.trunc(y * np.float32(255.5))
    else:
        w64 = np.asarray(GRAY_WEIGHTS, dtype=np.float64)
        out = np.rint(r * w64[0] + g * w64[1] + b * w64[2])
    return np.clip(out, 0, 255).astype(np.uint8)


def find_cifar_dir(root: str | os.PathLike) -> Path:
    root = as_dir("root", root)
    for cand in (root, root / "cifar-10-batches-py"):
        if (cand / CIFAR_TEST_FILE).is_file() or (cand / CIFAR_TRAIN_FILES[0]).is_file():
            return cand
    raise FileNotFoundError(f"no CIFAR-10 python batches in {root} or {root / 'cifar-10-batches-py'}")


def load_cifar_split(root: str | os.PathLike, split: str, *, gray_rule: str = "tf") -> tuple[np.ndarray, np.ndarray]:
    """(``uint8[N, 1024]`` greyscale tokens, labels ``int64[N]``) of one split (see module doc)."""
    split = split_name(split)
    if gray_rule not in GRAY_RULES:
        raise ValueError(f"gray_rule must be one of {GRAY_RULES}, got {gray_rule!r}")
    d = find_cifar_dir(root)
    if split == "test":
        data, labels = read_cifar_batch(d / CIFAR_TEST_FILE)
    else:
        parts = [read_cifar_batch(d / name) for name in CIFAR_TRAIN_FILES]
        data = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        n_train = (len(data) * 9) // 10  # the size of TFDS's train[:90%] (45,000 of 50,000), in file order
        sl = slice(0, n_train) if split == "train" else slice(n_train, len(data))
        data, labels = data[sl], labels[sl]
    return rgb_to_gray(data, gray_rule), labels


# --------------------------------------------------------------------------- Fashion-MNIST (idx)


def _read_gz(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"idx file not found: {path}")
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: not a readable gzip file ({e})") from None


def read_idx_images(path: str | os.PathLike, *, expected_count: int | None = None) -> np.ndarray:
    """Gzipped idx3 image file → ``uint8[N, rows, cols]`` (validates magic, count and size)."""
    path = Path(path)
    raw = _read_gz(path)
    if len(raw) < 16:
        raise ValueError(f"{path}: truncated idx header ({len(raw)} bytes, need 16)")
    magic, count, rows, cols = struct.unpack(">iiii", raw[:16])
    if magic != IDX_IMAGES_MAGIC:
        raise ValueError(f"{path}: bad magic number {magic} (expected {IDX_IMAGES_MAGIC} for idx3 images)")
    if count < 0 or rows <= 0 or cols <= 0:
        raise ValueError(f"{path}: bad header count={count}, rows={rows}, cols={cols}")
    if expected_count is not None and count != expected_count:
        raise ValueError(f"{path}: header count {count} != expected {expected_count}")
    need = count * rows * cols
    if len(raw) - 16 != need:
        raise ValueError(f"{path}: {len(raw) - 16} pixel bytes, header says {count}×{rows}×{cols} = {need}")
    return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(count, rows, cols)


def read_idx_labels(path: str | os.PathLike, *, expected_count: int | None = None, num_classes: int = 10) -> np.ndarray:
    """Gzipped idx1 label file → ``int64[N]`` (validates magic, count, size and range)."""
    path = Path(path)
    raw = _read_gz(path)
    if len(raw) < 8:
        raise ValueError(f"{path}: truncated idx header ({len(raw)} bytes, need 8)")
    magic, count = struct.unpack(">ii", raw[:8])
    if magic != IDX_LABELS_MAGIC:
        raise ValueError(f"{path}: bad magic number {magic} (expected {IDX_LABELS_MAGIC} for idx1 labels)")
    if count < 0:
        raise ValueError(f"{path}: bad header count={count}")
    if expected_count is not None and count != expected_count:
        raise ValueError(f"{path}: header count {count} != expected {expected_count}")
    if len(raw) - 8 != count:
        raise ValueError(f"{path}: {len(raw) - 8} label bytes, header says {count}")
    labels = np.frombuffer(raw, dtype=np.uint8, offset=8)
    if labels.size and labels.max() >= num_classes:
        bad = int(np.argmax(labels >= num_classes))
        raise ValueError(f"{path}: label {int(labels[bad])} at index {bad} outside 0-{num_classes - 1}")
    return labels.astype(np.int64)


FMNIST_REL = Path("..") / "shared" / "data" / "lra" / "fashion-mnist"


def default_fmnist_dir() -> Path:
    """``$TRANSNORMER_FMNIST_DIR`` if set, else ``../shared/data/lra/fashion-mnist`` from the working
    directory when that folder exists, else the same path next to the repository. (One rule for
    ``lra prepare`` and the loaders, which must agree on the folder they check and read.)"""
    env = os.environ.get("TRANSNORMER_FMNIST_DIR")
    if env:
        return Path(env)
    cwd_rel = Path.cwd() / FMNIST_REL
    if cwd_rel.is_dir():
        return cwd_rel
    repo_root = Path(__file__).resolve().parents[4]  # src/transnormer/data/lra/image.py → repo
    return repo_root / FMNIST_REL


def pad_to_32(images: np.ndarray) -> np.ndarray:
    """``uint8[N, 28, 28]`` → ``uint8[N, 1024]``: 2 zero pixels on every side, flattened row-major."""
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ValueError(f"images must have shape [N, 28, 28], got {list(images.shape)}")
    return np.pad(images, ((0, 0), (2, 2), (2, 2))).reshape(len(images), 1024)


def load_fmnist_split(
    data_dir: str | os.PathLike | None, split: str, *, strict_counts: bool = True
) -> tuple[np.ndarray, np.ndarray, dict]:
    """(``uint8[N, 1024]`` tokens, labels ``int64[N]``, info) of the ``image-fmnist32`` stand-in.

    ``strict_counts`` checks the official 60,000 / 10,000 counts (turn off for small fixtures).
    """
    split = split_name(split)
    d = as_dir("data_dir", default_fmnist_dir() if data_dir is None else data_dir)
    part = "test" if split == "test" else "train"
    img_name, lab_name = FMNIST_FILES[part]
    expected = FMNIST_COUNTS[part] if strict_counts else None
    images = read_idx_images(d / img_name, expected_count=expected)
    labels = read_idx_labels(d / lab_name, expected_count=expected)
    if len(images) != len(labels):
        raise ValueError(f"{d}: {img_name} has {len(images)} images but {lab_name} has {len(labels)} labels")
    if images.shape[1:] != (28, 28):
        raise ValueError(f"{d / img_name}: expected 28×28 images, got {images.shape[1]}×{images.shape[2]}")
    if part == "train":
        n_val = len(images) // 10  # 6,000 of 60,000
        sl = slice(0, len(images) - n_val) if split == "train" else slice(len(images) - n_val, len(images))
        images, labels = images[sl], labels[sl]
    return pad_to_32(images), labels, {"dir": str(d), "files": [img_name, lab_name]}


def write_idx_gz(images_path, labels_path, images: np.ndarray, labels: np.ndarray) -> None:
    """Write idx3/idx1 gz files (used by tests and for making fixtures); atomic."""
    from ..._files import atomic_write_bytes

    images = np.ascontiguousarray(images, dtype=np.uint8)
    labels = np.ascontiguousarray(labels, dtype=np.uint8)
    if images.ndim != 3:
        raise ValueError(f"images must have shape [N, rows, cols], got {list(images.shape)}")
    head = struct.pack(">iiii", IDX_IMAGES_MAGIC, images.shape[0], images.shape[1], images.shape[2])
    atomic_write_bytes(images_path, _gz(head + images.tobytes()))
    atomic_write_bytes(labels_path, _gz(struct.pack(">ii", IDX_LABELS_MAGIC, labels.shape[0]) + labels.tobytes()))


def _gz(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        f.write(data)
    return buf.getvalue()
