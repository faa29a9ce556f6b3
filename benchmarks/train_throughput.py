"""Training tokens/s and peak memory: t2-lm vs vanilla-lm at T = 512, 2k, 8k, fp32 and bf16 autocast.

    python benchmarks/train_throughput.py [--lengths 512 2048 8192] [--dtypes fp32 bf16] [--vocab-size 32768]

Each configuration runs in a fresh process (peak RSS is its own) with 8,192 tokens per step
(batch = 8192 / T). The vocabulary defaults to 32,768 rather than WikiText-103's 267,735: with the
paper's vocabulary the tied LM head is ~7x the FLOPs of all six blocks and would hide the
attention cost this benchmark is about (pass --vocab-size 267735 for the paper's setting).
"""

from __future__ import annotations

import argparse
import json

import torch

from transnormer._files import atomic_write_text, check_output, to_jsonable
from transnormer.bench.suite import preset_flops_per_token
from transnormer.bench.train_step import require_causal, train_step_throughput
from transnormer.cli import positive_int
from transnormer.runtime import tune_allocator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["t2-lm", "vanilla-lm"])
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--vocab-size", type=positive_int, default=32768)
    ap.add_argument("--tokens-per-step", type=positive_int, default=8192)
    ap.add_argument("--steps", type=positive_int, default=3)
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()
    for flag, values in (("--presets", args.presets), ("--lengths", args.lengths), ("--dtypes", args.dtypes)):
        if len(set(values)) != len(values):
            ap.error(f"{flag}: each once, got {values}")
    try:  # before minutes of measuring, not after
        if args.json:
            check_output(args.json, "--json")
        for p in args.presets:  # a typo or a bidirectional preset had been a child's traceback, presets later
            if not p.startswith("peer:"):
                require_causal(p)
    except ValueError as e:
        ap.error(str(e))
    tune_allocator()  # as the CLI does: no page faults per step (transnormer/runtime.py)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.tokens_per_step} tokens/step, "
          f"vocab {args.vocab_size}; each row a fresh process; median of {args.steps} steps")
    print("| dtype | T | " + " | ".join(f"{p} tok/s | {p} peak MB" for p in args.presets)
          + f" | {args.presets[0]}/{args.presets[-1]} measured | ideal (FLOPs the kernels run) | ideal (3x convention) |")
    print("|---|---|" + "---|---|" * len(args.presets) + "---|---|---|")
    results = []
    for dtype in args.dtypes:
        for T in args.lengths:
            row = {}
            for p in args.presets:
                r = train_step_throughput(p, T, dtype=dtype, tokens_per_step=args.tokens_per_step,
                                          vocab_size=args.vocab_size, steps=args.steps)
                row[p] = r
                results.append(r)
            a, b = args.presets[0], args.presets[-1]
            # (None for a layer type without a FLOP model, e.g. FLASH, or a peer: no ideal then)
            fl = {(p, rc): preset_flops_per_token(p, args.vocab_size, T, recompute=rc)
                  for p in (a, b) for rc in (True, False)}
            ideal = [f"{fl[b, rc] / fl[a, rc]:.2f}x" if fl[a, rc] and fl[b, rc] else "-" for rc in (True, False)]
            cells = " | ".join(f"{row[p]['tokens_per_s']:,.0f} | {row[p]['peak_mem_mb']:,.0f}" for p in args.presets)
            print(f"| {dtype} | {T} | {cells} | {row[a]['tokens_per_s'] / row[b]['tokens_per_s']:.2f}x | "
                  f"{ideal[0]} | {ideal[1]} |", flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(to_jsonable(results), indent=1))


if __name__ == "__main__":
    main()
