"""Chunked AHLA on the Triton kernels: the configuration rule, the launchers, the autograd Function.

Forward: one program per (value block, segment, head) walks its segment's chunks in order
(``ahla_fwd_kernel``). With more than one segment a first launch computes the summary of every
segment but the last from a zero state (``ahla_fwd_summary_kernel``; no start state follows the
last) and a small kernel folds them into each segment's start state (``ahla_fwd_fold_kernel``), so
that all segments then run at once.

Backward, coupled (the default but for bf16 training with key tiles of 128): the chunk-start
states (kept by the forward, or recomputed by a forward walk without outputs), a walk from the
last chunk to the first carrying only the state gradients
(``ahla_bwd_state_kernel``, segmented the same way with ``ahla_bwd_summary_kernel`` and
``ahla_bwd_fold_kernel``), then every chunk's dq, dk, dv in parallel (``ahla_bwd_grad_kernel``).
The gradient of the log-gates g follows from dq and dk (see ``chunk_kernels.py``) plus the final
state's share. Segments need keys of at most 128: a fold holds a K x K fp32 tile.

Backward, layered (``ChunkConfig.bwd_layers``, :func:`_bwd_layers`): AHLA is first-order attention
applied twice, so its backward is two first-order backwards, the outer layer's (on the first
order's output R, which the forward keeps beside the chunk-start states) before the inner's, each
a state-gradient walk (``ahla_bwd_dh_kernel``) and a per-chunk kernel (``ahla_bwd_layer_kernel``).
A walk carries one state's gradient, not two coupled ones, so it splits over key blocks too.

With ``config.fwd_prefetch`` / ``config.bwd_prefetch`` the forward's / backward's walks load each
next chunk's tiles while computing the current one (PREFETCH in ``chunk_kernels.py``).

Gates: every launcher first gets the log-gates' chunk-local sums at its chunk size, which its
kernels read (``common.cumsum``). Where a launcher's ``g`` is a tensor it writes them
(``chunk_sums``); the autograd Functions pass the call's ``GateSums`` instead, so a call computes the
sums of one chunk size once for its forward, its backward and any recompute (``sums_at``).

Normalization: the operator is linear in its values and the denominator is the operator applied
to a column of ones, so a normalized call runs the unnormalized walks twice, on the values
[1 | 0 ...] (ONES_ALIGN columns, the zeros keeping its rows 16-byte aligned: ``common.normalize``,
"Width") and on v. The forward walks the denominator first (outputs in fp32), then the values,
dividing as it stores them (``ahla_fwd_kernel``'s DEN_IN), and keeps both walks' states for
training. The backward differentiates the values' walk from do / (den + eps) and the denominator's
from dd = -(do . o) / (den + eps) (HLA2's one-pass kernel forms both,
``common.normalize.normalized_output_grad``), each from its kept states, and sums their dq, dk in
fp32. (Before, one forward walk carried the denominator's state (p, e) beside (P, E), and one
backward ran on [v | 1], V + 1 columns whose rows the compiler could not align; hla_fast/README.md,
AHLA's "What the kernels do".)

The autograd Function's passes call the plain functions :func:`ahla_fwd` and :func:`ahla_bwd`,
whose arguments are tensors (or None) and numbers only.

Launches go through each launcher's ``launch`` argument (``common.compile.launch_kernel``); the entry
point first has ``common.compile.compile_ahead`` rehearse a new call with a recorder there and compile
its kernels at once.
"""
from __future__ import annotations

import functools

import torch

from ..common.compile import compile_ahead, launch_kernel
from ..common.autograd import autograd_records, kernel_backward
from ..common.config import DEFAULT_CHUNK, ChunkConfig, refuse_layers, refuse_split_forward
from ..common.cumsum import GateSums, sums_at
from ..common.denominator import carried_denominator, carried_denominator_grad
from ..common.gates import log_gamma, log_gate_grad, summed_shares
from ..common.normalize import ONES_ALIGN, normalized_output_grad, with_column
from ..common.launch import (
    backward_pieces, bf16_dots, cdiv, dot_precision, fp32_tiles, min_key_block, min_value_block, one_wave_segments,
    pow2_block, rule_pieces, run_pieces, snapshot_dtype, split_segments, tile_chunk, value_block,
)
from .chunk_kernels import (
    ahla_bwd_dh_kernel, ahla_bwd_fold_kernel, ahla_bwd_grad_kernel, ahla_bwd_layer_kernel, ahla_bwd_state_kernel,
    ahla_bwd_summary_kernel, ahla_fwd_fold_kernel, ahla_fwd_kernel, ahla_fwd_summary_kernel,
)

# widest value block of one backward program: the per-chunk gradient kernel holds a dozen
# [BT, BV] and [BV, BK] tiles per value block, so it walks the values in blocks of this width
BWD_BLOCK_V = 64
# widest key tile whose bf16 per-chunk gradient kernel keeps the key tiles across its value blocks
GRAD_SHARED_KEYS_MAX_K = 128
# widest key tile the segment summaries and folds take (they hold a K x K fp32 tile)
SEGMENT_MAX_K = 128
# fewest chunks a segment walks when segments are picked by occupancy
MIN_SEGMENT_CHUNKS = 4
# the layered backward's state-gradient walks (``ahla_bwd_dh_kernel``): key blocks of at most this
# width, in DH_WARPS warps, loads pipelined DH_STAGES deep (the walk's loads do not depend on the
# state it carries). At K = V = 128, T = 32k, bf16 the fastest walk measured: faster than 8 warps
# without pipelining and than key blocks of 32 or 128 (benchmarks/results/ahla_h200_layers_kernels.md).
# At K = V = 64 (HLA3's first stage) key blocks of 32 were slightly faster, too little to take, and
# key blocks of 128 slower (ahla_h200_layers_kernels_k64.md)
DH_BLOCK_K = 64
DH_WARPS = 4
DH_STAGES = 3
# the layered backward's per-chunk kernel (``ahla_bwd_layer_kernel``) pipelines the loads of its
# two value blocks: faster than one stage in 8 warps (the same record); at K = V = 64 one value
# block of 64 in 4 warps (the rule's bwd_warps there) took the same time with one stage or two, and was
# faster than 8 warps or value blocks of 32 (ahla_h200_layers_kernels_k64.md)
LAYER_STAGES = 2
# the forward walks of chunks of at least this many rows apply the state update's decay to the rows
# of V and R instead of the columns of K^T (``_chunk_carry``'s SCALE_ROWS). K = V = 128, T = 32k,
# bf16, the walk kernel alone: chunks of 128 in 8 warps are faster with rows, with two stages or
# one; chunks of 64 are slower with rows, in 4 warps and in 8 (benchmarks/results/ahla_h200_chunk128.md)
SCALE_ROWS_MIN_CHUNK = 128


