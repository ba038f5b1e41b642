"""AHLA's own launchers (hla_fast/ops/ahla/chunk.py, decode.py) beyond the operator contract: chunk
sizes, value blocks in both passes, kept or recomputed chunk states, the state the walk carries,
bf16 inputs, strong gates, a wide head, the configuration rule and the decode kernel. Under
TRITON_INTERPRET=1 on a CPU, compiled on CUDA. Kernel outputs are poisoned with NaN first."""
import importlib
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import DEVICE, HAS_CUDA
from .helpers import (BENCHMARKS, HOPPER_SHARED, brute_ahla, has_cuda_compiler, rand_gates, rand_qkv, rel, run_compiler,
                      torch)

import hla_fast
from hla_fast import AHLAState, ChunkConfig
from hla_fast.ops.ahla.naive import ahla_naive_recurrent
from hla_fast.ops.common.launch import bf16_dots
from hla_fast.ops.common import launch

chunk = importlib.import_module("hla_fast.ops.ahla.chunk")
decode = importlib.import_module("hla_fast.ops.ahla.decode")

# fp32 kernels against float64: the products are fp32 (ieee on the interpreter, tf32x3 on a GPU)
TOL = 1e-5


def _cfg(fwd_chunk=16, bwd_chunk=16, block_v=16, save_states=True, prefetch=True):
    return ChunkConfig(fwd_chunk=fwd_chunk, bwd_chunk=bwd_chunk, fwd_block_v=block_v, grad_parts=(7,),
                       save_states=save_states, fwd_prefetch=prefetch, bwd_prefetch=prefetch)


def _inputs(device, B=1, T=45, H=2, K=12, V=20, seed=5, positive=False):
    q, k, v = rand_qkv(B, T, H, K, V, seed=seed, positive=positive, device=device)
    return q, k, v, rand_gates(B, T, H, seed=seed, device=device)


def _state0(B, H, K, V, normalize, gen, scale=0.2):
    """A random initial state on gen's device: P, E normal; p, e (positive) only when normalizing."""
    dev = gen.device
    return AHLAState(scale * torch.randn(B, H, K, V, generator=gen, device=dev),
                     scale * torch.randn(B, H, K, V, generator=gen, device=dev),
                     scale * torch.rand(B, H, K, generator=gen, device=dev) if normalize else None,
                     scale * torch.rand(B, H, K, generator=gen, device=dev) if normalize else None)


def _grads64(q, k, v, g, do, st0=None, normalize=False):
    """float64 torch-path output and gradients (q, k, v, g, then the state's parts)."""
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v, g)]
    st = None if st0 is None else AHLAState(*(None if x is None else x.detach().double().cpu().requires_grad_()
                                             for x in st0))
    o, _ = hla_fast.ahla(*leaves[:3], g=leaves[3], normalize=normalize, initial_state=st, backend="torch")
    parts = [] if st is None else [x for x in st if x is not None]
    return o, torch.autograd.grad((o * do.double().cpu()).sum(), leaves + parts)


@pytest.mark.parametrize("C", [16, 32, 64, 128])
@pytest.mark.parametrize("T", [1, 17, 45, 70])
def test_every_chunk_size_is_the_index_sum(C, T, device, poison):
    q, k, v, g = _inputs(device, T=T, seed=T)
    o, _ = hla_fast.ahla(q, k, v, g=g, chunk_size=C, backend="triton")
    assert rel(o, brute_ahla(q, k, v, g=g)) < TOL


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("segments", [1, 2])
def test_chunks_of_128_scale_the_rows(normalize, segments, device, poison):
    """Forward walks and segment summaries of chunks of 128 apply the state update's decay to the
    rows of V and R (SCALE_ROWS), of 64 to the columns of K^T; both are the operator: three chunks
    (the last one shorter) with gates, an initial state and the final state against float64."""
    from hla_fast.ops.common.compile import Recorder

    B, T, H, K, V = 1, 300, 2, 12, 20
    q, k, v, g = _inputs(device, T=T, seed=31, positive=normalize)
    st0 = _state0(B, H, K, V, normalize, torch.Generator(device=device).manual_seed(32))
    want, want_st = hla_fast.ahla(q.double(), k.double(), v.double(), g=g.double(), normalize=normalize,
                                  initial_state=AHLAState(*(None if x is None else x.double() for x in st0)),
                                  output_final_state=True, backend="torch")
    for C in (64, 128):
        if C > launch.FP32_MAX_CHUNK and segments > 1 and device == "cuda":
            continue   # fp32 segment summaries of chunks of 128 ask Hopper for 256 KB of shared memory
        cfg = _cfg(C, C).replace(fwd_segments=segments)
        o, st = hla_fast.ahla(q, k, v, g=g, normalize=normalize, initial_state=st0, output_final_state=True,
                              backend="triton", config=cfg)
        assert rel(o, want) < TOL
        for a, b in zip(st, want_st):
            if b is not None:
                assert rel(a, b) < TOL
        rec = Recorder()
        with torch.no_grad():
            chunk.ahla_chunked(q, k, v, g, None, *st0, normalize, 1e-6, cfg, C, launch=rec)
        scale = {kern.fn.__name__: kw["SCALE_ROWS"] for kern, _, kw in rec.launches if "SCALE_ROWS" in kw}
        assert set(scale) == ({"ahla_fwd_kernel", "ahla_fwd_summary_kernel"} if segments > 1 else {"ahla_fwd_kernel"})
        assert set(scale.values()) == {C >= chunk.SCALE_ROWS_MIN_CHUNK}


@pytest.mark.parametrize("bwd_chunk", [16, 32])
@pytest.mark.parametrize("save_states", [False, True])
@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("prefetch", [False, True])
def test_backward_chunks_and_kept_or_recomputed_states(bwd_chunk, save_states, segments, prefetch, device, poison):
    """The backward's chunk need not be the forward's (then the states are recomputed); kept and
    recomputed chunk-start states, one walk or segments (T = 50: the last one shorter), walks that
    load their next chunk ahead or not, give the same gradients."""
    q, k, v, g = _inputs(device, T=50, seed=6)
    do = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(7))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o, _ = hla_fast.ahla(*leaves[:3], g=leaves[3], backend="triton",
                         config=_cfg(bwd_chunk=bwd_chunk, save_states=save_states, prefetch=prefetch).replace(
                             fwd_segments=segments, bwd_segments=segments))
    got = torch.autograd.grad((o * do.to(device)).sum(), leaves)
    o64, want = _grads64(q, k, v, g, do)
    assert rel(o, o64) < TOL
    for name, a, b in zip(["dq", "dk", "dv", "dg"], got, want):
        assert rel(a, b) < (1e-4 if name == "dg" else TOL), name


