"""Vectorized pure-torch chunked HLA2 (the ``backend="torch"`` path).

Everything inside a chunk is batched over all chunks at once (matrix products on
``[B, H, NT, C, C]`` tiles); only the small state recurrence between chunks is a Python loop.
Autograd differentiates through it (the gates' gradient too), so it doubles as a second reference
for the Triton kernels (run it on float64 tensors for a tight one).

Chunk form (one chunk, local rows r, carried state (S0, W0), chunk-local cumulative log-gates
beta, decay factors G, g1, g2, gl, gC as in ``hla_fast/ops/common/gates.py``):

    X = Q K^T,  A = X o G,  Xm = X o L
    O = diag(g2) Q W0 + ((diag(g1) Q S0 Q^T + A Xm^T) o G) V
    S <- gC S0 + K^T diag(gl) K
    W <- gC^2 W0 + gC S0 Q^T diag(gl) V + K^T diag(gl) Xm^T diag(gl) V

Every exponent is <= 0, so no factor exceeds 1. The normalizer is one more value column of ones.
The chunk is capped at T, so a large ``chunk_size`` on a short sequence allocates no more than
the sequence needs.
"""
from __future__ import annotations

import torch

from ..common.gates import chunk_decay_tiles
from ..common.torch_chunks import chunk_inputs, from_chunks, run_with_normalizer
from .state import HLA2State


def hla2_chunk_torch(q, k, v, g=None, initial_state=None, chunk_size=64):
    """Unnormalized chunked HLA2 in torch.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-gates or None (no decay), all in the
    compute dtype; initial_state: (S [B, H, K, K], W [B, H, K, V]) or None.
    Returns o [B, T, H, V] and the final (S, W) in the compute dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt, dev = q.dtype, q.device
    C, NT, Q, Kc, Vc, beta, valid = chunk_inputs(q, k, v, g, chunk_size)  # Q, Kc, Vc: [B, H, NT, C, *]
    G, g1, gl, gC = chunk_decay_tiles(beta, valid)
    g2 = g1 * g1
    L = torch.ones(C, C, device=dev, dtype=torch.bool).tril()
    zero = torch.zeros((), device=dev, dtype=dt)

    X = Q @ Kc.transpose(-1, -2)                              # [B, H, NT, C, C]
    A = torch.where(L, X * G, zero)
    Xm = torch.where(L, X, zero)
    AXm = A @ Xm.transpose(-1, -2)                            # sum_{i <= j} G[r, i] x[r, i] x[j, i]
    Kg = Kc * gl[..., None]                                   # [B, H, NT, C, K]
    Vg = Vc * gl[..., None]
    dS = Kg.transpose(-1, -2) @ Kc                            # [B, H, NT, K, K]
    QtVg = Q.transpose(-1, -2) @ Vg                           # [B, H, NT, K, V]
    dW = Kg.transpose(-1, -2) @ (Xm.transpose(-1, -2) @ Vg)   # [B, H, NT, K, V]

    if initial_state is None:
        S, W = q.new_zeros(B, H, K, K), q.new_zeros(B, H, K, V)
    else:
        S, W = initial_state[0].to(dt), initial_state[1].to(dt)
    S0s, W0s = [], []
    for c in range(NT):  # the only sequential part: states at chunk starts
        S0s.append(S)
        W0s.append(W)
        gc = gC[:, :, c, None, None]
        W = gc * gc * W + gc * (S @ QtVg[:, :, c]) + dW[:, :, c]
        S = gc * S + dS[:, :, c]
    S0 = torch.stack(S0s, dim=2)  # [B, H, NT, K, K]
    W0 = torch.stack(W0s, dim=2)  # [B, H, NT, K, V]

    M = torch.where(L, ((g1[..., None] * (Q @ S0)) @ Q.transpose(-1, -2) + AXm) * G, zero)  # [B, H, NT, C, C]
    O = g2[..., None] * (Q @ W0) + M @ Vc                     # [B, H, NT, C, V]
    O = from_chunks(O, T)                                     # [B, T, H, V]
    return O, S, W


def hla2_torch(q, k, v, g=None, normalize=False, eps=1e-6, initial_state=None, chunk_size=64):
    """Torch backend entry. Computes in fp32 (float64 for float64 inputs).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-gates or None; initial_state: HLA2State
    or None. Returns (o [B, T, H, V] in v's dtype, HLA2State)."""
    return run_with_normalizer(hla2_chunk_torch, HLA2State, {"W": "z"}, q, k, v, g, normalize, eps, initial_state,
                               chunk_size)
