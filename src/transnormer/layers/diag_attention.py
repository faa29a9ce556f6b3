"""DiagAttention (spec §2): softmax (T2) or ReLU (T1, then a norm) attention inside blocks."""

from __future__ import annotations

import torch

from ..modules.norms import build_norm
from ..modules.positional import build_lrpe
from ..ops import block_attn
from ..ops._checks import check_bool, check_probability, check_right_padded
from ..ops._dtypes import autocast_off
from .base import (
    MultiHeadMixer,
    mask_and_positions,
    one_run_per_row,
    reads_given_cache,
    same_block_keys,
    update_block_cache,
    windows_of_blocks,
    with_cache,
    zero_padded,
)


def _attend_within_blocks(q, K, V, qpos, kpos, kvalid, *, block: int, kernel: str, causal: bool):
    """q [B, T, H, D] against keys K [B, S, H, D] / values V [B, S, H, E] of the same block by
    position (qpos [B, T], kpos/kvalid [B, S]), earlier or equal when ``causal``: dense [T, S] scores."""
    allowed = same_block_keys(qpos, kpos, kvalid, block, causal=causal)[:, None]  # [B, 1, T, S]
    s = torch.einsum("bihd,bjhd->bhij", q, K)
    if kernel == "softmax":
        p = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)).masked_fill(~allowed, float("-inf")), -1)
        p = torch.where(allowed.any(-1, keepdim=True), p, torch.zeros_like(p)).to(q.dtype)
    else:
        p = torch.relu(s).masked_fill(~allowed, 0.0)
    return torch.einsum("bhij,bjhe->bihe", p, V)


def cached_block_attend(q, k, v, cache, positions, valid, *, block: int, kernel: str, causal: bool = True):
    """Attention of new queries to cached + new keys of the same block, selected by position.

    q, k: [B, T, H, D] (q already scaled), v: [B, T, H, E], positions/valid: [B, T]. The cache
    (see ``update_block_cache``) holds at most one block, so a step costs O(block). A chunk of
    T > 2·block new tokens (chunked prefill, a continued prompt) goes block by block: queries
    [a, a + block) against the cache and the new keys [a - block, a + block), which hold every key
    of their blocks when each row's real tokens are consecutive, as the model lays out a call:
    O(T·block). Against all T keys at once it had been quadratic in T (a 2,048-token chunk 14x the
    time of a prefill from empty); rows with gaps still take that path.
    """
    c0 = cache["k"].shape[1] if cache is not None and "k" in cache else 0
    k, v = zero_padded(valid, k, v)
    seq = with_cache(cache, k=k, v=v, pos=positions, valid=valid)
    K, V, kpos, kvalid = seq["k"], seq["v"], seq["pos"], seq["valid"]
    T = q.shape[1]
    kw = dict(block=block, kernel=kernel, causal=causal)
    if T <= 2 * block or not (causal and one_run_per_row(valid)):
        return _attend_within_blocks(q, K, V, positions, kpos, kvalid, **kw)
    outs = []
    for a, keys in windows_of_blocks(c0, T, block, K.device):
        outs.append(_attend_within_blocks(q[:, a:a + block], K[:, keys], V[:, keys], positions[:, a:a + block],
                                          kpos[:, keys], kvalid[:, keys], **kw))
    return torch.cat(outs, 1)


