"""The torch.library registrations (hla_fast.ops.library) and torch.compile of a model built from
the layer.

* ``torch.library.opcheck`` on every op (schema, fake implementation against the real one: shapes,
  dtypes, strides; the autograd registration; tracing by AOTAutograd);
* the gradient of the chunk op (its backward op recomputes the forward) against the operator's
  own autograd, for q, k, v, the log-gates and the initial state, with cotangents on the final
  state, in float64 (rounding only);
* a two-block model compiled with ``fullgraph=True`` (no graph break) gives eager's outputs and
  gradients: on a CPU with the torch backend (AOTAutograd for every order, Inductor for hla2), on
  CUDA with the Triton kernels;
* compiled single-token decode calls (the step op, the cache passed in) continue an eager prefill.
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import hla_fast  # noqa: E402
from hla_fast.layers import HigherOrderLinearAttention  # noqa: E402
from hla_fast.ops import library  # noqa: E402

ORDERS = ["hla2", "ahla", "hla3"]


def rand_inputs(order, B=2, T=9, H=2, K=8, V=4, *, normalize, gates, state, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.rand(B, T, H, K, generator=gen) * 0.5).to(dtype)  # positive: normalize's den > 0
    k = (torch.rand(B, T, H, K, generator=gen) * 0.5).to(dtype)
    v = torch.randn(B, T, H, V, generator=gen).to(dtype)
    g = (-0.3 * torch.rand(B, T, H, generator=gen)).to(dtype) if gates else None
    st = []
    if state:
        for shape in library.state_shapes(order, B, H, K, V, normalize):
            st.append((0.1 * torch.rand(shape, generator=gen)).to(dtype))
    return q, k, v, g, st


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("normalize", [False, True])
def test_opcheck(order, normalize):
    op, _, _ = library.OPS[order]
    q, k, v, g, st = rand_inputs(order, normalize=normalize, gates=True, state=True, dtype=torch.float32)
    torch.library.opcheck(op, (q, k, v, g, st, None, normalize, 1e-6, True, 4, "torch"))
    torch.library.opcheck(op, (q, k, v, None, [], 0.9, normalize, 1e-6, False, 4, "torch"))
    step = library.step_op(order)
    one = [x[:, 0] for x in (q, k, v, g)]
    torch.library.opcheck(step, (*one, st, None, normalize, 1e-6, "torch"))
    torch.library.opcheck(step, (*one[:3], None, [], 0.8, normalize, 1e-6, "torch"))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("normalize", [False, True])
def test_opcheck_backward_on_strided_inputs(order, normalize):
    """The backward op on inputs that are not contiguous (heads-first tensors transposed, a gate
    expanded from one head, a state transposed twice): its fake gives the real op's contiguous
    gradients, as Inductor's compiled backward relies on."""
    _, backward, _ = library.OPS[order]
    q, k, v, g, st = rand_inputs(order, normalize=normalize, gates=True, state=True, dtype=torch.float32)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))   # [B, H, T, D] in memory
    g = g[:, :, :1].expand(g.shape)
    st = [x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() == 4 else x for x in st]
    assert not q.is_contiguous() and not g.is_contiguous()
    gen = torch.Generator().manual_seed(7)
    shapes = [v.shape] + [x.shape for x in st]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    torch.library.opcheck(backward, (q, k, v, g, st, grads, None, normalize, 1e-6, True, 4, "torch"))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("normalize", [False, True])
def test_custom_op_gradients_match_operator(order, normalize):
    op, _, _ = library.resolve(order)
    q, k, v, g, st = rand_inputs(order, normalize=normalize, gates=True, state=True)
    leaves = [x.requires_grad_() for x in (q, k, v, g, *st)]
    state0 = library.unpack_state(order, st, normalize)
    gen = torch.Generator().manual_seed(5)

    def loss(o, fin):
        parts = [o] + library.pack_state(order, fin, normalize)
        return sum((p * torch.randn(p.shape, generator=gen, dtype=p.dtype)).sum() for p in parts)

    o1, f1 = op(q, k, v, g=g, normalize=normalize, initial_state=state0, output_final_state=True, chunk_size=4,
                backend="torch")
    gen.manual_seed(5)
    want = torch.autograd.grad(loss(o1, f1), leaves)
    o2, f2 = library.chunked(order, q, k, v, g=g, normalize=normalize, initial_state=state0,
                             output_final_state=True, chunk_size=4, backend="torch")
    gen.manual_seed(5)
    got = torch.autograd.grad(loss(o2, f2), leaves)
    assert torch.equal(o1, o2)
    for a, b in zip(library.pack_state(order, f1, normalize), library.pack_state(order, f2, normalize)):
        assert torch.equal(a, b)
    for i, (a, b) in enumerate(zip(got, want)):
        assert float((a - b).norm() / b.norm()) < 1e-12, i


