"""Turn a ``--data`` spec into step-indexed training batches and an evaluation function, per task.

    clm: corpus → BPE tokenizer → token cache → contiguous windows (labels = inputs; the model shifts)
    mlm: whole-sentence blocks (<s> first, padded; ``mlm_packing="contiguous"``: the clm windows), each
         row masked 15% (80/10/10) from a generator seeded by (seed, optimizer step, the row's index in
         the global batch): the same masks on any number of ranks; evaluation rows by their index in
         the split, under one seed for every run (``EVAL_MASK_SEED``)
    cls: TSV/CSV/JSONL files (GLUE layout) → tokenized examples → padded batches

Every batch source has ``__next__``, ``state_dict()`` and ``load_state_dict()``, and batch k is a
pure function of (seed, k), so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..data.corpus import Corpus, load_corpus
from ..data.lm import LMBatchIterator, eval_batches
from ..data.mlm import mask_tokens
from ..data.mlm_blocks import BlockBatchIterator, eval_block_batches, line_end_ids
from ..data.sampler import StepBatchSampler
from ..data.token_cache import build_token_cache
from ..data.tokenizer import build_tokenizer
from .distributed import DistInfo, all_reduce_sum, forwards_in_step, forwards_to_match, main_first
from .evaluate import evaluate_classifier

# The seed of the MLM evaluation masks, whatever the training seed (it had been seed + 1_000_003).
EVAL_MASK_SEED = 1_000_003

CLS_SPLIT_NAMES = {"train": ("train",), "valid": ("dev", "valid", "validation", "val", "dev_matched"),
                   "test": ("test", "test_matched")}
CLS_EXTS = (".tsv", ".csv", ".jsonl", ".json")


@dataclass
class TaskData:
    tokenizer: object
    train: object  # step-indexed batch source
    evaluate: object  # callable(model, split, max_batches) -> dict
    tokens_per_step: int  # tokens one optimizer micro-batch holds on this rank
    num_labels: int | None = None
    extra: dict = field(default_factory=dict)
    eval_split: str = "valid"  # what the training loop evaluates (cls without a dev file: "train")


class MLMBatches:
    """Masks LM windows. Each row's mask depends only on (seed, optimizer step, the row's place in
    that step's global batch), so it is the same whatever the number of ranks and accumulation
    steps the global batch is split over (and a run resumed on another world size sees the masks it
    would have seen). ``windows`` steps once per micro-batch: ``grad_accum`` of them make a step."""

    def __init__(self, windows: LMBatchIterator | BlockBatchIterator | LazyBatches, tokenizer, seed: int, rank: int,
                 world_size: int = 1, grad_accum: int = 1):
        self.windows, self.tok, self.seed, self.rank = windows, tokenizer, seed, rank
        self.world_size, self.grad_accum = world_size, grad_accum
        # Checkpoints saved before the keys were per optimizer step keyed each micro-batch as a step of
        # its own: such a run resumes with those (the same keys unless grad_accum > 1).
        self.micro_batch_keys = False

    def masked(self, batch: dict, step: int, rows=None) -> dict:
        """``rows``: each row's global key (default: its place in the global batch of ``step``)."""
        ids = batch["input_ids"]
        if rows is None:
            rows = range(self.rank * ids.shape[0], (self.rank + 1) * ids.shape[0])
        out_ids, out_labels = [], []
        for r, key in enumerate(rows):
            seed = int(np.random.SeedSequence([self.seed, step, int(key)]).generate_state(1)[0])
            i, lab = mask_tokens(ids[r:r + 1], mask_id=self.tok.mask_id, vocab_size=self.tok.vocab_size,
                                 special_ids=self.tok.special_ids, generator=torch.Generator().manual_seed(seed))
            out_ids.append(i)
            out_labels.append(lab)
        ids, labels = torch.cat(out_ids), torch.cat(out_labels)
        if "labels" in batch:  # evaluation windows mark tokens an earlier window scored with -100
            labels = labels.masked_fill(batch["labels"] == -100, -100)
        out = {"input_ids": ids, "labels": labels}
        if "attention_mask" in batch:  # whole-sentence blocks are padded (padding is never masked)
            out["attention_mask"] = batch["attention_mask"]
        return out

    def __next__(self) -> dict:
        micro = self.windows.state_dict()["step"]
        batch = next(self.windows)
        if self.micro_batch_keys:
            return self.masked(batch, micro)
        step, k = divmod(micro, self.grad_accum)
        B = batch["input_ids"].shape[0]
        first = (k * self.world_size + self.rank) * B  # this micro-batch's rows in the step's global batch
        return self.masked(batch, step, rows=range(first, first + B))

    def state_dict(self) -> dict:  # the keys this run masks with, so that every later resume keeps them
        return {**self.windows.state_dict(), "mask_keys": "micro-batch" if self.micro_batch_keys else "optimizer-step"}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        keys = state.pop("mask_keys", None)
        self.micro_batch_keys = keys == "micro-batch" or (keys is None and self.grad_accum > 1)
        self.windows.load_state_dict(state)


