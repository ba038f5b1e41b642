"""Second-order HLA: the operator, its streaming summaries, its scan and its chunked form.

The operator (masked, decayed; paper Sec. 3 and 4.3 with the decay of Erratum A corrected):

    o_t = sum_{i <= j <= t} gamma^(2t-i-j) (q_t . k_i)(q_j . k_i) v_j        ((W W^T) o L) V at gamma = 1

and, unmasked (paper eq. 3.1), the same weight over all i, j <= t, which is q_t^T S^K_t C^QV_t.
With ``normalize=True`` the output is num / (den + eps), den being the same sum with v_j -> 1.

Per-token gates: ``gamma`` may also be an array (n,) of factors a_t in (0, 1]. With
b_t = sum_{s <= t} log a_s the weight of the pair (i, j) becomes exp(2 b_t - b_i - b_j)
= (a_{i+1} ... a_t)(a_{j+1} ... a_t): the age of the key plus the age of the query-value, now
measured in gates. Every recurrence below multiplies by a_t at step t where it multiplied by gamma;
a constant gamma is the case b_t = (t + 1) log gamma.

Shapes: Q, K (n, d); V (n, dv); outputs (n, dv). States are decayed to the last token seen.
"""


from typing import NamedTuple

import numpy as np

from ._checks import (
    check_chunk_size, check_common, check_dims, check_dtype, check_flag, check_gamma, check_gates, check_qk,
    check_ridge, check_segments, check_token, decay_matrix, with_ones,
)
from ._readout import chunk_decays, read_out
from .baselines import causal_mask
from .scan import token_scan

__all__ = [
    "HLA2State", "HLA2CompactState", "HLA2Segment",
    "hla2_weights", "hla2_naive", "hla2_stream", "hla2_scan", "hla2_chunked",
    "hla2_segment", "hla2_identity", "hla2_combine",
]


# --------------------------------------------------------------------------------------------
# 1. Naive: materialize the n x n weights
# --------------------------------------------------------------------------------------------

def hla2_weights(Q, K, *, gamma=1.0, masked: bool = True) -> np.ndarray:
    """The ``(n, n)`` matrix T with ``o = T V``.

    masked:   T[t, j] = gamma^(t-j) sum_{i <= j} gamma^(t-i) X[t, i] X[j, i]   for j <= t
    unmasked: T[t, j] = gamma^(t-j) sum_{i <= t} gamma^(t-i) X[t, i] X[j, i]   for j <= t
    with X = Q K^T. At gamma = 1 the masked T is (W W^T) o L with W = X o L.
    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors a_t; with gates every
    gamma^(t-x) reads exp(b_t - b_x) = a_{x+1} ... a_t.
    """
    Q, K = check_qk(Q, K)
    gates = check_gates(gamma, Q.shape[0])
    masked = check_flag(masked, "masked")
    X = Q @ K.T
    Gam = decay_matrix(gates.log_a, dtype=X.dtype)   # exp(b_t - b_j) on and below the diagonal
    Wg = X * Gam                                     # exp(b_t - b_i) X[t, i], i <= t
    inner = X * causal_mask(Q.shape[0]) if masked else X   # masked: only i <= j survives
    return Gam * (Wg @ inner.T)


def hla2_naive(Q, K, V, *, gamma=1.0, normalize: bool = False, eps: float = 1e-6,
               masked: bool = True) -> np.ndarray:
    """Second-order HLA from the ``n x n`` weights (definition; O(n^2 d) time, O(n^2) memory).

    ``masked=False`` gives the paper's unmasked eq. 3.1. ``gamma``: a float in (0, 1] or an array
    (n,) of per-token factors (pair weight exp(2 b_t - b_i - b_j)).
    Q, K (n, d); V (n, dv) -> (n, dv).
    """
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    masked = check_flag(masked, "masked")
    Vh = with_ones(V) if normalize else V
    out = hla2_weights(Q, K, gamma=gates.a, masked=masked) @ Vh
    return read_out(out[:, : V.shape[1]], out[:, -1], normalize, eps)


