"""HLA2's own launchers (hla_fast/ops/hla2/chunk.py) beyond the operator contract: the cross
operator the kernels compute, segments, gradient launches, kept or recomputed chunk states, wide
heads, and the configuration rule. Under TRITON_INTERPRET=1 on a CPU, compiled on CUDA."""
import importlib
import json
import os

import pytest
import triton
import triton.language as tl

from .helpers import (
    BENCHMARKS, HOPPER_SHARED, brute_hla2, checked_layers_flag, has_cuda_compiler, rand_gates, rand_qkv, real_calls,
    ref_hla2, rel, rule_kernels_shared, run_compiler, torch,
)

import hla_fast
from hla_fast import ChunkConfig
from hla_fast.ops.common.tiles import chunk_beta, held_decays

chunk = importlib.import_module("hla_fast.ops.hla2.chunk")
launch = importlib.import_module("hla_fast.ops.common.launch")
launch_kernel = importlib.import_module("hla_fast.ops.common.compile").launch_kernel

TOL = 1e-5
SMALL = ChunkConfig(fwd_chunk=16, bwd_chunk=16, fwd_block_v=16)
LAYERS = {"layers": True, "grad_parts": (7,)}   # SMALL.replace(**LAYERS): the first-order layers


def cross_definition(q, k, q2, k2, v, g=None):
    """o_t = sum_{i <= j <= t} exp(2 b_t - b_i - b_j) (q_t . k_i)(q2_j . k2_i) v_j, straight from the
    sum over (t, i, j) (float64 in, [B, T, H, V] out; differentiable)."""
    B, T, H, _ = q.shape
    b = torch.zeros(B, T, H, dtype=q.dtype) if g is None else g.cumsum(1)
    t = torch.arange(T)
    keep = (t[None, :, None] <= t[None, None, :]) & (t[None, None, :] <= t[:, None, None])  # [t, i, j]: i <= j <= t
    expo = 2 * b[:, :, None, None] - b[:, None, :, None] - b[:, None, None, :]             # [B, t, i, j, H]
    w = torch.where(keep[None, ..., None], torch.exp(torch.where(keep[None, ..., None], expo, 0.0)), 0.0)
    x = torch.einsum("bthd,bihd->btih", q, k)
    y = torch.einsum("bjhd,bihd->bjih", q2, k2)
    return torch.einsum("btijh,btih,bjih,bjhv->bthv", w, x, y, v)


@pytest.mark.parametrize("gated", [False, True])
def test_cross_operator_and_its_gradients(gated, device, poison):
    B, T, H, K, K2, V = 1, 23, 2, 12, 20, 8
    q, k, v = rand_qkv(B, T, H, K, V, seed=1, device=device)
    q2, k2, _ = rand_qkv(B, T, H, K2, V, seed=2, device=device)
    g = rand_gates(B, T, H, seed=3, device=device) if gated else None
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, q2, k2, v)]
    want = cross_definition(*leaves, g=None if g is None else g.double().cpu())
    o, _, sT, wT, _, _ = chunk.fwd_launch(q, k, v, g, None, None, None, None, chunk=16, segments=2, warps=4,
                                          block_v=16, q2=q2, k2=k2)
    assert rel(o, want) < TOL
    do = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad((want * do).sum(), leaves)
    got = chunk.bwd_launch(q, k, v, do.float().to(device), g, None, None, None, None, None, SMALL, q2=q2, k2=k2)
    for name, a, b in zip(["dq", "dk", "dq2", "dk2", "dv"], [got[0], got[1], got[2], got[3], got[4]],
                          [grads[0], grads[1], grads[2], grads[3], grads[4]]):
        assert rel(a, b) < TOL, name


def _inputs(device, T=45, K=16, V=24, seed=5):
    q, k, v = rand_qkv(2, T, 2, K, V, seed=seed, positive=True, device=device)
    g = rand_gates(2, T, 2, seed=seed, device=device)
    S0 = 0.1 * torch.rand(2, 2, K, K, device=device)
    return q, k, v, g, S0 + S0.transpose(-1, -2), 0.1 * torch.randn(2, 2, K, V, device=device), 0.1 * torch.rand(2, 2, K, device=device)


@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("normalize", [False, True])
def test_segmented_forward_equals_one_walk(segments, normalize, device, poison):
    q, k, v, g, S0, W0, z0 = _inputs(device)
    kw = dict(chunk=16, warps=4, block_v=16, normalize=normalize, eps=1e-6)
    a = chunk.fwd_launch(q, k, v, g, None, S0, W0, z0, segments=1, **kw)
    b = chunk.fwd_launch(q, k, v, g, None, S0, W0, z0, segments=segments, **kw)
    for x, y in zip(a[:5], b[:5]):
        assert (x is None) == (y is None)
        if x is not None:
            assert rel(y, x) < 1e-6
    sa = chunk.fwd_launch(q, k, v, g, None, S0, W0, None, segments=1, outputs=False, store_final=False,
                          snapshots=torch.float32, chunk=16, warps=4, block_v=16)[5]
    sb = chunk.fwd_launch(q, k, v, g, None, S0, W0, None, segments=segments, outputs=False, store_final=False,
                          snapshots=torch.float32, chunk=16, warps=4, block_v=16)[5]
    assert rel(sb[0], sa[0]) < 1e-6 and rel(sb[1], sa[1]) < 1e-6


@pytest.mark.parametrize("row_blocks,two_walks,output_block_v", [(1, False, None), (2, False, None), (1, True, None),
                                                                  (2, True, None), (2, False, 64), (2, True, 64)])
@pytest.mark.parametrize("segments", [1, 2])
@pytest.mark.parametrize("normalize,cross,rate", [(False, False, 1), (True, False, 1), (False, True, 1),
                                                  (False, False, 2)])
def test_split_forward_equals_one_walk(row_blocks, two_walks, output_block_v, segments, normalize, cross, rate, device,
                                       poison):
    """output_pass: a state walk (its key rows split over ``row_blocks`` programs; with
    ``two_walks`` a walk of S alone in blocks, then one of W and z reading its stored S) storing
    every chunk's start state, then every chunk's outputs at once (``output_block_v``: in value
    blocks other than the walk's), gives the one walk's outputs,
    den, final state and, when asked for, snapshots; with an initial state, gates, segments, a
    cross pair, normalization and rate 2 (hla3's second stage). The states it stores only for its
    own outputs are not returned. Two walks take one segment (a clear error where more would
    run). 45 tokens
    in chunks of 16; row blocks of the narrowest key tile: keys 32 wide in blocks of 16 on a CPU,
    128 wide in blocks of 64 on CUDA."""
    K = 2 * launch.min_key_block(torch.device(device))
    q, k, v, g, S0, W0, z0 = _inputs(device, K=K)
    q2, k2 = (q.flip(-1).contiguous(), k.flip(-1).contiguous()) if cross else (None, None)
    kw = dict(chunk=16, warps=4, block_v=16, segments=segments, normalize=normalize, eps=1e-6, q2=q2, k2=k2,
              rate=rate)
    split = dict(output_pass=True, row_blocks=row_blocks, two_walks=two_walks, output_block_v=output_block_v)
    # (fp32 keys 128 wide, on CUDA, walk in one segment whatever is asked: ``chunk.fold_fits``)
    if two_walks and segments > 1 and chunk.fold_fits(K, q.dtype):
        with pytest.raises(ValueError, match=f"config.fwd_two_walks needs one forward segment, got {segments}"):
            chunk.fwd_launch(q, k, v, g, None, S0, W0, z0, **split, **kw)
        return
    for snap in (None, torch.float32):
        a = chunk.fwd_launch(q, k, v, g, None, S0, W0, z0, snapshots=snap, **kw)
        b = chunk.fwd_launch(q, k, v, g, None, S0, W0, z0, snapshots=snap, **split, **kw)
        assert (b[5] is None) == (snap is None)
        for x, y in zip(a[:5] + (tuple(a[5]) if snap else ()), b[:5] + (tuple(b[5]) if snap else ())):
            assert (x is None) == (y is None)
            if x is not None:
                assert rel(y, x) < 1e-6


