"""Triton kernels of chunked AHLA: forward walk, backward state walk, segment summaries and folds,
per-chunk gradients.

Layout: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, log-gates ``g: [B, T, H]`` (contiguous).
States are fp32 ``P, E: [B*H, K, V]``, ``p, e: [B*H, K]`` whatever the input dtype. Per-chunk
snapshots that a later kernel reads only as dot operands may be stored in the dots' operand dtype
(bf16 for bf16 inputs): rounding them on store is the rounding the dot applies on load anyway.

The operator. With b_t = sum_{s <= t} g_s,

    o_t = sum_{j <= i <= t} exp(b_t - b_j) (q_t . k_i)(q_i . k_j) v_j.

The decay splits as exp(b_t - b_i) exp(b_i - b_j), so AHLA is first-order (gated) linear attention
applied twice, the second time to the first one's outputs:

    R_i = sum_{j <= i} exp(b_i - b_j) (q_i . k_j) v_j,      o_t = sum_{i <= t} exp(b_t - b_i) (q_t . k_i) R_i,

and the state after token t is P_t = sum_{j <= t} exp(b_t - b_j) k_j v_j^T (so R_t = q_t^T P_t) and
E_t = sum_{i <= t} exp(b_t - b_i) k_i R_i^T (so o_t = q_t^T E_t).

Chunk form. One chunk of C = BT rows Q, K, V (local row r), the state (P0, E0) after the previous
chunk, beta_r = b_r - b_{start - 1} (<= 0, the chunk-local cumulative sum of g, ``common.cumsum``),
G[r, c] = exp(beta_r - beta_c) for c <= r else 0, g1[r] = exp(beta_r), gl[r] = exp(beta_L - beta_r)
(0 on padded rows), gC = exp(beta_L). Splitting each sum into the part before the chunk and the
part inside it, with A = (Q K^T) o G and Kg = diag(gl) K:

    R = diag(g1) Q P0 + A V                       (row r: q_r^T P_r)
    O = diag(g1) Q E0 + A R
    P <- gC P0 + Kg^T V,      E <- gC E0 + Kg^T R

(the decay from a token before the chunk to row r is exp(beta_r) times the state's own decay to
the chunk start; from row c to the chunk end it is gl[c]). Every line is linear in V's columns
(R's columns are those of V), so a program may own a block of value columns and all of P, E on
them: the forward runs over (value block, segment, batch*head) programs, each walking its chunks
in order with P, E in registers.

Normalization. The denominator is the same operator on a column of ones: r_n = diag(g1) Q p0 +
A 1, den = diag(g1) Q e0 + A r_n, p <- gC p0 + Kg^T 1, e <- gC e0 + Kg^T r_n. A normalized AHLA
call runs these walks unnormalized on the values [1 | 0 ...] (chunk.py, "Normalization"); a walk
carries p itself only as a first layer alone (NORM, without E: R / (r_n + eps), the normalized
first-order layers of HLA2 and third order).

Backward (L a loss; dO = dL/dO; dP, dE the gradients of the state at the chunk's end). By the
chain rule through the four lines above, in reverse:

    dR  = A^T dO + Kg dE                         (R feeds O and E)
    dA  = dO R^T + dR V^T,   dX = dA o G         (A = X o G, X = Q K^T)
    dQ  = diag(g1) (dO E0^T + dR P0^T) + dX K
    dK  = dX^T Q + diag(gl) (V dP^T + R dE^T)
    dV  = A^T dR + Kg dP
    dE0 = gC dE + Q^T diag(g1) dO,   dP0 = gC dP + Q^T diag(g1) dR

The state gradients (the last line) only need dO, Q, K and dE, so ``ahla_bwd_state_kernel``
walks the chunks from last to first carrying (dP, dE) and stores each chunk's end gradient; then
every chunk's dQ, dK, dV are independent (``ahla_bwd_grad_kernel``, one program per chunk, a loop
over value blocks summing dQ and dK). Transposed tiles (A^T, R^T, dR^T, dA^T) come from their own
dots of loaded tiles, never from transposing a dot result fed into another dot (miscompiled by
Triton 3.4-3.7.0 on Hopper).

Segments. A run of chunks started from a zero state ends with (P_s, E_s); a start state (P0, E0)
adds rho P0 to P and rho E0 + rho R_s P0 to E, where rho = exp(b_end - b_start) and
R_s = sum_{i in the run} k_i q_i^T carries no decay: the path j (before the run) -> i (in it) ->
the end decays by exp(b_i - b_start) exp(b_end - b_i) = rho whatever i is (``hla_ref.ahla_combine``).
So ``ahla_fwd_summary_kernel`` computes the segments' (P_s, E_s, R_s, log rho) in parallel,
``ahla_fwd_fold_kernel`` folds them in order into each segment's start state,

    E <- rho (E + R_s P) + E_s,   P <- rho P + P_s,

and the segments then walk at once. No start state follows the last segment, so its summary is not
computed: with NSEG segments the summaries are those of the first NSEG - 1 (the walk of the last
segment gives the final state). The backward walk is split the same way with the transposed map: an
end gradient (dP, dE) reaches the segment's start as rho (dP + R_s^T dE) and rho dE
(``ahla_bwd_summary_kernel``, ``ahla_bwd_fold_kernel``), and there the first segment's summary is
the one no fold reads.

Gate gradient. The weight factors per index: exp(b_t - b_j) (q_t.k_i)(q_i.k_j) =
((e^{b_t} q_t).(e^{-b_i} k_i)) ((e^{b_i} q_i).(e^{-b_j} k_j)), so the gated operator is the ungated
one on q~_x = e^{b_x} q_x, k~_x = e^{-b_x} k_x. Hence dL/db_s = q~_s.dq~_s - k~_s.dk~_s =
q_s.dq_s - k_s.dk_s (v carries no gate), plus, at the last token, the final state's own factor
e^{b_T}: <P_T, dP_T> + <E_T, dE_T> (+ the same for p, e). dg is the reverse cumulative sum of db.

Loading ahead (PREFETCH). Each walk (forward, backward state walk, their segment summaries) may read
the first chunk's tiles before its loop and, in every step, issue the next chunk's loads before
computing the current chunk, carrying the tiles as read (``read_rows`` / ``read_cols``: no cast,
which would wait for the data) into the next step. The memory latency then overlaps one chunk's
products instead of preceding them; the price is the carried tiles' registers, so the rule
(``chunk.ahla_config``) takes it only where it measured faster. The loads past the walk's range
are masked to nothing.

A second value tensor (HAS_V2, the first layer alone). Two first-order layers on the same queries
and keys, R = LA(Q, K, V) and R2 = LA(Q, K, V2) (third order's R and K', V2 = K), share each chunk's
tiles of Q and K and its A: the walk then carries a second state P2 = sum_j exp(b_t - b_j) k_j v2_j^T
[BK, BV2] beside P (all of V's and V2's columns in one program), R2 = diag(g1) Q P2_0 + A V2 and
P2 <- gC P2_0 + Kg^T V2 being E's lines with V2 in R's place; the segment summaries carry P2 too and
the fold runs once more on them (P2 folds as P does).

Gate sums. The forward walk, its segment summaries and the layers' backward kernels
(``ahla_bwd_dh_kernel``, ``ahla_bwd_layer_kernel``) read beta as loads from the log-gates'
chunk-local sums that their launcher computes first (``gc``, ``common.cumsum``;
``tiles.summed_beta``), the walks of one pipeline stage a chunk ahead (``tiles.walk_factors``):
no scan, reduction or layout shuffle of beta on a walk's path (hla_fast/README.md, "Per-token
gates: the chunk sums, read from memory"). So do the coupled backward's kernels.

Masks are applied by selection (``tl.where``), not by multiplying with 0. The matrix products still
multiply: a non-finite q or k at row r makes R's row r non-finite, and A R then reaches every row
of the chunk (0 times a non-finite number); earlier chunks are untouched.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common.tiles import (
    cast, chunk_decays_t, decays_with_total, dot, first_walk_sums, head_row, load_cols, load_mat, load_mat_t,
    load_rows, load_vec, mat_or_zeros, plus_stored, read_cols, read_rows, store_mat, summed_beta, sums_offset,
    vec_or_zeros, walk_factors,
)


@triton.jit
def _head_offsets(i_bh, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Offsets of head i_bh's first element in [B, T, H, K], [.., V] and [B, T, H] tensors
    (64-bit, ``head_row``)."""
    row = head_row(i_bh, T, H)
    return row * K, row * V, row


# ============================================================================ a chunk's tiles (both walks)


@triton.jit
def _walk_loads(q, k, x, off_k, off_x, t, mt, rk, mk, rv, mv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                Q_ROWS: tl.constexpr):
    """What one chunk of a walk reads, as stored (0 outside the sequence). Q_ROWS (the forward):
    Q [BT, BK], K^T [BK, BT] (a strided load) and x = V [BT, BV]; else (the backward walk)
    Q^T [BK, BT], K [BT, BK] and x = dO [BT, BV]."""
    if Q_ROWS:
        b_q = read_rows(q + off_k, t, mt, rk, mk, H * K)
        b_k = read_cols(k + off_k, t, mt, rk, mk, H * K)
    else:
        b_q = read_cols(q + off_k, t, mt, rk, mk, H * K)
        b_k = read_rows(k + off_k, t, mt, rk, mk, H * K)
    b_x = read_rows(x + off_x, t, mt, rv, mv, H * V)
    return b_q, b_k, b_x


