"""Asymmetric HLA (AHLA, paper Sec. 6): the operator, streaming, scan (Erratum B fixed), chunked.

    o_t = sum_{j <= i <= t} gamma^(t-j) (q_t . k_i)(q_i . k_j) v_j          ((W W) o L) V at gamma = 1

HLA multiplies two prefix moments (S C); AHLA nests them: the inner moment P_i is read by q_i
before it is folded into the outer one, hence the single decay gamma^(t-j).

Per-token gates: ``gamma`` may also be an array (n,) of factors a_t in (0, 1]; with
b_t = sum_{s <= t} log a_s the weight becomes exp(b_t - b_j) = a_{j+1} ... a_t (the middle
index i still adds nothing), and every recurrence multiplies by a_t at step t.
Shapes: Q, K (n, d); V (n, dv); outputs (n, dv).
"""


from typing import NamedTuple

import numpy as np

from ._checks import (
    check_chunk_size, check_common, check_dims, check_dtype, check_flag, check_gamma, check_gates, check_qk,
    check_segments, check_token, decay_matrix, with_ones,
)
from ._readout import chunk_decays, read_out
from .scan import token_scan

__all__ = [
    "AHLAState", "AHLASegment",
    "ahla_weights", "ahla_naive", "ahla_stream", "ahla_scan", "ahla_chunked",
    "ahla_segment", "ahla_identity", "ahla_combine",
]


def ahla_weights(Q, K, *, gamma=1.0) -> np.ndarray:
    """The ``(n, n)`` matrix T with ``o = T V``: T = Wg Wg, Wg[t, i] = gamma^(t-i) X[t, i] (i <= t).

    (Wg Wg)[t, j] = sum_{j <= i <= t} gamma^(t-i) gamma^(i-j) X[t, i] X[i, j], and the two decays
    multiply to gamma^(t-j). ``gamma``: a float in (0, 1] or an array (n,) of per-token factors;
    then Wg[t, i] = exp(b_t - b_i) X[t, i] and the two decays multiply to exp(b_t - b_j).
    """
    Q, K = check_qk(Q, K)
    gates = check_gates(gamma, Q.shape[0])
    X = Q @ K.T
    Wg = X * decay_matrix(gates.log_a, dtype=X.dtype)
    return Wg @ Wg