def test_row_blocks_need_a_state_walk_and_16_rows(device):
    q, k, v, g, S0, W0, _ = _inputs(device, K=16)
    kw = dict(chunk=16, segments=1, warps=4, block_v=16)
    with pytest.raises(ValueError, match="config.fwd_row_blocks=2 needs config.fwd_output_pass"):
        chunk.fwd_launch(q, k, v, g, None, None, None, None, row_blocks=2, **kw)
    least = launch.min_key_block(q.device)
    with pytest.raises(ValueError, match=f"config.fwd_row_blocks=2 cuts a key tile of {least} into blocks of "
                                         f"{least // 2} rows; blocks need at least {least} on {q.device.type}"):
        chunk.fwd_launch(q, k, v, g, None, None, None, None, output_pass=True, row_blocks=2, **kw)
    # a state walk without outputs (the backward's recompute) may split its rows too
    q, k, v, g, S0, W0, _ = _inputs(device, K=2 * least)
    a = chunk.fwd_launch(q, k, v, g, None, S0, W0, None, outputs=False, snapshots=torch.float32, **kw)
    b = chunk.fwd_launch(q, k, v, g, None, S0, W0, None, outputs=False, snapshots=torch.float32,
                         row_blocks=2, **kw)
    assert a[0] is None and b[0] is None
    for x, y in zip(a[2:4] + tuple(a[5][:2]), b[2:4] + tuple(b[5][:2])):
        assert rel(y, x) < 1e-6


def _close(a, b, tol=1e-5):
    """Two bwd_launch results: the same gradients present, each within tol (relative)."""
    assert [x is None for x in a] == [y is None for y in b]
    for x, y in zip(a, b):
        if x is not None:
            assert rel(x, y) < tol


@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("cross", [False, True])
def test_segmented_backward_equals_one_walk(segments, cross, device, poison):
    q, k, v, g, S0, W0, _ = _inputs(device)
    q2, k2 = (q.flip(-1).contiguous(), k.flip(-1).contiguous()) if cross else (None, None)
    do = torch.randn_like(v)
    dS, dW = torch.randn_like(S0), torch.randn_like(W0)
    runs = [chunk.bwd_launch(q, k, v, do, g, None, S0, W0, dS, dW, SMALL.replace(bwd_segments=n), q2=q2, k2=k2,
                             want_db=True) for n in (1, segments)]
    _close(*runs)


@pytest.mark.parametrize("pieces", [2, 3, 5])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("init", [False, True])
def test_backward_in_pieces_equals_one_walk(pieces, cross, init, device, poison):
    """A backward walked in pieces (the last first, each from the gradient the later one left at
    its start, one piece's end-state gradients at a time) gives the gradients of one walk, with an
    initial state, end-state cotangents and gates; 45 tokens in chunks of 16: 3 chunks, so 5 pieces
    are 3 and every piece but the last is one chunk."""
    q, k, v, g, S0, W0, _ = _inputs(device)
    q2, k2 = (q.flip(-1).contiguous(), k.flip(-1).contiguous()) if cross else (None, None)
    do = torch.randn_like(v)
    dS, dW = torch.randn_like(S0), torch.randn_like(W0)
    s0, w0 = (S0, W0) if init else (None, None)
    runs = [chunk.bwd_launch(q, k, v, do, g, None, s0, w0, dS, dW, SMALL.replace(bwd_pieces=n), q2=q2, k2=k2,
                             want_db=True) for n in (1, pieces)]
    _close(*runs)
    assert (runs[1][5] is None) == (not init)


def test_backward_pieces_are_the_chunk_ranges():
    assert launch.backward_pieces(10, 4) == ([9, 6, 3, 0], 3)
    assert launch.backward_pieces(3, 5) == ([2, 1, 0], 1)
    assert launch.backward_pieces(8, 1) == ([0], 8)


def test_value_block_never_below_the_device_minimum():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")   # only the device type is read
    assert launch.value_block(64, 16, cpu) == 16 and launch.value_block(8, 64, cpu) == 16
    assert launch.value_block(200, 64, cpu) == 64 and launch.value_block(40, 32, cpu) == 32
    # on CUDA 16- and 32-wide value blocks crashed the forward (an illegal memory access): 64 there
    assert launch.value_block(64, 16, cuda) == 64 and launch.value_block(64, 32, cuda) == 64
    assert launch.value_block(8, 16, cuda) == 64 and launch.value_block(256, 128, cuda) == 128


@pytest.mark.parametrize("cross", [False, True])
def test_gradient_launches_split_by_part(cross, device, poison):
    """Every grouping of dq (1), dk (2), dv (4) over launches gives the same gradients and db."""
    q, k, v, g, S0, W0, _ = _inputs(device, T=37)
    q2, k2 = (q.flip(-1).contiguous(), k.flip(-1).contiguous()) if cross else (None, None)
    do, dS = torch.randn_like(v), torch.randn_like(S0)
    runs = [chunk.bwd_launch(q, k, v, do, g, None, S0, W0, dS, None,
                             SMALL.replace(grad_parts=p), q2=q2, k2=k2, want_db=True)
            for p in [(7,), (1, 2, 4), (1, 6), (3, 4), (5, 2)]]
    for r in runs[1:]:
        _close(runs[0], r)


@pytest.mark.parametrize("save", [True, False])
def test_kept_states_equal_recomputed(save, monkeypatch, device, poison):
    """The forward keeps its chunk-start states for the backward (save_states) or the backward
    recomputes them: the same gradients, and the recompute pass runs only when nothing was kept."""
    q, k, v, g, S0, W0, _ = _inputs(device)
    calls = []
    fwd = chunk.fwd_launch
    monkeypatch.setattr(chunk, "fwd_launch", real_calls(fwd, lambda *a, **kw: calls.append(kw.get("outputs", True))))

    def grads(cfg):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
        o, _ = hla_fast.hla2(*leaves[:3], g=leaves[3], initial_state=hla_fast.HLA2State(S0, W0),
                             backend="triton", config=cfg)
        return torch.autograd.grad((o * v).sum(), leaves)

    calls.clear()
    a = grads(SMALL.replace(save_states=save))
    assert (False in calls) == (not save)
    b = grads(SMALL.replace(save_states=not save))
    for x, y in zip(a, b):
        assert rel(x, y) < 1e-6


def _normalized_grads(q, k, v, g, S0, W0, z0, weights, backend, cfg=None):
    """Gradients of a random linear function of a normalized call's o and final state (S, W, z)
    w.r.t. q, k, v, g and the initial state, on ``backend`` (float64 for "torch")."""
    dt = torch.float64 if backend == "torch" else torch.float32
    leaves = [x.detach().cpu().to(dt).to(q.device if backend == "triton" else "cpu").requires_grad_()
              for x in (q, k, v, g, S0, W0, z0)]
    o, fin = hla_fast.hla2(*leaves[:3], g=leaves[3], normalize=True, initial_state=hla_fast.HLA2State(*leaves[4:]),
                           output_final_state=True, backend=backend, config=cfg, chunk_size=16)
    loss = sum((x.double().cpu() * w).sum() for x, w in zip((o, *fin), weights))
    return [o.detach(), *(x.detach() for x in fin)], torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("V,changes", [
    (24, {}), (24, {"save_states": False}), (24, {"bwd_segments": 2}), (24, {"bwd_segments": 3, "fwd_segments": 2}),
    (24, {"bwd_pieces": 3}), (24, {"grad_parts": (1, 2, 4)}), (24, {"grad_parts": (7,)}), (70, {}),
    (24, LAYERS), (24, dict(LAYERS, save_states=False)), (24, dict(LAYERS, fwd_segments=3)), (70, LAYERS)],
    ids=lambda x: str(x) if isinstance(x, int) else "-".join(f"{k}={v}" for k, v in x.items()) or "rule")
