"""Vectorized pure-torch chunked AHLA (the ``backend="torch"`` path).

Everything inside a chunk is batched over all chunks at once (matrix products on
``[B, H, NT, C, C]`` tiles); only the small state recurrence between chunks is a Python loop.
Autograd differentiates through it (the gates' gradient too), so it doubles as a second reference
for the Triton kernels (run it on float64 tensors for a tight one).

AHLA is first-order linear attention applied twice: R_i = sum_{j <= i} exp(b_i - b_j)(q_i.k_j) v_j
and o_t = sum_{i <= t} exp(b_t - b_i)(q_t.k_i) R_i. One chunk (local rows r, carried state (P0, E0)
decayed to the chunk start, chunk-local cumulative log-gates beta, the factors G, g1, gl, gC of
``hla_fast/ops/common/gates.py``):

    A = (Q K^T) o G,   Kg = diag(gl) K
    R = diag(g1) Q P0 + A V,          O = diag(g1) Q E0 + A R
    P <- gC P0 + Kg^T V,              E <- gC E0 + Kg^T R

Since R is linear in P0, E's update reads Kg^T R = (Kg^T diag(g1) Q) P0 + Kg^T A V: both products
are batched over the chunks first, and the loop over chunks only does E <- gC E + M_c P + N_c and
P <- gC P + D_c. Every exponent is <= 0. The normalizer is one more value column of ones. The
chunk is capped at T, so a large ``chunk_size`` on a short sequence allocates no more than the
sequence needs.
"""
from __future__ import annotations

import torch

from ..common.gates import chunk_decay_tiles
from ..common.torch_chunks import chunk_inputs, from_chunks, run_with_normalizer
from .state import AHLAState


def ahla_chunk_torch(q, k, v, g=None, initial_state=None, chunk_size=64):
    """Unnormalized chunked AHLA in torch.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-gates or None (no decay), all in the
    compute dtype; initial_state: (P [B, H, K, V], E [B, H, K, V]) or None.
    Returns o [B, T, H, V] and the final (P, E) in the compute dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = q.dtype
    C, NT, Q, Kc, Vc, beta, valid = chunk_inputs(q, k, v, g, chunk_size)  # Q, Kc, Vc: [B, H, NT, C, *]
    G, g1, gl, gC = chunk_decay_tiles(beta, valid)

    A = (Q @ Kc.transpose(-1, -2)) * G                         # [B, H, NT, C, C]
    AV = A @ Vc                                               # [B, H, NT, C, V]
    Kgt = (Kc * gl[..., None]).transpose(-1, -2)              # [B, H, NT, K, C]
    Qg = Q * g1[..., None]                                    # diag(g1) Q
    D = Kgt @ Vc                                              # P's increment       [B, H, NT, K, V]
    M = Kgt @ Qg                                              # E's gain on P0      [B, H, NT, K, K]
    N = Kgt @ AV                                              # E's increment       [B, H, NT, K, V]

    if initial_state is None:
        P, E = q.new_zeros(B, H, K, V), q.new_zeros(B, H, K, V)
    else:
        P, E = initial_state[0].to(dt), initial_state[1].to(dt)
    P0s, E0s = [], []
    for c in range(NT):  # the only sequential part: states at chunk starts
        P0s.append(P)
        E0s.append(E)
        gc = gC[:, :, c, None, None]
        E = gc * E + M[:, :, c] @ P + N[:, :, c]
        P = gc * P + D[:, :, c]
    P0 = torch.stack(P0s, dim=2)  # [B, H, NT, K, V]
    E0 = torch.stack(E0s, dim=2)

    R = Qg @ P0 + AV                                          # [B, H, NT, C, V]
    O = Qg @ E0 + A @ R
    O = from_chunks(O, T)                                     # [B, T, H, V]
    return O, P, E


def ahla_torch(q, k, v, g=None, normalize=False, eps=1e-6, initial_state=None, chunk_size=64):
    """Torch backend entry. Computes in fp32 (float64 for float64 inputs).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-gates or None; initial_state: AHLAState
    or None. Returns (o [B, T, H, V] in v's dtype, AHLAState)."""
    return run_with_normalizer(ahla_chunk_torch, AHLAState, {"P": "p", "E": "e"}, q, k, v, g, normalize, eps, initial_state,
                               chunk_size)