@pytest.mark.parametrize("keys_per_block", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_value_blocks_in_both_passes(normalize, keys_per_block, device, poison, monkeypatch):
    """V = 80: five forward value blocks of 16, two backward blocks of 64 (BWD_BLOCK_V; 81 columns
    normalized), with an initial state whose columns are split the same way; the per-chunk
    gradient kernel keeps its key tiles across the value blocks or forms them in each."""
    monkeypatch.setattr(chunk, "grad_keys_per_block", lambda n, BK, dtype: keys_per_block)
    B, T, H, K, V = 1, 33, 2, 12, 80
    q, k, v, g = _inputs(device, B, T, H, K, V, seed=8, positive=normalize)
    gen = torch.Generator().manual_seed(9)
    st0 = AHLAState(*(None if x is None else x.to(device) for x in _state0(B, H, K, V, normalize, gen)))
    do = torch.randn(B, T, H, V, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    parts = [None if x is None else x.clone().requires_grad_() for x in st0]
    o, _ = hla_fast.ahla(*leaves[:3], g=leaves[3], normalize=normalize, initial_state=AHLAState(*parts),
                         backend="triton", config=_cfg(block_v=16))
    got = torch.autograd.grad((o * do.to(device)).sum(), leaves + [x for x in parts if x is not None])
    o64, want = _grads64(q, k, v, g, do, st0, normalize)
    assert rel(o, o64) < TOL
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel(a, b) < (1e-4 if i == 3 else TOL), i
    # one forward value block gives the same output
    o_one, _ = hla_fast.ahla(q, k, v, g=g, normalize=normalize, initial_state=st0, backend="triton",
                             config=_cfg(block_v=128))
    assert rel(o_one, o) < 1e-6


@pytest.mark.parametrize("parts", [(1, 6), (1, 2, 4), (3, 4), (4, 2, 1)])
@pytest.mark.parametrize("normalize", [False, True])
def test_gradient_launches(parts, normalize, device, poison):
    """The per-chunk gradients split over the launches ``config.grad_parts`` names (each storing
    its gradients and its share of dL/db) equal the float64 path's, with two backward value blocks
    (V = 70) and gates."""
    B, T, H, K, V = 1, 37, 2, 12, 70
    q, k, v, g = _inputs(device, B, T, H, K, V, seed=14, positive=normalize)
    do = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(15))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o, _ = hla_fast.ahla(*leaves[:3], g=leaves[3], normalize=normalize, backend="triton",
                         config=_cfg().replace(grad_parts=parts))
    got = torch.autograd.grad((o * do.to(device)).sum(), leaves)
    o64, want = _grads64(q, k, v, g, do, normalize=normalize)
    assert rel(o, o64) < TOL
    for name, a, b in zip(["dq", "dk", "dv", "dg"], got, want):
        assert rel(a, b) < (1e-4 if name == "dg" else TOL), name


def test_snapshots_are_the_states_at_chunk_starts(device, poison):
    """The forward's chunk-start snapshots and the final state are the token recurrence's states."""
    B, T, H, K, V = 1, 40, 2, 12, 20
    q, k, v, g = _inputs(device, B, T, H, K, V, seed=10)
    gen = torch.Generator().manual_seed(11)
    p0, e0 = (0.2 * torch.randn(B, H, K, V, generator=gen).to(device) for _ in range(2))
    _, _, PT, ET, _, cs, _ = chunk.fwd_launch(q, k, v, g, None, p0, e0, None, chunk=16, warps=4, block_v=16,
                                              outputs=False, snapshots=torch.float32)
    st = AHLAState(p0.double().cpu(), e0.double().cpu())
    for c, t0 in enumerate(range(0, T, 16)):
        for name, snap, want in (("P", cs[0], st.P), ("E", cs[1], st.E)):
            assert rel(snap.view(B, H, -1, K, V)[:, :, c], want) < TOL, (name, c)
        sl = slice(t0, t0 + 16)
        _, st = ahla_naive_recurrent(q[:, sl].double().cpu(), k[:, sl].double().cpu(), v[:, sl].double().cpu(),
                                     initial_state=st, g=g[:, sl].double().cpu())
    assert rel(PT, st.P) < TOL and rel(ET, st.E) < TOL


def test_bf16_inputs(device, poison):
    """bf16 in, bf16 out: against float64 on the same (rounded) inputs, within bf16's rounding of
    the outputs and gradients (the interpreter widens the dots to fp32; on a GPU they take bf16
    operands, whose rounding the tolerance also covers)."""
    q, k, v, g = _inputs(device, T=40, seed=12)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    do = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(13))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o, st = hla_fast.ahla(*leaves[:3], g=leaves[3], backend="triton", output_final_state=True, config=_cfg())
    assert o.dtype == torch.bfloat16 and st.P.dtype == torch.float32
    got = torch.autograd.grad((o.float() * do.to(device)).sum(), leaves)
    o64, want = _grads64(q, k, v, g, do)
    assert rel(o, o64) < 2e-2
    for a, b in zip(got, want):
        assert rel(a, b) < 3e-2


def test_strong_gates_underflow_to_zero_not_nan(device, poison):
    """Gates near -30 per token: every decay across a token underflows in fp32; nothing overflows."""
    q, k, v, g = _inputs(device, T=37, seed=14)
    g = g.clone()
    g[:, ::3] = -30.0
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o, _ = hla_fast.ahla(*leaves[:3], g=leaves[3], backend="triton", config=_cfg())
    assert rel(o, brute_ahla(q, k, v, g=g)) < TOL
    grads = torch.autograd.grad(o.square().sum(), leaves)
    assert all(torch.isfinite(x).all() for x in grads)


@pytest.mark.parametrize("T,H,chunk", [(45, 2, 16), (1, 3, 16), (64, 5, 32), (129, 16, 64)])
def test_chunk_sums_are_the_chunk_local_cumsum(T, H, chunk, device, poison):
    """``common.cumsum.chunk_sums``, the gate sums every first-order walk reads: the cumulative sum
    of g inside each chunk, head-major and padded to whole chunks with the chunk's last sum
    (``gates.chunk_local_cumsum``, in float64), to the fp32 rounding of a chunk's partial sums."""
    from hla_fast.ops.common.cumsum import chunk_sums
    from hla_fast.ops.common.gates import chunk_local_cumsum

    g = rand_gates(2, T, H, seed=T + H, strength=3.0, device=device)
    got = chunk_sums(g, chunk)
    want = chunk_local_cumsum(g.double().cpu(), chunk).reshape(2 * H, -1)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got.double().cpu(), want, rtol=chunk * 2.0 ** -24, atol=0)


def test_chunk_sums_of_no_gates_are_none():
    """Without log-gates (a constant decay or none) there are no sums to read: ``chunk_sums``
    returns None, which the kernels' heuristics take as HAS_G = False."""
    from hla_fast.ops.common.cumsum import chunk_sums

    assert chunk_sums(None, 64) is None


