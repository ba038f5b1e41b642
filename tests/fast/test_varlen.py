"""Packed sequences (``cu_seqlens``): a packed batch equals separate calls, forward and every
gradient (q, k, v, the log-gates g and the initial state, with cotangents on the final state), on
the torch backend in float64 (tolerance 1e-10: the same float64 arithmetic up to reordering) and on
the Triton kernels (fp32 against separate float64 calls: 1e-5, the kernels' fp32 products); lengths
of 1 and lengths that are not multiples of the chunk; every bad-offset case with its error.

Every operator of helpers.OPERATORS is checked, through its ``cu_seqlens`` keyword.
"""
import pytest

from .helpers import OPERATORS, rand_gates, rand_qkv, rand_state, rel, torch

from hla_fast.ops.common.varlen import check_cu_seqlens, from_padded, to_padded, varlen_gates

OPS = pytest.mark.parametrize("op", OPERATORS, ids=lambda o: o.name)
LENGTHS = [1, 7, 19, 4]          # a single token; 7, 19 not multiples of the chunks below


def _packed_call(op, q, k, v, cu_seqlens, **kw):
    """op on packed sequences, through its cu_seqlens keyword."""
    return op.op(q, k, v, cu_seqlens=cu_seqlens, **kw)


def _offsets(lengths, device="cpu"):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)


