"""HLA3's own launchers (hla_fast/ops/hla3/chunk.py, decode.py) beyond the operator contract:
gradients against autograd through the index sums, value blocks, forward and backward segments, kept or
recomputed chunk states, chunk sizes, the two-stage structure claimed in chunk.py's docstring, the
decode kernel's row and value blocks, head-size limits and the configuration rule. Under
TRITON_INTERPRET=1 on a CPU, compiled on CUDA."""
import importlib

import pytest

from .helpers import (
    HOPPER_SHARED, checked_layers_flag, has_cuda_compiler, rand_gates, rand_qkv, real_calls, rel, rule_kernels_shared,
    torch,
)

import hla_fast
from hla_fast import ChunkConfig
from hla_fast.ops.common.launch import min_key_block, pow2_block

chunk = importlib.import_module("hla_fast.ops.hla3.chunk")

# fp32 kernels against float64 (ieee products on the interpreter, tf32x3 on a GPU)
TOL = 1e-5
SMALL = ChunkConfig(fwd_chunk=16, bwd_chunk=16, fwd_block_v=16)


def hla3_definition(q, k, v, g=None):
    """o_t = sum_{i <= u, j <= u, u <= t} exp(3 b_t - b_i - b_u - b_j) (q_t.k_i)(k_i.q_u)(q_u.k_j) v_j,
    straight from the sum over (t, i, u, j) (float64 in, [B, T, H, V] out; differentiable)."""
    B, T, H, _ = q.shape
    b = torch.zeros(B, T, H, dtype=q.dtype) if g is None else g.cumsum(1)
    n = torch.arange(T)
    t, i, u, j = n[:, None, None, None], n[None, :, None, None], n[None, None, :, None], n[None, None, None, :]
    keep = ((i <= u) & (j <= u) & (u <= t))[None, ..., None]                           # [1, t, i, u, j, 1]
    expo = (3 * b[:, :, None, None, None] - b[:, None, :, None, None] - b[:, None, None, :, None]
            - b[:, None, None, None, :])                                                # [B, t, i, u, j, H]
    w = torch.where(keep, torch.exp(torch.where(keep, expo, 0.0)), 0.0)
    x = torch.einsum("bthd,bihd->btih", q, k)                                           # q_t . k_i
    return torch.einsum("btiujh,btih,buih,bujh,bjhv->bthv", w, x, x, x, v)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("init", [False, True])
def test_gradients_against_the_index_sums(gated, init, device, poison):
    """dq, dk, dv, dg (and the initial state's through the state's definition) from the kernels
    against autograd through the four-index sum, several chunks and value blocks."""
    B, T, H, K, V = 1, 19, 2, 8, 24
    q, k, v = rand_qkv(B, T, H, K, V, seed=1, device=device)
    g = rand_gates(B, T, H, seed=2, device=device) if gated else None
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    g64 = None if g is None else g.detach().double().cpu().requires_grad_()
    want = hla3_definition(*leaves, g=g64)
    st = None
    if init:  # a prefix of 6 tokens as the initial state: the definition covers it
        p = 6
        _, st = hla_fast.hla3(q[:, :p], k[:, :p], v[:, :p], g=None if g is None else g[:, :p],
                                  output_final_state=True, backend="torch")
        want = want[:, p:]
        q, k, v = q[:, p:], k[:, p:], v[:, p:]
        g = None if g is None else g[:, p:]
    do = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    wanted = [x for x in leaves + [g64] if x is not None]
    grads = torch.autograd.grad((want * do).sum(), wanted)
    ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    gi = None if g is None else g.detach().clone().requires_grad_()
    st_in = None if st is None else type(st)(*(None if x is None else x.detach().clone().requires_grad_() for x in st))
    o, _ = hla_fast.hla3(*ins, g=gi, initial_state=st_in, chunk_size=16, backend="triton", config=SMALL)
    assert rel(o, want) < TOL
    torch.autograd.backward(o, do.float().to(device))
    if init:
        # chain the prefix: the gradient of the definition w.r.t. the first 6 tokens goes through the state
        pre = [x[:, :6].detach().double().cpu().requires_grad_() for x in leaves]
        gp = None if g64 is None else g64.detach()[:, :6].clone().requires_grad_()
        _, st64 = hla_fast.hla3(*pre, g=gp, output_final_state=True, backend="torch")
        dst = [x.grad.double().cpu() for x in st_in[:3]]
        chained = torch.autograd.grad(sum((a * b).sum() for a, b in zip(st64[:3], dst)),
                                      pre + ([gp] if gp is not None else []))
        assert rel(torch.cat([chained[0], ins[0].grad.double().cpu()], 1), grads[0]) < TOL
        assert rel(torch.cat([chained[1], ins[1].grad.double().cpu()], 1), grads[1]) < TOL
        assert rel(torch.cat([chained[2], ins[2].grad.double().cpu()], 1), grads[2]) < TOL
        if gated:
            # db_t is the reverse cumsum: the prefix's gates see the suffix's whole gate gradient
            assert rel(torch.cat([chained[3], gi.grad.double().cpu()], 1), grads[3]) < 1e-4
    else:
        got = [ins[0].grad, ins[1].grad, ins[2].grad, None if gi is None else gi.grad]
        for name, a, b in zip(["dq", "dk", "dv", "dg"], got, grads):
            # dg: a reverse cumulative sum of differences of fp32 products
            assert rel(a, b) < (1e-4 if name == "dg" else TOL), name


