"""Brute-force HLA operators, written straight from the index sums.

Nothing here imports hla_ref.  Every operator is evaluated in float64 by building the
full tensor of index tuples (one axis per summation index), zeroing the tuples the
definition excludes, and summing.  That is O(n^2) to O(n^4) work and memory, which is
fine for the n <= ~40 the tests use, and it keeps each definition one readable line.

Notation: X[a, b] = q_a . k_b.  Output row t is a sum over the other indices of
    weight(t, ...) * v_j,
and the normalized output divides by the same sum with v_j replaced by 1, plus eps:
    out = num / (den + eps).

Decay.  ``gamma`` is a float in (0, 1] or an array (n,) of per-token gates a_t in (0, 1].
A term with summed indices x_1..x_p read at token t carries
    float gamma:  gamma ** (p t - x_1 - ... - x_p)               (integer powers, as printed)
    gates:        exp(p b_t - b_{x_1} - ... - b_{x_p}),  b_t = sum_{s <= t} log a_s
(evaluated only where the tuple is allowed, so the exponent is never positive).  The two
branches share no code: the tests check that gates all equal to gamma give the float result.
"""

import numpy as np


def _f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def _grid(n, axes):
    """Index arrays (t, i, ...) broadcasting to an n**axes tensor, t on axis 0."""
    return np.ogrid[tuple(slice(0, n) for _ in range(axes))]


def is_gated(gamma):
    return np.ndim(gamma) > 0


def cumulative_log(gates):
    """b_t = sum_{s <= t} log a_s (float64) of per-token gates a."""
    return np.cumsum(np.log(np.asarray(gates, dtype=np.float64)))


def decay(gamma, t, *xs):
    """The decay weight of summed indices xs read at token t (all xs <= t, broadcasting):
    gamma ** (p t - sum xs) for a float, exp(p b_t - sum b_x) for gates (p = len(xs))."""
    if not is_gated(gamma):
        return float(gamma) ** (len(xs) * np.asarray(t) - sum(np.asarray(x) for x in xs))
    b = cumulative_log(gamma)
    return np.exp(len(xs) * b[t] - sum(b[x] for x in xs))


def _decayed(allowed, gamma, t, *xs):
    """decay(gamma, t, *xs) where allowed, 0 elsewhere.  Outside the allowed tuples every index
    is replaced by t first, so no positive exponent is ever evaluated."""
    shape = np.broadcast_shapes(np.shape(allowed), np.shape(t), *(np.shape(x) for x in xs))
    allowed = np.broadcast_to(allowed, shape)
    xs = [np.where(allowed, x, t) for x in xs]
    t = np.broadcast_to(t, shape)
    return np.where(allowed, decay(gamma, t, *xs), 0.0)


def rho(gamma, n):
    """Decay across a whole run of n tokens: gamma ** n, or the product of the n gates."""
    if not is_gated(gamma):
        return float(gamma) ** n
    return float(np.prod(np.asarray(gamma, dtype=np.float64)))


def _finish(weight, V, normalize, eps, extra=None):
    """Contract a weight tensor whose first axis is t and last axis is j with V.

    extra: optional (num, den) pair added before normalizing (used for the ridge term).
    """
    n = weight.shape[0]
    flat = weight.reshape(n, -1, n).sum(axis=1)  # sum over the middle indices -> (t, j)
    num = flat @ V
    den = flat.sum(axis=1)
    if extra is not None:
        num = num + extra[0]
        den = den + extra[1]
    if normalize:
        return num / (den + eps)[:, None]
    return num


def linear_sums(Q, K, V, gamma):
    """num, den of o_t = sum_{j<=t} gamma^(t-j) (q_t.k_j) v_j  (gates: exp(b_t - b_j))."""
    Q, K, V = _f64(Q, K, V)
    t, j = _grid(Q.shape[0], 2)
    X = np.einsum("ad,bd->ab", Q, K)
    w = _decayed(j <= t, gamma, t, j) * X[t, j]
    return w @ V, w.sum(axis=1)


