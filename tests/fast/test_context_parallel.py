"""Context parallelism (hla_fast/ops/cp): the slice summaries and combines against hla_ref's
monoids and streams, the algorithm in one process against the single call, and the real thing over
``torch.distributed`` with the gloo backend in 2 and 4 spawned processes.

Float64 torch paths are compared at 1e-10 (the same float64 arithmetic up to reordering; the
summaries against hla_ref at 1e-12, where only a few hundred products are summed); the Triton case
(fp32 kernels under the interpreter against a float64 reference) at 1e-5, the fp32 products'
tolerance. Operators missing from this hla_fast (``hla_fast.ahla`` / ``hla_fast.hla3``) skip.
"""
import json
import os
import time
import traceback

import numpy as np
import pytest

from .helpers import rand_gates, rand_qkv, rel, torch

import hla_ref  # noqa: E402

import hla_fast  # noqa: E402
from hla_fast.ops.cp import SUMMARIES, decayed_linear_attention, run_slices, summary_numbers  # noqa: E402
from hla_fast.ops.cp.summaries import linear_attention_chunk, suffix_decay  # noqa: E402

NAMES = ["hla2", "ahla", "hla3"]
STATE_NAMES = {"hla2": "HLA2State", "ahla": "AHLAState", "hla3": "HLA3State"}


def _available(name):
    return hasattr(hla_fast, name) and hasattr(hla_fast, STATE_NAMES[name])


def _need(name):
    if not _available(name):
        pytest.skip(f"hla_fast.{name} is not in this build yet")


def _f64(*xs):
    return [torch.as_tensor(np.asarray(x), dtype=torch.float64) for x in xs]


# ----------------------------------------------------------------------------------------------
# the pieces, against hla_ref
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,chunk", [(1, 4), (9, 4), (13, 64), (16, 4), (150, 8)])
def test_decayed_linear_attention_matches_hla_ref(T, chunk):
    B, H, K, D = 2, 2, 3, 4
    q, k, v = rand_qkv(B, T, H, K, D, seed=T, dtype=torch.float64)
    lg = rand_gates(B, T, H, seed=T, dtype=torch.float64)
    o = decayed_linear_attention(q, k, v, lg, chunk)
    for b in range(B):
        for h in range(H):
            want = hla_ref.linear_attention(q[b, :, h].numpy(), k[b, :, h].numpy(), v[b, :, h].numpy(),
                                            gamma=np.exp(lg[b, :, h].numpy()))
            assert rel(o[b, :, h], torch.from_numpy(want)) < 1e-12


def test_linear_attention_chunk_rule():
    """Powers of two in [16, 256], growing with T (C^3 ~ T K D / (K + D))."""
    cs = [linear_attention_chunk(T, 64, 128) for T in (1, 1024, 4096, 32768, 10 ** 7)]
    assert all(c & (c - 1) == 0 and 16 <= c <= 256 for c in cs)
    assert cs == sorted(cs) and cs[0] == 16 and cs[-1] == 256 and linear_attention_chunk(32768, 64, 128) == 128


def _segment(name, q, k, v, a):
    """hla_ref's segment of tokens q, k, v (n, .) with factors a (n,): one-token segments folded."""
    seg, ident, comb = {"hla2": (hla_ref.hla2_segment, hla_ref.hla2_identity, hla_ref.hla2_combine),
                        "ahla": (hla_ref.ahla_segment, hla_ref.ahla_identity, hla_ref.ahla_combine),
                        "hla3": (hla_ref.hla3_segment, hla_ref.hla3_identity, hla_ref.hla3_combine)}[name]
    out = ident(q.shape[1], v.shape[1])
    for t in range(q.shape[0]):
        out = comb(out, seg(q[t], k[t], v[t], float(a[t])))
    return out


# summary piece -> the hla_ref segment field it equals
PIECES = {"hla2": {"C": "C", "c": "m"}, "ahla": {"R": "R"}, "hla3": {"SQ": "SQ", "R": "R", "N": "N", "r": "r"}}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 10])
def test_summary_pieces_match_hla_ref_segments(name, T):
    B, H, K, V = 1, 2, 3, 4
    q, k, v = rand_qkv(B, T, H, K, V, seed=T + 1, dtype=torch.float64)
    lg = rand_gates(B, T, H, seed=T, dtype=torch.float64)
    pieces = SUMMARIES[name].extras(q, k, v, lg, True)
    _, log_rho = suffix_decay(lg)
    assert set(pieces) == set(PIECES[name])
    for h in range(H):
        seg = _segment(name, q[0, :, h].numpy(), k[0, :, h].numpy(), v[0, :, h].numpy(), np.exp(lg[0, :, h].numpy()))
        for piece, field in PIECES[name].items():
            assert rel(pieces[piece][0, h], _f64(getattr(seg, field))[0]) < 1e-12, piece
        assert abs(float(log_rho[0, h]) - np.log(seg.rho)) < 1e-12


