"""The denominator of a normalized first-order layer: what it carries from before each chunk, in
passes of their own, parallel over chunks.

A normalized layer O = LA(Q, K, V) / (LA(Q, K, 1) + eps) divides by the layer on a column of ones,

    den_t = q_t . p_t,    p_t = sum_{j <= t} exp(b_t - b_j) k_j     ([K]: the ones column's state).

In a chunk (the walk's chunk form, ``ahla/chunk_kernels.py``) den = diag(g1) Q p_c + A 1, with
p_c the state at the chunk's start and A = (Q K^T) o G the chunk's own scores. Carried beside the
values' state in the layer's walk (``ahla_fwd_kernel``'s NORM), p, its update Kg^T 1 and the row
sums Q p_c cost that walk registers it does not have at 128-wide keys. Here the part from before
each chunk comes from three launches before the walk, none of which walks the sequence token by
token:

1. ``den_chunk_sums_kernel``, one program per chunk: the chunk's own contribution to p at its end,
   s_c = Kg^T 1 = sum_r gl_r k_r [K], and its decay gC = exp(beta_L).
2. ``den_chunk_scan_kernel``, one program per head and block of features: p at every chunk's
   start, the recurrence p_{c+1} = gC_c p_c + s_c from p_0 (the initial state), as an associative
   scan over blocks of chunks (the pair (a, x) of ``x <- a x + s`` composes as (a1 a2, a2 x1 + x2));
   and p after the last chunk (the final state).
3. ``den_query_kernel``, one program per block of rows: q_t . p_c for every token t of chunk c.

The walk then runs unnormalized, forms den = g1 (q . p_c) + A 1 from its own A (a row sum of a tile
it holds) and divides the chunk's rows by (den + eps) before storing them (``ahla_fwd_kernel``'s
DIVIDE). The chunk-start p are the snapshots a normalized layer keeps for its backward. Pass 1
reads K once and pass 3 Q once; pass 2 reads and writes [K] per chunk. Which layout is faster is the
configuration rule's to say (``ChunkConfig.fwd_den_pass``; hla_fast/README.md, "The configuration
rule").

The backward has the same recurrence run from the other end. Given dd = dL/dden, p's gradient at
the end of chunk c is what the chunks after it read of p through their rows q_t . p_c:

    dp_c = gC_{c+1} dp_{c+1} + u_{c+1},    u_c = Q_c^T diag(g1) dd_c = sum_r g1_r dd_r q_r   [K],

from dp_{NT-1} = dL/dp_T, and the initial state's gradient is gC_0 dp_0 + u_0. The state-gradient
walk (``ahla_bwd_dh_kernel``'s NORM) carries it beside dH; :func:`carried_denominator_grad` forms
it with passes 1 and 2 instead (u_c as pass 1's weighted row sum of Q, weights g1 dd instead of
gl; the scan over the chunks in reverse), so that the walk carries dH alone
(``ChunkConfig.bwd_den_pass``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cumsum import sums_at
from .launch import cdiv, min_key_block, pow2_block
from .tiles import decays_with_total, head_row, read_rows, summed_beta, sums_offset, vec_or_zeros

# rows a query program reads (at most the chunk)
QUERY_ROWS = 64
# chunks and features a scan program holds at once ([SCAN_CHUNKS, SCAN_FEATURES] fp32)
SCAN_CHUNKS = 32
SCAN_FEATURES = 32


@triton.heuristics({
    "HAS_G": lambda a: a["gc"] is not None,
    "HAS_DD": lambda a: a["dd"] is not None,
})
@triton.jit
def den_chunk_sums_kernel(
    x, gc,              # x: the rows summed [B, T, H, K] (k; q with dd); gc: the log-gates' chunk-local sums at BT,
                        #   fp32 [B*H, NT*BT], or None
    dd,                 # the denominator's gradient fp32 [B, T, H] (the backward's weights g1 dd), or None (gl)
    sums, decay,        # out: the chunk's weighted row sum fp32 [B*H, NT, K]; its decay gC fp32 [B*H, NT]
    log_gamma, T,       # log(gamma) (without g), sequence length
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_G: tl.constexpr, HAS_DD: tl.constexpr,
):
    """Pass 1: one program per (chunk, batch*head) stores its chunk's weighted row sum and gC:
    s_c = Kg^T 1 = sum_r gl_r k_r, or with HAS_DD u_c = Q^T diag(g1) dd = sum_r g1_r dd_r q_r."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    NT = tl.cdiv(T, BT)
    off_g = head_row(i_bh, T, H)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mk = rk < K
    t = i_c * BT + rt
    mt = t < T
    beta, bL = summed_beta(gc, sums_offset(i_bh, NT, BT), i_c * BT, log_gamma, mt, BT, HAS_G, HAS_DECAY)
    _, g1, _, gl, gC, _ = decays_with_total(beta, bL, mt, BT, HAS_DECAY)             # gl [BT], 0 on padded rows
    if HAS_DD:
        w = g1 * tl.load(dd + off_g + t * H, mask=mt, other=0.0)                     # g1 dd [BT], 0 past T
    else:
        w = gl
    b_x = read_rows(x + off_g * K, t, mt, rk, mk, H * K).to(tl.float32)               # X [BT, BK]
    i_cs = i_bh.to(tl.int64) * NT + i_c
    tl.store(sums + i_cs * K + rk, tl.sum(b_x * w[:, None], axis=0), mask=mk)         # X^T w [BK]
    tl.store(decay + i_cs, gC)