def linear_attention(Q, K, V, *, gamma=1.0, normalize=False, eps=1e-6):
    """o_t = sum_{j<=t} gamma^(t-j) (q_t.k_j) v_j  (gates: exp(b_t - b_j))."""
    num, den = linear_sums(Q, K, V, gamma)
    return num / (den + eps)[:, None] if normalize else num


def hla2(Q, K, V, *, gamma=1.0, normalize=False, eps=1e-6, masked=True, ridge=0.0):
    """Second order.

    masked:   o_t = sum_{i<=j<=t}   gamma^(2t-i-j) (q_t.k_i)(q_j.k_i) v_j
    unmasked: o_t = sum_{i,j<=t}    (same weight)               (paper eq. 3.1)
    (gates: exp(2 b_t - b_i - b_j))
    ridge lam adds lam * q_t^T C_t = lam * sum_{j<=t} gamma^(t-j) (q_t.q_j) v_j
    (that is lam*I added to S^K in the read-out q_t^T (S_t C_t - G_t)).
    """
    Q, K, V = _f64(Q, K, V)
    n = Q.shape[0]
    t, i, j = _grid(n, 3)
    X = np.einsum("ad,bd->ab", Q, K)
    allowed = (i <= t) & (j <= t)
    if masked:
        allowed = allowed & (i <= j)
    w = _decayed(allowed, gamma, t, i, j) * X[t, i] * X[j, i]
    extra = None
    if ridge:
        num_r, den_r = linear_sums(Q, Q, V, gamma)
        extra = (ridge * num_r, ridge * den_r)
    return _finish(w, V, normalize, eps, extra)


def ahla(Q, K, V, *, gamma=1.0, normalize=False, eps=1e-6):
    """o_t = sum_{j<=i<=t} gamma^(t-j) (q_t.k_i)(q_i.k_j) v_j  (gates: exp(b_t - b_j))."""
    Q, K, V = _f64(Q, K, V)
    t, i, j = _grid(Q.shape[0], 3)
    X = np.einsum("ad,bd->ab", Q, K)
    w = _decayed((j <= i) & (i <= t), gamma, t, j) * X[t, i] * X[i, j]
    return _finish(w, V, normalize, eps)


def _hla3_allowed(t, i, u, j, variant):
    if variant == "masked":
        return (i <= u) & (j <= u) & (u <= t)
    if variant == "paper":
        # i, u, j <= t and the largest of the three occurs at least twice
        top = np.maximum(np.maximum(i, u), j)
        count = (i == top).astype(int) + (u == top) + (j == top)
        return (i <= t) & (u <= t) & (j <= t) & (count >= 2)
    raise ValueError(variant)


def hla3(Q, K, V, *, gamma=1.0, normalize=False, eps=1e-6, variant="masked"):
    """Third order, o_t = sum gamma^(3t-i-u-j) (q_t.k_i)(k_i.q_u)(q_u.k_j) v_j over

    masked: i <= u, j <= u, u <= t
    paper:  i, u, j <= t whose largest index occurs at least twice (what Alg. 3 computes)
    (gates: exp(3 b_t - b_i - b_u - b_j))
    """
    Q, K, V = _f64(Q, K, V)
    t, i, u, j = _grid(Q.shape[0], 4)
    X = np.einsum("ad,bd->ab", Q, K)
    w = _decayed(_hla3_allowed(t, i, u, j, variant), gamma, t, i, u, j)
    w = w * X[t, i] * X[u, i] * X[u, j]
    return _finish(w, V, normalize, eps)


def softmax_attention(Q, K, V, *, causal=True, scale=None):
    """o_t = sum_j softmax_j(scale * q_t.k_j) v_j over j <= t (causal) or all j."""
    Q, K, V = _f64(Q, K, V)
    n, d = Q.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((n, V.shape[1]))
    for t in range(n):
        js = range(t + 1) if causal else range(n)
        s = np.array([scale * (Q[t] @ K[j]) for j in js])
        p = np.exp(s - s.max())
        out[t] = sum(p[m] * V[j] for m, j in enumerate(js)) / p.sum()
    return out


# ---------------------------------------------------------------------------
# Moments at the last token T = n - 1, written as explicit loops over tokens.
# These define what the stream states and the folded segments must hold.
# gamma ** (T - i) reads decay(gamma, T, i), gamma ** (2T - i - j) decay(gamma, T, i, j), ...
# ---------------------------------------------------------------------------

