"""Gated Attention Unit (FLASH-Quad) and FLASH (mixed chunk attention), spec flash.md.

Both replace attention + FFN of a block (``replaces_ffn = True``). The block supplies the GAU's
pre-norm and residual (flash.md §1.1, §1.6): use ``norm_type="scale"`` for the paper's ScaleNorm.

Per token, one dense layer with SiLU on all of its output (§1.2):
    [U | V | Z] = SiLU(x W + b),  U, V ∈ R^e,  Z ∈ R^s
    heads h = Z ⊙ γ_h + β_h (GAU: q, k; FLASH: local q, k and global q, k), RoPE on every head
    O = (U ⊙ attn(heads, V)) W_o + b_o

Padding (§4): padded keys get A_ij = 0 and zeroed K^l/V rows in the global states; normalisers
count real tokens only. FLASH chunks by index, so it needs right-padded rows; TransNormerModel
moves left padding to the right before the layers, so left-padded batches work at model level,
and a direct FLASH call with left padding raises. GAU works with either (it uses positions).
Decoding (§2, §3.7): GAU caches all RoPE'd K and V; FLASH caches the current chunk's local K/V
plus the global prefix state S_prev and the current chunk's partial state S_cur.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..modules.linear import Linear
from ..modules.positional import LRPE
from ..ops._checks import check_bool, check_positive_int, check_probability
from ..ops._dtypes import autocast_enabled, autocast_off
from ..ops.dense import linear
from ..ops.flash import (
    GLOBAL_NORMALIZERS,
    QUAD_NORMALIZERS,
    causal_flash_mixer,
    check_normalizer,
    flash_attn,
    flash_mixer_usable,
    gau_attn,
    relu2_attention,
)
from ..ops.norm_linear import state_dtype_for
from ..ops.rowwise import scale_offset_rope, silu_split
from .base import (
    TokenMixer,
    mask_and_positions,
    one_run_per_row,
    reads_given_cache,
    same_block_keys,
    update_block_cache,
    windows_of_blocks,
    with_cache,
    zero_padded,
)

REL_BIAS_TYPES = ("toeplitz", "toeplitz_moving", "rope_bias", "t5", "none")


def build_rope(spec: str, dim: int) -> LRPE | None:
    """``full`` (all ``dim`` channels), ``partial:k`` (the first k), ``none``; rotate-half pairs."""
    if spec == "none":
        return None
    if spec == "full":
        k = dim
    elif isinstance(spec, str) and spec.startswith("partial:") and spec[8:].isdigit():
        k = int(spec[8:])
        if not 2 <= k <= dim or k % 2:
            raise ValueError(f"rope 'partial:k' needs an even k in [2, {dim}], got {spec!r}")
    else:
        raise ValueError(f"rope must be 'full', 'partial:k' or 'none', got {spec!r}")
    return LRPE(k, householder=False, learn_theta=False, pairing="half")


def t5_bucket(delta: torch.Tensor, *, causal: bool, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5 relative-position bucket of δ = j − i: exact for small |δ|, log-spaced up to
    ``max_distance``, clipped beyond. Causal: all buckets for the past (future keys are masked)."""
    n = -delta  # > 0 for keys in the past
    ret = torch.zeros_like(n)
    if causal:
        n = n.clamp_min(0)
    else:
        num_buckets //= 2
        ret = (n < 0).long() * num_buckets
        n = n.abs()
    exact = num_buckets // 2
    log_ratio = torch.log(n.float().clamp_min(1) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (num_buckets - exact)).long()).clamp_max(num_buckets - 1)
    return ret + torch.where(n < exact, n, large)