@pytest.mark.parametrize("normalize", [False, True])
def test_value_blocks_sum_to_the_whole(normalize, device, poison):
    """V = 40 over value blocks of 16 (three programs a head, the last one partial): the partial
    dq, dk, dS0 and db of the blocks sum to the gradients of one wide block."""
    B, T, H, K, V = 1, 33, 2, 16, 40
    q, k, v = rand_qkv(B, T, H, K, V, seed=4, positive=normalize, device=device)
    g = rand_gates(B, T, H, seed=5, device=device)
    gen = torch.Generator().manual_seed(6)
    st0 = hla_fast.HLA3State(*(0.1 * torch.rand(s, generator=gen).to(device) for s in
                               [(B, H, K, K), (B, H, K, V), (B, H, K, V)]),
                             *((0.1 * torch.rand(B, H, K, generator=gen).to(device),) * 2 if normalize else (None, None)))

    def run(cfg):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
        st = type(st0)(*(None if x is None else x.detach().clone().requires_grad_() for x in st0))
        o, fin = hla_fast.hla3(*ins[:3], g=ins[3], normalize=normalize, initial_state=st, output_final_state=True,
                               chunk_size=16, backend="triton", config=cfg)
        loss = (o * torch.cos(o)).sum() + (fin.F * fin.P).sum()
        loss.backward()
        return [o] + [x.grad for x in ins] + [x.grad for x in st if x is not None]

    narrow, wide = run(SMALL), run(SMALL.replace(fwd_block_v=64))
    for a, b in zip(narrow, wide):
        assert rel(a, b) < TOL


@pytest.mark.parametrize("save", [True, False])
def test_kept_states_equal_recomputed(save, monkeypatch, device, poison):
    """The forward keeps both stages' chunk-start states (save_states) or the backward recomputes
    them (also when the passes use different chunks): the same gradients; each stage's recompute
    (a walk without outputs) runs only when nothing was kept."""
    from hla_fast.ops.hla2 import chunk as hla2_chunk

    q, k, v = rand_qkv(1, 45, 2, 16, 24, seed=7, device=device)
    g = rand_gates(1, 45, 2, seed=8, device=device)
    calls = []
    monkeypatch.setattr(chunk, "layer_fwd", real_calls(
        chunk.layer_fwd, lambda *a, **kw: calls.append(("first", kw["keep_states"]))))
    monkeypatch.setattr(hla2_chunk, "fwd_launch", real_calls(
        hla2_chunk.fwd_launch, lambda *a, **kw: calls.append(("second", kw.get("outputs", True)))))

    def grads(cfg):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
        o, _ = hla_fast.hla3(*ins[:3], g=ins[3], backend="triton", config=cfg)
        o.square().sum().backward()
        return [x.grad for x in ins]

    a = grads(SMALL.replace(save_states=save))
    recompute = [("second", False), ("first", True)]
    assert calls == [("first", save), ("second", True)] + ([] if save else recompute)
    calls.clear()
    b = grads(SMALL.replace(fwd_chunk=32))  # a different backward chunk: always recomputed
    assert calls == [("first", False), ("second", True)] + recompute
    for x, y in zip(a, b):
        assert rel(x, y) < TOL


