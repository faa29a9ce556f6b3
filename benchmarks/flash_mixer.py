"""FLASH's fused mixer (``_CausalFlashMixer``) against its composed form, in one process.

    python benchmarks/flash_mixer.py [--seq-len 4096] [--rounds 8] [--level layer|model]

The fused form runs with the kernels in "native" mode; the composed form with the fused mixer
switched off (``ops.flash._FUSED_MIXER``), every other kernel as in "native". This is the A/B behind
"auto"'s choice per build (ops/_native.py, ``_NEEDS_BUILD_FLAG``). The two alternate within each
round, in turn order swapped every round; it prints each form's median and the median of the
per-round ratios. fp32, one sequence. ``layer``: one flash-lm FLASH layer (d = 512), forward +
backward of a fixed output gradient; ``model``: a flash-lm training step (forward + backward with
the LM loss, no optimizer).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import transnormer.ops.flash as flash_ops
from transnormer.cli import positive_int
from transnormer.ops import _native, set_kernel_backend
from transnormer.runtime import tune_allocator


def build_step(level: str, T: int):
    torch.manual_seed(0)
    if level == "layer":
        from transnormer.layers.gau import FLASH

        layer = FLASH(512, causal=True)
        x = torch.randn(1, T, 512, requires_grad=True)
        g = torch.randn(1, T, 512)

        def step():
            y = layer(x)
            (y[0] if isinstance(y, tuple) else y).backward(g)
        return step
    from transnormer.bench.train_step import build_bench_model, lm_loss

    model = build_bench_model("flash-lm", T, 32768, {})
    ids = torch.randint(0, 32768, (1, T))

    def step():
        model.zero_grad(set_to_none=True)
        lm_loss(model, ids).backward()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=positive_int, default=4096, help="T, a multiple of the chunk size 256")
    ap.add_argument("--rounds", type=positive_int, default=8)
    ap.add_argument("--level", choices=("layer", "model"), default="layer")
    args = ap.parse_args()
    if args.seq_len < 256 or args.seq_len % 256:
        ap.error(f"--seq-len must be a positive multiple of 256 (FLASH's chunk), got {args.seq_len}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    tune_allocator()
    if _native.load() is None:
        raise SystemExit(f"no fused kernels here: {_native._error}")
    in_auto = _native.rows_usable(torch.float32, torch.device("cpu"), "flash_mixer")
    print(f"this build's 'auto' runs the {'fused' if in_auto else 'composed'} form in fp32")
    set_kernel_backend("native")
    step = build_step(args.level, args.seq_len)
    forms = ("fused", "composed")
    times = {f: [] for f in forms}
    try:
        for f in forms:  # warm-up: kernels loaded, allocator filled
            flash_ops._FUSED_MIXER = f == "fused"
            step()
        for r in range(args.rounds):
            for f in forms if r % 2 == 0 else forms[::-1]:
                flash_ops._FUSED_MIXER = f == "fused"
                t0 = time.perf_counter()
                step()
                times[f].append(time.perf_counter() - t0)
    finally:
        flash_ops._FUSED_MIXER = True
        set_kernel_backend("auto")
    print(f"flash-lm {args.level}, T = {args.seq_len}, fp32, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds (s):")
    for f in forms:
        print(f"  {f:9s} median {statistics.median(times[f]):.3f}  " + " ".join(f"{t:.3f}" for t in times[f]))
    ratios = [a / b for a, b in zip(times["fused"], times["composed"], strict=True)]
    print(f"  fused / composed: medians {statistics.median(times['fused']) / statistics.median(times['composed']):.3f}, "
          f"per-round ratios' median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
