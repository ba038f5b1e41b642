"""Checks of the brute-force definitions themselves (no hla_ref involved).

Two independent routes: the matrix forms at gamma = 1 from the math note's table, and the
loop-built moments at the last token (o_T = q_T^T (moment)), prefix by prefix, with decay.
Per-token gates get two more: gates all equal to gamma against the integer powers gamma^(...),
and plain loops that multiply the gates a_{x+1} ... a_t of every index (no logs, no b).
"""

import numpy as np
import pytest

from . import brute
from .helpers import random_qkv, rel_err

TOL = 1e-12  # n <= 9 here, so float64 rounding stays far below this


def _masked_w(Q, K):
    n = Q.shape[0]
    return np.tril(Q @ K.T), np.tril(np.ones((n, n)))


@pytest.mark.parametrize("seed", range(3))
def test_brute_matches_matrix_forms_without_decay(seed):
    Q, K, V = random_qkv(seed, 9, 3, 2)
    W, L = _masked_w(Q, K)
    X = Q @ K.T
    assert rel_err(brute.linear_attention(Q, K, V), W @ V) < TOL
    assert rel_err(brute.hla2(Q, K, V), ((W @ W.T) * L) @ V) < TOL
    assert rel_err(brute.hla2(Q, K, V, masked=False), ((W @ X.T) * L) @ V) < TOL
    assert rel_err(brute.ahla(Q, K, V), ((W @ W) * L) @ V) < TOL
    assert rel_err(brute.hla3(Q, K, V), ((((W @ W.T) * L) @ W) * L) @ V) < TOL


GATES6 = np.array([0.7, 0.4, 1.0, 0.9, 1e-3, 0.8])


@pytest.mark.parametrize("gamma", [pytest.param(1.0, id="gamma=1"), pytest.param(0.6, id="gamma=0.6"),
                                   pytest.param(GATES6, id="gates")])
@pytest.mark.parametrize("seed", range(2))
def test_brute_outputs_match_loop_moments(seed, gamma):
    n = 6
    Q, K, V = random_qkv(seed, n, 3, 2)
    eps = 0.25
    for t in range(n):
        q = Q[t]
        g = gamma[: t + 1] if np.ndim(gamma) else gamma    # the gates of the prefix
        m2 = brute.hla2_moments(Q[: t + 1], K[: t + 1], V[: t + 1], g)
        ma = brute.ahla_moments(Q[: t + 1], K[: t + 1], V[: t + 1], g)
        rows = {
            "hla2": (q @ (m2["S"] @ m2["C"] - m2["G"]), q @ (m2["S"] @ m2["m"] - m2["h"])),
            "hla2_unmasked": (q @ m2["S"] @ m2["C"], q @ m2["S"] @ m2["m"]),
            "ahla": (q @ ma["E"], q @ ma["e"]),
        }
        for variant in ("masked", "paper"):
            m3 = brute.hla3_moments(Q[: t + 1], K[: t + 1], V[: t + 1], g, variant)
            rows[f"hla3_{variant}"] = (q @ m3["F"], q @ m3["f"])
            if variant == "paper":
                # Algorithm 3's read-out: F = S^K S^Q P - G1 - G2 - G3
                F = m3["SK"] @ m3["SQ"] @ m3["P"] - m3["G1"] - m3["G2"] - m3["G3"]
                assert rel_err(F, m3["F"]) < TOL
        full = {
            "hla2": lambda **kw: brute.hla2(Q, K, V, gamma=gamma, **kw),
            "hla2_unmasked": lambda **kw: brute.hla2(Q, K, V, gamma=gamma, masked=False, **kw),
            "ahla": lambda **kw: brute.ahla(Q, K, V, gamma=gamma, **kw),
            "hla3_masked": lambda **kw: brute.hla3(Q, K, V, gamma=gamma, **kw),
            "hla3_paper": lambda **kw: brute.hla3(Q, K, V, gamma=gamma, variant="paper", **kw),
        }
        for name, (num, den) in rows.items():
            assert rel_err(full[name]()[t], num) < TOL, name
            want = num / (den + eps)
            assert rel_err(full[name](normalize=True, eps=eps)[t], want) < TOL, name


def test_brute_paper_variant_by_enumeration():
    """The paper set, enumerated by hand for n = 3: 'largest index occurs at least twice'."""
    Q, K, V = random_qkv(5, 3, 2, 2)
    gamma = 0.7
    out = np.zeros((3, 2))
    for t in range(3):
        for i in range(t + 1):
            for u in range(t + 1):
                for j in range(t + 1):
                    top = max(i, u, j)
                    if [i, u, j].count(top) >= 2:
                        out[t] += (gamma ** (3 * t - i - u - j) * (Q[t] @ K[i]) * (K[i] @ Q[u])
                                   * (Q[u] @ K[j]) * V[j])
    assert rel_err(brute.hla3(Q, K, V, gamma=gamma, variant="paper"), out) < TOL


