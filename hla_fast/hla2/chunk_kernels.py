"""Triton kernels of chunked HLA2: forward (fused, segmented, two-pass), backward.

Layout follows flash-linear-attention: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``
(contiguous). States are fp32 ``S: [B*H, K, K2]`` and ``W: [B*H, K, V]`` whatever
the input dtype: every walk carries them, and every fold, in fp32. The per-chunk
snapshots that the backward stores for its parallel kernel (chunk-start states and
chunk-end state gradients) are only ever read as dot operands, so they are stored in
the dots' operand dtype (bf16 for bf16 inputs, fp32 otherwise): rounding them on store
is the rounding each dot applied on load anyway (the one sum dS + dS^T of plain HLA2
is taken after rounding its two terms instead of before).

The kernels compute the *cross* operator with an outer pair (q, k) and an inner
pair (q2, k2):

    o_t = sum_{i <= j <= t} g^(2t-i-j) (q_t . k_i)(q2_j . k2_i) v_j

HLA2 is the case q2 = q, k2 = k (``CROSS=False``: the same tiles are reused). The
cross form is what lets a head wider than one tile be cut into feature blocks:
q . k = sum over blocks a of q_a . k_a, so HLA2 is the sum over block pairs (a, b)
of the cross operator with (q_a, k_a) outside and (q_b, k_b) inside (see
``chunk.py``).

Chunk form (one chunk of C = BT rows, local row r, state (S0, W0) carried in,
g = gamma, n valid rows, gl[r] = g^(n-1-r), gC = g^n):

    X  = Q K^T                      Y  = K2 Q2^T        (each its own dot; see below)
    G[r, j] = g^(r-j) (j <= r)      A  = X o G          Ym = Y o U   (U: j >= r)
    N  = diag(g^(r+1)) Q S0 Q2^T + A Ym
    O  = diag(g^(2(r+1))) Q W0 + (N o G) V
    S  <- gC S0 + (diag(gl) K)^T K2
    W  <- gC^2 W0 + gC S0 (Q2^T diag(gl) V) + (diag(gl) K)^T (Ym diag(gl) V)

All decay exponents are >= 0 (factors <= 1). Transposed quantities come from
their own dots of loaded (or transposed-loaded) tiles, never from transposing a
dot result fed into another dot (miscompiled by Triton 3.4-3.7.0 on Hopper).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _cast(x, IS_BF16: tl.constexpr):
    """Operand dtype of the tensor-core dots: bf16 for bf16 inputs, else fp32."""
    if IS_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _rows(base, t, mt, rc, mc, stride, IS_BF16: tl.constexpr):
    """Tile [BT, BC] of a [B, T, H, C] tensor: rows t (token stride ``stride``), features rc."""
    x = tl.load(base + t[:, None] * stride + rc[None, :], mask=mt[:, None] & mc[None, :], other=0.0)
    return _cast(x, IS_BF16)


@triton.jit
def _cols(base, t, mt, rc, mc, stride, IS_BF16: tl.constexpr):
    """The same tile transposed, [BC, BT], read with a strided load."""
    x = tl.load(base + t[None, :] * stride + rc[:, None], mask=mc[:, None] & mt[None, :], other=0.0)
    return _cast(x, IS_BF16)


@triton.jit
def _mat(base, ri, mi, rj, mj, stride):
    """fp32 state tile [BI, BJ]: element (i, j) at base + i * stride + j."""
    return tl.load(base + ri[:, None] * stride + rj[None, :], mask=mi[:, None] & mj[None, :], other=0.0)


@triton.jit
def _mat_t(base, ri, mi, rj, mj, stride):
    """The transpose of ``_mat(base, rj, mj, ri, mi, stride)``: [BI, BJ] with (i, j) = M[j, i]."""
    return tl.load(base + rj[None, :] * stride + ri[:, None], mask=mi[:, None] & mj[None, :], other=0.0)


@triton.jit
def _put(base, x, ri, mi, rj, mj, stride):
    tl.store(base + ri[:, None] * stride + rj[None, :], x, mask=mi[:, None] & mj[None, :])


@triton.jit
def _state_pair(base_s, base_w, i, rk, mk, mk2, rv, mv, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, LOAD: tl.constexpr):
    """State pair number i of fp32 [.., K, K2] and [.., K, V] buffers (rows rk, value columns rv),
    or zeros when not LOAD."""
    if LOAD:
        a = _mat(base_s + i * K * K2, rk, mk, rk, mk2, K2)
        b = _mat(base_w + i * K * V, rk, mk, rv, mv, V)
    else:
        a = tl.zeros([BK, BK], dtype=tl.float32)
        b = tl.zeros([BK, BV], dtype=tl.float32)
    return a, b


@triton.jit
def _pow_g(log2g, n, BT: tl.constexpr):
    """g^n for an integer scalar n (computed on a vector lane: no scalar casts of loop values)."""
    rt = tl.arange(0, BT)
    e = (rt * 0 + n).to(tl.float32)
    return tl.sum(tl.where(rt == 0, tl.exp2(log2g * e), 0.0), axis=0)


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
    q, k, q2, k2, v, o,  # q, k: [B, T, H, K]; q2, k2: [B, T, H, K2]; v, o: [B, T, H, V]
    h0_s, h0_w,          # start states, fp32: [B*H*NSEG, K, K2], [B*H*NSEG, K, V] (one per segment)
    ht_s, ht_w, ht_c,    # final state [B*H, K, K2], [B*H, K, V]; MODE 3: segment sums (+ C [.., K2, V])
    cs_s, cs_w,          # chunk-start snapshots (fp32, or bf16 with bf16 dots): [B*H, NT, K, K2], [B*H, NT, K, V]
    log2g, T, NS,        # log2(gamma), sequence length, chunks per segment
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    MODE: tl.constexpr,  # 0: outputs + state, 1: store chunk-start states, 2: outputs from stored
                         # states (one chunk a program), 3: segment summary (S, C, W) from zero,
                         # 4: outputs + state + chunk-start states (a forward that saves for the backward)
    USE_G: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
    IS_BF16: tl.constexpr, PREC: tl.constexpr,
):
    # -- which piece of work this program owns --------------------------------
    i_v = tl.program_id(0)   # value block
    i_n = tl.program_id(1)   # segment (MODE 0, 1, 3, 4) or chunk (MODE 2)
    i_bh = tl.program_id(2)  # batch * head
    NSEG = tl.num_programs(1)
    i_b = i_bh // H
    i_h = i_bh % H
    NT = tl.cdiv(T, BT)
    # 64-bit offsets: B*T*H*K can pass 2^31 for long sequences
    q_base = q + (i_b.to(tl.int64) * T * H + i_h) * K
    k_base = k + (i_b.to(tl.int64) * T * H + i_h) * K
    q2_base = q2 + (i_b.to(tl.int64) * T * H + i_h) * K2
    k2_base = k2 + (i_b.to(tl.int64) * T * H + i_h) * K2
    v_base = v + (i_b.to(tl.int64) * T * H + i_h) * V
    o_base = o + (i_b.to(tl.int64) * T * H + i_h) * V

    rt = tl.arange(0, BT)               # rows of a chunk
    rk = tl.arange(0, BK)               # key features (padded to a power of two)
    rv = i_v * BV + tl.arange(0, BV)    # this program's value features
    mk = rk < K
    mk2 = rk < K2
    mv = rv < V
    upper = rt[:, None] <= rt[None, :]  # U: column index >= row index

    # -- state at the first chunk this program handles --------------------------
    if MODE == 2:
        lo = i_n
        hi = i_n + 1
        S = _mat(cs_s + (i_bh.to(tl.int64) * NT + i_n) * K * K2, rk, mk, rk, mk2, K2)
        W = _mat(cs_w + (i_bh.to(tl.int64) * NT + i_n) * K * V, rk, mk, rv, mv, V)
    else:
        lo = i_n * NS
        hi = tl.minimum(lo + NS, NT)
        S, W = _state_pair(h0_s, h0_w, i_bh.to(tl.int64) * NSEG + i_n, rk, mk, mk2, rv, mv, K, K2, V, BK, BV, HAS_INIT)
    if MODE == 3:
        C = tl.zeros([BK, BV], dtype=tl.float32)  # sum_j g^(end-j) q2_j v_j^T over the segment

    for i_c in range(lo, hi):
        t = i_c * BT + rt
        mt = t < T
        # -- load the chunk: Q [BT, BK], K^T and Q2^T [BK, BT], K2 [BT, BK], V [BT, BV]
        b_kt = _cols(k_base, t, mt, rk, mk, H * K, IS_BF16)
        b_q2t = _cols(q2_base, t, mt, rk, mk2, H * K2, IS_BF16)
        b_k2 = _rows(k2_base, t, mt, rk, mk2, H * K2, IS_BF16)
        b_v = _rows(v_base, t, mt, rv, mv, H * V, IS_BF16)
        G, g1, g2, gl, gC = _decays(log2g, T, i_c, BT, USE_G)

        # Y = K2 Q2^T computed by its own dot; Ym keeps i <= j
        b_y = tl.dot(b_k2, b_q2t, input_precision=PREC)
        b_ym = tl.where(upper, b_y, 0.0)

        if MODE == 1 or MODE == 4:
            # store the state at this chunk's start (S once, by the first value block)
            if i_v == 0:
                _put(cs_s + (i_bh.to(tl.int64) * NT + i_c) * K * K2, S, rk, mk, rk, mk2, K2)
            _put(cs_w + (i_bh.to(tl.int64) * NT + i_c) * K * V, W, rk, mk, rv, mv, V)
        if MODE == 0 or MODE == 2 or MODE == 4:
            b_q = _rows(q_base, t, mt, rk, mk, H * K, IS_BF16)
            # X = Q K^T, A = X o G (decay g^(r-i) on i <= r)
            b_x = tl.dot(b_q, b_kt, input_precision=PREC)
            b_a = b_x * G
            # N = diag(g1) (Q S0) Q2^T + A Ym
            b_qs = tl.dot(b_q, _cast(S, IS_BF16), input_precision=PREC) * g1[:, None]
            b_n = tl.dot(_cast(b_qs, IS_BF16), b_q2t, input_precision=PREC)
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
            # W <- gC^2 W + gC S (Q2^T Vg) + Kg^T (Ym Vg); uses S before its update
            b_qtv = tl.dot(b_q2t, b_vg, input_precision=PREC)
            b_yv = tl.dot(_cast(b_ym, IS_BF16), b_vg, input_precision=PREC)
            W = W * (gC * gC) + tl.dot(_cast(S, IS_BF16), _cast(b_qtv, IS_BF16), input_precision=PREC) * gC
            W += tl.dot(b_kgt, _cast(b_yv, IS_BF16), input_precision=PREC)
            # S <- gC S + Kg^T K2
            S = S * gC + tl.dot(b_kgt, b_k2, input_precision=PREC)
            if MODE == 3:
                C = C * gC + b_qtv

    if MODE == 3:
        # the segment's summary, read by _hla2_seg_combine_kernel
        i_sg = i_bh.to(tl.int64) * NSEG + i_n
        if i_v == 0:
            _put(ht_s + i_sg * K * K2, S, rk, mk, rk, mk2, K2)
        _put(ht_w + i_sg * K * V, W, rk, mk, rv, mv, V)
        _put(ht_c + i_sg * K2 * V, C, rk, mk2, rv, mv, V)
    elif STORE_FINAL and MODE != 2:
        if i_n == NSEG - 1:
            if i_v == 0:
                _put(ht_s + i_bh * K * K2, S, rk, mk, rk, mk2, K2)
            _put(ht_w + i_bh * K * V, W, rk, mk, rv, mv, V)


@triton.jit
def _hla2_seg_combine_kernel(
    sum_s, sum_c, sum_w,  # segment summaries from MODE 3: [B*H*NSEG, K, K2], [.., K2, V], [.., K, V]
    h0_s, h0_w,           # state before the sequence, fp32 [B*H, K, K2], [B*H, K, V] (if HAS_INIT)
    seg_s, seg_w,         # out: state at each segment's start, [B*H*NSEG, K, K2], [B*H*NSEG, K, V]
    log2g, T, NS, NSEG,
    K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, HAS_INIT: tl.constexpr, PREC: tl.constexpr,
):
    """Fold the segment summaries in order: with rho = g^(tokens in the segment),

        W <- rho^2 W + rho S C_seg + W_seg,    S <- rho S + S_seg,

    the (S, C, W) monoid of the chunk form, applied one segment at a time."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mk2 = rk < K2
    mv = rv < V
    S, W = _state_pair(h0_s, h0_w, i_bh.to(tl.int64), rk, mk, mk2, rv, mv, K, K2, V, BK, BV, HAS_INIT)
    for i_s in range(0, NSEG):
        i_sg = i_bh.to(tl.int64) * NSEG + i_s
        if i_v == 0:
            _put(seg_s + i_sg * K * K2, S, rk, mk, rk, mk2, K2)
        _put(seg_w + i_sg * K * V, W, rk, mk, rv, mv, V)
        b_s = _mat(sum_s + i_sg * K * K2, rk, mk, rk, mk2, K2)
        b_c = _mat(sum_c + i_sg * K2 * V, rk, mk2, rv, mv, V)
        b_w = _mat(sum_w + i_sg * K * V, rk, mk, rv, mv, V)
        if USE_G:
            n = tl.minimum(T - i_s * NS * BT, NS * BT)  # tokens in this segment
            rho = _pow_g(log2g, n, BT)
        else:
            rho = 1.0
        W = W * (rho * rho) + tl.dot(S, b_c, input_precision=PREC) * rho + b_w
        S = S * rho + b_s


