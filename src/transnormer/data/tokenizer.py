"""Tokenizers: a byte-level BPE trained on a corpus (cached), or any saved / Hugging Face tokenizer.

:class:`TextTokenizer` is the one small interface the rest of the data code uses::

    tok = build_tokenizer(corpus, vocab_size=8192)      # trained once, then read from the cache
    ids = tok.encode("Return the sum.")                  # no special tokens added
    tok.decode(ids) == "Return the sum."                 # byte-level BPE round-trips exactly
    tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id
    tok.save("out/tokenizer")                            # loadable by load_tokenizer and AutoTokenizer
    hf = tok.to_hf()                                     # transformers.PreTrainedTokenizerFast

The trained BPE has special tokens ``<pad>=0, <s>=1, </s>=2, <unk>=3, <mask>=4``. ``encode`` treats text
that happens to spell a special token (``"<s>"`` inside a docstring) as ordinary text, so raw data can
never inject control tokens; only the code that builds sequences inserts specials, by id. (A Python
"slow" transformers tokenizer, one without a ``tokenizer.json``, cannot do that: ``encode`` refuses
such text with a ValueError instead of returning the control token.)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from .._files import atomic_write_text, cache_write_text
from ._util import resolve_cache_dir, sha256_text

__all__ = [
    "SPECIAL_TOKENS",
    "TextTokenizer",
    "build_tokenizer",
    "load_tokenizer",
    "train_bpe",
]

SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>", "mask": "<mask>"}
_BPE_FORMAT = 1  # bump when the trained pipeline changes so that cached tokenizers are not reused
MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # specials + the 256 byte symbols

# Names that common tokenizer files use for each role, tried in order when the file says nothing.
_ROLE_CANDIDATES = {
    "pad": ("<pad>", "[PAD]", "<|pad|>", "<|padding|>"),
    "bos": ("<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<|endoftext|>"),
    "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>", "[SEP]"),
    "unk": ("<unk>", "[UNK]", "<|unk|>"),
    "mask": ("<mask>", "[MASK]", "<|mask|>"),
}


def _encoding_backend(json_str: str) -> tokenizers.Tokenizer:
    """The private copy a TextTokenizer encodes with: encode_special_tokens=True, so a literal "<s>" in
    data text stays text, and no truncation or padding, which a loaded tokenizer.json may carry (a
    hub file's 512-token truncation had cut every document short and padded it, into the token
    cache). Neither setting is changed in the JSON, so saved files and to_hf() keep the original's."""
    backend = tokenizers.Tokenizer.from_str(json_str)
    backend.encode_special_tokens = True
    backend.no_truncation()
    backend.no_padding()
    return backend


class TextTokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` (or, for exotic HF tokenizers, a transformers one).

    Args:
        backend: the Rust tokenizer; ``None`` only together with ``hf``.
        special_tokens: role (``pad``/``bos``/``eos``/``unk``/``mask``) → token string; roles not given are
            looked up among common names (``<pad>``, ``[PAD]``, ``<|endoftext|>``, ...).
        hf: a ``transformers`` tokenizer to use when there is no Rust backend.
        name: where it came from (for messages).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer | None = None,
        *,
        special_tokens: dict[str, str | None] | None = None,
        hf=None,
        name: str = "",
        hf_settings: dict | None = None,
    ) -> None:
        if backend is None and hf is None:
            raise ValueError("backend: give a tokenizers.Tokenizer (or hf, a transformers tokenizer)")
        if backend is not None and not isinstance(backend, tokenizers.Tokenizer):
            raise TypeError(f"backend must be a tokenizers.Tokenizer, got {type(backend).__name__}")
        self.name = name
        self._hf = hf
        # HF-side settings the source tokenizer had beyond the five roles (BERT's [CLS]/[SEP],
        # model_max_length, padding_side, ...): kept through save() (they had been dropped)
        self._hf_settings = _hf_settings_of(hf_settings or (getattr(hf, "init_kwargs", None) if hf is not None else None))
        self._hf_vocab: dict[str, int] | None = None
        self._fingerprint: str | None = None
        if backend is not None:
            self._json = backend.to_str()
            self._backend = _encoding_backend(self._json)
        else:
            self._json = None
            self._backend = None
        self._special: dict[str, str | None] = {}
        given = special_tokens or {}
        unknown = set(given) - set(_ROLE_CANDIDATES)
        if unknown:
            raise ValueError(f"special_tokens: unknown role(s) {sorted(unknown)}; use {sorted(_ROLE_CANDIDATES)}")
        for key in ("cls_token", "sep_token"):  # one the vocabulary lacks would be added by HF, shifting ids
            if key in self._hf_settings and self._token_to_id(self._hf_settings[key]) is None:
                del self._hf_settings[key]
        for role, candidates in _ROLE_CANDIDATES.items():
            token = given.get(role)
            if token is not None and self._token_to_id(token) is None:
                raise ValueError(
                    f"special_tokens[{role!r}]={token!r} is not in the vocabulary of {name or 'tokenizer'}"
                )
            if token is None and role not in given:
                token = next((c for c in candidates if self._token_to_id(c) is not None), None)
            self._special[role] = token

    # Copies (pickle: spawned DataLoader workers, multiprocessing; copy.deepcopy) rebuild the backend
    # from the JSON, which does not carry encode_special_tokens: set it again, or a copy would turn
    # a literal "<s>" in data text into the control token under the same fingerprint.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if state["_backend"] is not None:
            state["_backend"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_fingerprint", None)  # pickled before the attribute existed
        self.__dict__.setdefault("_hf_settings", {})
        if self._json is not None:
            self._backend = _encoding_backend(self._json)

    # ------------------------------------------------------------------------------------------ lookup
    def _token_to_id(self, token: str) -> int | None:
        if self._backend is not None:
            return self._backend.token_to_id(token)
        if self._hf_vocab is None:
            self._hf_vocab = dict(self._hf.get_vocab())
        return self._hf_vocab.get(token)

    def _role_id(self, role: str) -> int | None:
        token = self._special.get(role)
        return None if token is None else self._token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids (including added/special tokens): ids are in ``[0, vocab_size)``."""
        if self._backend is not None:
            return self._backend.get_vocab_size(with_added_tokens=True)
        return len(self._hf)

    @property
    def pad_id(self) -> int | None:
        return self._role_id("pad")

    @property
    def bos_id(self) -> int | None:
        return self._role_id("bos")

    @property
    def eos_id(self) -> int | None:
        return self._role_id("eos")

    @property
    def unk_id(self) -> int | None:
        return self._role_id("unk")

    @property
    def mask_id(self) -> int | None:
        return self._role_id("mask")

    @property
    def special_tokens(self) -> dict[str, str | None]:
        """Role → token string (``None`` when the tokenizer has no such token)."""
        return dict(self._special)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of all special tokens: the pad/bos/eos/unk/mask roles plus any other special added token."""
        ids = {self._role_id(r) for r in self._special}
        if self._backend is not None:
            ids |= {int(i) for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special}
        else:
            ids |= set(getattr(self._hf, "all_special_ids", ()))
        return frozenset(i for i in ids if i is not None)

    @functools.cached_property
    def splits_at_line_starts(self) -> bool:
        """Whether cutting a text just after ``"x\\n"`` before a printable ASCII character (``x`` one too)
        leaves its ids unchanged: true of byte-level BPE with GPT-2's pre-tokenizer regex, no prefix
        space and no normalizer (the library's own BPE), where ``"\\n"`` there is a pre-token of its
        own and no merge crosses pre-tokens. Lets the token cache encode a huge document a piece at a
        time (:mod:`~transnormer.data.token_cache`)."""
        if self._json is None:
            return False
        spec = json.loads(self._json)
        pre = spec.get("pre_tokenizer") or {}
        # a non-special added token is matched in the text before pre-tokenization, and may span the cut
        # ("end\nBEGIN") or take the newline before it (lstrip): special ones never match text here
        added = all(t.get("special") for t in spec.get("added_tokens") or [])
        return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex") is True
                and pre.get("add_prefix_space") is False and (spec.get("model") or {}).get("type") == "BPE" and added)

    @property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer's JSON (vocabulary, merges, pipeline) and its special-token roles.

        The post-processor is left out: :meth:`encode` never applies it, and a causal LM's saved
        tokenizer frames text differently (:meth:`save`) from the same tokenizer's under an MLM.
        Truncation and padding count as off, as encoding runs them (``_encoding_backend``): a token
        cache built while they cut documents short no longer matches.

        A tokenizer without a Rust backend (a Python "slow" transformers tokenizer) is fingerprinted by
        the files its ``save_pretrained`` writes: its vocabulary alone would leave out merges and
        options such as ``do_lower_case``, and two tokenizers that encode differently would share a
        token cache.
        """
        if self._fingerprint is None:  # computed once: the tokenizer does not change
            roles = json.dumps(self._special, sort_keys=True)
            if self._json is not None:
                encoding = {k: v for k, v in json.loads(self._json).items() if k != "post_processor"}
                encoding.update(truncation=None, padding=None)
                self._fingerprint = sha256_text(json.dumps(encoding, sort_keys=True, ensure_ascii=False), roles)
            else:
                self._fingerprint = sha256_text(type(self._hf).__name__, *_saved_files(self._hf), roles)
        return self._fingerprint

    # ---------------------------------------------------------------------------------------- encoding
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special token added."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        ids = list(self._hf.encode(text, add_special_tokens=False))
        self._refuse_injected(ids, text)
        return ids

    def _refuse_injected(self, ids: list[int], text: str) -> None:
        # A slow tokenizer matches special tokens' text before it tokenizes, and (unlike the Rust
        # backend) has no switch to stop it; encode adds no special token itself, so any special id
        # but <unk> in its output came from the text.
        injected = self.special_ids - {self.unk_id}
        bad = next((i for i in ids if i in injected), None)
        if bad is not None:
            token = self._hf.convert_ids_to_tokens(bad)
            raise ValueError(
                f"text contains {token!r}, the text of a special token, which {self.name or 'this tokenizer'!r} "
                f"({type(self._hf).__name__}, a Python tokenizer) cannot encode as ordinary text: it would "
                f"become the control token (id {bad}). Use a tokenizer with a tokenizer.json (a fast "
                f"tokenizer), or remove that text; text seen: {text[:80]!r}"
            )

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, in parallel in the Rust backend."""
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}")
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (a list, array or tensor of ints)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids: {bad[0]} is outside [0, vocab_size={self.vocab_size})")
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"TextTokenizer({self.name!r}, vocab_size={self.vocab_size}, specials={self._special})"

    # ----------------------------------------------------------------------------------------- export
    def to_json(self) -> str:
        """The ``tokenizer.json`` content (Rust-backed tokenizers only)."""
        if self._json is None:
            raise TypeError(f"{self.name!r} has no tokenizers backend; it cannot be exported as tokenizer.json")
        return self._json

    def to_hf(self):
        """A ``transformers.PreTrainedTokenizerFast`` with the same vocabulary and special tokens.

        Note: HF's ``tokenizer(text)`` applies the saved post-processor (for trained BPEs:
        ``<s> A </s>`` / ``<s> A </s> B </s>``), unlike :meth:`encode`.
        """
        if self._hf is not None:
            return self._hf
        return self._hf_of(self._json)

    def _hf_of(self, tokenizer_json: str):
        from transformers import PreTrainedTokenizerFast  # heavy import, only when asked for

        kwargs = {f"{role}_token": tok for role, tok in self._special.items() if tok is not None}
        return PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer_json),
                                       **{**self._hf_settings, **kwargs})

    def _framed_json(self, causal: bool) -> str:
        """The JSON with a causal LM's framing, ``</s> A`` (text follows an end of document, as in
        the training stream, where documents each end with EOS and ``<s>`` never occurs); else the
        JSON as it is, but for one read from a causal LM's checkpoint, which gets the trained BPE's
        ``<s> A </s>`` back (an MLM or classifier saved from it had kept the causal framing)."""
        bos, eos = self._special.get("bos"), self._special.get("eos")
        causal_json = self._with_post_processor(None if eos is None else processors.TemplateProcessing(
            single=f"{eos} $A", pair=f"{eos} $A {eos} $B:1", special_tokens=[(eos, self.eos_id)]))
        if causal:
            return causal_json
        if json.loads(causal_json).get("post_processor") != json.loads(self._json).get("post_processor"):
            return self._json
        return self._with_post_processor(
            None if bos is None or eos is None else _bpe_framing(bos, self.bos_id, eos, self.eos_id))

    def _with_post_processor(self, post_processor) -> str:
        tok = tokenizers.Tokenizer.from_str(self._json)
        tok.post_processor = post_processor
        return tok.to_str()

    def save(self, directory: str | os.PathLike, *, causal: bool = False) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` (created).

        The directory loads with :func:`load_tokenizer` and with ``transformers.AutoTokenizer``.
        ``causal``: frame HF-side ``tokenizer(text)`` calls as a causal LM reads text, ``</s> A``,
        instead of ``<s> A </s>``: with that framing ``pipeline("text-generation")`` ended every
        prompt with an end of document. :meth:`encode` and the fingerprint are the same either way.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        js = self._framed_json(causal) if self._json is not None else None
        (self._hf_of(js) if js is not None else self.to_hf()).save_pretrained(str(directory))
        if js is not None:
            # save_pretrained re-serialises the tokenizer; write the exact JSON so fingerprints survive.
            atomic_write_text(directory / "tokenizer.json", js)
        return directory


