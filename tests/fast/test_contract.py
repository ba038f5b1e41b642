"""The operator contract: every hla_fast operator joins by adding itself to helpers.OPERATORS.

For each member, on the Triton kernels (under TRITON_INTERPRET=1 on a CPU, compiled on CUDA) and
on the torch backend: outputs and final state against the index sums (tests/ref/brute.py),
hla_ref and the float64 torch path; every gradient (q, k, v, the log-gates g and the initial
state, with cotangents on the final state too) against float64 autograd of the torch path; state
carry-over and decode steps continuing a chunked prefill; the bad-input errors; and the faults
found by using the ops as a user would. Kernel outputs are poisoned with NaN before each run.
"""
import pytest

from .helpers import OPERATORS, decay_kwargs, rand_qkv, rand_state, rel, torch

OPS = pytest.mark.parametrize("op", OPERATORS, ids=lambda o: o.name)
KINDS = ["none", "gamma", "g"]
# (B, T, H, K, V, chunk): one token, odd T, K != V, T below / equal to / above a chunk
SHAPES = [(1, 1, 1, 16, 16, 16), (2, 37, 2, 20, 12, 16), (1, 45, 3, 7, 24, 16), (1, 64, 1, 32, 16, 32)]
# fp32 kernels against float64: the products are fp32 (ieee on the interpreter, tf32x3 on a GPU)
TOL = 1e-5


def _f64(kw):
    return {a: (b.double().cpu() if torch.is_tensor(b) else b) for a, b in kw.items()}


def _state64(st):
    return None if st is None else type(st)(*(None if x is None else x.double().cpu() for x in st))


@OPS
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalize", [False, True])
def test_forward_matches_definitions(op, shape, kind, normalize, device, poison):
    B, T, H, K, V, C = shape
    q, k, v = rand_qkv(B, T, H, K, V, seed=T + K, positive=normalize, device=device)
    dk = decay_kwargs(kind, B, T, H, seed=T, device=device)
    brute = op.brute(q, k, v, normalize=normalize, **dk)
    o, st = op.op(q, k, v, normalize=normalize, chunk_size=C, backend="triton", output_final_state=True, **dk)
    assert o.shape == v.shape and o.dtype == v.dtype
    assert rel(o, brute) < TOL
    assert rel(o, op.ref(q, k, v, normalize=normalize, **dk)) < TOL
    # the torch path in float64 is exact to rounding: it is the reference of the gradient checks
    o64, st64 = op.op(q.double().cpu(), k.double().cpu(), v.double().cpu(), normalize=normalize, backend="torch",
                      output_final_state=True, **_f64(dk))
    assert rel(o64, brute) < 1e-10
    for field, a, b in zip(st._fields, st, st64):
        assert (a is None) == (b is None) == (field in op.norm_fields and not normalize), field
        if a is not None:
            assert a.dtype == torch.float32 and rel(a, b) < TOL, field


