"""Asymmetric HLA (AHLA, paper Sec. 6): the operator, streaming, scan (Erratum B fixed), chunked.

    o_t = sum_{j <= i <= t} gamma^(t-j) (q_t . k_i)(q_i . k_j) v_j          ((W W) o L) V at gamma = 1

HLA multiplies two prefix moments (S C); AHLA nests them: the inner moment P_i is read by q_i
before it is folded into the outer one, hence the single decay gamma^(t-j).
Shapes: Q, K (n, d); V (n, dv); outputs (n, dv).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._checks import (
    check_chunk_size, check_common, check_flag, check_gamma, check_qk, check_token,
    decay_matrix, with_ones,
)
from ._readout import chunk_decays, read_out
from .scan import token_scan

__all__ = [
    "AHLAState", "AHLASegment",
    "ahla_weights", "ahla_naive", "ahla_stream", "ahla_scan", "ahla_chunked",
    "ahla_segment", "ahla_identity", "ahla_combine",
]


def ahla_weights(Q, K, *, gamma: float = 1.0) -> np.ndarray:
    """The ``(n, n)`` matrix T with ``o = T V``: T = Wg Wg, Wg[t, i] = gamma^(t-i) X[t, i] (i <= t).

    (Wg Wg)[t, j] = sum_{j <= i <= t} gamma^(t-i) gamma^(i-j) X[t, i] X[i, j], and the two decays
    multiply to gamma^(t-j).
    """
    Q, K = check_qk(Q, K)
    gamma = check_gamma(gamma)
    X = Q @ K.T
    Wg = X * decay_matrix(Q.shape[0], gamma, dtype=X.dtype)
    return Wg @ Wg


def ahla_naive(Q, K, V, *, gamma: float = 1.0, normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    """AHLA from its ``n x n`` weights (definition). Q, K (n, d); V (n, dv) -> (n, dv)."""
    Q, K, V, gamma, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    Vh = with_ones(V) if normalize else V
    out = ahla_weights(Q, K, gamma=gamma) @ Vh
    return read_out(out[:, : V.shape[1]], out[:, -1], normalize, eps)


class AHLAState(NamedTuple):
    """AHLA prefix summaries after token t (paper Sec. 6), decayed to t.

    P: (d, dv) P^KV_t = sum_j gamma^(t-j) k_j v_j^T
    E: (d, dv) E_t    = sum_i gamma^(t-i) k_i (q_i^T P_i)
    p: (d,)    P with v -> 1;   e: (d,)  E with v -> 1
    """
    P: np.ndarray
    E: np.ndarray
    p: np.ndarray
    e: np.ndarray


def ahla_stream(Q, K, V, *, gamma: float = 1.0, normalize: bool = False, eps: float = 1e-6,
                return_state: bool = False):
    """AHLA one token at a time (Theorem 6.1)::

        P_t = gamma P_{t-1} + k_t v_t^T,    E_t = gamma E_{t-1} + k_t (q_t^T P_t),    o_t = q_t^T E_t

    Q, K (n, d); V (n, dv) -> O (n, dv), or (O, AHLAState) with ``return_state``.
    """
    Q, K, V, gamma, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    return_state = check_flag(return_state, "return_state")
    (n, d), dv, dt = Q.shape, V.shape[1], Q.dtype
    P, E, p, e = np.zeros((d, dv), dt), np.zeros((d, dv), dt), np.zeros(d, dt), np.zeros(d, dt)
    num, den = np.zeros((n, dv), dt), np.zeros(n, dt)
    for t in range(n):
        q, k, v = Q[t], K[t], V[t]
        P = gamma * P + np.outer(k, v)
        p = gamma * p + k
        E = gamma * E + np.outer(k, q @ P)
        e = gamma * e + k * (q @ p)
        num[t], den[t] = q @ E, q @ e
    out = read_out(num, den, normalize, eps)
    return (out, AHLAState(P, E, p, e)) if return_state else out


class AHLASegment(NamedTuple):
    """Summary of a run of tokens, decayed to its last token (rho = gamma^length).

    P, E, p, e as in :class:`AHLAState` over the segment only; R = sum_i k_i q_i^T over the segment,
    NOT decayed (Erratum B): shapes P, E (d, dv); R (d, d); p, e (d,).
    """
    P: np.ndarray
    E: np.ndarray
    R: np.ndarray
    p: np.ndarray
    e: np.ndarray
    rho: float


def ahla_segment(q, k, v, gamma: float = 1.0) -> AHLASegment:
    """One token: P = k v^T, E = k (q.k) v^T, R = k q^T, p = k, e = k (q.k), rho = gamma."""
    (q, k, v), gamma = check_token(q, k, v), check_gamma(gamma)
    qk = q @ k
    return AHLASegment(np.outer(k, v), qk * np.outer(k, v), np.outer(k, q), np.array(k, copy=True),
                       qk * k, float(gamma))


def ahla_identity(d: int, dv: int, dtype=np.float64) -> AHLASegment:
    """The empty segment: zeros and rho = 1."""
    return AHLASegment(np.zeros((d, dv), dtype), np.zeros((d, dv), dtype), np.zeros((d, d), dtype),
                       np.zeros(d, dtype), np.zeros(d, dtype), 1.0)


def ahla_combine(A: AHLASegment, B: AHLASegment) -> AHLASegment:
    """Segment A followed by segment B, with the undecayed moment R in the cross term::

        P = rho_B P_A + P_B,   E = rho_B E_A + E_B + rho_B R_B P_A,   R = R_A + R_B

    The cross pairs (i in B, j in A) carry gamma^(t-j) with no factor from i: each k_i q_i^T of B
    enters with weight 1, and all of P_A decays by rho_B.
    """
    r = B.rho
    return AHLASegment(
        P=r * A.P + B.P,
        E=r * A.E + B.E + r * (B.R @ A.P),
        R=A.R + B.R,
        p=r * A.p + B.p,
        e=r * A.e + B.e + r * (B.R @ A.p),
        rho=A.rho * B.rho,
    )


def scan_ahla(Q, K, V, gamma, normalize, eps, combine):
    """Shared body of :func:`ahla_scan` and the published variant: o_t = q_t^T E, den_t = q_t^T e."""
    num, den = token_scan(Q, K, V, gamma, ahla_segment, combine, ahla_identity,
                          lambda q, s: (q @ s.E, q @ s.e))
    return read_out(num, den, normalize, eps)


def ahla_scan(Q, K, V, *, gamma: float = 1.0, normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    """AHLA by a Blelloch scan of one-token segments under :func:`ahla_combine` (Sec. 6.2, corrected).

    Q, K (n, d); V (n, dv) -> (n, dv).
    """
    Q, K, V, gamma, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    return scan_ahla(Q, K, V, gamma, normalize, eps, ahla_combine)


def ahla_chunked(Q, K, V, *, chunk_size: int = 64, gamma: float = 1.0, normalize: bool = False,
                 eps: float = 1e-6, return_state: bool = False):
    """AHLA by chunks. One chunk (rows Q, K, V), state (P, E) before it, g = gamma^tau::

        Wg = (Q K^T) o Gamma_1
        B  = g o (Q P) + Wg V                  (row i: q_i^T P_i)
        O  = g o (Q E) + Wg B
        E <- gamma^c E + K^T diag(gamma^(c-tau)) B,    P <- gamma^c P + K^T diag(gamma^(c-tau)) V

    At gamma = 1: O = Q E + Wc (Q P) + (Wc Wc) V. Returns (n, dv), or (O, AHLAState).
    """
    Q, K, V, gamma, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    C = check_chunk_size(chunk_size)
    return_state = check_flag(return_state, "return_state")
    (n, d), dv, dt = Q.shape, V.shape[1], Q.dtype
    Vh = with_ones(V)
    P, E = np.zeros((d, dv + 1), dt), np.zeros((d, dv + 1), dt)
    out = np.zeros((n, dv + 1), dt)
    for s in range(0, n, C):
        q, k, v = Q[s:s + C], K[s:s + C], Vh[s:s + C]
        c = q.shape[0]
        g, to_end = chunk_decays(c, gamma, dt)
        Wg = (q @ k.T) * decay_matrix(c, gamma, dtype=dt)
        B = g[:, None] * (q @ P) + Wg @ v
        out[s:s + c] = g[:, None] * (q @ E) + Wg @ B
        E = gamma ** c * E + k.T @ (B * to_end[:, None])
        P = gamma ** c * P + k.T @ (v * to_end[:, None])
    O = read_out(out[:, :dv], out[:, dv], normalize, eps)
    if return_state:
        return O, AHLAState(P[:, :dv], E[:, :dv], P[:, dv], E[:, dv])
    return O