@triton.jit
def _first_loads(q, k, x, off_k, off_x, t, mt, rk, mk, rv, mv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 Q_ROWS: tl.constexpr, PREFETCH: tl.constexpr):
    """With PREFETCH the tiles of the walk's first chunk (tokens t, valid where mt) as read,
    carried into its first step; else placeholders the steps pass through."""
    if PREFETCH:
        n_q, n_k, n_x = _walk_loads(q, k, x, off_k, off_x, t, mt, rk, mk, rv, mv, H, K, V, Q_ROWS)
    else:
        n_q, n_k, n_x = 0.0, 0.0, 0.0
    return n_q, n_k, n_x


@triton.jit
def _step_loads(q, k, x, n_q, n_k, n_x, off_k, off_x, t, mt, tn, mn, rk, mk, rv, mv,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, Q_ROWS: tl.constexpr,
                IS_BF16: tl.constexpr, PREFETCH: tl.constexpr):
    """This chunk's tiles (tokens t, valid where mt) cast for the dots, and the tiles the walk
    carries to its next step. PREFETCH: this chunk's are the carried n_q, n_k, n_x (read a step
    ago) and the loads of the walk's next chunk (tokens tn, none where not mn: past the walk's
    range) are issued now; else this chunk's are loaded here and n_* pass through."""
    if PREFETCH:
        b_q, b_k, b_x = n_q, n_k, n_x
        n_q, n_k, n_x = _walk_loads(q, k, x, off_k, off_x, tn, mn, rk, mk, rv, mv, H, K, V, Q_ROWS)
    else:
        b_q, b_k, b_x = _walk_loads(q, k, x, off_k, off_x, t, mt, rk, mk, rv, mv, H, K, V, Q_ROWS)
    return cast(b_q, IS_BF16), cast(b_k, IS_BF16), cast(b_x, IS_BF16), n_q, n_k, n_x


# ============================================================================ forward


@triton.jit
def _first_values2(v2, off_v2, t, mt, rv2, mv2, H: tl.constexpr, V2: tl.constexpr, HAS_V2: tl.constexpr,
                   PREFETCH: tl.constexpr):
    """With HAS_V2 and PREFETCH, V2's tile [BT, BV2] of the walk's first chunk as read (``_first_loads``)."""
    if HAS_V2 and PREFETCH:
        n_v2 = read_rows(v2 + off_v2, t, mt, rv2, mv2, H * V2)
    else:
        n_v2 = 0.0
    return n_v2


@triton.jit
def _step_values2(v2, n_v2, off_v2, t, mt, tn, mn, rv2, mv2, H: tl.constexpr, V2: tl.constexpr,
                  IS_BF16: tl.constexpr, HAS_V2: tl.constexpr, PREFETCH: tl.constexpr):
    """With HAS_V2, this chunk's V2 tile [BT, BV2] cast for the dots, and the tile carried to the
    walk's next step (``_step_loads`` for V2); else placeholders."""
    if HAS_V2:
        if PREFETCH:
            b_v2 = n_v2
            n_v2 = read_rows(v2 + off_v2, tn, mn, rv2, mv2, H * V2)
        else:
            b_v2 = read_rows(v2 + off_v2, t, mt, rv2, mv2, H * V2)
        b_v2 = cast(b_v2, IS_BF16)
    else:
        b_v2 = 0.0
    return b_v2, n_v2


