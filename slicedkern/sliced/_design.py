"""QMC slicing designs: antipodal point sets of low energy on the sphere, built once per (P, d).

The un-rotated design of ``P`` directions in R^d is deterministic (a fixed internal seed); the
public :func:`slicedkern.directions` rotates it by a Haar-random orthogonal matrix drawn from the
caller's seed, which makes every direction uniform on the sphere and so every sliced estimate
unbiased (docs/directions.rst, "Choosing directions"; the idea is the "QMC slicing" of Hertrich,
Jahn and Quellmalz, "Fast summation of radial kernels via QMC slicing", ICLR 2025, arXiv:2410.01316).

Construction (docs/directions.rst, "How the designs are built"): ``h = ceil(P / 2)`` unit vectors
``u_i`` such that the antipodal set ``{+u_i, -u_i}`` has a low *distance energy*
``-sum |a - b|`` (pairs of distinct points of the set), i.e. a large sum of distances, found by
projected Adam descent on the sphere from stacked random frames. Rows are interleaved
``u_1, -u_1, u_2, -u_2, ...`` and truncated to ``P`` (for odd ``P`` the last ``-u_h`` is dropped).
Sizes whose descent costs more than a few hundred milliseconds are read from package data
(``designs.npz``, written by ``scripts/directions_bench.py --write-designs``).
"""

from __future__ import annotations

import functools
import os

import numpy as np

__all__ = ["unrotated_design", "build_half_design", "MAX_BLOCK", "SHIPPED_SLICES", "SHIPPED_DIMS"]

#: Seed of the start of the descent: a constant, so that one (P, d) always gives one design.
_DESIGN_SEED = 28_2410_01316
#: Adam steps and step-size scale of the on-the-fly descent (docs/directions.rst, "How the designs
#: are built"); the shipped designs ran 1500 steps (scripts/directions_bench.py --write-designs).
_STEPS = 300
_LEARNING_RATE = 0.5
#: Sizes shipped in ``designs.npz`` (float32 up to d = 20, float16 above): P = 256, 512, 1024 and the
#: dimensions below; other sizes are built on first use (and cached, see ``unrotated_design``).
SHIPPED_SLICES = (256, 512, 1024)
SHIPPED_DIMS = (3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 32, 50, 64, 100)

_DATA = os.path.join(os.path.dirname(__file__), "designs.npz")


