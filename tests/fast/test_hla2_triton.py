"""The Triton kernels (forward, backward, decode) on small shapes.

On a machine without CUDA they run under TRITON_INTERPRET=1 (see conftest.py) on
CPU tensors. Truth: hla_ref in float64 (per batch and head) and the torch backend.
Outputs are poisoned with NaN before each check so that an unwritten element fails.
"""
import pytest

from .helpers import brute_hla2, rand_qkv, ref_hla2, rel, torch

import hla_fast
from hla_fast.hla2.chunk import fwd_launch
from hla_fast.hla2.decode import hla2_step_triton


def _poisoned_empty_like(monkeypatch):
    """Make torch.empty_like / torch.empty inside the kernels' module return NaN-filled tensors."""
    import importlib

    # hla_fast.hla2 is the function; the subpackage of the same name lives in sys.modules
    chunk = importlib.import_module("hla_fast.hla2.chunk")
    decode = importlib.import_module("hla_fast.hla2.decode")

    class _NaNTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty_like(x, *a, **kw):
            return torch.full_like(x, float("nan"), *a, **kw)

        @staticmethod
        def empty(*a, **kw):
            out = torch.empty(*a, **kw)
            return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(chunk, "torch", _NaNTorch())
    monkeypatch.setattr(decode, "torch", _NaNTorch())


@pytest.fixture
def poison(monkeypatch):
    _poisoned_empty_like(monkeypatch)


# (B, T, H, K, V, chunk): odd T, K != V, T below / equal to / above a chunk
SHAPES = [(1, 1, 1, 16, 16, 16), (2, 37, 2, 20, 12, 16), (1, 64, 1, 32, 16, 32), (1, 45, 3, 7, 24, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gamma", [None, 0.9])
def test_forward_matches_reference(shape, gamma, device, poison):
    B, T, H, K, V, C = shape
    q, k, v = rand_qkv(B, T, H, K, V, seed=T + K, device=device)
    ref = ref_hla2(q, k, v, gamma)
    o, st = hla_fast.hla2(q, k, v, gamma=gamma, chunk_size=C, backend="triton", output_final_state=True)
    assert o.shape == v.shape and o.dtype == v.dtype
    assert rel(o, ref) < 1e-5
    assert rel(o, brute_hla2(q, k, v, gamma)) < 1e-5       # the index sums themselves
    o_t, st_t = hla_fast.hla2(q.double().cpu(), k.double().cpu(), v.double().cpu(), gamma=gamma,
                              backend="torch", output_final_state=True)
    assert rel(o, o_t) < 1e-5
    assert rel(st.S, st_t.S) < 1e-5 and rel(st.W, st_t.W) < 1e-5


@pytest.mark.parametrize("gamma", [None, 0.8])
def test_forward_normalized(gamma, device, poison):
    q, k, v = rand_qkv(2, 29, 2, 12, 20, seed=11, positive=True, device=device)
    ref = ref_hla2(q, k, v, gamma, normalize=True)
    o, st = hla_fast.hla2(q, k, v, gamma=gamma, normalize=True, chunk_size=16, backend="triton",
                          output_final_state=True)
    assert rel(o, ref) < 1e-5
    assert rel(o, brute_hla2(q, k, v, gamma, normalize=True)) < 1e-5
    assert st.z is not None and st.z.shape == (2, 2, 12)


def test_two_pass_equals_fused(device, poison):
    q, k, v = rand_qkv(2, 50, 2, 16, 24, seed=12, device=device)
    S0 = torch.randn(2, 2, 16, 16, device=device)
    W0 = torch.randn(2, 2, 16, 24, device=device)
    a, sa, wa, _ = fwd_launch(q, k, v, 0.9, S0, W0, 16, mode="fused")
    b, sb, wb, cs = fwd_launch(q, k, v, 0.9, S0, W0, 16, mode="two_pass", block_v=16)
    assert rel(b, a) < 1e-6 and rel(sb, sa) < 1e-6 and rel(wb, wa) < 1e-6
    assert cs[0].shape == (4, 4, 16, 16) and cs[1].shape == (4, 4, 16, 24)


@pytest.mark.parametrize("normalize", [False, True])
def test_state_carry_over(normalize, device, poison):
    q, k, v = rand_qkv(1, 40, 2, 16, 12, seed=13, positive=normalize, device=device)
    ref = ref_hla2(q, k, v, 0.9, normalize)
    kw = dict(gamma=0.9, normalize=normalize, chunk_size=16, backend="triton", output_final_state=True)
    o1, st = hla_fast.hla2(q[:, :21], k[:, :21], v[:, :21], **kw)
    o2, st2 = hla_fast.hla2(q[:, 21:], k[:, 21:], v[:, 21:], initial_state=st, **kw)
    assert rel(torch.cat([o1, o2], 1), ref) < 1e-5
    _, st_full = hla_fast.hla2(q, k, v, **kw)
    assert rel(st2.W, st_full.W) < 1e-5 and rel(st2.S, st_full.S) < 1e-5


@pytest.mark.parametrize("gamma", [None, 0.85])
@pytest.mark.parametrize("normalize", [False, True])
def test_gradients_match_float64_torch(gamma, normalize, device, poison):
    B, T, H, K, V = 1, 37, 2, 12, 20
    q, k, v = rand_qkv(B, T, H, K, V, seed=14, positive=normalize, device=device)
    g = torch.Generator().manual_seed(15)
    S0 = torch.randn(B, H, K, K, generator=g) * 0.3
    S0 = (S0 + S0.transpose(-1, -2)).to(device)
    W0 = (torch.randn(B, H, K, V, generator=g) * 0.3).to(device)
    z0 = (torch.rand(B, H, K, generator=g) * 0.3).to(device)
    w_o = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    w_s = torch.randn(B, H, K, K, generator=g, dtype=torch.float64)
    w_w = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)

    def run(dtype, dev, backend):
        leaves = [x.detach().to(dev, dtype).requires_grad_() for x in (q, k, v, S0, W0, z0)]
        st = hla_fast.HLA2State(leaves[3], leaves[4], leaves[5] if normalize else None)
        o, fin = hla_fast.hla2(*leaves[:3], gamma=gamma, normalize=normalize, initial_state=st,
                               output_final_state=True, chunk_size=16, backend=backend)
        loss = (o * w_o.to(dev, dtype)).sum() + (fin.S * w_s.to(dev, dtype)).sum()
        loss = loss + (fin.W * w_w.to(dev, dtype)).sum()
        loss.backward()
        return [x.grad for x in leaves[: 6 if normalize else 5]]

    got = run(torch.float32, device, "triton")
    want = run(torch.float64, "cpu", "torch")
    for name, a, b in zip(["dq", "dk", "dv", "dS0", "dW0", "dz0"], got, want):
        assert rel(a, b) < 1e-4, name


def test_gradients_without_initial_state(device, poison):
    q, k, v = rand_qkv(2, 21, 1, 16, 16, seed=16, device=device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, _ = hla_fast.hla2(*leaves, gamma=0.9, chunk_size=16, backend="triton")
    o.sum().backward()
    d64 = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    o64, _ = hla_fast.hla2(*d64, gamma=0.9, backend="torch")
    o64.sum().backward()
    for a, b in zip(leaves, d64):
        assert rel(a.grad, b.grad) < 1e-4


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 2e-2), ("float16", 5e-3)])
def test_half_precision_inputs(dtype, tol, device, poison):
    dt = getattr(torch, dtype)
    q, k, v = rand_qkv(1, 40, 2, 32, 16, seed=17, device=device, dtype=dt)
    ref = ref_hla2(q, k, v, 0.95)
    o, st = hla_fast.hla2(q, k, v, gamma=0.95, chunk_size=16, backend="triton", output_final_state=True)
    assert o.dtype == dt and st.S.dtype == torch.float32
    assert rel(o, ref) < tol


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("KV", [(16, 16), (20, 40), (7, 3)])
def test_decode_kernel(normalize, KV, device, poison):
    K, V = KV
    B, T, H = 2, 6, 3
    q, k, v = rand_qkv(B, T, H, K, V, seed=18 + K, positive=normalize, device=device)
    ref = ref_hla2(q, k, v, 0.8, normalize)
    state, outs = None, []
    for t in range(T):
        o, state = hla_fast.hla2_step(q[:, t], k[:, t], v[:, t], state, gamma=0.8, normalize=normalize,
                                      backend="triton")
        outs.append(o)
    assert rel(torch.stack(outs, 1), ref) < 1e-5
    _, st_seq = hla_fast.hla2(q, k, v, gamma=0.8, normalize=normalize, output_final_state=True,
                              chunk_size=16, backend="triton")
    assert rel(state.S, st_seq.S) < 1e-5 and rel(state.W, st_seq.W) < 1e-5
    if normalize:
        assert rel(state.z, st_seq.z) < 1e-5


