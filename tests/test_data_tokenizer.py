"""Byte-level BPE training, caching, saving/loading and the HF bridge."""

from __future__ import annotations

import json
import random

import pytest

from transnormer.data import Corpus, TextTokenizer, build_tokenizer, load_tokenizer, train_bpe
from transnormer.data import tokenizer as tok_mod

_WORDS = (
    "the of to and a in is it that for return value list string object file data when if this with "
    "as not are be by on or from an default raise error name type None True key item number module "
    "function class method argument attribute instance buffer stream encoding character line path"
).split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(15, 40))).capitalize() + "." for _ in range(n)]


@pytest.fixture(scope="module")
def small_corpus() -> Corpus:
    return Corpus(name="small", splits={"train": make_docs(300), "valid": make_docs(5, 1), "test": make_docs(5, 2)})


@pytest.fixture(scope="module")
def bpe(small_corpus) -> TextTokenizer:
    return train_bpe(small_corpus["train"], vocab_size=500)


def test_train_bpe_specials_and_round_trip(bpe):
    assert 261 < bpe.vocab_size <= 500
    assert (bpe.pad_id, bpe.bos_id, bpe.eos_id, bpe.unk_id, bpe.mask_id) == (0, 1, 2, 3, 4)
    assert bpe.special_ids == frozenset({0, 1, 2, 3, 4})
    for text in ["Return the value of the list.", "  leading spaces\n\ttabs\n", "naïve café ✓ 日本語", ""]:
        ids = bpe.encode(text)
        assert all(isinstance(i, int) and 0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
    # Frequent words became single tokens: BPE merged something.
    assert len(bpe.encode("the value of the")) < len("the value of the")
    # Literal special-token text in data is ordinary text, never a control id.
    ids = bpe.encode("a <mask> and <s> here")
    assert not set(ids) & bpe.special_ids
    assert bpe.decode(ids) == "a <mask> and <s> here"
    assert bpe.encode_batch(["the list", "a file"]) == [bpe.encode("the list"), bpe.encode("a file")]


def test_copies_keep_special_token_text_as_text(bpe):
    """pickle / deepcopy rebuilt the backend from JSON without encode_special_tokens: a copy encoded
    a literal "<s>" as the control id under the same fingerprint."""
    import copy
    import pickle

    for clone in (pickle.loads(pickle.dumps(bpe)), copy.deepcopy(bpe)):
        ids = clone.encode("a <mask> and <s> here")
        assert ids == bpe.encode("a <mask> and <s> here") and not set(ids) & clone.special_ids
        assert clone.fingerprint == bpe.fingerprint


def test_a_loaded_tokenizer_json_with_truncation_or_padding_keeps_whole_documents(bpe, tmp_path):
    """A tokenizer.json may carry truncation and padding (hub files often truncate to 512): the
    private copy had kept them, cutting every document short and padding it, into the token cache."""
    import pickle

    import tokenizers

    from transnormer.data.tokenizer import load_tokenizer

    backend = tokenizers.Tokenizer.from_str(bpe._json)
    backend.enable_truncation(8)
    backend.enable_padding(pad_id=0, pad_token="<pad>", length=40)
    backend.save(str(tmp_path / "tokenizer.json"))
    text = "Return the value of the list, then the value of the file, then the list again."
    want = bpe.encode(text)
    assert len(want) > 8
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    for t in (tok, pickle.loads(pickle.dumps(tok))):
        assert t.encode(text) == want and t.encode_batch([text, "a file"]) == [want, bpe.encode("a file")]
    # the same ids, the same token cache; one built while truncation applied has another key
    assert tok.fingerprint == bpe.fingerprint


def test_decode_accepts_tensors_and_checks_range(bpe):
    import torch

    ids = bpe.encode("the file")
    assert bpe.decode(torch.tensor(ids)) == "the file"
    assert bpe.decode([1] + ids + [2], skip_special_tokens=True) == "the file"
    with pytest.raises(ValueError, match="outside"):
        bpe.decode([bpe.vocab_size])
    with pytest.raises(TypeError, match="text must be str"):
        bpe.encode(3)


def test_train_bpe_argument_errors():
    with pytest.raises(ValueError, match="vocab_size must be >= 261"):
        train_bpe(["abc"], vocab_size=100)
    with pytest.raises(TypeError, match="vocab_size"):
        train_bpe(["abc"], vocab_size="500")
    with pytest.raises(TypeError, match="texts"):
        train_bpe("a single string", vocab_size=300)
    with pytest.raises(ValueError, match="min_frequency"):
        train_bpe(["abc"], vocab_size=300, min_frequency=0)


def test_build_tokenizer_cache_reuse(small_corpus, tmp_path, monkeypatch):
    t1 = build_tokenizer(small_corpus, vocab_size=400, cache_dir=tmp_path)
    files = sorted(p.name for p in (tmp_path / "tokenizers").iterdir())
    assert len(files) == 1 and small_corpus.fingerprint[:20] in files[0] and "-v400-" in files[0]

    monkeypatch.setattr(tok_mod, "train_bpe", lambda *a, **k: pytest.fail("cached tokenizer not reused"))
    t2 = build_tokenizer(small_corpus, vocab_size=400, cache_dir=tmp_path)
    assert t2.fingerprint == t1.fingerprint
    assert t2.encode("the data") == t1.encode("the data")
    monkeypatch.undo()

    # Another vocab size or another corpus is another cache entry.
    t3 = build_tokenizer(small_corpus, vocab_size=420, cache_dir=tmp_path)
    assert t3.fingerprint != t1.fingerprint
    other = Corpus(name="other", splits={"train": make_docs(300, 7), "valid": ["v"], "test": ["t"]})
    build_tokenizer(other, vocab_size=400, cache_dir=tmp_path)
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 3
    assert not list((tmp_path / "tokenizers").glob("*.tmp"))

    with pytest.raises(TypeError, match="corpus"):
        build_tokenizer(["not", "a", "corpus"], cache_dir=tmp_path)


def test_save_load_and_hf(bpe, tmp_path):
    out = bpe.save(tmp_path / "tok")
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    for spec in (out, str(out / "tokenizer.json")):
        loaded = load_tokenizer(spec)
        assert loaded.fingerprint == bpe.fingerprint
        assert (loaded.pad_id, loaded.bos_id, loaded.eos_id, loaded.mask_id) == (0, 1, 2, 4)
        assert loaded.encode("the module name") == bpe.encode("the module name")

    hf = bpe.to_hf()
    text = "Return the default encoding."
    assert hf(text, add_special_tokens=False)["input_ids"] == bpe.encode(text)
    assert hf(text)["input_ids"] == [bpe.bos_id] + bpe.encode(text) + [bpe.eos_id]
    assert (hf.pad_token_id, hf.mask_token_id) == (bpe.pad_id, bpe.mask_id)

    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(out))
    assert auto(text, add_special_tokens=False)["input_ids"] == bpe.encode(text)


