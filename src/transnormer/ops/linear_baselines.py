"""Kernelized linear attention WITH the classic row-sum denominator: the paper's baselines.

Layouts as in the other ops:

    qf, kf: [B, T, H, F] featurised queries / keys     v: [B, T, H, E]
    key_padding_mask: [B, T] (True = valid)            state: [B, H, F, E + 1] (see below)

Every baseline here is "features, then ratio":

    o_i = Σ_{j∈V(i)} (φq_i·φk_j) v_j  /  ( Σ_{j∈V(i)} φq_i·φk_j  +  eps )

with V(i) = {j ≤ i} (causal) or all j (bidirectional), padded keys excluded. The numerator and
the denominator are ONE call of the existing chunked machinery (:func:`norm_linear_attn`) on the
value matrix augmented with a column of ones, [v | 1]: its last output column is the
denominator, so both share the chunking, the fp32 state and the hand-written backward.
The decoding state is therefore [B, H, F, E + 1]: Σ k_jᵀ v_j next to the key sum Σ k_j.

``eps`` sits in the denominator (default 1e-6, as in Katharopoulos et al.): it keeps rows with no
visible key (fully padded, or left padding in causal mode) at 0 instead of 0/0. It is not
scale-free: it is negligible for the O(1) features of 1+elu and cosFormer, not for FAVOR+, whose
key features are not rescaled (a rescale by their max over tokens would leak the future) and fall
far below 1 once |q|, |k| grow. ``eps=0`` divides exactly and gives 0 only where the denominator
is 0; the Performer layer uses it.
``denominator=False`` gives the un-normalised numerator alone: the paper's "1+elu without
scaling" that diverges when no norm follows it (spec §9, Table 1).

Feature maps provided here (pure functions, the layers hold the parameters):
    elu_features          φ(x) = 1 + elu(x)                          (Katharopoulos et al. 2020)
    favor_features        FAVOR+ positive random features            (Choromanski et al. 2021)
    cosformer_features    [relu(x) cos θ_p, relu(x) sin θ_p]         (Qin et al. 2022, cosFormer)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._checks import check_bool, check_bthd, check_key_padding_mask, check_positive_int, check_qkv
from ._dtypes import autocast_off
from .norm_linear import norm_linear_attn, norm_linear_attn_step

DEFAULT_EPS = 1e-6


# ----------------------------------------------------------------------------------------------
# Core: numerator and denominator in one chunked pass
# ----------------------------------------------------------------------------------------------
def _augment(v: torch.Tensor) -> torch.Tensor:
    """[..., E] → [..., E + 1] with a trailing column of ones (the denominator's 'value')."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)  # (E = 0 too: ones_like(v[..., :1]) is empty)


def _check_augmented_state(name: str, state, qf: torch.Tensor, v: torch.Tensor) -> None:
    """A state given with the denominator carries its key sum as a last column: [B, H, F, E + 1]."""
    if isinstance(state, torch.Tensor):
        want = (qf.shape[0], qf.shape[-2], qf.shape[-1], v.shape[-1] + 1)
        if tuple(state.shape) != want:
            raise ValueError(f"{name} must have shape [B, H, F, E + 1] = {want} (its last column holds the "
                             f"denominator's key sum), got {tuple(state.shape)}")


def _wide_for_sums(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp16 inputs in fp32: the numerator and denominator both grow with the number of keys and
    left the op in its dtype, so in fp16 (largest 65504) both overflowed past ~1k tokens and their
    ratio, a weighted mean of the values, read inf / inf = NaN. bf16 has fp32's range."""
    return tuple(x.float() if x.dtype == torch.float16 else x for x in xs)


def _ratio(o: torch.Tensor, eps: float) -> torch.Tensor:
    return safe_ratio(o[..., :-1], o[..., -1:], eps)


def safe_ratio(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """num / (den + eps); ``eps`` = 0: the exact ratio, with a zero denominator (a row with no
    visible key, whose numerator is 0 too when the features are >= 0) giving 0 instead of 0/0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:  # (None: a bare '>=' error)
        raise ValueError(f"eps must be a number >= 0 with a denominator, got {eps!r}")
    if eps == 0:
        return num / torch.where(den > 0, den, torch.ones_like(den))
    return num / (den + eps)


def kernel_linear_attn(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    denominator: bool = True,
    eps: float = DEFAULT_EPS,
    chunk_size: int = 64,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention with (or without) the row-sum denominator; linear in T.

    Args:
        qf, kf: [B, T, H, F] non-negative features (any features without ``denominator``).
        v: [B, T, H, E] values.
        causal: j ≤ i (chunked form, exclusive prefix state across chunks) or all keys.
        denominator: divide by Σ_j φq_i·φk_j + eps (True) or return the bare numerator.
        eps: added to the denominator (see the module docstring).
        chunk_size: rows per chunk of the causal form; a speed knob, not a model parameter.
        key_padding_mask: optional [B, T], True = valid; padded keys are excluded from both sums.
        initial_state: optional prefix state, [B, H, F, E + 1] with denominator, else [B, H, F, E].
        output_final_state: also return the state after the last token (for decoding).

    Returns:
        (o [B, T, H, E] in qf's dtype, final state or None). The state is fp32 for half inputs.
    """
    check_bool("causal", causal)  # (a string "false" had run the causal form, None the bidirectional one)
    check_qkv(qf, kf, v)
    dtype = qf.dtype
    if denominator:
        _check_augmented_state("initial_state", initial_state, qf, v)
        qf, kf, v = _wide_for_sums(qf, kf, v)
    vv = _augment(v) if denominator else v
    o, state = norm_linear_attn(
        qf, kf, vv, causal=causal, chunk_size=chunk_size, initial_state=initial_state,
        output_final_state=output_final_state, key_padding_mask=key_padding_mask,
    )
    if denominator:
        o = _ratio(o, eps).to(dtype)
    return o, state


def kernel_linear_attn_step(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None,
    *,
    denominator: bool = True,
    eps: float = DEFAULT_EPS,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step, inclusive of the current token.

    qf, kf: [B, H, F]; v: [B, H, E]; state: [B, H, F, E (+1)] or None; key_padding_mask: [B].
    Returns (o [B, H, E], new state).
    """
    for name, x in (("qf", qf), ("kf", kf), ("v", v)):  # under their own names, before v is augmented
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a [B, H, {'E' if name == 'v' else 'F'}] tensor for one step, "
                             f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not x.is_floating_point():  # (the message had come from the step below, naming its q)
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got {x.dtype}")
    dtype = qf.dtype
    if denominator:
        _check_augmented_state("state", state, qf, v)
        qf, kf, v = _wide_for_sums(qf, kf, v)
    vv = _augment(v) if denominator else v
    o, state = norm_linear_attn_step(qf, kf, vv, state, key_padding_mask=key_padding_mask)
    if denominator:
        o = _ratio(o, eps).to(dtype)
    return o, state


# ----------------------------------------------------------------------------------------------
# 1 + elu (Katharopoulos et al.)
# ----------------------------------------------------------------------------------------------
def elu_features(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = 1 + elu(x) > 0, element-wise; x: [..., D] → [..., D]."""
    return 1.0 + F.elu(x)


# ----------------------------------------------------------------------------------------------
# FAVOR+ (Performer)
# ----------------------------------------------------------------------------------------------
# Key features are never shifted by a data-dependent amount (see favor_features); each key
# exponent is capped here on its own, so exp() stays far from the fp32 limit (exp(60) ≈ 1e26;
# 88 overflows) with room for sums over long sequences.
KEY_EXPONENT_CAP = 60.0


def default_num_features(head_dim: int) -> int:
    """⌊d_h ln d_h⌋ random features (the FAVOR+ default), at least 1."""
    return max(1, int(head_dim * math.log(head_dim))) if head_dim > 1 else 1


def draw_favor_projection(num_features: int, head_dim: int, *, seed: int, orthogonal: bool = True) -> torch.Tensor:
    """Random projection ω ∈ R^{m×d_h} on the CPU, fully determined by ``seed``.

    ``orthogonal``: stacked blocks of Haar-orthogonal rows (QR of a Gaussian matrix with the sign
    fix of diag(R)), each row rescaled to the norm of an independent N(0, I) vector, so every row
    is marginally N(0, I) as the unbiased estimator needs, and rows within a block are orthogonal
    (lower variance). Otherwise i.i.d. N(0, I) rows.
    """
    check_positive_int("num_features", num_features)
    check_positive_int("head_dim", head_dim)
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    if not orthogonal:
        return torch.randn(num_features, head_dim, generator=g, device="cpu", dtype=torch.float32)
    nb = -(-num_features // head_dim)
    q, r = torch.linalg.qr(torch.randn(nb, head_dim, head_dim, generator=g, device="cpu", dtype=torch.float32))  # batched
    q = q * torch.where(torch.diagonal(r, dim1=-2, dim2=-1) >= 0, 1.0, -1.0)[:, None, :]  # QR sign fix: Haar
    w = q.transpose(-1, -2).reshape(nb * head_dim, head_dim)[:num_features]  # orthonormal rows per block
    norms = torch.randn(num_features, head_dim, generator=g, device="cpu", dtype=torch.float32).norm(dim=1)
    return w * norms[:, None]


def favor_features(x: torch.Tensor, proj: torch.Tensor, *, is_query: bool) -> torch.Tensor:
    """FAVOR+ positive features of the softmax kernel exp(q·k / √d_h).

    φ(x)_r = exp(ω_r·x̃ − |x̃|²/2 − c) / √m,  x̃ = x d_h^{-1/4},  so E_ω[φ(q)·φ(k)] = exp(q·k/√d_h)
    up to the per-query factor exp(−c), which cancels in the ratio.

    Stabiliser c (why it cannot leak in causal mode):
      * queries: c = max_r(ω_r·x̃ − |x̃|²/2) of the token itself. A per-query constant multiplies
        numerator and denominator of that query's row alike, so it cancels (up to eps) and
        depends on nothing but the token.
      * keys: no max over tokens at all. The reference Performer code subtracts the maximum
        over the whole sequence here, which lets a future token change earlier outputs
        (peers.md §3.4). Each key exponent is instead capped at ``KEY_EXPONENT_CAP`` on its
        own (local to the token: nothing leaks), which only binds for exponents past exp(60)
        ~ 1e26, far beyond what q·k/√d_h reaches in practice. (A constant shift by the worst
        case max_r |ω_r|²/2 − cap, used before, is 28 at d_h = 128 and 110 at 256: the
        denominators then fell under eps or every feature underflowed to 0.)

    Args:
        x: [B, T, H, D] queries or keys (un-scaled; the d^{-1/4} scaling is done here).
        proj: [m, D] projection ω.
    Returns:
        [B, T, H, m] features, computed in fp32 at least (the exponentials need the range).
    """
    check_bthd("x", x)
    if not isinstance(proj, torch.Tensor) or proj.dim() != 2 or proj.shape[1] != x.shape[-1]:
        got = tuple(proj.shape) if isinstance(proj, torch.Tensor) else type(proj).__name__
        raise ValueError(f"proj must be an [m, D] projection with D = {x.shape[-1]} (x's head dim), got {got}")
    dtype = torch.promote_types(x.dtype, torch.float32)
    D = x.shape[-1]
    m = proj.shape[0]
    # Not under autocast: a bf16 projection would put ~1% errors into exponents of size ~10.
    with autocast_off(x.device.type):
        xs = x.to(dtype) * D ** -0.25
        expo = torch.einsum("bthd,md->bthm", xs, proj.to(dtype)) - 0.5 * xs.pow(2).sum(-1, keepdim=True)
        if is_query:
            expo = expo - expo.amax(-1, keepdim=True)
        else:
            expo = expo.clamp_max(KEY_EXPONENT_CAP)
        return torch.exp(expo) * m ** -0.5


# ----------------------------------------------------------------------------------------------
# cosFormer
# ----------------------------------------------------------------------------------------------
def cosformer_angles(positions: torch.Tensor, max_len) -> torch.Tensor:
    """θ_p = π/2 · p / M. positions [B, T] (real-token positions); M a number or [B] tensor (a row
    of no tokens, length 0, is given M = 1: its angles are never read, and 0 made them NaN, whose
    gradient reached the shared projections)."""
    M = torch.as_tensor(max_len, device=positions.device, dtype=torch.float64)
    if M.dim() == 1:
        M = M.clamp_min(1)[:, None]
    return (positions.to(torch.float64) * (math.pi / 2) / M)


def check_cosformer_positions(positions, max_len, mask: torch.Tensor | None, batch: int, length: int, *,
                              from_zero: bool = False, hint: str = "") -> None:
    """positions: a [B or 1, T] tensor of real-token positions. The cos re-weighting stays >= 0 only
    while |p_i - p_j| < M (a number or [B] tensor), so each row's real positions (``mask`` [B, T], or
    all) must span less than M; ``from_zero`` (a layer that decodes, whose later tokens are not
    known yet): each must lie in [0, M)."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dim() != 2 or positions.shape[0] not in (1, batch) or positions.shape[1] != length:
        raise ValueError(f"positions must be [B or 1, T] = [{batch} or 1, {length}], got {tuple(positions.shape)}")
    if positions.numel() == 0:
        return
    p = positions.expand(batch, length).to(torch.float64)
    if not bool(torch.isfinite(p).all()):  # (a NaN passes every comparison below)
        raise ValueError("positions must be finite")
    real = torch.ones_like(p, dtype=torch.bool) if mask is None else mask
    lo, hi = torch.where(real, p, math.inf).amin(1), torch.where(real, p, -math.inf).amax(1)  # a row of padding: inf, -inf
    if from_zero and bool((lo < 0).any()):
        raise ValueError(f"positions must be >= 0, got {float(lo.min()):g}")
    span = hi - (0.0 if from_zero else lo)
    M = torch.as_tensor(max_len, dtype=torch.float64, device=p.device)
    if M.dim() > 1 or M.dim() == 1 and M.shape[0] != batch:
        raise ValueError(f"max_len must be a number or a [B] = [{batch}] tensor, got shape {tuple(M.shape)}")
    M = M.expand(batch)
    # a row with tokens needs M >= 1, as a number does; a row of padding alone (lo = inf) may say 0
    bad = (torch.isfinite(lo) & ~(M >= 1)).nonzero()
    if len(bad):
        r = int(bad[0, 0])
        raise ValueError(f"max_len must be >= 1 in every row with tokens, got {float(M[r]):g} in row {r}")
    bad = (span >= M).nonzero()
    if len(bad):
        r = int(bad[0, 0])
        what = (f"position {float(hi[r]):g}" if from_zero else
                f"positions {float(lo[r]):g} .. {float(hi[r]):g} (a gap of {float(span[r]):g})")
        raise ValueError(f"cosFormer {what} in row {r} >= max_len M = {float(M[r]):g}: the cos re-weighting needs "
                         f"|p_i - p_j| < M{hint}")


def cosformer_features(x: torch.Tensor, positions: torch.Tensor, max_len) -> torch.Tensor:
    """[relu(x) cos θ_p, relu(x) sin θ_p]: x [B, T, H, D] → [B, T, H, 2D].

    The decomposition cos(θ_i − θ_j) = cos θ_i cos θ_j + sin θ_i sin θ_j turns the re-weighted
    kernel relu(q_i)·relu(k_j) · cos(π/2 · (p_i − p_j)/M) into a plain dot product of these
    features, so it runs through the linear-time machinery. Weights stay ≥ 0 while
    |p_i − p_j| ≤ M, which the layer guarantees by checking positions < M
    (:func:`check_cosformer_positions`).
    """
    check_bthd("x", x)
    ang = cosformer_angles(positions, max_len)[:, :, None, None]
    r = F.relu(x)
    return torch.cat([r * torch.cos(ang).to(x.dtype), r * torch.sin(ang).to(x.dtype)], dim=-1)


def cosformer_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    max_len,
    *,
    causal: bool,
    eps: float = DEFAULT_EPS,
    chunk_size: int = 64,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """cosFormer attention, linear in T. q, k: [B, T, H, D] raw (pre-ReLU); v: [B, T, H, E];
    positions [B, T]; max_len M (number or [B]). Returns o [B, T, H, E]."""
    check_bool("causal", causal)  # (a string "false" had run the causal form, None the bidirectional one)
    check_qkv(q, k, v)
    mask = check_key_padding_mask(key_padding_mask, q.shape[0], q.shape[1])
    if not isinstance(max_len, torch.Tensor) and not max_len >= 1:  # M = 0 made every weight NaN
        raise ValueError(f"max_len must be >= 1 (or a [B] tensor of row lengths), got {max_len!r}")
    check_cosformer_positions(positions, max_len, mask, q.shape[0], q.shape[1])
    qf = cosformer_features(q, positions, max_len)
    kf = cosformer_features(k, positions, max_len)
    o, _ = kernel_linear_attn(qf, kf, v, causal=causal, eps=eps, chunk_size=chunk_size,
                              key_padding_mask=key_padding_mask)
    return o