# tokenizer_config.json entries that describe HF-side behaviour, not encoding (the fingerprint leaves
# them out): what save() writes back beside the roles.
_HF_SETTINGS = ("cls_token", "sep_token", "model_max_length", "padding_side", "truncation_side", "chat_template",
                "clean_up_tokenization_spaces")


def _hf_settings_of(config: dict | None) -> dict:
    """The :data:`_HF_SETTINGS` of a ``tokenizer_config.json`` (or a transformers tokenizer's
    ``init_kwargs``), tokens given as ``{"content": ...}`` read as their text."""
    out = {}
    for key in _HF_SETTINGS:
        value = (config or {}).get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not (key.endswith("_token") and not isinstance(value, str)):
            out[key] = value if isinstance(value, (str, int, float, bool, list)) else str(value)
    return out


def _bpe_framing(bos: str, bos_id: int, eos: str, eos_id: int):
    """``<s> A </s>`` / ``<s> A </s> B </s>``: the trained BPE's framing of HF-side calls."""
    return processors.TemplateProcessing(single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B:1 {eos}:1",
                                         special_tokens=[(bos, bos_id), (eos, eos_id)])


def _saved_files(hf) -> list[str]:
    """``name\0sha256`` of every file ``hf.save_pretrained`` writes, in name order; paths left out."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        parts = []
        for f in sorted(Path(tmp).rglob("*")):
            if not f.is_file():
                continue
            data = f.read_bytes()
            if f.name == "tokenizer_config.json":
                config = json.loads(data)
                for key in ("name_or_path", "tokenizer_file"):  # where it was loaded from, not what it does
                    config.pop(key, None)
                data = json.dumps(config, sort_keys=True).encode()
            parts.append(f"{f.relative_to(tmp).as_posix()}\0{hashlib.sha256(data).hexdigest()}")
    return parts


# ---------------------------------------------------------------------------------------------- training


def train_bpe(
    texts: Iterable[str],
    vocab_size: int = 8192,
    *,
    min_frequency: int = 2,
    show_progress: bool = False,
    length: int | None = None,
) -> TextTokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenisation, no prefix space) on ``texts``.

    Args:
        texts: training documents.
        vocab_size: target size including the 5 special tokens and 256 byte symbols (>= 261). The result
            can be smaller when the text has too few distinct pairs.
        min_frequency: pairs seen fewer times are not merged.
        length: number of texts, only for the progress bar.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (5 special tokens + 256 bytes), got {vocab_size}")
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise ValueError(f"min_frequency must be an int >= 1, got {min_frequency!r}")
    if isinstance(texts, str):
        raise TypeError("texts must be an iterable of str, not a single str")
    tok = tokenizers.Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS.values())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,  # first, so they get ids 0..4 in SPECIAL_TOKENS order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    bos, eos = SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"]
    # Only used by HF-side tokenizer(text) calls (RoBERTa-like framing); our encode() adds nothing.
    tok.post_processor = _bpe_framing(bos, tok.token_to_id(bos), eos, tok.token_to_id(eos))
    return TextTokenizer(tok, special_tokens=dict(SPECIAL_TOKENS), name="bpe")


def build_tokenizer(
    corpus,
    vocab_size: int = 8192,
    *,
    cache_dir: str | os.PathLike | None = None,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> TextTokenizer:
    """Byte-level BPE trained on ``corpus.splits["train"]``, cached by corpus fingerprint and settings.

    The cache file is ``<cache_dir>/tokenizers/bpe-<corpus fp>-v<vocab>-m<min_freq>-f<format>.json``,
    written atomically, so a second call with the same corpus and options does not train again.
    """
    fingerprint = getattr(corpus, "fingerprint", None)
    splits = getattr(corpus, "splits", None)
    if not fingerprint or not isinstance(splits, dict) or "train" not in splits:
        raise TypeError("corpus must be a Corpus (with .fingerprint and a 'train' split); see load_corpus")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB}, got {vocab_size!r}")
    path = (
        resolve_cache_dir(cache_dir)
        / "tokenizers"
        / f"bpe-{fingerprint[:20]}-v{vocab_size}-m{min_frequency}-f{_BPE_FORMAT}.json"
    )
    if path.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
            return TextTokenizer(backend, special_tokens=dict(SPECIAL_TOKENS), name=str(path))
        except Exception:  # noqa: BLE001 - a corrupt cache file is rebuilt, never fatal
            pass
    train = splits["train"]
    tok = train_bpe(train, vocab_size, min_frequency=min_frequency, show_progress=show_progress, length=len(train))
    if cache_write_text(path, tok.to_json()):
        tok.name = str(path)
    return tok


# ----------------------------------------------------------------------------------------------- loading


def _read_config(f: Path) -> dict:
    """A tokenizer folder's JSON config ({} when missing)."""
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{str(f)!r} is not valid JSON: {e}") from e
    return cfg if isinstance(cfg, dict) else {}


