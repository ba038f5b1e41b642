"""Third-order HLA (paper Sec. 7): two operators, each in four forms.

variant="masked" (the operator the paper means, (((W W^T) o L) W o L) V at gamma = 1)::

    o_t = sum_{i <= u, j <= u, u <= t} gamma^(3t-i-u-j) (q_t . k_i)(k_i . q_u)(q_u . k_j) v_j

variant="paper" (what the paper's Algorithm 3, F = S^K S^Q P - G1 - G2 - G3, really computes;
Erratum C): the same weight summed over all i, u, j <= t whose largest index occurs at least twice.
Both are causal; they differ by O(1). Theorem 7.1 claims they are equal.

The masked operator streams with a state of d^2 + 2 d dv numbers (S, P, F) and scans with segment
pieces of size d x d or d x dv. Algorithm 3's operator needs, for a fully parallel scan, a
(d, d, d, dv) linear map per segment (the paper's M^KQP). Shapes: Q, K (n, d); V (n, dv).

Per-token gates: ``gamma`` may also be an array (n,) of factors a_t in (0, 1]; with
b_t = sum_{s <= t} log a_s both operators keep their index sets and weigh a triple by
exp(3 b_t - b_i - b_u - b_j); every recurrence multiplies by a_t at step t where it multiplied
by gamma (a_t^2, a_t^3 where it multiplied by gamma^2, gamma^3).
"""


from typing import NamedTuple

import numpy as np

from ._checks import (
    check_chunk_size, check_common, check_dims, check_dtype, check_flag, check_gamma, check_gates, check_qk,
    check_segments, check_token, check_variant, decay_matrix, to_array, with_ones,
)
from ._readout import chunk_decays, read_out
from .scan import token_scan

__all__ = [
    "HLA3State", "HLA3PaperState", "HLA3Segment", "HLA3PaperSegment",
    "hla3_weights", "hla3_naive", "hla3_stream", "hla3_scan", "hla3_chunked",
    "hla3_segment", "hla3_identity", "hla3_combine",
    "hla3_paper_segment", "hla3_paper_identity", "hla3_paper_combine", "largest_index_twice",
]


# --------------------------------------------------------------------------------------------
# 1. Naive
# --------------------------------------------------------------------------------------------

def _index_array(x, name: str) -> np.ndarray:
    """x as an integer array (a token index or an array of them), refusing anything else by name."""
    arr = to_array(x, name, "a Python int or a NumPy integer array", f"{name}.item() or {name}.detach().cpu().numpy()")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer or an integer array (token indices), got dtype {arr.dtype}")
    return arr


def largest_index_twice(i, u, j):
    """Boolean (broadcasting): does max(i, u, j) occur at least twice among i, u, j? Each an integer
    or an integer array (token indices)."""
    i, u, j = (_index_array(x, name) for x, name in ((i, "i"), (u, "u"), (j, "j")))
    top = np.maximum(np.maximum(i, u), j)
    return ((i == top).astype(int) + (u == top) + (j == top)) >= 2


def hla3_weights(Q, K, *, gamma=1.0, variant: str = "masked") -> np.ndarray:
    """The ``(n, n)`` matrix T with ``o = T V``.

    masked: T = (Gamma_3 o (X Wg^T)) Wg with X = Q K^T and Wg = X o Gamma_1, because
        gamma^(3t-i-u-j) = gamma^(3(t-u)) gamma^(u-i) gamma^(u-j).
    paper: for every t, the (t+1)^3 weight tensor over (i, u, j) restricted to
        :func:`largest_index_twice`, summed over i and u (O(n^4): small n only).
    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors; then
    Gamma_p[t, x] = exp(p (b_t - b_x)) and the same splits hold with b in place of the indices.
    """
    Q, K = check_qk(Q, K)
    gates = check_gates(gamma, Q.shape[0])
    variant = check_variant(variant)
    n = Q.shape[0]
    X = Q @ K.T
    Gam = decay_matrix(gates.log_a, dtype=X.dtype)
    Wg = X * Gam
    if variant == "masked":
        return (Gam ** 3 * (X @ Wg.T)) @ Wg
    T = np.zeros_like(X)
    for t in range(n):
        idx = np.arange(t + 1)
        w = Gam[t, : t + 1]                          # gamma^(t-i) (exp(b_t - b_i)), <= 1
        a = X[t, : t + 1] * w                        # (q_t . k_i) gamma^(t-i)
        b = X[: t + 1, : t + 1].T * w[None, :]       # b[i, u] = (k_i . q_u) gamma^(t-u)
        c = X[: t + 1, : t + 1] * w[None, :]         # c[u, j] = (q_u . k_j) gamma^(t-j)
        keep = largest_index_twice(idx[:, None, None], idx[None, :, None], idx[None, None, :])
        T[t, : t + 1] = np.einsum("i,iu,uj,iuj->j", a, b, c, keep)
    return T