@functools.lru_cache(maxsize=4096)
def ahla_config(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device,
                chunk_size: int | None = None, training: bool = False) -> ChunkConfig:
    """The default layout for one call; ``training``: the forward will be differentiated (its
    layout then serves the backward too); ``chunk_size``: None (the call's default) or the rows
    per chunk asked for. From HLA2's measured layouts (hla_fast/README.md, "The
    configuration rule"), and for keys of 65 to 128 from AHLA's own layout sweep
    (benchmarks/results/ahla_h200_variants.md, bf16, T = 32k):

    * chunks of ``chunk_size`` forward (at most 32 for keys wider than 128: a [K, 64] tile of P
      and of E stays in registers; at most FP32_MAX_CHUNK for fp32 and fp16 inputs, whose tiles
      are fp32: the segment summary of fp32 chunks of 128 asked an H200 for more shared memory
      than Hopper's 227 KB); backward chunks of at most 64 rows, at most 32 for heads wider
      than 64 and 16 for keys wider than 128 (the coupled per-chunk gradient kernel holds many
      [BT, BT] and [BT, K] tiles), but 64 for the layered backward below;
    * keys of 65 to 128, training, coupled backward: the forward takes the backward's chunk of 32 and keeps its
      chunk-start states, instead of a forward of 64 whose states the backward recomputes at 32
      (faster forward + backward at K = V = 128);
    * forward value blocks of 64 columns (the backward's are BWD_BLOCK_V);
    * a bf16 forward that autograd does not record, with key tiles of 128 and ``chunk_size`` None,
      runs in chunks of 128, the layout below (64 rows otherwise, DEFAULT_CHUNK), timed against
      flash-linear-attention's forward at K = V = 128, T = 32k in ``ahla_h200_default_chunks.md``;
    * a bf16 forward of chunks of 128 (``chunk_size=128``) with key tiles of 128 runs in 8 warps
      without loading ahead: faster than the default chunks of 64 in 4 warps (K = V = 128,
      T = 32k, ``ahla_h200_fwd_chunks.md``; in 4 warps, or loading ahead, an sm_90 compile spills
      several times as many registers a thread: ``compile_ahla_bf16_k128_fwd_chunk128_{w4,w8_prefetch,w8}_cpu.md``,
      compiled before the walk scaled rows), with its loads pipelined two stages deep
      (``fwd_stages=2``) and the decay on the rows of V and R (SCALE_ROWS_MIN_CHUNK): faster than
      one stage, timed against fla's first-order forward in the same run (``ahla_h200_chunk128_calls.md``;
      two stages fit Hopper's 227 KB of shared memory and spill a little by an sm_90 compile,
      ``compile_ahla_bf16_k128_fwd_chunk128_w8_stages2_cpu.md``; three stages do not fit);
    * 4 warps for key tiles up to 64 wide, 8 above; but a bf16 inference forward (chunks of 64)
      at key tiles of 128 takes 4 (faster at K = V = 128);
    * the per-chunk gradients in one launch (two or three launches, ``grad_parts``, spill fewer
      registers by ``ptxas -v`` but were slower forward + backward at both sizes, K = V = 64 and
      128); but fp32 inputs with keys up to 128 wide take one launch per gradient, as HLA2's fp32
      calls do: the one launch of tf32x3 products was by far a first training call's slowest
      compile (a call's kernels compile in parallel), and the three ran faster too
      (``compile_ahla_fp32_k64{,_one_launch}_cpu.md``, ``ahla_h100_ab_fp32_grad_parts.json``; the
      first calls before and after in ``hla2_h100_first_call_{ahla_fp32_one_launch,ops_fp32}.md``);
      with 256-wide key tiles one of the three launches would take more shared memory than
      Hopper's 227 KB, so those keep one. fp16 inputs take fp32's launches (``fp32_tiles``: the
      same fp32 tiles and tf32x3 products; the one launch compiled as slowly for them,
      ``compile_ahla_fp16_k64{,_one_launch}_cpu.md``);
    * segments: as many as keep every program in one wave (two programs a multiprocessor for key
      tiles up to 64 wide, one for 128), at least MIN_SEGMENT_CHUNKS chunks each; one for keys
      wider than SEGMENT_MAX_K;
    * the forward keeps its chunk-start states for the backward when both use one chunk size;
    * training heads wider than 64 whose backward walk is one segment walk it in pieces, HLA2's rule
      (``common.launch.rule_pieces``): the chunk-end state gradients for a quarter of the sequence
      at a time (``ahla_h200_ab_pieces.json``);
    * bf16 training with key tiles of 128: the backward as two first-order layers
      (``bwd_layers``; ``ahla_h200.md``'s layouts, T = 32k), in chunks of 64 for both passes, the
      forward in 4 warps without loading ahead, the backward in 8: faster forward + backward at
      K = V = 128 than the coupled backward in its layout (chunks of 32, an 8-warp forward), and
      than the layers in chunks of 32, with an 8-warp forward or with a 4-warp backward. At
      K = V = 64 the coupled backward in segments stays (faster than the layers there);
    * bf16 walks load each next chunk's tiles ahead (``fwd_prefetch``, ``bwd_prefetch``;
      ``ahla_h200_prefetch.md``, T = 32k), where that was faster: the forward's at K = V = 64 and
      in 8 warps, the backward's in 8 warps (forward + backward at K = V = 128); not the 4-warp
      backward walks of K = V = 64 nor the 4-warp forward of key tiles of 128, whose prefetched
      tiles multiply its register spills (both slower loading ahead). fp32 and fp16 tiles take
      twice the registers; they were not measured.
    Off CUDA (the interpreter) every walk is one segment. The result is immutable, so it is cached
    per shape.

    Shared memory (227 KB a multiprocessor on Hopper) bounds the per-chunk gradient kernel: with
    more than one value block it forms its key tiles and A, A^T in every block
    (:func:`grad_keys_per_block`), except for bf16 key tiles up to GRAD_SHARED_KEYS_MAX_K wide,
    which fit when kept across the blocks (and are faster so); fp16 inputs take fp32's dot
    precision (``dot_precision``: single tf32 products of fp32 tiles stage both operands of every
    dot in shared memory, past Hopper's 227 KB at every key width)."""
    wide = max(K, V) > 64
    BK = pow2_block(K, min_key_block(device))
    bf16 = bf16_dots(dtype)
    layers = training and bf16 and 64 < BK <= GRAD_SHARED_KEYS_MAX_K
    if chunk_size is None:
        chunk_size = 128 if bf16 and not training and 64 < BK <= 128 else DEFAULT_CHUNK
    bwd_chunk = min(chunk_size, 16 if K > 128 else (32 if wide and not layers else 64))
    if K > 128:
        fwd_chunk = min(chunk_size, 32)
    elif training and BK > 64:
        fwd_chunk = bwd_chunk
    else:
        fwd_chunk = tile_chunk(chunk_size, dtype)
    block_v = min(64, pow2_block(V, min_value_block(device)))
    bwd_warps = 4 if BK <= 64 else 8
    wide_long = bf16 and BK > 64 and fwd_chunk >= 128   # a forward of chunks of 128 with wide keys: 8 warps
    fwd_warps = 4 if BK <= 64 or (BK <= 128 and (layers or not training) and bf16 and not wide_long) else 8
    fwd_seg = bwd_seg = 1
    if K <= SEGMENT_MAX_K:
        # key tiles of 128 count one program a multiprocessor whatever the warps: the 4-warp forward
        # in two segments was slower than in one (a summary holds a 128 x 128 fp32 tile; ahla_h200_variants.md)
        per_sm = 2 if BK <= 64 else 1
        fwd_seg = one_wave_segments(cdiv(V, block_v) * B * H, cdiv(T, fwd_chunk), device, per_sm, MIN_SEGMENT_CHUNKS)
        if not layers:   # the layered backward walks each layer whole
            bwd_bv = bwd_blocks(K, V, device)[1]
            bwd_seg = one_wave_segments(cdiv(V, bwd_bv) * B * H, cdiv(T, bwd_chunk), device, per_sm,
                                        MIN_SEGMENT_CHUNKS)
    return ChunkConfig(fwd_chunk=fwd_chunk, bwd_chunk=bwd_chunk, fwd_segments=fwd_seg, bwd_segments=bwd_seg,
                       fwd_warps=fwd_warps, bwd_warps=bwd_warps, fwd_block_v=block_v,
                       grad_parts=(1, 2, 4) if fp32_tiles(dtype) and BK <= 128 else (7,),
                       save_states=fwd_chunk == bwd_chunk, bf16_snapshots=True,
                       bwd_pieces=1 if layers else rule_pieces(wide and training, bwd_seg, cdiv(T, bwd_chunk)),
                       fwd_stages=2 if wide_long else 1,
                       fwd_prefetch=bf16 and (BK <= 64 or fwd_warps == 8) and not wide_long,
                       bwd_prefetch=bf16 and BK > 64 and not layers,
                       bwd_layers=layers)


