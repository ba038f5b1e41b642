"""The cross operator behind wide heads, segmented forwards and value blocks.

The kernels compute o_t = sum_{i <= j <= t} g^(2t-i-j) (q_t . k_i)(q2_j . k2_i) v_j;
HLA2 is q2 = q, k2 = k. A head wider than one tile is the sum of this operator over
pairs of feature blocks. Truth here: that index sum written out in float64 torch
(and, for states, the token recurrence it satisfies), differentiated by autograd.
"""
import importlib

import pytest

from .helpers import rand_qkv, ref_hla2, rel, torch
from .test_hla2_triton import poison  # noqa: F401  (fixture)

import hla_fast

chunk = importlib.import_module("hla_fast.hla2.chunk")


def cross_index_sum(q, k, q2, k2, v, g):
    """o [B, T, H, V] = sum_{i <= j <= t} g^(2t-i-j) (q_t . k_i)(q2_j . k2_i) v_j, float64."""
    T = q.shape[1]
    t = torch.arange(T, dtype=torch.float64)
    x = torch.einsum("bthd,bihd->bhti", q, k)          # q_t . k_i
    y = torch.einsum("bjhd,bihd->bhij", q2, k2)        # q2_j . k2_i
    ti, ii, jj = torch.meshgrid(t, t, t, indexing="ij")
    w = torch.where((ii <= jj) & (jj <= ti), g ** (2 * ti - ii - jj), torch.zeros(()))  # [t, i, j]
    return torch.einsum("bhti,bhij,tij,bjhv->bthv", x, y, w, v)


def cross_recurrence(q, k, q2, k2, v, g, S0=None, W0=None):
    """Token recurrence of the cross operator from a start state, float64:
    S_t = g S_{t-1} + k_t k2_t^T,  W_t = g^2 W_{t-1} + (S_t q2_t) v_t^T,  o_t = q_t^T W_t."""
    B, T, H, K = q.shape
    K2, V = q2.shape[-1], v.shape[-1]
    S = q.new_zeros(B, H, K, K2) if S0 is None else S0
    W = q.new_zeros(B, H, K, V) if W0 is None else W0
    outs = []
    for s in range(T):
        S = g * S + k[:, s, :, :, None] * k2[:, s, :, None, :]
        u = (S @ q2[:, s, :, :, None])[..., 0]
        W = g * g * W + u[..., :, None] * v[:, s, :, None, :]
        outs.append((q[:, s, :, None, :] @ W)[..., 0, :])
    return torch.stack(outs, 1), S, W


def _cross_inputs(device, B=1, T=37, H=2, K=12, K2=20, V=24, seed=30):
    q, k, v = rand_qkv(B, T, H, K, V, seed=seed, device=device)
    q2, k2, _ = rand_qkv(B, T, H, K2, 1, seed=seed + 1, device=device)
    return q, k, q2, k2, v


def test_recurrence_is_the_index_sum():
    q, k, q2, k2, v = (x.double() for x in _cross_inputs("cpu"))
    o, _, _ = cross_recurrence(q, k, q2, k2, v, 0.9)
    assert rel(o, cross_index_sum(q, k, q2, k2, v, 0.9)) < 1e-12


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("mode", ["fused", "two_pass"])
def test_cross_forward(gamma, mode, device, poison):  # noqa: F811
    q, k, q2, k2, v = _cross_inputs(device)
    o, S, W, _ = chunk.fwd_launch(q, k, v, gamma, None, None, 16, mode=mode, q2=q2, k2=k2, block_v=16)
    d64 = [x.double().cpu() for x in (q, k, q2, k2, v)]
    assert rel(o, cross_index_sum(*d64, gamma)) < 1e-5
    _, S_ref, W_ref = cross_recurrence(*d64, gamma)
    assert S.shape == (1, 2, 12, 20) and rel(S, S_ref) < 1e-5 and rel(W, W_ref) < 1e-5


