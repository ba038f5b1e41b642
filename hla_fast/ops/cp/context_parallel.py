"""Exact context parallelism over ``torch.distributed``: each rank of a process group holds one
contiguous slice of the sequence, in rank order.

Forward, on every rank ``r`` of ``R`` (``hla_fast/ops/cp/summaries.py`` defines the summaries):

    1. run the operator on the slice, from a zero state (rank 0: from ``initial_state``), asking for
       the final state; with the slice's extra pieces (torch einsums) and ``log rho`` this is the
       slice's summary, a few ``[B, H, K, .]`` tensors whose size does not depend on the slice
       length. Rank 0's summary is its state itself: the head of every fold.
    2. all-gather the summaries, flattened into one ``[B, H, n]`` buffer per rank (:class:`_AllGather`,
       autograd-aware: its backward sums every rank's cotangent for a summary back into the rank
       that made it).
    3. fold rank 0's state and the summaries of ranks ``1 .. r - 1`` in order with the operator's
       combine: the exact state after the last token of rank ``r - 1``.
    4. run the operator on the slice again from that start state (rank 0 keeps its output of step
       1, which already started from the true start state).

The final state, when asked for, is the fold of every rank's summary, returned on every rank.
Backward mirrors this through autograd: the second run's gradients flow into the start state, the
fold's into the gathered summaries, the all-gather's backward (a reduce-scatter; on gloo an
all-reduce of every rank's cotangents, of which each keeps its own) into each rank's own summary,
and the first run's into the slice's inputs.
A later rank's output reads the gathered summaries through its start state; rank 0's output is
tied to them (:class:`_Tie`, a copy whose backward sends them zeros), so every rank's backward
reaches the collective: every rank must backpropagate through its output or final state, as with
any collective in a graph.

Costs per rank: the operator runs twice on its slice (rank 0 once), plus the extra pieces (HLA2 and
AHLA one einsum pass over the slice; HLA3 a first-order linear attention over it) and ``r``
combines of ``O(K^2 V)``; one all-gather of ``R`` summaries (:func:`hla_fast.ops.cp.summaries.summary_numbers`
numbers per batch row and head, each) forward and one reduce-scatter of the same size backward.

Errors. With ``check_ranks`` (the default) each rank first checks its arguments and runs step 1,
then a small all-gather of the call's sizes and settings, and of whether the rank failed so far,
precedes the exchange: a rank whose inputs were refused raises its own error and every other rank
raises one that names it, instead of waiting inside the exchange for it.

``run_slices`` runs the same steps for all slices in one process (the exchange is a list): the
algorithm without processes, which tests use to check every operator quickly.
"""
from __future__ import annotations

import torch

from ..common.checks import check_eps, check_flag, check_gamma, check_gates, check_qkv
from ..common.gates import gates_from_gamma
from .summaries import SUMMARIES

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _spec(op):
    """The OpSummary of ``op``: a name ("hla2", "ahla", "hla3") or the operator function."""
    name = op if isinstance(op, str) else getattr(op, "__name__", None)
    if not isinstance(name, str) or name not in SUMMARIES:
        raise ValueError(f"op must be one of {sorted(SUMMARIES)} or hla_fast's function of that name, got {op!r}")
    return SUMMARIES[name]


class _AllGather(torch.autograd.Function):
    """Every rank's ``[B, H, n]`` buffer x on every rank (a tuple in group-rank order),
    differentiable: the backward gives each rank the sum over the ranks of the cotangents held for
    its own buffer, by a reduce-scatter on NCCL and elsewhere (gloo) by an all-reduce of the stacked
    cotangents of which the rank keeps its row. (The backward of
    ``torch.distributed.nn.functional.all_gather`` on gloo took group ranks for global ones and
    failed on any group but the default one.)"""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        import torch.distributed as dist
        rank = dist.get_rank(ctx.group)
        if dist.get_backend(ctx.group) in (dist.Backend.NCCL, getattr(dist.Backend, "XCCL", "xccl")):
            mine = torch.empty_like(grads[rank], memory_format=torch.contiguous_format)
            dist.reduce_scatter(mine, [x.contiguous() for x in grads], group=ctx.group)
        else:   # gloo has no reduce-scatter
            stacked = torch.stack(grads)                              # [R, B, H, n]
            dist.all_reduce(stacked, group=ctx.group)
            mine = stacked[rank]
        return mine, None