def test_normalized_backward_carries_the_ones_column(V, changes, device, poison):
    """A normalized call's backward differentiates the operator on [v | 1], the ones column carried
    as dz beside dW in the kernels (not as a value block): in every backward layout (kept or
    recomputed chunk states, segments, pieces, gradient launches, values wider than one block, the
    first-order layers, whose outer layer carries z beside W), with gates, an initial state
    (S, W, z) and cotangents on the whole final state, every gradient matches the float64 torch
    path."""
    q, k, v, g, S0, W0, z0 = _inputs(device, V=V)
    gen = torch.Generator().manual_seed(9)
    weights = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (v, S0, W0, z0)]
    cfg = SMALL.replace(**changes)
    fin, got = _normalized_grads(q, k, v, g, S0, W0, z0, weights, "triton", cfg)
    fin64, want = _normalized_grads(q, k, v, g, S0, W0, z0, weights, "torch")
    for name, a, b in zip(["o", "S", "W", "z"], fin, fin64):
        assert rel(a, b) < TOL, name
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dS0", "dW0", "dz0"], got, want):
        # dg is a reverse cumulative sum of differences of fp32 products: a few times fp32's rounding
        assert rel(a, b) < (1e-4 if name == "dg" else TOL), name


@pytest.mark.parametrize("dtype,V", [(torch.float32, 24), (torch.float32, 70), (torch.bfloat16, 64),
                                     (torch.float16, 40)])
def test_normalized_output_gradient_in_one_pass(dtype, V, device, poison):
    """normalized_output_grad splits dL/do of o = num / (den + eps) into do / d and
    dd = -(do . o) / d, as written in float64 (rows not a multiple of a program's, V not a power of
    two); do / d in bf16 for bf16 inputs, else fp32 (below fp16's normal range for a large d)."""
    from hla_fast.ops.common.normalize import normalized_output_grad

    gen = torch.Generator().manual_seed(V)
    do, o = (torch.randn(2, 37, 3, V, generator=gen).to(device, dtype) for _ in range(2))
    den = (torch.rand(2, 37, 3, generator=gen) + 0.5).to(device)
    num, dd = normalized_output_grad(do, o, den, 1e-3)
    d = den.double().cpu() + 1e-3
    want_dd = -(do.double().cpu() * o.double().cpu()).sum(-1) / d
    assert num.dtype == (dtype if dtype == torch.bfloat16 else torch.float32)
    assert dd.dtype == torch.float32 and dd.shape == den.shape
    exact = 4e-3 if dtype == torch.bfloat16 else 1e-6   # the quotient rounded to bf16 on store
    assert rel(num, do.double().cpu() / d[..., None]) < exact
    assert rel(dd, want_dd) < 1e-6


@pytest.mark.parametrize("V", [1, 15, 16, 24, 63, 64, 70, 127, 128, 256])
def test_ones_width_keeps_value_rows_aligned(V):
    """[v | 1] on the Triton kernels has ones_width(V) columns: at least V + 1, a multiple of
    ONES_ALIGN (16, so that the kernels' value rows start on 16 bytes), fewer than V + 1 + 16, and
    no more 64-wide value blocks than V + 1 columns take (the kernels' narrowest block on CUDA)."""
    from hla_fast.ops.common.normalize import ONES_ALIGN, ones_width

    W = ones_width(V)
    assert ONES_ALIGN == 16 and W % ONES_ALIGN == 0
    assert V + 1 <= W < V + 1 + ONES_ALIGN
    assert -(-W // 64) == -(-(V + 1) // 64)


def test_padded_ones_and_columns():
    """with_ones and with_column: [v | 1 | 0 ...] and [x | col | 0 ...] of the width asked for (V + 1
    and C + 1 by default), gradients flowing to v and col; a width below that refused by name."""
    from hla_fast.ops.common.normalize import quotient, with_column, with_ones

    gen = torch.Generator().manual_seed(5)
    v = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    vv = with_ones(v, 16)
    assert vv.shape == (2, 3, 4, 16) and with_ones(v).shape == (2, 3, 4, 6)
    assert torch.equal(vv[..., :5], v) and torch.equal(vv[..., 5], torch.ones_like(v[..., 0]))
    assert torch.equal(vv[..., 6:], torch.zeros_like(vv[..., 6:]))
    x = torch.randn(2, 4, 3, 5, generator=gen, dtype=torch.float64)
    col = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    xc = with_column(x, col, 16)
    assert xc.shape == (2, 4, 3, 16) and torch.equal(xc[..., 5], col)
    assert torch.equal(xc[..., 6:], torch.zeros_like(xc[..., 6:]))
    assert torch.equal(with_column(x, None, 8)[..., 5:], torch.zeros(2, 4, 3, 3, dtype=torch.float64))
    assert with_column(None, col, 16) is None
    (gv, gc) = torch.autograd.grad((vv * 2).sum() + (xc * 3).sum(), (v, col))
    assert torch.equal(gv, torch.full_like(v, 2.0)) and torch.equal(gc, torch.full_like(col, 3.0))
    # the quotient (in fp32) reads column V, whatever follows it
    o = torch.cat([torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64), vv[..., 5:].detach() + 1.0], -1)
    assert rel(quotient(o, 5, 0.5, torch.float64), o[..., :5] / (o[..., 5:6] + 0.5)) < 1e-6
    with pytest.raises(ValueError, match="width"):
        with_ones(v, 5)
    with pytest.raises(ValueError, match="width"):
        with_column(x, col, 5)


def test_normalized_backward_runs_the_unnormalized_launches(monkeypatch, device):
    """The ones column costs no launch: a normalized training call launches the kernels of an
    unnormalized one, as often (one forward walk that keeps its chunk states, one backward walk,
    the gradient launches of the config), where a value block for it would double the
    backward's, plus two small parallel passes: the one that splits the output gradient
    (normalized_grad_kernel) and the one that forms the ones column's vectors per chunk
    (hla2_bwd_ones_kernel). As first-order layers, only the first of those (the outer layer's
    walks carry the column's vectors themselves)."""
    q, k, v, g, S0, W0, z0 = _inputs(device)
    names = []
    real = chunk.launch_kernel

    def spy(kernel, grid, **kw):
        names.append(kernel.fn.__name__)
        return real(kernel, grid, **kw)

    monkeypatch.setattr(chunk, "launch_kernel", spy)
    runs = {}
    for cfg in (SMALL, SMALL.replace(**LAYERS)):
        for normalize in (False, True):
            names.clear()
            leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
            o, _ = hla_fast.hla2(*leaves[:3], g=leaves[3], normalize=normalize, backend="triton", config=cfg)
            (o * v).sum().backward()
            runs[cfg.layers, normalize] = sorted(names)
    assert runs[False, True] == sorted(runs[False, False] + ["hla2_bwd_ones_kernel", "normalized_grad_kernel"])
    assert runs[False, True].count("hla2_fwd_kernel") == 1 and runs[False, True].count("hla2_bwd_state_kernel") == 1
    # the layers: the denominator comes from the outer layer's walks, the output gradient's split alone is added
    assert runs[True, True] == sorted(runs[True, False] + ["normalized_grad_kernel"])
    assert runs[True, True].count("ahla_fwd_kernel") == 2 and runs[True, True].count("ahla_bwd_dh_kernel") == 2


@pytest.mark.parametrize("K,V,normalize", [(140, 8, True), (150, 12, False), (20, 140, False), (20, 140, True)])
def test_wide_heads_with_carry_over(K, V, normalize, device, poison):
    q, k, v = rand_qkv(1, 30, 1, K, V, seed=K + V, scale=0.2, positive=normalize, device=device)
    g = rand_gates(1, 30, 1, seed=6, device=device)
    kw = dict(normalize=normalize, chunk_size=16, backend="triton", output_final_state=True)
    o1, st = hla_fast.hla2(q[:, :17], k[:, :17], v[:, :17], g=g[:, :17], **kw)
    o2, st = hla_fast.hla2(q[:, 17:], k[:, 17:], v[:, 17:], g=g[:, 17:], initial_state=st, **kw)
    assert rel(torch.cat([o1, o2], 1), ref_hla2(q, k, v, normalize=normalize, g=g)) < TOL
    _, st64 = hla_fast.hla2(q.double().cpu(), k.double().cpu(), v.double().cpu(), g=g.double().cpu(), normalize=normalize,
                            backend="torch", output_final_state=True)
    for a, b in zip(st, st64):
        if b is not None:
            assert rel(a, b) < TOL


@pytest.mark.parametrize("K", [129, 140, 200, 256])
def test_feature_blocks_tile_the_head(K):
    blocks = chunk._feature_blocks(K)
    assert blocks[0][0] == 0 and blocks[-1][1] == K
    assert all(a1 == b0 for (_, a1), (b0, _) in zip(blocks, blocks[1:]))
    assert max(b - a for a, b in blocks) <= chunk.FEATURE_BLOCK