def _config_specials(directory: Path) -> dict[str, str | None]:
    """Special tokens named in tokenizer_config.json / special_tokens_map.json, if any."""
    found: dict[str, str | None] = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        cfg = _read_config(directory / fname)
        for role in _ROLE_CANDIDATES:
            value = cfg.get(f"{role}_token")
            if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
                value = value.get("content")
            if isinstance(value, str) and role not in found:
                found[role] = value
    return found


def load_tokenizer(spec: str | os.PathLike) -> TextTokenizer:
    """Load a tokenizer from a ``tokenizer.json`` file, a directory, or a Hugging Face name.

    * a file: read with ``tokenizers.Tokenizer.from_file``; special tokens found by common names;
    * a directory with ``tokenizer.json`` (e.g. from :meth:`TextTokenizer.save` or ``save_pretrained``):
      that file, with special tokens from ``tokenizer_config.json`` when present;
    * anything else (a directory without ``tokenizer.json``, a hub name like ``"gpt2"``):
      ``transformers.AutoTokenizer.from_pretrained`` (needs the files locally or network access).
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str or path, got {type(spec).__name__}")
    if not spec:
        raise ValueError("spec must not be empty")
    path = Path(spec).expanduser()
    json_file = path / "tokenizer.json" if path.is_dir() else path
    if json_file.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(json_file))
        except Exception as e:  # the Rust error type is not importable; report the file
            raise ValueError(f"{str(json_file)!r} is not a valid tokenizer.json: {e}") from e
        specials = _config_specials(path) if path.is_dir() else {}
        settings = _read_config(path / "tokenizer_config.json") if path.is_dir() else {}
        if path.is_dir() and (path / "chat_template.jinja").is_file():  # (transformers 5 writes it apart)
            settings = {**settings, "chat_template": (path / "chat_template.jinja").read_text(encoding="utf-8")}
        return TextTokenizer(backend, special_tokens=specials, name=str(path), hf_settings=settings)
    if path.is_dir():
        pass  # e.g. a sentencepiece-only directory: AutoTokenizer below knows how to read it
    elif spec.startswith((".", "/", "~")) or path.suffix == ".json":
        raise FileNotFoundError(f"tokenizer {spec!r}: no such file or directory")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is a hard dependency
        raise ImportError(f"loading tokenizer {spec!r} needs the transformers package") from e
    try:
        hf = AutoTokenizer.from_pretrained(spec)
    except Exception as e:
        raise ValueError(
            f"could not load tokenizer {spec!r}: not a tokenizer.json file or directory, and "
            f"AutoTokenizer.from_pretrained failed ({type(e).__name__}: {e})"
        ) from e
    backend = getattr(hf, "backend_tokenizer", None)
    specials = {
        role: getattr(hf, f"{role}_token", None) for role in _ROLE_CANDIDATES if getattr(hf, f"{role}_token", None)
    }
    if not isinstance(backend, tokenizers.Tokenizer):
        backend = None
    return TextTokenizer(backend, hf=hf, special_tokens=specials, name=spec)
