"""Bad input gives a clear error that names the offending argument, for every operator of the
contract (helpers.OPERATORS) and on both backends where the check is the backend's."""
import pytest

from .helpers import OPERATORS, rand_qkv, rand_state, rel, torch

import hla_fast
from hla_fast.ops.common.launch import min_key_block

OPS = pytest.mark.parametrize("op", OPERATORS, ids=lambda o: o.name)


def _qkv(B=1, T=5, H=2, K=8, V=4, **kw):
    return rand_qkv(B, T, H, K, V, **kw)


@OPS
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mismatched_shapes(op, backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k must have q's shape"):
        op.op(q, k[..., :4], v, backend=backend)
    with pytest.raises(ValueError, match="v must share q's leading dims"):
        op.op(q, k, v[:, :3], backend=backend)
    with pytest.raises(ValueError, match=r"q must have shape \[B, T, H, K\]"):
        op.op(q[0], k, v, backend=backend)
    with pytest.raises(ValueError, match=r"q must have shape \[B, H, K\]"):
        op.step(q, k, v, backend=backend)


@OPS
def test_not_tensors_wrong_dtypes_devices(op, device):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        op.op(q, k, v.numpy())
    with pytest.raises(TypeError, match="k has dtype"):
        op.op(q, k.double(), v)
    with pytest.raises(TypeError, match="v has dtype"):
        op.step(q[:, 0], k[:, 0], v[:, 0].half())
    with pytest.raises(TypeError, match="q, k, v must be float"):
        op.op(*(x.to(torch.int32) for x in (q, k, v)))
    with pytest.raises(TypeError, match="backend='triton' takes float32"):
        op.op(*(x.to(device, torch.float64) for x in (q, k, v)), backend="triton")
    with pytest.raises(ValueError, match="k is on meta"):
        op.op(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="v is on meta"):
        op.step(q[:, 0], k[:, 0], v[:, 0].to("meta"))


@OPS
def test_sizes(op):
    with pytest.raises(ValueError, match="K=257 is too large"):
        op.op(*_qkv(K=257))
    with pytest.raises(ValueError, match="V=300 is too large"):
        op.op(*_qkv(V=300))
    with pytest.raises(ValueError, match="V=257 is too large"):
        op.op(*_qkv(V=257), backend="triton")
    with pytest.raises(ValueError, match="T = 0"):
        op.op(*_qkv(T=0))


@OPS
@pytest.mark.parametrize("gamma", [0.0, -0.5, 1.5, float("nan")])
def test_gamma_out_of_range(op, gamma):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="gamma"):
        op.op(q, k, v, gamma=gamma)
    with pytest.raises(ValueError, match="gamma"):
        op.step(q[:, 0], k[:, 0], v[:, 0], gamma=gamma)


@OPS
@pytest.mark.parametrize("gamma", ["0.9", True, [0.9]])
def test_gamma_wrong_type(op, gamma):
    with pytest.raises(TypeError, match="gamma"):
        op.op(*_qkv(), gamma=gamma)


@OPS
def test_learnable_gamma_is_refused_with_a_pointer_to_g(op):
    q, k, v = _qkv()
    gamma = torch.tensor(0.9, requires_grad=True)
    with pytest.raises(TypeError, match="gamma is a tensor that requires grad.*pass log-gates g"):
        op.op(q, k, v, gamma=gamma)
    with pytest.raises(ValueError, match="gamma must be a single number"):
        op.op(q, k, v, gamma=torch.tensor([0.9, 0.8]))
    with pytest.raises(TypeError, match="gamma is a tensor on the meta device"):
        op.op(q, k, v, gamma=torch.tensor(0.9, device="meta"))
    o, _ = op.op(q, k, v, gamma=torch.tensor(0.9))  # a plain 0-d tensor is a number
    assert torch.isfinite(o).all()


