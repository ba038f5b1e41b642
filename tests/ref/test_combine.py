"""Segment monoids (associativity, identity, meaning of the fields) and blelloch_scan.

With per-token gates a segment's rho is the product of its tokens' factors, and token t's
one-token segment is built with its own factor a_t; the combine operators are unchanged.
"""

import functools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from . import brute
from .helpers import PROPERTY, RTOL, fields, func, random_gates, random_qkv, rel_err

# name: (module, segment, identity, combine)
MONOIDS = {
    "hla2": ("second_order", "hla2_segment", "hla2_identity", "hla2_combine"),
    "ahla": ("asymmetric", "ahla_segment", "ahla_identity", "ahla_combine"),
    "hla3": ("third_order", "hla3_segment", "hla3_identity", "hla3_combine"),
    "hla3_paper": ("third_order", "hla3_paper_segment", "hla3_paper_identity", "hla3_paper_combine"),
}


def monoid(name):
    module, seg, ident, comb = MONOIDS[name]
    return func(module, seg), func(module, ident), func(module, comb)


def tokens(name, Q, K, V, gamma):
    """One-token segments; ``gamma`` a float or per-token gates (token t gets its own a_t)."""
    seg, _, _ = monoid(name)
    gates = np.broadcast_to(np.asarray(gamma, dtype=np.float64), Q.shape[:1])
    return [seg(Q[t], K[t], V[t], float(gates[t])) for t in range(Q.shape[0])]


def fold(name, segs, d, dv):
    _, ident, comb = monoid(name)
    return functools.reduce(comb, segs, ident(d, dv))