@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("normalize", [False, True])
def test_segmented_forward_equals_one_walk(segments, normalize, device, poison):
    """Segments (summaries from a zero state, folded into each segment's start state) give the
    outputs, final state and gradients of one walk, from an initial state, with gates and several
    value blocks; the first stage's R, final P and chunk-start P's too."""
    B, T, H, K, V = 2, 45, 2, 16, 24
    q, k, v = rand_qkv(B, T, H, K, V, seed=18, positive=normalize, device=device)
    g = rand_gates(B, T, H, seed=19, device=device)
    gen = torch.Generator().manual_seed(20)
    shapes = [(B, H, K, K), (B, H, K, V), (B, H, K, V)] + ([(B, H, K)] * 2 if normalize else [])
    st0 = hla_fast.HLA3State(*(0.1 * torch.rand(s, generator=gen).to(device) for s in shapes))

    def run(cfg):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
        st = type(st0)(*(None if x is None else x.detach().clone().requires_grad_() for x in st0))
        o, fin = hla_fast.hla3(*ins[:3], g=ins[3], normalize=normalize, initial_state=st, output_final_state=True,
                               backend="triton", config=cfg)
        ((o * torch.sin(o)).sum() + (fin.F * fin.S[..., :1]).sum()).backward()
        return [o, *[x for x in fin if x is not None]] + [x.grad for x in ins] + [x.grad for x in st if x is not None]

    one = run(SMALL.replace(save_states=False))
    # the backward's recompute and its walk are segmented too
    many = run(SMALL.replace(fwd_segments=segments, bwd_segments=segments, save_states=False))
    for a, b in zip(one, many):
        assert rel(b, a) < TOL
    # the first stage's walk alone (its segment summaries and fold without AHLA's second layer)
    runs = [chunk.layer_fwd(q, k, v, g, None, st0.P, SMALL.replace(fwd_segments=n), keep_states=True)
            for n in (1, segments)]
    for a, b in zip(*runs):
        assert rel(b, a) < 1e-6


@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("final_grads", ["all", "F only", "none"])
def test_segmented_backward_equals_one_walk(segments, final_grads, device, poison):
    """The backward walk in segments (summaries from a zero end gradient, folded last to first)
    gives the gradients of one walk: inputs, gates, initial state, with cotangents on the final
    state or not, two value blocks."""
    B, T, H, K, V = 2, 45, 2, 16, 24
    q, k, v = rand_qkv(B, T, H, K, V, seed=21, device=device)
    g = rand_gates(B, T, H, seed=22, device=device)
    gen = torch.Generator().manual_seed(23)
    st0 = hla_fast.HLA3State(*(0.1 * torch.randn(s, generator=gen).to(device)
                               for s in [(B, H, K, K), (B, H, K, V), (B, H, K, V)]))
    do = torch.randn(B, T, H, V, generator=gen).to(device)
    dst = [torch.randn(s, generator=gen).to(device) for s in [(B, H, K, K), (B, H, K, V), (B, H, K, V)]]
    if final_grads == "F only":
        dst[0] = dst[1] = None
    elif final_grads == "none":
        dst = [None] * 3

    def run(cfg):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
        st = type(st0)(*(None if x is None else x.detach().clone().requires_grad_() for x in st0))
        o, fin = hla_fast.hla3(*ins[:3], g=ins[3], initial_state=st, output_final_state=True, backend="triton",
                               config=cfg)
        loss = (o * do).sum() + sum((a * b).sum() for a, b in zip(fin[:3], dst) if b is not None)
        loss.backward()
        return [x.grad for x in ins] + [x.grad for x in st[:3]]

    runs = [run(SMALL.replace(bwd_segments=n)) for n in (1, segments)]
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dS0", "dP0", "dF0"], *runs):
        # dg_t = sum_{s >= t} db_s, a reverse cumulative sum whose terms cancel: at this shape the norm
        # of sum_{s >= t} |db_s| is about 14 times that of dg (float64 torch path), so an error of TOL
        # in every term could reach dg 14 times over; ten times is the bound the other gates' tests hold
        assert rel(b, a) < (1e-4 if name == "dg" else TOL), name


def test_chunk_size_does_not_change_the_result(device, poison):
    q, k, v = rand_qkv(2, 70, 2, 12, 20, seed=9, device=device)
    g = rand_gates(2, 70, 2, seed=10, device=device)
    outs = [hla_fast.hla3(q, k, v, g=g, chunk_size=c, backend="triton", output_final_state=True) for c in (16, 32, 64, 128)]
    for o, st in outs[1:]:
        assert rel(o, outs[0][0]) < TOL
        for a, b in zip(st, outs[0][1]):
            if b is not None:
                assert rel(a, b) < TOL


def test_at_gamma_one_it_is_hla2_on_first_order_values(device):
    """The structure of chunk.py's docstring: without decay, hla3(Q, K, V) = hla2(Q, K, R)
    with R_u = sum_{j <= u} (q_u . k_j) v_j."""
    q, k, v = rand_qkv(1, 29, 2, 8, 6, seed=11, dtype=torch.float64)
    x = torch.einsum("buhd,bjhd->bhuj", q, k).tril()
    r = torch.einsum("bhuj,bjhv->buhv", x, v)
    o3, _ = hla_fast.hla3(q, k, v, backend="torch")
    o2, _ = hla_fast.hla2(q, k, r, backend="torch")
    assert rel(o3, o2) < 1e-12


