"""Pathfinder / Path-X: clean-room generator (numpy + Pillow) and loader (spec lra.md §2, §4.2).

Geometry conventions (all on the window grid, ``x`` = column, ``y`` = row, pixel ``(x, y)`` has
its centre at integer coordinates):

* A **paddle** is a segment ``(x0, y0) → (x1, y1)`` (tail → head) of length ℓ and thickness τ.
* A **snake** is a chain of paddles grown from a seed paddle. Each paddle has a *pivot* p and an
  orientation ψ such that the paddle is the segment from ``p + μ·u(ψ)`` to ``p + (ℓ + μ)·u(ψ)``
  (seed: pivot = tail − μ·u(ψ)), so consecutive paddles are separated by a gap of about 2μ
  (the dashed look of Pathfinder). The next pivot is ``p' = p + (ℓ + 2μ)·u(ψ)``; candidate heads
  are the pixels on the circle of radius ℓ + μ around p' and the new paddle runs from the chosen
  pixel c back towards p' (tail ``c − ℓ·v``, head ``c``, ``v = (c − p')/|c − p'|``).
* The **occupancy mask** (``bytearray`` of ``R·R``, 1 = occupied) holds the border padding and the
  strokes dilated by the margin μ (Euclidean disc of radius μ); a snake's newest paddle enters it
  only when that snake's next paddle is placed (so consecutive paddles may touch), but it does
  count for the other snakes.
* Labels: 1 iff both markers sit on the two tips of the same target snake.

Randomness: image ``g`` (global index) uses ``numpy.random.PCG64(SeedSequence(seed,
spawn_key=(g,)))``, consumed as float64 uniforms in blocks, so the output does not depend on the
number of worker processes or on the batch size, and a fixed seed reproduces byte-identical PNGs.

Output layout (official): ``<root>/pathfinder<R>/<difficulty>/imgs/<batch>/sample_<i>.png`` and
``<root>/pathfinder<R>/<difficulty>/metadata/<batch>.npy`` (plain text, one line per image:
``imgs/<batch> sample_<i>.png <i> <label> <continuity> <contour_length> <distractor_length>
<paddle_length> <paddle_thickness> <margin> <n_contrasts>``), plus ``generation.json``.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from ..._files import atomic_write_bytes
from ._common import (
    as_dir,
    atomic_write_lines,
    begin_generation,
    check_int,
    check_seed,
    end_generation,
    sha256_file,
    split_name,
)

GENERATOR_VERSION = "v2"  # v2: markers drawn at the marker radius (v1: half a hi-res pixel less)
VOCAB_SIZE = 256
NUM_CLASSES = 2

DIFFICULTIES = {"easy": "curv_baseline", "intermediate": "curv_contour_length_9", "hard": "curv_contour_length_14"}
CONTOUR_LENGTHS = {"curv_baseline": 6, "curv_contour_length_9": 9, "curv_contour_length_14": 14}


@dataclass(frozen=True)
class PathfinderConfig:
    """Generator parameters. Defaults: Pathfinder-32, hard set (spec §4.2, column "Pathfinder-32").

    Lengths are in window pixels. ``*_retries`` are numbers of attempts. ``margins`` and the
    contrast lists are sampled once per image. Paddles are rendered with intensity
    ``paddle_contrast × snake_contrast``, markers with intensity 1.
    """

    resolution: int = 32
    padding: int = 1
    antialias: int = 2
    paddle_length: float = 2.0
    paddle_thickness: float = 0.5
    margins: tuple[int, ...] = (1,)
    contour_length: int = 14
    seed_distance: float = 7.0
    continuity: float = 1.0
    distractor_length: int = 4
    n_distractors: int = 5
    marker_radius: float = 1.5
    snake_contrasts: tuple[float, ...] = (2.0,)
    paddle_contrasts: tuple[float, ...] = (0.75,)
    target_retries: int = 4
    distractor_retries: int = 4
    paddle_retries: int = 2
    difficulty: str = "curv_contour_length_14"
    n_images: int = 200_000
    batch_size: int = 1000
    max_restarts: int = 10_000

    def __post_init__(self) -> None:
        check_int("resolution", self.resolution, minimum=8)
        check_int("padding", self.padding, minimum=0)
        check_int("antialias", self.antialias, minimum=1, maximum=8)
        check_int("contour_length", self.contour_length, minimum=1)
        check_int("distractor_length", self.distractor_length, minimum=1)
        check_int("n_distractors", self.n_distractors, minimum=0)
        for name in ("target_retries", "distractor_retries", "paddle_retries", "batch_size", "max_restarts"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("n_images", self.n_images, minimum=0)
        for name in ("paddle_length", "paddle_thickness", "seed_distance", "continuity", "marker_radius"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        for name in ("margins", "snake_contrasts", "paddle_contrasts"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not v:
                raise TypeError(f"{name} must be a non-empty tuple, got {v!r}")
        for m in self.margins:
            check_int("margins[i]", m, minimum=0)
        for name in ("snake_contrasts", "paddle_contrasts"):  # intensities: a layer of them is scaled by one
            for v in getattr(self, name):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                    raise ValueError(f"{name} must hold positive finite numbers, got {getattr(self, name)!r}")
        if not isinstance(self.difficulty, str) or not self.difficulty or "/" in self.difficulty:
            raise ValueError(
                f"difficulty must be a folder name such as 'curv_contour_length_14', got {self.difficulty!r}"
            )


def pathfinder_config(resolution: int = 32, difficulty: str = "hard", **overrides) -> PathfinderConfig:
    """Preset for a resolution (32, 64, 128; 128 = Path-X) and difficulty (easy/intermediate/hard).

    32 and 128 follow the spec table (O). 64 is **our interpolation** between them [I] (LRA
    lists 64×64 but the spec does not give its parameters): ℓ = 3, τ = 1, μ ∈ {1, 2},
    seed distance 12, κ = 1.4, marker radius 2, 6 distractors of ⌊K/3⌋ paddles.
    Easy/intermediate use K = 6 / 9 with distractor length ⌊K/3⌋ and the distractor count recomputed
    from the same total (⌊20 / length⌋ at 32, ⌊35 / length⌋ at 128) [I].
    """
    check_int("resolution", resolution)
    d = DIFFICULTIES.get(difficulty, difficulty)
    if d not in CONTOUR_LENGTHS:
        raise ValueError(
            f"difficulty must be one of {sorted(DIFFICULTIES)} or {sorted(CONTOUR_LENGTHS)}, got {difficulty!r}"
        )
    k = CONTOUR_LENGTHS[d]
    dl = max(1, k // 3)
    if resolution == 32:
        cfg = PathfinderConfig(difficulty=d, contour_length=k, distractor_length=dl, n_distractors=20 // dl)
    elif resolution == 64:
        cfg = PathfinderConfig(
            resolution=64,
            paddle_length=3.0,
            paddle_thickness=1.0,
            margins=(1, 2),
            contour_length=k,
            seed_distance=12.0,
            continuity=1.4,
            distractor_length=dl,
            n_distractors=max(1, 24 // dl),
            marker_radius=2.0,
            snake_contrasts=(1.0,),
            paddle_contrasts=(1.0,),
            difficulty=d,
        )
    elif resolution == 128:
        cfg = PathfinderConfig(
            resolution=128,
            paddle_length=5.0,
            paddle_thickness=1.5,
            margins=(2, 3),
            contour_length=k,
            seed_distance=20.0,
            continuity=1.8,
            distractor_length=dl,
            n_distractors=35 // dl,
            marker_radius=3.0,
            snake_contrasts=(0.9,),
            paddle_contrasts=(1.0,),
            difficulty=d,
        )
    else:
        raise ValueError(f"resolution must be 32, 64 or 128 for a preset, got {resolution}")
    return replace(cfg, **overrides) if overrides else cfg


# --------------------------------------------------------------------------- geometry


Paddle = tuple[float, float, float, float]
"""(x0, y0, x1, y1): tail → head, window pixel coordinates."""


@dataclass
class Snake:
    """A chain of paddles, first = seed. ``start`` = seed tail, ``end`` = head of the last paddle."""

    paddles: list[Paddle] = field(default_factory=list)

    @property
    def start(self) -> tuple[float, float]:
        return self.paddles[0][0], self.paddles[0][1]

    @property
    def end(self) -> tuple[float, float]:
        return self.paddles[-1][2], self.paddles[-1][3]


@dataclass
class PathfinderGeometry:
    """Pre-render description of one image (what the label is checked against)."""

    label: int
    targets: tuple[Snake, Snake]
    distractors: list[Snake]
    marker_snake: int  # index into targets of the snake carrying the first marker
    markers: tuple[tuple[float, float], tuple[float, float]]
    margin: int
    snake_contrast: float
    paddle_contrast: float
    restarts: int = 0

    @property
    def snakes(self) -> list[Snake]:
        return [*self.targets, *self.distractors]


class _Uniforms:
    """Float64 uniforms from a numpy Generator, drawn in blocks (fast scalar access)."""

    __slots__ = ("_rng", "_buf", "_i")

    def __init__(self, rng: np.random.Generator, block: int = 1024):
        self._rng = rng
        self._buf = rng.random(block).tolist()
        self._i = 0

    def random(self) -> float:
        if self._i >= len(self._buf):
            self._buf = self._rng.random(len(self._buf)).tolist()
            self._i = 0
        u = self._buf[self._i]
        self._i += 1
        return u

    def integer(self, lo: int, hi: int) -> int:
        """Uniform integer in [lo, hi] (inclusive)."""
        return lo + int(self.random() * (hi - lo + 1))

    def choice(self, seq):
        return seq[int(self.random() * len(seq))]


def segment_cells(x0: float, y0: float, x1: float, y1: float) -> list[tuple[int, int]]:
    """Pixels (x, y) whose unit squares centred on integer coordinates the segment passes through.

    Amanatides-Woo traversal from the cell of (x0, y0) to the cell of (x1, y1) (cells of the end
    points as ``floor(v + 0.5)``); a step exactly through a corner moves diagonally.
    """
    floor = math.floor
    X0, Y0, X1, Y1 = x0 + 0.5, y0 + 0.5, x1 + 0.5, y1 + 0.5
    ix, iy, ex, ey = floor(X0), floor(Y0), floor(X1), floor(Y1)
    dx, dy = X1 - X0, Y1 - Y0
    inf = math.inf
    if dx > 0:
        sx, tdx, tmx = 1, 1.0 / dx, (ix + 1 - X0) / dx
    elif dx < 0:
        sx, tdx, tmx = -1, -1.0 / dx, (X0 - ix) / -dx
    else:
        sx, tdx, tmx = 0, inf, inf
    if dy > 0:
        sy, tdy, tmy = 1, 1.0 / dy, (iy + 1 - Y0) / dy
    elif dy < 0:
        sy, tdy, tmy = -1, -1.0 / dy, (Y0 - iy) / -dy
    else:
        sy, tdy, tmy = 0, inf, inf
    out = [(ix, iy)]
    for _ in range(abs(ex - ix) + abs(ey - iy)):
        if ix == ex and iy == ey:
            break
        if tmx < tmy:
            ix += sx
            tmx += tdx
        elif tmy < tmx:
            iy += sy
            tmy += tdy
        else:
            ix += sx
            iy += sy
            tmx += tdx
            tmy += tdy
        out.append((ix, iy))
    return out


def _rint(v: float) -> int:
    return math.floor(v + 0.5)


@functools.lru_cache(maxsize=16)
def _dilation_table(W: int, r: int) -> tuple[tuple[int, ...], ...]:
    """For each flat pixel index of a W×W canvas, the in-canvas pixels within distance r."""
    offs = [(dx, dy) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if dx * dx + dy * dy <= r * r]
    return tuple(
        tuple((y + dy) * W + (x + dx) for dx, dy in offs if 0 <= x + dx < W and 0 <= y + dy < W)
        for y in range(W)
        for x in range(W)
    )


class _Grower:
    """Occupancy mask and paddle placement for one image."""

    def __init__(self, cfg: PathfinderConfig, margin: int, u: _Uniforms):
        self.cfg = cfg
        self.u = u
        self.W = W = cfg.resolution
        self.margin = margin
        self.ell = float(cfg.paddle_length)
        pad = cfg.padding
        border = bytearray(W * W)
        for y in range(W):
            for x in range(W):
                if x < pad or y < pad or x >= W - pad or y >= W - pad:
                    border[y * W + x] = 1
        self._border = bytes(border)
        self.mask = border
        r = margin
        self.dilation = _dilation_table(W, r)
        radius = self.ell + margin
        n = max(8, round(2 * math.pi * radius))
        self.arc = 2 * math.pi / n
        self.circle = [(radius * math.cos(j * self.arc), radius * math.sin(j * self.arc)) for j in range(n)]
        self.step = self.ell + 2 * margin
        self.kappa = float(cfg.continuity)
        # Rounding a circle point moves it by <= sqrt(2)/2 px, i.e. its direction by <= asin(0.71 / radius):
        # circle points further than this from the zero-weight cone are skipped (pure speed-up, same result).
        self.cone = math.pi / (2 * self.kappa) + math.asin(min(1.0, 0.71 / radius)) + 1e-6

    def reset(self) -> None:
        """Back to an empty canvas (border padding only)."""
        self.mask[:] = self._border

    # -- pixels
    def footprint(self, p: Paddle) -> list[int] | None:
        """Flat indices of every pixel whose square ``[x ± 0.5] × [y ± 0.5]`` the paddle's centre
        line crosses (exact grid traversal); None if any of them is off-canvas."""
        cells = segment_cells(*p)
        W = self.W
        out = []
        for x, y in cells:
            if x < 0 or y < 0 or x >= W or y >= W:
                return None
            out.append(y * W + x)
        return out

    def dilate(self, fp: list[int]) -> set[int]:
        """Pixels within Euclidean distance ``margin`` of the footprint (flat indices)."""
        tab = self.dilation
        out: set[int] = set()
        for idx in fp:
            out.update(tab[idx])
        return out

    def dilation_inside(self, fp: list[int]) -> bool:
        W, m = self.W, self.margin
        for idx in fp:
            y, x = divmod(idx, W)
            if x < m or y < m or x >= W - m or y >= W - m:
                return False
        return True

    def free(self, fp: list[int], blocked: set[int]) -> bool:
        mask = self.mask
        return not any(mask[i] or i in blocked for i in fp)

    def commit(self, pixels) -> None:
        mask = self.mask
        for i in pixels:
            mask[i] = 1

    # -- snakes
    def seed(self, tx: int, ty: int, psi: float, blocked: set[int]) -> tuple[Paddle, list[int]] | None:
        c, s = math.cos(psi), math.sin(psi)
        p = (float(tx), float(ty), tx + self.ell * c, ty + self.ell * s)
        fp = self.footprint(p)
        if fp is None or not self.dilation_inside(fp) or not self.free(fp, blocked):
            return None
        return p, fp

    def grow(self, state: list, blocked: set[int]) -> bool:
        """One growth step. ``state`` = [snake, pivot_x, pivot_y, psi, pending_pixels]."""
        snake, px, py, psi, pending = state
        qx = px + self.step * math.cos(psi)
        qy = py + self.step * math.sin(psi)
        W, mask, kappa = self.W, self.mask, self.kappa
        seen = set()
        cands = []
        weights = []
        cone = self.cone
        two_pi, pi, half_pi = 2 * math.pi, math.pi, math.pi / 2
        floor, atan2, cos = math.floor, math.atan2, math.cos
        circle, n_circ = self.circle, len(self.circle)
        j_lo = math.ceil((psi - cone) / self.arc)
        j_hi = min(math.floor((psi + cone) / self.arc), j_lo + n_circ - 1)
        for j in range(j_lo, j_hi + 1):  # circle points by angle from ψ − cone to ψ + cone
            ox, oy = circle[j % n_circ]
            cx, cy = floor(qx + ox + 0.5), floor(qy + oy + 0.5)
            if cx < 0 or cy < 0 or cx >= W or cy >= W:
                continue
            idx = cy * W + cx
            if idx in seen:
                continue
            seen.add(idx)
            if mask[idx] or idx in blocked:
                continue  # weight 0
            phi = atan2(cy - qy, cx - qx)
            a = kappa * abs((phi - psi + pi) % two_pi - pi)
            if a < half_pi:  # w = max(cos(min(a, π/2)), 0)² is 0 from π/2 on
                w = cos(a)
                cands.append((cx, cy, phi))
                weights.append(w * w)
        for _ in range(self.cfg.paddle_retries):
            total = sum(weights)
            if total < 1e-4:
                return False
            r = self.u.random() * total
            j = 0
            acc = weights[0]
            while acc <= r and j < len(weights) - 1:
                j += 1
                acc += weights[j]
            cx, cy, phi = cands[j]
            dist = math.hypot(cx - qx, cy - qy)
            vx, vy = (cx - qx) / dist, (cy - qy) / dist
            p = (cx - self.ell * vx, cy - self.ell * vy, float(cx), float(cy))
            fp = self.footprint(p)
            if fp is None or not self.free(fp, blocked):
                weights[j] = 0.0
                continue
            self.commit(pending)
            snake.paddles.append(p)
            state[1], state[2], state[3], state[4] = qx, qy, phi, self.dilate(fp)
            return True
        return False

    def random_free_pixel(self, lo: int, hi: int, blocked: set[int]) -> tuple[int, int] | None:
        """Uniform free pixel with lo <= x, y <= hi (rejection sampling, then exhaustive)."""
        W, mask = self.W, self.mask
        if hi < lo:
            return None
        for _ in range(64):
            x, y = self.u.integer(lo, hi), self.u.integer(lo, hi)
            if not mask[y * W + x] and y * W + x not in blocked:
                return x, y
        free = [
            (x, y)
            for y in range(lo, hi + 1)
            for x in range(lo, hi + 1)
            if not mask[y * W + x] and y * W + x not in blocked
        ]
        return self.u.choice(free) if free else None

    def free_fraction(self) -> float:
        return 1.0 - self.mask.count(1) / len(self.mask)


def _random_angle(u: _Uniforms) -> float:
    return math.radians(u.integer(-180, 179))


def _make_targets(g: _Grower) -> tuple[Snake, Snake] | None:
    cfg, u = g.cfg, g.u
    lo = math.ceil(2 * cfg.seed_distance)
    hi = g.W - 1 - lo
    base = bytes(g.mask)
    for _ in range(cfg.target_retries):
        g.mask[:] = base
        # seed 1
        t1 = g.random_free_pixel(lo, hi, set())
        if t1 is None:
            return None
        psi1 = _random_angle(u)
        s1 = g.seed(t1[0], t1[1], psi1, set())
        if s1 is None:
            continue
        pend1 = g.dilate(s1[1])
        # seed 2: at seed distance from seed 1's tail
        s2 = None
        for _ in range(cfg.target_retries):
            th = _random_angle(u)
            tx = _rint(t1[0] + cfg.seed_distance * math.cos(th))
            ty = _rint(t1[1] + cfg.seed_distance * math.sin(th))
            psi2 = _random_angle(u)
            if not (0 <= tx < g.W and 0 <= ty < g.W) or g.mask[ty * g.W + tx] or ty * g.W + tx in pend1:
                continue
            s2 = g.seed(tx, ty, psi2, pend1)
            if s2 is not None:
                break
        if s2 is None:
            continue
        m = g.margin
        a = [Snake([s1[0]]), t1[0] - m * math.cos(psi1), t1[1] - m * math.sin(psi1), psi1, pend1]
        b = [Snake([s2[0]]), tx - m * math.cos(psi2), ty - m * math.sin(psi2), psi2, g.dilate(s2[1])]
        ok = True
        for _ in range(cfg.contour_length - 1):
            if not g.grow(a, b[4]) or not g.grow(b, a[4]):
                ok = False
                break
        if ok:
            g.commit(a[4])
            g.commit(b[4])
            return a[0], b[0]
    return None


def _make_distractor(g: _Grower) -> Snake | None:
    cfg, u = g.cfg, g.u
    base = bytes(g.mask)
    for _ in range(cfg.distractor_retries):
        g.mask[:] = base
        t = g.random_free_pixel(0, g.W - 1, set())
        if t is None:
            return None
        psi = _random_angle(u)
        s = g.seed(t[0], t[1], psi, set())
        if s is None:
            continue
        m = g.margin
        st = [Snake([s[0]]), t[0] - m * math.cos(psi), t[1] - m * math.sin(psi), psi, g.dilate(s[1])]
        if all(g.grow(st, set()) for _ in range(cfg.distractor_length - 1)):
            g.commit(st[4])
            return st[0]
    g.mask[:] = base
    return None


def image_rng(seed: int, index: int) -> np.random.Generator:
    """The numpy Generator of image ``index`` (global position) for ``seed``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(index,))))