class RelativePositionBias(nn.Module):
    """The scalar bias b_ij of the GAU kernel (flash.md §1.2), a function of positions.

    ``toeplitz``: b_ij = w[(p_j − p_i) + L − 1] with L = ``max_len`` (512): fixed centre, identical
    to the appendix at n = L. ``toeplitz_moving``: centre n − 1 (bit-faithful to the appendix).
    ``rope_bias``: b_ij = ⟨RoPE_i(a), RoPE_j(b)⟩. ``t5``: 32 log buckets up to distance 128.
    With ``toeplitz*`` a row whose length n exceeds L uses ``rope_bias`` instead, as the paper
    switches beyond 512; n is given by the caller per row (see GAU/FLASH). Parameters N(0, 0.02²).
    """

    def __init__(self, kind: str, qk_dim: int, *, causal: bool, max_len: int = 512, switch_to_rope: bool = True):
        super().__init__()
        if kind not in REL_BIAS_TYPES:
            raise ValueError(f"rel_bias must be one of {REL_BIAS_TYPES}, got {kind!r}")
        self.kind, self.causal, self.max_len = kind, causal, max_len
        self.w = nn.Parameter(torch.empty(2 * max_len - 1)) if kind.startswith("toeplitz") else None
        has_rope = kind == "rope_bias" or (kind.startswith("toeplitz") and switch_to_rope)
        self.a = nn.Parameter(torch.empty(qk_dim)) if has_rope else None
        self.b = nn.Parameter(torch.empty(qk_dim)) if has_rope else None
        self.rope = LRPE(qk_dim, householder=False, learn_theta=False, pairing="half") if has_rope else None
        self.t5 = nn.Parameter(torch.empty(32)) if kind == "t5" else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.reset_own_parameters()

    def reset_own_parameters(self) -> None:
        """This module's own tensors, not its RoPE's (``_init_weights`` under RoBERTa's init)."""
        for p in (self.w, self.a, self.b, self.t5):
            if p is not None:
                nn.init.normal_(p, std=0.02)

    def _rope_bias(self, qpos, kpos):
        B, Tq = qpos.shape
        a = self.rope(self.a.expand(B, Tq, 1, -1), qpos)[:, :, 0]
        b = self.rope(self.b.expand(kpos.shape[0], kpos.shape[1], 1, -1), kpos)[:, :, 0]
        return a @ b.transpose(-1, -2)

    def forward(self, qpos: torch.Tensor, kpos: torch.Tensor, n) -> torch.Tensor | None:
        """qpos [B, Tq], kpos [B, Tk] positions; n: the length deciding toeplitz vs rope_bias
        (an int or [B, Tq] / [B, 1]). Returns [B, Tq, Tk] or None (``none``)."""
        if self.kind == "none":
            return None
        if self.kind == "rope_bias":
            return self._rope_bias(qpos, kpos)
        if self.kind == "t5":
            return self.t5[t5_bucket(kpos[:, None, :] - qpos[:, :, None], causal=self.causal)]
        n_t = torch.as_tensor(n, device=qpos.device)
        n_t = n_t.expand_as(qpos) if n_t.dim() == 0 else n_t.expand(qpos.shape[0], qpos.shape[1])
        long_rows = (n_t > self.max_len) if self.a is not None else None
        n_long = 0 if long_rows is None else int(long_rows.sum())
        if n_long == 0:
            bias = self._table(qpos[:, :, None], kpos[:, None, :], n_t[..., None])
            if self.a is not None and self.training and torch.is_grad_enabled():
                # Keep a, b in the graph (zero gradient) so DDP without find_unused_parameters
                # works when training at lengths ≤ L, where the RoPE bias is never used.
                bias = bias + 0.0 * (self.a.sum() + self.b.sum())
            return bias
        rope = self._rope_bias(qpos, kpos)
        if n_long == long_rows.numel():
            return rope
        # Mixed (causal rows cross 512 at position 511): table entries only for the short rows.
        b, i = (~long_rows).nonzero(as_tuple=True)
        return rope.index_put((b, i), self._table(qpos[b, i][:, None], kpos[b], n_t[b, i][:, None]).to(rope.dtype))

    def _table(self, qpos, kpos, n):
        """w[(k − q) + centre], broadcasting qpos/kpos/n; centre = L − 1 (fixed) or n − 1 (moving)."""
        centre = n - 1 if self.kind == "toeplitz_moving" else self.max_len - 1
        return self.w[(kpos - qpos + centre).clamp(0, 2 * self.max_len - 2)]


