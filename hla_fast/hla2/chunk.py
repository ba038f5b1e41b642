"""Triton kernels for chunked HLA2: forward, backward and the autograd Function.

Layout follows flash-linear-attention: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``
(contiguous), one program per (value block, chunk or whole sequence, batch*head).
States are fp32 ``S: [B*H, K, K]`` and ``W: [B*H, K, V]`` whatever the input dtype.

Chunk form computed by the kernels (one chunk of C = BT rows, local row r,
state (S0, W0) carried in, g = gamma, n valid rows, gl[r] = g^(n-1-r)):

    X  = Q K^T                      Y  = K Q^T          (two dots: never tl.trans a dot result)
    G[r, j] = g^(r-j) (j <= r)      A  = X o G          Ym = Y o U   (U: j >= r, = Xm^T)
    N  = diag(g^(r+1)) Q S0 Q^T + A Ym
    O  = diag(g^(2(r+1))) Q W0 + (N o G) V
    S  <- g^n S0 + (diag(gl) K)^T K
    W  <- g^(2n) W0 + g^n S0 (Q^T diag(gl) V) + (diag(gl) K)^T (Ym diag(gl) V)

All decay exponents are >= 0 (factors <= 1).

The backward recomputes the chunk-start states with the forward kernel (MODE 1)
and differentiates the chunk form by hand, in one of two layouts:

* split: ``_hla2_bwd_state_kernel`` walks the chunks in reverse carrying only the
  gradients (dS, dW) of the state and stores them per chunk; then
  ``_hla2_bwd_grad_kernel`` runs one program per (chunk, head) for dq, dk, dv;
* fused: ``_hla2_bwd_kernel`` walks the chunks in reverse carrying dS, dS^T, dW,
  dW^T and writes dq, dk, dv as it goes.

Both share ``_bwd_chunk_grads``. Transposed quantities come from their own dots
of loaded (or transposed-loaded) tiles, never from transposing a dot result fed
into another dot (miscompiled by Triton 3.4-3.7.0 on Hopper).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .utils import interpreter_on


@triton.jit
def _cast(x, IS_BF16: tl.constexpr):
    """Operand dtype of the tensor-core dots: bf16 for bf16 inputs, else fp32."""
    if IS_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _decays(log2g, T, i_c, BT: tl.constexpr, USE_G: tl.constexpr):
    """Decay factors of chunk i_c.

    Returns G [BT, BT] (g^(r-j) on/below the diagonal, 0 above), g1 [BT] = g^(r+1),
    g2 [BT] = g^(2(r+1)), gl [BT] = g^(n-1-r) for valid rows (0 for padding), gC = g^n.
    """
    rt = tl.arange(0, BT)
    n = tl.minimum(T - i_c * BT, BT)  # valid rows in this chunk
    causal = rt[:, None] >= rt[None, :]
    e_row = n - 1 - rt  # exponent of gl, negative on padded rows
    if USE_G:
        rf = rt.to(tl.float32)
        # exp2(log2(g) * e) = g^e; only e >= 0 is ever kept, so nothing exceeds 1
        G = tl.where(causal, tl.exp2(log2g * (rf[:, None] - rf[None, :])), 0.0)
        g1 = tl.exp2(log2g * (rf + 1.0))
        g2 = g1 * g1
        ef = e_row.to(tl.float32)
        gl = tl.where(e_row >= 0, tl.exp2(log2g * ef), 0.0)
        # g^n, read off the first row (e_row[0] + 1 = n) without a scalar exp2
        gC = tl.sum(tl.where(rt == 0, tl.exp2(log2g * (ef + 1.0)), 0.0), axis=0)
    else:
        G = tl.where(causal, 1.0, 0.0)
        g1 = tl.full([BT], 1.0, tl.float32)
        g2 = g1
        gl = tl.where(e_row >= 0, 1.0, 0.0)
        gC = 1.0
    return G, g1, g2, gl, gC


@triton.jit
def _hla2_fwd_kernel(
    q, k, v, o,          # q, k: [B, T, H, K]; v, o: [B, T, H, V]
    h0_s, h0_w,          # initial state, fp32: [B*H, K, K], [B*H, K, V]
    ht_s, ht_w,          # final state, fp32: [B*H, K, K], [B*H, K, V]
    cs_s, cs_w,          # chunk-start states, fp32: [B*H, NT, K, K], [B*H, NT, K, V]
    log2g, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    MODE: tl.constexpr,         # 0: fused (outputs + state), 1: chunk states only, 2: outputs from stored states
    USE_G: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
    IS_BF16: tl.constexpr, PREC: tl.constexpr,
):
    # -- which piece of work this program owns --------------------------------
    i_v = tl.program_id(0)   # value block
    i_n = tl.program_id(1)   # chunk (MODE 2 only; 0 otherwise)
    i_bh = tl.program_id(2)  # batch * head
    i_b = i_bh // H
    i_h = i_bh % H
    NT = tl.cdiv(T, BT)
    # 64-bit offsets: B*T*H*K can pass 2^31 for long sequences
    q_base = q + (i_b.to(tl.int64) * T * H + i_h) * K
    k_base = k + (i_b.to(tl.int64) * T * H + i_h) * K
    v_base = v + (i_b.to(tl.int64) * T * H + i_h) * V
    o_base = o + (i_b.to(tl.int64) * T * H + i_h) * V

    rt = tl.arange(0, BT)               # rows of a chunk
    rk = tl.arange(0, BK)               # key features (padded to a power of two)
    rv = i_v * BV + tl.arange(0, BV)    # this program's value features
    mk = rk < K
    mv = rv < V
    mkk = mk[:, None] & mk[None, :]
    mkv = mk[:, None] & mv[None, :]
    upper = rt[:, None] <= rt[None, :]  # U: column index >= row index

    # -- state at the first chunk this program handles --------------------------
    if MODE == 2:
        lo = i_n
        hi = i_n + 1
        st_s = cs_s + (i_bh.to(tl.int64) * NT + i_n) * K * K
        st_w = cs_w + (i_bh.to(tl.int64) * NT + i_n) * K * V
        S = tl.load(st_s + rk[:, None] * K + rk[None, :], mask=mkk, other=0.0)
        W = tl.load(st_w + rk[:, None] * V + rv[None, :], mask=mkv, other=0.0)
    else:
        lo = 0
        hi = NT
        if HAS_INIT:
            S = tl.load(h0_s + i_bh * K * K + rk[:, None] * K + rk[None, :], mask=mkk, other=0.0)
            W = tl.load(h0_w + i_bh * K * V + rk[:, None] * V + rv[None, :], mask=mkv, other=0.0)
        else:
            S = tl.zeros([BK, BK], dtype=tl.float32)
            W = tl.zeros([BK, BV], dtype=tl.float32)

    for i_c in range(lo, hi):
        t = i_c * BT + rt
        mt = t < T
        # -- load the chunk: Q, K as [BT, BK] and transposed [BK, BT], V as [BT, BV]
        b_q = tl.load(q_base + t[:, None] * (H * K) + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b_qt = tl.load(q_base + t[None, :] * (H * K) + rk[:, None], mask=mt[None, :] & mk[:, None], other=0.0)
        b_k = tl.load(k_base + t[:, None] * (H * K) + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b_kt = tl.load(k_base + t[None, :] * (H * K) + rk[:, None], mask=mt[None, :] & mk[:, None], other=0.0)
        b_v = tl.load(v_base + t[:, None] * (H * V) + rv[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        b_q = _cast(b_q, IS_BF16)
        b_qt = _cast(b_qt, IS_BF16)
        b_k = _cast(b_k, IS_BF16)
        b_kt = _cast(b_kt, IS_BF16)
        b_v = _cast(b_v, IS_BF16)
        G, g1, g2, gl, gC = _decays(log2g, T, i_c, BT, USE_G)

        # Y = K Q^T computed by its own dot; Ym = Xm^T keeps i <= j
        b_y = tl.dot(b_k, b_qt, input_precision=PREC)
        b_ym = tl.where(upper, b_y, 0.0)

        if MODE == 1:
            # store the state at this chunk's start (S once, by the first value block)
            st_s = cs_s + (i_bh.to(tl.int64) * NT + i_c) * K * K
            st_w = cs_w + (i_bh.to(tl.int64) * NT + i_c) * K * V
            if i_v == 0:
                tl.store(st_s + rk[:, None] * K + rk[None, :], S, mask=mkk)
            tl.store(st_w + rk[:, None] * V + rv[None, :], W, mask=mkv)
        else:
            # X = Q K^T, A = X o G (decay g^(r-i) on i <= r)
            b_x = tl.dot(b_q, b_kt, input_precision=PREC)
            b_a = b_x * G
            # N = diag(g1) (Q S0) Q^T + A Ym
            b_qs = tl.dot(b_q, _cast(S, IS_BF16), input_precision=PREC) * g1[:, None]
            b_n = tl.dot(_cast(b_qs, IS_BF16), b_qt, input_precision=PREC)
            b_n += tl.dot(_cast(b_a, IS_BF16), _cast(b_ym, IS_BF16), input_precision=PREC)
            # M = N o G, O = diag(g2) Q W0 + M V
            b_m = b_n * G
            b_o = tl.dot(b_q, _cast(W, IS_BF16), input_precision=PREC) * g2[:, None]
            b_o += tl.dot(_cast(b_m, IS_BF16), b_v, input_precision=PREC)
            tl.store(o_base + t[:, None] * (H * V) + rv[None, :], b_o.to(o.dtype.element_ty),
                     mask=mt[:, None] & mv[None, :])

        if MODE != 2:
            # -- carry the state to the next chunk's start -----------------------
            b_vg = _cast(b_v * gl[:, None], IS_BF16)     # diag(gl) V
            b_kgt = _cast(b_kt * gl[None, :], IS_BF16)   # (diag(gl) K)^T
            # W <- g^2n W + g^n S (Q^T Vg) + Kg^T (Ym Vg); uses S before its update
            b_qtv = tl.dot(b_qt, b_vg, input_precision=PREC)
            b_yv = tl.dot(_cast(b_ym, IS_BF16), b_vg, input_precision=PREC)
            W = W * (gC * gC) + tl.dot(_cast(S, IS_BF16), _cast(b_qtv, IS_BF16), input_precision=PREC) * gC
            W += tl.dot(b_kgt, _cast(b_yv, IS_BF16), input_precision=PREC)
            # S <- g^n S + Kg^T K
            S = S * gC + tl.dot(b_kgt, b_k, input_precision=PREC)

    if STORE_FINAL:
        if MODE != 2:
            if i_v == 0:
                tl.store(ht_s + i_bh * K * K + rk[:, None] * K + rk[None, :], S, mask=mkk)
            tl.store(ht_w + i_bh * K * V + rk[:, None] * V + rv[None, :], W, mask=mkv)


@triton.jit
def _bwd_chunk_grads(
    b_q, b_qt, b_k, b_kt, b_v, b_vt, b_do, b_dot,   # chunk tiles [BT, *] and transposed [*, BT]
    b_s0, b_s0t, b_w0t,                             # chunk-start state S0 [BK, BK], S0^T, W0^T [BV, BK]
    d_s, d_st, d_w, d_wt,                           # gradient of the chunk-end state (and transposes), fp32
    G, g1, g2, gl, gC, lower, upper,                # decays and masks of the chunk
    IS_BF16: tl.constexpr, PREC: tl.constexpr,
):
    """dq [BT, BK], dk [BT, BK], dv [BT, BV] of one chunk (fp32), plus dN, dN^T [BT, BT] for the state update."""
    # G^T from its own formula (G[j, r] laid out as [r, j])
    GT = tl.trans(G)

    # -- recompute the forward's chunk matrices ------------------------------------
    b_x = tl.dot(b_q, b_kt, input_precision=PREC)      # X = Q K^T
    b_y = tl.dot(b_k, b_qt, input_precision=PREC)      # Y = K Q^T = X^T
    b_a = b_x * G                                      # A
    b_at = b_y * GT                                    # A^T
    b_xm = tl.where(lower, b_x, 0.0)                   # Xm
    b_ym = tl.where(upper, b_y, 0.0)                   # Ym = Xm^T
    # dN = (dO V^T) o G and its transpose (V dO^T) o G^T
    b_dn = tl.dot(b_do, b_vt, input_precision=PREC) * G
    b_dnt = tl.dot(b_v, b_dot, input_precision=PREC) * GT
    b_qs = tl.dot(b_q, b_s0, input_precision=PREC)     # Q S0
    b_qst = tl.dot(b_q, b_s0t, input_precision=PREC)   # Q S0^T
    b_kg = _cast(b_k * gl[:, None], IS_BF16)
    b_vg = _cast(b_v * gl[:, None], IS_BF16)
    b_kgt = _cast(b_kt * gl[None, :], IS_BF16)
    b_vgt = _cast(b_vt * gl[None, :], IS_BF16)
    c_dw = _cast(d_w, IS_BF16)
    c_dwt = _cast(d_wt, IS_BF16)
    c_xm = _cast(b_xm, IS_BF16)
    c_ym = _cast(b_ym, IS_BF16)
    c_dn = _cast(b_dn, IS_BF16)
    c_dnt = _cast(b_dnt, IS_BF16)

    # -- dV = M^T dO + diag(gl) (g^n Q S0^T dW + Xm Kg dW) -------------------------
    b_mt = tl.dot(_cast(b_qst, IS_BF16), _cast(b_qt * g1[None, :], IS_BF16), input_precision=PREC)
    b_mt += tl.dot(c_xm, _cast(b_at, IS_BF16), input_precision=PREC)
    b_mt = b_mt * GT
    b_dv = tl.dot(_cast(b_mt, IS_BF16), b_do, input_precision=PREC)
    b_xk = tl.dot(c_xm, b_kg, input_precision=PREC)
    b_dvg = tl.dot(_cast(b_qst, IS_BF16), c_dw, input_precision=PREC) * gC
    b_dvg += tl.dot(_cast(b_xk, IS_BF16), c_dw, input_precision=PREC)
    b_dv += b_dvg * gl[:, None]

    # -- dQ -----------------------------------------------------------------------
    # from Q W0:  diag(g2) dO W0^T
    b_dq = tl.dot(b_do, b_w0t, input_precision=PREC) * g2[:, None]
    # from diag(g1) Q S0 Q^T:  diag(g1) dN Q S0^T + dN^T diag(g1) Q S0
    b_dnq = tl.dot(c_dn, b_q, input_precision=PREC)
    b_dq += tl.dot(_cast(b_dnq, IS_BF16), b_s0t, input_precision=PREC) * g1[:, None]
    b_dq += tl.dot(c_dnt, _cast(b_qs * g1[:, None], IS_BF16), input_precision=PREC)
    # from A Ym: dX = (dN Xm) o G + (dN^T A) o L, then dQ += dX K
    b_dx = tl.dot(c_dn, c_xm, input_precision=PREC) * G
    b_dx += tl.where(lower, tl.dot(c_dnt, _cast(b_a, IS_BF16), input_precision=PREC), 0.0)
    b_dq += tl.dot(_cast(b_dx, IS_BF16), b_k, input_precision=PREC)
    # from the state update: g^n Vg dW^T S0 and dY^T K with dY^T = (Vg dW^T Kg^T) o L
    b_f = _cast(tl.dot(b_vg, c_dwt, input_precision=PREC), IS_BF16)
    b_dq += tl.dot(b_f, b_s0, input_precision=PREC) * gC
    b_dyt = tl.where(lower, tl.dot(b_f, b_kgt, input_precision=PREC), 0.0)
    b_dq += tl.dot(_cast(b_dyt, IS_BF16), b_k, input_precision=PREC)

    # -- dK -----------------------------------------------------------------------
    # dX^T = (Ym dN^T) o G^T + (A^T dN) o U, then dK += dX^T Q
    b_dxt = tl.dot(c_ym, c_dnt, input_precision=PREC) * GT
    b_dxt += tl.where(upper, tl.dot(_cast(b_at, IS_BF16), c_dn, input_precision=PREC), 0.0)
    b_dk = tl.dot(_cast(b_dxt, IS_BF16), b_q, input_precision=PREC)
    # dY = (Kg dW Vg^T) o U, dK += dY Q
    b_e = tl.dot(b_kg, c_dw, input_precision=PREC)
    b_dy = tl.where(upper, tl.dot(_cast(b_e, IS_BF16), b_vgt, input_precision=PREC), 0.0)
    b_dk += tl.dot(_cast(b_dy, IS_BF16), b_q, input_precision=PREC)
    # dKg = Ym Vg dW^T and the S update: diag(gl) K (dS + dS^T)
    b_yv = tl.dot(c_ym, b_vg, input_precision=PREC)
    b_dkg = tl.dot(_cast(b_yv, IS_BF16), c_dwt, input_precision=PREC)
    b_dkg += tl.dot(b_k, _cast(d_s + d_st, IS_BF16), input_precision=PREC)
    b_dk += b_dkg * gl[:, None]

    return b_dq, b_dk, b_dv, c_dn, c_dnt


@triton.jit
def _hla2_bwd_kernel(
    q, k, v, do,           # q, k: [B, T, H, K]; v, do: [B, T, H, V]
    dq, dk, dv,            # gradients, same shapes and dtypes as q, k, v
    cs_s, cs_w,            # chunk-start states from the MODE 1 forward, fp32
    dht_s, dht_w,          # gradient of the final state, fp32: [B*H, K, K], [B*H, K, V]
    dh0_s, dh0_w,          # gradient of the initial state, fp32 (written if STORE_DH0)
    log2g, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    IS_BF16: tl.constexpr, PREC: tl.constexpr,
):
    # one program per (batch, head); it walks the chunks from last to first
    i_bh = tl.program_id(0)
    i_b = i_bh // H
    i_h = i_bh % H
    NT = tl.cdiv(T, BT)
    off_k = (i_b.to(tl.int64) * T * H + i_h) * K
    off_v = (i_b.to(tl.int64) * T * H + i_h) * V

    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    mkk = mk[:, None] & mk[None, :]
    mkv = mk[:, None] & mv[None, :]
    mvk = mv[:, None] & mk[None, :]
    lower = rt[:, None] >= rt[None, :]
    upper = rt[:, None] <= rt[None, :]

    # gradients w.r.t. the state at the end of the current chunk (and transposes)
    if HAS_DHT:
        d_s = tl.load(dht_s + i_bh * K * K + rk[:, None] * K + rk[None, :], mask=mkk, other=0.0)
        d_st = tl.load(dht_s + i_bh * K * K + rk[None, :] * K + rk[:, None], mask=mkk, other=0.0)
        d_w = tl.load(dht_w + i_bh * K * V + rk[:, None] * V + rv[None, :], mask=mkv, other=0.0)
        d_wt = tl.load(dht_w + i_bh * K * V + rk[None, :] * V + rv[:, None], mask=mvk, other=0.0)
    else:
        d_s = tl.zeros([BK, BK], dtype=tl.float32)
        d_st = tl.zeros([BK, BK], dtype=tl.float32)
        d_w = tl.zeros([BK, BV], dtype=tl.float32)
        d_wt = tl.zeros([BV, BK], dtype=tl.float32)

    for i_r in range(0, NT):
        i_c = NT - 1 - i_r
        t = i_c * BT + rt
        mt = t < T
        m_tk = mt[:, None] & mk[None, :]
        m_kt = mk[:, None] & mt[None, :]
        m_tv = mt[:, None] & mv[None, :]
        m_vt = mv[:, None] & mt[None, :]
        # -- tiles of this chunk, plain and transposed ------------------------------
        b_q = _cast(tl.load(q + off_k + t[:, None] * (H * K) + rk[None, :], mask=m_tk, other=0.0), IS_BF16)
        b_qt = _cast(tl.load(q + off_k + t[None, :] * (H * K) + rk[:, None], mask=m_kt, other=0.0), IS_BF16)
        b_k = _cast(tl.load(k + off_k + t[:, None] * (H * K) + rk[None, :], mask=m_tk, other=0.0), IS_BF16)
        b_kt = _cast(tl.load(k + off_k + t[None, :] * (H * K) + rk[:, None], mask=m_kt, other=0.0), IS_BF16)
        b_v = _cast(tl.load(v + off_v + t[:, None] * (H * V) + rv[None, :], mask=m_tv, other=0.0), IS_BF16)
        b_vt = _cast(tl.load(v + off_v + t[None, :] * (H * V) + rv[:, None], mask=m_vt, other=0.0), IS_BF16)
        b_do = _cast(tl.load(do + off_v + t[:, None] * (H * V) + rv[None, :], mask=m_tv, other=0.0), IS_BF16)
        b_dot = _cast(tl.load(do + off_v + t[None, :] * (H * V) + rv[:, None], mask=m_vt, other=0.0), IS_BF16)
        # -- the state at this chunk's start (S0, S0^T, W0^T) -------------------------
        st_s = cs_s + (i_bh.to(tl.int64) * NT + i_c) * K * K
        st_w = cs_w + (i_bh.to(tl.int64) * NT + i_c) * K * V
        b_s0 = _cast(tl.load(st_s + rk[:, None] * K + rk[None, :], mask=mkk, other=0.0), IS_BF16)
        b_s0t = _cast(tl.load(st_s + rk[None, :] * K + rk[:, None], mask=mkk, other=0.0), IS_BF16)
        b_w0t = _cast(tl.load(st_w + rk[None, :] * V + rv[:, None], mask=mvk, other=0.0), IS_BF16)

        G, g1, g2, gl, gC = _decays(log2g, T, i_c, BT, USE_G)
        b_dq, b_dk, b_dv, c_dn, c_dnt = _bwd_chunk_grads(
            b_q, b_qt, b_k, b_kt, b_v, b_vt, b_do, b_dot, b_s0, b_s0t, b_w0t, d_s, d_st, d_w, d_wt,
            G, g1, g2, gl, gC, lower, upper, IS_BF16, PREC)
        b_vg = _cast(b_v * gl[:, None], IS_BF16)
        b_vgt = _cast(b_vt * gl[None, :], IS_BF16)
        c_dw = _cast(d_w, IS_BF16)
        c_dwt = _cast(d_wt, IS_BF16)

        tl.store(dq + off_k + t[:, None] * (H * K) + rk[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + off_k + t[:, None] * (H * K) + rk[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
        tl.store(dv + off_v + t[:, None] * (H * V) + rv[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)

        # -- gradients w.r.t. this chunk's start state ---------------------------------
        # dS0 = g^n dS + g^n dW Vg^T Q + Q^T diag(g1) dN Q   (and its transpose)
        b_vq = tl.dot(b_vgt, b_q, input_precision=PREC)            # Vg^T Q  [BV, BK]
        b_qv = tl.dot(b_qt, b_vg, input_precision=PREC)            # Q^T Vg  [BK, BV]
        b_qdn = tl.dot(_cast(b_qt * g1[None, :], IS_BF16), c_dn, input_precision=PREC)   # Q^T diag(g1) dN
        b_qdnt = tl.dot(b_qt, c_dnt, input_precision=PREC)                              # Q^T dN^T
        n_s = d_s * gC + tl.dot(c_dw, _cast(b_vq, IS_BF16), input_precision=PREC) * gC
        n_s += tl.dot(_cast(b_qdn, IS_BF16), b_q, input_precision=PREC)
        n_st = d_st * gC + tl.dot(_cast(b_qv, IS_BF16), c_dwt, input_precision=PREC) * gC
        n_st += tl.dot(_cast(b_qdnt, IS_BF16), _cast(b_q * g1[:, None], IS_BF16), input_precision=PREC)
        # dW0 = g^2n dW + Q^T diag(g2) dO   (and its transpose)
        d_w = d_w * (gC * gC) + tl.dot(_cast(b_qt * g2[None, :], IS_BF16), b_do, input_precision=PREC)
        d_wt = d_wt * (gC * gC) + tl.dot(b_dot, _cast(b_q * g2[:, None], IS_BF16), input_precision=PREC)
        d_s = n_s
        d_st = n_st

    if STORE_DH0:
        tl.store(dh0_s + i_bh * K * K + rk[:, None] * K + rk[None, :], d_s, mask=mkk)
        tl.store(dh0_w + i_bh * K * V + rk[:, None] * V + rv[None, :], d_w, mask=mkv)


@triton.jit
def _hla2_bwd_state_kernel(
    q, v, do,              # q: [B, T, H, K]; v, do: [B, T, H, V]
    ds_end, dw_end,        # out, fp32: gradient w.r.t. each chunk's END state, [B*H, NT, K, K], [B*H, NT, K, V]
    dht_s, dht_w,          # gradient of the final state, fp32: [B*H, K, K], [B*H, K, V]
    dh0_s, dh0_w,          # gradient of the initial state, fp32 (written if STORE_DH0)
    log2g, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    IS_BF16: tl.constexpr, PREC: tl.constexpr,
):
    # one program per (batch, head), chunks from last to first; only (dS, dW) are carried
    i_bh = tl.program_id(0)
    i_b = i_bh // H
    i_h = i_bh % H
    NT = tl.cdiv(T, BT)
    off_k = (i_b.to(tl.int64) * T * H + i_h) * K
    off_v = (i_b.to(tl.int64) * T * H + i_h) * V
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    mkk = mk[:, None] & mk[None, :]
    mkv = mk[:, None] & mv[None, :]
    if HAS_DHT:
        d_s = tl.load(dht_s + i_bh * K * K + rk[:, None] * K + rk[None, :], mask=mkk, other=0.0)
        d_w = tl.load(dht_w + i_bh * K * V + rk[:, None] * V + rv[None, :], mask=mkv, other=0.0)
    else:
        d_s = tl.zeros([BK, BK], dtype=tl.float32)
        d_w = tl.zeros([BK, BV], dtype=tl.float32)
    for i_r in range(0, NT):
        i_c = NT - 1 - i_r
        # the chunk's end-state gradient, read back by the parallel kernel
        p_s = ds_end + (i_bh.to(tl.int64) * NT + i_c) * K * K
        p_w = dw_end + (i_bh.to(tl.int64) * NT + i_c) * K * V
        tl.store(p_s + rk[:, None] * K + rk[None, :], d_s, mask=mkk)
        tl.store(p_w + rk[:, None] * V + rv[None, :], d_w, mask=mkv)
        t = i_c * BT + rt
        mt = t < T
        b_q = _cast(tl.load(q + off_k + t[:, None] * (H * K) + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0), IS_BF16)
        b_qt = _cast(tl.load(q + off_k + t[None, :] * (H * K) + rk[:, None], mask=mk[:, None] & mt[None, :], other=0.0), IS_BF16)
        b_vt = tl.load(v + off_v + t[None, :] * (H * V) + rv[:, None], mask=mv[:, None] & mt[None, :], other=0.0)
        b_vt = _cast(b_vt, IS_BF16)
        b_do = _cast(tl.load(do + off_v + t[:, None] * (H * V) + rv[None, :], mask=mt[:, None] & mv[None, :], other=0.0), IS_BF16)
        G, g1, g2, gl, gC = _decays(log2g, T, i_c, BT, USE_G)
        # dN = (dO V^T) o G
        b_dn = _cast(tl.dot(b_do, b_vt, input_precision=PREC) * G, IS_BF16)
        # dS <- g^n dS + g^n dW (Vg^T Q) + (Q^T diag(g1) dN) Q
        b_vq = tl.dot(_cast(b_vt * gl[None, :], IS_BF16), b_q, input_precision=PREC)
        b_qdn = tl.dot(_cast(b_qt * g1[None, :], IS_BF16), b_dn, input_precision=PREC)
        n_s = d_s * gC + tl.dot(_cast(d_w, IS_BF16), _cast(b_vq, IS_BF16), input_precision=PREC) * gC
        n_s += tl.dot(_cast(b_qdn, IS_BF16), b_q, input_precision=PREC)
        # dW <- g^2n dW + Q^T diag(g2) dO
        d_w = d_w * (gC * gC) + tl.dot(_cast(b_qt * g2[None, :], IS_BF16), b_do, input_precision=PREC)
        d_s = n_s
    if STORE_DH0:
        tl.store(dh0_s + i_bh * K * K + rk[:, None] * K + rk[None, :], d_s, mask=mkk)
        tl.store(dh0_w + i_bh * K * V + rk[:, None] * V + rv[None, :], d_w, mask=mkv)


@triton.jit
def _hla2_bwd_grad_kernel(
    q, k, v, do,           # q, k: [B, T, H, K]; v, do: [B, T, H, V]
    dq, dk, dv,            # gradients, same shapes and dtypes as q, k, v
    cs_s, cs_w,            # chunk-start states (forward), fp32: [B*H, NT, K, K], [B*H, NT, K, V]
    ds_end, dw_end,        # chunk-end state gradients (backward state pass), same shapes
    log2g, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
):
    # one program per (chunk, batch*head): every chunk is independent here
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    NT = tl.cdiv(T, BT)
    off_k = (i_b.to(tl.int64) * T * H + i_h) * K
    off_v = (i_b.to(tl.int64) * T * H + i_h) * V
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    mkk = mk[:, None] & mk[None, :]
    mkv = mk[:, None] & mv[None, :]
    mvk = mv[:, None] & mk[None, :]
    lower = rt[:, None] >= rt[None, :]
    upper = rt[:, None] <= rt[None, :]
    t = i_c * BT + rt
    mt = t < T
    m_tk = mt[:, None] & mk[None, :]
    m_kt = mk[:, None] & mt[None, :]
    m_tv = mt[:, None] & mv[None, :]
    m_vt = mv[:, None] & mt[None, :]
    # -- tiles of this chunk, plain and transposed (transposes are strided loads) ------
    b_q = _cast(tl.load(q + off_k + t[:, None] * (H * K) + rk[None, :], mask=m_tk, other=0.0), IS_BF16)
    b_qt = _cast(tl.load(q + off_k + t[None, :] * (H * K) + rk[:, None], mask=m_kt, other=0.0), IS_BF16)
    b_k = _cast(tl.load(k + off_k + t[:, None] * (H * K) + rk[None, :], mask=m_tk, other=0.0), IS_BF16)
    b_kt = _cast(tl.load(k + off_k + t[None, :] * (H * K) + rk[:, None], mask=m_kt, other=0.0), IS_BF16)
    b_v = _cast(tl.load(v + off_v + t[:, None] * (H * V) + rv[None, :], mask=m_tv, other=0.0), IS_BF16)
    b_vt = _cast(tl.load(v + off_v + t[None, :] * (H * V) + rv[:, None], mask=m_vt, other=0.0), IS_BF16)
    b_do = _cast(tl.load(do + off_v + t[:, None] * (H * V) + rv[None, :], mask=m_tv, other=0.0), IS_BF16)
    b_dot = _cast(tl.load(do + off_v + t[None, :] * (H * V) + rv[:, None], mask=m_vt, other=0.0), IS_BF16)
    # -- forward state at the chunk start, gradient of the state at its end ---------------
    off_s = (i_bh.to(tl.int64) * NT + i_c) * K * K
    off_w = (i_bh.to(tl.int64) * NT + i_c) * K * V
    b_s0 = _cast(tl.load(cs_s + off_s + rk[:, None] * K + rk[None, :], mask=mkk, other=0.0), IS_BF16)
    b_s0t = _cast(tl.load(cs_s + off_s + rk[None, :] * K + rk[:, None], mask=mkk, other=0.0), IS_BF16)
    b_w0t = _cast(tl.load(cs_w + off_w + rk[None, :] * V + rv[:, None], mask=mvk, other=0.0), IS_BF16)
    d_s = tl.load(ds_end + off_s + rk[:, None] * K + rk[None, :], mask=mkk, other=0.0)
    d_st = tl.load(ds_end + off_s + rk[None, :] * K + rk[:, None], mask=mkk, other=0.0)
    d_w = tl.load(dw_end + off_w + rk[:, None] * V + rv[None, :], mask=mkv, other=0.0)
    d_wt = tl.load(dw_end + off_w + rk[None, :] * V + rv[:, None], mask=mvk, other=0.0)
    G, g1, g2, gl, gC = _decays(log2g, T, i_c, BT, USE_G)
    b_dq, b_dk, b_dv, c_dn, c_dnt = _bwd_chunk_grads(
        b_q, b_qt, b_k, b_kt, b_v, b_vt, b_do, b_dot, b_s0, b_s0t, b_w0t, d_s, d_st, d_w, d_wt,
        G, g1, g2, gl, gC, lower, upper, IS_BF16, PREC)
    tl.store(dq + off_k + t[:, None] * (H * K) + rk[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + off_k + t[:, None] * (H * K) + rk[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dv + off_v + t[:, None] * (H * V) + rv[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)


def _pow2(n, lo=16):
    return max(lo, triton.next_power_of_2(n))


def _min_bv(device):
    return 64 if device.type == "cuda" else 16


def _bf16_dots(dtype):
    """bf16 inputs use bf16 tensor-core dots. fp16 inputs are widened to fp32 inside the
    kernel (an fp16 operand cannot hold the growing state). Under TRITON_INTERPRET the
    interpreter's bf16 dot is unreliable, so bf16 tiles are widened there too."""
    return dtype == torch.bfloat16 and not interpreter_on()


