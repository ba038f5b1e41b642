"""GPU checks (marked ``gpu``; skipped without CUDA): long sequences, fp32 and bf16.

Truth: the torch backend in float64 on the GPU (itself checked against hla_ref on
short sequences in test_hla2_torch.py and here). Outputs are poisoned with NaN
before each run; inputs are random, never zeros.
"""
import pytest

from .helpers import rand_qkv, ref_hla2, rel, torch
from .test_hla2_triton import poison  # noqa: F401  (fixture)

import hla_fast

pytestmark = pytest.mark.gpu

# relative error that the precision explains: fp32 products are exact ("ieee" dots);
# bf16 rounds every tensor-core operand to 8 bits of mantissa
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _ref64(q, k, v, **kw):
    o, st = hla_fast.hla2(q.double(), k.double(), v.double(), backend="torch", output_final_state=True, **kw)
    return o, st


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1000, 4097, 32768])
@pytest.mark.parametrize("gamma", [None, 0.999])
def test_long_forward(dtype, T, gamma, poison):  # noqa: F811
    q, k, v = rand_qkv(1, T, 2, 64, 64, seed=T, scale=0.3, device="cuda", dtype=dtype)
    want, st_want = _ref64(q, k, v, gamma=gamma)
    o, st = hla_fast.hla2(q, k, v, gamma=gamma, output_final_state=True)
    assert o.dtype == dtype
    assert rel(o, want) < TOL[dtype]
    assert rel(st.S, st_want.S) < TOL[dtype] and rel(st.W, st_want.W) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hla_ref_on_gpu(dtype, poison):  # noqa: F811
    q, k, v = rand_qkv(1, 300, 2, 32, 48, seed=1, device="cuda", dtype=dtype)
    o, _ = hla_fast.hla2(q, k, v, gamma=0.95)
    assert rel(o, ref_hla2(q, k, v, 0.95)) < TOL[dtype]


@pytest.mark.parametrize("K,V", [(16, 16), (96, 80), (128, 128), (48, 128), (128, 24)])
def test_head_sizes(K, V, poison):  # noqa: F811
    # bf16 here: fp32 ("ieee") kernels at 128-wide tiles take about a minute to compile
    q, k, v = rand_qkv(1, 333, 2, K, V, seed=K + V, scale=0.2, device="cuda", dtype=torch.bfloat16)
    want, _ = _ref64(q, k, v, gamma=0.99)
    o, _ = hla_fast.hla2(q, k, v, gamma=0.99)
    assert rel(o, want) < TOL[torch.bfloat16]


def test_normalized_and_carry_over(poison):  # noqa: F811
    q, k, v = rand_qkv(2, 5000, 2, 64, 32, seed=3, positive=True, scale=0.3, device="cuda")
    want, _ = _ref64(q, k, v, gamma=0.99, normalize=True)
    o1, st = hla_fast.hla2(q[:, :2345], k[:, :2345], v[:, :2345], gamma=0.99, normalize=True,
                           output_final_state=True)
    o2, _ = hla_fast.hla2(q[:, 2345:], k[:, 2345:], v[:, 2345:], gamma=0.99, normalize=True,
                          initial_state=st)
    assert rel(torch.cat([o1, o2], 1), want) < TOL[torch.float32]


def _grads(q, k, v, S0, W0, do, dtype, backend, gamma, chunk_size):
    """dq, dk, dv, dS0, dW0 of sum(o * do), inputs cast to dtype (states fp32, float64 on float64)."""
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.detach().to(dtype if i < 3 else sd).requires_grad_() for i, x in enumerate((q, k, v, S0, W0))]
    o, _ = hla_fast.hla2(*leaves[:3], gamma=gamma, initial_state=hla_fast.HLA2State(leaves[3], leaves[4]),
                         backend=backend, chunk_size=chunk_size)
    (o.double() * do).sum().backward()
    return [x.grad for x in leaves]


def _check_grads(q, k, v, S0, W0, do, dtype, gamma, chunk_size):
    """Triton gradients against float64 autograd of the torch path, within what dtype explains."""
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    got = _grads(q, k, v, S0, W0, do, dtype, "triton", gamma, chunk_size)
    want = _grads(q, k, v, S0, W0, do, torch.float64, "torch", gamma, chunk_size)
    for name, a, b in zip(["dq", "dk", "dv", "dS0", "dW0"], got, want):
        assert rel(a, b) < tol, name