@pytest.mark.parametrize("op, rates", [("ahla", 1), ("hla2", 2), ("hla3", 2)])
@pytest.mark.parametrize("bwd_chunk", [16, 32])
def test_a_gated_training_call_sums_each_rate_once(op, rates, bwd_chunk):
    """A call's walks share its gate sums (``common.cumsum.GateSums``): a gated training call of AHLA
    computes them once, HLA2 as first-order layers once for each layer's rate (g and 2 g), HLA3 as
    layers once for g (its first stage and K') and once for 3 g, over the forward, the backward
    and, when the backward walks other chunks than the forward, the walks that recompute the states
    at those (then once more, at that chunk size). Recorded launches."""
    from hla_fast.ops.common.compile import Recorder
    from hla_fast.ops.common.cumsum import chunk_sums_kernel

    hla2_chunk = importlib.import_module("hla_fast.ops.hla2.chunk")
    hla3_chunk = importlib.import_module("hla_fast.ops.hla3.chunk")
    B, T, H, K = 1, 40, 2, 16
    q, k, v = (x.requires_grad_() for x in rand_qkv(B, T, H, K, K, seed=3))
    g = rand_gates(B, T, H, seed=4).requires_grad_()
    rule = chunk.ahla_config if op == "ahla" else hla2_chunk.layers_config
    cfg = rule(B, T, H, K, K, torch.float32, torch.device("cpu"), 16, training=True).replace(bwd_chunk=bwd_chunk)
    rec = Recorder()
    if op == "ahla":
        o = chunk.ahla_chunked(q, k, v, g, None, None, None, None, None, False, 0.0, config=cfg, launch=rec)[0]
    elif op == "hla2":
        o = hla2_chunk.hla2_chunked(q, k, v, g, None, None, None, None, False, 0.0, config=cfg, launch=rec)[0]
    else:
        o = hla3_chunk.hla3_chunked(q, k, v, g, None, None, False, 0.0, config=cfg, launch=rec)[0]
    o.backward(torch.ones_like(o))   # nothing ran: the recorded launches are what counts
    sums = sum(kernel is chunk_sums_kernel for kernel, _, _ in rec.launches)
    assert sums == rates * (1 if bwd_chunk == cfg.fwd_chunk else 2)


@pytest.mark.parametrize("stages", [1, 2])
def test_walks_read_the_gate_sums_ahead_or_in_step(stages, device, poison):
    """The forward walk and its segment summaries read each next chunk's gate sums a step ahead
    when the compiler does not pipeline their loads (num_stages 1: ``tiles.walk_factors``' AHEAD)
    and in the step otherwise. Both give the index sums, over segments and a ragged last chunk,
    and with strong gates (-30 every third token: decays underflow in fp32, nothing overflows)."""
    q, k, v, g = _inputs(device, T=45, seed=31)
    strong = g.clone()
    strong[:, ::3] = -30.0
    cfg = _cfg().replace(fwd_segments=3, fwd_stages=stages)
    for gates in (g, strong):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gates)]
        o, _ = hla_fast.ahla(*leaves[:3], g=leaves[3], backend="triton", config=cfg)
        assert rel(o, brute_ahla(q, k, v, g=gates)) < TOL
        grads = torch.autograd.grad(o.square().sum(), leaves)
        assert all(torch.isfinite(x).all() for x in grads)


def test_wide_head(device, poison):
    """K = 130 (a 256-wide key tile), V = 20."""
    q, k, v, g = _inputs(device, T=20, K=130, V=20, seed=15)
    q, k = q * 0.3, k * 0.3
    do = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(16))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o, _ = hla_fast.ahla(*leaves[:3], g=leaves[3], chunk_size=16, backend="triton")
    got = torch.autograd.grad((o * do.to(device)).sum(), leaves)
    o64, want = _grads64(q, k, v, g, do)
    assert rel(o, o64) < TOL
    for name, a, b in zip(["dq", "dk", "dv", "dg"], got, want):
        assert rel(a, b) < (1e-4 if name == "dg" else TOL), name


@pytest.mark.parametrize("save_states", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_layered_backward(save_states, normalize, device, poison):
    """The backward as two first-order layers (config.bwd_layers): its walks over two key blocks
    (K = 72: 128-wide key tiles, walks over blocks of 64) and two value blocks (V = 70, 71 columns
    normalized), kept or recomputed chunk states and R, an initial state and cotangents of the
    final state, gates: every gradient is the float64 path's."""
    B, T, H, K, V = 1, 37, 2, 72, 70
    q, k, v, g = _inputs(device, B, T, H, K, V, seed=19, positive=normalize)
    gen = torch.Generator().manual_seed(20)
    st0 = _state0(B, H, K, V, normalize, gen)
    do = torch.randn(B, T, H, V, generator=gen)
    w = AHLAState(*(None if x is None else torch.randn(x.shape, generator=gen) for x in st0))
    cfg = _cfg(save_states=save_states, prefetch=False).replace(bwd_layers=True)

    def grads(backend, dtype, dev):
        leaves = [x.detach().to(dev, dtype).requires_grad_() for x in (q, k, v, g)]
        parts = [None if x is None else x.to(dev, dtype).requires_grad_() for x in st0]
        o, st = hla_fast.ahla(*leaves[:3], g=leaves[3], normalize=normalize, initial_state=AHLAState(*parts),
                              output_final_state=True, backend=backend, **({"config": cfg} if backend == "triton" else {}))
        loss = (o * do.to(dev, dtype)).sum() + sum((a * b.to(dev, dtype)).sum() for a, b in zip(st, w)
                                                  if a is not None)
        return o, torch.autograd.grad(loss, leaves + [x for x in parts if x is not None])

    o, got = grads("triton", q.dtype, device)
    o64, want = grads("torch", torch.float64, "cpu")
    assert rel(o, o64) < TOL
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel(a, b) < (1e-4 if i == 3 else TOL), i


@pytest.mark.parametrize("layered", [False, True])
def test_normalized_backward_adds_in_place(layered, device, poison):
    """A normalized call's backward adds its denominator's part into the numerator's fp32 dq, dk:
    one pair of [B, T, H, K] fp32 buffers for every gradient kernel, each after the first taking
    the sums so far as dq_in (the coupled backward's two launches, the layered backward's four
    layer kernels). dL/db: the coupled kernels' own shares, added on the host; the layered one's
    once, in the last kernel, from the sums (it is linear in them). The gradients are the float64
    path's (with gates, so that db is checked through dg)."""
    from hla_fast.ops.common.compile import launch_kernel

    q, k, v, g = _inputs(device, T=37, seed=23, positive=True)
    cfg = _cfg(prefetch=False).replace(bwd_layers=layered)
    grad_kernel = chunk.ahla_bwd_layer_kernel if layered else chunk.ahla_bwd_grad_kernel
    seen = []

    def launch(kernel, grid, **kw):
        if kernel is grad_kernel:
            seen.append({a: None if kw[a] is None else (kw[a].data_ptr(), kw[a].dtype) for a in ("dq", "dq_in", "db")})
        launch_kernel(kernel, grid, **kw)

    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o = chunk.ahla_chunked(*leaves, None, None, None, None, None, True, 1e-6, config=cfg, launch=launch)[0]
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(24)).to(device)
    got = torch.autograd.grad((o * do).sum(), leaves)
    assert len(seen) == (4 if layered else 2)
    assert len({s["dq"] for s in seen}) == 1 and seen[0]["dq"][1] == torch.float32
    assert seen[0]["dq_in"] is None and all(s["dq_in"] == s["dq"] for s in seen[1:])
    assert [s["db"] is not None for s in seen] == ([False, False, False, True] if layered else [True, True])
    o64, want = _grads64(q, k, v, g, do, normalize=True)
    assert rel(o, o64) < TOL
    for name, a, b in zip(["dq", "dk", "dv", "dg"], got, want):
        assert rel(a, b) < (1e-4 if name == "dg" else TOL), name