class LazyBatches:
    """A batch source made at first use (``__next__``, ``state_dict``, ``load_state_dict``):
    evaluating a model (``transnormer eval``) builds the task's data too, and must not need a
    train split that fills a global batch."""

    def __init__(self, make):
        self._make, self._source = make, None

    @property
    def source(self):
        if self._source is None:
            self._source = self._make()
        return self._source

    def __next__(self) -> dict:
        return next(self.source)

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)


class ClsBatches:
    """Training batches of a classification split. The sampler is made at first use: evaluating a
    model (``transnormer eval``) builds the task's data too, and must not need a train split of at
    least one batch."""

    def __init__(self, dataset, collate, batch_size: int, info: DistInfo, seed: int):
        self.dataset, self.collate, self._sampler = dataset, collate, None
        self.batch_size, self.info, self.seed = batch_size, info, seed

    @property
    def sampler(self) -> StepBatchSampler:
        if self._sampler is None:
            self._sampler = StepBatchSampler(len(self.dataset), self.batch_size, seed=self.seed, rank=self.info.rank,
                                             world_size=self.info.world_size)
        return self._sampler

    def __next__(self) -> dict:
        return self.collate([self.dataset[int(i)] for i in next(self.sampler)])

    def state_dict(self) -> dict:
        fingerprint = getattr(self.dataset, "fingerprint", None)  # (the LM batches keep their tokens')
        return {**self.sampler.state_dict(), **({"data": fingerprint} if fingerprint else {})}

    def load_state_dict(self, state: dict) -> None:
        saved, now = state.get("data") if isinstance(state, dict) else None, getattr(self.dataset, "fingerprint", None)
        if saved and now and saved != now:  # (a checkpoint from before the fingerprint has none)
            raise ValueError(f"the training split is not the one the run was saved with (fingerprint {now[:12]} "
                             f"now, {saved[:12]} saved: edited or regenerated data, or another tokenizer)")
        self.sampler.load_state_dict(state)


def get_tokenizer(cfg, corpus: Corpus | None, info: DistInfo):
    """The run's tokenizer: a given one, the one of the model a run starts from (its embeddings
    are indexed by that tokenizer's ids), or a BPE trained (once, by rank 0) on the training split."""
    if cfg.init_from:
        from .checkpoint import model_tokenizer, resolve_model_dir

        return model_tokenizer(resolve_model_dir(cfg.init_from, what="init_from"), cfg.tokenizer,
                               flag="tokenizer (--tokenizer)")
    if cfg.tokenizer:
        from .checkpoint import tokenizer_from_arg

        return tokenizer_from_arg(cfg.tokenizer)
    if corpus is None:
        raise ValueError("tokenizer: this task needs --tokenizer (or --init-from a checkpoint that has one)")
    return main_first(info, lambda: build_tokenizer(corpus, cfg.vocab_size, cache_dir=cfg.cache_dir))


def _token_splits(cfg, info: DistInfo):
    corpus = load_corpus(cfg.data, cache_dir=cfg.cache_dir, seed=cfg.data_seed)
    tok = get_tokenizer(cfg, corpus, info)
    tokens = main_first(info, lambda: build_token_cache(corpus, tok, cache_dir=cfg.cache_dir))
    return corpus, tok, tokens