def _prec(dtype):
    # fp32 inputs get exact fp32 products; bf16/fp16 operands take the tensor cores
    return "ieee" if dtype == torch.float32 else "tf32"


def fwd_launch(q, k, v, gamma, s0, w0, chunk_size, mode="fused", store_final=True, block_v=None,
               num_warps=None, num_stages=1):
    """Run the forward kernel.

    q, k: [B, T, H, K]; v: [B, T, H, V] (contiguous); s0, w0: fp32 [B, H, K, K],
    [B, H, K, V] or None. mode: "fused" (one pass), "two_pass" (state pass then a
    parallel output pass) or "states" (chunk-start states only, for the backward).
    Returns (o or None, S_T, W_T, (cs_s [B*H, NT, K, K], cs_w [B*H, NT, K, V]) or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT = chunk_size
    NT = triton.cdiv(T, BT)
    BK = _pow2(K)
    # value blocks of 64 (never 32: a 32-wide value block crashed with an illegal address
    # on an H200 with Triton 3.6, see the package README); small blocks under the interpreter
    BV = min(_pow2(V, _min_bv(q.device)), 64 if block_v is None else block_v)
    NV = triton.cdiv(V, BV)
    dev = q.device
    f32 = torch.float32
    is_bf16 = _bf16_dots(q.dtype)
    use_g = gamma != 1.0
    log2g = math.log2(gamma) if use_g else 0.0
    has_init = s0 is not None
    if num_warps is None:
        num_warps = 4 if BK <= 64 and BV <= 64 else 8
    ht_s = torch.empty(B * H, K, K, device=dev, dtype=f32)
    ht_w = torch.empty(B * H, K, V, device=dev, dtype=f32)
    h0_s = s0.reshape(B * H, K, K) if has_init else ht_s
    h0_w = w0.reshape(B * H, K, V) if has_init else ht_w
    kw = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, USE_G=use_g, HAS_INIT=has_init,
              IS_BF16=is_bf16, PREC=_prec(q.dtype), num_warps=num_warps, num_stages=num_stages)
    o = None
    cs = None
    if mode == "fused":
        o = torch.empty_like(v)
        _hla2_fwd_kernel[(NV, 1, B * H)](q, k, v, o, h0_s, h0_w, ht_s, ht_w, ht_s, ht_w, log2g, T,
                                         MODE=0, STORE_FINAL=store_final, **kw)
    elif mode in ("two_pass", "states"):
        cs_s = torch.empty(B * H, NT, K, K, device=dev, dtype=f32)
        cs_w = torch.empty(B * H, NT, K, V, device=dev, dtype=f32)
        _hla2_fwd_kernel[(NV, 1, B * H)](q, k, v, v, h0_s, h0_w, ht_s, ht_w, cs_s, cs_w, log2g, T,
                                         MODE=1, STORE_FINAL=store_final, **kw)
        cs = (cs_s, cs_w)
        if mode == "two_pass":
            o = torch.empty_like(v)
            _hla2_fwd_kernel[(NV, NT, B * H)](q, k, v, o, h0_s, h0_w, ht_s, ht_w, cs_s, cs_w, log2g, T,
                                              MODE=2, STORE_FINAL=False, **kw)
    else:
        raise ValueError(f"mode must be 'fused', 'two_pass' or 'states', got {mode!r}")
    return o, ht_s.view(B, H, K, K), ht_w.view(B, H, K, V), cs


def bwd_launch(q, k, v, do, gamma, s0, w0, dht_s, dht_w, chunk_size, num_warps=None, mode=None):
    """Gradients of the unnormalized operator.

    q, k: [B, T, H, K]; v, do: [B, T, H, V]; s0, w0: initial state or None;
    dht_s [B, H, K, K], dht_w [B, H, K, V]: gradient of the final state or None.
    mode: "split" (a sequential pass for the state gradients, then one program per
    chunk for dq, dk, dv) or "fused" (one program per head walks all chunks); None
    picks with bwd_mode(K, V).
    Returns dq, dk, dv (input dtypes) and dS0, dW0 (fp32, None without s0).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    mode = bwd_mode(K, V) if mode is None else mode
    BT = chunk_size
    BK = _pow2(K)
    BV = _pow2(V, _min_bv(q.device))
    _, _, _, (cs_s, cs_w) = fwd_launch(q, k, v, gamma, s0, w0, BT, mode="states", store_final=False)
    do = do.contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    has_dht = dht_s is not None or dht_w is not None
    f32 = torch.float32
    if has_dht:
        dht_s = torch.zeros(B, H, K, K, device=q.device, dtype=f32) if dht_s is None else dht_s.float().contiguous()
        dht_w = torch.zeros(B, H, K, V, device=q.device, dtype=f32) if dht_w is None else dht_w.float().contiguous()
    store_dh0 = s0 is not None
    dh0_s = torch.empty(B, H, K, K, device=q.device, dtype=f32) if store_dh0 else cs_s
    dh0_w = torch.empty(B, H, K, V, device=q.device, dtype=f32) if store_dh0 else cs_w
    use_g = gamma != 1.0
    log2g = math.log2(gamma) if use_g else 0.0
    common = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, USE_G=use_g, IS_BF16=_bf16_dots(q.dtype),
                  PREC=_prec(q.dtype), num_stages=1)
    # 8 warps for the 128-wide tiles (the configuration measured on Hopper), else 4
    nw = num_warps if num_warps is not None else (8 if max(BK, BV) > 64 else 4)
    if mode == "fused":
        _hla2_bwd_kernel[(B * H,)](
            q, k, v, do, dq, dk, dv, cs_s, cs_w,
            dht_s if has_dht else cs_s, dht_w if has_dht else cs_w, dh0_s, dh0_w, log2g, T,
            HAS_DHT=has_dht, STORE_DH0=store_dh0, num_warps=nw, **common)
    elif mode == "split":
        NT = triton.cdiv(T, BT)
        ds_end = torch.empty_like(cs_s)
        dw_end = torch.empty_like(cs_w)
        _hla2_bwd_state_kernel[(B * H,)](
            q, v, do, ds_end, dw_end,
            dht_s if has_dht else cs_s, dht_w if has_dht else cs_w, dh0_s, dh0_w, log2g, T,
            HAS_DHT=has_dht, STORE_DH0=store_dh0, num_warps=nw, **common)
        _hla2_bwd_grad_kernel[(NT, B * H)](
            q, k, v, do, dq, dk, dv, cs_s, cs_w, ds_end, dw_end, log2g, T,
            num_warps=nw, **common)
    else:
        raise ValueError(f"mode must be 'split' or 'fused', got {mode!r}")
    return dq, dk, dv, (dh0_s if store_dh0 else None), (dh0_w if store_dh0 else None)