def test_config_rule_and_wide_segments_refused(device):
    cfg = chunk.ahla_config(2, 4096, 4, 64, 64, torch.bfloat16, torch.device(device), 64)
    assert cfg.fwd_chunk == 64 and cfg.save_states
    assert (cfg.fwd_segments == cfg.bwd_segments == 1) == (device == "cpu")   # one segment off CUDA
    wide = chunk.ahla_config(2, 4096, 4, 128, 128, torch.bfloat16, torch.device(device), 64)
    assert wide.fwd_chunk == 64 and wide.bwd_chunk == 32 and not wide.save_states and wide.bwd_warps == 8
    assert wide.fwd_warps == (4 if bf16_dots(torch.bfloat16) else 8)   # bf16 dots: a GPU
    train = chunk.ahla_config(2, 4096, 4, 128, 128, torch.bfloat16, torch.device(device), 64, training=True)
    bf16 = bf16_dots(torch.bfloat16)
    # bf16 dots (a GPU) train 128-wide keys with the layered backward in chunks of 64, a 4-warp forward
    assert train.bwd_layers == bf16 and train.save_states
    assert (train.fwd_chunk, train.bwd_chunk, train.fwd_warps) == ((64, 64, 4) if bf16 else (32, 32, 8))
    assert train.bwd_pieces == 1 and wide.bwd_pieces == 1   # 128 chunks: one piece
    long = chunk.ahla_config(4, 32768, 16, 128, 128, torch.bfloat16, torch.device(device), 64, training=True)
    # 1024 chunks in one segment: the coupled walk in pieces, the layered one whole
    assert long.bwd_segments == 1 and long.bwd_pieces == (1 if bf16 else launch.BWD_PIECES)
    f32_train = chunk.ahla_config(4, 32768, 16, 128, 128, torch.float32, torch.device(device), 64, training=True)
    assert not f32_train.bwd_layers and f32_train.bwd_chunk == 32
    # fp32 keys up to 128 wide: a gradient launch per gradient; 256-wide fp32 keys and bf16: one
    assert f32_train.grad_parts == (1, 2, 4) and long.grad_parts == cfg.grad_parts == (7,)
    assert chunk.ahla_config(2, 4096, 4, 256, 64, torch.float32, torch.device(device), training=True).grad_parts == (7,)
    # fp16 inputs (fp32 tiles, tf32x3 products): fp32's layouts
    for K, V, training in [(64, 64, True), (128, 128, True), (256, 64, True), (64, 64, False), (128, 128, False)]:
        f16 = chunk.ahla_config(2, 4096, 4, K, V, torch.float16, torch.device(device), training=training)
        assert f16 == chunk.ahla_config(2, 4096, 4, K, V, torch.float32, torch.device(device), training=training)
    assert not chunk.ahla_config(2, 4096, 4, 64, 64, torch.bfloat16, torch.device(device), 64, training=True).bwd_layers
    assert chunk.ahla_config(4, 32768, 16, 128, 128, torch.bfloat16, torch.device(device), 64).bwd_pieces == 1
    assert chunk.ahla_config(2, 4096, 4, 64, 64, torch.bfloat16, torch.device(device), 64, training=True) == cfg
    # bf16 walks load ahead, except the 4-warp forward of 128-wide keys and the 4-warp backward walks
    # (and the layered backward, whose walks pipeline their loads instead)
    assert (cfg.fwd_prefetch, cfg.bwd_prefetch) == (bf16, False)
    assert (wide.fwd_prefetch, wide.bwd_prefetch) == (False, bf16)
    assert (train.fwd_prefetch, train.bwd_prefetch) == (False, False)
    # an inference forward of chunks of 128 with 128-wide keys: 8 warps, no loading ahead, its loads
    # pipelined two stages deep with bf16 dots (every other layout above: one stage)
    long_chunks = chunk.ahla_config(2, 4096, 4, 128, 128, torch.bfloat16, torch.device(device), 128)
    assert (long_chunks.fwd_chunk, long_chunks.fwd_warps, long_chunks.fwd_prefetch) == (128, 8, False)
    assert long_chunks.fwd_stages == (2 if bf16 else 1)
    assert {c.fwd_stages for c in (cfg, wide, train, long, f32_train)} == {1}
    # chunk_size None (the call's default): that layout for a bf16 inference forward of 128-wide keys
    # (under the interpreter, whose dots are not bf16, 64), 64 rows everywhere else
    dev = torch.device(device)
    assert chunk.ahla_config(2, 4096, 4, 128, 128, torch.bfloat16, dev, None) == (long_chunks if bf16 else wide)
    assert chunk.ahla_config(2, 4096, 4, 128, 128, torch.bfloat16, dev, None, training=True) == train
    assert chunk.ahla_config(2, 4096, 4, 64, 64, torch.bfloat16, dev, None) == cfg
    assert chunk.ahla_config(2, 4096, 4, 128, 128, torch.float32, dev, None) == \
        chunk.ahla_config(2, 4096, 4, 128, 128, torch.float32, dev, 64)
    f32 = chunk.ahla_config(2, 4096, 4, 128, 128, torch.float32, torch.device(device), 64, training=True)
    assert not f32.fwd_prefetch and not f32.bwd_prefetch
    widest = chunk.ahla_config(1, 4096, 1, 256, 64, torch.bfloat16, torch.device(device), 64)
    assert widest.fwd_segments == widest.bwd_segments == 1 and widest.fwd_chunk == 32
    assert hla_fast.ahla_config is chunk.ahla_config
    q, k, v = rand_qkv(1, 20, 1, 130, 16, seed=17, device=device)
    with pytest.raises(ValueError, match=r"keys wider than 128 \(K=130\) in one segment: config.fwd_segments"):
        hla_fast.ahla(q, k, v, backend="triton", config=ChunkConfig(fwd_segments=2))


def test_the_call_takes_the_training_layout_when_autograd_records(device, monkeypatch):
    """ahla asks the rule for its training layout exactly when an input requires grad and grad
    mode is on."""
    seen = []
    rule = chunk.ahla_config

    def spy(*args):
        seen.append(args[-1])
        return rule(*args)

    monkeypatch.setattr(chunk, "ahla_config", spy)
    q, k, v, g = _inputs(device, T=20, seed=18)
    hla_fast.ahla(q, k, v, g=g, backend="triton")
    hla_fast.ahla(q, k, v, g=g.clone().requires_grad_(), backend="triton")
    with torch.no_grad():
        hla_fast.ahla(q.clone().requires_grad_(), k, v, g=g, backend="triton")
    hla_fast.ahla(q, k, v, g=g, backend="triton", config=_cfg())   # an explicit config: no rule
    assert seen == [False, True, False]


