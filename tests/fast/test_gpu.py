"""GPU checks (marked ``gpu``; skipped without CUDA): long sequences, fp32 and bf16, constant decay
and per-token gates, normalization, gradients, wide heads, decode.

Truth: the torch backend in float64 on the GPU (itself checked against the index sums in
test_contract.py). Kernel outputs are poisoned with NaN before each run; inputs are random,
never zeros.
"""
import pytest

from .helpers import rand_gates, rand_qkv, ref_hla2, rel, torch

import hla_fast

pytestmark = pytest.mark.gpu

# relative error the precision explains: fp32 inputs take tf32x3 products (fp32-level error);
# bf16 rounds every tensor-core operand to 8 bits of mantissa
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# the gradients of 2049-token sequences: fp32 sums of thousands of products; fp16 inputs run the
# fp32 kernels (fp32 tiles, tf32x3 products) and round o and every gradient to fp16 (2^-11 = 4.9e-4
# relative); bf16 rounds every product's operands to 8 bits
GRAD_TOL = {torch.float32: 1e-3, torch.float16: 3e-3, torch.bfloat16: 5e-2}


def _dtype_id(x):
    """Test ids name dtypes (``float16-128-128-True``, not ``dtype15-128-128-True``)."""
    return str(x).removeprefix("torch.") if isinstance(x, torch.dtype) else None


def _decay(kind, B, T, H, dtype=torch.float32):
    if kind == "gamma":
        return {"gamma": 0.999}
    return {"g": rand_gates(B, T, H, seed=T, strength=0.004, device="cuda", dtype=dtype)}


def _ref64(q, k, v, **kw):
    kw = {n: (x.double() if torch.is_tensor(x) else x) for n, x in kw.items()}
    return hla_fast.hla2(q.double(), k.double(), v.double(), backend="torch", output_final_state=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1000, 4097, 32768])
@pytest.mark.parametrize("kind", ["gamma", "g"])
def test_long_forward(dtype, T, kind, poison):
    q, k, v = rand_qkv(1, T, 2, 64, 64, seed=T, scale=0.3, device="cuda", dtype=dtype)
    dk = _decay(kind, 1, T, 2)
    want, st_want = _ref64(q, k, v, **dk)
    o, st = hla_fast.hla2(q, k, v, output_final_state=True, **dk)
    assert o.dtype == dtype
    assert rel(o, want) < TOL[dtype]
    assert rel(st.S, st_want.S) < TOL[dtype] and rel(st.W, st_want.W) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hla_ref_on_gpu(dtype, poison):
    q, k, v = rand_qkv(1, 300, 2, 32, 48, seed=1, device="cuda", dtype=dtype)
    g = rand_gates(1, 300, 2, seed=2, strength=0.05, device="cuda")
    assert rel(hla_fast.hla2(q, k, v, gamma=0.95)[0], ref_hla2(q, k, v, 0.95)) < TOL[dtype]
    assert rel(hla_fast.hla2(q, k, v, g=g)[0], ref_hla2(q, k, v, g=g)) < TOL[dtype]


@pytest.mark.parametrize("K,V", [(16, 16), (96, 80), (128, 128), (48, 128), (128, 24), (256, 256), (200, 72)])
def test_head_sizes(K, V, poison):
    q, k, v = rand_qkv(1, 999, 2, K, V, seed=K + V, scale=0.15, device="cuda", dtype=torch.bfloat16)
    g = rand_gates(1, 999, 2, seed=3, strength=0.01, device="cuda")
    want, st_want = _ref64(q, k, v, g=g)
    o, st = hla_fast.hla2(q, k, v, g=g, output_final_state=True)
    assert rel(o, want) < TOL[torch.bfloat16]
    assert rel(st.S, st_want.S) < TOL[torch.bfloat16] and rel(st.W, st_want.W) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalized_gated_and_carry_over(dtype, poison):
    q, k, v = rand_qkv(2, 5000, 2, 64, 32, seed=3, positive=True, scale=0.3, device="cuda", dtype=dtype)
    g = rand_gates(2, 5000, 2, seed=4, strength=0.02, device="cuda")
    want, _ = _ref64(q, k, v, g=g, normalize=True)
    o1, st = hla_fast.hla2(q[:, :2345], k[:, :2345], v[:, :2345], g=g[:, :2345], normalize=True, output_final_state=True)
    o2, _ = hla_fast.hla2(q[:, 2345:], k[:, 2345:], v[:, 2345:], g=g[:, 2345:], normalize=True, initial_state=st)
    assert rel(torch.cat([o1, o2], 1), want) < TOL[dtype]