# --------------------------------------------------------------------------------------------
# 2. Streaming: prefix summaries and the cross corrections (Theorem 3.1, Algorithm 1)
# --------------------------------------------------------------------------------------------

class HLA2State(NamedTuple):
    """Prefix summaries after token t (paper Sec. 3), all decayed to t.

    S: (d, d)   S^K_t  = sum_i gamma^(t-i) k_i k_i^T
    C: (d, dv)  C^QV_t = sum_j gamma^(t-j) q_j v_j^T
    m: (d,)     m^Q_t  = sum_j gamma^(t-j) q_j
    G: (d, dv)  G_t    = sum_{j < i <= t} gamma^(2t-i-j) k_i k_i^T q_j v_j^T
                         (the pairs i > j that the mask removes)
    h: (d,)     h_t    = G_t with v_j -> 1
    With per-token gates, gamma^(t-x) reads exp(b_t - b_x) (gamma^(2t-i-j): exp(2 b_t - b_i - b_j)).
    """
    S: np.ndarray
    C: np.ndarray
    m: np.ndarray
    G: np.ndarray
    h: np.ndarray


class HLA2CompactState(NamedTuple):
    """The decoder's state: S (d, d), W = S C - G (d, dv), z = S m - h (d,).

    W_t = gamma^2 W_{t-1} + (S_t q_t) v_t^T and z_t = gamma^2 z_{t-1} + S_t q_t (a_t^2 with gates),
    so C, m, G, h need not be kept: d^2 + d dv (+ d) numbers instead of d^2 + 2 d dv (+ 2 d).
    """
    S: np.ndarray
    W: np.ndarray
    z: np.ndarray


def hla2_stream(Q, K, V, *, gamma=1.0, normalize: bool = False, eps: float = 1e-6,
                masked: bool = True, ridge: float = 0.0, compact: bool = False,
                return_state: bool = False):
    """Second-order HLA one token at a time (Theorem 3.1; Algorithm 1 with corrected decay).

    Per token, with the decay of Erratum A corrected (G and h decay by a_t^2, their
    increment by a_t; a_t = gamma for a float gamma)::

        G_t = a_t^2 G_{t-1} + a_t k_t (k_t^T C_{t-1})      h_t likewise with m_{t-1}
        S_t = a_t S_{t-1} + k_t k_t^T,  C_t = a_t C_{t-1} + q_t v_t^T,  m_t = a_t m_{t-1} + q_t
        o_t = q_t^T ((S_t + ridge I) C_t - G_t),  den_t = q_t^T ((S_t + ridge I) m_t - h_t)

    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors a_t. ``masked=False`` drops
    G and h (eq. 3.1). ``ridge`` is the paper's optional lambda I. ``compact=True`` runs the
    (S, W, z) recurrence of :class:`HLA2CompactState` instead (masked only, no ridge).
    Q, K (n, d); V (n, dv) -> O (n, dv), or (O, state) with ``return_state``.
    """
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    masked = check_flag(masked, "masked")
    compact = check_flag(compact, "compact")
    return_state = check_flag(return_state, "return_state")
    ridge = check_ridge(ridge)
    if compact and (not masked or ridge):
        raise ValueError("compact=True needs masked=True and ridge=0: the compact state folds G in")
    (n, d), dv, dt = Q.shape, V.shape[1], Q.dtype
    num, den = np.zeros((n, dv), dt), np.zeros(n, dt)
    a = gates.a.tolist()           # Python floats: float32 states stay float32

    if compact:
        S, W, z = np.zeros((d, d), dt), np.zeros((d, dv), dt), np.zeros(d, dt)
        for t in range(n):
            q, k, v, g = Q[t], K[t], V[t], a[t]
            S = g * S + np.outer(k, k)
            Sq = S @ q
            W = g * g * W + np.outer(Sq, v)
            z = g * g * z + Sq
            num[t], den[t] = q @ W, q @ z
        state = HLA2CompactState(S, W, z)
    else:
        S, C, m = np.zeros((d, d), dt), np.zeros((d, dv), dt), np.zeros(d, dt)
        G, h = np.zeros((d, dv), dt), np.zeros(d, dt)
        for t in range(n):
            q, k, v, g = Q[t], K[t], V[t], a[t]
            G = g * g * G + g * np.outer(k, k @ C)      # uses C_{t-1}: pairs (i = t, j < t)
            h = g * g * h + g * k * (k @ m)
            S = g * S + np.outer(k, k)
            C = g * C + np.outer(q, v)
            m = g * m + q
            qS = q @ S + ridge * q                      # q^T (S + ridge I)
            num[t], den[t] = qS @ C, qS @ m
            if masked:
                num[t] -= q @ G
                den[t] -= q @ h
        state = HLA2State(S, C, m, G, h)

    out = read_out(num, den, normalize, eps)
    return (out, state) if return_state else out


