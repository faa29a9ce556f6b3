"""Positional encodings: LRPE (Householder + rotary with learnable angles), RoPE, sinusoidal
and learned absolute positions.

Positions are integer tensors [B, T] (or [T]): the count of valid tokens before each token,
so left-padded and unpadded sequences get the same positions (spec §1.2).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..ops._checks import check_bool, check_positive_int
from ..ops.lrpe import FEATURE_KERNELS, lrpe_feature_map
from .precision import apply_keeping_full_precision

LRPE_TYPES = ("householder_rope", "rope", "none")



def _check_pairing(pairing) -> None:
    if pairing not in ("interleaved", "half"):
        raise ValueError(f"pairing must be 'interleaved' or 'half', got {pairing!r}")

def _as_batched(positions: torch.Tensor) -> torch.Tensor:
    return positions[None] if positions.dim() == 1 else positions


def rotate(x: torch.Tensor, angles: torch.Tensor, pairing: str = "interleaved") -> torch.Tensor:
    """Rotate channel pairs of x [B, T, H, D] by angles [B, T, P] (P ≤ D/2 pairs).

    ``interleaved`` pairs (2i, 2i+1) (TransNormer LRPE); ``half`` pairs (i, i + D/2) (GAU RoPE).
    Channels beyond the 2P rotated ones pass through unchanged (odd D: the last channel).

    Written as x·cos + swap(x)·sin with full-width cos/sin tables: no strided slices, whose
    backward would allocate and fill a zero tensor per slice.
    """
    P = angles.shape[-1]
    _check_pairing(pairing)
    D = x.shape[-1]
    cos, sin = torch.cos(angles), torch.sin(angles)
    rot = x[..., : 2 * P] if D != 2 * P else x
    if pairing == "interleaved":
        cos2 = torch.stack((cos, cos), -1).flatten(-2)
        sin2 = torch.stack((-sin, sin), -1).flatten(-2)
        swapped = rot.unflatten(-1, (P, 2)).flip(-1).flatten(-2)  # (a, b) -> (b, a)
    else:
        cos2 = torch.cat((cos, cos), -1)
        sin2 = torch.cat((-sin, sin), -1)
        swapped = torch.cat((rot[..., P:], rot[..., :P]), -1)
    out = rot * cos2[:, :, None].to(x.dtype) + swapped * sin2[:, :, None].to(x.dtype)
    return torch.cat((out, x[..., 2 * P :]), dim=-1) if D != 2 * P else out


class LRPE(nn.Module):
    """LRPE_m(x) = R_m P x with P = I − 2uuᵀ frozen and R_m a rotary map of angles m·θ (spec §3).

    ``householder=False`` and ``learn_theta=False`` give plain RoPE. The Householder vector u is
    drawn from ``seed`` and stored as a buffer, so checkpoints carry it. x: [B, T, H, D].
    """

    def __init__(
        self,
        head_dim: int,
        *,
        householder: bool = True,
        learn_theta: bool = True,
        seed: int = 0,
        base: float = 10000.0,
        pairing: str = "interleaved",
    ):
        super().__init__()
        check_positive_int("head_dim", head_dim)
        _check_pairing(pairing)  # (had waited for the first forward)
        self.head_dim, self.householder, self.pairing = head_dim, householder, pairing
        self.base, self.seed = base, seed
        theta = self._initial_theta()
        if learn_theta:
            self.theta = nn.Parameter(theta)
        else:
            self.register_buffer("theta", theta)
        if householder:
            self.register_buffer("u", self._initial_u())
        else:
            self.u = None

    def _initial_theta(self) -> torch.Tensor:
        return self.base ** (-2.0 * torch.arange(self.head_dim // 2, dtype=torch.float32) / self.head_dim)

    def _initial_u(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        z = torch.randn(self.head_dim, generator=g, dtype=torch.float32)  # fp32 under any default dtype
        return z / z.norm()

    @torch.no_grad()
    def reset_parameters(self, keep=None) -> None:
        """θ and u as built (computed from ``base`` and ``seed``, not drawn through torch.nn.init);
        ``keep(tensor)``: leave those it says (Hugging Face's loading keeps the loaded ones)."""
        for t, value in ((self.theta, self._initial_theta()), (self.u, None if self.u is None else self._initial_u())):
            if value is not None and not (keep is not None and keep(t)):
                t.copy_(value)

    def _apply(self, fn, recurse=True):
        """As nn.Module's (``.to``, ``.half()``, ``.cuda()``, ...), except that θ and u keep at least
        fp32: a model cast to bf16 had rounded θ to 8 bits, which moves the angle m·θ of a far position
        by radians (θ_0 = 1 off by up to 2^-9: ~4 rad at m = 2048), a silent change of the encoding
        the model was trained with; autocast keeps them fp32 as it is. The tables are cast where they
        are used."""
        return apply_keeping_full_precision(self, ("theta", "u"), lambda: super(LRPE, self)._apply(fn, recurse))

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """The pair angles m·θ [B or 1, T, D/2] at positions [B, T] (or [T])."""
        # at least fp32: bf16 positions past 256 round to even numbers, and the error grows with them
        dt = torch.promote_types(self.theta.dtype, torch.float32)
        return _as_batched(positions).to(dt)[..., None] * self.theta.to(dt)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B or 1, T, D/2] of the pair angles at positions [B, T] (or [T])."""
        angles = self.angles(positions)
        return torch.cos(angles), torch.sin(angles)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, scale: float = 1.0,
                kernel: str = "identity") -> torch.Tensor:
        """LRPE of ``kernel(x)`` for x [B, T, H, D] at positions [B, T] (or [T]), times ``scale``.

        Fusing the attention kernel here lets the interleaved form run as one pass (ops.lrpe).
        """
        if self.pairing == "interleaved" and self.head_dim % 2 == 0:
            return lrpe_feature_map(x, *self.tables(positions), self.u, scale=scale, kernel=kernel)
        x = FEATURE_KERNELS[kernel](x)
        if self.u is not None:
            u = self.u.to(x.dtype)
            x = x @ (torch.eye(self.head_dim, dtype=x.dtype, device=x.device) - 2.0 * torch.outer(u, u))
        if scale != 1.0:
            x = x * scale
        return rotate(x, self.angles(positions), self.pairing)


def build_lrpe(kind: str, head_dim: int, *, learn_theta: bool = True, seed: int = 0, pairing: str = "interleaved"):
    """``householder_rope`` (LRPE), ``rope`` (plain, fixed θ) or ``none`` (returns None).

    ``learn_theta`` (the config's ``lrpe_learn_theta``) applies to ``householder_rope`` only: ``rope``
    is the LRA configs' plain RoPE, θ fixed (spec §3), whatever it says."""
    # (through layer_options these had reached torch unchecked: a string seed failed in manual_seed,
    # a negative one was taken, a learn_theta of "false" read as True)
    check_bool("lrpe_learn_theta", learn_theta)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:  # (torch's seeds: int64)
        raise ValueError(f"lrpe_seed must be an int in [0, 2**63), got {seed!r}")
    if kind == "householder_rope":
        return LRPE(head_dim, householder=True, learn_theta=learn_theta, seed=seed, pairing=pairing)
    if kind == "rope":
        return LRPE(head_dim, householder=False, learn_theta=False, pairing=pairing)
    if kind == "none":
        return None
    raise ValueError(f"lrpe must be one of {LRPE_TYPES}, got {kind!r}")


SINUSOID_LAYOUTS = ("fairseq", "transformer")


def sinusoidal_table(positions: torch.Tensor, dim: int, layout: str = "fairseq",
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[sin(pθ) | cos(pθ)] for positions [B, T] → [B, T, dim] (an odd ``dim`` gets a zero last column),
    computed in ``dtype`` (fp32, or fp64 for an fp64 model).

    ``layout`` sets the frequencies θ_i, i < ⌊dim/2⌋: ``fairseq`` θ_i = 10000^{-i/(⌊dim/2⌋-1)} (the
    OpenNLPLab/fairseq embedding, which reaches 1/10000 in its last pair), ``transformer``
    θ_i = 10000^{-2i/dim} (Vaswani et al.; FLASH's scaled sinusoid, flash.md §1.3).
    """
    half = dim // 2
    if layout == "fairseq":
        scale = math.log(10000.0) / max(half - 1, 1)
    elif layout == "transformer":
        scale = 2.0 * math.log(10000.0) / dim
    else:
        raise ValueError(f"layout must be one of {SINUSOID_LAYOUTS}, got {layout!r}")
    freqs = torch.exp(-scale * torch.arange(half, dtype=dtype, device=positions.device))
    ang = positions.to(dtype)[..., None] * freqs
    emb = torch.cat((torch.sin(ang), torch.cos(ang)), dim=-1)
    if dim % 2:
        emb = torch.nn.functional.pad(emb, (0, 1))
    return emb


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal absolute positions (see :func:`sinusoidal_table` for ``layout``), optionally
    times a learnable scalar (FLASH)."""

    def __init__(self, dim: int, learnable_scale: float | None = None, layout: str = "fairseq"):
        super().__init__()
        if layout not in SINUSOID_LAYOUTS:
            raise ValueError(f"layout must be one of {SINUSOID_LAYOUTS}, got {layout!r}")
        self.dim = dim
        self.layout = layout
        self.initial_scale = learnable_scale
        self.scale = None if learnable_scale is None else nn.Parameter(torch.tensor(float(learnable_scale)))

    def reset_parameters(self) -> None:
        if self.scale is not None:
            nn.init.constant_(self.scale, float(self.initial_scale))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[B, T, dim]; ``dtype`` fp64 computes the table in fp64 (an fp64 model's oracle runs), else fp32."""
        table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        emb = sinusoidal_table(_as_batched(positions), self.dim, self.layout, table_dtype)
        return emb if self.scale is None else emb * self.scale


class LearnedPositions(nn.Module):
    """Learned absolute positions for at most ``max_positions`` tokens."""

    def __init__(self, max_positions: int, dim: int):
        super().__init__()
        check_positive_int("max_positions", max_positions)
        check_positive_int("dim", dim)
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.zeros(max_positions, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[B, T, dim]; ``dtype`` is not used (the table is the parameter): as SinusoidalPositions'."""
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"sequence needs position {int(positions.max())} but max_position_embeddings is "
                f"{self.max_positions} (learned positions); use shorter inputs or a larger config"
            )
        return nn.functional.embedding(_as_batched(positions), self.weight)