def sample_geometry(cfg: PathfinderConfig, rng: np.random.Generator) -> PathfinderGeometry:
    """Sample label and geometry of one image (spec §4.2 steps 1-5)."""
    u = _Uniforms(rng)
    label = 1 if u.random() < 0.5 else 0
    margin = u.choice(cfg.margins)
    snake_contrast = float(u.choice(cfg.snake_contrasts))
    paddle_contrast = float(u.choice(cfg.paddle_contrasts))
    g = _Grower(cfg, margin, u)
    for restart in range(cfg.max_restarts):
        g.reset()
        targets = _make_targets(g)
        if targets is None:
            continue
        distractors = []
        for _ in range(cfg.n_distractors):
            if g.free_fraction() < 0.01:
                break
            d = _make_distractor(g)
            if d is not None:
                distractors.append(d)
        s = u.integer(0, 1)
        first = targets[s].start
        second = targets[s].end if label == 1 else targets[1 - s].end
        return PathfinderGeometry(
            label, targets, distractors, s, (first, second), margin, snake_contrast, paddle_contrast, restart
        )
    raise RuntimeError(
        f"could not place the two target snakes in {cfg.max_restarts} restarts "
        f"(resolution={cfg.resolution}, contour_length={cfg.contour_length}, seed_distance={cfg.seed_distance}); "
        "the parameters leave too little room"
    )