def test_configuration_rule(monkeypatch):
    """The fused kernels' rule (``fused_config``, what hla2_config takes where it does not take the
    first-order layers) on an H200-sized device (132 multiprocessors) and on the CPU."""
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    chunk.fused_config.cache_clear()  # the rule's results are cached per shape and device
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    c = chunk.fused_config(4, 32768, 16, 64, 64, torch.bfloat16, cuda)
    # 64 heads: 4 segments put 256 four-warp programs in one wave of 264
    assert (c.fwd_chunk, c.bwd_chunk, c.fwd_warps, c.fwd_segments, c.bwd_segments) == (64, 64, 4, 4, 4)
    assert c.save_states and c.grad_parts == (1, 6)   # the forward keeps its chunk states for the backward
    # gated and normalized: three gradient launches; either alone, or wider heads: two
    for gated, normalize, K, parts in [(True, True, 64, (1, 2, 4)), (True, False, 64, (1, 6)),
                                       (False, True, 64, (1, 6)), (True, True, 128, (1, 6))]:
        rule = chunk.fused_config(4, 32768, 16, K, K, torch.bfloat16, cuda, gated=gated, normalize=normalize)
        assert rule == chunk.fused_config(4, 32768, 16, K, K, torch.bfloat16, cuda).replace(grad_parts=parts)
    c = chunk.fused_config(4, 32768, 16, 128, 128, torch.bfloat16, cuda)
    # inference: split, its state pass two walks (S's in blocks, then W's from S's stored chunk
    # states) in chunks of 64 with pipelined loads, then every chunk's outputs
    assert c.fwd_output_pass and c.fwd_two_walks and c.fwd_row_blocks == chunk.SPLIT_ROW_BLOCKS
    assert (c.fwd_chunk, c.fwd_warps, c.fwd_stages, c.bwd_stages) == (chunk.TWO_WALKS_CHUNK, 4, chunk.SPLIT_STAGES, 1)
    # the output pass computes every value column of a 128-wide head in one program
    assert c.fwd_output_block_v == chunk.OUTPUT_BLOCK_V == 128 and c.fwd_block_v == 64
    one = c.replace(fwd_chunk=32, fwd_warps=8, fwd_stages=1, fwd_output_pass=False, fwd_row_blocks=1,
                    fwd_two_walks=False, fwd_output_block_v=None)
    # one walk: 128 eight-warp programs (two value blocks a head), one a multiprocessor: one segment
    assert (one.fwd_chunk, one.bwd_chunk, one.fwd_segments, one.bwd_segments) == (32, 32, 1, 1)
    assert c.save_states and c.bwd_pieces == launch.BWD_PIECES  # 1024 chunks: the walk in pieces
    # training: the forward stores its chunk states anyway, so it runs split in the backward's chunks
    # (one state walk in row blocks of 4 warps, then every chunk's outputs), and both passes
    # pipeline their loads; the rest of the layout is the one walk's
    t = chunk.fused_config(4, 32768, 16, 128, 128, torch.bfloat16, cuda, training=True)
    assert t == one.replace(fwd_output_pass=True, fwd_row_blocks=chunk.SPLIT_ROW_BLOCKS, fwd_warps=4,
                            fwd_stages=chunk.SPLIT_STAGES, bwd_stages=chunk.SPLIT_STAGES,
                            fwd_output_block_v=chunk.OUTPUT_BLOCK_V)
    assert chunk.fused_config(4, 8192, 16, 128, 128, torch.bfloat16, cuda).fwd_two_walks   # 128 chunks of 64
    for shape, dtype in [((4, 32768, 16, 64, 64), torch.bfloat16), ((4, 32768, 16, 128, 128), torch.float32),
                         ((4, 4096, 16, 128, 128), torch.bfloat16), ((1, 32768, 2, 128, 128), torch.bfloat16),
                         ((4, 32768, 16, 64, 128), torch.bfloat16), ((4, 32768, 16, 128, 129), torch.bfloat16)]:
        # narrower keys, fp32, fewer than SPLIT_MIN_CHUNKS (TWO_WALKS_MIN_CHUNKS) chunks, a segmented
        # walk, nothing kept (two backward value blocks: hla3's normalized second stage, whose
        # forward took 20.7 against 18.7 ms with two walks)
        for training in (False, True):
            cfg = chunk.fused_config(*shape, dtype, cuda, training=training)
            assert not cfg.fwd_output_pass and not cfg.fwd_two_walks and cfg.fwd_stages == cfg.bwd_stages == 1, shape
            assert cfg.fwd_output_block_v is None, shape
    c = chunk.fused_config(4, 4096, 16, 128, 128, torch.bfloat16, cuda)
    assert c.bwd_pieces == 1  # 128 chunks: too few to be worth the launches
    c = chunk.fused_config(4, 32768, 16, 64, 128, torch.bfloat16, cuda)
    # 64-wide keys keep 64 x 64 tiles, 4 warps and (bf16) chunks of 64: the backward runs two value
    # blocks, so nothing is kept
    assert (c.fwd_warps, c.bwd_warps, c.fwd_segments, c.bwd_segments, c.save_states) == (4, 4, 2, 4, False)
    assert (c.fwd_chunk, c.bwd_chunk) == (64, 64)
    for V in (65, 128, 256):
        assert chunk.fused_config(4, 32768, 16, 64, V, torch.bfloat16, cuda).fwd_chunk == 64
    # fp32 (tf32x3 tiles) keeps the wide heads' chunks; wider keys keep chunks of 32
    assert chunk.fused_config(4, 32768, 16, 64, 128, torch.float32, cuda).fwd_chunk == 16
    assert chunk.fused_config(4, 32768, 16, 128, 64, torch.bfloat16, cuda).fwd_chunk == 32
    assert c.bwd_pieces == 1  # a segmented walk is not cut into pieces
    assert chunk.bwd_value_width(64) == 64 and chunk.bwd_value_width(65) == chunk.bwd_value_width(128) == 128
    c = chunk.fused_config(1, 4096, 2, 64, 64, torch.bfloat16, cuda)
    assert c.fwd_segments == 16  # few heads: many segments, but at least 4 chunks each
    # short sequences (at most SHORT_CHUNKS chunks): one segment, kept states, one gradient launch
    c = chunk.fused_config(4, 2048, 16, 64, 64, torch.bfloat16, cuda)
    assert (c.fwd_segments, c.bwd_segments, c.save_states, c.grad_parts) == (1, 1, True, (7,))
    c = chunk.fused_config(4, 8192, 16, 64, 64, torch.bfloat16, cuda)   # 128 chunks: segmented
    assert (c.fwd_segments, c.bwd_segments, c.save_states, c.grad_parts) == (4, 4, True, (1, 6))
    # fp32 (tf32x3 products): one gradient launch per gradient, chunks of 16 for wide heads
    c = chunk.fused_config(4, 32768, 16, 64, 64, torch.float32, cuda)
    assert (c.bwd_warps, c.grad_parts, c.bwd_segments) == (4, (1, 2, 4), 4)
    assert chunk.fused_config(4, 2048, 16, 64, 64, torch.float32, cuda).grad_parts == (1, 2, 4)
    # fp16 inputs (fp32 tiles, tf32x3 products): fp32's layouts, short, long, wide, gated, normalized
    for shape in [(4, 2048, 16, 64, 64), (4, 8192, 16, 64, 64), (4, 32768, 16, 128, 128), (1, 2049, 2, 128, 128),
                  (4, 2048, 16, 32, 48)]:
        for kw in ({}, dict(training=True), dict(gated=True, normalize=True, training=True)):
            f16 = chunk.fused_config(*shape, torch.float16, cuda, **kw)
            assert f16 == chunk.fused_config(*shape, torch.float32, cuda, **kw), (shape, kw)
    assert chunk.fused_config(4, 2048, 16, 64, 64, torch.float16, cuda).grad_parts == (1, 2, 4)
    c = chunk.fused_config(4, 32768, 16, 128, 128, torch.float32, cuda)
    assert (c.fwd_chunk, c.bwd_chunk, c.bwd_warps, c.grad_parts, c.save_states) == (16, 16, 8, (1, 2, 4), True)
    # fp32 at key tiles of 128: the fold of segments would not fit in shared memory, one segment
    assert chunk.fused_config(1, 2049, 2, 128, 128, torch.float32, cuda).fwd_segments == 1
    # normalized fp32 with heads up to 64 wide: chunks of 32 in both passes; a sequence short in
    # chunks of 64 stays short (one segment, kept states), a long one keeps its segments
    for K, T, segments in [(64, 2048, 1), (32, 2048, 1), (64, 32768, 4), (64, 2049, 4)]:
        c = chunk.fused_config(4, T, 16, K, K, torch.float32, cuda, normalize=True, training=True)
        plain = chunk.fused_config(4, T, 16, K, K, torch.float32, cuda, training=True)
        assert c == plain.replace(fwd_chunk=chunk.NORMALIZED_FP32_CHUNK, bwd_chunk=chunk.NORMALIZED_FP32_CHUNK,
                                  fwd_segments=segments, bwd_segments=segments), (K, T)
    assert chunk.fused_config(4, 2048, 16, 64, 64, torch.float32, cuda, chunk_size=16, normalize=True).fwd_chunk == 16
    for shape, dtype in [((4, 2048, 16, 64, 64), torch.bfloat16), ((4, 2048, 16, 128, 128), torch.float32),
                         ((4, 2048, 16, 64, 128), torch.float32)]:
        # bf16, and fp32 heads wider than 64, keep their chunks (fp16 takes fp32's layouts, above)
        assert chunk.fused_config(*shape, dtype, cuda, normalize=True) == chunk.fused_config(*shape, dtype, cuda), shape
    assert chunk.fused_config(1, 2049, 2, 128, 128, torch.bfloat16, cuda).fwd_segments > 1
    assert chunk.fused_config(1, 2049, 2, 64, 64, torch.float32, cuda).fwd_segments > 1
    c = chunk.fused_config(4, 32768, 16, 64, 64, torch.bfloat16, cpu, chunk_size=128)
    assert (c.fwd_chunk, c.bwd_chunk, c.fwd_segments, c.bwd_segments, c.save_states) == (128, 64, 1, 1, False)
    # fp32 forward chunks of 128 do not fit in Hopper's shared memory (FP32_MAX_CHUNK)
    c = chunk.fused_config(4, 32768, 16, 64, 64, torch.float32, cpu, chunk_size=128)
    assert (c.fwd_chunk, c.bwd_chunk, c.save_states) == (64, 64, True)
    chunk.fused_config.cache_clear()


