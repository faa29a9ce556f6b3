"""One preset's training step on two checkouts of this library, in alternating fresh processes.

    git worktree add /tmp/base <commit>      # the code to compare against
    python benchmarks/ab_checkouts.py --base /tmp/base [--preset flash-lm] [--dtype bf16] \
        [--seq-len 4096] [--tokens-per-step 16384] [--rounds 4] [--threads 2]

Each round times the base checkout, then this one, each in a new interpreter whose
``PYTHONPATH`` is that checkout's ``src`` (the fused kernels are built from its own sources, and
cached by their hash); each keeps the median of its rounds. Alternating rounds put both sides
in the same spells of this shared machine, which a before/after pair of runs does not: single
step times here drift by 10-20% over minutes, the changes measured are often 1-5%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from transnormer.cli import positive_int

# The child is the fresh process: it measures in place (isolate=False) with the allocator setting
# train_step_throughput's own fresh process would have applied.
_CHILD = """
import json, sys
from transnormer.bench.train_step import train_step_throughput
from transnormer.runtime import tune_allocator
if __name__ == "__main__":
    tune_allocator()
    preset, T, dtype, vocab, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    r = train_step_throughput(preset, T, dtype=dtype, tokens_per_step=int(sys.argv[6]), vocab_size=vocab, steps=steps,
                              threads=int(sys.argv[7]), isolate=False)
    print(json.dumps(r["step_s"]))
"""


def step_seconds(src: Path, args) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", _CHILD, args.preset, str(args.seq_len), args.dtype,
                          str(args.vocab_size), str(args.steps), str(args.tokens_per_step or args.seq_len),
                          str(args.threads)],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the run on {src} failed:\n{out.stderr[-3000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the other checkout's root (it has src/transnormer)")
    ap.add_argument("--preset", default="flash-lm")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--seq-len", type=positive_int, default=4096)
    ap.add_argument("--vocab-size", type=positive_int, default=32768)
    ap.add_argument("--tokens-per-step", type=positive_int, help="tokens a step (batch = this // T, at least 1; default T)")
    ap.add_argument("--steps", type=positive_int, default=3, help="timed steps per process (after the checkout's own warm-up)")
    ap.add_argument("--rounds", type=positive_int, default=4)
    ap.add_argument("--threads", type=positive_int, default=2, help="threads of each timed process (default 2, this machine's cores)")
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1] / "src"
    base = args.base.resolve() / "src"
    if not (base / "transnormer").is_dir():
        ap.error(f"--base must be a checkout of this repository; {base / 'transnormer'} does not exist")
    times: dict[str, list[float]] = {"base": [], "this": []}
    for r in range(args.rounds):
        for name, src in (("base", base), ("this", here)):
            times[name].append(step_seconds(src, args))
            print(f"round {r}: {name} {times[name][-1]:.3f} s", flush=True)
    b, t = statistics.median(times["base"]), statistics.median(times["this"])
    print(f"{args.preset} {args.dtype} T={args.seq_len}: base {b:.3f} s, this {t:.3f} s, this/base {t / b:.3f} "
          f"(medians of {args.rounds} alternating rounds)")


if __name__ == "__main__":
    main()
