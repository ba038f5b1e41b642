"""HigherOrderLinearAttention and HLACache (hla_fast.layers).

* the layer equals its definition: projections, q/k norm, grouped heads, gates, the operator in
  float64 from hla_ref (per head), output norm, o_proj;
* a prefill of T tokens in chunks, continued by single-token steps through an HLACache, gives the
  outputs of one call over all tokens, for every order, gate and backend (float64 torch path:
  to rounding; fp32 Triton kernels: 1e-5 relative, also against the float64 torch path);
* grouped key/value heads share the key second moment within a group;
* gradients reach every parameter; bad arguments raise errors naming them.

On a CPU the Triton backend runs under Triton's interpreter (tests/fast/conftest.py), on CUDA the
compiled kernels.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import hla_ref  # noqa: E402

import hla_fast  # noqa: E402
from hla_fast.layers import HigherOrderLinearAttention, HLACache  # noqa: E402
from hla_fast.layers.hla import fixed_log_decays  # noqa: E402
from hla_fast.ops import library  # noqa: E402

ORDERS = ["hla2", "ahla", "hla3"]
GATES = ["none", "fixed", "data"]
# fp32 kernels (ieee products on the interpreter, tf32x3 on a GPU) against float64
TOL32 = 1e-5
# float64 torch path: rounding only
TOL64 = 1e-10


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values"
    return float((a - b).norm() / b.norm())


def make_layer(order, gate="none", *, normalize=False, hidden=32, heads=2, kv_heads=1, head_dim=16,
               backend="torch", dtype=torch.float64, device="cpu", seed=0, **kw):
    torch.manual_seed(seed)
    layer = HigherOrderLinearAttention(hidden, heads, head_dim=head_dim, num_kv_heads=kv_heads, order=order,
                                       gate=gate, normalize=normalize, layer_idx=0, backend=backend, **kw)
    with torch.no_grad():
        if layer.g_proj is not None:  # gates spread over (0, 1): some forget fast, some slowly
            layer.g_proj.bias.uniform_(-2.0, 4.0)
        if layer.o_norm_weight is not None:
            layer.o_norm_weight.uniform_(0.5, 1.5)
    return layer.to(device=device, dtype=dtype)


def hidden_states(B, T, D, *, seed=1, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g).to(device=device, dtype=dtype)


def layer_by_definition(layer, x):
    """The layer's output in float64, with the operator taken from hla_ref (per batch and head)."""
    ref_op = {"hla2": hla_ref.hla2_naive, "ahla": hla_ref.ahla_naive, "hla3": hla_ref.hla3_naive}[layer.order]
    x = x.double()
    B, T, D = x.shape
    H, K, Hk = layer.num_heads, layer.head_dim, layer.num_kv_heads
    W = {n: getattr(layer, n).weight.detach().double() for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    q = (x @ W["q_proj"].T).reshape(B, T, H, K)
    k = (x @ W["k_proj"].T).reshape(B, T, Hk, K)
    v = (x @ W["v_proj"].T).reshape(B, T, Hk, K)
    q = q / q.norm(dim=-1, keepdim=True)
    k = k / k.norm(dim=-1, keepdim=True)
    grp = H // Hk
    if layer.gate == "data":
        z = x @ layer.g_proj.weight.detach().double().T + layer.g_proj.bias.detach().double()
        a = torch.exp(torch.nn.functional.logsigmoid(z) / layer.gate_logit_normalizer)  # [B, T, H]
    elif layer.gate == "fixed":
        a = torch.exp(layer.log_decay.double())[None, None, :].expand(B, T, H)
    else:
        a = torch.ones(B, T, H, dtype=torch.float64)
    o = np.zeros((B, T, H, K))
    for b in range(B):
        for h in range(H):
            o[b, :, h] = ref_op(q[b, :, h].numpy(), k[b, :, h // grp].numpy(), v[b, :, h // grp].numpy(),
                                gamma=a[b, :, h].numpy(), normalize=layer.normalize, eps=layer.eps)
    o = torch.from_numpy(o)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm_eps) * layer.o_norm_weight.detach().double()
    return o.reshape(B, T, H * K) @ W["o_proj"].T


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("normalize", [False, True])
def test_layer_matches_definition(order, gate, normalize):
    layer = make_layer(order, gate, normalize=normalize, heads=4, kv_heads=2)
    x = hidden_states(2, 13, 32)
    o, none, cache = layer(x)
    assert o.shape == x.shape and o.dtype == x.dtype and none is None and cache is None
    assert rel(o, layer_by_definition(layer, x)) < TOL64   # gates too: the float64 layer computes them in float64


def _incremental(layer, x, splits):
    """Run x [B, T, D] through the layer in pieces of the given lengths (1: a decode step),
    carrying one HLACache; returns the outputs concatenated and the cache."""
    cache, outs, t = None, [], 0
    for n in splits:
        o, _, cache = layer(x[:, t:t + n], past_key_values=cache, use_cache=True)
        outs.append(o)
        t += n
    assert t == x.shape[1]
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_then_decode_matches_one_call(order, gate, normalize, backend, device):
    on_torch = backend == "torch"
    dev, dt = ("cpu", torch.float64) if on_torch else (device, torch.float32)
    layer = make_layer(order, gate, normalize=normalize, backend=backend, dtype=dt, device=dev)
    x = hidden_states(2, 11, 32, dtype=dt, device=dev)
    with torch.no_grad():
        full, _, _ = layer(x)
        inc, cache = _incremental(layer, x, [5, 3, 1, 1, 1])  # prefill, a chunk continuing it, 3 steps
    assert isinstance(cache, HLACache) and len(cache) == 1 and cache.get_seq_length(0) == 11
    _, _, State = library.resolve(order)
    assert isinstance(cache[0], State)
    assert rel(inc, full) < (TOL64 if on_torch else TOL32)
    if not on_torch:  # the kernels against the float64 torch path
        ref = make_layer(order, gate, normalize=normalize, backend="torch")
        assert rel(full, ref(x.double().cpu())[0]) < TOL32


@pytest.mark.parametrize("order", ORDERS)
def test_step_from_empty_cache_and_first_token(order):
    """A first call of one token with use_cache (no state yet) starts from zeros."""
    layer = make_layer(order, "data")
    x = hidden_states(1, 4, 32)
    full, _, _ = layer(x)
    inc, cache = _incremental(layer, x, [1, 1, 1, 1])
    assert rel(inc, full) < TOL64 and cache.get_seq_length() == 4


@pytest.mark.parametrize("order", ORDERS)
def test_cache_read_without_update(order):
    """A cache passed with use_cache=False is read (the call continues the state) but not updated."""
    layer = make_layer(order, "fixed")
    x = hidden_states(1, 9, 32)
    full, _, _ = layer(x)
    _, _, cache = layer(x[:, :6], use_cache=True)
    before = [t.clone() for t in cache[0] if t is not None]
    o, _, same = layer(x[:, 6:], past_key_values=cache, use_cache=False)
    assert same is cache and cache.get_seq_length(0) == 6
    assert all(torch.equal(a, b) for a, b in zip(before, [t for t in cache[0] if t is not None]))
    assert rel(o, full[:, 6:]) < TOL64


@pytest.mark.parametrize("order", ORDERS)
def test_grouped_heads_share_key_moment(order):
    """num_kv_heads = 1 with 4 query heads: each head's state parts built from keys alone (the
    key second moment S; P, the key-value moment) are equal across the group."""
    layer = make_layer(order, "none", heads=4, kv_heads=1)
    _, _, cache = layer(hidden_states(2, 10, 32), use_cache=True)
    st = cache[0]
    shared = [f for f in ("S", "P") if f in st._fields and (order != "ahla" or f == "P")]
    assert shared
    for f in shared:
        x = getattr(st, f)
        for h in range(1, 4):
            assert torch.equal(x[:, h], x[:, 0]), f
    # the parts that involve the queries differ between heads
    other = {"hla2": "W", "ahla": "E", "hla3": "F"}[order]
    y = getattr(st, other)
    assert not torch.allclose(y[:, 1], y[:, 0])
    assert layer.k_proj.weight.shape == (16, 32) and layer.q_proj.weight.shape == (64, 32)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("gate", GATES)
def test_gradients_reach_every_parameter(order, gate):
    layer = make_layer(order, gate, dtype=torch.float32)
    x = hidden_states(2, 9, 32, dtype=torch.float32).requires_grad_()
    o, _, _ = layer(x)
    (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_fixed_decays():
    d = fixed_log_decays(6)
    one_minus = -torch.expm1(d.double())
    assert torch.allclose(one_minus, torch.pow(2.0, -torch.linspace(5, 10, 6, dtype=torch.float64)), rtol=1e-6)
    assert torch.allclose(-torch.expm1(fixed_log_decays(1).double()), torch.tensor([2.0 ** -5], dtype=torch.float64))
    layer = make_layer("hla2", "fixed", heads=6, kv_heads=6, head_dim=8, hidden=24)
    assert layer.log_decay.shape == (6,) and bool((layer.log_decay < 0).all())
    assert "log_decay" not in layer.state_dict()  # a constant, rebuilt from num_heads


@pytest.mark.parametrize("gate", ["fixed", "data"])
def test_gates_follow_the_layer_dtype(gate):
    """The log-gates are fp32 for bf16 and fp32 layers (a bf16 cast of the module leaves the fixed
    decays fp32) and float64 for a float64 one, whose gate parameters then pass gradcheck."""
    for dtype, want in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                        (torch.float64, torch.float64)):
        layer = make_layer("hla2", gate, dtype=torch.float32).to(dtype)
        g = layer._heads(hidden_states(1, 3, 32, dtype=dtype))[3]
        assert g.dtype == want and g.shape == (1, 3, 2)
    layer = make_layer("hla2", gate, hidden=8, head_dim=4)   # float64
    x = hidden_states(1, 3, 8)
    if gate == "fixed":
        g = layer._heads(x)[3]
        want = torch.pow(2.0, -torch.tensor([5.0, 10.0], dtype=torch.float64))   # 1 - gamma_h, exactly
        assert torch.allclose(-torch.expm1(g[0, 0]), want, rtol=4 * 2.0 ** -52, atol=0)   # (fp32: 2^-24 off)
    else:
        def out(w):
            return torch.func.functional_call(layer, {"g_proj.weight": w}, (x,))[0]

        assert torch.autograd.gradcheck(out, (layer.g_proj.weight.detach().clone().requires_grad_(),))


def test_layer_built_on_the_meta_device():
    """Built on the meta device, materialized (to_empty) and loaded from a checkpoint, the layer
    computes what the checkpoint's layer does: the fixed decays are made from num_heads, not kept."""
    ref = make_layer("hla2", "fixed", heads=4, kv_heads=4, head_dim=8)
    with torch.device("meta"):
        layer = HigherOrderLinearAttention(32, 4, head_dim=8, order="hla2", gate="fixed", backend="torch")
    layer = layer.to_empty(device="cpu").double()
    layer.load_state_dict(ref.state_dict())
    x = hidden_states(1, 5, 32)
    assert torch.equal(layer(x)[0], ref(x)[0])


@pytest.mark.parametrize("gate", ["none", "fixed", "data"])
@pytest.mark.parametrize("order", ["hla2", "ahla", "hla3"])
def test_layer_forward_on_the_meta_device(order, gate):
    """A layer on the meta device infers its output's shape, gated or not."""
    with torch.device("meta"):
        layer = HigherOrderLinearAttention(32, 4, head_dim=8, order=order, gate=gate, backend="torch")
        o = layer(torch.empty(2, 5, 32))[0]
    assert o.device.type == "meta" and o.shape == (2, 5, 32)


def test_data_gates_are_log_gates():
    layer = make_layer("hla2", "data", dtype=torch.float32)
    _, _, _, g = layer._heads(hidden_states(2, 7, 32, dtype=torch.float32))
    assert g.shape == (2, 7, 2) and g.dtype == torch.float32 and bool((g <= 0).all()) and bool((g < 0).any())


def test_qk_scaling_without_norm():
    """qk_norm=None: q and k are scaled by K^-1/4 each (q . k carries 1/sqrt(K))."""
    layer = make_layer("hla2", qk_norm=None, output_norm=False)
    x = hidden_states(1, 5, 32)
    q, k, _, _ = layer._heads(x)
    raw = (x @ layer.q_proj.weight.T).view(1, 5, 2, 16)
    assert torch.allclose(q, raw * 16 ** -0.25)
    assert k.shape == (1, 5, 2, 16) and layer.o_norm_weight is None
    o, _, _ = layer(x)
    assert torch.isfinite(o).all()


def test_cache_bookkeeping():
    c = HLACache()
    assert len(c) == 0 and c[3] is None and c.get_seq_length(2) == 0
    st = hla_fast.HLA2State(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 3))
    c.update(2, st, 5)
    c.update(2, st, 1)
    assert len(c) == 3 and c[2] is st and c[0] is None and c.get_seq_length(2) == 6 and c.get_seq_length(0) == 0
    assert "seen_tokens" in repr(c)
    c.reset()
    assert len(c) == 0 and c[2] is None
    with pytest.raises(TypeError, match="layer_idx"):
        c[-1]
    with pytest.raises(TypeError, match="layer_idx"):
        c.update(True, st, 1)
    with pytest.raises(TypeError, match="state"):
        c.update(0, torch.ones(2), 1)
    with pytest.raises(TypeError, match="state must be an HLA state NamedTuple .* got tuple"):
        c.update(0, (1, 2), 1)
    with pytest.raises(ValueError, match="n_tokens"):
        c.update(0, st, 0)