def _stream_state(name, q, k, v, a):
    """hla_ref's streamed state after q, k, v (n, .) with factors a: a dict of float64 tensors."""
    if name == "hla2":
        _, st = hla_ref.hla2_stream(q, k, v, gamma=a, compact=True, return_state=True)
        return dict(zip(("S", "W", "z"), _f64(st.S, st.W, st.z)))
    if name == "ahla":
        _, st = hla_ref.ahla_stream(q, k, v, gamma=a, return_state=True)
        return dict(zip(("P", "E", "p", "e"), _f64(st.P, st.E, st.p, st.e)))
    _, st = hla_ref.hla3_stream(q, k, v, gamma=a, return_state=True)
    return dict(zip(("S", "P", "F", "p", "f"), _f64(st.S, st.P, st.F, st.p, st.f)))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("split", [(5, 1), (1, 7), (6, 9)])
def test_combine_continues_the_stream(name, split):
    """combine(state after A, summary of B) = the state after A then B, every field (the
    normalizer's too), with per-token gates; B's state part is B's own stream from zero."""
    nA, nB = split
    T, K, V = nA + nB, 3, 2
    q, k, v = (x[0, :, 0].numpy() for x in rand_qkv(1, T, 1, K, V, seed=nA * 7 + nB, dtype=torch.float64))
    lg = rand_gates(1, T, 1, seed=nA, dtype=torch.float64)
    a = np.exp(lg[0, :, 0].numpy())
    A = {f: x[None, None] for f, x in _stream_state(name, q[:nA], k[:nA], v[:nA], a[:nA]).items()}
    Bst = {f: x[None, None] for f, x in _stream_state(name, q[nA:], k[nA:], v[nA:], a[nA:]).items()}
    qt, kt, vt = (torch.from_numpy(x[nA:])[None, :, None] for x in (q, k, v))
    Bst.update(SUMMARIES[name].extras(qt, kt, vt, lg[:, nA:], True))
    Bst["log_rho"] = lg[:, nA:].sum(1)
    got = SUMMARIES[name].combine(A, Bst, True)
    want = _stream_state(name, q, k, v, a)
    assert set(got) == set(want)
    for f in want:
        assert rel(got[f][0, 0], want[f]) < 1e-12, f
    plain = SUMMARIES[name].combine(A, Bst, False)   # unnormalized: the state without the v -> 1 fields
    assert set(plain) == set(SUMMARIES[name].fields(False))
    for f in plain:
        assert torch.equal(plain[f], got[f]), f


def test_summary_sizes():
    """The exchanged numbers per batch row and head (the README's table)."""
    K, V = 64, 32
    assert summary_numbers("hla2", K, V, False) == K * K + 2 * K * V + 1
    assert summary_numbers("hla2", K, V, True) == K * K + 2 * K * V + 2 * K + 1
    assert summary_numbers("ahla", K, V, True) == K * K + 2 * K * V + 2 * K + 1
    assert summary_numbers("hla3", K, V, False) == 3 * K * K + 3 * K * V + 1
    assert summary_numbers("hla3", K, V, True) == 3 * K * K + 3 * K * V + 3 * K + 1


# ----------------------------------------------------------------------------------------------
# one process: the algorithm against the single call
# ----------------------------------------------------------------------------------------------

def _case_inputs(name, T, kind, normalize, init, *, B=2, H=2, K=5, V=3, seed=0, dtype=torch.float64):
    q, k, v = rand_qkv(B, T, H, K, V, seed=seed, positive=normalize, dtype=dtype)
    kw = {"gamma": 0.8} if kind == "gamma" else {}
    g = rand_gates(B, T, H, seed=seed, dtype=dtype) if kind == "g" else None
    st = None
    if init:
        State = getattr(hla_fast, STATE_NAMES[name])
        shapes = SUMMARIES[name].state_shapes(K, V, normalize)
        gen = torch.Generator().manual_seed(seed + 11)
        sd = torch.float64 if dtype == torch.float64 else torch.float32
        st = State(*(None if shapes[f] is None else
                     (0.2 * (torch.rand if normalize else torch.randn)((B, H) + shapes[f], generator=gen)).to(sd)
                     for f in SUMMARIES[name].state[1]))
    return q, k, v, g, kw, st