def test_decode_leaves_input_state_alone(device):
    q, k, v = rand_qkv(1, 1, 2, 16, 16, seed=19, device=device)
    st = hla_fast.HLA2State(torch.randn(1, 2, 16, 16, device=device), torch.randn(1, 2, 16, 16, device=device))
    before = [x.clone() for x in st[:2]]
    hla2_step_triton(q[:, 0], k[:, 0], v[:, 0], st, 0.9, False, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(before, st[:2]))


@pytest.mark.parametrize("gamma", [None, 0.9])
def test_backward_layouts_agree(gamma, device, poison):
    """The split backward (state pass + per-chunk kernel) equals the fused one."""
    import importlib

    chunk = importlib.import_module("hla_fast.hla2.chunk")
    q, k, v = rand_qkv(2, 45, 2, 16, 24, seed=20, device=device)
    do = torch.randn(2, 45, 2, 24, device=device)
    S0 = torch.randn(2, 2, 16, 16, device=device) * 0.2
    W0 = torch.randn(2, 2, 16, 24, device=device) * 0.2
    dS = torch.randn(2, 2, 16, 16, device=device)
    dW = torch.randn(2, 2, 16, 24, device=device)
    g = 1.0 if gamma is None else gamma
    a = chunk.bwd_launch(q, k, v, do, g, S0, W0, dS, dW, 16, mode="split")
    b = chunk.bwd_launch(q, k, v, do, g, S0, W0, dS, dW, 16, mode="fused")
    assert a[2] is None and a[3] is None  # dq2, dk2: only for the cross operator
    for x, y in zip(a, b):
        if x is not None:
            assert rel(x, y) < 1e-5