class _Tie(torch.autograd.Function):
    """A copy of o; in backward, zero cotangents for the tied tensors. Puts the all-gather on the
    first rank's backward path (its output does not otherwise depend on the gathered summaries),
    so the collective backward runs there too. A copy, not o itself: an output that aliases an
    input of a custom Function could not be modified in place afterwards."""

    @staticmethod
    def forward(ctx, o, *tied):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tied]
        return o.clone()

    @staticmethod
    def backward(ctx, do):
        return (do, *(torch.zeros(s, dtype=dt, device=dev) for s, dt, dev in ctx.shapes))


def _log_gates(q, gamma, g, dtype):
    """Per-token log-gates [B, T, H] in ``dtype``: g, log(gamma) everywhere, or zeros."""
    if g is not None:
        return g.to(dtype)
    if gamma is not None:
        return gates_from_gamma(gamma, q[..., 0]).to(dtype)
    return torch.zeros(q.shape[:-1], dtype=dtype, device=q.device)


def _first_pass(spec, fn, q, k, v, first, initial_state, kw):
    """Step 1 on one slice: (o, summary dict). On the first slice (``first``) the run starts from
    ``initial_state`` (None: zeros) and the summary is the state after it, the head of every fold
    (its extra pieces and log rho are zeros, never read); later slices start from zeros."""
    o, st = fn(q, k, v, initial_state=initial_state if first else None, output_final_state=True, **kw)
    normalize = kw["normalize"]
    B, _, H, K = q.shape
    V = v.shape[-1]
    summary = {f: getattr(st, f) for f in spec.fields(normalize)}
    sd = summary[spec.state[1][0]].dtype
    if first:
        for name, shape in spec.extra_shapes(K, V, normalize).items():
            summary[name] = q.new_zeros((B, H) + shape, dtype=sd)
        summary["log_rho"] = q.new_zeros(B, H, dtype=sd)
        return o, summary
    lg = _log_gates(q, kw["gamma"], kw["g"], sd)
    summary.update(spec.extras(q.to(sd), k.to(sd), v.to(sd), lg, normalize))
    summary["log_rho"] = lg.sum(1)
    return o, summary


def _layout(spec, K, V, normalize):
    """[(name, trailing shape)] of a flattened summary, in buffer order."""
    shapes = {f: s for f, s in spec.state_shapes(K, V, normalize).items() if s is not None}
    shapes.update(spec.extra_shapes(K, V, normalize))
    shapes["log_rho"] = ()
    return list(shapes.items())


def _flatten(summary, layout):
    B, H = summary["log_rho"].shape
    return torch.cat([summary[name].reshape(B, H, -1) for name, _ in layout], dim=-1)


def _unflatten(flat, layout):
    B, H = flat.shape[:2]
    sizes = [int(torch.Size(s).numel()) for _, s in layout]
    parts = torch.split(flat, sizes, dim=-1)
    return {name: p.reshape((B, H) + tuple(s)) for (name, s), p in zip(layout, parts)}


def _fold(spec, entries, upto, normalize):
    """The state after slices 0 .. upto - 1: entries[0] as the head, then combines in order."""
    state = {f: entries[0][f] for f in spec.fields(normalize)}
    for s in range(1, upto):
        state = spec.combine(state, entries[s], normalize)
    return state


def _state(spec, State, state, normalize):
    return State(*(state[f] if f in state else None for f in spec.state[1]))