def _inputs(op, lengths, kind, normalize, dtype, device, H=2, K=6, V=5, seed=0):
    T, N = sum(lengths), len(lengths)
    q, k, v = rand_qkv(1, T, H, K, V, seed=seed, positive=normalize, dtype=dtype, device=device)
    kw = {}
    if kind == "gamma":
        kw["gamma"] = 0.8
    elif kind == "g":
        kw["g"] = rand_gates(1, T, H, seed=seed, device=device, dtype=dtype)
    st = rand_state(op, N, H, K, V, normalize, seed=seed, device=device,
                    dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    return q, k, v, kw, st


def _leaves(q, k, v, kw, st):
    """Fresh leaves (requires_grad) of every differentiable input."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    kw = {a: (b.detach().clone().requires_grad_() if torch.is_tensor(b) else b) for a, b in kw.items()}
    st = type(st)(*(None if x is None else x.detach().clone().requires_grad_() for x in st))
    return q, k, v, kw, st


def _loss(o, final, seed=3):
    gen = torch.Generator().manual_seed(seed)
    total = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
    for x in final:
        if x is not None:
            total = total + (x.double() * torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)).sum()
    return total


def _grads(q, k, v, kw, st):
    out = {"q": q.grad, "k": k.grad, "v": v.grad}
    if "g" in kw:
        out["g"] = kw["g"].grad
    out.update({f"initial_state.{f}": x.grad for f, x in zip(st._fields, st) if x is not None})
    return out


def _packed(op, q, k, v, kw, st, lengths, normalize, **call):
    q, k, v, kw, st = _leaves(q, k, v, kw, st)
    o, final = _packed_call(op, q, k, v, _offsets(lengths, q.device), normalize=normalize, initial_state=st,
                            output_final_state=True, **kw, **call)
    _loss(o, final).backward()
    return o, final, _grads(q, k, v, kw, st)


def _separate(op, q, k, v, kw, st, lengths, normalize, **call):
    """One call per sequence (B = 1 each); outputs concatenated along T, final states along B."""
    q, k, v, kw, st = _leaves(q, k, v, kw, st)
    outs, finals, a = [], [], 0
    for n, L in enumerate(lengths):
        sl = slice(a, a + L)
        kwn = {name: (x[:, sl] if torch.is_tensor(x) else x) for name, x in kw.items()}
        stn = type(st)(*(None if x is None else x[n:n + 1] for x in st))
        o, f = op.op(q[:, sl], k[:, sl], v[:, sl], normalize=normalize, initial_state=stn,
                     output_final_state=True, **kwn, **call)
        outs.append(o)
        finals.append(f)
        a += L
    o = torch.cat(outs, dim=1)
    final = type(st)(*(None if parts[0] is None else torch.cat(parts, dim=0) for parts in zip(*finals)))
    _loss(o, final).backward()
    return o, final, _grads(q, k, v, kw, st)


def _compare(got, want, tol):
    (o, f, gr), (o2, f2, gr2) = got, want
    assert o.shape == o2.shape and rel(o, o2) < tol
    for field, a, b in zip(f._fields, f, f2):
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.shape == b.shape and rel(a, b) < tol, field
    assert gr.keys() == gr2.keys()
    for name in gr:
        assert gr[name] is not None and rel(gr[name], gr2[name]) < tol, name


@OPS
@pytest.mark.parametrize("kind", ["none", "gamma", "g"])
@pytest.mark.parametrize("normalize", [False, True])
def test_packed_equals_separate_torch(op, kind, normalize):
    q, k, v, kw, st = _inputs(op, LENGTHS, kind, normalize, torch.float64, "cpu", seed=len(kind))
    call = dict(backend="torch", chunk_size=4)
    got = _packed(op, q, k, v, kw, st, LENGTHS, normalize, **call)
    want = _separate(op, q, k, v, kw, st, LENGTHS, normalize, **call)
    _compare(got, want, 1e-10)


@OPS
@pytest.mark.parametrize("kind,normalize", [("gamma", False), ("g", False), ("g", True)])
def test_packed_equals_separate_triton(op, kind, normalize, device, poison):
    lengths = [1, 19, 5]
    q, k, v, kw, st = _inputs(op, lengths, kind, normalize, torch.float32, device, H=1, seed=4)
    got = _packed(op, q, k, v, kw, st, lengths, normalize, backend="triton", chunk_size=16)
    f64 = lambda x: x.double().cpu()  # noqa: E731
    want = _separate(op, f64(q), f64(k), f64(v), {a: (f64(b) if torch.is_tensor(b) else b) for a, b in kw.items()},
                     type(st)(*(None if x is None else f64(x) for x in st)), lengths, normalize,
                     backend="torch", chunk_size=16)
    _compare(got, want, 1e-5)


@OPS
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_smallest_accepted_eps_keeps_padded_gradients_finite(op, backend, device):
    """Normalized, with lengths that differ: at the smallest eps the check accepts (fp32's smallest
    normal number) the padded rows' 0 / eps is 0 and every gradient is finite."""
    if backend == "torch":
        device = "cpu"
    q, k, v = rand_qkv(1, 10, 1, 4, 4, seed=5, positive=True, device=device)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    o, _ = _packed_call(op, *leaves, _offsets([3, 7], device), normalize=True, eps=torch.finfo(torch.float32).tiny,
                        backend=backend)
    o.sum().backward()
    assert torch.isfinite(o).all() and all(torch.isfinite(x.grad).all() for x in leaves)


@OPS
def test_equal_lengths_take_no_padding(op):
    """Equal lengths: the padded batch is a reshape (no copy), gamma stays a constant, and the
    result is bit-for-bit the batched call."""
    N, L, H, K, V = 3, 5, 2, 4, 3
    q, k, v = rand_qkv(1, N * L, H, K, V, seed=1, dtype=torch.float64)
    lay = check_cu_seqlens(_offsets([L] * N), q)
    assert not lay.padded and lay.index is None
    assert to_padded(q, lay).data_ptr() == q.data_ptr()
    assert varlen_gates(0.9, None, lay, q) == (0.9, None)
    o, f = _packed_call(op, q, k, v, _offsets([L] * N), gamma=0.9, output_final_state=True, backend="torch")
    ob, fb = op.op(*(x.reshape(N, L, H, -1) for x in (q, k, v)), gamma=0.9, output_final_state=True, backend="torch")
    assert torch.equal(o, ob.reshape(1, N * L, H, V))
    for a, b in zip(f, fb):
        assert (a is None and b is None) or torch.equal(a, b)


def test_layout_pack_unpack_and_gates():
    """Padding holds zeros, unpacking inverts packing, a constant gamma becomes log(gamma) on the
    valid rows and 0 on the padding."""
    lengths = [2, 1, 3]
    q = torch.arange(1.0, 7.0, dtype=torch.float64).reshape(1, 6, 1, 1)
    lay = check_cu_seqlens(_offsets(lengths), q)
    assert lay.padded and lay.T_max == 3 and lay.N == 3 and lay.lengths == (2, 1, 3)
    p = to_padded(q, lay)
    assert p[..., 0, 0].tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    assert torch.equal(from_padded(p, lay), q)
    gamma, g = varlen_gates(0.5, None, lay, q)
    assert gamma is None and g.dtype == torch.float64
    want = torch.log(torch.tensor(0.5, dtype=torch.float64)).item()
    want = torch.tensor([[want, want, 0], [want, 0, 0], [want, want, want]], dtype=torch.float64)
    assert torch.allclose(g[..., 0], want)


@OPS
def test_padding_does_not_touch_the_final_state(op):
    """The short sequence's final state equals its own call's even though its padded row runs on
    for 11 more rows of zeros (with a constant decay that would otherwise decay it)."""
    q, k, v, kw, st = _inputs(op, [1, 12], "gamma", True, torch.float64, "cpu", seed=9)
    _, f = _packed_call(op, q, k, v, _offsets([1, 12]), gamma=0.7, normalize=True, initial_state=st,
                        output_final_state=True, backend="torch")
    _, f1 = op.op(q[:, :1], k[:, :1], v[:, :1], gamma=0.7, normalize=True, output_final_state=True,
                  initial_state=type(st)(*(None if x is None else x[:1] for x in st)), backend="torch")
    for a, b in zip(f, f1):
        if a is not None:
            assert rel(a[:1], b) < 1e-12


@OPS
def test_bad_offsets(op):
    q, k, v = rand_qkv(1, 6, 2, 4, 3, seed=2)

    def run(cu, **kw):
        return _packed_call(op, q, k, v, cu, **kw)

    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        run([0, 6])
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        run(torch.tensor([0, 6]))
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        run(torch.tensor([0.0, 6.0]))
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor \[N \+ 1\]"):
        run(i32([[0, 6]]))
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor \[N \+ 1\]"):
        run(i32([0]))
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        run(i32([0, 6]).to("meta"))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        run(i32([1, 3, 6]))
    with pytest.raises(ValueError, match=r"strictly increasing .* cu_seqlens\[1\] = 3 and cu_seqlens\[2\] = 3"):
        run(i32([0, 3, 3, 6]))
    with pytest.raises(ValueError, match="strictly increasing"):
        run(i32([0, 4, 2, 6]))
    with pytest.raises(ValueError, match="cu_seqlens must end at T = 6"):
        run(i32([0, 2, 5]))
    with pytest.raises(ValueError, match="cu_seqlens must end at T = 6"):
        run(i32([0, 2, 7]))
    with pytest.raises(ValueError, match="q must have B == 1, got B=2"):
        _packed_call(op, *(torch.cat([x, x]) for x in (q, k, v)), i32([0, 6]))
    with pytest.raises(ValueError, match=r"needs eps >= 1.175e-38 \(eps > 0, .*got eps=0.0"):
        run(i32([0, 2, 6]), normalize=True, eps=0.0)
    for eps in (1e-50, 1e-40):   # 0 in fp32, and a subnormal a GPU flushes to 0
        with pytest.raises(ValueError, match=rf"needs eps >= 1.175e-38 .*got eps={eps}"):
            run(i32([0, 2, 6]), normalize=True, eps=eps)
    with pytest.raises(ValueError, match="cu_seqlens is on the meta device, which holds no values"):
        _packed_call(op, *(x.to("meta") for x in (q, k, v)), i32([0, 2, 6]).to("meta"))
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H\]"):
        run(i32([0, 2, 6]), g=torch.zeros(2, 6))
    bad_rows = rand_state(op, 3, 2, 4, 3, False)   # 3 rows for 2 sequences
    with pytest.raises(ValueError, match=r"initial_state\.\w+ must have shape \[2, "):
        run(i32([0, 2, 6]), initial_state=bad_rows)
    # equal lengths with eps = 0 need no padding and are accepted
    o, _ = run(i32([0, 3, 6]), normalize=True, eps=0.0)
    assert o.shape == v.shape
