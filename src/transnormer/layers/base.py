"""The token-mixer interface every layer type implements, and the registry of layer types.

A mixer maps x [B, T, d] → y [B, T, d]. Keyword inputs:
    attention_mask: [B, T] bool, True = real token (None = all real)
    positions:      [B, T] long, count of real tokens before each token
    cache:          a dict the mixer owns (None when not decoding); read whenever given (x then
                    continues the cached prefix), returned updated only when ``use_cache`` is
                    True, so a causal model can decode token by token.
A mixer with ``replaces_ffn = True`` (GAU/FLASH) stands for attention + FFN in a block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn

from ..modules.linear import Linear
from ..ops._checks import check_positive_int
from ..ops.dense import linear

# name -> builder(config, layer_idx) -> TokenMixer
LAYER_TYPES: dict[str, Callable] = {}


def register_layer_type(name: str):
    def deco(builder: Callable) -> Callable:
        LAYER_TYPES[name] = builder
        return builder

    return deco


def build_mixer(config, layer_idx: int) -> nn.Module:
    layer_type = config.layer_types[layer_idx]
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"unknown layer type {layer_type!r} in layer_types; known: {sorted(LAYER_TYPES)}")
    return LAYER_TYPES[layer_type](config, layer_idx)


def reads_given_cache(forward: Callable) -> Callable:
    """For a mixer whose forward branches on ``use_cache``: a non-empty cache passed with
    ``use_cache=False`` is still read (the interface above), and no updated cache is returned."""

    @functools.wraps(forward)
    def wrapped(self, x, *, cache=None, use_cache=False, **kw):
        if cache and not use_cache:
            return forward(self, x, cache=cache, use_cache=True, **kw)[0], None
        return forward(self, x, cache=cache, use_cache=use_cache, **kw)

    return wrapped


class TokenMixer(nn.Module):
    replaces_ffn: bool = False

    @property
    def decodes(self) -> bool:
        """Whether ``use_cache=True`` works: a causal mixer whose options do not need the whole
        sequence (the model's ``use_cache=None`` default asks this)."""
        return bool(getattr(self, "causal", False))

    def forward(
        self,
        x: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: dict | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, dict | None]:
        raise NotImplementedError


class MultiHeadMixer(TokenMixer):
    """A token mixer with biased q/k/v/out projections over ``num_heads`` heads of ``head_dim``."""

    def _build_projections(self, hidden_size: int, num_heads: int) -> None:
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("num_heads", num_heads)
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = Linear(hidden_size, hidden_size)
        self.k_proj = Linear(hidden_size, hidden_size)
        self.v_proj = Linear(hidden_size, hidden_size)
        self.out_proj = Linear(hidden_size, hidden_size)

    def _reset_projections(self, qkv_gain: float) -> None:
        """xavier-uniform with ``qkv_gain`` on q/k/v, xavier on out, zero out bias (the released init)."""
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=qkv_gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def _project(self, x: torch.Tensor):
        """x [B, T, d] → q, k, v [B, T, H, e] (before any kernel or positional map)."""
        # One GEMM on the concatenated weights: under autocast x is cast once instead of three
        # times, and the backward has one input gradient instead of a sum of three.
        w = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        b = torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias))
        return linear(x, w, b).view(*x.shape[:2], 3, self.num_heads, self.head_dim).unbind(2)


