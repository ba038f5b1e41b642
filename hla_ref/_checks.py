"""Input validation shared by every public function.

Each check raises a ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value)
whose message starts with the argument's name, so a caller sees at once what to fix.
Nothing is silently truncated, broadcast or cast from a non-float type.
"""

from __future__ import annotations

import numbers

import numpy as np

_FLOATS = (np.float32, np.float64)


def as_matrix(x, name: str) -> np.ndarray:
    """Return ``x`` as a 2-D float32/float64 array, or raise naming ``name``."""
    arr = np.asarray(x)
    if arr.dtype.type not in _FLOATS:
        raise TypeError(
            f"{name} must be a float32 or float64 array, got dtype {arr.dtype}"
        )
    if arr.ndim != 2:
        raise ValueError(
            f"{name} must have shape (n, features) with ndim 2, got shape {arr.shape}"
        )
    if arr.shape[1] < 1:
        raise ValueError(f"{name} must have at least one feature column, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return arr


def check_qk(Q, K):
    """Validate ``Q, K: (n, d)``; both come back in one dtype (float32 only if both are)."""
    Q, K = as_matrix(Q, "Q"), as_matrix(K, "K")
    if K.shape != Q.shape:
        raise ValueError(
            f"K must have the same shape (n, d) as Q {Q.shape}, got {K.shape}"
        )
    dtype = np.result_type(Q, K)
    return Q.astype(dtype, copy=False), K.astype(dtype, copy=False)


def check_qkv(Q, K, V):
    """Validate a single-head ``Q, K: (n, d)``, ``V: (n, dv)`` triple.

    Returns the three arrays in one common dtype: float32 when all three are float32,
    float64 otherwise.
    """
    Q, K = check_qk(Q, K)
    V = as_matrix(V, "V")
    if V.shape[0] != Q.shape[0]:
        raise ValueError(
            f"V must have the same length n = {Q.shape[0]} as Q and K, got shape {V.shape}"
        )
    dtype = np.result_type(Q, V)
    return Q.astype(dtype, copy=False), K.astype(dtype, copy=False), V.astype(dtype, copy=False)


def check_token(q, k, v):
    """Validate one token's ``q, k: (d,)`` and ``v: (dv,)`` (the one-token segment builders)."""
    Q, K, V = check_qkv(np.asarray(q)[None], np.asarray(k)[None], np.asarray(v)[None])
    return Q[0], K[0], V[0]


def _real(x, name: str) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    x = float(x)
    if not np.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def check_gamma(gamma) -> float:
    """Decay ``gamma`` must be a finite real in (0, 1]; 1 means no decay."""
    g = _real(gamma, "gamma")
    if not 0.0 < g <= 1.0:
        raise ValueError(f"gamma must lie in (0, 1], got {g}")
    return g


def check_eps(eps) -> float:
    """Normalizer offset ``eps`` must be a finite real >= 0."""
    e = _real(eps, "eps")
    if e < 0:
        raise ValueError(f"eps must be >= 0, got {e}")
    return e


def check_ridge(ridge) -> float:
    """Ridge ``lambda`` must be a finite real >= 0."""
    r = _real(ridge, "ridge")
    if r < 0:
        raise ValueError(f"ridge must be >= 0, got {r}")
    return r


def check_chunk_size(chunk_size) -> int:
    """``chunk_size`` must be an integer >= 1 (bools are refused)."""
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an integer, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)


def check_flag(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(x).__name__}")
    return bool(x)


def check_variant(variant) -> str:
    if variant not in ("masked", "paper"):
        raise ValueError(f"variant must be 'masked' or 'paper', got {variant!r}")
    return variant


def check_common(Q, K, V, gamma, normalize, eps):
    """Validate the arguments every operator form takes; returns them cleaned."""
    Q, K, V = check_qkv(Q, K, V)
    return Q, K, V, check_gamma(gamma), check_flag(normalize, "normalize"), check_eps(eps)


def with_ones(V: np.ndarray) -> np.ndarray:
    """``[V | 1]``: the normalizer is the same sum with every ``v_j`` replaced by 1,
    so one extra column of ones carries the denominator through any form."""
    return np.concatenate([V, np.ones((V.shape[0], 1), V.dtype)], axis=1)


def decay_matrix(n: int, gamma: float, power: int = 1, dtype=np.float64) -> np.ndarray:
    """``Gamma[t, j] = gamma**(power*(t - j))`` for ``j <= t`` and 0 above the diagonal: (n, n).

    Exponents are never negative, so no entry exceeds 1 (no overflow for small gamma)."""
    t = np.arange(n)
    diff = t[:, None] - t[None, :]
    return np.where(diff >= 0, float(gamma) ** (power * np.maximum(diff, 0)), 0.0).astype(dtype)