@pytest.mark.parametrize("mode", ["split", "fused"])
@pytest.mark.parametrize("gamma", [1.0, 0.85])
def test_cross_gradients(mode, gamma, device, poison):  # noqa: F811
    """Every gradient of the cross operator (q, k, q2, k2, v, S0, W0) against float64 autograd,
    with a loss that also reads the final state."""
    q, k, q2, k2, v = _cross_inputs(device, T=41, K=20, K2=12, V=16)
    gen = torch.Generator().manual_seed(31)
    S0 = torch.randn(1, 2, 20, 12, generator=gen) * 0.3
    W0 = torch.randn(1, 2, 20, 16, generator=gen) * 0.3
    do = torch.randn(1, 41, 2, 16, generator=gen)
    dS = torch.randn(1, 2, 20, 12, generator=gen)
    dW = torch.randn(1, 2, 20, 16, generator=gen)
    got = chunk.bwd_launch(q, k, v, do.to(device), gamma, S0.to(device), W0.to(device), dS.to(device),
                           dW.to(device), 16, mode=mode, q2=q2, k2=k2)
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, q2, k2, v, S0, W0)]
    o, S, W = cross_recurrence(*leaves[:5], gamma, leaves[5], leaves[6])
    ((o * do.double()).sum() + (S * dS.double()).sum() + (W * dW.double()).sum()).backward()
    want = [x.grad for x in leaves]
    names = ["dq", "dk", "dq2", "dk2", "dv", "dS0", "dW0"]
    order = [0, 1, 2, 3, 4, 5, 6]
    for name, i in zip(names, order):
        assert rel(got[i], want[i]) < 1e-4, name


@pytest.mark.parametrize("segments", [2, 3, 5])
@pytest.mark.parametrize("init", [False, True])
def test_segmented_forward_equals_one_segment(segments, init, device, poison):  # noqa: F811
    """Segments run in parallel from start states folded from their summaries; outputs,
    final state and stored chunk states equal the one-segment walk (T = 85: 6 chunks of 16)."""
    q, k, v = rand_qkv(2, 85, 2, 16, 24, seed=32, device=device)
    S0 = torch.randn(2, 2, 16, 16, device=device) * 0.2 if init else None
    W0 = torch.randn(2, 2, 16, 24, device=device) * 0.2 if init else None
    a = chunk.fwd_launch(q, k, v, 0.9, S0, W0, 16, mode="fused", block_v=16, segments=1)
    b = chunk.fwd_launch(q, k, v, 0.9, S0, W0, 16, mode="fused", block_v=16, segments=segments)
    for x, y in zip(a[:3], b[:3]):
        assert rel(y, x) < 1e-5
    ref = ref_hla2(q, k, v, 0.9) if not init else None
    if ref is not None:
        assert rel(b[0], ref) < 1e-5
    sa = chunk.fwd_launch(q, k, v, 0.9, S0, W0, 16, mode="states", block_v=16, segments=1)
    sb = chunk.fwd_launch(q, k, v, 0.9, S0, W0, 16, mode="states", block_v=16, segments=segments)
    for x, y in zip(sa[3] + sa[1:3], sb[3] + sb[1:3]):
        assert rel(y, x) < 1e-5


def test_segments_through_hla2(monkeypatch, device, poison):  # noqa: F811
    monkeypatch.setattr(chunk, "FWD_SEGMENTS", 3)
    q, k, v = rand_qkv(1, 70, 2, 16, 8, seed=33, device=device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, st = hla_fast.hla2(*leaves, gamma=0.95, chunk_size=16, backend="triton", output_final_state=True)
    assert rel(o, ref_hla2(q, k, v, 0.95)) < 1e-5
    o.sum().backward()
    d64 = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    o64, st64 = hla_fast.hla2(*d64, gamma=0.95, backend="torch", output_final_state=True)
    o64.sum().backward()
    assert rel(st.S, st64.S) < 1e-5 and rel(st.W, st64.W) < 1e-5
    for a, b in zip(leaves, d64):
        assert rel(a.grad, b.grad) < 1e-4


@pytest.mark.parametrize("K,V", [(150, 12), (20, 140), (133, 131)])
def test_wide_heads(K, V, device, poison):  # noqa: F811
    """Heads wider than one 128-feature tile: feature-block pairs (K) and value blocks (V),
    forward, final state and every gradient, against the float64 torch path."""
    B, T, H = 1, 19, 1
    q, k, v = rand_qkv(B, T, H, K, V, seed=K + V, scale=0.2, device=device)
    gen = torch.Generator().manual_seed(34)
    S0 = torch.randn(B, H, K, K, generator=gen) * 0.05
    W0 = torch.randn(B, H, K, V, generator=gen) * 0.05
    w_o = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    w_s = torch.randn(B, H, K, K, generator=gen, dtype=torch.float64)
    w_w = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)

    def run(dtype, dev, backend):
        leaves = [x.detach().to(dev, dtype).requires_grad_() for x in (q, k, v, S0, W0)]
        o, fin = hla_fast.hla2(*leaves[:3], gamma=0.9, initial_state=hla_fast.HLA2State(leaves[3], leaves[4]),
                               output_final_state=True, chunk_size=16, backend=backend)
        loss = (o * w_o.to(dev, dtype)).sum() + (fin.S * w_s.to(dev, dtype)).sum()
        (loss + (fin.W * w_w.to(dev, dtype)).sum()).backward()
        return [o, fin.S, fin.W] + [x.grad for x in leaves]

    got = run(torch.float32, device, "triton")
    want = run(torch.float64, "cpu", "torch")
    for name, a, b in zip(["o", "S", "W", "dq", "dk", "dv", "dS0", "dW0"], got, want):
        assert rel(a, b) < 1e-4, name