# Shared memory of the per-chunk gradient kernel compiled for Hopper (sm_90), in a fresh interpreter
# without TRITON_INTERPRET, the layout taken from the rule for a CUDA device of 132 multiprocessors.
_GRAD_SHARED = r"""
import json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile
from triton.runtime.jit import JITFunction
from hla_fast.ops.common import launch
launch.sm_count = lambda device: 132
from hla_fast.ops.ahla import chunk, chunk_kernels

def jit(fn):
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn

dev = torch.device("cuda")
out = []
for K, V, dtype, normalize, ones in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    cfg = chunk.ahla_config(1, 2049, 2, K, V, dtype, dev, training=True)
    layer = cfg.bwd_layers or ones   # ones: a normalized layer's kernel (the column of ones as vectors)
    fn = jit(chunk_kernels.ahla_bwd_layer_kernel if layer else chunk_kernels.ahla_bwd_grad_kernel)
    Vn = V + normalize
    BK, BV = chunk.bwd_blocks(K, Vn, dev)
    el = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    snap_dtype = launch.snapshot_dtype(cfg, dtype)
    snap = "*bf16" if snap_dtype == torch.bfloat16 else "*fp32"
    dst = "*bf16" if chunk._dstate_dtype(snap_dtype, BK) == torch.bfloat16 else "*fp32"
    types = dict(q=el, k=el, v=el, do=el, dq=el, dk=el, dv=el, gc="*fp32", db="*fp32", cs_p=snap, cs_e=snap,
                 dp_end=dst, de_end=dst, log_gamma="fp32", T="i32", C0="i32", NP="i32",
                 x=el, dy=el, h0=snap, dh_end=dst, dx=el, dq_in=el, dk_in=el, dd="*fp32", z0="*fp32", dz_end="*fp32")
    consts = dict(H=2, K=K, V=Vn, BT=cfg.bwd_chunk, BK=BK, BV=BV, HAS_DECAY=True, IS_BF16=launch.bf16_dots(dtype),
                  PREC=launch.dot_precision(dtype), HAS_G=True, HAS_DB=True)
    if layer:
        consts.update(HAS_DQ_IN=True, HAS_DK_IN=True, DB_OWN=False, DX_TO_DK=False, NORM=ones)
    else:
        # a normalized call's denominator part adds into the numerator's dq, dk (ahla_bwd)
        consts.update(HAS_DQ_IN=normalize, HAS_DK_IN=normalize,
                      KEYS_PER_BLOCK=chunk.grad_keys_per_block(launch.cdiv(Vn, BV), BK, dtype))
    shared = 0
    for parts in [None] if layer else cfg.grad_parts:   # every launch of the per-chunk gradients
        if parts is not None:
            consts["PARTS"] = parts
        sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()})
        kernel = triton_compile(src, target=GPUTarget("cuda", 90, 32), options=dict(
            num_warps=cfg.bwd_warps, num_stages=chunk.LAYER_STAGES if layer else 1))
        shared = max(shared, kernel.metadata.shared)
    out.append(shared)
print(json.dumps(out))
"""


@pytest.mark.skipif(not has_cuda_compiler(), reason="needs triton.compiler.ASTSource, GPUTarget and the CUDA backend")
def test_grad_kernel_fits_hopper_shared_memory():
    """The per-chunk gradient kernel, in the layouts the rule gives for shapes that once took more
    shared memory than an H200 has (294 to 332 KB): fp32 with two value blocks, K = 256 in fp32
    and bf16 normalized (65 value columns), fp16 (tf32 products of fp32 tiles took 368 KB and
    more); bf16 at K = V = 64 normalized, whose key tiles stay across the value blocks; bf16 at
    K = 256, where bf16 chunk-end state gradients are staged in shared memory (324 KB, so it keeps
    fp32 ones, ``chunk._dstate_dtype``); and bf16 at K = 128, whose training takes the layered
    backward: its per-chunk kernel (``ahla_bwd_layer_kernel``), with loads pipelined, plain and
    normalized (three value blocks); and that kernel for HLA2's normalized outer layer (the column
    of ones carried as vectors, NORM) at K = V = 64 and 128. Every launch the rule splits the
    gradients into is compiled (fp32 keys up to 128 wide: one a gradient; at K = 256
    normalized one of those took 228 KB, so 256-wide fp32 keys keep one launch)."""
    cases = [(128, 128, "float32", False, False), (256, 64, "float32", True, False), (256, 64, "bfloat16", True, False),
             (64, 64, "float32", True, False), (128, 128, "float32", True, False),
             (64, 64, "float16", False, False), (64, 64, "bfloat16", True, False), (128, 128, "bfloat16", False, False),
             (128, 128, "bfloat16", True, False), (256, 256, "bfloat16", False, False),
             (64, 64, "bfloat16", False, True), (128, 128, "bfloat16", False, True)]
    shared = json.loads(run_compiler(["-c", _GRAD_SHARED, json.dumps(cases)], timeout=600).strip().splitlines()[-1])
    for case, nbytes in zip(cases, shared):
        assert nbytes <= HOPPER_SHARED, (case, nbytes)


_RECORDED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])   # benchmarks/
from compile_report import record_launches

out = {}
for which in ("forward", "both"):
    cfg, launches = record_launches("ahla", 4, 4096, 16, 128, 128, torch.bfloat16, forward_only=which == "forward",
                                    normalize=True)
    out[which] = sorted({kernel.fn.__name__ for kernel, _, _ in launches})
try:
    record_launches("hla3", 1, 64, 1, 16, 16, torch.bfloat16, normalize=True)
except ValueError as e:
    out["hla3"] = str(e)
print(json.dumps(out))
"""


def test_compile_report_records_normalized_ahla_calls():
    """``compile_report.py --normalize`` records AHLA's normalized call as it runs (its autograd
    Function rehearsed on meta tensors): the forward walk alone for an inference forward; for a
    training call also the one-pass output gradient and the backward's launches. Third order's
    normalized launchers are refused by name."""
    got = json.loads(run_compiler(["-c", _RECORDED, BENCHMARKS], timeout=300).strip().splitlines()[-1])
    assert got["forward"] == ["ahla_fwd_kernel"], got
    assert {"ahla_fwd_kernel", "normalized_grad_kernel"} <= set(got["both"]), got
    assert any(name.startswith("ahla_bwd") for name in got["both"]), got
    assert got["hla3"].startswith("normalize: only hla2's and ahla's launchers"), got


@pytest.mark.parametrize("gates", [False, True])
def test_normalized_call_walks_the_denominator_then_the_values(gates, device, poison):
    """A normalized call runs the unnormalized walks twice (``ahla.chunk`` module docstring): the
    forward walks the denominator on [1 | 0 ...] (ONES_ALIGN columns, outputs in fp32), then the
    values, dividing by it as it stores them (DEN_IN); a training forward keeps both walks' states,
    so the backward walks no forward again and runs two per-chunk gradient launches, the values'
    and the ones column's. The recorded launches run too: outputs and gradients against float64."""
    from hla_fast.ops.common.compile import Recorder, launch_kernel
    from hla_fast.ops.common.normalize import ONES_ALIGN

    B, T, H, K, V = 1, 40, 2, 12, 20
    q, k, v, g = _inputs(device, B, T, H, K, V, seed=41, positive=True)
    g = g if gates else None
    rec = Recorder()

    def launch(kernel, grid, **kw):
        rec(kernel, grid, **kw)
        launch_kernel(kernel, grid, **kw)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = chunk.ahla_chunked(*leaves, g, None if gates else 0.95, None, None, None, None, True, 1e-6, _cfg(),
                           launch=launch)[0]
    walks = [kw for kern, _, kw in rec.launches if kern.fn.__name__ == "ahla_fwd_kernel"]
    assert len(walks) == 2
    assert walks[0]["V"] == ONES_ALIGN and walks[0]["o"].dtype == torch.float32 and walks[0]["den_in"] is None
    assert walks[1]["V"] == V and walks[1]["o"].dtype == v.dtype and walks[1]["den_in"] is not None
    assert all(kw["cs_p"] is not None and kw["ht_pn"] is None for kw in walks)   # kept states, no carried p
    n = len(rec.launches)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(42)).to(device)
    got = torch.autograd.grad(o, leaves, do)
    names = [kern.fn.__name__ for kern, _, _ in rec.launches[n:]]
    assert "ahla_fwd_kernel" not in names and names.count("ahla_bwd_grad_kernel") == 2, names
    x64 = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    o64, _ = hla_fast.ahla(*x64, g=None if g is None else g.double().cpu(), gamma=None if gates else 0.95,
                           normalize=True, eps=1e-6, backend="torch")
    want = torch.autograd.grad(o64, x64, do.double().cpu())
    assert rel(o, o64) < TOL
    for name, a, b in zip("qkv", got, want):
        assert rel(a, b) < TOL, name