def test_load_tokenizer_generic_json_and_errors(tmp_path):
    # A tokenizer.json with other special-token names: roles found by common names.
    import tokenizers
    from tokenizers import models, pre_tokenizers

    t = tokenizers.Tokenizer(
        models.WordLevel({"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "hi": 5}, unk_token="[UNK]")
    )
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    path = tmp_path / "wl.json"
    path.write_text(t.to_str(), encoding="utf-8")
    loaded = load_tokenizer(path)
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_id, loaded.unk_id, loaded.mask_id) == (0, 2, 3, 1, 4)
    assert loaded.encode("hi hi") == [5, 5]

    with pytest.raises(FileNotFoundError, match="no such file"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}), encoding="utf-8")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(bad)
    with pytest.raises(TypeError, match="spec"):
        load_tokenizer(5)
    with pytest.raises(ValueError, match="special_tokens"):
        TextTokenizer(t, special_tokens={"pad": "<nope>"})
    with pytest.raises(ValueError, match="unknown role"):
        TextTokenizer(t, special_tokens={"sep": "[SEP]"})


def _slow_bert(tmp_path, name: str, **kwargs):
    """A Python ("slow") transformers tokenizer saved to ``tmp_path/name`` (no tokenizer.json)."""
    legacy = pytest.importorskip("transformers.models.bert.tokenization_bert_legacy")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "Hello", "World"]) + "\n")
    out = tmp_path / name
    legacy.BertTokenizerLegacy(str(vocab), **kwargs).save_pretrained(str(out))
    assert not (out / "tokenizer.json").exists()
    return out


def test_slow_tokenizer_fingerprint_covers_options_and_not_location(tmp_path):
    # Fingerprinted by the vocabulary alone, do_lower_case True and False shared one token cache.
    lower, cased = (load_tokenizer(_slow_bert(tmp_path, n, do_lower_case=lc)) for n, lc in (("l", True), ("c", False)))
    assert lower._backend is None and cased._backend is None
    assert lower.encode("Hello World") != cased.encode("Hello World")
    assert lower.fingerprint != cased.fingerprint
    import pickle
    import shutil

    shutil.copytree(tmp_path / "l", tmp_path / "elsewhere")
    assert load_tokenizer(tmp_path / "elsewhere").fingerprint == lower.fingerprint
    assert pickle.loads(pickle.dumps(lower)).fingerprint == lower.fingerprint