def test_two_layers_share_one_cache():
    a = make_layer("hla2", "data", seed=0)
    b = make_layer("hla2", "fixed", seed=1)
    b.layer_idx = 1
    x = hidden_states(1, 8, 32)
    full = b(a(x)[0])[0]
    cache, outs = None, []
    for t in range(8):
        h, _, cache = a(x[:, t:t + 1], past_key_values=cache, use_cache=True)
        o, _, cache = b(h, past_key_values=cache, use_cache=True)
        outs.append(o)
    assert len(cache) == 2 and cache.get_seq_length(0) == cache.get_seq_length(1) == 8
    assert rel(torch.cat(outs, 1), full) < TOL64


def test_bad_arguments():
    with pytest.raises(ValueError, match="order"):
        HigherOrderLinearAttention(32, 2, order="hla4")
    with pytest.raises(ValueError, match="gate"):
        HigherOrderLinearAttention(32, 2, gate="learned")
    with pytest.raises(ValueError, match="num_kv_heads"):
        HigherOrderLinearAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim"):
        HigherOrderLinearAttention(30, 4)
    with pytest.raises(ValueError, match="head_dim must be at most 256 .* got 300"):
        HigherOrderLinearAttention(32, 2, head_dim=300)
    assert HigherOrderLinearAttention(32, 2, head_dim=256).head_dim == 256
    with pytest.raises(ValueError, match="qk_norm"):
        HigherOrderLinearAttention(32, 2, qk_norm="rms")
    with pytest.raises(TypeError, match="normalize"):
        HigherOrderLinearAttention(32, 2, normalize=1)
    with pytest.raises(ValueError, match="backend"):
        HigherOrderLinearAttention(32, 2, backend="cuda")
    with pytest.raises(ValueError, match="layer_idx"):
        HigherOrderLinearAttention(32, 2, layer_idx=-1)
    # numbers: real, finite, in range, never a bool or a string
    for kw, err, msg in ((dict(eps=-1.0), ValueError, "eps must be a finite float >= 0"),
                         (dict(eps=True), TypeError, "eps must be a finite float >= 0"),
                         (dict(eps="a"), TypeError, "eps must be a finite float >= 0"),
                         (dict(norm_eps=0.0), ValueError, "norm_eps must be a finite float > 0"),
                         (dict(norm_eps=float("nan")), ValueError, "norm_eps must be a finite float > 0"),
                         (dict(norm_eps=True), TypeError, "norm_eps must be a finite float > 0"),
                         (dict(gate_logit_normalizer=float("inf")), ValueError, "gate_logit_normalizer must be"),
                         (dict(gate_logit_normalizer=True), TypeError, "gate_logit_normalizer must be"),
                         (dict(gate_bias_init=float("inf")), ValueError, "gate_bias_init must be a finite float"),
                         (dict(gate_bias_init="3"), TypeError, "gate_bias_init must be a finite float"),
                         (dict(gate_bias_init=True), TypeError, "gate_bias_init must be a finite float"),
                         (dict(chunk_size=0), ValueError, "chunk_size must be an int >= 1"),
                         (dict(chunk_size="16"), ValueError, "chunk_size must be an int >= 1")):
        with pytest.raises(err, match=msg):
            HigherOrderLinearAttention(32, 2, gate="data", **kw)
    layer = make_layer("hla2")
    x = hidden_states(1, 4, 32)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(x[..., :16])
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, attention_mask=torch.ones(1, 4))
    with pytest.raises(TypeError, match="use_cache"):
        layer(x, use_cache=1)
    with pytest.raises(TypeError, match="past_key_values"):
        layer(x, past_key_values={})
    with pytest.raises(TypeError, match="unexpected"):
        layer(x, output_attentions=False)
    layer.layer_idx = None
    with pytest.raises(ValueError, match="layer_idx"):
        layer(x, use_cache=True)