def _weights(o_shape, final, seed=5):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(o_shape, generator=gen, dtype=torch.float64)
    wf = [None if x is None else torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in final]
    return w, wf


def _final_loss(final, wf):
    return sum((x.double() * w).sum() for x, w in zip(final, wf) if x is not None)


def _leaf(x):
    return None if x is None else x.detach().clone().requires_grad_()


def _reference(name, q, k, v, g, kw, st, normalize, call):
    """Single call on the whole sequence: (o, final, grads) with the loss of _weights."""
    q, k, v, g = (_leaf(x) for x in (q, k, v, g))
    st = None if st is None else type(st)(*(_leaf(x) for x in st))
    o, final = getattr(hla_fast, name)(q, k, v, g=g, normalize=normalize, initial_state=st,
                                       output_final_state=True, **kw, **call)
    w, wf = _weights(o.shape, final)
    ((o.double() * w).sum() + _final_loss(final, wf)).backward()
    grads = {"q": q.grad, "k": k.grad, "v": v.grad, "g": None if g is None else g.grad}
    if st is not None:
        grads.update({f"init.{f}": x.grad for f, x in zip(st._fields, st) if x is not None})
    return o.detach(), final, grads, (w, wf)


CASES = [("g", False, True), ("gamma", True, False), ("none", False, False), ("g", True, True)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind,normalize,init", CASES)
def test_run_slices_matches_single_call(name, kind, normalize, init):
    _need(name)
    cuts = [0, 7, 8, 17, 23]          # a one-token slice; lengths not multiples of the chunk
    q, k, v, g, kw, st = _case_inputs(name, cuts[-1], kind, normalize, init, seed=len(kind) + normalize)
    call = dict(backend="torch", chunk_size=4)
    o_ref, f_ref, g_ref, (w, wf) = _reference(name, q, k, v, g, kw, st, normalize, call)
    q, k, v, g = (_leaf(x) for x in (q, k, v, g))
    st = None if st is None else type(st)(*(_leaf(x) for x in st))
    sl = lambda x: None if x is None else [x[:, a:b] for a, b in zip(cuts[:-1], cuts[1:])]  # noqa: E731
    outs, final = run_slices(name, sl(q), sl(k), sl(v), gs=sl(g), normalize=normalize, initial_state=st,
                             output_final_state=True, **kw, **call)
    o = torch.cat(outs, dim=1)
    assert rel(o, o_ref) < 1e-10
    for f, a, b in zip(final._fields, final, f_ref):
        assert (a is None) == (b is None), f
        if a is not None:
            assert a.dtype == b.dtype and rel(a, b) < 1e-10, f
    ((o.double() * w).sum() + _final_loss(final, wf)).backward()
    got = {"q": q.grad, "k": k.grad, "v": v.grad, "g": None if g is None else g.grad}
    if st is not None:
        got.update({f"init.{f}": x.grad for f, x in zip(st._fields, st) if x is not None})
    assert got.keys() == g_ref.keys()
    for n in got:
        assert (got[n] is None) == (g_ref[n] is None), n
        if got[n] is not None:
            assert rel(got[n], g_ref[n]) < 1e-10, n


def test_bad_arguments():
    q, k, v = rand_qkv(1, 4, 1, 2, 2, seed=0)
    with pytest.raises(ValueError, match="op must be one of"):
        run_slices("hla9", [q], [k], [v])
    with pytest.raises(ValueError, match="op must be one of"):
        hla_fast.context_parallel(len, q, k, v)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        hla_fast.context_parallel("hla2", q, k, v)
    with pytest.raises(ValueError, match="equally long non-empty lists"):
        run_slices("hla2", [q, q], [k], [v, v])
    with pytest.raises(ValueError, match="equally long non-empty lists"):
        run_slices("hla2", [], [], [])
    with pytest.raises(ValueError, match=r"slice 1 has \(B, H, K, V\) = \(1, 1, 2, 1\)"):
        run_slices("hla2", [q, q], [k, k], [v, v[..., :1]])
    with pytest.raises(ValueError, match=r"slice 1 is torch.float64 on cpu, slice 0 torch.float32 on cpu"):
        run_slices("hla2", [q, q.double()], [k, k.double()], [v, v.double()], backend="torch")
    with pytest.raises(ValueError, match=r"g must have shape"):
        run_slices("hla2", [q], [k], [v], gs=[torch.zeros(1, 4)])


# ----------------------------------------------------------------------------------------------
# gloo: 2 and 4 processes
# ----------------------------------------------------------------------------------------------

def _cp_case(name, rank, world, cuts, kind, normalize, init, backend, dtype, chunk, device="cpu"):
    """One case on one rank: errors (relative) of this rank's output, final state and gradients
    against the single call on the whole sequence (computed here, in float64 on the torch path on
    the CPU)."""
    q, k, v, g, kw, st = _case_inputs(name, cuts[-1], kind, normalize, init, seed=cuts[-1] + normalize)
    f64 = lambda x: None if x is None else x.double()  # noqa: E731
    st64 = None if st is None else type(st)(*(f64(x) for x in st))
    o_ref, f_ref, g_ref, (w, wf) = _reference(name, f64(q), f64(k), f64(v), f64(g), kw, st64, normalize,
                                              dict(backend="torch", chunk_size=4))
    a, b = cuts[rank], cuts[rank + 1]
    q, k, v, g = (None if x is None else _leaf(x[:, a:b].to(device, dtype)) for x in (q, k, v, g))
    mine = None
    if rank == 0 and st is not None:   # the state's own dtype: fp32 next to fp32 inputs
        sd = torch.float64 if dtype == torch.float64 else torch.float32
        mine = type(st)(*(None if x is None else _leaf(x.to(device, sd)) for x in st))
    o, final = hla_fast.context_parallel(name, q, k, v, g=g, normalize=normalize, initial_state=mine,
                                         output_final_state=True, chunk_size=chunk, backend=backend, **kw)
    errs = {"o": rel(o, o_ref[:, a:b])}
    for f, x, y in zip(final._fields, final, f_ref):
        if (x is None) != (y is None):
            errs[f"final.{f}"] = float("inf")
        elif x is not None:
            errs[f"final.{f}"] = rel(x, y)
    o.mul_(1.0)   # the output is an ordinary tensor: in-place use is allowed
    loss = (o.double() * w[:, a:b].to(device)).sum()
    if rank == world - 1:   # the final state's cotangent enters on one rank
        loss = loss + _final_loss(final, [None if x is None else x.to(device) for x in wf])
    loss.backward()
    for n, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x is not None:
            errs[f"d{n}"] = rel(x.grad, g_ref[n][:, a:b])
    if mine is not None:
        for f, x in zip(mine._fields, mine):
            if x is not None:
                errs[f"dinit.{f}"] = rel(x.grad, g_ref[f"init.{f}"])
    return errs


def _bad_calls(rank):
    """Calls that must fail on every rank (no rank left waiting in a collective): the type and
    message of the error each rank got. Disagreements raise the same error everywhere; a rank
    whose own inputs are refused (a positive gate on the last rank, a state of the wrong dtype on
    the first) raises its error and every other rank one that names it."""
    q, k, v = rand_qkv(1, 3, 1, 2, 2 + rank, seed=rank)
    v2 = v[..., :2]
    last = rank == dist_world() - 1
    g = torch.full((1, 3, 1), 0.5 if last else -0.1)
    bad_state = hla_fast.HLA2State(torch.zeros(1, 1, 2, 2, dtype=torch.float64), torch.zeros(1, 1, 2, 2))
    msgs = {}
    for case, call in {
        "V differs": lambda: hla_fast.context_parallel("hla2", q, k, v),
        "late initial_state": lambda: hla_fast.context_parallel(
            "hla2", q, k, v2,
            initial_state=None if rank == 0 else hla_fast.HLA2State(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))),
        "positive gate on the last rank": lambda: hla_fast.context_parallel("hla2", q, k, v2, g=g),
        "bad state on the first rank": lambda: hla_fast.context_parallel(
            "hla2", q, k, v2, initial_state=bad_state if rank == 0 else None),
        "eps nan": lambda: hla_fast.context_parallel("hla2", q, k, v2, normalize=True, eps=float("nan")),
    }.items():
        try:
            call()
            msgs[case] = "no error"
        except (ValueError, TypeError, RuntimeError) as err:
            msgs[case] = f"{type(err).__name__}: {err}"
    return msgs


