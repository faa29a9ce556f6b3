"""The attention kernels of two checkouts, interleaved in one process.

    git worktree add /tmp/base <commit>      # the code to compare against
    python benchmarks/ab_kernels.py --base /tmp/base [--dtype fp32|bf16] [--mode causal|bidir|softmax] \
        [--lengths 4096 16384] [--reps 21] [--batch 1] [--heads 8]

Both checkouts' ``src/transnormer/ops`` sources are compiled with this checkout's flags
(``-O3 -march=native -fopenmp``) into two libraries, loaded side by side with ctypes, and
``norm_linear_attn``'s forward and backward walks (``tn_causal_*`` / ``tn_bidir_*``, heads of 64)
or, with ``--mode softmax``, causal softmax attention's (``tn_softmax_*``: vanilla-lm's attention)
are timed in alternation on the same inputs. Prints each side's median fwd / bwd / total, the
ratio, and the largest difference between the two sides' outputs (0 for a change that keeps
every sum).

Why this shape: on this shared machine the speed of one kernel drifts by 10-40% over minutes,
and the changes measured are often 2-5%, so the two sides must take turns within seconds. Even
then one side can read consistently faster: running one library against itself (``--base .``)
read the second side 4-7% faster in several runs in a row, then even, then the first side 5%
faster. The two sides differ there only in where their library and output buffers lie. So the
sides take turns going first and swap their output buffers every repetition: so run, three A/A
runs of the causal fp32 walk read 0.978-1.010 (4k and 16k). A difference under ~3% should still
be believed only if it holds with the order of ``--base`` and this checkout swapped too
(``--swap``), in more than one run.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from transnormer import runtime  # noqa: E402
from transnormer.bench import DTYPES  # noqa: E402
from transnormer.ops import _native  # noqa: E402


def build(checkout: Path, out: Path) -> ctypes.CDLL:
    """``checkout``'s kernels as a library at ``out``, with the argument types of this checkout's."""
    ops = checkout / "src" / "transnormer" / "ops"
    sources = [ops / s.name for s in _native._SOURCES]
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise SystemExit(f"--base lacks kernel sources this checkout has: {', '.join(missing)}")
    proc = _native._build(_native._compiler(), [*_native._FLAGS, "-fopenmp", "-march=native"], str(out),
                          tuple(sources))
    if proc.returncode:
        raise SystemExit(f"compiling {ops} failed:\n{proc.stderr[-2000:]}")
    lib = ctypes.CDLL(str(out))
    # (not _native._declare, which requires every symbol: a base checkout may lack kernels added since)
    for name, (suffixes, argtypes) in _native._SIGNATURES.items():
        for sfx in suffixes:
            fn = getattr(lib, f"{name}_{sfx}", None)
            if fn is not None:
                fn.argtypes, fn.restype = [*argtypes, ctypes.c_int], ctypes.c_int
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the other checkout's root (it has src/transnormer)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--mode", choices=["causal", "bidir", "softmax"], default="bidir")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--reps", type=int, default=21, help="timed calls per side and length")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--swap", action="store_true", help="put this checkout first and --base second")
    args = ap.parse_args()
    if args.reps < 1 or args.batch < 1 or args.heads < 1 or min(args.lengths) < 1:
        raise SystemExit("--reps, --batch, --heads and --lengths must be >= 1")
    runtime.tune_allocator()
    sides = [("base", args.base.resolve()), ("this", ROOT)]
    if args.swap:
        sides.reverse()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: build(path, Path(tmp) / f"{name}.so") for name, path in sides}
        run(libs, args)


def _ptr(x):
    return None if x is None else ctypes.c_void_p(x.data_ptr())


def walk(lib, mode: str, sfx: str, inputs, outputs, threads: int) -> tuple[float, float]:
    """One forward and one backward walk: (seconds fwd, seconds bwd). inputs q, k, v, dO
    [B, T, H, 64]; outputs o, dq, dk, dv like them, then the fp32 states fin, dS [B, H, 64, 64]."""
    q, k, v, do = map(_ptr, inputs)
    o, dq, dk, dv, fin, dS = map(_ptr, outputs)
    B, T, H, D = inputs[0].shape
    t0 = time.perf_counter()
    if mode == "softmax":  # causal, no window; fin holds the stats [B, H, 2, T] (it has room)
        ld, scale = H * D, D ** -0.5
        getattr(lib, f"tn_softmax_fwd_{sfx}")(q, k, v, ld, ld, ld, o, fin, B, T, H, D, D, 0, 1, scale, threads)
        t1 = time.perf_counter()
        getattr(lib, f"tn_softmax_bwd_{sfx}")(q, k, v, ld, ld, ld, o, do, fin, dq, dk, dv, B, T, H, D, D, 0, 1, scale,
                                              threads)
    elif mode == "bidir":
        getattr(lib, f"tn_bidir_fwd_{sfx}")(q, k, v, o, None, fin, B, T, H, D, D, threads)
        t1 = time.perf_counter()
        getattr(lib, f"tn_bidir_bwd_{sfx}")(q, k, v, do, fin, None, dq, dk, dv, dS, B, T, H, D, D, threads)
    else:
        getattr(lib, f"tn_causal_fwd_{sfx}")(q, k, v, o, None, fin, B, T, H, D, D, 64, threads)
        t1 = time.perf_counter()
        getattr(lib, f"tn_causal_bwd_{sfx}")(q, k, v, do, None, None, dq, dk, dv, None, B, T, H, D, D, 64, threads)
    return t1 - t0, time.perf_counter() - t1


def run(libs: dict, args) -> None:
    dtype = DTYPES[args.dtype]
    sfx = {"fp32": "f32", "bf16": "bf16"}[args.dtype]
    B, H, D, nt = args.batch, args.heads, 64, torch.get_num_threads()
    names = list(libs)
    print(f"{args.mode} {args.dtype}, B={B}, H={H}, D=E=64, {nt} threads, medians of {args.reps}")
    for T in args.lengths:
        inputs = [torch.randn(B, T, H, D).mul_(0.3).to(dtype) for _ in range(4)]
        # two sets of outputs, swapped between the sides every repetition
        state = (B, H, max(D, 2 * T // D + 1), D)  # the fp32 states, or the softmax stats
        outs = [[torch.zeros(B, T, H, D, dtype=dtype) for _ in range(4)] + [torch.zeros(state) for _ in range(2)]
                for _ in range(2)]
        times = {n: ([], []) for n in names}
        results = {}
        for i in range(-2, args.reps):  # two untimed rounds first
            for n in (names if i % 2 == 0 else names[::-1]):
                buf = outs[(names.index(n) + i) % 2]
                f, b = walk(libs[n], args.mode, sfx, inputs, buf, nt)
                if i >= 0:
                    times[n][0].append(f)
                    times[n][1].append(b)
                results[n] = [x.clone() for x in buf[:4]]
        total = {}
        for n in names:
            f, b = statistics.median(times[n][0]), statistics.median(times[n][1])
            total[n] = f + b
            print(f"T={T:>6} {n}: fwd {f * 1e3:.3f}  bwd {b * 1e3:.3f}  total {(f + b) * 1e3:.3f} ms")
        diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(*results.values()))
        print(f"T={T:>6} this / base: {total['this'] / total['base']:.3f}   "
              f"max |this - base| over o, dq, dk, dv: {diff:.3g}")


if __name__ == "__main__":
    main()