def _loss_grads(op, q, k, v, st0, dk, normalize, dtype, dev, backend, weights, C=16):
    """Gradients of a random linear function of o and the final state w.r.t. every input."""
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.detach().to(dev, dtype).requires_grad_() for x in (q, k, v)]
    kw = {}
    if "g" in dk:
        kw["g"] = dk["g"].detach().to(dev, sd).requires_grad_()
    elif "gamma" in dk:
        kw["gamma"] = dk["gamma"]
    st = None
    if st0 is not None:
        st = type(st0)(*(None if x is None else x.detach().to(dev, sd).requires_grad_() for x in st0))
    o, fin = op.op(*leaves, normalize=normalize, initial_state=st, output_final_state=True, chunk_size=C,
                   backend=backend, **kw)
    loss = 0.0 if weights[0] is None else (o.double() * weights[0].to(dev)).sum()
    for x, w in zip(fin, weights[1:]):
        if x is not None and w is not None:   # a None weight leaves that output out of the loss
            loss = loss + (x.double() * w.to(dev)).sum()
    loss.backward()
    grads = {"dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if "g" in kw:
        grads["dg"] = kw["g"].grad
    if st is not None:
        for field, x in zip(st._fields, st):
            if x is not None:
                grads["d" + field + "0"] = x.grad
    return o, fin, grads


@OPS
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("init", [False, True])
def test_gradients_match_float64(op, kind, normalize, init, device, poison):
    B, T, H, K, V = 1, 37, 2, 12, 20
    q, k, v = rand_qkv(B, T, H, K, V, seed=14, positive=normalize)
    dk = decay_kwargs(kind, B, T, H, seed=15)
    st0 = rand_state(op, B, H, K, V, normalize, seed=16) if init else None
    _assert_matches_float64(op, q, k, v, st0, dk, normalize, device, "triton", seed=17)


def _assert_matches_float64(op, q, k, v, st0, dk, normalize, device, backend, seed):
    """Outputs, final states and every gradient of a random linear loss (on o and on each final state
    field) of an fp32 call on ``backend`` against the float64 torch path."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    shapes = op.state_shapes(B, H, K, V, normalize)
    weights = [torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)]
    weights += [None if s is None else torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes.values()]
    o, fin, got = _loss_grads(op, q, k, v, st0, dk, normalize, torch.float32, device, backend, weights)
    o64, fin64, want = _loss_grads(op, q, k, v, st0, dk, normalize, torch.float64, "cpu", "torch", weights)
    assert set(got) == set(want)
    assert rel(o, o64) < TOL
    for a, b in zip(fin, fin64):
        if b is not None:
            assert rel(a, b) < TOL
    for name in want:
        # dg is a reverse cumulative sum of differences of fp32 products: a few times fp32's rounding
        assert rel(got[name], want[name]) < (1e-4 if name == "dg" else TOL), name


@OPS
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("normalize", [False, True])
def test_gates_closing_hard_keep_fp32_precision(op, backend, normalize, device, poison):
    """Log-gates of -1e4 and -1e9 (factors that underflow to 0) inside chunks of 16. Every later
    decay of such a chunk is a difference of two sums near -1e4 or -1e9, which fp32 holds to 1e-3
    or not at all; the fp32 paths floor each gate at GATE_FLOOR (hla_fast/ops/common/gates.py, "The
    gate floor"), so outputs, final states and every gradient keep fp32's precision against the
    float64 torch path, which takes the gates as they are (and is itself exact to ~3e-7 at -1e9)."""
    B, T, H, K, V = 1, 45, 2, 12, 20
    q, k, v = rand_qkv(B, T, H, K, V, seed=41, positive=normalize)
    g = decay_kwargs("g", B, T, H, seed=42)["g"]
    g[0, 5, 0] = -1e4      # early in chunk 0, one head
    g[0, 20, :] = -1e9     # chunk 1, both heads
    g[0, 38, 1] = -1e4     # chunk 2, and the last chunk is partial
    st0 = rand_state(op, B, H, K, V, normalize, seed=43)
    _assert_matches_float64(op, q, k, v, st0, {"g": g}, normalize, device, backend, seed=44)


@OPS
@pytest.mark.parametrize("normalize", [False, True])
def test_float64_path_keeps_its_digits_after_any_gate(op, normalize):
    """Log-gates of -1e16 and -1e300 (finite, accepted) inside chunks of the float64 torch path: the
    decays after such a gate are differences of sums near the gate, which float64 holds to 1e-16 of
    their size only; floored at -50 (hla_fast/ops/common/gates.py, "The gate floor") the outputs and
    final state equal the decode steps', which multiply by exp(g) (0 here) and take no difference."""
    B, T, H, K, V = 1, 23, 2, 5, 4
    q, k, v = (x.double() for x in rand_qkv(B, T, H, K, V, seed=61, positive=normalize))
    g = decay_kwargs("g", B, T, H, seed=62)["g"].double()
    g[0, 3, 0] = -1e16
    g[0, 13, :] = -1e300
    o, fin = op.op(q, k, v, g=g, normalize=normalize, chunk_size=8, backend="torch", output_final_state=True)
    st, steps = None, []
    for t in range(T):
        ot, st = op.step(q[:, t], k[:, t], v[:, t], st, g=g[:, t], normalize=normalize, backend="torch")
        steps.append(ot)
    assert rel(o, torch.stack(steps, 1)) < 1e-12
    for field, a, b in zip(fin._fields, fin, st):
        if b is not None:
            assert rel(a, b) < 1e-12, field


@OPS
@pytest.mark.parametrize("used", ["o", "state"])
def test_gradients_of_a_loss_on_part_of_the_outputs(op, used, device, poison):
    """A loss on the outputs alone or on the final state alone: the outputs left out of it get no
    cotangent (None, not zeros) in the backward, which must still give every gradient."""
    B, T, H, K, V = 1, 29, 2, 12, 20
    q, k, v = rand_qkv(B, T, H, K, V, seed=24)
    dk = decay_kwargs("g", B, T, H, seed=25)
    st0 = rand_state(op, B, H, K, V, False, seed=26)
    gen = torch.Generator().manual_seed(27)
    shapes = op.state_shapes(B, H, K, V, False)
    weights = [torch.randn(B, T, H, V, generator=gen, dtype=torch.float64) if used == "o" else None]
    weights += [None if (s is None or used == "o") else torch.randn(s, generator=gen, dtype=torch.float64)
                for s in shapes.values()]
    _, _, got = _loss_grads(op, q, k, v, st0, dk, False, torch.float32, device, "triton", weights)
    _, _, want = _loss_grads(op, q, k, v, st0, dk, False, torch.float64, "cpu", "torch", weights)
    assert set(got) == set(want)
    for name in want:
        assert rel(got[name], want[name]) < (1e-4 if name == "dg" else TOL), name


@OPS
@pytest.mark.parametrize("gates", ["none", "g_fixed", "g_learned"])
@pytest.mark.parametrize("normalize", [False, True])
def test_forward_keeps_the_final_state_only_for_the_gates(op, gates, normalize, device):
    """The backward reads the final state back only for the log-gates' gradient (the state's own
    factor e^{b_T}), so a forward whose gates do not require grad keeps none of it: at K = V = 128
    that is 8 MB of fp32 state per (batch, head) group held through the backward for nothing."""
    B, T, H, K, V = 1, 21, 2, 12, 10
    q, k, v = (x.to(device).requires_grad_() for x in rand_qkv(B, T, H, K, V, seed=31, positive=normalize))
    kw = {}
    if gates != "none":
        kw["g"] = decay_kwargs("g", B, T, H, seed=32, device=device)["g"].requires_grad_(gates == "g_learned")
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, st = op.op(q, k, v, normalize=normalize, chunk_size=16, backend="triton", output_final_state=True, **kw)
    final = {x.untyped_storage().data_ptr() for x in st if x is not None}
    kept = final & set(saved)
    if gates == "g_learned":
        assert kept == final
    else:
        assert not kept
    # and the backward still runs on what was kept
    (o.double().sum() + sum(x.double().sum() for x in st if x is not None)).backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@OPS
@pytest.mark.parametrize("kind", KINDS)
def test_torch_path_gradients_are_the_definitions(op, kind):
    """The float64 torch path (the reference above) against autograd through the index sums."""
    B, T, H, K, V = 1, 13, 2, 5, 3
    q, k, v = rand_qkv(B, T, H, K, V, seed=18, dtype=torch.float64)
    dk = _f64(decay_kwargs(kind, B, T, H, seed=19))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([dk["g"].clone().requires_grad_()] if "g" in dk else [])
    kw = {"gamma": dk["gamma"]} if "gamma" in dk else ({"g": leaves[3]} if "g" in dk else {})
    w = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(20))
    a = torch.autograd.grad((op.op(*leaves[:3], backend="torch", chunk_size=4, **kw)[0] * w).sum(), leaves)
    b = torch.autograd.grad((op.naive(*leaves[:3], **kw) * w).sum(), leaves)
    for x, y in zip(a, b):
        assert rel(x, y) < 1e-10


@OPS
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_carry_over_and_decode_after_prefill(op, kind, normalize, backend, device, poison):
    B, T, H, K, V = 2, 40, 2, 16, 12
    q, k, v = rand_qkv(B, T, H, K, V, seed=21, positive=normalize, device=device)
    dk = decay_kwargs(kind, B, T, H, seed=22, device=device)

    def part(a, b):
        return {n: (x[:, a:b] if torch.is_tensor(x) else x) for n, x in dk.items()}

    want = op.ref(q, k, v, normalize=normalize, **dk)
    kw = dict(normalize=normalize, chunk_size=16, backend=backend, output_final_state=True)
    o1, st = op.op(q[:, :21], k[:, :21], v[:, :21], **kw, **part(0, 21))
    o2, st = op.op(q[:, 21:37], k[:, 21:37], v[:, 21:37], initial_state=st, **kw, **part(21, 37))
    outs = [o1, o2]
    for t in range(37, T):  # decode continues the chunked prefill
        step_kw = {n: (x[:, t] if torch.is_tensor(x) else x) for n, x in dk.items()}
        y, st = op.step(q[:, t], k[:, t], v[:, t], st, normalize=normalize, backend=backend, **step_kw)
        outs.append(y[:, None])
    assert rel(torch.cat(outs, 1), want) < TOL
    _, st_full = op.op(q, k, v, **kw, **dk)
    for a, b in zip(st, st_full):
        if b is not None:
            assert rel(a, b) < TOL


@OPS
def test_decode_leaves_the_input_state_alone(op, device):
    q, k, v = rand_qkv(1, 1, 2, 16, 16, seed=23, device=device)
    st = rand_state(op, 1, 2, 16, 16, False, seed=24, device=device)
    before = [None if x is None else x.clone() for x in st]
    op.step(q[:, 0], k[:, 0], v[:, 0], st, gamma=0.9, backend="triton")
    assert all(a is None or torch.equal(a, b) for a, b in zip(before, st))


@OPS
@pytest.mark.parametrize("normalize", [False, True])
def test_fp16_inputs_run_the_fp32_kernels(op, normalize, device, poison):
    """fp16 inputs, widened to fp32 tiles in the kernels (fp32's products and layouts,
    ``launch.fp32_tiles``): outputs, final states and every gradient of a random linear loss against
    the float64 torch path on the same fp16 numbers. What is left is fp16's rounding (2^-11
    relative) of what the call stores in the inputs' dtype and of what follows from it: o; every
    gradient, since autograd hands the backward do rounded to o's dtype; the final states of the
    layers and of HLA3, which sum products of the inner layer's K' and of the first stage's R, both
    stored in fp16 (the fused kernels' states, from the inputs alone, stay at fp32's level).
    Measured: 2e-4 to 6e-4 for every operator and layout, normalized or not."""
    B, T, H, K, V = 1, 37, 2, 12, 20
    q, k, v = (x.half().float() for x in rand_qkv(B, T, H, K, V, seed=24, positive=normalize))
    dk = decay_kwargs("g", B, T, H, seed=25)
    st0 = rand_state(op, B, H, K, V, normalize, seed=26)
    gen = torch.Generator().manual_seed(27)
    shapes = op.state_shapes(B, H, K, V, normalize)
    weights = [torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)]
    weights += [None if s is None else torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes.values()]
    o, fin, got = _loss_grads(op, q, k, v, st0, dk, normalize, torch.float16, device, "triton", weights)
    o64, fin64, want = _loss_grads(op, q, k, v, st0, dk, normalize, torch.float64, "cpu", "torch", weights)
    assert o.dtype == torch.float16 and rel(o, o64) < 1e-3
    for a, b in zip(fin, fin64):
        if b is not None:
            assert a.dtype == torch.float32 and rel(a, b) < 1e-3
    for name in want:
        assert got[name].dtype == (torch.float16 if name in ("dq", "dk", "dv") else torch.float32), name
        assert rel(got[name], want[name]) < 1e-3, name