@pytest.mark.parametrize("K", [1, 64, 128, 129, 150, 200, 256])
@pytest.mark.parametrize("width", [64, 128])
def test_feature_blocks_tile_the_head(K, width, monkeypatch):
    monkeypatch.setattr(chunk, "FEATURE_BLOCK", width)
    blocks = chunk._feature_blocks(K)
    assert blocks[0][0] == 0 and blocks[-1][1] == K
    assert all(a1 == b0 for (_, a1), (b0, _) in zip(blocks, blocks[1:]))   # contiguous, no gap
    sizes = [b - a for a, b in blocks]
    assert max(sizes) <= (chunk.TILE_MAX if K <= chunk.TILE_MAX else width)
    assert max(sizes) - min(sizes) <= 1                                     # as even as possible
    vb = chunk._value_blocks(K)
    assert vb[0][0] == 0 and vb[-1][1] == K and max(b - a for a, b in vb) <= chunk.TILE_MAX


def test_two_128_wide_blocks(monkeypatch, device, poison):  # noqa: F811
    """The 128-wide block split (one cross pair each way) gives the same operator."""
    monkeypatch.setattr(chunk, "FEATURE_BLOCK", 128)
    q, k, v = rand_qkv(1, 21, 1, 140, 8, seed=35, scale=0.2, device=device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, st = hla_fast.hla2(*leaves, gamma=0.9, chunk_size=16, backend="triton", output_final_state=True)
    o.sum().backward()
    d64 = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    o64, st64 = hla_fast.hla2(*d64, gamma=0.9, backend="torch", output_final_state=True)
    o64.sum().backward()
    assert rel(o, o64) < 1e-5 and rel(st.S, st64.S) < 1e-5 and rel(st.W, st64.W) < 1e-5
    for a, b in zip(leaves, d64):
        assert rel(a.grad, b.grad) < 1e-4


def test_wide_head_normalized_with_carry_over(device, poison):  # noqa: F811
    """normalize=True on a 140-wide head (the denominator runs through the same block pairs),
    in two pieces with the state passed on."""
    q, k, v = rand_qkv(1, 30, 1, 140, 6, seed=36, positive=True, scale=0.1, device=device)
    kw = dict(gamma=0.9, normalize=True, chunk_size=16, backend="triton", output_final_state=True)
    o1, st = hla_fast.hla2(q[:, :13], k[:, :13], v[:, :13], **kw)
    o2, st2 = hla_fast.hla2(q[:, 13:], k[:, 13:], v[:, 13:], initial_state=st, **kw)
    want = ref_hla2(q, k, v, 0.9, normalize=True)
    assert rel(torch.cat([o1, o2], 1), want) < 1e-5
    d64 = [x.double().cpu() for x in (q, k, v)]
    _, st64 = hla_fast.hla2(*d64, gamma=0.9, normalize=True, backend="torch", output_final_state=True)
    for a, b in zip(st2, st64):
        assert rel(a, b) < 1e-5


def _backward_case(device, cross, T, seed, plain_dims):
    """Inputs of a backward check: (q, k, q2, k2, v) (q2 = k2 = None unless cross), a start
    state (S0, W0), and cotangents dO, dS_T, dW_T, all float32."""
    K, K2, V = (12, 20, 16) if cross else plain_dims
    q, k, q2, k2, v = _cross_inputs(device, B=1, T=T, K=K, K2=K2, V=V, seed=seed)
    if not cross:
        q2 = k2 = None
    gen = torch.Generator().manual_seed(seed + 1)
    S0 = (torch.randn(1, 2, K, K2, generator=gen) * 0.2).to(device)
    W0 = (torch.randn(1, 2, K, V, generator=gen) * 0.2).to(device)
    do = torch.randn(1, T, 2, V, generator=gen).to(device)
    dS = torch.randn(1, 2, K, K2, generator=gen).to(device)
    dW = torch.randn(1, 2, K, V, generator=gen).to(device)
    return (q, k, q2, k2, v), (S0, W0), (do, dS, dW)


def _assert_same_grads(a, b, tol):
    """Two bwd_launch results: the same gradients present, each within tol (relative)."""
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert rel(y, x) < tol


@pytest.mark.parametrize("mode", ["split", "fused"])
@pytest.mark.parametrize("segments", [3, 7])
@pytest.mark.parametrize("cross", [False, True])
def test_segmented_backward_equals_one_walk(mode, segments, cross, device, poison):  # noqa: F811
    """Backward walks run per segment from end gradients folded last to first (the reverse of the
    forward's fold): every gradient, the initial state's included, equals the single walk.
    T = 100: 7 chunks of 16, cut into segments of 3, 3 and 1 chunks, or 7 single chunks."""
    (q, k, q2, k2, v), (S0, W0), (do, dS, dW) = _backward_case(device, cross, 100, 37, (16, 16, 16))
    for dS_, dW_ in ((dS, dW), (None, None)):
        a = chunk.bwd_launch(q, k, v, do, 0.9, S0, W0, dS_, dW_, 16, mode=mode, q2=q2, k2=k2, segments=1)
        b = chunk.bwd_launch(q, k, v, do, 0.9, S0, W0, dS_, dW_, 16, mode=mode, q2=q2, k2=k2, segments=segments)
        _assert_same_grads(a, b, 1e-5)


def test_segment_rules(monkeypatch):
    """The occupancy rules behind the automatic segment counts (an H200 has 132 SMs)."""
    monkeypatch.setattr(chunk, "_sm_count", lambda device: 132)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # forward: all programs in one wave of two (4 warps) or one (8 warps) per SM
    assert chunk.fwd_segments(64, 512, cuda, per_sm=2) == 4        # 256 programs <= 264
    assert chunk.fwd_segments(128, 512, cuda, per_sm=1) == 1       # K = V = 128: 128 programs
    assert chunk.fwd_segments(2, 512, cuda, per_sm=2) == 128       # few heads: many segments ...
    assert chunk.fwd_segments(2, 20, cuda, per_sm=2) == 5          # ... of at least 4 chunks
    assert chunk.fwd_segments(64, 512, cpu) == 1
    monkeypatch.setattr(chunk, "FWD_SEGMENTS", 7)
    assert chunk.fwd_segments(64, 512, cuda) == 7 and chunk.fwd_segments(64, 3, cuda) == 3
    # backward walks: the measured case only (split layout, 4 warps)
    assert chunk.bwd_segments(512, 64, "split", 4, cuda) == 4
    assert chunk.bwd_segments(512, 64, "fused", 4, cuda) == 1
    assert chunk.bwd_segments(512, 64, "split", 8, cuda) == 1
    assert chunk.bwd_segments(512, 64, "split", 4, cpu) == 1
    monkeypatch.setattr(chunk, "BWD_SEGMENTS", 3)
    assert chunk.bwd_segments(512, 64, "fused", 8, cuda) == 3


def test_layout_rules(monkeypatch):
    """The measured layout rules: split backward with dq and (dk, dv) from two launches, chunks
    of at most 32 rows in the forward and backward of heads wider than 64."""
    assert chunk.bwd_mode(64, 64) == chunk.bwd_mode(128, 128) == "split"
    assert chunk.bwd_grad_parts(64, 64) == chunk.bwd_grad_parts(128, 128) == (1, 6)
    assert chunk.fwd_chunk_size(64, 64, 64) == 64 and chunk.fwd_chunk_size(64, 64, 128) == 128
    assert chunk.fwd_chunk_size(128, 128, 64) == 32 and chunk.fwd_chunk_size(64, 96, 16) == 16
    assert chunk.bwd_chunk_size(64, 64, 128) == 64 and chunk.bwd_chunk_size(96, 64, 64) == 32
    monkeypatch.setattr(chunk, "BWD_MODE", "fused")
    monkeypatch.setattr(chunk, "BWD_GRAD_PARTS", [7])
    assert chunk.bwd_mode(64, 64) == "fused" and chunk.bwd_grad_parts(64, 64) == (7,)


@pytest.mark.parametrize("cross", [False, True])
def test_gradient_launches_split_by_part(cross, device, poison):  # noqa: F811
    """The split layout's per-chunk gradient kernel can store dq, dk and dv from separate
    launches (each compiles to a smaller kernel): every grouping gives the same gradients,
    and a grouping that misses or repeats a gradient is refused."""
    (q, k, q2, k2, v), (S0, W0), (do, dS, _) = _backward_case(device, cross, 45, 41, (16, 16, 24))

    def grads(parts):
        return chunk.bwd_launch(q, k, v, do, 0.9, S0, W0, dS, None, 16, mode="split", q2=q2, k2=k2,
                                grad_parts=parts)

    whole = grads((7,))
    for parts in ((1, 2, 4), (3, 4), (5, 2)):
        _assert_same_grads(whole, grads(parts), 1e-6)
    for bad in ((1, 2), (3, 6), (7, 1)):
        with pytest.raises(ValueError, match="grad_parts"):
            grads(bad)


@pytest.mark.parametrize("cross", [False, True])
def test_backward_from_saved_states(cross, device, poison):  # noqa: F811
    """A fused forward that stores its chunk-start states (MODE 4) gives the same outputs as
    one that does not, the same states as the states-only pass, and a backward that starts
    from them gives the gradients of one that recomputes them."""
    (q, k, q2, k2, v), (S0, W0), (do, _, _) = _backward_case(device, cross, 45, 43, (16, 16, 24))
    plain = chunk.fwd_launch(q, k, v, 0.9, S0, W0, 16, q2=q2, k2=k2, segments=2)
    saved = chunk.fwd_launch(q, k, v, 0.9, S0, W0, 16, q2=q2, k2=k2, segments=2, snapshots=torch.float32)
    states = chunk.fwd_launch(q, k, v, 0.9, S0, W0, 16, mode="states", q2=q2, k2=k2, segments=1)[3]
    assert plain[3] is None
    for x, y in zip(plain[:3], saved[:3]):
        assert rel(y, x) < 1e-6
    for x, y in zip(states, saved[3]):
        assert rel(y, x) < 1e-5
    a = chunk.bwd_launch(q, k, v, do, 0.9, S0, W0, None, None, 16, mode="split", q2=q2, k2=k2)
    b = chunk.bwd_launch(q, k, v, do, 0.9, S0, W0, None, None, 16, mode="split", q2=q2, k2=k2, states=saved[3])
    _assert_same_grads(a, b, 1e-5)


@pytest.mark.parametrize("save", [True, False])
def test_hla2_gradients_with_and_without_saved_states(save, monkeypatch, device, poison):  # noqa: F811
    """hla2() through autograd: whether the forward keeps its chunk-start states for the backward
    (SAVE_CHUNK_STATES) or the backward recomputes them, the gradients match the float64 torch path."""
    monkeypatch.setattr(chunk, "SAVE_CHUNK_STATES", save)
    calls = []
    launch = chunk.fwd_launch
    monkeypatch.setattr(chunk, "fwd_launch", lambda *a, **kw: calls.append(kw.get("mode")) or launch(*a, **kw))
    q, k, _, _, v = _cross_inputs(device, B=1, T=37, K=12, K2=12, V=20, seed=45)
    do = torch.randn(1, 37, 2, 20, generator=torch.Generator().manual_seed(46)).to(device)
    grads = []
    for backend, dt in (("triton", torch.float32), ("torch", torch.float64)):
        leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        o, _ = hla_fast.hla2(*leaves, gamma=0.9, chunk_size=16, backend=backend)
        o.backward(do.to(dt))
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert rel(a, b) < 1e-5
    # the triton forward ran once; the backward recomputed the states only when they were not kept
    assert calls == (["fused"] if save else ["fused", "states"])
