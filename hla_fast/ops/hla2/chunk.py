"""Chunked HLA2 on the Triton kernels: the configuration rule, the launchers, the autograd Function.

Forward: one program per (value block, segment, head) walks its segment's chunks
(``hla2_fwd_kernel``). With more than one segment a first launch computes every segment's summary
from a zero state (``hla2_fwd_summary_kernel``) and a small kernel folds them into each segment's
start state (``hla2_fwd_fold_kernel``), so that all segments then run at once. Split
(``config.fwd_output_pass``): the walk only carries the state and stores every chunk's start
state, its key rows cut over ``config.fwd_row_blocks`` programs, and ``hla2_fwd_output_kernel``
computes every chunk's outputs from them at once. With ``config.fwd_two_walks`` that state pass is
two walks, S's alone (``hla2_fwd_key_walk_kernel``) and then W's and z's, reading each chunk's S
from the first walk's stored states (``hla2_fwd_value_walk_kernel``).

Backward: the chunk-start states (kept by the forward, or recomputed by the forward walk), a walk
from the last chunk to the first carrying only the state gradients (``hla2_bwd_state_kernel``,
segmented the same way with ``hla2_bwd_fold_kernel``), then every chunk's dq, dk, dv in parallel
(``hla2_bwd_grad_kernel``), split over the launches ``config.grad_parts`` names. The gradient of the
log-gates g follows from dq, dk, dv (see ``hla2_bwd_grad_kernel``) plus the final state's share.
In pieces (``config.bwd_pieces``): the walk and the per-chunk launches run on the last piece of the
chunks, then on the one before it from the state gradient the walk left at the piece's start, and so
on, so that the chunk-end state gradients are held for one piece at a time (the chain rule is the
same; only the order of the launches and the buffer's size change).

Normalization: the forward carries the denominator's state z beside W in the same kernels and
divides in-kernel. The backward differentiates the unnormalized operator on the value [v | 1] with
the output gradient [do / (den + eps) | -(do . o) / (den + eps)] (the denominator is the operator
applied to a column of ones). The ones column is not a value block: the backward kernels carry its
state gradient dz beside dW and add its rank-one terms to the products over value columns
(``dd`` in ``bwd_launch``), and the forward keeps z's chunk-start snapshots beside W's.

Wide heads: a program holds a K x K and a K x V fp32 state, so tiles stop at TILE_MAX features. A
wider head is cut into feature blocks a, b of at most FEATURE_BLOCK: since q . k is the sum of the
blocks' dot products, HLA2 is the sum over block pairs of the cross operator with (q_a, k_a)
outside and (q_b, k_b) inside (``hla2_chunked``). Values wider than TILE_MAX are cut into value
blocks in the backward (the operator is linear in v). As first-order layers (the rule's layout for
bf16 heads of 256), a layer is the sum of its key blocks' layers, each block's state the rows of
the layer's state for its keys, so a head needs one walk per key block of at most TILE_MAX and
layer instead of one per pair (``key_block_layers_fwd``).

Launches go through each launcher's ``launch`` argument (``common.compile.launch_kernel``); the entry
point first has ``common.compile.compile_ahead`` rehearse a new call with a recorder there and compile
its kernels at once.
"""
from __future__ import annotations

import functools

import torch

from ..common.compile import compile_ahead, launch_kernel
from ..ahla.chunk import ahla_config, layer_bwd, layer_fwd, normalized_layer_bwd, normalized_layer_fwd
from ..common.autograd import autograd_records, kernel_backward
from ..common.config import DEFAULT_CHUNK, ChunkConfig, chunk_or_default, refuse_ahla_fields, refuse_shared_walk
from ..common.cumsum import GateSums
from ..common.gates import log_gamma, log_gate_grad, summed_shares
from ..common.launch import (
    backward_pieces, bf16_dots, cdiv, dot_precision, even_blocks, fp32_tiles, min_key_block, min_value_block,
    one_wave_segments, pow2_block, rule_pieces, run_pieces, snapshot_dtype, split_segments, tile_chunk, value_block,
)
from ..common.normalize import normalized_output_grad, ones_width, quotient, quotient_values, with_column
from .chunk_kernels import (
    hla2_bwd_fold_kernel, hla2_bwd_grad_kernel, hla2_bwd_ones_kernel, hla2_bwd_state_kernel, hla2_fwd_fold_kernel,
    hla2_fwd_kernel, hla2_fwd_key_walk_kernel, hla2_fwd_output_kernel, hla2_fwd_summary_kernel,
    hla2_fwd_value_walk_kernel,
)

# widest feature block one program holds (a K x K and a K x V fp32 state on chip)
TILE_MAX = 128
# width of the feature blocks a head wider than TILE_MAX is cut into: with 128-wide blocks the
# backward of a cross pair did not fit the H200's shared memory (hla_fast/README.md, wide heads)
FEATURE_BLOCK = 64
# fewest chunks a segment walks when segments are picked by occupancy
MIN_SEGMENT_CHUNKS = 4
# a sequence of at most SHORT_CHUNKS chunks (heads up to 64 wide) walks in one segment and computes
# its gradients in one launch: 3 launches a training call instead of 8 (hla2_config)
SHORT_CHUNKS = 32
# chunks of a normalized call's fp32 inputs with heads up to 64 wide, in both passes: their first
# training call compiles in two thirds of the time of chunks of 64, and runs faster (hla2_config)
NORMALIZED_FP32_CHUNK = 32
# a bf16 training forward of 128-wide key tiles over at least SPLIT_MIN_CHUNKS chunks runs split
# (``fwd_output_pass``): its state walk in SPLIT_ROW_BLOCKS row blocks, then every chunk's outputs
SPLIT_MIN_CHUNKS = 256
SPLIT_ROW_BLOCKS = 2
# the split's state walks pipeline their loads this deep (Triton's num_stages), and so does the
# backward of a split training call (its state-gradient walks)
SPLIT_STAGES = 3
# a bf16 inference forward of 128-wide key tiles over at least TWO_WALKS_MIN_CHUNKS chunks of
# TWO_WALKS_CHUNK runs split with two state walks (``fwd_two_walks``): S's, then W's (hla2_config)
TWO_WALKS_CHUNK = 64
TWO_WALKS_MIN_CHUNKS = 128
# a split forward's output pass computes up to OUTPUT_BLOCK_V value columns a program
OUTPUT_BLOCK_V = TILE_MAX


def bwd_value_width(K: int) -> int:
    """Widest value block of one backward program for keys K wide: TILE_MAX, but 64 when the key
    tile is 64 or narrower. On an H200 (Triton 3.6) 64-wide key tiles with 128-wide value tiles
    in 8-warp programs gave NaN gradients and an illegal memory access, while 64 x 64 tiles in
    4-warp programs, the layout of K = V = 64, passed (hla_fast/README.md, limits)."""
    return TILE_MAX if pow2_block(K) > 64 else 64


@functools.lru_cache(maxsize=4096)
def hla2_config(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device,
                chunk_size: int | None = None, gated: bool = False, normalize: bool = False,
                training: bool = False) -> ChunkConfig:
    """The default layout for one call (the arguments as :func:`fused_config`'s): the first-order
    layers (:func:`layers_config`) where :func:`takes_layers` says they were measured faster, else
    the fused kernels' rule (:func:`fused_config`). Normalized or not alike: the layers carry the
    denominator's state z beside W in the outer layer's walks (:class:`HLA2LayersFunction`), as the
    fused kernels do; but with 128-wide key tiles the outer layer's walk takes what its
    denominator carries from before each chunk from passes of its own (``fwd_den_pass``) instead of
    carrying z, in the unnormalized call's layout: the inference forward (chunks of 128 in 8 warps,
    where the walk carrying z was slower than in chunks of 64 in 4) and the gated training call were
    faster, the ungated training call took as long (``hla2_h100_ab_den_pass_k128{,_gates}.json``);
    at K = V = 64 both were slower (``hla2_h100_ab_den_pass_k64_unkept.json``). With key tiles of
    64 the backward takes the gradients of z's states from passes of their own (``bwd_den_pass``),
    so that its walk carries dW alone: a training call 5.20 -> 5.06 ms, 5.73 -> 5.51 gated; at 128
    it took as long (13.42 against 13.47 ms, 14.01 against 13.88 gated) and keeps the walk carrying
    dz (``hla2_h100_ab_bwd_den_pass{,_gates}.json``; the numbers and the commands in
    hla_fast/README.md, "The configuration rule"). The result is immutable, so it is cached."""
    wide = K > TILE_MAX   # in key blocks (normalized on [v | 1]: no NORM walks)
    if takes_layers(T, K, V, dtype, False, training):
        width = max(b - a for a, b in key_blocks(K))
        cfg = layers_config(B, T, H, width, V, dtype, device, chunk_size, training)
        if normalize and not wide:   # the denominator's passes: forward at 128-wide key tiles, else backward
            cfg = cfg.replace(**{"fwd_den_pass" if pow2_block(width) == TILE_MAX else "bwd_den_pass": True})
        return cfg
    return fused_config(B, T, H, K, V, dtype, device, chunk_size, gated, normalize, training)