class _GatedUnit(TokenMixer):
    """Shared part of GAU and FLASH: the dense layer, the γ/β heads, RoPE, gate and output."""

    # the per-head scales and offsets of the shared z are a gain and a bias, though 2-D: the training
    # loop's weight decay leaves them out (by attribute name, which survives FSDP's parameter swap)
    no_weight_decay = ("gamma", "beta")

    replaces_ffn = True
    num_qk_heads = 2

    def __init__(
        self,
        hidden_size: int,
        *,
        causal: bool,
        expansion: float = 2.0,
        qk_dim: int = 128,
        rope: str = "full",
        rel_bias: str = "toeplitz",
        max_rel_len: int = 512,
        attention_dropout: float = 0.0,
        switch_to_rope: bool = True,
    ):
        super().__init__()
        check_positive_int("max_rel_len", max_rel_len)  # the Toeplitz table holds 2 max_rel_len - 1 offsets
        if isinstance(expansion, bool) or not isinstance(expansion, (int, float)) or not math.isfinite(expansion):
            raise TypeError(f"expansion must be a finite number (e = expansion x hidden_size), got {expansion!r}")
        if isinstance(qk_dim, bool) or not isinstance(qk_dim, int):
            raise TypeError(f"qk_dim must be an int, got {qk_dim!r}")
        e = int(round(expansion * hidden_size))
        if e < 1 or qk_dim < 1:
            raise ValueError(f"expansion and qk_dim must give positive widths, got e={e}, s={qk_dim}")
        self.hidden_size, self.e, self.s = hidden_size, e, qk_dim
        self.causal = check_bool("causal", causal)  # (a string "false" had run a causal layer)
        check_bool("switch_to_rope", switch_to_rope)
        self.attention_dropout = check_probability("attention_dropout", attention_dropout)
        self.proj = Linear(hidden_size, 2 * e + qk_dim)
        self.gamma = nn.Parameter(torch.empty(self.num_qk_heads, qk_dim))
        self.beta = nn.Parameter(torch.empty(self.num_qk_heads, qk_dim))
        self.out_proj = Linear(e, hidden_size)
        self.rope = build_rope(rope, qk_dim)
        self.rel_bias = RelativePositionBias(rel_bias, qk_dim, causal=causal, max_len=max_rel_len,
                                             switch_to_rope=switch_to_rope)

    def reset_parameters(self) -> None:
        # flash.md §1.4 (our default, as the ports): N(0, 0.02²) weights, zero biases, γ ~ N(0, 0.02²), β = 0.
        for lin in (self.proj, self.out_proj):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        self.reset_own_parameters()
        self.rel_bias.reset_parameters()

    def reset_own_parameters(self) -> None:
        """γ and β only: RoBERTa's init (``_init_weights``) draws the projections itself."""
        nn.init.normal_(self.gamma, std=0.02)
        nn.init.zeros_(self.beta)

    # FLASH's training products take the heads in the autocast dtype (C, its only divisor, is a
    # power of two in every preset), so the heads can be made in it; GAU divides by N_q before
    # its product, in the heads' dtype, and keeps fp32 heads.
    heads_in_autocast_dtype = False

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """u [B, T, e], v [B, T, e], heads [B, T, n_heads, s] (scaled/offset, RoPE'd at ``positions``)."""
        # the bias is added by the fused SiLU (ops/rowwise.py), not by an addmm (a copy of it into
        # every row forward, a sum over rows backward)
        pre = linear(x, self.proj.weight)
        u, v, z = silu_split(pre, [self.e, self.e, self.s], self.proj.bias)
        if self.rope is None:
            return u, v, z[:, :, None, :] * self.gamma + self.beta
        dev = x.device.type
        out_dtype = (torch.get_autocast_dtype(dev) if self.heads_in_autocast_dtype and autocast_enabled(dev)
                     else None)
        # scale/offset and rotate-half in one pass on CPU (ops/rowwise.py)
        return u, v, scale_offset_rope(z, self.gamma, self.beta, *self.rope.tables(positions), out_dtype=out_dtype)

    def _dropout(self) -> float:
        return self.attention_dropout if self.training else 0.0