@OPS
def test_fp16_normalized_gradients_at_large_denominators(op, device, poison):
    """A normalized fp16 call whose denominator d = den + eps is large (q, k in (0, 1), K = 32: d
    reaches 1.6e5 for HLA2 and AHLA here, 9e4 in a long AHLA call at K = 256): the backward's
    output gradient do / d then lies below fp16's smallest normal number (for 73% of it here), so
    the kernels take it in fp32 (``normalize.cotangent_dtype``). Rounded to fp16 it put AHLA's dq
    3.2e-3 off and HLA2's 1.3e-3; kept in fp32, what is left is fp16's rounding of the stored o
    and gradients (at most 9e-4 here). HLA3's d reaches 5.8e7, past fp16's largest number: HLA3
    divides in torch, and the operator on [v | 1] before it stores num and den in fp32 for fp16
    inputs (``normalize.quotient_values``; in fp16 the output was not finite). AHLA's layered
    backward (``ahla_layers``) keeps the first-order output R in fp32 for fp16 inputs
    (``ahla.chunk.kept_r_dtype``): kept in fp16 it put dq 1.06e-3 off."""
    B, T, H, K, V = 1, 64, 2, 32, 16
    q, k, v = (x.half().float() for x in rand_qkv(B, T, H, K, V, seed=24, positive=True, scale=1.0))
    gen = torch.Generator().manual_seed(27)
    weights = [torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)] + [None] * 5
    o, _, got = _loss_grads(op, q, k, v, None, {}, True, torch.float16, device, "triton", weights)
    o64, _, want = _loss_grads(op, q, k, v, None, {}, True, torch.float64, "cpu", "torch", weights)
    assert rel(o, o64) < 1e-3
    for name in want:
        assert rel(got[name], want[name]) < 1e-3, name