# --------------------------------------------------------------------------- rendering


def _capsules(canvas: np.ndarray, segs: np.ndarray, half: float) -> None:
    """Max-stamp antialiased capsules onto a float32 canvas ``[H, W]`` (hi-res pixels).

    ``segs``: ``float64[n, 4]`` rows ``(x0, y0, x1, y1)``; coverage of a pixel centre at distance
    ``d`` from the segment is ``clip(half + 0.5 − d, 0, 1)``.
    """
    if len(segs) == 0:
        return
    H, W = canvas.shape
    x0, y0, x1, y1 = (segs[:, k : k + 1, None] for k in range(4))
    pad = half + 1.0
    ext = float(np.max(np.maximum(np.abs(segs[:, 2] - segs[:, 0]), np.abs(segs[:, 3] - segs[:, 1]))))
    B = int(math.ceil(ext + 2 * pad)) + 2
    ox = np.floor(np.minimum(segs[:, 0], segs[:, 2]) - pad).astype(np.int64)
    oy = np.floor(np.minimum(segs[:, 1], segs[:, 3]) - pad).astype(np.int64)
    r = np.arange(B, dtype=np.float64)
    xs = (ox[:, None] + r[None, :])[:, None, :]  # [n, 1, B]
    ys = (oy[:, None] + r[None, :])[:, :, None]  # [n, B, 1]
    dx, dy = x1 - x0, y1 - y0
    ll = dx * dx + dy * dy
    t = np.clip(((xs - x0) * dx + (ys - y0) * dy) / np.where(ll > 0, ll, 1.0), 0.0, 1.0)
    dist = np.hypot(xs - (x0 + t * dx), ys - (y0 + t * dy))
    cov = np.clip(half + 0.5 - dist, 0.0, 1.0).astype(np.float32)  # [n, B, B]
    big = np.zeros((H + 2 * B, W + 2 * B), np.float32)
    for k in range(len(segs)):
        a, b = int(oy[k]) + B, int(ox[k]) + B
        if a < 0 or b < 0 or a + B > H + 2 * B or b + B > W + 2 * B:
            continue  # entirely off-canvas
        region = big[a : a + B, b : b + B]
        np.maximum(region, cov[k], out=region)
    np.maximum(canvas, big[B : B + H, B : B + W], out=canvas)


