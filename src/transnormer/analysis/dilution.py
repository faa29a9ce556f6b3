"""Attention dilution (Fig. 2 of the paper): the locally accumulated attention score (spec §10).

For row i of an N×N attention matrix and a fraction r ∈ [0, 1], l(i; r) = Σ_{j=start}^{end} p_ij
over a window around i; L(r) averages l over rows (and heads, samples). With h = ⌊rN/2⌋:

    clip:   start = max(0, i−h), end = min(N−1, i+h)           (window cut at the sequence ends)
    shift:  W = min(N, 2h+1); start = min(max(0, i−h), N−W), end = start+W−1
            (same length everywhere: pushed inward at the ends)
    causal: start = max(0, i−⌊rN⌋), end = i                    (the ⌊rN⌋ previous tokens and i)

The window always contains i, so L(0) is the mean diagonal weight. Windows grow with r (nested),
so L(r) is non-decreasing for non-negative P. For a uniform matrix (p_ij = 1/N):
shift gives exactly min(N, 2h+1)/N, within 1/N of r; clip gives (2h+1)/N − h(h+1)/N² ≈ r − r²/4
(the rows near the ends lose part of their window), so clip reads below the diagonal even for a
fully diluted layer — always report the mode. ⌊·⌋ is taken with a 1e-9 slack so that r·N that is an
integer in exact arithmetic (0.29·100) is not rounded down by float error.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ..layers.base import default_positions
from ..ops._checks import check_positive_int
from ._io import new_figure, save_figure, save_json
from .attention_maps import NoAttentionMap, attention_map, eval_mode, pooled_note

MODES = ("clip", "shift", "causal")
MAP_ELEMENTS_BUDGET = 2**27  # float64 entries of attention maps held at once (1 GiB)
DEFAULT_RS = tuple(round(0.05 * i, 2) for i in range(21))  # 0, 0.05, ..., 1 (spec §10)


def _floor(x: float) -> int:
    return math.floor(x + 1e-9)


def window_bounds(N: int, r: float, mode: str = "clip") -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive window [start_i, end_i] for every row i: two long tensors [N]."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"r must be in [0, 1], got {r}")
    i = torch.arange(N)
    if mode == "causal":
        return (i - _floor(r * N)).clamp_min(0), i
    h = _floor(r * N / 2)
    if mode == "clip":
        return (i - h).clamp_min(0), (i + h).clamp_max(N - 1)
    W = min(N, 2 * h + 1)
    start = (i - h).clamp(0, N - W)
    return start, start + W - 1


def locally_accumulated_score(P: torch.Tensor, rs: Sequence[float] = DEFAULT_RS, mode: str = "clip",
                              reduce: bool = True) -> torch.Tensor:
    """L(r) of attention matrices P [..., N, N] (rows = queries).

    Returns [R] (mean over rows and all leading dims, float64) or, with ``reduce=False``, the
    per-row scores l [..., N, R]. Computed from row prefix sums, O(N² + R·N) per matrix.
    """
    if P.dim() < 2 or P.shape[-1] != P.shape[-2]:
        raise ValueError(f"P must be [..., N, N], got {tuple(P.shape)}")
    N = P.shape[-1]
    if N == 0:
        raise ValueError("P must have N >= 1")
    if len(rs) == 0:
        raise ValueError("rs must hold at least one window fraction")
    # prefix[..., i, j] = Σ_{j' < j} p_ij', so a window sum is one subtraction
    prefix = torch.nn.functional.pad(P.double().cumsum(-1), (1, 0))
    bounds = [window_bounds(N, float(r), mode) for r in rs]
    start = torch.stack([b[0] for b in bounds], -1).to(P.device)  # [N, R]
    end = torch.stack([b[1] for b in bounds], -1).to(P.device)
    lead = prefix.shape[:-2]
    hi = prefix.gather(-1, (end + 1).expand(*lead, N, len(bounds)))
    lo = prefix.gather(-1, start.expand(*lead, N, len(bounds)))
    rows = hi - lo  # [..., N, R]
    return rows.reshape(-1, len(bounds)).mean(0) if reduce else rows


def curve_auc(rs: Sequence[float], curve: Sequence[float]) -> float:
    """Area under L(r) by the trapezoid rule (1 = all mass on the diagonal, 0.5 ≈ fully diluted)."""
    return float(torch.trapezoid(torch.as_tensor(curve, dtype=torch.float64),
                                 torch.as_tensor(rs, dtype=torch.float64)))


def uniform_reference(N: int, rs: Sequence[float] = DEFAULT_RS, mode: str = "clip",
                      causal: bool = False) -> list[float]:
    """L(r) of the fully diluted matrix: uniform over all keys, or over j ≤ i for a causal model."""
    if causal:
        P = torch.ones(N, N, dtype=torch.float64).tril()
        P = P / P.sum(-1, keepdim=True)
    else:
        P = torch.full((N, N), 1.0 / N, dtype=torch.float64)
    return locally_accumulated_score(P, rs, mode).tolist()


# --------------------------------------------------------------------------- model capture

def find_mixers(model) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every token mixer (``*.mixer``) in forward order."""
    return [(n, m) for n, m in model.named_modules() if n == "mixer" or n.endswith(".mixer")]