@pytest.mark.skipif(not has_cuda_compiler(), reason="needs triton.compiler.ASTSource, GPUTarget and the CUDA backend")
def test_normalized_backward_reads_aligned_value_rows():
    """A normalized training call's backward is two unnormalized ones, on v and on the denominator's
    column of ones padded with zero columns to ONES_ALIGN (``common.normalize``, "Width"), so that
    by an sm_90 compile both per-chunk gradient launches read every tile in loads of at least 4
    bytes (on [v | 1] of V + 1 = 65 columns, one launch, the kernel had 352 two-byte loads)."""
    out = run_compiler([os.path.join(BENCHMARKS, "compile_report.py"), "ahla", "4", "4096", "16", "64", "64",
                        "bfloat16", "--normalize", "--only", "ahla_bwd_grad_kernel", "--json"], timeout=600)
    rows = json.loads(out)["kernels"]

    def nbytes(w):   # "v4.b32" -> 16, "b16" -> 2
        vec, _, elem = w.rpartition(".")
        return (int(vec[1:]) if vec else 1) * int(elem[1:]) // 8

    assert len(rows) == 2, rows   # the values' and the ones column's
    for row in rows:
        widths = dict(row["global_loads"])
        assert widths and min(nbytes(w) for w in widths) >= 4, widths


@pytest.mark.parametrize("segments", [2, 3, 5])
@pytest.mark.parametrize("normalize", [False, True])
def test_segments_equal_one_walk(segments, normalize, device, poison):
    """Segmented walks (summaries from zero states, folded in order) give the one walk's outputs,
    snapshots, final state and gradients, with an initial state and final-state cotangents. The
    normalized walk is a first layer alone (``second=False``: R / (den + eps), carrying p), the only
    walk normalized in-kernel."""
    B, T, H, K, V = 2, 77, 2, 12, 20
    q, k, v, g = _inputs(device, B, T, H, K, V, seed=20, positive=normalize)
    gen = torch.Generator().manual_seed(21)
    st0 = [0.2 * torch.randn(B, H, K, V, generator=gen), 0.2 * torch.randn(B, H, K, V, generator=gen),
           0.2 * torch.rand(B, H, K, generator=gen)]
    st0 = [x.to(device) for x in st0]
    if normalize:   # the first layer's state (P, p); no E
        st0[1] = None
    kw = dict(chunk=16, warps=4, block_v=16, normalize=normalize, eps=1e-6, snapshots=torch.float32,
              second=not normalize)
    a = chunk.fwd_launch(q, k, v, g, None, *st0, segments=1, **kw)
    b = chunk.fwd_launch(q, k, v, g, None, *st0, segments=segments, **kw)
    assert (a[1] is not None) == normalize and (a[4] is not None) == normalize and (a[5][3] is not None) == normalize
    for x, y in zip(a[:5] + a[5], b[:5] + b[5]):
        assert (x is None) == (y is None)
        if x is not None:
            assert rel(y, x) < 1e-6
    if normalize:   # the backward below is the unnormalized one either way
        return      # (the normalized layer's: test_normalized_layer_is_the_index_sum)
    do = torch.randn(B, T, H, V, generator=gen).to(device)
    dht = [torch.randn(B, H, K, V, generator=gen).to(device) for _ in range(2)]
    one = chunk.bwd_launch(q, k, v, do, g, None, st0[0], st0[1], *dht, _cfg(), want_db=True)
    seg = chunk.bwd_launch(q, k, v, do, g, None, st0[0], st0[1], *dht,
                           _cfg().replace(fwd_segments=segments, bwd_segments=segments), want_db=True)
    for x, y in zip(one, seg):
        assert rel(y, x) < 1e-6


def test_only_a_first_layer_is_normalized_in_the_walk():
    """AHLA's normalized operator is two unnormalized walks (``ahla_fwd``), so the walk's launcher
    normalizes a first layer alone (``second=False``) and refuses normalize=True with both layers."""
    meta = torch.device("meta")
    q, k, v = (torch.empty(1, 32, 2, n, device=meta) for n in (16, 16, 32))
    with pytest.raises(ValueError, match=r"normalize=True is for the first layer alone \(second=False\): AHLA's "
                                         r"normalized operator is two unnormalized walks \(ahla_fwd\)"):
        chunk.fwd_launch(q, k, v, None, 0.9, None, None, None, chunk=16, warps=4, block_v=16, normalize=True)


def _normalized_layer64(q, k, v, g, p0, pn0, eps):
    """A normalized first-order gated layer from its index sums, float64 (autograd records it):
    num_t = e^{b_t} q_t^T P0 + sum_{j <= t} e^{b_t - b_j} (q_t . k_j) v_j, den_t the same with p0
    and a column of ones, o = num / (den + eps); P_T, p_T the states after the last token."""
    b = torch.cumsum(g, 1)                                                  # [B, T, H]
    T = q.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    w = torch.where(causal[None, :, :, None], torch.exp(b[:, :, None, :] - b[:, None, :, :]), 0.0)  # [B, t, j, H]
    a = torch.einsum("bthk,bjhk->btjh", q, k) * w
    num = torch.einsum("btjh,bjhv->bthv", a, v) + torch.einsum("bthk,bhkv->bthv", q * b.exp()[..., None], p0)
    den = a.sum(2) + torch.einsum("bthk,bhk->bth", q * b.exp()[..., None], pn0)
    dec = torch.exp(b[:, -1:, :] - b)[..., None]                            # e^{b_T - b_j} [B, T, H, 1]
    PT = b[:, -1].exp()[..., None, None] * p0 + torch.einsum("bjhk,bjhv->bhkv", k * dec, v)
    pT = b[:, -1].exp()[..., None] * pn0 + (k * dec).sum(1)
    return num / (den + eps)[..., None], den, PT, pT


