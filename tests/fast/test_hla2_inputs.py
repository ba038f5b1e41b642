"""Bad input gives a clear error that names the offending argument."""
import pytest

from .helpers import rand_qkv, torch

import hla_fast


def _qkv(B=1, T=5, H=2, K=8, V=4, **kw):
    return rand_qkv(B, T, H, K, V, **kw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mismatched_shapes(backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k must have q's shape"):
        hla_fast.hla2(q, k[..., :4], v, backend=backend)
    with pytest.raises(ValueError, match="v must share q's leading dims"):
        hla_fast.hla2(q, k, v[:, :3], backend=backend)
    with pytest.raises(ValueError, match=r"q must have shape \[B, T, H, K\]"):
        hla_fast.hla2(q[0], k, v, backend=backend)


def test_not_a_tensor():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        hla_fast.hla2(q, k, v.numpy())


def test_head_size_too_large():
    q, k, v = _qkv(K=257, V=4)
    with pytest.raises(ValueError, match="K=257 is too large"):
        hla_fast.hla2(q, k, v)
    q, k, v = _qkv(K=8, V=300)
    with pytest.raises(ValueError, match="V=300 is too large"):
        hla_fast.hla2(q, k, v)


def test_empty_sequence():
    q, k, v = _qkv(T=0)
    with pytest.raises(ValueError, match="T = 0"):
        hla_fast.hla2(q, k, v)


@pytest.mark.parametrize("gamma", [0.0, -0.5, 1.5, float("nan")])
def test_gamma_out_of_range(gamma):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="gamma"):
        hla_fast.hla2(q, k, v, gamma=gamma)
    with pytest.raises(ValueError, match="gamma"):
        hla_fast.hla2_step(q[:, 0], k[:, 0], v[:, 0], gamma=gamma)


@pytest.mark.parametrize("gamma", ["0.9", True, [0.9]])
def test_gamma_wrong_type(gamma):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="gamma"):
        hla_fast.hla2(q, k, v, gamma=gamma)


def test_mixed_dtypes():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="k has dtype"):
        hla_fast.hla2(q, k.double(), v)
    with pytest.raises(TypeError, match="v has dtype"):
        hla_fast.hla2_step(q[:, 0], k[:, 0], v[:, 0].half())


def test_integer_inputs():
    q, k, v = (x.to(torch.int32) for x in _qkv())
    with pytest.raises(TypeError, match="q, k, v must be float"):
        hla_fast.hla2(q, k, v)


def test_float64_not_on_triton():
    q, k, v = _qkv(dtype=torch.float64)
    with pytest.raises(TypeError, match="backend='triton' takes float32"):
        hla_fast.hla2(q, k, v, backend="triton")


def test_mixed_devices():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k is on meta"):
        hla_fast.hla2(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="v is on meta"):
        hla_fast.hla2_step(q[:, 0], k[:, 0], v[:, 0].to("meta"))


def test_cpu_tensors_to_triton_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv()
    if q.is_cuda:
        pytest.skip("CPU-only check")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        hla_fast.hla2(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        hla_fast.hla2_step(q[:, 0], k[:, 0], v[:, 0], backend="triton")


def test_unknown_backend():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend must be"):
        hla_fast.hla2(q, k, v, backend="cuda")


def test_bad_chunk_size():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="chunk_size"):
        hla_fast.hla2(q, k, v, chunk_size=48, backend="triton")
    with pytest.raises(ValueError, match="chunk_size"):
        hla_fast.hla2(q, k, v, chunk_size=0, backend="torch")
    with pytest.raises(TypeError, match="chunk_size"):
        hla_fast.hla2(q, k, v, chunk_size=16.0)


def test_bad_eps_and_normalize():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="eps"):
        hla_fast.hla2(q, k, v, eps=-1.0)
    with pytest.raises(TypeError, match="normalize"):
        hla_fast.hla2(q, k, v, normalize="yes")


def test_bad_initial_state():
    q, k, v = _qkv(B=1, H=2, K=8, V=4)
    good = hla_fast.HLA2State(torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 4))
    with pytest.raises(ValueError, match=r"initial_state.S must have shape \[1, 2, 8, 8\]"):
        hla_fast.hla2(q, k, v, initial_state=good._replace(S=torch.zeros(1, 2, 8, 9)))
    with pytest.raises(ValueError, match=r"initial_state.W must have shape"):
        hla_fast.hla2(q, k, v, initial_state=good._replace(W=torch.zeros(1, 2, 4, 8)))
    with pytest.raises(TypeError, match="initial_state.S must be torch.float32"):
        hla_fast.hla2(q, k, v, initial_state=good._replace(S=good.S.double()))
    with pytest.raises(ValueError, match="initial_state.z is None"):
        hla_fast.hla2(q, k, v, normalize=True, initial_state=good)
    with pytest.raises(TypeError, match="initial_state must be an HLA2State"):
        hla_fast.hla2(q, k, v, initial_state=torch.zeros(3))


def test_bad_decode_state():
    q, k, v = _qkv(B=1, H=2, K=8, V=4)
    with pytest.raises(ValueError, match=r"state.W must have shape \[1, 2, 8, 4\]"):
        hla_fast.hla2_step(q[:, 0], k[:, 0], v[:, 0],
                           hla_fast.HLA2State(torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8)))
    with pytest.raises(ValueError, match=r"q must have shape \[B, H, K\]"):
        hla_fast.hla2_step(q, k, v)


def test_triton_head_size_limit():
    # the triton backend takes every head size the torch one takes (up to 256), no more
    for K, V, name in ((257, 8, "K=257"), (8, 257, "V=257")):
        q, k, v = _qkv(K=K, V=V)
        with pytest.raises(ValueError, match=f"{name} is too large"):
            hla_fast.hla2(q, k, v, backend="triton")