def _start(n_half: int, dim: int) -> np.ndarray:
    """Stacked random orthonormal frames (fixed seed): already well spread, a good start."""
    rng = np.random.default_rng(_DESIGN_SEED + 1009 * dim + n_half)
    frames = []
    for _ in range(-(-n_half // dim)):
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        frames.append((q * np.where(np.diag(r) < 0, -1.0, 1.0)).T)
    return np.concatenate(frames, axis=0)[:n_half]


def build_half_design(n_half: int, dim: int, *, steps: int = _STEPS) -> np.ndarray:
    """``n_half`` unit vectors ``u`` of R^d whose antipodal set ``{+-u}`` has a large distance sum.

    Returns a float64 array of shape (n_half, dim). Closed forms where the optimum is known:
    ``d = 1`` (all ``+1``), ``d = 2`` (``2 n_half`` equally spaced angles), ``n_half <= d`` (an
    orthonormal set: the cross-polytope). Otherwise ``steps`` of projected Adam on
    ``E = -sum_{i != j} (|u_i - u_j| + |u_i + u_j|)`` written with the Gram matrix ``G = U U^T``
    (``|u_i -+ u_j|^2 = 2 -+ 2 G_ij``), so one step is two ``(n_half, n_half, d)`` products.
    """
    if dim == 1:
        return np.ones((n_half, 1))
    if dim == 2:
        angle = np.pi * np.arange(n_half) / n_half
        return np.stack([np.cos(angle), np.sin(angle)], axis=1)
    if n_half <= dim:
        return np.eye(n_half, dim)
    u = _start(n_half, dim)
    m, v = np.zeros_like(u), np.zeros_like(u)
    beta1, beta2 = 0.9, 0.999
    # a step of the order of the spacing of n_half points on S^{d-1}, decaying linearly to 0
    rate = _LEARNING_RATE * (2.0 / n_half) ** (1.0 / (dim - 1))
    diagonal = np.arange(n_half)
    for t in range(1, steps + 1):
        # dE/dG_ij = (2 - 2G)^(-1/2) - (2 + 2G)^(-1/2), up to a constant factor that Adam ignores;
        # written in place: this loop is the whole cost of a design
        g = u @ u.T
        np.clip(g, -1.0 + 1e-12, 1.0 - 1e-12, out=g)
        g *= 2.0
        w = 2.0 - g
        np.sqrt(w, out=w)
        np.reciprocal(w, out=w)
        g += 2.0
        np.sqrt(g, out=g)
        np.reciprocal(g, out=g)
        w -= g
        w[diagonal, diagonal] = 0.0
        grad = w @ u
        grad -= np.sum(grad * u, axis=1, keepdims=True) * u         # tangent to the sphere
        m *= beta1
        m += (1.0 - beta1) * grad
        v *= beta2
        v += (1.0 - beta2) * grad * grad
        step = rate * (1.0 - t / (steps + 1)) * np.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)
        u -= step * m / (np.sqrt(v) + 1e-300)
        u /= np.linalg.norm(u, axis=1, keepdims=True)
    return u


@functools.lru_cache(maxsize=1)
def _shipped() -> dict[str, np.ndarray]:
    """The half designs of ``designs.npz``, keyed ``"P{P}_d{d}"`` (empty when the file is absent)."""
    try:
        with np.load(_DATA) as data:
            return {key: data[key] for key in data.files}
    except FileNotFoundError:
        return {}


#: Largest design built as one point set: the descent costs O(P^2 d) memory and time a step, so a
#: larger P is made of blocks of this size (docs/directions.rst, "Cost, cache and shipped designs").
MAX_BLOCK = 1024


def _one_design(n_slices: int, dim: int) -> np.ndarray:
    """One point set of ``n_slices <= MAX_BLOCK`` rows ``u_1, -u_1, ...`` (shipped or descended)."""
    n_half = -(-n_slices // 2)
    half = _shipped().get(f"P{2 * n_half}_d{dim}")
    if half is None:
        half = build_half_design(n_half, dim)
    half = np.asarray(half, dtype=np.float64)
    half = half / np.linalg.norm(half, axis=1, keepdims=True)   # float32 storage: exact unit norms again
    full = np.empty((2 * n_half, dim))
    full[0::2], full[1::2] = half, -half
    return full[:n_slices]


def _block_rotation(block: int, dim: int) -> np.ndarray:
    """A fixed Haar-random rotation per block after the first (fixed seed: part of the design)."""
    rng = np.random.default_rng((_DESIGN_SEED, dim, block))
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


@functools.lru_cache(maxsize=32)
def _cached_design(n_slices: int, dim: int) -> np.ndarray:
    if n_slices <= MAX_BLOCK:
        full = _one_design(n_slices, dim)
    else:
        # blocks of MAX_BLOCK rows and one of the rest, each a design of its size under a fixed
        # rotation: bounded cost for any P, and antipodal pairs within every block
        blocks, rest = divmod(n_slices, MAX_BLOCK)
        sizes = [MAX_BLOCK] * blocks + ([rest] if rest else [])
        full = np.concatenate([_one_design(size, dim) if b == 0 else _one_design(size, dim) @ _block_rotation(b, dim)
                               for b, size in enumerate(sizes)])
    full.setflags(write=False)          # shared by every caller through the cache
    return full


def unrotated_design(n_slices: int, dim: int) -> np.ndarray:
    """The un-rotated design of ``n_slices`` directions in R^d, float64, read-only, shape (P, d).

    Rows ``u_1, -u_1, u_2, -u_2, ...`` of :func:`build_half_design` (or the shipped set), truncated
    to ``P``. Beyond ``MAX_BLOCK`` rows: consecutive blocks of ``MAX_BLOCK`` rows (the last one
    shorter), each such a design under a fixed rotation. The last 32 sizes used are kept in memory.
    """
    return _cached_design(int(n_slices), int(dim))