class GAU(_GatedUnit):
    """FLASH-Quad layer: single-head relu²(Q Kᵀ / N_q + B) attention, gated; x [B, T, d] → [B, T, d].

    Args:
        normalizer: N_q ∈ {seq_len (paper, default), fixed, visible, none} (flash.md §1.1).
            ``seq_len`` is not prefix-consistent, so decoding with it raises.
        fixed_len: T_fix for ``fixed`` (use the training length).
        rel_bias: see :class:`RelativePositionBias`. The length n that picks toeplitz or
            rope_bias is the row's real length in bidirectional layers and the query's visible
            length (position + 1) in causal ones (prefix-consistent, so decodable; equal to the
            paper whenever the sequence fits in 512). ``toeplitz_moving`` uses the real length in
            both modes and therefore cannot decode.
    O(T²) time and memory (FLASH-Quad is quadratic by design).
    """

    @property
    def decodes(self) -> bool:  # the refusals of the cached path in forward()
        return self.causal and self.normalizer != "seq_len" and self.rel_bias.kind != "toeplitz_moving"

    def __init__(self, hidden_size: int, *, causal: bool, normalizer: str = "seq_len", fixed_len: int = 512, **kw):
        super().__init__(hidden_size, causal=causal, **kw)
        check_normalizer(normalizer, QUAD_NORMALIZERS, "normalizer")
        check_positive_int("fixed_len", fixed_len)  # the divisor of the "fixed" normalizer
        self.normalizer, self.fixed_len = normalizer, fixed_len
        self.reset_parameters()

    def _bias_length(self, positions, valid):
        if self.causal and self.rel_bias.kind == "toeplitz":
            return positions + 1
        return valid.sum(-1, keepdim=True)

    @reads_given_cache
    def forward(self, x, *, attention_mask=None, positions=None, cache=None, use_cache=False):
        mask, positions = mask_and_positions(x, attention_mask, positions, cache, hidden_size=self.hidden_size)
        B, T, _ = x.shape
        valid = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask
        u, v, heads = self.project(x, positions)
        q, k = heads[:, :, 0], heads[:, :, 1]
        if not use_cache:
            bias = self.rel_bias(positions, positions, self._bias_length(positions, valid))
            o = gau_attn(q, k, v, causal=self.causal, normalizer=self.normalizer, fixed_len=self.fixed_len,
                         bias=bias, key_padding_mask=mask, dropout_p=self._dropout())
            return self.out_proj(u * o), None
        if not self.causal:
            raise ValueError("use_cache needs a causal GAU (decoding is causal)")
        if self.normalizer == "seq_len":
            raise ValueError("GAU normalizer 'seq_len' divides by the full sequence length, which is unknown while "
                             "decoding (outputs change as tokens are appended); use 'fixed' (T_fix = training "
                             "length) or 'visible' to decode")
        if self.rel_bias.kind == "toeplitz_moving":
            raise ValueError("rel_bias 'toeplitz_moving' depends on the full sequence length; use 'toeplitz' to decode")
        k, v = zero_padded(mask, k, v)
        seq = with_cache(cache, k=k, v=v, pos=positions, valid=valid)
        K, V, kpos, kvalid = seq["k"], seq["v"], seq["pos"], seq["valid"]
        # Positions, not indices, order the keys: rows may hold padding holes after a prefill.
        allowed = kvalid[:, None, :] & (kpos[:, None, :] <= positions[:, :, None])
        if self.normalizer == "fixed":
            norm = float(self.fixed_len)
        elif self.normalizer == "visible":
            norm = allowed.sum(-1, keepdim=True).to(q.dtype).clamp_min(1)
        else:
            norm = 1.0
        bias = self.rel_bias(positions, kpos, positions + 1)
        o = relu2_attention(q, K, V, allowed=allowed, norm=norm, bias=bias)
        return self.out_proj(u * o), {"k": K, "v": V, "pos": kpos, "valid": kvalid}


