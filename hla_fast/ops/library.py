"""The HLA operators as ``torch.library`` custom ops, so ``torch.compile`` sees them as single nodes.

``torch.compile`` cannot trace into a Triton launch or into a ``torch.autograd.Function`` that calls
one without breaking the graph. Registered as custom ops with fake (meta) implementations, the
operators become opaque nodes whose output shapes the compiler knows, and a model built from
:class:`hla_fast.layers.HigherOrderLinearAttention` compiles into one graph.

Ops (namespace ``hla``), for every order in ``ORDERS`` ("hla2", "ahla", "hla3"):

    hla::<order>_chunk(q, k, v, g, initial_state, gamma, normalize, eps, output_final_state,
                       chunk_size, backend) -> [o, *final_state]
        The chunked call ``hla_fast.<order>``. ``g``: log-gates [B, T, H] or None;
        ``initial_state``: the state's used fields as a list (empty for a zero state);
        ``backend``: None, "triton" or "torch". Returns o [B, T, H, V] and, when
        ``output_final_state``, the final state's used fields in the state's field order
        (the normalization fields only when ``normalize``).
    hla::<order>_chunk_backward(q, k, v, g, initial_state, grads, ...) -> [dq, dk, dv, (dg), *dstate]
        The gradient of the chunked call (see "Backward" below).
    hla::<order>_step(q, k, v, g, state, gamma, normalize, eps, backend) -> [o, *state]
        One decode step ``hla_fast.<order>_step`` (forward only: no autograd formula is
        registered; traced while autograd records, the layer runs a one-token call through
        ``<order>_chunk`` instead, which gives the same output and state).

State layouts (fp32; float64 on the float64 torch path), per batch and head, K the key width and
V the value width:

    hla2: S [K, K], W [K, V], z [K]                         (z only when normalizing)
    ahla: P [K, V], E [K, V], p [K], e [K]                  (p, e only when normalizing)
    hla3: S [K, K], P [K, V], F [K, V], p [K], f [K]        (p, f only when normalizing)

Backward. The public operators differentiate themselves (the Triton path through its own
autograd Function with backward kernels, the torch path through autograd), but a custom op must
say how to differentiate it in terms of other ops. The backward op therefore re-runs the public
operator on detached copies of the inputs with autograd recording (``_autograd_recording``) and
asks ``torch.autograd.grad`` for the input gradients. Cost: the operator's forward runs twice per
training step (once for the output, once inside the backward), so a compiled training step pays
one extra forward of the operator over eager. The compiled forward keeps only the op's inputs for
the backward; the operator's own saved tensors exist only while the backward op runs.

The operators are looked up by name on first use (``getattr(hla_fast, order)``), so this module
imports, and registers every op, even when an operator is not part of the installation; calling
such an op raises a clear error.
"""
from typing import List, Optional

import torch
from torch import Tensor

ORDERS = ("hla2", "ahla", "hla3")
STATE_CLASS = {"hla2": "HLA2State", "ahla": "AHLAState", "hla3": "HLA3State"}
# field -> layout ("KK": [B, H, K, K], "KV": [B, H, K, V], "K": [B, H, K]); lower-case fields are
# the normalization states, present only when normalizing
STATE_LAYOUT = {
    "hla2": (("S", "KK"), ("W", "KV"), ("z", "K")),
    "ahla": (("P", "KV"), ("E", "KV"), ("p", "K"), ("e", "K")),
    "hla3": (("S", "KK"), ("P", "KV"), ("F", "KV"), ("p", "K"), ("f", "K")),
}


def check_order(order) -> str:
    """One of ORDERS."""
    if not isinstance(order, str) or order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return order


def resolve(order: str):
    """(op, op_step, State) of ``hla_fast`` for ``order``, looked up by name on each call."""
    import hla_fast

    check_order(order)
    names = (order, order + "_step", STATE_CLASS[order])
    try:
        return tuple(getattr(hla_fast, n) for n in names)
    except AttributeError:
        raise NotImplementedError(
            f"order {order!r} needs hla_fast.{names[0]}, hla_fast.{names[1]} and hla_fast.{names[2]}, "
            "which this installation of hla_fast does not provide") from None


def state_fields(order: str, normalize: bool):
    """The state fields a call uses, in field order: ((name, layout), ...)."""
    return tuple((f, lay) for f, lay in STATE_LAYOUT[order] if normalize or f[0].isupper())


def state_shapes(order: str, B: int, H: int, K: int, V: int, normalize: bool):
    """Shapes of the used state fields, in field order."""
    dims = {"KK": (B, H, K, K), "KV": (B, H, K, V), "K": (B, H, K)}
    return [dims[lay] for _, lay in state_fields(order, normalize)]