def _split_tokens(cfg, tokens: dict, split: str, purpose: str):
    """One split's token stream, checked when a job first uses it (``purpose`` "training": a window
    of seq_len + 1 tokens; "evaluation": 2 tokens, as a shorter split is scored in one window)."""
    if split not in tokens:
        raise ValueError(f"split must be one of {sorted(tokens)}, got {split!r}")
    minimum = cfg.seq_len + 1 if purpose == "training" else 2
    if len(tokens[split]) < minimum:
        raise ValueError(f"data: the {split} split of {cfg.data!r} has {len(tokens[split])} tokens, "
                         f"fewer than the {minimum} {purpose} needs")
    return tokens[split]


@torch.no_grad()
def _eval_lm(model, batches, info: DistInfo, max_batches: int | None, autocast, shift: bool) -> dict:
    """Token-weighted mean cross-entropy over the scored targets, and its perplexity.

    ``shift``: causal LM (predict token t+1 at t); MLM labels sit at their own positions.
    """
    was_training = model.training  # (put back: a model in eval mode had come back in training mode)
    model.eval()
    total, count = 0.0, 0
    batches = itertools.islice(batches, max_batches)
    extra = 0
    if forwards_in_step(model, info):  # counted first (held in memory) for forwards_to_match
        batches = list(batches)
        extra = forwards_to_match(model, len(batches), info)
    for batch in itertools.chain(batches, [None] * extra):
        filler = batch is None  # an FSDP rank in step with the others: its result is not used
        batch = {k: v.to(info.device) for k, v in (_filler(batches) if filler else batch).items()}
        with autocast():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False,
                           return_dict=True).logits
        if filler:
            continue
        labels = batch["labels"]
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
        total += float(loss)
        count += int((labels != -100).sum())
    model.train(was_training)
    total, count = all_reduce_sum([total, count], info)
    loss = total / count if count else float("nan")  # nothing scored: no loss (0 would read as perfect)
    # exp(loss) itself (it had been capped at e^50 without a word); inf only past float's range
    return {"loss": loss, "ppl": math.exp(loss) if not loss > 709.0 else math.inf, "eval_tokens": int(count)}


def _filler(batches: list[dict]) -> dict:
    """The inputs of a forward whose result is not used (:func:`forwards_to_match`): the rank's
    first batch, or one token when it has none."""
    if batches:
        return {k: v for k, v in batches[0].items() if k in ("input_ids", "attention_mask")}
    return {"input_ids": torch.zeros((1, 1), dtype=torch.long)}


def _find_cls_files(spec: str, require_train: bool = True) -> dict[str, Path]:
    root = Path(spec)
    if root.is_file():
        return {"train": root}
    if not root.is_dir():
        raise ValueError(f"data: {spec!r} is neither a classification file nor a directory of them")
    files: dict[str, Path] = {}
    for split, names in CLS_SPLIT_NAMES.items():
        for name in names:
            hits = [root / f"{name}{ext}" for ext in CLS_EXTS if (root / f"{name}{ext}").is_file()]
            if hits:
                files[split] = hits[0]
                break
    if require_train and "train" not in files:
        raise ValueError(f"data: no train.{{tsv,csv,jsonl}} in {root}")
    if not files:
        raise ValueError(f"data: no train, valid or test .{{tsv,csv,jsonl}} file in {root}")
    return files


