"""Plain torch references for the masked third-order operator (HLA3).

Two small, slow and obviously-correct forms that live beside the kernels:

* :func:`hla3_naive_quadratic` builds the full ``[T, T]`` weight matrix from the definition

      o_t = sum_{i <= u, j <= u, u <= t} exp(3 b_t - b_i - b_u - b_j) (q_t.k_i)(k_i.q_u)(q_u.k_j) v_j

  with ``b_t = sum_{s <= t} g_s`` (``g = log(gamma)`` for a constant decay): with
  Wg[u, j] = exp(b_u - b_j) (q_u.k_j) (j <= u) and X = Q K^T the weight matrix is
  ((X Wg^T) o Gamma_3) Wg, Gamma_3[t, u] = exp(3 (b_t - b_u)) (u <= t), because
  3 b_t - b_i - b_u - b_j = 3 (b_t - b_u) + (b_u - b_i) + (b_u - b_j).
* :func:`hla3_naive_recurrent` walks the compact recurrence token by token, with the factor
  ``a_t = exp(g_t)``: ``S = a S + k k^T``; ``P = a P + k v^T``; ``F = a^3 F + (S q)(q^T P)``;
  ``o = q^T F`` (``p``, ``f``: the same with v -> 1, for the denominator).

Both take the fla layout ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g: [B, T, H]`` and
compute in the dtype given (pass float64 tensors for a high-precision reference).
"""
from __future__ import annotations

import torch

from ..common.gates import causal_decay_matrix, log_gates_like
from .state import HLA3State


def hla3_naive_quadratic(q, k, v, gamma=None, normalize=False, eps=1e-6, g=None):
    """O(T^2) definition. q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None
    -> o: [B, T, H, V]."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, *]
    b = log_gates_like(q, gamma, g).transpose(1, 2).cumsum(-1)  # [B, H, T]
    decay = causal_decay_matrix(b)[1]  # [B, H, T, T]: exp(b_r - b_c) for c <= r, 0 above
    x = qh @ kh.transpose(-1, -2)  # [B, H, T, T], x[t, i] = q_t . k_i
    wg = x * decay  # Wg[u, j] = exp(b_u - b_j)(q_u . k_j), j <= u
    m = ((x @ wg.transpose(-1, -2)) * decay ** 3) @ wg  # [B, H, T, T]: o = m v
    num = m @ vh
    if normalize:
        num = num / (m.sum(-1, keepdim=True) + eps)
    return num.transpose(1, 2)


def hla3_naive_recurrent(q, k, v, gamma=None, normalize=False, eps=1e-6, initial_state=None, g=None):
    """Token-by-token compact recurrence.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None; initial_state: HLA3State of
    S [B, H, K, K], P, F [B, H, K, V] (, p, f [B, H, K]) or None.
    Returns (o [B, T, H, V], HLA3State) with states in q's dtype.
    """
    a = torch.exp(log_gates_like(q, gamma, g))  # [B, T, H] factors in (0, 1]
    B, T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        S, P, F = q.new_zeros(B, H, K, K), q.new_zeros(B, H, K, V), q.new_zeros(B, H, K, V)
        p, f = q.new_zeros(B, H, K), q.new_zeros(B, H, K)
    else:
        S, P, F = (x.to(q.dtype) for x in initial_state[:3])
        p = initial_state.p.to(q.dtype) if initial_state.p is not None else q.new_zeros(B, H, K)
        f = initial_state.f.to(q.dtype) if initial_state.f is not None else q.new_zeros(B, H, K)
    outs = []
    for t in range(T):
        qt, kt, vt = q[:, t], k[:, t], v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        at = a[:, t, :, None]  # [B, H, 1]
        S = at[..., None] * S + kt[..., :, None] * kt[..., None, :]
        P = at[..., None] * P + kt[..., :, None] * vt[..., None, :]
        p = at * p + kt
        u = (S @ qt[..., None])[..., 0]  # S_t q_t: [B, H, K]
        r = (qt[..., None, :] @ P)[..., 0, :]  # q_t^T P_t: [B, H, V]
        F = at[..., None] ** 3 * F + u[..., :, None] * r[..., None, :]
        f = at ** 3 * f + u * (qt * p).sum(-1, keepdim=True)
        o = (qt[..., None, :] @ F)[..., 0, :]  # [B, H, V]
        if normalize:
            o = o / ((qt * f).sum(-1, keepdim=True) + eps)
        outs.append(o)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o, HLA3State(S, P, F, p if normalize else None, f if normalize else None)
