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


# Which parts read each option (besides `all`, which runs every part): given to another part, an
# option had been ignored (bench memory --lengths 8 ran its full 4k/16k sweep).
_APPLIES = {"presets": ("train", "infer"), "lengths": ("ops", "train", "infer"),
            "vocab_size": ("train", "infer", "memory", "peers"), "rounds": ("ops", "train", "infer", "peers"),
            "tokens_per_step": ("train", "infer"), "max_step_s": ("train", "infer"), "max_mem_gb": ("train", "infer")}


def _check_flags(args) -> None:
    """Options of other parts, repeats, and unknown presets refused before the GEMM probe."""
    for name, parts in _APPLIES.items():
        if getattr(args, name) is not None and args.what != "all" and args.what not in parts:
            raise ValueError(f"--{name.replace('_', '-')} applies to bench {', '.join(parts)}, not {args.what}")
    if args.what == "long" and args.dtypes not in (None, ["bf16"]):  # (had been accepted and ignored)
        raise ValueError(f"--dtypes: bench long measures its target's bf16 step only, got {args.dtypes}")
    for name in ("presets", "lengths", "dtypes"):
        values = getattr(args, name) or []
        if len(set(values)) != len(values):  # each had been measured twice
            raise ValueError(f"--{name}: each once, got {values}")
    for preset in args.presets or []:
        if preset.startswith("peer:"):
            from .bench.peers import PEER_MODULES, PEER_NAMES, _import_peer

            if preset == "peer:sdpa":  # (the hint peers.py gives had been lost to "unknown peer")
                raise ValueError("--presets peer:sdpa: our 'vanilla-lm' preset is the SDPA softmax baseline; "
                                 "use vanilla-lm")
            if preset[5:] not in PEER_NAMES:
                raise ValueError(f"--presets: unknown peer {preset!r}; known: {['peer:' + n for n in PEER_NAMES]}")
            try:  # (a missing package had been found after the GEMM probe)
                _import_peer(PEER_MODULES[preset[5:]])
            except ImportError as e:
                raise ValueError(f"--presets {preset}: {e}") from None
        else:
            from .bench.train_step import require_causal

            try:  # (had been refused by the first measuring process, after the GEMM probe)
                require_causal(preset)
            except ValueError as e:
                raise ValueError(f"--presets: {e}") from None
    if args.what == "peers":
        _peer_for_bench_peers()
    if args.max_mem_gb is not None and args.max_mem_gb >= 2**20:
        raise ValueError(f"--max-mem-gb must be below 2^20 GB, got {args.max_mem_gb:g}")


def _peer_for_bench_peers() -> None:
    """Raise ValueError when flash-pytorch, bench peers' peer, cannot be imported."""
    from .bench.peers import PEER_MODULES, _import_peer

    try:
        _import_peer(PEER_MODULES["flash-pytorch"])
    except ImportError as e:
        raise ValueError(f"bench peers: {e}") from None


def cmd_bench(args) -> int:
    import torch

    from .bench import suite
    from .bench.timing import cpu_has_bf16_products, default_dtypes

    _check_flags(args)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["TRANSNORMER_THREADS"] = str(args.threads)  # every measurement runs in a spawned child
    out = Path(args.out)
    what = ["ops", "train", "infer", "memory", "long", "peers"] if args.what == "all" else [args.what]
    all_verdicts = []
    given = args.dtypes
    if args.dtypes is None and what == ["long"]:  # its target is a bf16 step ("fp32 only" had been printed)
        if suite._device() == "cpu" and not cpu_has_bf16_products():
            print("this CPU has no bf16 products (AVX512-BF16 or AMX): the bf16 step runs on PyTorch's slow "
                  "fallback", flush=True)
        args.dtypes = ["bf16"]
    if args.dtypes is None:
        args.dtypes = default_dtypes()
    if "long" in what and len(what) > 1 and "bf16" not in args.dtypes:  # (--dtypes fp32 had run it anyway)
        what.remove("long")
        why = "this CPU has no bf16 products" if given is None else f"--dtypes {' '.join(given)} leaves bf16 out"
        all_verdicts.append(f"SKIP  long: its target is a bf16 step, and {why} (bench long to insist)")
    if "peers" in what and len(what) > 1:
        try:  # (bench all had run every other part, hours, before finding the peer missing)
            _peer_for_bench_peers()
        except ValueError as e:
            what.remove("peers")
            all_verdicts.append(f"SKIP  peers: {e}")
            print(f"bench all: skipping peers ({e})", flush=True)
    args.presets = args.presets or ["t2-lm", "vanilla-lm"]
    args.vocab_size = args.vocab_size or 32768
    args.rounds = args.rounds or 1
    args.tokens_per_step = args.tokens_per_step or 16384
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
    p.add_argument("--presets", nargs="+",
                   help="for train/infer (memory, long and peers use their own; default t2-lm vanilla-lm); "
                        "train compares the first with the last against their FLOP ratio (not a peer: no FLOP "
                        "count) and gives the first's MFU; peers as peer:NAME")
    p.add_argument("--lengths", type=positive_int, nargs="+", help="ops, train, infer")
    p.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"],
                   help="default fp32 bf16, or fp32 alone on a CPU without bf16 products (AVX512-BF16 or AMX); "
                        "long: bf16 only, the target's")
    p.add_argument("--vocab-size", type=positive_int,
                   help="train, infer, memory, peers (default 32,768; long uses 8,192, what fits at T = 65,536 in "
                        "24 GB)")
    p.add_argument("--threads", type=positive_int)
    p.add_argument("--rounds", type=positive_int,
                   help="ops, train, infer, peers: measure the configurations in turn this many times; each keeps its "
                        "median round")
    p.add_argument("--tokens-per-step", type=positive_int,
                   help="train/infer: tokens in each step (batch = this // T, at least 1; default 16,384)")
    p.add_argument("--max-step-s", type=positive_float,
                   help="train/infer: a preset whose step takes longer than this is not run at longer T")
    p.add_argument("--max-mem-gb", type=positive_float,
                   help="train/infer on CPU: cap each measuring process's address space; a configuration "
                        "that needs more is recorded as out of memory and the preset's longer T skipped")
    p.add_argument("--out", default="runs/bench")
    p.set_defaults(func=cmd_bench)