def _check_local(q, k, v, gamma, g, normalize, eps, output_final_state):
    """The arguments one slice's call checks before any exchange; returns (gamma, g, eps)."""
    check_qkv(q, k, v, seq=True)
    gamma = check_gamma(gamma)
    g = check_gates(g, gamma, q, seq=True)
    check_flag(normalize, "normalize")
    eps = check_eps(eps)
    check_flag(output_final_state, "output_final_state")
    return gamma, g, eps


def context_parallel(op, q, k, v, *, group=None, gamma=None, g=None, normalize=False, eps=1e-6,
                     initial_state=None, output_final_state=False, chunk_size=None, backend=None,
                     config=None, check_ranks=True):
    """Run ``op`` ("hla2", "ahla", "hla3" or the function) on a sequence split over the ranks of
    ``group`` (None: the default group): rank r holds tokens of slice r, in rank order.

    Args:
        q, k: [B, T_r, H, K]; v: [B, T_r, H, V]; g: None or [B, T_r, H]: this rank's slice (T_r
            may differ between ranks; B, H, K, V, dtype and the other arguments may not).
        gamma, normalize, eps, chunk_size, backend, config: as for the operator, the same on
            every rank.
        initial_state: the state before the whole sequence (the operator's state tuple, or
            None), given on the group's first rank only: other ranks must pass None. Its gradient
            (on the first rank) is the whole gradient.
        output_final_state: also return the state after the last token of the last rank, on every
            rank. Cotangents given to it on several ranks add up (as the per-rank losses do).
        check_ranks: first all-gather a small tensor of the call's sizes and settings and raise on
            every rank if they differ (a mismatch would otherwise fail or hang inside the
            exchange). One more small collective and a host synchronization per call. Must be the
            same on every rank.

    Returns:
        (o [B, T_r, H, V], the global final state or None). Equal to the single-process call on
        the concatenated slices, forward and backward, to the precision's tolerance.
    """
    import torch.distributed as dist

    spec = _spec(op)
    fn, State = spec.resolve()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context_parallel needs torch.distributed initialized (init_process_group) first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("context_parallel: this process is not a member of group (run the call on the group's "
                         "ranks only)")
    check_flag(check_ranks, "check_ranks")
    late_init = rank != 0 and initial_state is not None
    failure = None
    try:   # this rank's checks and first pass; with check_ranks a failure is reported to every rank below
        gamma, g, eps = _check_local(q, k, v, gamma, g, normalize, eps, output_final_state)
        if late_init and not check_ranks:
            raise ValueError(
                f"initial_state is read on the group's first rank only; rank {rank} of the group must pass None")
        kw = dict(gamma=gamma, g=g, normalize=normalize, eps=eps, chunk_size=chunk_size, backend=backend,
                  config=config)
        layout = _layout(spec, q.shape[-1], v.shape[-1], normalize)
        o, summary = _first_pass(spec, fn, q, k, v, rank == 0, initial_state, kw)
    except Exception as exc:
        if not check_ranks:
            raise
        failure = exc
    if check_ranks:  # raises on every rank alike, so no rank is left waiting in the exchange
        _check_ranks(dist, group, world, rank, failure, q, v, gamma, g, normalize, eps, chunk_size, late_init)
    gathered = _AllGather.apply(_flatten(summary, layout), group)
    entries = [_unflatten(x, layout) for x in gathered]
    if rank > 0:  # the start state reads the gathered summaries: the exchange is on this backward path
        start = _state(spec, State, _fold(spec, entries, rank, normalize), normalize)
        o, _ = fn(q, k, v, initial_state=start, output_final_state=False, **kw)
    else:
        o = _Tie.apply(o, *gathered)
    final = _state(spec, State, _fold(spec, entries, world, normalize), normalize) if output_final_state else None
    return o, final