@pytest.mark.parametrize("dtype,K,folds", [(torch.float32, 128, False), (torch.float32, 64, True),
                                            (torch.bfloat16, 128, True)])
def test_forward_segments_only_where_the_fold_fits(dtype, K, folds):
    """A config asking fp32 inputs with 128-wide key tiles for forward segments walks one segment:
    their fold needs 256 KB of shared memory (an H200 refused it). Launches recorded, none run."""
    from hla_fast.ops.common.compile import Recorder

    q, k, v = (torch.empty(1, 2049, 2, K, dtype=dtype) for _ in range(3))
    rec = Recorder()
    chunk.fwd_launch(q, k, v, None, 0.9, None, None, None, chunk=16, segments=4, warps=4, block_v=64, launch=rec)
    names = [kern.fn.__name__ for kern, _, _ in rec.launches]
    assert ("hla2_fwd_fold_kernel" in names) == folds
    assert rec.launches[-1][1][1] == (4 if folds else 1)   # the walk's grid: (value blocks, segments, heads)


def test_config_reaches_the_backward(monkeypatch, device):
    """The configuration a call was given is the one its backward runs with."""
    seen = []
    bwd = chunk.bwd_launch
    monkeypatch.setattr(chunk, "bwd_launch", real_calls(bwd, lambda *a, **kw: seen.append(a[10])))
    q, k, v = (x.requires_grad_() for x in rand_qkv(1, 20, 1, 16, 16, seed=7, device=device))
    cfg = SMALL.replace(grad_parts=(1, 2, 4), bwd_segments=2)
    hla_fast.hla2(q, k, v, gamma=0.9, backend="triton", config=cfg)[0].sum().backward()
    assert seen == [cfg]


@triton.jit
def _held_decays_kernel(g_in, g_out, IS_BF16: tl.constexpr, N: tl.constexpr):
    r = tl.arange(0, N)
    G = tl.load(g_in + r[:, None] * N + r[None, :])
    tl.store(g_out + r[:, None] * N + r[None, :], held_decays(G, IS_BF16).to(tl.float32))


@pytest.mark.parametrize("N", [32, 64])
def test_held_decays_rounds_within_what_its_docstring_states(N, device):
    """``held_decays`` keeps a decay tile of 64 rows or more for bf16 dots as fp16: each factor in
    (0, 1] moves by at most fp16's unit roundoff 2^-11 relative in its normal range and 2^-25
    absolute below it (2^-14). A tile of 32 rows, or one for fp32 dots, is kept exactly."""
    gen = torch.Generator().manual_seed(N)
    G = torch.exp2(-40 * torch.rand(N, N, generator=gen)).to(device)   # factors from 2^-40 to 1
    G[0, :4] = torch.tensor([1.0, 2.0 ** -14, 2.0 ** -24, 0.0])
    for is_bf16 in (True, False):
        out = torch.full_like(G, float("nan"))
        _held_decays_kernel[(1,)](G, out, IS_BF16=is_bf16, N=N)
        err = (out.double() - G.double()).abs()
        if is_bf16 and N >= 64:
            bound = torch.where(G >= 2.0 ** -14, G.double() * 2.0 ** -11, torch.full_like(err, 2.0 ** -25))
            assert bool((err <= bound).all()) and bool((err > 0).any())
        else:
            assert torch.equal(out, G)


@triton.jit
def _chunk_beta_kernel(g, beta, T, ROW_SUMS: tl.constexpr, BT: tl.constexpr):
    t = tl.arange(0, BT)
    tl.store(beta + t, chunk_beta(g, 0, 0.0, t, t < T, 1, BT, True, True, ROW_SUMS), mask=t < T)


@pytest.mark.parametrize("row_sums", [False, True])
def test_chunk_beta_sums_the_gates_and_never_rises(row_sums, device):
    """The chunk's cumulative log-gates, by rows of a masked tile or by a scan: the float64 sums to
    fp32 precision. Where gates of -1e-9 follow sums near -30, the row sums never rise after
    rounding; the scan (tl.cumsum: its partial sums associate differently from row to row) may rise
    by a rounding of the sums, and did on the H200, so ``chunk_decays`` takes the minimum as the
    chunk's total."""
    BT = 32
    gen = torch.Generator().manual_seed(5)
    for T in (BT, 27):
        g = -torch.rand(T, generator=gen, dtype=torch.float64) * 3
        g[1::3] = -1e-9
        out = torch.full((T,), float("nan"), device=device)
        _chunk_beta_kernel[(1,)](g.float().to(device), out, T, ROW_SUMS=row_sums, BT=BT)
        ref = g.float().double().cumsum(0)
        assert torch.allclose(out.double().cpu(), ref, rtol=BT * 2.0 ** -24, atol=0)
        rise = out.diff().double().cpu().clamp(min=0)
        if row_sums:
            assert bool((rise == 0).all())
        else:
            assert bool((rise <= BT * 2.0 ** -24 * ref.abs()[1:]).all())


@pytest.mark.parametrize("gated,normalize", [(False, False), (True, False), (False, True), (True, True)])
def test_the_call_asks_the_rule_with_its_gates_and_normalization(gated, normalize, device, monkeypatch):
    """Without a config, hla2 asks hla2_config for the layout of what it runs: gated or not,
    normalized or not (the rule's gradient launches depend on both), and whether autograd
    records the call (a training forward keeps its states, and may then run split)."""
    asked = []
    rule = chunk.hla2_config

    def spy(*args, **kw):
        asked.append((kw.get("gated"), kw.get("normalize"), kw.get("training")))
        return rule(*args, **kw)

    monkeypatch.setattr(chunk, "hla2_config", spy)
    q, k, v = rand_qkv(1, 9, 2, 8, 8, seed=4, positive=True, device=device)
    g = rand_gates(1, 9, 2, seed=5, device=device) if gated else None
    hla_fast.hla2(q, k, v, g=g, gamma=None if gated else 0.9, normalize=normalize, backend="triton")
    assert asked and set(asked) == {(gated, normalize, False)}
    asked.clear()
    hla_fast.hla2(q, k, v.requires_grad_(), g=g, gamma=None if gated else 0.9, normalize=normalize, backend="triton")
    assert asked and set(asked) == {(gated, normalize, True)}