@triton.jit
def _normalizer_rows(q, b_q, off_k, t, mt, rk, mk, H: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr,
                     PREFETCH: tl.constexpr):
    """Q [BT, BK] in fp32 for the normalizer's row sums (Q p) when NORM, else a dummy 0. A walk
    whose loads the compiler pipelines (not PREFETCH) reads the tile a second time, bypassing L1
    (``.cg``) so that it stays a load of its own: taken from the dots' tile b_q, the sums held that
    tile in registers and the walk kept it in one shared-memory buffer instead of the two it has
    without NORM. A PREFETCH walk holds b_q in registers anyway and takes it (hla_fast/README.md,
    "The configuration rule", the normalized layers)."""
    if NORM:
        if PREFETCH:
            b_qn = b_q.to(tl.float32)
        else:
            b_qn = tl.load(q + off_k + t[:, None] * (H * K) + rk[None, :], mask=mt[:, None] & mk[None, :],
                           other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        b_qn = 0.0
    return b_qn


@triton.jit
def _chunk_first_order(b_q, b_kt, b_v, P, b_qn, pn, G, g1, NORM: tl.constexpr, IS_BF16: tl.constexpr,
                       PREC: tl.constexpr):
    """A = (Q K^T) o G [BT, BT], R = diag(g1) Q P0 + A V [BT, BV] of one chunk, and R's
    normalizer column r_n = diag(g1) Q p0 + A 1 [BT] when NORM (else a dummy 0), its Q p0 from
    b_qn (``_normalizer_rows``)."""
    b_x = tl.dot(b_q, b_kt, input_precision=PREC)                  # X = Q K^T       [BT, BT]
    b_a = tl.where(G > 0, b_x * G, 0.0)                             # A = X o G
    b_r = dot(b_q, P, IS_BF16, PREC) * g1[:, None] + dot(b_a, b_v, IS_BF16, PREC)
    if NORM:
        r_n = tl.sum(b_qn * pn[None, :], axis=1) * g1 + tl.sum(b_a, axis=1)
    else:
        r_n = 0.0
    return b_a, b_r, r_n


@triton.jit
def _chunk_carry(b_kt, b_v, b_r, P, E, pn, gl, gC, NORM: tl.constexpr, IS_BF16: tl.constexpr,
                 PREC: tl.constexpr, SCALE_ROWS: tl.constexpr, HAS_E: tl.constexpr = True):
    """The state at the chunk's end: P <- gC P0 + Kg^T V, E <- gC E0 + Kg^T R (E only with HAS_E),
    and p the same as P on the column of ones when NORM (a normalized first layer, which has no E).
    Kg^T V = K^T (diag(gl) V): SCALE_ROWS scales the rows of V and R ([BT, BV] tiles) so that K^T
    enters both products as loaded, else K^T's columns (one [BK, BT] tile for both). Which is
    faster depends on the chunk (``SCALE_ROWS_MIN_CHUNK`` in chunk.py). p takes Kg^T's rows summed
    either way (vector work, no product)."""
    b_kgt = b_kt * gl[None, :]                                             # Kg^T [BK, BT]
    if SCALE_ROWS:
        P = P * gC + dot(b_kt, b_v * gl[:, None], IS_BF16, PREC)
        if HAS_E:
            E = E * gC + dot(b_kt, b_r * gl[:, None], IS_BF16, PREC)
    else:
        P = P * gC + dot(b_kgt, b_v, IS_BF16, PREC)
        if HAS_E:
            E = E * gC + dot(b_kgt, b_r, IS_BF16, PREC)
    if NORM:
        pn = pn * gC + tl.sum(b_kgt.to(tl.float32), axis=1)
    return P, E, pn


@triton.heuristics({
    "HAS_G": lambda a: a["gc"] is not None,
    "HAS_INIT": lambda a: a["h0_p"] is not None,
    "HAS_O": lambda a: a["o"] is not None,
    "SAVE_STATES": lambda a: a["cs_p"] is not None,
    "SAVE_PN": lambda a: a["cs_pn"] is not None,
    "STORE_R": lambda a: a["r"] is not None,
    "STORE_FINAL": lambda a: a["ht_p"] is not None,
    "NORM": lambda a: (a["ht_pn"] is not None or a["den"] is not None) and a["qp"] is None,
    "HAS_E": lambda a: a["o"] is not None or a["ht_e"] is not None or a["cs_e"] is not None,
    "HAS_V2": lambda a: a["v2"] is not None,
    "DIVIDE": lambda a: a["qp"] is not None,
    "DEN_IN": lambda a: a["den_in"] is not None,
})
@triton.jit
def ahla_fwd_kernel(
    q, k, v, gc,             # q, k: [B, T, H, K]; v: [B, T, H, V]; gc: the log-gates' chunk-local sums at BT,
                             #   fp32 [B*H, NT*BT] (``common.cumsum``), or None
    v2, r2, h0_p2, ht_p2, cs_p2,  # HAS_V2: second values [B, T, H, V2]; out: R2 = LA(q, k, v2); P2's start
                             #   state per segment [B*H*NSEG, K, V2] (None: zero), final state [B*H, K, V2],
                             #   snapshots [B*H, NT, K, V2] (each None when not asked for); all None without
    o, den,                  # out: o [B, T, H, V] or None; den [B, T, H] fp32 (normalize, or DIVIDE) or None
    qp,                      # DIVIDE: q_t . p_c, the denominator's state at the start of t's chunk, fp32 [B, T, H]
                             #   (``common.denominator``); or None
    den_in,                  # DEN_IN: the denominator fp32 [B, T, H] from a walk of its own: o / (den_in + eps); or None
    h0_p, h0_e, h0_pn,       # start state of every segment, fp32 [B*H*NSEG, K, V] x 2, [.., K] (NORM); or None
                             #   (h0_e None: zero, or not carried)
    ht_p, ht_e, ht_pn,       # out: final state [B*H, K, V] x 2, [B*H, K] (NORM); or None
    cs_p, cs_e,              # out: chunk-start snapshots [B*H, NT, K, V] x 2; or None
    cs_pn,                   # out: chunk-start snapshots of p, fp32 [B*H, NT, K] (a normalized first layer); or None
    r,                       # out: the first order's output R [B, T, H, V] (v's dtype), normalized with NORM
                             #   or DIVIDE (its denominator then in den); or None
    log_gamma, eps, T, NS,   # log(gamma) (without g), normalizer eps, sequence length, chunks per segment
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, HAS_INIT: tl.constexpr, HAS_O: tl.constexpr, SAVE_STATES: tl.constexpr,
    STORE_R: tl.constexpr, STORE_FINAL: tl.constexpr, NORM: tl.constexpr, PREFETCH: tl.constexpr,
    SCALE_ROWS: tl.constexpr, HAS_E: tl.constexpr, V2: tl.constexpr, BV2: tl.constexpr, HAS_V2: tl.constexpr,
    SAVE_PN: tl.constexpr, SUMS_AHEAD: tl.constexpr,   # read each next chunk's gate sums a step ahead
    DIVIDE: tl.constexpr, DEN_IN: tl.constexpr,
):
    """One program per (value block, segment, batch*head) walks its segment's chunks in order,
    keeping its columns of P and E (and all of p when NORM) in fp32 registers: outputs (HAS_O),
    chunk-start snapshots (SAVE_STATES), the first order's output R for the layered backward
    (STORE_R) and the final state (STORE_FINAL, last segment).

    Without HAS_E (no output, E's snapshot or final state asked for) the walk is first-order
    attention alone, R = LA(q, k, v) with state P: third order's first stage (``hla3``), HLA2's
    layers. Only such a walk is normalized in-kernel. With NORM: R / (r_n + eps) is stored in r,
    r_n in den, p carried beside P (its chunk-start snapshots in cs_pn with SAVE_PN). DIVIDE
    (without NORM): the same R / (r_n + eps) in r and r_n in den, the walk carrying no p: r_n =
    diag(g1) qp + A 1 from qp, formed before the walk (``common/denominator.py``). HAS_V2
    (without HAS_E or NORM, V in one block): also R2 = LA(q, k, v2) with state P2 (module docstring,
    "A second value tensor"). DEN_IN (with HAS_O): o is divided by (den_in + eps), the denominator
    a walk on the values [1 | 0 ...] stored before: AHLA's normalized forward is two such walks
    (``ahla_fwd`` in chunk.py), so that neither carries a normalizer."""
    tl.static_assert(not (NORM and HAS_E), "only a first layer alone (no E) is normalized in the walk")
    # -- which piece of work this program owns ---------------------------------------------
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NSEG = tl.num_programs(1)
    NT = tl.cdiv(T, BT)
    off_k, off_v, off_g = _head_offsets(i_bh, T, H, K, V)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    lo = i_n * NS
    hi = tl.minimum(lo + NS, NT)

    # -- the state at the segment's start -------------------------------------------------
    i_sg = i_bh.to(tl.int64) * NSEG + i_n
    P = mat_or_zeros(h0_p, i_sg * K * V, rk, mk, rv, mv, V, BK, BV, HAS_INIT)    # [BK, BV]
    E = mat_or_zeros(h0_e, i_sg * K * V, rk, mk, rv, mv, V, BK, BV, HAS_INIT and HAS_E)  # [BK, BV]
    if NORM:
        pn = vec_or_zeros(h0_pn, i_sg * K, rk, mk, BK, HAS_INIT)                 # [BK]
    else:
        pn = 0.0
    # the second values' columns, head offset and state (HAS_V2)
    rv2 = tl.arange(0, BV2)
    mv2 = rv2 < V2
    off_v2 = off_g * V2
    if HAS_V2:
        P2 = mat_or_zeros(h0_p2, i_sg * K * V2, rk, mk, rv2, mv2, V2, BK, BV2, HAS_INIT)  # [BK, BV2]
    else:
        P2 = 0.0

    end = tl.minimum(hi * BT, T)                       # first token past the segment
    n_q, n_kt, n_v = _first_loads(q, k, v, off_k, off_v, lo * BT + rt, lo * BT + rt < end, rk, mk, rv, mv, H, K, V,
                                  True, PREFETCH)
    n_v2 = _first_values2(v2, off_v2, lo * BT + rt, lo * BT + rt < end, rv2, mv2, H, V2, HAS_V2, PREFETCH)
    off_gc = sums_offset(i_bh, NT, BT)                 # the head's chunk-local sums (HAS_G)
    n_beta, n_bL = first_walk_sums(gc, off_gc, lo * BT, BT, HAS_G, SUMS_AHEAD)
    for i_c in range(lo, hi):
        t = i_c * BT + rt
        mt = t < T
        # -- the chunk's tiles (with PREFETCH loaded one step ahead) and decay factors -------
        b_q, b_kt, b_v, n_q, n_kt, n_v = _step_loads(q, k, v, n_q, n_kt, n_v, off_k, off_v, t, mt, t + BT, t + BT < end,
                                                     rk, mk, rv, mv, H, K, V, True, IS_BF16, PREFETCH)
        b_v2, n_v2 = _step_values2(v2, n_v2, off_v2, t, mt, t + BT, t + BT < end, rv2, mv2, H, V2, IS_BF16, HAS_V2,
                                   PREFETCH)
        G, g1, g2, gl, gC, bL, n_beta, n_bL = walk_factors(
            gc, off_gc, n_beta, n_bL, i_c * BT, i_c * BT + BT, lo * BT, hi * BT, log_gamma, mt, BT, HAS_G, HAS_DECAY,
            SUMS_AHEAD)
        if SAVE_STATES:   # the chunk's start state (p's with SAVE_PN)
            i_cs = i_bh.to(tl.int64) * NT + i_c
            _store_start(cs_p, cs_e, cs_pn, i_cs, P, E, pn, i_v, rk, mk, rv, mv, K, V, SAVE_PN, HAS_E)
            if HAS_V2:
                store_mat(cs_p2 + i_cs * K * V2, P2, rk, mk, rv2, mv2, V2)
        if DIVIDE:   # read here, used after the chunk's first products: their time covers its latency
            b_qp = tl.load(qp + off_g + t * H, mask=mt, other=0.0)                       # q . p_c [BT]
        if DEN_IN:   # the same for the denominator the outputs are divided by
            b_den_in = tl.load(den_in + off_g + t * H, mask=mt, other=1.0)              # den [BT]
        # -- first order: R = diag(g1) Q P0 + A V ------------------------------------------
        b_qn = _normalizer_rows(q, b_q, off_k, t, mt, rk, mk, H, K, NORM, PREFETCH)      # Q [BT, BK] fp32
        b_a, b_r, r_n = _chunk_first_order(b_q, b_kt, b_v, P, b_qn, pn, G, g1, NORM, IS_BF16, PREC)
        if DIVIDE:   # r_n = diag(g1) Q p_c + A 1, as NORM's from a carried p
            r_n = b_qp * g1 + tl.sum(b_a, axis=1)
        if STORE_R:
            if NORM or DIVIDE:   # a normalized first-order layer: R / (r_n + eps), r_n its denominator
                if i_v == 0:
                    tl.store(den + off_g + t * H, r_n, mask=mt)
                b_ro = b_r / (r_n + eps)[:, None]
            else:
                b_ro = b_r
            tl.store(r + off_v + t[:, None] * (H * V) + rv[None, :], b_ro.to(r.dtype.element_ty),
                     mask=mt[:, None] & mv[None, :])
        # -- the second values: R2 = diag(g1) Q P2_0 + A V2 ------------------------------------
        if HAS_V2:
            b_r2 = dot(b_q, P2, IS_BF16, PREC) * g1[:, None] + dot(b_a, b_v2, IS_BF16, PREC)   # [BT, BV2]
            tl.store(r2 + off_v2 + t[:, None] * (H * V2) + rv2[None, :], b_r2.to(r2.dtype.element_ty),
                     mask=mt[:, None] & mv2[None, :])
        # -- second order: O = diag(g1) Q E0 + A R ------------------------------------------
        if HAS_O:
            b_o = dot(b_q, E, IS_BF16, PREC) * g1[:, None] + dot(b_a, b_r, IS_BF16, PREC)      # [BT, BV]
            if DEN_IN:
                b_o = b_o / (b_den_in + eps)[:, None]
            tl.store(o + off_v + t[:, None] * (H * V) + rv[None, :], b_o.to(o.dtype.element_ty),
                     mask=mt[:, None] & mv[None, :])
        # -- carry the state to the chunk's end --------------------------------------------
        if HAS_V2:   # P2 as E would be, with V2 in R's place
            P, P2, pn = _chunk_carry(b_kt, b_v, b_v2, P, P2, pn, gl, gC, NORM, IS_BF16, PREC, SCALE_ROWS)
        else:
            P, E, pn = _chunk_carry(b_kt, b_v, b_r, P, E, pn, gl, gC, NORM, IS_BF16, PREC, SCALE_ROWS, HAS_E)

    if STORE_FINAL:
        if i_n == NSEG - 1:
            base = i_bh.to(tl.int64) * K * V
            store_mat(ht_p + base, P, rk, mk, rv, mv, V)
            if HAS_E:
                store_mat(ht_e + base, E, rk, mk, rv, mv, V)
            if HAS_V2:
                store_mat(ht_p2 + i_bh.to(tl.int64) * K * V2, P2, rk, mk, rv2, mv2, V2)
            if NORM:
                if i_v == 0:
                    tl.store(ht_pn + i_bh * K + rk, pn, mask=mk)


@triton.heuristics({
    "HAS_G": lambda a: a["gc"] is not None,
    "NORM": lambda a: a["sum_pn"] is not None,
    "HAS_E": lambda a: a["sum_e"] is not None,
    "HAS_V2": lambda a: a["v2"] is not None,
})
@triton.jit
def ahla_fwd_summary_kernel(
    q, k, v, gc, v2,             # as in ahla_fwd_kernel
    sum_p2,                      # out (HAS_V2): P2's summary [B*H*NSEG, K, V2]; or None
    sum_p, sum_e, sum_pn,        # out: each segment's end state from a zero start, fp32
                                 #      [B*H*NSEG, K, V] x 2, [.., K] (NORM, else None);
                                 #      sum_e None: first order alone (no E, R)
    sum_r, sum_lr,               # out: R = sum_i k_i q_i^T over the segment [B*H*NSEG, K, K]; log rho [B*H*NSEG]
    log_gamma, T, NS,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, NORM: tl.constexpr, PREFETCH: tl.constexpr, SCALE_ROWS: tl.constexpr,
    HAS_E: tl.constexpr, V2: tl.constexpr, BV2: tl.constexpr, HAS_V2: tl.constexpr, SUMS_AHEAD: tl.constexpr,
):
    """A segment's summary: the state (P, E, or P[, p] of a first layer alone) after it from a zero
    state, the undecayed moment R = sum_i k_i q_i^T and log rho = b_end - b_start (its total log
    decay). A start state (P0, E0) reaches the segment's end as rho P0 and rho E0 + rho R P0
    (``ahla_fwd_fold_kernel``). The grid's segments are the first NSEG - 1 of the walk's (the fold
    needs no summary of the last), and the summaries are stored [B*H, NSEG - 1, ..]."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NSEG = tl.num_programs(1)                          # summaries per head: the walk's segments - 1
    NT = tl.cdiv(T, BT)
    off_k, off_v, off_g = _head_offsets(i_bh, T, H, K, V)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    lo = i_n * NS
    hi = tl.minimum(lo + NS, NT)
    P = tl.zeros([BK, BV], dtype=tl.float32)
    E = tl.zeros([BK, BV], dtype=tl.float32)
    R = tl.zeros([BK, BK], dtype=tl.float32)
    tl.static_assert(not (NORM and HAS_E), "only a first layer alone (no E) is normalized in the walk")
    if NORM:
        pn = tl.zeros([BK], dtype=tl.float32)
    else:
        pn = 0.0
    log_rho = 0.0
    rv2 = tl.arange(0, BV2)
    mv2 = rv2 < V2
    off_v2 = off_g * V2
    P2 = tl.zeros([BK, BV2], dtype=tl.float32)
    end = tl.minimum(hi * BT, T)                       # first token past the segment
    n_q, n_kt, n_v = _first_loads(q, k, v, off_k, off_v, lo * BT + rt, lo * BT + rt < end, rk, mk, rv, mv, H, K, V,
                                  True, PREFETCH)
    n_v2 = _first_values2(v2, off_v2, lo * BT + rt, lo * BT + rt < end, rv2, mv2, H, V2, HAS_V2, PREFETCH)
    off_gc = sums_offset(i_bh, NT, BT)                 # the head's chunk-local sums (HAS_G)
    n_beta, n_bL = first_walk_sums(gc, off_gc, lo * BT, BT, HAS_G, SUMS_AHEAD)
    for i_c in range(lo, hi):
        t = i_c * BT + rt
        mt = t < T
        b_q, b_kt, b_v, n_q, n_kt, n_v = _step_loads(q, k, v, n_q, n_kt, n_v, off_k, off_v, t, mt, t + BT, t + BT < end,
                                                     rk, mk, rv, mv, H, K, V, True, IS_BF16, PREFETCH)
        b_v2, n_v2 = _step_values2(v2, n_v2, off_v2, t, mt, t + BT, t + BT < end, rv2, mv2, H, V2, IS_BF16, HAS_V2,
                                   PREFETCH)
        G, g1, g2, gl, gC, bL, n_beta, n_bL = walk_factors(
            gc, off_gc, n_beta, n_bL, i_c * BT, i_c * BT + BT, lo * BT, hi * BT, log_gamma, mt, BT, HAS_G, HAS_DECAY,
            SUMS_AHEAD)
        if HAS_E:
            b_a, b_r, _ = _chunk_first_order(b_q, b_kt, b_v, P, 0.0, 0.0, G, g1, False, IS_BF16, PREC)
            R += dot(b_kt, b_q, IS_BF16, PREC)                               # K^T Q  [BK, BK]
        else:   # P alone needs neither R nor the chunk's products with Q
            b_r = 0.0
        if HAS_V2:   # P2 as E would be, with V2 in R's place
            P, P2, pn = _chunk_carry(b_kt, b_v, b_v2, P, P2, pn, gl, gC, NORM, IS_BF16, PREC, SCALE_ROWS)
        else:
            P, E, pn = _chunk_carry(b_kt, b_v, b_r, P, E, pn, gl, gC, NORM, IS_BF16, PREC, SCALE_ROWS, HAS_E)
        log_rho += bL
    i_sg = i_bh.to(tl.int64) * NSEG + i_n
    store_mat(sum_p + i_sg * K * V, P, rk, mk, rv, mv, V)
    if HAS_E:
        store_mat(sum_e + i_sg * K * V, E, rk, mk, rv, mv, V)
    if HAS_V2:
        store_mat(sum_p2 + i_sg * K * V2, P2, rk, mk, rv2, mv2, V2)
    if i_v == 0:
        if HAS_E:
            store_mat(sum_r + i_sg * K * K, R, rk, mk, rk, mk, K)
        tl.store(sum_lr + i_sg, log_rho)
        if NORM:
            tl.store(sum_pn + i_sg * K + rk, pn, mask=mk)


@triton.jit
def _store_start(seg_p, seg_e, seg_pn, i_sg, P, E, pn, i_v, rk, mk, rv, mv,
                 K: tl.constexpr, V: tl.constexpr, NORM: tl.constexpr, HAS_E: tl.constexpr):
    """Store a start state at index i_sg (a segment's, or a chunk's snapshot): P, E [BK, BV] (E with
    HAS_E), p [BK] (NORM, value block 0)."""
    store_mat(seg_p + i_sg * K * V, P, rk, mk, rv, mv, V)
    if HAS_E:
        store_mat(seg_e + i_sg * K * V, E, rk, mk, rv, mv, V)
    if NORM:
        if i_v == 0:
            tl.store(seg_pn + i_sg * K + rk, pn, mask=mk)


@triton.heuristics({
    "HAS_INIT": lambda a: a["h0_p"] is not None,
    "NORM": lambda a: a["sum_pn"] is not None,
    "HAS_E": lambda a: a["sum_e"] is not None,
})
@triton.jit
def ahla_fwd_fold_kernel(
    sum_p, sum_e, sum_pn, sum_r, sum_lr,  # segment summaries (ahla_fwd_summary_kernel)
    h0_p, h0_e, h0_pn,                   # state before the sequence [B*H, ..] or None
    seg_p, seg_e, seg_pn,                # out: state at each segment's start [B*H*NSEG, ..]
    NSEG,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, HAS_INIT: tl.constexpr, NORM: tl.constexpr, HAS_E: tl.constexpr,
):
    """Fold the segment summaries in order (the combine of ``hla_ref.ahla_combine``): with
    rho = exp(log rho),  E <- rho E + rho R_seg P + E_seg,  P <- rho P + P_seg  (E only with
    HAS_E; p as P with NORM, a first layer alone). Stores the start state of each of the NSEG
    segments; the summaries are the first NSEG - 1 segments' ([B*H, NSEG - 1, ..],
    ``ahla_fwd_summary_kernel``)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    P = mat_or_zeros(h0_p, i_bh.to(tl.int64) * K * V, rk, mk, rv, mv, V, BK, BV, HAS_INIT)
    E = mat_or_zeros(h0_e, i_bh.to(tl.int64) * K * V, rk, mk, rv, mv, V, BK, BV, HAS_INIT and HAS_E)
    tl.static_assert(not (NORM and HAS_E), "only a first layer alone (no E) is normalized in the walk")
    if NORM:
        pn = vec_or_zeros(h0_pn, i_bh.to(tl.int64) * K, rk, mk, BK, HAS_INIT)
    else:
        pn = 0.0
    for i_s in range(0, NSEG - 1):
        _store_start(seg_p, seg_e, seg_pn, i_bh.to(tl.int64) * NSEG + i_s, P, E, pn, i_v, rk, mk, rv, mv, K, V,
                     NORM, HAS_E)
        i_sm = i_bh.to(tl.int64) * (NSEG - 1) + i_s          # segment i_s's summary
        rho = tl.exp(tl.load(sum_lr + i_sm))
        if HAS_E:
            b_r = load_mat(sum_r + i_sm * K * K, rk, mk, rk, mk, K)
            E = (E + tl.dot(b_r, P, input_precision=PREC)) * rho + load_mat(sum_e + i_sm * K * V, rk, mk, rv, mv, V)
        P = P * rho + load_mat(sum_p + i_sm * K * V, rk, mk, rv, mv, V)
        if NORM:
            pn = pn * rho + load_vec(sum_pn + i_sm * K, rk, mk)
    _store_start(seg_p, seg_e, seg_pn, i_bh.to(tl.int64) * NSEG + NSEG - 1, P, E, pn, i_v, rk, mk, rv, mv, K, V,
                 NORM, HAS_E)


