"""Per-token gates: what a gate array means, beyond matching the brute force (test_forms.py).

With factors a_t in (0, 1] and b_t = sum_{s <= t} log a_s, every operator weighs a term with
summed indices x_1..x_p read at token t by exp(p b_t - sum b_x) = prod_x (a_{x+1} ... a_t).
Consequences pinned here, for every form of every operator:

* a constant array of gamma is the float gamma;
* the first factor a_0 multiplies only the empty state before the sequence: it changes nothing;
* a gate a_s closing (a_s -> 0) cuts every term that has an index x < s out of the outputs at
  t >= s, because each such index carries the factor a_s (the product a_{x+1} ... a_t contains
  it). Token s itself is not cut (its product a_{s+1} ... a_t does not contain a_s), and the
  outputs before s never see a_s. So for t >= s the outputs are those of the suffix run on tokens
  s.., and the leak from before s is a polynomial in a_s without constant term: a_s times a
  bounded sum for AHLA and linear attention (one decayed index j), degree 2 for HLA2 (i, j),
  degree 3 for third order (i, u, j), each with a non-zero linear term;
* no gate, however small, overflows anything or produces NaN (every exponent is <= 0).
"""

import numpy as np
import pytest

from . import brute
from .helpers import RTOL, TINIEST, func, random_gates, random_qkv, rel_err
from .test_forms import BRUTE, FORMS, WEIGHTS, _form_id, run_form

N, D, DV = 12, 3, 2
CHUNK = 4          # s = 4 starts a chunk, s = 6 lies inside one


def _qkv(seed=41, n=N, positive=False):
    Q, K, V = random_qkv(seed, n, D, DV)
    if positive:    # positive weights: a normalized denominator far from zero
        Q, K = np.abs(Q) + 0.1, np.abs(K) + 0.1
    return Q, K, V


def _gates(seed=42, n=N, low=0.5):
    a = np.random.default_rng(seed).uniform(low, 1.0, n)
    a[n // 4] = 1.0
    return a


def _run(form, Q, K, V, gamma, normalize=False):
    return run_form(form, Q, K, V, gamma=gamma, normalize=normalize, eps=1e-6, chunk_size=CHUNK)


# ---------------------------------------------------------------------------
# A float gamma is the special case a_t = gamma
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.3, 1e-3])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_array_of_gamma_equals_float_gamma(form, normalize, gamma):
    Q, K, V = _qkv(positive=normalize)
    as_float = _run(form, Q, K, V, gamma, normalize)
    as_array = _run(form, Q, K, V, np.full(N, gamma), normalize)
    assert rel_err(as_array, as_float) <= 1e-14
    # and both are the brute force's integer powers gamma^(p t - sum x)
    want = BRUTE[form[0]](Q, K, V, gamma=gamma, normalize=normalize)
    assert rel_err(as_array, want) < RTOL


@pytest.mark.parametrize("op,module,name,kw", WEIGHTS, ids=[w[0] for w in WEIGHTS])
def test_weights_array_of_gamma_equals_float_gamma(op, module, name, kw):
    Q, K, _ = _qkv()
    fn = func(module, name)
    assert rel_err(fn(Q, K, gamma=np.full(N, 0.7), **kw), fn(Q, K, gamma=0.7, **kw)) <= 1e-14


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_gates_given_as_list_or_float32_array(form):
    """A list of floats and a float32 array are accepted and mean the same gates."""
    Q, K, V = _qkv()
    a = _gates().astype(np.float32)          # exactly representable in float64 as well
    want = _run(form, Q, K, V, a.astype(np.float64))
    assert rel_err(_run(form, Q, K, V, a), want) <= 1e-14
    assert rel_err(_run(form, Q, K, V, [float(x) for x in a]), want) <= 1e-14


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_float32_inputs_with_gates_stay_float32(form):
    Q, K, V = (x.astype(np.float32) for x in _qkv(positive=True))
    a = _gates()
    out = _run(form, Q, K, V, a, normalize=True)
    assert out.dtype == np.float32
    want = _run(form, *(x.astype(np.float64) for x in (Q, K, V)), a, normalize=True)
    assert rel_err(out, want) < 1e-4


# ---------------------------------------------------------------------------
# The first factor multiplies nothing
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_first_gate_changes_nothing(form):
    Q, K, V = _qkv()
    a = _gates()
    outs = []
    for a0 in (1.0, 0.3, 1e-300):
        a[0] = a0
        outs.append(_run(form, Q, K, V, a.copy()))
    for out in outs[1:]:
        assert np.array_equal(out, outs[0])


# ---------------------------------------------------------------------------
# A closing gate cuts the context
# ---------------------------------------------------------------------------