def ahla_naive(Q, K, V, *, gamma=1.0, normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    """AHLA from its ``n x n`` weights (definition). ``gamma``: a float in (0, 1] or an array (n,)
    of per-token factors. Q, K (n, d); V (n, dv) -> (n, dv)."""
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    Vh = with_ones(V) if normalize else V
    out = ahla_weights(Q, K, gamma=gates.a) @ Vh
    return read_out(out[:, : V.shape[1]], out[:, -1], normalize, eps)


class AHLAState(NamedTuple):
    """AHLA prefix summaries after token t (paper Sec. 6), decayed to t.

    P: (d, dv) P^KV_t = sum_j gamma^(t-j) k_j v_j^T
    E: (d, dv) E_t    = sum_i gamma^(t-i) k_i (q_i^T P_i)
    p: (d,)    P with v -> 1;   e: (d,)  E with v -> 1
    With per-token gates, gamma^(t-x) reads exp(b_t - b_x).
    """
    P: np.ndarray
    E: np.ndarray
    p: np.ndarray
    e: np.ndarray


def ahla_stream(Q, K, V, *, gamma=1.0, normalize: bool = False, eps: float = 1e-6,
                return_state: bool = False):
    """AHLA one token at a time (Theorem 6.1), a_t = gamma for a float gamma::

        P_t = a_t P_{t-1} + k_t v_t^T,    E_t = a_t E_{t-1} + k_t (q_t^T P_t),    o_t = q_t^T E_t

    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors a_t.
    Q, K (n, d); V (n, dv) -> O (n, dv), or (O, AHLAState) with ``return_state``.
    """
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    return_state = check_flag(return_state, "return_state")
    (n, d), dv, dt = Q.shape, V.shape[1], Q.dtype
    P, E, p, e = np.zeros((d, dv), dt), np.zeros((d, dv), dt), np.zeros(d, dt), np.zeros(d, dt)
    num, den = np.zeros((n, dv), dt), np.zeros(n, dt)
    a = gates.a.tolist()           # Python floats: float32 states stay float32
    for t in range(n):
        q, k, v, g = Q[t], K[t], V[t], a[t]
        P = g * P + np.outer(k, v)
        p = g * p + k
        E = g * E + np.outer(k, q @ P)
        e = g * e + k * (q @ p)
        num[t], den[t] = q @ E, q @ e
    out = read_out(num, den, normalize, eps)
    return (out, AHLAState(P, E, p, e)) if return_state else out


class AHLASegment(NamedTuple):
    """Summary of a run of tokens, decayed to its last token; rho is the product of the run's
    factors a_t (gamma^length for a constant gamma).

    P, E, p, e as in :class:`AHLAState` over the segment only; R = sum_i k_i q_i^T over the segment,
    NOT decayed (Erratum B): shapes P, E (d, dv); R (d, d); p, e (d,).
    """
    P: np.ndarray
    E: np.ndarray
    R: np.ndarray
    p: np.ndarray
    e: np.ndarray
    rho: float
    # each field's shape in d and dv (v), for the combine's checks; rho a scalar
    SHAPES = ("dv", "dv", "dd", "d", "d", "")


def ahla_segment(q, k, v, gamma: float = 1.0) -> AHLASegment:
    """One token: P = k v^T, E = k (q.k) v^T, R = k q^T, p = k, e = k (q.k), rho = gamma.

    ``gamma`` is this token's own factor a_t (a float in (0, 1])."""
    (q, k, v), gamma = check_token(q, k, v), check_gamma(gamma)
    qk = q @ k
    return AHLASegment(np.outer(k, v), qk * np.outer(k, v), np.outer(k, q), np.array(k, copy=True),
                       qk * k, float(gamma))


def ahla_identity(d: int, dv: int, dtype=np.float64) -> AHLASegment:
    """The empty segment: zeros and rho = 1."""
    d, dv = check_dims(d, dv)
    dtype = check_dtype(dtype)
    return AHLASegment(np.zeros((d, dv), dtype), np.zeros((d, dv), dtype), np.zeros((d, d), dtype),
                       np.zeros(d, dtype), np.zeros(d, dtype), 1.0)


def ahla_combine(A: AHLASegment, B: AHLASegment) -> AHLASegment:
    """Segment A followed by segment B, with the undecayed moment R in the cross term::

        P = rho_B P_A + P_B,   E = rho_B E_A + E_B + rho_B R_B P_A,   R = R_A + R_B

    The cross pairs (i in B, j in A) carry gamma^(t-j) with no factor from i: each k_i q_i^T of B
    enters with weight 1, and all of P_A decays by rho_B. With gates the same holds with
    exp(b_t - b_j) = exp(b_t - b_{e_A}) exp(b_{e_A} - b_j) and rho_B = the product of B's factors.
    """
    A, B = check_segments(A, B, AHLASegment)
    r = B.rho
    return AHLASegment(
        P=r * A.P + B.P,
        E=r * A.E + B.E + r * (B.R @ A.P),
        R=A.R + B.R,
        p=r * A.p + B.p,
        e=r * A.e + B.e + r * (B.R @ A.p),
        rho=A.rho * B.rho,
    )


def scan_ahla(Q, K, V, a, normalize, eps, combine):
    """Shared body of :func:`ahla_scan` and the published variant (token t's rho = a[t]):
    o_t = q_t^T E, den_t = q_t^T e."""
    num, den = token_scan(Q, K, V, a, ahla_segment, combine, ahla_identity,
                          lambda q, s: (q @ s.E, q @ s.e))
    return read_out(num, den, normalize, eps)


def ahla_scan(Q, K, V, *, gamma=1.0, normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    """AHLA by a Blelloch scan of one-token segments under :func:`ahla_combine` (Sec. 6.2, corrected).

    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors (token t's rho = a_t).
    Q, K (n, d); V (n, dv) -> (n, dv).
    """
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    return scan_ahla(Q, K, V, gates.a, normalize, eps, ahla_combine)


def ahla_chunked(Q, K, V, *, chunk_size: int = 64, gamma=1.0, normalize: bool = False,
                 eps: float = 1e-6, return_state: bool = False):
    """AHLA by chunks. One chunk (rows Q, K, V), state (P, E) before it, g = gamma^tau::

        Wg = (Q K^T) o Gamma_1
        B  = g o (Q P) + Wg V                  (row i: q_i^T P_i)
        O  = g o (Q E) + Wg B
        E <- gamma^c E + K^T diag(gamma^(c-tau)) B,    P <- gamma^c P + K^T diag(gamma^(c-tau)) V

    At gamma = 1: O = Q E + Wc (Q P) + (Wc Wc) V. ``gamma``: a float in (0, 1] or an array (n,)
    of per-token factors; then g[r] = exp(b_r - b_before), gamma^(c-tau) -> exp(b_end - b_r),
    gamma^c -> the chunk's product of factors, Gamma_1[t, i] = exp(b_t - b_i): all <= 1.
    Returns (n, dv), or (O, AHLAState).
    """
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    C = check_chunk_size(chunk_size)
    return_state = check_flag(return_state, "return_state")
    (n, d), dv, dt = Q.shape, V.shape[1], Q.dtype
    Vh = with_ones(V)
    P, E = np.zeros((d, dv + 1), dt), np.zeros((d, dv + 1), dt)
    out = np.zeros((n, dv + 1), dt)
    for s in range(0, n, C):
        q, k, v = Q[s:s + C], K[s:s + C], Vh[s:s + C]
        c = q.shape[0]
        la = gates.log_a[s:s + C]
        g, to_end, rho = chunk_decays(la, dt)
        Wg = (q @ k.T) * decay_matrix(la, dtype=dt)
        B = g[:, None] * (q @ P) + Wg @ v
        out[s:s + c] = g[:, None] * (q @ E) + Wg @ B
        E = rho * E + k.T @ (B * to_end[:, None])
        P = rho * P + k.T @ (v * to_end[:, None])
    O = read_out(out[:, :dv], out[:, dv], normalize, eps)
    if return_state:
        return O, AHLAState(P[:, :dv], E[:, :dv], P[:, dv], E[:, dv])
    return O