def test_bf16_inputs(device, poison):
    """bf16 in, bf16 out: against float64 on the same (rounded) inputs the error is two bf16
    roundings (unit 2^-9), the first stage's R (stored in bf16 for the second) and the output, plus
    the dots' rounding of their operands (bf16 on a GPU; tf32, unit 2^-11, on the interpreter): two
    operands in each of the three products on the way to o (Q S0 Q^T, A Ym, M R). R's and the
    operands' roundings reach o_t through the second stage's sum, so each is bounded by its unit
    times that sum on |x| and |R|, relative to max |o|."""
    q, k, v = rand_qkv(1, 40, 2, 16, 16, seed=12, dtype=torch.bfloat16, device=device)
    g = rand_gates(1, 40, 2, seed=13, device=device)
    o, st = hla_fast.hla3(q, k, v, g=g, chunk_size=16, backend="triton", output_final_state=True)
    assert o.dtype == torch.bfloat16 and st.F.dtype == torch.float32
    q64, k64, v64, g64 = (x.double().cpu() for x in (q, k, v, g))
    o64, st64 = hla_fast.hla3(q64, k64, v64, g=g64, backend="torch", output_final_state=True)
    # the second stage's sum on absolute values: sum_{i <= u <= t} e^{3 b_t - b_i - 2 b_u} |q_t.k_i| |k_i.q_u| |R_u|
    b = g64.cumsum(1)[0].T                                                          # [H, T]
    x = torch.einsum("thd,ihd->hti", q64[0], k64[0])
    first = torch.where(torch.ones_like(x, dtype=torch.bool).tril(), x * torch.exp(b[:, :, None] - b[:, None, :]), 0.0)
    r = torch.einsum("huj,jhv->huv", first, v64[0])                                 # R [H, T, V]
    t = torch.arange(40)
    keep = (t[None, :, None] <= t[:, None, None]) & (t[None, None, :] <= t[None, :, None])   # [t, u, i]: i <= u <= t
    w = torch.where(keep, torch.exp(3 * b[:, :, None, None] - 2 * b[:, None, :, None] - b[:, None, None, :]), 0.0)
    absum = torch.einsum("htui,hti,hui,huv->htv", w, x.abs(), x.abs(), r.abs())
    amp = (absum.abs().max() / o64.abs().max()).item()
    unit_dot = 2 ** -11 if device == "cpu" else 2 ** -9
    tol = 2 ** -9 * (1 + amp) + 6 * unit_dot * amp
    assert rel(o, o64) < tol
    assert rel(st.F, st64.F) < tol


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("kind", ["gamma", "g"])
def test_decode_kernel_row_and_value_blocks(normalize, kind, device, poison):
    """K = 40 (two row blocks of 32, the second partial) and V = 200 (two value blocks of 128):
    the Triton step equals the torch step in float64."""
    B, H, K, V = 2, 3, 40, 200
    q, k, v = (x[:, 0] for x in rand_qkv(B, 1, H, K, V, seed=14, positive=True, device=device))
    gen = torch.Generator().manual_seed(15)
    parts = [0.2 * torch.rand(s, generator=gen) for s in [(B, H, K, K), (B, H, K, V), (B, H, K, V)]]
    parts += [0.2 * torch.rand(B, H, K, generator=gen) for _ in range(2)] if normalize else [None, None]
    st = hla_fast.HLA3State(*(None if x is None else x.to(device) for x in parts))
    kw = {"gamma": 0.9} if kind == "gamma" else {"g": rand_gates(B, 1, H, seed=16, device=device)[:, 0]}
    o, new = hla_fast.hla3_step(q, k, v, st, normalize=normalize, backend="triton", **kw)
    kw64 = {n: (x.double().cpu() if torch.is_tensor(x) else x) for n, x in kw.items()}
    st64 = hla_fast.HLA3State(*(None if x is None else x.double().cpu() for x in st))
    o64, new64 = hla_fast.hla3_step(q.double().cpu(), k.double().cpu(), v.double().cpu(), st64,
                                    normalize=normalize, backend="torch", **kw64)
    assert rel(o, o64) < TOL
    for a, b in zip(new, new64):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel(a, b) < TOL


def test_wide_keys_are_refused_on_triton_only(device):
    q, k, v = rand_qkv(1, 4, 1, 130, 8, seed=17, device=device)
    with pytest.raises(ValueError, match="K <= 128, got K=130"):
        hla_fast.hla3(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="K <= 128, got K=130"):
        hla_fast.hla3_step(q[:, 0], k[:, 0], v[:, 0], backend="triton")
    o, _ = hla_fast.hla3(q.cpu(), k.cpu(), v.cpu(), backend="torch")
    assert o.shape == v.shape and torch.isfinite(o).all()


