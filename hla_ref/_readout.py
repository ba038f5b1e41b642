"""Small helpers that turn per-token numerators and denominators into outputs, and the decay
factors of one chunk."""

from __future__ import annotations

import numpy as np


def read_out(num: np.ndarray, den: np.ndarray, normalize: bool, eps: float) -> np.ndarray:
    """``num`` (n, dv) when not normalizing, else ``num / (den + eps)`` with ``den`` (n,)."""
    if not normalize:
        return num
    return num / (den + eps)[:, None]


def chunk_decays(log_a: np.ndarray, dtype):
    """Decay factors of one chunk of ``c`` tokens, from their log factors ``log_a`` (c,).

    With r the chunk's tokens, ``before`` the token just before the chunk and ``end`` its last one:

    * ``g[r] = exp(b_r - b_before) = a_start ... a_r``: from the state before the chunk to token r;
    * ``to_end[r] = exp(b_end - b_r) = a_{r+1} ... a_end``: from token r to the chunk's last token;
    * ``rho = exp(b_end - b_before)``, the product of the chunk's factors (a Python float).

    The exponents are running sums of log a <= 0 taken inside the chunk (never a difference of
    two large b's), so every factor is <= 1. For a constant gamma, at local positions
    tau = 1..c: ``g = gamma^tau``, ``to_end = gamma^(c - tau)``, ``rho = gamma^c``.
    """
    log_a = np.asarray(log_a, dtype=np.float64)
    inc = np.cumsum(log_a)                                     # sum_{start <= s <= r}
    suffix = np.concatenate([np.cumsum(log_a[:0:-1])[::-1], [0.0]])  # sum_{r < s <= end}
    return np.exp(inc).astype(dtype), np.exp(suffix).astype(dtype), float(np.exp(inc[-1]))