def bwd_blocks(K: int, V: int, device: torch.device):
    """(BK, BV): the backward's key tile and value block for K keys and V value columns (V + 1
    when normalizing)."""
    mvb = min_value_block(device)
    return pow2_block(K, min_key_block(device)), min(pow2_block(V, mvb), max(BWD_BLOCK_V, mvb))


def grad_keys_per_block(n_value_blocks: int, BK: int, dtype: torch.dtype) -> bool:
    """Whether ``ahla_bwd_grad_kernel`` forms its key tiles and A, A^T afresh in every value block
    (KEYS_PER_BLOCK). Kept across more than one block, the compiler holds their shared-memory
    copies beside every block's own: past Hopper's 227 KB for fp32 tiles (fp32 and fp16 inputs,
    keys of 64 to 256) and for 256-wide bf16 key tiles. bf16 key tiles up to
    GRAD_SHARED_KEYS_MAX_K wide fit when kept and save two [BT, BT] dots
    and the key reloads per block, so they stay."""
    return n_value_blocks > 1 and (not bf16_dots(dtype) or BK > GRAD_SHARED_KEYS_MAX_K)


def _check_config(cfg: ChunkConfig, K: int):
    """Refuse a layout the kernels cannot run: segments for keys wider than SEGMENT_MAX_K; the
    layered backward (``bwd_layers``) with backward segments, pieces or loading ahead, which are
    the coupled walk's; the split forward of HLA2 (``refuse_split_forward``)."""
    refuse_split_forward(cfg, "ahla")
    refuse_layers(cfg, "ahla")
    if K > SEGMENT_MAX_K and (cfg.fwd_segments != 1 or cfg.bwd_segments != 1):
        raise ValueError(f"ahla runs keys wider than {SEGMENT_MAX_K} (K={K}) in one segment: config.fwd_segments "
                         f"and config.bwd_segments must be 1, got {cfg.fwd_segments} and {cfg.bwd_segments}")
    if cfg.bwd_layers and (cfg.bwd_segments != 1 or cfg.bwd_pieces != 1 or cfg.bwd_prefetch or cfg.bwd_stages != 1):
        raise ValueError(f"ahla's layered backward (config.bwd_layers) walks each layer whole with its own pipelining: "
                         f"config.bwd_segments, config.bwd_pieces and config.bwd_stages must be 1 and "
                         f"config.bwd_prefetch False, got {cfg.bwd_segments}, {cfg.bwd_pieces}, {cfg.bwd_stages} and "
                         f"{cfg.bwd_prefetch}")


def _dstate_dtype(snap: torch.dtype, BK: int) -> torch.dtype:
    """dtype of the chunk-end state gradients the backward walk stores for the per-chunk kernel:
    the snapshots' (``snap``), as HLA2 does, since that kernel reads them only as dot operands
    (the same bf16 rounding, half the bytes written and read), but fp32 for key tiles wider than
    GRAD_SHARED_KEYS_MAX_K: with bf16 ones the compiler stages them in shared memory, past
    Hopper's 227 KB at K = 256 (the sm_90 compile in tests/fast/test_ahla_kernels.py)."""
    return snap if BK <= GRAD_SHARED_KEYS_MAX_K else torch.float32


def _common(q, gamma, g):
    """Constexprs and scalars every launch shares."""
    return dict(HAS_DECAY=g is not None or gamma is not None, IS_BF16=bf16_dots(q.dtype),
                PREC=dot_precision(q.dtype)), log_gamma(gamma) if g is None else 0.0


def forward_layout(cfg: ChunkConfig) -> dict:
    """:func:`fwd_launch`'s layout keywords for the forward walks of ``cfg``: chunk, warps, block_v,
    segments, prefetch and stages."""
    return dict(chunk=cfg.fwd_chunk, warps=cfg.fwd_warps, block_v=cfg.fwd_block_v, segments=cfg.fwd_segments,
                prefetch=cfg.fwd_prefetch, stages=cfg.fwd_stages)