def test_missing_operator_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(hla_fast, "hla2_step")
    with pytest.raises(NotImplementedError, match="hla_fast.hla2_step"):
        HigherOrderLinearAttention(32, 2, order="hla2")


@pytest.mark.gpu
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("gate", GATES)
def test_layer_under_cuda_bf16_autocast(order, gate):
    """Under CUDA autocast the projections are bf16 while the l2 norm runs in fp32: the layer keeps
    q, k, v in one dtype, trains (finite gradients) and decodes, close to the fp32 layer."""
    layer = make_layer(order, gate, hidden=128, heads=2, kv_heads=1, head_dim=64, backend=None,
                       dtype=torch.float32, device="cuda")
    x = hidden_states(2, 100, 128, dtype=torch.float32, device="cuda").requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        o, _, _ = layer(x)
        inc, _ = _incremental(layer, x.detach(), [97, 1, 1, 1])
    assert o.dtype == torch.bfloat16
    o.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters()) and torch.isfinite(x.grad).all()
    with torch.no_grad():
        ref, _, _ = layer(x)
    # bf16 projections, kernel inputs and outputs against the fp32 layer: several bf16 roundings
    # (2^-8 relative each) compound through the two products of every index pair
    assert rel(o, ref) < 5e-2 and rel(inc, ref) < 5e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_zero_hidden_state_leaves_the_outputs_finite(dtype):
    """The l2 q/k norm runs in fp32: an all-zero hidden state (whose q and k are zero) gives
    zero q and k in every dtype (fp16 would round the norm's eps to 0 and divide 0 by 0), so no
    NaN reaches the state, the later tokens or the cache; its output is the fp32 layer's."""
    torch.manual_seed(4)
    layer = HigherOrderLinearAttention(32, 2, layer_idx=0, backend="torch")
    x = torch.randn(1, 6, 32)
    x[:, 2] = 0
    with torch.no_grad():
        want, _, _ = layer(x)
        got, _, cache = layer.to(dtype)(x.to(dtype), use_cache=True)
    assert torch.isfinite(got).all() and all(torch.isfinite(t).all() for t in cache[0] if t is not None)
    # a few roundings of the dtype through the projections, the operator and the norms
    assert float((got.double() - want.double()).norm() / want.double().norm()) < 8 * torch.finfo(dtype).eps

