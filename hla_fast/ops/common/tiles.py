"""``@triton.jit`` tile helpers shared by every operator's kernels.

Layout: sequence tensors are flash-linear-attention's ``[B, T, H, D]`` (contiguous); a kernel
offsets a head's base pointer once and then reads a chunk's rows ``t`` with token stride ``H * D``.
States are fp32 ``[.., D1, D2]`` row-major matrices. Every helper masks out-of-range rows and
features with 0, so a tile padded to a power of two holds zeros where no data is.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gates import GATE_FLOOR

# the smallest log-gate the kernels sum (``gates.py``, "The gate floor")
FLOOR: tl.constexpr = tl.constexpr(GATE_FLOOR)


@triton.jit
def cast(x, IS_BF16: tl.constexpr):
    """Operand dtype of the tensor-core dots: bf16 for bf16 inputs, else fp32."""
    if IS_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def dot(a, b, IS_BF16: tl.constexpr, PREC: tl.constexpr):
    """a @ b with fp32 accumulation: both operands cast to the dot dtype, ``PREC`` the input
    precision (``dot_precision`` in launch.py)."""
    return tl.dot(cast(a, IS_BF16), cast(b, IS_BF16), input_precision=PREC)


@triton.jit
def read_rows(base, t, mt, rc, mc, stride):
    """Tile [BT, BC] of a [B, T, H, C] tensor as stored: rows t (token stride ``stride``), features rc.
    A walk that loads its next chunk ahead (PREFETCH) keeps tiles as read until their turn: a cast
    right after the load would wait for the data there."""
    return tl.load(base + t[:, None] * stride + rc[None, :], mask=mt[:, None] & mc[None, :], other=0.0)


@triton.jit
def read_cols(base, t, mt, rc, mc, stride):
    """The same tile transposed, [BC, BT], read with a strided load."""
    return tl.load(base + t[None, :] * stride + rc[:, None], mask=mc[:, None] & mt[None, :], other=0.0)


@triton.jit
def load_rows(base, t, mt, rc, mc, stride, IS_BF16: tl.constexpr):
    """``read_rows`` cast to the dots' operand dtype."""
    return cast(read_rows(base, t, mt, rc, mc, stride), IS_BF16)


@triton.jit
def load_cols(base, t, mt, rc, mc, stride, IS_BF16: tl.constexpr):
    """``read_cols`` cast to the dots' operand dtype."""
    return cast(read_cols(base, t, mt, rc, mc, stride), IS_BF16)


@triton.jit
def load_mat(base, ri, mi, rj, mj, stride):
    """fp32 tile [BI, BJ] of a matrix: element (i, j) at base + i * stride + j."""
    return tl.load(base + ri[:, None] * stride + rj[None, :], mask=mi[:, None] & mj[None, :], other=0.0).to(tl.float32)


@triton.jit
def load_mat_t(base, ri, mi, rj, mj, stride):
    """The transpose of ``load_mat(base, rj, mj, ri, mi, stride)``: [BI, BJ] with (i, j) = M[j, i]."""
    return tl.load(base + rj[None, :] * stride + ri[:, None], mask=mi[:, None] & mj[None, :], other=0.0).to(tl.float32)


@triton.jit
def store_mat(base, x, ri, mi, rj, mj, stride):
    """Store tile x [BI, BJ] at base + i * stride + j (cast to the buffer's dtype)."""
    tl.store(base + ri[:, None] * stride + rj[None, :], x.to(base.dtype.element_ty), mask=mi[:, None] & mj[None, :])


@triton.jit
def load_vec(base, ri, mi):
    """fp32 vector [BI] at base + i."""
    return tl.load(base + ri, mask=mi, other=0.0).to(tl.float32)


@triton.jit
def mat_or_zeros(base, off, ri, mi, rj, mj, stride, BI: tl.constexpr, BJ: tl.constexpr, LOAD: tl.constexpr):
    """``load_mat(base + off, ..)`` when LOAD, else a zero fp32 tile [BI, BJ] (an absent state:
    ``base`` may then be None, so the offset is added only here)."""
    if LOAD:
        x = load_mat(base + off, ri, mi, rj, mj, stride)
    else:
        x = tl.zeros([BI, BJ], dtype=tl.float32)
    return x