def fwd_launch(q, k, v, g, gamma, p0, e0, pn0, *, chunk, warps, block_v, segments=1, prefetch=False,
               stages=1, outputs=True, normalize=False, eps=0.0, store_final=True, snapshots=None, keep_r=False,
               second=True, v2=None, p20=None, qp=None, den_in=None, out_dtype=None, launch=launch_kernel):
    """Run the forward walk (after the segment summaries and fold when ``segments > 1``).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H], its GateSums or None; all contiguous. p0, e0: fp32
    [B, H, K, V] or None; pn0: fp32 [B, H, K] or None (zeros when normalizing from a state without
    it). outputs: compute o (else only states). normalize (with second=False): carry p and divide
    by (den + eps); AHLA's normalized operator is two unnormalized walks instead (:func:`ahla_fwd`).
    snapshots: None, or the dtype to store every chunk-start state (P, E) in.
    prefetch: the walks load each next chunk's tiles ahead (``ChunkConfig.fwd_prefetch``).
    stages: the compiler pipelines the walks' loads this deep (``ChunkConfig.fwd_stages``).
    keep_r: with snapshots, also keep the first order's output R [B, T, H, V] (``kept_r_dtype``) for
    the layered backward. second=False: the first layer alone (:func:`layer_fwd`): o is R, and E, its
    snapshots and the summaries' R moment are neither computed nor returned (None); normalized, R is
    divided by its own denominator (den) and the snapshots (with ``snapshots``) include p's
    (:func:`normalized_layer_fwd`).
    v2 (with second=False): a second value tensor [B, T, H, V2] walked beside v with the same q, k
    (``ahla_fwd_kernel``'s HAS_V2: R2 = LA(q, k, v2) from p20, fp32 [B, H, K, V2] or None); its
    programs hold all of V's columns, whatever ``block_v``.
    qp (with second=False, unnormalized): q_t . p_c fp32 [B, T, H], the denominator's state at the
    start of t's chunk (``common.denominator``): R is normalized as with ``normalize``, its
    denominator formed from qp instead of a carried p, and returned in den; p_T and its snapshots are
    not (``ahla_fwd_kernel``'s DIVIDE; :func:`normalized_layer_fwd`).
    den_in (with second=True, unnormalized): the denominator fp32 [B, T, H] from a walk of its own;
    o is divided by (den_in + eps) (``ahla_fwd_kernel``'s DEN_IN; :func:`ahla_fwd`). out_dtype: o's
    dtype (None: v's).
    Returns (o [B, T, H, V] or None, den [B, T, H] fp32 or None, P_T, E_T, p_T or None,
    (cs_p, cs_e, R or None, cs_pn or None) or None, (R2, P2_T or None, cs_p2 or None) or None;
    cs_p, cs_e [B*H, NT, K, V], cs_pn fp32 [B*H, NT, K] (a normalized first layer's))."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BH, dev, f32 = B * H, q.device, torch.float32
    BK = pow2_block(K, min_key_block(dev))
    if normalize and second:
        raise ValueError("normalize=True is for the first layer alone (second=False): AHLA's normalized "
                         "operator is two unnormalized walks (ahla_fwd)")
    if v2 is not None and normalize:
        raise ValueError("a second value tensor (v2) is not normalized")
    if v2 is not None and second:
        raise ValueError("a second value tensor (v2) is for the first layer alone (second=False)")
    if qp is not None and (second or normalize or v2 is not None):
        raise ValueError("a carried denominator (qp) is for an unnormalized first layer alone (second=False)")
    if den_in is not None and (not second or normalize or not outputs):
        raise ValueError("a denominator to divide by (den_in) is for the unnormalized outputs of both layers (second=True)")
    V2 = 0 if v2 is None else v2.shape[-1]
    BV = value_block(V, block_v if v2 is None else pow2_block(V), dev)
    BV2 = value_block(V2, pow2_block(V2), dev) if V2 else 16   # (16: an unused placeholder tile)
    NV, NT = cdiv(V, BV), cdiv(T, chunk)
    NS, nseg = split_segments(NT, segments)
    flags, lg = _common(q, gamma, g)
    kw = dict(H=H, K=K, V=V, BT=chunk, BK=BK, BV=BV, num_warps=warps, num_stages=stages, **flags)
    # walks whose loads the compiler does not pipeline read each next chunk's gate sums a step ahead
    walk = dict(kw, PREFETCH=prefetch, SCALE_ROWS=chunk >= SCALE_ROWS_MIN_CHUNK, V2=V2, BV2=BV2, SUMS_AHEAD=stages == 1)
    if normalize and p0 is not None:
        pn0 = torch.zeros(B, H, K, device=dev, dtype=f32) if pn0 is None else pn0
    elif not normalize:
        pn0 = None
    if v2 is not None and (p0 is None) != (p20 is None):   # both states or neither (HAS_INIT is both's)
        p0 = torch.zeros(B, H, K, V, device=dev, dtype=f32) if p0 is None else p0
        p20 = torch.zeros(B, H, K, V2, device=dev, dtype=f32) if p20 is None else p20
    h0, h02 = (p0, e0, pn0), p20
    gc = sums_at(g, chunk, launch)   # the walks read beta (common.cumsum)
    if nseg > 1:
        # -- the summaries from a zero state of every segment but the last (no start state follows
        #    it), then every segment's start state ---------------------------------------------------
        def kv(width=V, n=nseg):
            return torch.empty(BH * n, K, width, device=dev, dtype=f32)

        def kvec(n=nseg):
            return torch.empty(BH * n, K, device=dev, dtype=f32) if normalize else None

        ns = nseg - 1
        sums = dict(sum_p=kv(n=ns), sum_e=kv(n=ns) if second else None, sum_pn=kvec(ns),
                    sum_r=kv(K, ns) if second else None,
                    sum_lr=torch.empty(BH * ns, device=dev, dtype=f32))
        sum_p2 = kv(V2, ns) if V2 else None
        launch(ahla_fwd_summary_kernel, (NV, ns, BH), q=q, k=k, v=v, gc=gc, v2=v2, sum_p2=sum_p2, **sums,
               log_gamma=lg, T=T, NS=NS, **walk)
        seg = (kv(), kv() if second else None, kvec())
        fold = dict(NSEG=nseg, K=K, BK=BK, PREC=flags["PREC"], num_warps=warps)
        launch(ahla_fwd_fold_kernel, (NV, BH),
            **sums, h0_p=p0, h0_e=e0, h0_pn=pn0, seg_p=seg[0], seg_e=seg[1], seg_pn=seg[2], V=V, BV=BV, **fold)
        h0 = seg
        if V2:   # P2 folds as P does, on the same log decays
            h02 = kv(V2)
            launch(ahla_fwd_fold_kernel, (1, BH), sum_p=sum_p2, sum_e=None, sum_pn=None, sum_r=None,
                   sum_lr=sums["sum_lr"], h0_p=p20, h0_e=None, h0_pn=None, seg_p=h02, seg_e=None, seg_pn=None,
                   V=V2, BV=BV2, **fold)
    o = torch.empty_like(v, dtype=out_dtype) if (outputs and second) else None
    den = torch.empty(B, T, H, device=dev, dtype=f32) if (normalize or qp is not None) else None
    ht = (None,) * 3
    if store_final:
        ht = (torch.empty(B, H, K, V, device=dev, dtype=f32),
              torch.empty(B, H, K, V, device=dev, dtype=f32) if second else None,
              torch.empty(B, H, K, device=dev, dtype=f32) if normalize else None)
    cs = None
    if snapshots is not None:
        cs = (torch.empty(BH, NT, K, V, device=dev, dtype=snapshots),
              torch.empty(BH, NT, K, V, device=dev, dtype=snapshots) if second else None,
              torch.empty_like(v, dtype=kept_r_dtype(v.dtype)) if (keep_r and second) else None,
              torch.empty(BH, NT, K, device=dev, dtype=f32) if normalize else None)
    r = None if cs is None else cs[2]
    if not second:   # the first layer's output R is what this call returns
        r = torch.empty_like(v)
    out2 = (None,) * 3
    if v2 is not None:   # R2, P2_T and P2's snapshots
        out2 = (torch.empty_like(v2), torch.empty(B, H, K, V2, device=dev, dtype=f32) if store_final else None,
                None if cs is None else torch.empty(BH, NT, K, V2, device=dev, dtype=snapshots))
    launch(ahla_fwd_kernel, (NV, nseg, BH),
        q=q, k=k, v=v, gc=gc, o=o, den=den, qp=qp, den_in=den_in, h0_p=h0[0], h0_e=h0[1], h0_pn=h0[2],
        ht_p=ht[0], ht_e=ht[1], ht_pn=ht[2],
        cs_p=None if cs is None else cs[0], cs_e=None if cs is None else cs[1], cs_pn=None if cs is None else cs[3],
        r=r,
        v2=v2, r2=out2[0], h0_p2=h02, ht_p2=out2[1], cs_p2=out2[2],
        log_gamma=lg, eps=eps, T=T, NS=NS, **walk)
    return o if second else r, den, ht[0], ht[1], ht[2], cs, (out2 if v2 is not None else None)


def kept_r_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the first-order output R that a forward keeps for the layered backward
    (``ChunkConfig.bwd_layers``), for inputs of ``dtype``: fp32 where the kernels' tiles are
    (``fp32_tiles``: fp16 and fp32 inputs), so that the backward reads R as the coupled backward
    forms it, else the inputs' (bf16, which the dots round R to anyway). Kept in fp16, R put a
    normalized fp16 call's dq 1.06e-3 off float64 against the coupled backward's 9.0e-4
    (``test_fp16_normalized_gradients_at_large_denominators``); its gradient dR, stored in R's
    dtype, follows it."""
    return torch.float32 if fp32_tiles(dtype) else dtype