@triton.jit
def _bwd_chunk_grads(
    b_q, b_qt, b_k, b_kt,            # outer pair: Q, K as [BT, BK] and transposed [BK, BT]
    b_q2, b_q2t, b_k2, b_k2t,        # inner pair (the same tiles when not CROSS)
    b_v, b_vt, b_do, b_dot,          # V, dO as [BT, BV] and transposed
    b_s0, b_s0t, b_w0t,              # chunk-start state S0 [BK, BK], S0^T, W0^T [BV, BK]
    d_s, d_st, d_w, d_wt,            # gradient of the chunk-end state (and transposes), fp32
    G, g1, g2, gl, gC, lower, upper,  # decays and masks of the chunk
    CROSS: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
):
    """Gradients of one chunk (fp32): returns dq, dk, dq2, dk2, dv and dN, dN^T [BT, BT].

    Not CROSS: dq2 and dk2 already hold the whole gradient of q and k (dq, dk are partial)."""
    # G^T from its own formula (G[j, r] laid out as [r, j])
    GT = tl.trans(G)

    # -- recompute the forward's chunk matrices ------------------------------------
    b_x = tl.dot(b_q, b_kt, input_precision=PREC)      # X = Q K^T
    b_y = tl.dot(b_k2, b_q2t, input_precision=PREC)    # Y = K2 Q2^T
    b_a = b_x * G                                      # A
    b_ym = tl.where(upper, b_y, 0.0)                   # Ym
    if CROSS:
        b_at = tl.dot(b_k, b_qt, input_precision=PREC) * GT                    # A^T
        b_xm = tl.where(lower, tl.dot(b_q2, b_k2t, input_precision=PREC), 0.0)  # Ym^T
    else:
        b_at = b_y * GT
        b_xm = tl.where(lower, b_x, 0.0)
    # dN = (dO V^T) o G and its transpose (V dO^T) o G^T
    b_dn = tl.dot(b_do, b_vt, input_precision=PREC) * G
    b_dnt = tl.dot(b_v, b_dot, input_precision=PREC) * GT
    b_qs = tl.dot(b_q, b_s0, input_precision=PREC)     # Q S0     [BT, K2]
    b_qst = tl.dot(b_q2, b_s0t, input_precision=PREC)  # Q2 S0^T  [BT, K]
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

    # -- dV = M^T dO + diag(gl) (gC Q2 S0^T dW + Ym^T Kg dW) ---------------------------
    b_mt = tl.dot(_cast(b_qst, IS_BF16), _cast(b_qt * g1[None, :], IS_BF16), input_precision=PREC)
    b_mt += tl.dot(c_xm, _cast(b_at, IS_BF16), input_precision=PREC)
    b_mt = b_mt * GT
    b_dv = tl.dot(_cast(b_mt, IS_BF16), b_do, input_precision=PREC)
    b_xk = tl.dot(c_xm, b_kg, input_precision=PREC)
    b_dvg = tl.dot(_cast(b_qst, IS_BF16), c_dw, input_precision=PREC) * gC
    b_dvg += tl.dot(_cast(b_xk, IS_BF16), c_dw, input_precision=PREC)
    b_dv += b_dvg * gl[:, None]

    # -- dQ (outer): diag(g2) dO W0^T + diag(g1) dN Q2 S0^T + ((dN Ym^T) o G) K --------
    b_dq = tl.dot(b_do, b_w0t, input_precision=PREC) * g2[:, None]
    b_dnq = tl.dot(c_dn, b_q2, input_precision=PREC)
    b_dq += tl.dot(_cast(b_dnq, IS_BF16), b_s0t, input_precision=PREC) * g1[:, None]
    b_dx = tl.dot(c_dn, c_xm, input_precision=PREC) * G
    # -- dQ2 (inner): ((dN^T A) o L) K2 + ((Vg dW^T Kg^T) o L) K2 + dN^T diag(g1) Q S0 + gC Vg dW^T S0
    b_dx2 = tl.where(lower, tl.dot(c_dnt, _cast(b_a, IS_BF16), input_precision=PREC), 0.0)
    b_f = _cast(tl.dot(b_vg, c_dwt, input_precision=PREC), IS_BF16)
    b_dx2 += tl.where(lower, tl.dot(b_f, b_kgt, input_precision=PREC), 0.0)
    if CROSS:
        b_dq += tl.dot(_cast(b_dx, IS_BF16), b_k, input_precision=PREC)
        b_dq2 = tl.dot(_cast(b_dx2, IS_BF16), b_k2, input_precision=PREC)
    else:
        b_dq2 = b_dq + tl.dot(_cast(b_dx + b_dx2, IS_BF16), b_k, input_precision=PREC)
    b_dq2 += tl.dot(c_dnt, _cast(b_qs * g1[:, None], IS_BF16), input_precision=PREC)
    b_dq2 += tl.dot(b_f, b_s0, input_precision=PREC) * gC

    # -- dK (outer): ((Ym dN^T) o G^T) Q + diag(gl) (Ym Vg dW^T + K2 dS^T) ------------
    b_dxt = tl.dot(c_ym, c_dnt, input_precision=PREC) * GT
    b_yv = tl.dot(c_ym, b_vg, input_precision=PREC)
    b_dkg = tl.dot(_cast(b_yv, IS_BF16), c_dwt, input_precision=PREC)
    # -- dK2 (inner): ((A^T dN) o U) Q2 + ((Kg dW Vg^T) o U) Q2 + diag(gl) K dS --------
    b_dy = tl.where(upper, tl.dot(_cast(b_at, IS_BF16), c_dn, input_precision=PREC), 0.0)
    b_e = tl.dot(b_kg, c_dw, input_precision=PREC)
    b_dy += tl.where(upper, tl.dot(_cast(b_e, IS_BF16), b_vgt, input_precision=PREC), 0.0)
    if CROSS:
        b_dk = tl.dot(_cast(b_dxt, IS_BF16), b_q, input_precision=PREC)
        b_dkg += tl.dot(b_k2, _cast(d_st, IS_BF16), input_precision=PREC)
        b_dk += b_dkg * gl[:, None]
        b_dk2 = tl.dot(_cast(b_dy, IS_BF16), b_q2, input_precision=PREC)
        b_dk2 += tl.dot(b_kg, _cast(d_s, IS_BF16), input_precision=PREC)
    else:
        b_dk = tl.dot(_cast(b_dxt + b_dy, IS_BF16), b_q, input_precision=PREC)
        b_dkg += tl.dot(b_k, _cast(d_s + d_st, IS_BF16), input_precision=PREC)
        b_dk2 = b_dk + b_dkg * gl[:, None]
    return b_dq, b_dk, b_dq2, b_dk2, b_dv, c_dn, c_dnt


