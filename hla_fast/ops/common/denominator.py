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
})
@triton.jit
def den_chunk_sums_kernel(
    k, gc,              # k: [B, T, H, K]; gc: the log-gates' chunk-local sums at BT, fp32 [B*H, NT*BT], or None
    sums, decay,        # out: s_c = Kg^T 1 fp32 [B*H, NT, K]; the chunk's decay gC fp32 [B*H, NT]
    log_gamma, T,       # log(gamma) (without g), sequence length
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_G: tl.constexpr,
):
    """Pass 1: one program per (chunk, batch*head) stores its chunk's s_c [K] and gC."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    NT = tl.cdiv(T, BT)
    off_k = head_row(i_bh, T, H) * K
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mk = rk < K
    t = i_c * BT + rt
    mt = t < T
    beta, bL = summed_beta(gc, sums_offset(i_bh, NT, BT), i_c * BT, log_gamma, mt, BT, HAS_G, HAS_DECAY)
    _, _, _, gl, gC, _ = decays_with_total(beta, bL, mt, BT, HAS_DECAY)              # gl [BT], 0 on padded rows
    b_k = read_rows(k + off_k, t, mt, rk, mk, H * K).to(tl.float32)                    # K [BT, BK]
    i_cs = i_bh.to(tl.int64) * NT + i_c
    tl.store(sums + i_cs * K + rk, tl.sum(b_k * gl[:, None], axis=0), mask=mk)        # Kg^T 1 [BK]
    tl.store(decay + i_cs, gC)


@triton.jit
def _decayed_sum(a1, x1, a2, x2):
    """Two steps of x <- a x + s, the first (a1, x1) then (a2, x2), as one: (a1 a2, a2 x1 + x2)."""
    return a1 * a2, a2 * x1 + x2


@triton.heuristics({
    "HAS_INIT": lambda a: a["h0"] is not None,
})
@triton.jit
def den_chunk_scan_kernel(
    sums, decay,        # s_c fp32 [B*H, NT, K] and gC fp32 [B*H, NT] (den_chunk_sums_kernel)
    h0,                 # p before the sequence fp32 [B*H, K], or None (zeros)
    starts, final,      # out: p at every chunk's start fp32 [B*H, NT, K]; p after the last chunk [B*H, K]
    NT,
    K: tl.constexpr, BF: tl.constexpr, BC: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """Pass 2: one program per (batch*head, block of BF features) scans its chunks BC at a time,
    carrying p between blocks (the features never meet). Block rows past NT read (gC, s) = (1, 0),
    which leave p as it is, so a block's last row is p after its last chunk."""
    i_bh, i_f = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rk = i_f * BF + tl.arange(0, BF)
    mk = rk < K
    rc = tl.arange(0, BC)
    p = vec_or_zeros(h0, i_bh * K, rk, mk, BF, HAS_INIT)                                  # [BF]
    tl.store(starts + i_bh * NT * K + rk, p, mask=mk)                                     # chunk 0's start
    for c0 in range(0, NT, BC):
        c = c0 + rc
        mc = c < NT
        b_s = tl.load(sums + (i_bh * NT + c)[:, None] * K + rk[None, :], mask=mc[:, None] & mk[None, :],
                      other=0.0)                                                           # [BC, BF]
        b_a = tl.load(decay + i_bh * NT + c, mask=mc, other=1.0)                          # [BC]
        b_a = b_a[:, None] + tl.zeros([BC, BF], dtype=tl.float32)
        b_a, b_x = tl.associative_scan((b_a, b_s), 0, _decayed_sum)   # from a zero start: (prod gC, x)
        b_p = b_a * p[None, :] + b_x                                                       # p after chunk c
        # p after chunk c is chunk c + 1's start
        tl.store(starts + (i_bh * NT + c + 1)[:, None] * K + rk[None, :], b_p,
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


def carried_denominator(q, k, g, p0, *, chunk: int, has_decay: bool, log_gamma: float, launch):
    """What a normalized first-order layer's walk needs of its denominator from before each chunk
    (the module docstring): q_t . p_c for every token, p's final state and its chunk-start states.

    q, k: [B, T, H, K] (contiguous); g: [B, T, H], its GateSums or None; p0: fp32 [B, H, K] or None
    (zeros); chunk: the walk's rows per chunk; has_decay, log_gamma: the walk's HAS_DECAY and
    log(gamma) (0 with g). Returns (q_t . p_c fp32 [B, T, H], p_T fp32 [B, H, K], p at
    every chunk's start fp32 [B*H, NT, K])."""
    B, T, H, K = q.shape
    BH, dev, f32 = B * H, q.device, torch.float32
    BK = pow2_block(K, min_key_block(dev))
    NT = cdiv(T, chunk)
    gc = sums_at(g, chunk, launch)
    sums = torch.empty(BH, NT, K, device=dev, dtype=f32)
    decay = torch.empty(BH, NT, device=dev, dtype=f32)
    launch(den_chunk_sums_kernel, (NT, BH), k=k, gc=gc, sums=sums, decay=decay, log_gamma=log_gamma, T=T, H=H,
           K=K, BT=chunk, BK=BK, HAS_DECAY=has_decay, num_warps=4 if chunk * BK <= 64 * 128 else 8)
    starts = torch.empty(BH, NT, K, device=dev, dtype=f32)
    final = torch.empty(B, H, K, device=dev, dtype=f32)
    BF = min(BK, SCAN_FEATURES)
    launch(den_chunk_scan_kernel, (BH, cdiv(K, BF)), sums=sums, decay=decay,
           h0=None if p0 is None else p0.contiguous(), starts=starts, final=final, NT=NT, K=K, BF=BF, BC=SCAN_CHUNKS,
           num_warps=4)
    qp = torch.empty(B, T, H, device=dev, dtype=f32)
    BR = min(chunk, QUERY_ROWS)
    launch(den_query_kernel, (cdiv(T, BR), BH), q=q, starts=starts, qp=qp, T=T, H=H, K=K, BT=chunk, BR=BR, BK=BK,
           num_warps=4)
    return qp, final, starts