def pack_state(order: str, state, normalize: bool) -> List[Tensor]:
    """A state NamedTuple (or None) -> the list of its used fields (empty for None)."""
    if state is None:
        return []
    names = [f for f, _ in STATE_LAYOUT[order]]
    if not isinstance(state, tuple) or len(state) != len(names):
        raise TypeError(f"state must be a {STATE_CLASS[order]}{tuple(names)}, got {type(state).__name__}")
    used = {f for f, _ in state_fields(order, normalize)}
    out = []
    for name, x in zip(names, state):
        if name in used:
            if not isinstance(x, Tensor):
                raise TypeError(f"state.{name} must be a torch.Tensor (pass a state made with "
                                f"normalize={normalize}), got {type(x).__name__}")
            out.append(x)
    return out


def unpack_state(order: str, parts, normalize: bool):
    """The list of used fields -> the state NamedTuple (unused fields None); [] -> None."""
    if len(parts) == 0:
        return None
    _, _, State = resolve(order)
    used = [f for f, _ in state_fields(order, normalize)]
    if len(parts) != len(used):
        raise ValueError(f"{order} state needs {len(used)} tensors {used}, got {len(parts)}")
    vals = dict(zip(used, parts))
    return State(**{f: vals.get(f) for f, _ in STATE_LAYOUT[order]})


def _fresh(outs, ins):
    """Outputs of a custom op may not share memory with its inputs or with each other, and must
    have the strides of the fake implementation (contiguous): clone the ones that are views or
    share memory (a state field may be a view of one buffer holding several fields)."""
    seen = {x.untyped_storage().data_ptr() for x in ins if isinstance(x, Tensor) and x.numel()}
    res = []
    for x in outs:
        if x.numel():
            if x.untyped_storage().data_ptr() in seen or x._base is not None or not x.is_contiguous():
                x = x.clone(memory_format=torch.contiguous_format)
            seen.add(x.untyped_storage().data_ptr())
        res.append(x)
    return res


