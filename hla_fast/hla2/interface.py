"""Public entry points of the HLA2 operator: :func:`hla2` and :func:`hla2_step`."""
from __future__ import annotations

import torch

from .utils import (
    HLA2State,
    check_backend,
    check_eps,
    check_gamma,
    check_kernel_dtype,
    check_qkv,
    check_state,
    state_dtype,
)


def _check_common(q, k, v, gamma, normalize, eps, backend, seq):
    """The checks hla2 and hla2_step share; returns (shape dims, gamma, eps, backend)."""
    dims = check_qkv(q, k, v, seq=seq)
    g = check_gamma(gamma)
    eps = check_eps(eps)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    return dims, g, eps, check_backend(backend, q.device)


def _check_chunk(chunk_size, backend):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if backend == "triton":
        if chunk_size not in (16, 32, 64, 128):
            raise ValueError(f"chunk_size must be 16, 32, 64 or 128 on the triton backend, got {chunk_size}")
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def hla2(q, k, v, *, gamma=None, normalize=False, eps=1e-6, initial_state=None,
         output_final_state=False, chunk_size=64, backend=None):
    """Masked second-order HLA, decayed.

    o_t = sum_{i <= j <= t} gamma^(2t-i-j) (q_t . k_i)(q_j . k_i) v_j, divided by the same
    sum with v_j -> 1 plus eps when ``normalize``. No scaling is applied to q or k.

    Args:
        q, k: [B, T, H, K] float32, bfloat16 or float16 (float64 too on backend="torch").
        v: [B, T, H, V], same dtype and device as q.
        gamma: None (no decay) or a float in (0, 1].
        normalize: divide by the denominator (den + eps). The denominator is a signed
            sum and can cross zero; there the output is ill-conditioned.
        initial_state: HLA2State(S [B, H, K, K], W [B, H, K, V], z [B, H, K] if normalize),
            fp32 (float64 on the float64 torch path), or None for zeros.
        output_final_state: also return the state after the last token.
        chunk_size: rows per chunk (16, 32, 64 or 128 on the triton backend). The triton
            kernels take at most 32 rows for heads wider than 64, and the backward at most
            64 (measured layouts, see hla_fast/README.md); the result does not depend on it.
        backend: "triton", "torch" or None (triton for CUDA tensors, torch otherwise).

    Returns:
        (o [B, T, H, V] in v's dtype, HLA2State or None).
    """
    (B, T, H, K, V), g, eps, backend = _check_common(q, k, v, gamma, normalize, eps, backend, seq=True)
    _check_chunk(chunk_size, backend)
    if backend == "triton":
        check_kernel_dtype(q)
    st = check_state(initial_state, B, H, K, V, normalize, q.device, dtype=state_dtype(q.dtype))
    if backend == "torch":
        from .torch_backend import hla2_torch

        o, final = hla2_torch(q, k, v, g, normalize, eps, st, chunk_size)
        return o, (final if output_final_state else None)
    from .chunk import hla2_unnormalized

    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    s0 = st.S.contiguous() if st is not None else None
    w0 = st.W.contiguous() if st is not None else None
    o, sT, wT = hla2_unnormalized(qc, kc, vc, g, s0, w0, chunk_size)
    zT = None
    if normalize:
        # the denominator is the same operator with v -> 1: a second pass on a one-column value
        ones = torch.ones_like(vc[..., :1])
        z0 = st.z[..., None].contiguous() if st is not None else None
        den, _, zT = hla2_unnormalized(qc, kc, ones, g, s0, z0, chunk_size)
        o = (o.float() / (den.float() + eps)).to(v.dtype)
        zT = zT[..., 0]
    final = HLA2State(sT, wT, zT)
    return o, (final if output_final_state else None)


def hla2_step(q, k, v, state=None, *, gamma=None, normalize=False, eps=1e-6, backend=None):
    """One decode step of HLA2, O(K^2 + K V) per head.

    Args:
        q, k: [B, H, K]; v: [B, H, V] (same dtype and device).
        state: HLA2State(S [B, H, K, K], W [B, H, K, V], z [B, H, K] if normalize), fp32
            (float64 on the float64 torch path); None starts from zeros.
    Returns:
        (o [B, H, V] in v's dtype, new HLA2State). The input state is not modified.
    """
    (B, _, H, K, V), g, eps, backend = _check_common(q, k, v, gamma, normalize, eps, backend, seq=False)
    sd = state_dtype(q.dtype)
    if state is None:
        state = HLA2State(
            q.new_zeros(B, H, K, K, dtype=sd), q.new_zeros(B, H, K, V, dtype=sd),
            q.new_zeros(B, H, K, dtype=sd) if normalize else None,
        )
    st = check_state(state, B, H, K, V, normalize, q.device, name="state", dtype=sd)
    if backend == "triton":
        check_kernel_dtype(q)
        from .decode import hla2_step_triton

        return hla2_step_triton(q, k, v, st, g, normalize, eps)
    from .decode import hla2_step_torch

    return hla2_step_torch(q, k, v, st, g, normalize, eps)
