"""The attention HLA is compared with: the causal mask, softmax attention, first-order linear attention.

Shapes: ``Q, K: (n, d)``, ``V: (n, dv)``, output ``(n, dv)``.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_common, check_flag, check_qkv, check_scale, decay_matrix, with_ones
from ._readout import read_out


def causal_mask(n: int) -> np.ndarray:
    """``L``: the ``(n, n)`` boolean lower-triangular mask, diagonal included (``L[t, j] = j <= t``)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n must be an integer, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return np.tril(np.ones((n, n), dtype=bool))


def softmax_attention(Q, K, V, *, causal: bool = True, scale: float | None = None) -> np.ndarray:
    """Softmax attention ``softmax(scale * Q K^T + mask) V``: the ``n x n`` baseline.

    ``scale`` defaults to ``1/sqrt(d)``. Returns ``(n, dv)``.
    """
    Q, K, V = check_qkv(Q, K, V)
    causal = check_flag(causal, "causal")
    n, d = Q.shape
    scale = check_scale(scale, d)
    scores = scale * (Q @ K.T)
    if causal:
        scores = np.where(causal_mask(n), scores, -np.inf)
    if n == 0:
        return np.zeros((0, V.shape[1]), V.dtype)
    scores = scores - scores.max(axis=1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=1, keepdims=True)
    return (weights @ V).astype(V.dtype, copy=False)


def linear_attention(Q, K, V, *, gamma=1.0, normalize: bool = False,
                     eps: float = 1e-6) -> np.ndarray:
    """First-order (causal, decayed) linear attention, as an ``n x n`` matrix:

    ``o_t = sum_{j <= t} gamma^(t-j) (q_t . k_j) v_j``, i.e. ``((Q K^T) o L o Gamma) V``.
    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors a_t; with gates the weight
    is ``exp(b_t - b_j) = a_{j+1} ... a_t`` (b_t = sum_{s <= t} log a_s), the output of the
    recurrence P_t = a_t P_{t-1} + k_t v_t^T, o_t = q_t^T P_t. Returns ``(n, dv)``.
    """
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    Vh = with_ones(V) if normalize else V
    A = (Q @ K.T) * decay_matrix(gates.log_a, dtype=Q.dtype)
    out = A @ Vh
    return read_out(out[:, : V.shape[1]], out[:, -1], normalize, eps)
