"""Public entry points of the masked third-order operator: :func:`hla3` and :func:`hla3_step`."""
from __future__ import annotations

from ..common.checks import check_call, check_sequence_options, check_state, zero_state
from ..common.config import chunk_or_default
from ..common.gates import call_gates
from ..common.autograd import autograd_records
from ..common.varlen import varlen_call
from .state import HLA3State

# widest key head one Triton program holds (S is a K x K fp32 tile beside two K x BV ones)
TRITON_MAX_K = 128


def _state_shapes(B, H, K, V, normalize):
    """HLA3State's field shapes (None: a field this call does not keep)."""
    return {"S": (B, H, K, K), "P": (B, H, K, V), "F": (B, H, K, V),
            "p": (B, H, K) if normalize else None, "f": (B, H, K) if normalize else None}


def _check_state(state, B, H, K, V, normalize, q, name):
    return check_state(state, HLA3State, _state_shapes(B, H, K, V, normalize), {"p", "f"}, q, name)


def hla3(q, k, v, *, gamma=None, g=None, normalize=False, eps=1e-6, initial_state=None,
         output_final_state=False, chunk_size=None, backend=None, config=None, cu_seqlens=None):
    """Masked third-order HLA with a constant decay or per-token gates.

    o_t = sum_{i <= u, j <= u, u <= t} exp(3 b_t - b_i - b_u - b_j) (q_t . k_i)(k_i . q_u)(q_u . k_j) v_j
    with b_t = sum_{s <= t} g_s (g = log(gamma) for a constant decay), divided by the same sum with
    v_j -> 1 plus eps when ``normalize``. This is ``hla_ref.hla3_naive(variant="masked")``; the
    operator of the paper's Algorithm 3 (``variant="paper"``) is not implemented here. No scaling
    is applied to q or k: the terms are cubic in q . k, so keep |q . k| near 1 (e.g. L2-normalized
    q and k) for long sequences (hla_fast/README.md, third order).

    Args:
        q, k: [B, T, H, K] float32, bfloat16 or float16 (float64 too on backend="torch"); K <= 128
            on backend="triton".
        v: [B, T, H, V], same dtype and device as q.
        gamma: None (no decay) or a float in (0, 1] (not a tensor that requires grad: use g).
        g: None or log-gates [B, T, H] (every value <= 0); exclusive with gamma. Differentiable.
            Below float64, a value under -30 counts as -30 (``ops/common/gates.py``).
        normalize: divide by the denominator (den + eps). The denominator is a signed sum and
            can cross zero; there the output is ill-conditioned.
        eps: finite float >= 0.
        initial_state: HLA3State(S [B, H, K, K], P [B, H, K, V], F [B, H, K, V], p [B, H, K],
            f [B, H, K] (p, f if normalize)), fp32 (float64 on the float64 torch path), or None for
            zeros. Differentiable.
        output_final_state: also return the state after the last token.
        chunk_size: None (the default, 64) or 16, 32, 64 or 128 (>= 1 on torch): the rows per
            chunk of the torch backend, and on the triton backend a bound on them (the stages'
            rules, ``hla2_config``'s and ``ahla_config``'s, take it or less); the result does not
            depend on it.
        backend: "triton", "torch" or None (triton for CUDA tensors, torch otherwise).
        config: the triton backend's layout: a ChunkConfig for both stages, a tuple
            (first stage's, second stage's), or None for the rule's pair (``stage_rules`` in
            ``hla_fast/ops/hla3/chunk.py``: ``hla3_config`` for the second, HLA2's rule at rate
            2, its fused kernels or first-order layers, and AHLA's for the first, its first
            layer, or the layers' walk). The first stage reads fwd_chunk, fwd_segments,
            fwd_warps, fwd_stages, fwd_block_v, fwd_prefetch, bwd_chunk, bwd_warps and
            save_states; the second, on HLA2's fused kernels, those but fwd_prefetch, and
            bwd_segments, bwd_stages, grad_parts, bwd_pieces, fwd_output_pass and
            fwd_row_blocks; with ``layers`` (two first-order layers) the first stage's fields,
            and ``fwd_shared_walk`` (one config, not a pair: R and K' in one forward walk). Its
            chunks are the call's (chunk_size None or the same). Refused on the torch backend.
        cu_seqlens: None, or int32 offsets [N + 1] of N sequences packed along T (B == 1);
            initial_state and the final state then have N rows. Runs as a padded batch of N
            (``hla_fast/ops/common/varlen.py``: exact; costs N * max length rows).

    Returns:
        (o [B, T, H, V] in v's dtype, HLA3State or None).
    """
    if cu_seqlens is not None:  # packed sequences: a padded batch on the same kernels
        return varlen_call(hla3, q, k, v, cu_seqlens, gamma=gamma, g=g, normalize=normalize, eps=eps,
                           initial_state=initial_state, output_final_state=output_final_state,
                           chunk_size=chunk_size, backend=backend, config=config)
    (B, T, H, K, V), gamma, g, eps, backend = check_call(q, k, v, gamma, g, normalize, eps, backend, seq=True,
                                                         op="hla3", triton_max_k=TRITON_MAX_K)
    check_sequence_options(output_final_state, chunk_size, backend, config, stages=2)
    st = _check_state(initial_state, B, H, K, V, normalize, q, "initial_state")
    if backend == "torch":
        from .torch_backend import hla3_torch

        o, final = hla3_torch(q, k, v, call_gates(g, gamma, q), normalize, eps, st, chunk_or_default(chunk_size))
        return o, (final if output_final_state else None)
    from .chunk import hla3_chunked

    o, final = hla3_chunked(q.contiguous(), k.contiguous(), v.contiguous(), None if g is None else g.contiguous(),
                            gamma, st, normalize, eps, config, chunk_size)
    return o, (final if output_final_state else None)


def hla3_step(q, k, v, state=None, *, gamma=None, g=None, normalize=False, eps=1e-6, backend=None):
    """One decode step of HLA3, O(K^2 + K V) per head.

    Args:
        q, k: [B, H, K]; v: [B, H, V] (same dtype and device).
        state: HLA3State(S [B, H, K, K], P [B, H, K, V], F [B, H, K, V], p, f [B, H, K] if
            normalize), fp32 (float64 on the float64 torch path); None starts from zeros.
        gamma: None or a float in (0, 1]; g: None or log-gates [B, H] (<= 0), exclusive.
    Returns:
        (o [B, H, V] in v's dtype, new HLA3State). The input state is not modified. The Triton
        kernel has no backward: while autograd records (an input requires grad), the step runs
        on the torch path, which differentiates it.
    """
    (B, _, H, K, V), gamma, g, eps, backend = check_call(q, k, v, gamma, g, normalize, eps, backend, seq=False,
                                                         op="hla3", triton_max_k=TRITON_MAX_K)
    if state is None:
        state = zero_state(HLA3State, _state_shapes(B, H, K, V, normalize), q)
    st = _check_state(state, B, H, K, V, normalize, q, "state")
    from .decode import hla3_step_torch, hla3_step_triton

    if backend == "triton" and not autograd_records(q, k, v, g, *st):
        return hla3_step_triton(q, k, v, st, g, gamma, normalize, eps)
    return hla3_step_torch(q, k, v, st, g, gamma, normalize, eps)
