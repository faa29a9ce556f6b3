"""``transnormer bench ops|train|infer|memory|long|peers|all``: speed and memory with PASS/FAIL targets."""

from __future__ import annotations

import os
from pathlib import Path

from .cli import positive_float, positive_int


def _print(res: dict) -> None:
    print(res["table"])
    for v in res["verdicts"]:
        print(v)
    print("wrote", ", ".join(res["files"]))


def cmd_bench(args) -> int:
    import torch

    from .bench import suite

    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["TRANSNORMER_THREADS"] = str(args.threads)  # every measurement runs in a spawned child
    out = Path(args.out)
    what = ["ops", "train", "infer", "memory", "long", "peers"] if args.what == "all" else [args.what]
    all_verdicts = []
    for w in what:
        print(f"\n## {w}", flush=True)
        if w == "ops":
            res = suite.bench_ops(out, lengths=args.lengths or (1024, 4096, 16384), dtypes=args.dtypes,
                                  rounds=args.rounds)
        elif w in ("train", "infer"):
            res = suite.bench_train(out, presets=args.presets, lengths=args.lengths or (512, 2048, 8192, 16384),
                                    dtypes=args.dtypes, vocab_size=args.vocab_size, mode=w, rounds=args.rounds,
                                    tokens_per_step=args.tokens_per_step, max_step_s=args.max_step_s,
                                    max_mem_gb=args.max_mem_gb)
        elif w == "memory":
            res = suite.bench_memory(out, vocab_size=args.vocab_size, dtypes=args.dtypes)
        elif w == "long":
            res = suite.bench_long(out)
        else:
            res = suite.bench_peers(out, vocab_size=args.vocab_size, dtypes=args.dtypes, rounds=args.rounds)
        _print(res)
        all_verdicts += res["verdicts"]
    if len(what) > 1:
        print("\n## verdicts")
        print("\n".join(all_verdicts))
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="speed/memory benchmarks against T with the performance targets")
    p.add_argument("what", choices=["ops", "train", "infer", "memory", "long", "peers", "all"])
    p.add_argument("--presets", nargs="+", default=["t2-lm", "vanilla-lm"],
                   help="for train/infer (memory, long and peers use their own): the first is compared with "
                        "the last; peers as peer:NAME")
    p.add_argument("--lengths", type=positive_int, nargs="+", help="ops, train, infer")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                   help="(long: bf16 only, the target's)")
    p.add_argument("--vocab-size", type=positive_int, default=32768,
                   help="(long: 8,192, what fits at T = 65,536 in 24 GB)")
    p.add_argument("--threads", type=positive_int)
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="ops, train, infer, peers: measure the configurations in turn this many times; each keeps its "
                        "median round")
    p.add_argument("--tokens-per-step", type=positive_int, default=16384,
                   help="train/infer: tokens in each step (batch = this // T, at least 1)")
    p.add_argument("--max-step-s", type=positive_float,
                   help="train/infer: a preset whose step takes longer than this is not run at longer T")
    p.add_argument("--max-mem-gb", type=positive_float,
                   help="train/infer on CPU: cap each measuring process's address space; a configuration "
                        "that needs more is recorded as out of memory and the preset's longer T skipped")
    p.add_argument("--out", default="runs/bench")
    p.set_defaults(func=cmd_bench)