def dist_world():
    import torch.distributed as dist
    return dist.get_world_size()


def _subgroup_case(rank, world):
    """context_parallel over a group of ranks 1 and 2 (not the default group, not starting at
    global rank 0), float64: on its members the errors of the output and gradients against one
    process; {} elsewhere. (Every rank creates the group, as torch.distributed requires.)"""
    import torch.distributed as dist
    group = dist.new_group([1, 2])
    if rank not in (1, 2):
        return {}
    q, k, v, g, kw, _ = _case_inputs("hla2", 9, "g", False, False, seed=9)
    o_ref, _, g_ref, (w, wf) = _reference("hla2", q, k, v, g, kw, None, False, dict(backend="torch", chunk_size=4))
    a, b = (0, 4) if rank == 1 else (4, 9)
    q, k, v, g = (_leaf(x[:, a:b]) for x in (q, k, v, g))
    o, final = hla_fast.context_parallel("hla2", q, k, v, g=g, group=group, output_final_state=True, chunk_size=4,
                                         backend="torch")
    loss = (o * w[:, a:b]).sum()
    if rank == 2:   # the final state's cotangent enters on one rank (_reference's loss)
        loss = loss + _final_loss(final, wf)
    loss.backward()
    errs = {"o": rel(o, o_ref[:, a:b]), "tol": 1e-10}
    errs.update({f"d{n}": rel(x.grad, g_ref[n][:, a:b]) for n, x in (("q", q), ("k", k), ("v", v), ("g", g))})
    return errs