def hla3_naive(Q, K, V, *, gamma=1.0, normalize: bool = False, eps: float = 1e-6,
               variant: str = "masked") -> np.ndarray:
    """Third-order HLA from its weights (definition). ``gamma``: a float in (0, 1] or an array
    (n,) of per-token factors. Q, K (n, d); V (n, dv) -> (n, dv)."""
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    variant = check_variant(variant)
    Vh = with_ones(V) if normalize else V
    out = hla3_weights(Q, K, gamma=gates.a, variant=variant) @ Vh
    return read_out(out[:, : V.shape[1]], out[:, -1], normalize, eps)


# --------------------------------------------------------------------------------------------
# 2. Streaming
# --------------------------------------------------------------------------------------------

class HLA3State(NamedTuple):
    """Masked third-order state after token t, decayed to t: d^2 + 2 d dv (+ 2d) numbers.

    S: (d, d)  S^K_t = sum gamma^(t-i) k_i k_i^T      P: (d, dv) P_t = sum gamma^(t-j) k_j v_j^T
    F: (d, dv) F_t = gamma^3 F_{t-1} + (S_t q_t)(q_t^T P_t)
    p: (d,) P with v -> 1;  f: (d,) F with v -> 1
    With per-token gates: gamma^(t-x) -> exp(b_t - b_x), gamma^3 -> a_t^3.
    """
    S: np.ndarray
    P: np.ndarray
    F: np.ndarray
    p: np.ndarray
    f: np.ndarray


class HLA3PaperState(NamedTuple):
    """Algorithm 3's state after token t: S^K, S^Q (d, d); P (d, dv); the corrections G1, G2, G3
    (d, dv) remove triples whose largest index is i, u or j alone; p, g1, g2, g3 (d,) their
    v -> 1 versions. Output F = S^K S^Q P - G1 - G2 - G3."""
    SK: np.ndarray
    SQ: np.ndarray
    P: np.ndarray
    G1: np.ndarray
    G2: np.ndarray
    G3: np.ndarray
    p: np.ndarray
    g1: np.ndarray
    g2: np.ndarray
    g3: np.ndarray


def _stream_masked(Q, K, V, a):
    """The masked recurrence; ``a`` (list of n floats) holds the tokens' factors."""
    (n, d), dv, dt = Q.shape, V.shape[1], Q.dtype
    S, P, F = np.zeros((d, d), dt), np.zeros((d, dv), dt), np.zeros((d, dv), dt)
    p, f = np.zeros(d, dt), np.zeros(d, dt)
    num, den = np.zeros((n, dv), dt), np.zeros(n, dt)
    for t in range(n):
        q, k, v, g = Q[t], K[t], V[t], a[t]
        g3 = g * g * g
        S = g * S + np.outer(k, k)
        P = g * P + np.outer(k, v)
        p = g * p + k
        Sq = S @ q
        F = g3 * F + np.outer(Sq, q @ P)
        f = g3 * f + Sq * (q @ p)
        num[t], den[t] = q @ F, q @ f
    return num, den, HLA3State(S, P, F, p, f)


