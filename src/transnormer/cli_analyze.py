"""``transnormer analyze gradient-bound|dilution|grad-stats|ablation``: the paper's evidence as tools."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from .cli import bpe_vocab_size, saved_data_spec, seed_int


def _dump(obj) -> None:
    print(json.dumps(obj, indent=1, default=str)[:4000])


def cmd_gradient_bound(args) -> int:
    from .analysis import run_gradient_bound

    res = run_gradient_bound(args.out, seed=args.seed)
    _dump(res["summary"])
    print("wrote", ", ".join(res["files"]))
    return 0


def _text_ids(data: str, tokenizer, seq_len: int, n: int, cache_dir):
    import torch

    from .data.corpus import load_corpus

    corpus = load_corpus(data, cache_dir=cache_dir)
    text = "\n\n".join(corpus.splits["valid"])
    ids = tokenizer.encode(text)
    if len(ids) < seq_len * n:
        raise ValueError(f"--data: the valid split has {len(ids)} tokens, fewer than {n} x --seq-len {seq_len}")
    return torch.tensor(ids[: seq_len * n]).view(n, seq_len)


def _is_preset(name: str) -> bool:
    from .models.presets import preset_task

    try:
        preset_task(name)
    except ValueError:
        return False
    return True


def cmd_dilution(args) -> int:
    from .analysis import run_dilution
    from .data.corpus import load_corpus
    from .data.tokenizer import MIN_VOCAB, build_tokenizer
    from .presets import get_config
    from .train.checkpoint import model_tokenizer, resolve_model_dir, tokenizer_from_arg

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names:
        raise ValueError("--models: no model given (comma-separated presets or model/run directories)")
    # (a repeat had been analysed once, silently; a folder spelt two ways, run and run/, twice)
    if len({str(Path(n).resolve()) if Path(n).exists() else n for n in names}) != len(names):
        raise ValueError(f"--models: each model once, got {names}")
    for flag, value in (("--seq-len", args.seq_len), ("--samples", args.samples)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for name in names:  # an unknown preset: said before the corpus and tokenizer are built
        if not Path(name).exists():
            if any(sep in name for sep in ("/", os.sep)) and not _is_preset(name):  # (a mistyped folder)
                raise ValueError(f"--models: no such folder {name!r}")
            get_config(name)
        elif _is_preset(name):  # (the folder had been analysed, under the preset's name)
            raise ValueError(f"--models: {name!r} is both a preset and a folder here; write ./{name} for the folder")
    # a model folder's tokenizer is the one every model reads (presets are built at its vocabulary)
    trains_bpe = not args.tokenizer and not any(Path(n).exists() for n in names)
    if args.vocab_size is not None and not trains_bpe:  # (it had been read by nothing, silently)
        raise ValueError("--vocab-size sizes the BPE trained on --data for presets given by name; with --tokenizer, "
                         "or model folders (their own tokenizer), leave --vocab-size out")
    args.vocab_size = 8192 if args.vocab_size is None else args.vocab_size
    if trains_bpe and args.vocab_size < MIN_VOCAB:
        raise ValueError(f"--vocab-size must be >= {MIN_VOCAB} (5 specials and 256 bytes), got {args.vocab_size}")
    models, toks = {}, {}
    for name in names:
        if Path(name).exists():
            from transformers import AutoModel

            from . import models as _  # noqa: F401

            d = resolve_model_dir(name, what="--models")
            models[name] = AutoModel.from_pretrained(d).eval()
            toks[name] = model_tokenizer(d, args.tokenizer)
            if toks[name].vocab_size > models[name].config.vocab_size:  # ids past its embedding
                raise ValueError(f"--tokenizer: {toks[name].vocab_size} ids, more than the vocab_size "
                                 f"{models[name].config.vocab_size} of {name}")
    # every model reads the same ids: each model's own tokenizer must be the same one
    if len({t.fingerprint for t in toks.values()}) > 1:
        raise ValueError(f"--models: {', '.join(toks)} were trained with different tokenizers; compare models that "
                         "share one (or analyze each in its own run)")
    tok = next(iter(toks.values()), None)
    if tok is None:
        tok = tokenizer_from_arg(args.tokenizer) if args.tokenizer else build_tokenizer(
            load_corpus(args.data, cache_dir=args.cache_dir), args.vocab_size, cache_dir=args.cache_dir)
    for name in names:
        if name not in models:
            import torch

            from .presets import build_model

            torch.manual_seed(args.seed)  # a preset's random weights: the same for every run and position in --models
            # the preset's own limit unless --seq-len needs more (cosFormer's re-weighting length M is
            # it: a smaller one had analysed another model than the preset)
            limit = max(get_config(name).max_position_embeddings, args.seq_len)
            models[name] = build_model(name, vocab_size=tok.vocab_size, dropout=0.0,
                                       max_position_embeddings=limit).eval()
    ids = _text_ids(args.data, tok, args.seq_len, args.samples, args.cache_dir)
    res = run_dilution(models, ids, args.out, mode=args.mode, seq_len=args.seq_len, seed=args.seed)
    _dump(res["summary"])
    print("wrote", ", ".join(str(f) for f in res["files"]))
    return 0


def cmd_grad_stats(args) -> int:
    from .analysis import run_grad_stats

    metrics = Path(args.metrics)
    if metrics.is_dir():  # (it had been "[Errno 21] Is a directory")
        hint = metrics / "grad_norms.jsonl"
        raise ValueError(f"--metrics {args.metrics} is a folder; give a file in it, e.g. {hint}"
                         + ("" if hint.is_file() else " (written by train --grad-stats)"))
    if not metrics.is_file():
        raise ValueError(f"--metrics {args.metrics}: no such file (grad_norms.jsonl or metrics.jsonl of a run)")

    res = run_grad_stats(args.metrics, args.out, key=args.key, start=args.start, end=args.end,
                         param_set=args.param_set)
    _dump(res)
    return 0


def cmd_ablation(args) -> int:
    from .analysis.ablation import run_scaling_ablation
    from .presets import get_config
    from .train.distributed import barrier, cleanup, setup_distributed
    from .train.loop import TrainConfig, train
    from .train.metrics import read_metrics

    out = Path(args.out)
    # an LM base trains three causal LMs; a bidirectional one three masked LMs (the paper's Table 1)
    task = "clm" if get_config(args.base).causal else "mlm"
    # the runs' settings, checked once, before any run writes a config or trains (each had been found
    # by the first run, after its model_config.json was written); each run takes its own config file
    base = TrainConfig(task=task, preset=args.base, data=saved_data_spec(args.data), budget=args.budget,
                       seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup, clip=0.0,
                       out_dir=str(out), seed=args.seed, vocab_size=args.vocab_size, cache_dir=args.cache_dir,
                       eval_batches=10, progress=False, resume=args.resume)
    base.check()
    data = base.data
    if (isinstance(data, str) and data != "stdlib" and not data.startswith(("hf:", "lra:"))
            and not Path(data).expanduser().exists()):  # (found by the first run, after it wrote its config)
        raise ValueError(f"--data path {data!r} does not exist (nor is it 'stdlib' or 'hf:NAME')")
    # under torchrun: one process group for the three runs (as compare), rank 0 writes
    info = setup_distributed()

    def train_fn(config, budget):
        run = out / config.name_or_path if getattr(config, "name_or_path", "") else out / "run"
        cfg_path = run / "model_config.json"
        if info.is_main:
            run.mkdir(parents=True, exist_ok=True)
            config.to_json_file(cfg_path)
        barrier(info)  # the config file is there for every rank
        summary = train(replace(base, preset=None, config_file=str(cfg_path), budget=budget, out_dir=str(run)))
        if summary.get("interrupted_at") is not None:  # Ctrl-C: saved; no ablation of a cut curve
            raise KeyboardInterrupt(f"{run} interrupted after step {summary['interrupted_at']}")
        barrier(info)  # rank 0 has written the run's metrics
        curve = [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl")
                 if r["kind"] == "train" and r["loss"] is not None]  # (an MLM step that masked nothing: None)
        if summary.get("diverged_at") is not None:
            # the loop stops at a non-finite gradient too, after logging that step's finite loss:
            # end the curve with a non-finite point there (in place of that step's), or the stopped
            # run reads as healthy
            curve = [pt for pt in curve if pt[0] != summary["diverged_at"]] + [(summary["diverged_at"], float("nan"))]
        return curve

    from .analysis.ablation import ablation_configs

    configs = ablation_configs(args.base)
    for name, c in configs.items():
        c.name_or_path = name
    res = run_scaling_ablation(train_fn, args.budget, out if info.is_main else None, base=args.base, configs=configs)
    cleanup(info)
    if info.is_main:
        _dump(res["stats"])
        print("wrote", ", ".join(res["files"]))
    return 0


def register(sub) -> None:
    p = sub.add_parser("analyze", help="gradient bound, attention dilution, gradient stability, scaling ablation")
    asub = p.add_subparsers(dest="analysis", required=True)

    q = asub.add_parser("gradient-bound", help="Proposition 3.1: softmax vs linear vs NormAttention gradients")
    q.add_argument("--out", default="runs/analysis/gradient_bound")
    q.add_argument("--seed", type=seed_int, default=0)
    q.set_defaults(func=cmd_gradient_bound)

    q = asub.add_parser("dilution", help="locally accumulated attention score l(r) per layer")
    q.add_argument("--models", required=True, help="comma-separated presets (random init) or model/run dirs")
    q.add_argument("--data", default="stdlib")
    q.add_argument("--tokenizer")
    q.add_argument("--vocab-size", type=int, help="of the BPE trained on --data for presets (default 8192)")
    q.add_argument("--cache-dir")
    q.add_argument("--seq-len", type=int, default=512)
    q.add_argument("--samples", type=int, default=2)
    q.add_argument("--mode", default="clip", choices=["clip", "shift", "causal"])
    q.add_argument("--seed", type=seed_int, default=0, help="of the random weights of presets given by name")
    q.add_argument("--out", default="runs/analysis/dilution")
    q.set_defaults(func=cmd_dilution)

    q = asub.add_parser("grad-stats", help="relative std of gradient norms from a run's metrics")
    q.add_argument("--metrics", required=True, help="grad_norms.jsonl (train --grad-stats) or metrics.jsonl")
    q.add_argument("--key", default="grad_norm")
    q.add_argument("--start", type=int)
    q.add_argument("--end", type=int)
    q.add_argument("--param-set", help="what the norms cover, for the report (default: the file's param_set "
                   "field; 'all' for a training run's metrics.jsonl grad_norm)")
    q.add_argument("--out", default="runs/analysis/grad_stats")
    q.set_defaults(func=cmd_grad_stats)

    q = asub.add_parser("ablation", help="linear_elu with / without denominator vs NormAttention, same budget")
    q.add_argument("--base", default="t2-lm-tiny",
                   help="an LM preset (three causal LMs) or a bidirectional one (three masked LMs, as Table 1)")
    q.add_argument("--data", default="stdlib")
    q.add_argument("--budget", default="300k")
    q.add_argument("--seq-len", type=int, default=256)
    q.add_argument("--batch-size", type=int, default=8)
    q.add_argument("--lr", type=float, default=1e-3)
    q.add_argument("--warmup", type=int, default=20)
    q.add_argument("--vocab-size", type=bpe_vocab_size, default=8192)
    q.add_argument("--cache-dir")
    q.add_argument("--seed", type=seed_int, default=0)
    q.add_argument("--out", default="runs/analysis/ablation")
    # (an interrupted run said "the same command with --resume continues", which this command refused;
    # without it the three runs start again)
    q.add_argument("--resume", action="store_true", help="continue each run from its newest valid checkpoint in "
                   "--out (a finished run stays as it is)")
    q.set_defaults(func=cmd_ablation)