def test_fp16_normalized_wide_heads_at_large_denominators(device, poison):
    """HLA2 with heads wider than 128 (fp16: feature-block pairs) divides in torch after the
    operator on [v | 1], as HLA3 does: with q, k in (0, 1) the denominator passes fp16's largest
    number, so num and den are stored in fp32 (``normalize.quotient_values``); output and
    gradients against the float64 torch path on the same fp16 numbers."""
    import hla_fast

    B, T, H, K, V = 1, 40, 1, 160, 24
    q, k, v = (x.half().float() for x in rand_qkv(B, T, H, K, V, seed=28, positive=True, scale=1.0))
    w = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(29), dtype=torch.float64)

    def call(dtype, dev, backend):
        leaves = [x.detach().to(dev, dtype).requires_grad_() for x in (q, k, v)]
        o, _ = hla_fast.hla2(*leaves, normalize=True, backend=backend)
        (o.double() * w.to(dev)).sum().backward()
        return [o] + [x.grad for x in leaves]

    got = call(torch.float16, device, "triton")
    want = call(torch.float64, "cpu", "torch")
    assert got[0].dtype == torch.float16
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        assert rel(a, b) < 1e-3, name


@OPS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("normalize", [False, True])
def test_decode_step_is_one_launch(op, dtype, normalize, device, monkeypatch):
    """A Triton step returns the buffer its kernel stored, in v's dtype and normalized in-kernel:
    no torch op (a sum, a division, a cast) follows the launch, whose output would be a new tensor."""
    import importlib

    decode = importlib.import_module(f"hla_fast.ops.{op.module}.decode")
    made = []

    def recording_step_out(v):
        made.append(real(v))
        return made[-1]

    real = decode.step_out
    monkeypatch.setattr(decode, "step_out", recording_step_out)
    q, k, v = (x[:, 0].to(dtype) for x in rand_qkv(2, 1, 3, 16, 24, seed=31, positive=normalize, device=device))
    st = rand_state(op, 2, 3, 16, 24, normalize, seed=32, device=device)
    o, _ = op.step(q, k, v, st, gamma=0.9, normalize=normalize, backend="triton")
    assert len(made) == 1 and o.dtype == dtype and o.data_ptr() == made[0].data_ptr()
    want, _ = op.step(q.double().cpu(), k.double().cpu(), v.double().cpu(), _state64(st), gamma=0.9,
                      normalize=normalize, backend="torch")
    # bf16: the inputs are the same bf16 numbers on both paths; the output's rounding to bf16 (2^-9)
    assert rel(o, want) < (TOL if dtype == torch.float32 else 4e-3)


