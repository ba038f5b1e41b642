"""Triton kernels of chunked masked third-order HLA (HLA3): forward walk, segment summaries and
fold, backward walk, gradients.

The operator (``hla_ref.hla3_naive(variant="masked")``), with b_t = sum_{s <= t} g_s:

    o_t = sum_{i <= u, j <= u, u <= t} exp(3 b_t - b_i - b_u - b_j) (q_t . k_i)(k_i . q_u)(q_u . k_j) v_j

Structure. The sum over j only involves u: with the gated first-order linear attention

    R_u = sum_{j <= u} exp(b_u - b_j) (q_u . k_j) v_j = q_u^T P_u,   P_u = sum_{j <= u} exp(b_u - b_j) k_j v_j^T,

and 3 b_t - b_i - b_u - b_j = (3 b_t - b_i - 2 b_u) + (b_u - b_j),

    o_t = sum_{i <= u <= t} exp(3 b_t - b_i - 2 b_u) (q_t . k_i)(k_i . q_u) R_u:

an HLA2-like pass over the values R whose weight has the exponents (3, 1, 2) on (t, i, u) where
HLA2's has (2, 1, 1); at gamma = 1 it is exactly hla2(Q, K, R). Grouping by u,
q_t^T S_u q_u = sum_{i <= u} exp(b_u - b_i) (q_t . k_i)(k_i . q_u) with the key moment S_u, so
o_t = q_t^T F_t with F_t = sum_{u <= t} exp(3 (b_t - b_u)) (S_u q_u) R_u, i.e. the recurrence
F_t = a_t^3 F_{t-1} + (S_t q_t)(q_t^T P_t) of ``state.py``.

Chunk form. A chunk of C = BT rows starts from the state (S0, P0, F0) after the previous token;
beta_r = b_{start + r} - b_{start - 1} <= 0 and the factors G, g1, gl, gC of
``hla_fast/ops/common/gates.py``. Inside the chunk S_u = g1_u S0 + sum_{i <= u} G[u, i] k_i k_i^T,
P_u likewise, so with X = Q K^T and Wc = X o G (lower triangle):

    R  = diag(g1) Q P0 + Wc V
    q_t^T S_u q_u = g1_u (Q S0 Q^T)[t, u] + (X Wc^T)[t, u]
    M  = (diag(g1) Q S0 Q^T) o G^2 + (X Wc^T) o G^3                 (u <= t)
    O  = diag(g1^3) Q F0 + M R

The S0 term of o_t carries exp(3 beta_t - 2 beta_u) = e^{beta_t} e^{2 (beta_t - beta_u)} and the
in-chunk one exp(3 (beta_t - beta_u)) exp(beta_u - beta_i): every exponent is <= 0. At the chunk's
end (S_u q_u is column u of S0 Q^T diag(g1) + K^T Wc^T, and g1_u gl_u^3 = gC gl_u^2):

    S <- gC S0 + K^T diag(gl) K,    P <- gC P0 + K^T diag(gl) V
    F <- gC^3 F0 + gC S0 Q^T diag(gl^2) R + K^T Wc^T diag(gl^3) R

Everything is linear in the columns of V (R, P, F, O are), so a program owns a block of value
columns and recomputes S (shared by all blocks) itself. Segments of the sequence run in parallel
once each one's start state is known: ``hla3_fwd_summary_kernel`` summarizes every segment from a
zero state and ``hla3_fwd_fold_kernel`` folds the summaries in order (their docstrings derive the
fold; for wide keys ``hla3_fwd_fold_f_kernel`` takes F's part of it by row blocks). The normalizer is the operator on a value
column of ones (``chunk.py`` appends it).

Backward of one chunk, given dO and the gradient (dS, dP, dF) of the chunk's END state:

    dR  = M^T dO + gC diag(gl^2) Q S0^T dF + diag(gl^3) Wc K dF
    dM  = (dO R^T) o L,   dA = diag(g1) dM o G^2  (A = Q S0 Q^T),   dXW = dM o G^3  (XW = X Wc^T)
    dWc = dXW^T X + diag(gl^3) R dF^T K^T  (through the H pass)   +   dR V^T  (through R)
    dX  = dXW Wc + dWc o G
    dQ  = dX K + dA Q S0^T + dA^T Q S0 + diag(g1^3) dO F0^T + gC diag(gl^2) R dF^T S0 + diag(g1) dR P0^T
    dK  = dX^T Q + diag(gl) (K (dS + dS^T) + V dP^T) + Wc^T diag(gl^3) R dF^T
    dV  = Wc^T dR + diag(gl) K dP
    dS0 = gC dS + Q^T dA Q + gC dF R^T diag(gl^2) Q,   dP0 = gC dP + Q^T diag(g1) dR,
    dF0 = gC^3 dF + Q^T diag(g1^3) dO

The walk from the last chunk to the first carries (dS, dP, dF) (``hla3_bwd_state_kernel``, in
segments folded by ``hla3_bwd_fold_kernel``: its docstring gives the linear map of a segment); the
per-chunk gradients are then independent (``hla3_bwd_grad_kernel``). Each value block's program
gives a partial dq, dk, dS and db; the launcher sums them (exact by linearity).

Gate gradient. Scaling q_s -> e^{3 b_s} q_s, k_s -> e^{-b_s / 2} k_s, R_s -> e^{-5 b_s} R_s turns
the weights of the (3, 1, 2) pass into those of the ungated pass (q sits at t and u, k twice at i,
R at u), so that pass's share of dL/db_s is 3 q.dq_H - 1/2 k.dk_H - 5 R.dR, with dq_H, dk_H the
gradients through it with R held fixed and dR the gradient with respect to R. R itself is gated
first-order attention (q_s -> e^{b_s} q_s, k_s -> e^{-b_s} k_s): q.dq_R - k.dk_R. The final
state's share at the last token (S_T, P_T carry exp(b_T - .), F_T exp(3 b_T - .)) is added by the
launcher: <dS_T, S_T> + <dP_T, P_T> + 3 <dF_T, F_T>; dg is the reverse cumulative sum of db.

Transposed quantities come from their own dots of loaded (or transposed-loaded) tiles, never from
transposing a dot result fed into another dot (miscompiled by Triton on Hopper).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common.tiles import (
    chunk_factors, dot, load_cols, load_mat, load_mat_t, load_rows, mat_or_zeros, store_mat,
)


@triton.jit
def _offsets(i_bh, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Offsets of head i_bh's first element in [B, T, H, K], [B, T, H, V] and [B, T, H] tensors
    (64-bit: B*T*H*K can pass 2^31)."""
    row = (i_bh // H).to(tl.int64) * T * H + i_bh % H
    return row * K, row * V, row


@triton.jit
def _scores(b_q, b_qt, b_k, b_kt, G, GT, lower, upper, PREC: tl.constexpr):
    """X = Q K^T and X^T = K Q^T (each its own dot), kept on and below (above) the diagonal only:
    every product uses X[t, i] with i <= t. Wc = X o G and Wc^T. Masks are selections, so a
    non-finite score of a later key does not enter earlier rows."""
    b_x = tl.where(lower, tl.dot(b_q, b_kt, input_precision=PREC), 0.0)    # X o L      [BT, BT]
    b_xt = tl.where(upper, tl.dot(b_k, b_qt, input_precision=PREC), 0.0)   # (X o L)^T  [BT, BT]
    b_wc = tl.where(lower, b_x * G, 0.0)                                   # Wc
    b_wct = tl.where(upper, b_xt * GT, 0.0)                                # Wc^T
    return b_x, b_xt, b_wc, b_wct


# ============================================================================ forward


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "HAS_INIT": lambda a: a["h0_s"] is not None,
    "HAS_O": lambda a: a["o"] is not None,
    "SAVE_STATES": lambda a: a["cs_s"] is not None,
    "STORE_FINAL": lambda a: a["ht_s"] is not None,
})
@triton.jit
def hla3_fwd_kernel(
    q, k, v, g,            # q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None
    o,                     # out: [B, T, H, V] or None
    h0_s, h0_p, h0_f,      # start state of every segment, fp32 [B*H*NSEG, K, K], [.., K, V] (x2); or None
    ht_s, ht_p, ht_f,      # out: final state [B*H, K, K], [B*H, K, V], [B*H, K, V]; or None
    cs_s, cs_p, cs_f,      # out: chunk-start snapshots [B*H, NT, K, K], [B*H, NT, K, V] (x2); or None
    log_gamma, T, NS,      # log(gamma) (without g), sequence length, chunks per segment
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, HAS_INIT: tl.constexpr, HAS_O: tl.constexpr, SAVE_STATES: tl.constexpr,
    STORE_FINAL: tl.constexpr,
):
    """One program per (value block, segment, batch*head) walks its segment's chunks in order,
    keeping S and its blocks of P and F in fp32 registers: outputs (HAS_O), chunk-start snapshots
    (SAVE_STATES, S by the first value block) and the final state (STORE_FINAL, last segment)."""
    # -- which piece of work this program owns ---------------------------------------------
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NSEG = tl.num_programs(1)
    NT = tl.cdiv(T, BT)
    lo = i_n * NS
    hi = tl.minimum(lo + NS, NT)
    i_sg = i_bh.to(tl.int64) * NSEG + i_n
    off_k, off_v, off_g = _offsets(i_bh, T, H, K, V)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    lower = rt[:, None] >= rt[None, :]
    upper = rt[:, None] <= rt[None, :]

    # -- the state at the segment's start -------------------------------------------------
    S = mat_or_zeros(h0_s, i_sg * K * K, rk, mk, rk, mk, K, BK, BK, HAS_INIT)   # [BK, BK]
    P = mat_or_zeros(h0_p, i_sg * K * V, rk, mk, rv, mv, V, BK, BV, HAS_INIT)   # [BK, BV]
    F = mat_or_zeros(h0_f, i_sg * K * V, rk, mk, rv, mv, V, BK, BV, HAS_INIT)   # [BK, BV]

    for i_c in range(lo, hi):
        t = i_c * BT + rt
        mt = t < T
        if SAVE_STATES:
            off_c = i_bh.to(tl.int64) * NT + i_c
            if i_v == 0:
                store_mat(cs_s + off_c * K * K, S, rk, mk, rk, mk, K)
            store_mat(cs_p + off_c * K * V, P, rk, mk, rv, mv, V)
            store_mat(cs_f + off_c * K * V, F, rk, mk, rv, mv, V)
        # -- the chunk's tiles, decay factors and scores -------------------------------------
        b_q = load_rows(q + off_k, t, mt, rk, mk, H * K, IS_BF16)        # Q    [BT, BK]
        b_qt = load_cols(q + off_k, t, mt, rk, mk, H * K, IS_BF16)       # Q^T  [BK, BT]
        b_k = load_rows(k + off_k, t, mt, rk, mk, H * K, IS_BF16)        # K    [BT, BK]
        b_kt = load_cols(k + off_k, t, mt, rk, mk, H * K, IS_BF16)       # K^T  [BK, BT]
        b_v = load_rows(v + off_v, t, mt, rv, mv, H * V, IS_BF16)        # V    [BT, BV]
        G, g1, g2, gl, gC, bL = chunk_factors(g, off_g, log_gamma, t, mt, H, BT, HAS_G, HAS_DECAY)
        GT = tl.trans(G)  # of an elementwise tile, not of a dot result
        b_x, b_xt, b_wc, b_wct = _scores(b_q, b_qt, b_k, b_kt, G, GT, lower, upper, PREC)
        # -- R = diag(g1) Q P0 + Wc V: first-order attention, the values of the second pass -----
        b_r = dot(b_q, P, IS_BF16, PREC) * g1[:, None] + dot(b_wc, b_v, IS_BF16, PREC)   # [BT, BV]
        if HAS_O:
            # -- O = diag(g1^3) Q F0 + M R -------------------------------------------------
            b_qs = dot(b_q, S, IS_BF16, PREC) * g1[:, None]                # diag(g1) Q S0 [BT, BK]
            G2 = G * G
            b_m = dot(b_qs, b_qt, IS_BF16, PREC) * G2 + dot(b_x, b_wct, IS_BF16, PREC) * (G2 * G)
            b_m = tl.where(lower, b_m, 0.0)                                 # M [BT, BT]
            b_o = dot(b_q, F, IS_BF16, PREC) * (g1 * g2)[:, None] + dot(b_m, b_r, IS_BF16, PREC)
            tl.store(o + off_v + t[:, None] * (H * V) + rv[None, :], b_o.to(o.dtype.element_ty),
                     mask=mt[:, None] & mv[None, :])
        # -- carry the state to the next chunk's start (F first: it reads S0) ------------------
        gl2 = gl * gl
        b_qtr = dot(b_qt * gl2[None, :], b_r, IS_BF16, PREC)               # Q^T diag(gl^2) R [BK, BV]
        b_wr = dot(b_wct, b_r * (gl2 * gl)[:, None], IS_BF16, PREC)        # Wc^T diag(gl^3) R [BT, BV]
        F = F * (gC * gC * gC) + dot(S, b_qtr, IS_BF16, PREC) * gC + dot(b_kt, b_wr, IS_BF16, PREC)
        b_kgt = b_kt * gl[None, :]                                          # (diag(gl) K)^T
        P = P * gC + dot(b_kgt, b_v, IS_BF16, PREC)
        S = S * gC + dot(b_kgt, b_k, IS_BF16, PREC)

    if STORE_FINAL:
        if i_n == NSEG - 1:
            if i_v == 0:
                store_mat(ht_s + i_bh * K * K, S, rk, mk, rk, mk, K)
            store_mat(ht_p + i_bh * K * V, P, rk, mk, rv, mv, V)
            store_mat(ht_f + i_bh * K * V, F, rk, mk, rv, mv, V)