def takes_layers(T: int, K: int, V: int, dtype: torch.dtype, normalize: bool, training: bool) -> bool:
    """Whether the rule runs a call as first-order layers (``ChunkConfig.layers``): bf16, key and
    value tiles of one width, 64 or 128 (the heads measured), over more than SHORT_CHUNKS chunks of
    64, or training 128-wide heads at any length; keys wider than 128 (key blocks) at any length and
    with values of any width; not ``normalize``: a stage whose values carry a column of ones (HLA3's
    normalized second stage, V + 1 values; HLA2's own normalized calls carry z beside W instead and
    ask without it, :func:`hla2_config`). Each was timed in one process against the fused kernels'
    rule (hla_fast/README.md, "The configuration rule", with the commands):

    * long sequences (T = 32k), K = V = 64 and 128, with and without log-gates: the layers are faster
      in both passes; the training peak is lower at 128 and higher at 64
      (``hla2_h200_ab_layers{,_gates}.json``);
    * the layers on [v | 1] (one more value column) were slower, so a stage on such values keeps the
      fused kernels, which carry the ones column as z beside W (``hla2_h200_ab_layers_normalize.json``);
    * T = 2048: at K = V = 64 the fused rule's short layout (one segment, three launches) is faster;
      at 128 the layers are faster for training and slower for an inference forward
      (``hla2_h200_ab_layers_2k.json``);
    * heads of 129 to 256 key features, at any length: the layers in key blocks of at most 128
      (:func:`key_block_layers_fwd`) are several times faster than the fused kernels' 16
      feature-block pairs at K = V = 256, gated, normalized (the outer blocks on [v | 1],
      :func:`hla2_chunked`) and with narrower values, at a higher training peak (the blocks of q, k
      and K' and each block's chunk states are kept)
      (``hla2_h200_ab_key_block_layers_{8k,8k_gates,2k,8k_normalize,8k_v128,8k_v64}.json``)."""
    BK, BV = pow2_block(K), pow2_block(V)
    if dtype != torch.bfloat16 or normalize:
        return False
    if BK > TILE_MAX:   # key blocks, whatever the values' width
        return True
    if BK != BV or BK not in (64, 128):
        return False
    return cdiv(T, DEFAULT_CHUNK) > SHORT_CHUNKS or (training and BK == 128)


@functools.lru_cache(maxsize=4096)
def layers_config(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device,
                  chunk_size: int | None = None, training: bool = False) -> ChunkConfig:
    """The layout of HLA2 as first-order layers (``ChunkConfig.layers``): AHLA's rule for the
    same first-order kernels (``ahla.chunk.ahla_config``, which measured them: chunks of 128 in
    8 warps for a bf16 inference forward of 128-wide keys, chunks of 64 for training, whose
    forward keeps its chunk states), with the backward walking whole sequences by the per-layer
    kernels. V: the values the outer layer sees. Cached (immutable)."""
    return ahla_config(B, T, H, K, V, dtype, device, chunk_size, training=training).replace(
        bwd_segments=1, bwd_pieces=1, bwd_prefetch=False, bwd_layers=False, grad_parts=(7,), layers=True)


@functools.lru_cache(maxsize=4096)
def fused_config(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device,
                 chunk_size: int | None = None, gated: bool = False, normalize: bool = False,
                 training: bool = False) -> ChunkConfig:
    """The layout of the fused kernels for one call, by the measurements in ``benchmarks/results/``
    (the numbers, and what was tried and not kept, in hla_fast/README.md, "The configuration rule");
    a ``chunk_size`` of None stands for DEFAULT_CHUNK (64); ``training``: autograd records the call
    (its forward keeps the chunk states for the backward). "fp32" below means fp32 and fp16 inputs
    (``fp32_tiles``: both run on fp32 tiles with tf32x3 products, so fp16 takes fp32's layouts,
    whose kernels the GPU tests and the shared-memory checks cover):

    * heads up to 64 wide: chunks of ``chunk_size`` forward (at most FP32_MAX_CHUNK for fp32 and
      fp16 inputs, whose tiles are fp32) and at most 64 backward; wider heads: chunks of at most 32
      in both passes (fewer live tiles a program), 16 for fp32 inputs, whose tf32x3 products of
      32-row tiles were the slowest compiles (``hla2_h200_first_call_rule.md``,
      ``hla2_h200_fp32_k128_chunk16.json``); but bf16 keys up to 64 wide with wider values take the
      chunks of K = V = 64, since their programs hold its tiles (values run in blocks of 64): faster
      and a lower peak than chunks of 32 (``hla2_h200_layouts_k64_v128.json``, and HLA3's normalized
      second stage, ``hla3_h200_second_stage_layouts_k64_normalize.json``);
    * forward value blocks of 64 columns; backward value blocks of ``bwd_value_width(K)``;
    * 4 warps for tiles up to 64 x 64, 8 above;
    * segments: as many as keep every program in one wave (two 4-warp programs or one 8-warp
      program a multiprocessor), at least MIN_SEGMENT_CHUNKS chunks each; the backward walk is
      segmented only with 4-warp programs (the fold's fp32 product of two 128-wide tiles does not
      fit in shared memory) (``hla2_h200_variants.md``, ``hla2_h200_segments.md``);
    * gradients from two launches, dq and (dk, dv) (``hla2_h200_variants.md``); three, dq, dk and
      dv, for a bf16 call both ``gated`` (log-gates g) and ``normalize``d with heads up to 64 wide,
      whose (dk, dv) launch spilled registers by an sm_90 compile and was slower in one launch; gated
      alone or normalized alone three launches did not pay
      (``hla2_h200_ab_gates_normalize_parts124.json``, ``hla2_h200_ab_gates_parts124.json``,
      ``hla2_h200_ab_normalize_parts124.json``); for fp32 inputs one launch per gradient: the
      tf32x3 products made the gradient kernel a first training call's slowest compile, and a
      call's kernels compile in parallel (``hla2_h200_first_call_rule.md``, ``compile_report.py``;
      ``hla2_h200_fp32_layouts_first.json`` for the 8-warp layout not taken);
    * normalized fp32 calls with heads up to 64 wide: chunks of NORMALIZED_FP32_CHUNK in both passes,
      whose first training call compiled faster and which ran faster at T = 2k, 8k and 32k, at a
      higher peak (twice the kept chunk states); with gamma or g such chunks ran slower (a gradient
      launch spilled heavily by an sm_90 compile) and are not taken (``hla2_h100_fp32_chunk32.json``,
      ``compile_hla2_fp32_k64_*_triton36_cpu.md``); a sequence is short (below) by its chunks of 64;
    * fp32 inputs with key tiles wider than 64: one forward segment (``fold_fits``: the fold of
      their segments does not fit in shared memory);
    * short sequences, at most SHORT_CHUNKS chunks, with heads up to 64 wide: one segment in both
      walks and, for bf16, every gradient in one launch (fp32 and fp16 inputs, whose tiles are fp32,
      keep theirs: one launch of fp32 tiles would not fit in shared memory): a training call launches
      three kernels instead of eight, and there the host's work per launch outweighs the longer
      walk (``hla2_h200_short_layouts_first.md``, ``hla2_h200_short_layouts.md``);
    * the forward keeps its chunk-start states for the backward when both passes use one chunk
      size and the backward runs one value block (z's too when normalizing): it saves the
      backward's recomputing walk (``hla2_h200_short_layouts.md``, rows ``seg_kept`` and
      ``seg_recomputed``);
    * heads wider than 64 with a one-segment backward walk over at least BWD_PIECES_MIN_CHUNKS
      chunks walk it in BWD_PIECES pieces (``common.launch.rule_pieces``): the chunk-end state
      gradients are kept for a quarter of the sequence at a time instead of all of it, which lowers
      the training peak at K = V = 128 below 1.5x fla's at the same speed (``hla2_h200_pieces.md``,
      ``hla2_h200_ab_pieces.json``);
    * a bf16 training forward of key tiles 128 wide over at least SPLIT_MIN_CHUNKS chunks, which
      stores its chunk states anyway: a state walk in SPLIT_ROW_BLOCKS row blocks of 4 warps, then
      the outputs of every chunk at once (``fwd_output_pass``), faster at T = 8k and 32k, gated or
      not (``hla2_h200_split_forward_train_k128{,_gates,_8k}.json``); at K = V = 64 it did not
      pay (``hla2_h200_split_forward_k64.json``). Its state walk and the backward's pipeline their
      loads SPLIT_STAGES deep (``fwd_stages``, ``bwd_stages``; depths 2 to 4 in
      ``hla2_h200_split_stages_k128{,_gates}.json``); at K = V = 64 neither pass gained
      (``hla2_h200_stages_k64.json``);
    * a bf16 inference forward of the same heads over at least TWO_WALKS_MIN_CHUNKS chunks of
      TWO_WALKS_CHUNK: split too, its state pass two walks (``fwd_two_walks``: S's alone in blocks,
      then W's reading S's stored chunk states), loads pipelined SPLIT_STAGES deep, in chunks of
      TWO_WALKS_CHUNK, faster than one walk in chunks of 32, gated, normalized and at T = 8k too
      (``hla2_h200_ab_two_walks_k128{,_8k,_gates,_normalize}.json``; the one-walk splits and other
      depths in ``hla2_h200_split_forward_k128.json``, ``hla2_h200_split_stages_k128.json``,
      ``hla2_h200_two_walks_stages_k128.json``). Not taken for values in two backward value blocks
      (``keep``: HLA3's normalized second stage, slower, ``hla3_h200_ab_two_walks_k128_normalize_unkept.json``),
      nor at K = V = 64, where it walks one segment (slower, ``hla2_h200_two_walks_k64.json``). The
      call stores the chunk states (B * H * T / TWO_WALKS_CHUNK states of K x (K + V) in bf16) until
      it returns;
    * a split forward's output pass in value blocks of up to OUTPUT_BLOCK_V columns, so that each
      chunk's S is read and Q S0 formed once for all 128 values instead of once per 64: faster in
      both passes, normalized too (``hla2_h200_ab_output_block_k128{,_normalize}.json``); by an sm_90
      compile no layout of the rule spills in it (``benchmarks/compile_report.py``).
    Off CUDA (the interpreter) every walk is one segment. K is the width of one program's key
    tile (a feature block of a wider head). The result is immutable, so it is cached per shape."""
    chunk_size = chunk_or_default(chunk_size)
    wide = max(K, V) > 64
    # bf16 values wider than 64 run in blocks of 64: with keys up to 64 a program's tiles are those of
    # K = V = 64, and so are its chunks
    wide_tiles = wide and not (dtype == torch.bfloat16 and pow2_block(K) <= 64)
    fp32 = fp32_tiles(dtype)   # fp32 and fp16 inputs alike: fp32 tiles, tf32x3 products
    wide_chunk = 16 if fp32 else 32   # fp32: tf32x3 products of 32-row tiles were the slowest compiles
    fwd_chunk = min(chunk_size, wide_chunk) if wide_tiles else tile_chunk(chunk_size, dtype)
    bwd_chunk = min(chunk_size, wide_chunk if wide_tiles else 64)
    # judged on these chunks, before a normalized fp32 call halves them below
    short = not wide and max(cdiv(T, fwd_chunk), cdiv(T, bwd_chunk)) <= SHORT_CHUNKS
    if fp32 and normalize and not wide_tiles:
        # the denominator's column makes fp32 tiles of 64 rows the slowest compiles and spill more
        fwd_chunk = bwd_chunk = min(fwd_chunk, NORMALIZED_FP32_CHUNK)
    block_v = min(64, pow2_block(V, min_value_block(device)))
    bwd_bv = min(pow2_block(V, min_value_block(device)), bwd_value_width(K))
    fwd_warps = 4 if pow2_block(K) <= 64 and block_v <= 64 else 8
    bwd_warps = 4 if pow2_block(K) <= 64 and bwd_bv <= 64 else 8
    n_fwd, n_bwd = cdiv(T, fwd_chunk), cdiv(T, bwd_chunk)
    n_v = cdiv(V, block_v)
    fwd_seg = one_wave_segments(n_v * B * H, n_fwd, device, 2 if fwd_warps == 4 else 1, MIN_SEGMENT_CHUNKS)
    if not fold_fits(pow2_block(K, min_key_block(device)), dtype):
        fwd_seg = 1
    bwd_seg = one_wave_segments(B * H, n_bwd, device, 2, MIN_SEGMENT_CHUNKS) if bwd_warps == 4 else 1
    keep = fwd_chunk == bwd_chunk and V <= bwd_value_width(K)
    # fp32: tf32x3 products; a gradient launch per gradient keeps each compile short
    grad_parts = (1, 2, 4) if fp32 or (gated and normalize and not wide) else (1, 6)
    if keep and short:
        # a short sequence: host work per launch outweighs a longer walk
        fwd_seg = bwd_seg = 1
        if dtype == torch.bfloat16:
            grad_parts = (7,)   # fp32 tiles (fp32 and fp16 inputs) would not fit in shared memory
    long_wide = dtype == torch.bfloat16 and pow2_block(K) > 64 and fwd_seg == 1
    split = training and keep and long_wide and n_fwd >= SPLIT_MIN_CHUNKS
    two_walks = (not training and keep and long_wide and chunk_size >= TWO_WALKS_CHUNK
                 and cdiv(T, TWO_WALKS_CHUNK) >= TWO_WALKS_MIN_CHUNKS)
    output_pass = split or two_walks
    fwd_stages = bwd_stages = 1
    if output_pass:          # carry the states in row blocks, then every chunk's outputs at once
        fwd_warps, fwd_stages = 4, SPLIT_STAGES
    if split:                # the states are stored for the backward anyway
        bwd_stages = SPLIT_STAGES
    if two_walks:
        fwd_chunk = TWO_WALKS_CHUNK
    return ChunkConfig(fwd_chunk=fwd_chunk, bwd_chunk=bwd_chunk, fwd_segments=fwd_seg, bwd_segments=bwd_seg,
                       fwd_warps=fwd_warps, bwd_warps=bwd_warps, fwd_stages=fwd_stages, bwd_stages=bwd_stages,
                       fwd_block_v=block_v, grad_parts=grad_parts,
                       save_states=keep, bf16_snapshots=True, bwd_pieces=rule_pieces(wide, bwd_seg, n_bwd),
                       fwd_output_pass=output_pass, fwd_row_blocks=SPLIT_ROW_BLOCKS if output_pass else 1,
                       fwd_two_walks=two_walks, fwd_output_block_v=OUTPUT_BLOCK_V if output_pass else None)