@pytest.mark.parametrize("segments,block_v", [(1, 32), (3, 16)])
def test_normalized_layer_is_the_index_sum(segments, block_v, device, poison):
    """One normalized first-order layer (HLA2's outer layer when normalizing): the forward walk
    divides by the layer on a column of ones, carried as the vector p beside P (in segments, over
    value blocks), and the backward takes the numerator's and the denominator's gradients through
    the same walks. Output, denominator, final state, snapshots' use and every gradient (q, k, v,
    the gates, P0, p0) against the float64 index sums, from an initial state and with cotangents
    on the final state."""
    from hla_fast.ops.common.gates import log_gate_grad
    from hla_fast.ops.common.normalize import normalized_output_grad

    B, T, H, K, V, eps = 2, 45, 2, 12, 20, 1e-6
    q, k, v, g = _inputs(device, B, T, H, K, V, seed=31, positive=True)
    gen = torch.Generator().manual_seed(32)
    p0, pn0 = 0.2 * torch.randn(B, H, K, V, generator=gen), 0.2 * torch.rand(B, H, K, generator=gen)
    do, dPT, dpT = (torch.randn(shape, generator=gen) for shape in ((B, T, H, V), (B, H, K, V), (B, H, K)))
    cfg = _cfg(block_v=block_v).replace(fwd_segments=segments)
    dev = [x.to(device) for x in (p0, pn0, do, dPT, dpT)]
    o, den, PT, pT, cs_p, cs_pn = chunk.normalized_layer_fwd(q, k, v, g, None, dev[0], dev[1], eps, cfg,
                                                              keep_states=True)
    do_num, dd = normalized_output_grad(dev[2], o, den, eps)
    dv, dq, dk, dP0, dp0, db = chunk.normalized_layer_bwd(q, k, v, do_num, dd, g, None, cs_p, cs_pn, dev[3], dev[4],
                                                          True, cfg, want_db=True)
    dg = log_gate_grad(db, ((PT, dev[3], 1.0), (pT, dev[4], 1.0)), g.dtype)
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v, g, p0, pn0)]
    want = _normalized_layer64(*leaves, eps)
    for name, a, b in zip(["o", "den", "P_T", "p_T"], (o, den, PT, pT), want):
        assert rel(a, b) < TOL, name
    loss = sum((x * c.double()).sum() for x, c in zip((want[0], want[2], want[3]), (do, dPT, dpT)))
    grads = torch.autograd.grad(loss, leaves)
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dP0", "dp0"], (dq, dk, dv, dg, dP0, dp0), grads):
        # dg: a reverse cumulative sum of differences of fp32 products, a few times fp32's rounding
        assert rel(a, b) < (1e-4 if name == "dg" else TOL), name


