"""Public entry points of the HLA2 operator: :func:`hla2` and :func:`hla2_step`."""
from __future__ import annotations

from ..common.checks import check_call, check_sequence_options, check_state, zero_state
from ..common.config import chunk_or_default
from ..common.gates import call_gates
from ..common.autograd import autograd_records
from ..common.varlen import varlen_call
from .state import HLA2State


def _state_shapes(B, H, K, V, normalize):
    """HLA2State's field shapes (None: a field this call does not keep)."""
    return {"S": (B, H, K, K), "W": (B, H, K, V), "z": (B, H, K) if normalize else None}


def _check_state(state, B, H, K, V, normalize, q, name):
    return check_state(state, HLA2State, _state_shapes(B, H, K, V, normalize), {"z"}, q, name)


def hla2(q, k, v, *, gamma=None, g=None, normalize=False, eps=1e-6, initial_state=None,
         output_final_state=False, chunk_size=None, backend=None, config=None, cu_seqlens=None):
    """Masked second-order HLA with a constant decay or per-token gates.

    o_t = sum_{i <= j <= t} exp(2 b_t - b_i - b_j) (q_t . k_i)(q_j . k_i) v_j with
    b_t = sum_{s <= t} g_s (g = log(gamma) for a constant decay), divided by the same sum with
    v_j -> 1 plus eps when ``normalize``. No scaling is applied to q or k.

    Args:
        q, k: [B, T, H, K] float32, bfloat16 or float16 (float64 too on backend="torch").
        v: [B, T, H, V], same dtype and device as q.
        gamma: None (no decay) or a float in (0, 1] (not a tensor that requires grad: use g).
        g: None or log-gates [B, T, H] (every value <= 0: the factor exp(g) in (0, 1] per token
            and head; flash-linear-attention's convention); exclusive with gamma. Differentiable.
            Below float64, a value under -30 counts as -30 (a factor of 9e-14: the gate still
            closes, and its chunk's later sums keep their digits; ``ops/common/gates.py``).
        normalize: divide by the denominator (den + eps). The denominator is a signed sum and
            can cross zero; there the output is ill-conditioned.
        eps: finite float >= 0.
        initial_state: HLA2State(S [B, H, K, K], W [B, H, K, V], z [B, H, K] if normalize),
            fp32 (float64 on the float64 torch path), or None for zeros. Differentiable.
        output_final_state: also return the state after the last token.
        chunk_size: None (the default: 64 rows on the torch backend, ``hla2_config``'s chunks
            on triton) or the rows per chunk: 16, 32, 64 or 128 on triton (the rule may take
            fewer), >= 1 on torch. The result does not depend on it.
        backend: "triton", "torch" or None (triton for CUDA tensors, torch otherwise).
        config: a ChunkConfig for the triton backend (None: ``hla2_config``'s measured rule); its
            chunks are the call's (chunk_size None or the same). Refused on the torch backend.
        cu_seqlens: None, or int32 offsets [N + 1] of N sequences packed along T (B == 1);
            initial_state and the final state then have N rows. Runs as a padded batch of N
            (``hla_fast/ops/common/varlen.py``: exact; costs N * max length rows).

    Returns:
        (o [B, T, H, V] in v's dtype, HLA2State or None).
    """
    if cu_seqlens is not None:  # packed sequences: a padded batch on the same kernels
        return varlen_call(hla2, q, k, v, cu_seqlens, gamma=gamma, g=g, normalize=normalize, eps=eps,
                           initial_state=initial_state, output_final_state=output_final_state,
                           chunk_size=chunk_size, backend=backend, config=config)
    (B, T, H, K, V), gamma, g, eps, backend = check_call(q, k, v, gamma, g, normalize, eps, backend, seq=True)
    check_sequence_options(output_final_state, chunk_size, backend, config)
    st = _check_state(initial_state, B, H, K, V, normalize, q, "initial_state")
    if backend == "torch":
        from .torch_backend import hla2_torch

        o, final = hla2_torch(q, k, v, call_gates(g, gamma, q), normalize, eps, st, chunk_or_default(chunk_size))
        return o, (final if output_final_state else None)
    from .chunk import hla2_chunked

    s0, w0, z0 = (None, None, None) if st is None else (st.S.contiguous(), st.W.contiguous(),
                                                         None if st.z is None else st.z.contiguous())
    o, sT, wT, zT = hla2_chunked(q.contiguous(), k.contiguous(), v.contiguous(),
                                 None if g is None else g.contiguous(), gamma, s0, w0, z0, normalize, eps, config, chunk_size)
    return o, (HLA2State(sT, wT, zT) if output_final_state else None)


def hla2_step(q, k, v, state=None, *, gamma=None, g=None, normalize=False, eps=1e-6, backend=None):
    """One decode step of HLA2, O(K^2 + K V) per head.

    Args:
        q, k: [B, H, K]; v: [B, H, V] (same dtype and device).
        state: HLA2State(S [B, H, K, K], W [B, H, K, V], z [B, H, K] if normalize), fp32
            (float64 on the float64 torch path); None starts from zeros.
        gamma: None or a float in (0, 1]; g: None or log-gates [B, H] (<= 0), exclusive.
    Returns:
        (o [B, H, V] in v's dtype, new HLA2State). The input state is not modified. The Triton
        kernel has no backward: while autograd records (an input requires grad), the step runs
        on the torch path, which differentiates it.
    """
    (B, _, H, K, V), gamma, g, eps, backend = check_call(q, k, v, gamma, g, normalize, eps, backend, seq=False)
    if state is None:
        state = zero_state(HLA2State, _state_shapes(B, H, K, V, normalize), q)
    st = _check_state(state, B, H, K, V, normalize, q, "state")
    from .decode import hla2_step_torch, hla2_step_triton

    if backend == "triton" and not autograd_records(q, k, v, g, *st):
        return hla2_step_triton(q, k, v, st, g, gamma, normalize, eps)
    return hla2_step_torch(q, k, v, st, g, gamma, normalize, eps)