def _stream_paper(Q, K, V, gates):
    """Algorithm 3 with decay; ``gates`` (list of n floats) holds the tokens' factors."""
    (n, d), dv, dt = Q.shape, V.shape[1], Q.dtype
    SK, SQ = np.zeros((d, d), dt), np.zeros((d, d), dt)
    P, G1, G2, G3 = (np.zeros((d, dv), dt) for _ in range(4))
    p, g1, g2, g3 = (np.zeros(d, dt) for _ in range(4))
    num, den = np.zeros((n, dv), dt), np.zeros(n, dt)
    for t in range(n):
        q, k, v, g = Q[t], K[t], V[t], gates[t]
        a, b = g ** 3, g ** 2
        # Triples whose largest index t occurs once; moments are those of tokens < t.
        kSQ, SKq, SKSQk = k @ SQ, SK @ q, SK @ (SQ @ k)
        G1 = a * G1 + b * np.outer(k, kSQ @ P)            # i = t alone
        g1 = a * g1 + b * k * (kSQ @ p)
        G2 = a * G2 + b * np.outer(SKq, q @ P)            # u = t alone
        g2 = a * g2 + b * SKq * (q @ p)
        G3 = a * G3 + b * np.outer(SKSQk, v)              # j = t alone
        g3 = a * g3 + b * SKSQk
        SK = g * SK + np.outer(k, k)
        SQ = g * SQ + np.outer(q, q)
        P = g * P + np.outer(k, v)
        p = g * p + k
        qSKSQ = q @ SK @ SQ
        num[t] = qSKSQ @ P - q @ (G1 + G2 + G3)
        den[t] = qSKSQ @ p - q @ (g1 + g2 + g3)
    return num, den, HLA3PaperState(SK, SQ, P, G1, G2, G3, p, g1, g2, g3)


def hla3_stream(Q, K, V, *, gamma=1.0, normalize: bool = False, eps: float = 1e-6,
                variant: str = "masked", return_state: bool = False):
    """Third-order HLA one token at a time (a_t = gamma for a float gamma).

    masked (compact recurrence)::

        S_t = a_t S_{t-1} + k_t k_t^T,  P_t = a_t P_{t-1} + k_t v_t^T
        F_t = a_t^3 F_{t-1} + (S_t q_t)(q_t^T P_t),   o_t = q_t^T F_t

    paper (Algorithm 3, with decay: each G^(k) decays by a_t^3 and its increment by a_t^2)::

        G1 += k k^T S^Q_{t-1} P_{t-1},  G2 += S^K_{t-1} q q^T P_{t-1},  G3 += S^K_{t-1} S^Q_{t-1} k v^T
        o_t = q_t^T (S^K_t S^Q_t P_t - G1 - G2 - G3)

    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors a_t.
    Q, K (n, d); V (n, dv) -> O (n, dv), or (O, state) with ``return_state``.
    """
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    variant = check_variant(variant)
    return_state = check_flag(return_state, "return_state")
    run = _stream_masked if variant == "masked" else _stream_paper
    num, den, state = run(Q, K, V, gates.a.tolist())   # Python floats: float32 stays float32
    out = read_out(num, den, normalize, eps)
    return (out, state) if return_state else out


# --------------------------------------------------------------------------------------------
# 3. Scan
# --------------------------------------------------------------------------------------------

class HLA3Segment(NamedTuple):
    """Masked third-order segment summary, decayed to the segment's last token e; rho is the
    product of the segment's factors a_t (gamma^len for a constant gamma; with gates every
    gamma^(e-x) below reads exp(b_e - b_x)).

    S, SQ (d, d): sum gamma^(e-i) k k^T, q q^T.   P (d, dv), p (d,): sum gamma^(e-j) k v^T, k.
    F (d, dv), f (d,): the operator's F over the segment alone.
    R (d, dv), r (d,): sum_u gamma^(2(e-u)) q_u q_u^T P_{<=u}  (P local to the segment)
    N (d, d):          sum_u gamma^(2(e-u)) S_{<=u} q_u q_u^T  (S local to the segment)
    """
    S: np.ndarray
    SQ: np.ndarray
    P: np.ndarray
    F: np.ndarray
    R: np.ndarray
    N: np.ndarray
    p: np.ndarray
    f: np.ndarray
    r: np.ndarray
    rho: float
    # each field's shape in d and dv (v), for the combine's checks; rho a scalar
    SHAPES = ("dd", "dd", "dv", "dv", "dv", "dd", "d", "d", "d", "")


