"""Shared pieces of the hla_ref tests: function lookup, random problems, error measures."""

import dataclasses
import importlib
import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Hypothesis budget.  Each property test below runs a brute-force O(n^4) sum per example,
# so the default is kept small enough for the whole tests/ref run to stay well under two
# minutes on two cores.  Set HLA_REF_EXAMPLES=500 (say) for a longer local sweep.
# No example database: nothing is written into the checkout, and a failure prints the whole
# Problem (seed included), which reproduces it exactly.
EXAMPLES = int(os.environ.get("HLA_REF_EXAMPLES", "50"))
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# Tolerance for float64 fast form vs brute force.  Unit roundoff is 1.1e-16.  Both sides
# add at most n^3 = 6.4e4 products of at most 7 factors (n <= 40), in different orders;
# the worst-case bound n^3 * 7 * u ~ 5e-11 holds for sums of same-sign terms, and random
# rounding grows like sqrt(n^3) instead (~3e-14).  The signed sums here cancel a little
# (with normal data the output norm is within ~1e2 of the sum of absolute terms), and the
# paper's third-order form subtracts G1..G3 from S^K S^Q P, losing about one more digit.
# 1e-10 relative to the norm of the brute output leaves a margin of ~1e2 over that, and is
# still eight orders below the O(1) errors of the errata.  (Measured on 150 random problems
# with n <= 40: the worst form, hla3 masked, stayed below 5e-15.)
# Per-token gates add one rounding source, in the brute force: it evaluates
# exp(p b_t - sum b_x) from the cumulative logs b, and subtracting b's of size |b| costs an
# absolute error ~ (p + 1) u |b| in the exponent, which is the relative error of the weight.
# For gates >= 0.05 and n <= 40 (|b| <= 120) that is ~5e-14; the "closing" problems add gates
# of 1e-300 and 5e-324 (|log a| = 691 and 744, so |b| ~ 1.5e3) and reach ~1e-12.  (Measured on
# 1000 random gated problems: worst 1.1e-12, hla3 masked, every form alike; the forms agree
# among themselves to 1e-15, since they only exponentiate sums of log a inside a chunk or a
# column.)  That is still two orders below RTOL, so the same tolerance serves.
RTOL = 1e-10


def func(module, name):
    """hla_ref.<module>.<name>, looked up when a test runs (so one missing name fails one test)."""
    return getattr(importlib.import_module(f"hla_ref.{module}"), name)


def rel_err(got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = np.linalg.norm(want)
    diff = np.linalg.norm(got - want)
    return diff / scale if scale > 0 else diff


def fields(obj):
    """Field name -> value for a NamedTuple or a dataclass state/segment."""
    if hasattr(obj, "_asdict"):
        return dict(obj._asdict())
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raise TypeError(f"not a state/segment: {type(obj)!r}")


# The smallest positive float64 (a subnormal): log of it is -744.4, finite.
TINIEST = float(np.nextafter(0.0, 1.0))


def random_gates(seed, n, low=0.05, closing=None):
    """Per-token gates a (n,) in (0, 1] for a test problem, reproducible from ``seed``.

    Uniform in [low, 1], about 15 % exactly 1 (open), and with probability 0.3 one gate of 1e-12
    (almost closed) at a random place.  ``closing``: additionally close gates fully, a_{n//2} =
    1e-300 and a_{n//3} = the smallest positive float64 (whose square underflows to 0).
    """
    rng = np.random.default_rng([seed, 0x6A7E5])   # a stream apart from the Q, K, V of the seed
    a = rng.uniform(low, 1.0, n)
    a[rng.random(n) < 0.15] = 1.0
    if n > 1 and rng.random() < 0.3:
        a[rng.integers(n)] = 1e-12
    if closing:
        a[n // 2] = 1e-300
        a[n // 3] = TINIEST
    return a


@dataclasses.dataclass
class Problem:
    n: int
    d: int
    dv: int
    gamma: float
    normalize: bool
    eps: float
    chunk_size: int
    seed: int
    # "float": gamma as is; "random": per-token gates random_gates(seed, n, low=gamma);
    # "closing": the same with two fully closed gates (see random_gates).
    gates: str = "float"

    def gamma_arg(self):
        """gamma as the forms take it: the float, or an (n,) array of per-token gates."""
        if self.gates == "float":
            return self.gamma
        return random_gates(self.seed, self.n, low=self.gamma, closing=self.gates == "closing")

    def arrays(self):
        """Q, K, V for this problem.

        Unnormalized: standard normal entries (signed, so cancellation is exercised).
        Normalized: the denominator is a signed sum that can cross zero (see the math note),
        and near a zero num / (den + eps) is ill-conditioned: the comparison would then
        measure the input's conditioning, not the implementation.  So q, k get entries in
        [0.1, 1]; every q.k is then >= 0.01 * d > 0, every weight is positive, and den is
        bounded away from zero (V stays signed).  Signed denominators are covered by a
        deterministic test on a hand-checked well-conditioned input.
        """
        rng = np.random.default_rng(self.seed)
        if self.normalize:
            Q = rng.uniform(0.1, 1.0, (self.n, self.d))
            K = rng.uniform(0.1, 1.0, (self.n, self.d))
        else:
            Q = rng.standard_normal((self.n, self.d))
            K = rng.standard_normal((self.n, self.d))
        V = rng.standard_normal((self.n, self.dv))
        return Q, K, V


GAMMAS = st.one_of(st.just(1.0), st.sampled_from([0.5, 0.9, 0.99]), st.floats(0.05, 1.0))


@st.composite
def problems(draw, max_n=40, max_d=6, gates=("float",)):
    """Random problems; ``gates`` lists the kinds of gamma to draw from (see Problem.gates)."""
    n = draw(st.integers(1, max_n))
    return Problem(
        n=n,
        d=draw(st.integers(1, max_d)),
        dv=draw(st.integers(1, max_d)),  # drawn independently of d
        gamma=draw(GAMMAS),
        normalize=draw(st.booleans()),
        eps=draw(st.sampled_from([1e-6, 0.0, 0.5])),
        chunk_size=draw(st.integers(1, n + 8)),  # need not divide n; may exceed it
        seed=draw(st.integers(0, 2**32 - 1)),
        gates=draw(st.sampled_from(gates)),
    )


def random_qkv(seed, n, d, dv, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)).astype(dtype),
            rng.standard_normal((n, d)).astype(dtype),
            rng.standard_normal((n, dv)).astype(dtype))