@torch.no_grad()
def capture_mixer_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """Run the model once and return, per mixer, (name, module, x [B, T, d], mask, positions).

    Pre-hooks on ``block.mixer`` see exactly what the mixer gets — after the block's pre-norm (or
    the raw residual stream in post-norm), with the positions and the (left padding moved right)
    mask the model computed — so no model internals are re-derived here.
    """
    mixers = find_mixers(model)
    if not mixers:
        raise ValueError("model has no token mixers (no module named '*.mixer')")
    seen: dict[int, tuple] = {}

    def hook(idx):
        def fn(module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            seen[idx] = (x.detach(), kwargs.get("attention_mask"), kwargs.get("positions"))
        return fn

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, (_, m) in enumerate(mixers)]
    try:
        with eval_mode(model):  # no dropout in the embeddings / residuals while capturing
            model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for h in handles:
            h.remove()
    return [(name, m, *seen[i]) for i, (name, m) in enumerate(mixers) if i in seen]


def _layer_types(model) -> list[str] | None:
    return getattr(getattr(model, "config", None), "layer_types", None)


@torch.no_grad()
def dilution_curves(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    rs: Sequence[float] = DEFAULT_RS, mode: str = "clip") -> dict:
    """Per-layer L(r) of ``model`` on input_ids [B, T] (attention_mask [B, T], 1 = real token).

    Each sample is scored on its real tokens only (N = its length), and rows of all samples and
    heads are pooled with equal weight. Returns a JSON-ready dict::

        {"mode", "rs", "seq_len", "num_samples", "num_rows", "causal",
         "uniform_reference": [R] (L of uniform attention over the allowed keys, N = T),
         "layers": [{"index", "name", "layer_type", "class", "kind", "flagged", "note",
                     "negative_fraction", "curve": [R], "auc"}],
         "skipped": [{"index", "name", "class", "reason"}]}

    Layers without an attention matrix (see :mod:`.attention_maps`) are listed in ``skipped``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    rs = [float(r) for r in rs]
    if not rs:
        raise ValueError("rs must hold at least one window fraction")
    if any(b <= a for a, b in zip(rs, rs[1:], strict=False)):  # the AUC's trapezoids would be negative or wrong
        raise ValueError(f"rs must be increasing, got {rs}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got {getattr(input_ids, 'shape', input_ids)}")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask must be [B, T] = {tuple(input_ids.shape)}, got "
                             f"{tuple(attention_mask.shape)}")
        if not bool(attention_mask.bool().any()):
            raise ValueError("attention_mask marks no real token: nothing to score")
    B, T = input_ids.shape
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    attention_mask = None if attention_mask is None else attention_mask.to(device)
    captured = capture_mixer_inputs(model, input_ids, attention_mask)
    types = _layer_types(model)
    layers, skipped = [], []
    num_rows = None
    for idx, (name, mixer, x, mask, positions) in enumerate(captured):
        info = {"index": idx, "name": name, "class": type(mixer).__name__,
                "layer_type": types[idx] if types and idx < len(types) else None}
        if positions is None:
            positions = default_positions(x, mask)
        H = getattr(mixer, "num_heads", 16)
        # samples per map call, so that one float64 map [b, H, T, T] stays under ~1 GiB
        per_call = max(1, MAP_ELEMENTS_BUDGET // max(1, H * T * T))
        rows, maps = [], []
        try:
            for b0 in range(0, B, per_call):
                sl = slice(b0, b0 + per_call)
                amap = attention_map(mixer, x[sl], None if mask is None else mask[sl], positions[sl])
                maps.append((amap, x[sl].shape[0]))
                for b in range(amap.weights.shape[0]):
                    # select the real tokens by the mask the mixer saw (not by slicing a prefix),
                    # so any padding layout works; N is the sample's own length
                    P = amap.weights[b]
                    if mask is not None:
                        keep = mask[b0 + b].bool().nonzero().squeeze(-1)
                        P = P[:, keep][:, :, keep]
                    if P.shape[-1] > 0:
                        rows.append(locally_accumulated_score(P, rs, mode, reduce=False).reshape(-1, len(rs)))
        except NoAttentionMap as e:
            skipped.append({**info, "reason": str(e)})
            warnings.warn(f"dilution: skipping layer {idx} ({info['class']}): no attention matrix", stacklevel=2)
            continue
        rows = torch.cat(rows)
        num_rows = rows.shape[0]
        curve = rows.mean(0)
        # the samples' maps come in chunks; one flagged chunk (|s|, which equals s where no score is
        # negative) names the layer's kind, not whichever chunk came first
        kind = next((m.kind for m, _ in maps if m.flagged), maps[0][0].kind)
        layers.append({**info, "kind": kind, "flagged": any(m.flagged for m, _ in maps),
                       "note": pooled_note([m for m, _ in maps]),  # (it had been the worst chunk's)
                       # a share of all the chunks' allowed scores (not a mean over samples, which
                       # would change with how the batch was chunked)
                       "negative_fraction": (sum(m.negative_fraction * m.num_allowed for m, _ in maps)
                                             / max(1, sum(m.num_allowed for m, _ in maps))),
                       "curve": curve.tolist(), "auc": curve_auc(rs, curve)})
    causal = bool(getattr(getattr(model, "config", None), "causal",
                          any(getattr(m, "causal", False) for _, m, *_ in captured)))
    # The fully diluted reference over the same rows as the curves: each sample is scored at its
    # own real length N_b, so the reference pools the uniform matrices of those lengths, row-weighted
    lengths = [T] * B if attention_mask is None else [int(n) for n in attention_mask.bool().sum(1).tolist() if n]
    ref = sum(n * torch.tensor(uniform_reference(n, rs, mode, causal), dtype=torch.float64) for n in lengths)
    return {"mode": mode, "rs": rs, "seq_len": T, "num_samples": B, "num_rows": num_rows, "causal": causal,
            "uniform_reference": (ref / sum(lengths)).tolist(), "layers": layers, "skipped": skipped}


# --------------------------------------------------------------------------- plots

def _draw(ax, results: dict, title: str | None = None) -> None:
    rs = results["rs"]
    ax.plot(rs, results["uniform_reference"], color="0.6", ls="--", lw=1, label="uniform" + (" causal" if results.get("causal") else "") + " (fully diluted)")
    for layer in results["layers"]:
        label = f"L{layer['index']} {layer['layer_type'] or layer['class']} ({layer['kind']})"
        if layer["flagged"]:
            label += " *|s|"
        ax.plot(rs, layer["curve"], marker="o", ms=2.5, lw=1.2, ls=":" if layer["flagged"] else "-", label=label)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("r (window fraction)")
    ax.set_ylabel("locally accumulated score L(r)")
    ax.set_title(f"{title or 'attention dilution'} [{results['mode']}, N={results['seq_len']}]", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="lower right")


def plot_dilution(results: dict, path, title: str | None = None) -> Path:
    """One curve per layer (dotted = flagged |s| map) with the uniform reference; writes a PNG."""
    fig, axes = new_figure()
    _draw(axes[0, 0], results, title)
    return save_figure(fig, path)


def plot_dilution_compare(results_by_model: dict[str, dict], path) -> Path:
    """Side-by-side panels, one per model, same axes; writes a PNG."""
    if not results_by_model:
        raise ValueError("results_by_model is empty")
    fig, axes = new_figure(ncols=len(results_by_model), sharey=True)
    for ax, (name, res) in zip(axes[0], results_by_model.items(), strict=True):
        _draw(ax, res, name)
    return save_figure(fig, path)


def dilution_summary(results: dict) -> dict:
    """{layer index: AUC} plus the uniform reference's AUC, the one-number view per layer."""
    return {"mode": results["mode"], "uniform_auc": curve_auc(results["rs"], results["uniform_reference"]),
            "auc": {str(layer["index"]): layer["auc"] for layer in results["layers"]},
            "flagged": [layer["index"] for layer in results["layers"] if layer["flagged"]]}


