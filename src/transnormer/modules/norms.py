"""Normalisation layers, selectable by name through :func:`build_norm`.

All norms act on the last dimension of x: [..., d] and accept an optional ``mask`` [B, T]
(True = valid) so that batch statistics (``batch``) can exclude padding; the others ignore it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops._checks import check_bool
from ..ops._dtypes import autocast_enabled
from ..ops.norm_linear import state_dtype_for
from ..ops.rowwise import scale_norm, simple_rms_norm
from .precision import apply_keeping_full_precision
from .recompute import recomputing


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 for half inputs (their sums of squares lose too much); fp32/fp64 stay as they are."""
    return x.to(state_dtype_for(x.dtype))


def _check_width(norm: nn.Module, x: torch.Tensor) -> None:
    # The gain-free norms would otherwise normalise any width silently, and MaskedBatchNorm's
    # reshape would fold a wrong width into rows before failing somewhere less clear.
    if x.dim() == 0 or x.shape[-1] != norm.dim:
        raise ValueError(f"{type(norm).__name__}: x must be [..., {norm.dim}] (the norm's dim), "
                         f"got {tuple(x.shape)}")


def _check_eps(eps) -> None:
    # (a negative ε had flipped SimpleRMSNorm's sign, a NaN one made every output NaN)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


class SimpleRMSNorm(nn.Module):
    """SRMSNorm: no gain, no bias (spec §5).

    ``eps_inside_sqrt=False`` (the released code): y = x / (‖x‖₂·d^{-1/2} + ε).
    ``eps_inside_sqrt=True`` (the paper's theory):  y = x / √(mean(x²) + ε).
    """

    def __init__(self, dim: int, eps: float = 1e-8, eps_inside_sqrt: bool = False):
        super().__init__()
        _check_eps(eps)
        self.dim, self.eps, self.eps_inside_sqrt = dim, eps, eps_inside_sqrt

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        _check_width(self, x)
        return simple_rms_norm(x, self.eps, self.eps_inside_sqrt)  # fused on CPU (ops/rowwise.py)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, eps_inside_sqrt={self.eps_inside_sqrt}"


class RMSNorm(SimpleRMSNorm):
    """RMSNorm with a learnable per-channel gain (ε inside the root, as is usual)."""

    def __init__(self, dim: int, eps: float = 1e-6, eps_inside_sqrt: bool = True):
        super().__init__(dim, eps, eps_inside_sqrt)
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        # (from_pretrained leaves a gain the checkpoint lacks as torch.empty and calls this)
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x) * self.weight.to(x.dtype)