# ============================================================================ forward segments


@triton.heuristics({"HAS_G": lambda a: a["g"] is not None})
@triton.jit
def hla3_fwd_summary_kernel(
    q, k, v, g,            # as in hla3_fwd_kernel
    sum_s, sum_p, sum_f,   # out: the segment's state from a zero start [B*H*NSEG, K, K], [.., K, V] (x2)
    sum_z1, sum_z2, sum_z3,  # out: its cross moments Z1 [.., K, K], Z2 [.., K, V], Z3 [.., K, K]
    sum_lr,                # out: log rho, the segment's total log decay [B*H*NSEG]
    log_gamma, T, NS,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr, HAS_G: tl.constexpr,
):
    """Each segment's summary from a zero state. With b measured from the segment's start and L its
    last token, the state after it from a start state (S0, P0, F0) is

        S = rho S0 + S_seg,  P = rho P0 + P_seg,  F = rho^3 F0 + S0 Z1 P0 + S0 Z2 + Z3 P0 + F_seg

    (expand (S_u q_u)(q_u^T P_u) with S_u = e^{b_u} S0 + S_u^seg, P_u = e^{b_u} P0 + P_u^seg), where

        Z1 = sum_u e^{3 b_L - b_u} q_u q_u^T,   Z2 = sum_u e^{3 b_L - 2 b_u} q_u (R_u^seg)^T,
        Z3 = sum_u e^{3 b_L - 2 b_u} (S_u^seg q_u) q_u^T.

    Appending a chunk that starts at b_c (<= 0) multiplies each by gC^3 and adds, with the chunk's
    factors, e^{2 b_c} Q^T diag(gC^2 gl) Q to Z1, e^{b_c} Q^T diag(gC gl^2) R to Z2 and
    e^{b_c} (gC^2 S_c Q^T diag(gl) Q + gC K^T Wc^T diag(gl^2) Q) to Z3 (S_c: the segment's S at the
    chunk's start): every factor is <= 1."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NSEG = tl.num_programs(1)
    NT = tl.cdiv(T, BT)
    lo = i_n * NS
    hi = tl.minimum(lo + NS, NT)
    off_k, off_v, off_g = _offsets(i_bh, T, H, K, V)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    lower = rt[:, None] >= rt[None, :]
    upper = rt[:, None] <= rt[None, :]
    S = tl.zeros([BK, BK], dtype=tl.float32)
    P = tl.zeros([BK, BV], dtype=tl.float32)
    F = tl.zeros([BK, BV], dtype=tl.float32)
    Z1 = tl.zeros([BK, BK], dtype=tl.float32)
    Z2 = tl.zeros([BK, BV], dtype=tl.float32)
    Z3 = tl.zeros([BK, BK], dtype=tl.float32)
    log_rho = 0.0  # b at the current chunk's start, from the segment's start
    for i_c in range(lo, hi):
        t = i_c * BT + rt
        mt = t < T
        b_q = load_rows(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
        b_qt = load_cols(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
        b_k = load_rows(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
        b_kt = load_cols(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
        b_v = load_rows(v + off_v, t, mt, rv, mv, H * V, IS_BF16)
        G, g1, g2, gl, gC, bL = chunk_factors(g, off_g, log_gamma, t, mt, H, BT, HAS_G, HAS_DECAY)
        GT = tl.trans(G)
        b_x, b_xt, b_wc, b_wct = _scores(b_q, b_qt, b_k, b_kt, G, GT, lower, upper, PREC)
        b_r = dot(b_q, P, IS_BF16, PREC) * g1[:, None] + dot(b_wc, b_v, IS_BF16, PREC)   # R^seg [BT, BV]
        gl2 = gl * gl
        gC3 = gC * gC * gC
        e1 = tl.exp(log_rho)
        # -- the cross moments (they read S, P at the chunk's start) ----------------------------
        Z1 = Z1 * gC3 + dot(b_qt * (gl * gC * gC)[None, :], b_q, IS_BF16, PREC) * (e1 * e1)
        Z2 = Z2 * gC3 + dot(b_qt * (gl2 * gC)[None, :], b_r, IS_BF16, PREC) * e1
        b_kw = dot(b_kt, b_wct, IS_BF16, PREC)                                  # K^T Wc^T [BK, BT]
        Z3 = Z3 * gC3 + (dot(dot(S, b_qt * gl[None, :], IS_BF16, PREC), b_q, IS_BF16, PREC) * (gC * gC)
                         + dot(b_kw * (gl2 * gC)[None, :], b_q, IS_BF16, PREC)) * e1
        # -- the segment's own state, as in the forward walk --------------------------------------
        b_qtr = dot(b_qt * gl2[None, :], b_r, IS_BF16, PREC)
        b_wr = dot(b_wct, b_r * (gl2 * gl)[:, None], IS_BF16, PREC)
        F = F * gC3 + dot(S, b_qtr, IS_BF16, PREC) * gC + dot(b_kt, b_wr, IS_BF16, PREC)
        b_kgt = b_kt * gl[None, :]
        P = P * gC + dot(b_kgt, b_v, IS_BF16, PREC)
        S = S * gC + dot(b_kgt, b_k, IS_BF16, PREC)
        log_rho += bL
    i_sg = i_bh.to(tl.int64) * NSEG + i_n
    if i_v == 0:
        store_mat(sum_s + i_sg * K * K, S, rk, mk, rk, mk, K)
        store_mat(sum_z1 + i_sg * K * K, Z1, rk, mk, rk, mk, K)
        store_mat(sum_z3 + i_sg * K * K, Z3, rk, mk, rk, mk, K)
        tl.store(sum_lr + i_sg, log_rho)
    store_mat(sum_p + i_sg * K * V, P, rk, mk, rv, mv, V)
    store_mat(sum_f + i_sg * K * V, F, rk, mk, rv, mv, V)
    store_mat(sum_z2 + i_sg * K * V, Z2, rk, mk, rv, mv, V)


@triton.heuristics({"HAS_INIT": lambda a: a["h0_s"] is not None})
@triton.jit
def hla3_fwd_fold_kernel(
    sum_s, sum_p, sum_f, sum_z1, sum_z2, sum_z3, sum_lr,  # segment summaries (hla3_fwd_summary_kernel)
    h0_s, h0_p, h0_f,      # state before the sequence [B*H, ..] or None
    seg_s, seg_p, seg_f,   # out: state at each segment's start [B*H*NSEG, ..]
    NSEG,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_INIT: tl.constexpr, CROSS: tl.constexpr = True,
):
    """Fold the segment summaries in order (see hla3_fwd_summary_kernel):

        F <- rho^3 F + S (Z1 P + Z2) + Z3 P + F_seg,   P <- rho P + P_seg,   S <- rho S + S_seg.

    Without CROSS only S and P are folded (elementwise, no products) and F is left to
    ``hla3_fwd_fold_f_kernel``: for wide keys the [BK, BK] operands S, Z1 and Z3 of one program
    would not fit in shared memory together."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    S = mat_or_zeros(h0_s, i_bh.to(tl.int64) * K * K, rk, mk, rk, mk, K, BK, BK, HAS_INIT)
    P = mat_or_zeros(h0_p, i_bh.to(tl.int64) * K * V, rk, mk, rv, mv, V, BK, BV, HAS_INIT)
    if CROSS:
        F = mat_or_zeros(h0_f, i_bh.to(tl.int64) * K * V, rk, mk, rv, mv, V, BK, BV, HAS_INIT)
    for i_s in range(0, NSEG):
        i_sg = i_bh.to(tl.int64) * NSEG + i_s
        if i_v == 0:
            store_mat(seg_s + i_sg * K * K, S, rk, mk, rk, mk, K)
        store_mat(seg_p + i_sg * K * V, P, rk, mk, rv, mv, V)
        rho = tl.exp(tl.load(sum_lr + i_sg))
        if CROSS:
            store_mat(seg_f + i_sg * K * V, F, rk, mk, rv, mv, V)
            b_z1 = load_mat(sum_z1 + i_sg * K * K, rk, mk, rk, mk, K)
            b_z2 = load_mat(sum_z2 + i_sg * K * V, rk, mk, rv, mv, V)
            b_z3 = load_mat(sum_z3 + i_sg * K * K, rk, mk, rk, mk, K)
            b_zp = tl.dot(b_z1, P, input_precision=PREC) + b_z2                # Z1 P + Z2 [BK, BV]
            F = (F * (rho * rho * rho) + tl.dot(S, b_zp, input_precision=PREC)
                 + tl.dot(b_z3, P, input_precision=PREC) + load_mat(sum_f + i_sg * K * V, rk, mk, rv, mv, V))
        P = P * rho + load_mat(sum_p + i_sg * K * V, rk, mk, rv, mv, V)
        S = S * rho + load_mat(sum_s + i_sg * K * K, rk, mk, rk, mk, K)


