"""One-token HLA2 decode step: a Triton kernel and its torch twin.

Compact recurrence per (batch, head), state fp32, with the token's factor
a = exp(g) (g the log-gate; a = gamma for a constant decay, 1 without decay):

    S <- a S + k k^T           [K, K]
    u  = S q                   [K]
    W <- a^2 W + u v^T         [K, V]
    z <- a^2 z + u             [K]      (normalize only)
    o  = q^T W  [/ (q^T z + eps)]

One program a head walks the rows of S, W (and z) a block at a time, so each
state element is read once and written once, and sums q^T W (and q^T z) over the
blocks: the output is finished (normalized, in v's dtype) in-kernel and a step is
one launch. Work is O(K^2 + K V) per head and the step is bound by state traffic.

The kernel has no backward: ``hla2_step`` runs the torch step (differentiable) whenever a
gradient is being recorded.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common.launch import cdiv, next_pow2
from ..common.step import step_factors, step_gamma, step_inputs, step_out, step_state_buffers
from ..common.tiles import step_rank1, step_rows, step_token, store_step_output
from ..common.torch_chunks import full_precision
from .state import HLA2State


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "NORM": lambda a: a["z_in"] is not None,
})
@triton.jit
def hla2_step_kernel(
    q, k, v, g,              # [B*H, K], [B*H, K], [B*H, V] (any float dtype); log-gates [B*H] or None
    s_in, w_in, z_in,        # fp32 state: [B*H, K, K], [B*H, K, V], [B*H, K] (or None)
    s_out, w_out, z_out,     # fp32 new state, same shapes
    o,                       # out: [B*H, V] in v's dtype
    gamma, eps,              # the constant factor when g is None; the normalizer's eps
    K: tl.constexpr, V: tl.constexpr,
    BR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NR: tl.constexpr,
    HAS_G: tl.constexpr, NORM: tl.constexpr,
):
    i_bh = tl.program_id(0)  # batch * head
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    base_kk = i_bh.to(tl.int64) * K * K
    base_kv = i_bh.to(tl.int64) * K * V
    # -- the token: q and k in full (columns of S), v in full ---------------------------------
    b_q, b_k, b_v, a = step_token(q, k, v, g, i_bh, rk, mk, rv, mv, gamma, K, V, HAS_G)
    # -- the rows of S, W (and z), BR at a time; o = q^T W summed over them ----------------------
    b_o = tl.zeros([BV], dtype=tl.float32)
    b_den = 0.0
    for i_r in range(0, NR):
        rr, mr, b_qr, b_kr = step_rows(q, k, i_bh, i_r, K, BR)
        b_s = step_rank1(s_in, s_out, base_kk, rr, mr, rk, mk, a, b_kr, b_k, K, True)       # S <- a S + k k^T
        b_u = tl.sum(b_s * b_q[None, :], axis=1)                                    # u = S q  [BR]
        b_w = step_rank1(w_in, w_out, base_kv, rr, mr, rv, mv, a * a, b_u, b_v, V, True)    # W <- a^2 W + u v^T
        b_o += tl.sum(b_qr[:, None] * b_w, axis=0)
        if NORM:
            # z <- a^2 z + u, den = q . z
            b_z = tl.load(z_in + i_bh * K + rr, mask=mr, other=0.0) * (a * a) + b_u
            tl.store(z_out + i_bh * K + rr, b_z, mask=mr)
            b_den += tl.sum(b_qr * b_z, axis=0)
    store_step_output(o, i_bh, rv, mv, b_o, b_den, eps, V, NORM)


def hla2_step_triton(q, k, v, state, g, gamma, normalize, eps):
    """Triton decode step. q, k: [B, H, K]; v: [B, H, V]; g: [B, H] log-gates or None (then the
    constant factor gamma, None for no decay); state: fp32 HLA2State.

    Returns (o [B, H, V] in v's dtype, new HLA2State)."""
    B, H, K = q.shape
    V = v.shape[-1]
    BK, BV = max(16, next_pow2(K)), max(16, next_pow2(V))
    # rows of S and W per step of a program's walk (one program a head, so the output is finished
    # in-kernel and a step is one launch): the 32 of the earlier kernel, which split the rows over
    # programs (closer to copy bandwidth there than 16 or 8); the walk's share of copy bandwidth, a
    # call and replayed from a CUDA graph, is in benchmarks/results/hla2_h200_decode.md
    BR = min(32 if max(BK, BV) <= 128 else 8, BK)
    q, k, v, g = step_inputs(q, k, v, g)
    (S, W, z), (s_out, w_out, z_out) = step_state_buffers(state, normalize, ("z",))
    o = step_out(v)
    hla2_step_kernel[(B * H,)](
        q=q, k=k, v=v, g=g, s_in=S, w_in=W, z_in=z, s_out=s_out, w_out=w_out, z_out=z_out, o=o,
        gamma=step_gamma(gamma), eps=eps, K=K, V=V, BR=BR, BK=BK, BV=BV, NR=cdiv(K, BR), num_warps=4)
    return o.view(B, H, V), HLA2State(s_out, w_out, z_out)


@full_precision
def hla2_step_torch(q, k, v, state, g, gamma, normalize, eps):
    """Torch decode step (same contract as :func:`hla2_step_triton`; differentiable)."""
    cd = state.S.dtype
    qf, kf, vf = q.to(cd), k.to(cd), v.to(cd)
    a_z, a = step_factors(g, gamma, cd, q.device)  # [B, H, 1] against z, [B, H, 1, 1] against S, W
    S = a * state.S + kf[..., :, None] * kf[..., None, :]
    u = (S @ qf[..., None])[..., 0]
    W = a * a * state.W + u[..., :, None] * vf[..., None, :]
    o = (qf[..., None, :] @ W)[..., 0, :]
    z = None
    if normalize:
        z = a_z * a_z * state.z + u
        o = o / ((qf * z).sum(-1, keepdim=True) + eps)
    return o.to(v.dtype), HLA2State(S, W, z)