@triton.jit
def _chunk_tiles(q_base, k_base, q2_base, k2_base, v_base, do_base, t, mt, rk, mk, mk2, rv, mv,
                 H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
                 CROSS: tl.constexpr, IS_BF16: tl.constexpr):
    """Every tile the backward of one chunk reads, plain and transposed (strided loads)."""
    b_q = _rows(q_base, t, mt, rk, mk, H * K, IS_BF16)
    b_qt = _cols(q_base, t, mt, rk, mk, H * K, IS_BF16)
    b_k = _rows(k_base, t, mt, rk, mk, H * K, IS_BF16)
    b_kt = _cols(k_base, t, mt, rk, mk, H * K, IS_BF16)
    if CROSS:
        b_q2 = _rows(q2_base, t, mt, rk, mk2, H * K2, IS_BF16)
        b_q2t = _cols(q2_base, t, mt, rk, mk2, H * K2, IS_BF16)
        b_k2 = _rows(k2_base, t, mt, rk, mk2, H * K2, IS_BF16)
        b_k2t = _cols(k2_base, t, mt, rk, mk2, H * K2, IS_BF16)
    else:
        b_q2 = b_q
        b_q2t = b_qt
        b_k2 = b_k
        b_k2t = b_kt
    b_v = _rows(v_base, t, mt, rv, mv, H * V, IS_BF16)
    b_vt = _cols(v_base, t, mt, rv, mv, H * V, IS_BF16)
    b_do = _rows(do_base, t, mt, rv, mv, H * V, IS_BF16)
    b_dot = _cols(do_base, t, mt, rv, mv, H * V, IS_BF16)
    return b_q, b_qt, b_k, b_kt, b_q2, b_q2t, b_k2, b_k2t, b_v, b_vt, b_do, b_dot