# --------------------------------------------------------------------------- entry point

def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def run_dilution(models, text_ids: torch.Tensor | None = None, out_dir="analysis_out/dilution", *,
                 attention_mask: torch.Tensor | None = None, rs: Sequence[float] = DEFAULT_RS,
                 mode: str = "clip", seq_len: int = 512, batch_size: int = 2, seed: int = 0) -> dict:
    """Dilution of several models: per-model JSON + PNG, a side-by-side PNG and a summary JSON.

    ``models``: a preset name, a model, or a list / dict of them (preset names are built with
    ``build_model`` at a fixed seed, i.e. random init). ``text_ids`` [B, T]: the token ids; None →
    uniform random ids [batch_size, seq_len] (seeded), drawn below the smallest vocabulary.
    Returns {"results": {name: dilution_curves(...)}, "summary": {name: dilution_summary(...)},
    "files": [paths]}.
    """
    from ..models.presets import build_model

    if isinstance(models, (str, torch.nn.Module)):
        models = [models]
    if not isinstance(models, dict):
        models = {(m if isinstance(m, str) else f"model{i}"): m for i, m in enumerate(models)}
    if not models:  # nothing scored would read as a finding, as a model without a scorable layer would
        raise ValueError("models must name at least one model")
    built = {}
    for name, m in models.items():
        if isinstance(m, str):
            torch.manual_seed(seed)
            m = build_model(m)
        built[name] = m
    if text_ids is None:  # (0 had been refused as an empty input_ids, naming neither argument)
        check_positive_int("batch_size", batch_size)
        check_positive_int("seq_len", seq_len)
        vocab = min(getattr(getattr(m, "config", None), "vocab_size", 2**31) for m in built.values())
        gen = torch.Generator().manual_seed(seed)
        text_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    out = Path(out_dir)
    stems = [_safe(name) for name in built]
    clash = next((n for n, s in zip(built, stems, strict=True) if stems.count(s) > 1), None)
    if clash is not None:  # one model's files had overwritten the other's
        raise ValueError(f"models: {[n for n, s in zip(built, stems, strict=True) if s == _safe(clash)]} would "
                         "write the same output files; rename one")
    results, summary, files = {}, {}, []
    for name, m in built.items():
        res = dilution_curves(m, text_ids, attention_mask, rs=rs, mode=mode)
        if not res["layers"]:  # every layer skipped: an empty result would read as a finding
            raise ValueError(f"models: {name} has no layer with an attention matrix to score "
                             f"({'; '.join(sorted({s['reason'] for s in res.get('skipped', [])}))})")
        res["model"] = name
        results[name], summary[name] = res, dilution_summary(res)
        files.append(save_json(res, out / f"dilution_{_safe(name)}_{mode}.json"))
        files.append(plot_dilution(res, out / f"dilution_{_safe(name)}_{mode}.png", title=name))
    if len(built) > 1:
        files.append(plot_dilution_compare(results, out / f"dilution_compare_{mode}.png"))
    files.append(save_json(summary, out / f"dilution_summary_{mode}.json"))
    return {"results": results, "summary": summary, "files": [str(f) for f in files]}