def test_config_rule(monkeypatch):
    """HLA3's rule is HLA2's (its second stage is HLA2 at rate 2), with the call's gates, whether
    it normalizes and whether autograd records it: first-order layers where ``takes_layers`` says
    so, else the fused kernels' rule; there a long bf16 call of 128-wide keys on an H200-sized
    device (132 multiprocessors) runs that stage's forward split, training with one state walk and
    inference with two, as HLA2's own does."""
    from hla_fast.ops.common import launch

    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    from hla_fast.ops.hla2.chunk import fused_config, layers_config, takes_layers

    rules = (fused_config, layers_config, hla_fast.hla3_config)
    for rule in rules:
        rule.cache_clear()   # cached per shape and device
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    seen = set()
    for args in ((4, 32768, 16, 64, 64, torch.bfloat16, cpu), (4, 32768, 16, 128, 128, torch.bfloat16, cpu),
                 (4, 32768, 16, 128, 128, torch.bfloat16, cuda), (4, 2048, 16, 64, 64, torch.bfloat16, cpu),
                 (1, 100, 1, 16, 20, torch.float32, cpu, 16)):
        B, T, H, K, V, dtype = args[:6]
        for gated in (False, True):
            for training in (False, True):
                for normalize in (False, True):
                    got = hla_fast.hla3_config(*args, gated=gated, training=training, normalize=normalize)
                    if takes_layers(T, K, V, dtype, normalize, training):
                        # R and K' in one walk for tiles up to SHARED_WALK_MAX wide
                        shared = max(pow2_block(K), pow2_block(V)) <= chunk.SHARED_WALK_MAX
                        assert got == layers_config(*args, training=training).replace(fwd_shared_walk=shared)
                        assert got.layers and got.fwd_shared_walk == (K == 64)
                    else:
                        assert got == fused_config(*args, gated=gated, training=training) and not got.layers
                    seen.add(got.layers)
    assert seen == {False, True}
    long128 = (4, 32768, 16, 128, 128, torch.bfloat16, cuda)
    assert hla_fast.hla3_config(*long128).layers and hla_fast.hla3_config(*long128, training=True).layers
    train = hla_fast.hla3_config(*long128, training=True, normalize=True)
    infer = hla_fast.hla3_config(*long128, normalize=True)
    assert train.fwd_output_pass and not train.fwd_two_walks and infer.fwd_two_walks   # as HLA2's fused rule
    # the two rules' pair is a pair the call accepts: the first stage's backward (per-layer kernels)
    # does not load ahead, though AHLA's rule asks its own backward walk to for an inference call's
    # layout at 128-wide keys with bf16 dots (which the interpreter does not take: the rule is
    # asked as on a GPU)
    monkeypatch.setattr(launch, "interpreter_on", lambda: False)
    hla_fast.ahla_config.cache_clear()
    assert hla_fast.ahla_config(*long128).bwd_prefetch
    for args in (long128, (4, 32768, 16, 64, 64, torch.bfloat16, cuda)):
        for training in (False, True):
            second = hla_fast.hla3_config(*args, training=training)
            pair = (chunk.first_stage_config(*args, training=training), second)
            assert not pair[0].bwd_prefetch
            if second.fwd_shared_walk:   # the first stage runs in the second's walk: one config, not a pair
                with pytest.raises(ValueError, match=r"config\[1\].fwd_shared_walk runs the first stage's layer in "
                                                     r"the second stage's walk and layout: pass one ChunkConfig"):
                    chunk.stage_configs(pair)
                assert chunk.stage_configs(second) == chunk.stage_rules(*args, training=training)
            else:
                assert chunk.stage_configs(pair) == pair
    # fp16 inputs (fp32 tiles, tf32x3 products): both stages take fp32's layouts
    for shape in ((4, 32768, 16, 128, 128), (2, 4099, 4, 64, 64), (1, 2048, 2, 32, 48)):
        for training in (False, True):
            for gated in (False, True):
                f16, f32 = (chunk.stage_rules(*shape, dt, cuda, gated=gated, training=training)
                            for dt in (torch.float16, torch.float32))
                assert f16 == f32, (shape, training, gated)
    for rule in rules + (hla_fast.ahla_config,):
        rule.cache_clear()   # nothing cached while the rule saw a GPU's layouts stays
    with pytest.raises(TypeError, match="config must be a ChunkConfig"):
        hla_fast.hla3(*rand_qkv(1, 4, 1, 8, 8), backend="torch", config={"fwd_chunk": 16})