@triton.jit
def _store_pair(d, d2, off_k, off_k2, t, m_tk, m_tk2, rk, b_d, b_d2,
                H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, CROSS: tl.constexpr):
    """One gradient of the outer pair into d ([B, T, H, K]) and of the inner pair into d2
    ([.., K2]). Not CROSS: the pairs are one tensor and b_d2 holds its whole gradient."""
    if CROSS:
        tl.store(d + off_k + t[:, None] * (H * K) + rk[None, :], b_d.to(d.dtype.element_ty), mask=m_tk)
        tl.store(d2 + off_k2 + t[:, None] * (H * K2) + rk[None, :], b_d2.to(d2.dtype.element_ty), mask=m_tk2)
    else:
        tl.store(d + off_k + t[:, None] * (H * K) + rk[None, :], b_d2.to(d.dtype.element_ty), mask=m_tk)


@triton.jit
def _store_grads(dq, dk, dq2, dk2, dv, off_k, off_k2, off_v, t, mt, rk, mk, mk2, rv, mv,
                 b_dq, b_dk, b_dq2, b_dk2, b_dv,
                 H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
                 CROSS: tl.constexpr, PARTS: tl.constexpr):
    """Store the gradients PARTS selects: bit 1 dq (and dq2), bit 2 dk (and dk2), bit 4 dv.
    What no stored gradient needs is never computed: the compiler drops unused dots and loads."""
    m_tk = mt[:, None] & mk[None, :]
    m_tk2 = mt[:, None] & mk2[None, :]
    if PARTS & 1:
        _store_pair(dq, dq2, off_k, off_k2, t, m_tk, m_tk2, rk, b_dq, b_dq2, H, K, K2, CROSS)
    if PARTS & 2:
        _store_pair(dk, dk2, off_k, off_k2, t, m_tk, m_tk2, rk, b_dk, b_dk2, H, K, K2, CROSS)
    if PARTS & 4:
        tl.store(dv + off_v + t[:, None] * (H * V) + rv[None, :], b_dv.to(dv.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])