def test_slow_tokenizer_refuses_special_token_text(tmp_path):
    slow = load_tokenizer(_slow_bert(tmp_path, "s", do_lower_case=True))
    assert slow.encode("hello world") == [5, 6]
    assert slow.encode("hello qqq world") == [5, slow.unk_id, 6]  # <unk> is what it is for
    with pytest.raises(ValueError, match=r"'\[SEP\]'.*control token"):
        slow.encode("hello [SEP] world")
    with pytest.raises(ValueError, match="MASK"):
        slow.encode_batch(["hello", "world [MASK]"])


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # dynamo's import
def test_a_compiled_causal_lms_checkpoint_keeps_the_causal_framing(bpe, tmp_path):
    """save_checkpoint read the framing off the model's class name, and torch.compile's wrapper
    (train --compile) is no ...ForCausalLM: its checkpoint's tokenizer framed prompts <s> A </s>."""
    import torch
    from transformers import AutoTokenizer

    from transnormer.presets import build_model
    from transnormer.train.checkpoint import save_checkpoint

    model = build_model("t2-lm-tiny", vocab_size=50, hidden_size=16, num_attention_heads=2, num_hidden_layers=1)
    ckpt = save_checkpoint(tmp_path / "checkpoints", 1, torch.compile(model), {"step": 1}, tokenizer=bpe)
    text = "Return the value of the key."
    assert AutoTokenizer.from_pretrained(str(ckpt / "tokenizer"))(text)["input_ids"] == [2, *bpe.encode(text)]


def test_causal_save_frames_text_after_eos_and_keeps_the_fingerprint(bpe, tmp_path):
    """HF-side calls (pipeline("text-generation")) applied <s> A </s>: every prompt ended with an end
    of document. A causal LM's tokenizer is saved framing text as its training stream does: </s> A."""
    from transformers import AutoTokenizer

    text = "Return the value of the key."
    bpe.save(tmp_path / "mlm")
    bpe.save(tmp_path / "clm", causal=True)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "mlm"))(text)["input_ids"] == [1, *bpe.encode(text), 2]
    assert AutoTokenizer.from_pretrained(str(tmp_path / "clm"))(text)["input_ids"] == [2, *bpe.encode(text)]
    fingerprints = {load_tokenizer(tmp_path / d).fingerprint for d in ("mlm", "clm")}
    assert fingerprints == {bpe.fingerprint}  # encode is the same: one token cache
    # read back from a causal LM's checkpoint and saved for an MLM or a classifier: <s> A </s> again
    load_tokenizer(tmp_path / "clm").save(tmp_path / "again")
    assert AutoTokenizer.from_pretrained(str(tmp_path / "again"))(text)["input_ids"] == [1, *bpe.encode(text), 2]


def test_save_keeps_an_hf_tokenizers_cls_sep_and_settings(tmp_path):
    # save() (every checkpoint's tokenizer/) had rebuilt a plain tokenizer of the five roles: a BERT-style
    # tokenizer lost [CLS]/[SEP] as cls/sep tokens, its model_max_length and padding_side
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "##b", "c"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                            unk_token="[UNK]", mask_token="[MASK]", model_max_length=512,
                            padding_side="left").save_pretrained(tmp_path / "wp")
    tok = load_tokenizer(tmp_path / "wp")
    tok.save(tmp_path / "again")
    hf = AutoTokenizer.from_pretrained(tmp_path / "again")
    assert (hf.cls_token, hf.sep_token, hf.model_max_length, hf.padding_side) == ("[CLS]", "[SEP]", 512, "left")
    assert hf.convert_tokens_to_ids(["[CLS]", "[SEP]", "c"]) == [2, 3, 8] and len(hf) == len(vocab)
    assert load_tokenizer(tmp_path / "again").fingerprint == tok.fingerprint
    # transformers 5 saves a chat template beside the config, in chat_template.jinja: kept too
    (tmp_path / "wp" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    load_tokenizer(tmp_path / "wp").save(tmp_path / "chat")
    assert AutoTokenizer.from_pretrained(tmp_path / "chat").chat_template.startswith("{% for m in messages %}")
    # a cls/sep the vocabulary lacks is not written (HF would add it as a new id)
    cfg = json.loads((tmp_path / "wp" / "tokenizer_config.json").read_text())
    (tmp_path / "wp" / "tokenizer_config.json").write_text(json.dumps({**cfg, "cls_token": "<cls>"}))
    load_tokenizer(tmp_path / "wp").save(tmp_path / "third")
    assert AutoTokenizer.from_pretrained(tmp_path / "third").cls_token is None
