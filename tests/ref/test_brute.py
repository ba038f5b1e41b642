"""Checks of the brute-force definitions themselves (no hla_ref involved).

Two independent routes: the matrix forms at gamma = 1 from the math note's table, and the
loop-built moments at the last token (o_T = q_T^T (moment)), prefix by prefix, with decay.
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


@pytest.mark.parametrize("gamma", [1.0, 0.6])
@pytest.mark.parametrize("seed", range(2))
def test_brute_outputs_match_loop_moments(seed, gamma):
    n = 6
    Q, K, V = random_qkv(seed, n, 3, 2)
    eps = 0.25
    for t in range(n):
        q = Q[t]
        m2 = brute.hla2_moments(Q[: t + 1], K[: t + 1], V[: t + 1], gamma)
        ma = brute.ahla_moments(Q[: t + 1], K[: t + 1], V[: t + 1], gamma)
        rows = {
            "hla2": (q @ (m2["S"] @ m2["C"] - m2["G"]), q @ (m2["S"] @ m2["m"] - m2["h"])),
            "hla2_unmasked": (q @ m2["S"] @ m2["C"], q @ m2["S"] @ m2["m"]),
            "ahla": (q @ ma["E"], q @ ma["e"]),
        }
        for variant in ("masked", "paper"):
            m3 = brute.hla3_moments(Q[: t + 1], K[: t + 1], V[: t + 1], gamma, variant)
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
