"""Attention matrices of token mixers, as the analyses define them (spec §10).

    attention_map(layer, x, attention_mask=None, positions=None) -> AttentionMap
        weights: [B, H, T, T] (query i, key j), rows ≥ 0 summing to ≤ 1

How a layer's matrix is obtained, in order:
1. a function registered here for the layer's class name (walking the MRO, so subclasses
   inherit it) — NormAttention, DiagAttention, SoftmaxAttention and KernelLinearAttention
   (linear_elu, Performer, cosFormer) are registered below, through their ``featurize``;
2. the layer's own ``attention_weights(x, attention_mask, positions)`` method, returning a
   [B, H, T, T] tensor or an :class:`AttentionMap` (the hook for layers added later: softmax,
   linear_elu, performer, ... need no edit here);
3. otherwise :class:`NoAttentionMap` is raised.

Everything goes through the quadratic references of :mod:`transnormer.ops.reference` (never the
fast paths), in float64, so the maps are exact up to the layer's own float32 projections.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..layers.base import default_positions, mask_and_positions
from ..ops._checks import check_right_padded
from ..ops.reference import block_attn_reference, norm_linear_attn_reference

# The ReLA row sum is clamped at this value before dividing (the released code's choice, spec §10).
RELA_ROW_SUM_MIN = 1e-4


@dataclass
class AttentionMap:
    """weights [B, H, T, T]; ``kind`` names how they were made; ``flagged`` marks maps that are not
    a distribution of the layer's own scores (negative scores replaced by |s|), with the reason in
    ``note``; ``negative_fraction`` is the share of allowed raw scores < 0 (0 when not applicable),
    ``num_allowed`` the number of allowed scores it is a share of (maps of several chunks of
    samples pool by it)."""

    weights: torch.Tensor
    kind: str
    flagged: bool = False
    note: str = ""
    negative_fraction: float = 0.0
    num_allowed: int = 0
    dead_fraction: float = 0.0  # ReLA: the share of real query rows (x heads) with no positive score
    num_query_rows: int = 0  # the rows it is a share of


def negative_note(fraction: float) -> str:
    return f"{fraction:.1%} of the scores q̂·k̂ are negative; weights use |s| / Σ|s|"


def dead_rows_note(fraction: float) -> str:
    return f"{fraction:.1%} of rows have no positive score (all-zero rows)"


def pooled_note(maps: list[AttentionMap]) -> str:
    """The note of one layer's maps made chunk by chunk, its shares over all the chunks (each
    chunk's own note gave that chunk's share)."""
    if len(maps) == 1:
        return maps[0].note
    if any(m.kind == "linear_abs" for m in maps):
        return negative_note(sum(m.negative_fraction * m.num_allowed for m in maps)
                             / max(1, sum(m.num_allowed for m in maps)))
    if any(m.dead_fraction for m in maps):
        return dead_rows_note(sum(m.dead_fraction * m.num_query_rows for m in maps)
                              / max(1, sum(m.num_query_rows for m in maps)))
    return next((m.note for m in maps if m.note), "")


class NoAttentionMap(TypeError):
    """The layer has no registered map function and no ``attention_weights`` method."""


# class name -> fn(layer, x, attention_mask, positions) -> AttentionMap
ATTENTION_MAP_FNS: dict[str, Callable] = {}


def register_attention_map(class_name: str):
    """Decorator: register ``fn(layer, x, attention_mask, positions) -> AttentionMap`` for a class name.

    Keyed by name (not class object) so registering needs no import of the layer module."""

    def deco(fn: Callable) -> Callable:
        ATTENTION_MAP_FNS[class_name] = fn
        return fn

    return deco


def row_normalize(scores: torch.Tensor, min_sum: float | None = None) -> torch.Tensor:
    """p_ij = s_ij / Σ_k s_ik for non-negative scores [..., T, T]; all-zero rows stay zero.

    ``min_sum`` clamps the row sum from below (ReLA's 1e-4); without it only exact-zero rows are
    protected, so every non-empty row sums to 1.
    """
    denom = scores.sum(-1, keepdim=True)
    if min_sum is not None:
        return scores / denom.clamp_min(min_sum)
    return torch.where(denom > 0, scores / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(scores))


def linear_attention_map(scores: torch.Tensor, allowed: torch.Tensor | None = None) -> AttentionMap:
    """Map of a kernelized (no-softmax) attention from its raw scores s = q̂k̂ᵀ [B, H, T, T].

    Disallowed keys must already be 0 in ``scores`` (the references zero them); ``allowed``
    [B, 1|H, T, T] (real query and key, causal) only serves to count the negative share, and to
    flag the map, among real entries: a padded query's row is computed but never counted. Negative scores
    (φ = elu, or any kernel composed with LRPE's rotations) make s/Σs a signed, possibly unbounded
    "distribution"; as the spec says we then use |s| and flag the map.
    """
    neg = scores < 0 if allowed is None else (scores < 0) & allowed  # padded query rows are not counted
    n_allowed = scores.numel() if allowed is None else int(allowed.expand_as(scores).sum())
    neg_fraction = float(neg.sum()) / max(n_allowed, 1)
    if bool(neg.any()):
        return AttentionMap(
            row_normalize(scores.abs()), kind="linear_abs", flagged=True, negative_fraction=neg_fraction,
            note=negative_note(neg_fraction), num_allowed=n_allowed,
        )
    return AttentionMap(row_normalize(scores), kind="linear", num_allowed=n_allowed)


def _linear_scores_map(q, k, v, causal: bool, mask) -> AttentionMap:
    """Row-normalised s = q̂k̂ᵀ from featurised q, k [B, T, H, F] via the quadratic reference."""
    _, _, s = norm_linear_attn_reference(q.double(), k.double(), v.double(), causal=causal,
                                         key_padding_mask=mask, return_weights=True)
    B, T = q.shape[:2]
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed.expand(B, 1, T, T)
    if mask is not None:
        allowed = allowed & mask[:, None, None, :] & mask[:, None, :, None]
    return linear_attention_map(s, allowed)


@register_attention_map("NormAttention")
def norm_attention_map(layer, x, attention_mask=None, positions=None) -> AttentionMap:
    """p_ij = s_ij / Σ_k s_ik, s = q̂ k̂ᵀ (masked keys and, if causal, k > i removed)."""
    mask, positions = mask_and_positions(x, attention_mask, positions, hidden_size=layer.hidden_size)
    q, k, v = layer.featurize(x, positions)
    return _linear_scores_map(q, k, v, layer.causal, mask)


@register_attention_map("KernelLinearAttention")
def kernel_linear_attention_map(layer, x, attention_mask=None, positions=None) -> AttentionMap:
    """Baselines of the form φq·φk / Σ φq·φk (linear_elu, Performer, cosFormer; also with
    ``denominator=False``, where it is the map the analysis defines rather than what the layer
    mixes with). The layer's eps in the denominator is left out, as in the spec's definition."""
    mask, positions = mask_and_positions(x, attention_mask, positions, hidden_size=layer.hidden_size)
    q, k, v = layer.featurize(x, positions, mask)
    return _linear_scores_map(q, k, v, layer.causal, mask)


@register_attention_map("SoftmaxAttention")
def softmax_attention_map(layer, x, attention_mask=None, positions=None) -> AttentionMap:
    """softmax(q kᵀ/√e) over the allowed keys: the block reference with one block of T tokens."""
    mask, positions = mask_and_positions(x, attention_mask, positions, hidden_size=layer.hidden_size)
    q, k, v = layer.featurize(x, positions)
    _, p = block_attn_reference(q.double(), k.double(), v.double(), block_size=max(1, x.shape[1]),
                                causal=layer.causal, kernel="softmax", key_padding_mask=mask, return_weights=True)
    return AttentionMap(p, kind="softmax")


@register_attention_map("DiagAttention")
def diag_attention_map(layer, x, attention_mask=None, positions=None) -> AttentionMap:
    """Softmax Diag: its block-diagonal weights. ReLA Diag: ReLU(s) row-normalised with the row sum
    clamped at ≥ 1e-4 (rows whose scores are all ≤ 0 stay zero). Dropout is never applied."""
    mask, positions = mask_and_positions(x, attention_mask, positions, hidden_size=layer.hidden_size)
    if x.shape[1] > layer.block_size:  # as the layer: blocks are cut by index, real tokens first
        check_right_padded(mask, "DiagAttention")
    q, k, v = layer.featurize(x, positions)  # q already carries the e^{-1/2} scale
    _, p = block_attn_reference(
        q.double(), k.double(), v.double(), block_size=layer.block_size, causal=layer.causal,
        kernel=layer.kernel, scale=1.0, key_padding_mask=mask, return_weights=True,
    )
    if layer.kernel == "softmax":
        return AttentionMap(p, kind="softmax")
    empty = p.sum(-1) == 0  # [B, H, T]; padded query rows are empty by construction and not counted
    rows = empty.numel() if mask is None else int(mask.sum()) * p.shape[1]
    dead = float(empty.sum() if mask is None else (empty & mask[:, None, :]).sum()) / max(rows, 1)
    return AttentionMap(row_normalize(p, RELA_ROW_SUM_MIN), kind="rela", note=dead_rows_note(dead) if dead > 0 else "",
                        dead_fraction=dead, num_query_rows=rows)


def find_map_fn(layer) -> Callable | None:
    for cls in type(layer).__mro__:
        fn = ATTENTION_MAP_FNS.get(cls.__name__)
        if fn is not None:
            return fn
    return None


def has_attention_map(layer) -> bool:
    return find_map_fn(layer) is not None or callable(getattr(layer, "attention_weights", None))


@contextmanager
def eval_mode(module: torch.nn.Module):
    """Evaluation mode for the duration: no dropout, and no training-time side effects such as
    Performer's feature redraw counter."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


@torch.no_grad()
def attention_map(layer, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None) -> AttentionMap:
    """The analysis attention matrix of ``layer`` on its input x [B, T, d] (what the layer's
    ``forward`` receives); attention_mask [B, T] bool (True = real), positions [B, T] long."""
    with eval_mode(layer):
        return _attention_map(layer, x, attention_mask, positions)


def _attention_map(layer, x, attention_mask, positions) -> AttentionMap:
    fn = find_map_fn(layer)
    if fn is not None:
        return fn(layer, x, attention_mask, positions)
    method = getattr(layer, "attention_weights", None)
    if callable(method):
        if positions is None:
            positions = default_positions(x, attention_mask)
        out = method(x, attention_mask, positions)
        if isinstance(out, AttentionMap):
            return out
        if not isinstance(out, torch.Tensor) or out.dim() != 4:
            raise TypeError(f"{type(layer).__name__}.attention_weights must return a [B, H, T, T] tensor "
                            f"or an AttentionMap, got {getattr(out, 'shape', type(out))}")
        out = out.double()
        if bool((out < 0).any()):  # a signed map from a layer: same treatment as linear scores
            return linear_attention_map(out)
        if bool((out.sum(-1) > 1 + 1e-6).any()):  # rows over 1 would weigh in more than a distribution
            return AttentionMap(row_normalize(out), kind="layer_normalized",
                                note="the layer's weights had rows summing above 1; rows were normalised")
        return AttentionMap(out, kind="layer")
    raise NoAttentionMap(
        f"{type(layer).__name__} exposes no attention matrix: register one with "
        f"transnormer.analysis.register_attention_map({type(layer).__name__!r}) or give the layer an "
        "attention_weights(x, attention_mask, positions) -> [B, H, T, T] method"
    )