def _autograd_recording():
    """A context in which autograd records again, inside a custom op's implementation.

    A custom op's implementation runs below the autograd dispatch level: the dispatcher has
    taken the autograd keys out of the thread's dispatch key set, so ``torch.enable_grad()`` alone
    records nothing there. This context restores those keys (keeping everything else the
    dispatcher set, autocast stays off) and enables gradients, for the recomputation of the
    backward op."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(C.DispatchKey, key))
    guard = C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)

    class _Both:
        def __enter__(self):
            guard.__enter__()
            self.grad = torch.enable_grad()
            self.grad.__enter__()

        def __exit__(self, *exc):
            self.grad.__exit__(*exc)
            guard.__exit__(*exc)
            return False

    return _Both()


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _define(order: str):
    """Register hla::<order>_chunk, its backward and hla::<order>_step."""

    def run(q, k, v, g, initial_state, gamma, normalize, eps, output_final_state, chunk_size, backend):
        op, _, _ = resolve(order)
        o, st = op(q, k, v, gamma=gamma, g=g, normalize=normalize, eps=eps,
                   initial_state=unpack_state(order, initial_state, normalize),
                   output_final_state=output_final_state, chunk_size=chunk_size, backend=backend)
        return [o] + (pack_state(order, st, normalize) if output_final_state else [])

    @torch.library.custom_op(f"hla::{order}_chunk", mutates_args=())
    def chunk(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], initial_state: List[Tensor],
              gamma: Optional[float], normalize: bool, eps: float, output_final_state: bool,
              chunk_size: Optional[int], backend: Optional[str]) -> List[Tensor]:
        outs = run(q, k, v, g, initial_state, gamma, normalize, eps, output_final_state, chunk_size, backend)
        return _fresh(outs, [q, k, v, g, *initial_state])

    @chunk.register_fake
    def _(q, k, v, g, initial_state, gamma, normalize, eps, output_final_state, chunk_size, backend):
        B, T, H, K = q.shape
        V = v.shape[-1]
        o = v.new_empty(B, T, H, V)
        if not output_final_state:
            return [o]
        sd = _state_dtype(q)
        return [o] + [q.new_empty(s, dtype=sd) for s in state_shapes(order, B, H, K, V, normalize)]

    @torch.library.custom_op(f"hla::{order}_chunk_backward", mutates_args=())
    def chunk_backward(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], initial_state: List[Tensor],
                       grads: List[Tensor], gamma: Optional[float], normalize: bool, eps: float,
                       output_final_state: bool, chunk_size: Optional[int], backend: Optional[str]) -> List[Tensor]:
        # recompute the forward with autograd recording, then differentiate it (module docstring)
        ins = [q, k, v] + ([g] if g is not None else []) + list(initial_state)
        leaves = [x.detach().requires_grad_(True) for x in ins]
        lq, lk, lv = leaves[:3]
        lg = leaves[3] if g is not None else None
        lst = leaves[3 + (g is not None):]
        with _autograd_recording():
            outs = run(lq, lk, lv, lg, lst, gamma, normalize, eps, output_final_state, chunk_size, backend)
            pairs = [(y, dy) for y, dy in zip(outs, grads) if y.requires_grad]
            got = torch.autograd.grad([y for y, _ in pairs], leaves, [dy for _, dy in pairs], allow_unused=True)
        res = [torch.zeros_like(x) if d is None else d.to(x.dtype) for x, d in zip(leaves, got)]
        return _fresh(res, ins + list(grads))

    @chunk_backward.register_fake
    def _(q, k, v, g, initial_state, grads, gamma, normalize, eps, output_final_state, chunk_size, backend):
        ins = [q, k, v] + ([g] if g is not None else []) + list(initial_state)
        return [x.new_empty(x.shape) for x in ins]   # contiguous, as the real op's (``_fresh``)

    def setup_context(ctx, inputs, output):
        q, k, v, g, initial_state, gamma, normalize, eps, output_final_state, chunk_size, backend = inputs
        ctx.save_for_backward(q, k, v, *([g] if g is not None else []), *initial_state)
        ctx.has_g = g is not None
        ctx.n_state = len(initial_state)
        ctx.args = (gamma, normalize, eps, output_final_state, chunk_size, backend)
        ctx.out_meta = [(y.shape, y.dtype) for y in output]

    def backward(ctx, grads):
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        g = saved[3] if ctx.has_g else None
        st = list(saved[3 + ctx.has_g:])
        # an output that received no gradient contributes zeros
        grads = [torch.zeros(s, dtype=d, device=q.device) if dy is None else dy
                 for dy, (s, d) in zip(grads, ctx.out_meta)]
        res = chunk_backward(q, k, v, g, st, grads, *ctx.args)
        dg = res[3] if ctx.has_g else None
        dst = list(res[3 + ctx.has_g:])
        return res[0], res[1], res[2], dg, dst, None, None, None, None, None, None

    chunk.register_autograd(backward, setup_context=setup_context)

    @torch.library.custom_op(f"hla::{order}_step", mutates_args=())
    def step(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], state: List[Tensor],
             gamma: Optional[float], normalize: bool, eps: float, backend: Optional[str]) -> List[Tensor]:
        _, op_step, _ = resolve(order)
        o, st = op_step(q, k, v, unpack_state(order, state, normalize), gamma=gamma, g=g,
                        normalize=normalize, eps=eps, backend=backend)
        return _fresh([o] + pack_state(order, st, normalize), [q, k, v, g, *state])

    @step.register_fake
    def _(q, k, v, g, state, gamma, normalize, eps, backend):
        B, H, K = q.shape
        V = v.shape[-1]
        sd = _state_dtype(q)
        return [v.new_empty(B, H, V)] + [q.new_empty(s, dtype=sd) for s in state_shapes(order, B, H, K, V, normalize)]

    return chunk, chunk_backward, step


OPS = {order: _define(order) for order in ORDERS}


def chunk_op(order: str):
    """The registered hla::<order>_chunk op (a ``torch.library`` custom op)."""
    return OPS[check_order(order)][0]


def step_op(order: str):
    """The registered hla::<order>_step op."""
    return OPS[check_order(order)][2]


def chunked(order, q, k, v, *, gamma=None, g=None, normalize=False, eps=1e-6, initial_state=None,
            output_final_state=False, chunk_size=None, backend=None):
    """``hla_fast.<order>`` through its custom op: same arguments and returns (o, state or None).

    Eager callers gain nothing from the op (its backward recomputes the forward); the layer uses
    it only while ``torch.compile`` traces."""
    outs = chunk_op(order)(q, k, v, g, pack_state(order, initial_state, normalize), gamma, normalize,
                           float(eps), output_final_state, chunk_size, backend)
    return outs[0], (unpack_state(order, outs[1:], normalize) if output_final_state else None)


def stepped(order, q, k, v, state=None, *, gamma=None, g=None, normalize=False, eps=1e-6, backend=None):
    """``hla_fast.<order>_step`` through its custom op: returns (o, new state)."""
    outs = step_op(order)(q, k, v, g, pack_state(order, state, normalize), gamma, normalize, float(eps), backend)
    return outs[0], unpack_state(order, outs[1:], normalize)