@pytest.mark.parametrize("dtype,KV,mode", [
    (torch.bfloat16, (64, 128), "split"), (torch.bfloat16, (128, 64), "split"),
    (torch.bfloat16, (64, 64), "fused"), (torch.float32, (64, 32), "split"),
])
def test_gradients_long(dtype, KV, mode, poison, monkeypatch):  # noqa: F811
    import importlib

    monkeypatch.setattr(importlib.import_module("hla_fast.hla2.chunk"), "BWD_MODE", mode)
    K, V = KV
    T, B, H = 2049, 1, 2
    q, k, v = rand_qkv(B, T, H, K, V, seed=4, scale=0.3, device="cuda", dtype=dtype)
    S0 = torch.randn(B, H, K, K, device="cuda") * 0.1
    S0 = S0 + S0.transpose(-1, -2)
    W0 = torch.randn(B, H, K, V, device="cuda") * 0.1
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.float64)

    # fp32 ("ieee") kernels are unrolled FMA loops: 16-row chunks keep their compile time short
    _check_grads(q, k, v, S0, W0, do, dtype, 0.999, 16 if dtype == torch.float32 else 64)


@pytest.mark.parametrize("K,V", [(256, 256), (200, 72), (64, 256), (256, 16)])
def test_wide_heads_forward(K, V, poison):  # noqa: F811
    # heads wider than a 128-feature tile: feature-block pairs and value blocks
    q, k, v = rand_qkv(1, 1000, 2, K, V, seed=K * V, scale=0.15, device="cuda", dtype=torch.bfloat16)
    want, st_want = _ref64(q, k, v, gamma=0.99)
    o, st = hla_fast.hla2(q, k, v, gamma=0.99, output_final_state=True)
    assert rel(o, want) < TOL[torch.bfloat16]
    assert rel(st.S, st_want.S) < TOL[torch.bfloat16] and rel(st.W, st_want.W) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype,K,V", [(torch.bfloat16, 256, 192), (torch.float32, 160, 48)])
def test_wide_heads_gradients(dtype, K, V, poison):  # noqa: F811
    T, B, H = 515, 1, 2
    q, k, v = rand_qkv(B, T, H, K, V, seed=5, scale=0.15, device="cuda", dtype=dtype)
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.float64)
    S0 = torch.randn(B, H, K, K, device="cuda") * 0.02
    W0 = torch.randn(B, H, K, V, device="cuda") * 0.02
    # 16-row chunks: short compile of the fp32 ("ieee") kernels
    _check_grads(q, k, v, S0, W0, do, dtype, 0.99, 16 if dtype == torch.float32 else 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_equal_one_walk(dtype, poison, monkeypatch):  # noqa: F811
    # the segmented forward (summaries, fold, parallel segments) against a single walk
    import importlib

    chunk = importlib.import_module("hla_fast.hla2.chunk")
    q, k, v = rand_qkv(2, 8191, 3, 64, 64, seed=6, scale=0.3, device="cuda", dtype=dtype)
    S0 = torch.randn(2, 3, 64, 64, device="cuda") * 0.1
    W0 = torch.randn(2, 3, 64, 64, device="cuda") * 0.1
    st0 = hla_fast.HLA2State(S0, W0)
    outs = []
    for nseg in (1, 7, 128):
        monkeypatch.setattr(chunk, "FWD_SEGMENTS", nseg)
        outs.append(hla_fast.hla2(q, k, v, gamma=0.999, initial_state=st0, output_final_state=True))
    want, st_want = _ref64(q, k, v, gamma=0.999, initial_state=hla_fast.HLA2State(S0.double(), W0.double()))
    for o, st in outs:
        assert rel(o, want) < TOL[dtype]
        assert rel(st.S, st_want.S) < TOL[dtype] and rel(st.W, st_want.W) < TOL[dtype]


@pytest.mark.parametrize("K,V", [(128, 128), (96, 80), (256, 256)])
@pytest.mark.parametrize("normalize", [False, True])
def test_decode_gpu(K, V, normalize, poison):  # noqa: F811
    B, H = 8, 4
    q, k, v = rand_qkv(B, 3, H, K, V, seed=K, positive=normalize, device="cuda")
    st_a = st_b = None
    for t in range(3):
        oa, st_a = hla_fast.hla2_step(q[:, t], k[:, t], v[:, t], st_a, gamma=0.9, normalize=normalize)
        ob, st_b = hla_fast.hla2_step(q[:, t].double(), k[:, t].double(), v[:, t].double(),
                                      st_b, gamma=0.9, normalize=normalize, backend="torch")
        assert rel(oa, ob) < 1e-5
    assert rel(st_a.W, st_b.W) < 1e-5