# --------------------------------------------------------------------------------------------
# 3. Scan: segment summaries and their associative combine (Sec. 4, Theorem 4.1)
# --------------------------------------------------------------------------------------------

class HLA2Segment(NamedTuple):
    """Summary of a run of tokens, decayed to the run's last token; rho is the product of the
    run's factors a_t (gamma^length for a constant gamma), the decay across the whole run.

    S, C, m as in :class:`HLA2State` but summed over the segment only; G, h: the pairs j < i
    inside the segment. Shapes S (d, d), C (d, dv), m (d,), G (d, dv), h (d,); rho a float.
    """
    S: np.ndarray
    C: np.ndarray
    m: np.ndarray
    G: np.ndarray
    h: np.ndarray
    rho: float
    # each field's shape in d and dv (v), for the combine's checks; rho a scalar
    SHAPES = ("dd", "dv", "d", "dv", "d", "")


def hla2_segment(q, k, v, gamma: float = 1.0) -> HLA2Segment:
    """The segment of one token: S = k k^T, C = q v^T, m = q, G = h = 0, rho = gamma.

    ``gamma`` is this token's own factor a_t (a float in (0, 1]): with per-token gates, build
    token t's segment with ``gamma=a[t]``."""
    (q, k, v), gamma = check_token(q, k, v), check_gamma(gamma)
    d, dv = len(k), len(v)
    return HLA2Segment(np.outer(k, k), np.outer(q, v), q.copy(), np.zeros((d, dv), k.dtype),
                       np.zeros(d, k.dtype), gamma)


def hla2_identity(d: int, dv: int, dtype=np.float64) -> HLA2Segment:
    """The empty segment (all zeros, rho = 1): a two-sided identity of :func:`hla2_combine`."""
    d, dv = check_dims(d, dv)
    dtype = check_dtype(dtype)
    return HLA2Segment(np.zeros((d, d), dtype), np.zeros((d, dv), dtype), np.zeros(d, dtype),
                       np.zeros((d, dv), dtype), np.zeros(d, dtype), 1.0)


def hla2_combine(A: HLA2Segment, B: HLA2Segment) -> HLA2Segment:
    """Segment A followed by segment B (associative, not commutative).

    Everything of A decays by rho_B across B; the new cross pairs (i in B, j in A) give
    ``rho_B S_B C_A``, because gamma^(2e-i-j) = gamma^(e-i) * rho_B * gamma^(e_A-j), and with
    gates exp(2 b_e - b_i - b_j) = exp(b_e - b_i) * rho_B * exp(b_{e_A} - b_j),
    rho_B = exp(b_e - b_{e_A}) the product of B's factors::

        S = rho_B S_A + S_B,   C = rho_B C_A + C_B,   m = rho_B m_A + m_B
        G = rho_B^2 G_A + G_B + rho_B S_B C_A,   h = rho_B^2 h_A + h_B + rho_B S_B m_A
    """
    A, B = check_segments(A, B, HLA2Segment)
    r = B.rho
    return HLA2Segment(
        S=r * A.S + B.S,
        C=r * A.C + B.C,
        m=r * A.m + B.m,
        G=r * r * A.G + B.G + r * (B.S @ A.C),
        h=r * r * A.h + B.h + r * (B.S @ A.m),
        rho=A.rho * B.rho,
    )