@OPS
def test_bad_gates(op):
    q, k, v = _qkv(B=1, T=5, H=2)
    g = -0.1 * torch.rand(1, 5, 2)
    with pytest.raises(ValueError, match="either gamma .* or g"):
        op.op(q, k, v, gamma=0.9, g=g)
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H\] = \[1, 5, 2\] \(no broadcasting\)"):
        op.op(q, k, v, g=g[:, :, :1])
    with pytest.raises(ValueError, match=r"g must have shape \[B, H\]"):
        op.step(q[:, 0], k[:, 0], v[:, 0], g=g)
    with pytest.raises(TypeError, match="g must be a torch.Tensor"):
        op.op(q, k, v, g=g.numpy())
    with pytest.raises(TypeError, match="g must be a float tensor"):
        op.op(q, k, v, g=g.to(torch.int64))
    with pytest.raises(ValueError, match="g must hold finite log-gates <= 0"):
        op.op(q, k, v, g=-g)
    with pytest.raises(ValueError, match="g must hold finite log-gates <= 0"):
        op.op(q, k, v, g=torch.full_like(g, float("-inf")))
    with pytest.raises(ValueError, match="g is on meta"):
        op.op(q, k, v, g=g.to("meta"))


def test_finite_float_names_the_argument_and_its_bound():
    from hla_fast.ops.common.checks import check_finite_float
    assert check_finite_float(2, "x", above=0) == 2.0 and type(check_finite_float(2, "x")) is float
    assert check_finite_float(0, "x", at_least=0) == 0.0
    for bad, err, msg in ((True, TypeError, "x must be a finite float > 0, got bool True"),
                          ("1", TypeError, "x must be a finite float > 0, got str '1'"),
                          (1j, TypeError, "x must be a finite float > 0, got complex 1j"),
                          (0.0, ValueError, "x must be a finite float > 0, got 0.0"),
                          (float("nan"), ValueError, "x must be a finite float > 0, got nan"),
                          (float("inf"), ValueError, "x must be a finite float > 0, got inf")):
        with pytest.raises(err) as e:
            check_finite_float(bad, "x", above=0)
        assert str(e.value) == msg
    with pytest.raises(ValueError, match=r"y must be a finite float >= 0, got -1.0"):
        check_finite_float(-1, "y", at_least=0)


@OPS
def test_flags_and_numbers(op, device):
    q, k, v = _qkv(device=device)
    with pytest.raises(ValueError, match="eps"):
        op.op(q, k, v, eps=-1.0)
    with pytest.raises(ValueError, match="eps must be a finite float"):
        op.op(q, k, v, eps=float("inf"))
    with pytest.raises(TypeError, match="eps"):
        op.op(q, k, v, eps="1e-6")
    with pytest.raises(TypeError, match="normalize must be True or False"):
        op.op(q, k, v, normalize="yes")
    with pytest.raises(TypeError, match="normalize must be True or False"):
        op.step(q[:, 0], k[:, 0], v[:, 0], normalize=1)
    with pytest.raises(TypeError, match="output_final_state must be True or False"):
        op.op(q, k, v, output_final_state="no")
    with pytest.raises(ValueError, match="backend must be"):
        op.op(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="chunk_size"):
        op.op(q, k, v, chunk_size=48, backend="triton")
    with pytest.raises(ValueError, match="chunk_size"):
        op.op(q.cpu(), k.cpu(), v.cpu(), chunk_size=0, backend="torch")
    with pytest.raises(TypeError, match="chunk_size must be None or an int, got float"):
        op.op(q, k, v, chunk_size=16.0)
    with pytest.raises(TypeError, match="chunk_size must be None or an int, got bool"):
        op.op(q, k, v, chunk_size=True)
    with pytest.raises(TypeError, match="config must be a ChunkConfig"):
        op.op(q, k, v, backend="triton", config={"fwd_chunk": 16})


@OPS
def test_default_chunk_size(op, device):
    """chunk_size=None, the default, is 64 rows on the torch backend and, for fp32 inputs, the
    rule's layout for 64 on triton: the same computation, the same bits (only a bf16 forward of
    AHLA with 128-wide keys takes chunks of 128 by default, ``test_ahla_kernels``)."""
    q, k, v = _qkv(T=70, device=device)
    for backend, x in [("torch", (q.cpu(), k.cpu(), v.cpu())), ("triton", (q, k, v))]:
        assert torch.equal(op.op(*x, backend=backend)[0], op.op(*x, chunk_size=64, backend=backend)[0]), backend