def render(geom: PathfinderGeometry, cfg: PathfinderConfig) -> np.ndarray:
    """Rasterise a geometry → ``uint8[R, R]`` (spec §4.2 step 6).

    Each layer (paddles; markers) is rasterised with antialiased coverage at ``antialias×``
    resolution, Lanczos-downsampled to the window, clipped at 0 and scaled by its intensity; layers
    are combined by pixel-wise maximum (paddles never overlap each other, so a layer equals the
    maximum of its strokes), then min-max scaled to 0-255 and rounded.
    """
    from PIL import Image

    R, a = cfg.resolution, cfg.antialias
    hr = R * a
    off = (a - 1) / 2.0  # window pixel centre x → hi-res pixel centre a·x + (a−1)/2

    def down(layer: np.ndarray) -> np.ndarray:
        if a == 1:
            return layer
        img = Image.fromarray(layer).resize((R, R), Image.Resampling.LANCZOS)
        return np.clip(np.asarray(img, dtype=np.float32), 0.0, None)

    segs = np.array([p for s in geom.snakes for p in s.paddles], dtype=np.float64).reshape(-1, 4) * a + off
    strokes = np.zeros((hr, hr), np.float32)
    _capsules(strokes, segs, cfg.paddle_thickness * a / 2.0)
    centres = np.array(geom.markers, dtype=np.float64) * a + off
    markers = np.zeros((hr, hr), np.float32)
    # a disc of the marker radius (coverage falls from 1 to 0 across r ± 0.5): r − 0.5 had drawn
    # 70% of its area (effective radius 1.26 of 1.5 at 32 px)
    _capsules(markers, np.concatenate([centres, centres], axis=1), cfg.marker_radius * a)
    img = np.maximum(down(strokes) * (geom.paddle_contrast * geom.snake_contrast), down(markers))
    lo, hi = float(img.min()), float(img.max())
    if hi - lo <= 0:
        return np.zeros((R, R), np.uint8)
    return np.rint((img - lo) * (255.0 / (hi - lo))).astype(np.uint8)


