"""Property-based checks of the Triton path (under the interpreter on CPU): random shapes,
decay, chunk sizes, segments and state carry-over against the index-sum definition.

Shapes are drawn small (T <= 70, K, V <= 40) so that each example runs in a fraction of a
second; the hypothesis profile in tests/conftest.py makes the examples the same on every run.
"""
import importlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from .conftest import DEVICE as device
from .helpers import brute_hla2, rand_qkv, rel, torch
from .test_hla2_triton import _poisoned_empty_like

import hla_fast

chunk = importlib.import_module("hla_fast.hla2.chunk")

shapes = st.fixed_dictionaries({
    "B": st.integers(1, 2), "T": st.integers(1, 70), "H": st.integers(1, 2),
    "K": st.integers(1, 40), "V": st.integers(1, 40),
    "gamma": st.sampled_from([None, 1.0, 0.95, 0.7]), "chunk": st.sampled_from([16, 32]),
    "segments": st.integers(1, 4), "cut": st.floats(0.0, 1.0), "seed": st.integers(0, 2 ** 16),
})


@settings(max_examples=25)
@given(p=shapes)
@example(p={"B": 1, "T": 1, "H": 1, "K": 1, "V": 1, "gamma": 0.7, "chunk": 16, "segments": 1, "cut": 0.0, "seed": 0})
@example(p={"B": 2, "T": 70, "H": 2, "K": 40, "V": 3, "gamma": None, "chunk": 16, "segments": 4, "cut": 0.5,
          "seed": 1})
def test_triton_forward_is_the_index_sum(p):
    """Outputs of the whole sequence, and of the sequence cut in two with the state passed on,
    equal the index sums; the final state equals the float64 torch path's."""
    q, k, v = rand_qkv(p["B"], p["T"], p["H"], p["K"], p["V"], seed=p["seed"], device=device)
    want = brute_hla2(q, k, v, p["gamma"])
    with pytest.MonkeyPatch.context() as mp:
        _poisoned_empty_like(mp)   # every kernel output starts as NaN
        mp.setattr(chunk, "FWD_SEGMENTS", p["segments"])
        kw = dict(gamma=p["gamma"], chunk_size=p["chunk"], backend="triton", output_final_state=True)
        o, fin = hla_fast.hla2(q, k, v, **kw)
        c = int(p["cut"] * p["T"])
        if 0 < c < p["T"]:
            o1, st1 = hla_fast.hla2(q[:, :c], k[:, :c], v[:, :c], **kw)
            o2, _ = hla_fast.hla2(q[:, c:], k[:, c:], v[:, c:], initial_state=st1, **kw)
            assert rel(torch.cat([o1, o2], 1), want) < 1e-5
    assert o.shape == v.shape and rel(o, want) < 1e-5
    _, fin64 = hla_fast.hla2(q.double().cpu(), k.double().cpu(), v.double().cpu(), gamma=p["gamma"],
                             backend="torch", output_final_state=True)
    assert rel(fin.S, fin64.S) < 1e-5 and rel(fin.W, fin64.W) < 1e-5


@pytest.mark.parametrize("mode", ["split", "fused"])
@settings(max_examples=15)
@given(p=shapes)
def test_triton_gradients_match_float64(mode, p):
    """dq, dk, dv of both backward layouts (with segmented walks) against float64 autograd of
    the torch path."""
    with pytest.MonkeyPatch.context() as mp:
        _poisoned_empty_like(mp)
        mp.setattr(chunk, "BWD_MODE", mode)
        mp.setattr(chunk, "FWD_SEGMENTS", p["segments"])
        mp.setattr(chunk, "BWD_SEGMENTS", p["segments"])
        q, k, v = rand_qkv(p["B"], p["T"], p["H"], p["K"], p["V"], seed=p["seed"], device=device)
        w = torch.randn(p["B"], p["T"], p["H"], p["V"], generator=torch.Generator().manual_seed(p["seed"]))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, _ = hla_fast.hla2(*leaves, gamma=p["gamma"], chunk_size=p["chunk"], backend="triton")
        (o * w.to(device)).sum().backward()
    d64 = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    o64, _ = hla_fast.hla2(*d64, gamma=p["gamma"], backend="torch")
    (o64 * w.double()).sum().backward()
    for name, a, b in zip(("dq", "dk", "dv"), leaves, d64):
        assert rel(a.grad, b.grad) < 1e-4, name