def hla3_segment(q, k, v, gamma: float = 1.0) -> HLA3Segment:
    """One token: S = k k^T, SQ = q q^T, P = k v^T, F = k (k.q)^2 v^T, R = q (q.k) v^T,
    N = k k^T q q^T, rho = gamma, this token's own factor a_t (a float in (0, 1])."""
    (q, k, v), gamma = check_token(q, k, v), check_gamma(gamma)
    qk = q @ k
    kv = np.outer(k, v)
    return HLA3Segment(np.outer(k, k), np.outer(q, q), kv, qk * qk * kv, qk * np.outer(q, v),
                       qk * np.outer(k, q), np.array(k, copy=True), qk * qk * k, qk * q, float(gamma))


def hla3_identity(d: int, dv: int, dtype=np.float64) -> HLA3Segment:
    """The empty masked segment: zeros, rho = 1."""
    d, dv = check_dims(d, dv)
    dtype = check_dtype(dtype)
    z = lambda *shape: np.zeros(shape, dtype)  # noqa: E731
    return HLA3Segment(z(d, d), z(d, d), z(d, dv), z(d, dv), z(d, dv), z(d, d), z(d), z(d), z(d), 1.0)


def hla3_combine(A: HLA3Segment, B: HLA3Segment) -> HLA3Segment:
    """Segment A then B. A triple (i, u, j) that crosses the boundary must have u in B (u is a
    largest index), which leaves three cross families, all products of d x d / d x dv pieces::

        F = rho^3 F_A + F_B + rho^2 S_A SQ_B P_A + rho S_A R_B + rho N_B P_A
        R = rho^2 R_A + R_B + rho SQ_B P_A,    N = rho^2 N_A + N_B + rho S_A SQ_B
        S, SQ, P: rho X_A + X_B     (rho = rho_B)
    """
    A, B = check_segments(A, B, HLA3Segment)
    r = B.rho
    SA_SQB = A.S @ B.SQ
    return HLA3Segment(
        S=r * A.S + B.S,
        SQ=r * A.SQ + B.SQ,
        P=r * A.P + B.P,
        F=r ** 3 * A.F + B.F + r * r * (SA_SQB @ A.P) + r * (A.S @ B.R) + r * (B.N @ A.P),
        R=r * r * A.R + B.R + r * (B.SQ @ A.P),
        N=r * r * A.N + B.N + r * SA_SQB,
        p=r * A.p + B.p,
        f=r ** 3 * A.f + B.f + r * r * (SA_SQB @ A.p) + r * (A.S @ B.r) + r * (B.N @ A.p),
        r=r * r * A.r + B.r + r * (B.SQ @ A.p),
        rho=A.rho * B.rho,
    )


class HLA3PaperSegment(NamedTuple):
    """Segment summary for Algorithm 3's operator (decayed to the segment's end e; rho is the
    product of the segment's factors, and with gates gamma^(e-x) reads exp(b_e - b_x)).

    SK, SQ (d, d); P (d, dv), p (d,): decayed moments.   F (d, dv), f (d,): the operator over the
    segment alone.  Diagonal moments (two indices equal), weights gamma^(2(e-i)):
    KQ (d, d) = sum k_i (k_i.q_i) q_i^T;  QP (d, dv) = sum q_u (q_u.k_u) v_u^T, qp (d,) its v -> 1;
    M (d, d, d, dv) = sum k_i (x) k_i (x) k_i (x) v_i, Mm (d, d, d) its v -> 1: the linear map
    X -> sum k_i (k_i^T X k_i) v_i^T that a later segment needs to apply to an earlier S^Q.
    """
    SK: np.ndarray
    SQ: np.ndarray
    P: np.ndarray
    F: np.ndarray
    KQ: np.ndarray
    QP: np.ndarray
    M: np.ndarray
    p: np.ndarray
    f: np.ndarray
    qp: np.ndarray
    Mm: np.ndarray
    rho: float
    # each field's shape in d and dv (v), for the combine's checks; rho a scalar
    SHAPES = ("dd", "dd", "dv", "dv", "dd", "dv", "dddv", "d", "d", "d", "ddd", "")