class FLASH(_GatedUnit):
    """FLASH layer: local relu² attention inside chunks of C tokens + global linear attention
    across chunks, gated; x [B, T, d] → [B, T, d]. Four γ/β heads (local q, k; global q, k).

    Args:
        chunk_size: C (paper: 256).
        normalizer: global N_g ∈ {visible (paper reading, default), chunk, none} (flash.md §3.4);
            the local branch always divides by C (§3.2).
        local_branch, global_branch: switch a branch off (ablations; C = T without the global
            branch equals GAU with N_q = C).
    The local bias is the bias of length C (``toeplitz`` switches to rope_bias only if C > 512).
    Linear in T: O(T·C·(s + e) + T·s·e).
    """

    num_qk_heads = 4
    heads_in_autocast_dtype = True

    def __init__(self, hidden_size: int, *, causal: bool, chunk_size: int = 256, normalizer: str = "visible",
                 local_branch: bool = True, global_branch: bool = True, **kw):
        max_rel_len = kw.get("max_rel_len", 512)
        # (checked before it is compared with max_rel_len: a string had failed in that comparison)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        check_positive_int("max_rel_len", max_rel_len)
        # The local bias only ever sees length C: rope_bias parameters exist only if C needs them.
        kw.setdefault("switch_to_rope", chunk_size > max_rel_len)
        super().__init__(hidden_size, causal=causal, **kw)
        check_bool("local_branch", local_branch)
        check_bool("global_branch", global_branch)
        check_normalizer(normalizer, GLOBAL_NORMALIZERS, "normalizer")
        if not (local_branch or global_branch):
            raise ValueError("FLASH needs at least one of local_branch, global_branch")
        self.chunk_size, self.normalizer = chunk_size, normalizer
        self.local_branch, self.global_branch = local_branch, global_branch
        self.reset_parameters()

    def local_bias(self, device) -> torch.Tensor | None:
        """[C, C] with entry [ρ_i, ρ_j] = β(ρ_j − ρ_i), the bias for length C."""
        rho = torch.arange(self.chunk_size, device=device)[None]
        bias = self.rel_bias(rho, rho, self.chunk_size)
        return None if bias is None else bias[0]

    def _global_norm(self, qpos: torch.Tensor, dtype) -> torch.Tensor | float:
        """N_g for decoding queries at positions qpos [B]: real tokens in the chunks before."""
        C = self.chunk_size
        if self.normalizer == "visible":
            return ((qpos // C) * C).clamp_min(1).to(dtype)[:, None, None]
        return float(C) if self.normalizer == "chunk" else 1.0

    @reads_given_cache
    def forward(self, x, *, attention_mask=None, positions=None, cache=None, use_cache=False):
        mask, positions = mask_and_positions(x, attention_mask, positions, cache, hidden_size=self.hidden_size)
        B, T, _ = x.shape
        if T == 0:  # (an empty chunk of a piecewise prefill: as every other mixer, no output, the cache as it was)
            return self.out_proj(x.new_zeros(B, 0, self.e)), cache if use_cache else None
        valid = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask
        if (self.causal and self.local_branch and self.global_branch and mask is None and not use_cache
                and T % self.chunk_size == 0 and self._dropout() == 0.0 and self.rope is not None
                and flash_mixer_usable(x, self.proj.weight, self.proj.bias)
                and self.gamma.dtype == self.beta.dtype == torch.float32):
            cos, sin = self.rope.tables(positions)
            if not (cos.requires_grad or sin.requires_grad):
                # the layer from its input projection to the gate in one Function (ops/flash.py)
                y = causal_flash_mixer(x, self.proj.weight, self.proj.bias, self.gamma, self.beta, cos, sin,
                                       self.local_bias(x.device), e=self.e, chunk_size=self.chunk_size,
                                       normalizer=self.normalizer)
                return self.out_proj(y), None
        u, v, heads = self.project(x, positions)
        ql, kl, qg, kg = heads.unbind(2)
        if use_cache and not self.causal:
            raise ValueError("use_cache needs a causal FLASH (decoding is causal)")
        if use_cache:  # flash_attn zeroes them itself; the state and the cached keys need it here
            kl, kg, v = zero_padded(mask, kl, kg, v)
        if use_cache and cache is not None and "s_prev" in cache:
            if T > 1 and one_run_per_row(valid):  # chunked prefill, a continued prompt
                o, cache = self._continue(ql, kl, qg, kg, v, positions, valid, cache)
                return self.out_proj(u * o), cache
            outs = []
            for t in range(T):  # generation's one token (and rows with gaps: token by token)
                o, cache = self._step(ql[:, t], kl[:, t], qg[:, t], kg[:, t], v[:, t], positions[:, t], valid[:, t],
                                      cache)
                outs.append(o)
            return self.out_proj(u * torch.stack(outs, 1)), cache
        o = flash_attn(ql, kl, qg, kg, v, causal=self.causal, chunk_size=self.chunk_size,
                       normalizer=self.normalizer, local_bias=self.local_bias(x.device), key_padding_mask=mask,
                       local_branch=self.local_branch, global_branch=self.global_branch,
                       dropout_p=self._dropout())
        new_cache = self._prefill_cache(kl, kg, v, positions, valid) if use_cache else None
        return self.out_proj(u * o), new_cache

    def _prefill_cache(self, kl, kg, v, positions, valid) -> dict:
        """The §3.7 state after a prefill: local K/V of the open chunk, S_prev, S_cur."""
        C = self.chunk_size
        sdt = state_dtype_for(v.dtype)
        last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(1)
        open_chunk = ((last + 1) // C)[:, None]  # the chunk of the next real token
        chunk = positions // C
        w_prev = (valid & (chunk < open_chunk)).to(sdt)[..., None]
        w_cur = (valid & (chunk == open_chunk)).to(sdt)[..., None]
        kg, vs = kg.to(sdt), v.to(sdt)
        cache = update_block_cache(None, kl[:, :, None], v[:, :, None], positions, valid, C)
        with autocast_off(kg.device.type):  # the states accumulate in sdt, as in _step
            cache["s_prev"] = (kg * w_prev).transpose(1, 2) @ vs
            cache["s_cur"] = (kg * w_cur).transpose(1, 2) @ vs
        return cache

    def _continue(self, ql, kl, qg, kg, v, positions, valid, cache):
        """T > 1 new tokens on a cache, as T calls of :meth:`_step` give them, each row's real tokens
        consecutive: ql, kl, qg, kg [B, T, s]; v [B, T, e]; positions, valid [B, T]. The loop over
        tokens had cost a 1,024-token prompt in 256-token chunks 14x its whole prefill.

        Local branch: queries [a, a + C) against the cached keys and the new keys [a - C, a + C),
        which hold every key of their chunks. Global branch: a token of the r-th chunk from the
        cache's open chunk g0 reads S_prev + [r > 0] S_cur + the new tokens of chunks g0 … g0 + r - 1.
        """
        C = self.chunk_size
        B, T, _ = v.shape
        dev = v.device
        out = v.new_zeros(v.shape)
        if self.local_branch:
            c0 = cache["k"].shape[1]
            seq = with_cache(cache, k=kl[:, :, None], v=v[:, :, None], pos=positions, valid=valid)
            K, V, kpos, kvalid = seq["k"][:, :, 0], seq["v"][:, :, 0], seq["pos"], seq["valid"]
            parts = []
            for a, keys in windows_of_blocks(c0, T, C, dev):
                qp, kp = positions[:, a:a + C], kpos[:, keys]
                parts.append(relu2_attention(ql[:, a:a + C], K[:, keys], V[:, keys],
                                             allowed=same_block_keys(qp, kp, kvalid[:, keys], C), norm=float(C),
                                             bias=self.rel_bias(qp, kp, C)))
            out = out + torch.cat(parts, 1)
        s_prev, s_cur = cache["s_prev"], cache["s_cur"]
        sdt = s_prev.dtype
        # chunks counted from the cache's open chunk: the first new real token's (its position counts
        # the real tokens before it, so a row without one gets the chunk of its next token anyway)
        first = torch.where(valid, positions, torch.iinfo(positions.dtype).max).amin(1)
        g0 = torch.where(valid.any(1), first, positions[:, 0]) // C
        rel = (positions // C - g0[:, None]).clamp_min(0)  # [B, T]
        R = int(rel.max()) + 2
        kv = kg.to(sdt).transpose(1, 2)  # [B, s, T]; padding's rows are 0 (forward's zero_padded)
        onehot = torch.nn.functional.one_hot(rel, R).to(sdt)  # [B, T, R]
        with autocast_off(dev.type):  # the states accumulate in sdt, as in _step
            sums = torch.einsum("bst,btr,bte->brse", kv, onehot, v.to(sdt))  # [B, R, s, e] per chunk
            before = torch.cumsum(sums, 1) - sums  # the new tokens of the chunks before each
            carried = torch.cat([torch.zeros_like(s_cur)[:, None], s_cur[:, None].expand(-1, R - 1, -1, -1)], 1)
            states = s_prev[:, None] + carried + before  # [B, R, s, e]: what a token of chunk g0 + r reads
            rows = torch.arange(B, device=dev)
            if self.global_branch:
                glob = torch.zeros(B, T, v.shape[-1], dtype=sdt, device=dev)
                for a in range(0, T, C):  # a slice's real tokens span at most two chunks: r0 and r0 + 1
                    r = rel[:, a:a + C]
                    r0 = r.amin(1)
                    pick = [states[rows, (r0 + i).clamp_max(R - 1)] for i in (0, 1)]
                    q = qg[:, a:a + C].to(sdt)
                    glob[:, a:a + C] = torch.where((r == r0[:, None])[..., None], q @ pick[0], q @ pick[1])
                norm = self._global_norm(positions.reshape(-1), sdt)
                out = out + (glob / (norm.reshape(B, T, 1) if torch.is_tensor(norm) else norm)).to(out.dtype)
            # the state after the call: the open chunk is the next token's
            last = torch.where(valid, positions, -1).amax(1)
            r_new = (torch.where(valid.any(1), last + 1, positions[:, 0]) // C - g0).clamp_min(0)
            new_prev = states[rows, r_new]
            new_cur = torch.where((r_new == 0)[:, None, None], s_cur, torch.zeros_like(s_cur)) + sums[rows, r_new]
        new = update_block_cache({k: cache[k] for k in ("k", "v", "pos", "valid")}, kl[:, :, None], v[:, :, None],
                                 positions, valid, C)
        new["s_prev"], new["s_cur"] = new_prev, new_cur
        return out, new

    def _step(self, ql, kl, qg, kg, v, pos, valid, cache):
        """One token: ql, kl, qg, kg [B, s]; v [B, e]; pos, valid [B]. Returns (o [B, e], cache)."""
        C = self.chunk_size
        out = v.new_zeros(v.shape)
        if self.local_branch:
            seq = with_cache(cache, k=kl[:, None, None], v=v[:, None, None], pos=pos[:, None], valid=valid[:, None])
            K, V, kpos, kvalid = seq["k"][:, :, 0], seq["v"][:, :, 0], seq["pos"], seq["valid"]
            allowed = same_block_keys(pos[:, None], kpos, kvalid, C)  # [B, 1, S]
            bias = self.rel_bias(pos[:, None], kpos, C)
            out = out + relu2_attention(ql[:, None], K, V, allowed=allowed, norm=float(C), bias=bias)[:, 0]
        s_prev, s_cur = cache["s_prev"], cache["s_cur"]
        if self.global_branch:
            glob = (qg[:, None].to(s_prev.dtype) @ s_prev) / self._global_norm(pos, s_prev.dtype)
            out = out + glob[:, 0].to(out.dtype)
        # a padded token adds 0: forward zeroed its kg and v (zero_padded)
        s_cur = s_cur + kg.to(s_cur.dtype)[:, :, None] * v.to(s_cur.dtype)[:, None, :]
        closes = (valid & ((pos + 1) % C == 0))[:, None, None]  # the token ends its chunk
        s_prev = torch.where(closes, s_prev + s_cur, s_prev)
        s_cur = torch.where(closes, torch.zeros_like(s_cur), s_cur)
        new = update_block_cache({k: cache[k] for k in ("k", "v", "pos", "valid")}, kl[:, None, None],
                                 v[:, None, None], pos[:, None], valid[:, None], C)
        new["s_prev"], new["s_cur"] = s_prev, s_cur
        return out, new
