"""Token cache: contents, dtype, reuse, invalidation, and no partial files after a failed build."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest

from transnormer.data import Corpus, build_token_cache, token_cache_dir, token_dtype, train_bpe


def make_docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "the of to and a in is return value list string file data when if this with error".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(name="c", splits={"train": make_docs(200, 0), "valid": make_docs(20, 1), "test": make_docs(20, 2)})


@pytest.fixture(scope="module")
def tok(corpus):
    return train_bpe(corpus["train"], vocab_size=300)


def test_contents_dtype_and_sidecar(corpus, tok, tmp_path):
    arrays = build_token_cache(corpus, tok, cache_dir=tmp_path)
    assert set(arrays) == {"train", "valid", "test"}
    for split, arr in arrays.items():
        assert isinstance(arr, np.memmap) and arr.dtype == np.uint16 and arr.ndim == 1
        expected = [i for doc in corpus[split] for i in tok.encode(doc) + [tok.eos_id]]
        assert arr.tolist() == expected
        meta = json.loads((token_cache_dir(corpus, tok, tmp_path) / f"{split}.json").read_text())
        assert meta["num_tokens"] == len(expected) and meta["num_docs"] == len(corpus[split])
        assert meta["corpus_fingerprint"] == corpus.fingerprint
        assert meta["tokenizer_fingerprint"] == tok.fingerprint
    # Documents are separated by EOS: as many EOS as documents.
    assert int((arrays["valid"] == tok.eos_id).sum()) == len(corpus["valid"])
    assert not arrays["train"].flags.writeable


def test_token_dtype():
    assert token_dtype(500) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(250_000) == np.uint32
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


class _BigVocabTokenizer:
    """Duck-typed tokenizer with ids above 65535 (checks the uint32 path without a huge vocab)."""

    vocab_size, eos_id, name, fingerprint = 70_000, 69_999, "big", "f" * 64

    def encode_batch(self, texts):
        return [[65_536 + len(t), 1] for t in texts]


def test_uint32_for_large_vocab(corpus, tmp_path):
    arr = build_token_cache(corpus, _BigVocabTokenizer(), cache_dir=tmp_path, splits=["valid"])["valid"]
    assert arr.dtype == np.uint32
    assert arr[:3].tolist() == [65_536 + len(corpus["valid"][0]), 1, 69_999]


def test_reuse_and_rebuild(corpus, tok, tmp_path, monkeypatch):
    first = build_token_cache(corpus, tok, cache_dir=tmp_path)
    # Same corpus + tokenizer: no tokenization at all.
    monkeypatch.setattr(type(tok), "encode_batch", lambda *a, **k: pytest.fail("cache not reused"))
    again = build_token_cache(corpus, tok, cache_dir=tmp_path)
    assert all(np.array_equal(first[s], again[s]) for s in first)
    monkeypatch.undo()

    # Changed corpus → new key, rebuilt with the new text.
    changed = Corpus(name="c", splits={**corpus.splits, "valid": corpus["valid"][:-1]})
    rebuilt = build_token_cache(changed, tok, cache_dir=tmp_path, splits=["valid"])
    assert len(rebuilt["valid"]) < len(first["valid"])
    # Changed tokenizer → new key.
    tok2 = train_bpe(corpus["train"], vocab_size=280)
    assert tok2.fingerprint != tok.fingerprint
    other = build_token_cache(corpus, tok2, cache_dir=tmp_path, splits=["valid"])
    assert other["valid"].tolist() == [i for d in corpus["valid"] for i in tok2.encode(d) + [tok2.eos_id]]
    assert len({p.name for p in (tmp_path / "tokens").iterdir()}) == 3

    # A cache whose .bin does not match its sidecar (e.g. truncated by hand) is rebuilt.
    directory = token_cache_dir(corpus, tok, tmp_path)
    expected = first["test"].tolist()
    del first, again  # (unlink, not truncate in place: live memmaps of the old file stay valid)
    (directory / "test.bin").unlink()
    (directory / "test.bin").write_bytes(b"\x00\x00")
    fixed = build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["test"])
    assert fixed["test"].tolist() == expected
    # ... and so is one changed under the same size (it had been read as the cache): the sidecar
    # records the sha256 of the .bin as written
    assert json.loads((directory / "test.json").read_text())["sha256"] == hashlib.sha256(
        (directory / "test.bin").read_bytes()).hexdigest()
    del fixed
    corrupt = bytearray((directory / "test.bin").read_bytes())
    corrupt[len(corrupt) // 2] ^= 0x01
    (directory / "test.bin").unlink()
    (directory / "test.bin").write_bytes(bytes(corrupt))
    with pytest.warns(UserWarning, match="test.bin' does not match the sha256 its sidecar records"):
        fixed = build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["test"])
    assert fixed["test"].tolist() == expected
    # a sidecar written before the digest was recorded is read as it was (no sha256: no check)
    meta = json.loads((directory / "test.json").read_text())
    del meta["sha256"]
    (directory / "test.json").write_text(json.dumps(meta))
    monkeypatch.setattr(type(tok), "encode_batch", lambda *a, **k: pytest.fail("an old cache was rebuilt"))
    assert build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["test"])["test"].tolist() == expected


def test_failed_build_leaves_no_partial_files(corpus, tok, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = type(tok).encode_batch

    def flaky(self, texts):
        calls["n"] += 1
        if calls["n"] == 3:  # midway through the train split
            raise RuntimeError("tokenizer crashed")
        return real(self, texts)

    monkeypatch.setattr(type(tok), "encode_batch", flaky)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["train"], batch_docs=16)
    directory = token_cache_dir(corpus, tok, tmp_path)
    assert calls["n"] == 3
    # no .bin, no sidecar, no temp file (the split's lock file stays: it holds no data)
    assert sorted(p.name for p in directory.iterdir() if p.suffix != ".lock") == []
    monkeypatch.undo()

    # The next build succeeds and is complete.
    arr = build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["train"], batch_docs=16)["train"]
    assert arr.tolist() == [i for d in corpus["train"] for i in tok.encode(d) + [tok.eos_id]]
    assert sorted(p.name for p in directory.iterdir()) == ["train.bin", "train.json", "train.lock"]


def test_a_killed_builds_partial_file_is_removed_by_the_next_build(corpus, tok, tmp_path):
    # a build killed by SIGKILL / the OOM killer never runs atomic_path's cleanup: its partial .bin
    # stayed in the cache for good (one more for every killed retry)
    directory = token_cache_dir(corpus, tok, tmp_path)
    directory.mkdir(parents=True)
    orphan = directory / ".train.bin.abc123.tmp"
    orphan.write_bytes(b"\0" * 4096)
    other = directory / ".valid.bin.abc123.tmp"  # another split's: its own builder's to remove
    other.write_bytes(b"")
    build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["train"], batch_docs=16)
    assert not orphan.exists() and other.exists()


def test_argument_errors(corpus, tok, tmp_path):
    with pytest.raises(ValueError, match="splits"):
        build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["dev"])
    with pytest.raises(TypeError, match=r"list of split names, got the str 'train'"):
        build_token_cache(corpus, tok, cache_dir=tmp_path, splits="train")
    with pytest.raises(TypeError, match="corpus"):
        build_token_cache(["text"], tok, cache_dir=tmp_path)
    with pytest.raises(TypeError, match="tokenizer"):
        build_token_cache(corpus, object(), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="batch_docs"):
        build_token_cache(corpus, tok, cache_dir=tmp_path, batch_docs=0)


def _build_in_child(corpus, tok, cache_dir, queue):
    try:
        arrays = build_token_cache(corpus, tok, cache_dir=cache_dir)
        queue.put(("ok", len(arrays["train"])))
    except Exception as e:  # reported to the parent, which asserts on it
        queue.put((type(e).__name__, str(e)))


def test_concurrent_builders_take_turns(corpus, tok, tmp_path, capfd):
    """Two processes building the same entry take turns: the second waits for the first's lock (it
    used to delete the first's freshly written sidecar, failing the first's read-back), and says so."""
    import multiprocessing as mp

    from transnormer._files import file_lock

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    lock = token_cache_dir(corpus, tok, tmp_path) / "train.lock"
    with file_lock(lock):  # another builder is mid-build of "train"
        child = ctx.Process(target=_build_in_child, args=(corpus, tok, tmp_path, queue))
        child.start()
        child.join(timeout=1.5)
        assert child.is_alive(), "the second builder did not wait for the split's lock"
    child.join(timeout=60)
    arrays = build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["train"])  # the child's, committed
    assert queue.get(timeout=5) == ("ok", len(arrays["train"]))
    assert "waiting for another process to finish tokenizing split 'train'" in capfd.readouterr().err


def test_a_built_cache_is_read_without_taking_the_lock(corpus, tok, tmp_path, monkeypatch):
    """Users who may only read a shared cache could not open the lock file for writing: the lock
    is taken only to build."""
    from transnormer.data import token_cache

    first = build_token_cache(corpus, tok, cache_dir=tmp_path)

    def no_write(path):
        raise PermissionError(f"[Errno 13] Permission denied: {path}")

    monkeypatch.setattr(token_cache, "file_lock", no_write)
    again = build_token_cache(corpus, tok, cache_dir=tmp_path)
    assert all(np.array_equal(first[s], again[s]) for s in first)


def test_long_documents_encoded_in_pieces_to_the_same_ids(tok, tmp_path):
    # A one-sentence-per-line file without blank lines is one document: encoded whole it held ~165 bytes
    # a token. Cut at line starts it is encoded a piece at a time, to the ids of the whole.
    from transnormer.data.token_cache import _pieces, _write_split

    rng = random.Random(3)
    lines = [" ".join(make_docs(1, i)) + rng.choice(["", " ", ".", "  ", "\t"]) for i in range(300)]
    doc = "\n".join(lines) + "\n\n ' 's\nx\n\n\ny \n z\n"
    assert tok.splits_at_line_starts
    assert len(_pieces(doc, 500)) > 10 and "".join(_pieces(doc, 500)) == doc
    for piece_chars, batch_docs in ((500, 3), (37, 64), (len(doc), 1)):
        path = tmp_path / f"p{piece_chars}.bin"
        n, docs, sha256 = _write_split([doc, "short one", doc], tok, path, np.dtype(np.uint16), batch_docs, None,
                                       piece_chars=piece_chars)
        ids = np.fromfile(path, dtype=np.uint16).tolist()
        assert docs == 3 and n == len(ids) and sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        assert ids == [*tok.encode(doc), tok.eos_id, *tok.encode("short one"), tok.eos_id, *tok.encode(doc), tok.eos_id]


def test_only_byte_level_bpe_is_cut(tok):
    # a normalizer or a prefix space could join or change pieces across the cut: such tokenizers encode whole
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    from transnormer.data import TextTokenizer

    lowered = Tokenizer.from_str(tok._json)
    lowered.normalizer = normalizers.Lowercase()
    assert not TextTokenizer(lowered, name="lower").splits_at_line_starts
    prefixed = Tokenizer.from_str(tok._json)
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    assert not TextTokenizer(prefixed, name="prefix").splits_at_line_starts
    assert TextTokenizer(Tokenizer.from_str(tok._json), name="same").splits_at_line_starts
    added = Tokenizer.from_str(tok._json)
    added.add_tokens(["end\nBEGIN"])  # matched in the text, across a line start
    assert not TextTokenizer(added, name="added").splits_at_line_starts


def _read_only_under(monkeypatch, root):
    """os.access as for a user who may only read ``root`` (tests run as root, for whom chmod is moot)."""
    import os

    from transnormer import _files

    real = os.access

    def access(path, mode, *a, **k):
        if mode & os.W_OK and str(path).startswith(str(root)):
            return False
        return real(path, mode, *a, **k)

    monkeypatch.setattr(_files.os, "access", access)


def test_a_read_only_cache_serves_what_it_holds_and_names_what_it_lacks(corpus, tok, tmp_path, monkeypatch):
    import argparse

    from transnormer.cli import _check_outputs
    from transnormer.data import TextTokenizer, build_tokenizer

    first = build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["train"])
    _read_only_under(monkeypatch, tmp_path)
    # --cache-dir of a shared read-only cache: accepted (it had been refused as "not writable")
    _check_outputs(argparse.Namespace(command="train", cache_dir=str(tmp_path), out=None))
    again = build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["train"])
    assert np.array_equal(first["train"], again["train"])
    # a split it lacks is refused up front, naming the flag (it had failed naming a temp file)
    with pytest.raises(ValueError, match=r"lacks split 'valid'.*not writable.*--cache-dir"):
        build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["valid"])
    # a split changed on disk is named as such, not as missing (and not said to be tokenized again)
    bin_path = token_cache_dir(corpus, tok, tmp_path) / "train.bin"
    data = bytearray(bin_path.read_bytes())
    data[0] ^= 0x01
    del first, again
    bin_path.unlink()
    bin_path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="does not match the sha256"), \
            pytest.raises(ValueError, match=r"split 'train' of the token cache .* does not match the sha256 its "
                                            r"sidecar records .*not writable.*restore train.bin"):
        build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["train"])
    # a tokenizer it lacks is trained and used, with a warning, not cached
    with pytest.warns(UserWarning, match="not writable"):
        bpe = build_tokenizer(corpus, 300, cache_dir=tmp_path)
    assert isinstance(bpe, TextTokenizer) and not (tmp_path / "tokenizers").exists()


def test_a_full_disk_names_the_token_cache(corpus, tok, tmp_path, monkeypatch):
    # the write's own error had named the temporary .bin (or, from numpy, nothing)
    import errno

    from transnormer.data import token_cache

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".train.bin.x.tmp"))

    monkeypatch.setattr(token_cache, "_write_split", full)
    with pytest.raises(OSError, match=r"no space left on the device \(\d+ MiB free there\) writing the token cache "
                                      r"of split 'train' \(give another --cache-dir\)") as err:
        build_token_cache(corpus, tok, cache_dir=tmp_path, splits=["train"])
    assert err.value.filename == str(token_cache_dir(corpus, tok, tmp_path))


def test_a_cache_that_is_a_file_is_named_by_where_it_came_from(tmp_path, monkeypatch):
    from transnormer.data._util import resolve_cache_dir

    f = tmp_path / "cache"
    f.write_text("")
    with pytest.raises(ValueError, match=r"cache_dir \(--cache-dir\) .*is not a directory"):
        resolve_cache_dir(f)
    monkeypatch.setenv("TRANSNORMER_CACHE", str(f))
    with pytest.raises(ValueError, match=r"\$TRANSNORMER_CACHE .*is not a directory"):
        resolve_cache_dir(None)