LAYER_CASES = [("hla2", "data"), ("ahla", "fixed"), ("hla3", "none")]


def _layer(order, gate):
    """The same HigherOrderLinearAttention (weights from one seed) in every process, float64."""
    from hla_fast.layers import HigherOrderLinearAttention
    torch.manual_seed(3)
    layer = HigherOrderLinearAttention(hidden_size=8, num_heads=2, num_kv_heads=1 if order == "hla3" else None,
                                       order=order, gate=gate, chunk_size=4, backend="torch").double()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():   # a nonzero, varied output-norm scale
        layer.o_norm_weight.add_(0.3 * torch.randn(layer.o_norm_weight.shape, generator=gen, dtype=torch.float64))
    return layer, gen


def _layer_case(order, gate, rank, world, cuts):
    """The layer with ``cp_group`` on this rank's slice against the single-process layer on the
    whole sequence: errors of the output slice, the input slice's gradient and every parameter's
    gradient summed over the ranks (all_reduce)."""
    import torch.distributed as dist
    layer, gen = _layer(order, gate)
    x = torch.randn(2, cuts[-1], 8, generator=gen, dtype=torch.float64)
    w = torch.randn(2, cuts[-1], 8, generator=gen, dtype=torch.float64)
    xf = _leaf(x)
    o_ref = layer(xf)[0]
    (o_ref * w).sum().backward()
    p_ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    a, b = cuts[rank], cuts[rank + 1]
    xs = _leaf(x[:, a:b])
    o, none, cache = layer(xs, cp_group=dist.group.WORLD)
    errs = {"o": rel(o, o_ref[:, a:b].detach()), "none": float(none is not None or cache is not None)}
    (o * w[:, a:b]).sum().backward()
    errs["dx"] = rel(xs.grad, xf.grad[:, a:b])
    for n, p in layer.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        errs[f"d{n}"] = rel(grad, p_ref[n])
    return errs


