"""One-token AHLA decode step: a Triton kernel and its torch twin.

Compact recurrence per (batch, head), state fp32, with the token's factor a = exp(g) (g the
log-gate; a = gamma for a constant decay, 1 without decay):

    P <- a P + k v^T           [K, V]
    r  = q^T P                 [V]      (the token's first-order output, R_t)
    E <- a E + k r^T           [K, V]
    o  = q^T E                 [V]
    p <- a p + k,  e <- a e + k (q . p),  o / (q . e + eps)     (normalize only)

r needs every row of the new P, but each value column is independent: the kernel splits the
columns of P and E over programs, so each state element is read once and written once and no
partial sums cross programs: each program stores its columns of the finished output (normalized,
in v's dtype), and a step is one launch. p and e (K numbers) are recomputed by every column block
and stored by the first. Work is O(K V) per head and the step is bound by state traffic.

The kernel has no backward: ``ahla_step`` runs the torch step (differentiable) whenever a
gradient is being recorded.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common.launch import cdiv, next_pow2
from ..common.step import step_factors, step_gamma, step_inputs, step_out, step_state_buffers
from ..common.tiles import step_rank1, step_token, store_step_output
from ..common.torch_chunks import full_precision
from .state import AHLAState


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "NORM": lambda a: a["pn_in"] is not None,
})
@triton.jit
def ahla_step_kernel(
    q, k, v, g,              # [B*H, K], [B*H, K], [B*H, V] (any float dtype); log-gates [B*H] or None
    p_in, e_in,              # fp32 state: P, E [B*H, K, V]
    pn_in, en_in,            # fp32 normalizer state p, e [B*H, K] (or None)
    p_out, e_out,            # fp32 new P, E, same shapes
    pn_out, en_out,          # fp32 new p, e (or None)
    o,                       # out: [B*H, V] in v's dtype
    gamma, eps,              # the constant factor when g is None; the normalizer's eps
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, NORM: tl.constexpr,
):
    i_bh = tl.program_id(0)  # batch * head
    i_v = tl.program_id(1)   # block of BV value columns
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    base = i_bh.to(tl.int64) * K * V
    # -- the token ----------------------------------------------------------------------------
    b_q, b_k, b_v, a = step_token(q, k, v, g, i_bh, rk, mk, rv, mv, gamma, K, V, HAS_G)
    # -- P <- a P + k v^T, r = q^T P on our columns ---------------------------------------------
    b_p = step_rank1(p_in, p_out, base, rk, mk, rv, mv, a, b_k, b_v, V, True)
    b_r = tl.sum(b_q[:, None] * b_p, axis=0)                                    # [BV]
    # -- E <- a E + k r^T, o = q^T E --------------------------------------------------------------
    b_e = step_rank1(e_in, e_out, base, rk, mk, rv, mv, a, b_k, b_r, V, True)
    b_o = tl.sum(b_q[:, None] * b_e, axis=0)
    b_den = 0.0
    if NORM:
        # every column block computes p, e (K numbers) and its den; the first stores them
        b_pn = tl.load(pn_in + i_bh * K + rk, mask=mk, other=0.0) * a + b_k
        b_en = tl.load(en_in + i_bh * K + rk, mask=mk, other=0.0) * a + b_k * tl.sum(b_q * b_pn, axis=0)
        if i_v == 0:
            tl.store(pn_out + i_bh * K + rk, b_pn, mask=mk)
            tl.store(en_out + i_bh * K + rk, b_en, mask=mk)
        b_den = tl.sum(b_q * b_en, axis=0)
    store_step_output(o, i_bh, rv, mv, b_o, b_den, eps, V, NORM)


def ahla_step_triton(q, k, v, state, g, gamma, normalize, eps):
    """Triton decode step. q, k: [B, H, K]; v: [B, H, V]; g: [B, H] log-gates or None (then the
    constant factor gamma, None for no decay); state: fp32 AHLAState.

    Returns (o [B, H, V] in v's dtype, new AHLAState)."""
    B, H, K = q.shape
    V = v.shape[-1]
    BK = max(16, next_pow2(K))
    # value columns per program: a [BK, BV] tile of P and of E; 32 columns keep a 128-row tile of
    # each at 16 fp32 values a thread (4 warps) and give B*H*V/32 programs
    BV = min(32, max(16, next_pow2(V)))
    NV = cdiv(V, BV)
    q, k, v, g = step_inputs(q, k, v, g)
    (P, E, pn, en), (p_out, e_out, pn_out, en_out) = step_state_buffers(state, normalize, ("p", "e"))
    o = step_out(v)
    ahla_step_kernel[(B * H, NV)](
        q=q, k=k, v=v, g=g, p_in=P, e_in=E, pn_in=pn, en_in=en,
        p_out=p_out, e_out=e_out, pn_out=pn_out, en_out=en_out, o=o,
        gamma=step_gamma(gamma), eps=eps, K=K, V=V, BK=BK, BV=BV, num_warps=4)
    return o.view(B, H, V), AHLAState(p_out, e_out, pn_out, en_out)


@full_precision
def ahla_step_torch(q, k, v, state, g, gamma, normalize, eps):
    """Torch decode step (same contract as :func:`ahla_step_triton`; differentiable)."""
    cd = state.P.dtype
    qf, kf, vf = q.to(cd), k.to(cd), v.to(cd)
    a, a2 = step_factors(g, gamma, cd, q.device)  # [B, H, 1] against p, e; [B, H, 1, 1] against P, E
    P = a2 * state.P + kf[..., :, None] * vf[..., None, :]
    r = (qf[..., None, :] @ P)[..., 0, :]
    E = a2 * state.E + kf[..., :, None] * r[..., None, :]
    o = (qf[..., None, :] @ E)[..., 0, :]
    pn = en = None
    if normalize:
        pn = a * state.p + kf
        en = a * state.e + kf * (qf * pn).sum(-1, keepdim=True)
        o = o / ((qf * en).sum(-1, keepdim=True) + eps)
    return o.to(v.dtype), AHLAState(P, E, pn, en)