@triton.jit
def vec_or_zeros(base, off, ri, mi, BI: tl.constexpr, LOAD: tl.constexpr):
    """``load_vec(base + off, ..)`` when LOAD, else a zero fp32 vector [BI]."""
    if LOAD:
        x = load_vec(base + off, ri, mi)
    else:
        x = tl.zeros([BI], dtype=tl.float32)
    return x


@triton.jit
def plus_stored(x, base, off, mask, LOAD: tl.constexpr):
    """x + the tile stored at ``base + off`` (fp32, 0 where ``mask`` is off) when LOAD, else x itself
    (``base`` may then be None): a gradient that another part of the call stored before, added to
    this part's (AHLA's ``dq_in``, ``dk_in``)."""
    if LOAD:
        x = x + tl.load(base + off, mask=mask, other=0.0).to(tl.float32)
    return x


# ============================================================================ decode steps
# One token updates each state block by a rank-one term; these helpers are the pieces every step
# kernel (``ops/*/decode.py``) shares.


@triton.jit
def step_token(q, k, v, g, i_bh, rk, mk, rv, mv, gamma, K: tl.constexpr, V: tl.constexpr, HAS_G: tl.constexpr):
    """The token of head i_bh as fp32: q, k [BK] (features rk) and v's columns rv [BV], and its
    factor a = exp(g) (the constant gamma without log-gates)."""
    b_q = tl.load(q + i_bh * K + rk, mask=mk, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_bh * K + rk, mask=mk, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_bh * V + rv, mask=mv, other=0.0).to(tl.float32)
    if HAS_G:
        a = tl.exp(tl.load(g + i_bh).to(tl.float32))
    else:
        a = gamma
    return b_q, b_k, b_v, a


@triton.jit
def step_rows(q, k, i_bh, i_r, K: tl.constexpr, BR: tl.constexpr):
    """Block i_r of a head's K state rows: rows rr [BR], their mask, and q, k on them (fp32)."""
    rr = i_r * BR + tl.arange(0, BR)
    mr = rr < K
    b_qr = tl.load(q + i_bh * K + rr, mask=mr, other=0.0).to(tl.float32)
    b_kr = tl.load(k + i_bh * K + rr, mask=mr, other=0.0).to(tl.float32)
    return rr, mr, b_qr, b_kr


@triton.jit
def step_rank1(x_in, x_out, base, ri, mi, rj, mj, c, b_left, b_right, D: tl.constexpr, STORE):
    """Rows ri, columns rj of a row-major state [.., D] (its head at ``base``) after one token:
    X <- c X + left right^T (b_left [BI], b_right [BJ]); stored into x_out when STORE. Returns the
    new block [BI, BJ]."""
    p = base + ri[:, None] * D + rj[None, :]
    m = mi[:, None] & mj[None, :]
    x = tl.load(x_in + p, mask=m, other=0.0) * c + b_left[:, None] * b_right[None, :]
    if STORE:
        tl.store(x_out + p, x, mask=m)
    return x


@triton.jit
def store_step_output(o, i_bh, rv, mv, b_num, b_den, eps, V: tl.constexpr, NORM: tl.constexpr):
    """A decode step's output row: o[i_bh, rv] = num / (den + eps) when NORM (else num), in o's
    dtype. b_num [BV] and the scalar b_den are fp32."""
    if NORM:
        b_num = b_num / (b_den + eps)
    tl.store(o + i_bh * V + rv, b_num.to(o.dtype.element_ty), mask=mv)


# ============================================================================ decay and gate factors
# (the conventions are in gates.py)


