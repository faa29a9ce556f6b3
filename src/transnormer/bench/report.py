"""Benchmark reports: JSON of every measurement, a markdown table, log-log PNGs against T."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from .._files import atomic_write_text, to_jsonable
from ..ops import _native


def environment() -> dict:
    """What a number needs beside it to be read: versions, threads, CPU model."""
    cpu = _native.cpu_info().model or platform.processor()
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version()}


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if v is None:  # a column that does not apply to the row (e.g. the bf16 engine of an fp32 op)
            return ""
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 999.5 else f"{v:,.0f}"  # 999.7 would print as 1e+03
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def loglog_plot(rows: list[dict], path, *, x: str, y: str, series: str, title: str = "") -> Path | None:
    """One line per ``series`` value of (``x``, ``y``) points, both axes logarithmic."""
    from ..train.metrics import plot_curves

    curves = {name: sorted((r[x], r[y]) for r in rows if r[series] == name and r.get(y) is not None)
              for name in dict.fromkeys(r[series] for r in rows)}
    return plot_curves(curves, path, xlabel=x, ylabel=y, title=title, logx=True, logy=True)


def write_report(rows: list[dict], out_dir, name: str, columns: list[str], *, x: str = "seq_len",
                 series: str = "preset", plots: tuple[str, ...] = ("step_s", "peak_mem_mb"), extra: dict | None = None
                 ) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), "results": rows, **(extra or {})}
    # strict JSON: a non-finite loss (what bench long is there to catch) becomes null, not a bare NaN
    atomic_write_text(out / f"{name}.json", json.dumps(to_jsonable(payload), indent=1, default=str))
    table = markdown_table(rows, columns)
    atomic_write_text(out / f"{name}.md", table + "\n")
    files = [str(out / f"{name}.json"), str(out / f"{name}.md")]
    for y in plots:
        p = loglog_plot(rows, out / f"{name}_{y}.png", x=x, y=y, series=series, title=f"{name}: {y} vs {x}")
        if p:
            files.append(str(p))
    return {"table": table, "files": files}