def _worker(rank, world, init_file, out_dir, names, cuts, with_triton, mode="gloo"):
    """One rank. gloo: the float64 torch cases of every operator, hla2's Triton case when
    ``with_triton`` (interpreter), the failing calls. layer (gloo): the layer cases ``names`` of
    ``LAYER_CASES``. nccl: GPU ``rank``, the Triton kernels in
    fp32 for every operator."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    result = {}
    try:
        if mode == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group("gloo" if mode == "layer" else mode, init_method=f"file://{init_file}", rank=rank, world_size=world)
        if mode == "layer":
            for order, gate in names:
                result[f"{order}-{gate}"] = _layer_case(order, gate, rank, world, cuts)
        elif mode == "nccl":
            for name in names:
                extra = [("gamma", True, False)] if name == "hla2" else []
                for kind, normalize, init in [("g", False, True)] + extra:
                    result[f"{name}-{kind}-norm{int(normalize)}-init{int(init)}"] = _cp_case(
                        name, rank, world, cuts, kind, normalize, init, "triton", torch.float32, 16,
                        device=f"cuda:{rank}") | {"tol": 1e-5}
        else:
            for name in names:
                for kind, normalize, init in CASES[:3]:
                    result[f"{name}-{kind}-norm{int(normalize)}-init{int(init)}"] = _cp_case(
                        name, rank, world, cuts, kind, normalize, init, "torch", torch.float64, 4) | {"tol": 1e-10}
            if with_triton:
                result["hla2-triton-g-init"] = _cp_case(
                    "hla2", rank, world, cuts, "g", False, True, "triton", torch.float32, 16) | {"tol": 1e-5}
            result["errors"] = _bad_calls(rank)
            if world >= 3:
                result["subgroup"] = _subgroup_case(rank, world)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # reported to the parent, which fails the test with it
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


def _spawn(world, tmp_path, names, cuts, with_triton, timeout=120.0, mode="gloo"):
    """Run ``_worker`` in ``world`` spawned processes; stop any still running after ``timeout``
    seconds (then fail). Returns every rank's result."""
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path / "rendezvous"), str(tmp_path), names, cuts,
                                               with_triton, mode), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.terminate()
        for p in hung:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not hung, f"{len(hung)} of {world} ranks still running after {timeout} s (stopped)"
    out = []
    for r, p in enumerate(procs):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} exited with code {p.exitcode} and no result"
        res = json.loads(path.read_text())
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        out.append(res)
    return out


@pytest.mark.parametrize("world,cuts", [(2, [0, 6, 13]), (4, [0, 7, 8, 17, 23])], ids=["2ranks", "4ranks"])
def test_gloo_matches_single_process(world, cuts, tmp_path):
    """Spawned gloo ranks: every operator present, with gates, a constant decay and none, with
    normalization and a carried-in initial state; outputs, the final state on every rank and every
    gradient (q, k, v, g, initial state) against the single process. Two ranks also run hla2's
    Triton kernels (fp32, under the interpreter on a CPU). Mismatched ranks fail on every rank."""
    names = [n for n in NAMES if _available(n)]
    with_triton = world == 2 and not torch.cuda.is_available()   # the interpreter; on GPUs see the nccl test
    results = _spawn(world, tmp_path, names, cuts, with_triton=with_triton)
    for r, res in enumerate(results):
        msgs = res.pop("errors")
        assert msgs["V differs"].startswith("ValueError: context_parallel: the ranks disagree on V: [2.0, 3.0"), (r, msgs)
        assert "ranks [1" in msgs["late initial_state"] and "must pass None" in msgs["late initial_state"], (r, msgs)
        assert msgs["eps nan"] == "ValueError: eps must be a finite float >= 0, got nan", (r, msgs)
        for case, culprit in (("positive gate on the last rank", world - 1), ("bad state on the first rank", 0)):
            if r == culprit:   # its own error
                assert msgs[case].startswith(("ValueError: g", "TypeError: initial_state")), (r, case, msgs[case])
            else:
                assert msgs[case].startswith(f"RuntimeError: context_parallel: rank(s) [{culprit}] of the group "
                                             f"refused their inputs"), (r, case, msgs[case])
        if world >= 3:   # a group of global ranks 1 and 2 trains too
            sub = res.pop("subgroup")
            if r in (1, 2):
                _assert_close(r, {"subgroup": sub})
            else:
                assert sub == {}, (r, sub)
        assert len(res) == len(names) * 3 + with_triton, (r, sorted(res))
        _assert_close(r, res)


def _assert_close(r, res):
    """Every error of every case of rank r's result below the case's tolerance."""
    for case, errs in res.items():
        tol = errs.pop("tol")
        assert errs and "o" in errs and "dq" in errs, (r, case)
        bad = {n: e for n, e in errs.items() if not e < tol}
        assert not bad, f"rank {r} {case}: {bad} (tolerance {tol})"