@triton.jit
def _decayed_sum(a1, x1, a2, x2):
    """Two steps of x <- a x + s, the first (a1, x1) then (a2, x2), as one: (a1 a2, a2 x1 + x2)."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _visit(c, NT, REVERSE: tl.constexpr):
    """The chunk a scan visits c-th: c, or NT - 1 - c when it runs from the last chunk."""
    if REVERSE:
        return NT - 1 - c
    else:
        return c


@triton.heuristics({
    "HAS_INIT": lambda a: a["h0"] is not None,
})
@triton.jit
def den_chunk_scan_kernel(
    sums, decay,        # s_c fp32 [B*H, NT, K] and gC fp32 [B*H, NT] (den_chunk_sums_kernel)
    h0,                 # p before the sequence fp32 [B*H, K], or None (zeros)
    starts, final,      # out: p at every chunk's start fp32 [B*H, NT, K]; p after the last chunk [B*H, K]
    NT,
    K: tl.constexpr, BF: tl.constexpr, BC: tl.constexpr, HAS_INIT: tl.constexpr, REVERSE: tl.constexpr,
):
    """Pass 2: one program per (batch*head, block of BF features) scans its chunks BC at a time,
    carrying p between blocks (the features never meet). Block rows past NT read (gC, s) = (1, 0),
    which leave p as it is, so a block's last row is p after its last chunk.

    REVERSE (the backward's dp): the scan visits the chunks from the last; ``starts`` of a chunk is
    then the gradient at its end (h0 that of the final state) and ``final`` the initial state's."""
    i_bh, i_f = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rk = i_f * BF + tl.arange(0, BF)
    mk = rk < K
    rc = tl.arange(0, BC)
    p = vec_or_zeros(h0, i_bh * K, rk, mk, BF, HAS_INIT)                                  # [BF]
    tl.store(starts + (i_bh * NT + _visit(0, NT, REVERSE)) * K + rk, p, mask=mk)          # the first visited
    for c0 in range(0, NT, BC):
        c = c0 + rc                                                                        # visit order
        mc = c < NT
        i_c = _visit(c, NT, REVERSE)                                                       # chunk indices
        b_s = tl.load(sums + (i_bh * NT + i_c)[:, None] * K + rk[None, :], mask=mc[:, None] & mk[None, :],
                      other=0.0)                                                           # [BC, BF]
        b_a = tl.load(decay + i_bh * NT + i_c, mask=mc, other=1.0)                        # [BC]
        b_a = b_a[:, None] + tl.zeros([BC, BF], dtype=tl.float32)
        b_a, b_x = tl.associative_scan((b_a, b_s), 0, _decayed_sum)   # from a zero start: (prod gC, x)
        b_p = b_a * p[None, :] + b_x                                                       # p after visit c
        # p after visit c is what visit c + 1 starts from
        tl.store(starts + (i_bh * NT + _visit(c + 1, NT, REVERSE))[:, None] * K + rk[None, :], b_p,
                 mask=((c + 1) < NT)[:, None] & mk[None, :])
        p = tl.sum(tl.where(rc[:, None] == BC - 1, b_p, 0.0), axis=0)                     # the block's last row
    tl.store(final + i_bh * K + rk, p, mask=mk)


@triton.jit
def den_query_kernel(
    q,                  # q: [B, T, H, K]
    starts,             # p at every chunk's start fp32 [B*H, NT, K] (den_chunk_scan_kernel)
    qp,                 # out: q_t . p_c, p at the start of t's chunk, fp32 [B, T, H]
    T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
):
    """Pass 3: one program per (block of BR rows, batch*head), BR dividing the chunk BT, so that
    every row of the block reads the same chunk-start p."""
    i_r, i_bh = tl.program_id(0), tl.program_id(1)
    NT = tl.cdiv(T, BT)
    off_g = head_row(i_bh, T, H)
    off_k = off_g * K
    rk = tl.arange(0, BK)
    mk = rk < K
    t = i_r * BR + tl.arange(0, BR)
    mt = t < T
    b_q = read_rows(q + off_k, t, mt, rk, mk, H * K).to(tl.float32)                     # Q [BR, BK]
    b_p = tl.load(starts + (i_bh.to(tl.int64) * NT + i_r * BR // BT) * K + rk, mask=mk, other=0.0)   # p_c [BK]
    tl.store(qp + off_g + t * H, tl.sum(b_q * b_p[None, :], axis=1), mask=mt)


def _chunk_scan(x, g, dd, init, *, chunk: int, has_decay: bool, log_gamma: float, reverse: bool, launch):
    """Passes 1 and 2: x [B, T, H, K]'s weighted row sum in every chunk (weights gl, or g1 dd with
    dd [B, T, H] fp32), scanned over the chunks from the first (or the last, ``reverse``) starting
    at init (fp32 [B, H, K] or None: zeros). Returns (the state each visit starts from, fp32
    [B*H, NT, K] in chunk order; the state after the last visit, fp32 [B, H, K])."""
    B, T, H, K = x.shape
    BH, dev, f32 = B * H, x.device, torch.float32
    BK = pow2_block(K, min_key_block(dev))
    NT = cdiv(T, chunk)
    sums = torch.empty(BH, NT, K, device=dev, dtype=f32)
    decay = torch.empty(BH, NT, device=dev, dtype=f32)
    launch(den_chunk_sums_kernel, (NT, BH), x=x, gc=sums_at(g, chunk, launch), dd=dd, sums=sums, decay=decay,
           log_gamma=log_gamma, T=T, H=H, K=K, BT=chunk, BK=BK, HAS_DECAY=has_decay,
           num_warps=4 if chunk * BK <= 64 * 128 else 8)
    starts = torch.empty(BH, NT, K, device=dev, dtype=f32)
    final = torch.empty(B, H, K, device=dev, dtype=f32)
    BF = min(BK, SCAN_FEATURES)
    launch(den_chunk_scan_kernel, (BH, cdiv(K, BF)), sums=sums, decay=decay,
           h0=None if init is None else init.float().contiguous(), starts=starts, final=final, NT=NT, K=K, BF=BF,
           BC=SCAN_CHUNKS, REVERSE=reverse, num_warps=4)
    return starts, final


def carried_denominator(q, k, g, p0, *, chunk: int, has_decay: bool, log_gamma: float, launch):
    """What a normalized first-order layer's walk needs of its denominator from before each chunk
    (the module docstring): q_t . p_c for every token, p's final state and its chunk-start states.

    q, k: [B, T, H, K] (contiguous); g: [B, T, H], its GateSums or None; p0: fp32 [B, H, K] or None
    (zeros); chunk: the walk's rows per chunk; has_decay, log_gamma: the walk's HAS_DECAY and
    log(gamma) (0 with g). Returns (q_t . p_c fp32 [B, T, H], p_T fp32 [B, H, K], p at
    every chunk's start fp32 [B*H, NT, K])."""
    B, T, H, K = q.shape
    starts, final = _chunk_scan(k, g, None, p0, chunk=chunk, has_decay=has_decay, log_gamma=log_gamma,
                                reverse=False, launch=launch)
    qp = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    BR = min(chunk, QUERY_ROWS)
    launch(den_query_kernel, (cdiv(T, BR), B * H), q=q, starts=starts, qp=qp, T=T, H=H, K=K, BT=chunk, BR=BR,
           BK=pow2_block(K, min_key_block(q.device)), num_warps=4)
    return qp, final, starts


def carried_denominator_grad(q, dd, g, dpT, *, chunk: int, has_decay: bool, log_gamma: float, launch):
    """The gradient of the denominator's state p at every chunk's end and at the start, from
    dd = dL/dden (the module docstring's backward): what the state-gradient walk of a normalized
    layer would carry beside dH.

    q: [B, T, H, K] (contiguous); dd: fp32 [B, T, H]; g: [B, T, H], its GateSums or None; dpT: the
    final state's gradient (fp32 [B, H, K]) or None (zero); chunk, has_decay, log_gamma: as the walk's.
    Returns (dp at every chunk's end fp32 [B*H, NT, K], dp0 fp32 [B, H, K])."""
    return _chunk_scan(q, g, dd, dpT, chunk=chunk, has_decay=has_decay, log_gamma=log_gamma, reverse=True,
                       launch=launch)