@OPS
def test_config_is_the_triton_layout_alone(op, device):
    """A config sets the Triton kernels' whole layout: on the torch backend it is refused (not
    ignored), and a chunk_size beside it must be None or the config's own chunks (not ignored)."""
    q, k, v = _qkv(T=20, device=device)
    cfg = hla_fast.ChunkConfig(fwd_chunk=16, bwd_chunk=16, fwd_block_v=16)
    with pytest.raises(ValueError, match="config is a layout of the triton backend's kernels; backend 'torch'"):
        op.op(q, k, v, backend="torch", config=cfg)
    with pytest.raises(ValueError, match=r"chunk_size=32 asks for chunks the config does not have"):
        op.op(q, k, v, backend="triton", chunk_size=32, config=cfg)
    a, _ = op.op(q, k, v, backend="triton", chunk_size=16, config=cfg)
    b, _ = op.op(q, k, v, backend="triton", config=cfg)
    assert torch.equal(a, b)


def test_config_fields_are_checked():
    cfg = hla_fast.ChunkConfig()
    for field, bad in [("fwd_chunk", 48), ("bwd_chunk", True), ("fwd_segments", 0), ("bwd_warps", 3),
                       ("fwd_block_v", 24), ("grad_parts", (1, 2)), ("grad_parts", (3, 6)), ("grad_parts", [7]),
                       ("fwd_stages", 0), ("fwd_stages", 5), ("bwd_stages", True), ("bwd_stages", 2.0),
                       ("fwd_chunk", 64.0), ("fwd_warps", 4.0)]:
        with pytest.raises(ValueError, match=f"config.{field}"):
            cfg.replace(**{field: bad})
    with pytest.raises(TypeError, match="config.save_states"):
        cfg.replace(save_states=1)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="config.bwd_pieces must be an int >= 1"):
            cfg.replace(bwd_pieces=bad)
    # pieces need a backward walk of one segment: refused with the config, not at the backward
    with pytest.raises(ValueError, match="config.bwd_pieces=2 needs config.bwd_segments=1 .* got bwd_segments=3"):
        cfg.replace(bwd_pieces=2, bwd_segments=3)
    with pytest.raises(ValueError, match="config.bwd_pieces=4 needs config.bwd_segments=1"):
        hla_fast.ChunkConfig(bwd_segments=2, bwd_pieces=4)
    assert cfg.replace(bwd_pieces=2).bwd_pieces == 2 and cfg.replace(bwd_segments=2).bwd_segments == 2


@OPS
def test_backward_pieces_give_the_whole_walks_gradients(op, device):
    """config.bwd_pieces: every operator can walk its backward (hla3: its second stage's) in
    pieces, the last first, with the gradients of one walk."""
    q, k, v = _qkv(T=40, device=device)   # three chunks of 16: two pieces

    def grads(pieces):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        cfg = hla_fast.ChunkConfig(fwd_chunk=16, bwd_chunk=16, fwd_block_v=16, bwd_pieces=pieces)
        o, _ = op.op(*ins, gamma=0.9, backend="triton", config=cfg)
        o.square().sum().backward()
        return [x.grad for x in ins]

    for a, b in zip(grads(1), grads(2)):
        assert rel(b, a) < 1e-6


@OPS
def test_prefetch_only_where_the_operator_has_it(op, device):
    q, k, v = _qkv(device=device)
    for fields in ({"fwd_prefetch": True}, {"bwd_prefetch": True}):
        cfg = hla_fast.ChunkConfig(fwd_chunk=16, bwd_chunk=16, fwd_block_v=16, **fields)
        if op.module == "ahla":
            o, _ = op.op(q, k, v, backend="triton", config=cfg)   # its walks load ahead
            assert o.shape == v.shape
        else:
            with pytest.raises(ValueError, match=f"config.fwd_prefetch and config.bwd_prefetch must be False for "
                                                 f"{op.module}"):
                op.op(q, k, v, backend="triton", config=cfg)
    with pytest.raises(TypeError, match="config.fwd_prefetch"):
        cfg.replace(fwd_prefetch=1)