@triton.jit
def read_gates(ptrs, mask):
    """Log-gates at ``ptrs`` as the kernels sum them: fp32, 0 where masked off, floored at
    FLOOR (``gates.py``, "The gate floor": a harder gate would cost the later sums of its chunk
    their digits). A NaN stays NaN (as torch's clamp keeps it), so a broken gate shows in the
    outputs instead of closing quietly."""
    return tl.maximum(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), FLOOR, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def chunk_beta(g, g_off, log_gamma, t, mt, H: tl.constexpr, BT: tl.constexpr,
               HAS_G: tl.constexpr, HAS_DECAY: tl.constexpr, ROW_SUMS: tl.constexpr = False,
               HOIST: tl.constexpr = False):
    """beta [BT] (fp32) of the chunk whose token indices are ``t`` (valid where ``mt``).

    HAS_G: the cumulative sum of the log-gates g [B, T, H] of one head (``g_off`` its first
    element, token stride H); else a constant decay, beta_r = (r + 1) log(gamma) on valid rows.
    Without decay beta is 0. (``g`` is None unless HAS_G: only the taken branch is compiled.)

    ROW_SUMS (HAS_G): sum each row of the masked tile [g_s for s <= r] instead of scanning
    (``tl.cumsum``). Which compiles better depends on the kernel; the callers say when (HLA2's for
    chunks of up to 32 rows: ``hla2/chunk_kernels.py``, "Gates"). Every row sums its columns in the
    same order and row r + 1 only adds g_{r+1} <= 0 to what row r sums, so beta stays
    non-increasing after rounding (rounding is monotone), as the factors require.

    HOIST (a constant decay): beta_r = (r + 1) log(gamma) on every row, padded ones too, instead of
    repeating the last valid one there. It is then the same in every chunk, so the compiler computes
    G and g1 once before a walk's loop instead of in every step (an exp per element of G and two
    reductions a chunk); pass ``chunk_decays`` the same flag. Padded rows hold zeros wherever these
    factors meet data, and every factor stays finite (the exponents kept are <= 0). Taken by the
    kernels of ``ahla/chunk_kernels.py``; measured in hla_fast/README.md ("Constant decay")."""
    if HAS_G:
        b_g = read_gates(g + g_off + t * H, mt)                                 # [BT], 0 past T
        if ROW_SUMS:
            rt = tl.arange(0, BT)
            beta = tl.sum(tl.where(rt[:, None] >= rt[None, :], b_g[None, :], 0.0), axis=1)
        else:
            beta = tl.cumsum(b_g, axis=0)
    elif HAS_DECAY and HOIST:
        beta = (tl.arange(0, BT) + 1).to(tl.float32) * log_gamma
    elif HAS_DECAY:
        # valid rows r -> (r + 1) log(gamma); padded rows repeat the last valid one
        n_valid = tl.sum(mt.to(tl.int32), axis=0)
        rows = tl.minimum(tl.arange(0, BT), n_valid - 1) + 1
        beta = rows.to(tl.float32) * log_gamma
    else:
        beta = tl.zeros([BT], dtype=tl.float32)
    return beta


@triton.jit
def chunk_decays(beta, mt, BT: tl.constexpr, HAS_DECAY: tl.constexpr, HOIST: tl.constexpr = False):
    """Decay factors of one chunk from its beta [BT] (see the module docstring); HOIST as
    ``chunk_beta``'s (the chunk's total is then the minimum over its valid rows).

    Returns G [BT, BT], g1 [BT], g2 = g1^2 [BT], gl [BT] (0 on padded rows), gC (scalar) and
    bL = beta_L (scalar, the log of the chunk's decay, for segment folds)."""
    return decays_with_total(beta, chunk_total(beta, mt, HAS_DECAY, HOIST), mt, BT, HAS_DECAY)


@triton.jit
def chunk_total(beta, mt, HAS_DECAY: tl.constexpr, HOIST: tl.constexpr):
    """beta_L, the chunk's total log decay, from its beta [BT] (0 without decay; HOIST as
    ``chunk_beta``'s: the minimum over the valid rows only)."""
    if HAS_DECAY:
        # beta is non-increasing (up to a rounding of the scan's sums, which may rise by one): its
        # last (= padded) value is the minimum, the chunk's total
        if HOIST:
            bL = tl.min(tl.where(mt, beta, 0.0), axis=0)   # beta <= 0: the last valid row's
        else:
            bL = tl.min(beta, axis=0)
    else:
        bL = 0.0
    return bL


