"""Property-based checks of the Triton path against the index sums (tests/ref/brute.py): random
shapes, decay or gates, normalization, chunk sizes, segments and a cut with state carry-over.
Under TRITON_INTERPRET=1 on a CPU (few examples: each runs the kernels in Python). Skipped on a
GPU: K and V are compile-time constants of the kernels, so every drawn shape would be a fresh
compile; test_contract.py and test_gpu.py cover the GPU."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import DEVICE, HAS_CUDA
from .helpers import brute_hla2, rand_gates, rand_qkv, rel, torch

import hla_fast
from hla_fast import ChunkConfig

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="every drawn shape is a fresh compile on a GPU; covered there by "
                                                 "test_contract.py and test_gpu.py")


@settings(max_examples=40)
@given(T=st.integers(1, 70), K=st.integers(1, 40), V=st.integers(1, 40), chunk=st.sampled_from([16, 32]),
       fwd_seg=st.integers(1, 4), bwd_seg=st.integers(1, 3), kind=st.sampled_from(["none", "gamma", "g"]),
       normalize=st.booleans(), cut=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 16))
def test_triton_path_is_the_index_sum(T, K, V, chunk, fwd_seg, bwd_seg, kind, normalize, cut, seed):
    device = DEVICE
    q, k, v = rand_qkv(1, T, 2, K, V, seed=seed, positive=normalize, device=device)
    g = rand_gates(1, T, 2, seed=seed, device=device) if kind == "g" else None
    gamma = 0.8 if kind == "gamma" else None
    cfg = ChunkConfig(fwd_chunk=chunk, bwd_chunk=chunk, fwd_segments=fwd_seg, bwd_segments=bwd_seg, fwd_block_v=16)
    want = brute_hla2(q, k, v, gamma=gamma, normalize=normalize, g=g)
    n = int(cut * T)
    kw = dict(gamma=gamma, normalize=normalize, backend="triton", config=cfg, output_final_state=True)
    if 0 < n < T:
        o1, st1 = hla_fast.hla2(q[:, :n], k[:, :n], v[:, :n], g=None if g is None else g[:, :n], **kw)
        o2, _ = hla_fast.hla2(q[:, n:], k[:, n:], v[:, n:], g=None if g is None else g[:, n:], initial_state=st1, **kw)
        o = torch.cat([o1, o2], 1)
    else:
        o, _ = hla_fast.hla2(q, k, v, g=g, **kw)
    assert rel(o, want) < 1e-5


@settings(max_examples=15)
@given(T=st.integers(1, 40), K=st.integers(1, 24), V=st.integers(1, 24), kind=st.sampled_from(["gamma", "g"]),
       normalize=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_triton_gradients_match_float64(T, K, V, kind, normalize, seed):
    device = DEVICE
    q, k, v = rand_qkv(1, T, 1, K, V, seed=seed, positive=normalize, device=device)
    g = rand_gates(1, T, 1, seed=seed, device=device)
    w = torch.randn(1, T, 1, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def grads(dtype, dev, backend):
        leaves = [x.detach().to(dev, dtype).requires_grad_() for x in (q, k, v, g)]
        kw = {"g": leaves[3]} if kind == "g" else {"gamma": 0.9}
        o, _ = hla_fast.hla2(*leaves[:3], normalize=normalize, chunk_size=16, backend=backend, **kw)
        used = leaves if kind == "g" else leaves[:3]
        return torch.autograd.grad((o.double() * w.to(dev)).sum(), used)

    for a, b in zip(grads(torch.float32, device, "triton"), grads(torch.float64, "cpu", "torch")):
        if b.abs().max() > 0:
            assert rel(a, b) < 1e-4