def test_layer_cp_group_matches_single_process(tmp_path):
    """HigherOrderLinearAttention(...)(slice, cp_group=WORLD) on 2 gloo ranks: each rank's output
    slice, its input slice's gradient and the parameters' gradients (summed over the ranks) equal
    the single-process layer on the whole sequence (hla2 with data gates; ahla with the fixed decay
    and hla3 with grouped key/value heads, where present)."""
    cases = [c for c in LAYER_CASES if _available(c[0])]
    results = _spawn(2, tmp_path, cases, [0, 6, 13], with_triton=False, mode="layer")
    for r, res in enumerate(results):
        assert sorted(res) == sorted(f"{o}-{g}" for o, g in cases), (r, sorted(res))
        for case, errs in res.items():
            assert errs.pop("none") == 0.0, (r, case)
            assert {"o", "dx", "dq_proj.weight"} <= set(errs), (r, case, sorted(errs))
            bad = {n: e for n, e in errs.items() if not e < 1e-10}
            assert not bad, f"rank {r} {case}: {bad} (tolerance 1e-10)"


def test_layer_cp_group_refusals():
    """cp_group with a cache, use_cache or a decode step is refused before any collective."""
    from hla_fast.layers import HigherOrderLinearAttention, HLACache
    layer = HigherOrderLinearAttention(hidden_size=8, num_heads=2, layer_idx=0, backend="torch")
    x = torch.randn(1, 5, 8)
    group = object()   # never reached: the checks come first
    with pytest.raises(ValueError, match="cp_group .* use_cache"):
        layer(x, use_cache=True, cp_group=group)
    with pytest.raises(ValueError, match="cp_group .* past_key_values"):
        layer(x, past_key_values=HLACache(), cp_group=group)
    _, _, cache = layer(x, use_cache=True)
    with pytest.raises(ValueError, match="cp_group"):   # a decode step
        layer(x[:, :1], past_key_values=cache, use_cache=True, cp_group=group)
    with pytest.raises(TypeError, match="cp_group must be None or a torch.distributed process group"):
        layer(x, cp_group=True)


@pytest.mark.gpu
@pytest.mark.parametrize("world,cuts", [(2, [0, 40, 101]), (4, [0, 33, 34, 90, 150])], ids=["2gpus", "4gpus"])
def test_nccl_matches_single_process(world, cuts, tmp_path):
    """One process per GPU over NCCL, the Triton kernels in fp32 (tf32x3 products: 1e-5 against
    the float64 reference), every operator present, gates and a carried-in initial state (hla2
    also normalized with a constant decay). Generous timeout: the kernels compile in every rank."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    names = [n for n in NAMES if _available(n)]
    results = _spawn(world, tmp_path, names, cuts, with_triton=True, timeout=480.0, mode="nccl")
    for r, res in enumerate(results):
        assert len(res) == len(names) + 1, (r, sorted(res))
        _assert_close(r, res)


def test_cp_scaling_script_rehearses_on_gloo(tmp_path):
    """benchmarks/cp_scaling.py as it runs on GPUs, launched by torchrun with two ranks on gloo at
    tiny sizes: every code path up to NCCL. Its own correctness check (output and every input
    gradient of context_parallel against one process, fp32 on the torch backend: a few roundings of
    sums over 200 tokens) stays at fp32's level, and every row holds the timings, the peaks (None
    off CUDA) and the one-device baseline."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          os.path.join(root, "benchmarks", "cp_scaling.py"), "--cpu-smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    res = json.load(open(tmp_path / "cp_cpu_smoke.json"))
    assert res["meta"]["world"] == 2 and res["meta"]["check_T"] == 100
    assert sorted(res["meta"]["exactness"]) == sorted(n for n in ("hla2", "ahla", "hla3") if hasattr(hla_fast, n))
    for name, errs in res["meta"]["exactness"].items():
        assert sorted(errs) == ["dg", "dk", "dq", "dv", "o"], name
        assert all(0 <= e < 1e-5 for e in errs.values()), (name, errs)
    assert {(r["op"], r["T_per_rank"]) for r in res["rows"]} == {(n, T) for n in res["meta"]["exactness"] for T in (100, 64)}
    for r in res["rows"]:
        assert r["T_total"] == 2 * r["T_per_rank"] and r["single_fits"] is True
        assert all(r[f] > 0 for f in ("slice_fwd_ms", "cp_fwd_ms", "cp_fwdbwd_ms", "exchange_ms", "single_fwdbwd_ms"))
        assert r["cp_fwdbwd_peak_bytes"] is None and r["single_fwdbwd_peak_bytes"] is None
    md = open(tmp_path / "cp_cpu_smoke.md").read()
    assert "2 ranks" in md and "Exactness at T/rank = 100" in md and "| hla3 | 64 | 128 |" in md