def _grads(q, k, v, g, S0, W0, do, dtype, backend, normalize, cfg=None):
    """dq, dk, dv, dg, dS0, dW0 of sum(o * do), inputs cast to dtype (states and g fp32, float64 on float64)."""
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.detach().to(dtype if i < 3 else sd).requires_grad_() for i, x in enumerate((q, k, v, g, S0, W0))]
    z0 = torch.zeros_like(leaves[5][..., 0]) if normalize else None
    o, _ = hla_fast.hla2(*leaves[:3], g=leaves[3], initial_state=hla_fast.HLA2State(leaves[4], leaves[5], z0),
                         normalize=normalize, backend=backend, config=cfg)
    (o.double() * do).sum().backward()
    return [x.grad for x in leaves]


def _assert_gradients_match(q, k, v, g, tol, normalize=False, cfg=None):
    """The triton path's dq, dk, dv, dg, dS0, dW0 of sum(o * do) from a small random initial state
    (in the layout ``cfg``, or the rule's), finite and within tol of the float64 torch path's (dg
    within 2 tol)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S0 = torch.rand(B, H, K, K, device=q.device) * 0.02
    S0 = S0 + S0.transpose(-1, -2)
    W0 = torch.randn(B, H, K, V, device=q.device) * 0.02
    do = torch.randn(B, T, H, V, device=q.device, dtype=torch.float64)
    got = _grads(q, k, v, g, S0, W0, do, q.dtype, "triton", normalize, cfg)
    want = _grads(q, k, v, g, S0, W0, do, torch.float64, "torch", normalize)
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dS0", "dW0"], got, want):
        assert torch.isfinite(a).all(), name
        # dg_t = sum_{s >= t} (2 q.dq - k.dk/2 - 3 v.dv)_s: a reverse sum over T of products whose
        # terms cancel, each carrying the bf16 error of dq, dk, dv: its relative error is about twice theirs
        assert rel(a, b) < (2 * tol if name == "dg" else tol), name


@pytest.mark.parametrize("dtype,K,V,normalize", [
    (torch.bfloat16, 64, 64, False), (torch.bfloat16, 64, 128, False), (torch.bfloat16, 128, 64, True),
    (torch.bfloat16, 128, 128, False), (torch.float32, 64, 32, True), (torch.float32, 64, 64, False),
    (torch.bfloat16, 256, 192, False), (torch.float32, 160, 48, False), (torch.bfloat16, 256, 256, True),
    (torch.bfloat16, 32, 32, False), (torch.bfloat16, 32, 32, True), (torch.bfloat16, 16, 48, False),
    (torch.bfloat16, 64, 64, True), (torch.bfloat16, 128, 128, True), (torch.float32, 128, 128, True),
    (torch.float16, 128, 128, False), (torch.float16, 128, 128, True), (torch.float16, 64, 48, True),
], ids=_dtype_id)
def test_gradients(dtype, K, V, normalize, poison):
    T, B, H = 2049, 1, 2
    q, k, v = rand_qkv(B, T, H, K, V, seed=4, scale=0.2, positive=normalize, device="cuda", dtype=dtype)
    g = rand_gates(B, T, H, seed=5, strength=0.01, device="cuda")
    _assert_gradients_match(q, k, v, g, GRAD_TOL[dtype], normalize)


@pytest.mark.parametrize("dtype,T,short,normalize", [
    (torch.bfloat16, 2000, True, False), (torch.float32, 2000, True, False), (torch.float16, 2000, True, False),
    (torch.float16, 4097, False, False), (torch.float32, 2000, True, True), (torch.float32, 4097, False, True),
], ids=_dtype_id)
def test_gradients_in_the_rule_layouts(dtype, T, short, normalize, poison):
    """The configuration rule's layouts as a caller gets them (config=None): a short sequence (at most
    SHORT_CHUNKS chunks of 64: one segment, kept states; bf16 computes every gradient in one launch)
    and, for fp16, whose tiles are fp32, a segmented walk with kept states; normalized fp32, in
    chunks of NORMALIZED_FP32_CHUNK, short and segmented. Gradients against float64."""
    from hla_fast.ops.hla2 import chunk

    B, H, K, V = 2, 3, 64, 64
    cfg = chunk.fused_config(B, T, H, K, V, dtype, torch.device("cuda"), gated=True, normalize=normalize,
                             training=True)
    assert (cfg.fwd_segments == 1 and cfg.bwd_segments == 1) == short and cfg.save_states
    assert (cfg.grad_parts == (7,)) == (short and dtype == torch.bfloat16)
    assert chunk.SHORT_CHUNKS >= -(-T // chunk.DEFAULT_CHUNK) or not short
    assert (cfg.fwd_chunk == chunk.NORMALIZED_FP32_CHUNK) == (dtype == torch.float32 and normalize)
    q, k, v = rand_qkv(B, T, H, K, V, seed=T, scale=0.2, positive=normalize, device="cuda", dtype=dtype)
    g = rand_gates(B, T, H, seed=T + 1, strength=0.01, device="cuda")
    _assert_gradients_match(q, k, v, g, GRAD_TOL[dtype], normalize)


@pytest.mark.parametrize("dtype,K,normalize,training", [
    (torch.bfloat16, 128, False, True), (torch.bfloat16, 128, False, False), (torch.bfloat16, 64, False, True),
    (torch.bfloat16, 64, False, False), (torch.bfloat16, 128, True, True), (torch.float32, 64, False, True),
])
def test_layers(dtype, K, normalize, training, poison):
    """HLA2 as first-order layers (``ChunkConfig.layers``, the rule's layout for a long bf16 call
    of 64- or 128-wide heads; normalized and fp32 through a config): outputs, final state and
    gradients (a random initial state, log-gates) against float64."""
    from hla_fast.ops.hla2 import chunk

    cuda = torch.device("cuda")
    B, T, H = 1, 8195, 2
    cfg = chunk.layers_config(B, T, H, K, K + int(normalize), dtype, cuda, training=training)
    if not normalize and dtype == torch.bfloat16:
        assert hla_fast.hla2_config(B, T, H, K, K, dtype, cuda, gated=True, training=training) == cfg
    q, k, v = rand_qkv(B, T, H, K, K, seed=K + 9, scale=0.2, positive=normalize, device="cuda", dtype=dtype)
    g = rand_gates(B, T, H, seed=K + 10, strength=0.004, device="cuda")
    want, st_want = _ref64(q, k, v, g=g, normalize=normalize)
    o, st = hla_fast.hla2(q, k, v, g=g, normalize=normalize, output_final_state=True, config=cfg)
    assert rel(o, want) < TOL[dtype]
    assert rel(st.S, st_want.S) < TOL[dtype] and rel(st.W, st_want.W) < TOL[dtype]
    if training:
        _assert_gradients_match(q, k, v, g, 1e-3 if dtype == torch.float32 else 5e-2, normalize, cfg)


# the layouts of the rule's split forwards: a training call's (one state walk, loads pipelined in
# both passes) and an inference call's (two state walks in chunks of 64)
_TRAIN_SPLIT = dict(fwd_stages=3, bwd_stages=3, fwd_output_block_v=128)
_INFER_SPLIT = dict(fwd_two_walks=True, fwd_chunk=64, fwd_stages=3, fwd_output_block_v=128)


@pytest.mark.parametrize("dtype,K,normalize,row_blocks,layout", [
    (torch.bfloat16, 128, False, 2, {}), (torch.bfloat16, 128, True, 2, {}), (torch.float32, 128, False, 2, {}),
    (torch.bfloat16, 128, False, 1, {}), (torch.bfloat16, 64, False, 1, {}), (torch.bfloat16, 96, True, 2, {}),
    (torch.bfloat16, 128, False, 2, _TRAIN_SPLIT), (torch.bfloat16, 128, True, 2, _TRAIN_SPLIT),
    (torch.bfloat16, 128, False, 2, _INFER_SPLIT), (torch.bfloat16, 128, True, 2, _INFER_SPLIT),
    (torch.bfloat16, 96, True, 2, _INFER_SPLIT), (torch.float32, 128, False, 2, dict(fwd_two_walks=True)),
    (torch.bfloat16, 64, False, 1, dict(fwd_two_walks=True)),
])
def test_split_forward(dtype, K, normalize, row_blocks, layout, poison):
    """config.fwd_output_pass: a state walk in row blocks (``fwd_two_walks``: S's walk, then W's
    from S's stored chunk states), then every chunk's outputs at once (the rule's layouts for a bf16
    call at K = V = 128 over enough chunks, whose walk is one segment: here a long sequence of few
    heads, its walk made one segment). Outputs, final state and gradients against float64."""
    from hla_fast.ops.hla2 import chunk

    cuda = torch.device("cuda")
    rule = chunk.fused_config(4, 32768, 16, 128, 128, torch.bfloat16, cuda, training=True)
    assert rule.fwd_output_pass and rule.fwd_row_blocks == chunk.SPLIT_ROW_BLOCKS and rule.fwd_segments == 1
    assert chunk.fused_config(4, 32768, 16, 128, 128, torch.bfloat16, cuda).fwd_two_walks
    B, T, H = 1, 8195, 2
    q, k, v = rand_qkv(B, T, H, K, K, seed=K, scale=0.2, positive=normalize, device="cuda", dtype=dtype)
    g = rand_gates(B, T, H, seed=K + 1, strength=0.004, device="cuda")
    cfg = chunk.fused_config(B, T, H, K, K, dtype, cuda, gated=True, normalize=normalize, training=True).replace(
        fwd_segments=1, fwd_output_pass=True, fwd_row_blocks=row_blocks, fwd_warps=4, **layout)
    want, st_want = _ref64(q, k, v, g=g, normalize=normalize)
    o, st = hla_fast.hla2(q, k, v, g=g, normalize=normalize, output_final_state=True, config=cfg)
    assert rel(o, want) < TOL[dtype]
    assert rel(st.S, st_want.S) < TOL[dtype] and rel(st.W, st_want.W) < TOL[dtype]
    _assert_gradients_match(q, k, v, g, 1e-3 if dtype == torch.float32 else 5e-2, normalize, cfg)


@pytest.mark.parametrize("gated", [False, True])
def test_hla3_second_stage_split(gated, poison):
    """HLA3's fused second stage in the rule's split layouts at K = V = 128 (bf16, one segment;
    the rule's layouts of a normalized call, which do not run as layers): an
    inference forward with two state walks in chunks of 64 gives the outputs of float64 within
    TOL, as the one walk does; a training call's pipelined loads (``fwd_stages``, ``bwd_stages``)
    change no number: outputs and gradients equal the unpipelined split's to the bit."""
    from hla_fast.ops.hla2.chunk import fused_config
    from hla_fast.ops.hla3.chunk import first_stage_config

    cuda = torch.device("cuda")
    B, T, H, K = 1, 8195, 2, 128
    q, k, v = rand_qkv(B, T, H, K, K, seed=11, scale=0.1, device="cuda", dtype=torch.bfloat16)
    decay = {"g": rand_gates(B, T, H, seed=12, strength=0.004, device="cuda")} if gated else {"gamma": 0.999}
    want, _ = hla_fast.hla3(q.double(), k.double(), v.double(), backend="torch",
                            **{n: (x.double() if torch.is_tensor(x) else x) for n, x in decay.items()})
    shape = (B, T, H, K, K, torch.bfloat16, cuda)
    one = fused_config(*shape, gated=gated).replace(fwd_segments=1)
    infer = one.replace(fwd_output_pass=True, fwd_row_blocks=2, fwd_warps=4, **_INFER_SPLIT)
    for second in (one, infer):
        o, _ = hla_fast.hla3(q, k, v, config=(first_stage_config(*shape), second), **decay)
        assert rel(o, want) < TOL[torch.bfloat16]
    split = fused_config(*shape, gated=gated, training=True).replace(
        fwd_segments=1, bwd_segments=1, fwd_output_pass=True, fwd_row_blocks=2, fwd_warps=4)
    runs = []
    for second in (split, split.replace(**_TRAIN_SPLIT)):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o, _ = hla_fast.hla3(*ins, config=(first_stage_config(*shape, training=True), second), **decay)
        o.float().square().sum().backward()
        runs.append([o] + [x.grad for x in ins])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_equal_one_walk(dtype, poison):
    q, k, v = rand_qkv(2, 8191, 3, 64, 64, seed=6, scale=0.3, device="cuda", dtype=dtype)
    g = rand_gates(2, 8191, 3, seed=7, strength=0.002, device="cuda")
    st0 = hla_fast.HLA2State(torch.randn(2, 3, 64, 64, device="cuda") * 0.1, torch.randn(2, 3, 64, 64, device="cuda") * 0.1)
    want, st_want = _ref64(q, k, v, g=g, initial_state=hla_fast.HLA2State(st0.S.double(), st0.W.double()))
    from hla_fast.ops.hla2 import chunk

    base = chunk.fused_config(2, 8191, 3, 64, 64, dtype, q.device)
    for nseg in (1, 7, 128):
        o, st = hla_fast.hla2(q, k, v, g=g, initial_state=st0, output_final_state=True,
                              config=base.replace(fwd_segments=nseg))
        assert rel(o, want) < TOL[dtype]
        assert rel(st.S, st_want.S) < TOL[dtype] and rel(st.W, st_want.W) < TOL[dtype]
    do = torch.randn(2, 8191, 3, 64, device="cuda", dtype=torch.float64)
    ref = _grads(q, k, v, g, st0.S, st0.W, do, dtype, "triton", False, base.replace(bwd_segments=1))
    for nseg in (3, 8):
        got = _grads(q, k, v, g, st0.S, st0.W, do, dtype, "triton", False, base.replace(bwd_segments=nseg))
        for a, b in zip(got, ref):
            assert rel(a, b) < TOL[dtype]


@pytest.mark.parametrize("K,V", [(128, 128), (96, 80), (256, 256)])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("kind", ["gamma", "g"])
def test_decode_gpu(K, V, normalize, kind, poison):
    B, H = 8, 4
    q, k, v = rand_qkv(B, 3, H, K, V, seed=K, positive=normalize, device="cuda")
    g = rand_gates(B, 3, H, seed=8, device="cuda")
    st_a = st_b = None
    for t in range(3):
        kw = {"gamma": 0.9} if kind == "gamma" else {"g": g[:, t]}
        oa, st_a = hla_fast.hla2_step(q[:, t], k[:, t], v[:, t], st_a, normalize=normalize, **kw)
        kw64 = {n: (x.double() if torch.is_tensor(x) else x) for n, x in kw.items()}
        ob, st_b = hla_fast.hla2_step(q[:, t].double(), k[:, t].double(), v[:, t].double(), st_b,
                                      normalize=normalize, backend="torch", **kw64)
        assert rel(oa, ob) < 1e-5
    assert rel(st_a.W, st_b.W) < 1e-5
