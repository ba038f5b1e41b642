"""Vectorized pure-torch chunked HLA3 (the ``backend="torch"`` path).

Everything inside a chunk is batched over all chunks at once (matrix products on
``[B, H, NT, C, C]`` tiles); only the small state recurrences between chunks are Python loops.
Autograd differentiates through it (the gates' gradient too), so it doubles as a second reference
for the Triton kernels (run it on float64 tensors for a tight one).

Chunk form (one chunk, local rows r, carried state (S0, P0, F0), chunk-local cumulative log-gates
beta, decay factors G, g1, gl, gC as in ``hla_fast/ops/common/gates.py``; the derivation is in
``chunk_kernels.py``'s docstring):

    X  = Q K^T,  Wc = X o G
    R  = diag(g1) Q P0 + Wc V                                 (row u: q_u^T P_u)
    M  = (diag(g1) Q S0 Q^T) o G^2 + (X Wc^T) o G^3           (lower triangle)
    O  = diag(g1^3) Q F0 + M R
    S <- gC S0 + K^T diag(gl) K,    P <- gC P0 + K^T diag(gl) V
    F <- gC^3 F0 + gC S0 Q^T diag(gl^2) R + K^T Wc^T diag(gl^3) R

Every exponent is <= 0, so no factor exceeds 1. The normalizer is one more value column of ones.
The chunk is capped at T, so a large ``chunk_size`` on a short sequence allocates no more than
the sequence needs.
"""
from __future__ import annotations

import torch

from ..common.gates import chunk_decay_tiles
from ..common.torch_chunks import chunk_inputs, from_chunks, run_with_normalizer
from .state import HLA3State


def hla3_chunk_torch(q, k, v, g=None, initial_state=None, chunk_size=64):
    """Unnormalized chunked HLA3 in torch.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-gates or None (no decay), all in the
    compute dtype; initial_state: (S [B, H, K, K], P [B, H, K, V], F [B, H, K, V]) or None.
    Returns o [B, T, H, V] and the final (S, P, F) in the compute dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt, dev = q.dtype, q.device
    C, NT, Q, Kc, Vc, beta, valid = chunk_inputs(q, k, v, g, chunk_size)  # Q, Kc, Vc: [B, H, NT, C, *]
    G, g1, gl, gC = chunk_decay_tiles(beta, valid)
    L = torch.ones(C, C, device=dev, dtype=torch.bool).tril()
    zero = torch.zeros((), device=dev, dtype=dt)
    Qt = Q.transpose(-1, -2)

    # X o L: every product uses X[t, i] with i <= t (a selection, so a non-finite later key
    # does not enter earlier rows through it)
    X = torch.where(L, Q @ Kc.transpose(-1, -2), zero)       # [B, H, NT, C, C]
    Wc = torch.where(L, X * G, zero)
    Kg = Kc * gl[..., None]                                   # diag(gl) K
    dS = Kg.transpose(-1, -2) @ Kc                            # [B, H, NT, K, K]
    dP = Kg.transpose(-1, -2) @ Vc                            # [B, H, NT, K, V]

    if initial_state is None:
        S, P, F = q.new_zeros(B, H, K, K), q.new_zeros(B, H, K, V), q.new_zeros(B, H, K, V)
    else:
        S, P, F = (x.to(dt) for x in initial_state)
    S0s, P0s = [], []
    for c in range(NT):  # the first-order states at chunk starts
        S0s.append(S)
        P0s.append(P)
        gc = gC[:, :, c, None, None]
        S = gc * S + dS[:, :, c]
        P = gc * P + dP[:, :, c]
    S0 = torch.stack(S0s, dim=2)  # [B, H, NT, K, K]
    P0 = torch.stack(P0s, dim=2)  # [B, H, NT, K, V]

    R = g1[..., None] * (Q @ P0) + Wc @ Vc                    # [B, H, NT, C, V]
    QtR = Qt @ (R * (gl * gl)[..., None])                     # Q^T diag(gl^2) R  [B, H, NT, K, V]
    dF = Kc.transpose(-1, -2) @ (Wc.transpose(-1, -2) @ (R * (gl ** 3)[..., None]))
    F0s = []
    for c in range(NT):  # the third-order state at chunk starts
        F0s.append(F)
        gc = gC[:, :, c, None, None]
        F = gc ** 3 * F + gc * (S0[:, :, c] @ QtR[:, :, c]) + dF[:, :, c]
    F0 = torch.stack(F0s, dim=2)  # [B, H, NT, K, V]

    M = torch.where(L, (g1[..., None] * (Q @ S0 @ Qt)) * (G * G) + (X @ Wc.transpose(-1, -2)) * G ** 3, zero)
    O = (g1 ** 3)[..., None] * (Q @ F0) + M @ R               # [B, H, NT, C, V]
    O = from_chunks(O, T)                                     # [B, T, H, V]
    return O, S, P, F


def hla3_torch(q, k, v, g=None, normalize=False, eps=1e-6, initial_state=None, chunk_size=64):
    """Torch backend entry. Computes in fp32 (float64 for float64 inputs).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-gates or None; initial_state: HLA3State
    or None. Returns (o [B, T, H, V] in v's dtype, HLA3State)."""
    return run_with_normalizer(hla3_chunk_torch, HLA3State, {"P": "p", "F": "f"}, q, k, v, g, normalize, eps, initial_state,
                               chunk_size)