class DiagAttention(MultiHeadMixer):
    """Block-diagonal attention with LRPE; x: [B, T, d] → [B, T, d].

    kernel ``softmax`` (T2, no norm after) or ``relu`` (T1, ReLA, followed by ``norm_type``).
    Decoding keeps at most one block of keys/values per layer (``cache``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        causal: bool,
        kernel: str = "softmax",
        block_size: int = 64,
        use_norm: bool | None = None,
        norm_type: str = "simple_rms",
        norm_eps: float | None = None,
        eps_inside_sqrt: bool = False,
        lrpe: str = "householder_rope",
        lrpe_learn_theta: bool = True,
        lrpe_seed: int = 0,
        attention_dropout: float = 0.0,
    ):
        super().__init__()
        if kernel not in ("softmax", "relu"):
            raise ValueError(f"kernel must be 'softmax' or 'relu', got {kernel!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.causal, self.kernel, self.block_size = check_bool("causal", causal), kernel, block_size
        self.attention_dropout = check_probability("attention_dropout", attention_dropout)
        self._build_projections(hidden_size, num_heads)
        self.lrpe = build_lrpe(lrpe, self.head_dim, learn_theta=lrpe_learn_theta, seed=lrpe_seed)
        use_norm = kernel == "relu" if use_norm is None else check_bool("use_norm", use_norm)
        self.norm = build_norm(norm_type, hidden_size, eps=norm_eps, eps_inside_sqrt=eps_inside_sqrt) if use_norm else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self._reset_projections(qkv_gain=1.0)

    def featurize(self, x: torch.Tensor, positions: torch.Tensor):
        """Scaled, LRPE'd q and k, and v: [B, T, H, e] each."""
        q, k, v = self._project(x)
        if self.lrpe is not None:  # the e^-1/2 score scale rides on LRPE's matmul (LRPE is linear)
            q, k = self.lrpe(q, positions, scale=self.head_dim ** -0.5), self.lrpe(k, positions)
        else:
            q = q * self.head_dim ** -0.5
        return q, k, v

    @reads_given_cache
    def forward(self, x, *, attention_mask=None, positions=None, cache=None, use_cache=False):
        mask, positions = mask_and_positions(x, attention_mask, positions, cache, hidden_size=self.hidden_size)
        q, k, v = self.featurize(x, positions)
        # fp16 with the norm (T1): a block's first query whose only score is negative gives a zero row, whose
        # norm gradient dy/eps (1e8 dy) overflows fp16, and 0 * inf in the product before it is NaN in every
        # gradient. The attention and its norm then run in fp32, as NormAttention's fp16 path does, with
        # autocast off: under fp16 autocast block_attn had handed the norm fp16 again.
        wide = q.dtype == torch.float16 and self.norm is not None
        if wide:
            with autocast_off(x.device.type):
                o, new_cache = self._attend_and_norm(q.float(), k.float(), v.float(), mask, positions, cache,
                                                     use_cache)
            return self.out_proj(o.to(x.dtype)), new_cache
        o, new_cache = self._attend_and_norm(q, k, v, mask, positions, cache, use_cache)
        return self.out_proj(o), new_cache

    def _attend_and_norm(self, q, k, v, mask, positions, cache, use_cache):
        """The block attention of q, k, v [B, T, H, e] and the norm after it: ([B, T, d], new cache)."""
        B, T = q.shape[:2]
        new_cache = None
        continuing = use_cache and cache is not None and "k" in cache
        if not continuing and T > self.block_size:  # one block (T <= block) is the same either way
            check_right_padded(mask, "DiagAttention")
        if use_cache:
            if not self.causal:
                raise ValueError("use_cache needs a causal DiagAttention (decoding is causal)")
            valid = torch.ones(B, T, dtype=torch.bool, device=q.device) if mask is None else mask
            if continuing:
                o = cached_block_attend(q, k, v, cache, positions, valid, block=self.block_size, kernel=self.kernel)
            else:
                # Prefill from empty: blocks by index, which the model guarantees equal blocks by
                # position (padding is moved to the right before the first call).
                o = block_attn(q, k, v, block_size=self.block_size, causal=True, kernel=self.kernel,
                               scale=1.0, key_padding_mask=mask)
            new_cache = update_block_cache(cache, k, v, positions, valid, self.block_size)
        else:
            o = block_attn(
                q, k, v, block_size=self.block_size, causal=self.causal, kernel=self.kernel, scale=1.0,
                key_padding_mask=mask, dropout_p=self.attention_dropout if self.training else 0.0,
            )
        o = o.reshape(B, T, self.hidden_size)
        if self.norm is not None:
            o = self.norm(o, mask)
        return o, new_cache
