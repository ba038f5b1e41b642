"""Triton kernels of chunked HLA2: forward walk, segment summaries and folds, backward.

Layout: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, log-gates ``g: [B, T, H]`` (contiguous).
States are fp32 ``S: [B*H, K, K2]``, ``W: [B*H, K, V]``, ``z: [B*H, K]`` whatever the input dtype:
every walk and every fold carries them in fp32. Per-chunk snapshots that a later kernel reads only
as dot operands may be stored in the dots' operand dtype (bf16 for bf16 inputs): rounding them on
store is the rounding the dot applies on load anyway.

The kernels compute the *cross* operator with an outer pair (q, k) and an inner pair (q2, k2),

    o_t = sum_{i <= j <= t} exp(2 b_t - b_i - b_j) (q_t . k_i)(q2_j . k2_i) v_j,

HLA2 being q2 = q, k2 = k (``CROSS=False``: the same tiles are reused). The cross form lets a head
wider than one tile run as a sum over pairs of feature blocks (see ``chunk.py``).

Rate. Every kernel takes a constexpr RATE = c, the rate at which the inner index j decays: the
weight is exp((1 + c) b_t - b_i - c b_j), so HLA2 is c = 1 and masked third order's second stage
(on the first stage's output R in place of v, ``hla3/chunk.py``) is c = 2. It changes only the
factors that involve j: M = N o G^c, O's and W's g2 = g1^(1 + c) and gC^(1 + c), and the value rows'
gl^c (``_inner_factors``); the state recurrence is W_t = a_t^(1 + c) W_{t-1} + (S_t q_t) v_t^T. At
c = 1 the kernels compile to what they were before the constexpr (HLA2's outputs and gradients
bit-identical and its times unchanged, ``benchmarks/results/hla2_h200_ab_rate.json``).

Chunk form (one chunk of C = BT rows, local row r, carried state (S0, W0, z0), the decay factors
G, g1, g2, gl, gC of ``hla_fast/ops/common/gates.py``):

    X  = Q K^T,   Y = K2 Q2^T                       (each its own dot, see below)
    A  = X o G,   Ym = Y o U                          (U: column >= row)
    N  = diag(g1) Q S0 Q2^T + A Ym
    M  = N o G                                        (G^c at rate c)
    O  = diag(g2) Q W0 + M V                          den = diag(g2) Q z0 + M 1
    S  <- gC S0 + (diag(gl) K)^T K2
    W  <- gC^2 W0 + P diag(gl) V,    P = gC S0 Q2^T + (diag(gl) K)^T Ym   [K, C]   (gC^(1+c), gl^c)
          (= gC^2 W0 + gC S0 (Q2^T diag(gl) V) + (diag(gl) K)^T (Ym diag(gl) V), in one product)
    z  <- the same as W with V -> 1

Gates: the chunk's cumulative log-gates are row sums for chunks of up to 32 rows (``chunk_beta``'s
ROW_SUMS) and a scan for longer ones. With the scan the gated per-chunk gradient kernel at
K = V = 128 (chunks of 32, 8 warps) spilled more registers a thread in its two launches by an sm_90
compile than with row sums, and a gated forward + backward was slower
(``benchmarks/results/hla2_h200_ab_row_sums.json``); on chunks of 64 the [64, 64] tile of the sums
costs the 4-warp walks registers (the forward spilled more with them), and HLA3's kernels
(chunks of 32 in 4 warps) spilled more with them, so both keep the scan there. Between their uses
the decay tiles are held in fp16 for bf16 dots (``held_decays``).

Every factor is exp of an exponent <= 0. Masks are applied by selection (``tl.where``), not by
multiplying with 0, so a non-finite score above the diagonal does not leak into earlier rows
through an elementwise product (the matrix products still multiply: see hla_fast/README.md).
Transposed quantities come from their own dots of loaded (or transposed-loaded) tiles, never
from transposing a dot result fed into another dot (miscompiled by Triton 3.4-3.7.0 on Hopper).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common.tiles import (
    cast, chunk_factors, dot, head_row, held_decays, ipow, load_cols, load_mat, load_mat_t, load_rows, load_vec,
    mat_or_zeros, read_rows, store_mat, vec_or_zeros,
)

# ============================================================================ forward: one chunk


@triton.jit
def _chunk_output(b_q, b_kt, b_q2t, b_ym, b_v, S, W, z, G, g1, g2,
                  NORM: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr, RATE: tl.constexpr):
    """Outputs of one chunk: O [BT, BV] = diag(g2) Q W0 + M V, and den [BT] = diag(g2) Q z0 + M 1
    when NORM (else a dummy 0); M = N o G^RATE (g2 = g1^(1 + RATE), ``_inner_factors``)."""
    b_x = tl.dot(b_q, b_kt, input_precision=PREC)                 # X = Q K^T      [BT, BT]
    b_a = tl.where(G > 0, b_x * G, 0.0)                            # A = X o G
    G = held_decays(ipow(G, RATE), IS_BF16)                        # G^RATE, until M's
    b_qs = dot(b_q, S, IS_BF16, PREC) * g1[:, None]                # diag(g1) Q S0  [BT, BK]
    b_n = dot(b_qs, b_q2t, IS_BF16, PREC) + dot(b_a, b_ym, IS_BF16, PREC)   # N  [BT, BT]
    b_m = tl.where(G > 0, b_n * G, 0.0)                            # M = N o G^RATE
    b_o = dot(b_q, W, IS_BF16, PREC) * g2[:, None] + dot(b_m, b_v, IS_BF16, PREC)   # [BT, BV]
    if NORM:
        den = tl.sum(b_q.to(tl.float32) * z[None, :], axis=1) * g2 + tl.sum(b_m, axis=1)
    else:
        den = 0.0
    return b_o, den


@triton.jit
def _store_state(s_base, w_base, z, z_off, S, W, b_z, ri, mi, rk, mk2, rv, mv, first_block,
                 K2: tl.constexpr, V: tl.constexpr, NORM: tl.constexpr):
    """Store rows ri of a state: S [BR, BK] at s_base by the first value block (it has no value
    columns), and W, z as ``_store_values``."""
    if first_block:
        store_mat(s_base, S, ri, mi, rk, mk2, K2)
    _store_values(w_base, z, z_off, W, b_z, ri, mi, rv, mv, first_block, V, NORM)


@triton.jit
def _store_values(w_base, z, z_off, W, b_z, ri, mi, rv, mv, first_block, V: tl.constexpr, NORM: tl.constexpr):
    """Store rows ri of W [BR, BV] at w_base (every value block) and, when NORM, of z [BR] at
    z + z_off (the first value block: z has no value columns)."""
    if NORM:
        if first_block:
            tl.store(z + z_off + ri, b_z, mask=mi)
    store_mat(w_base, W, ri, mi, rv, mv, V)


@triton.jit
def _store_output(o, den, off_v, off_g, t, mt, rv, mv, b_o, b_den, eps, first_block,
                  H: tl.constexpr, V: tl.constexpr, NORM: tl.constexpr):
    """Store a chunk's outputs [BT, BV] in o's dtype, divided by (den + eps) when NORM; den [BT]
    (fp32) by the first value block."""
    if NORM:
        b_o = b_o / (b_den + eps)[:, None]
        if first_block:
            tl.store(den + off_g + t * H, b_den, mask=mt)
    tl.store(o + off_v + t[:, None] * (H * V) + rv[None, :], b_o.to(o.dtype.element_ty),
             mask=mt[:, None] & mv[None, :])


@triton.jit
def _chunk_carry(b_kt, b_k2, b_q2t, b_ym, b_v, S, W, z, gl, gC, glv, gCw,
                 NORM: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr):
    """The state at the next chunk's start from (S0, W0, z0) at this one's.

    W's two new terms share their right factor diag(glv) V, so they are one product:
    W <- gCw W0 + P diag(glv) V with P = gC S0 Q2^T + (diag(gl) K)^T Ym [BK, BT], and z the same
    with V -> 1 (z <- gCw z0 + P glv); glv = gl^RATE, gCw = gC^(1 + RATE) (``_inner_factors``).
    Three products instead of four, and the K x K2 x V one of S0 (Q2^T Vg) becomes the K x K2 x BT
    one of S0 Q2^T."""
    b_kgt = b_kt * gl[None, :]                                     # (diag(gl) K)^T [BK, BT]
    W_new, z_new = _value_carry(b_kgt, b_q2t, b_ym, b_v, S, W, z, gC, glv, gCw, NORM, IS_BF16, PREC)
    S_new = S * gC + dot(b_kgt, b_k2, IS_BF16, PREC)               # [BK, BK]
    return S_new, W_new, z_new


@triton.jit
def _value_carry(b_kgt, b_q2t, b_ym, b_v, S, W, z, gC, glv, gCw,
                 NORM: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr):
    """W and z at the next chunk's start (``_chunk_carry``): W <- gCw W0 + P diag(glv) V with
    P = gC S0 Q2^T + (diag(gl) K)^T Ym [BR, BT], z the same with V -> 1. S0 enters only as the
    left factor of one product, so its rows may come from a register carry or from a stored
    snapshot (``hla2_fwd_value_walk_kernel``)."""
    b_p = dot(S, b_q2t, IS_BF16, PREC) * gC + dot(b_kgt, b_ym, IS_BF16, PREC)   # P [BR, BT]
    W_new = W * gCw + dot(b_p, b_v * glv[:, None], IS_BF16, PREC)              # [BR, BV]
    if NORM:
        z_new = z * gCw + tl.sum(b_p * glv[None, :], axis=1)                       # [BR]
    else:
        z_new = z
    return W_new, z_new


@triton.jit
def _inner_factors(g1, gl, gC, RATE: tl.constexpr):
    """The factors of the inner index j, whose weight is exp(RATE (b_t - b_j)) (RATE 1: HLA2;
    2: the second-order stage of third order, ``hla3``): g2 = g1^(1 + RATE) [BT] (W0 to row r),
    glv = gl^RATE [BT] (row r's value to the chunk's end), gCw = gC^(1 + RATE) (W0 to the end)."""
    return ipow(g1, RATE + 1), ipow(gl, RATE), ipow(gC, RATE + 1)


@triton.jit
def _carry_tiles(k, q2, k2, v, g, off_k, off_k2, off_v, off_g, log_gamma, t, mt, rr, mr, rk, mk2, rv, mv, upper,
                 H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 HAS_G: tl.constexpr, HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
                 RATE: tl.constexpr):
    """What carrying the state across one chunk reads: K^T [BR, BT] (the key features rr the program
    carries rows of S and W for: all of them, rk, except in a split state walk), Q2^T [BK, BT],
    K2 [BT, BK], V [BT, BV], the decay factors (G, g1, g2, gl, gC, bL, and glv, gCw of
    ``_inner_factors``), and Ym = (K2 Q2^T) o U [BT, BT] (its own dot, keeping i <= j)."""
    b_kt = load_cols(k + off_k, t, mt, rr, mr, H * K, IS_BF16)
    b_q2t = load_cols(q2 + off_k2, t, mt, rk, mk2, H * K2, IS_BF16)
    b_k2 = load_rows(k2 + off_k2, t, mt, rk, mk2, H * K2, IS_BF16)
    b_v = load_rows(v + off_v, t, mt, rv, mv, H * V, IS_BF16)
    G, g1, g2, gl, gC, bL = chunk_factors(g, off_g, log_gamma, t, mt, H, BT, HAS_G, HAS_DECAY, BT <= 32)
    g2, glv, gCw = _inner_factors(g1, gl, gC, RATE)
    b_ym = tl.where(upper, tl.dot(b_k2, b_q2t, input_precision=PREC), 0.0)
    return b_kt, b_q2t, b_k2, b_v, b_ym, G, g1, g2, gl, gC, bL, glv, gCw


@triton.jit
def _feature_ranges(i_v, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Key features rk [BK] (padded to a power of two), value features rv [BV] of value block i_v,
    and their masks: rk < K, rk < K2 (the inner pair's width), rv < V."""
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    return rk, rv, rk < K, rk < K2, rv < V