@pytest.mark.parametrize("segments", [2, 3, 5])
@pytest.mark.parametrize("v2", [False, True])
def test_summaries_only_where_a_fold_reads_them(segments, v2):
    """No start state follows the last segment and no end gradient precedes the first: the forward
    summarizes the first segments - 1 segments, the backward the last segments - 1, each into
    buffers of that many per head, while the folds give every segment its state (recorded launches
    on meta tensors; the test above checks the values)."""
    from hla_fast.ops.common.compile import Recorder

    B, T, H, K, V, C = 2, 16 * 9, 3, 16, 32, 16
    meta = torch.device("meta")
    q, k, v = (torch.empty(B, T, H, n, device=meta) for n in (K, K, V))
    rec = Recorder()
    kw = dict(v2=k, second=False) if v2 else {}
    chunk.fwd_launch(q, k, v, None, 0.99, None, None, None, chunk=C, warps=4, block_v=V, segments=segments,
                     launch=rec, **kw)
    if not v2:
        cfg = _cfg(C, C).replace(bwd_segments=segments)
        chunk.bwd_launch(q, k, v, torch.empty_like(v), None, 0.99, None, None, None, None, cfg,
                         states=(torch.empty(B * H, T // C, K, V, device=meta),) * 3, launch=rec)
    by_name = {}
    for kern, grid, args in rec.launches:
        by_name.setdefault(kern.fn.__name__, []).append((grid, args))
    (grid, args), = by_name["ahla_fwd_summary_kernel"]
    assert grid[1] == segments - 1
    assert args["sum_p"].shape[0] == args["sum_lr"].shape[0] == B * H * (segments - 1)
    for grid, args in by_name["ahla_fwd_fold_kernel"]:            # P's (and P2's) fold
        assert args["NSEG"] == segments and args["seg_p"].shape[0] == B * H * segments
        assert args["sum_p"].shape[0] == B * H * (segments - 1)
    assert len(by_name["ahla_fwd_fold_kernel"]) == (2 if v2 else 1)
    (grid, args), = by_name["ahla_fwd_kernel"]
    assert grid[1] == segments
    if not v2:
        (grid, args), = by_name["ahla_bwd_summary_kernel"]
        assert grid[1] == segments - 1 and args["sum_dp"].shape[0] == B * H * (segments - 1)
        (grid, args), = by_name["ahla_bwd_fold_kernel"]
        assert args["NSEG"] == segments and args["de_p"].shape[0] == B * H * segments


@pytest.mark.parametrize("pieces", [2, 3, 6])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("dht", [False, True])
def test_backward_in_pieces_equals_one_walk(pieces, init, dht, device, poison):
    """A backward walked in pieces (the last first, each from the gradient the later one left at
    its start; common.launch.run_pieces) gives the one walk's gradients, with or without an
    initial state and final-state cotangents; 77 tokens in chunks of 16: 5 chunks, so 6 pieces are 5
    and two value blocks of 16 walk side by side. The pieces load ahead (each piece's walk stops
    its loads at the piece's first chunk), the one walk does not."""
    B, T, H, K, V = 2, 77, 2, 12, 20
    q, k, v, g = _inputs(device, B, T, H, K, V, seed=22)
    gen = torch.Generator().manual_seed(23)
    p0, e0 = ([0.2 * torch.randn(B, H, K, V, generator=gen).to(device) for _ in range(2)] if init
              else [None, None])
    do = torch.randn(B, T, H, V, generator=gen).to(device)
    d_t = [torch.randn(B, H, K, V, generator=gen).to(device) for _ in range(2)] if dht else [None, None]
    one = chunk.bwd_launch(q, k, v, do, g, None, p0, e0, *d_t, _cfg(prefetch=False), want_db=True)
    cut = chunk.bwd_launch(q, k, v, do, g, None, p0, e0, *d_t, _cfg().replace(bwd_pieces=pieces), want_db=True)
    for x, y in zip(one, cut):
        assert (x is None) == (y is None)
        if x is not None:
            assert rel(y, x) < 1e-6


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("kind", ["none", "gamma", "g"])
def test_decode_kernel_value_blocks(normalize, kind, device, poison):
    """V = 40: two column blocks of 32 in the step kernel, against the torch step in float64."""
    B, H, K, V = 2, 3, 20, 40
    q, k, v = (x[:, 0] for x in rand_qkv(B, 1, H, K, V, seed=18, positive=normalize, device=device))
    gen = torch.Generator().manual_seed(19)
    st = AHLAState(0.2 * torch.randn(B, H, K, V, generator=gen), 0.2 * torch.randn(B, H, K, V, generator=gen),
                   0.2 * torch.rand(B, H, K, generator=gen) if normalize else None,
                   0.2 * torch.rand(B, H, K, generator=gen) if normalize else None)
    st = AHLAState(*(None if x is None else x.to(device) for x in st))
    g = -0.3 * torch.rand(B, H, generator=gen).to(device) if kind == "g" else None
    gamma = 0.9 if kind == "gamma" else None
    o, new = decode.ahla_step_triton(q, k, v, st, g, gamma, normalize, 1e-6)
    st64 = AHLAState(*(None if x is None else x.double().cpu() for x in st))
    o64, new64 = decode.ahla_step_torch(q.double().cpu(), k.double().cpu(), v.double().cpu(), st64,
                                        None if g is None else g.double().cpu(), gamma, normalize, 1e-6)
    assert rel(o, o64) < TOL
    for a, b in zip(new, new64):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel(a, b) < TOL


@pytest.mark.skipif(HAS_CUDA, reason="every drawn shape is a fresh compile on a GPU")
@settings(max_examples=12, deadline=None)
@given(T=st.integers(1, 50), K=st.integers(1, 40), V=st.integers(1, 40), chunk_size=st.sampled_from([16, 32]),
       fwd_seg=st.integers(1, 4), bwd_seg=st.integers(1, 3), kind=st.sampled_from(["none", "gamma", "g"]),
       normalize=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_triton_path_is_the_index_sum(T, K, V, chunk_size, fwd_seg, bwd_seg, kind, normalize, seed):
    """Random shapes, decays, chunks and segments: the output against the index sums and, without
    normalization, dq against the float64 torch path. (Normalized, dq can be ill-conditioned: for
    one token with K = 1 it is a difference of two terms of size 1/den that nearly cancel, beyond
    what fp32 resolves; the contract suite checks normalized gradients on well-conditioned inputs.)"""
    q, k, v = rand_qkv(1, T, 2, K, V, seed=seed, positive=normalize, device=DEVICE)
    dk = {"gamma": 0.8} if kind == "gamma" else ({"g": rand_gates(1, T, 2, seed=seed, device=DEVICE)} if kind == "g" else {})
    cfg = _cfg(chunk_size, chunk_size).replace(fwd_segments=fwd_seg, bwd_segments=bwd_seg)
    qq = q.clone().requires_grad_()
    o, _ = hla_fast.ahla(qq, k, v, normalize=normalize, backend="triton", config=cfg, **dk)
    assert rel(o, brute_ahla(q, k, v, normalize=normalize, **dk)) < TOL
    if normalize:
        return
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed))
    (got,) = torch.autograd.grad((o * w.to(DEVICE)).sum(), qq)
    q64 = q.double().cpu().requires_grad_()
    dk64 = {n: (x.double().cpu() if torch.is_tensor(x) else x) for n, x in dk.items()}
    o64, _ = hla_fast.ahla(q64, k.double().cpu(), v.double().cpu(), normalize=normalize, backend="torch", **dk64)
    (want,) = torch.autograd.grad((o64 * w.double()).sum(), q64)
    assert rel(got, want) < 1e-4


# ----------------------------------------------------------------------- compiled kernels (GPU only)

# relative error the precision explains: fp32 inputs take tf32x3 products (fp32-level error); fp16
# inputs run the same fp32 kernels and round o and the gradients to fp16 (2^-11 = 4.9e-4 relative);
# bf16 rounds every tensor-core operand to 8 bits of mantissa
GPU_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("K,V", [(64, 64), (128, 128), (32, 100), (16, 16), (256, 64)])
@pytest.mark.parametrize("normalize", [False, True])
def test_gpu_forward_backward(dtype, K, V, normalize, poison):
    """Compiled kernels on a long sequence with gates and an initial state, forward and every
    gradient, against the float64 torch path on the GPU."""
    B, T, H = 1, 2049, 2
    q, k, v = rand_qkv(B, T, H, K, V, seed=K + V, scale=0.15, positive=normalize, device="cuda", dtype=dtype)
    g = rand_gates(B, T, H, seed=3, strength=0.01, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(4)
    st0 = _state0(B, H, K, V, normalize, gen, scale=0.1)
    do = torch.randn(B, T, H, V, device="cuda", generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    parts = [None if x is None else x.clone().requires_grad_() for x in st0]
    o, st = hla_fast.ahla(*leaves[:3], g=leaves[3], normalize=normalize, initial_state=AHLAState(*parts),
                          output_final_state=True)
    got = torch.autograd.grad((o.float() * do).sum(), leaves + [x for x in parts if x is not None])
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v, g)]
    parts64 = [None if x is None else x.double().requires_grad_() for x in st0]
    o64, st64 = hla_fast.ahla(*leaves64[:3], g=leaves64[3], normalize=normalize,
                              initial_state=AHLAState(*parts64), output_final_state=True, backend="torch")
    want = torch.autograd.grad((o64 * do.double()).sum(), leaves64 + [x for x in parts64 if x is not None])
    assert o.dtype == dtype and rel(o, o64) < GPU_TOL[dtype]
    for a, b in zip(st, st64):
        if b is not None:
            assert rel(a, b) < GPU_TOL[dtype]
    for i, (a, b) in enumerate(zip(got, want)):
        # dg (i = 3) is a reverse cumulative sum of differences of products: a few times looser
        assert rel(a, b) < GPU_TOL[dtype] * (10 if i == 3 else 1), i


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [128, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [False, True])
def test_gpu_forward_of_chunks_of_128(dtype, normalize, chunk_size, poison):
    """chunk_size=128 with 128-wide keys, and the default chunk_size=None, which takes it for bf16:
    the rule's 8-warp forward of chunks of 128 (bf16; fp32 inputs get chunks of 64 either way),
    gates, an initial state and the final state, against the float64 torch path."""
    B, T, H, K, V = 2, 1500, 2, 128, 128
    q, k, v = rand_qkv(B, T, H, K, V, seed=21, scale=0.15, positive=normalize, device="cuda", dtype=dtype)
    g = rand_gates(B, T, H, seed=22, strength=0.01, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(23)
    st0 = _state0(B, H, K, V, normalize, gen, scale=0.1)
    want = 128 if dtype == torch.bfloat16 else 64   # fp32 forward chunks stop at FP32_MAX_CHUNK
    assert chunk.ahla_config(B, T, H, K, V + normalize, dtype, torch.device("cuda"), chunk_size).fwd_chunk == want
    o, st = hla_fast.ahla(q, k, v, g=g, normalize=normalize, initial_state=st0, output_final_state=True,
                          chunk_size=chunk_size)
    o64, st64 = hla_fast.ahla(q.double(), k.double(), v.double(), g=g.double(), normalize=normalize,
                              initial_state=AHLAState(*(None if x is None else x.double() for x in st0)),
                              output_final_state=True, backend="torch")
    assert rel(o, o64) < GPU_TOL[dtype]
    for a, b in zip(st, st64):
        if b is not None:
            assert rel(a, b) < GPU_TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [False, True])
def test_gpu_decode_continues_prefill(normalize, poison):
    B, T, H, K, V = 2, 300, 4, 128, 128
    q, k, v = rand_qkv(B, T, H, K, V, seed=5, scale=0.15, positive=normalize, device="cuda")
    g = rand_gates(B, T, H, seed=6, strength=0.01, device="cuda")
    want, _ = hla_fast.ahla(q.double(), k.double(), v.double(), g=g.double(), normalize=normalize, backend="torch")
    o, st = hla_fast.ahla(q[:, :290], k[:, :290], v[:, :290], g=g[:, :290], normalize=normalize,
                          output_final_state=True)
    outs = [o]
    for t in range(290, T):
        y, st = hla_fast.ahla_step(q[:, t], k[:, t], v[:, t], st, g=g[:, t], normalize=normalize)
        outs.append(y[:, None])
    assert rel(torch.cat(outs, 1), want) < GPU_TOL[torch.float32]