def _other_prefix(Q, K, V, s, positive=False):
    """The same tokens from s on, different (random) tokens before s."""
    Q2, K2, V2 = (x.copy() for x in (Q, K, V))
    P, R, U = _qkv(seed=99, positive=positive)
    Q2[:s], K2[:s], V2[:s] = P[:s], R[:s], U[:s]
    return Q2, K2, V2


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("s", [4, 6])
@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_closed_gate_cuts_everything_before_it(form, s, normalize):
    """a_s = 1e-300: outputs at t >= s are those of the run on tokens s.. alone, whatever the
    tokens before s; outputs before s are exactly those of an open gate; token s is not cut."""
    Q, K, V = _qkv(positive=normalize)
    a = _gates()
    open_out = _run(form, Q, K, V, a, normalize)
    a[s] = 1e-300
    out = _run(form, Q, K, V, a, normalize)
    assert np.all(np.isfinite(out))
    # before s: a_s is not in any product a_{x+1} ... a_t with t < s
    assert np.array_equal(out[:s], open_out[:s])
    # from s on: the suffix run (its first factor a_s multiplies nothing there)
    suffix = _run(form, Q[s:], K[s:], V[s:], a[s:], normalize)
    assert rel_err(out[s:], suffix) < RTOL
    # ... so the tokens before s do not matter
    Q2, K2, V2 = _other_prefix(Q, K, V, s, positive=normalize)
    other = _run(form, Q2, K2, V2, a, normalize)
    assert rel_err(other[s:], out[s:]) < RTOL
    assert rel_err(other[:s], out[:s]) > 1e-3          # (they do matter before s)
    # and the cut is not an open gate's output
    assert rel_err(out[s:], open_out[s:]) > 1e-3
    # token s itself is kept: changing it changes the outputs from s on
    Q3, V3 = Q.copy(), V.copy()
    Q3[s], V3[s] = Q3[s] + 0.5, V3[s] + 1.0
    assert rel_err(_run(form, Q3, K, V3, a, normalize)[s:], out[s:]) > 1e-3


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_nearly_closed_gate_isolates_to_its_own_order(form):
    """a_s = 1e-12 (the brief's 'tiny'): the tokens before s reach the outputs at t >= s only
    through terms carrying a_s, so perturbing them moves those outputs by O(1e-12)."""
    Q, K, V = _qkv()
    a = _gates()
    s = 6
    a[s] = 1e-12
    out = _run(form, Q, K, V, a)
    other = _run(form, *_other_prefix(Q, K, V, s), a)
    assert rel_err(other[s:], out[s:]) < 1e-10
    assert rel_err(other[:s], out[:s]) > 1e-3


# Degree of the leak in a_s: the number of decayed indices of the operator's weight.
LEAK_DEGREE = {"linear": 1, "ahla": 1, "hla2": 2, "hla2_unmasked": 2, "hla3_masked": 3,
               "hla3_paper": 3}


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_leak_through_a_nearly_closed_gate_is_linear_in_it(form):
    """o_t(a_s) - o_t(suffix) for t >= s is a polynomial in a_s with no constant term and a
    non-zero linear term (the terms with one index before s): halving a_s about halves it, and
    for AHLA and linear attention (a single decayed index) the leak is exactly linear."""
    Q, K, V = _qkv()
    a = _gates()
    s = 6
    suffix = _run(form, Q[s:], K[s:], V[s:], a[s:])

    def leak(eps):
        a[s] = eps
        return _run(form, Q, K, V, a)[s:] - suffix

    big, small = leak(1e-4), leak(5e-5)
    ratio = np.linalg.norm(big) / np.linalg.norm(small)
    assert np.linalg.norm(big) > 1e-8 * np.linalg.norm(suffix)     # it does leak
    if LEAK_DEGREE[form[0]] == 1:
        assert rel_err(big, 2 * small) < 1e-8                       # affine in a_s, exactly
    else:
        assert abs(ratio - 2) < 1e-2                                 # linear to first order
    # and the brute force agrees on the leak itself (a difference of O(1) numbers, of size
    # ~5e-5 relative, so it keeps about 11 of the 16 digits)
    a[s] = 5e-5
    bf = BRUTE[form[0]]
    want = bf(Q, K, V, gamma=a)[s:] - bf(Q[s:], K[s:], V[s:], gamma=a[s:])
    assert rel_err(small, want) < 1e-8


@pytest.mark.parametrize("op,module,name,kw", WEIGHTS, ids=[w[0] for w in WEIGHTS])
def test_closed_gate_zeroes_the_weights_across_it(op, module, name, kw):
    """T[t, j] for t >= s > j vanishes when a_s = 1e-300; the other weights are those of the
    two separate runs (before s, and from s on)."""
    Q, K, _ = _qkv()
    a = _gates()
    s = 5
    a[s] = 1e-300
    fn = func(module, name)
    T = fn(Q, K, gamma=a, **kw)
    assert np.max(np.abs(T[s:, :s])) < 1e-250
    assert np.array_equal(T[:s, :s], fn(Q[:s], K[:s], gamma=a[:s], **kw))
    assert rel_err(T[s:, s:], fn(Q[s:], K[s:], gamma=a[s:], **kw)) < RTOL


# ---------------------------------------------------------------------------
# Extreme gates: no overflow, no NaN
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_extreme_gates_raise_no_floating_point_error(form, normalize):
    """Gates of 1e-300, the smallest positive float64 (log -744.4; its square underflows to 0)
    and exactly 1: no overflow, no invalid operation (NaN), no division by zero anywhere; only
    underflow to 0, which is the right value. Checked against the brute force."""
    Q, K, V = _qkv(positive=normalize)
    a = _gates()
    a[[2, 3, 5, 9]] = [1e-300, TINIEST, 1.0, TINIEST]
    with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
        out = _run(form, Q, K, V, a, normalize)
    assert np.all(np.isfinite(out))
    assert rel_err(out, BRUTE[form[0]](Q, K, V, gamma=a, normalize=normalize)) < RTOL


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_all_gates_closed_leaves_each_token_alone(form):
    """Every a_t = 1e-300: o_t is the operator on token t alone (the diagonal term)."""
    Q, K, V = _qkv()
    a = np.full(N, 1e-300)
    out = _run(form, Q, K, V, a)
    alone = np.concatenate([_run(form, Q[t:t + 1], K[t:t + 1], V[t:t + 1], 1.0) for t in range(N)])
    assert rel_err(out, alone) < RTOL


def test_random_gates_helper_is_reproducible():
    assert np.array_equal(random_gates(3, 10), random_gates(3, 10))
    a = random_gates(3, 10, closing=True)
    assert a[5] == 1e-300 and a[3] == TINIEST and np.all((a > 0) & (a <= 1))