@pytest.mark.parametrize("gated", [False, True])
def test_the_call_asks_the_rule_whether_it_trains(gated, device, monkeypatch):
    """Without a config, hla3 asks each stage's rule whether autograd records the call (the
    first stage's keeps its states then, the second's may run split) and the second's whether it
    is gated."""
    asked = []
    rule, first = chunk.hla3_config, chunk.first_stage_config

    def spy(*args, **kw):
        asked.append(("second", kw.get("gated"), kw.get("training")))
        return rule(*args, **kw)

    def spy_first(*args, **kw):
        asked.append(("first", None, kw.get("training")))
        return first(*args, **kw)

    monkeypatch.setattr(chunk, "hla3_config", spy)
    monkeypatch.setattr(chunk, "first_stage_config", spy_first)
    q, k, v = rand_qkv(1, 9, 2, 8, 8, seed=4, device=device)
    g = rand_gates(1, 9, 2, seed=5, device=device) if gated else None
    decay = dict(g=g) if gated else dict(gamma=0.9)
    hla_fast.hla3(q, k, v, backend="triton", **decay)
    assert set(asked) == {("first", None, False), ("second", gated, False)}
    asked.clear()
    hla_fast.hla3(q, k, v.requires_grad_(), backend="triton", **decay)
    assert set(asked) == {("first", None, True), ("second", gated, True)}


def test_a_config_for_each_stage(device):
    """config=(first, second) sets each stage's layout: the same outputs and gradients as the
    rule's or one config for both (fp32 under the interpreter: to fp32 rounding), the first stage
    loading ahead (AHLA's walk may) and the second walking its backward in pieces and running its
    forward split; what a stage does not have is refused, naming the stage."""
    q, k, v = rand_qkv(1, 40, 2, 2 * min_key_block(torch.device(device)), 8, seed=11, device=device)
    g = rand_gates(1, 40, 2, seed=12, device=device)
    both = hla_fast.ChunkConfig(fwd_chunk=16, bwd_chunk=16, fwd_block_v=16)

    def run(config):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
        o, st = hla_fast.hla3(*ins[:3], g=ins[3], backend="triton", config=config, output_final_state=True)
        (o.square().sum() + st.F.sum()).backward()
        return [o, st.S, st.P, st.F] + [x.grad for x in ins]

    ref = run(both)
    for a, b in zip(ref, run((both, both))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    first = both.replace(fwd_prefetch=True, fwd_chunk=32, bwd_chunk=32)
    second = both.replace(bwd_pieces=2, fwd_chunk=32, bwd_chunk=32, fwd_output_pass=True, fwd_row_blocks=2)
    for a, b in zip(ref, run((first, second))):
        assert rel(b, a) < 1e-5
    with pytest.raises(ValueError,
                       match=r"config.fwd_output_pass must be False .* for hla3's first stage \(config\[0\]\)"):
        hla_fast.hla3(q, k, v, backend="triton", config=(second, both))
    with pytest.raises(ValueError, match=r"config\[0\].bwd_prefetch must be False for hla3's first stage"):
        hla_fast.hla3(q, k, v, backend="triton", config=(both.replace(bwd_prefetch=True), both))
    with pytest.raises(ValueError, match=r"must be False for hla3's second stage \(config\[1\]\)"):
        hla_fast.hla3(q, k, v, backend="triton", config=(both, first))
    layers = both.replace(layers=True, fwd_block_v=64)
    with pytest.raises(ValueError, match=r"config\[0\].layers must be False for hla3's first stage .*got True"):
        hla_fast.hla3(q, k, v, backend="triton", config=(layers, both))
    # the layered second stage takes AHLA's loading ahead, which the fused one refuses
    for a, b in zip(ref, run((both, layers.replace(fwd_prefetch=True)))):
        assert rel(b, a) < 1e-5
    for bad, got in (((both,), r"got a tuple of 1: \(ChunkConfig\)"), ([both, both], "got list"),
                     ((both, {"fwd_chunk": 16}), r"got a tuple of 2: \(ChunkConfig, dict\)"),
                     ((both, both, both), "got a tuple of 3")):
        with pytest.raises(TypeError, match=r"config must be a ChunkConfig, a tuple of 2 ChunkConfigs \(one a stage\) "
                                            r"or None, " + got):
            hla_fast.hla3(q, k, v, backend="triton", config=bad)
    for op in (hla_fast.hla2, hla_fast.ahla):   # one stage: a pair is refused
        with pytest.raises(TypeError, match="config must be a ChunkConfig or None, got tuple"):
            op(q, k, v, backend="triton", config=(both, both))


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("gated", [False, True])
def test_the_second_stage_as_layers(gated, save, device, poison):
    """config.layers: the second stage as two first-order layers (chunk.py's docstring: third
    order as three), from an initial S that is not symmetric (the inner layer reads q^T S0) and an
    initial P and F, with the chunk states kept by the forward or recomputed by the backward:
    outputs, final states and every gradient as the fused second stage's (fp32 rounding), and one
    layers config for both stages equal to a pair whose first stage asks the same walk."""
    B, T, H, K, V = 1, 37, 2, 16, 24
    q, k, v = rand_qkv(B, T, H, K, V, seed=31, device=device)
    g = rand_gates(B, T, H, seed=32, strength=0.1, device=device) if gated else None
    gen = torch.Generator().manual_seed(33)
    S0, P0, F0 = ((torch.randn(B, H, K, n, generator=gen) * 0.2).to(device) for n in (K, V, V))
    layers = ChunkConfig(fwd_chunk=16, bwd_chunk=16, grad_parts=(7,), layers=True, save_states=save)

    def run(config):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v, S0, P0, F0) + ((g,) if gated else ())]
        decay = dict(g=ins[6]) if gated else dict(gamma=0.9)
        o, st = hla_fast.hla3(*ins[:3], initial_state=hla_fast.HLA3State(*ins[3:6]), output_final_state=True,
                              backend="triton", config=config, **decay)
        (o.sin().sum() + st.S.cos().sum() + st.P.square().sum() + (st.F * st.F.flip(-1)).sum()).backward()
        return [o, st.S, st.P, st.F] + [x.grad for x in ins]

    fused = run(layers.replace(layers=False))
    layered = run(layers)
    for a, b in zip(layered, fused):
        assert rel(a, b) < TOL
    for a, b in zip(run((layers.replace(layers=False), layers)), layered):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["one_segment", "segments", "segments_prefetch"])
