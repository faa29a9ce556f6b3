"""Scaling ablation (Table 1's argument): does linear attention train without its denominator?

Three models equal in everything but the token mixer, every layer of the same type:
    "linear_elu"            1+elu linear attention with the denominator (scaling) — the baseline
    "linear_elu_no_denom"   the same without the denominator and with no norm — unbounded outputs,
                            expected to diverge / train badly (paper: ppl 797 vs 4.98)
    "norm"                  NormAttention: no denominator, an RMSNorm on the output instead (with the
                            1+elu kernel and without LRPE, as the linear_elu layers: only the norm
                            differs, whatever kernel the base preset's NormAttention uses)

The base may be causal (an LM) or bidirectional (a masked LM, the paper's Table 1 setting).

The training itself belongs to the caller (the training engine): ``train_fn(config, budget)``
returns [(step, loss), ...]. This module builds the configs, runs them, judges divergence and
plots the three loss curves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from ._io import new_figure, save_figure, save_json

ABLATION_NAMES = ("linear_elu", "linear_elu_no_denom", "norm")


def linear_elu_registered() -> bool:
    """Is the ``linear_elu`` layer type available (it is added by the baselines, maybe not yet)?"""
    from ..layers import LAYER_TYPES
    from ..models import presets

    presets._load_extra_presets()  # baseline modules register their layer types on import
    return "linear_elu" in LAYER_TYPES


def ablation_configs(base: str = "t2-lm-tiny", **overrides) -> dict:
    """The three TransNormerConfigs from preset ``base`` (+ overrides), differing only in the mixers
    (NormAttention on 1+elu without its LRPE, as the linear_elu layers: a T1 base's elu kernel, or
    its LRPE, would have been a second difference)."""
    from ..models.presets import get_config

    ref = get_config(base, **overrides)
    L, opts = ref.num_hidden_layers, dict(ref.layer_options)
    # both linear arms pinned: a linear-elu-noscale base's own denominator=False had made the "with
    # denominator" arm the same model as the other, and the NormAttention arm runs 1+elu
    elu = {**opts.get("linear_elu", {}), "kernel": "1+elu"}
    with_denom = {**opts, "linear_elu": {**elu, "denominator": True}}
    no_denom = {**opts, "linear_elu": {**elu, "denominator": False}}
    return {
        "linear_elu": get_config(base, **overrides, layer_types=["linear_elu"] * L, layer_options=with_denom),
        "linear_elu_no_denom": get_config(base, **overrides, layer_types=["linear_elu"] * L, layer_options=no_denom),
        "norm": get_config(base, **{**overrides, "lrpe": "none", "norm_kernel": "1+elu"}, layer_types=["norm"] * L,
                           layer_options=opts),
    }


def curve_stats(curve) -> dict:
    """Summary of one loss curve [(step, loss)]; ``diverged`` = a non-finite loss, or the final loss
    (mean of the last 10% of points) above the first loss, i.e. training went backwards."""
    losses = [float(v) for _, v in curve]
    if not losses:
        return {"num_points": 0, "diverged": None}
    finite = [v for v in losses if math.isfinite(v)]
    nonfinite = len(finite) < len(losses)
    tail = losses[-max(1, len(losses) // 10):]
    final = sum(tail) / len(tail)
    return {"num_points": len(losses), "first": losses[0], "final": final,
            "min": min(finite) if finite else None, "nonfinite": nonfinite,
            "diverged": bool(nonfinite or not math.isfinite(final) or final > losses[0])}


def plot_ablation(curves: dict, path, title: str = "scaling ablation") -> Path:
    fig, axes = new_figure(size=(6.0, 4.0))
    ax = axes[0, 0]
    for name, curve in curves.items():
        steps = [s for s, _ in curve]
        losses = [v if math.isfinite(v) else float("nan") for _, v in curve]
        ax.plot(steps, losses, lw=1.2, label=name)
        bad = [s for s, v in curve if not math.isfinite(v)]
        if bad:  # mark where a run blew up, since NaN points are invisible
            ax.axvline(bad[0], ls=":", lw=1, color=ax.lines[-1].get_color())
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def run_scaling_ablation(train_fn: Callable, budget, out_dir="analysis_out/ablation", *, base: str = "t2-lm-tiny",
                         configs: dict | None = None, require_registered: bool = True, **overrides) -> dict:
    """Train the three configs with ``train_fn(config, budget) -> [(step, loss), ...]`` and plot.

    ``configs`` replaces :func:`ablation_configs` (e.g. names → preset names for a custom
    train_fn). Writes ablation.json and ablation.png (unless ``out_dir`` is None: under torchrun
    the ranks but the first); returns {"curves", "stats", "files"}.
    """
    if configs is None:
        if require_registered and not linear_elu_registered():
            raise RuntimeError("layer type 'linear_elu' is not registered (baseline layers not available)")
        configs = ablation_configs(base, **overrides)
    curves, stats = {}, {}
    for name, cfg in configs.items():
        curve = [(int(s), float(v)) for s, v in train_fn(cfg, budget)]
        curves[name], stats[name] = curve, curve_stats(curve)
    if out_dir is None:
        return {"curves": curves, "stats": stats, "files": []}
    out = Path(out_dir)
    files = [save_json({"budget": budget, "base": base, "stats": stats, "curves": curves}, out / "ablation.json"),
             plot_ablation(curves, out / "ablation.png")]
    return {"curves": curves, "stats": stats, "files": [str(f) for f in files]}
