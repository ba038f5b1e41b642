"""Vectorized pure-torch chunked HLA2 (the ``backend="torch"`` path).

Everything inside a chunk is batched over all chunks at once (matrix products on
``[B, H, NT, C, C]`` tiles); only the small state recurrence between chunks is a
Python loop. Autograd differentiates through it, so it doubles as a second
reference for the Triton kernels (run it on float64 tensors for a tight one).

Chunk form (one chunk, local rows r = 0..C-1, carried state (S0, W0), gamma = g):

    X = Q K^T,  A = X o G,  Xm = X o L,   G[r, j] = g^(r-j) for j <= r else 0
    O = diag(g^(2(r+1))) Q W0 + ((diag(g^(r+1)) Q S0 Q^T + A Xm^T) o G) V
    S <- g^n S0 + K^T diag(gl) K
    W <- g^(2n) W0 + g^n S0 Q^T diag(gl) V + K^T diag(gl) Xm^T diag(gl) V

with n the chunk's number of valid rows and gl[r] = g^(n-1-r). Every decay
exponent is >= 0, so no factor exceeds 1.
"""
from __future__ import annotations

import math

import torch

from .utils import HLA2State


def _decays(C, T, NT, gamma, device, dtype):
    """Decay factors of the chunk form.

    Returns G [C, C], g1 [C], g2 [C], gl [NT, C], gC [NT] (see the module docstring).
    """
    lg = math.log(gamma)
    r = torch.arange(C, device=device, dtype=dtype)
    diff = r[:, None] - r[None, :]
    G = torch.where(diff >= 0, torch.exp(lg * diff.clamp(min=0)), torch.zeros((), device=device, dtype=dtype))
    g1 = torch.exp(lg * (r + 1))
    g2 = g1 * g1
    n = torch.clamp(T - C * torch.arange(NT, device=device, dtype=dtype), max=C)  # valid rows per chunk
    e = n[:, None] - 1 - r[None, :]
    gl = torch.where(e >= 0, torch.exp(lg * e.clamp(min=0)), torch.zeros((), device=device, dtype=dtype))
    gC = torch.exp(lg * n)
    return G, g1, g2, gl, gC


def hla2_chunk_torch(q, k, v, gamma=1.0, initial_state=None, chunk_size=64):
    """Unnormalized chunked HLA2 in torch.

    q, k: [B, T, H, K]; v: [B, T, H, V] (already in the compute dtype);
    initial_state: (S [B, H, K, K], W [B, H, K, V]) or None.
    Returns o [B, T, H, V] and the final (S, W) in the compute dtype.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NT = (T + C - 1) // C
    pad = NT * C - T
    dt, dev = q.dtype, q.device

    def chunks(x):  # [B, T, H, D] -> [B, H, NT, C, D]
        x = x.transpose(1, 2)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return x.reshape(B, H, NT, C, x.shape[-1])

    Q, Kc, Vc = chunks(q), chunks(k), chunks(v)
    G, g1, g2, gl, gC = _decays(C, T, NT, gamma, dev, dt)
    L = torch.ones(C, C, device=dev, dtype=torch.bool).tril()

    X = Q @ Kc.transpose(-1, -2)  # [B, H, NT, C, C]
    A = X * G
    Xm = X.masked_fill(~L, 0)
    AXm = A @ Xm.transpose(-1, -2)  # sum_{i <= j} g^(r-i) x[r,i] x[j,i]
    Kg = Kc * gl[..., None]  # [B, H, NT, C, K]
    Vg = Vc * gl[..., None]
    dS = Kg.transpose(-1, -2) @ Kc  # [B, H, NT, K, K]
    QtVg = Q.transpose(-1, -2) @ Vg  # [B, H, NT, K, V]
    dW = Kg.transpose(-1, -2) @ (Xm.transpose(-1, -2) @ Vg)  # [B, H, NT, K, V]

    if initial_state is None:
        S = q.new_zeros(B, H, K, K)
        W = q.new_zeros(B, H, K, V)
    else:
        S, W = initial_state[0].to(dt), initial_state[1].to(dt)
    S0s, W0s = [], []
    for c in range(NT):  # the only sequential part: states at chunk starts
        S0s.append(S)
        W0s.append(W)
        gc = gC[c]
        W = gc * gc * W + gc * (S @ QtVg[:, :, c]) + dW[:, :, c]
        S = gc * S + dS[:, :, c]
    S0 = torch.stack(S0s, dim=2)  # [B, H, NT, K, K]
    W0 = torch.stack(W0s, dim=2)  # [B, H, NT, K, V]

    M = ((g1[:, None] * (Q @ S0)) @ Q.transpose(-1, -2) + AXm) * G  # [B, H, NT, C, C]
    O = g2[:, None] * (Q @ W0) + M @ Vc  # [B, H, NT, C, V]
    O = O.reshape(B, H, NT * C, V)[:, :, :T].transpose(1, 2)
    return O, S, W


def hla2_torch(q, k, v, gamma=1.0, normalize=False, eps=1e-6, initial_state=None, chunk_size=64):
    """Torch backend entry. Computes in fp32 (float64 for float64 inputs).

    q, k: [B, T, H, K]; v: [B, T, H, V]; initial_state: HLA2State or None.
    Returns (o [B, T, H, V] in v's dtype, HLA2State).
    """
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
    V = v.shape[-1]
    st = None
    if normalize:
        # the denominator is the numerator with v -> 1: carry it as one more value column
        vc = torch.cat([vc, torch.ones_like(vc[..., :1])], dim=-1)
        if initial_state is not None:
            st = (initial_state.S, torch.cat([initial_state.W, initial_state.z[..., None]], dim=-1))
    elif initial_state is not None:
        st = (initial_state.S, initial_state.W)
    o, S, W = hla2_chunk_torch(qc, kc, vc, gamma, st, chunk_size)
    if normalize:
        o = o[..., :V] / (o[..., V:] + eps)
        state = HLA2State(S, W[..., :V], W[..., V])
    else:
        state = HLA2State(S, W, None)
    return o.to(v.dtype), state