# ============================================================================ backward


@triton.jit
def _dstate_factors(gc, off_gc, c0, log_gamma, mt, BT: tl.constexpr, HAS_G: tl.constexpr, HAS_DECAY: tl.constexpr):
    """The backward walk's decay factors of the chunk whose first token is c0, from the gate sums
    (``tiles.summed_beta``): G^T, g1, gl, gC, bL."""
    beta, bL = summed_beta(gc, off_gc, c0, log_gamma, mt, BT, HAS_G, HAS_DECAY)
    G, g1, g2, gl, gC, bL = decays_with_total(beta, bL, mt, BT, HAS_DECAY)
    GT = chunk_decays_t(beta, BT, HAS_DECAY)
    return GT, g1, gl, gC, bL


@triton.jit
def _dstate_step(b_qt, b_k, b_do, d_p, d_e, GT, g1, gl, gC, IS_BF16: tl.constexpr, PREC: tl.constexpr):
    """The gradient of a chunk's start state from that of its end state:

        dR = A^T dO + Kg dE,   dE0 = gC dE + Q^T diag(g1) dO,   dP0 = gC dP + Q^T diag(g1) dR

    (A^T = (K Q^T) o G^T from its own dot)."""
    b_at = tl.where(GT > 0, tl.dot(b_k, b_qt, input_precision=PREC) * GT, 0.0)   # A^T [BT, BT]
    b_dr = dot(b_at, b_do, IS_BF16, PREC) + dot(b_k * gl[:, None], d_e, IS_BF16, PREC)
    b_qgt = b_qt * g1[None, :]                                                   # Q^T diag(g1)
    n_e = d_e * gC + dot(b_qgt, b_do, IS_BF16, PREC)
    n_p = d_p * gC + dot(b_qgt, b_dr, IS_BF16, PREC)
    return n_p, n_e


