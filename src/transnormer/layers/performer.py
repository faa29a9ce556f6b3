"""Performer (FAVOR+) attention: positive orthogonal random features of the softmax kernel.

Differences from the reference implementation (peers.md §3.4), all deliberate:
  * no causal leak: queries are stabilised by their own per-token maximum, each key exponent
    is capped on its own (see :func:`transnormer.ops.linear_baselines.favor_features`);
  * no ε added to the features (it does not cancel in the ratio); ε sits in the denominator only;
  * padded keys are excluded from the denominator as well as the numerator;
  * linear-time chunked causal form (no O(T·m·d) outer products) and a recurrent decode state.

The projection ω [m, d_h] (shared by the heads of a layer) is a persistent buffer, so
save/load reproduces outputs exactly; redraws are seeded and counted (``num_redraws`` buffer).
"""

from __future__ import annotations

import torch

from ..modules.recompute import recomputing, remember, replayed
from ..ops._checks import check_bool
from ..ops.linear_baselines import (
    default_num_features,
    draw_favor_projection,
    favor_features,
)
from .linear_attention import KernelLinearAttention

_SEED_STRIDE = 1_000_003  # seed of draw r of a layer with base seed s: s * stride + r


class Performer(KernelLinearAttention):
    """FAVOR+ softmax-kernel attention with denominator; x: [B, T, d] → [B, T, d].

    Args:
        num_features: m random features (default ⌊d_h ln d_h⌋).
        orthogonal: orthogonal random rows (FAVOR+) or i.i.d. Gaussian rows.
        feature_seed: base seed; draw r uses ``feature_seed * 1_000_003 + r``.
        redraw_interval: in training mode, draw new features every this many forward calls
            (None or 0: never). Evaluation and decoding never redraw.
    """

    has_call_state = True  # the redraw counter and the features a checkpointed call must replay

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        causal: bool,
        num_features: int | None = None,
        orthogonal: bool = True,
        feature_seed: int = 0,
        redraw_interval: int | None = 1000,
        eps: float = 0.0,
        chunk_size: int = 64,
    ):
        super().__init__(hidden_size, num_heads, causal=causal, denominator=True, eps=eps, chunk_size=chunk_size)
        m = default_num_features(self.head_dim) if num_features is None else num_features
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"num_features must be an int >= 1, got {num_features!r}")
        if redraw_interval is not None and (isinstance(redraw_interval, bool) or not isinstance(redraw_interval, int)
                                            or redraw_interval < 0):
            raise ValueError(f"redraw_interval must be None or an int >= 0, got {redraw_interval!r}")
        # (1.5 had been truncated; a seed past 2**32 overflowed torch's seed, feature_seed * 1_000_003 + r, unnamed)
        if isinstance(feature_seed, bool) or not isinstance(feature_seed, int) or not 0 <= feature_seed < 2**43:
            raise ValueError(f"feature_seed must be an int in [0, 2**43), got {feature_seed!r}")
        self.num_features, self.orthogonal = m, check_bool("orthogonal", orthogonal)
        self.feature_seed, self.redraw_interval = feature_seed, redraw_interval or None
        self.register_buffer("proj", torch.empty(m, self.head_dim))
        self.register_buffer("num_redraws", torch.zeros((), dtype=torch.long))
        # saved with the weights, so that a resumed run redraws when the uninterrupted one would
        self.register_buffer("calls_since_redraw", torch.zeros((), dtype=torch.long))
        self._decoding = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.reset_own_parameters()

    def reset_own_parameters(self) -> None:
        """The feature projection only (RoBERTa's init draws the linears itself)."""
        self.num_redraws.zero_()
        self._draw(self.feature_seed * _SEED_STRIDE)

    @torch.no_grad()
    def _draw(self, seed: int) -> None:
        w = draw_favor_projection(self.num_features, self.head_dim, seed=seed, orthogonal=self.orthogonal)
        self.proj.copy_(w.to(device=self.proj.device, dtype=self.proj.dtype))
        self.calls_since_redraw.zero_()

    @torch.no_grad()
    def redraw_features(self, seed: int | None = None) -> None:
        """Draw a new projection: from ``seed`` if given, else the next draw of this layer's
        seeded sequence (deterministic given ``feature_seed`` and the redraw count)."""
        self.num_redraws += 1
        self._draw(self.feature_seed * _SEED_STRIDE + int(self.num_redraws) if seed is None else seed)

    def forward(self, x, *, cache=None, use_cache=False, **kwargs):
        # A cached call keeps the projection its state was built with (generate() does not switch
        # the model to eval mode).
        self._decoding = use_cache or cache is not None
        try:
            return super().forward(x, cache=cache, use_cache=use_cache, **kwargs)
        finally:
            self._decoding = False

    def feature_map(self, q, k, positions, mask):
        # Not while decoding (the state was built with this projection), nor while activation
        # checkpointing recomputes the block (the gradient must be that of the forward's features),
        # nor without gradients: only training steps count (generate(use_cache=False) in train mode
        # runs under no_grad and would otherwise redraw mid-sequence).
        if (self.training and self.redraw_interval and not self._decoding and not recomputing()
                and torch.is_grad_enabled()):
            if int(self.calls_since_redraw) >= self.redraw_interval:
                self.redraw_features()
            self.calls_since_redraw += 1
        # a snapshot: autograd saves the projection it used, and a later redraw rewrites self.proj
        # in place (a buffer DDP keeps by reference) while an earlier call may still await backward;
        # activation checkpointing's recomputation gets the same snapshot back
        proj = replayed(self)
        if proj is None:
            proj = self.proj.clone()
            remember(self, proj)
        return (favor_features(q, proj, is_query=True),
                favor_features(k, proj, is_query=False))

    def extra_repr(self) -> str:
        return (f"num_features={self.num_features}, orthogonal={self.orthogonal}, "
                f"redraw_interval={self.redraw_interval}, causal={self.causal}")