def scan_hla2(Q, K, V, a, normalize, eps, combine):
    """Shared body of :func:`hla2_scan` and the published variant: scan with ``combine`` the
    one-token segments (token t's rho = a[t]), then o_t = q_t^T (S C - G) and
    den_t = q_t^T (S m - h) of the inclusive prefix."""
    num, den = token_scan(Q, K, V, a, hla2_segment, combine, hla2_identity,
                          lambda q, s: (q @ (s.S @ s.C - s.G), q @ (s.S @ s.m - s.h)))
    return read_out(num, den, normalize, eps)


def hla2_scan(Q, K, V, *, gamma=1.0, normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    """Second-order HLA by a Blelloch scan of one-token segments under :func:`hla2_combine`.

    o_t = q_t^T (S C - G) of the inclusive prefix up to t (Theorem 4.1: equals the serial form).
    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors (token t's segment has
    rho = a_t). Q, K (n, d); V (n, dv) -> (n, dv).
    """
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    return scan_hla2(Q, K, V, gates.a, normalize, eps, hla2_combine)


# --------------------------------------------------------------------------------------------
# 4. Chunked: dense masked work inside a chunk, the compact state (S, W) across chunks
# --------------------------------------------------------------------------------------------

def hla2_chunked(Q, K, V, *, chunk_size: int = 64, gamma=1.0, normalize: bool = False,
                 eps: float = 1e-6, return_state: bool = False):
    """Second-order HLA by chunks: what a GPU kernel computes (derived at gamma = 1 in
    notebooks/06_chunk_parallel.ipynb, section 2, "The chunk step as matrix products").

    For one chunk of c tokens (rows Q, K, V), state (S, W) before it, X = Q K^T,
    local positions tau = 1..c, g = gamma^tau, Gamma_p[t, u] = gamma^(p (t-u)) for u <= t::

        Wg = X o Gamma_1                                (gamma^(t-i) X[t, i], i <= t)
        O  = g^2 o (Q W) + (Gamma_2 o ((Q S Q^T) g_u + X Wg^T)) V
        W <- gamma^(2c) W + (S Q^T g + K^T Wg^T) diag(gamma^(2(c-tau))) V
        S <- gamma^c S + K^T diag(gamma^(c-tau)) K

    At gamma = 1: O = Q W + ((Q S Q^T + Wc Wc^T) o L) V, W += S Q^T V + K^T (Wc^T V), S += K^T K.
    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors. With gates the same
    formulas hold with g[r] = exp(b_r - b_before) (state before the chunk to token r),
    gamma^(c-tau) -> exp(b_end - b_r), gamma^c -> rho = the chunk's product of factors, and
    Gamma_p[t, u] = exp(p (b_t - b_u)); every exponent is a sum of log a_s <= 0 inside the chunk,
    so no factor exceeds 1 however small a gate is. Any n (the last chunk may be short).
    Returns (n, dv), or (O, HLA2CompactState) with ``return_state``.
    """
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    C = check_chunk_size(chunk_size)
    return_state = check_flag(return_state, "return_state")
    (n, d), dv, dt = Q.shape, V.shape[1], Q.dtype
    Vh = with_ones(V)                       # the last column carries the normalizer (z)
    S, W = np.zeros((d, d), dt), np.zeros((d, dv + 1), dt)
    out = np.zeros((n, dv + 1), dt)
    for s in range(0, n, C):
        q, k, v = Q[s:s + C], K[s:s + C], Vh[s:s + C]
        c, la = q.shape[0], gates.log_a[s:s + C]
        g, to_end, rho = chunk_decays(la, dt)
        Gam = decay_matrix(la, dtype=dt)
        X = q @ k.T
        Wg = X * Gam
        A = Gam ** 2 * ((q @ S @ q.T) * g[None, :] + X @ Wg.T)
        out[s:s + c] = (g ** 2)[:, None] * (q @ W) + A @ v
        SQ = (S @ q.T) * g[None, :] + k.T @ Wg.T          # column u: S_u q_u
        W = rho * rho * W + SQ @ (v * (to_end ** 2)[:, None])
        S = rho * S + k.T @ (k * to_end[:, None])
    O = read_out(out[:, :dv], out[:, dv], normalize, eps)
    if return_state:
        return O, HLA2CompactState(S, W[:, :dv], W[:, dv])
    return O
