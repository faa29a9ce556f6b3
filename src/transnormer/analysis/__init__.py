"""Analyses of the paper (spec §9-10): gradient bounds, attention dilution, gradient stability,
and the scaling ablation. Each ``run_*`` function writes a JSON of its numbers and a PNG.

    run_gradient_bound(out_dir)                            Proposition 3.1 + NormAttention bound
    run_dilution(["t1-lm-tiny", "t2-lm-tiny"], ids, out)   locally accumulated attention score
    GradientRecorder(...).record(model, step)              G_t during training; RSD summaries
    run_grad_stats(metrics_jsonl, out_dir)                 RSD from a metrics JSONL
    run_scaling_ablation(train_fn, budget, out_dir)        denominator / no-denominator / NormAttention
"""

from .ablation import ABLATION_NAMES, ablation_configs, curve_stats, plot_ablation, run_scaling_ablation
from .attention_maps import (
    ATTENTION_MAP_FNS,
    AttentionMap,
    NoAttentionMap,
    attention_map,
    has_attention_map,
    register_attention_map,
    row_normalize,
)
from .dilution import (
    DEFAULT_RS,
    MODES,
    capture_mixer_inputs,
    curve_auc,
    dilution_curves,
    dilution_summary,
    locally_accumulated_score,
    plot_dilution,
    plot_dilution_compare,
    run_dilution,
    uniform_reference,
    window_bounds,
)
from .grad_stats import GradientRecorder, plot_grad_norms, rsd_from_jsonl, run_grad_stats
from .gradient_bound import (
    norm_attention_grad,
    norm_attention_sweep,
    plot_gradient_bound,
    run_gradient_bound,
    unified_attention,
    unified_sweep,
)

__all__ = [
    "ABLATION_NAMES",
    "ATTENTION_MAP_FNS",
    "DEFAULT_RS",
    "MODES",
    "AttentionMap",
    "GradientRecorder",
    "NoAttentionMap",
    "ablation_configs",
    "attention_map",
    "capture_mixer_inputs",
    "curve_auc",
    "curve_stats",
    "dilution_curves",
    "dilution_summary",
    "has_attention_map",
    "locally_accumulated_score",
    "norm_attention_grad",
    "norm_attention_sweep",
    "plot_ablation",
    "plot_dilution",
    "plot_dilution_compare",
    "plot_grad_norms",
    "plot_gradient_bound",
    "register_attention_map",
    "row_normalize",
    "rsd_from_jsonl",
    "run_dilution",
    "run_grad_stats",
    "run_gradient_bound",
    "run_scaling_ablation",
    "unified_attention",
    "uniform_reference",
    "unified_sweep",
    "window_bounds",
]