def fold_fits(BK: int, dtype: torch.dtype) -> bool:
    """Whether the forward's segment fold (``hla2_fwd_fold_kernel``) fits in shared memory for key
    tiles BK wide: not for fp32 inputs (tf32x3 products) with tiles wider than 64 (256 KB at 128 by
    an sm_90 compile, ``benchmarks/compile_report.py hla2 1 2049 2 128 128 float32``; an H200
    refused the launch with OutOfResources), nor for fp16 inputs, whose tiles and products are
    fp32's. The same on every device, so the interpreter runs the layouts a GPU does."""
    return not (fp32_tiles(dtype) and BK > 64)


def _inner_pair(q, k, q2, k2):
    """The inner pair (q2, k2) (q, k for plain HLA2), its width K2 and the key tile BK."""
    q2 = q if q2 is None else q2
    k2 = k if k2 is None else k2
    return q2, k2, q2.shape[-1], pow2_block(max(q.shape[-1], q2.shape[-1]), min_key_block(q.device))


def _bwd_width(q, q2):
    """Widest value block of one backward program for the key tile of (q, q2)."""
    return bwd_value_width(max(q.shape[-1], (q if q2 is None else q2).shape[-1]))


def keeps_states(cfg: ChunkConfig, q, q2, V: int) -> bool:
    """Whether a training forward on (q, q2) with V value columns keeps its chunk-start states for
    the backward: one chunk size in both passes and one backward value block (else ``bwd_launch``
    recomputes them). Also for ``hla3``'s second stage."""
    return cfg.keeps_states and V <= _bwd_width(q, q2)


def _common(q, gamma, g, rate):
    """Constexprs and scalars every launch shares."""
    return dict(HAS_DECAY=g is not None or gamma is not None, IS_BF16=bf16_dots(q.dtype),
                PREC=dot_precision(q.dtype), RATE=rate), log_gamma(gamma) if g is None else 0.0


def _check_rate(rate, normalize):
    """The inner index's rate: 1 (HLA2) or 2 (the second-order stage of ``hla3``), unnormalized."""
    if rate not in (1, 2):
        raise ValueError(f"rate must be 1 or 2, got {rate!r}")
    if rate != 1 and normalize:
        raise ValueError("normalize needs rate 1 (the ones column of a rate-2 stage is not a column of ones)")