@triton.jit
def _head_offsets(i_bh, T, H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr):
    """Offsets of head i_bh's first element in [B, T, H, K], [.., K2], [.., V] and [B, T, H]
    tensors (64-bit, ``head_row``)."""
    row = head_row(i_bh, T, H)
    return row * K, row * K2, row * V, row


# ============================================================================ forward kernels


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "HAS_INIT": lambda a: a["h0_s"] is not None,
    "HAS_O": lambda a: a["o"] is not None,
    "SAVE_STATES": lambda a: a["cs_s"] is not None,
    "STORE_FINAL": lambda a: a["ht_s"] is not None,
    "NORM": lambda a: a["den"] is not None or a["cs_z"] is not None,
})
@triton.jit
def hla2_fwd_kernel(
    q, k, q2, k2, v, g,  # q, k: [B, T, H, K]; q2, k2: [B, T, H, K2]; v: [B, T, H, V]; g: [B, T, H] or None
    o, den,              # out: o [B, T, H, V] or None; den [B, T, H] fp32 (normalize) or None
    h0_s, h0_w, h0_z,    # start state of every segment, fp32 [B*H*NSEG, K, K2], [.., K, V], [.., K]; or None
    ht_s, ht_w, ht_z,    # out: final state [B*H, K, K2], [B*H, K, V], [B*H, K]; or None
    cs_s, cs_w, cs_z,    # out: chunk-start snapshots [B*H, NT, K, K2], [B*H, NT, K, V], fp32 [B*H, NT, K]
                         #      (z: when normalizing); or None
    log_gamma, eps, T, NS,  # log(gamma) (without g), normalizer eps, sequence length, chunks per segment
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr, RATE: tl.constexpr,
    HAS_G: tl.constexpr, HAS_INIT: tl.constexpr, HAS_O: tl.constexpr, SAVE_STATES: tl.constexpr,
    STORE_FINAL: tl.constexpr, NORM: tl.constexpr,
):
    """One program per (key-row block and value block, segment, batch*head) walks its segment's
    chunks in order, keeping its rows of S, of its block of W (and of z) in fp32 registers: outputs
    (HAS_O, normalized when NORM), chunk-start snapshots (SAVE_STATES) and the final state
    (STORE_FINAL, last segment). NORM: carry z (the forward of a normalized call, or the backward's
    recomputing walk, which then keeps z's snapshots).

    BR: the key rows of S, W and z one program carries. BR = BK carries them all, as the outputs
    need (o_t = q_t^T W0 + .. sums over every row). A state walk (no HAS_O) may split them into
    BK / BR blocks, one program each: row block a of every update reads only rows a of S, W and z
    and columns a of K^T (``_chunk_carry``), so the blocks never meet."""
    tl.static_assert(BR == BK or not HAS_O, "a walk that computes outputs carries every key row")
    # -- which piece of work this program owns ---------------------------------------------
    i_p, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_v, i_r = i_p % tl.cdiv(V, BV), i_p // tl.cdiv(V, BV)         # value block, key-row block
    NSEG = tl.num_programs(1)
    NT = tl.cdiv(T, BT)
    off_k, off_k2, off_v, off_g = _head_offsets(i_bh, T, H, K, K2, V)
    rt = tl.arange(0, BT)                # rows of a chunk
    rk, rv, mk, mk2, mv = _feature_ranges(i_v, K, K2, V, BK, BV)   # key / this block's value features
    rr = i_r * BR + tl.arange(0, BR)     # the key rows of S and W this program carries
    mr = rr < K
    upper = rt[:, None] <= rt[None, :]   # U: column >= row
    lo = i_n * NS
    hi = tl.minimum(lo + NS, NT)

    # -- the state at the segment's start -------------------------------------------------
    i_sg = i_bh.to(tl.int64) * NSEG + i_n
    S = mat_or_zeros(h0_s, i_sg * K * K2, rr, mr, rk, mk2, K2, BR, BK, HAS_INIT)   # [BR, BK]
    W = mat_or_zeros(h0_w, i_sg * K * V, rr, mr, rv, mv, V, BR, BV, HAS_INIT)      # [BR, BV]
    if NORM:
        z = vec_or_zeros(h0_z, i_sg * K, rr, mr, BR, HAS_INIT)                     # [BR]
    else:
        z = 0.0

    for i_c in range(lo, hi):
        t = i_c * BT + rt
        mt = t < T
        # -- the chunk's tiles, decay factors and Ym ----------------------------------------
        b_kt, b_q2t, b_k2, b_v, b_ym, G, g1, g2, gl, gC, bL, glv, gCw = _carry_tiles(
            k, q2, k2, v, g, off_k, off_k2, off_v, off_g, log_gamma, t, mt, rr, mr, rk, mk2, rv, mv, upper,
            H, K, K2, V, BT, HAS_G, HAS_DECAY, IS_BF16, PREC, RATE)

        if SAVE_STATES:
            # the state at this chunk's start (S once, by the first value block)
            i_cs = i_bh.to(tl.int64) * NT + i_c
            _store_state(cs_s + i_cs * K * K2, cs_w + i_cs * K * V, cs_z, i_cs * K, S, W, z, rr, mr, rk, mk2, rv, mv,
                         i_v == 0, K2, V, NORM)
        if HAS_O:
            b_q = load_rows(q + off_k, t, mt, rk, mk, H * K, IS_BF16)               # [BT, BK]
            b_o, b_den = _chunk_output(b_q, b_kt, b_q2t, b_ym, b_v, S, W, z, G, g1, g2,
                                       NORM, IS_BF16, PREC, RATE)
            _store_output(o, den, off_v, off_g, t, mt, rv, mv, b_o, b_den, eps, i_v == 0, H, V, NORM)
        # -- carry the state to the next chunk's start ------------------------------------
        S, W, z = _chunk_carry(b_kt, b_k2, b_q2t, b_ym, b_v, S, W, z, gl, gC, glv, gCw, NORM, IS_BF16, PREC)

    if STORE_FINAL:
        if i_n == NSEG - 1:
            _store_state(ht_s + i_bh * K * K2, ht_w + i_bh * K * V, ht_z, i_bh * K, S, W, z, rr, mr, rk, mk2, rv, mv,
                         i_v == 0, K2, V, NORM)


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "NORM": lambda a: a["den"] is not None,
})
@triton.jit
def hla2_fwd_output_kernel(
    q, k, q2, k2, v, g,  # q, k: [B, T, H, K]; q2, k2: [B, T, H, K2]; v: [B, T, H, V]; g: [B, T, H] or None
    o, den,              # out: o [B, T, H, V]; den [B, T, H] fp32 (normalize) or None
    cs_s, cs_w, cs_z,    # every chunk's start state (a state walk's snapshots): [B*H, NT, K, K2],
                         # [B*H, NT, K, V], fp32 [B*H, NT, K] (NORM) or None
    log_gamma, eps, T,   # log(gamma) (without g), normalizer eps, sequence length
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr, RATE: tl.constexpr,
    HAS_G: tl.constexpr, NORM: tl.constexpr,
):
    """The outputs of a split forward: one program per (value block, chunk, batch*head) computes
    its chunk's O (and den) from the chunk-start state a state walk stored, as the walk would
    have (``_chunk_output``), so that every chunk runs at once instead of one after the other.
    The snapshots hold what the walk's dots read: for bf16 dots the bf16 rounding of the fp32
    state, which is what ``dot`` casts the walk's registers to, so the outputs are the walk's."""
    i_v, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NT = tl.cdiv(T, BT)
    off_k, off_k2, off_v, off_g = _head_offsets(i_bh, T, H, K, K2, V)
    rt = tl.arange(0, BT)
    rk, rv, mk, mk2, mv = _feature_ranges(i_v, K, K2, V, BK, BV)
    upper = rt[:, None] <= rt[None, :]
    t = i_c * BT + rt
    mt = t < T
    # -- the chunk's tiles and decay factors (those of the carry go unused) ------------------
    b_kt, b_q2t, b_k2, b_v, b_ym, G, g1, g2, gl, gC, bL, glv, gCw = _carry_tiles(
        k, q2, k2, v, g, off_k, off_k2, off_v, off_g, log_gamma, t, mt, rk, mk, rk, mk2, rv, mv, upper,
        H, K, K2, V, BT, HAS_G, HAS_DECAY, IS_BF16, PREC, RATE)
    b_q = load_rows(q + off_k, t, mt, rk, mk, H * K, IS_BF16)                       # [BT, BK]
    # -- the state at the chunk's start -------------------------------------------------------
    i_cs = i_bh.to(tl.int64) * NT + i_c
    S = load_mat(cs_s + i_cs * K * K2, rk, mk, rk, mk2, K2)                           # [BK, BK]
    W = load_mat(cs_w + i_cs * K * V, rk, mk, rv, mv, V)                              # [BK, BV]
    if NORM:
        z = load_vec(cs_z + i_cs * K, rk, mk)                                         # [BK]
    else:
        z = 0.0
    b_o, b_den = _chunk_output(b_q, b_kt, b_q2t, b_ym, b_v, S, W, z, G, g1, g2, NORM, IS_BF16, PREC, RATE)
    _store_output(o, den, off_v, off_g, t, mt, rv, mv, b_o, b_den, eps, i_v == 0, H, V, NORM)


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "HAS_INIT": lambda a: a["h0_s"] is not None,
    "STORE_FINAL": lambda a: a["ht_s"] is not None,
})
@triton.jit
def hla2_fwd_key_walk_kernel(
    k, k2, g,            # k: [B, T, H, K]; k2: [B, T, H, K2]; g: [B, T, H] or None
    h0_s, ht_s,          # start state fp32 [B*H, K, K2] or None; out: final state fp32 [B*H, K, K2] or None
    cs_s,                # out: every chunk's start state [B*H, NT, K, K2] (the dots' operand dtype)
    log_gamma, T,        # log(gamma) (without g), sequence length
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
):
    """The first of a two-walk state pass (``fwd_two_walks``): S alone, a first-order walk
    S <- gC S0 + (diag(gl) K)^T K2, storing every chunk's start state. One program per block
    [BR, BR] of S (rows a, columns b) and batch*head: block (a, b) of the update reads only
    columns a of K^T and columns b of K2, so the blocks never meet. The arithmetic is
    ``_chunk_carry``'s for S, element for element."""
    i_r, i_j, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NT = tl.cdiv(T, BT)
    off_k, off_k2, off_v, off_g = _head_offsets(i_bh, T, H, K, K2, 1)   # (no values here)
    rt = tl.arange(0, BT)
    rr = i_r * BR + tl.arange(0, BR)     # rows of S this program carries
    rc = i_j * BR + tl.arange(0, BR)     # its columns
    mr, mc = rr < K, rc < K2
    S = mat_or_zeros(h0_s, i_bh.to(tl.int64) * K * K2, rr, mr, rc, mc, K2, BR, BR, HAS_INIT)   # [BR, BR]
    for i_c in range(0, NT):
        t = i_c * BT + rt
        mt = t < T
        i_cs = i_bh.to(tl.int64) * NT + i_c
        store_mat(cs_s + i_cs * K * K2, S, rr, mr, rc, mc, K2)                     # S at the chunk's start
        G, g1, g2, gl, gC, bL = chunk_factors(g, off_g, log_gamma, t, mt, H, BT, HAS_G, HAS_DECAY, BT <= 32)
        b_kgt = load_cols(k + off_k, t, mt, rr, mr, H * K, IS_BF16) * gl[None, :]   # (diag(gl) K)^T [BR, BT]
        b_k2 = load_rows(k2 + off_k2, t, mt, rc, mc, H * K2, IS_BF16)              # K2 [BT, BR]
        S = S * gC + dot(b_kgt, b_k2, IS_BF16, PREC)                                # [BR, BR]
    if STORE_FINAL:
        store_mat(ht_s + i_bh.to(tl.int64) * K * K2, S, rr, mr, rc, mc, K2)


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "HAS_INIT": lambda a: a["h0_w"] is not None,
    "STORE_FINAL": lambda a: a["ht_w"] is not None,
    "NORM": lambda a: a["cs_z"] is not None,
})
@triton.jit
def hla2_fwd_value_walk_kernel(
    k, q2, k2, v, g,     # k: [B, T, H, K]; q2, k2: [B, T, H, K2]; v: [B, T, H, V]; g: [B, T, H] or None
    cs_s,                # every chunk's start S [B*H, NT, K, K2] (``hla2_fwd_key_walk_kernel``)
    h0_w, h0_z,          # start state fp32 [B*H, K, V], [B*H, K] (NORM) or None
    ht_w, ht_z,          # out: final state fp32 [B*H, K, V], [B*H, K] (NORM); or None
    cs_w, cs_z,          # out: every chunk's start W [B*H, NT, K, V] (the dots' operand dtype), z fp32
                         #      [B*H, NT, K] (NORM) or None
    log_gamma, T,
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr, RATE: tl.constexpr,
    HAS_G: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, NORM: tl.constexpr,
):
    """The second walk of a two-walk state pass: W (and z) alone, reading each chunk's S from the
    first walk's snapshots instead of carrying it (``_value_carry``: S0 is only a product's left
    factor). One program per (key-row block, value block) and batch*head, as a split
    ``hla2_fwd_kernel`` walk, but holding [BR, BV] of W where that one holds S's rows too. The
    snapshots are what the one walk's dots read (its S rounded to the operand dtype), so W is the
    one walk's."""
    i_p, i_bh = tl.program_id(0), tl.program_id(2)
    i_v, i_r = i_p % tl.cdiv(V, BV), i_p // tl.cdiv(V, BV)         # value block, key-row block
    NT = tl.cdiv(T, BT)
    off_k, off_k2, off_v, off_g = _head_offsets(i_bh, T, H, K, K2, V)
    rt = tl.arange(0, BT)
    rk, rv, mk, mk2, mv = _feature_ranges(i_v, K, K2, V, BK, BV)
    rr = i_r * BR + tl.arange(0, BR)     # the key rows of W this program carries
    mr = rr < K
    upper = rt[:, None] <= rt[None, :]
    W = mat_or_zeros(h0_w, i_bh.to(tl.int64) * K * V, rr, mr, rv, mv, V, BR, BV, HAS_INIT)   # [BR, BV]
    if NORM:
        z = vec_or_zeros(h0_z, i_bh.to(tl.int64) * K, rr, mr, BR, HAS_INIT)                 # [BR]
    else:
        z = 0.0
    for i_c in range(0, NT):
        t = i_c * BT + rt
        mt = t < T
        b_kt, b_q2t, b_k2, b_v, b_ym, G, g1, g2, gl, gC, bL, glv, gCw = _carry_tiles(
            k, q2, k2, v, g, off_k, off_k2, off_v, off_g, log_gamma, t, mt, rr, mr, rk, mk2, rv, mv, upper,
            H, K, K2, V, BT, HAS_G, HAS_DECAY, IS_BF16, PREC, RATE)
        i_cs = i_bh.to(tl.int64) * NT + i_c
        _store_values(cs_w + i_cs * K * V, cs_z, i_cs * K, W, z, rr, mr, rv, mv, i_v == 0, V, NORM)   # at its start
        S = read_rows(cs_s + i_cs * K * K2, rr, mr, rk, mk2, K2)   # S0 rows [BR, BK], as stored (the dot's dtype)
        W, z = _value_carry(b_kt * gl[None, :], b_q2t, b_ym, b_v, S, W, z, gC, glv, gCw, NORM, IS_BF16, PREC)
    if STORE_FINAL:
        _store_values(ht_w + i_bh.to(tl.int64) * K * V, ht_z, i_bh.to(tl.int64) * K, W, z, rr, mr, rv, mv, i_v == 0,
                      V, NORM)


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "NORM": lambda a: a["sum_z"] is not None,
})
@triton.jit
def hla2_fwd_summary_kernel(
    k, q2, k2, v, g,          # k: [B, T, H, K]; q2, k2: [B, T, H, K2]; v: [B, T, H, V]; g or None
    sum_s, sum_w, sum_c,      # out: [B*H*NSEG, K, K2], [.., K, V], C [.., K2, V]
    sum_z, sum_cz, sum_lr,    # out: z [.., K] and Cz [.., K2] (NORM, else None); log rho [B*H*NSEG]
    log_gamma, T, NS,
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr, RATE: tl.constexpr,
    HAS_G: tl.constexpr, NORM: tl.constexpr,
):
    """Each segment's summary from a zero state: (S, W[, z]) after it,
    C = sum_j exp(RATE (b_end - b_j)) q2_j v_j^T (Cz: v -> 1) and log rho = b_end - b_start (its
    total log decay)."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NSEG = tl.num_programs(1)
    NT = tl.cdiv(T, BT)
    off_k, off_k2, off_v, off_g = _head_offsets(i_bh, T, H, K, K2, V)
    rt = tl.arange(0, BT)
    rk, rv, mk, mk2, mv = _feature_ranges(i_v, K, K2, V, BK, BV)
    upper = rt[:, None] <= rt[None, :]
    lo = i_n * NS
    hi = tl.minimum(lo + NS, NT)
    S = tl.zeros([BK, BK], dtype=tl.float32)
    W = tl.zeros([BK, BV], dtype=tl.float32)
    C = tl.zeros([BK, BV], dtype=tl.float32)
    if NORM:
        z = tl.zeros([BK], dtype=tl.float32)
        Cz = tl.zeros([BK], dtype=tl.float32)
    else:
        z = 0.0
    log_rho = 0.0
    for i_c in range(lo, hi):
        t = i_c * BT + rt
        mt = t < T
        b_kt, b_q2t, b_k2, b_v, b_ym, G, g1, g2, gl, gC, bL, glv, gCw = _carry_tiles(
            k, q2, k2, v, g, off_k, off_k2, off_v, off_g, log_gamma, t, mt, rk, mk, rk, mk2, rv, mv, upper,
            H, K, K2, V, BT, HAS_G, HAS_DECAY, IS_BF16, PREC, RATE)
        S, W, z = _chunk_carry(b_kt, b_k2, b_q2t, b_ym, b_v, S, W, z, gl, gC, glv, gCw, NORM, IS_BF16, PREC)
        gCv = ipow(gC, RATE)
        C = C * gCv + dot(b_q2t, b_v * glv[:, None], IS_BF16, PREC)                # + Q2^T diag(glv) V
        if NORM:
            Cz = Cz * gCv + tl.sum(b_q2t.to(tl.float32) * glv[None, :], axis=1)   # + Q2^T glv
        log_rho += bL
    i_sg = i_bh.to(tl.int64) * NSEG + i_n
    _store_state(sum_s + i_sg * K * K2, sum_w + i_sg * K * V, sum_z, i_sg * K, S, W, z, rk, mk, rk, mk2, rv, mv,
                 i_v == 0, K2, V, NORM)
    if i_v == 0:
        tl.store(sum_lr + i_sg, log_rho)
        if NORM:
            tl.store(sum_cz + i_sg * K2 + rk, Cz, mask=mk2)
    store_mat(sum_c + i_sg * K2 * V, C, rk, mk2, rv, mv, V)


@triton.heuristics({
    "HAS_INIT": lambda a: a["h0_s"] is not None,
    "NORM": lambda a: a["sum_z"] is not None,
})
@triton.jit
def hla2_fwd_fold_kernel(
    sum_s, sum_w, sum_c, sum_z, sum_cz, sum_lr,  # segment summaries (hla2_fwd_summary_kernel)
    h0_s, h0_w, h0_z,                            # state before the sequence [B*H, ..] or None
    seg_s, seg_w, seg_z,                         # out: state at each segment's start [B*H*NSEG, ..]
    NSEG,
    K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, RATE: tl.constexpr, HAS_INIT: tl.constexpr, NORM: tl.constexpr,
):
    """Fold the segment summaries in order, the (S, C, W) monoid: with rho = exp(log rho) and
    rw = rho^(1 + RATE) (W's decay across the segment),

        W <- rw W + rho S C_seg + W_seg,   z <- rw z + rho S Cz_seg + z_seg,   S <- rho S + S_seg."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    rk, rv, mk, mk2, mv = _feature_ranges(i_v, K, K2, V, BK, BV)
    S = mat_or_zeros(h0_s, i_bh.to(tl.int64) * K * K2, rk, mk, rk, mk2, K2, BK, BK, HAS_INIT)
    W = mat_or_zeros(h0_w, i_bh.to(tl.int64) * K * V, rk, mk, rv, mv, V, BK, BV, HAS_INIT)
    if NORM:
        z = vec_or_zeros(h0_z, i_bh.to(tl.int64) * K, rk, mk, BK, HAS_INIT)
    for i_s in range(0, NSEG):
        i_sg = i_bh.to(tl.int64) * NSEG + i_s
        if i_v == 0:
            store_mat(seg_s + i_sg * K * K2, S, rk, mk, rk, mk2, K2)
            if NORM:
                tl.store(seg_z + i_sg * K + rk, z, mask=mk)
        store_mat(seg_w + i_sg * K * V, W, rk, mk, rv, mv, V)
        rho = tl.exp(tl.load(sum_lr + i_sg))
        rw = ipow(rho, RATE + 1)
        b_c = load_mat(sum_c + i_sg * K2 * V, rk, mk2, rv, mv, V)
        W = W * rw + tl.dot(S, b_c, input_precision=PREC) * rho + load_mat(sum_w + i_sg * K * V, rk, mk, rv, mv, V)
        if NORM:
            b_cz = load_vec(sum_cz + i_sg * K2, rk, mk2)
            z = z * rw + tl.sum(S * b_cz[None, :], axis=1) * rho + load_vec(sum_z + i_sg * K, rk, mk)
        S = S * rho + load_mat(sum_s + i_sg * K * K2, rk, mk, rk, mk2, K2)


# ============================================================================ backward: one chunk


@triton.jit
def _bwd_chunk_grads(
    b_q, b_qt, b_k, b_kt,            # outer pair: Q, K as [BT, BK] and transposed [BK, BT]
    b_q2, b_q2t, b_k2, b_k2t,        # inner pair (the same tiles when not CROSS)
    b_v, b_vt, b_do, b_dot,          # V, dO as [BT, BV] and transposed
    b_s0, b_s0t, b_w0t,              # chunk-start state S0 [BK, BK], S0^T, W0^T [BV, BK]
    d_s, d_st, d_w, d_wt,            # gradient of the chunk-end state (and transposes), fp32
    G, g1, g2, gl, gC, glv, lower, upper,  # decays (g2, glv: ``_inner_factors``) and masks of the chunk
    b_dd, z0, d_z,                   # NORM: the ones column's output gradient [BT], z0 [BK], dz [BK]
    CROSS: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr,
    DV1: tl.constexpr,               # NORM: also the ones column's value gradient dv1 (for dL/db)
    RATE: tl.constexpr,              # the inner index's rate: M = N o G^RATE, Vg = diag(gl^RATE) V
):
    """Gradients of one chunk (fp32): returns dq, dk, dq2, dk2, dv and (DV1) dv1 [BT].

    Not CROSS: dq2 and dk2 already hold the whole gradient of q and k (dq, dk are partial).
    NORM: the value is [V | 1] (a column of ones, whose output is the denominator) with output
    gradient [dO | dd], start state [W0 | z0] and end-state gradient [dW | dz]. Every product over
    value columns gains the ones column's rank-1 term (marked "ones" below), and dv1 is that
    column's value gradient (only the gates' dL/db reads it)."""
    GT = tl.trans(G)  # G^T of an elementwise tile (not of a dot result)

    # -- recompute the forward's chunk matrices ----------------------------------------------
    b_x = tl.dot(b_q, b_kt, input_precision=PREC)       # X = Q K^T
    b_y = tl.dot(b_k2, b_q2t, input_precision=PREC)     # Y = K2 Q2^T
    b_a = b_x * G                 # A
    b_ym = tl.where(upper, b_y, 0.0)                    # Ym
    if NORM:   # the ones column's vectors, formed while their tiles are live
        ym_gl = tl.sum(b_ym * glv[None, :], axis=1)                 # Ym glv  [BT]
        kg_dz = tl.sum(b_k.to(tl.float32) * d_z[None, :], axis=1) * gl   # diag(gl) K dz  [BT]
    if CROSS:
        b_at = tl.dot(b_k, b_qt, input_precision=PREC) * GT  # A^T
        b_xm = tl.where(lower, tl.dot(b_q2, b_k2t, input_precision=PREC), 0.0)      # Ym^T
    else:
        b_at = b_y * GT
        b_xm = tl.where(lower, b_x, 0.0)
    # dN = (dO V^T) o G and its transpose (V dO^T) o G^T
    b_dn = tl.dot(b_do, b_vt, input_precision=PREC)
    b_dnt = tl.dot(b_v, b_dot, input_precision=PREC)
    if NORM:   # ones: dd 1^T and 1 dd^T
        b_dn += b_dd[:, None]
        b_dnt += b_dd[None, :]
    b_dn = b_dn * ipow(G, RATE)
    b_dnt = b_dnt * ipow(GT, RATE)
    GT = held_decays(GT, IS_BF16)   # until M^T's and dX^T's (G's last use, dX, comes next)
    b_qs = tl.dot(b_q, b_s0, input_precision=PREC)      # Q S0     [BT, K2]
    b_qst = tl.dot(b_q2, b_s0t, input_precision=PREC)   # Q2 S0^T  [BT, K]
    b_kg = cast(b_k * gl[:, None], IS_BF16)
    b_vg = cast(b_v * glv[:, None], IS_BF16)
    b_kgt = cast(b_kt * gl[None, :], IS_BF16)
    b_vgt = cast(b_vt * glv[None, :], IS_BF16)
    c_dw = cast(d_w, IS_BF16)
    c_dwt = cast(d_wt, IS_BF16)
    c_xm = cast(b_xm, IS_BF16)
    c_ym = cast(b_ym, IS_BF16)
    c_dn = cast(b_dn, IS_BF16)
    c_dnt = cast(b_dnt, IS_BF16)
    # the products of dN with G's tiles first, so that G and A die here: dX = (dN Xm^T) o G,
    # ((dN^T A) o L) and dN^T diag(g1) Q S0 (a dq launch with gates spilled more registers a thread
    # when they waited for the dV block: benchmarks/results/compile_hla2_bf16_k64_gates_cpu.md)
    b_dx = tl.dot(c_dn, c_xm, input_precision=PREC) * G
    b_dx2 = tl.where(lower, dot(c_dnt, b_a, IS_BF16, PREC), 0.0)
    b_dnq2 = dot(c_dnt, b_qs * g1[:, None], IS_BF16, PREC)

    # -- dV = M^T dO + diag(gl) (gC Q2 S0^T dW + Ym^T Kg dW) ---------------------------------
    b_mt = dot(b_qst, b_qt * g1[None, :], IS_BF16, PREC) + dot(c_xm, b_at, IS_BF16, PREC)
    b_mt = b_mt * ipow(GT, RATE)
    b_dv = dot(b_mt, b_do, IS_BF16, PREC)
    b_xk = tl.dot(c_xm, b_kg, input_precision=PREC)
    b_dvg = dot(b_qst, c_dw, IS_BF16, PREC) * gC + dot(b_xk, c_dw, IS_BF16, PREC)
    b_dv += b_dvg * glv[:, None]
    if DV1:   # ones: the same rows against dd and dz
        b_dv1 = tl.sum(b_mt * b_dd[None, :], axis=1)
        b_dv1 += (tl.sum(b_qst * d_z[None, :], axis=1) * gC + tl.sum(b_xk * d_z[None, :], axis=1)) * glv
    else:
        b_dv1 = 0.0

    # -- dQ (outer): diag(g2) dO W0^T + diag(g1) dN Q2 S0^T + ((dN Ym^T) o G) K --------------
    b_dq = tl.dot(b_do, b_w0t, input_precision=PREC)
    if NORM:   # ones: dd z0^T
        b_dq += b_dd[:, None] * z0[None, :]
    b_dq = b_dq * g2[:, None]
    b_dnq = tl.dot(c_dn, b_q2, input_precision=PREC)
    b_dq += dot(b_dnq, b_s0t, IS_BF16, PREC) * g1[:, None]
    # -- dQ2 (inner): ((dN^T A) o L) K2 + ((Vg dW^T Kg^T) o L) K2 + dN^T diag(g1) Q S0 + gC Vg dW^T S0
    b_f = tl.dot(b_vg, c_dwt, input_precision=PREC)                     # Vg dW^T [BT, BK]
    if NORM:   # ones: glv dz^T
        b_f += glv[:, None] * d_z[None, :]
    b_f = cast(b_f, IS_BF16)
    b_dx2 += tl.where(lower, tl.dot(b_f, b_kgt, input_precision=PREC), 0.0)
    if CROSS:
        b_dq += dot(b_dx, b_k, IS_BF16, PREC)
        b_dq2 = dot(b_dx2, b_k2, IS_BF16, PREC)
    else:
        b_dq2 = b_dq + dot(b_dx + b_dx2, b_k, IS_BF16, PREC)
    b_dq2 += b_dnq2
    b_dq2 += tl.dot(b_f, b_s0, input_precision=PREC) * gC

    # -- dK (outer): ((Ym dN^T) o G^T) Q + diag(gl) (Ym Vg dW^T + K2 dS^T) -------------------
    b_dxt = tl.dot(c_ym, c_dnt, input_precision=PREC) * GT
    b_yv = tl.dot(c_ym, b_vg, input_precision=PREC)
    b_dkg = dot(b_yv, c_dwt, IS_BF16, PREC)
    if NORM:   # ones: (Ym gl) dz^T
        b_dkg += ym_gl[:, None] * d_z[None, :]
    # -- dK2 (inner): ((A^T dN) o U) Q2 + ((Kg dW Vg^T) o U) Q2 + diag(gl) K dS -------------
    b_dy = tl.where(upper, dot(b_at, c_dn, IS_BF16, PREC), 0.0)
    b_e = tl.dot(b_kg, c_dw, input_precision=PREC)
    b_dy += tl.where(upper, dot(b_e, b_vgt, IS_BF16, PREC), 0.0)
    if NORM:   # ones: (Kg dz) glv^T
        b_dy += tl.where(upper, kg_dz[:, None] * glv[None, :], 0.0)
    if CROSS:
        b_dk = dot(b_dxt, b_q, IS_BF16, PREC)
        b_dkg += dot(b_k2, d_st, IS_BF16, PREC)
        b_dk += b_dkg * gl[:, None]
        b_dk2 = dot(b_dy, b_q2, IS_BF16, PREC)
        b_dk2 += dot(b_kg, d_s, IS_BF16, PREC)
    else:
        b_dk = dot(b_dxt + b_dy, b_q, IS_BF16, PREC)
        b_dkg += dot(b_k, d_s + d_st, IS_BF16, PREC)
        b_dk2 = b_dk + b_dkg * gl[:, None]
    return b_dq, b_dk, b_dq2, b_dk2, b_dv, b_dv1


@triton.jit
def _dstate_step(d_s, d_w, b_qt, b_q2, b_vgt, b_dn, b_do, g1, g2, gC, gCw, b_ones,
                 IS_BF16: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr):
    """Gradient of a chunk's start state from that of its end state:

        dS0 = gC dS + gC dW (Vg^T Q2) + (Q^T diag(g1) dN + ones) Q2,    dW0 = gCw dW + Q^T diag(g2) dO,

    (Vg = diag(glv) V; g2, glv, gCw of ``_inner_factors``),

    ones (NORM): a [BK, BT] term that enters dS0 through Q2 (a normalized walk's gC dz gl^T)."""
    b_vq = tl.dot(b_vgt, b_q2, input_precision=PREC)                       # Vg^T Q2         [BV, BK]
    b_qdn = dot(b_qt * g1[None, :], b_dn, IS_BF16, PREC)                    # Q^T diag(g1) dN [BK, BT]
    if NORM:
        b_qdn += b_ones
    n_s = d_s * gC + dot(d_w, b_vq, IS_BF16, PREC) * gC + dot(b_qdn, b_q2, IS_BF16, PREC)
    n_w = d_w * gCw + dot(b_qt * g2[None, :], b_do, IS_BF16, PREC)
    return n_s, n_w


# ============================================================================ backward kernels


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "STORE_W": lambda a: a["ones_w"] is not None,
})
@triton.jit
def hla2_bwd_ones_kernel(
    q, g, dd,          # q: [B, T, H, K]; g: [B, T, H] or None; dd: the ones column's output gradient, fp32 [B, T, H]
    ones_u, ones_w,    # out: per chunk, fp32 [B*H, NT, K]: Q^T diag(g2) dd, and Q^T glv (or None: not needed)
    log_gamma, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HAS_DECAY: tl.constexpr, RATE: tl.constexpr, HAS_G: tl.constexpr, STORE_W: tl.constexpr,
):
    """One program per (chunk, batch*head): the two vectors a normalized backward walk adds per
    chunk for the ones column (plain operator, q2 = q), every chunk at once and in fp32."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    NT = tl.cdiv(T, BT)
    row = head_row(i_bh, T, H)
    t = i_c * BT + tl.arange(0, BT)
    mt = t < T
    rk = tl.arange(0, BK)
    mk = rk < K
    b_q = read_rows(q + row * K, t, mt, rk, mk, H * K).to(tl.float32)             # [BT, BK]
    b_dd = tl.load(dd + row + t * H, mask=mt, other=0.0)                            # [BT]
    G, g1, g2, gl, gC, bL = chunk_factors(g, row, log_gamma, t, mt, H, BT, HAS_G, HAS_DECAY, BT <= 32)
    g2, glv, gCw = _inner_factors(g1, gl, gC, RATE)
    off = (i_bh.to(tl.int64) * NT + i_c) * K
    tl.store(ones_u + off + rk, tl.sum(b_q * (g2 * b_dd)[:, None], axis=0), mask=mk)
    if STORE_W:   # only segment summaries read it
        tl.store(ones_w + off + rk, tl.sum(b_q * glv[:, None], axis=0), mask=mk)


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "HAS_DHT": lambda a: a["de_s"] is not None,
    "STORE_DH0": lambda a: a["dh0_s"] is not None,
    "SUMMARY": lambda a: a["sum_p"] is not None,
    "NORM": lambda a: a["dd"] is not None,
})
@triton.jit(do_not_specialize=["C0", "NP"])
def hla2_bwd_state_kernel(
    q, q2, v, do, g,       # q: [B, T, H, K]; q2: [B, T, H, K2]; v, do: [B, T, H, V]; g or None
    dd,                    # NORM: output gradient of the ones column (the denominator), fp32 [B, T, H]; or None
    ones_u, ones_w,        # NORM: each chunk's Q^T diag(g2) dd and (SUMMARY) Q2^T gl, fp32 [B*H, NT, K]
                           #   (hla2_bwd_ones_kernel); or None
    ds_end, dw_end, dz_end,  # out: gradient of each chunk's END state [B*H, NP, K, K2], [.., K, V],
                           #      fp32 [.., K] (NORM), chunk C0 + i at i (SUMMARY: the segment's
                           #      start-state gradient [B*H*NSEG, ..])
    de_s, de_w, de_z,      # gradient of each segment's END state, fp32 [B*H*NSEG, ..]; or None (zero)
    dh0_s, dh0_w, dh0_z,   # out: gradient of the initial state [B*H, ..]; or None
    sum_p, sum_pz, sum_lr,  # SUMMARY out: P = sum_j exp(RATE (b_end - b_j)) v_j q2_j^T [B*H*NSEG, V, K2],
                           #   its ones row [.., K2] (NORM), log rho [B*H*NSEG]; or None
    log_gamma, T, NS,
    C0, NP,                # the walk covers chunks [C0, min(C0 + NP, NT)) (a piece of the sequence)
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr, RATE: tl.constexpr,
    HAS_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, SUMMARY: tl.constexpr,
    NORM: tl.constexpr,
):
    """One program per (segment, batch*head) walks its chunks from last to first carrying only the
    state gradients (dS, dW), storing each chunk's end-state gradient for the per-chunk kernel.
    SUMMARY: walk from a zero end gradient and store the segment's backward summary instead.
    NORM: the value is [V | 1] with output gradient [dO | dd]; the ones column's state gradient
    dz [BK] is carried beside dW (dz0 = gCw dz + Q^T diag(g2) dd, and dS0 gains gC dz (glv^T Q2)),
    with Q^T diag(g2) dd per chunk from ``hla2_bwd_ones_kernel`` (row sums of the Q tiles here,
    which the walk holds as dot operands, cost register spills), and Q2^T glv (the ones row of the
    segment summary's P) from there too.

    C0, NP: the chunks this launch walks (segments of NS chunks from C0, none past C0 + NP or the
    last chunk) and the per-head length of the ds_end buffer. A backward in pieces walks the
    sequence's last piece first, starting each piece from the gradient the later one stored in
    dh0, and reuses one piece-sized buffer; not in pieces, C0 = 0 and NP = NT."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    NSEG = tl.num_programs(0)
    NT = tl.cdiv(T, BT)
    lo = C0 + i_n * NS
    hi = tl.minimum(tl.minimum(lo + NS, C0 + NP), NT)
    i_sg = i_bh.to(tl.int64) * NSEG + i_n
    off_k, off_k2, off_v, off_g = _head_offsets(i_bh, T, H, K, K2, V)
    rt = tl.arange(0, BT)
    rk, rv, mk, mk2, mv = _feature_ranges(0, K, K2, V, BK, BV)
    d_s = mat_or_zeros(de_s, i_sg * K * K2, rk, mk, rk, mk2, K2, BK, BK, HAS_DHT)
    d_w = mat_or_zeros(de_w, i_sg * K * V, rk, mk, rv, mv, V, BK, BV, HAS_DHT)
    if NORM:
        d_z = vec_or_zeros(de_z, i_sg * K, rk, mk, BK, HAS_DHT)
    if SUMMARY:
        b_p = tl.zeros([BV, BK], dtype=tl.float32)
        if NORM:
            b_pz = tl.zeros([BK], dtype=tl.float32)
        log_after = 0.0  # log decay from the current chunk's end to the segment's end
    for i_r in range(0, hi - lo):
        i_c = hi - 1 - i_r
        if not SUMMARY:
            store_mat(ds_end + (i_bh.to(tl.int64) * NP + i_c - C0) * K * K2, d_s, rk, mk, rk, mk2, K2)
            store_mat(dw_end + (i_bh.to(tl.int64) * NP + i_c - C0) * K * V, d_w, rk, mk, rv, mv, V)
            if NORM:
                tl.store(dz_end + (i_bh.to(tl.int64) * NP + i_c - C0) * K + rk, d_z, mask=mk)
        t = i_c * BT + rt
        mt = t < T
        b_qt = load_cols(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
        b_q2 = load_rows(q2 + off_k2, t, mt, rk, mk2, H * K2, IS_BF16)
        b_vt = load_cols(v + off_v, t, mt, rv, mv, H * V, IS_BF16)
        b_do = load_rows(do + off_v, t, mt, rv, mv, H * V, IS_BF16)
        G, g1, g2, gl, gC, bL = chunk_factors(g, off_g, log_gamma, t, mt, H, BT, HAS_G, HAS_DECAY, BT <= 32)
        g2, glv, gCw = _inner_factors(g1, gl, gC, RATE)
        b_vgt = cast(b_vt * glv[None, :], IS_BF16)
        b_dn = tl.dot(b_do, b_vt, input_precision=PREC)
        if NORM:
            b_dd = tl.load(dd + off_g + t * H, mask=mt, other=0.0)                  # [BT]
            b_dn += b_dd[:, None]                                                   # ones: dd 1^T
            off_u = (i_bh.to(tl.int64) * NT + i_c) * K
            # dS0's ones term gC dz (gl^T Q2), as a [BK, BT] term of the product with Q2 (an
            # elementwise outer product added to dS instead spilled registers at K = 128)
            b_ones = (d_z * gC)[:, None] * glv[None, :]
            d_z = d_z * gCw + load_vec(ones_u + off_u, rk, mk)                     # + Q^T diag(g2) dd
        else:
            b_ones = 0.0
        if SUMMARY:
            b_p += tl.dot(b_vgt, b_q2, input_precision=PREC) * tl.exp(RATE * log_after)
            if NORM:
                b_pz += load_vec(ones_w + off_u, rk, mk) * tl.exp(RATE * log_after)  # + Q2^T glv
            log_after += bL
        b_dn = cast(b_dn * ipow(G, RATE), IS_BF16)
        d_s, d_w = _dstate_step(d_s, d_w, b_qt, b_q2, b_vgt, b_dn, b_do, g1, g2, gC, gCw, b_ones, IS_BF16, PREC,
                                NORM)
    if SUMMARY:
        store_mat(ds_end + i_sg * K * K2, d_s, rk, mk, rk, mk2, K2)
        store_mat(dw_end + i_sg * K * V, d_w, rk, mk, rv, mv, V)
        store_mat(sum_p + i_sg * V * K2, b_p, rv, mv, rk, mk2, K2)
        tl.store(sum_lr + i_sg, log_after)
        if NORM:
            tl.store(dz_end + i_sg * K + rk, d_z, mask=mk)
            tl.store(sum_pz + i_sg * K2 + rk, b_pz, mask=mk2)
    elif STORE_DH0:
        store_mat(dh0_s + i_bh * K * K2, d_s, rk, mk, rk, mk2, K2)
        store_mat(dh0_w + i_bh * K * V, d_w, rk, mk, rv, mv, V)
        if NORM:
            tl.store(dh0_z + i_bh * K + rk, d_z, mask=mk)


@triton.heuristics({
    "HAS_DHT": lambda a: a["dht_s"] is not None,
    "STORE_DH0": lambda a: a["dh0_s"] is not None,
    "NORM": lambda a: a["sum_z"] is not None,
})
@triton.jit
def hla2_bwd_fold_kernel(
    sum_s, sum_w, sum_z,          # segments' backward summaries (SUMMARY walk; sum_z: NORM, else None)
    sum_p, sum_pz, sum_lr,
    dht_s, dht_w, dht_z,          # gradient of the final state, fp32 [B*H, ..]; or None
    de_s, de_w, de_z,             # out: gradient of each segment's END state [B*H*NSEG, ..]
    dh0_s, dh0_w, dh0_z,          # out: gradient of the initial state; or None
    NSEG,
    K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, RATE: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    NORM: tl.constexpr,
):
    """Fold the backward summaries from the last segment to the first (the transpose of the
    forward's fold, P = C^T; rw = rho^(1 + RATE)):  dS <- rho dS + rho dW P + dS_seg,
    dW <- rw dW + dW_seg; NORM: dS gains rho dz pz^T (pz: P's ones row), dz <- rw dz + dz_seg."""
    i_bh = tl.program_id(0)
    rk, rv, mk, mk2, mv = _feature_ranges(0, K, K2, V, BK, BV)
    d_s = mat_or_zeros(dht_s, i_bh.to(tl.int64) * K * K2, rk, mk, rk, mk2, K2, BK, BK, HAS_DHT)
    d_w = mat_or_zeros(dht_w, i_bh.to(tl.int64) * K * V, rk, mk, rv, mv, V, BK, BV, HAS_DHT)
    if NORM:
        d_z = vec_or_zeros(dht_z, i_bh.to(tl.int64) * K, rk, mk, BK, HAS_DHT)
    for i_r in range(0, NSEG):
        i_sg = i_bh.to(tl.int64) * NSEG + NSEG - 1 - i_r
        store_mat(de_s + i_sg * K * K2, d_s, rk, mk, rk, mk2, K2)
        store_mat(de_w + i_sg * K * V, d_w, rk, mk, rv, mv, V)
        rho = tl.exp(tl.load(sum_lr + i_sg))
        rw = ipow(rho, RATE + 1)
        b_p = load_mat(sum_p + i_sg * V * K2, rv, mv, rk, mk2, K2)
        d_s = d_s * rho + tl.dot(d_w, b_p, input_precision=PREC) * rho + load_mat(sum_s + i_sg * K * K2, rk, mk, rk, mk2, K2)
        d_w = d_w * rw + load_mat(sum_w + i_sg * K * V, rk, mk, rv, mv, V)
        if NORM:
            tl.store(de_z + i_sg * K + rk, d_z, mask=mk)
            d_s += d_z[:, None] * load_vec(sum_pz + i_sg * K2, rk, mk2)[None, :] * rho
            d_z = d_z * rw + load_vec(sum_z + i_sg * K, rk, mk)
    if STORE_DH0:
        store_mat(dh0_s + i_bh * K * K2, d_s, rk, mk, rk, mk2, K2)
        store_mat(dh0_w + i_bh * K * V, d_w, rk, mk, rv, mv, V)
        if NORM:
            tl.store(dh0_z + i_bh * K + rk, d_z, mask=mk)


@triton.jit
def _store_pair(d, d2, off_k, off_k2, t, m_tk, m_tk2, rk, b_d, b_d2,
                H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, CROSS: tl.constexpr):
    """The gradient of the outer pair into d ([B, T, H, K]) and of the inner pair into d2
    ([.., K2]). Not CROSS: the pairs are one tensor and b_d2 holds its whole gradient."""
    if CROSS:
        tl.store(d + off_k + t[:, None] * (H * K) + rk[None, :], b_d.to(d.dtype.element_ty), mask=m_tk)
        tl.store(d2 + off_k2 + t[:, None] * (H * K2) + rk[None, :], b_d2.to(d2.dtype.element_ty), mask=m_tk2)
    else:
        tl.store(d + off_k + t[:, None] * (H * K) + rk[None, :], b_d2.to(d.dtype.element_ty), mask=m_tk)


@triton.heuristics({
    "HAS_G": lambda a: a["g"] is not None,
    "HAS_DB": lambda a: a["db"] is not None,
    "NORM": lambda a: a["dd"] is not None,
})
@triton.jit(do_not_specialize=["C0", "NP"])
def hla2_bwd_grad_kernel(
    q, k, q2, k2, v, do, g,  # inputs as in the forward; do: [B, T, H, V]
    dd,                      # NORM: output gradient of the ones column, fp32 [B, T, H]; or None
    dq, dk, dq2, dk2, dv,    # out: gradients, same shapes and dtypes (dq2, dk2 written when CROSS)
    db,                      # out: this launch's share of dL/db_t, fp32 [B, T, H]; or None
    cs_s, cs_w, cs_z,        # chunk-start snapshots [B*H, NT, K, K2], [B*H, NT, K, V], fp32 [.., K] (NORM)
    ds_end, dw_end, dz_end,  # chunk-end state gradients (hla2_bwd_state_kernel) [B*H, NP, ..]: chunk C0 + i at i
    log_gamma, T,
    C0, NP,                  # this launch's chunks: program i does chunk C0 + i
    H: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, CROSS: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    RATE: tl.constexpr,
    PARTS: tl.constexpr,     # which gradients this launch stores: bit 1 dq, 2 dk, 4 dv
    HAS_G: tl.constexpr, HAS_DB: tl.constexpr, NORM: tl.constexpr,
):
    """One program per (chunk, batch*head): every chunk is independent here. A launch storing only
    some gradients compiles to a smaller kernel (the compiler drops products no stored gradient
    needs), so the launcher may split them over several launches.

    db: each term of the operator carries exp((1 + c) b_t - b_i - c b_j) (c = RATE; 1 for HLA2), so
    the operator is the ungated one on q_x e^{a b_x}, k_x e^{b b_x}, v_x e^{d b_x} whenever the
    exponents match: a = 1 + c (q_t), 2 b = -1 (k_i twice), a + d = -c (q_j and v_j). Hence
    dL/db_s = a q.dq + b k.dk + d v.dv: (1 + c) q.dq - 1/2 k.dk - (1 + 2c) v.dv (plain HLA2: 2, -1/2,
    -3), or (1 + c) q.dq - k.dk - c v.dv (cross, the outer pair carrying t and i). Each launch adds
    the part its gradients give. NORM: the value is [V | 1] (``_bwd_chunk_grads``), whose ones
    column adds -(1 + 2c) dv1 to the v term."""
    i_c, i_bh = C0 + tl.program_id(0), tl.program_id(1)
    NT = tl.cdiv(T, BT)
    off_k, off_k2, off_v, off_g = _head_offsets(i_bh, T, H, K, K2, V)
    rt = tl.arange(0, BT)
    rk, rv, mk, mk2, mv = _feature_ranges(0, K, K2, V, BK, BV)
    lower = rt[:, None] >= rt[None, :]
    upper = rt[:, None] <= rt[None, :]
    t = i_c * BT + rt
    mt = t < T
    # -- every tile of the chunk, plain and transposed (strided loads) ------------------------
    b_q = load_rows(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_qt = load_cols(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_k = load_rows(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_kt = load_cols(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
    if CROSS:
        b_q2 = load_rows(q2 + off_k2, t, mt, rk, mk2, H * K2, IS_BF16)
        b_q2t = load_cols(q2 + off_k2, t, mt, rk, mk2, H * K2, IS_BF16)
        b_k2 = load_rows(k2 + off_k2, t, mt, rk, mk2, H * K2, IS_BF16)
        b_k2t = load_cols(k2 + off_k2, t, mt, rk, mk2, H * K2, IS_BF16)
    else:
        b_q2, b_q2t, b_k2, b_k2t = b_q, b_qt, b_k, b_kt
    b_v = load_rows(v + off_v, t, mt, rv, mv, H * V, IS_BF16)
    b_vt = load_cols(v + off_v, t, mt, rv, mv, H * V, IS_BF16)
    b_do = load_rows(do + off_v, t, mt, rv, mv, H * V, IS_BF16)
    b_dot = load_cols(do + off_v, t, mt, rv, mv, H * V, IS_BF16)
    # -- forward state at the chunk start, gradient of the state at its end ------------------
    off_s = (i_bh.to(tl.int64) * NT + i_c) * K * K2
    off_w = (i_bh.to(tl.int64) * NT + i_c) * K * V
    b_s0 = cast(load_mat(cs_s + off_s, rk, mk, rk, mk2, K2), IS_BF16)
    b_s0t = cast(load_mat_t(cs_s + off_s, rk, mk2, rk, mk, K2), IS_BF16)
    b_w0t = cast(load_mat_t(cs_w + off_w, rv, mv, rk, mk, V), IS_BF16)
    off_ds = (i_bh.to(tl.int64) * NP + i_c - C0) * K * K2
    off_dw = (i_bh.to(tl.int64) * NP + i_c - C0) * K * V
    d_s = load_mat(ds_end + off_ds, rk, mk, rk, mk2, K2)
    d_st = load_mat_t(ds_end + off_ds, rk, mk2, rk, mk, K2)
    d_w = load_mat(dw_end + off_dw, rk, mk, rv, mv, V)
    d_wt = load_mat_t(dw_end + off_dw, rv, mv, rk, mk, V)
    if NORM:
        b_dd = tl.load(dd + off_g + t * H, mask=mt, other=0.0)                      # [BT]
        z0 = load_vec(cs_z + (i_bh.to(tl.int64) * NT + i_c) * K, rk, mk)          # [BK]
        d_z = load_vec(dz_end + (i_bh.to(tl.int64) * NP + i_c - C0) * K, rk, mk)  # [BK]
    else:
        b_dd, z0, d_z = 0.0, 0.0, 0.0
    G, g1, g2, gl, gC, bL = chunk_factors(g, off_g, log_gamma, t, mt, H, BT, HAS_G, HAS_DECAY, BT <= 32)
    g2, glv, gCw = _inner_factors(g1, gl, gC, RATE)
    b_dq, b_dk, b_dq2, b_dk2, b_dv, b_dv1 = _bwd_chunk_grads(
        b_q, b_qt, b_k, b_kt, b_q2, b_q2t, b_k2, b_k2t, b_v, b_vt, b_do, b_dot,
        b_s0, b_s0t, b_w0t, d_s, d_st, d_w, d_wt, G, g1, g2, gl, gC, glv, lower, upper, b_dd, z0, d_z,
        CROSS, IS_BF16, PREC, NORM, NORM and HAS_DB and (PARTS & 4) != 0, RATE)
    # -- store what this launch owns ----------------------------------------------------------
    m_tk = mt[:, None] & mk[None, :]
    m_tk2 = mt[:, None] & mk2[None, :]
    b_db = tl.zeros([BT], dtype=tl.float32)
    if PARTS & 1:
        _store_pair(dq, dq2, off_k, off_k2, t, m_tk, m_tk2, rk, b_dq, b_dq2, H, K, K2, CROSS)
        if CROSS:
            b_db += (1.0 + RATE) * tl.sum(b_q.to(tl.float32) * b_dq, axis=1)
        else:
            b_db += (1.0 + RATE) * tl.sum(b_q.to(tl.float32) * b_dq2, axis=1)
    if PARTS & 2:
        _store_pair(dk, dk2, off_k, off_k2, t, m_tk, m_tk2, rk, b_dk, b_dk2, H, K, K2, CROSS)
        if CROSS:
            b_db -= tl.sum(b_k.to(tl.float32) * b_dk, axis=1)
        else:
            b_db -= 0.5 * tl.sum(b_k.to(tl.float32) * b_dk2, axis=1)
    if PARTS & 4:
        tl.store(dv + off_v + t[:, None] * (H * V) + rv[None, :], b_dv.to(dv.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
        if CROSS:
            b_db -= RATE * tl.sum(b_v.to(tl.float32) * b_dv, axis=1)
        else:
            b_db -= (1.0 + 2.0 * RATE) * tl.sum(b_v.to(tl.float32) * b_dv, axis=1)
        if NORM and HAS_DB:
            b_db -= (1.0 + 2.0 * RATE) * b_dv1
    if HAS_DB:
        tl.store(db + off_g + t * H, b_db, mask=mt)
