"""Gradient stability during training: G_t = ‖∇_θ L_t‖₂ and its relative standard deviation (spec §10).

    recorder = GradientRecorder(params="mixer", per_layer=True, jsonl_path="run/grad_norms.jsonl")
    for step, batch in ...:
        loss.backward()
        recorder.record(model, step)        # after backward, before optimizer.step / zero_grad
        ...
    recorder.save_summary("run/grad_rsd.json", start=1000)   # RSD = std_t(G_t) / mean_t(G_t)

Mode ``norm_over_steps`` (ours, spec §10): RSD over steps of the global L2 norm of the selected
parameters' gradients; std is the population std (ddof = 0). Every summary names the mode, the
parameter set and the step range, as reported RSDs must. ``record`` does no host sync: norms
stay on the device and are copied in one transfer every ``sync_every`` records (or on demand).
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from .._files import atomic_path, read_jsonl
from ..ops._checks import check_positive_int
from ._io import new_figure, save_figure, save_json, to_jsonable

MODE = "norm_over_steps"
PARAM_SETS = {"mixer": ("*.mixer.*", "mixer.*"), "all": ("*",)}
_LAYER_RE = re.compile(r"(?:^|\.)(layers\.\d+)(?:\.|$)")


def _layer_key(name: str, param_set: str) -> str:
    """Group name for per-layer norms: 'layers.3' (or the mixer's own prefix, or 'other')."""
    m = _LAYER_RE.search(name)
    if m:
        return m.group(1)
    if param_set == "mixer" and ".mixer." in name:
        return name.split(".mixer.")[0]
    return "other"


def summarize(values: Sequence[float], steps: Sequence[int], *, param_set: str, key: str = "grad_norm",
              start: int | None = None, end: int | None = None, every_step: bool = True) -> dict:
    """RSD of ``values`` restricted to steps in [start, end]; non-finite values are counted and excluded.
    ``every_step``: the series was recorded at every step (the recorder's), so the steps of the range
    with no record are counted (``missing_steps``); a metrics.jsonl logged every N steps is not."""
    if start is not None and end is not None and start > end:
        raise ValueError(f"start ({start}) must be <= end ({end})")
    bad = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)
    if bad is not None:  # two runs' records mixed in one file, or a resumed run's repeated steps
        raise ValueError(f"steps must increase, got step {steps[bad]} after {steps[bad - 1]} (records of more than "
                         "one run in one file?)")
    pairs = [(s, v) for s, v in zip(steps, values, strict=True)
             if (start is None or s >= start) and (end is None or s <= end)]
    if steps and not pairs:  # a range that misses every record: an RSD of nothing would read as a result
        raise ValueError(f"no recorded step lies in [{start}, {end}] (recorded: {steps[0]}..{steps[-1]})")
    finite = [(s, v) for s, v in pairs if v is not None and math.isfinite(v)]
    # (another key's RSD, e.g. the loss's, is not the gradient norm's mode)
    out = {"mode": MODE if key == "grad_norm" else f"rsd_over_steps({key})", "param_set": param_set, "key": key, "std": "population (ddof=0)",
           "step_range": [finite[0][0], finite[-1][0]] if finite else None,
           "requested_range": [start, end], "num_steps": len(finite), "num_nonfinite": len(pairs) - len(finite)}
    if key == "grad_norm" and every_step:
        # recorded at every step: steps in the range with no record (a run resumed with --grad-stats
        # after steps trained without it) are said, where the range alone had claimed them
        out["missing_steps"] = pairs[-1][0] - pairs[0][0] + 1 - len(pairs) if pairs else 0
    if not finite:
        return {**out, "mean": None, "stdev": None, "rsd": None}
    if len(finite) < 2:  # the spread of one value is 0 by definition: it would read as perfectly stable
        return {**out, "mean": float(finite[0][1]), "stdev": None, "rsd": None}
    x = torch.tensor([v for _, v in finite], dtype=torch.float64)
    mean, std = float(x.mean()), float(x.std(correction=0))
    return {**out, "mean": mean, "stdev": std, "rsd": std / mean if mean > 0 else None}