@pytest.mark.skipif(not has_cuda_compiler(), reason="needs Triton's CUDA backend (compiler and ptxas)")
def test_split_layouts_fit_hopper_shared_memory():
    """The rule's split layouts at K = V = 128, T = 32k on an H200-sized device pipeline their loads
    (``SPLIT_STAGES`` copies of a chunk's tiles in shared memory): every kernel of a training call
    (one state walk) and of an inference forward (two state walks in chunks of 64), plain and gated
    and normalized, fits an H200's shared memory by an sm_90 compile."""
    cases = [dict(B=4, T=32768, H=16, K=128, V=128, dtype="bfloat16", forward_only=fwd, gates=gn, normalize=gn)
             for fwd in (False, True) for gn in (False, True)]
    shared = rule_kernels_shared("hla2", cases)
    names = {name for name, *_ in shared}
    assert {"hla2_fwd_kernel", "hla2_fwd_output_kernel", "hla2_fwd_key_walk_kernel", "hla2_fwd_value_walk_kernel",
            "hla2_bwd_state_kernel", "hla2_bwd_grad_kernel"} <= names, names
    assert all(f"fwd_stages={chunk.SPLIT_STAGES}" in cfg for _, _, cfg in shared)
    for name, nbytes, cfg in shared:
        assert nbytes <= HOPPER_SHARED, (name, cfg, nbytes)


@pytest.mark.skipif(not has_cuda_compiler(), reason="needs Triton's CUDA backend (compiler and ptxas)")
def test_key_block_layers_fit_hopper_shared_memory():
    """The rule's layouts for bf16 heads of 256 key features (values 256 or 128 wide), first-order
    layers in two key blocks of 128 whose inner layer's values are all 256 keys: every kernel of a
    training call and of an inference forward, with gamma and with gates (whose walks read the
    gates' chunk sums, ``chunk_sums_kernel``), fits an H200's shared memory by an sm_90 compile."""
    cases = [dict(B=4, T=8192, H=16, K=256, V=V, dtype="bfloat16", forward_only=fwd, gates=gates, layers=True)
             for V in (256, 128) for fwd in (False, True) for gates in (False, True)]
    shared = rule_kernels_shared("hla2", cases)
    names = {name for name, *_ in shared}
    assert names == {"ahla_fwd_kernel", "ahla_bwd_dh_kernel", "ahla_bwd_layer_kernel", "chunk_sums_kernel"}, names
    assert all("layers=True" in cfg for _, _, cfg in shared)
    for name, nbytes, cfg in shared:
        assert nbytes <= HOPPER_SHARED, (name, cfg, nbytes)


def test_layers_rule(monkeypatch):
    """hla2_config takes the first-order layers (``layers_config``: AHLA's rule for the same
    kernels, the backward walking whole sequences) for long bf16 calls of 64- or 128-wide heads,
    normalized or not (the same layout, with the denominator's passes), and for training 128-wide heads at any length; the fused
    kernels' rule otherwise (``takes_layers``' measurements)."""
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch, "interpreter_on", lambda: False)   # the rule as a GPU sees it
    for rule in (hla_fast.hla2_config, chunk.layers_config, chunk.fused_config, hla_fast.ahla_config):
        rule.cache_clear()
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    for K in (64, 128):
        for training in (False, True):
            for gated in (False, True):
                c = hla_fast.hla2_config(4, 32768, 16, K, K, bf16, cuda, gated=gated, training=training)
                ahla = hla_fast.ahla_config(4, 32768, 16, K, K, bf16, cuda, training=training)
                assert c == ahla.replace(bwd_segments=1, bwd_pieces=1, bwd_prefetch=False, bwd_layers=False,
                                         grad_parts=(7,), layers=True)
                # normalized: the same layout, with the denominator's passes for 128-wide key tiles and
                # its state gradients' passes for 64-wide ones
                n = hla_fast.hla2_config(4, 32768, 16, K, K, bf16, cuda, gated=gated, training=training, normalize=True)
                assert n == c.replace(**{"fwd_den_pass" if K == 128 else "bwd_den_pass": True})
    c = hla_fast.hla2_config(4, 32768, 16, 128, 128, bf16, cuda)
    assert (c.fwd_chunk, c.fwd_warps, c.fwd_stages) == (128, 8, 2)   # AHLA's inference walk of 128-wide keys
    for chunk_size in (None, 128, 64):
        for K in (100, 128):
            n = hla_fast.hla2_config(4, 32768, 16, K, K, bf16, cuda, chunk_size, normalize=True)
            assert n.fwd_chunk == (chunk_size or 128) and n.fwd_den_pass, (chunk_size, K)
    c = hla_fast.hla2_config(4, 32768, 16, 128, 128, bf16, cuda, training=True)
    assert (c.fwd_chunk, c.bwd_chunk, c.save_states) == (64, 64, True)
    for args, kw in [((4, 32768, 16, 128, 128, torch.float32), dict(normalize=True)),
                     ((4, 32768, 16, 128, 128, torch.float32), {}), ((4, 32768, 16, 128, 128, torch.float16), {}),
                     ((4, 32768, 16, 64, 128, bf16), {}), ((4, 32768, 16, 32, 32, bf16), {}),
                     ((4, 2048, 16, 64, 64, bf16), dict(training=True)), ((4, 2048, 16, 128, 128, bf16), {})]:
        c = hla_fast.hla2_config(*args, cuda, **kw)
        assert not c.layers and c == chunk.fused_config(*args, cuda, **kw), (args, kw)
    assert hla_fast.hla2_config(4, 2048, 16, 128, 128, bf16, cuda, training=True).layers
    assert hla_fast.hla2_config(4, 2049, 16, 64, 64, bf16, cuda).layers
    # keys wider than 128: the layers in two key blocks, in the layout of a 128-wide key tile
    # (normalized too: on [v | 1], no NORM walk to take chunks of 64 for), values of any width; fp32
    # the fused kernels' feature-block pairs
    for T in (2048, 8192):
        for training in (False, True):
            for K, V in ((256, 256), (256, 64), (200, 72)):
                for kw in ({}, {"normalize": True}, {"gated": True}):
                    c = hla_fast.hla2_config(4, T, 16, K, V, bf16, cuda, training=training, **kw)
                    width = max(b - a for a, b in chunk.key_blocks(K))
                    assert c == chunk.layers_config(4, T, 16, width, V, bf16, cuda, training=training), (T, K, V, kw)
    for args in [(4, 8192, 16, 256, 256, torch.float32), (4, 8192, 16, 256, 64, torch.float16)]:
        assert not hla_fast.hla2_config(*args, cuda).layers, args
    for rule in (hla_fast.hla2_config, chunk.layers_config, chunk.fused_config, hla_fast.ahla_config):
        rule.cache_clear()   # nothing the rule cached while it saw a GPU stays


def test_layers_config_is_checked(device):
    """config.layers: refused beside the fields of the fused kernels' backward walk and split
    forward, and by AHLA, which does not run as layers in both passes (HLA3's second stage does:
    test_hla3_kernels.py)."""
    layers = ChunkConfig(fwd_chunk=16, bwd_chunk=16, grad_parts=(7,), layers=True)
    for bad in ({"bwd_segments": 2}, {"bwd_pieces": 2}, {"bwd_prefetch": True}, {"bwd_layers": True},
                {"fwd_output_pass": True}):
        with pytest.raises(ValueError, match=f"config.layers needs .*, got {bad!r}".replace("{", r"\{")
                           .replace("}", r"\}")):
            layers.replace(**bad)
    with pytest.raises(TypeError, match="config.layers must be True or False, got 1"):
        layers.replace(layers=1)
    q, k, v = rand_qkv(1, 5, 1, 8, 8, seed=2, device=device)
    with pytest.raises(ValueError, match="config.layers must be False for ahla"):
        hla_fast.ahla(q, k, v, gamma=0.9, backend="triton", config=layers)
    # the layers take AHLA's loading ahead, which the fused kernels refuse
    o, _ = hla_fast.hla2(q, k, v, gamma=0.9, backend="triton", config=layers.replace(fwd_prefetch=True))
    assert rel(o, ref_hla2(q, k, v, 0.9)) < TOL


