"""Plain torch references for the masked second-order operator (HLA2).

Two small, slow and obviously-correct forms that live beside the kernels:

* :func:`hla2_naive_quadratic` builds the full ``[T, T]`` weight matrix from the
  definition ``o_t = sum_{i <= j <= t} gamma^(2t-i-j) (q_t.k_i)(q_j.k_i) v_j``.
* :func:`hla2_naive_recurrent` walks the compact recurrence token by token
  (``S = gamma S + k k^T``; ``W = gamma^2 W + (S q) v^T``; ``z = gamma^2 z + S q``;
  ``o = q^T W [/ (q^T z + eps)]``).

Both take the fla layout ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]`` and compute in
the dtype given (pass float64 tensors for a high-precision reference).
"""
from __future__ import annotations

import torch

from .utils import HLA2State


def hla2_naive_quadratic(q, k, v, gamma=None, normalize=False, eps=1e-6):
    """O(T^2) definition. q, k: [B, T, H, K]; v: [B, T, H, V] -> o: [B, T, H, V]."""
    g = 1.0 if gamma is None else float(gamma)
    B, T, H, K = q.shape
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, *]
    t = torch.arange(T, device=q.device)
    causal = (t[:, None] >= t[None, :]).to(q.dtype)  # [T, T], row >= column
    # decay[r, c] = gamma^(r - c) on and below the diagonal, 0 above it
    expo = (t[:, None] - t[None, :]).clamp(min=0).to(q.dtype)
    decay = (g ** expo) * causal
    x = qh @ kh.transpose(-1, -2)  # [B, H, T, T], x[t, i] = q_t . k_i
    a = x * decay  # gamma^(t - i) (q_t . k_i), i <= t
    xm = x * causal  # (q_j . k_i), i <= j
    # sum_{i <= j} gamma^(t-i)(q_t.k_i)(q_j.k_i), then times gamma^(t-j) for j <= t
    m = (a @ xm.transpose(-1, -2)) * decay  # [B, H, T, T]
    num = m @ vh
    if normalize:
        den = m.sum(-1, keepdim=True)
        num = num / (den + eps)
    return num.transpose(1, 2)


def hla2_naive_recurrent(q, k, v, gamma=None, normalize=False, eps=1e-6, initial_state=None):
    """Token-by-token compact recurrence.

    q, k: [B, T, H, K]; v: [B, T, H, V]; initial_state: HLA2State of
    S [B, H, K, K], W [B, H, K, V] (, z [B, H, K]) or None.
    Returns (o [B, T, H, V], HLA2State) with states in q's dtype.
    """
    g = 1.0 if gamma is None else float(gamma)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        S = q.new_zeros(B, H, K, K)
        W = q.new_zeros(B, H, K, V)
        z = q.new_zeros(B, H, K)
    else:
        S = initial_state.S.to(q.dtype)
        W = initial_state.W.to(q.dtype)
        z = initial_state.z.to(q.dtype) if initial_state.z is not None else q.new_zeros(B, H, K)
    outs = []
    for t in range(T):
        qt, kt, vt = q[:, t], k[:, t], v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        S = g * S + kt[..., :, None] * kt[..., None, :]
        u = (S @ qt[..., None])[..., 0]  # S_t q_t: [B, H, K]
        W = g * g * W + u[..., :, None] * vt[..., None, :]
        z = g * g * z + u
        o = (qt[..., None, :] @ W)[..., 0, :]  # [B, H, V]
        if normalize:
            o = o / ((qt * z).sum(-1, keepdim=True) + eps)
        outs.append(o)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o, HLA2State(S, W, z if normalize else None)