# ----------------------------------------------------------------------- faults found by use


@OPS
@pytest.mark.parametrize("loss", ["linear", "square"])
def test_second_derivative_through_triton_raises(op, loss, device):
    """A backward asked to build its own graph (create_graph=True, for a second derivative) raises,
    whether or not the loss is linear in o: under a linear loss no incoming gradient requires
    grad, and the first derivatives would come back detached, silently missing the operator's
    share of the second. Without create_graph the backward runs."""
    q, k, v = (x.requires_grad_() for x in rand_qkv(1, 20, 1, 16, 16, seed=25, device=device))
    o, _ = op.op(q, k, v, gamma=0.9, chunk_size=16, backend="triton")
    out = o.sum() if loss == "linear" else o.square().sum()
    with pytest.raises(RuntimeError, match="Triton backward is not differentiable.*backend='torch'"):
        torch.autograd.grad(out, q, create_graph=True, retain_graph=True)
    (gq,) = torch.autograd.grad(out, q)
    assert gq.shape == q.shape and not gq.requires_grad


@OPS
@pytest.mark.parametrize("kind", KINDS)
def test_decode_on_triton_keeps_gradients(op, kind, device):
    B, H, K, V = 2, 2, 8, 8
    q, k, v = rand_qkv(B, 1, H, K, V, seed=26, device=device)
    dk = {n: (x[:, 0] if torch.is_tensor(x) else x) for n, x in decay_kwargs(kind, B, 1, H, seed=27, device=device).items()}
    if "g" in dk:
        dk["g"].requires_grad_()
    st = rand_state(op, B, H, K, V, False, seed=30, device=device)  # a zero state gives dg = 0
    qq = q[:, 0].clone().requires_grad_()
    o, _ = op.step(qq, k[:, 0], v[:, 0], st, backend="triton", **dk)
    assert o.requires_grad
    leaves = [qq] + ([dk["g"]] if "g" in dk else [])
    got = torch.autograd.grad(o.sum(), leaves)
    q64 = qq.detach().double().cpu().requires_grad_()
    dk64 = {n: (x.detach().double().cpu().requires_grad_() if torch.is_tensor(x) else x) for n, x in dk.items()}
    o64, _ = op.step(q64, k[:, 0].double().cpu(), v[:, 0].double().cpu(), _state64(st), backend="torch", **dk64)
    want = torch.autograd.grad(o64.sum(), [q64] + ([dk64["g"]] if "g" in dk64 else []))
    for a, b in zip(got, want):
        assert rel(a, b) < TOL