class HLA2ChunkFunction(torch.autograd.Function):
    """Autograd wrapper of the unnormalized Triton HLA2.

    forward(q [B,T,H,K], k [B,T,H,K], v [B,T,H,V], s0 [B,H,K,K] | None, w0 [B,H,K,V] | None,
    gamma, chunk_size, mode) -> (o [B,T,H,V], S_T [B,H,K,K], W_T [B,H,K,V]).
    """

    @staticmethod
    def forward(ctx, q, k, v, s0, w0, gamma, chunk_size, mode, bwd_chunk_size, block_v=None):
        o, st, wt, _ = fwd_launch(q, k, v, gamma, s0, w0, chunk_size, mode=mode, block_v=block_v)
        ctx.save_for_backward(q, k, v, s0, w0)
        ctx.gamma = gamma
        ctx.bwd_chunk_size = bwd_chunk_size
        return o, st, wt

    @staticmethod
    def backward(ctx, do, dst, dwt):
        q, k, v, s0, w0 = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, ds0, dw0 = bwd_launch(q, k, v, do, ctx.gamma, s0, w0, dst, dwt, ctx.bwd_chunk_size)
        return dq, dk, dv, ds0, dw0, None, None, None, None, None


# Backward layout used by hla2(): "split" or "fused" (see bwd_launch); None picks by head size:
# on an H200 at T = 32k, B*H = 64, split took 7.3 ms against 14.8 ms fused at K = V = 64, but
# 183 ms against 55 ms at K = V = 128 (its per-chunk kernel then holds too many 128 x 128 tiles).
BWD_MODE = None


def bwd_mode(K, V):
    """Backward layout for head sizes K, V."""
    if BWD_MODE is not None:
        return BWD_MODE
    return "split" if max(K, V) <= 64 else "fused"

# Forward layout used by hla2(); see the package README for the measurements behind it.
FWD_MODE = "fused"
FWD_BLOCK_V = None  # None: min(64, V padded); the value split also decides the parallelism


def fwd_config(BH, K, V):
    """(mode, block_v) of the forward for B*H heads of sizes K, V."""
    return FWD_MODE, FWD_BLOCK_V
