"""Small helpers that turn per-token numerators and denominators into outputs."""

from __future__ import annotations

import numpy as np


def read_out(num: np.ndarray, den: np.ndarray, normalize: bool, eps: float) -> np.ndarray:
    """``num`` (n, dv) when not normalizing, else ``num / (den + eps)`` with ``den`` (n,)."""
    if not normalize:
        return num
    return num / (den + eps)[:, None]


def chunk_decays(c: int, gamma: float, dtype):
    """Decay factors for one chunk of ``c`` tokens at local positions tau = 1..c.

    Returns ``g[tau-1] = gamma**tau`` (from the state before the chunk to token tau) and
    ``to_end[tau-1] = gamma**(c - tau)`` (from token tau to the chunk's last token). All <= 1.
    """
    tau = np.arange(1, c + 1)
    return (gamma ** tau).astype(dtype), (gamma ** (c - tau)).astype(dtype)