@triton.jit
def decays_with_total(beta, bL, mt, BT: tl.constexpr, HAS_DECAY: tl.constexpr):
    """``chunk_decays`` given the chunk's total bL = beta_L as well (a scalar <= every valid beta):
    G, g1, g2, gl, gC, bL."""
    rt = tl.arange(0, BT)
    causal = rt[:, None] >= rt[None, :]
    if HAS_DECAY:
        # exponents are <= 0 wherever they are kept; tl.where selects (no 0 * inf)
        G = tl.where(causal, tl.exp(tl.where(causal, beta[:, None] - beta[None, :], 0.0)), 0.0)
        g1 = tl.exp(beta)
        gl = tl.where(mt, tl.exp(bL - beta), 0.0)
        gC = tl.exp(bL)
    else:
        G = tl.where(causal, 1.0, 0.0)
        g1 = tl.full([BT], 1.0, tl.float32)
        gl = tl.where(mt, 1.0, 0.0)
        gC = 1.0
    return G, g1, g1 * g1, gl, gC, bL


@triton.jit
def head_row(i_bh, T, H: tl.constexpr):
    """Row of head i_bh's first token in a [B, T, H, ..] tensor seen as [B*T*H, ..] rows, 64-bit
    (B*T*H*K can pass 2^31): its offset in a [B, T, H] tensor, and times C in a [B, T, H, C] one."""
    return (i_bh // H).to(tl.int64) * T * H + i_bh % H


@triton.jit
def sums_offset(i_bh, NT, BT: tl.constexpr):
    """Head i_bh's first element in the stored chunk-local sums (``cumsum.py``: gc fp32
    [B*H, NT*BT], each head's row padded to whole chunks; 64-bit)."""
    return i_bh.to(tl.int64) * NT * BT


@triton.jit
def read_sums(gc, gc_off, c0, lo, hi, BT: tl.constexpr):
    """The stored chunk-local sums (``cumsum.py``: gc fp32 [B*H, NT*BT] from ``chunk_sums`` at this
    BT, ``gc_off`` the head's first element) of the chunk whose first token is c0: beta [BT] and
    its total bL, the chunk's last row (padded rows repeat it). Nothing is read unless
    lo <= c0 < hi (a walk's next chunk past its range: zeros)."""
    rt = tl.arange(0, BT)
    cv = c0 + rt * 0                                   # c0 on every row (a [BT] mask, not a scalar's broadcast)
    beta = tl.load(gc + gc_off + c0 + rt, mask=(cv >= lo) & (cv < hi), other=0.0)            # [BT]
    bL = tl.load(gc + gc_off + c0 + BT - 1, mask=(c0 >= lo) & (c0 < hi), other=0.0)          # scalar
    return beta, bL


@triton.jit
def summed_beta(gc, gc_off, c0, log_gamma, mt, BT: tl.constexpr, HAS_G: tl.constexpr, HAS_DECAY: tl.constexpr):
    """beta [BT] and its total bL (scalar) of the chunk whose first token is c0, for the kernels
    that read the log-gates as chunk-local sums: with HAS_G both are loads (``read_sums``), so
    neither a scan nor a reduction runs in the kernel. Else a constant decay's or none, as
    ``chunk_beta``'s HOIST and ``chunk_decays`` give them (gc is then None)."""
    if HAS_G:
        beta, bL = read_sums(gc, gc_off, c0, c0, c0 + 1, BT)
    else:
        beta = chunk_beta(gc, gc_off, log_gamma, c0 + tl.arange(0, BT), mt, 1, BT, False, HAS_DECAY, HOIST=True)
        bL = chunk_total(beta, mt, HAS_DECAY, True)
    return beta, bL


@triton.jit
def first_walk_sums(gc, gc_off, c0, BT: tl.constexpr, HAS_G: tl.constexpr, AHEAD: tl.constexpr):
    """With HAS_G and AHEAD the sums of a walk's first chunk (first token c0), read before its
    loop and carried into its first step (``walk_factors``); else placeholders."""
    if HAS_G and AHEAD:
        n_beta, n_bL = read_sums(gc, gc_off, c0, c0, c0 + 1, BT)
    else:
        n_beta, n_bL = 0.0, 0.0
    return n_beta, n_bL


@triton.jit
def walk_factors(gc, gc_off, n_beta, n_bL, c0, c0_next, lo, hi, log_gamma, mt, BT: tl.constexpr,
                 HAS_G: tl.constexpr, HAS_DECAY: tl.constexpr, AHEAD: tl.constexpr):
    """A walk's step: the factors G, g1, g2, gl, gC, bL of its chunk (first token c0) and the sums
    it carries to its next step. With HAS_G and AHEAD this chunk's sums are the carried n_beta,
    n_bL (read a step ago) and those of the walk's next chunk (first token c0_next, read only where
    lo <= c0_next < hi) are issued now, so that their memory latency overlaps this chunk's products
    instead of preceding them; else this chunk's are read now (``summed_beta``; a constant decay's
    are formed, not read) and n_beta, n_bL pass through. The launchers take AHEAD for walks whose
    loads the compiler does not pipeline (num_stages 1), ``ahla/chunk.py``."""
    if HAS_G and AHEAD:
        beta, bL = n_beta, n_bL
        n_beta, n_bL = read_sums(gc, gc_off, c0_next, lo, hi, BT)
    else:
        beta, bL = summed_beta(gc, gc_off, c0, log_gamma, mt, BT, HAS_G, HAS_DECAY)
    G, g1, g2, gl, gC, bL = decays_with_total(beta, bL, mt, BT, HAS_DECAY)
    return G, g1, g2, gl, gC, bL, n_beta, n_bL


@triton.jit
def chunk_factors(g, g_off, log_gamma, t, mt, H: tl.constexpr, BT: tl.constexpr,
                  HAS_G: tl.constexpr, HAS_DECAY: tl.constexpr, ROW_SUMS: tl.constexpr = False,
                  HOIST: tl.constexpr = False):
    """``chunk_decays(chunk_beta(...))``: G, g1, g2, gl, gC, bL of the chunk with tokens ``t``."""
    beta = chunk_beta(g, g_off, log_gamma, t, mt, H, BT, HAS_G, HAS_DECAY, ROW_SUMS, HOIST)
    return chunk_decays(beta, mt, BT, HAS_DECAY, HOIST)


@triton.jit
def ipow(x, N: tl.constexpr):
    """x ** N for a constexpr N >= 1, as N - 1 products (a decay factor raised to an index's
    rate: exact where x is 0 or 1, no exp or log). ``ipow(x, 1)`` is x itself."""
    y = x
    for _ in tl.static_range(N - 1):
        y = y * x
    return y


@triton.jit
def held_decays(G, IS_BF16: tl.constexpr):
    """A decay tile G (or G^T) as a kernel keeps it between its first use and its later ones:
    fp16 for chunks of 64 rows or more when the products it scales are rounded to bf16 for their
    dots (IS_BF16), else as is.

    Per-token gates make G depend on loaded data, so the compiler cannot recompute it where it is
    used (as it can a constant decay's, a function of the row and column indices) and holds the
    fp32 tile in registers between its uses: with chunks of 64 in 4 warps that is 32 registers a
    thread, and the kernels already spill. Held in fp16 it takes half (HLA2's forward at K = 64 with
    a constant decay got faster too, ``hla2_h200_ab_held_decays_plain.json``), and
    G's rounding (unit roundoff 2^-11, absolute 2^-25 below fp16's normal range) stays an eighth of
    the bf16 rounding (2^-8) that every product it scales takes before its dot. A [32, 32] tile in
    8 warps is 4 registers: there holding it only cost time (HLA2's forward at K = V = 128 was
    slower held than not, ``benchmarks/results/hla2_h200_ab_held_decays.json``). Call it
    after G's first use, which takes the fp32 tile."""
    if IS_BF16 and G.shape[0] >= 64:
        H = G.to(tl.float16)
    else:
        H = G
    return H


@triton.jit
def chunk_decays_t(beta, BT: tl.constexpr, HAS_DECAY: tl.constexpr):
    """The transpose of ``chunk_decays``' G, built from beta [BT] rather than transposed:
    GT [BT, BT] with GT[c, r] = G[r, c] = exp(beta_r - beta_c) for c <= r, else 0. A kernel that
    needs a product with G^T forms it from its own tiles (never a transposed dot result)."""
    rt = tl.arange(0, BT)
    upper = rt[:, None] <= rt[None, :]
    if HAS_DECAY:
        GT = tl.where(upper, tl.exp(tl.where(upper, beta[None, :] - beta[:, None], 0.0)), 0.0)
    else:
        GT = tl.where(upper, 1.0, 0.0)
    return GT