@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("gated", [False, True])
def test_r_and_kprime_in_one_walk(gated, save, layout, device, poison):
    """config.fwd_shared_walk: R = LA(q, k, v) and K' = LA(q, k, k) as one walk carrying P and S^T
    (``ahla.chunk.layer_pair_fwd``), from an initial S that is not symmetric and an initial P and
    F, in one segment or three (the second values' summaries and fold), loading ahead or not, with
    the chunk states kept by the forward (each layer's, for its backward) or recomputed: outputs,
    final states and every gradient as the three layers walked apart (fp32 rounding); d != dv, an
    odd length."""
    B, T, H, K, V = 1, 37, 2, 16, 24
    q, k, v = rand_qkv(B, T, H, K, V, seed=41, device=device)
    g = rand_gates(B, T, H, seed=42, strength=0.1, device=device) if gated else None
    gen = torch.Generator().manual_seed(43)
    S0, P0, F0 = ((torch.randn(B, H, K, n, generator=gen) * 0.2).to(device) for n in (K, V, V))
    apart = ChunkConfig(fwd_chunk=16, bwd_chunk=16, grad_parts=(7,), layers=True, save_states=save,
                        fwd_segments=1 if layout == "one_segment" else 3, fwd_prefetch=layout == "segments_prefetch")

    def run(config, state=True):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v, S0, P0, F0) + ((g,) if gated else ())]
        decay = dict(g=ins[-1]) if gated else dict(gamma=0.9)
        init = hla_fast.HLA3State(*ins[3:6]) if state else None
        o, st = hla_fast.hla3(*ins[:3], initial_state=init, output_final_state=True, backend="triton",
                              config=config, **decay)
        (o.sin().sum() + st.S.cos().sum() + st.P.square().sum() + (st.F * st.F.flip(-1)).sum()).backward()
        return [o, st.S, st.P, st.F] + [x.grad for x in ins if x.grad is not None]

    for state in (True, False):
        shared = run(apart.replace(fwd_shared_walk=True), state)
        for a, b in zip(shared, run(apart, state), strict=True):
            assert rel(a, b) < TOL


def test_shared_walk_is_checked(device):
    """config.fwd_shared_walk needs layers, is hla3's alone, and sets both stages (not a pair)."""
    layers, shared = checked_layers_flag("fwd_shared_walk")
    q, k, v = rand_qkv(1, 5, 1, 8, 8, seed=3, device=device)
    with pytest.raises(ValueError, match=r"config.fwd_shared_walk must be False for hla2 \(its first-order layers "
                                         r"read different keys; only hla3's R and K' share theirs\), got True"):
        hla_fast.hla2(q, k, v, gamma=0.9, backend="triton", config=shared)
    with pytest.raises(ValueError, match="config.layers must be False for ahla"):
        hla_fast.ahla(q, k, v, gamma=0.9, backend="triton", config=shared)
    with pytest.raises(ValueError, match=r"config\[1\].fwd_shared_walk runs the first stage's layer in the second "
                                         r"stage's walk and layout: pass one ChunkConfig for both stages, not a pair"):
        hla_fast.hla3(q, k, v, gamma=0.9, backend="triton", config=(layers.replace(layers=False), shared))
    first, second = chunk.stage_configs(shared)
    assert second == shared and first == layers.replace(layers=False)
    # the walk's launcher: a second value tensor is for the first layer alone, and is not normalized
    from hla_fast.ops.ahla.chunk import fwd_launch

    walk = dict(chunk=16, warps=4, block_v=16)
    with pytest.raises(ValueError, match=r"a second value tensor \(v2\) is for the first layer alone \(second=False\)"):
        fwd_launch(q, k, v, None, 0.9, None, None, None, v2=k, **walk)
    with pytest.raises(ValueError, match=r"a second value tensor \(v2\) is not normalized"):
        fwd_launch(q, k, v, None, 0.9, None, None, None, v2=k, second=False, normalize=True, **walk)


