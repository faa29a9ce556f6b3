"""Mixer-level side-by-side timing against the peers (peers.md §2), at B = 1 without a padding mask;
a fixed token budget per step, models against T, is `transnormer bench train` (peers as peer:NAME).

    python benchmarks/peers_mixers.py [--lengths 256 512 1024 2048 4096 8192] [--dim 512] [--heads 8]
                                      [--bidirectional] [--out runs/bench/peers_mixers]   (default: causal)

Each mixer maps (B=1, T, d) -> (B, T, d). The ones compared:
- ours: NormAttention (TransNormer's linear mixer), FLASH (mixed-chunk GAU), SoftmaxAttention
  (our projections around PyTorch's SDPA: the vanilla peer, peers.md §3.1);
- peers: flash-pytorch's FLASH, performer-pytorch's SelfAttention (FAVOR+; its causal form on
  CPU is the package's memory-heavy fallback, peers.md §3.4).
flash-pytorch's FLASH adds its input back (to_out(.) + x, §2 rule 2); one add is negligible for
timing. Forward (no grad) and forward + backward are timed with
torch.utils.benchmark.Timer.blocked_autorange after a warm-up; the table gives the median and
the IQR of the blocks, and the crossover length: the shortest T from which each mixer's
forward + backward stays faster than SDPA's. Versions, threads and the CPU model are recorded
(rule 7). All mixers run in one process, alternating per T, so a drift of the shared machine's
speed falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import warnings
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

from transnormer._files import atomic_write_text, check_output, to_jsonable
from transnormer.bench.peers import _import_peer, peer_versions
from transnormer.cli import positive_float, positive_int
from transnormer.layers import FLASH, NormAttention, SoftmaxAttention
from transnormer.ops import _native
from transnormer.runtime import tune_allocator


class _Ours(torch.nn.Module):
    """Our layers return (y, cache): keep y."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def build_mixers(d: int, heads: int, causal: bool) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flash_pytorch = _import_peer("flash_pytorch")
        performer_pytorch = _import_peer("performer_pytorch")
    torch.manual_seed(0)
    mixers = {
        "ours: NormAttention": _Ours(NormAttention(d, heads, causal=causal)),
        "ours: FLASH": _Ours(FLASH(d, causal=causal)),
        "SDPA (our SoftmaxAttention)": _Ours(SoftmaxAttention(d, heads, causal=causal)),
        "peer: flash-pytorch FLASH": flash_pytorch.FLASH(dim=d, causal=causal),
        "peer: performer-pytorch": performer_pytorch.SelfAttention(dim=d, heads=heads, dim_head=d // heads,
                                                                   causal=causal),
    }
    for m in mixers.values():
        m.eval()  # dropout off; Performer keeps its projection (no redraw outside training)
    return mixers


def time_mixer(mixer, T: int, d: int, backward: bool, min_run_time: float) -> dict:
    x = torch.randn(1, T, d, requires_grad=backward)
    if backward:
        def run():
            mixer(x).sum().backward()
    else:
        def run():
            with torch.no_grad():
                mixer(x)
    run()  # warm-up (kernel builds, allocator)
    m = Timer(stmt="run()", globals={"run": run}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time)
    return {"median_s": m.median, "iqr_s": m.iqr, "blocks": len(m.times)}


def crossover(rows: list[dict], name: str, ref: str) -> int | None:
    """Shortest T from which ``name``'s forward + backward stays faster than ``ref``'s."""
    lengths = sorted({r["T"] for r in rows})
    t = {(r["mixer"], r["T"]): r["fwd_bwd_s"] for r in rows}
    for i, T in enumerate(lengths):
        if all(t[(name, L)] < t[(ref, L)] for L in lengths[i:]):
            return T
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--dim", type=positive_int, default=512)
    ap.add_argument("--heads", type=positive_int, default=8)
    ap.add_argument("--bidirectional", action="store_true", help="default: causal")
    ap.add_argument("--min-run-time", type=positive_float, default=0.5, help="seconds per timed measurement")
    ap.add_argument("--out", default="runs/bench/peers_mixers")
    args = ap.parse_args()
    if min(args.lengths) < 1 or args.dim < 1 or args.heads < 1 or args.dim % args.heads:
        ap.error("lengths, dim and heads must be >= 1, and dim a multiple of heads")
    if len(set(args.lengths)) != len(args.lengths):  # a repeat's rows had been divided by another run's SDPA
        ap.error(f"--lengths: each once, got {args.lengths}")
    try:  # before minutes of measuring, not after
        check_output(args.out, "--out", directory=True)
    except ValueError as e:
        ap.error(str(e))
    tune_allocator()
    causal = not args.bidirectional
    mixers = build_mixers(args.dim, args.heads, causal)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": _native.cpu_info().model or
           platform.machine(), "versions": peer_versions(), "causal": causal, "dim": args.dim, "heads": args.heads,
           "batch": 1, "timer": "torch.utils.benchmark.Timer.blocked_autorange"}
    print(f"torch {env['torch']}, {env['threads']} threads, d={args.dim}, {args.heads} heads, B=1, "
          f"{'causal' if causal else 'bidirectional'}, fp32")
    rows = []
    for T in sorted(args.lengths):
        for name, mixer in mixers.items():
            fwd = time_mixer(mixer, T, args.dim, False, args.min_run_time)
            both = time_mixer(mixer, T, args.dim, True, args.min_run_time)
            rows.append({"mixer": name, "T": T, "fwd_s": fwd["median_s"], "fwd_iqr_s": fwd["iqr_s"],
                         "fwd_bwd_s": both["median_s"], "fwd_bwd_iqr_s": both["iqr_s"]})
            print(f"  T={T:5d} {name:30s} fwd {fwd['median_s'] * 1e3:9.2f} ms  fwd+bwd {both['median_s'] * 1e3:9.2f} ms",
                  flush=True)
    ref = "SDPA (our SoftmaxAttention)"
    lines = ["| mixer | T | fwd ms (IQR) | fwd+bwd ms (IQR) | fwd+bwd vs SDPA |", "|---|---|---|---|---|"]
    sdpa = {r["T"]: r["fwd_bwd_s"] for r in rows if r["mixer"] == ref}
    for r in rows:
        lines.append(f"| {r['mixer']} | {r['T']} | {r['fwd_s'] * 1e3:.2f} ({r['fwd_iqr_s'] * 1e3:.2f}) | "
                     f"{r['fwd_bwd_s'] * 1e3:.2f} ({r['fwd_bwd_iqr_s'] * 1e3:.2f}) | "
                     f"{sdpa[r['T']] / r['fwd_bwd_s']:.2f}x |")
    cross = {name: crossover(rows, name, ref) for name in mixers if name != ref}
    lines.append("")
    for name, T in cross.items():
        lines.append(f"crossover against SDPA (fwd+bwd), {name}: "
                     + (f"T >= {T}" if T is not None else "none in the lengths measured"))
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "peers_mixers.json", json.dumps(to_jsonable({"environment": env, "rows": rows,
                                                                        "crossover": cross}), indent=1))
    atomic_write_text(out / "peers_mixers.md", table + "\n")
    print("wrote", out / "peers_mixers.json", out / "peers_mixers.md")


if __name__ == "__main__":
    main()
