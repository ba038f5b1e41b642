"""Property-based checks of the Triton path against the index sums (tests/ref/brute.py): random
shapes, decay or gates, normalization, chunk sizes, segments and a cut with state carry-over (HLA2;
AHLA also with walks that load ahead or not).
Under TRITON_INTERPRET=1 on a CPU (few examples: each runs the kernels in Python). Skipped on a
GPU: K and V are compile-time constants of the kernels, so every drawn shape would be a fresh
compile; test_contract.py and test_gpu.py cover the GPU."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import DEVICE, HAS_CUDA
from .helpers import brute_ahla, brute_hla2, rand_gates, rand_qkv, rel, torch

import hla_fast
from hla_fast import ChunkConfig

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="every drawn shape is a fresh compile on a GPU; covered there by "
                                                 "test_contract.py and test_gpu.py")


def _cut_at(op, q, k, v, g, n, **kw):
    """The triton path's output of the whole sequence; for 0 < n < T as two calls, the second
    started from the state the first returned."""
    kw.update(backend="triton", output_final_state=True)
    if not 0 < n < q.shape[1]:
        return op(q, k, v, g=g, **kw)[0]
    o1, st1 = op(q[:, :n], k[:, :n], v[:, :n], g=None if g is None else g[:, :n], **kw)
    o2, _ = op(q[:, n:], k[:, n:], v[:, n:], g=None if g is None else g[:, n:], initial_state=st1, **kw)
    return torch.cat([o1, o2], 1)


@settings(max_examples=60)
@given(op=st.sampled_from(["hla2", "ahla"]), T=st.integers(1, 70), K=st.integers(1, 40), V=st.integers(1, 40),
       chunk=st.sampled_from([16, 32]), fwd_seg=st.integers(1, 4), bwd_seg=st.integers(1, 3), prefetch=st.booleans(),
       kind=st.sampled_from(["none", "gamma", "g"]), normalize=st.booleans(), cut=st.floats(0.0, 1.0),
       seed=st.integers(0, 2 ** 16))
def test_triton_path_is_the_index_sum(op, T, K, V, chunk, fwd_seg, bwd_seg, prefetch, kind, normalize, cut, seed):
    """prefetch: AHLA's walks load ahead (HLA2's have no such layout)."""
    device = DEVICE
    q, k, v = rand_qkv(1, T, 2, K, V, seed=seed, positive=normalize, device=device)
    g = rand_gates(1, T, 2, seed=seed, device=device) if kind == "g" else None
    gamma = 0.8 if kind == "gamma" else None
    ahead = prefetch and op == "ahla"
    cfg = ChunkConfig(fwd_chunk=chunk, bwd_chunk=chunk, fwd_segments=fwd_seg, bwd_segments=bwd_seg, fwd_block_v=16,
                      fwd_prefetch=ahead, bwd_prefetch=ahead)
    want = {"hla2": brute_hla2, "ahla": brute_ahla}[op](q, k, v, gamma=gamma, normalize=normalize, g=g)
    o = _cut_at(getattr(hla_fast, op), q, k, v, g, int(cut * T), gamma=gamma, normalize=normalize, config=cfg)
    assert rel(o, want) < 1e-5


@settings(max_examples=15)
@given(op=st.sampled_from(["hla2", "ahla", "ahla_layers"]), T=st.integers(1, 40), K=st.integers(1, 24),
       V=st.integers(1, 24), kind=st.sampled_from(["gamma", "g"]), normalize=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_triton_gradients_match_float64(op, T, K, V, kind, normalize, seed):
    """ahla_layers: AHLA's backward as two first-order layers (config.bwd_layers).

    A normalized output o = num / (den + eps) has gradients that are sums of the numerator's part
    and the denominator's, which cancel where eps is small against den: at T = K = V = 1 (hla2,
    seed 2) each part of dq is about 8.4 and their sum 9.6e-4, so fp32's rounding of the parts
    (6e-8 relative) is 5e-4 of the sum (the fp32 torch path's dq is 1.3e-4 off too). The error is
    therefore measured against the larger of the gradient and its two parts (float64, from the
    unnormalized operator on v and on a column of ones, ``_normalized_parts``); unnormalized
    against the gradient."""
    device = DEVICE
    q, k, v = rand_qkv(1, T, 1, K, V, seed=seed, positive=normalize, device=device)
    g = rand_gates(1, T, 1, seed=seed, device=device)
    w = torch.randn(1, T, 1, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    fn = hla_fast.hla2 if op == "hla2" else hla_fast.ahla

    def leaves_kw(dtype, dev):
        leaves = [x.detach().to(dev, dtype).requires_grad_() for x in (q, k, v, g)]
        return leaves, ({"g": leaves[3]} if kind == "g" else {"gamma": 0.9}), (leaves if kind == "g" else leaves[:3])

    def grads(dtype, dev, backend):
        leaves, kw, used = leaves_kw(dtype, dev)
        if op == "ahla_layers" and backend == "triton":
            kw["config"] = ChunkConfig(fwd_chunk=16, bwd_chunk=16, fwd_block_v=16, bwd_layers=True)
        o, _ = fn(*leaves[:3], normalize=normalize, chunk_size=16, backend=backend, **kw)
        return o, torch.autograd.grad((o.double() * w.to(dev)).sum(), used)

    _, got = grads(torch.float32, device, "triton")
    o64, want = grads(torch.float64, "cpu", "torch")
    scale = [b.norm() for b in want]
    if normalize:
        scale = [max(s, *parts) for s, parts in zip(scale, _normalized_parts(fn, leaves_kw, o64, w))]
    for a, b, s in zip(got, want, scale):
        if b.abs().max() > 0:
            assert float((a.double().cpu() - b).norm() / s) < 1e-4


def _normalized_parts(fn, leaves_kw, o64, w):
    """Norms of the numerator's and the denominator's parts of each gradient of sum(w * o), o =
    num / (den + eps) (eps = 1e-6, the default) with num and den the unnormalized operator on v and
    on a column of ones (float64 torch path), after checking that this quotient is o64."""
    leaves, kw, used = leaves_kw(torch.float64, "cpu")
    q, k, v = leaves[:3]
    num = fn(q, k, v, chunk_size=16, backend="torch", **kw)[0]
    den = fn(q, k, torch.ones_like(v[..., :1]), chunk_size=16, backend="torch", **kw)[0]
    assert rel(num / (den + 1e-6), o64) < 1e-12
    by_num = torch.autograd.grad((num / (den.detach() + 1e-6) * w).sum(), used, allow_unused=True, retain_graph=True)
    by_den = torch.autograd.grad((num.detach() / (den + 1e-6) * w).sum(), used, allow_unused=True)
    return [[0.0 if x is None else x.norm() for x in pair] for pair in zip(by_num, by_den)]
