"""``transnormer train|eval|compare|generate|lra|analyze|bench``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from ._files import atomic_write_text


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def bpe_vocab_size(text: str) -> int:
    """argparse type: the size of a byte-level BPE, at least its special tokens and 256 bytes (the
    tokenizer's own check had named ``vocab_size``, not the flag)."""
    from .data.tokenizer import MIN_VOCAB

    want = f"expected an integer >= {MIN_VOCAB} (the BPE's special tokens and 256 byte symbols)"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{want}, got {text!r}") from None
    if value < MIN_VOCAB:
        raise argparse.ArgumentTypeError(f"{want}, got {value}")
    return value


def seed_int(text: str) -> int:
    """argparse type: a seed, an integer in [0, 2**32) (numpy's range; torch's is wider)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed in [0, 2**32), got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer seed in [0, 2**32), got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return value


def _column(value: str) -> int | str:
    """A column name, or (all digits) a 0-based column index: a header-less file has no names."""
    return int(value) if value.isdigit() else value


CLS_COLUMNS = ("text_column", "text_pair_column", "label_column")


def _add_cls_column_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-column", type=_column, help="cls: column name or 0-based index (default: detected)")
    p.add_argument("--text-pair-column", type=_column)
    p.add_argument("--label-column", type=_column)
    p.add_argument("--header", choices=["auto", "yes", "no"], default="auto",
                   help="cls: whether a TSV/CSV file's first row names its columns (default: detected; say 'no' "
                        "for a header-less file whose first row could read as names)")
    p.add_argument("--drop-label", action="append", metavar="LABEL",
                   help="cls: skip rows with this label (repeatable), e.g. '-' for SNLI's no-consensus rows")
    p.add_argument("--skip-bad-rows", action="store_true",
                   help="cls: skip TSV/CSV rows with too many or too few fields (a stray delimiter) instead of "
                        "refusing the file")


def _cls_read_kwargs(args) -> dict:
    """The reading flags given (an index 0 included); refused for a task that reads no columns."""
    read = {k: getattr(args, k) for k in CLS_COLUMNS if getattr(args, k, None) is not None}
    if getattr(args, "header", "auto") != "auto":
        read["has_header"] = args.header == "yes"
    if getattr(args, "drop_label", None):
        read["drop_labels"] = list(args.drop_label)
    if getattr(args, "skip_bad_rows", False):
        read["skip_bad_rows"] = True
    if args.task != "cls" and (read or getattr(args, "no_truncate", False)):
        raise ValueError(f"--text-column, --text-pair-column, --label-column, --header, --drop-label, "
                         f"--skip-bad-rows and --no-truncate apply to --task cls only, not --task {args.task}")
    return read


def _add_mlm_packing_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mlm-packing", choices=["complete", "contiguous"],
                   help="mlm samples: whole sentences packed up to --seq-len with <s> first (complete, the "
                   "paper's fairseq recipe; default) or contiguous windows of the token stream")


def _add_train_args(p: argparse.ArgumentParser, *, preset_required: bool = False) -> None:
    from .train.loop import TrainConfig

    d = TrainConfig()
    p.add_argument("--task", default="clm", choices=["clm", "mlm", "cls"])
    if not preset_required:
        p.add_argument("--preset", help=f"preset name (python -m transnormer.presets; default: {d.preset}); "
                       "not with --config or --init-from")
        p.add_argument("--config", dest="config_file", help="a config.json instead of a preset")
        p.add_argument("--init-from", help="pretrained model directory to fine-tune")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (JSON value), e.g. --set dropout=0.0; layer_options is merged "
                        "into the preset's per layer type, e.g. --set 'layer_options={\"flash\": {\"normalizer\": \"chunk\"}}'")
    p.add_argument("--data", default=d.data, help="'stdlib' (default, offline), a path, or hf:NAME[:CONFIG][#COLUMN]")
    p.add_argument("--tokenizer", help="saved tokenizer or HF name; default: train a BPE on the data")
    p.add_argument("--vocab-size", type=bpe_vocab_size,
                   help=f"of the BPE trained on the data (default: {d.vocab_size}); not with --tokenizer"
                        + ("" if preset_required else " or --init-from"))  # (compare has no --init-from)
    p.add_argument("--cache-dir")
    _add_cls_column_args(p)
    p.add_argument("--no-truncate", action="store_true", help="cls: error on over-long examples")
    _add_mlm_packing_arg(p)
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len)
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="per process and micro-step")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum)
    p.add_argument("--max-steps", type=int, help="with --budget too, the run stops at whichever comes first")
    p.add_argument("--budget", help="tokens ('200k', '2M') or time ('90s', '5min'); with --max-steps too, the run "
                   "stops at whichever comes first (a token budget's schedule follows the smaller of the two, a "
                   "time budget's follows --max-steps)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                   help=f"cosine only: the final lr as a fraction of --lr (default {d.min_lr_ratio})")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--warmup-init-lr", type=float, default=d.warmup_init_lr)
    p.add_argument("--schedule", default=d.schedule, choices=["cosine", "inverse_sqrt", "polynomial", "constant"])
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--weight-decay-all", action="store_true",
                   help="decay biases, norm gains, LRPE θ and GAU/FLASH's γ, β too (default: weight matrices "
                   "only); fairseq's Adam, the paper's")
    p.add_argument("--betas", type=float, nargs=2, default=list(d.betas))
    p.add_argument("--adam-eps", type=float, default=d.adam_eps)
    p.add_argument("--clip", type=float, default=d.clip, help="gradient-norm clipping; 0 = off")
    p.add_argument("--dtype", default=d.dtype, choices=["fp32", "bf16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute blocks in the backward")
    p.add_argument("--strategy", default=d.strategy, choices=["ddp", "fsdp"])
    p.add_argument("--sync-batch-norm", action="store_true",
                   help="under torchrun, batch norm statistics over every process (default: per process)")
    p.add_argument("--device")
    p.add_argument("--seed", type=seed_int, default=d.seed)
    p.add_argument("--out", dest="out_dir", default=d.out_dir)
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="steps; 0 = at the end only (compare: 0 = 8 evaluations per run)")
    p.add_argument("--eval-batches", type=positive_int, default=d.eval_batches,
                   help="batches each process evaluates (under torchrun the split is shared out, so N processes "
                   "score up to N times as many; default: %(default)s)")
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--keep-last", type=int, default=d.keep_last,
                   help="checkpoints kept (the newest; 0 = all; default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --out")
    p.add_argument("--grad-stats", action="store_true", help="record attention-gradient norms (RSD analysis)")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def parse_overrides(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items → {KEY: VALUE}, VALUE parsed as JSON when it is JSON, else a string."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def saved_data_spec(data):
    """``--data`` as a run saves it: a local file or folder made absolute, so that ``eval`` run from another
    folder finds the run that trained on it (the data seed and a classifier's reading options); the
    embedded ``stdlib``, ``hf:`` and ``lra:`` names (LRA resolves its own folder) as given."""
    if not isinstance(data, str) or data == "stdlib" or data.startswith(("hf:", "lra:")) or not data.strip():
        return data
    path = Path(data).expanduser()
    # absolute, links not followed: the corpus reader takes split, suffix and compression from the
    # names (a Hugging Face snapshot's files link to blobs named by hash); a pipe stays as given
    return os.path.abspath(path) if path.is_file() or path.is_dir() else data


def _train_config(args) -> object:
    from .train.loop import TrainConfig

    overrides = parse_overrides(args.set)  # a ValueError: exit status 2 with the command's prefix
    read = _cls_read_kwargs(args)
    if args.vocab_size is not None and (args.tokenizer or getattr(args, "init_from", None)):
        raise ValueError("--vocab-size sizes the BPE trained on the data; with --tokenizer or --init-from the "
                         "given tokenizer's vocabulary is used: leave --vocab-size out")
    model_from = "--init-from" if getattr(args, "init_from", None) else "--config" if getattr(args, "config_file", None) else None
    if model_from and getattr(args, "preset", None):
        raise ValueError(f"--preset names a model to build; with {model_from} the model is that one: leave --preset out")
    fields = TrainConfig.__dataclass_fields__
    kw = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if model_from:
        kw["preset"] = None  # (train_config.json had recorded the default preset as the run's)
    kw["betas"] = tuple(args.betas)
    if "data" in kw:
        kw["data"] = saved_data_spec(kw["data"])
    return TrainConfig(overrides=overrides, cls_read_kwargs=read, **kw)


def cmd_train(args) -> int:
    from .train import train

    summary = train(_train_config(args))
    main = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 reports (the others lack its metrics)
    # the status and its message first: a reader of stdout that goes away while the summary is
    # printed ends the command with 141, and the run's own status must have been said by then
    rc, message = 0, None
    if summary.get("interrupted_at") is not None:  # Ctrl-C / SIGTERM: saved, to be resumed
        rc, message = 130, (f"transnormer train: interrupted after step {summary['interrupted_at']}; the checkpoint "
                            "is saved: run the same command with --resume to continue")
    elif summary.get("diverged_at") is not None:  # a failed run: scripts must not take it for a model
        rc, message = 1, (f"transnormer train: error: the run diverged at step {summary['diverged_at']} (non-finite "
                          "loss or gradient); its weights were not saved, earlier checkpoints are kept (try a lower "
                          "--lr or --clip)")
    if main:
        if message:
            print(message, file=sys.stderr)
        print(json.dumps(summary, indent=1, default=str))
    return rc


def cmd_compare(args) -> int:
    from .train.compare import compare

    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if not presets:
        raise ValueError(f"--presets: give one or more comma-separated preset names, got {args.presets!r}")
    if args.sample and args.task != "clm":  # generation needs a causal LM: said before the runs, not after
        raise ValueError(f"--sample generates text and needs --task clm, not --task {args.task}")
    if args.sample_prompt is not None and not args.sample:  # (it had been read by nothing, silently)
        raise ValueError("--sample-prompt is the prompt of --sample: give --sample too")
    args.preset = presets[0]
    cfg = _train_config(args)
    result = compare(presets, cfg)
    diverged = [f"{s['name']} at step {s['diverged_at']}" for s in result["summaries"]
                if s.get("diverged_at") is not None]
    if result["plot"] is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 1 if diverged else 0
    if args.sample:
        # from the first preset that finished (a diverged run saves no weights: it had ended the command
        # with "--model: no model", before the divergence was reported)
        done = [p for s, p in zip(result["summaries"], presets, strict=True) if s.get("diverged_at") is None]
        if done:
            first = Path(cfg.out_dir) / done[0]
            print(f"\nsample from {done[0]} (greedy, checkpoint {resolve_model_dir(first)}):")
            prompt = "Return the" if args.sample_prompt is None else args.sample_prompt
            generate_text(first, prompt, max_new_tokens=40, temperature=0.0, top_p=1.0, stream=True)
        else:
            print("\nno sample: every run diverged")
    print(f"\nwrote {Path(cfg.out_dir) / 'comparison.md'} and {result['plot']}")
    if diverged:  # the table says so too; scripts must not take the comparison for a finished one
        print(f"transnormer compare: error: run(s) diverged (non-finite loss or gradient): {', '.join(diverged)}",
              file=sys.stderr)
        return 1
    return 0


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory, a checkpoint root, or a run directory → the model directory (``--model``)."""
    from .train.checkpoint import resolve_model_dir as resolve

    return resolve(path, what="--model")


def generate_text(model_path, prompt: str, *, max_new_tokens: int = 50, temperature: float = 0.8,
                  top_p: float = 0.95, top_k: int = 0, tokenizer: str | None = None, stream: bool = True,
                  seed: int = 0) -> str:
    """Sample (or, at temperature 0, greedily decode) a continuation of ``prompt``. ``top_k`` 0 keeps
    every token (transformers' own default, 50, had been applied whatever --top-p said)."""
    import torch
    from transformers import AutoModelForCausalLM, TextStreamer

    from . import models  # noqa: F401  (registers the Auto classes)
    from .train.checkpoint import model_tokenizer

    model_dir = resolve_model_dir(model_path)
    _check_head_for("clm", model_dir, flag="generate needs")  # a classifier's config had failed inside HF
    tok = model_tokenizer(model_dir, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if tok.vocab_size > model.config.vocab_size:  # its ids past the embedding would fail inside the model
        raise ValueError(f"--tokenizer has {tok.vocab_size} ids, more than the model's vocab_size "
                         f"{model.config.vocab_size}: use the tokenizer the model was trained with")
    # The training stream is documents each followed by EOS (data/token_cache.py), so a document
    # starts after an EOS there; <s> never occurs in it, and starting from it costs ~3 nats.
    ids = ([tok.eos_id] if tok.eos_id is not None else []) + tok.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty and the tokenizer has no EOS to start from: give a prompt")
    _check_decodable_length(model, len(ids), max_new_tokens)
    input_ids = torch.tensor([ids])
    hf_tok = tok.to_hf()
    streamer = TextStreamer(hf_tok, skip_prompt=False, skip_special_tokens=True) if stream else None
    if not 0 <= temperature < float("inf"):  # inf samples uniformly, whatever the model says
        raise ValueError(f"--temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if 0 < temperature < 1e-6:  # logits / 1e-45 (0 in fp32) had ended in a NaN traceback from sampling
        raise ValueError(f"--temperature must be 0 (greedy) or at least 1e-6, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"--top-k must be an int >= 0 (0: no cut), got {top_k!r}")
    torch.manual_seed(seed)
    sample = temperature > 0
    # A model wider than its tokenizer (--set vocab_size=N, padded for speed) must not sample an id
    # the tokenizer cannot decode: it had failed at the end, after streaming the text.
    beyond = list(range(tok.vocab_size, model.config.vocab_size)) or None
    out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=sample,
                         temperature=temperature if sample else None, top_p=top_p if sample else None,
                         top_k=top_k if sample else None, streamer=streamer, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id,
                         attention_mask=torch.ones_like(input_ids), suppress_tokens=beyond)
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def _check_decodable_length(model, n_prompt: int, max_new_tokens: int) -> None:
    """Refuse, before generating, a prompt + --max-new-tokens past a position the model has no encoding
    for (learned positions, a causal cosFormer's M): it had failed after streaming part of the text
    (all of it lost with --no-stream), naming a config field."""
    from .layers.cosformer import CosFormerAttention
    from .modules.positional import LearnedPositions

    limits = [(m.max_positions, "its learned positions (max_position_embeddings)") for m in model.modules()
              if isinstance(m, LearnedPositions)]
    limits += [(m.max_len, "its cosFormer re-weighting length M (max_len)") for m in model.modules()
               if isinstance(m, CosFormerAttention) and m.max_len is not None]
    if not limits:
        return
    limit, what = min(limits)
    needed = n_prompt + max_new_tokens - 1  # positions 0 .. needed - 1 are read (the last token is not fed back)
    if needed > limit:
        # (a prompt too long by itself had been told "at most --max-new-tokens 0", which the flag refuses)
        fix = (f"give at most --max-new-tokens {limit - n_prompt + 1} or a shorter prompt" if n_prompt <= limit
               else f"the prompt alone is too long: shorten it to at most {limit} tokens, the EOS included")
        raise ValueError(f"--prompt ({n_prompt} tokens, with the EOS that starts it) + --max-new-tokens "
                         f"{max_new_tokens} needs {needed} positions, but the model has {limit} ({what}): {fix}")


def cmd_generate(args) -> int:
    text = generate_text(args.model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         top_p=args.top_p, top_k=args.top_k, tokenizer=args.tokenizer, stream=not args.no_stream,
                         seed=args.seed)
    if args.no_stream:
        print(text)
    return 0


_HEADS = {"clm": "ForCausalLM", "mlm": "ForMaskedLM", "cls": "ForSequenceClassification"}


def _check_head_for(task: str, model_dir: Path, flag: str | None = None) -> None:
    """Refuse a model trained with another head: a language model evaluated with --task cls loaded
    with a fresh random classifier, and its scores were printed with rc 0. ``flag``: what needs the
    head, in the message (default ``--task TASK needs``)."""
    archs = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    if archs and not any(a.endswith(_HEADS[task]) for a in archs):
        trained = next((t for t, h in _HEADS.items() if any(a.endswith(h) for a in archs)), None)
        raise ValueError(f"--model {model_dir} is a {', '.join(archs)}"
                         + (f" (trained with --task {trained})" if trained else "")
                         + f"; {flag or f'--task {task} needs'} a *{_HEADS[task]} model")


def _run_config_for(model_dir: Path, data: str) -> dict:
    """The training config the model's run recorded, when it trained on ``data``; else {}. eval reads
    ``data`` as the run did from it: the seed that carved valid/test out of train (eval had split
    with seed 0, scoring a ``data_seed=3`` run on its training text) and a classifier's columns and
    reading options (a model trained on one column of a pair file had been scored on both)."""
    from .train.checkpoint import saved_train_configs
    from .train.loop import _same_path

    for cfg, _ in saved_train_configs(model_dir)[:1]:
        saved = str(cfg.get("data", ""))
        if saved == data or _same_path(saved, data):  # (one path spelt two ways: resume's own rule)
            return cfg
    return {}


def _classes_of(model_dir: Path, args) -> dict:
    """For ``eval --task cls`` of a model whose classes are known (every classifier this library
    trains): build_task_data's ``labels`` and ``splits``, so that the data's labels are read
    against the model's classes (or as scores, for a regression model) and only the evaluated split
    is read. A model with HF's default names (LABEL_0, ...) takes its label set from the data's
    train split, as training does."""
    from .data.classification import LabelSet, Scores

    if args.task != "cls" or str(args.data).startswith("lra:"):
        return {}
    config = json.loads((model_dir / "config.json").read_text())
    names = config.get("id2label") or {}
    if config.get("problem_type") == "regression" or (config.get("problem_type") is None and len(names) == 1):
        return {"labels": Scores(), "splits": (args.split,)}  # (one output: regression, HF's rule)
    classes = [names.get(str(i)) for i in range(len(names))]
    if not classes or None in classes or classes == [f"LABEL_{i}" for i in range(len(classes))]:
        return {}
    return {"labels": LabelSet(classes, origin="the model's classes, its config.id2label"), "splits": (args.split,)}


def cmd_eval(args) -> int:
    from .train.distributed import cleanup, setup_distributed
    from .train.loop import TrainConfig, autocast_factory, build_model_for, name_classes, special_token_ids
    from .train.tasks import build_task_data

    if args.no_truncate is False and args.task != "cls":  # (--truncate stores False, which the cls-only check passed)
        raise ValueError(f"--truncate applies to --task cls only, not --task {args.task}")
    if args.data is None:  # (cls had been told "'stdlib' is neither a classification file nor ...", unasked)
        if args.task == "cls":
            raise ValueError("--data is required with --task cls: the classification file or folder to score")
        args.data = "stdlib"
    if args.stride is not None and args.task != "clm":  # mlm and cls windows do not slide
        raise ValueError(f"--stride applies to --task clm only, not --task {args.task}")
    if args.stride is not None and args.stride > args.seq_len:  # (TrainConfig's message named eval_stride)
        raise ValueError(f"--stride must be at most --seq-len ({args.seq_len}), got {args.stride}")
    read = _cls_read_kwargs(args)
    model_dir = resolve_model_dir(args.model)
    _check_head_for(args.task, model_dir)
    if args.out:  # (it had overwritten the corpus, or a checkpoint's config.json: the model unloadable)
        out = Path(args.out).resolve()
        for what, path in (("--data", Path(args.data)), ("--model", Path(args.model)), ("--model", model_dir)):
            path = path.resolve()
            if out == path or (path.is_dir() and path in out.parents):
                raise ValueError(f"--out {args.out} is {'in ' if out != path else ''}{what} {path}: write the "
                                 "result elsewhere")
    run = _run_config_for(model_dir, args.data)
    data_seed = int(run.get("data_seed") or 0)
    given_truncate = args.no_truncate  # None, or the --truncate / --no-truncate given
    args.no_truncate = bool(given_truncate)
    if args.task == "cls" and run.get("task") == "cls":  # the flags given override the run's
        read = {**(run.get("cls_read_kwargs") or {}), **read}
        # (a store_true flag could only turn the run's --no-truncate on, not off)
        args.no_truncate = bool(run.get("no_truncate")) if given_truncate is None else given_truncate
    # no --tokenizer: the model's own, in <model>/tokenizer or beside its weights (tasks.get_tokenizer)
    cfg = TrainConfig(task=args.task, preset=None, init_from=str(model_dir), data=args.data, tokenizer=args.tokenizer,
                      data_seed=data_seed, seq_len=args.seq_len, batch_size=args.batch_size, eval_stride=args.stride,
                      cache_dir=args.cache_dir, max_steps=1, dtype=args.dtype, cls_read_kwargs=read,
                      no_truncate=args.no_truncate,
                      mlm_packing=args.mlm_packing)
    cfg.check()
    info = setup_distributed(args.device)
    autocast = autocast_factory(info.device, args.dtype)
    # stdout carries the JSON result alone (`eval ... > res.json`): the data side's notes (e.g. how
    # many examples were truncated) go to stderr
    with contextlib.redirect_stdout(sys.stderr):
        data = build_task_data(cfg, info, autocast, **_classes_of(model_dir, args))
        factory = data.extra.get("model_factory", build_model_for)
        model = factory(cfg, data.tokenizer.vocab_size, data.num_labels, special_token_ids(data.tokenizer))
        name_classes(model, data.extra.get("label_set"))
        model = model.to(info.device)
        res = data.evaluate(model, args.split, args.max_batches)
    cleanup(info)
    res = {"model": str(model_dir), "data": args.data, "data_seed": data_seed, **({"read": read} if read else {}),
           "split": args.split, "task": args.task,
           "seq_len": args.seq_len, "stride": args.stride, "max_batches": args.max_batches,
           "world_size": info.world_size, **res}
    if info.is_main:  # under torchrun every rank has the (all-reduced) result; one reports it
        if args.out:  # (written before printing: a reader of stdout that goes away stops the command)
            atomic_write_text(args.out, json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="transnormer", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a preset or config on a text or classification dataset")
    _add_train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("compare", help="train several presets with the same data, budget and seed")
    p.add_argument("--presets", required=True, help="comma-separated preset names")
    _add_train_args(p, preset_required=True)
    p.add_argument("--sample", action="store_true", help="print a generated sample from the first preset")
    p.add_argument("--sample-prompt", help="the prompt of --sample (default \"Return the\")")
    p.set_defaults(func=cmd_compare, config_file=None, init_from=None)

    p = sub.add_parser("eval", help="perplexity (clm, mlm), or accuracy/F1/MCC (cls; Pearson/Spearman for real-valued scores) of a trained model")
    p.add_argument("--model", required=True)
    p.add_argument("--data", help="clm/mlm: the corpus (default stdlib); cls: the classification file or folder "
                   "(required)")
    p.add_argument("--task", default="clm", choices=["clm", "mlm", "cls"])
    p.add_argument("--split", default="valid", choices=["valid", "test", "train"])
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--stride", type=positive_int, help="clm sliding-window stride (default: seq-len)")
    _add_mlm_packing_arg(p)
    p.add_argument("--batch-size", type=positive_int, default=8, help="per process under torchrun")
    p.add_argument("--max-batches", type=positive_int,
                   help="per process under torchrun (the result records world_size); default: the whole split")
    p.add_argument("--tokenizer")
    p.add_argument("--cache-dir")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device")
    _add_cls_column_args(p)
    cut = p.add_mutually_exclusive_group()  # (default None: as the run was trained)
    cut.add_argument("--no-truncate", dest="no_truncate", action="store_const", const=True, default=None,
                     help="cls: error on over-long examples (default: as the run was trained)")
    cut.add_argument("--truncate", dest="no_truncate", action="store_const", const=False,
                     help="cls: cut over-long examples, even if the run was trained with --no-truncate")
    p.add_argument("--out", help="also write the JSON here")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="stream text from a causal LM (recurrent decoding)")
    p.add_argument("--model", required=True, help="model dir, checkpoint dir or run dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=positive_int, default=50)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens only (default 0: all)")
    p.add_argument("--tokenizer")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--no-stream", action="store_true")
    p.set_defaults(func=cmd_generate)

    for extra in ("lra", "analyze", "bench"):
        try:
            mod = __import__(f"transnormer.cli_{extra}", fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != f"transnormer.cli_{extra}":
                raise
            continue
        mod.register(sub)
    return ap


# Commands whose --out names a file (the others' --out is a folder).
_FILE_OUTPUTS = {("eval", None), ("lra", "eval"), ("lra", "report")}


def _check_outputs(args) -> None:
    """--out and --cache-dir checked before any work: a file where a folder belongs had failed
    only after minutes of data, training or measuring, naming a temporary file."""
    from ._files import check_output

    for dest, flag in (("out", "--out"), ("out_dir", "--out"), ("cache_dir", "--cache-dir")):
        value = getattr(args, dest, None)  # an unset shell variable: the run had gone into "."
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"{flag}: expected a path, got {value!r}")
    out = getattr(args, "out", None) or getattr(args, "out_dir", None)
    if out:
        sub = getattr(args, "lra_command", None)
        check_output(out, "--out", directory=(args.command, sub) not in _FILE_OUTPUTS)
    cache = getattr(args, "cache_dir", None)
    # An existing cache folder may be read-only (shared): what it lacks is refused when it would be built.
    if cache and not Path(cache).expanduser().is_dir():
        check_output(cache, "--cache-dir", directory=True)


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """No option may be abbreviated: compare --preset X had been taken as --presets X, replacing the
    presets given (train's flag, meant for another command, ran other models with rc 0)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _no_abbreviations(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    _no_abbreviations(parser)
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from .runtime import check_env, tune_allocator

    try:
        check_env()  # TRANSNORMER_THREADS (README) set for training, evaluation and the rest; the others checked
        tune_allocator()  # keep freed memory for reuse: no page faults per step (runtime.py)
        _check_outputs(args)
        rc = args.func(args)
        sys.stdout.flush()  # (a pipe's buffered output, written here, not at exit after main returned)
        return rc
    except KeyboardInterrupt:  # a second Ctrl-C (training saves and stops at the first): no traceback
        print(f"transnormer {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as e:
        if not _stdout_gone():  # another pipe (stderr, a child's): an error like any other
            return _report_error(args, e)
        # The reader of stdout went away (`transnormer generate ... | head`): stop quietly with the
        # status of a process SIGPIPE ended, as Unix tools do (it had printed "error: [Errno 32]
        # Broken pipe" and returned 2). stdout is pointed at /dev/null so that the interpreter's
        # last flush at exit does not fail on the closed pipe again.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE (13)
    except (ValueError, TypeError, OSError, ImportError) as e:  # bad input, a path, a missing extra: one line
        return _report_error(args, e)


def _stdout_gone() -> bool:
    """Whether stdout's reader has gone: the pipe reports an error to poll() (unbuffered stdout,
    PYTHONUNBUFFERED, has nothing left to flush), or its flush fails with a broken pipe."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # (a StringIO has none)
        fd = None
    if fd is not None and hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if any(events & select.POLLERR for _, events in poller.poll(0)):
            return True
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    except (OSError, ValueError):
        return False
    return False


def _report_error(args, e: Exception) -> int:
    """One line on stderr for bad input, a path, a missing extra (TRANSNORMER_DEBUG: the traceback)."""
    if "TRANSNORMER_DEBUG" in os.environ:
        raise e
    with contextlib.suppress(OSError):  # (stderr may be the pipe that broke)
        print(f"transnormer {args.command}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