def hla3_paper_segment(q, k, v, gamma: float = 1.0) -> HLA3PaperSegment:
    """One token: every triple is (t, t, t), which Algorithm 3 keeps; rho = gamma, this
    token's own factor a_t (a float in (0, 1])."""
    (q, k, v), gamma = check_token(q, k, v), check_gamma(gamma)
    qk = q @ k
    kv = np.outer(k, v)
    kkk = np.einsum("a,b,c->abc", k, k, k)
    return HLA3PaperSegment(np.outer(k, k), np.outer(q, q), kv, qk * qk * kv, qk * np.outer(k, q),
                            qk * np.outer(q, v), np.einsum("abc,e->abce", kkk, v),
                            np.array(k, copy=True), qk * qk * k, qk * q, kkk, float(gamma))


def hla3_paper_identity(d: int, dv: int, dtype=np.float64) -> HLA3PaperSegment:
    """The empty segment for :func:`hla3_paper_combine`: zeros, rho = 1."""
    d, dv = check_dims(d, dv)
    dtype = check_dtype(dtype)
    z = lambda *shape: np.zeros(shape, dtype)  # noqa: E731
    return HLA3PaperSegment(z(d, d), z(d, d), z(d, dv), z(d, dv), z(d, d), z(d, dv), z(d, d, d, dv),
                            z(d), z(d), z(d), z(d, d, d), 1.0)


def hla3_paper_combine(A: HLA3PaperSegment, B: HLA3PaperSegment) -> HLA3PaperSegment:
    """Segment A then B for Algorithm 3's operator. A kept triple that crosses the boundary has
    exactly two equal indices in B (its repeated largest index) and one in A::

        (i in A, u = j in B):  rho SK_A QP_B
        (u in A, i = j in B):  rho M_B(SQ_A),   M_B(X) = sum_i gamma^(2(e-i)) k_i (k_i^T X k_i) v_i^T
        (j in A, i = u in B):  rho KQ_B P_A
        F = rho^3 F_A + F_B + (the three);  KQ, QP, M: rho^2 X_A + X_B;  SK, SQ, P: rho X_A + X_B

    The middle family needs B's individual keys, hence the (d, d, d, dv) map M in the summary.
    """
    A, B = check_segments(A, B, HLA3PaperSegment)
    r = B.rho
    return HLA3PaperSegment(
        SK=r * A.SK + B.SK,
        SQ=r * A.SQ + B.SQ,
        P=r * A.P + B.P,
        F=r ** 3 * A.F + B.F + r * (A.SK @ B.QP + np.einsum("abce,bc->ae", B.M, A.SQ) + B.KQ @ A.P),
        KQ=r * r * A.KQ + B.KQ,
        QP=r * r * A.QP + B.QP,
        M=r * r * A.M + B.M,
        p=r * A.p + B.p,
        f=r ** 3 * A.f + B.f + r * (A.SK @ B.qp + np.einsum("abc,bc->a", B.Mm, A.SQ) + B.KQ @ A.p),
        qp=r * r * A.qp + B.qp,
        Mm=r * r * A.Mm + B.Mm,
        rho=A.rho * B.rho,
    )


def hla3_scan(Q, K, V, *, gamma=1.0, normalize: bool = False, eps: float = 1e-6,
              variant: str = "masked") -> np.ndarray:
    """Third-order HLA by a Blelloch scan of one-token segments; o_t = q_t^T F of the inclusive
    prefix. ``variant="paper"`` uses :func:`hla3_paper_combine` (d^3 dv map per segment).
    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors (token t's rho = a_t).
    Q, K (n, d); V (n, dv) -> (n, dv)."""
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    variant = check_variant(variant)
    if variant == "masked":
        make, combine, ident = hla3_segment, hla3_combine, hla3_identity
    else:
        make, combine, ident = hla3_paper_segment, hla3_paper_combine, hla3_paper_identity
    num, den = token_scan(Q, K, V, gates.a, make, combine, ident, lambda q, s: (q @ s.F, q @ s.f))
    return read_out(num, den, normalize, eps)


