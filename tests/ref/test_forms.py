"""Every fast form of every operator against the brute-force index sums, with a constant decay
and with per-token gates."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from . import brute
from .helpers import (
    PROPERTY, RTOL, Problem, fields, func, problems, random_gates, random_qkv, rel_err,
)

# (operator, module, function, fixed keyword arguments, takes chunk_size)
FORMS = [
    ("hla2", "second_order", "hla2_naive", {}, False),
    ("hla2", "second_order", "hla2_stream", {}, False),
    ("hla2", "second_order", "hla2_stream", {"compact": True}, False),
    ("hla2", "second_order", "hla2_scan", {}, False),
    ("hla2", "second_order", "hla2_chunked", {}, True),
    ("hla2_unmasked", "second_order", "hla2_naive", {"masked": False}, False),
    ("hla2_unmasked", "second_order", "hla2_stream", {"masked": False}, False),
    ("ahla", "asymmetric", "ahla_naive", {}, False),
    ("ahla", "asymmetric", "ahla_stream", {}, False),
    ("ahla", "asymmetric", "ahla_scan", {}, False),
    ("ahla", "asymmetric", "ahla_chunked", {}, True),
    ("linear", "baselines", "linear_attention", {}, False),
]
for _variant in ("masked", "paper"):
    for _form, _chunk in (("naive", False), ("stream", False), ("scan", False), ("chunked", True)):
        FORMS.append((f"hla3_{_variant}", "third_order", f"hla3_{_form}", {"variant": _variant}, _chunk))

BRUTE = {
    "hla2": brute.hla2,
    "hla2_unmasked": lambda Q, K, V, **kw: brute.hla2(Q, K, V, masked=False, **kw),
    "ahla": brute.ahla,
    "hla3_masked": brute.hla3,
    "hla3_paper": lambda Q, K, V, **kw: brute.hla3(Q, K, V, variant="paper", **kw),
    "linear": brute.linear_attention,
}


def _form_id(form):
    op, _, name, kw, _ = form
    extra = ",".join(f"{k}={v}" for k, v in kw.items())
    return f"{op}-{name}" + (f"[{extra}]" if extra else "")


def run_form(form, Q, K, V, *, gamma, normalize, eps, chunk_size):
    _, module, name, kw, chunked = form
    kwargs = dict(kw, gamma=gamma, normalize=normalize, eps=eps)
    if chunked:
        kwargs["chunk_size"] = chunk_size
    return func(module, name)(Q, K, V, **kwargs)


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
@PROPERTY
@given(p=problems())
@example(p=Problem(n=1, d=1, dv=1, gamma=1.0, normalize=False, eps=1e-6, chunk_size=1, seed=0))
@example(p=Problem(n=1, d=3, dv=2, gamma=0.5, normalize=True, eps=1e-6, chunk_size=4, seed=1))
@example(p=Problem(n=7, d=2, dv=5, gamma=0.7, normalize=False, eps=1e-6, chunk_size=3, seed=2))
@example(p=Problem(n=13, d=4, dv=1, gamma=1.0, normalize=True, eps=0.5, chunk_size=64, seed=3))
@example(p=Problem(n=33, d=5, dv=3, gamma=0.9, normalize=False, eps=1e-6, chunk_size=8, seed=4))
@example(p=Problem(n=40, d=6, dv=6, gamma=0.95, normalize=True, eps=1e-6, chunk_size=1, seed=5))
def test_form_matches_brute_force(form, p):
    Q, K, V = p.arrays()
    want = BRUTE[form[0]](Q, K, V, gamma=p.gamma, normalize=p.normalize, eps=p.eps)
    got = run_form(form, Q, K, V, gamma=p.gamma, normalize=p.normalize, eps=p.eps,
                   chunk_size=p.chunk_size)
    assert got.shape == (p.n, p.dv)
    assert got.dtype == np.float64
    assert rel_err(got, want) < RTOL


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
@PROPERTY
@given(p=problems(gates=("random", "closing")))
@example(p=Problem(n=1, d=1, dv=1, gamma=0.5, normalize=False, eps=1e-6, chunk_size=1, seed=0,
                   gates="random"))
@example(p=Problem(n=1, d=3, dv=2, gamma=0.5, normalize=True, eps=1e-6, chunk_size=4, seed=1,
                   gates="closing"))
@example(p=Problem(n=7, d=2, dv=5, gamma=0.3, normalize=False, eps=1e-6, chunk_size=3, seed=2,
                   gates="random"))
@example(p=Problem(n=13, d=4, dv=1, gamma=0.05, normalize=True, eps=0.5, chunk_size=5, seed=3,
                   gates="closing"))
@example(p=Problem(n=33, d=5, dv=3, gamma=0.9, normalize=False, eps=1e-6, chunk_size=8, seed=4,
                   gates="closing"))
@example(p=Problem(n=40, d=6, dv=6, gamma=0.5, normalize=True, eps=1e-6, chunk_size=7, seed=5,
                   gates="random"))
def test_form_matches_brute_force_with_gates(form, p):
    """Per-token gates a_t: weights exp(p b_t - sum b_x); every form against the brute force."""
    Q, K, V = p.arrays()
    gamma = p.gamma_arg()
    assert np.shape(gamma) == (p.n,)
    want = BRUTE[form[0]](Q, K, V, gamma=gamma, normalize=p.normalize, eps=p.eps)
    got = run_form(form, Q, K, V, gamma=gamma, normalize=p.normalize, eps=p.eps,
                   chunk_size=p.chunk_size)
    assert got.shape == (p.n, p.dv)
    assert got.dtype == np.float64
    assert rel_err(got, want) < RTOL


@pytest.mark.parametrize("masked", [True, False])
@PROPERTY
@given(p=problems(max_n=25, gates=("float", "random", "closing")),
       ridge=st.sampled_from([0.0, 1e-3, 0.5, 2.0]))
def test_hla2_stream_ridge_matches_brute_force(masked, p, ridge):
    Q, K, V = p.arrays()
    gamma = p.gamma_arg()
    want = brute.hla2(Q, K, V, gamma=gamma, normalize=p.normalize, eps=p.eps, masked=masked,
                      ridge=ridge)
    got = func("second_order", "hla2_stream")(Q, K, V, gamma=gamma, normalize=p.normalize,
                                               eps=p.eps, masked=masked, ridge=ridge)
    assert rel_err(got, want) < RTOL


# A fixed set of gates for the deterministic tests: uneven, one almost closed (1e-12 at 3).
GATES12 = np.array([0.9, 0.5, 1.0, 1e-12, 0.8, 0.95, 0.3, 1.0, 0.7, 0.99, 0.6, 0.85])
GAMMAS_DET = [pytest.param(0.8, id="gamma=0.8"), pytest.param(GATES12, id="gates")]


@pytest.mark.parametrize("gamma", GAMMAS_DET)
@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_form_is_causal(form, gamma):
    """Changing tokens after t leaves rows <= t unchanged."""
    Q, K, V = random_qkv(11, 12, 3, 2)
    Q2, K2, V2 = random_qkv(12, 12, 3, 2)
    t = 6
    Q2[: t + 1], K2[: t + 1], V2[: t + 1] = Q[: t + 1], K[: t + 1], V[: t + 1]
    kw = dict(gamma=gamma, normalize=False, eps=1e-6, chunk_size=4)
    a = run_form(form, Q, K, V, **kw)
    b = run_form(form, Q2, K2, V2, **kw)
    assert rel_err(b[: t + 1], a[: t + 1]) < RTOL
    assert rel_err(b[t + 1:], a[t + 1:]) > 1e-3  # the later rows do see the change


def _signed_well_conditioned(op, n=4, d=3, dv=2, gamma=0.8, margin=0.1):
    """First seed whose denominators are signed (some negative) yet all far from zero.

    margin is relative to the same sum with |q|, |k| (a bound on the sum of |terms|),
    so the division loses at most a factor 1/margin of accuracy.
    """
    ones = np.ones((n, 1))
    for seed in range(10_000):
        Q, K, V = random_qkv(seed, n, d, dv)
        den = BRUTE[op](Q, K, ones, gamma=gamma)[:, 0]
        bound = BRUTE[op](np.abs(Q), np.abs(K), ones, gamma=gamma)[:, 0]
        if den.min() < 0 and np.all(np.abs(den) > margin * bound):
            return Q, K, V
    raise AssertionError("no well-conditioned signed example found")


@pytest.mark.parametrize("gamma", [pytest.param(0.8, id="gamma=0.8"),
                                   pytest.param(np.array([0.9, 0.4, 1.0, 0.7]), id="gates")])
@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_normalized_form_with_negative_denominator(form, gamma):
    """den + eps is used as is: a negative den is not clipped or replaced by |den|."""
    Q, K, V = _signed_well_conditioned(form[0], gamma=gamma)
    want = BRUTE[form[0]](Q, K, V, gamma=gamma, normalize=True, eps=1e-6)
    got = run_form(form, Q, K, V, gamma=gamma, normalize=True, eps=1e-6, chunk_size=3)
    assert rel_err(got, want) < RTOL


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_softmax_attention_matches_brute_force(causal, scale):
    Q, K, V = random_qkv(3, 9, 4, 3)
    got = func("baselines", "softmax_attention")(Q, K, V, causal=causal, scale=scale)
    assert rel_err(got, brute.softmax_attention(Q, K, V, causal=causal, scale=scale)) < RTOL


@pytest.mark.parametrize("n", [0, 1, 2, 7])
def test_causal_mask(n):
    mask = func("baselines", "causal_mask")(n)
    want = np.array([[j <= i for j in range(n)] for i in range(n)], dtype=bool).reshape(n, n)
    assert mask.dtype == bool
    assert np.array_equal(mask, want)


# ---------------------------------------------------------------------------
# Stream states: return_state gives the same output, and the state holds the moments
# at the last token exactly as brute.*_moments defines them.
# ---------------------------------------------------------------------------

STATE_FIELDS = {
    # (module, function, fixed kwargs): (moments function, {state field: moment name})
    ("second_order", "hla2_stream", ()): (
        brute.hla2_moments, {"S": "S", "C": "C", "m": "m", "G": "G", "h": "h"}),
    ("asymmetric", "ahla_stream", ()): (
        brute.ahla_moments, {"P": "P", "E": "E", "p": "p", "e": "e"}),
    ("third_order", "hla3_stream", (("variant", "masked"),)): (
        brute.hla3_moments, {"S": "S", "P": "P", "F": "F", "p": "p", "f": "f"}),
    ("third_order", "hla3_stream", (("variant", "paper"),)): (
        lambda Q, K, V, g: brute.hla3_moments(Q, K, V, g, "paper"),
        {"SK": "SK", "SQ": "SQ", "P": "P", "G1": "G1", "G2": "G2", "G3": "G3",
         "p": "p", "g1": "g1", "g2": "g2", "g3": "g3"}),
}


GAMMAS7 = [pytest.param(1.0, id="gamma=1"), pytest.param(0.7, id="gamma=0.7"),
           pytest.param(np.array([0.6, 1.0, 0.9, 1e-12, 0.5, 0.8, 0.95]), id="gates")]


@pytest.mark.parametrize("gamma", GAMMAS7)
@pytest.mark.parametrize("key", list(STATE_FIELDS), ids=lambda k: "-".join([k[1]] + [v for _, v in k[2]]))
def test_stream_state_holds_the_moments(key, gamma):
    module, name, kw = key
    moments, names = STATE_FIELDS[key]
    Q, K, V = random_qkv(21, 7, 3, 2)
    fn = func(module, name)
    out, state = fn(Q, K, V, gamma=gamma, return_state=True, **dict(kw))
    assert np.array_equal(out, fn(Q, K, V, gamma=gamma, **dict(kw)))
    want = moments(Q, K, V, gamma)
    got = fields(state)
    assert set(names) <= set(got), sorted(got)
    for field, moment in names.items():
        assert rel_err(got[field], want[moment]) < RTOL, field


@pytest.mark.parametrize("gamma", [pytest.param(1.0, id="gamma=1"),
                                   pytest.param(0.7, id="gamma=0.7"),
                                   pytest.param(random_gates(22, 9, low=0.3), id="gates")])
def test_hla2_compact_state(gamma):
    """compact=True carries (S, W, z) with W = S C - G and z = S m - h."""
    Q, K, V = random_qkv(22, 9, 4, 2)
    fn = func("second_order", "hla2_stream")
    out, state = fn(Q, K, V, gamma=gamma, compact=True, return_state=True)
    assert rel_err(out, brute.hla2(Q, K, V, gamma=gamma)) < RTOL
    got = fields(state)
    assert set(got) == {"S", "W", "z"}
    m = brute.hla2_moments(Q, K, V, gamma)
    assert rel_err(got["S"], m["S"]) < RTOL
    assert rel_err(got["W"], m["S"] @ m["C"] - m["G"]) < RTOL
    assert rel_err(got["z"], m["S"] @ m["m"] - m["h"]) < RTOL


# ---------------------------------------------------------------------------
# The weight matrices: o = T V
# ---------------------------------------------------------------------------

WEIGHTS = [
    ("hla2", "second_order", "hla2_weights", {}),
    ("hla2_unmasked", "second_order", "hla2_weights", {"masked": False}),
    ("ahla", "asymmetric", "ahla_weights", {}),
    ("hla3_masked", "third_order", "hla3_weights", {"variant": "masked"}),
    ("hla3_paper", "third_order", "hla3_weights", {"variant": "paper"}),
]


@pytest.mark.parametrize("op,module,name,kw", WEIGHTS, ids=[w[0] for w in WEIGHTS])
@PROPERTY
@given(p=problems(max_n=20, gates=("float", "random", "closing")))
def test_weights_times_v_matches_brute_force(op, module, name, kw, p):
    Q, K, V = p.arrays()
    gamma = p.gamma_arg()
    T = func(module, name)(Q, K, gamma=gamma, **kw)
    assert T.shape == (p.n, p.n)
    assert np.all(np.triu(T, 1) == 0)  # causal
    assert rel_err(T @ V, BRUTE[op](Q, K, V, gamma=gamma)) < RTOL


def test_largest_index_twice():
    fn = func("third_order", "largest_index_twice")
    for i in range(4):
        for u in range(4):
            for j in range(4):
                assert bool(fn(i, u, j)) == ([i, u, j].count(max(i, u, j)) >= 2)


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
@pytest.mark.parametrize("gamma", [pytest.param(1.0, id="gamma=1"),
                                   pytest.param(0.7, id="gamma=0.7"),
                                   pytest.param(random_gates(23, 8, low=0.2), id="gates")])
def test_chunked_states_hold_the_moments(gamma, chunk_size):
    """hla2_chunked carries the compact (S, W, z); ahla_chunked carries (P, E, p, e); hla3_chunked
    (masked) carries its stream's (S, P, F, p, f)."""
    Q, K, V = random_qkv(23, 8, 3, 2)
    out, state = func("second_order", "hla2_chunked")(Q, K, V, gamma=gamma, chunk_size=chunk_size,
                                                      return_state=True)
    assert rel_err(out, brute.hla2(Q, K, V, gamma=gamma)) < RTOL
    got, m = fields(state), brute.hla2_moments(Q, K, V, gamma)
    assert rel_err(got["S"], m["S"]) < RTOL
    assert rel_err(got["W"], m["S"] @ m["C"] - m["G"]) < RTOL
    assert rel_err(got["z"], m["S"] @ m["m"] - m["h"]) < RTOL

    out, state = func("asymmetric", "ahla_chunked")(Q, K, V, gamma=gamma, chunk_size=chunk_size,
                                                    return_state=True)
    assert rel_err(out, brute.ahla(Q, K, V, gamma=gamma)) < RTOL
    got, m = fields(state), brute.ahla_moments(Q, K, V, gamma)
    for key in ("P", "E", "p", "e"):
        assert rel_err(got[key], m[key]) < RTOL, key

    out, state = func("third_order", "hla3_chunked")(Q, K, V, gamma=gamma, chunk_size=chunk_size,
                                                     return_state=True)
    assert type(state).__name__ == "HLA3State"
    assert rel_err(out, brute.hla3(Q, K, V, gamma=gamma)) < RTOL
    got, m = fields(state), brute.hla3_moments(Q, K, V, gamma)
    for key in ("S", "P", "F", "p", "f"):
        assert rel_err(got[key], m[key]) < RTOL, key


def test_hla3_chunked_state_is_the_masked_variants():
    Q, K, V = random_qkv(24, 5, 3, 2)
    fn = func("third_order", "hla3_chunked")
    with pytest.raises(ValueError, match="return_state is for variant='masked'"):
        fn(Q, K, V, variant="paper", return_state=True)
    with pytest.raises(TypeError, match="return_state must be True or False"):
        fn(Q, K, V, return_state="yes")
    assert isinstance(fn(Q, K, V, variant="paper"), np.ndarray)