@OPS
def test_split_forward_only_where_the_operator_has_it(op, device):
    """config.fwd_output_pass / fwd_row_blocks: HLA2's forward (and HLA3's second stage) as a state
    walk and a pass over the chunks gives the one walk's outputs and gradients; AHLA refuses them."""
    # keys twice the narrowest key tile: two row blocks (of 16 on a CPU, of 64 on CUDA)
    q, k, v = _qkv(T=40, K=2 * min_key_block(torch.device(device)), device=device)
    cfg = hla_fast.ChunkConfig(fwd_chunk=32, bwd_chunk=32, fwd_block_v=16)   # two chunks
    split = cfg.replace(fwd_output_pass=True, fwd_row_blocks=2)
    two_walks = split.replace(fwd_two_walks=True)
    wide_out = two_walks.replace(fwd_output_block_v=32)   # outputs in one value block, the walks in two
    if op.module == "ahla":
        with pytest.raises(ValueError, match="config.fwd_output_pass must be False and config.fwd_row_blocks 1 "
                                             "for ahla"):
            op.op(q, k, v, backend="triton", config=two_walks)
        with pytest.raises(ValueError, match="config.fwd_output_pass must be False and config.fwd_row_blocks 1 "
                                             "for ahla"):
            op.op(q, k, v, backend="triton", config=split)
        with pytest.raises(ValueError, match="config.fwd_output_pass must be False and config.fwd_row_blocks 1 "
                                             "for ahla"):
            op.op(q, k, v, backend="triton", config=wide_out)
    else:
        def run(c):
            ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            o, _ = op.op(*ins, gamma=0.9, backend="triton", config=c)
            o.square().sum().backward()
            return [o] + [x.grad for x in ins]

        for layout in (split, two_walks, wide_out):
            for a, b in zip(run(cfg), run(layout)):
                assert rel(b, a) < 1e-6
    with pytest.raises(TypeError, match="config.fwd_output_pass"):
        cfg.replace(fwd_output_pass=1)
    for bad in (0, 3, True, 2.0):
        with pytest.raises(ValueError, match="config.fwd_row_blocks must be a power of two >= 1"):
            cfg.replace(fwd_output_pass=True, fwd_row_blocks=bad)
    with pytest.raises(ValueError, match="config.fwd_row_blocks must be 1 without fwd_output_pass"):
        cfg.replace(fwd_row_blocks=2)
    with pytest.raises(TypeError, match="config.fwd_two_walks must be True or False, got 1"):
        split.replace(fwd_two_walks=1)
    with pytest.raises(ValueError, match="config.fwd_two_walks must be False without fwd_output_pass"):
        cfg.replace(fwd_two_walks=True)
    with pytest.raises(ValueError, match="config.fwd_two_walks needs config.fwd_segments=1 .*, got 2"):
        split.replace(fwd_two_walks=True, fwd_segments=2)
    for bad in (8, 24, True, 32.0, "64"):
        with pytest.raises(ValueError, match=f"config.fwd_output_block_v must be a power of two >= 16, got {bad!r}"):
            split.replace(fwd_output_block_v=bad)
    with pytest.raises(ValueError, match="config.fwd_output_block_v must be None without fwd_output_pass .*, got 64"):
        cfg.replace(fwd_output_block_v=64)