@triton.heuristics({
    "HAS_G": lambda a: a["gc"] is not None,
    "HAS_DHT": lambda a: a["de_p"] is not None,
    "STORE_DH0": lambda a: a["dh0_p"] is not None,
})
@triton.jit(do_not_specialize=["C0", "NP"])
def ahla_bwd_state_kernel(
    q, k, do, gc,            # q, k: [B, T, H, K]; do: [B, T, H, V]; gc: the log-gates' chunk sums as in
                             #   ahla_fwd_kernel (at this BT), or None
    dp_end, de_end,          # out: gradient of each chunk's END state (P, E) [B*H, NP, K, V], in the snapshots'
                             #      dtype, chunk C0 + i at i
    de_p, de_e,              # gradient of each segment's END state, fp32 [B*H*NSEG, K, V]; or None (zero)
    dh0_p, dh0_e,            # out: gradient of the initial state, fp32 [B*H, K, V]; or None
    log_gamma, T, NS,
    C0, NP,                  # the walk covers chunks [C0, min(C0 + NP, NT)) (a piece of the sequence)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREFETCH: tl.constexpr,
):
    """One program per (value block, segment, batch*head) walks its segment's chunks from last to
    first carrying the state gradients (dP, dE) of its value columns (``_dstate_step``), storing
    each chunk's end-state gradient for the per-chunk kernel; the first segment stores the initial
    state's gradient (in pieces: the gradient at the piece's start, C0, as in HLA2's walk)."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NSEG = tl.num_programs(1)
    NT = tl.cdiv(T, BT)
    off_k, off_v, off_g = _head_offsets(i_bh, T, H, K, V)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    lo = C0 + i_n * NS
    hi = tl.minimum(tl.minimum(lo + NS, C0 + NP), NT)
    i_sg = i_bh.to(tl.int64) * NSEG + i_n
    d_p = mat_or_zeros(de_p, i_sg * K * V, rk, mk, rv, mv, V, BK, BV, HAS_DHT)    # [BK, BV]
    d_e = mat_or_zeros(de_e, i_sg * K * V, rk, mk, rv, mv, V, BK, BV, HAS_DHT)    # [BK, BV]
    start = lo * BT                                   # the walk's last token is before this one
    t0 = (hi - 1) * BT + rt                           # the walk starts at the last chunk
    n_qt, n_k, n_do = _first_loads(q, k, do, off_k, off_v, t0, (t0 >= start) & (t0 < T), rk, mk, rv, mv, H, K, V,
                                   False, PREFETCH)
    for i_r in range(0, hi - lo):
        i_c = hi - 1 - i_r
        off_d = (i_bh.to(tl.int64) * NP + i_c - C0) * K * V
        store_mat(dp_end + off_d, d_p, rk, mk, rv, mv, V)
        store_mat(de_end + off_d, d_e, rk, mk, rv, mv, V)
        t = i_c * BT + rt
        mt = t < T
        # the walk's next chunk is the previous one in the sequence
        b_qt, b_k, b_do, n_qt, n_k, n_do = _step_loads(q, k, do, n_qt, n_k, n_do, off_k, off_v, t, mt, t - BT,
                                                       t - BT >= start, rk, mk, rv, mv, H, K, V, False, IS_BF16,
                                                       PREFETCH)
        GT, g1, gl, gC, bL = _dstate_factors(gc, sums_offset(i_bh, NT, BT), i_c * BT, log_gamma, mt, BT, HAS_G,
                                             HAS_DECAY)
        d_p, d_e = _dstate_step(b_qt, b_k, b_do, d_p, d_e, GT, g1, gl, gC, IS_BF16, PREC)
    if STORE_DH0:
        if i_n == 0:
            base = i_bh.to(tl.int64) * K * V
            store_mat(dh0_p + base, d_p, rk, mk, rv, mv, V)
            store_mat(dh0_e + base, d_e, rk, mk, rv, mv, V)


@triton.heuristics({
    "HAS_G": lambda a: a["gc"] is not None,
})
@triton.jit
def ahla_bwd_summary_kernel(
    q, k, do, gc,            # as in ahla_bwd_state_kernel
    sum_dp, sum_de,          # out: each segment's start-state gradient from a zero end gradient [B*H*NSEG, K, V]
    sum_rt, sum_lr,          # out: R^T = sum_i q_i k_i^T over the segment [B*H*NSEG, K, K]; log rho [B*H*NSEG]
    log_gamma, T, NS,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, PREFETCH: tl.constexpr,
):
    """A segment's backward summary: the walk of ``ahla_bwd_state_kernel`` from a zero end
    gradient, R^T and log rho. (The transpose of the forward's segment map: an end gradient
    (dP, dE) reaches the segment's start as rho dP + rho R^T dE and rho dE.) The grid's segments
    are the walk's second to last (no fold reads the first's summary); program i_n summarizes
    segment i_n + 1 and stores it at [B*H, NSEG - 1, ..] index i_n."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1) + 1, tl.program_id(2)
    NSUM = tl.num_programs(1)                         # summaries per head: the walk's segments - 1
    NT = tl.cdiv(T, BT)
    off_k, off_v, off_g = _head_offsets(i_bh, T, H, K, V)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    lo = i_n * NS
    hi = tl.minimum(lo + NS, NT)
    d_p = tl.zeros([BK, BV], dtype=tl.float32)
    d_e = tl.zeros([BK, BV], dtype=tl.float32)
    b_rt = tl.zeros([BK, BK], dtype=tl.float32)
    log_rho = 0.0
    start = lo * BT                                   # the walk's last token is before this one
    t0 = (hi - 1) * BT + rt                           # the walk starts at the last chunk
    n_qt, n_k, n_do = _first_loads(q, k, do, off_k, off_v, t0, (t0 >= start) & (t0 < T), rk, mk, rv, mv, H, K, V,
                                   False, PREFETCH)
    for i_r in range(0, hi - lo):
        i_c = hi - 1 - i_r
        t = i_c * BT + rt
        mt = t < T
        # the walk's next chunk is the previous one in the sequence
        b_qt, b_k, b_do, n_qt, n_k, n_do = _step_loads(q, k, do, n_qt, n_k, n_do, off_k, off_v, t, mt, t - BT,
                                                       t - BT >= start, rk, mk, rv, mv, H, K, V, False, IS_BF16,
                                                       PREFETCH)
        GT, g1, gl, gC, bL = _dstate_factors(gc, sums_offset(i_bh, NT, BT), i_c * BT, log_gamma, mt, BT, HAS_G,
                                             HAS_DECAY)
        d_p, d_e = _dstate_step(b_qt, b_k, b_do, d_p, d_e, GT, g1, gl, gC, IS_BF16, PREC)
        b_rt += dot(b_qt, b_k, IS_BF16, PREC)                                # Q^T K  [BK, BK]
        log_rho += bL
    i_sg = i_bh.to(tl.int64) * NSUM + i_n - 1
    store_mat(sum_dp + i_sg * K * V, d_p, rk, mk, rv, mv, V)
    store_mat(sum_de + i_sg * K * V, d_e, rk, mk, rv, mv, V)
    if i_v == 0:
        store_mat(sum_rt + i_sg * K * K, b_rt, rk, mk, rk, mk, K)
        tl.store(sum_lr + i_sg, log_rho)