def first_order_state(k, b, p0):
    """p before every token and after the last, p_t = exp(b_t) p0 + sum_{j <= t} exp(b_t - b_j) k_j
    (after token t), straight from the sums (float64 in: k [B, T, H, K], b [B, T, H] the cumulative
    log decay, p0 [B, H, K]; out [B, T, H, K], [B, H, K])."""
    T = k.shape[1]
    t = torch.arange(T)
    keep = t[:, None] >= t[None, :]                                                   # [t, j]
    w = torch.where(keep[None, :, :, None], torch.exp(torch.where(
        keep[None, :, :, None], b[:, :, None] - b[:, None, :], 0.0)), 0.0)             # [B, t, j, H]
    p = torch.einsum("btjh,bjhk->bthk", w, k) + torch.exp(b)[..., None] * p0[:, None]  # p after token t
    return torch.cat([p0[:, None], p[:, :-1]], 1), p[:, -1]


def den_pass_decay(decay, g, B, T, H):
    """For the denominator passes' tests: (log(gamma) as their launch takes it, the cumulative log
    decay b [B, T, H] float64 to each token) for ``decay`` "none", "gamma" (0.9) or "g" (log-gates
    g [B, T, H])."""
    lg = float(torch.log(torch.tensor(0.9, dtype=torch.float64))) if decay == "gamma" else 0.0
    if decay == "g":
        return lg, g.double().cpu().cumsum(1)
    return lg, torch.arange(1, T + 1, dtype=torch.float64)[None, :, None].expand(B, T, H) * lg


@pytest.mark.parametrize("T,K,chunk_rows", [(1, 8, 16), (37, 12, 16), (600, 20, 16), (70, 16, 32), (300, 24, 128)])
@pytest.mark.parametrize("decay", ["none", "gamma", "g"])
@pytest.mark.parametrize("init", [False, True])
def test_denominator_passes_are_the_sums(T, K, chunk_rows, decay, init, device, poison):
    """``common.denominator.carried_denominator`` (``fwd_den_pass``): p at every chunk's start, q_t
    . p at the start of t's chunk and the final p against the index sums, with a constant decay,
    log-gates or none, from zero or from a given p0, over a single token, odd lengths, more chunks
    than one scan block (600 tokens in chunks of 16: two blocks of SCAN_CHUNKS) and chunks longer
    than a query block (128 rows: two blocks of QUERY_ROWS read one chunk's p)."""
    from hla_fast.ops.common import denominator
    B, H = 2, 3
    q, k, _ = rand_qkv(B, T, H, K, 4, seed=T + K, device=device)
    g = rand_gates(B, T, H, seed=K, device=device) if decay == "g" else None
    p0 = torch.rand(B, H, K, generator=torch.Generator().manual_seed(5)).to(device) if init else None
    lg, b = den_pass_decay(decay, g, B, T, H)
    qp, pT, starts = denominator.carried_denominator(q, k, g, p0, chunk=chunk_rows, has_decay=decay != "none",
                                                     log_gamma=lg, launch=launch_kernel)
    before, want_pT = first_order_state(k.double().cpu(), b, torch.zeros(B, H, K, dtype=torch.float64)
                                        if p0 is None else p0.double().cpu())
    NT = -(-T // chunk_rows)
    at_starts = before[:, ::chunk_rows]                                               # [B, NT, H, K]
    want_qp = (q.double().cpu() * at_starts.repeat_interleave(chunk_rows, 1)[:, :T]).sum(-1)
    assert rel(pT, want_pT) < TOL
    if NT == 1 and p0 is None:   # one chunk from a zero state: nothing before it
        assert torch.equal(qp.cpu(), torch.zeros(B, T, H))
    else:
        assert rel(qp, want_qp) < TOL
    assert starts.shape == (B * H, NT, K)
    assert torch.equal(starts[:, 0].cpu(), torch.zeros(B * H, K) if p0 is None else p0.reshape(B * H, K).cpu())
    if NT > 1:
        assert rel(starts[:, 1:], at_starts.permute(0, 2, 1, 3).reshape(B * H, NT, K)[:, 1:]) < TOL


@pytest.mark.parametrize("T,K,chunk_rows", [(1, 8, 16), (37, 12, 16), (600, 20, 16), (70, 16, 32), (300, 24, 128)])
@pytest.mark.parametrize("decay", ["none", "gamma", "g"])
@pytest.mark.parametrize("final", [False, True])
def test_denominator_grad_passes_are_the_sums(T, K, chunk_rows, decay, final, device, poison):
    """``common.denominator.carried_denominator_grad`` (``bwd_den_pass``): the gradient of the
    denominator's state p at every chunk's end and at the start, given dd = dL/dden and dL/dp_T,
    against the index sums dp_e = sum_{t > e} dd_t exp(b_t - b_e) q_t + exp(b_{T-1} - b_e) dL/dp_T
    (b_{-1} = 0 for the start), on the shapes of the forward's test."""
    from hla_fast.ops.common import denominator
    B, H = 2, 3
    q, _, _ = rand_qkv(B, T, H, K, 4, seed=T + K + 1, device=device)
    dd = torch.randn(B, T, H, generator=torch.Generator().manual_seed(T)).to(device)
    g = rand_gates(B, T, H, seed=K + 1, device=device) if decay == "g" else None
    dpT = torch.randn(B, H, K, generator=torch.Generator().manual_seed(6)).to(device) if final else None
    lg, b = den_pass_decay(decay, g, B, T, H)
    dp_end, dp0 = denominator.carried_denominator_grad(q, dd, g, dpT, chunk=chunk_rows, has_decay=decay != "none",
                                                       log_gamma=lg, launch=launch_kernel)
    b = torch.cat([torch.zeros(B, 1, H, dtype=torch.float64), b], 1)                   # b_{-1} = 0 first
    qd, ddd = q.double().cpu(), dd.double().cpu()
    dpTd = torch.zeros(B, H, K, dtype=torch.float64) if dpT is None else dpT.double().cpu()

    def grad_after(e):   # dL/dp for p after token e (e = -1: the initial state)
        later = slice(e + 1, T)
        w = torch.exp(b[:, e + 2:] - b[:, e + 1:e + 2]) * ddd[:, later]                   # [B, T - e - 1, H]
        return torch.einsum("bth,bthk->bhk", w, qd[:, later]) + torch.exp(b[:, -1] - b[:, e + 1])[..., None] * dpTd

    NT = -(-T // chunk_rows)
    want = torch.stack([grad_after(min((c + 1) * chunk_rows, T) - 1) for c in range(NT)], 2)   # [B, H, NT, K]
    assert dp_end.shape == (B * H, NT, K) and dp0.shape == (B, H, K)
    # the last chunk ends the sequence: its end gradient is dL/dp_T itself (zero without it)
    assert torch.equal(dp_end[:, -1].cpu(), torch.zeros(B * H, K) if dpT is None else dpT.reshape(B * H, K).cpu())
    if NT > 1:
        assert rel(dp_end[:, :-1], want.reshape(B * H, NT, K)[:, :-1]) < TOL
    assert rel(dp0, grad_after(-1)) < TOL


@pytest.mark.parametrize("name", ["fwd_den_pass", "bwd_den_pass"])
def test_den_pass_config_is_checked(name, device):
    """config.fwd_den_pass and config.bwd_den_pass: bools that need layers (so AHLA, which refuses
    layers, refuses them too), refused by hla3 (one config or either of a pair); unnormalized they
    change nothing."""
    layers, den_pass = checked_layers_flag(name)
    q, k, v = rand_qkv(1, 21, 2, 8, 8, seed=3, device=device)
    for config in (den_pass, (layers.replace(layers=False), den_pass), (den_pass, layers)):
        with pytest.raises(ValueError, match=rf"config.{name} must be False for hla3 \(only hla2's normalized"):
            hla_fast.hla3(q, k, v, gamma=0.9, backend="triton", config=config)
    with pytest.raises(ValueError, match="config.layers must be False for ahla"):
        hla_fast.ahla(q, k, v, gamma=0.9, backend="triton", config=den_pass)
    plain = []
    for c in (layers, den_pass):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o, state = hla_fast.hla2(*ins, gamma=0.9, backend="triton", config=c, output_final_state=True)
        (o * v).sum().backward()
        plain.append([o, *(s for s in state if s is not None), *(x.grad for x in ins)])
    assert all(torch.equal(a, b) for a, b in zip(*plain))


@pytest.mark.parametrize("K", [16, 140])
@pytest.mark.parametrize("gated", [False, True])
def test_layers_at_rate_two_equal_the_fused_kernels(gated, K, device, poison):
    """The layers at the inner index's rate 2 (hla3's second stage's weights, exp(3 b_t - b_i -
    2 b_j)): the outer layer decays at 3 g. Outputs, final states and gradients as the fused kernels'
    (for keys wider than one tile, the layers in key blocks against the fused feature-block pairs)."""
    q, k, v = rand_qkv(1, 41, 2, K, 24, seed=11, scale=0.5 if K < 64 else 0.2, device=device)
    g = rand_gates(1, 41, 2, seed=12, strength=0.1, device=device) if gated else None
    gamma = None if gated else 0.9

    def run(cfg):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v) + ((g,) if gated else ())]
        o, S, W, _ = chunk.hla2_chunked(*ins[:3], ins[3] if gated else None, gamma, None, None, None, False, 0.0,
                                        cfg, rate=2)
        (o.sin().sum() + S.cos().sum() + W.square().sum()).backward()
        return [o, S, W] + [x.grad for x in ins]

    fused = run(SMALL.replace(grad_parts=(7,)))
    layered = run(ChunkConfig(fwd_chunk=16, bwd_chunk=16, grad_parts=(7,), layers=True))
    for a, b in zip(layered, fused):
        assert rel(a, b) < TOL


