"""NormAttention (spec §1): kernelized linear attention without denominator, then a norm."""

from __future__ import annotations

import math

import torch

from ..modules.norms import build_norm
from ..modules.positional import build_lrpe
from ..ops import norm_linear_attn, norm_linear_attn_step
from ..ops._checks import check_bool, check_positive_int
from ..ops.lrpe import FEATURE_KERNELS
from .base import MultiHeadMixer, mask_and_positions

KERNELS = {name: fn for name, fn in FEATURE_KERNELS.items() if name != "identity"}


def get_kernel(name: str):
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {name!r}")
    return KERNELS[name]


def fla_causal_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None,
                    output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The causal core Σ_{j≤i} (q̂_i·k̂_j) v_j on flash-linear-attention's chunk kernel (peers.md §3.6; GPU
    and Triton only, imported at first use): q̂, k̂ as they are (``scale=1.0``) and no denominator
    (``normalize=False``). q, k: [B, T, H, e]; v: [B, T, H, e]; state [B, H, e, e]."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError as e:
        raise ImportError("impl='fla' needs flash-linear-attention and Triton on a GPU: pip install "
                          "flash-linear-attention") from e
    import inspect

    # versions with a head_first switch defaulted it to True ([B, H, T, e]) in 2024: say the layout
    layout = {"head_first": False} if "head_first" in inspect.signature(chunk_linear_attn).parameters else {}
    return chunk_linear_attn(q, k, v, scale=1.0, initial_state=initial_state, output_final_state=output_final_state,
                             normalize=False, **layout)


IMPLS = ("auto", "fla")


class NormAttention(MultiHeadMixer):
    """O = Norm(concat_h φ̂(Q_h) φ̂(K_h)ᵀ V_h) W_o + b_o with φ̂ = LRPE ∘ kernel. x: [B, T, d].

    The norm runs over the full width d (the paper) or per head (``norm_per_head``). The causal
    form is chunked (linear in T); decoding carries one [B, H, e, e] state (``cache["state"]``).
    ``impl="fla"`` runs the causal core (not decoding steps) on flash-linear-attention's GPU kernel
    (:func:`fla_causal_core`), without padding masks.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        causal: bool,
        kernel: str = "1+elu",
        chunk_size: int = 64,
        lrpe: str = "householder_rope",
        lrpe_learn_theta: bool = True,
        lrpe_seed: int = 0,
        norm_type: str = "simple_rms",
        norm_eps: float | None = None,
        eps_inside_sqrt: bool = False,
        norm_per_head: bool = False,
        impl: str = "auto",
    ):
        super().__init__()
        check_positive_int("chunk_size", chunk_size)
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if impl == "fla" and not causal:
            raise ValueError("impl='fla' serves the causal form only (fla's kernel is causal)")
        self.impl = impl
        self.causal, self.chunk_size = check_bool("causal", causal), chunk_size
        self.kernel_name, self.kernel = kernel, get_kernel(kernel)
        self._build_projections(hidden_size, num_heads)
        self.lrpe = build_lrpe(lrpe, self.head_dim, learn_theta=lrpe_learn_theta, seed=lrpe_seed)
        self.norm_per_head = check_bool("norm_per_head", norm_per_head)
        norm_dim = self.head_dim if norm_per_head else hidden_size
        self.norm = build_norm(norm_type, norm_dim, eps=norm_eps, eps_inside_sqrt=eps_inside_sqrt)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Released code (spec §1): xavier-uniform gain 2^-1/2 on q/k/v, xavier on out, zero out bias.
        self._reset_projections(qkv_gain=1 / math.sqrt(2))

    def featurize(self, x: torch.Tensor, positions: torch.Tensor):
        """q̂, k̂ [B, T, H, e] (kernel then LRPE) and v [B, T, H, e]; used by the analysis tools."""
        q, k, v = self._project(x)
        if self.lrpe is None:
            return self.kernel(q), self.kernel(k), v
        # the kernel rides inside LRPE (one fused pass on CPU, ops/lrpe.py)
        return self.lrpe(q, positions, kernel=self.kernel_name), self.lrpe(k, positions, kernel=self.kernel_name), v

    def forward(self, x, *, attention_mask=None, positions=None, cache=None, use_cache=False):
        mask, positions = mask_and_positions(x, attention_mask, positions, cache, hidden_size=self.hidden_size)
        B, T, _ = x.shape
        q, k, v = self.featurize(x, positions)
        # fp16: the attention's output has no denominator and grows with the keys (past 65504 at a
        # few thousand tokens) until the norm takes the scale out, so it stays fp32 until then
        wide = q.dtype == torch.float16
        if wide:
            q, k, v = q.float(), k.float(), v.float()
        state = None if cache is None else cache.get("state")
        if use_cache and not self.causal:
            raise ValueError("use_cache needs a causal NormAttention (decoding is causal)")
        if use_cache and T == 1 and state is not None:
            step_mask = None if mask is None else mask[:, 0]
            o, state = norm_linear_attn_step(q[:, 0], k[:, 0], v[:, 0], state, key_padding_mask=step_mask)
            o = o[:, None]
        elif self.impl == "fla":
            if mask is not None:
                raise ValueError("impl='fla' takes no padding mask (fla packs sequences by cu_seqlens instead)")
            o, state = fla_causal_core(q, k, v, state, use_cache)
        else:
            o, state = norm_linear_attn(
                q, k, v, causal=self.causal, chunk_size=self.chunk_size, initial_state=state,
                output_final_state=use_cache, key_padding_mask=mask,
            )
        o = o.to(torch.float32 if wide else x.dtype)
        if self.norm_per_head:  # rows are (token, head) pairs: the mask repeats over heads
            head_mask = None if mask is None else mask[:, :, None].expand(B, T, self.num_heads)
            o = self.norm(o, head_mask).reshape(B, T, self.hidden_size)
        else:
            o = self.norm(o.reshape(B, T, self.hidden_size), mask)
        return self.out_proj(o.to(x.dtype) if wide else o), ({"state": state} if use_cache else None)