class GradientRecorder:
    """Records G_t after each backward.

    params: "mixer" (default; parameters under ``*.mixer.*``, the token mixers), "all", or a list of
    fnmatch patterns over parameter names. per_layer: also record one norm per layer
    (``layers.<i>``). jsonl_path: one JSON line per record, written at each sync (``flush``); the
    file is started anew, unless ``resume``: then its records (a resumed run's earlier steps; the
    caller truncates it to the checkpoint's step) are read back, count in every summary, and new
    ones are appended.
    """

    def __init__(self, params: str | Sequence[str] = "mixer", *, per_layer: bool = False,
                 jsonl_path: str | Path | None = None, sync_every: int = 100, resume: bool = False):
        if isinstance(params, str):
            if params not in PARAM_SETS:
                raise ValueError(f"params must be one of {tuple(PARAM_SETS)} or a list of name patterns, got {params!r}")
            self.param_set, self.patterns = params, PARAM_SETS[params]
        else:
            self.patterns = tuple(params)
            if not self.patterns:
                raise ValueError("params: empty pattern list")
            self.param_set = ",".join(self.patterns)
        self.per_layer = per_layer
        self.jsonl_path = Path(jsonl_path) if jsonl_path is not None else None
        check_positive_int("sync_every", sync_every)
        self.sync_every = sync_every
        self._steps: list[int] = []
        self._values: list[float] = []
        self._layer_values: dict[str, list[float]] = {}
        # (step, [1 + n_groups] norms still on the device, group names)
        self._pending: list[tuple[int, torch.Tensor, list[str]]] = []
        self._selection: tuple[int, list[tuple[str, torch.nn.Parameter]], list[str]] | None = None
        self.skipped_steps: list[int] = []
        self._appending = False  # False: the first flush starts the file anew
        if resume and self.jsonl_path is not None and self.jsonl_path.exists():
            for rec in read_jsonl(self.jsonl_path):
                self._append(int(rec["step"]), rec["grad_norm"], rec.get("per_layer", {}))
            self._appending = True

    def _append(self, step: int, value: float, per_layer: dict) -> None:
        """One record; every per-layer list stays aligned with ``steps`` (NaN where a record lacks
        the group: a resumed file written without per_layer, or a layer with no gradient)."""
        self._steps.append(step)
        self._values.append(value)
        if not self.per_layer:
            return
        for g in per_layer:  # in the record's order (a set difference had put the layers in hash order)
            if g not in self._layer_values:
                self._layer_values[g] = [float("nan")] * (len(self._steps) - 1)
        for g, vals in self._layer_values.items():
            vals.append(per_layer.get(g, float("nan")))

    # -- selection ------------------------------------------------------------------------
    def _select(self, model) -> tuple[list[tuple[str, torch.nn.Parameter]], list[str]]:
        # The selection is cached per model object: name matching every step would cost more
        # than the norms on a small model.
        if self._selection is None or self._selection[0] != id(model):
            chosen = [(n, p) for n, p in model.named_parameters()
                      if p.requires_grad and any(fnmatch.fnmatchcase(n, pat) for pat in self.patterns)]
            if not chosen:
                raise ValueError(f"no trainable parameter matches {self.patterns} (param set {self.param_set!r})")
            groups = sorted({_layer_key(n, self.param_set) for n, _ in chosen},
                            key=lambda g: (int(g.split(".")[1]) if g.startswith("layers.") else 1 << 30, g))
            self._selection = (id(model), chosen, groups)
        return self._selection[1], self._selection[2]

    # -- recording ------------------------------------------------------------------------
    @torch.no_grad()
    def record(self, model, step: int) -> None:
        """Store G_t for this step (call after backward). Steps where no selected parameter has a
        gradient are skipped and listed in ``skipped_steps``."""
        chosen, groups = self._select(model)
        with_grad = [(n, p.grad) for n, p in chosen if p.grad is not None]
        if not with_grad:
            self.skipped_steps.append(int(step))
            return
        # per-parameter norms in fp32 (one fused kernel per device/dtype), squared and summed:
        # the global norm equals √Σ‖g_p‖², the per-layer norms are partial sums of the same terms
        # (selection by Python lists of 0-d tensors, not index tensors: no host→device copies)
        # (dtype=fp32: the norm itself is accumulated in fp32, not rounded to bf16 or overflowing fp16)
        # (fp64 gradients keep fp64: _foreach_norm refuses to narrow them, and an fp64 run wants fp64)
        grads = [g for _, g in with_grad]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(torch.promote_types(g.dtype, torch.float32), []).append(i)
        sq: list = [None] * len(grads)
        acc = max(by_dtype, key=lambda d: torch.finfo(d).bits)  # one dtype for the sums
        for dt, idx in by_dtype.items():
            for i, n in zip(idx, torch._foreach_norm([grads[i] for i in idx], 2, dtype=dt), strict=True):
                sq[i] = n.to(acc).pow(2)
        norms = [torch.stack(sq).sum().sqrt()]
        if self.per_layer:
            keys = [_layer_key(n, self.param_set) for n, _ in with_grad]
            for grp in groups:
                part = [v for v, k in zip(sq, keys, strict=True) if k == grp]
                norms.append(torch.stack(part).sum().sqrt() if part else sq[0].new_full((), float("nan")))
        self._pending.append((int(step), torch.stack(norms), groups))
        if len(self._pending) >= self.sync_every:
            self.flush()

    def flush(self) -> None:
        """Copy pending norms to the host (one transfer) and append them to the JSONL file."""
        if not self._pending:
            return
        host = torch.stack([v for _, v, _ in self._pending]).double().cpu().tolist()
        lines = []
        for (step, _, groups), vals in zip(self._pending, host, strict=True):
            per = dict(zip(groups, vals[1:], strict=True)) if self.per_layer else {}
            self._append(step, vals[0], per)
            rec = {"step": step, "grad_norm": vals[0], "param_set": self.param_set}
            if self.per_layer:
                rec["per_layer"] = per
            lines.append(rec)
        self._pending.clear()
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            with self.jsonl_path.open("a" if self._appending else "w") as f:
                for rec in lines:
                    f.write(json.dumps(to_jsonable(rec)) + "\n")
            self._appending = True

    # -- results (each accessor flushes first, so it never misses pending steps) --------------
    @property
    def steps(self) -> list[int]:
        self.flush()
        return self._steps

    @property
    def values(self) -> list[float]:
        """G_t per recorded step, aligned with ``steps``."""
        self.flush()
        return self._values

    @property
    def layer_values(self) -> dict[str, list[float]]:
        self.flush()
        return self._layer_values

    def rsd(self, start: int | None = None, end: int | None = None) -> float | None:
        """std_t(G_t) / mean_t(G_t) over recorded steps in [start, end]."""
        return self.summary(start, end)["rsd"]

    def summary(self, start: int | None = None, end: int | None = None) -> dict:
        """RSD summary (mode, param set, step range, mean, stdev, rsd) and per-layer RSDs."""
        self.flush()
        out = summarize(self.values, self.steps, param_set=self.param_set, start=start, end=end)
        out["skipped_steps"] = len(self.skipped_steps)
        if self.per_layer:
            out["per_layer"] = {g: summarize(v, self.steps, param_set=f"{self.param_set}@{g}", start=start, end=end)
                                for g, v in self.layer_values.items()}
        return out

    def save_summary(self, path, start: int | None = None, end: int | None = None) -> Path:
        return save_json(self.summary(start, end), path)

    def save_jsonl(self, path) -> Path:
        """Write every recorded step (one JSON line each) to ``path`` (overwrites)."""
        self.flush()
        path = Path(path)
        with atomic_path(path) as tmp, tmp.open("w") as f:
            for i, (step, v) in enumerate(zip(self.steps, self.values, strict=True)):
                rec = {"step": step, "grad_norm": v, "param_set": self.param_set}
                if self.per_layer:
                    rec["per_layer"] = {g: vals[i] for g, vals in self.layer_values.items()}
                f.write(json.dumps(to_jsonable(rec)) + "\n")
        return path

    def plot(self, path, title: str | None = None) -> Path:
        self.flush()
        return plot_grad_norms(self.steps, self.values, path, title=title or f"G_t over {self.param_set}",
                               per_layer=self.layer_values if self.per_layer else None)