def test_the_second_stage_rate_is_checked():
    """The HLA2 launchers take rate 1 (HLA2) or 2 (third order's second stage), unnormalized."""
    from hla_fast.ops.hla2 import chunk as hla2_chunk

    q, k, v = rand_qkv(1, 8, 1, 8, 8, seed=5)
    for rate, normalize, match in ((3, False, "rate must be 1 or 2, got 3"), (2, True, "normalize needs rate 1")):
        with pytest.raises(ValueError, match=match):
            hla2_chunk.fwd_launch(q, k, v, None, None, None, None, None, chunk=16, segments=1, warps=4, block_v=16,
                                  normalize=normalize, rate=rate)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("one_segment", [False, True], ids=["rule", "one_segment"])
def test_long_sequences_on_the_gpu(dtype, D, one_segment):
    """The compiled kernels of both stages at a realistic size with the default configuration
    (forward segments chosen by occupancy, but for fp32 at K = 128, whose fold does not fit), and
    with both walks in one segment (the rule's layout once B * H fills the GPU): outputs, final
    state and gradients against the float64 torch path on the same rounded inputs. fp32: tf32x3
    products (fp32's level) summed over thousands of tokens; fp16: the fp32 kernels, with R, o and
    the gradients rounded to fp16 (2^-11 relative); bf16: bf16 operands, R stored in bf16 between
    the stages (and the second stage as two first-order layers, K' stored in bf16: the rule's
    layout there)."""
    B, T, H = 2, 4099, 4
    gen = torch.Generator().manual_seed(31)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=gen)
    g = -0.01 * torch.rand(B, T, H, generator=gen)
    q, k, v = (x.to("cuda", dtype) for x in (q, k, v))
    g = g.cuda()
    cfg = hla_fast.hla3_config(B, T, H, D, D, dtype, q.device, gated=True)
    assert cfg.fwd_segments > 1 or (dtype != torch.bfloat16 and D > 64), cfg   # fp32 tiles: fold_fits
    assert cfg.layers == (dtype == torch.bfloat16)
    if one_segment:
        cfg = cfg.replace(fwd_segments=1, bwd_segments=1)
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}[dtype]
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    o, st = hla_fast.hla3(*leaves[:3], g=leaves[3], output_final_state=True, config=cfg)
    do = torch.randn(o.shape, generator=gen).to("cuda", dtype)
    o.backward(do)
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v, g)]
    o64, st64 = hla_fast.hla3(*leaves64[:3], g=leaves64[3], output_final_state=True, backend="torch")
    o64.backward(do.double())
    assert rel(o, o64) < tol
    for a, b in zip(st, st64):
        if b is not None:
            assert rel(a, b) < tol
    for name, a, b in zip(["dq", "dk", "dv", "dg"], leaves, leaves64):
        assert rel(a.grad, b.grad) < (10 * tol if name == "dg" else tol), name


# The launches of one forward and backward with the rule's CUDA configuration (an H200's 132
# multiprocessors), recorded on meta tensors without running anything, then the kernels they name
# compiled for Hopper (sm_90) with those arguments: in a fresh interpreter without TRITON_INTERPRET.
@pytest.mark.skipif(not has_cuda_compiler(), reason="needs triton.compiler.ASTSource, GPUTarget and the CUDA backend")
def test_rule_kernels_fit_hopper_shared_memory():
    """Every kernel the rule launches for a gated forward + backward at K = V = 128 (the widest
    tiles; fp32 takes tf32x3 products, which keep split copies of the operands) fits an H200's
    shared memory: the first stage's walks without AHLA's second layer and the second stage's
    kernels at rate 2. fp16 inputs too, which take fp32's layouts and products: with single tf32
    products HLA2's gradient kernel there asked for 307 KB (``launch.dot_precision``)."""
    cases = [dict(B=2, T=4099, H=4, K=128, V=128, dtype=dtype, gates=True)
             for dtype in ("bfloat16", "float32", "float16")]
    shared = rule_kernels_shared("hla3", cases)
    names = {name for name, *_ in shared}
    assert {"ahla_fwd_kernel", "ahla_bwd_dh_kernel", "ahla_bwd_layer_kernel", "hla2_fwd_kernel",
            "hla2_bwd_state_kernel", "hla2_bwd_grad_kernel"} <= names, names
    for name, nbytes, cfg in shared:
        assert nbytes <= HOPPER_SHARED, (name, cfg, nbytes)