@triton.heuristics({
    "HAS_DHT": lambda a: a["dht_p"] is not None,
})
@triton.jit
def ahla_bwd_fold_kernel(
    sum_dp, sum_de, sum_rt, sum_lr,  # segments' backward summaries (ahla_bwd_summary_kernel)
    dht_p, dht_e,                    # gradient of the final state, fp32 [B*H, K, V]; or None
    de_p, de_e,                      # out: gradient of each segment's END state [B*H*NSEG, K, V]
    NSEG,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, HAS_DHT: tl.constexpr,
):
    """Fold the backward summaries from the last segment to the first (the transpose of the
    forward's fold):  dP <- rho dP + rho R^T dE + dP_seg,  dE <- rho dE + dE_seg. Stores the end
    gradient of each of the NSEG segments; the summaries are the last NSEG - 1 segments'
    ([B*H, NSEG - 1, ..], ``ahla_bwd_summary_kernel``)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    d_p = mat_or_zeros(dht_p, i_bh.to(tl.int64) * K * V, rk, mk, rv, mv, V, BK, BV, HAS_DHT)
    d_e = mat_or_zeros(dht_e, i_bh.to(tl.int64) * K * V, rk, mk, rv, mv, V, BK, BV, HAS_DHT)
    for i_r in range(0, NSEG - 1):
        i_s = NSEG - 1 - i_r                                  # the segment, from the last
        i_sg = i_bh.to(tl.int64) * NSEG + i_s
        store_mat(de_p + i_sg * K * V, d_p, rk, mk, rv, mv, V)
        store_mat(de_e + i_sg * K * V, d_e, rk, mk, rv, mv, V)
        i_sm = i_bh.to(tl.int64) * (NSEG - 1) + i_s - 1      # its summary
        rho = tl.exp(tl.load(sum_lr + i_sm))
        b_rt = load_mat(sum_rt + i_sm * K * K, rk, mk, rk, mk, K)
        d_p = (d_p + tl.dot(b_rt, d_e, input_precision=PREC)) * rho + load_mat(sum_dp + i_sm * K * V, rk, mk, rv, mv, V)
        d_e = d_e * rho + load_mat(sum_de + i_sm * K * V, rk, mk, rv, mv, V)
    i_sg = i_bh.to(tl.int64) * NSEG                           # the first segment
    store_mat(de_p + i_sg * K * V, d_p, rk, mk, rv, mv, V)
    store_mat(de_e + i_sg * K * V, d_e, rk, mk, rv, mv, V)


@triton.jit
def _chunk_value_block_grads(b_q, b_qgt, b_k, b_kg, b_kgt, b_a, b_at, G, GT, g1, gl,
                             b_v, b_vt, b_do, b_dot, b_p0, b_p0t, b_e0t, d_p, d_pt, d_e, d_et,
                             IS_BF16: tl.constexpr, PREC: tl.constexpr):
    """One value block's share of a chunk's gradients (see the module docstring): returns its
    terms of dQ and dK [BT, BK] (to be summed over blocks) and its dV [BT, BV]."""
    b_qg = b_q * g1[:, None]
    # -- R and R^T, dR and dR^T, each from its own dots ---------------------------------------
    b_r = dot(b_qg, b_p0, IS_BF16, PREC) + dot(b_a, b_v, IS_BF16, PREC)                # [BT, BV]
    b_rt = dot(b_p0t, b_qgt, IS_BF16, PREC) + dot(b_vt, b_at, IS_BF16, PREC)           # [BV, BT]
    b_dr = dot(b_at, b_do, IS_BF16, PREC) + dot(b_kg, d_e, IS_BF16, PREC)              # [BT, BV]
    b_drt = dot(b_dot, b_a, IS_BF16, PREC) + dot(d_et, b_kgt, IS_BF16, PREC)           # [BV, BT]
    # -- dX = (dO R^T + dR V^T) o G and its transpose --------------------------------------
    b_dx = dot(b_do, b_rt, IS_BF16, PREC) + dot(b_dr, b_vt, IS_BF16, PREC)
    b_dx = tl.where(G > 0, b_dx * G, 0.0)
    b_dxt = dot(b_r, b_dot, IS_BF16, PREC) + dot(b_v, b_drt, IS_BF16, PREC)
    b_dxt = tl.where(GT > 0, b_dxt * GT, 0.0)
    # -- dQ = diag(g1) (dO E0^T + dR P0^T) + dX K ----------------------------------------------
    b_dq = (dot(b_do, b_e0t, IS_BF16, PREC) + dot(b_dr, b_p0t, IS_BF16, PREC)) * g1[:, None]
    b_dq += dot(b_dx, b_k, IS_BF16, PREC)
    # -- dK = dX^T Q + diag(gl) (V dP^T + R dE^T) -----------------------------------------------
    b_dk = dot(b_dxt, b_q, IS_BF16, PREC)
    b_dk += (dot(b_v, d_pt, IS_BF16, PREC) + dot(b_r, d_et, IS_BF16, PREC)) * gl[:, None]
    # -- dV = A^T dR + Kg dP ----------------------------------------------------------------------
    b_dv = dot(b_at, b_dr, IS_BF16, PREC) + dot(b_kg, d_p, IS_BF16, PREC)
    return b_dq, b_dk, b_dv


@triton.jit
def _chunk_key_tiles(q, k, gc, off_k, off_gc, log_gamma, c0, t, mt, rk, mk,
                     H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                     HAS_G: tl.constexpr, HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr):
    """What every value block of a chunk's gradients shares: Q, K [BT, BK] and Q^T, K^T [BK, BT]
    (strided loads), the decay factors G, G^T, g1, gl, A = (Q K^T) o G and A^T [BT, BT] (each from
    its own dot), Q^T diag(g1), diag(gl) K and its transpose; the decays from the gate sums (gc,
    ``tiles.summed_beta``; off_gc the head's first element there)."""
    b_q = load_rows(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_qt = load_cols(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_k = load_rows(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_kt = load_cols(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
    beta, bL = summed_beta(gc, off_gc, c0, log_gamma, mt, BT, HAS_G, HAS_DECAY)
    G, g1, g2, gl, gC, bL = decays_with_total(beta, bL, mt, BT, HAS_DECAY)
    GT = chunk_decays_t(beta, BT, HAS_DECAY)
    b_a = tl.where(G > 0, tl.dot(b_q, b_kt, input_precision=PREC) * G, 0.0)      # A   [BT, BT]
    b_at = tl.where(GT > 0, tl.dot(b_k, b_qt, input_precision=PREC) * GT, 0.0)   # A^T [BT, BT]
    b_qgt = b_qt * g1[None, :]
    b_kg = b_k * gl[:, None]
    b_kgt = b_kt * gl[None, :]
    return b_q, b_qgt, b_k, b_kg, b_kgt, b_a, b_at, G, GT, g1, gl


@triton.heuristics({
    "HAS_G": lambda a: a["gc"] is not None,
    "HAS_DB": lambda a: a["db"] is not None,
    "HAS_DQ_IN": lambda a: a["dq_in"] is not None,
    "HAS_DK_IN": lambda a: a["dk_in"] is not None,
})
@triton.jit(do_not_specialize=["C0", "NP"])
def ahla_bwd_grad_kernel(
    q, k, v, do, gc,         # inputs as in the forward (gc: the gate sums at this BT, or None); do: [B, T, H, V]
    dq, dk, dv,              # out: gradients, same shapes and dtypes as q, k, v
    dq_in, dk_in,            # another part's dq, dk to add before storing (may be dq, dk themselves); each or None
    db,                      # out: dL/db_t without the final state's share, fp32 [B, T, H]; or None
    cs_p, cs_e,              # chunk-start snapshots [B*H, NT, K, V] (P0, E0)
    dp_end, de_end,          # chunk-end state gradients (ahla_bwd_state_kernel) [B*H, NP, K, V]: chunk C0 + i at i
    log_gamma, T,
    C0, NP,                  # this launch's chunks: program i does chunk C0 + i
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, HAS_DB: tl.constexpr, HAS_DQ_IN: tl.constexpr, HAS_DK_IN: tl.constexpr,
    KEYS_PER_BLOCK: tl.constexpr = False,
    PARTS: tl.constexpr = 7,  # which gradients this launch stores: bit 1 dq, 2 dk, 4 dv
):
    """One program per (chunk, batch*head): every chunk is independent here. The value columns are
    walked in blocks of BV (dQ and dK summed over them, dV stored per block).

    PARTS: the gradients this launch computes and stores (``ChunkConfig.grad_parts`` names the
    launches). The compiler drops the dots only the other gradients need, so a launch with fewer
    gradients holds fewer tiles live (fewer spilled registers) at the price of recomputing the
    tiles the launches share (R, dR).

    KEYS_PER_BLOCK: form the key tiles and A, A^T (``_chunk_key_tiles``) afresh in every value
    block instead of once before the loop. Kept across the loop, the compiler holds their
    shared-memory copies (dot operands) for the whole loop beside every value block's own, which
    for wide keys or fp32 tiles passes the multiprocessor's shared memory; formed per block, they
    live one block long (at the cost of two more [BT, BT] dots and the reloads per block).

    db: this launch's share of dL/db_s = q_s.dq_s - k_s.dk_s (module docstring, gate gradient):
    the shares of the launches are summed on the host. dq_in, dk_in (HAS_DQ_IN, HAS_DK_IN): another
    part's gradients, added to what is stored (a normalized call's denominator part adds into its
    numerator part's, ``ahla_bwd``); db stays this launch's own share."""
    i_c, i_bh = C0 + tl.program_id(0), tl.program_id(1)
    NT = tl.cdiv(T, BT)
    off_k, off_v, off_g = _head_offsets(i_bh, T, H, K, V)
    off_gc = sums_offset(i_bh, NT, BT)             # the head's gate sums (HAS_G)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mk = rk < K
    t = i_c * BT + rt
    mt = t < T
    # -- the chunk's key tiles, plain and transposed (strided loads), and its decay factors ------
    if not KEYS_PER_BLOCK:
        b_q, b_qgt, b_k, b_kg, b_kgt, b_a, b_at, G, GT, g1, gl = _chunk_key_tiles(
            q, k, gc, off_k, off_gc, log_gamma, i_c * BT, t, mt, rk, mk, H, K, BT, HAS_G, HAS_DECAY, IS_BF16, PREC)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    off_cs = (i_bh.to(tl.int64) * NT + i_c) * K * V
    off_d = (i_bh.to(tl.int64) * NP + i_c - C0) * K * V
    for i_v in range(0, tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        mv = rv < V
        if KEYS_PER_BLOCK:
            b_q, b_qgt, b_k, b_kg, b_kgt, b_a, b_at, G, GT, g1, gl = _chunk_key_tiles(
                q, k, gc, off_k, off_gc, log_gamma, i_c * BT, t, mt, rk, mk, H, K, BT, HAS_G, HAS_DECAY, IS_BF16, PREC)
        # -- this value block's tiles: inputs, snapshots, end-state gradients ----------------
        b_v = load_rows(v + off_v, t, mt, rv, mv, H * V, IS_BF16)
        b_vt = load_cols(v + off_v, t, mt, rv, mv, H * V, IS_BF16)
        b_do = load_rows(do + off_v, t, mt, rv, mv, H * V, IS_BF16)
        b_dot = load_cols(do + off_v, t, mt, rv, mv, H * V, IS_BF16)
        b_p0 = cast(load_mat(cs_p + off_cs, rk, mk, rv, mv, V), IS_BF16)           # [BK, BV]
        b_p0t = cast(load_mat_t(cs_p + off_cs, rv, mv, rk, mk, V), IS_BF16)        # [BV, BK]
        b_e0t = cast(load_mat_t(cs_e + off_cs, rv, mv, rk, mk, V), IS_BF16)        # [BV, BK]
        d_p = load_mat(dp_end + off_d, rk, mk, rv, mv, V)
        d_pt = load_mat_t(dp_end + off_d, rv, mv, rk, mk, V)
        d_e = load_mat(de_end + off_d, rk, mk, rv, mv, V)
        d_et = load_mat_t(de_end + off_d, rv, mv, rk, mk, V)
        p_dq, p_dk, b_dv = _chunk_value_block_grads(
            b_q, b_qgt, b_k, b_kg, b_kgt, b_a, b_at, G, GT, g1, gl, b_v, b_vt, b_do, b_dot,
            b_p0, b_p0t, b_e0t, d_p, d_pt, d_e, d_et, IS_BF16, PREC)
        # -- what this launch owns (the others' terms are dead code) --------------------------
        if PARTS & 1:
            b_dq += p_dq
        if PARTS & 2:
            b_dk += p_dk
        if PARTS & 4:
            tl.store(dv + off_v + t[:, None] * (H * V) + rv[None, :], b_dv.to(dv.dtype.element_ty),
                     mask=mt[:, None] & mv[None, :])
    # -- store dq, dk and this launch's share of db -------------------------------------------
    m_tk = mt[:, None] & mk[None, :]
    if HAS_DB:
        if KEYS_PER_BLOCK:
            b_q = load_rows(q + off_k, t, mt, rk, mk, H * K, IS_BF16)
            b_k = load_rows(k + off_k, t, mt, rk, mk, H * K, IS_BF16)
    b_db = tl.zeros([BT], dtype=tl.float32)
    p_k = off_k + t[:, None] * (H * K) + rk[None, :]
    if PARTS & 1:   # the stored sum; db below takes this launch's own dq
        tl.store(dq + p_k, plus_stored(b_dq, dq_in, p_k, m_tk, HAS_DQ_IN).to(dq.dtype.element_ty), mask=m_tk)
        if HAS_DB:
            b_db += tl.sum(b_q.to(tl.float32) * b_dq, axis=1)
    if PARTS & 2:
        tl.store(dk + p_k, plus_stored(b_dk, dk_in, p_k, m_tk, HAS_DK_IN).to(dk.dtype.element_ty), mask=m_tk)
        if HAS_DB:
            b_db -= tl.sum(b_k.to(tl.float32) * b_dk, axis=1)
    if HAS_DB:
        tl.store(db + off_g + t * H, b_db, mask=mt)


# ============================================================================ backward as two first-order layers
# AHLA is first-order attention applied twice (module docstring): R = LA(Q, K, V) with state P, then
# O = LA(Q, K, R) with state E. Its backward is then two first-order backwards, the outer layer's
# first: with the outer's state gradients dE (a walk over dO) the outer's per-chunk kernel gives
# dR = A^T dO + Kg dE and the outer's terms of dQ, dK; with the inner's dP (a walk over dR) the
# inner's per-chunk kernel gives dV and adds the inner's terms. Each walk carries one K x V state
# gradient, so it splits over key blocks as well as value blocks (four times the programs of the
# coupled walk at K = V = 128), and each per-chunk kernel holds one layer's tiles.


@triton.jit
def _chunk_dd(dd, off_g, t, T, H: tl.constexpr):
    """dd [BT] (fp32, 0 outside 0 <= t < T) at tokens t: the denominator's gradient, which the
    state-gradient walk reads a step ahead. As a vector load it is not one of the loads the
    compiler pipelines (those feed dots): read when its turn came, its latency was the walk's
    (hla_fast/README.md, "The configuration rule", the normalized layers;
    ``benchmarks/results/hla2_h100_ab_dd_ahead.json``)."""
    return tl.load(dd + off_g + t * H, mask=(t >= 0) & (t < T), other=0.0)


@triton.heuristics({
    "HAS_G": lambda a: a["gc"] is not None,
    "HAS_DHT": lambda a: a["dht"] is not None,
    "STORE_DH0": lambda a: a["dh0"] is not None,
    "NORM": lambda a: a["dd"] is not None,
    "HAS_DZT": lambda a: a["dzt"] is not None,
})
@triton.jit
def ahla_bwd_dh_kernel(
    q, dy, gc,               # q: [B, T, H, K]; dy: a layer's output gradient [B, T, H, V] (dO, dR); gc as in
                             #   ahla_fwd_kernel (at this BT) or None
    dh_end,                  # out: the gradient of each chunk's END state [B*H, NT, K, V] (the snapshots' dtype)
    dht,                     # gradient of the final state, fp32 [B*H, K, V]; or None (zero)
    dh0,                     # out: gradient of the initial state, fp32 [B*H, K, V]; or None
    dd, dz_end, dzt, dz0,    # a normalized layer (NORM): the denominator's gradient fp32 [B, T, H]; out: its
                             #   state's chunk-end gradients fp32 [B*H, NT, K]; the final one [B*H, K] or None;
                             #   out: the initial one [B*H, K] (with STORE_DH0). All None unless normalized
    log_gamma, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, NORM: tl.constexpr, HAS_DZT: tl.constexpr,
):
    """One program per (value block, key block, batch*head) walks the chunks from last to first
    carrying its [BK, BV] block of one layer's state gradient: the layer reads its state as
    Y = diag(g1) Q H0 + .., so  dH0 = gC dH + Q^T diag(g1) dY. Each chunk's end gradient is stored
    for the per-chunk kernel (``ahla_bwd_layer_kernel``).

    NORM: the layer is normalized, its denominator d = diag(g1) Q p0 + A 1 the same layer on a
    column of ones with state p; given dd = dL/dd, p's gradient walks as dp0 = gC dp + Q^T diag(g1) dd
    (a [BK] vector, carried by every value block's program and stored by the first's)."""
    i_v, i_kb, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NT = tl.cdiv(T, BT)
    off_k, off_v, off_g = _head_offsets(i_bh, T, H, K, V)
    rt = tl.arange(0, BT)
    rk = i_kb * BK + tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    base = i_bh.to(tl.int64) * K * V
    d_h = mat_or_zeros(dht, base, rk, mk, rv, mv, V, BK, BV, HAS_DHT)              # dH [BK, BV]
    if NORM:
        d_z = vec_or_zeros(dzt, i_bh.to(tl.int64) * K, rk, mk, BK, HAS_DZT)       # dp [BK]
        n_dd = _chunk_dd(dd, off_g, (NT - 1) * BT + rt, T, H)                      # the last chunk's dd
    off_gc = sums_offset(i_bh, NT, BT)                 # the head's chunk-local sums (HAS_G)
    n_beta, n_bL = first_walk_sums(gc, off_gc, (NT - 1) * BT, BT, HAS_G, False)
    for i_r in range(0, NT):
        i_c = NT - 1 - i_r
        t = i_c * BT + rt
        mt = t < T
        if NORM:   # dd of this chunk (read a step ago) and of the next one the walk visits, issued now
            b_dd = n_dd
            n_dd = _chunk_dd(dd, off_g, t - BT, T, H)
        store_mat(dh_end + (i_bh.to(tl.int64) * NT + i_c) * K * V, d_h, rk, mk, rv, mv, V)
        b_qt = load_cols(q + off_k, t, mt, rk, mk, H * K, IS_BF16)                # Q^T [BK, BT]
        b_dy = load_rows(dy + off_v, t, mt, rv, mv, H * V, IS_BF16)               # dY  [BT, BV]
        G, g1, g2, gl, gC, bL, n_beta, n_bL = walk_factors(
            gc, off_gc, n_beta, n_bL, i_c * BT, i_c * BT - BT, 0, NT * BT, log_gamma, mt, BT, HAS_G, HAS_DECAY,
            False)
        d_h = d_h * gC + dot(b_qt * g1[None, :], b_dy, IS_BF16, PREC)
        if NORM:
            if i_v == 0:
                tl.store(dz_end + (i_bh.to(tl.int64) * NT + i_c) * K + rk, d_z, mask=mk)
            d_z = d_z * gC + tl.sum(b_qt.to(tl.float32) * (g1 * b_dd)[None, :], axis=1)
    if STORE_DH0:
        store_mat(dh0 + base, d_h, rk, mk, rv, mv, V)
        if NORM:
            if i_v == 0:
                tl.store(dz0 + i_bh.to(tl.int64) * K + rk, d_z, mask=mk)


@triton.jit
def _store_layer_db(db, off_g, t, mt, b_q, b_dq, b_k, b_dk, H: tl.constexpr):
    """dL/db [BT] of a first-order layer's chunk rows from its gradients: each term carries
    exp(b_t - b_j), so q_t counts +1 and k_j -1: q.dq - k.dk, stored at the rows' gates."""
    b_db = tl.sum(b_q.to(tl.float32) * b_dq, axis=1) - tl.sum(b_k.to(tl.float32) * b_dk, axis=1)
    tl.store(db + off_g + t * H, b_db, mask=mt)


@triton.heuristics({
    "HAS_G": lambda a: a["gc"] is not None,
    "HAS_DQ_IN": lambda a: a["dq_in"] is not None,
    "HAS_DK_IN": lambda a: a["dk_in"] is not None,
    "HAS_DB": lambda a: a["db"] is not None,
    "NORM": lambda a: a["dd"] is not None,
})
@triton.jit
def ahla_bwd_layer_kernel(
    q, k, x, dy, gc,         # q, k: [B, T, H, K]; the layer's value x and output gradient dy [B, T, H, V]; gc as
                             #   in ahla_fwd_kernel (at this BT) or None
    h0, dh_end,              # the layer's chunk-start snapshots and chunk-end state gradients [B*H, NT, K, V]
    dd, z0, dz_end,          # a normalized layer (NORM): the denominator's gradient fp32 [B, T, H], its state's
                             #   chunk-start snapshots and chunk-end gradients fp32 [B*H, NT, K]; else None
    dx, dq, dk,              # out: dx [B, T, H, V] (x's dtype); dq, dk [B, T, H, K]
    dq_in, dk_in,            # the other layer's dq, dk to add (may be dq, dk themselves); each or None
    db,                      # out: dL/db_t = q_t.dq_t - k_t.dk_t (without the final state's share) fp32 [B, T, H]; or None
    log_gamma, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, IS_BF16: tl.constexpr, PREC: tl.constexpr,
    HAS_G: tl.constexpr, HAS_DQ_IN: tl.constexpr, HAS_DK_IN: tl.constexpr, HAS_DB: tl.constexpr,
    NORM: tl.constexpr,
    DB_OWN: tl.constexpr,    # db of this layer's dq, dk alone (hla3's stages have other factors), else
                             #   of the sums with dq_in, dk_in (AHLA's two layers share theirs)
    DX_TO_DK: tl.constexpr,  # the value is the key itself (HLA2's K' = LA(Q, K, K), V = K): dk gains dx
):
    """One program per (chunk, batch*head): one first-order layer's gradients of a chunk,
    Y = diag(g1) Q H0 + A X with A = (Q K^T) o G and the state's end H = gC H0 + Kg^T X:

        dX = A^T dY + Kg dH,   dM = (dY X^T) o G,
        dQ = diag(g1) dY H0^T + dM K,   dK = dM^T Q + diag(gl) X dH^T.

    dM, dY H0^T and X dH^T are sums over the value columns: the loop over value blocks sums
    them, and the two products with the key tiles follow once. NORM (a normalized layer, whose
    denominator is the layer on a column of ones with state p): that column's terms are added to the
    sums, dd 1^T to dM, dd p0^T to dY H0^T and 1 dp^T to X dH^T (no product: each is an outer
    product with a vector); the column itself has no gradient. dM^T comes from its own dot of
    loaded tiles (X dY^T o G^T), as A^T (K Q^T o G^T). With HAS_DQ_IN, HAS_DK_IN the other layer's dq_in,
    dk_in (stored in dq's dtype) are added before storing; the gate gradient db needs the sum,
    so it comes with the second layer (DB_OWN: db of this layer's share alone). With DX_TO_DK
    (x is k) the key's gradient through the value slot, dX, is read back once the loop has stored
    all its blocks (after a barrier: other threads of the program stored them) and added to dk."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    NT = tl.cdiv(T, BT)
    off_k, off_v, off_g = _head_offsets(i_bh, T, H, K, V)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mk = rk < K
    t = i_c * BT + rt
    mt = t < T
    # -- the chunk's key tiles and decay factors (those of the coupled kernel; this one uses Q, K,
    #    Kg, A^T and the factors, and the compiler drops the rest) --------------------------------
    b_q, b_qgt, b_k, b_kg, b_kgt, b_a, b_at, G, GT, g1, gl = _chunk_key_tiles(
        q, k, gc, off_k, sums_offset(i_bh, NT, BT), log_gamma, i_c * BT, t, mt, rk, mk, H, K, BT, HAS_G, HAS_DECAY,
        IS_BF16, PREC)
    # -- sums over the value blocks ----------------------------------------------------------
    b_dm = tl.zeros([BT, BT], dtype=tl.float32)                                   # dY X^T
    b_dmt = tl.zeros([BT, BT], dtype=tl.float32)                                  # X dY^T
    b_dqh = tl.zeros([BT, BK], dtype=tl.float32)                                  # dY H0^T
    b_dkh = tl.zeros([BT, BK], dtype=tl.float32)                                  # X dH^T
    off_s = (i_bh.to(tl.int64) * NT + i_c) * K * V
    for i_v in range(0, tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        mv = rv < V
        b_x = load_rows(x + off_v, t, mt, rv, mv, H * V, IS_BF16)                 # X    [BT, BV]
        b_xt = load_cols(x + off_v, t, mt, rv, mv, H * V, IS_BF16)                # X^T  [BV, BT]
        b_dy = load_rows(dy + off_v, t, mt, rv, mv, H * V, IS_BF16)               # dY   [BT, BV]
        b_dyt = load_cols(dy + off_v, t, mt, rv, mv, H * V, IS_BF16)              # dY^T [BV, BT]
        b_h0t = load_mat_t(h0 + off_s, rv, mv, rk, mk, V)                         # H0^T [BV, BK]
        d_h = load_mat(dh_end + off_s, rk, mk, rv, mv, V)                         # dH   [BK, BV]
        d_ht = load_mat_t(dh_end + off_s, rv, mv, rk, mk, V)                      # dH^T [BV, BK]
        # -- dX = A^T dY + Kg dH: this block's columns, stored now ---------------------------
        b_dx = dot(b_at, b_dy, IS_BF16, PREC) + dot(b_kg, d_h, IS_BF16, PREC)     # [BT, BV]
        tl.store(dx + off_v + t[:, None] * (H * V) + rv[None, :], b_dx.to(dx.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
        # -- this block's terms of the sums over value columns ------------------------------
        b_dm += dot(b_dy, b_xt, IS_BF16, PREC)
        b_dmt += dot(b_x, b_dyt, IS_BF16, PREC)
        b_dqh += dot(b_dy, b_h0t, IS_BF16, PREC)
        b_dkh += dot(b_x, d_ht, IS_BF16, PREC)
    if NORM:   # -- the column of ones: its output gradient dd, state p0 and end gradient dp ------------
        off_z = (i_bh.to(tl.int64) * NT + i_c) * K
        b_dd = tl.load(dd + off_g + t * H, mask=mt, other=0.0)                      # dd  [BT]
        b_one = tl.where(mt, 1.0, 0.0)                                              # the column [BT]
        b_dm += b_dd[:, None] * b_one[None, :]
        b_dmt += b_one[:, None] * b_dd[None, :]
        b_dqh += b_dd[:, None] * load_vec(z0 + off_z, rk, mk)[None, :]
        b_dkh += b_one[:, None] * load_vec(dz_end + off_z, rk, mk)[None, :]
    # -- dQ = diag(g1) dY H0^T + dM K,  dK = dM^T Q + diag(gl) X dH^T ----------------------------
    b_dm = tl.where(G > 0, b_dm * G, 0.0)
    b_dmt = tl.where(GT > 0, b_dmt * GT, 0.0)
    b_dq = b_dqh * g1[:, None] + dot(b_dm, b_k, IS_BF16, PREC)
    b_dk = b_dkh * gl[:, None] + dot(b_dmt, b_q, IS_BF16, PREC)
    p_k = off_k + t[:, None] * (H * K) + rk[None, :]
    m_tk = mt[:, None] & mk[None, :]
    if HAS_DB and DB_OWN:        # this layer's share, before the other layer's dq, dk are added
        _store_layer_db(db, off_g, t, mt, b_q, b_dq, b_k, b_dk, H)
    b_dq = plus_stored(b_dq, dq_in, p_k, m_tk, HAS_DQ_IN)
    b_dk = plus_stored(b_dk, dk_in, p_k, m_tk, HAS_DK_IN)
    if DX_TO_DK:                 # dX [BT, V = K], as stored above
        tl.debug_barrier()
        b_dk += tl.load(dx + p_k, mask=m_tk, other=0.0).to(tl.float32)
    tl.store(dq + p_k, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_k, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    if HAS_DB and not DB_OWN:    # the sums' (AHLA's two layers)
        _store_layer_db(db, off_g, t, mt, b_q, b_dq, b_k, b_dk, H)