@pytest.mark.parametrize("K,V,gated,save,normalize", [
    (160, 24, True, True, False), (144, 136, False, False, False), (256, 16, True, True, False),
    (200, 40, False, True, False), (160, 24, True, True, True), (140, 63, False, False, True)])
def test_wide_heads_as_key_block_layers(K, V, gated, save, normalize, device, poison):
    """Keys wider than one tile as first-order layers in key blocks (``key_block_layers_fwd``;
    normalized on [v | 1]): the output, the final states and every gradient (the initial state's
    too, with cotangents on the final states) against the float64 torch path, with gates or gamma,
    the chunk states kept by the forward or recomputed by the backward, values wider than one tile;
    and from no initial state, forward only, against the index sums."""
    B, T, H = 1, 37, 2
    q, k, v = rand_qkv(B, T, H, K, V, seed=K + V, scale=0.2, positive=normalize, device=device)
    g = rand_gates(B, T, H, seed=K, strength=0.1, device=device) if gated else None
    gen = torch.Generator().manual_seed(V)
    # S0 not symmetric; normalized, a positive start (S0, z0) keeps the denominator positive
    S0, W0 = ((torch.rand if normalize else torch.randn)(B, H, K, n, generator=gen) * 0.1 for n in (K, V))
    z0 = torch.rand(B, H, K, generator=gen) if normalize else None
    cfg = ChunkConfig(fwd_chunk=16, bwd_chunk=16, grad_parts=(7,), layers=True, save_states=save)
    assert len(chunk.key_blocks(K)) == 2

    def run(dtype, backend, config):
        ins = [None if x is None else x.detach().to(device if backend == "triton" else "cpu", dtype).requires_grad_()
               for x in (q, k, v, g, S0, W0, z0)]
        kw = {"g": ins[3]} if gated else {"gamma": 0.9}
        o, st = hla_fast.hla2(*ins[:3], initial_state=hla_fast.HLA2State(*ins[4:]), output_final_state=True,
                              normalize=normalize, backend=backend, config=config, **kw)
        loss = o.sin().sum() + st.S.cos().sum() + st.W.square().sum() + (st.z.sum() if normalize else 0)
        loss.backward()
        return [o, st.S, st.W] + ([st.z] if normalize else []) + [x.grad for x in ins if x is not None]

    for a, b in zip(run(torch.float32, "triton", cfg), run(torch.float64, "torch", None), strict=True):
        assert rel(a, b) < 1e-4   # dg: a reverse sum of fp32 products (the contract suite's bound)
    kw = {"g": g} if gated else {"gamma": 0.9}
    o, _ = hla_fast.hla2(q, k, v, normalize=normalize, backend="triton", config=cfg, **kw)
    assert rel(o, brute_hla2(q, k, v, None if gated else 0.9, normalize=normalize, g=g)) < TOL


@pytest.mark.parametrize("K", [129, 140, 200, 256])
def test_key_blocks_tile_the_head(K):
    blocks = chunk.key_blocks(K)
    assert len(blocks) == 2 and blocks[0][0] == 0 and blocks[-1][1] == K and blocks[0][1] == blocks[1][0]
    assert max(b - a for a, b in blocks) - min(b - a for a, b in blocks) <= 1 and blocks[0][1] <= chunk.TILE_MAX


@pytest.mark.parametrize("save", [True, False])
def test_layers_from_any_initial_state(save, device, poison):
    """The layers from an initial S that is not symmetric (the inner layer reads q^T S0, HLA2
    S0 q): outputs, final states and gradients against the float64 torch path, with the chunk
    states kept by the forward and recomputed by the backward."""
    B, T, H, K, V = 1, 37, 2, 16, 24
    q, k, v = rand_qkv(B, T, H, K, V, seed=21, device=device)
    g = rand_gates(B, T, H, seed=22, strength=0.1, device=device)
    gen = torch.Generator().manual_seed(23)
    S0, W0 = (torch.randn(B, H, K, n, generator=gen) * 0.2 for n in (K, V))
    cfg = ChunkConfig(fwd_chunk=16, bwd_chunk=16, grad_parts=(7,), layers=True, save_states=save)

    def run(dtype, backend, config):
        ins = [x.detach().to(device if backend == "triton" else "cpu", dtype).requires_grad_()
               for x in (q, k, v, g, S0, W0)]
        o, st = hla_fast.hla2(*ins[:3], g=ins[3], initial_state=hla_fast.HLA2State(ins[4], ins[5]),
                              output_final_state=True, backend=backend, config=config)
        (o.sin().sum() + st.S.cos().sum() + st.W.square().sum()).backward()
        return [o, st.S, st.W] + [x.grad for x in ins]

    for a, b in zip(run(torch.float32, "triton", cfg), run(torch.float64, "torch", None)):
        assert rel(a, b) < 1e-4   # dg: a reverse sum of fp32 products (the contract suite's bound)


@pytest.mark.skipif(not has_cuda_compiler(), reason="needs triton.compiler.ASTSource, GPUTarget and the CUDA backend")
def test_compile_report_lists_the_shared_memory_tiles():
    """``compile_report.py`` lists each kernel's shared-memory tiles (its GPU IR's allocations):
    HLA2's forward walk at K = V = 64 keeps its five loaded [64, 64] tiles in no pipelined buffer
    when its loads are not pipelined (``fwd_stages`` 1), and some in two buffers at two stages."""
    tiles = {}
    for stages in (1, 2):
        out = run_compiler([os.path.join(BENCHMARKS, "compile_report.py"), "hla2", "4", "32768", "16", "64", "64",
                            "bfloat16", "--pass", "forward", "--only", "hla2_fwd_kernel", "--json",
                            "--config", json.dumps({"fwd_stages": stages})], timeout=600)
        (row,) = json.loads(out)["kernels"]
        tiles[stages] = dict(row["shared_tiles"])
        assert sum(tiles[stages].values()) > 0
    assert not any(s.startswith(("1x", "2x")) for s in tiles[1]), tiles[1]
    assert tiles[2].get("2x64x64 bf16", 0) >= 3, tiles[2]
