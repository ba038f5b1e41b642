"""One-token HLA3 decode step: a Triton kernel and its torch twin.

Compact recurrence per (batch, head), state fp32, with the token's factor a = exp(g) (g the
log-gate; a = gamma for a constant decay, 1 without decay):

    S <- a S + k k^T           [K, K]
    P <- a P + k v^T           [K, V]          p <- a p + k          (normalize only)
    u  = S q                   [K]
    r  = q^T P                 [V]             rho = q . p
    F <- a^3 F + u r^T         [K, V]          f <- a^3 f + rho u
    o  = q^T F  [/ (q^T f + eps)]

The new F needs r, a sum over every row of the new P, so one program owns a block of value
columns of one head and walks the rows twice: first P (updating it and summing r), then S and F
(updating them and summing q^T F). Each element of P and F is read once and written once; S is
read by every value block of a head (one, for V <= 128) and written by the first. Each program
stores its columns of the finished output (normalized, in v's dtype): a step is one launch. Work
is O(K^2 + K V) per head and the step is bound by state traffic.

The kernel has no backward: ``hla3_step`` runs the torch step (differentiable) whenever a
gradient is being recorded.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common.launch import cdiv, next_pow2
from ..common.step import step_factors, step_gamma, step_inputs, step_out, step_state_buffers
from ..common.tiles import step_rank1, step_rows, step_token, store_step_output
from ..common.torch_chunks import full_precision
from .state import HLA3State


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "NORM": lambda a: a["p_in"] is not None,
})
@triton.jit
def hla3_step_kernel(
    q, k, v, g,                     # [B*H, K], [B*H, K], [B*H, V] (any float dtype); log-gates [B*H] or None
    s_in, pm_in, f_in, p_in, fz_in,     # fp32 state: S [B*H, K, K], P, F [B*H, K, V], p, f [B*H, K] (or None)
    s_out, pm_out, f_out, p_out, fz_out,  # fp32 new state, same shapes
    o,                              # out: [B*H, V] in v's dtype
    gamma, eps,                     # the constant factor when g is None; the normalizer's eps
    K: tl.constexpr, V: tl.constexpr,
    BR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NR: tl.constexpr,
    HAS_G: tl.constexpr, NORM: tl.constexpr,
):
    i_bh = tl.program_id(0)  # batch * head
    i_v = tl.program_id(1)   # block of BV value columns
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    base_kk = i_bh.to(tl.int64) * K * K
    base_kv = i_bh.to(tl.int64) * K * V
    # -- the token -------------------------------------------------------------------------
    b_q, b_k, b_v, a = step_token(q, k, v, g, i_bh, rk, mk, rv, mv, gamma, K, V, HAS_G)
    a3 = a * a * a
    # -- pass 1: P <- a P + k v^T row block by row block, r = q^T P ----------------------------
    b_r = tl.zeros([BV], dtype=tl.float32)
    for i_r in range(0, NR):
        rr, mr, b_qr, b_kr = step_rows(q, k, i_bh, i_r, K, BR)
        b_p = step_rank1(pm_in, pm_out, base_kv, rr, mr, rv, mv, a, b_kr, b_v, V, True)
        b_r += tl.sum(b_qr[:, None] * b_p, axis=0)
    if NORM:
        # p <- a p + k (whole vector), rho = q . p
        b_pz = tl.load(p_in + i_bh * K + rk, mask=mk, other=0.0) * a + b_k
        rho = tl.sum(b_q * b_pz, axis=0)
        if i_v == 0:
            tl.store(p_out + i_bh * K + rk, b_pz, mask=mk)
    b_den = 0.0
    # -- pass 2: S <- a S + k k^T, u = S q, F <- a^3 F + u r^T, o = q^T F -------------------------
    b_o = tl.zeros([BV], dtype=tl.float32)
    for i_r in range(0, NR):
        rr, mr, b_qr, b_kr = step_rows(q, k, i_bh, i_r, K, BR)
        # S is the same for every value block: the first stores it
        b_s = step_rank1(s_in, s_out, base_kk, rr, mr, rk, mk, a, b_kr, b_k, K, i_v == 0)
        b_u = tl.sum(b_s * b_q[None, :], axis=1)                 # (S q) on these rows [BR]
        b_f = step_rank1(f_in, f_out, base_kv, rr, mr, rv, mv, a3, b_u, b_r, V, True)
        b_o += tl.sum(b_qr[:, None] * b_f, axis=0)
        if NORM:
            b_fz = tl.load(fz_in + i_bh * K + rr, mask=mr, other=0.0) * a3 + b_u * rho
            if i_v == 0:
                tl.store(fz_out + i_bh * K + rr, b_fz, mask=mr)
            b_den += tl.sum(b_qr * b_fz, axis=0)
    store_step_output(o, i_bh, rv, mv, b_o, b_den, eps, V, NORM)


def hla3_step_triton(q, k, v, state, g, gamma, normalize, eps):
    """Triton decode step. q, k: [B, H, K]; v: [B, H, V]; g: [B, H] log-gates or None (then the
    constant factor gamma, None for no decay); state: fp32 HLA3State.

    Returns (o [B, H, V] in v's dtype, new HLA3State)."""
    B, H, K = q.shape
    V = v.shape[-1]
    BK = max(16, next_pow2(K))
    BV = min(128, max(16, next_pow2(V)))
    BR = min(32, BK)  # rows of S, P, F per step of a program's walk
    q, k, v, g = step_inputs(q, k, v, g)
    (S, P, F, p, f), (s_out, pm_out, f_out, p_out, fz_out) = step_state_buffers(state, normalize, ("p", "f"))
    o = step_out(v)
    hla3_step_kernel[(B * H, cdiv(V, BV))](
        q=q, k=k, v=v, g=g,
        s_in=S, pm_in=P, f_in=F, p_in=p, fz_in=f, s_out=s_out, pm_out=pm_out, f_out=f_out, p_out=p_out,
        fz_out=fz_out, o=o, gamma=step_gamma(gamma), eps=eps,
        K=K, V=V, BR=BR, BK=BK, BV=BV, NR=cdiv(K, BR), num_warps=4)
    return o.view(B, H, V), HLA3State(s_out, pm_out, f_out, p_out, fz_out)


@full_precision
def hla3_step_torch(q, k, v, state, g, gamma, normalize, eps):
    """Torch decode step (same contract as :func:`hla3_step_triton`; differentiable)."""
    cd = state.S.dtype
    qf, kf, vf = q.to(cd), k.to(cd), v.to(cd)
    a, a2 = step_factors(g, gamma, cd, q.device)  # [B, H, 1] against p, f; [B, H, 1, 1] against the matrices
    S = a2 * state.S + kf[..., :, None] * kf[..., None, :]
    P = a2 * state.P + kf[..., :, None] * vf[..., None, :]
    u = (S @ qf[..., None])[..., 0]          # [B, H, K]
    r = (qf[..., None, :] @ P)[..., 0, :]    # [B, H, V]
    F = a2 ** 3 * state.F + u[..., :, None] * r[..., None, :]
    o = (qf[..., None, :] @ F)[..., 0, :]
    p = f = None
    if normalize:
        p = a * state.p + kf
        f = a ** 3 * state.f + u * (qf * p).sum(-1, keepdim=True)
        o = o / ((qf * f).sum(-1, keepdim=True) + eps)
    return o.to(v.dtype), HLA3State(S, P, F, p, f)