@triton.jit
def _bwd_indices(i_bh, T, H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Offsets of head i_bh's first element in the [B, T, H, K], [.., K2] and [.., V] tensors,
    the index ranges of a chunk (rows, key features, value features) and their masks."""
    row = (i_bh // H).to(tl.int64) * T * H + i_bh % H
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    lower = rt[:, None] >= rt[None, :]
    upper = rt[:, None] <= rt[None, :]
    return row * K, row * K2, row * V, rt, rk, rv, rk < K, rk < K2, rv < V, lower, upper


@triton.jit
def _dstate_step(d_s, d_w, b_qt, b_q2, b_vgt, c_dn, b_do, g1, g2, gC,
                 IS_BF16: tl.constexpr, PREC: tl.constexpr):
    """Gradient of a chunk's start state from that of its end state (both walks share it):

        dS0 = gC dS + gC dW (Vg^T Q2) + (Q^T diag(g1) dN) Q2,    dW0 = gC^2 dW + Q^T diag(g2) dO."""
    b_vq = tl.dot(b_vgt, b_q2, input_precision=PREC)                                  # Vg^T Q2
    b_qdn = tl.dot(_cast(b_qt * g1[None, :], IS_BF16), c_dn, input_precision=PREC)    # Q^T diag(g1) dN
    n_s = d_s * gC + tl.dot(_cast(d_w, IS_BF16), _cast(b_vq, IS_BF16), input_precision=PREC) * gC
    n_s += tl.dot(_cast(b_qdn, IS_BF16), b_q2, input_precision=PREC)
    n_w = d_w * (gC * gC) + tl.dot(_cast(b_qt * g2[None, :], IS_BF16), b_do, input_precision=PREC)
    return n_s, n_w


@triton.jit
def _hla2_bwd_kernel(
    q, k, q2, k2, v, do,   # q, k: [B, T, H, K]; q2, k2: [B, T, H, K2]; v, do: [B, T, H, V]
    dq, dk, dq2, dk2, dv,  # gradients, same shapes and dtypes (dq2, dk2 written when CROSS)
    cs_s, cs_w,            # chunk-start snapshots from the MODE 1 forward (fp32, or bf16 with bf16 dots)
    de_s, de_w,            # gradient of each segment's END state, fp32: [B*H*NSEG, K, K2], [B*H*NSEG, K, V]
                           # (one segment: the gradient of the final state)
    dh0_s, dh0_w,          # gradient of the initial state, fp32 (written if STORE_DH0)
    log2g, T, NS,          # NS: chunks per segment
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    CROSS: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
):
    # one program per (segment, batch*head); it walks its chunks from last to first
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    NSEG = tl.num_programs(0)
    NT = tl.cdiv(T, BT)
    lo = i_n * NS
    hi = tl.minimum(lo + NS, NT)
    off_k, off_k2, off_v, rt, rk, rv, mk, mk2, mv, lower, upper = _bwd_indices(i_bh, T, H, K, K2, V, BT, BK, BV)

    # gradients w.r.t. the state at the end of the current chunk (and transposes)
    if HAS_DHT:
        i_sg = i_bh.to(tl.int64) * NSEG + i_n
        d_s = _mat(de_s + i_sg * K * K2, rk, mk, rk, mk2, K2)
        d_st = _mat_t(de_s + i_sg * K * K2, rk, mk2, rk, mk, K2)
        d_w = _mat(de_w + i_sg * K * V, rk, mk, rv, mv, V)
        d_wt = _mat_t(de_w + i_sg * K * V, rv, mv, rk, mk, V)
    else:
        d_s = tl.zeros([BK, BK], dtype=tl.float32)
        d_st = tl.zeros([BK, BK], dtype=tl.float32)
        d_w = tl.zeros([BK, BV], dtype=tl.float32)
        d_wt = tl.zeros([BV, BK], dtype=tl.float32)

    for i_r in range(0, hi - lo):
        i_c = hi - 1 - i_r
        t = i_c * BT + rt
        mt = t < T
        b_q, b_qt, b_k, b_kt, b_q2, b_q2t, b_k2, b_k2t, b_v, b_vt, b_do, b_dot = _chunk_tiles(
            q + off_k, k + off_k, q2 + off_k2, k2 + off_k2, v + off_v, do + off_v, t, mt, rk, mk, mk2, rv, mv,
            H, K, K2, V, CROSS, IS_BF16)
        # -- the state at this chunk's start (S0, S0^T, W0^T) -------------------------
        st_s = cs_s + (i_bh.to(tl.int64) * NT + i_c) * K * K2
        st_w = cs_w + (i_bh.to(tl.int64) * NT + i_c) * K * V
        b_s0 = _cast(_mat(st_s, rk, mk, rk, mk2, K2), IS_BF16)
        b_s0t = _cast(_mat_t(st_s, rk, mk2, rk, mk, K2), IS_BF16)
        b_w0t = _cast(_mat_t(st_w, rv, mv, rk, mk, V), IS_BF16)

        G, g1, g2, gl, gC = _decays(log2g, T, i_c, BT, USE_G)
        b_dq, b_dk, b_dq2, b_dk2, b_dv, c_dn, c_dnt = _bwd_chunk_grads(
            b_q, b_qt, b_k, b_kt, b_q2, b_q2t, b_k2, b_k2t, b_v, b_vt, b_do, b_dot,
            b_s0, b_s0t, b_w0t, d_s, d_st, d_w, d_wt,
            G, g1, g2, gl, gC, lower, upper, CROSS, IS_BF16, PREC)
        _store_grads(dq, dk, dq2, dk2, dv, off_k, off_k2, off_v, t, mt, rk, mk, mk2, rv, mv,
                     b_dq, b_dk, b_dq2, b_dk2, b_dv, H, K, K2, V, CROSS, 7)

        # -- gradients w.r.t. this chunk's start state ---------------------------------
        # dS0 = gC dS + gC dW Vg^T Q2 + Q^T diag(g1) dN Q2   (and its transpose). Written out here
        # rather than through _dstate_step: this order fits the 128-wide tiles in shared memory.
        b_vg = _cast(b_v * gl[:, None], IS_BF16)
        b_vgt = _cast(b_vt * gl[None, :], IS_BF16)
        c_dw = _cast(d_w, IS_BF16)
        c_dwt = _cast(d_wt, IS_BF16)
        b_vq = tl.dot(b_vgt, b_q2, input_precision=PREC)           # Vg^T Q2  [BV, BK]
        b_qv = tl.dot(b_q2t, b_vg, input_precision=PREC)           # Q2^T Vg  [BK, BV]
        b_qdn = tl.dot(_cast(b_qt * g1[None, :], IS_BF16), c_dn, input_precision=PREC)  # Q^T diag(g1) dN
        b_qdnt = tl.dot(b_q2t, c_dnt, input_precision=PREC)                             # Q2^T dN^T
        n_s = d_s * gC + tl.dot(c_dw, _cast(b_vq, IS_BF16), input_precision=PREC) * gC
        n_s += tl.dot(_cast(b_qdn, IS_BF16), b_q2, input_precision=PREC)
        n_st = d_st * gC + tl.dot(_cast(b_qv, IS_BF16), c_dwt, input_precision=PREC) * gC
        n_st += tl.dot(_cast(b_qdnt, IS_BF16), _cast(b_q * g1[:, None], IS_BF16), input_precision=PREC)
        # dW0 = gC^2 dW + Q^T diag(g2) dO   (and its transpose)
        d_w = d_w * (gC * gC) + tl.dot(_cast(b_qt * g2[None, :], IS_BF16), b_do, input_precision=PREC)
        d_wt = d_wt * (gC * gC) + tl.dot(b_dot, _cast(b_q * g2[:, None], IS_BF16), input_precision=PREC)
        d_s = n_s
        d_st = n_st

    if STORE_DH0:
        _put(dh0_s + i_bh * K * K2, d_s, rk, mk, rk, mk2, K2)
        _put(dh0_w + i_bh * K * V, d_w, rk, mk, rv, mv, V)


@triton.jit
def _hla2_bwd_state_kernel(
    q, q2, v, do,          # q: [B, T, H, K]; q2: [B, T, H, K2]; v, do: [B, T, H, V]
    ds_end, dw_end,        # out: gradient w.r.t. each chunk's END state (snapshot dtype), [B*H, NT, K, K2], [.., K, V]
    de_s, de_w,            # gradient of each segment's END state, fp32: [B*H*NSEG, K, K2], [B*H*NSEG, K, V]
    dh0_s, dh0_w, sum_p,   # gradient of the initial state (STORE_DH0); SUMMARY: segment sums, P [.., V, K2]
    log2g, T, NS,          # NS: chunks per segment
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    SUMMARY: tl.constexpr,  # walk the segment from a zero end gradient and store its summary only
    IS_BF16: tl.constexpr, PREC: tl.constexpr,
):
    # one program per (segment, batch*head), chunks from last to first; only (dS, dW) are carried
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    NSEG = tl.num_programs(0)
    NT = tl.cdiv(T, BT)
    lo = i_n * NS
    hi = tl.minimum(lo + NS, NT)
    i_sg = i_bh.to(tl.int64) * NSEG + i_n
    off_k, off_k2, off_v, rt, rk, rv, mk, mk2, mv, _, _ = _bwd_indices(i_bh, T, H, K, K2, V, BT, BK, BV)
    d_s, d_w = _state_pair(de_s, de_w, i_sg, rk, mk, mk2, rv, mv, K, K2, V, BK, BV, HAS_DHT)
    if SUMMARY:
        b_p = tl.zeros([BV, BK], dtype=tl.float32)  # P = sum_j g^(end-j) v_j q2_j^T over the segment
        t_end = tl.minimum(T, hi * BT)                # one past the segment's last token
    for i_r in range(0, hi - lo):
        i_c = hi - 1 - i_r
        if not SUMMARY:
            # the chunk's end-state gradient, read back by the parallel kernel
            _put(ds_end + (i_bh.to(tl.int64) * NT + i_c) * K * K2, d_s, rk, mk, rk, mk2, K2)
            _put(dw_end + (i_bh.to(tl.int64) * NT + i_c) * K * V, d_w, rk, mk, rv, mv, V)
        t = i_c * BT + rt
        mt = t < T
        b_qt = _cols(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
        b_q2 = _rows(q2 + off_k2, t, mt, rk, mk2, H * K2, IS_BF16)
        b_vt = _cols(v + off_v, t, mt, rv, mv, H * V, IS_BF16)
        b_do = _rows(do + off_v, t, mt, rv, mv, H * V, IS_BF16)
        G, g1, g2, gl, gC = _decays(log2g, T, i_c, BT, USE_G)
        b_vgt = _cast(b_vt * gl[None, :], IS_BF16)
        if SUMMARY:
            # Vg^T Q2 carries g^(chunk end - j); g^(segment end - chunk end) brings it to the segment end
            b_vq = tl.dot(b_vgt, b_q2, input_precision=PREC)
            if USE_G:
                b_vq = b_vq * _pow_g(log2g, t_end - tl.minimum(T, (i_c + 1) * BT), BT)
            b_p += b_vq
        # dN = (dO V^T) o G, then the start-state gradients
        b_dn = _cast(tl.dot(b_do, b_vt, input_precision=PREC) * G, IS_BF16)
        d_s, d_w = _dstate_step(d_s, d_w, b_qt, b_q2, b_vgt, b_dn, b_do, g1, g2, gC, IS_BF16, PREC)
    if SUMMARY:
        _put(ds_end + i_sg * K * K2, d_s, rk, mk, rk, mk2, K2)
        _put(dw_end + i_sg * K * V, d_w, rk, mk, rv, mv, V)
        _put(sum_p + i_sg * V * K2, b_p, rv, mv, rk, mk2, K2)
    elif STORE_DH0:
        _put(dh0_s + i_bh * K * K2, d_s, rk, mk, rk, mk2, K2)
        _put(dh0_w + i_bh * K * V, d_w, rk, mk, rv, mv, V)


@triton.jit
def _hla2_bwd_seg_combine_kernel(
    sum_s, sum_w, sum_p,  # segment summaries (SUMMARY walk): [B*H*NSEG, K, K2], [.., K, V], [.., V, K2]
    dht_s, dht_w,         # gradient of the final state, fp32 [B*H, K, K2], [B*H, K, V] (if HAS_DHT)
    de_s, de_w,           # out: gradient of each segment's END state, [B*H*NSEG, K, K2], [B*H*NSEG, K, V]
    dh0_s, dh0_w,         # out: gradient of the initial state (if STORE_DH0)
    log2g, T, NS, NSEG,
    K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
):
    """Fold the segments' backward summaries from the last segment to the first: with
    rho = g^(tokens in the segment) and P = sum_j g^(end-j) v_j q2_j^T,

        dS <- rho dS + rho dW P + dS_seg,    dW <- rho^2 dW + dW_seg,

    the transpose of the forward's (S, C, W) fold (P is C^T)."""
    i_bh = tl.program_id(0)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk = rk < K
    mk2 = rk < K2
    mv = rv < V
    d_s, d_w = _state_pair(dht_s, dht_w, i_bh.to(tl.int64), rk, mk, mk2, rv, mv, K, K2, V, BK, BV, HAS_DHT)
    for i_r in range(0, NSEG):
        i_s = NSEG - 1 - i_r
        i_sg = i_bh.to(tl.int64) * NSEG + i_s
        _put(de_s + i_sg * K * K2, d_s, rk, mk, rk, mk2, K2)
        _put(de_w + i_sg * K * V, d_w, rk, mk, rv, mv, V)
        if USE_G:
            rho = _pow_g(log2g, tl.minimum(T - i_s * NS * BT, NS * BT), BT)
        else:
            rho = 1.0
        b_p = _mat(sum_p + i_sg * V * K2, rv, mv, rk, mk2, K2)
        d_s = d_s * rho + tl.dot(d_w, b_p, input_precision=PREC) * rho + _mat(sum_s + i_sg * K * K2, rk, mk, rk, mk2, K2)
        d_w = d_w * (rho * rho) + _mat(sum_w + i_sg * K * V, rk, mk, rv, mv, V)
    if STORE_DH0:
        _put(dh0_s + i_bh * K * K2, d_s, rk, mk, rk, mk2, K2)
        _put(dh0_w + i_bh * K * V, d_w, rk, mk, rv, mv, V)


@triton.jit
def _hla2_bwd_grad_kernel(
    q, k, q2, k2, v, do,   # q, k: [B, T, H, K]; q2, k2: [B, T, H, K2]; v, do: [B, T, H, V]
    dq, dk, dq2, dk2, dv,  # gradients, same shapes and dtypes (dq2, dk2 written when CROSS)
    cs_s, cs_w,            # chunk-start snapshots (forward): [B*H, NT, K, K2], [B*H, NT, K, V]
    ds_end, dw_end,        # chunk-end state gradients (backward state pass), same shapes
    log2g, T,
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, CROSS: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    PARTS: tl.constexpr,   # which gradients this launch stores (see _store_grads): 7 all, or a subset
):
    # one program per (chunk, batch*head): every chunk is independent here. A launch that stores
    # only some gradients compiles to a smaller kernel (fewer live tiles, more programs a
    # multiprocessor); the launcher may split the gradients over several launches.
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    NT = tl.cdiv(T, BT)
    off_k, off_k2, off_v, rt, rk, rv, mk, mk2, mv, lower, upper = _bwd_indices(i_bh, T, H, K, K2, V, BT, BK, BV)
    t = i_c * BT + rt
    mt = t < T
    b_q, b_qt, b_k, b_kt, b_q2, b_q2t, b_k2, b_k2t, b_v, b_vt, b_do, b_dot = _chunk_tiles(
        q + off_k, k + off_k, q2 + off_k2, k2 + off_k2, v + off_v, do + off_v, t, mt, rk, mk, mk2, rv, mv,
        H, K, K2, V, CROSS, IS_BF16)
    # -- forward state at the chunk start, gradient of the state at its end ---------------
    off_s = (i_bh.to(tl.int64) * NT + i_c) * K * K2
    off_w = (i_bh.to(tl.int64) * NT + i_c) * K * V
    b_s0 = _cast(_mat(cs_s + off_s, rk, mk, rk, mk2, K2), IS_BF16)
    b_s0t = _cast(_mat_t(cs_s + off_s, rk, mk2, rk, mk, K2), IS_BF16)
    b_w0t = _cast(_mat_t(cs_w + off_w, rv, mv, rk, mk, V), IS_BF16)
    d_s = _mat(ds_end + off_s, rk, mk, rk, mk2, K2).to(tl.float32)
    d_st = _mat_t(ds_end + off_s, rk, mk2, rk, mk, K2).to(tl.float32)
    d_w = _mat(dw_end + off_w, rk, mk, rv, mv, V).to(tl.float32)
    d_wt = _mat_t(dw_end + off_w, rv, mv, rk, mk, V).to(tl.float32)
    G, g1, g2, gl, gC = _decays(log2g, T, i_c, BT, USE_G)
    b_dq, b_dk, b_dq2, b_dk2, b_dv, c_dn, c_dnt = _bwd_chunk_grads(
        b_q, b_qt, b_k, b_kt, b_q2, b_q2t, b_k2, b_k2t, b_v, b_vt, b_do, b_dot,
        b_s0, b_s0t, b_w0t, d_s, d_st, d_w, d_wt,
        G, g1, g2, gl, gC, lower, upper, CROSS, IS_BF16, PREC)
    _store_grads(dq, dk, dq2, dk2, dv, off_k, off_k2, off_v, t, mt, rk, mk, mk2, rv, mv,
                 b_dq, b_dk, b_dq2, b_dk2, b_dv, H, K, K2, V, CROSS, PARTS)