class ScaleNorm(nn.Module):
    """ScaleNorm (FLASH): g·x / √(mean(x²) + ε) with one learnable scalar g.

    ``feeds_autocast``: the output goes only to products that run under autocast (a pre-norm
    block's mixer), so under autocast it is returned in the autocast dtype, rounded once from
    fp32: the values those products' casts would make, without the fp32 copy and its cast back.
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, feeds_autocast: bool = False):
        super().__init__()
        _check_eps(eps)
        self.dim, self.eps, self.feeds_autocast = dim, eps, feeds_autocast
        self.scale = nn.Parameter(torch.ones(()))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        _check_width(self, x)
        dev = x.device.type
        out_dtype = (torch.get_autocast_dtype(dev) if self.feeds_autocast and autocast_enabled(dev)
                     else None)
        # fused on CPU with the gain inside (ops/rowwise.py); fp32 math, the result rounds once
        return scale_norm(x, self.scale, self.eps, out_dtype=out_dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that accepts (and ignores) a padding mask, and runs in fp32 where a half precision
    is involved: fp32 rows in a half-precision module (NormAttention in fp16 keeps its output fp32 up
    to the norm; PyTorch's CPU layer norm refuses fp32 input with half weights), and half rows, whose
    backward PyTorch's CPU kernel sums over the rows in that precision (the MLM head's gain and bias
    gradients under bf16 autocast: 0.56 relative error at 16k rows). The output keeps x's dtype."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        w, b, half = self.weight, self.bias, (torch.float16, torch.bfloat16)
        if x.dtype in half or (w is not None and x.dtype == torch.float32 and w.dtype in half):
            return F.layer_norm(x.float(), self.normalized_shape, None if w is None else w.float(),
                                None if b is None else b.float(), self.eps).to(x.dtype)
        return super().forward(x)


class MaskedBatchNorm(nn.Module):
    """BatchNorm over channels whose statistics use valid positions only (LRA, spec §12 item 6).

    x: [B, T, d]; mask: [B, T]. In eval mode the running statistics are used. Training statistics
    are this process's batch, or, after :func:`sync_batch_norm` (the authors' SyncBatchNorm;
    ``lra train``'s default), the valid positions of every process's batch (two all-reduces per
    forward, differentiable: the result is that of one process holding the global batch). A batch
    with fewer than two valid positions has no spread to measure: the running statistics serve.
    """

    has_call_state = True  # running statistics: updated once per step, not again when recomputed

    def __init__(self, dim: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        _check_eps(eps)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum <= 1:
            raise ValueError(f"momentum must be a number in [0, 1], got {momentum!r}")
        self.dim, self.eps, self.momentum = dim, eps, momentum
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        # at least fp32 whatever the default dtype (from_pretrained(dtype=torch.float16) builds under it);
        # fp64 under an fp64 default
        stats = torch.promote_types(torch.get_default_dtype(), torch.float32)
        self.register_buffer("running_mean", torch.zeros(dim, dtype=stats))
        self.register_buffer("running_var", torch.ones(dim, dtype=stats))
        self.synced = False  # statistics over every process (sync_batch_norm)

    def reset_parameters(self) -> None:
        """Unit gain, zero bias, fresh running statistics (through torch.nn.init, which HF guards while
        it loads: what a checkpoint held stays)."""
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)
        nn.init.zeros_(self.running_mean)
        nn.init.ones_(self.running_var)

    def _apply(self, fn, recurse=True):
        """As nn.Module's (``.half()``, ``.to(dtype)``, ...), except that the running statistics keep
        at least fp32: after NormAttention's core (no denominator) the variance grows with T², past
        fp16's 65504, and ``model.half()`` had made it inf, so the norm gave only its bias."""
        return apply_keeping_full_precision(self, ("running_mean", "running_var"),
                                            lambda: super(MaskedBatchNorm, self)._apply(fn, recurse))

    def _batch_stats(self, flat: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """(mean, biased var, count) over the rows of flat [n, d], pooled over the processes when
        synced: the global mean first, then the squared deviations from it (no E[x²] − E[x]²
        cancellation)."""
        if not (self.synced and torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1):
            n = flat.shape[0]
            return (flat.mean(0), flat.var(0, unbiased=False), n) if n else (None, None, 0)
        from torch.distributed.nn.functional import all_reduce  # differentiable: its backward sums too

        # in fp64: the count is exact past fp32's 2^24 positions, and the sums lose nothing either
        count = flat.new_full((1,), float(flat.shape[0]), dtype=torch.float64)
        total = all_reduce(torch.cat([flat.sum(0, dtype=torch.float64), count]))
        n = int(total[-1].item())
        if n == 0:  # (every rank: each saw the same total)
            return None, None, 0
        mean = (total[:-1] / n).to(flat.dtype)
        var = all_reduce(((flat - mean) ** 2).sum(0)) / n
        return mean, var, n

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        _check_width(self, x)
        xf = _upcast(x)
        if self.training:
            flat = xf.reshape(-1, self.dim)
            if mask is not None:
                if mask.shape != x.shape[:-1]:  # a [T, B] mask had picked other positions silently
                    raise ValueError(f"mask must have the shape of x without its last dim, {tuple(x.shape[:-1])}, "
                                     f"got {tuple(mask.shape)}")
                flat = flat[mask.reshape(-1).bool()]
            mean, var, n = self._batch_stats(flat)
            if n < 2:  # no spread to measure (one position: var 0 would zero the output and pull running_var to 0)
                mean, var = self.running_mean, self.running_var
            else:
                if not recomputing():  # once per step: not again in activation checkpointing's recomputation
                    with torch.no_grad():
                        unbiased = var * n / max(n - 1, 1)
                        # in the statistics' own dtype (fp32, or fp64 for an fp64 model)
                        self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), self.momentum)
                        self.running_var.lerp_(unbiased.detach().to(self.running_var.dtype), self.momentum)
        else:
            mean, var = self.running_mean, self.running_var
        y = (xf - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias
        return y.to(x.dtype)


def sync_batch_norm(model: nn.Module) -> int:
    """Make every :class:`MaskedBatchNorm` in ``model`` pool its training statistics over the
    processes of the default group (SyncBatchNorm's semantics; a no-op in one process). Every
    process must then run the same number of training forwards. Returns how many norms it set."""
    norms = [m for m in model.modules() if isinstance(m, MaskedBatchNorm)]
    for m in norms:
        m.synced = True
    return len(norms)


NORM_TYPES = ("simple_rms", "rms", "layer", "scale", "batch")


def build_norm(name: str, dim: int, *, eps: float | None = None, eps_inside_sqrt: bool = False,
               feeds_autocast: bool = False) -> nn.Module:
    """Build a norm by name: one of :data:`NORM_TYPES`. ``eps_inside_sqrt``: SimpleRMSNorm's choice
    (the other norms ignore it: RMSNorm and LayerNorm keep ε inside their roots).
    ``feeds_autocast``: see :class:`ScaleNorm` (the only norm that uses it so far)."""
    check_bool("eps_inside_sqrt", eps_inside_sqrt)  # (a string "false" had read as True)
    if name == "simple_rms":
        return SimpleRMSNorm(dim, 1e-8 if eps is None else eps, eps_inside_sqrt)
    if name == "rms":
        return RMSNorm(dim, 1e-6 if eps is None else eps)
    if name == "layer":
        _check_eps(1e-5 if eps is None else eps)
        return LayerNorm(dim, eps=1e-5 if eps is None else eps)
    if name == "scale":
        return ScaleNorm(dim, 1e-5 if eps is None else eps, feeds_autocast=feeds_autocast)
    if name == "batch":
        return MaskedBatchNorm(dim, 1e-5 if eps is None else eps)
    raise ValueError(f"norm_type must be one of {NORM_TYPES}, got {name!r}")
