"""The denominator of a normalized first-order layer in passes of its own, parallel over chunks.

A normalized layer O = LA(Q, K, V) / (LA(Q, K, 1) + eps) divides by the layer on a column of ones,

    den_t = q_t . p_t,    p_t = sum_{j <= t} exp(b_t - b_j) k_j     ([K]: the ones column's state).

Carried beside the values' state in the layer's walk (``ahla_fwd_kernel``'s NORM), ``p`` and the
row sums that form den cost that walk registers it does not have at 128-wide keys. Here den comes
from three launches before the walk, none of which walks the sequence token by token:

1. ``den_chunk_sums_kernel``, one program per chunk: the chunk's own contribution to p at its end,
   s_c = Kg^T 1 = sum_r gl_r k_r [K], and its decay gC = exp(beta_L).
2. ``den_chunk_scan_kernel``, one program per head and block of features: p at every chunk's start, the recurrence
   p_{c+1} = gC_c p_c + s_c from p_0 (the initial state), as an associative scan over blocks of
   chunks (the pair (a, x) of ``x <- a x + s`` composes as (a1 a2, a2 x1 + x2)); and p after the
   last chunk (the final state).
3. ``den_chunk_kernel``, one program per chunk: den = diag(g1) Q p_c + A 1 with A = (Q K^T) o G,
   the walk's own formula for the ones column (``ahla/chunk_kernels.py``, "Chunk form").

The walk then runs unnormalized and divides each chunk's rows by (den + eps) before storing them
(``ahla_fwd_kernel``'s DIVIDE). The chunk-start p are the snapshots a normalized layer keeps for
its backward, so a training forward keeps these. Passes 1 and 3 read K (and Q) once each; pass 2
reads and writes [K] per chunk. Which layout is faster is the configuration rule's to say
(``ChunkConfig.fwd_den_pass``; hla_fast/README.md, "The configuration rule").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cumsum import sums_at
from .launch import cdiv, min_key_block, pow2_block
from .tiles import decays_with_total, load_cols, load_rows, read_rows, summed_beta, sums_offset, vec_or_zeros

# rows per chunk of the passes when no chunk-start states are kept (a walk in longer chunks keeps
# none): pass 3 of chunks of 128 with 128-wide keys holds [128, 128] tiles in 8 warps, one program
# a multiprocessor, and read its inputs at 1.9 TB/s on an H100, under the 2.7 of pass 1
DEN_CHUNK = 64
# chunks and features a scan program holds at once ([SCAN_CHUNKS, SCAN_FEATURES] fp32)
SCAN_CHUNKS = 32
SCAN_FEATURES = 32


@triton.jit
def _head_rows(i_bh, T, H: tl.constexpr, K: tl.constexpr):
    """Offsets of head i_bh's first element in [B, T, H, K] and [B, T, H] tensors (64-bit)."""
    row = (i_bh // H).to(tl.int64) * T * H + i_bh % H
    return row * K, row


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
    off_k, _ = _head_rows(i_bh, T, H, K)
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


@triton.heuristics({
    "HAS_G": lambda a: a["gc"] is not None,
})
@triton.jit
def den_chunk_kernel(
    q, k, gc,           # q, k: [B, T, H, K]; gc as in den_chunk_sums_kernel
    starts,             # p at every chunk's start fp32 [B*H, NT, K] (den_chunk_scan_kernel)
    den,                # out: den = LA(Q, K, 1) fp32 [B, T, H]
    log_gamma, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr, HAS_G: tl.constexpr,
):
    """Pass 3: one program per (chunk, batch*head): den = diag(g1) Q p_c + A 1, A = (Q K^T) o G."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    NT = tl.cdiv(T, BT)
    off_k, off_g = _head_rows(i_bh, T, H, K)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mk = rk < K
    t = i_c * BT + rt
    mt = t < T
    beta, bL = summed_beta(gc, sums_offset(i_bh, NT, BT), i_c * BT, log_gamma, mt, BT, HAS_G, HAS_DECAY)
    G, g1, _, _, _, _ = decays_with_total(beta, bL, mt, BT, HAS_DECAY)
    b_q = load_rows(q + off_k, t, mt, rk, mk, H * K, IS_BF16)                          # Q [BT, BK]
    b_kt = load_cols(k + off_k, t, mt, rk, mk, H * K, IS_BF16)                         # K^T [BK, BT]
    b_p = tl.load(starts + (i_bh.to(tl.int64) * NT + i_c) * K + rk, mask=mk, other=0.0)  # p_c [BK]
    b_x = tl.dot(b_q, b_kt, input_precision=PREC)                                      # X = Q K^T [BT, BT]
    b_a = tl.where(G > 0, b_x * G, 0.0)                                                 # A = X o G
    b_d = tl.sum(b_q.to(tl.float32) * b_p[None, :], axis=1) * g1 + tl.sum(b_a, axis=1)   # [BT]
    tl.store(den + off_g + t * H, b_d, mask=mt)


def layer_denominator(q, k, g, gamma, p0, *, chunk: int, flags: dict, log_gamma: float, keep_starts: bool,
                      launch):
    """den = LA(Q, K, 1) of a first-order layer (the module docstring), with p's final state and,
    with ``keep_starts``, its chunk-start states.

    q, k: [B, T, H, K] (contiguous); g: [B, T, H], its GateSums or None; gamma: a float or None (its
    log is ``log_gamma``); p0: fp32 [B, H, K] or None (zeros); chunk: rows per chunk (the walk's, so
    that the chunk-start states are those it keeps; without ``keep_starts`` the passes take chunks
    of at most DEN_CHUNK); flags: the launch's HAS_DECAY, IS_BF16, PREC.
    Returns (den fp32 [B, T, H], p_T fp32 [B, H, K], p at every chunk's start fp32 [B*H, NT, K] or
    None)."""
    if not keep_starts:
        chunk = min(chunk, DEN_CHUNK)
    B, T, H, K = q.shape
    BH, dev, f32 = B * H, q.device, torch.float32
    BK = pow2_block(K, min_key_block(dev))
    NT = cdiv(T, chunk)
    gc = sums_at(g, chunk, launch)
    sums = torch.empty(BH, NT, K, device=dev, dtype=f32)
    decay = torch.empty(BH, NT, device=dev, dtype=f32)
    launch(den_chunk_sums_kernel, (NT, BH), k=k, gc=gc, sums=sums, decay=decay, log_gamma=log_gamma, T=T, H=H,
           K=K, BT=chunk, BK=BK, HAS_DECAY=flags["HAS_DECAY"], num_warps=4)
    starts = torch.empty(BH, NT, K, device=dev, dtype=f32)
    final = torch.empty(B, H, K, device=dev, dtype=f32)
    BF = min(BK, SCAN_FEATURES)
    launch(den_chunk_scan_kernel, (BH, cdiv(K, BF)), sums=sums, decay=decay,
           h0=None if p0 is None else p0.contiguous(), starts=starts, final=final, NT=NT, K=K, BF=BF, BC=SCAN_CHUNKS,
           num_warps=4)
    den = torch.empty(B, T, H, device=dev, dtype=f32)
    launch(den_chunk_kernel, (NT, BH), q=q, k=k, gc=gc, starts=starts, den=den, log_gamma=log_gamma, T=T, H=H, K=K,
           BT=chunk, BK=BK, num_warps=4 if chunk * BK <= 64 * 128 else 8, **flags)
    return den, final, (starts if keep_starts else None)