def test_brute_softmax_is_a_convex_combination():
    Q, K, V = random_qkv(1, 5, 3, 2)
    out = brute.softmax_attention(Q, K, V)
    assert np.allclose(out[0], V[0])
    s = Q[4] @ K.T / np.sqrt(3)
    p = np.exp(s) / np.exp(s).sum()
    assert rel_err(brute.softmax_attention(Q, K, V, causal=False)[4], p @ V) < TOL


# ---------------------------------------------------------------------------
# Per-token gates
# ---------------------------------------------------------------------------

BRUTE_OPS = {
    "linear": brute.linear_attention,
    "hla2": brute.hla2,
    "hla2_unmasked": lambda Q, K, V, **kw: brute.hla2(Q, K, V, masked=False, **kw),
    "ahla": brute.ahla,
    "hla3_masked": brute.hla3,
    "hla3_paper": lambda Q, K, V, **kw: brute.hla3(Q, K, V, variant="paper", **kw),
}


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.8, 0.2])
@pytest.mark.parametrize("op", list(BRUTE_OPS))
def test_brute_constant_gates_equal_integer_powers(op, gamma, normalize):
    """b_t = (t + 1) log gamma turns exp(p b_t - sum b_x) into gamma^(p t - sum x)."""
    Q, K, V = random_qkv(4, 8, 3, 2)
    fn = BRUTE_OPS[op]
    got = fn(Q, K, V, gamma=np.full(8, gamma), normalize=normalize, eps=0.3)
    assert rel_err(got, fn(Q, K, V, gamma=gamma, normalize=normalize, eps=0.3)) < TOL


@pytest.mark.parametrize("gamma", [0.8, 0.2])
def test_brute_constant_gates_give_the_same_moments(gamma):
    Q, K, V = random_qkv(6, 5, 2, 3)
    a = np.full(5, gamma)
    pairs = [(brute.hla2_moments(Q, K, V, a), brute.hla2_moments(Q, K, V, gamma)),
             (brute.ahla_moments(Q, K, V, a), brute.ahla_moments(Q, K, V, gamma))]
    for variant in ("masked", "paper"):
        pairs.append((brute.hla3_moments(Q, K, V, a, variant),
                      brute.hla3_moments(Q, K, V, gamma, variant)))
    for got, want in pairs:
        assert got.keys() == want.keys()
        for key in want:
            assert rel_err(got[key], want[key]) < TOL, key


def _age(a, x, t):
    """a_{x+1} ... a_t: how much a term that entered at token x has decayed by token t."""
    return float(np.prod(a[x + 1: t + 1]))


def _by_products(op, Q, K, V, a):
    """Each operator by explicit loops, weights as products of the gates of every index."""
    n, X = len(a), Q @ K.T
    out = np.zeros((n, V.shape[1]))
    for t in range(n):
        if op == "linear":
            for j in range(t + 1):
                out[t] += _age(a, j, t) * X[t, j] * V[j]
        elif op in ("hla2", "hla2_unmasked"):
            for i in range(t + 1):
                for j in range(t + 1):
                    if op == "hla2" and i > j:
                        continue
                    out[t] += _age(a, i, t) * _age(a, j, t) * X[t, i] * X[j, i] * V[j]
        elif op == "ahla":
            for i in range(t + 1):
                for j in range(i + 1):
                    out[t] += _age(a, j, t) * X[t, i] * X[i, j] * V[j]
        else:
            for i in range(t + 1):
                for u in range(t + 1):
                    for j in range(t + 1):
                        top = max(i, u, j)
                        keep = (i <= u and j <= u) if op == "hla3_masked" else \
                            [i, u, j].count(top) >= 2
                        if keep:
                            w = _age(a, i, t) * _age(a, u, t) * _age(a, j, t)
                            out[t] += w * X[t, i] * X[u, i] * X[u, j] * V[j]
    return out


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("op", list(BRUTE_OPS))
def test_brute_gates_match_products_of_gates(op, seed):
    """exp(p b_t - sum b_x) = prod_x (a_{x+1} ... a_t), including a closing gate."""
    Q, K, V = random_qkv(seed, 7, 3, 2)
    a = np.random.default_rng(seed).uniform(0.2, 1.0, 7)
    a[4] = 1e-12
    assert rel_err(BRUTE_OPS[op](Q, K, V, gamma=a), _by_products(op, Q, K, V, a)) < TOL