def build_task_data(cfg, info: DistInfo, autocast, *, labels=None, splits: tuple[str, ...] | None = None) -> TaskData:
    """Everything the loop needs from the data side for ``cfg.task``.

    For evaluating a classifier (cls) whose classes are known: ``labels``, the model's (a
    ``LabelSet`` of its class names in index order, or ``Scores`` for a regression model), and
    ``splits``, the splits to read. The data's labels are read against them, and no other split is
    needed or tokenized (the label set had been built from the data's train split, which had to be
    there and was read in full)."""
    if cfg.task == "cls" and str(cfg.data).startswith("lra:"):
        from .lra_tasks import build_lra_task_data  # Long Range Arena: "lra:TASK[:ROOT]"

        return build_lra_task_data(cfg, info, autocast)
    if cfg.task in ("clm", "mlm"):
        corpus, tok, tokens = _token_splits(cfg, info)

        def windows():  # the training windows, made at first use (LazyBatches)
            return LMBatchIterator(_split_tokens(cfg, tokens, "train", "training"), cfg.seq_len,
                                   cfg.batch_size, seed=cfg.seed, rank=info.rank, world_size=info.world_size)

        if cfg.task == "clm":
            train = LazyBatches(windows)

            def evaluate(model, split="valid", max_batches=None):
                return _eval_lm(model, eval_batches(_split_tokens(cfg, tokens, split, "evaluation"), cfg.seq_len, cfg.batch_size,
                                                    stride=cfg.eval_stride, rank=info.rank,
                                                    world_size=info.world_size),
                                info, max_batches, autocast, shift=True)
        else:
            if tok.mask_id is None:  # (had failed at the first step, after the model was built)
                raise ValueError(f"task 'mlm' masks tokens and the tokenizer {tok.name!r} has no mask token; "
                                 "use a tokenizer with one (the library's own BPE has <mask>)")
            if cfg.mlm_packing in (None, "complete"):
                # whole sentences, <s> first (fairseq's --sample-break-mode complete: spec §8)
                if tok.pad_id is None:
                    raise ValueError(f"mlm_packing 'complete' pads blocks and the tokenizer {tok.name!r} has no pad "
                                     "token; use mlm_packing 'contiguous' or a tokenizer with one")
                is_end = line_end_ids(tok)
                source = BlockBatchIterator(tokens["train"], is_end, cfg.seq_len, cfg.batch_size, bos_id=tok.bos_id,
                                            pad_id=tok.pad_id, seed=cfg.seed, rank=info.rank,
                                            world_size=info.world_size)  # (makes its blocks at first use)

                def split_rows(split):
                    return eval_block_batches(_split_tokens(cfg, tokens, split, "evaluation"), is_end, cfg.seq_len,
                                              cfg.batch_size, bos_id=tok.bos_id, pad_id=tok.pad_id, rank=info.rank,
                                              world_size=info.world_size)
            else:
                source = LazyBatches(windows)

                def split_rows(split):
                    return eval_batches(_split_tokens(cfg, tokens, split, "evaluation"), cfg.seq_len, cfg.batch_size,
                                        rank=info.rank, world_size=info.world_size, with_index=True)
            train = MLMBatches(source, tok, cfg.seed, info.rank, info.world_size, cfg.grad_accum)
            # the evaluation's masks do not follow the training seed: runs of a seed sweep, and eval
            # (which has no --seed) of any of them, score the same masked positions (seed 0's, as before)
            masker = MLMBatches(source, tok, EVAL_MASK_SEED, info.rank)

            def evaluate(model, split="valid", max_batches=None):
                # each row masked by its index in the split: the same masks on any number of ranks
                masked = (masker.masked(b, 0, rows=b.pop("window").tolist()) for b in split_rows(split))
                return _eval_lm(model, masked, info, max_batches, autocast, shift=False)
        return TaskData(tok, train, evaluate, cfg.batch_size * cfg.seq_len,
                        extra={"corpus": corpus.name, "train_tokens": int(len(tokens["train"]))})

    if cfg.task == "cls":
        from ..data.classification import ClassificationCollator, Scores, load_classification_splits

        given = labels
        found = files = _find_cls_files(cfg.data, require_train=given is None)
        if splits is not None:
            files = {k: v for k, v in files.items() if k in splits}
            if not files:
                lone = " (a single file is read as the train split: --split train)" if Path(cfg.data).is_file() else ""
                raise ValueError(f"--split {' or '.join(splits)}: no such split in --data {cfg.data} (it has "
                                 f"{', '.join(f'{k}: {v.name}' for k, v in found.items())}){lone}")
        if cfg.tokenizer or cfg.init_from:  # (the model's own, or --tokenizer checked against it)
            tok = get_tokenizer(cfg, None, info)
        else:  # a BPE trained on the training texts (of the data found, whichever splits are read)
            from ..data.classification import read_classification_file

            if "train" not in found:
                raise ValueError(f"data: no train file in {cfg.data} to train a tokenizer on; give the model's "
                                 "tokenizer (tokenizer= / --tokenizer, or init_from= / --init-from)")
            # (labels required here too: a file without them had been told "or require_labels=False", which
            # no CLI flag sets and training cannot use)
            texts = [" ".join(t for t in (ex.text, ex.text_pair) if t)
                     for ex in read_classification_file(found["train"], **{**cfg.cls_read_kwargs, "require_labels": True})]
            tok = get_tokenizer(cfg, Corpus(name=str(found["train"]), splits={"train": texts}), info)
        read = dict(max_length=cfg.seq_len, truncate=not cfg.no_truncate, **cfg.cls_read_kwargs)
        # training and validation rows need labels, whatever the file is called (a training file named
        # like sst_test.tsv had taken an empty label as "unlabelled", and failed steps later, unnamed)
        labelled = {k: v for k, v in files.items() if k != "test"}
        datasets, labels = (load_classification_splits(labelled, tok, label_set=given, **{"require_labels": True, **read})
                            if labelled else ({}, given))
        if isinstance(given, Scores) and datasets and all(float(y).is_integer() for ds in datasets.values()
                                                          for y in ds.labels if y is not None):
            # (a regressor on class data is scored as a regression: say that it looks like classes)
            warnings.warn(f"{cfg.data}: every label is a whole number, as class labels are, and the model is a "
                          "regression (one output): they are scored as real-valued scores", stacklevel=2)
        if given is None and not isinstance(labels, Scores) and len(labels.names) < 2:  # (one output: regression)
            raise ValueError(f"{files['train']}: every training example has the label {labels.names[0]!r}; a "
                             "classifier needs at least two classes")
        unusable = {}
        if "test" in files:  # often unlabelled (GLUE): training goes on, evaluating it says why not
            try:
                test = load_classification_splits({"test": files["test"]}, tok, label_set=labels, **read)[0]["test"]
                if any(y is None for y in test.labels):
                    raise ValueError(f"{files['test']} has unlabelled rows")
                datasets["test"] = test
            except ValueError as e:
                unusable["test"] = str(e)
        # padded positions are masked: a tokenizer without a pad token (GPT-2's) pads with its EOS
        collate = ClassificationCollator(tok.pad_id if tok.pad_id is not None else tok.eos_id,
                                         scores=isinstance(labels, Scores))
        eval_split = "valid" if "valid" in datasets or "train" not in datasets else "train"
        truncated = {split: ds.num_truncated for split, ds in datasets.items() if ds.num_truncated}
        for split, n in truncated.items() if info.is_main else ():  # a cut example reads as another: say so
            print(f"cls: truncated {n} of {len(datasets[split])} {split} examples to seq_len={cfg.seq_len} "
                  "tokens (--no-truncate refuses them instead)")

        def evaluate(model, split=eval_split, max_batches=None):
            if split not in datasets:
                why = unusable.get(split, f"the labelled splits are {sorted(datasets)}")
                raise ValueError(f"split {split!r} of {cfg.data} cannot be evaluated: {why}")
            res = evaluate_classifier(model, datasets[split], collate, info, cfg.batch_size, max_batches, autocast)
            # "eval_split": without a dev file the run scores its training split, which tables must say
            return {**res, "truncated": datasets[split].num_truncated, "eval_split": split}  # (of the whole split)

        train = ClsBatches(datasets["train"], collate, cfg.batch_size, info, cfg.seed) if "train" in datasets else None
        return TaskData(tok, train, evaluate,
                        cfg.batch_size * cfg.seq_len, num_labels=len(labels.names),
                        extra={"label_set": labels, "truncated": truncated}, eval_split=eval_split)
    raise ValueError(f"task must be 'clm', 'mlm' or 'cls', got {cfg.task!r}")