GRAD_NORM_LABEL = "‖∇θ L‖₂"


def plot_grad_norms(steps: Sequence[int], values: Sequence[float], path, *, title: str = "",
                    per_layer: dict[str, Sequence[float]] | None = None,
                    window: tuple[int, int] | None = None, ylabel: str = GRAD_NORM_LABEL) -> Path:
    """``window``: the (first, last) step an RSD in the title covers, shaded; ``ylabel``: what
    ``values`` are (another key than the gradient norm names itself)."""
    fig, axes = new_figure(size=(6.0, 4.0))
    ax = axes[0, 0]
    if window is not None:
        ax.axvspan(*window, color="C0", alpha=0.1, label="RSD window")
    clean = [float("nan") if v is None else v for v in values]
    ax.plot(steps, clean, lw=1.2, color="k", label="total" if ylabel == GRAD_NORM_LABEL else ylabel)
    for g, vals in (per_layer or {}).items():
        ax.plot(steps, vals, lw=0.8, label=g)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def rsd_from_jsonl(path, key: str = "grad_norm", *, start: int | None = None, end: int | None = None,
                   param_set: str | None = None, step_key: str = "step") -> dict:
    """RSD of ``key`` over the lines of a metrics JSONL file (lines without the key are ignored).

    ``param_set`` is recorded in the summary; if None it is taken from the lines' "param_set"
    field when present, else "unknown" (name it: spec §10 asks every RSD to say what it covers).
    """
    steps, values, sets, kinds = [], [], set(), set()
    for i, rec in enumerate(read_jsonl(path), 1):
        # a training run's metrics.jsonl: its eval records also carry "loss" at the same steps
        # (an MLM step that masked nothing has no loss and no gradient: not a point of the series)
        if key in rec and step_key in rec and rec.get("kind", "train") == "train" and not rec.get("no_targets"):
            step, value = rec[step_key], rec[key]
            # (a string had failed in the arithmetic naming neither file nor key; true was read as 1.0,
            # a negative norm averaged in)
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"{path}: record {i}: {step_key!r} must be an integer step, got {step!r}")
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{path}: record {i}: {key!r} must be a number or null, got {value!r}")
            if key == "grad_norm" and value is not None and value < 0:
                raise ValueError(f"{path}: record {i}: a gradient norm cannot be negative, got {value!r}")
            steps.append(step)
            values.append(value)
            kinds.add(rec.get("kind"))
            if "param_set" in rec:
                sets.add(rec["param_set"])
    if not values:
        raise ValueError(f"{path}: no record has both {key!r} and {step_key!r} (is it a metrics or grad_norms "
                         "JSONL file, and the key right?)")
    # the training loop's grad_norm is over all parameters, before clipping (train/loop.py)
    held = sets or ({"all"} if key == "grad_norm" and kinds == {"train"} else set())
    if param_set is not None and held and {param_set} != held:  # the report would name what the file does not hold
        raise ValueError(f"param_set {param_set!r}: {path} records norms over {', '.join(sorted(held))}")
    if param_set is None:
        param_set = ",".join(sorted(held)) or "unknown"
    # the recorder's grad_norms.jsonl (its records name their param_set) holds every step; a run's
    # metrics.jsonl only every --log-every steps, whose gaps are not missing steps
    out = summarize(values, steps, param_set=param_set, key=key, start=start, end=end, every_step=bool(sets))
    out["source"] = str(path)
    return out


def run_grad_stats(metrics_jsonl, out_dir="analysis_out/grad_stats", *, key: str = "grad_norm",
                   start: int | None = None, end: int | None = None, param_set: str | None = None) -> dict:
    """RSD from a metrics JSONL: writes grad_rsd.json and grad_norms.png; returns the summary."""
    out = Path(out_dir)
    summary = rsd_from_jsonl(metrics_jsonl, key, start=start, end=end, param_set=param_set)
    recs = [r for r in read_jsonl(metrics_jsonl)
            if key in r and "step" in r and r.get("kind", "train") == "train" and not r.get("no_targets")]
    # with --start/--end the plot still shows every step: shade and name the steps the RSD covers
    window = summary["step_range"] if (start is not None or end is not None) and summary["step_range"] else None
    where = f", steps {window[0]}-{window[1]}" if window else ""
    files = [save_json(summary, out / "grad_rsd.json"),
             plot_grad_norms([r["step"] for r in recs], [r[key] for r in recs], out / "grad_norms.png",
                             title=f"{key}: RSD={summary['rsd']} ({summary['param_set']}{where})", window=window,
                             **({} if key == "grad_norm" else {"ylabel": key}))]
    summary["files"] = [str(f) for f in files]
    return summary