def generate_image(cfg: PathfinderConfig, seed: int, index: int) -> tuple[np.ndarray, PathfinderGeometry]:
    """Image ``index`` of the set for ``seed``: (``uint8[R, R]``, geometry)."""
    geom = sample_geometry(cfg, image_rng(seed, index))
    return render(geom, cfg), geom


def png_bytes(img: np.ndarray) -> bytes:
    """Encode a ``uint8[H, W]`` array as an 8-bit greyscale PNG (deterministic bytes)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(img, dtype=np.uint8)).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


# --------------------------------------------------------------------------- writing


def _fmt(v) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _metadata_line(cfg: PathfinderConfig, batch: int, i: int, geom: PathfinderGeometry) -> str:
    return " ".join(
        [
            f"imgs/{batch}",
            f"sample_{i}.png",
            str(i),
            str(geom.label),
            _fmt(cfg.continuity),
            str(cfg.contour_length),
            str(cfg.distractor_length),
            _fmt(cfg.paddle_length),
            _fmt(cfg.paddle_thickness),
            str(geom.margin),
            str(len(cfg.snake_contrasts)),
        ]
    )


def _write_batch(args: tuple[str, PathfinderConfig, int, int, int]) -> dict:
    """Generate and write one batch; returns its label counts, restart count and file digests."""
    dest, cfg, seed, batch, count = args
    base = Path(dest)
    img_dir = base / "imgs" / str(batch)
    img_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    labels = [0, 0]
    restarts = 0
    digest = hashlib.sha256()
    for i in range(count):
        g = batch * cfg.batch_size + i
        img, geom = generate_image(cfg, seed, g)
        data = png_bytes(img)
        atomic_write_bytes(img_dir / f"sample_{i}.png", data)
        digest.update(hashlib.sha256(data).digest())
        lines.append(_metadata_line(cfg, batch, i, geom))
        labels[geom.label] += 1
        restarts += geom.restarts
    meta_path = base / "metadata" / f"{batch}.npy"
    atomic_write_lines(meta_path, lines)
    return {
        "batch": batch,
        "labels": labels,
        "restarts": restarts,
        "png_sha256": digest.hexdigest(),
        "metadata_sha256": sha256_file(meta_path),
    }


def dataset_dir(root: str | os.PathLike, cfg: PathfinderConfig) -> Path:
    """``<root>/pathfinder<R>/<difficulty>``."""
    return Path(root) / f"pathfinder{cfg.resolution}" / cfg.difficulty


# What may differ from a preset without changing the images' distribution: counts and batching.
_COUNT_FIELDS = ("n_images", "batch_size", "max_restarts")


def official_parameters(cfg: PathfinderConfig | dict) -> bool:
    """Whether ``cfg`` (or a sidecar's ``config`` dict) draws from the official generator's
    distribution: the spec's Pathfinder-32 or Path-X preset of its difficulty, counts aside. The
    64-pixel preset is our interpolation, so it is not."""
    if isinstance(cfg, dict):
        cfg = PathfinderConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})
    if cfg.resolution not in (32, 128) or cfg.difficulty not in CONTOUR_LENGTHS:
        return False
    ref = pathfinder_config(cfg.resolution, cfg.difficulty)
    return all(getattr(cfg, f.name) == getattr(ref, f.name) for f in fields(PathfinderConfig)
               if f.name not in _COUNT_FIELDS)


def pathfinder_dataset_id(seed: int, cfg: PathfinderConfig) -> str:
    """e.g. ``pathfinder32-hard-regen(gen=v2, seed=0)``; Path-X is ``pathx128-…``; other
    parameters than the official ones (:func:`official_parameters`) make it ``…-fixture(…)``."""
    level = {v: k for k, v in DIFFICULTIES.items()}.get(cfg.difficulty, cfg.difficulty)
    name = "pathx128" if cfg.resolution == 128 else f"pathfinder{cfg.resolution}"
    extra = "" if cfg.n_images == 200_000 else f", n={cfg.n_images}"
    kind = "regen" if official_parameters(cfg) else "fixture"
    return f"{name}-{level}-{kind}(gen={GENERATOR_VERSION}, seed={seed}{extra})"


def write_pathfinder(
    out_root: str | os.PathLike, *, seed: int, config: PathfinderConfig | None = None, workers: int = 1
) -> dict:
    """Generate ``config.n_images`` images into the official layout under ``out_root``.

    Batches of ``config.batch_size`` images go to ``imgs/<batch>/sample_<i>.png`` with
    ``metadata/<batch>.npy``; every file is written atomically. ``workers > 1`` uses a process pool
    over batches (same bytes as ``workers=1``). Writes and returns the ``generation.json`` dict.
    """
    cfg = config if config is not None else PathfinderConfig()
    if not isinstance(cfg, PathfinderConfig):
        raise TypeError(f"config must be a PathfinderConfig, got {type(cfg).__name__}")
    if not isinstance(out_root, (str, os.PathLike)):
        raise TypeError(f"out_root must be a str or os.PathLike path, got {type(out_root).__name__}")
    seed = check_seed(seed)
    workers = check_int("workers", workers, minimum=1)
    dest = dataset_dir(out_root, cfg)
    begin_generation(dest, (dest / "imgs").exists() or (dest / "metadata").exists(), f"Pathfinder{cfg.resolution}")
    n_batches = math.ceil(cfg.n_images / cfg.batch_size)
    tasks = [
        (str(dest), cfg, seed, b, min(cfg.batch_size, cfg.n_images - b * cfg.batch_size)) for b in range(n_batches)
    ]
    if workers > 1 and len(tasks) > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(min(workers, len(tasks))) as pool:
            results = list(pool.imap(_write_batch, tasks))
    else:
        results = [_write_batch(t) for t in tasks]
    _remove_stale_batches(dest, n_batches)
    labels = [sum(r["labels"][k] for r in results) for k in (0, 1)]
    meta = {
        "task": f"pathfinder{cfg.resolution}",
        "generator": "transnormer.data.lra.pathfinder",
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "config": asdict(cfg),
        "n_images": cfg.n_images,
        "n_batches": n_batches,
        "label_counts": labels,
        "restarts": sum(r["restarts"] for r in results),
        "sha256": {
            "metadata": {f"metadata/{r['batch']}.npy": r["metadata_sha256"] for r in results},
            "png_batches": {f"imgs/{r['batch']}": r["png_sha256"] for r in results},
        },
        "sha256_rule": "png_batches: sha256 over the concatenated sha256 digests of the batch's PNGs in index order",
        "dataset_id": pathfinder_dataset_id(seed, cfg),
        "official_parameters": official_parameters(cfg),
    }
    end_generation(dest, meta)
    return meta


def _remove_stale_batches(dest: Path, n_batches: int) -> None:
    """Delete the batches an earlier, larger generation left in ``dest``: the loader reads every
    metadata file there, and they would mix into this generation's splits."""
    import shutil

    keep = {str(b) for b in range(n_batches)}
    for p in (dest / "metadata").glob("*.npy"):
        if p.stem not in keep:
            p.unlink()
    imgs = dest / "imgs"
    for d in imgs.iterdir() if imgs.is_dir() else ():
        if d.is_dir() and d.name not in keep:
            shutil.rmtree(d)


# --------------------------------------------------------------------------- loading


def find_pathfinder_dir(
    root: str | os.PathLike, resolution: int = 32, difficulty: str = "curv_contour_length_14"
) -> Path:
    """Resolve the difficulty folder: ``root`` itself (if it has ``metadata/``) or
    ``root/pathfinder<R>/<difficulty>`` (official layout)."""
    root = as_dir("root", root)
    difficulty = DIFFICULTIES.get(difficulty, difficulty)
    if (root / "metadata").is_dir():
        return root
    cand = root / f"pathfinder{resolution}" / difficulty
    if (cand / "metadata").is_dir():
        return cand
    raise FileNotFoundError(f"no Pathfinder metadata folder at {root / 'metadata'} or {cand / 'metadata'}")


def read_metadata(base: str | os.PathLike) -> tuple[list[Path], np.ndarray, int]:
    """Read all ``metadata/<batch>.npy`` text files (batches in numeric order).

    Returns (image paths, labels ``int64[N]``, number of zero-length PNGs skipped). Raises
    ``ValueError`` naming file and line for malformed lines and ``FileNotFoundError`` for a listed
    image that does not exist.
    """
    base = Path(base)
    meta_dir = base / "metadata"
    files = [p for p in meta_dir.iterdir() if p.suffix == ".npy" and not p.name.startswith(".")]

    def key(p: Path):
        return (0, int(p.stem), "") if p.stem.isdigit() else (1, 0, p.stem)

    paths: list[Path] = []
    labels: list[int] = []
    skipped = 0
    for mf in sorted(files, key=key):
        with open(mf, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                parts = line.split()
                if not parts:
                    continue
                if len(parts) < 4:
                    raise ValueError(f"{mf}:{lineno}: expected at least 4 space-separated fields, got {len(parts)}")
                if parts[3] not in ("0", "1"):
                    raise ValueError(f"{mf}:{lineno}: label (field 3) must be 0 or 1, got {parts[3]!r}")
                img = base / parts[0] / parts[1]
                try:
                    size = img.stat().st_size
                except FileNotFoundError:
                    raise FileNotFoundError(f"{mf}:{lineno}: image not found: {img}") from None
                if size == 0:
                    skipped += 1
                    continue
                paths.append(img)
                labels.append(int(parts[3]))
    if not paths:
        raise ValueError(f"{meta_dir}: no images listed")
    return paths, np.asarray(labels, dtype=np.int64), skipped


def split_indices(n: int, split: str, *, mode: str = "position", seed: int = 42) -> np.ndarray:
    """Indices of an 80/10/10 split of ``n`` items: ``mode="position"`` (official order) or
    ``"random"`` (a ``torch.randperm`` with ``seed``, the S4-style random split)."""
    split = split_name(split)
    n_train, n_val = int(n * 0.8), int(n * 0.1)
    if mode == "position":
        order = np.arange(n)
    elif mode == "random":
        import torch

        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    else:
        raise ValueError(f"split_mode must be 'position' or 'random', got {mode!r}")
    a, b = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, n)}[split]
    if a == b:  # (a set of under 10 images: its evaluation had been NaN over nothing)
        raise ValueError(f"the {split} split of {n} images is empty (80/10/10): the set needs at least 10 images")
    return order[a:b]