def _check_ranks(dist, group, world, rank, failure, q, v, gamma, g, normalize, eps, chunk_size, late_init):
    """Raise on every rank if a rank failed its checks or first pass (that rank: its own error; the
    others: one naming it), if the ranks' sizes or settings differ, or if a rank after the first
    passed an initial_state (the same error on every rank)."""
    names = ["B", "H", "K", "V", "dtype", "normalize", "gamma", "g given", "eps", "chunk_size"]
    if isinstance(q, torch.Tensor):
        device = q.device
    else:   # a collective's buffer lives where its backend reads: NCCL's on the current GPU
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    if failure is None:
        B, _, H, K = q.shape
        meta = [B, H, K, v.shape[-1], _DTYPES.index(q.dtype), float(normalize), -1.0 if gamma is None else gamma,
                float(g is not None), eps, float(chunk_size) if isinstance(chunk_size, int) else -1.0]
    else:
        meta = [0.0] * len(names)
    meta = torch.tensor(meta + [float(late_init), float(failure is not None)], dtype=torch.float64, device=device)
    out = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(out, meta, group=group)
    table = torch.stack(out).cpu()
    failed = [r for r in range(world) if table[r, -1] != 0]
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(f"context_parallel: rank(s) {failed} of the group refused their inputs or failed before "
                           f"the exchange (their own errors say why); rank {rank} stops with them")
    for i, name in enumerate(names):
        col = table[:, i]
        if not bool((col == col[0]).all()):
            raise ValueError(f"context_parallel: the ranks disagree on {name}: {col.tolist()} (rank order)")
    late = [r for r in range(world) if table[r, -2] != 0]
    if late:
        raise ValueError(f"initial_state is read on the group's first rank only; ranks {late} of the group "
                         "must pass None")


def run_slices(op, qs, ks, vs, *, gs=None, gamma=None, normalize=False, eps=1e-6, initial_state=None,
               output_final_state=False, chunk_size=None, backend=None, config=None):
    """The context-parallel algorithm in one process: ``qs, ks, vs`` (and ``gs``) are lists of the
    slices [B, T_r, H, .] in order; the exchange is a list. Returns (list of outputs, final state or
    None). Differentiable like :func:`context_parallel` (same first pass, flattening, fold and
    second pass)."""
    spec = _spec(op)
    fn, State = spec.resolve()
    R = len(qs)
    gs = [None] * R if gs is None else gs
    if R == 0 or not len(ks) == len(vs) == len(gs) == R:
        raise ValueError(f"qs, ks, vs (and gs) must be equally long non-empty lists of slices, got "
                         f"{len(qs)}, {len(ks)}, {len(vs)}, {len(gs)}")
    outs, flats = [], []
    for r in range(R):
        gamma_r, g_r, eps = _check_local(qs[r], ks[r], vs[r], gamma, gs[r], normalize, eps, output_final_state)
        dims = (qs[r].shape[0], qs[r].shape[2], qs[r].shape[3], vs[r].shape[3])
        if r == 0:
            B, H, K, V = dims
            layout = _layout(spec, K, V, normalize)
        elif dims != (B, H, K, V):
            raise ValueError(f"slice {r} has (B, H, K, V) = {dims}, slice 0 has {(B, H, K, V)}: only T may differ")
        elif (qs[r].dtype, qs[r].device) != (qs[0].dtype, qs[0].device):
            raise ValueError(f"slice {r} is {qs[r].dtype} on {qs[r].device}, slice 0 {qs[0].dtype} on "
                             f"{qs[0].device}: every slice takes one dtype and device")
        kw = dict(gamma=gamma_r, g=g_r, normalize=normalize, eps=eps, chunk_size=chunk_size, backend=backend,
                  config=config)
        o, summary = _first_pass(spec, fn, qs[r], ks[r], vs[r], r == 0, initial_state, kw)
        outs.append((o, kw))
        flats.append(_flatten(summary, layout))
    entries = [_unflatten(x, layout) for x in flats]
    result = []
    for r, (o, kw) in enumerate(outs):
        if r > 0:
            start = _state(spec, State, _fold(spec, entries, r, normalize), normalize)
            o, _ = fn(qs[r], ks[r], vs[r], initial_state=start, output_final_state=False, **kw)
        result.append(o)
    final = _state(spec, State, _fold(spec, entries, R, normalize), normalize) if output_final_state else None
    return result, final