def assert_same_segment(a, b, tol=RTOL):
    fa, fb = fields(a), fields(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        x, y = np.asarray(fa[key], dtype=np.float64), np.asarray(fb[key], dtype=np.float64)
        scale = max(np.linalg.norm(x), np.linalg.norm(y), 1e-300)
        assert np.linalg.norm(x - y) <= tol * scale, key


def segment_differs(a, b, key):
    x, y = np.asarray(fields(a)[key]), np.asarray(fields(b)[key])
    return np.linalg.norm(x - y) / np.linalg.norm(y)


@st.composite
def three_segments(draw, gated=False):
    """Three segments of 1..5 tokens each, by folding single tokens left to right.
    ``gated``: per-token gates random_gates(seed, n, low=gamma) instead of the float gamma."""
    lengths = [draw(st.integers(1, 5)) for _ in range(3)]
    return dict(
        lengths=lengths,
        d=draw(st.integers(1, 4)),
        dv=draw(st.integers(1, 4)),
        gamma=draw(st.one_of(st.just(1.0), st.floats(0.3, 1.0))),
        seed=draw(st.integers(0, 2**32 - 1)),
        gated=gated,
    )


def spec_gamma(spec):
    n = sum(spec["lengths"])
    if spec["gated"]:
        return random_gates(spec["seed"], n, low=spec["gamma"])
    return spec["gamma"]


def build_three(name, spec):
    n = sum(spec["lengths"])
    Q, K, V = random_qkv(spec["seed"], n, spec["d"], spec["dv"])
    segs = tokens(name, Q, K, V, spec_gamma(spec))
    a, b = spec["lengths"][0], spec["lengths"][0] + spec["lengths"][1]
    return [fold(name, part, spec["d"], spec["dv"]) for part in (segs[:a], segs[a:b], segs[b:])]


@pytest.mark.parametrize("name", list(MONOIDS))
@PROPERTY
@given(spec=st.one_of(three_segments(), three_segments(gated=True)))
def test_combine_is_associative(name, spec):
    """With a constant decay, and with segments whose tokens carry different gates (so rho_A,
    rho_B, rho_C are arbitrary products, some possibly ~1e-12)."""
    _, _, comb = monoid(name)
    A, B, C = build_three(name, spec)
    assert_same_segment(comb(comb(A, B), C), comb(A, comb(B, C)))


@pytest.mark.parametrize("name", list(MONOIDS))
@PROPERTY
@given(spec=three_segments(gated=True))
def test_gated_segments_combine_to_the_moments_of_the_whole(name, spec):
    """A (B C) and (A B) C of gated segments both hold the moments of all their tokens, and each
    segment's rho is the product of its own tokens' factors."""
    _, _, comb = monoid(name)
    A, B, C = build_three(name, spec)
    n = sum(spec["lengths"])
    Q, K, V = random_qkv(spec["seed"], n, spec["d"], spec["dv"])
    a = spec_gamma(spec)
    moments, keys = SEGMENT_MEANING[name]
    want = moments(Q, K, V, a)
    for whole in (comb(comb(A, B), C), comb(A, comb(B, C))):
        got = fields(whole)
        for key in keys:
            assert rel_err(got[key], want[key]) < RTOL, key
    start = 0
    for seg, length in zip((A, B, C), spec["lengths"]):
        assert rel_err(fields(seg)["rho"], np.prod(a[start:start + length])) < 1e-14
        start += length


@pytest.mark.parametrize("name", list(MONOIDS))
@PROPERTY
@given(spec=three_segments())
def test_identity_is_two_sided(name, spec):
    _, ident, comb = monoid(name)
    A, _, _ = build_three(name, spec)
    e = ident(spec["d"], spec["dv"])
    assert_same_segment(comb(e, A), A)
    assert_same_segment(comb(A, e), A)
    assert_same_segment(comb(e, e), e)


@pytest.mark.parametrize("gated", [False, True], ids=["gamma=0.8", "gates"])
@pytest.mark.parametrize("name", list(MONOIDS))
@pytest.mark.parametrize("n", [1, 2, 5, 8, 13])
def test_blelloch_scan_of_segments_equals_serial_fold(name, n, gated):
    Q, K, V = random_qkv(100 + n, n, 3, 2)
    segs = tokens(name, Q, K, V, random_gates(n, n, low=0.3) if gated else 0.8)
    _, ident, comb = monoid(name)
    prefixes = func("scan", "blelloch_scan")(segs, comb, ident(3, 2))
    assert len(prefixes) == n
    for t in range(n):
        assert_same_segment(prefixes[t], fold(name, segs[:t], 3, 2))


# What a folded segment of tokens 0..n-1 must hold: the moments at T = n-1 (brute.py).
SEGMENT_MEANING = {
    "hla2": (brute.hla2_moments, ["S", "C", "m", "G", "h", "rho"]),
    "ahla": (brute.ahla_moments, ["P", "E", "R", "p", "e", "rho"]),
    "hla3": (brute.hla3_moments, ["S", "SQ", "P", "F", "p", "f", "rho"]),
    "hla3_paper": (lambda Q, K, V, g: brute.hla3_moments(Q, K, V, g, "paper"),
                   ["SK", "SQ", "P", "F", "p", "f", "rho"]),
}


@pytest.mark.parametrize("gamma", [pytest.param(1.0, id="gamma=1"), pytest.param(0.6, id="gamma=0.6"),
                                   pytest.param(np.array([0.5, 1.0, 0.8, 1e-12, 0.9, 0.7]),
                                                id="gates")])
@pytest.mark.parametrize("name", list(MONOIDS))
def test_folded_segment_holds_the_moments(name, gamma):
    Q, K, V = random_qkv(7, 6, 3, 2)
    got = fields(fold(name, tokens(name, Q, K, V, gamma), 3, 2))
    moments, keys = SEGMENT_MEANING[name]
    want = moments(Q, K, V, gamma)
    for key in keys:
        assert rel_err(got[key], want[key]) < RTOL, key


@pytest.mark.parametrize("name", list(MONOIDS))
def test_gated_middle_segment_holds_its_own_moments(name):
    """Folding tokens 2..5 of a gated sequence gives the moments of those tokens with their
    gates a[2:6] (the first of them, a_2, enters only rho: the decay across the segment)."""
    Q, K, V = random_qkv(9, 8, 3, 2)
    a = np.array([0.9, 0.5, 0.3, 1.0, 0.8, 0.6, 0.95, 0.7])
    got = fields(fold(name, tokens(name, Q, K, V, a)[2:6], 3, 2))
    moments, keys = SEGMENT_MEANING[name]
    want = moments(Q[2:6], K[2:6], V[2:6], a[2:6])
    for key in keys:
        assert rel_err(got[key], want[key]) < RTOL, key
    assert got["rho"] == pytest.approx(0.3 * 1.0 * 0.8 * 0.6, rel=1e-15)


def test_hla3_segment_cross_moments_without_decay():
    """At gamma = 1: R = sum_u q_u q_u^T P_{<=u} and N = sum_u S_{<=u} q_u q_u^T (section 5)."""
    Q, K, V = random_qkv(8, 6, 3, 2)
    got = fields(fold("hla3", tokens("hla3", Q, K, V, 1.0), 3, 2))
    R = sum(np.outer(Q[u], Q[u]) @ (K[: u + 1].T @ V[: u + 1]) for u in range(6))
    N = sum((K[: u + 1].T @ K[: u + 1]) @ np.outer(Q[u], Q[u]) for u in range(6))
    r = sum(np.outer(Q[u], Q[u]) @ K[: u + 1].sum(axis=0) for u in range(6))
    assert rel_err(got["R"], R) < RTOL
    assert rel_err(got["N"], N) < RTOL
    assert rel_err(got["r"], r) < RTOL


# ---------------------------------------------------------------------------
# blelloch_scan on non-commutative combines
# ---------------------------------------------------------------------------

def _concat(a, b):
    return a + b


MOD = 1_000_003


def _matmul_mod(a, b):
    """2x2 integer matrix product mod a prime: associative, not commutative, exact."""
    return tuple(tuple(sum(a[r][k] * b[k][c] for k in range(2)) % MOD for c in range(2))
                 for r in range(2))


def _random_matrices(n):
    rng = np.random.default_rng(n)
    return [tuple(tuple(int(x) for x in row) for row in rng.integers(0, 50, (2, 2)))
            for _ in range(n)]


@pytest.mark.parametrize("n", range(34))
def test_blelloch_scan_string_concatenation(n):
    items = [chr(ord("a") + t % 26) + str(t) for t in range(n)]
    got = func("scan", "blelloch_scan")(items, _concat, "")
    assert got == ["".join(items[:t]) for t in range(n)]


@pytest.mark.parametrize("n", range(34))
def test_blelloch_scan_matrix_product(n):
    items = _random_matrices(n)
    identity = ((1, 0), (0, 1))
    got = func("scan", "blelloch_scan")(items, _matmul_mod, identity)
    want, acc = [], identity
    for x in items:
        want.append(acc)
        acc = _matmul_mod(acc, x)
    assert got == want
    if n >= 2:
        assert _matmul_mod(items[0], items[1]) != _matmul_mod(items[1], items[0])


@pytest.mark.parametrize("n", range(34))
def test_blelloch_scan_record(n):
    calls = []

    def counting_concat(a, b):
        calls.append((a, b))
        return a + b

    record = []
    items = [str(t) + "," for t in range(n)]
    got = func("scan", "blelloch_scan")(items, counting_concat, "", record=record)
    assert got == ["".join(items[:t]) for t in range(n)]
    assert len(record) == len(calls)  # one entry per combine
    phases = [entry[0] for entry in record]
    assert set(phases) <= {"up", "down"}
    assert phases == sorted(phases, key=lambda p: p == "down")  # every up before every down
    for phase, level, left, right in record:
        assert isinstance(level, int) and level >= 0
        assert left != right
    # Work-efficient: padded to m = 2^ceil(log2 n) leaves, m - 1 combines each way.
    m = 1 if n <= 1 else 1 << (n - 1).bit_length()
    assert phases.count("up") == m - 1
    assert phases.count("down") == m - 1


def test_blelloch_scan_record_is_optional():
    items = list("abcde")
    assert func("scan", "blelloch_scan")(items, _concat, "") == ["", "a", "ab", "abc", "abcd"]


@pytest.mark.parametrize("n", range(12))
def test_serial_and_inclusive_scans(n):
    items = [str(t) + "," for t in range(n)]
    serial = func("scan", "serial_exclusive_scan")(items, _concat, "")
    inclusive = func("scan", "inclusive_scan")(items, _concat, "")
    assert serial == ["".join(items[:t]) for t in range(n)]
    assert inclusive == ["".join(items[: t + 1]) for t in range(n)]
