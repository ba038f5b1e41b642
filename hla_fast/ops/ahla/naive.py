"""Plain torch references for the asymmetric operator (AHLA).

Two small, slow and obviously-correct forms that live beside the kernels:

* :func:`ahla_naive_quadratic` builds the full ``[T, T]`` weight matrix from the definition
  ``o_t = sum_{j <= i <= t} exp(b_t - b_j) (q_t.k_i)(q_i.k_j) v_j`` with ``b_t = sum_{s <= t} g_s``
  (``g = log(gamma)`` for a constant decay). The decay splits as
  ``exp(b_t - b_i) exp(b_i - b_j)``, so the weights are the square of the first-order weight
  matrix ``Wg[t, i] = exp(b_t - b_i) (q_t.k_i)`` (i <= t): ``o = Wg (Wg V)``.
* :func:`ahla_naive_recurrent` walks the compact recurrence token by token, with the factor
  ``a_t = exp(g_t)``: ``P = a P + k v^T``; ``E = a E + k (q^T P)``; ``o = q^T E``
  (normalized: ``p = a p + k``, ``e = a e + k (q.p)``, ``o / (q.e + eps)``).

Both take the fla layout ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g: [B, T, H]`` and compute
in the dtype given (pass float64 tensors for a high-precision reference).
"""
from __future__ import annotations

import torch

from ..common.gates import causal_decay_matrix, log_gates_like
from .state import AHLAState


def ahla_naive_quadratic(q, k, v, gamma=None, normalize=False, eps=1e-6, g=None):
    """O(T^2) definition. q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None
    -> o: [B, T, H, V]."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, *]
    b = log_gates_like(q, gamma, g).transpose(1, 2).cumsum(-1)  # [B, H, T]
    decay = causal_decay_matrix(b)[1]  # [B, H, T, T]: exp(b_r - b_c) for c <= r, 0 above
    wg = (qh @ kh.transpose(-1, -2)) * decay  # [B, H, T, T]: exp(b_t - b_i) (q_t . k_i), i <= t
    m = wg @ wg  # sum_{j <= i <= t} exp(b_t - b_j) (q_t . k_i)(q_i . k_j)
    num = m @ vh
    if normalize:
        num = num / (m.sum(-1, keepdim=True) + eps)
    return num.transpose(1, 2)


def ahla_naive_recurrent(q, k, v, gamma=None, normalize=False, eps=1e-6, initial_state=None, g=None):
    """Token-by-token compact recurrence.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None; initial_state: AHLAState of
    P, E [B, H, K, V] (, p, e [B, H, K]) or None.
    Returns (o [B, T, H, V], AHLAState) with states in q's dtype."""
    a = torch.exp(log_gates_like(q, gamma, g))  # [B, T, H] factors in (0, 1]
    B, T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        P, E = q.new_zeros(B, H, K, V), q.new_zeros(B, H, K, V)
        p, e = q.new_zeros(B, H, K), q.new_zeros(B, H, K)
    else:
        P, E = initial_state.P.to(q.dtype), initial_state.E.to(q.dtype)
        p = initial_state.p.to(q.dtype) if initial_state.p is not None else q.new_zeros(B, H, K)
        e = initial_state.e.to(q.dtype) if initial_state.e is not None else q.new_zeros(B, H, K)
    outs = []
    for t in range(T):
        qt, kt, vt = q[:, t], k[:, t], v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        at = a[:, t, :, None]  # [B, H, 1]
        P = at[..., None] * P + kt[..., :, None] * vt[..., None, :]
        r = (qt[..., None, :] @ P)[..., 0, :]  # q_t^T P_t: [B, H, V]
        E = at[..., None] * E + kt[..., :, None] * r[..., None, :]
        o = (qt[..., None, :] @ E)[..., 0, :]  # [B, H, V]
        p = at * p + kt
        e = at * e + kt * (qt * p).sum(-1, keepdim=True)
        if normalize:
            o = o / ((qt * e).sum(-1, keepdim=True) + eps)
        outs.append(o)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o, AHLAState(P, E, p if normalize else None, e if normalize else None)
