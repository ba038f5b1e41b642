"""The torch backend, the naive forms and the torch decode step against hla_ref (float64)."""
import pytest

from .helpers import brute_hla2, rand_qkv, ref_hla2, rel, torch

import hla_fast
from hla_fast.hla2 import hla2_naive_quadratic, hla2_naive_recurrent


@pytest.mark.parametrize("gamma", [None, 0.9])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 16])
def test_torch_backend_matches_reference(gamma, normalize, chunk_size):
    q, k, v = rand_qkv(2, 23, 2, 5, 7, seed=1, positive=normalize, dtype=torch.float64)
    ref = ref_hla2(q, k, v, gamma, normalize)
    o, st = hla_fast.hla2(q, k, v, gamma=gamma, normalize=normalize, chunk_size=chunk_size,
                          backend="torch")
    assert st is None
    assert o.shape == v.shape and o.dtype == v.dtype
    assert rel(o, ref) < 1e-11
    assert rel(o, brute_hla2(q, k, v, gamma, normalize)) < 1e-11   # the index sums themselves


@pytest.mark.parametrize("gamma", [None, 0.7])
def test_naive_forms_match_reference(gamma):
    q, k, v = rand_qkv(1, 19, 2, 6, 3, seed=2, dtype=torch.float64)
    ref = ref_hla2(q, k, v, gamma)
    assert rel(hla2_naive_quadratic(q, k, v, gamma), ref) < 1e-12
    assert rel(hla2_naive_recurrent(q, k, v, gamma)[0], ref) < 1e-12


@pytest.mark.parametrize("normalize", [False, True])
def test_torch_state_carry_over(normalize):
    q, k, v = rand_qkv(2, 30, 2, 6, 5, seed=3, positive=normalize, dtype=torch.float64)
    full, st_full = hla_fast.hla2(q, k, v, gamma=0.8, normalize=normalize, output_final_state=True,
                                  chunk_size=8, backend="torch")
    o1, st = hla_fast.hla2(q[:, :13], k[:, :13], v[:, :13], gamma=0.8, normalize=normalize,
                           output_final_state=True, chunk_size=8, backend="torch")
    o2, st2 = hla_fast.hla2(q[:, 13:], k[:, 13:], v[:, 13:], gamma=0.8, normalize=normalize,
                            initial_state=st, output_final_state=True, chunk_size=8, backend="torch")
    assert rel(torch.cat([o1, o2], 1), full) < 1e-12
    for a, b in zip(st2, st_full):
        if b is not None:
            assert rel(a, b) < 1e-12
    # the final state is the recurrent one
    _, st_rec = hla2_naive_recurrent(q, k, v, 0.8, normalize)
    assert rel(st_full.S, st_rec.S) < 1e-12 and rel(st_full.W, st_rec.W) < 1e-12


def test_torch_backend_half_inputs_compute_in_fp32():
    q, k, v = rand_qkv(1, 20, 1, 8, 8, seed=4)
    ref = ref_hla2(q, k, v, 0.95)
    o, _ = hla_fast.hla2(q.bfloat16(), k.bfloat16(), v.bfloat16(), gamma=0.95, backend="torch")
    assert o.dtype == torch.bfloat16
    assert rel(o, ref) < 2e-2


@pytest.mark.parametrize("normalize", [False, True])
def test_torch_decode_matches_reference(normalize):
    q, k, v = rand_qkv(2, 9, 3, 5, 4, seed=5, positive=normalize, dtype=torch.float64)
    ref = ref_hla2(q, k, v, 0.9, normalize)
    state, outs = None, []
    for t in range(q.shape[1]):
        o, state = hla_fast.hla2_step(q[:, t], k[:, t], v[:, t], state, gamma=0.9, normalize=normalize,
                                      backend="torch")
        outs.append(o)
    assert rel(torch.stack(outs, 1), ref) < 1e-12
    _, st_seq = hla_fast.hla2(q, k, v, gamma=0.9, normalize=normalize, output_final_state=True,
                              backend="torch")
    assert rel(state.W, st_seq.W) < 1e-12


def test_decode_continues_a_prefill():
    q, k, v = rand_qkv(1, 12, 2, 6, 6, seed=6, dtype=torch.float64)
    ref = ref_hla2(q, k, v, 0.95)
    _, st = hla_fast.hla2(q[:, :11], k[:, :11], v[:, :11], gamma=0.95, output_final_state=True,
                          backend="torch")
    o, _ = hla_fast.hla2_step(q[:, 11], k[:, 11], v[:, 11], st, gamma=0.95, backend="torch")
    assert rel(o, ref[:, 11]) < 1e-12


def test_torch_backend_gradients_gradcheck():
    q, k, v = rand_qkv(1, 7, 1, 3, 2, seed=7, dtype=torch.float64)
    S0 = torch.randn(1, 1, 3, 3, dtype=torch.float64)
    W0 = torch.randn(1, 1, 3, 2, dtype=torch.float64)
    ins = [x.requires_grad_() for x in (q, k, v, S0, W0)]

    def f(q, k, v, S0, W0):
        o, st = hla_fast.hla2(q, k, v, gamma=0.8, initial_state=hla_fast.HLA2State(S0, W0),
                              output_final_state=True, chunk_size=3, backend="torch")
        return o, st.S, st.W

    assert torch.autograd.gradcheck(f, ins)