@OPS
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("which", ["q", "k"])
def test_garbage_after_a_token_leaves_earlier_outputs_alone(op, backend, which, device):
    """A NaN or Inf in q or k at token t (right padding, say) does not reach the outputs before t:
    masks are selections. (v must stay finite: its rows enter a matrix product, see README.) An
    operator that feeds a row made from q_t, k_t into a matrix product (AHLA's A R) keeps only the
    chunks before t's clean (``garbage_within_chunk=False``)."""
    q, k, v = rand_qkv(1, 30, 2, 16, 8, seed=28, device=device)
    bad = dict(q=q.clone(), k=k.clone(), v=v)
    bad[which][:, 20, 0, 3] = float("nan")
    bad[which][:, 25, 1, 0] = float("inf")
    C, first = (32, 20) if op.garbage_within_chunk else (16, 16)
    clean, _ = op.op(q, k, v, gamma=0.9, chunk_size=C, backend=backend)
    dirty, _ = op.op(bad["q"], bad["k"], bad["v"], gamma=0.9, chunk_size=C, backend=backend)
    assert torch.equal(dirty[:, :first], clean[:, :first])
    assert not torch.isfinite(dirty[:, 20:]).all()


@OPS
def test_torch_backend_caps_the_chunk_at_T(op):
    q, k, v = rand_qkv(1, 5, 1, 8, 8, seed=29)
    o, _ = op.op(q, k, v, gamma=0.9, chunk_size=2 ** 20, backend="torch")  # would be a 4 TB tile uncapped
    assert rel(o, op.ref(q, k, v, gamma=0.9)) < TOL


@OPS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_torch_paths_ignore_autocast(op, dtype):
    """Under torch.autocast the torch backend and the torch step give what they give outside it
    (fp32 products and states, as the kernels keep): an fp16 region overflowed a normalized third
    order call, and a bf16 one left the fp32 states 2e-3 off."""
    q, k, v = rand_qkv(1, 64, 2, 16, 16, seed=31)
    q, k = q.abs(), k.abs()
    g = -torch.rand(1, 64, 2, generator=torch.Generator().manual_seed(3))
    st = rand_state(op, 1, 2, 16, 16, True, seed=32)
    kw = dict(g=g, normalize=True, initial_state=st, output_final_state=True, backend="torch")
    want = op.op(q, k, v, **kw)
    step_want = op.step(q[:, 0], k[:, 0], v[:, 0], st, g=g[:, 0], normalize=True, backend="torch")
    with torch.autocast("cpu", dtype=dtype):
        got = op.op(q, k, v, **kw)
        step_got = op.step(q[:, 0], k[:, 0], v[:, 0], st, g=g[:, 0], normalize=True, backend="torch")
    for a, b in ((got[0], want[0]), (step_got[0], step_want[0])):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip((*got[1], *step_got[1]), (*want[1], *step_want[1])):
        assert (a is None and b is None) or (a.dtype == b.dtype == torch.float32 and torch.equal(a, b))


@OPS
@pytest.mark.parametrize("gated", [False, True])
def test_meta_tensors_infer_shapes(op, gated):
    """On the meta device a call infers its outputs' shapes, gated or not (the gates' values,
    checked off CUDA, do not exist there)."""
    meta = torch.device("meta")
    q, k, v = (torch.empty(2, 5, 3, n, device=meta) for n in (8, 8, 6))
    kw = dict(g=torch.empty(2, 5, 3, device=meta)) if gated else dict(gamma=0.9)
    o, st = op.op(q, k, v, output_final_state=True, backend="torch", **kw)
    assert o.device == meta and o.shape == (2, 5, 3, 6)
    shapes = op.state_shapes(2, 3, 8, 6, False)
    assert {f: tuple(x.shape) for f, x in zip(st._fields, st) if x is not None} == {
        f: s for f, s in shapes.items() if s is not None}
