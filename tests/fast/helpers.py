"""Shared helpers of the hla_fast tests: random inputs, float64 truth from hla_ref."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")


def rand_qkv(B, T, H, K, V, *, seed=0, scale=0.5, positive=False, dtype=None, device="cpu"):
    """Fresh random q, k: [B, T, H, K], v: [B, T, H, V] (never zeros).

    positive=True draws q, k from (0, 1): the denominator of normalize then stays > 0.
    """
    g = torch.Generator().manual_seed(seed)
    if positive:
        q = torch.rand(B, T, H, K, generator=g) * scale
        k = torch.rand(B, T, H, K, generator=g) * scale
    else:
        q = torch.randn(B, T, H, K, generator=g) * scale
        k = torch.randn(B, T, H, K, generator=g) * scale
    v = torch.randn(B, T, H, V, generator=g)
    dtype = dtype or torch.float32
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def _per_head(op, q, k, v, gamma, normalize, eps):
    """Apply a single-head NumPy operator ``op(Q, K, V, gamma=, normalize=, eps=)`` in float64 to
    every (batch, head) of q, k: [B, T, H, K], v: [B, T, H, V]. Returns [B, T, H, V] float64."""
    B, T, H, _ = q.shape
    out = np.zeros((B, T, H, v.shape[-1]))
    qn, kn, vn = (x.detach().double().cpu().numpy() for x in (q, k, v))
    for b in range(B):
        for h in range(H):
            out[b, :, h] = op(qn[b, :, h], kn[b, :, h], vn[b, :, h],
                              gamma=1.0 if gamma is None else gamma, normalize=normalize, eps=eps)
    return torch.from_numpy(out)


def ref_hla2(q, k, v, gamma=None, normalize=False, eps=1e-6):
    """hla_ref.hla2_naive in float64, per batch and head. Returns [B, T, H, V] float64."""
    import hla_ref

    return _per_head(hla_ref.hla2_naive, q, k, v, gamma, normalize, eps)


def brute_hla2(q, k, v, gamma=None, normalize=False, eps=1e-6):
    """The index-sum definition of tests/ref/brute.py (float64, O(T^3) memory: small T only),
    per batch and head. Returns [B, T, H, V] float64."""
    from ref import brute  # tests/ is on sys.path: pytest puts it there for these packages

    return _per_head(brute.hla2, q, k, v, gamma, normalize, eps)


def rel(a, b):
    """||a - b|| / ||b|| in float64; NaN anywhere fails."""
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values in the result"
    return float((a - b).norm() / b.norm())