@triton.heuristics({"HAS_INIT": lambda a: a["h0_f"] is not None})
@triton.jit
def hla3_fwd_fold_f_kernel(
    sum_f, sum_z1, sum_z2, sum_z3, sum_lr,  # segment summaries (hla3_fwd_summary_kernel)
    h0_f,                  # F before the sequence [B*H, K, V] or None
    seg_s, seg_p,          # every segment's start S, P (hla3_fwd_fold_kernel without CROSS)
    seg_f,                 # out: every segment's start F [B*H*NSEG, K, V]
    NSEG,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """F's part of the forward fold for wide keys, one program per (row block of BR rows, value
    block, batch*head), S and P at each segment's start read back from seg_s, seg_p:

        F[r] <- rho^3 F[r] + (S[r] Z1 + Z3[r]) P + S[r] Z2 + F_seg[r]

    (hla3_fwd_fold_kernel's update, regrouped by rows), the product with Z1 and P taken over
    blocks of BC columns so that no [BK, BK] operand is held whole."""
    i_r, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rr = i_r * BR + tl.arange(0, BR)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mr = rr < K
    mk = rk < K
    mv = rv < V
    F = mat_or_zeros(h0_f, i_bh.to(tl.int64) * K * V, rr, mr, rv, mv, V, BR, BV, HAS_INIT)   # [BR, BV]
    for i_s in range(0, NSEG):
        i_sg = i_bh.to(tl.int64) * NSEG + i_s
        store_mat(seg_f + i_sg * K * V, F, rr, mr, rv, mv, V)
        rho = tl.exp(tl.load(sum_lr + i_sg))
        b_s = load_mat(seg_s + i_sg * K * K, rr, mr, rk, mk, K)                          # S[r]  [BR, BK]
        acc = (tl.dot(b_s, load_mat(sum_z2 + i_sg * K * V, rk, mk, rv, mv, V), input_precision=PREC)
               + load_mat(sum_f + i_sg * K * V, rr, mr, rv, mv, V))
        for c in range(0, BK, BC):
            rc = c + tl.arange(0, BC)
            mc = rc < K
            b_w = (tl.dot(b_s, load_mat(sum_z1 + i_sg * K * K, rk, mk, rc, mc, K), input_precision=PREC)
                   + load_mat(sum_z3 + i_sg * K * K, rr, mr, rc, mc, K))                # (S Z1 + Z3)[r, c] [BR, BC]
            acc += tl.dot(b_w, load_mat(seg_p + i_sg * K * V, rc, mc, rv, mv, V), input_precision=PREC)
        F = F * (rho * rho * rho) + acc


# ============================================================================ backward


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "HAS_DHT": lambda a: a["de_p"] is not None,
    "STORE_DH0": lambda a: a["dh0_s"] is not None,
    "SUMMARY": lambda a: a["sum_m"] is not None,
})
@triton.jit
def hla3_bwd_state_kernel(
    q, k, v, do, g,        # inputs as in the forward; do: [B, T, H, V]
    cs_s, cs_p,            # chunk-start snapshots S [B*H, NT, K, K], P [B*H, NT, K, V]
    de_s, de_p, de_f,      # gradient of each segment's END state, fp32: dS partial per value block
                           # [NV*B*H*NSEG, K, K], dP, dF [B*H*NSEG, K, V]; or None (zero)
    ds_end, dp_end, df_end,  # out: every chunk's END-state gradient; dS partial per value block
                             #      [NV*B*H, NT, K, K], dP, dF [B*H, NT, K, V]
                             # (SUMMARY: the segment's start-state gradient, laid out as de_*)
    dh0_s, dh0_p, dh0_f,   # out: initial-state gradient, dS partial [NV*B*H, K, K], dP, dF [B*H, K, V]; or None
    sum_m, sum_n, sum_lr,  # SUMMARY out: M [B*H*NSEG, K, K], N [B*H*NSEG, V, K], log rho [B*H*NSEG]; or None
    log_gamma, T, NS,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, SUMMARY: tl.constexpr,
):
    """One program per (value block, segment, batch*head) walks its segment's chunks from last to
    first carrying the state gradients (dS partial, its blocks of dP and dF), storing each chunk's
    end-state gradient for ``hla3_bwd_grad_kernel``.

    SUMMARY: walk from a zero end gradient instead and store the segment's backward summary. The
    walk is linear in the end gradient (dS_e, dP_e, dF_e) with coefficients set by the forward, and
    dF_e reaches the other two only through matrix products:

        dS_start = rho dS_e + dF_e N + c_S,   dP_start = rho dP_e + M dF_e + c_P,   dF_start = rho^3 dF_e + c_F

    with, summed over the segment's chunks (a chunk's end lies a decay rho_a from the segment's end;
    each chunk multiplies what later chunks gave by its gC),
    N += gC rho_a^3 R^T diag(gl^2) Q and M += rho_a^3 Q^T diag(g1) (gC diag(gl^2) Q S0^T + diag(gl^3) Wc K)
    (the dF terms of dS0 and dP0 in the module docstring)."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NSEG = tl.num_programs(1)
    NBH = tl.num_programs(2)
    NT = tl.cdiv(T, BT)
    lo = i_n * NS
    hi = tl.minimum(lo + NS, NT)
    off_k, off_v, off_g = _offsets(i_bh, T, H, K, V)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    lower = rt[:, None] >= rt[None, :]
    upper = rt[:, None] <= rt[None, :]
    i_sv = i_v.to(tl.int64) * NBH + i_bh           # this program's slot of the per-chunk dS partials
    i_sg = i_bh.to(tl.int64) * NSEG + i_n          # this segment's slot
    i_svg = i_v.to(tl.int64) * NBH * NSEG + i_sg   # its slot of the per-segment dS partials

    d_s = mat_or_zeros(de_s, i_svg * K * K, rk, mk, rk, mk, K, BK, BK, HAS_DHT)
    d_p = mat_or_zeros(de_p, i_sg * K * V, rk, mk, rv, mv, V, BK, BV, HAS_DHT)
    d_f = mat_or_zeros(de_f, i_sg * K * V, rk, mk, rv, mv, V, BK, BV, HAS_DHT)
    if SUMMARY:
        b_macc = tl.zeros([BK, BK], dtype=tl.float32)
        b_nacc = tl.zeros([BV, BK], dtype=tl.float32)
        log_after = 0.0  # log decay from the current chunk's end to the segment's end
    for i_r in range(0, hi - lo):
        i_c = hi - 1 - i_r
        off_c = i_bh.to(tl.int64) * NT + i_c
        if not SUMMARY:
            store_mat(ds_end + (i_sv * NT + i_c) * K * K, d_s, rk, mk, rk, mk, K)
            store_mat(dp_end + off_c * K * V, d_p, rk, mk, rv, mv, V)
            store_mat(df_end + off_c * K * V, d_f, rk, mk, rv, mv, V)
        t = i_c * BT + rt
        mt = t < T
        # -- the chunk's tiles and its forward state -------------------------------------------
        b_q = load_rows(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
        b_qt = load_cols(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
        b_k = load_rows(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
        b_kt = load_cols(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
        b_vt = load_cols(v + off_v, t, mt, rv, mv, H * V, IS_BF16)       # V^T  [BV, BT]
        b_do = load_rows(do + off_v, t, mt, rv, mv, H * V, IS_BF16)      # dO   [BT, BV]
        b_s0t = load_mat_t(cs_s + off_c * K * K, rk, mk, rk, mk, K)       # S0^T [BK, BK]
        b_p0t = load_mat_t(cs_p + off_c * K * V, rv, mv, rk, mk, V)       # P0^T [BV, BK]
        G, g1, g2, gl, gC, bL = chunk_factors(g, off_g, log_gamma, t, mt, H, BT, HAS_G, HAS_DECAY)
        GT = tl.trans(G)
        b_x, b_xt, b_wc, b_wct = _scores(b_q, b_qt, b_k, b_kt, G, GT, lower, upper, PREC)
        gl2 = gl * gl
        # -- R^T and M^T from their own dots ---------------------------------------------------
        b_rt = dot(b_p0t, b_qt, IS_BF16, PREC) * g1[None, :] + dot(b_vt, b_wct, IS_BF16, PREC)   # [BV, BT]
        b_qst = dot(b_q, b_s0t, IS_BF16, PREC)                                # Q S0^T [BT, BK]
        b_mt = dot(b_qst, b_qt, IS_BF16, PREC) * g1[None, :] * (GT * GT) + dot(b_wc, b_xt, IS_BF16, PREC) * (GT * GT * GT)
        b_mt = tl.where(upper, b_mt, 0.0)                                     # M^T [BT, BT]
        # -- dR and dA -----------------------------------------------------------------------
        b_kdf = dot(b_k, d_f, IS_BF16, PREC)                                  # K dF [BT, BV]
        b_dr = (dot(b_mt, b_do, IS_BF16, PREC) + dot(b_qst, d_f, IS_BF16, PREC) * (gC * gl2)[:, None]
                + dot(b_wc, b_kdf, IS_BF16, PREC) * (gl2 * gl)[:, None])
        b_da = tl.where(lower, dot(b_do, b_rt, IS_BF16, PREC), 0.0) * (G * G) * g1[:, None]
        # -- the start state's gradient ------------------------------------------------------
        b_nq = dot(b_rt * gl2[None, :], b_q, IS_BF16, PREC)                   # R^T diag(gl^2) Q [BV, BK]
        n_s = (d_s * gC + dot(dot(b_qt, b_da, IS_BF16, PREC), b_q, IS_BF16, PREC)
               + dot(d_f, b_nq, IS_BF16, PREC) * gC)
        d_p = d_p * gC + dot(b_qt * g1[None, :], b_dr, IS_BF16, PREC)
        d_f = d_f * (gC * gC * gC) + dot(b_qt * (g1 * g2)[None, :], b_do, IS_BF16, PREC)
        d_s = n_s
        if SUMMARY:
            a3 = tl.exp(3.0 * log_after)
            b_wk = dot(b_wc, b_k, IS_BF16, PREC)                              # Wc K [BT, BK]
            b_mc = dot(b_qt * g1[None, :], b_qst * (gC * gl2)[:, None] + b_wk * (gl2 * gl)[:, None], IS_BF16, PREC)
            b_macc = b_macc * gC + b_mc * a3
            b_nacc = b_nacc * gC + b_nq * (gC * a3)
            log_after += bL
    if SUMMARY:
        store_mat(ds_end + i_svg * K * K, d_s, rk, mk, rk, mk, K)
        store_mat(dp_end + i_sg * K * V, d_p, rk, mk, rv, mv, V)
        store_mat(df_end + i_sg * K * V, d_f, rk, mk, rv, mv, V)
        store_mat(sum_n + i_sg * V * K, b_nacc, rv, mv, rk, mk, K)
        if i_v == 0:
            store_mat(sum_m + i_sg * K * K, b_macc, rk, mk, rk, mk, K)
            tl.store(sum_lr + i_sg, log_after)
    elif STORE_DH0:
        store_mat(dh0_s + i_sv * K * K, d_s, rk, mk, rk, mk, K)
        store_mat(dh0_p + i_bh * K * V, d_p, rk, mk, rv, mv, V)
        store_mat(dh0_f + i_bh * K * V, d_f, rk, mk, rv, mv, V)


@triton.heuristics({
    "HAS_DHT": lambda a: a["dht_p"] is not None,
    "STORE_DH0": lambda a: a["dh0_s"] is not None,
})
@triton.jit
def hla3_bwd_fold_kernel(
    sum_s, sum_p, sum_f, sum_m, sum_n, sum_lr,  # segments' backward summaries (SUMMARY walk)
    dht_s, dht_p, dht_f,   # gradient of the final state: dS partial [NV*B*H, K, K], dP, dF [B*H, K, V]; or None
    de_s, de_p, de_f,      # out: gradient of each segment's END state (laid out as the walk reads it)
    dh0_s, dh0_p, dh0_f,   # out: initial-state gradient (dS partial per value block); or None
    NSEG,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DS: tl.constexpr = True, DP: tl.constexpr = True,
):
    """Fold the backward summaries from the last segment to the first (hla3_bwd_state_kernel):

        dS <- rho dS + dF N + c_S,   dP <- rho dP + M dF + c_P,   dF <- rho^3 dF + c_F.

    dF's fold needs neither of the others, so one launch may fold dS alone (DS, not DP) and another
    dP and dF (DP, not DS): for wide keys the operands of both products would not fit in shared
    memory together."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    NBH = tl.num_programs(1)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    i_sv = i_v.to(tl.int64) * NBH + i_bh
    if DS:
        d_s = mat_or_zeros(dht_s, i_sv * K * K, rk, mk, rk, mk, K, BK, BK, HAS_DHT)
    if DP:
        d_p = mat_or_zeros(dht_p, i_bh.to(tl.int64) * K * V, rk, mk, rv, mv, V, BK, BV, HAS_DHT)
    d_f = mat_or_zeros(dht_f, i_bh.to(tl.int64) * K * V, rk, mk, rv, mv, V, BK, BV, HAS_DHT)
    for i_r in range(0, NSEG):
        i_sg = i_bh.to(tl.int64) * NSEG + NSEG - 1 - i_r
        i_svg = i_v.to(tl.int64) * NBH * NSEG + i_sg
        if DS:
            store_mat(de_s + i_svg * K * K, d_s, rk, mk, rk, mk, K)
        if DP:
            store_mat(de_p + i_sg * K * V, d_p, rk, mk, rv, mv, V)
            store_mat(de_f + i_sg * K * V, d_f, rk, mk, rv, mv, V)
        rho = tl.exp(tl.load(sum_lr + i_sg))
        if DS:
            b_n = load_mat(sum_n + i_sg * V * K, rv, mv, rk, mk, K)            # N [BV, BK]
        if DP:
            b_m = load_mat(sum_m + i_sg * K * K, rk, mk, rk, mk, K)            # M [BK, BK]
        if DS:
            d_s = (d_s * rho + tl.dot(d_f, b_n, input_precision=PREC)
                   + load_mat(sum_s + i_svg * K * K, rk, mk, rk, mk, K))
        if DP:
            d_p = (d_p * rho + tl.dot(b_m, d_f, input_precision=PREC)
                   + load_mat(sum_p + i_sg * K * V, rk, mk, rv, mv, V))
        d_f = d_f * (rho * rho * rho) + load_mat(sum_f + i_sg * K * V, rk, mk, rv, mv, V)
    if STORE_DH0:
        if DS:
            store_mat(dh0_s + i_sv * K * K, d_s, rk, mk, rk, mk, K)
        if DP:
            store_mat(dh0_p + i_bh * K * V, d_p, rk, mk, rv, mv, V)
            store_mat(dh0_f + i_bh * K * V, d_f, rk, mk, rv, mv, V)


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "HAS_DB": lambda a: a["db"] is not None,
})
@triton.jit
def hla3_bwd_grad_kernel(
    q, k, v, do, g,        # inputs as in the forward; do: [B, T, H, V]
    dq, dk,                # out: partial gradients per value block, fp32 [NV, B, T, H, K]; with one
                           # value block the gradients themselves, [1, B, T, H, K] in q's dtype
    dv,                    # out: [B, T, H, V] (v's dtype)
    db,                    # out: partial dL/db per value block, fp32 [NV, B, T, H]; or None
    cs_s, cs_p, cs_f,      # chunk-start snapshots (forward)
    ds_end, dp_end, df_end,  # chunk-end state gradients (hla3_bwd_state_kernel)
    log_gamma, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, HAS_DB: tl.constexpr,
):
    """One program per (chunk, value block, batch*head): every chunk is independent here. Stores
    this value block's share of dq, dk and db (see the module docstring for db) and its dv."""
    i_c, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NBH = tl.num_programs(2)
    NT = tl.cdiv(T, BT)
    off_k, off_v, off_g = _offsets(i_bh, T, H, K, V)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    lower = rt[:, None] >= rt[None, :]
    upper = rt[:, None] <= rt[None, :]
    t = i_c * BT + rt
    mt = t < T
    # -- every tile of the chunk, plain and transposed (strided loads) ------------------------
    b_q = load_rows(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_qt = load_cols(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_k = load_rows(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_kt = load_cols(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_v = load_rows(v + off_v, t, mt, rv, mv, H * V, IS_BF16)
    b_vt = load_cols(v + off_v, t, mt, rv, mv, H * V, IS_BF16)
    b_do = load_rows(do + off_v, t, mt, rv, mv, H * V, IS_BF16)
    b_dot = load_cols(do + off_v, t, mt, rv, mv, H * V, IS_BF16)
    # -- forward state at the chunk start, gradient of the state at its end ------------------
    off_c = i_bh.to(tl.int64) * NT + i_c
    off_sv = ((i_v.to(tl.int64) * NBH + i_bh) * NT + i_c) * K * K
    b_s0 = load_mat(cs_s + off_c * K * K, rk, mk, rk, mk, K)               # S0   [BK, BK]
    b_s0t = load_mat_t(cs_s + off_c * K * K, rk, mk, rk, mk, K)            # S0^T
    b_p0 = load_mat(cs_p + off_c * K * V, rk, mk, rv, mv, V)               # P0   [BK, BV]
    b_p0t = load_mat_t(cs_p + off_c * K * V, rv, mv, rk, mk, V)            # P0^T [BV, BK]
    b_f0t = load_mat_t(cs_f + off_c * K * V, rv, mv, rk, mk, V)            # F0^T [BV, BK]
    d_s = load_mat(ds_end + off_sv, rk, mk, rk, mk, K)                      # dS   [BK, BK]
    d_st = load_mat_t(ds_end + off_sv, rk, mk, rk, mk, K)
    d_p = load_mat(dp_end + off_c * K * V, rk, mk, rv, mv, V)              # dP   [BK, BV]
    d_pt = load_mat_t(dp_end + off_c * K * V, rv, mv, rk, mk, V)           # dP^T [BV, BK]
    d_f = load_mat(df_end + off_c * K * V, rk, mk, rv, mv, V)              # dF   [BK, BV]
    d_ft = load_mat_t(df_end + off_c * K * V, rv, mv, rk, mk, V)           # dF^T [BV, BK]
    G, g1, g2, gl, gC, bL = chunk_factors(g, off_g, log_gamma, t, mt, H, BT, HAS_G, HAS_DECAY)
    GT = tl.trans(G)
    G2, GT2 = G * G, GT * GT
    G3, GT3 = G2 * G, GT2 * GT
    gl2 = gl * gl
    gl3 = gl2 * gl

    # -- recompute the forward's chunk matrices, plain and transposed ---------------------------
    b_x, b_xt, b_wc, b_wct = _scores(b_q, b_qt, b_k, b_kt, G, GT, lower, upper, PREC)
    b_r = dot(b_q, b_p0, IS_BF16, PREC) * g1[:, None] + dot(b_wc, b_v, IS_BF16, PREC)       # R   [BT, BV]
    b_rt = dot(b_p0t, b_qt, IS_BF16, PREC) * g1[None, :] + dot(b_vt, b_wct, IS_BF16, PREC)  # R^T [BV, BT]
    b_qs = dot(b_q, b_s0, IS_BF16, PREC)                                   # Q S0   [BT, BK]
    b_qst = dot(b_q, b_s0t, IS_BF16, PREC)                                 # Q S0^T [BT, BK]
    b_m = dot(b_qs, b_qt, IS_BF16, PREC) * g1[:, None] * G2 + dot(b_x, b_wct, IS_BF16, PREC) * G3
    b_m = tl.where(lower, b_m, 0.0)                                        # M
    b_mt = dot(b_qst, b_qt, IS_BF16, PREC) * g1[None, :] * GT2 + dot(b_wc, b_xt, IS_BF16, PREC) * GT3
    b_mt = tl.where(upper, b_mt, 0.0)                                      # M^T

    # -- dR and its transpose -----------------------------------------------------------------
    b_kdf = dot(b_k, d_f, IS_BF16, PREC)                                   # K dF       [BT, BV]
    b_fk = dot(d_ft, b_kt, IS_BF16, PREC)                                  # dF^T K^T   [BV, BT]
    b_s0q = dot(b_s0, b_qt, IS_BF16, PREC)                                 # S0 Q^T     [BK, BT]
    b_dr = (dot(b_mt, b_do, IS_BF16, PREC) + dot(b_qst, d_f, IS_BF16, PREC) * (gC * gl2)[:, None]
            + dot(b_wc, b_kdf, IS_BF16, PREC) * gl3[:, None])
    b_drt = (dot(b_dot, b_m, IS_BF16, PREC) + dot(d_ft, b_s0q, IS_BF16, PREC) * (gC * gl2)[None, :]
             + dot(b_fk, b_wct, IS_BF16, PREC) * gl3[None, :])
    # -- dM, dA = diag(g1) dM o G^2, dXW = dM o G^3 ------------------------------------------
    b_dm = tl.where(lower, dot(b_do, b_rt, IS_BF16, PREC), 0.0)
    b_dmt = tl.where(upper, dot(b_r, b_dot, IS_BF16, PREC), 0.0)
    b_da = b_dm * G2 * g1[:, None]
    b_dat = b_dmt * GT2 * g1[None, :]
    b_dxw = b_dm * G3
    b_dxwt = b_dmt * GT3
    # -- dWc through the second pass (dXW, F's end) and through R --------------------------
    b_y = b_r * gl3[:, None]                                               # diag(gl^3) R
    b_yt = b_rt * gl3[None, :]
    b_dwc = dot(b_dxwt, b_x, IS_BF16, PREC) + dot(b_y, b_fk, IS_BF16, PREC)          # [BT(u), BT(i)]
    b_dwct = dot(b_xt, b_dxw, IS_BF16, PREC) + dot(b_kdf, b_yt, IS_BF16, PREC)       # its transpose
    b_dx = dot(b_dxw, b_wc, IS_BF16, PREC) + tl.where(lower, b_dwc * G, 0.0)         # dX_H
    b_dxt = dot(b_wct, b_dxwt, IS_BF16, PREC) + tl.where(upper, b_dwct * GT, 0.0)    # dX_H^T
    b_dxr = tl.where(lower, dot(b_dr, b_vt, IS_BF16, PREC) * G, 0.0)                 # dX_R
    b_dxrt = tl.where(upper, dot(b_v, b_drt, IS_BF16, PREC) * GT, 0.0)               # dX_R^T

    # -- dq, dk split by pass (the gate gradient weighs them differently) --------------------
    b_dq_r = dot(b_dxr, b_k, IS_BF16, PREC) + dot(b_dr, b_p0t, IS_BF16, PREC) * g1[:, None]
    b_dk_r = dot(b_dxrt, b_q, IS_BF16, PREC) + dot(b_v, d_pt, IS_BF16, PREC) * gl[:, None]
    b_dq_h = (dot(b_dx, b_k, IS_BF16, PREC) + dot(b_da, b_qst, IS_BF16, PREC) + dot(b_dat, b_qs, IS_BF16, PREC)
              + dot(b_do, b_f0t, IS_BF16, PREC) * (g1 * g2)[:, None]
              + dot(b_r * gl2[:, None], dot(d_ft, b_s0, IS_BF16, PREC), IS_BF16, PREC) * gC)
    b_dk_h = (dot(b_dxt, b_q, IS_BF16, PREC) + dot(b_k, d_s + d_st, IS_BF16, PREC) * gl[:, None]
              + dot(dot(b_wct, b_y, IS_BF16, PREC), d_ft, IS_BF16, PREC))
    b_dv = dot(b_wct, b_dr, IS_BF16, PREC) + dot(b_k, d_p, IS_BF16, PREC) * gl[:, None]

    # -- store ---------------------------------------------------------------------------------
    m_tk = mt[:, None] & mk[None, :]
    off_part = i_v.to(tl.int64) * NBH * T * K   # value block i_v's slice of dq, dk
    p_tk = off_part + off_k + t[:, None] * (H * K) + rk[None, :]
    tl.store(dq + p_tk, (b_dq_r + b_dq_h).to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_tk, (b_dk_r + b_dk_h).to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dv + off_v + t[:, None] * (H * V) + rv[None, :], b_dv.to(dv.dtype.element_ty),
             mask=mt[:, None] & mv[None, :])
    if HAS_DB:
        qf = b_q.to(tl.float32)
        kf = b_k.to(tl.float32)
        b_db = (3.0 * tl.sum(qf * b_dq_h, axis=1) - 0.5 * tl.sum(kf * b_dk_h, axis=1)
                - 5.0 * tl.sum(b_r * b_dr, axis=1) + tl.sum(qf * b_dq_r, axis=1) - tl.sum(kf * b_dk_r, axis=1))
        tl.store(db + i_v.to(tl.int64) * NBH * T + off_g + t * H, b_db, mask=mt)