# --------------------------------------------------------------------------------------------
# 4. Chunked
# --------------------------------------------------------------------------------------------

def _chunk_masked(q, k, v, state, log_a):
    """One chunk of the masked operator. state = (S, P, F) before the chunk; v may carry a ones
    column; ``log_a`` (c,) the chunk's log factors (g, gamma^(c-tau), gamma^c, Gamma_p as in
    :func:`hla_ref._readout.chunk_decays` / :func:`hla_ref._checks.decay_matrix`).
    Returns the chunk's outputs and the state after it.

        Amat = Gamma_3 o ((Q S Q^T) g_u + X Wg^T)       (q_t^T S_u q_u gamma^(3(t-u)))
        Bmat = g o (Q P) + Wg V                           (row u: q_u^T P_u)
        O = g^3 o (Q F) + Amat Bmat
        F <- gamma^(3c) F + (S Q^T g + K^T Wg^T) diag(gamma^(3(c-tau))) Bmat
    """
    S, P, F = state
    dt = q.dtype
    g, to_end, rho = chunk_decays(log_a, dt)
    Gam = decay_matrix(log_a, dtype=dt)
    X = q @ k.T
    Wg = X * Gam
    Amat = Gam ** 3 * ((q @ S @ q.T) * g[None, :] + X @ Wg.T)
    Bmat = g[:, None] * (q @ P) + Wg @ v
    out = (g ** 3)[:, None] * (q @ F) + Amat @ Bmat
    SQ = (S @ q.T) * g[None, :] + k.T @ Wg.T                      # column u: S_u q_u
    F = rho ** 3 * F + SQ @ (Bmat * (to_end ** 3)[:, None])
    S = rho * S + k.T @ (k * to_end[:, None])
    P = rho * P + k.T @ (v * to_end[:, None])
    return out, (S, P, F)


def _chunk_paper(q, k, v, state, log_a):
    """One chunk of Algorithm 3's operator. state = (SK, SQ, P, F) before the chunk; ``log_a``
    (c,) the chunk's log factors (with gates, gamma^(x-y) below reads exp(b_x - b_y)).

    kappa_i = q_i . k_i, sigma_i = k_i^T SQ k_i, c_i = sum_{u<i} gamma^(i-u) (q_u . k_i)^2,
    Ws = Wg without its diagonal. Kept triples touching the chunk, for a query t in it:
      prefix triples                      g^3 o (Q F)
      (i old, u = j new)                  g o ((Gamma_2 o Q SK Q^T)(kappa o V))
      (u old, i = j new), (j old, i = u)  g o ((Gamma_2 o X)(sigma o V + kappa o (Q P)))
      (i = u >= j new)                    (Gamma_3 o X)(kappa o (Wg V))
      (i = j > u new)                     (Gamma_3 o X)(c o V)
      (u = j > i new)                     (Gamma_3 o (X Ws^T))(kappa o V)
    """
    SK, SQ, P, F = state
    c, dt = q.shape[0], q.dtype
    g, to_end, rho = chunk_decays(log_a, dt)
    Gam = decay_matrix(log_a, dtype=dt)
    X = q @ k.T
    Wg = X * Gam
    Ws = Wg - np.diag(np.diag(Wg))
    kappa = np.einsum("ij,ij->i", q, k)
    sigma = np.einsum("ia,ab,ib->i", k, SQ, k)
    cdiag = np.einsum("iu,ui->i", Gam - np.eye(c, dtype=dt), X ** 2)  # c_i: u < i
    QP_old = q @ P
    kv = kappa[:, None] * v
    mixed = ((Gam ** 2 * (q @ SK @ q.T)) @ kv
             + (Gam ** 2 * X) @ (sigma[:, None] * v + kappa[:, None] * QP_old))
    local = ((Gam ** 3 * X) @ (kappa[:, None] * (Wg @ v) + cdiag[:, None] * v)
             + (Gam ** 3 * (X @ Ws.T)) @ kv)
    out = (g ** 3)[:, None] * (q @ F) + g[:, None] * mixed + local
    # The chunk's own summary, decayed to its last token, then the combine of hla3_paper_combine.
    w2, w3 = to_end ** 2, to_end ** 3
    F_chunk = (k.T @ ((w3 * kappa)[:, None] * (Wg @ v) + (w3 * cdiag)[:, None] * v)
               + k.T @ Ws.T @ ((w3 * kappa)[:, None] * v))
    cross = SK @ (q.T @ ((w2 * kappa)[:, None] * v)) + k.T @ ((w2 * sigma)[:, None] * v) \
        + k.T @ ((w2 * kappa)[:, None] * QP_old)
    F = rho ** 3 * F + F_chunk + rho * cross
    SK = rho * SK + k.T @ (k * to_end[:, None])
    SQ = rho * SQ + q.T @ (q * to_end[:, None])
    P = rho * P + k.T @ (v * to_end[:, None])
    return out, (SK, SQ, P, F)


