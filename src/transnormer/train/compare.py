"""``transnormer compare``: train several presets on the same data, budget and seed; tabulate.

Writes ``<out>/<preset>/`` per run (metrics, checkpoint, loss.png), ``<out>/comparison.md``,
``<out>/comparison.json`` and ``<out>/valid_curves.png`` (validation loss against tokens seen).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import replace
from pathlib import Path

from .._files import atomic_write_text, to_jsonable
from ..runtime import call_in_fresh_process
from .distributed import DistInfo, cleanup, setup_distributed
from .loop import TrainConfig, parse_budget, train
from .metrics import plot_curves, read_metrics


def compare(presets: list[str], base: TrainConfig, *, evals_per_run: int = 8) -> dict:
    """Train each preset with ``base``'s settings; evaluate ``evals_per_run`` times per run unless
    ``base`` sets eval_every or eval_every_s."""
    if not presets:
        raise ValueError("presets: give at least one preset name")
    if len(set(presets)) != len(presets):  # each run writes to out/NAME: a repeat would overwrite the first
        raise ValueError(f"presets: each preset once, got {list(presets)}")
    base.check()  # e.g. neither max_steps nor budget: said before any arithmetic on them
    for p in presets:  # an unknown name, or one the task cannot train: said before any training
        replace(base, preset=p).check()
    # Under torchrun every rank runs this and rank 0 writes; one process group for all the runs.
    # (No cleanup on an error: its barrier would wait for ranks stuck in a collective.)
    info = setup_distributed(base.device)
    result = _compare(presets, base, evals_per_run, info)
    cleanup(info)
    return result


def _compare(presets: list[str], base: TrainConfig, evals_per_run: int, info: DistInfo) -> dict:
    out = Path(base.out_dir)
    world, is_main = info.world_size, info.is_main
    kind, amount = parse_budget(base.budget) if base.budget else ("steps", base.max_steps)
    summaries, curves = [], {}
    for name in presets:
        cfg = copy.deepcopy(base)
        cfg.preset, cfg.out_dir = name, str(out / name)
        if cfg.eval_every or cfg.eval_every_s:
            pass  # the caller's evaluation interval is kept
        elif kind == "seconds":
            cfg.eval_every_s = amount / evals_per_run
        elif kind == "steps":
            cfg.eval_every = max(1, amount // evals_per_run)
        else:  # tokens: the steps they take, or max_steps when that comes first (as train() stops)
            steps = math.ceil(amount / (cfg.batch_size * cfg.seq_len * cfg.grad_accum * world))
            cfg.eval_every = max(1, min(steps, cfg.max_steps or steps) // evals_per_run)
        print(f"\n=== {name} ===", flush=True)
        summary = _train_isolated(cfg)
        if summary.get("interrupted_at") is not None:  # Ctrl-C: saved; the other presets do not start
            raise KeyboardInterrupt(f"{name} interrupted after step {summary['interrupted_at']}")
        summaries.append(summary)
        if is_main:
            records = read_metrics(Path(cfg.out_dir) / "metrics.jsonl")
            curves[name] = [(r["tokens"], r["loss"]) for r in records if r.get("kind") == "eval"]
    table = comparison_table(summaries, base, world)
    if not is_main:
        return {"summaries": summaries, "table": table, "plot": None}
    atomic_write_text(out / "comparison.md", table + "\n")
    atomic_write_text(out / "comparison.json", json.dumps(to_jsonable(summaries), indent=1))  # (NaN: null)
    plot_curves(curves, out / "valid_curves.png", xlabel="training tokens",
                ylabel="training-split loss (no dev file)" if _scored_on_train(summaries) else "validation loss",
                title=f"{base.data}, budget {base.budget or f'{base.max_steps} steps'}, seed {base.seed}")
    print("\n" + table)
    return {"summaries": summaries, "table": table, "plot": str(out / "valid_curves.png")}


def _train_isolated(cfg: TrainConfig) -> dict:
    """Train in a fresh process so that peak memory is this run's own (single-process runs only)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return train(cfg)
    return call_in_fresh_process(train, cfg)


# The evaluation columns by task: (heading, eval key, format). A classifier has no perplexity (its
# table had shown ppl nan for every model, and no accuracy).
_EVAL_COLUMNS = {
    "cls": [("valid loss", "loss", ".4f"), ("accuracy", "accuracy", ".4f"), ("macro F1", "f1", ".4f"),
            ("MCC", "mcc", ".4f")],
    "regression": [("valid loss (MSE)", "loss", ".4f"), ("Pearson", "pearson", ".4f"), ("Spearman", "spearman", ".4f")],
    "lm": [("valid loss", "loss", ".4f"), ("valid ppl", "ppl", ".2f")],
}


def _scored_on_train(summaries: list[dict]) -> bool:
    """Whether the runs scored their training split (a classification folder without a dev file)."""
    return any((s.get("eval") or {}).get("eval_split") == "train" for s in summaries)


def comparison_table(summaries: list[dict], base: TrainConfig, world_size: int = 1) -> str:
    regression = any("pearson" in (s.get("eval") or {}) for s in summaries)  # scores (STS-B), not classes
    columns = _EVAL_COLUMNS["regression" if regression else "cls" if base.task == "cls" else "lm"]
    # the batch of an optimizer step: per process x accumulation x processes (the tokens column counts all)
    procs = f"x{world_size} processes" if world_size > 1 else ""
    on_train = _scored_on_train(summaries)
    if on_train:  # a classification folder without a dev file: the runs scored what they trained on
        columns = [(("train-split " + h.removeprefix("valid ")) if h.startswith("valid ") else h, k, f)
                   for h, k, f in columns]
    rows = [
        f"Data `{base.data}`, budget {base.budget or f'{base.max_steps} steps'}, seq_len {base.seq_len}, "
        f"batch {base.batch_size}x{base.grad_accum}{procs}, seed {base.seed}, {base.dtype}."
        + (" Scored on the training split (no dev file): not held-out numbers." if on_train else ""),
        "",
        "| model | params | steps | tokens | tokens/s | peak mem (MB) | " + " | ".join(c[0] for c in columns) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(columns),
    ]
    for s in summaries:
        ev = s.get("eval") or {}
        if s.get("diverged_at") is not None:
            valid = f"diverged at step {s['diverged_at']} |" + " — |" * (len(columns) - 1)
        else:
            valid = " | ".join(format(ev.get(key, float("nan")), fmt) for _, key, fmt in columns) + " |"
        rows.append(f"| {s['name']} | {s['params'] / 1e6:.2f}M | {s['steps']} | {s['tokens']:,} | "
                    f"{s['tokens_per_s']:,.0f} | {s['peak_mem_mb']:,.0f} | {valid}")
    return "\n".join(rows)