def fwd_launch(q, k, v, g, gamma, s0, w0, z0, *, chunk, segments, warps, block_v, q2=None, k2=None, stages=1,
               outputs=True, normalize=False, eps=0.0, store_final=True, snapshots=None, rate=1,
               output_pass=False, row_blocks=1, two_walks=False, output_block_v=None, launch=launch_kernel):
    """Run the forward walk (after the segment summaries and fold when ``segments > 1``).

    q, k: [B, T, H, K]; q2, k2: [B, T, H, K2] or None (plain HLA2); v: [B, T, H, V]; g: [B, T, H]
    or None; all contiguous. s0, w0, z0: fp32 [B, H, K, K2], [B, H, K, V], [B, H, K] or None.
    outputs: compute o (else only states). normalize: carry z and divide by (den + eps).
    snapshots: None, or the dtype to store every chunk-start state (S, W) in (z, when normalizing,
    in fp32). rate: the inner index's rate c, the weight being exp((1 + c) b_t - b_i - c b_j)
    (1: HLA2; 2: the second-order stage of ``hla3``; ``chunk_kernels._inner_factors``).
    output_pass: with ``outputs``, the walk only carries the state and stores every chunk's start
    state (in ``snapshots``' dtype, or, when none are asked for, in a buffer of the dots' operand
    dtype freed on return), and ``hla2_fwd_output_kernel`` computes every chunk's outputs from
    them at once. row_blocks: the key rows of S and W are split over this many programs of a
    state walk (one without outputs, or with ``output_pass``). two_walks: with ``output_pass``,
    that state walk is ``hla2_fwd_key_walk_kernel`` (S alone, in [BR, BR] blocks) and then
    ``hla2_fwd_value_walk_kernel`` (W and z alone, reading the first walk's S), in one segment.
    output_block_v: the output pass's value block request (None: ``block_v``), at most
    ``bwd_value_width(K)``.
    Returns (o [B, T, H, V] or None, den [B, T, H] fp32 or None, S_T, W_T, z_T or None,
    (cs_s [B*H, NT, K, K2], cs_w [B*H, NT, K, V], cs_z [B*H, NT, K] or None) or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q2, k2, K2, BK = _inner_pair(q, k, q2, k2)
    BH, dev, f32 = B * H, q.device, torch.float32
    BV = value_block(V, block_v, dev)
    NV, NT = cdiv(V, BV), cdiv(T, chunk)
    # the fold's fp32 product of a 128-wide S with C in tf32x3 needs 256 KB of shared memory (past
    # Hopper's 227): such heads walk in one segment (as the backward's walk does, ``bwd_launch``)
    NS, nseg = split_segments(NT, 1 if not fold_fits(BK, q.dtype) else segments)
    _check_rate(rate, normalize)
    flags, lg = _common(q, gamma, g, rate)
    kw = dict(H=H, K=K, K2=K2, V=V, BT=chunk, BK=BK, BV=BV, num_warps=warps, num_stages=stages, **flags)
    h0 = (s0, w0, z0 if normalize else None)
    if s0 is not None and normalize and z0 is None:
        h0 = (s0, w0, torch.zeros(B, H, K, device=dev, dtype=f32))
    if nseg > 1:
        # -- every segment's summary from a zero state, then every segment's start state ----------
        sums = dict(sum_s=torch.empty(BH * nseg, K, K2, device=dev, dtype=f32),
                    sum_w=torch.empty(BH * nseg, K, V, device=dev, dtype=f32),
                    sum_c=torch.empty(BH * nseg, K2, V, device=dev, dtype=f32),
                    sum_z=torch.empty(BH * nseg, K, device=dev, dtype=f32) if normalize else None,
                    sum_cz=torch.empty(BH * nseg, K2, device=dev, dtype=f32) if normalize else None,
                    sum_lr=torch.empty(BH * nseg, device=dev, dtype=f32))
        launch(hla2_fwd_summary_kernel, (NV, nseg, BH), k=k, q2=q2, k2=k2, v=v, g=g, **sums, log_gamma=lg, T=T, NS=NS,
               **kw)
        seg = (torch.empty(BH * nseg, K, K2, device=dev, dtype=f32), torch.empty(BH * nseg, K, V, device=dev, dtype=f32),
               torch.empty(BH * nseg, K, device=dev, dtype=f32) if normalize else None)
        launch(hla2_fwd_fold_kernel, (NV, BH),
            **sums, h0_s=h0[0], h0_w=h0[1], h0_z=h0[2], seg_s=seg[0], seg_w=seg[1], seg_z=seg[2], NSEG=nseg,
            K=K, K2=K2, V=V, BK=BK, BV=BV, PREC=flags["PREC"], RATE=rate, num_warps=warps)
        h0 = seg
    o = torch.empty_like(v) if outputs else None
    den = torch.empty(B, T, H, device=dev, dtype=f32) if (outputs and normalize) else None
    ht = (torch.empty(B, H, K, K2, device=dev, dtype=f32), torch.empty(B, H, K, V, device=dev, dtype=f32),
          torch.empty(B, H, K, device=dev, dtype=f32) if normalize else None) if store_final else (None, None, None)
    split = outputs and output_pass
    BR = _row_block(BK, row_blocks, split or not outputs, dev)
    # the chunk states the walk stores: those asked for, or (split) a buffer of the dots' operand dtype
    held = snapshots if snapshots is not None else ((torch.bfloat16 if bf16_dots(q.dtype) else f32) if split else None)
    cs = None
    if held is not None:
        cs = (torch.empty(BH, NT, K, K2, device=dev, dtype=held),
              torch.empty(BH, NT, K, V, device=dev, dtype=held),
              torch.empty(BH, NT, K, device=dev, dtype=f32) if normalize else None)
    walk_out = (None, None) if split else (o, den)
    if split and two_walks:
        if nseg > 1:
            raise ValueError(f"config.fwd_two_walks needs one forward segment, got {nseg}")
        # -- S alone, then W and z from its stored chunk states ---------------------------------
        launch(hla2_fwd_key_walk_kernel, (BK // BR, BK // BR, BH),
            k=k, k2=k2, g=g, h0_s=h0[0], ht_s=ht[0], cs_s=cs[0], log_gamma=lg, T=T,
            H=H, K=K, K2=K2, BT=chunk, BR=BR, HAS_DECAY=flags["HAS_DECAY"], IS_BF16=flags["IS_BF16"],
            PREC=flags["PREC"], num_warps=warps, num_stages=stages)
        launch(hla2_fwd_value_walk_kernel, (NV * (BK // BR), 1, BH),
            k=k, q2=q2, k2=k2, v=v, g=g, cs_s=cs[0], h0_w=h0[1], h0_z=h0[2], ht_w=ht[1], ht_z=ht[2],
            cs_w=cs[1], cs_z=cs[2], log_gamma=lg, T=T, BR=BR, **kw)
    else:
        launch(hla2_fwd_kernel, (NV * (BK // BR), nseg, BH),
            q=q, k=k, q2=q2, k2=k2, v=v, g=g, o=walk_out[0], den=walk_out[1],
            h0_s=h0[0], h0_w=h0[1], h0_z=h0[2], ht_s=ht[0], ht_w=ht[1], ht_z=ht[2],
            cs_s=None if cs is None else cs[0], cs_w=None if cs is None else cs[1],
            cs_z=None if cs is None else cs[2], log_gamma=lg, eps=eps, T=T, NS=NS, BR=BR, **kw)
    if split:
        # -- every chunk's outputs from its start state, all chunks at once ----------------------
        # (no wider than the backward's value tiles for these keys: 128 columns beside 64-wide key
        # tiles have crashed on CUDA, ``bwd_value_width``)
        BVO = value_block(V, block_v if output_block_v is None else min(output_block_v, bwd_value_width(K)), dev)
        launch(hla2_fwd_output_kernel, (cdiv(V, BVO), NT, BH),
            q=q, k=k, q2=q2, k2=k2, v=v, g=g, o=o, den=den, cs_s=cs[0], cs_w=cs[1], cs_z=cs[2],
            log_gamma=lg, eps=eps, T=T, **dict(kw, BV=BVO))
    return o, den, ht[0], ht[1], ht[2], cs if snapshots is not None else None


def forward_layout(cfg: ChunkConfig) -> dict:
    """``fwd_launch``'s layout keywords for a call's forward in ``cfg``: chunk, segments, warps,
    value block, stages and the split (``fwd_output_pass``, ``fwd_row_blocks``, ``fwd_two_walks``,
    ``fwd_output_block_v``)."""
    return dict(chunk=cfg.fwd_chunk, segments=cfg.fwd_segments, warps=cfg.fwd_warps, block_v=cfg.fwd_block_v,
                stages=cfg.fwd_stages, output_pass=cfg.fwd_output_pass, row_blocks=cfg.fwd_row_blocks,
                two_walks=cfg.fwd_two_walks, output_block_v=cfg.fwd_output_block_v)


def _row_block(BK: int, row_blocks: int, state_walk: bool, device: torch.device) -> int:
    """Key rows of S and W one walk program carries: BK / row_blocks. Only a state walk (no
    outputs, or outputs in their own pass) splits them, into blocks no narrower than the device's
    narrowest key tile (``min_key_block``: 64 on CUDA, where narrower tiles have crashed, 16, a
    dot's smallest tile, under the interpreter)."""
    if row_blocks == 1:
        return BK
    if not state_walk:
        raise ValueError(f"config.fwd_row_blocks={row_blocks} needs config.fwd_output_pass (a walk that computes "
                         f"outputs carries every key row)")
    least = min_key_block(device)
    if BK // row_blocks < least:
        raise ValueError(f"config.fwd_row_blocks={row_blocks} cuts a key tile of {BK} into blocks of "
                         f"{BK // row_blocks} rows; blocks need at least {least} on {device.type}")
    return BK // row_blocks


def _value_split(fn, v, do, w0, dht_w, width):
    """Run ``fn`` per value block of at most ``width`` columns (the operator is linear in v) and
    combine: sums for the q, k and state-S gradients and db, concatenation for dv and dW0; the
    first block alone carries what is not per column (dS_T, and a normalized call's ones column,
    whose dz0 it returns)."""
    outs = []
    for j, (a, b) in enumerate(even_blocks(v.shape[-1], width)):
        outs.append(fn(v[..., a:b].contiguous(), do[..., a:b].contiguous(),
                       None if w0 is None else w0[..., a:b].contiguous(),
                       None if dht_w is None else dht_w[..., a:b].contiguous(), j == 0))

    def total(i):
        return None if outs[0][i] is None else sum(o[i] for o in outs)

    def cat(i):
        return None if outs[0][i] is None else torch.cat([o[i] for o in outs], -1)

    return total(0), total(1), total(2), total(3), cat(4), total(5), cat(6), total(7), outs[0][8]


def bwd_launch(q, k, v, do, g, gamma, s0, w0, dht_s, dht_w, cfg: ChunkConfig, *, q2=None, k2=None,
               states=None, want_db=False, dd=None, z0=None, dht_z=None, rate=1, launch=launch_kernel):
    """Gradients of the unnormalized (cross) operator, on the value [v | 1] when ``dd`` is given.

    q, k: [B, T, H, K]; q2, k2: [B, T, H, K2] or None; v, do: [B, T, H, V]; g: [B, T, H] or None;
    s0, w0: initial state or None; dht_s [B, H, K, K2], dht_w [B, H, K, V]: gradient of the final
    state or None. states: the chunk-start snapshots (cs_s, cs_w, cs_z) a forward with chunk
    ``cfg.bwd_chunk`` stored, or None to recompute them. want_db: also return dL/db [B, T, H] fp32
    (without the final state's share).
    dd: None, or the output gradient [B, T, H] fp32 of a column of ones appended to v (a normalized
    call's denominator, not a cross pair): the kernels carry that column's state z beside W (z0
    [B, H, K] fp32 or None its start, dht_z its final gradient or None) instead of a value block.
    rate: as ``fwd_launch``'s.
    Returns dq, dk, dq2, dk2 (None unless cross; input dtypes), dv, dS0, dW0 (fp32, None without
    s0), db (or None), dz0 (fp32; None without s0 or dd)."""
    V = v.shape[-1]
    width = _bwd_width(q, q2)
    norm = dd is not None
    if norm and q2 is not None:
        raise ValueError("a normalized backward (dd) needs the plain operator, not a cross pair")
    if V > width:
        def block(vb, dob, w0b, dhtb, first):
            return bwd_launch(q, k, vb, dob, g, gamma, s0, w0b, dht_s if first else None, dhtb, cfg,
                              q2=q2, k2=k2, want_db=want_db, dd=dd if first else None, z0=z0 if first else None,
                              dht_z=dht_z if first else None, rate=rate, launch=launch)
        return _value_split(block, v, do, w0, dht_w, width)
    B, T, H, K = q.shape
    cross = q2 is not None
    q2, k2, K2, BK = _inner_pair(q, k, q2, k2)
    BH, dev, f32 = B * H, q.device, torch.float32
    BT, nw = cfg.bwd_chunk, cfg.bwd_warps
    BV = pow2_block(V, min_value_block(dev))
    NT = cdiv(T, BT)
    snap = snapshot_dtype(cfg, q.dtype)
    if states is None or states[0].dtype != snap:
        states = fwd_launch(q, k, v, g, gamma, s0, w0, z0, chunk=BT, segments=cfg.fwd_segments, warps=nw,
                            block_v=cfg.fwd_block_v, q2=q2, k2=k2, stages=cfg.bwd_stages, outputs=False,
                            normalize=norm, store_final=False, snapshots=snap, rate=rate, launch=launch)[5]
    cs_s, cs_w, cs_z = states
    do = do.contiguous()
    flags, lg = _common(q, gamma, g, rate)
    common = dict(H=H, K=K, K2=K2, V=V, BT=BT, BK=BK, BV=BV, num_warps=nw, num_stages=cfg.bwd_stages, **flags)
    has_dht = dht_s is not None or dht_w is not None or (norm and dht_z is not None)
    if has_dht:
        dht_s = torch.zeros(B, H, K, K2, device=dev, dtype=f32) if dht_s is None else dht_s.float().contiguous()
        dht_w = torch.zeros(B, H, K, V, device=dev, dtype=f32) if dht_w is None else dht_w.float().contiguous()
    if has_dht and norm:
        dht_z = torch.zeros(B, H, K, device=dev, dtype=f32) if dht_z is None else dht_z.float().contiguous()
    else:
        dht_z = None

    def z_buf(*shape):   # the ones column's state gradient (normalized calls only)
        return torch.empty(*shape, K, device=dev, dtype=f32) if norm else None

    dh0 = ((torch.empty(B, H, K, K2, device=dev, dtype=f32), torch.empty(B, H, K, V, device=dev, dtype=f32),
            z_buf(B, H)) if s0 is not None else (None, None, None))
    # segments cannot fold 128 x 128 fp32 products in shared memory: such heads walk in one
    NS, nseg = split_segments(NT, 1 if (BK > 64 and BV > 64) else cfg.bwd_segments)
    ones = (None, None)
    if norm:   # the ones column's vectors per chunk for the walks (Q^T gl only for segment summaries)
        ones = (torch.empty(BH, NT, K, device=dev, dtype=f32),
                torch.empty(BH, NT, K, device=dev, dtype=f32) if nseg > 1 else None)
        launch(hla2_bwd_ones_kernel, (NT, BH), q=q, g=g, dd=dd, ones_u=ones[0], ones_w=ones[1], log_gamma=lg, T=T,
               H=H, K=K, BT=BT, BK=BK, HAS_DECAY=flags["HAS_DECAY"], RATE=rate, num_warps=4)
    de = (dht_s, dht_w, dht_z) if has_dht else (None, None, None)
    walk_dh0 = dh0
    if nseg > 1:
        # -- backward summaries of the segments from a zero end gradient, folded last to first -----
        sum_s = torch.empty(BH * nseg, K, K2, device=dev, dtype=f32)
        sum_w = torch.empty(BH * nseg, K, V, device=dev, dtype=f32)
        sum_z = z_buf(BH * nseg)
        sum_p = torch.empty(BH * nseg, V, K2, device=dev, dtype=f32)
        sum_pz = torch.empty(BH * nseg, K2, device=dev, dtype=f32) if norm else None
        sum_lr = torch.empty(BH * nseg, device=dev, dtype=f32)
        launch(hla2_bwd_state_kernel, (nseg, BH),
            q=q, q2=q2, v=v, do=do, g=g, dd=dd, ones_u=ones[0], ones_w=ones[1], ds_end=sum_s, dw_end=sum_w,
            dz_end=sum_z, de_s=None, de_w=None, de_z=None, dh0_s=None, dh0_w=None, dh0_z=None,
            sum_p=sum_p, sum_pz=sum_pz, sum_lr=sum_lr, log_gamma=lg, T=T, NS=NS, C0=0, NP=NT, **common)
        de = (torch.empty(BH * nseg, K, K2, device=dev, dtype=f32), torch.empty(BH * nseg, K, V, device=dev, dtype=f32),
              z_buf(BH * nseg))
        launch(hla2_bwd_fold_kernel, (BH,),
            sum_s=sum_s, sum_w=sum_w, sum_z=sum_z, sum_p=sum_p, sum_pz=sum_pz, sum_lr=sum_lr,
            dht_s=dht_s if has_dht else None, dht_w=dht_w if has_dht else None, dht_z=dht_z,
            de_s=de[0], de_w=de[1], de_z=de[2], dh0_s=dh0[0], dh0_w=dh0[1], dh0_z=dh0[2], NSEG=nseg,
            K=K, K2=K2, V=V, BK=BK, BV=BV, PREC=flags["PREC"], RATE=rate, num_warps=nw)
        walk_dh0 = (None, None, None)
    # -- the walk (every chunk's end-state gradient), then every chunk's gradients in the launches
    #    the config names; piece by piece, the last first, each walk starting from the gradient
    #    the later piece left at its start --------------------------------------------------------
    starts, NP = backward_pieces(NT, cfg.bwd_pieces)   # one piece when segmented (ChunkConfig)
    ds_end = torch.empty(BH, NP, K, K2, device=dev, dtype=cs_s.dtype)
    dw_end = torch.empty(BH, NP, K, V, device=dev, dtype=cs_w.dtype)
    dz_end = z_buf(BH, NP)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq2 = torch.empty_like(q2) if cross else dq
    dk2 = torch.empty_like(k2) if cross else dk
    db = torch.empty(len(cfg.grad_parts), B, T, H, device=dev, dtype=f32) if want_db else None

    def pair(zero):   # a state gradient (dS, dW, dz): dz only when normalizing
        new = torch.zeros if zero else torch.empty
        return (new(BH, K, K2, device=dev, dtype=f32), new(BH, K, V, device=dev, dtype=f32),
                new(BH, K, device=dev, dtype=f32) if norm else None)

    def step(c0, n, end_grad, start_grad):
        launch(hla2_bwd_state_kernel, (nseg, BH),
            q=q, q2=q2, v=v, do=do, g=g, dd=dd, ones_u=ones[0], ones_w=ones[1], ds_end=ds_end, dw_end=dw_end,
            dz_end=dz_end, de_s=end_grad[0], de_w=end_grad[1], de_z=end_grad[2],
            dh0_s=start_grad[0], dh0_w=start_grad[1], dh0_z=start_grad[2], sum_p=None, sum_pz=None, sum_lr=None, log_gamma=lg, T=T, NS=NS,
            C0=c0, NP=NP, **common)
        for i, parts in enumerate(cfg.grad_parts):
            launch(hla2_bwd_grad_kernel, (n, BH),
                q=q, k=k, q2=q2, k2=k2, v=v, do=do, g=g, dd=dd, dq=dq, dk=dk, dq2=dq2, dk2=dk2, dv=dv,
                db=None if db is None else db[i], cs_s=cs_s, cs_w=cs_w, cs_z=cs_z, ds_end=ds_end, dw_end=dw_end,
                dz_end=dz_end, log_gamma=lg, T=T, C0=c0, NP=NP, CROSS=cross, PARTS=parts, **common)

    run_pieces(starts, NP, NT, de, walk_dh0, pair, step)
    return (dq, dk, dq2 if cross else None, dk2 if cross else None, dv, dh0[0], dh0[1],
            summed_shares(db), dh0[2])


class HLA2ChunkFunction(torch.autograd.Function):
    """Autograd of one tile-able (cross) HLA2 on the Triton kernels.

    forward(q [B,T,H,K], k, q2 [B,T,H,K2] | None, k2 | None, v [B,T,H,V], g [B,T,H] | None,
    s0 [B,H,K,K2] | None, w0 [B,H,K,V] | None, z0 [B,H,K] | None, gamma, normalize, eps, cfg, rate,
    launch) -> (o [B,T,H,V], S_T [B,H,K,K2], W_T [B,H,K,V], z_T [B,H,K] | None). Normalization only
    without a cross pair and at rate 1 (``fwd_launch``). The backward is not itself differentiable
    (it raises if asked)."""

    @staticmethod
    def forward(ctx, q, k, q2, k2, v, g, s0, w0, z0, gamma, normalize, eps, cfg, rate, launch):
        # an output the loss does not use gets None, not a materialized zero tensor (the final
        # state's cotangents are [B, H, K, K]-sized: zeros would cost memory and a walk from zero)
        ctx.set_materialize_grads(False)
        V = v.shape[-1]
        grads = any(ctx.needs_input_grad[:9])
        save = grads and keeps_states(cfg, q, q2, V)
        snap = snapshot_dtype(cfg, q.dtype) if save else None
        o, den, sT, wT, zT, cs = fwd_launch(
            q, k, v, g, gamma, s0, w0, z0, q2=q2, k2=k2, normalize=normalize, eps=eps, snapshots=snap, rate=rate,
            launch=launch, **forward_layout(cfg))
        cs = (None, None, None) if cs is None else cs
        # the final state is read back only for the log-gates' gradient (its own factor e^{b_T})
        final = (sT, wT, zT) if g is not None and ctx.needs_input_grad[5] else (None, None, None)
        ctx.save_for_backward(q, k, q2, k2, v, g, s0, w0, z0, o if normalize else None, den, *final, *cs)
        ctx.gamma, ctx.normalize, ctx.eps, ctx.cfg, ctx.rate, ctx.launch = gamma, normalize, eps, cfg, rate, launch
        return o, sT, wT, zT

    @staticmethod
    @kernel_backward
    def backward(ctx, do, dsT, dwT, dzT):
        q, k, q2, k2, v, g, s0, w0, z0, o, den, sT, wT, zT, cs_s, cs_w, cs_z = ctx.saved_tensors
        want_dg = g is not None and ctx.needs_input_grad[5]
        if do is None:
            do = torch.zeros_like(v)
        dd = None
        if ctx.normalize:
            # o = num / (den + eps): the unnormalized operator on [v | 1] (the kernels carry the ones
            # column as z beside W) with output gradient [do / d | dd], dd = -(do . o) / d
            do, dd = normalized_output_grad(do, o, den, ctx.eps, launch=ctx.launch)
        dq, dk, dq2, dk2, dv, ds0, dw0, db, dz0 = bwd_launch(
            q, k, v, do, g, ctx.gamma, s0, w0, dsT, dwT, ctx.cfg, q2=q2, k2=k2,
            states=None if cs_s is None else (cs_s, cs_w, cs_z), want_db=want_dg, dd=dd, z0=z0,
            dht_z=dzT if ctx.normalize else None, rate=ctx.rate, launch=ctx.launch)
        dg = None
        if want_dg:
            # the final state S_T carries exp(b_T - b_i), W_T and z_T exp((1 + c) b_T - b_i - c b_j)
            # (c = rate): their share of dL/db_T
            c1 = 1 + ctx.rate
            dg = log_gate_grad(db, ((sT, dsT, 1.0), (wT, dwT, c1), (zT, dzT, c1)), g.dtype)
        return dq, dk, dq2, dk2, dv, dg, ds0, dw0, dz0, None, None, None, None, None, None


def outer_decay(g, gamma, rate):
    """The outer layer's decay: the call's log-gates (its GateSums, whose sums it shares) or gamma at
    1 + rate times (its weight exp((1 + c)(b_t - b_j)) for the inner index's rate c). Every caller
    (the layers' Functions here and HLA3's) passes a GateSums or None."""
    return (None if g is None else g.scaled(1 + rate)), (None if gamma is None else gamma ** (1 + rate))


def transposed(x):
    """x^T over the last two dims, contiguous (None stays None). S is symmetric whenever it is a
    sum of k k^T, but an initial state need not be: the inner layer reads q^T S0, HLA2 S0 q."""
    return None if x is None else x.transpose(-1, -2).contiguous()


def layers_fwd(q, k, v, g, gamma, s0t, w0, cfg: ChunkConfig, rate, keep, launch):
    """HLA2's forward as two first-order layers (:class:`HLA2LayersFunction`): K' = LA(Q, K, K; g)
    from S0^T (``s0t``; the inner layer reads q^T S), then O = LA(Q, K', V; (1 + rate) g) from W0.
    keep: also both layers' chunk-start states at ``cfg.fwd_chunk`` for :func:`layers_bwd`.
    Returns (o [B,T,H,V] in v's dtype, S_T, W_T fp32, K' [B,T,H,K] in q's dtype, cs_s, cs_w (each
    [B*H, NT, K, .] or None))."""
    # -- inner layer: K' = LA(Q, K, K) from S0 ---------------------------------------------------
    kp, sT, cs_s = layer_fwd(q, k, k, g, gamma, s0t, cfg, keep_states=keep, launch=launch)
    o, wT, cs_w = outer_layer_fwd(q, kp, v, g, gamma, w0, cfg, rate, keep, launch)
    return o, transposed(sT), wT, kp, cs_s, cs_w


def outer_layer_fwd(q, kp, v, g, gamma, w0, cfg: ChunkConfig, rate, keep, launch):
    """The outer layer of :func:`layers_fwd`, O = LA(Q, K', V; (1 + rate) g) from W0 (``layer_fwd``'s
    returns: o, W_T, cs_w or None)."""
    g_out, gamma_out = outer_decay(g, gamma, rate)
    return layer_fwd(q, kp, v, g_out, gamma_out, w0, cfg, keep_states=keep, launch=launch)


def recompute_layout(cfg: ChunkConfig) -> ChunkConfig:
    """The layout in which a layers' backward recomputes the chunk-start states its forward did not
    keep: the forward walk at the backward's chunk and warps, one pipeline stage."""
    return cfg.replace(fwd_chunk=cfg.bwd_chunk, fwd_warps=cfg.bwd_warps, fwd_stages=1)


def layers_bwd(q, k, v, kp, do, g, gamma, s0t, w0, cs_s, cs_w, dsT, dwT, cfg: ChunkConfig, rate, want_db, launch,
               norm=None):
    """The backward of :func:`layers_fwd`: its inputs, K' and its kept states (or None: both
    layers' are recomputed at ``cfg.bwd_chunk``), the cotangents do [B,T,H,V] and dsT, dwT (fp32 or
    None). The outer layer's first-order backward gives dv, dq, dK'; the inner's, from dK' as its
    output gradient, adds its dq to the outer's and the gradient through its value slot to dk
    (``ahla.chunk.layer_bwd``). Returns (dq, dk, dv, dS0, dW0 (None without an initial state),
    db [B, T, H] fp32, None unless ``want_db``, dz0): dL/db per token without the final states' share,
    (1 + c) times the outer layer's q.dq - K'.dK' plus the inner's q.dq - k.dk (each layer is the
    ungated one on e^{cb} q, e^{-cb} k). HLA3 runs this at rate 2 for its second stage.

    norm: None, or a normalized outer layer's (dd, cs_z, dzT, z0, eps) (:class:`HLA2LayersFunction`):
    do is then the numerator's gradient and dd [B, T, H] fp32 the denominator's, cs_z the outer
    layer's chunk-start z (or None with cs_w), dzT z_T's gradient or None, z0 the initial z (fp32
    [B, H, K]) or None; dz0 (None otherwise) is z0's gradient."""
    g_out, gamma_out = outer_decay(g, gamma, rate)
    dd, cs_z, dzT, z0, eps = (None,) * 5 if norm is None else norm
    if cs_s is None:
        # the forward kept no states (or walked other chunks): both layers' at the backward's chunk
        again = recompute_layout(cfg)
        cs_s = layer_fwd(q, k, k, g, gamma, s0t, again, keep_states=True, launch=launch)[2]
        if norm is None:
            cs_w = layer_fwd(q, kp, v, g_out, gamma_out, w0, again, keep_states=True, launch=launch)[2]
        else:
            cs_w, cs_z = normalized_layer_fwd(q, kp, v, g_out, gamma_out, w0, z0, eps, again, keep_states=True,
                                              launch=launch)[4:]
    # -- outer layer: dv, dq, dK' (and its share of dL/db at rate 1 + c) --------------------------
    dz0 = None
    if norm is None:
        dv, dq, dkp, dw0, db_out = layer_bwd(q, kp, v, do.contiguous(), g_out, gamma_out, cs_w, dwT, w0 is not None,
                                             cfg, want_db=want_db, db_own=True, launch=launch)
    else:   # on [v | 1]: the ones column as z beside W
        dv, dq, dkp, dw0, dz0, db_out = normalized_layer_bwd(
            q, kp, v, do.contiguous(), dd, g_out, gamma_out, cs_w, cs_z, dwT, dzT, w0 is not None, cfg,
            want_db=want_db, launch=launch)
    # -- inner layer from dK': dq added to the outer's, dk with its value slot's ------------------
    _, dq, dk, ds0, db_in = layer_bwd(q, k, k, dkp, g, gamma, cs_s, transposed(dsT), s0t is not None, cfg, dq_in=dq,
                                      want_db=want_db, db_own=True, x_is_k=True, launch=launch)
    db = db_in + (1 + rate) * db_out if want_db else None
    return dq, dk, dv, transposed(ds0), dw0, db, dz0


def key_blocks(K: int):
    """Bounds of the key blocks a first-order layer over K key features runs in: one up to TILE_MAX
    (the widest key tile a layer kernel holds), else the fewest blocks at most TILE_MAX wide, as
    even as possible."""
    return [(0, K)] if K <= TILE_MAX else even_blocks(K, TILE_MAX)


def _rows(x, a0, a1):
    """Rows a0:a1 of a state [B, H, K, .] (contiguous), or None."""
    return None if x is None else x[..., a0:a1, :].contiguous()


def _summed(parts):
    """The sum of same-shaped tensors (a contiguous tensor in their dtype)."""
    out = parts[0] + parts[1] if len(parts) > 1 else parts[0].contiguous()
    for x in parts[2:]:
        out += x
    return out


def key_block_layers_fwd(q, k, v, g, gamma, s0t, w0, cfg: ChunkConfig, rate, keep, launch):
    """:func:`layers_fwd` for keys wider than TILE_MAX, in key blocks (:func:`key_blocks`).
    First-order attention is a sum over its key features, LA(Q, K, X) = sum_a LA(Q_a, K_a, X) with
    Q_a, K_a the columns of block a, and the layer's state is the blocks' states stacked by rows
    (P_a = sum k_a x^T). So the inner layer is K' = sum_b LA(Q_b, K_b, K) (values: all of K; state
    S^T's rows b), and the outer O = sum_a LA(Q_a, K'_a, V) (state W's rows a): 2 x (number of
    blocks) launches of the same first-order walk, each with a key tile of at most TILE_MAX.
    Returns (o, S_T, W_T, qs, ks, kps (each block's columns of q, k, K', contiguous), cs_s, cs_w
    (lists over the blocks, or of None))."""
    blocks = key_blocks(q.shape[-1])
    qs = [q[..., a0:a1].contiguous() for a0, a1 in blocks]
    ks = [k[..., a0:a1].contiguous() for a0, a1 in blocks]
    # -- inner layer, block b: Y_b = LA(Q_b, K_b, K) from S0^T's rows b; K' = sum_b Y_b ----------------
    inner = [layer_fwd(qb, kb, k, g, gamma, _rows(s0t, b0, b1), cfg, keep_states=keep, launch=launch)
             for qb, kb, (b0, b1) in zip(qs, ks, blocks)]
    kps = [_summed([y[..., a0:a1] for y, _, _ in inner]) for a0, a1 in blocks]
    # -- outer layer, block a: LA(Q_a, K'_a, V) from W0's rows a; O is their sum ----------------------
    outer = [outer_layer_fwd(qa, kpa, v, g, gamma, _rows(w0, a0, a1), cfg, rate, keep, launch)
             for qa, kpa, (a0, a1) in zip(qs, kps, blocks)]
    o = _summed([x for x, _, _ in outer])
    sT = transposed(torch.cat([s for _, s, _ in inner], -2))
    wT = torch.cat([w for _, w, _ in outer], -2)
    return o, sT, wT, qs, ks, kps, [cs for _, _, cs in inner], [cs for _, _, cs in outer]


def key_block_layers_bwd(qs, ks, k, v, kps, do, g, gamma, s0t, w0, cs_s, cs_w, dsT, dwT, cfg: ChunkConfig, rate,
                         want_db, launch):
    """The backward of :func:`key_block_layers_fwd` from its blocks (qs, ks, kps), k, v, the kept
    states (lists over the blocks, or None: recomputed at ``cfg.bwd_chunk``) and the cotangents
    do, dsT, dwT: each block's first-order backward, the outer layer's first. The outer blocks
    give dv (summed), dq's blocks and dK' (their columns side by side), the inner layer's output
    gradient; the inner blocks add their dq to the outer's, give dk's blocks and, through their
    value slot, a gradient for all of k (summed into dk). Returns as :func:`layers_bwd` (dz0 None)."""
    blocks = key_blocks(k.shape[-1])
    g_out, gamma_out = outer_decay(g, gamma, rate)
    if cs_s is None:
        # the forward kept no states (or walked other chunks): both layers' at the backward's chunk
        again = recompute_layout(cfg)
        cs_s = [layer_fwd(qb, kb, k, g, gamma, _rows(s0t, b0, b1), again, keep_states=True, launch=launch)[2]
                for qb, kb, (b0, b1) in zip(qs, ks, blocks)]
        cs_w = [layer_fwd(qa, kpa, v, g_out, gamma_out, _rows(w0, a0, a1), again, keep_states=True, launch=launch)[2]
                for qa, kpa, (a0, a1) in zip(qs, kps, blocks)]
    do = do.contiguous()
    # -- outer layer, block a: dv's share, dq_a, dK'_a ----------------------------------------------
    outer = [layer_bwd(qa, kpa, v, do, g_out, gamma_out, cs, _rows(dwT, a0, a1), w0 is not None, cfg,
                       want_db=want_db, db_own=True, launch=launch)
             for qa, kpa, cs, (a0, a1) in zip(qs, kps, cs_w, blocks)]
    dkp = torch.cat([x[2] for x in outer], -1)
    # -- inner layer, block b, from dK': dq_b added to the outer's, dk_b, and dk's share as values ----
    dsTt = transposed(dsT)
    inner = [layer_bwd(qb, kb, k, dkp, g, gamma, cs, _rows(dsTt, b0, b1), s0t is not None, cfg, dq_in=dqa[1],
                       want_db=want_db, db_own=True, launch=launch)
             for qb, kb, cs, dqa, (b0, b1) in zip(qs, ks, cs_s, outer, blocks)]
    dq = torch.cat([x[1] for x in inner], -1)
    dk = _summed([torch.cat([x[2] for x in inner], -1)] + [x[0] for x in inner])
    ds0 = None if s0t is None else transposed(torch.cat([x[3] for x in inner], -2))
    dw0 = None if w0 is None else torch.cat([x[3] for x in outer], -2)
    db = _summed([x[4] for x in inner]) + (1 + rate) * _summed([x[4] for x in outer]) if want_db else None
    return dq, dk, _summed([x[0] for x in outer]), ds0, dw0, db, None


def _layers_gate_grad(db, sT, dsT, wT, dwT, zT, dzT, rate, dtype):
    """dL/dg of the layers from their per-token db and the final states' share: S_T carries
    exp(b_T - b_i), W_T and z_T exp((1 + c) b_T - b_i - c b_j) (c = rate)."""
    c1 = 1.0 + rate
    return log_gate_grad(db, ((sT, dsT, 1.0), (wT, dwT, c1), (zT, dzT, c1)), dtype)


class HLA2KeyBlockLayersFunction(torch.autograd.Function):
    """Autograd of HLA2 as first-order layers for keys wider than TILE_MAX, in key blocks
    (:func:`key_block_layers_fwd`, :func:`key_block_layers_bwd`); unnormalized (a normalized call
    runs it on [v | 1] and divides, :func:`hla2_chunked`: a block's layer would divide by its own
    share of the denominator).

    forward(q [B,T,H,K], k, v [B,T,H,V], g [B,T,H] | None, s0 [B,H,K,K] | None, w0 [B,H,K,V] | None,
    gamma, cfg, rate, launch) -> (o [B,T,H,V] in v's dtype, S_T, W_T fp32). The forward keeps the
    blocks of q, k and K' (in q's dtype) and, for the backward, each block's chunk-start states.
    The backward is not itself differentiable (it raises if asked)."""

    @staticmethod
    def forward(ctx, q, k, v, g, s0, w0, gamma, cfg, rate, launch):
        ctx.set_materialize_grads(False)
        keep = any(ctx.needs_input_grad[:6]) and cfg.keeps_states
        s0t = transposed(s0)   # the inner layer's state is S^T: it reads q^T S
        sums = None if g is None else GateSums(g, launch=launch)   # every block's walks share the sums
        o, sT, wT, qs, ks, kps, cs_s, cs_w = key_block_layers_fwd(q, k, v, sums, gamma, s0t, w0, cfg, rate, keep,
                                                                  launch)
        final = (sT, wT) if g is not None and ctx.needs_input_grad[3] else (None, None)
        ctx.n = len(qs)
        ctx.save_for_backward(k, v, g, s0t, w0, *final, *qs, *ks, *kps, *(cs_s if keep else []), *(cs_w if keep else []))
        ctx.keep, ctx.gamma, ctx.cfg, ctx.rate, ctx.launch, ctx.sums = keep, gamma, cfg, rate, launch, sums
        return o, sT, wT

    @staticmethod
    @kernel_backward
    def backward(ctx, do, dsT, dwT):
        k, v, g, s0t, w0, sT, wT, *blocks = ctx.saved_tensors
        n = ctx.n
        qs, ks, kps = blocks[:n], blocks[n:2 * n], blocks[2 * n:3 * n]
        cs_s, cs_w = (blocks[3 * n:4 * n], blocks[4 * n:]) if ctx.keep else (None, None)
        want_dg = g is not None and ctx.needs_input_grad[3]
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, ds0, dw0, db, _ = key_block_layers_bwd(qs, ks, k, v, kps, do, ctx.sums, ctx.gamma, s0t, w0, cs_s,
                                                           cs_w, dsT, dwT, ctx.cfg, ctx.rate, want_dg, ctx.launch)
        dg = _layers_gate_grad(db, sT, dsT, wT, dwT, None, None, ctx.rate, g.dtype) if want_dg else None
        return dq, dk, dv, dg, ds0, dw0, None, None, None, None


class HLA2LayersFunction(torch.autograd.Function):
    """Autograd of HLA2 as two first-order layers (``ChunkConfig.layers``). With gated linear
    attention LA(Q, K, X; c g)_t = sum_{j <= t} exp(c (b_t - b_j)) (q_t . k_j) x_j, HLA2's weight
    splits at the inner index j,

        exp((1 + c) b_t - b_i - c b_j) = exp((1 + c)(b_t - b_j)) exp(b_j - b_i),

    so o = LA(Q, K', V; (1 + c) g) with K'_j = sum_{i <= j} exp(b_j - b_i) (q_j . k_i) k_i =
    S_j q_j = LA(Q, K, K; g)_j: the inner layer's state is HLA2's S, the outer's W (c = rate, 1
    for HLA2). The forward runs AHLA's single-layer walk twice (:func:`layers_fwd`) and keeps
    K' (in q's dtype) and, for the backward, both layers' chunk-start states; the backward runs the
    two layers' first-order backwards, the outer first (:func:`layers_bwd`). dL/db is theirs plus
    the final states' share.

    Normalized (rate 1), the outer layer divides by its own denominator, the outer layer on a
    column of ones, LA(Q, K', 1)_t = q_t . z_t with z_t = sum_{j <= t} exp(2 (b_t - b_j)) K'_j: the
    walk carries z beside W, or with ``cfg.fwd_den_pass`` reads z's part from before each chunk from
    passes of its own (``common/denominator.py``), and forms the denominator from the chunk's A
    row sums (``ahla.chunk.normalized_layer_fwd``); the backward takes the numerator's and the denominator's
    gradients (``common.normalize``) through the same walks, the ones column as vectors
    (``ahla.chunk.normalized_layer_bwd``).

    forward(q [B,T,H,K], k, v [B,T,H,V], g [B,T,H] | None, s0 [B,H,K,K] | None, w0 [B,H,K,V] | None,
    z0 [B,H,K] | None, gamma, normalize, eps, cfg, rate, launch) -> (o [B,T,H,V] in v's dtype, S_T,
    W_T fp32, z_T fp32 [B,H,K] or None (unnormalized)). The backward is not itself differentiable
    (it raises if asked)."""

    @staticmethod
    def forward(ctx, q, k, v, g, s0, w0, z0, gamma, normalize, eps, cfg, rate, launch):
        ctx.set_materialize_grads(False)
        grads = any(ctx.needs_input_grad[:7])
        keep = grads and cfg.keeps_states
        s0t = transposed(s0)   # the inner layer's state is S^T: it reads q^T S
        sums = None if g is None else GateSums(g, launch=launch)   # both layers' sums, shared with the backward
        den = zT = cs_z = None
        if normalize:   # (rate 1: checked by _layers_call)
            kp, sT, cs_s = layer_fwd(q, k, k, sums, gamma, s0t, cfg, keep_states=keep, launch=launch)
            g_out, gamma_out = outer_decay(sums, gamma, rate)
            o, den, wT, zT, cs_w, cs_z = normalized_layer_fwd(q, kp, v, g_out, gamma_out, w0, z0, eps, cfg,
                                                              keep_states=keep, launch=launch)
            sT = transposed(sT)
        else:
            o, sT, wT, kp, cs_s, cs_w = layers_fwd(q, k, v, sums, gamma, s0t, w0, cfg, rate, keep, launch)
        final = (sT, wT, zT) if g is not None and ctx.needs_input_grad[3] else (None, None, None)
        ctx.save_for_backward(q, k, v, g, s0t, w0, z0, kp, o if normalize else None, den, *final, cs_s, cs_w, cs_z)
        ctx.gamma, ctx.normalize, ctx.eps, ctx.cfg, ctx.rate, ctx.launch = gamma, normalize, eps, cfg, rate, launch
        ctx.sums = sums
        return o, sT, wT, zT

    @staticmethod
    @kernel_backward
    def backward(ctx, do, dsT, dwT, dzT):
        q, k, v, g, s0t, w0, z0, kp, o, den, sT, wT, zT, cs_s, cs_w, cs_z = ctx.saved_tensors
        want_dg = g is not None and ctx.needs_input_grad[3]
        if do is None:
            do = torch.zeros_like(v)
        norm = None
        if ctx.normalize:
            # o = num / (den + eps): the numerator's gradient do / d and the denominator's dd
            do, dd = normalized_output_grad(do, o, den, ctx.eps, launch=ctx.launch)
            norm = (dd, cs_z, dzT, z0, ctx.eps)
        dq, dk, dv, ds0, dw0, db, dz0 = layers_bwd(q, k, v, kp, do, ctx.sums, ctx.gamma, s0t, w0, cs_s, cs_w, dsT, dwT,
                                                   ctx.cfg, ctx.rate, want_dg, ctx.launch, norm=norm)
        dg = _layers_gate_grad(db, sT, dsT, wT, dwT, zT, dzT, ctx.rate, g.dtype) if want_dg else None
        return dq, dk, dv, dg, ds0, dw0, dz0, None, None, None, None, None, None


def _layers_call(q, k, v, g, gamma, s0, w0, z0, normalize, eps, cfg, rate, launch):
    """HLA2 as first-order layers (:class:`HLA2LayersFunction`; normalized in the kernels, z beside
    W), for keys of at most TILE_MAX. Returns as :func:`hla2_chunked`."""
    _check_rate(rate, normalize)
    return HLA2LayersFunction.apply(q, k, v, g, s0, w0, z0 if normalize else None, gamma, normalize, eps, cfg, rate,
                                    launch)


def _feature_blocks(K):
    """Bounds of feature blocks at most FEATURE_BLOCK wide, as even as possible (one block when
    K <= TILE_MAX)."""
    return [(0, K)] if K <= TILE_MAX else even_blocks(K, FEATURE_BLOCK)


def hla2_chunked(q, k, v, g, gamma, s0, w0, z0, normalize, eps, config=None, chunk_size=None, rate=1, launch=None):
    """HLA2 on the Triton kernels, any head size up to 256 (through the checks).

    q, k: [B, T, H, K]; v: [B, T, H, V] (contiguous); g: [B, T, H] or None; s0, w0, z0: fp32
    state or None; config: a ChunkConfig for every launch, or None for ``hla2_config``'s rule
    (for the head, or for each feature-block pair's width). rate: the inner index's rate
    (``fwd_launch``; 2 for the second-order stage of ``hla3``). launch: how
    kernels are launched (``common.compile``); None launches them, after compiling a new call's
    kernels at once (``compile_ahead``).
    Returns (o [B, T, H, V], S_T, W_T, z_T or None).

    A head wider than TILE_MAX runs as first-order layers in key blocks where the config says
    ``layers`` (:func:`key_block_layers_fwd`), else as the sum over feature-block pairs (a, b) of
    the cross operator; the pair's state is S[a, b] and its share of W's rows a (W's rows a are the
    sum over b). Normalized, either runs on [v | 1] and the quotient is taken at the end."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if config is not None and config.layers:
        refuse_shared_walk(config, "hla2")
    elif config is not None:
        refuse_ahla_fields(config, "hla2")
    if launch is None:
        args = (q, k, v, g, gamma, s0, w0, z0, normalize, eps, config, chunk_size, rate)
        compile_ahead("hla2", hla2_chunked, args, q.device)
        launch = launch_kernel

    def cfg_for(width, v_width, rule=fused_config):
        if config is not None:
            return config
        return rule(B, T, H, width, v_width, q.dtype, q.device, chunk_size, gated=g is not None,
                    normalize=normalize, training=training)

    training = autograd_records(q, k, v, g, s0, w0, z0)
    cfg = cfg_for(K, V, hla2_config)
    if K <= TILE_MAX:
        if cfg.layers:
            return _layers_call(q, k, v, g, gamma, s0, w0, z0, normalize, eps, cfg, rate, launch)
        return HLA2ChunkFunction.apply(q, k, None, None, v, g, s0, w0, z0, gamma, normalize, eps, cfg, rate, launch)
    # a wider head, in key blocks or feature-block pairs, neither of which can divide by its share
    # of the denominator: normalized, it runs on [v | 1] (W beside z as its last column) and divides last
    dtype = v.dtype
    if normalize:
        v, w0 = quotient_values(v), with_column(w0, z0, ones_width(V))   # [v | 1 | 0 ...] (common.normalize)
    if cfg.layers:
        _check_rate(rate, normalize)
        o, S, W = HLA2KeyBlockLayersFunction.apply(q, k, v, g, s0, w0, gamma, cfg, rate, launch)
    else:
        o, S, W = _feature_block_pairs(q, k, v, g, gamma, s0, w0, rate, cfg_for, launch)
    if not normalize:
        return o.to(dtype), S, W, None
    return quotient(o, V, eps, dtype), S, W[..., :V], W[..., V]


def _feature_block_pairs(q, k, v, g, gamma, s0, w0, rate, cfg_for, launch):
    """A head wider than TILE_MAX as the sum over feature-block pairs (a, b) of the cross operator
    (:func:`hla2_chunked`; ``cfg_for(width, V)`` the config of a pair of that width). Returns (o fp32
    [B, T, H, V], S_T, W_T)."""
    B, _, H, K = q.shape
    blocks = _feature_blocks(K)
    qs = [q[..., a0:a1].contiguous() for a0, a1 in blocks]
    ks = [k[..., a0:a1].contiguous() for a0, a1 in blocks]
    o, s_rows, w_rows = None, [], []
    for ia, (a0, a1) in enumerate(blocks):
        s_row, w_row = [], None
        for ib, (b0, b1) in enumerate(blocks):
            cross = ia != ib
            s0_ab = w0_ab = None
            if s0 is not None:
                s0_ab = s0[..., a0:a1, b0:b1].contiguous()
                # W's rows a start in the row's first pair; the others start from zero
                w0_ab = w0[..., a0:a1, :].contiguous() if ib == 0 else w0.new_zeros(B, H, a1 - a0, v.shape[-1])
            o_ab, s_ab, w_ab, _ = HLA2ChunkFunction.apply(
                qs[ia], ks[ia], qs[ib] if cross else None, ks[ib] if cross else None, v, g, s0_ab, w0_ab, None,
                gamma, False, 0.0, cfg_for(max(a1 - a0, b1 - b0), v.shape[-1]), rate, launch)
            o = o_ab.float() if o is None else o + o_ab.float()
            s_row.append(s_ab)
            w_row = w_ab if w_row is None else w_row + w_ab
        s_rows.append(torch.cat(s_row, -1))
        w_rows.append(w_row)
    return o, torch.cat(s_rows, -2), torch.cat(w_rows, -2)