@OPS
def test_stages_reach_the_launches(op, device):
    """config.fwd_stages / bwd_stages: every operator's forward launches (walk, summaries) and
    backward launches take them as Triton's num_stages, and the results do not depend on them."""
    from hla_fast.ops.common.compile import Recorder

    q, k, v = _qkv(T=40, device=device)   # three chunks of 16: two segments
    cfg = hla_fast.ChunkConfig(fwd_chunk=16, bwd_chunk=16, fwd_block_v=16, fwd_segments=2, bwd_segments=2,
                               grad_parts=(7,))
    chunk = __import__(f"hla_fast.ops.{op.module}.chunk", fromlist=["chunk"])
    # hla3's forward: the first stage's walk (ahla's without its second layer), then hla2's at rate 2
    fwd_names = {"hla2": ["hla2_fwd_kernel"], "ahla": ["ahla_fwd_kernel"],
                 "hla3": ["ahla_fwd_kernel", "hla2_fwd_kernel"]}[op.module]
    outs = []
    for fs, bs in ((1, 1), (3, 2)):
        rec = Recorder()
        c = cfg.replace(fwd_stages=fs, bwd_stages=bs)
        q_, k_, v_ = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o, _ = op.op(q_, k_, v_, gamma=0.9, backend="triton", config=c)
        o.sum().backward()
        outs.append((o, q_.grad, k_.grad, v_.grad))
        state0 = {"hla2": (None,) * 3, "ahla": (None,) * 4, "hla3": (None,)}[op.module]
        with torch.no_grad():   # the operator's own forward, its launches recorded (nothing runs)
            getattr(chunk, f"{op.module}_chunked")(q, k, v, None, 0.9, *state0, False, 0.0, c, 16, launch=rec)
        for fwd_name in fwd_names:
            walks = [kw["num_stages"] for kern, _, kw in rec.launches
                     if kern.fn.__name__ in (fwd_name, fwd_name.replace("fwd_kernel", "fwd_summary_kernel"))]
            assert len(walks) == 2 and set(walks) == {fs}
        rec = Recorder()
        if op.module == "hla3":
            # its second stage's backward (the first stage's per-layer kernels keep their own stages,
            # ahla.chunk.DH_STAGES and LAYER_STAGES, as AHLA's layered backward does)
            from hla_fast.ops.hla2 import chunk as hla2_chunk

            hla2_chunk.bwd_launch(q, k, v, torch.ones_like(v), None, 0.9, None, None, None, None, c, rate=2,
                                  launch=rec)
        else:
            chunk.bwd_launch(q, k, v, torch.ones_like(v), None, 0.9, None, None, None, None, c, launch=rec)
        stages = {kern.fn.__name__: kw.get("num_stages") for kern, _, kw in rec.launches}
        assert stages[fwd_names[-1]] == bs   # the backward's recomputing walk (hla3: its second stage's)
        assert all(s == bs for name, s in stages.items() if "fold" not in name), stages
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@OPS
def test_layered_backward_only_where_the_operator_has_it(op, device):
    """config.bwd_layers: AHLA's backward as two first-order layers; the others refuse it, and
    AHLA refuses it beside the coupled walk's own fields (segments, pieces, loading ahead)."""
    q, k, v = _qkv(device=device)
    cfg = hla_fast.ChunkConfig(fwd_chunk=16, bwd_chunk=16, fwd_block_v=16, bwd_layers=True)
    if op.module == "ahla":
        o, _ = op.op(q, k, v, backend="triton", config=cfg)
        assert o.shape == v.shape
        for bad in ({"bwd_segments": 2}, {"bwd_pieces": 2}, {"bwd_prefetch": True}, {"bwd_stages": 2}):
            with pytest.raises(ValueError, match=r"layered backward \(config.bwd_layers\) walks each layer whole"):
                op.op(q, k, v, backend="triton", config=cfg.replace(**bad))
    else:
        with pytest.raises(ValueError, match=f"config.bwd_layers must be False for {op.module}"):
            op.op(q, k, v, backend="triton", config=cfg)
    with pytest.raises(TypeError, match="config.bwd_layers"):
        cfg.replace(bwd_layers="yes")


@OPS
def test_cpu_tensors_to_triton_without_interpreter(op, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        op.op(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        op.step(q[:, 0], k[:, 0], v[:, 0], backend="triton")


@OPS
def test_bad_states(op):
    q, k, v = _qkv(B=1, H=2, K=8, V=4)
    good = rand_state(op, 1, 2, 8, 4, False)
    first = good._fields[0]
    want = r"\[" + ", ".join(map(str, getattr(good, first).shape)) + r"\]"
    with pytest.raises(ValueError, match=rf"initial_state.{first} must have shape {want}"):
        op.op(q, k, v, initial_state=good._replace(**{first: torch.zeros(1, 2, 8, 9)}))
    with pytest.raises(TypeError, match=rf"initial_state.{first} must be torch.float32"):
        op.op(q, k, v, initial_state=good._replace(**{first: getattr(good, first).double()}))
    norm_field = next(f for f in good._fields if f in op.norm_fields)
    with pytest.raises(ValueError, match=rf"initial_state.{norm_field} is None.*normalize=True"):
        op.op(q, k, v, normalize=True, initial_state=good)
    with pytest.raises(TypeError, match=f"initial_state must be a {op.State.__name__}"):
        op.op(q, k, v, initial_state=torch.zeros(3))
    second = good._fields[1]  # a [B, H, K, V] part
    with pytest.raises(ValueError, match=rf"state.{second} must have shape \[1, 2, 8, 4\]"):
        op.step(q[:, 0], k[:, 0], v[:, 0], good._replace(**{second: torch.zeros(1, 2, 8, 8)}))