def default_positions(x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Positions [B, T] when the caller gives none: count of real tokens before each token."""
    B, T = x.shape[:2]
    if attention_mask is None:
        return torch.arange(T, device=x.device).expand(B, T)
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def padding_mask(attention_mask: torch.Tensor, name: str = "attention_mask") -> torch.Tensor:
    """``attention_mask`` [B, T] (1 / True = real token, 0 / False = padding, any dtype) as bool;
    ``name``: the argument the errors name (the two-tower model's ``attention_mask_2``).

    Anything but 0 and 1 is refused: an additive mask (0 / -inf, or -1e9 for padding) would
    otherwise read as "every position real except the real ones"."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError(f"{name} must hold 1 (real token) and 0 (padding) only, got other values "
                         "(an additive 0 / -inf mask? pass 1 for real tokens, 0 for padding)")
    return attention_mask.bool()


def mask_or_none(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Drop an all-true mask so fast paths stay mask-free."""
    if attention_mask is None:
        return None
    attention_mask = padding_mask(attention_mask)
    return None if bool(attention_mask.all()) else attention_mask


def mask_and_positions(x: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor | None,
                       cache: dict | None = None, *, hidden_size: int | None = None):
    """A mixer's input checked (``x`` a float [B, T, hidden_size]) and its optional arguments resolved:
    (key mask [B, T] or None, positions [B, T]). With a cache the positions must be given: counting
    from 0 again would place every decoded token at the start of the sequence."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype if isinstance(x, torch.Tensor) else type(x)}")
    if x.dim() != 3 or (hidden_size is not None and x.shape[-1] != hidden_size):
        raise ValueError(f"x must be [B, T, {hidden_size or 'hidden_size'}], got {tuple(x.shape)}")
    B, T = x.shape[:2]
    for name, value in (("attention_mask", attention_mask), ("positions", positions)):
        if value is not None and not isinstance(value, torch.Tensor):  # (an AttributeError on .shape had said it)
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")
    if attention_mask is not None and tuple(attention_mask.shape) != (B, T):  # before an all-true one is dropped
        raise ValueError(f"attention_mask must be [B, T] = {(B, T)}, got {tuple(attention_mask.shape)}")
    if attention_mask is not None:
        attention_mask = padding_mask(attention_mask)
    if positions is not None and (positions.dim() not in (1, 2) or positions.shape[-1] != T
                                  or positions.dim() == 2 and positions.shape[0] not in (1, B)):
        raise ValueError(f"positions must be [B, T] = {(B, T)} (or [1, T], [T]), got {tuple(positions.shape)}")
    if positions is not None and (positions.is_floating_point() or positions.is_complex()
                                  or positions.dtype == torch.bool):
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    if positions is None:
        if cache is not None:
            raise ValueError("positions must be given with a cache (the tokens' positions in the whole sequence)")
        positions = default_positions(x, attention_mask)
    # [1, T] and [T] are accepted above: every layer (and its cache) then sees [B, T], as the model passes
    return mask_or_none(attention_mask), positions.expand(B, T)


def one_run_per_row(valid: torch.Tensor) -> bool:
    """Whether each row's valid tokens [B, T] are consecutive (or absent), as the model lays out a call."""
    T = valid.shape[1]
    if T == 0:
        return True
    idx = torch.arange(T, device=valid.device)
    first = torch.where(valid, idx, T).amin(1)
    last = torch.where(valid, idx, -1).amax(1)
    return bool(((last - first + 1 == valid.sum(1)) | ~valid.any(1)).all())


def same_block_keys(qpos: torch.Tensor, kpos: torch.Tensor, kvalid: torch.Tensor, block: int, *,
                    causal: bool = True) -> torch.Tensor:
    """[B, Tq, Tk]: key j is valid, in query i's block of ``block`` positions and (``causal``) not
    after it; qpos [B, Tq], kpos / kvalid [B, Tk]. The mask of the cached block-local paths
    (DiagAttention, FLASH's local branch)."""
    allowed = (kpos[:, None, :] // block == qpos[:, :, None] // block) & kvalid[:, None, :]
    return allowed & (kpos[:, None, :] <= qpos[:, :, None]) if causal else allowed


def windows_of_blocks(cached: int, T: int, block: int, device):
    """(a, key indices) for each block of new queries [a, a + block) of a call continuing a cache:
    the ``cached`` keys and the new keys [a - block, a + block), in [cache | new] order. When each
    row's real tokens are consecutive (:func:`one_run_per_row`) they hold every key of the queries'
    blocks, so a chunk of T tokens costs O(T·block), not O(T²)."""
    old = torch.arange(cached, device=device)
    for a in range(0, T, block):
        yield a, torch.cat([old, torch.arange(cached + max(0, a - block), cached + min(T, a + block), device=device)])


def zero_padded(valid: torch.Tensor | None, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """xs ([B, T, ...]) with the rows of padding (``valid`` [B, T] False; None: no padding, xs as
    they are) set to 0. Attention weighs a padded key or value by 0, and 0 times an inf or NaN there
    is NaN: the full forwards zero them in the ops, the cached paths with this."""
    if valid is None:
        return xs
    return tuple(x.masked_fill(~valid.reshape(*valid.shape, *(1,) * (x.dim() - 2)), 0) for x in xs)


def with_cache(cache: dict | None, **new: torch.Tensor) -> dict:
    """The named [B, T, ...] tensors after the cache's entries of the same names (along T); ``new``
    itself when there is no cache yet."""
    if cache is None or "k" not in cache:
        return new
    for name, x in new.items():  # (another batch's cache had failed in torch.cat, naming no cache)
        held = cache[name]
        if held.shape[0] != x.shape[0] or held.shape[2:] != x.shape[2:]:
            raise ValueError(f"cache[{name!r}] holds {tuple(held.shape)} ([B, T, ...]); this call's is "
                             f"{tuple(x.shape)}: a cache of another batch or layer")
    return {name: torch.cat([cache[name], x], 1) for name, x in new.items()}


def update_block_cache(cache: dict | None, k, v, positions, valid, block: int) -> dict:
    """Keep, per row, the keys/values of the block of the last real token (at most ``block``).

    k: [B, T, H, D], v: [B, T, H, E], positions/valid: [B, T]. The cache stores slot s = pos mod
    block, so its size never exceeds one block. Used by DiagAttention, GAU-chunk and FLASH local.
    """
    B, T, H, D = k.shape
    E = v.shape[-1]
    seq = with_cache(cache, k=k, v=v, pos=positions, valid=valid)
    k, v, positions, valid = seq["k"], seq["v"], seq["pos"], seq["valid"]
    # [B]; -1 for a row with no tokens at all (an empty first segment: amax has nothing to reduce)
    last = (torch.where(valid, positions, torch.full_like(positions, -1)).amax(1) if positions.shape[1]
            else positions.new_full((B,), -1))
    # The block of the next token: if the last real token closed its block, the cache empties.
    next_block = (last + 1) // block
    keep = valid & (positions // block == next_block[:, None])
    slot = torch.where(keep, positions % block, torch.full_like(positions, block))  # dump slot
    new_k = k.new_zeros(B, block + 1, H, D).scatter(1, slot[:, :, None, None].expand(B, -1, H, D), k)
    new_v = v.new_zeros(B, block + 1, H, E).scatter(1, slot[:, :, None, None].expand(B, -1, H, E), v)
    new_pos = positions.new_zeros(B, block + 1).scatter(1, slot, positions)
    new_valid = torch.zeros(B, block + 1, dtype=torch.bool, device=k.device).scatter(1, slot, keep)
    return {"k": new_k[:, :block], "v": new_v[:, :block], "pos": new_pos[:, :block], "valid": new_valid[:, :block]}