def hla3_chunked(Q, K, V, *, chunk_size: int = 64, gamma=1.0, normalize: bool = False,
                 eps: float = 1e-6, variant: str = "masked", return_state: bool = False):
    """Third-order HLA by chunks: dense work inside a chunk, a carried state across chunks.

    masked: state (S, P, F), d^2 + 2 d dv numbers; at gamma = 1 the chunk output is
    O = Q F + ((Q S Q^T + X Wc^T) o L)(Q P + Wc V): the recurrence
    F_t = F_{t-1} + (S_t q_t)(q_t^T P_t) of notebooks/08_third_order.ipynb, section 3, summed over
    a chunk the way notebooks/06_chunk_parallel.ipynb, section 2 does at second order, with
    q_t^T S_u q_u = (Q S Q^T + X Wc^T)[t, u] and q_u^T P_u = (Q P + Wc V)[u] inside the chunk.
    paper: state (S^K, S^Q, P, F); no d^3 map is needed when chunks run in order, because the
    earlier S^Q is known when a chunk is processed (the map only serves a fully parallel scan).
    ``gamma``: a float in (0, 1] or an array (n,) of per-token factors; inside a chunk every
    decay is exp of a running sum of log a_s <= 0 (never above 1, whatever the gates).
    Q, K (n, d); V (n, dv) -> (n, dv); any n. ``return_state`` (masked only): also return the
    carried state after the last token, the :class:`HLA3State` of :func:`hla3_stream` (the paper
    variant's chunks carry (S^K, S^Q, P, F), which is not its stream's state: refused there).
    """
    Q, K, V, gates, normalize, eps = check_common(Q, K, V, gamma, normalize, eps)
    variant = check_variant(variant)
    C = check_chunk_size(chunk_size)
    if check_flag(return_state, "return_state") and variant != "masked":
        raise ValueError("return_state is for variant='masked': the paper variant's chunks carry "
                         "(S^K, S^Q, P, F), not the (S^K, S^Q, P, G1, G2, G3) of HLA3PaperState; "
                         "hla3_stream(..., variant='paper', return_state=True) returns that")
    (n, d), dv, dt = Q.shape, V.shape[1], Q.dtype
    Vh = with_ones(V)
    zdd, zdv = np.zeros((d, d), dt), np.zeros((d, dv + 1), dt)
    if variant == "masked":
        step, state = _chunk_masked, (zdd, zdv, zdv)
    else:
        step, state = _chunk_paper, (zdd, zdd, zdv, zdv)
    out = np.zeros((n, dv + 1), dt)
    for s in range(0, n, C):
        out[s:s + C], state = step(Q[s:s + C], K[s:s + C], Vh[s:s + C], state,
                                   gates.log_a[s:s + C])
    O = read_out(out[:, :dv], out[:, dv], normalize, eps)
    if return_state:   # the ones column of P and F: p and f
        S, P, F = state
        return O, HLA3State(S, P[:, :dv], F[:, :dv], P[:, dv], F[:, dv])
    return O