class PathfinderImages:
    """Lazy sequence of flattened images: item ``i`` → ``int64[R·R]`` (row-major intensities)."""

    def __init__(self, paths: list[Path], resolution: int, preload: bool = False):
        self.paths = paths
        self.resolution = resolution
        self._cache: np.ndarray | None = None
        if preload:
            self._cache = np.stack([self._read(i) for i in range(len(paths))]).astype(np.uint8)

    def __len__(self) -> int:
        return len(self.paths)

    def _read(self, i: int) -> np.ndarray:
        from PIL import Image

        p = self.paths[i]
        try:
            with Image.open(p) as im:
                im.load()
                if im.size != (self.resolution, self.resolution):
                    raise ValueError(
                        f"{p}: expected a {self.resolution}x{self.resolution} image, got {im.size[0]}x{im.size[1]}"
                    )
                arr = np.asarray(im.convert("L"), dtype=np.uint8)
        except OSError as e:
            raise ValueError(f"{p}: cannot decode PNG ({e})") from e
        return arr.reshape(-1)

    def __getitem__(self, i: int) -> np.ndarray:
        if self._cache is not None:
            return self._cache[i].astype(np.int64)
        return self._read(i).astype(np.int64)


def load_pathfinder_split(
    root: str | os.PathLike,
    split: str,
    *,
    resolution: int = 32,
    difficulty: str = "curv_contour_length_14",
    split_mode: str = "position",
    split_seed: int = 42,
    preload: bool = False,
) -> tuple[PathfinderImages, np.ndarray, dict]:
    """(images, labels ``int64[N]``, info) for one split of a Pathfinder set in the official layout.

    Zero-length PNGs (a known quirk of the official set) are skipped before splitting.
    """
    check_int("resolution", resolution, minimum=1)
    base = find_pathfinder_dir(root, resolution, difficulty)
    paths, labels, skipped = read_metadata(base)
    idx = split_indices(len(paths), split, mode=split_mode, seed=split_seed)
    images = PathfinderImages([paths[i] for i in idx], resolution, preload=preload)
    info = {"dir": str(base), "skipped_empty": skipped, "n_total": len(paths), "split_mode": split_mode}
    return images, labels[idx], info
