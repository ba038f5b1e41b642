"""Plain torch references for the masked second-order operator (HLA2).

Two small, slow and obviously-correct forms that live beside the kernels:

* :func:`hla2_naive_quadratic` builds the full ``[T, T]`` weight matrix from the
  definition ``o_t = sum_{i <= j <= t} exp(2 b_t - b_i - b_j) (q_t.k_i)(q_j.k_i) v_j``
  with ``b_t = sum_{s <= t} g_s`` (``g = log(gamma)`` for a constant decay).
* :func:`hla2_naive_recurrent` walks the compact recurrence token by token, with the
  factor ``a_t = exp(g_t)`` (``S = a S + k k^T``; ``W = a^2 W + (S q) v^T``;
  ``z = a^2 z + S q``; ``o = q^T W [/ (q^T z + eps)]``).

Both take the fla layout ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g: [B, T, H]`` and
compute in the dtype given (pass float64 tensors for a high-precision reference).
"""
from __future__ import annotations

import torch

from ..common.gates import causal_decay_matrix, log_gates_like
from .state import HLA2State


def hla2_naive_quadratic(q, k, v, gamma=None, normalize=False, eps=1e-6, g=None):
    """O(T^2) definition. q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None
    -> o: [B, T, H, V]."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, *]
    b = log_gates_like(q, gamma, g).transpose(1, 2).cumsum(-1)  # [B, H, T]
    # causal [T, T] (row >= column); decay[r, c] = exp(b_r - b_c) on and below the diagonal, 0 above
    causal, decay = causal_decay_matrix(b)
    x = qh @ kh.transpose(-1, -2)  # [B, H, T, T], x[t, i] = q_t . k_i
    a = x * decay  # exp(b_t - b_i) (q_t . k_i), i <= t
    xm = x * causal  # (q_j . k_i), i <= j
    # sum_{i <= j} exp(b_t - b_i)(q_t.k_i)(q_j.k_i), then times exp(b_t - b_j) for j <= t
    m = (a @ xm.transpose(-1, -2)) * decay  # [B, H, T, T]
    num = m @ vh
    if normalize:
        den = m.sum(-1, keepdim=True)
        num = num / (den + eps)
    return num.transpose(1, 2)


def hla2_naive_recurrent(q, k, v, gamma=None, normalize=False, eps=1e-6, initial_state=None, g=None):
    """Token-by-token compact recurrence.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None; initial_state: HLA2State of
    S [B, H, K, K], W [B, H, K, V] (, z [B, H, K]) or None.
    Returns (o [B, T, H, V], HLA2State) with states in q's dtype.
    """
    a = torch.exp(log_gates_like(q, gamma, g))  # [B, T, H] factors in (0, 1]
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
        at = a[:, t, :, None, None]  # [B, H, 1, 1]
        S = at * S + kt[..., :, None] * kt[..., None, :]
        u = (S @ qt[..., None])[..., 0]  # S_t q_t: [B, H, K]
        W = at * at * W + u[..., :, None] * vt[..., None, :]
        z = at[..., 0] ** 2 * z + u
        o = (qt[..., None, :] @ W)[..., 0, :]  # [B, H, V]
        if normalize:
            o = o / ((qt * z).sum(-1, keepdim=True) + eps)
        outs.append(o)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o, HLA2State(S, W, z if normalize else None)