def _outer(a, b):
    return np.multiply.outer(a, b)


def hla2_moments(Q, K, V, gamma):
    """S, C, m, G, h at T = n-1.  G, h are the i > j part of S C, S m (what the mask removes)."""
    Q, K, V = _f64(Q, K, V)
    n, d = Q.shape
    T = n - 1
    out = dict(S=np.zeros((d, d)), C=np.zeros((d, V.shape[1])), m=np.zeros(d),
               G=np.zeros((d, V.shape[1])), h=np.zeros(d))
    for i in range(n):
        out["S"] += decay(gamma, T, i) * _outer(K[i], K[i])
        out["C"] += decay(gamma, T, i) * _outer(Q[i], V[i])
        out["m"] += decay(gamma, T, i) * Q[i]
        for j in range(i):  # j < i
            w = decay(gamma, T, i, j) * (K[i] @ Q[j])
            out["G"] += w * _outer(K[i], V[j])
            out["h"] += w * K[i]
    out["rho"] = rho(gamma, n)
    return out


def ahla_moments(Q, K, V, gamma):
    """P, E, p, e at T = n-1 and the undecayed R = sum k_i q_i^T."""
    Q, K, V = _f64(Q, K, V)
    n, d = Q.shape
    T = n - 1
    out = dict(P=np.zeros((d, V.shape[1])), E=np.zeros((d, V.shape[1])), p=np.zeros(d),
               e=np.zeros(d), R=np.zeros((d, d)))
    for i in range(n):
        out["P"] += decay(gamma, T, i) * _outer(K[i], V[i])
        out["p"] += decay(gamma, T, i) * K[i]
        out["R"] += _outer(K[i], Q[i])
        for j in range(i + 1):  # j <= i
            w = decay(gamma, T, j) * (Q[i] @ K[j])
            out["E"] += w * _outer(K[i], V[j])
            out["e"] += w * K[i]
    out["rho"] = rho(gamma, n)
    return out


def hla3_moments(Q, K, V, gamma, variant="masked"):
    """S (=S^K), SQ, P, p, F, f at T = n-1, and for the paper variant G1, G2, G3, g1, g2, g3.

    F = sum over the variant's (i, u, j) of gamma^(3T-i-u-j) k_i (k_i.q_u)(q_u.k_j) v_j^T,
    so that o_T = q_T^T F.  G1 / G2 / G3 are the same sum restricted to i / u / j being the
    strict maximum (the terms Algorithm 3 subtracts from S^K S^Q P).
    """
    Q, K, V = _f64(Q, K, V)
    n, d = Q.shape
    dv = V.shape[1]
    T = n - 1
    out = dict(S=np.zeros((d, d)), SQ=np.zeros((d, d)), P=np.zeros((d, dv)), p=np.zeros(d),
               F=np.zeros((d, dv)), f=np.zeros(d))
    for name in ("G1", "G2", "G3"):
        out[name] = np.zeros((d, dv))
        out[name.lower()] = np.zeros(d)
    for x in range(n):
        out["S"] += decay(gamma, T, x) * _outer(K[x], K[x])
        out["SQ"] += decay(gamma, T, x) * _outer(Q[x], Q[x])
        out["P"] += decay(gamma, T, x) * _outer(K[x], V[x])
        out["p"] += decay(gamma, T, x) * K[x]
    for i in range(n):
        for u in range(n):
            for j in range(n):
                w = decay(gamma, T, i, u, j) * (K[i] @ Q[u]) * (Q[u] @ K[j])
                term, term1 = w * _outer(K[i], V[j]), w * K[i]
                top = max(i, u, j)
                count = (i == top) + (u == top) + (j == top)
                keep = (i <= u and j <= u) if variant == "masked" else count >= 2
                if keep:
                    out["F"] += term
                    out["f"] += term1
                if count == 1:
                    which = "G1" if i == top else ("G2" if u == top else "G3")
                    out[which] += term
                    out[which.lower()] += term1
    out["SK"] = out["S"]
    out["rho"] = rho(gamma, n)
    return out