def test_custom_op_gradient_without_state_outputs():
    """Only o carries a cotangent; the op's backward gets zeros for nothing else."""
    q, k, v, _, _ = rand_inputs("hla2", normalize=False, gates=False, state=False)
    for x in (q, k, v):
        x.requires_grad_()
    o, _ = library.chunked("hla2", q, k, v, gamma=0.9, backend="torch")
    got = torch.autograd.grad(o.square().sum(), (q, k, v))
    o_ref, _ = hla_fast.hla2(q, k, v, gamma=0.9, backend="torch")
    want = torch.autograd.grad(o_ref.square().sum(), (q, k, v))
    assert all(float((a - b).norm() / b.norm()) < 1e-12 for a, b in zip(got, want))


class TinyModel(torch.nn.Module):
    """Embedding, two blocks of RMS norm -> HLA layer -> residual, LM head."""

    def __init__(self, order, gate, backend, vocab=40, d=32, heads=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.norms = torch.nn.ModuleList([torch.nn.RMSNorm(d) for _ in range(2)])
        self.mixers = torch.nn.ModuleList([
            HigherOrderLinearAttention(d, heads, num_kv_heads=1, order=order, gate=gate, layer_idx=i, backend=backend)
            for i in range(2)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for norm, mix in zip(self.norms, self.mixers):
            h = h + mix(norm(h))[0]
        return self.head(h)


def _eager_and_compiled(model, ids, backend):
    def run(m):
        model.zero_grad(set_to_none=True)
        out = m(ids)
        out.float().square().mean().backward()
        return out.detach(), [p.grad.detach().clone() for p in model.parameters()]

    o_e, g_e = run(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    o_c, g_c = run(compiled)
    return (o_e, g_e), (o_c, g_c)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("order", ORDERS)
def test_compiled_model_matches_eager_cpu(order):
    torch.manual_seed(0)
    model = TinyModel(order, "data", "torch")
    ids = torch.randint(0, 40, (2, 13))
    (o_e, g_e), (o_c, g_c) = _eager_and_compiled(model, ids, "aot_eager")
    assert _rel(o_c, o_e) < 1e-6
    assert all(_rel(a, b) < 1e-5 for a, b in zip(g_c, g_e))


def test_compiled_model_inductor_cpu():
    torch.manual_seed(1)
    model = TinyModel("hla2", "fixed", "torch")
    ids = torch.randint(0, 40, (2, 13))
    (o_e, g_e), (o_c, g_c) = _eager_and_compiled(model, ids, "inductor")
    # Inductor fuses the norms and projections around the op: fp32 rounding in another order
    assert _rel(o_c, o_e) < 1e-5
    assert all(_rel(a, b) < 1e-4 for a, b in zip(g_c, g_e))


@pytest.mark.parametrize("order", ORDERS)
def test_compiled_decode_steps_cpu(order):
    """Decode steps through the layer and its HLACache compile into one graph (the step op) and
    continue an eager prefill as one eager call over all tokens would."""
    torch.manual_seed(2)
    layer = HigherOrderLinearAttention(32, 2, order=order, gate="data", layer_idx=0, backend="torch")
    x = torch.randn(1, 8, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        full, _, _ = layer(x)
        _, _, cache = layer(x[:, :5], use_cache=True)
        step = torch.compile(lambda xt, c: layer(xt, past_key_values=c, use_cache=True)[0], fullgraph=True,
                             backend="aot_eager")
        outs = torch.cat([step(x[:, t:t + 1], cache) for t in range(5, 8)], 1)
    assert cache.get_seq_length(0) == 8
    assert _rel(outs, full[:, 5:]) < 1e-5


@pytest.mark.parametrize("order", ORDERS)
def test_compiled_one_token_calls_with_a_cache_train(order):
    """A one-token call with a cache while autograd records (a first token, then a step after a
    prefill, gradients through both) compiles, and its outputs and gradients are the eager
    layer's: traced, such a call runs as a chunk call (the step op has no autograd formula)."""
    torch.manual_seed(3)
    layer = HigherOrderLinearAttention(32, 2, order=order, gate="data", layer_idx=0, backend="torch")
    x = torch.randn(1, 6, 32)

    def run(fn):
        layer.zero_grad(set_to_none=True)
        first, _, _ = fn(x[:, :1], None)
        _, _, cache = fn(x[:, :5], None)
        step, _, _ = fn(x[:, 5:6], cache)
        (first.square().sum() + step.square().sum()).backward()
        return [first.detach(), step.detach()] + [p.grad.clone() for p in layer.parameters()]

    eager = run(lambda xt, c: layer(xt, past_key_values=c, use_cache=True))
    torch._dynamo.reset()
    compiled = torch.compile(lambda xt, c: layer(xt, past_key_values=c, use_cache=True), fullgraph=True,
                             backend="aot_eager")
    got = run(compiled)
    assert all(_rel(a, b) < 1e-5 for a, b in zip(got, eager))


@pytest.mark.gpu
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("gate", ["none", "data"])
def test_compiled_model_matches_eager_cuda(order, gate):
    torch.manual_seed(0)
    model = TinyModel(order, gate, None, d=128, heads=2).cuda()
    ids = torch.randint(0, 40, (2, 100), device="cuda")
    (o_e, g_e), (o_c, g_c) = _eager_and_compiled(model, ids, "inductor")
    assert _rel(o_c, o_e) < 1e-4
    assert all(_rel(a, b) < 1e-3 for a, b in zip(g_c, g_e))