def bwd_launch(q, k, v, do, g, gamma, p0, e0, dht_p, dht_e, cfg: ChunkConfig, *, states=None, want_db=False,
               grad_dtype=None, dq_in=None, dk_in=None, launch=launch_kernel):
    """Gradients of the unnormalized operator.

    q, k: [B, T, H, K]; v, do: [B, T, H, V]; g: [B, T, H], its GateSums or None; p0, e0: fp32 initial state
    [B, H, K, V] or None; dht_p, dht_e: gradient of the final state (fp32 [B, H, K, V]) or None.
    states: what a forward with chunk ``cfg.bwd_chunk`` kept, (cs_p, cs_e, R or None) (R with
    ``cfg.bwd_layers``), or None to recompute them. want_db: also return dL/db [B, T, H] fp32
    (without the final state's share). grad_dtype: dq's and dk's dtype (None: the inputs').
    dq_in, dk_in: gradients of another part of the call (grad_dtype), to which this one's dq, dk
    are added in place (they are the dq, dk returned); want_db then gives the sums' dL/db with
    ``cfg.bwd_layers`` (:func:`_bwd_layers`), this part's own otherwise (``ahla_bwd_grad_kernel``).
    Returns dq, dk (grad_dtype), dv (v's dtype), dP0, dE0 (fp32, None without p0), db (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BH, dev, f32 = B * H, q.device, torch.float32
    BT, nw = cfg.bwd_chunk, cfg.bwd_warps
    BK, BV = bwd_blocks(K, V, dev)
    NT, NV = cdiv(T, BT), cdiv(V, BV)
    snap = snapshot_dtype(cfg, q.dtype)
    if states is None or states[0].dtype != snap or (cfg.bwd_layers and states[2] is None):
        # the forward walk again, in the backward's chunks and warps (its states serve this backward)
        layout = dict(forward_layout(cfg), chunk=BT, warps=nw, stages=cfg.bwd_stages)
        states = fwd_launch(q, k, v, g, gamma, p0, e0, None, outputs=False, store_final=False, snapshots=snap,
                            keep_r=cfg.bwd_layers, launch=launch, **layout)[5]
    do = do.contiguous()
    if cfg.bwd_layers:
        return _bwd_layers(q, k, v, do, g, gamma, p0, dht_p, dht_e, cfg, states, want_db, grad_dtype, launch,
                           dq_in, dk_in)
    cs_p, cs_e = states[:2]
    flags, lg = _common(q, gamma, g)
    common = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, num_warps=nw, num_stages=cfg.bwd_stages, **flags)
    gc = sums_at(g, BT, launch)   # every kernel below reads beta
    has_dht = dht_p is not None or dht_e is not None
    if has_dht:
        dht_p = torch.zeros(B, H, K, V, device=dev, dtype=f32) if dht_p is None else dht_p.float().contiguous()
        dht_e = torch.zeros(B, H, K, V, device=dev, dtype=f32) if dht_e is None else dht_e.float().contiguous()
    dh0 = ((torch.empty(B, H, K, V, device=dev, dtype=f32), torch.empty(B, H, K, V, device=dev, dtype=f32))
           if p0 is not None else (None, None))
    NS, nseg = split_segments(NT, cfg.bwd_segments)
    de = (dht_p, dht_e) if has_dht else (None, None)
    if nseg > 1:
        # -- backward summaries from a zero end gradient of every segment but the first (no end
        #    gradient precedes it), folded last to first ---------------------------------------------
        ns = nseg - 1
        sums = dict(sum_dp=torch.empty(BH * ns, K, V, device=dev, dtype=f32),
                    sum_de=torch.empty(BH * ns, K, V, device=dev, dtype=f32),
                    sum_rt=torch.empty(BH * ns, K, K, device=dev, dtype=f32),
                    sum_lr=torch.empty(BH * ns, device=dev, dtype=f32))
        launch(ahla_bwd_summary_kernel, (NV, ns, BH), q=q, k=k, do=do, gc=gc, **sums, log_gamma=lg, T=T, NS=NS,
               PREFETCH=cfg.bwd_prefetch, **common)
        de = (torch.empty(BH * nseg, K, V, device=dev, dtype=f32), torch.empty(BH * nseg, K, V, device=dev, dtype=f32))
        launch(ahla_bwd_fold_kernel, (NV, BH),
            **sums, dht_p=dht_p if has_dht else None, dht_e=dht_e if has_dht else None, de_p=de[0], de_e=de[1],
            NSEG=nseg, K=K, V=V, BK=BK, BV=BV, PREC=flags["PREC"], num_warps=nw)
    # -- the walk (every chunk's end-state gradient), then every chunk's gradients in the launches
    #    the config names; in pieces, the last first, as HLA2's backward (common.launch.run_pieces)
    starts, NP = backward_pieces(NT, cfg.bwd_pieces)   # one piece when segmented (ChunkConfig)
    dst = _dstate_dtype(snap, BK)
    dp_end = torch.empty(BH, NP, K, V, device=dev, dtype=dst)
    de_end = torch.empty(BH, NP, K, V, device=dev, dtype=dst)
    dq = torch.empty_like(q, dtype=grad_dtype) if dq_in is None else dq_in
    dk = torch.empty_like(k, dtype=grad_dtype) if dk_in is None else dk_in
    dv = torch.empty_like(v)
    db = torch.empty(len(cfg.grad_parts), B, T, H, device=dev, dtype=f32) if want_db else None

    def pair(zero):
        new = torch.zeros if zero else torch.empty
        return new(BH, K, V, device=dev, dtype=f32), new(BH, K, V, device=dev, dtype=f32)

    def step(c0, n, end_grad, start_grad):
        launch(ahla_bwd_state_kernel, (NV, nseg, BH),
            q=q, k=k, do=do, gc=gc, dp_end=dp_end, de_end=de_end, de_p=end_grad[0], de_e=end_grad[1],
            dh0_p=start_grad[0], dh0_e=start_grad[1], log_gamma=lg, T=T, NS=NS, C0=c0, NP=NP,
            PREFETCH=cfg.bwd_prefetch, **common)
        for i, parts in enumerate(cfg.grad_parts):
            launch(ahla_bwd_grad_kernel, (n, BH),
                q=q, k=k, v=v, do=do, gc=gc, dq=dq, dk=dk, dv=dv, dq_in=dq_in, dk_in=dk_in,
                db=None if db is None else db[i], cs_p=cs_p,
                cs_e=cs_e, dp_end=dp_end, de_end=de_end, log_gamma=lg, T=T, C0=c0, NP=NP, PARTS=parts,
                KEYS_PER_BLOCK=grad_keys_per_block(NV, BK, q.dtype), **common)

    run_pieces(starts, NP, NT, de, dh0, pair, step)
    return dq, dk, dv, dh0[0], dh0[1], summed_shares(db)


def _bwd_layers(q, k, v, do, g, gamma, p0, dht_p, dht_e, cfg: ChunkConfig, states, want_db, grad_dtype, launch,
                dq_in=None, dk_in=None):
    """``bwd_launch`` as two first-order backwards (``ChunkConfig.bwd_layers``; the kernels'
    module docstring): the outer layer O = LA(Q, K, R) with state E, then the inner R = LA(Q, K, V)
    with state P (:func:`layer_bwd` each). The outer's gives dR, the inner's output gradient; its
    dq, dk wait in dq, dk (in their dtype) for the inner's to be added, and db comes with the sums
    (dL/db is linear in dq and dk, ``ahla_bwd_layer_kernel``'s DB_OWN). Given dq_in, dk_in the
    outer's are added to those in place, so that dq, dk, db are the sums with them too.
    states: (cs_p, cs_e, R) at chunk ``cfg.bwd_chunk``. Returns as ``bwd_launch``."""
    cs_p, cs_e, r = states[:3]
    dr, dq, dk, dE0, _ = layer_bwd(q, k, r, do, g, gamma, cs_e, dht_e, p0 is not None, cfg, dq_in=dq_in,
                                   dk_in=dk_in, grad_dtype=grad_dtype, launch=launch)
    dv, dq, dk, dP0, db = layer_bwd(q, k, v, dr, g, gamma, cs_p, dht_p, p0 is not None, cfg, dq_in=dq, dk_in=dk,
                                    want_db=want_db, db_own=False, launch=launch)
    return dq, dk, dv, dP0, dE0, db


def layer_bwd(q, k, x, dy, g, gamma, h0, dht, want_dh0, cfg: ChunkConfig, *, dq_in=None, dk_in=None,
              want_db=False, db_own=True, x_is_k=False, grad_dtype=None, launch=launch_kernel):
    """The backward of one first-order layer Y = LA(Q, K, X) (gated linear attention with state H,
    y_t = q_t^T H_t, H_t = a_t H_{t-1} + k_t x_t^T): a walk over the chunks from last to first
    giving every chunk's end-state gradient (``ahla_bwd_dh_kernel``, programs over key blocks of
    at most DH_BLOCK_K and value blocks), then every chunk's gradients (``ahla_bwd_layer_kernel``).

    q, k: [B, T, H, K]; x, dy: [B, T, H, V]; g: [B, T, H], its GateSums or None; h0: the layer's chunk-start
    states [B*H, NT, K, V] at chunk ``cfg.bwd_chunk``; dht: the final state's gradient (fp32
    [B, H, K, V]) or None; want_dh0: also the initial state's. dq_in, dk_in: another layer's dq, dk
    (q's dtype; may be the tensors returned) added before storing. want_db: dL/db [B, T, H] fp32
    (without the final state's share) of this layer alone (db_own) or of the sums with dq_in, dk_in.
    x_is_k: x is k itself (HLA2's inner layer K' = LA(Q, K, K)): the returned dk includes dx.
    grad_dtype: dq's and dk's dtype without dq_in, dk_in (None: the inputs').
    Returns dx, dq, dk (inputs' dtypes, or grad_dtype), dH0 (fp32, or None), db (or None)."""
    dx, dq, dk, dh0, _, db = _layer_bwd(q, k, x, dy, g, gamma, h0, dht, want_dh0, cfg, None, dq_in=dq_in, dk_in=dk_in,
                                        want_db=want_db, db_own=db_own, x_is_k=x_is_k, grad_dtype=grad_dtype,
                                        launch=launch)
    return dx, dq, dk, dh0, db


def normalized_layer_bwd(q, k, x, dy, dd, g, gamma, h0, z0, dht, dzt, want_dh0, cfg: ChunkConfig, *,
                         want_db=False, launch=launch_kernel):
    """The backward of a normalized first-order layer (:func:`normalized_layer_fwd`) from the
    gradients of its numerator, dy [B, T, H, V], and of its denominator, dd [B, T, H] fp32
    (``common.normalize.normalized_output_grad``): :func:`layer_bwd` on the value [x | 1] with
    state [H | p], the column of ones carried as vectors (``ahla_bwd_dh_kernel``'s and
    ``ahla_bwd_layer_kernel``'s NORM; with ``cfg.bwd_den_pass`` p's state gradients come from
    ``common.denominator.carried_denominator_grad`` and the walk carries dH alone). z0: p's
    chunk-start snapshots fp32 [B*H, NT, K]; dzt: p_T's gradient fp32 [B, H, K] or None. Returns dx,
    dq, dk, dH0, dp0 (fp32 [B, H, K], or None), db."""
    return _layer_bwd(q, k, x, dy, g, gamma, h0, dht, want_dh0, cfg, (dd, z0, dzt), want_db=want_db, db_own=True,
                      launch=launch)


def _layer_bwd(q, k, x, dy, g, gamma, h0, dht, want_dh0, cfg: ChunkConfig, norm, *, dq_in=None, dk_in=None,
               want_db=False, db_own=True, x_is_k=False, grad_dtype=None, launch=launch_kernel):
    """:func:`layer_bwd`, normalized when ``norm`` is (dd, z0, dzt) (:func:`normalized_layer_bwd`):
    returns (dx, dq, dk, dH0, dp0 (None unless normalized with want_dh0), db)."""
    B, T, H, K = q.shape
    V = x.shape[-1]
    BH, dev, f32 = B * H, q.device, torch.float32
    BT, nw = cfg.bwd_chunk, cfg.bwd_warps
    BK, BV = bwd_blocks(K, V, dev)
    BKW = min(BK, DH_BLOCK_K)
    NT = cdiv(T, BT)
    flags, lg = _common(q, gamma, g)
    kw = dict(H=H, K=K, V=V, BT=BT, BV=BV, **flags)
    dh0 = torch.empty(B, H, K, V, device=dev, dtype=f32) if want_dh0 else None
    dht = None if dht is None else dht.float().contiguous()
    dh_end = torch.empty(BH, NT, K, V, device=dev, dtype=_dstate_dtype(h0.dtype, BK))
    dx = torch.empty_like(x)
    dq = torch.empty_like(q, dtype=grad_dtype) if dq_in is None else dq_in
    dk = torch.empty_like(k, dtype=grad_dtype) if dk_in is None else dk_in
    db = torch.empty(B, T, H, device=dev, dtype=f32) if want_db else None
    dd, z0, dzt = (None,) * 3 if norm is None else norm
    dz_end = dz0 = None
    # what the state-gradient walk carries of the column of ones (nothing unnormalized or with the passes)
    walk = dict.fromkeys(("dd", "dz_end", "dzt", "dz0"))
    if dd is not None and cfg.bwd_den_pass:   # its state gradients from passes of their own
        dz_end, dz0 = carried_denominator_grad(q, dd, g, dzt, chunk=BT, has_decay=flags["HAS_DECAY"], log_gamma=lg,
                                               launch=launch)
        dz0 = dz0 if want_dh0 else None
    elif dd is not None:   # carried by the walk: every chunk's end, and the start's
        dz_end = torch.empty(BH, NT, K, device=dev, dtype=f32)
        dz0 = torch.empty(B, H, K, device=dev, dtype=f32) if want_dh0 else None
        walk.update(dd=dd, dz_end=dz_end, dzt=None if dzt is None else dzt.float().contiguous(), dz0=dz0)
    gc = sums_at(g, BT, launch)   # both kernels read beta (common.cumsum)
    launch(ahla_bwd_dh_kernel, (cdiv(V, BV), cdiv(K, BKW), BH), q=q, dy=dy, gc=gc, dh_end=dh_end, dht=dht, dh0=dh0,
           **walk, log_gamma=lg, T=T, BK=BKW, num_warps=DH_WARPS, num_stages=DH_STAGES, **kw)
    launch(ahla_bwd_layer_kernel, (NT, BH), q=q, k=k, x=x, dy=dy, gc=gc, h0=h0, dh_end=dh_end, dd=dd, z0=z0,
           dz_end=dz_end, dx=dx, dq=dq, dk=dk, dq_in=dq_in, dk_in=dk_in, db=db, log_gamma=lg, T=T, DB_OWN=db_own,
           DX_TO_DK=x_is_k, BK=BK, num_warps=nw, num_stages=LAYER_STAGES, **kw)
    return dx, dq, dk, dh0, dz0, db


def layer_fwd(q, k, v, g, gamma, p0, cfg: ChunkConfig, *, keep_states=False, launch=launch_kernel):
    """One first-order layer R = LA(Q, K, V) from state P0 (the forward walk without its second
    layer: ``ahla_fwd_kernel`` without HAS_E), in ``cfg``'s forward layout.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H], its GateSums or None (contiguous); p0: fp32 [B, H, K, V]
    or None. keep_states: also the chunk-start states at chunk ``cfg.fwd_chunk`` for
    :func:`layer_bwd` (in the snapshots' dtype). Returns (R [B, T, H, V] (v's dtype), P_T fp32
    [B, H, K, V], cs_p [B*H, NT, K, V] or None)."""
    r, _, PT, _, _, cs, _ = fwd_launch(
        q, k, v, g, gamma, p0, None, None, **forward_layout(cfg),
        snapshots=snapshot_dtype(cfg, q.dtype) if keep_states else None, second=False, launch=launch)
    return r, PT, None if cs is None else cs[0]


def normalized_layer_fwd(q, k, v, g, gamma, p0, pn0, eps, cfg: ChunkConfig, *, keep_states=False,
                         launch=launch_kernel):
    """A normalized first-order layer, O = LA(Q, K, V) / (LA(Q, K, 1) + eps): the denominator is
    the layer on a column of ones, whose state is the vector p. In one walk (``ahla_fwd_kernel``
    without HAS_E and with NORM), or with ``cfg.fwd_den_pass`` from passes of its own parallel over
    chunks (``common/denominator.py``: its part from before each chunk) before a walk that carries
    no p (DIVIDE). As
    :func:`layer_fwd` with pn0 (fp32 [B, H, K] or None: p's initial state) and eps; returns (O (v's
    dtype), den [B, T, H] fp32 (without eps), P_T, p_T fp32, cs_p, cs_pn ([B*H, NT, K] fp32) or
    None)."""
    if cfg.fwd_den_pass:
        flags, lg = _common(q, gamma, g)
        qp, pT, cs_pn = carried_denominator(q, k, g, pn0, chunk=cfg.fwd_chunk, has_decay=flags["HAS_DECAY"],
                                            log_gamma=lg, launch=launch)
        o, den, PT, _, _, cs, _ = fwd_launch(
            q, k, v, g, gamma, p0, None, None, **forward_layout(cfg), eps=eps, qp=qp,
            snapshots=snapshot_dtype(cfg, q.dtype) if keep_states else None, second=False, launch=launch)
        return o, den, PT, pT, None if cs is None else cs[0], cs_pn if keep_states else None
    o, den, PT, _, pT, cs, _ = fwd_launch(
        q, k, v, g, gamma, p0, None, pn0, **forward_layout(cfg), normalize=True, eps=eps,
        snapshots=snapshot_dtype(cfg, q.dtype) if keep_states else None, second=False, launch=launch)
    return (o, den, PT, pT) + ((None, None) if cs is None else (cs[0], cs[3]))


def layer_pair_fwd(q, k, v, v2, g, gamma, p0, p20, cfg: ChunkConfig, *, keep_states=False, launch=launch_kernel):
    """Two first-order layers on the same queries and keys, R = LA(Q, K, V) from P0 and
    R2 = LA(Q, K, V2) from P2_0, in one walk (``ahla_fwd_kernel``'s HAS_V2) in ``cfg``'s forward
    layout but for its value block: each program holds all of V's and V2's columns, reads each
    chunk's Q and K once and forms one A = (Q K^T) o G for both. Third order's R and K' (V2 = K,
    ``ChunkConfig.fwd_shared_walk``).

    q, k: [B, T, H, K]; v: [B, T, H, V]; v2: [B, T, H, V2]; g: [B, T, H], its GateSums or None (contiguous); p0,
    p20: fp32 [B, H, K, V], [B, H, K, V2] or None. keep_states: as :func:`layer_fwd`'s, each layer's.
    Returns (R, R2 (the values' dtypes), P_T, P2_T fp32, cs_p, cs_p2 ([B*H, NT, K, .]) or None)."""
    r, _, PT, _, _, cs, (r2, PT2, cs2) = fwd_launch(
        q, k, v, g, gamma, p0, None, None, **forward_layout(cfg),
        snapshots=snapshot_dtype(cfg, q.dtype) if keep_states else None, second=False, v2=v2, p20=p20, launch=launch)
    return r, r2, PT, PT2, None if cs is None else cs[0], cs2


def ahla_fwd(q, k, v, g, p0, e0, pn0, en0, gamma, normalize, eps, cfg: ChunkConfig, keep_states=False,
             launch=launch_kernel):
    """The forward pass: q, k [B, T, H, K], v [B, T, H, V], g [B, T, H], its GateSums or None (contiguous);
    p0, e0 fp32 [B, H, K, V] or None; pn0, en0 fp32 [B, H, K] or None; gamma a float or None.
    Normalized, two walks: the denominator's, the operator on the values [1 | 0 ...]
    (:func:`_ones_column`; its outputs, den, stored in fp32), then the values' walk, which divides
    its outputs by (den + eps) as it stores them (``ahla_fwd_kernel``'s DEN_IN). keep_states: store
    the chunk-start states of each walk for :func:`ahla_bwd` when ``cfg.fwd_chunk == cfg.bwd_chunk``
    (else nothing is kept), and with ``cfg.bwd_layers`` each walk's first-order output R.
    Returns (o [B, T, H, V], den [B, T, H] fp32 or None, P_T, E_T [B, H, K, V], p_T, e_T [B, H, K]
    or None, cs_p, cs_e [B*H, NT, K, V] or None, R [B, T, H, V] or None, and the denominator walk's
    (cs_p, cs_e, R) on its ONES_ALIGN columns, each None when not kept)."""
    _check_config(cfg, q.shape[-1])
    save = keep_states and cfg.fwd_chunk == cfg.bwd_chunk
    walk = dict(forward_layout(cfg), snapshots=snapshot_dtype(cfg, q.dtype) if save else None, keep_r=cfg.bwd_layers,
                launch=launch)
    den = pT = eT = None
    kept1 = (None,) * 3
    if normalize:
        ones, p1, e1 = _ones_column(v, p0, pn0, en0)
        d1, _, P1, E1, _, cs1, _ = fwd_launch(q, k, ones, g, gamma, p1, e1, None, out_dtype=torch.float32, **walk)
        den, pT, eT = d1[..., 0].contiguous(), P1[..., 0].contiguous(), E1[..., 0].contiguous()
        kept1 = kept1 if cs1 is None else cs1[:3]
    o, _, PT, ET, _, cs, _ = fwd_launch(q, k, v, g, gamma, p0, e0, None, eps=eps, den_in=den, **walk)
    cs = (None, None, None) if cs is None else cs[:3]
    return (o, den, PT, ET, pT, eT) + cs + (kept1,)


def ahla_bwd(q, k, v, g, p0, e0, pn0, en0, o, den, PT, ET, pT, eT, cs_p, cs_e, r, do, dPT, dET, dpT, deT,
             gamma, normalize, eps, cfg: ChunkConfig, want_dg=False, kept1=(None, None, None), launch=launch_kernel):
    """The backward pass of :func:`ahla_fwd`: its inputs, its outputs (o and den are read only
    when normalizing), its kept states and R (or None), and the cotangents do [B, T, H, V] (or None),
    dPT, dET [B, H, K, V], dpT, deT [B, H, K] (each or None); kept1: the denominator walk's kept
    (cs_p, cs_e, R) (None: recomputed).
    Returns (dq, dk, dv, dg or None, dP0, dE0, dp0, de0; the state gradients None without p0,
    dp0 and de0 None unless normalizing)."""
    if do is None:
        do = torch.zeros_like(v)
    dd = None
    if normalize:
        # o = num / (den + eps): the gradients of num (do / d) and of den (dd = -(do . o) / d)
        do, dd = normalized_output_grad(do, o, den, eps, launch=launch)
    # dq, dk wait for the rest of their sums in fp32: a normalized call's two parts, and on fp32
    # tiles (fp16 inputs) the layered backward's two layers, whose sums give dL/db (in fp16 the
    # outer layer's rounded share put a call's dg 1.1e-3 off float64, against 1.5e-4 coupled)
    grad_dtype = torch.float32 if normalize or (cfg.bwd_layers and fp32_tiles(q.dtype)) else None
    # the denominator's part adds into the numerator's fp32 dq, dk in place (two [B, T, H, K] fp32
    # tensors fewer at once); the layered backward's dL/db then comes with the sums, once
    sums_db = normalize and cfg.bwd_layers
    states = None if cs_p is None else (cs_p, cs_e, r)
    dq, dk, dv, dP0, dE0, db = bwd_launch(q, k, v, do, g, gamma, p0, e0, dPT, dET, cfg, states=states,
                                          want_db=want_dg and not sums_db, grad_dtype=grad_dtype, launch=launch)
    dp0 = de0 = None
    if normalize:
        # the denominator's part: the operator on [1 | 0 ...] from (p0, e0), with gradient [dd | 0 ...]
        # and the cotangents of (p_T, e_T), from the denominator walk's kept states (else recomputed)
        ones, p1, e1 = _ones_column(v, p0, pn0, en0)
        dd = _column(dd, do)
        dp1, de1 = (None if x is None else _column(x, dq) for x in (dpT, deT))   # fp32, as dq here
        kept1 = None if kept1[0] is None else kept1
        dq, dk, _, dp0, de0, db1 = bwd_launch(q, k, ones, dd, g, gamma, p1, e1, dp1, de1, cfg, states=kept1,
                                              want_db=want_dg, grad_dtype=grad_dtype, dq_in=dq, dk_in=dk,
                                              launch=launch)
        if sums_db:   # the sums' dL/db
            db = db1
        elif db is not None:   # the two parts' own
            db += db1
        if dp0 is not None:
            dp0, de0 = dp0[..., 0].contiguous(), de0[..., 0].contiguous()
    dq, dk = dq.to(q.dtype), dk.to(k.dtype)
    dg = None
    if want_dg:
        # the final state carries the factor exp(b_T) (P_T and E_T alike, p_T and e_T too): its share of dL/db_T
        dg = log_gate_grad(db, ((PT, dPT, 1.0), (ET, dET, 1.0), (pT, dpT, 1.0), (eT, deT, 1.0)), g.dtype)
    return dq, dk, dv, dg, dP0, dE0, dp0, de0


def _column(col, like):
    """[col | 0 ...]: col [..., R] as the first of ONES_ALIGN columns [..., R, ONES_ALIGN], in
    like's dtype (the zero columns add nothing to the operator, linear in its values, and keep its
    rows 16-byte aligned: ``common.normalize``, "Width")."""
    return with_column(like.new_zeros(*col.shape, 0), col, ONES_ALIGN)


def _ones_column(v, p0, pn0, en0):
    """The denominator's operator as :func:`fwd_launch` and :func:`bwd_launch` take it: the values
    [1 | 0 ...] [B, T, H, ONES_ALIGN] in v's dtype (ones are exact in every dtype) and the initial
    states [p0 | 0 ...], [e0 | 0 ...] fp32 [B, H, K, ONES_ALIGN] (zeros for a missing one; both
    None without p0: the call had no initial state)."""
    ones = _column(torch.ones_like(v[..., 0]), v)
    if p0 is None:
        return ones, None, None
    return (ones,) + tuple(_column(p0.new_zeros(p0.shape[:-1]) if x is None else x, p0) for x in (pn0, en0))


class AHLAChunkFunction(torch.autograd.Function):
    """Autograd of AHLA on the Triton kernels.

    forward(q [B,T,H,K], k, v [B,T,H,V], g [B,T,H] | None, p0, e0 [B,H,K,V] | None,
    pn0, en0 [B,H,K] | None, gamma, normalize, eps, cfg, launch) -> (o [B,T,H,V], P_T, E_T [B,H,K,V],
    p_T, e_T [B,H,K] | None). The backward is not itself differentiable (it raises if asked)."""

    @staticmethod
    def forward(ctx, q, k, v, g, p0, e0, pn0, en0, gamma, normalize, eps, cfg, launch):
        # an output the loss does not use gets None, not a materialized zero tensor (the final
        # state's cotangents are [B, H, K, K]-sized: zeros would cost memory and a walk from zero)
        ctx.set_materialize_grads(False)
        grads = any(ctx.needs_input_grad[:8])
        sums = None if g is None else GateSums(g, launch=launch)   # the gate sums, shared with the backward
        o, den, PT, ET, pT, eT, cs_p, cs_e, r, kept1 = ahla_fwd(q, k, v, sums, p0, e0, pn0, en0, gamma, normalize,
                                                                eps, cfg, keep_states=grads and cfg.save_states,
                                                                launch=launch)
        # the final state is read back only for the log-gates' gradient (its own factor e^{b_T})
        final = (PT, ET, pT, eT) if g is not None and ctx.needs_input_grad[3] else (None,) * 4
        ctx.save_for_backward(q, k, v, g, p0, e0, pn0, en0, o if normalize else None, den, *final, cs_p, cs_e, r,
                              *kept1)
        ctx.gamma, ctx.normalize, ctx.eps, ctx.cfg, ctx.launch, ctx.sums = gamma, normalize, eps, cfg, launch, sums
        return o, PT, ET, pT, eT

    @staticmethod
    @kernel_backward
    def backward(ctx, do, dPT, dET, dpT, deT):
        q, k, v, g, p0, e0, pn0, en0, o, den, PT, ET, pT, eT, cs_p, cs_e, r, *kept1 = ctx.saved_tensors
        want_dg = g is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dg, dP0, dE0, dp0, de0 = ahla_bwd(
            q, k, v, ctx.sums, p0, e0, pn0, en0, o, den, PT, ET, pT, eT, cs_p, cs_e, r, do, dPT, dET, dpT, deT,
            ctx.gamma, ctx.normalize, ctx.eps, ctx.cfg, want_dg=want_dg, kept1=tuple(kept1), launch=ctx.launch)
        return dq, dk, dv, dg, dP0, dE0, dp0, de0, None, None, None, None, None


def ahla_chunked(q, k, v, g, gamma, p0, e0, pn0, en0, normalize, eps, config=None, chunk_size=None, launch=None):
    """AHLA on the Triton kernels.

    q, k: [B, T, H, K]; v: [B, T, H, V] (contiguous); g: [B, T, H] or None; p0, e0, pn0, en0:
    fp32 state or None; config: a ChunkConfig, or None for ``ahla_config``'s rule (its training
    layout when autograd records: an input requires grad). launch: how
    kernels are launched (``common.compile``); None launches them, after compiling a new call's
    kernels at once (``compile_ahead``).
    Returns (o [B, T, H, V], P_T, E_T, p_T or None, e_T or None)."""
    B, T, H, K = q.shape
    if config is None:
        config = ahla_config(B, T, H, K, v.shape[-1], q.dtype, q.device, chunk_size,
                             autograd_records(q, k, v, g, p0, e0, pn0, en0))
    _check_config(config, K)
    if launch is None:   # the rehearsal takes the layout chosen here
        args = (q, k, v, g, gamma, p0, e0, pn0, en0, normalize, eps, config, chunk_size)
        compile_ahead("ahla", ahla_chunked, args, q.device)
        launch = launch_kernel
    return AHLAChunkFunction.apply(q, k, v, g, p0, e0, pn0, en0, gamma, normalize, eps, config, launch)
