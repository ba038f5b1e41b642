"""Launchers of the chunked HLA2 Triton kernels, the autograd Function, wide heads.

The kernels live in ``chunk_kernels.py``; this module chooses their layouts:

* forward, ``mode="fused"``: one program per (value block, segment, head) walks its
  chunks keeping ``S`` and its ``W`` block in registers. With ``segments > 1`` the
  sequence is cut into segments: a first launch computes each segment's summary
  ``(S, C, W)`` from a zero state (MODE 3), a small kernel folds the summaries in order
  to get every segment's start state (the ``(S, C, W)`` monoid), and the fused pass
  then runs all segments in parallel. More programs fill the GPU when ``B*H`` is small.
* forward, ``mode="two_pass"`` / ``"states"``: store every chunk-start state (MODE 1),
  then (two_pass) one program per chunk computes the outputs (MODE 2).
* backward: recompute the chunk-start states (MODE 1), then either ``split`` (a
  sequential pass for the state gradients, then one program per chunk for dq, dk, dv)
  or ``fused`` (one program per head walks the chunks backwards). Either walk can be cut
  into segments too (``segments``/``BWD_SEGMENTS``): each segment's backward summary
  ``(dS, dW, P)`` from a zero end gradient, a fold from the last segment to the first
  (``P = C^T``: the transpose of the forward's fold), then all segments' walks at once.

Heads wider than ``TILE_MAX`` features are cut into feature blocks (see
``hla2_unnormalized``); value heads wider than ``TILE_MAX`` are cut into value blocks
in the backward (the operator is linear in v).
"""
from __future__ import annotations

import math

import torch

from .chunk_kernels import (  # noqa: F401  (re-exported for readers and notebook 09)
    _bwd_chunk_grads,
    _hla2_bwd_grad_kernel,
    _hla2_bwd_kernel,
    _hla2_bwd_seg_combine_kernel,
    _hla2_bwd_state_kernel,
    _hla2_fwd_kernel,
    _hla2_seg_combine_kernel,
)
from .utils import cdiv, interpreter_on, next_pow2

# widest feature block one kernel program holds (a K x K and a K x V fp32 state on chip)
TILE_MAX = 128
# width of the feature blocks a head wider than TILE_MAX is cut into. 64, not 128: on an H200
# (Triton 3.6) the fused backward of a 128-wide cross pair needs 241664 bytes of shared memory
# (the limit is 232448); with 64-wide blocks every pair fits (K = 256, V = 192, bf16 gradients
# within 7e-3 of float64).
FEATURE_BLOCK = 64


def _pow2(n, lo=16):
    return max(lo, next_pow2(n))


def _min_bv(device):
    return 64 if device.type == "cuda" else 16


def _bf16_dots(dtype):
    """bf16 inputs use bf16 tensor-core dots. fp16 inputs are widened to fp32 inside the
    kernel (an fp16 operand cannot hold the growing state). Under TRITON_INTERPRET the
    interpreter's bf16 dot is unreliable, so bf16 tiles are widened there too."""
    return dtype == torch.bfloat16 and not interpreter_on()


# Per-chunk snapshots of the split backward (chunk-start states, chunk-end state gradients)
# in the dots' operand dtype (see chunk_kernels.py); False keeps them fp32 (for measurements).
# On an H200 (bf16, B*H = 64, T = 32k, K = V = 64) bf16 snapshots took the backward from
# 6.21 to 5.34 ms. The fused backward keeps fp32 snapshots: read as bf16, its 128-wide
# kernel needs 258048 bytes of shared memory (the limit is 232448).
SNAPSHOTS_IN_DOT_DTYPE = True


def _snapshot_dtype(dtype, bwd_layout):
    """dtype of the per-chunk snapshots for inputs of ``dtype`` and a backward layout."""
    use_bf16 = SNAPSHOTS_IN_DOT_DTYPE and bwd_layout == "split" and _bf16_dots(dtype)
    return torch.bfloat16 if use_bf16 else torch.float32


def _prec(dtype):
    # fp32 inputs get exact fp32 products; bf16/fp16 operands take the tensor cores
    return "ieee" if dtype == torch.float32 else "tf32"


def _gamma_args(gamma):
    use_g = gamma != 1.0
    return use_g, (math.log2(gamma) if use_g else 0.0)


# Forward layout used by hla2(); see the package README for the measurements behind it.
FWD_MODE = "fused"
FWD_BLOCK_V = None  # None: min(64, V padded); the value split also decides the parallelism
# Segments of the fused forward: None picks by occupancy (see fwd_segments), an int forces it.
FWD_SEGMENTS = None
# fewest chunks a segment walks when segments are picked automatically
MIN_SEGMENT_CHUNKS = 4


def fwd_segments(n_programs, NT, device, per_sm=2):
    """Segments for the fused forward: as many as keep all programs in one wave of ``per_sm``
    programs per multiprocessor (a partial second wave costs a whole program length), each
    segment at least MIN_SEGMENT_CHUNKS chunks long. One segment off CUDA.

    Measured on an H200 (132 SMs), bf16, B*H = 64, T = 32768 (benchmarks/results/):
    K = V = 64 (4 warps, two programs fit an SM): 1 segment 2.11 ms, 4 (256 programs)
    1.09 ms, 5 (320 programs: a partial second wave) 1.67 ms, 8 1.12 ms, 16 1.16 ms.
    K = V = 128 (8 warps, one program an SM; 128 programs): 2 segments took 9.06 ms where
    the single walk had taken 6.97-8.24 ms in the earlier runs, hence ``per_sm=1`` there."""
    if FWD_SEGMENTS is not None:
        return max(1, min(FWD_SEGMENTS, NT))
    return _one_wave_segments(n_programs, NT, device, per_sm)


def _one_wave_segments(n_programs, NT, device, per_sm):
    """Most segments that keep n_programs * segments within one wave of per_sm programs per
    multiprocessor, with at least MIN_SEGMENT_CHUNKS chunks each; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    return max(1, min((per_sm * _sm_count(device)) // n_programs, NT // MIN_SEGMENT_CHUNKS))


_SMS = {}


def _sm_count(device):
    """Multiprocessors of a CUDA device (looked up once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def fwd_config(BH, K, V):
    """(mode, block_v) of the forward for B*H heads of sizes K, V."""
    return FWD_MODE, FWD_BLOCK_V


def fwd_launch(q, k, v, gamma, s0, w0, chunk_size, mode="fused", store_final=True, block_v=None,
               num_warps=None, num_stages=1, q2=None, k2=None, segments=None, snapshots=None):
    """Run the forward kernels.

    q, k: [B, T, H, K]; v: [B, T, H, V]; q2, k2: [B, T, H, K2] or None (then q, k: plain
    HLA2); all contiguous. s0, w0: fp32 [B, H, K, K2], [B, H, K, V] or None.
    mode: "fused", "two_pass" or "states" (chunk-start states only, for the backward).
    segments: sequence segments run in parallel (None: ``fwd_segments``).
    snapshots: None, or the dtype to store every chunk-start state in ("states" and
    "two_pass" store them always, in fp32 unless told; "fused" stores them only when told,
    for a backward that then skips recomputing them).
    Returns (o or None, S_T [B, H, K, K2], W_T [B, H, K, V],
    (cs_s [B*H, NT, K, K2], cs_w [B*H, NT, K, V]) or None), the final state in fp32.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    q2 = q if q2 is None else q2
    k2 = k if k2 is None else k2
    K2 = q2.shape[-1]
    BT = chunk_size
    NT = cdiv(T, BT)
    BK = _pow2(max(K, K2))
    # value blocks of 64 (never 32: a 32-wide value block crashed with an illegal address
    # on an H200 with Triton 3.6, see the package README); small blocks under the interpreter
    BV = min(_pow2(V, _min_bv(q.device)), 64 if block_v is None else block_v)
    NV = cdiv(V, BV)
    BH = B * H
    dev = q.device
    f32 = torch.float32
    is_bf16 = _bf16_dots(q.dtype)
    use_g, log2g = _gamma_args(gamma)
    if num_warps is None:
        num_warps = 4 if BK <= 64 and BV <= 64 else 8
    if mode not in ("fused", "two_pass", "states"):
        raise ValueError(f"mode must be 'fused', 'two_pass' or 'states', got {mode!r}")
    if segments is None:
        nseg = fwd_segments(NV * BH, NT, dev, per_sm=2 if num_warps == 4 else 1)
    else:
        nseg = max(1, min(int(segments), NT))
    NS = cdiv(NT, nseg)
    nseg = cdiv(NT, NS)  # no empty segment
    ht_s = torch.empty(BH, K, K2, device=dev, dtype=f32)
    ht_w = torch.empty(BH, K, V, device=dev, dtype=f32)
    kw = dict(H=H, K=K, K2=K2, V=V, BT=BT, BK=BK, BV=BV, USE_G=use_g,
              IS_BF16=is_bf16, PREC=_prec(q.dtype), num_warps=num_warps, num_stages=num_stages)
    has_init = s0 is not None
    h0_s = s0.reshape(BH, K, K2) if has_init else ht_s
    h0_w = w0.reshape(BH, K, V) if has_init else ht_w
    if nseg > 1:
        # segment summaries from a zero state, then every segment's start state
        sum_s = torch.empty(BH * nseg, K, K2, device=dev, dtype=f32)
        sum_w = torch.empty(BH * nseg, K, V, device=dev, dtype=f32)
        sum_c = torch.empty(BH * nseg, K2, V, device=dev, dtype=f32)
        _hla2_fwd_kernel[(NV, nseg, BH)](q, k, q2, k2, v, v, ht_s, ht_w, sum_s, sum_w, sum_c, ht_s, ht_w,
                                         log2g, T, NS, MODE=3, HAS_INIT=False, STORE_FINAL=False, **kw)
        seg_s = torch.empty(BH * nseg, K, K2, device=dev, dtype=f32)
        seg_w = torch.empty(BH * nseg, K, V, device=dev, dtype=f32)
        _hla2_seg_combine_kernel[(NV, BH)](sum_s, sum_c, sum_w, h0_s, h0_w, seg_s, seg_w, log2g, T, NS, nseg,
                                           K=K, K2=K2, V=V, BT=BT, BK=BK, BV=BV, USE_G=use_g,
                                           HAS_INIT=has_init, PREC=_prec(q.dtype), num_warps=num_warps)
        h0_s, h0_w, has_init = seg_s, seg_w, True
    o = None
    cs = None
    if mode != "fused" or snapshots is not None:
        cs_dtype = f32 if snapshots is None else snapshots
        cs = (torch.empty(BH, NT, K, K2, device=dev, dtype=cs_dtype),
              torch.empty(BH, NT, K, V, device=dev, dtype=cs_dtype))
    if mode == "fused":
        o = torch.empty_like(v)
        cs_s, cs_w = (ht_s, ht_w) if cs is None else cs
        _hla2_fwd_kernel[(NV, nseg, BH)](q, k, q2, k2, v, o, h0_s, h0_w, ht_s, ht_w, ht_w, cs_s, cs_w,
                                         log2g, T, NS, MODE=0 if cs is None else 4, HAS_INIT=has_init,
                                         STORE_FINAL=store_final, **kw)
    else:
        cs_s, cs_w = cs
        _hla2_fwd_kernel[(NV, nseg, BH)](q, k, q2, k2, v, v, h0_s, h0_w, ht_s, ht_w, ht_w, cs_s, cs_w,
                                         log2g, T, NS, MODE=1, HAS_INIT=has_init, STORE_FINAL=store_final, **kw)
        if mode == "two_pass":
            o = torch.empty_like(v)
            _hla2_fwd_kernel[(NV, NT, BH)](q, k, q2, k2, v, o, h0_s, h0_w, ht_s, ht_w, ht_w, cs_s, cs_w,
                                           log2g, T, 1, MODE=2, HAS_INIT=False, STORE_FINAL=False, **kw)
    return o, ht_s.view(B, H, K, K2), ht_w.view(B, H, K, V), cs


# Backward layout used by hla2(): "split" or "fused" (see bwd_launch); None: bwd_mode.
BWD_MODE = None


def bwd_mode(K, V):
    """Backward layout for head sizes K, V: split.

    Measured on an H200 (bf16, B*H = 64, T = 32k): at K = V = 64 split took 7.3 ms against
    14.8 ms fused. At K = V = 128 (chunks of 32) the fused walk took 55-58 ms; the split
    layout took 183 ms while its per-chunk kernel computed every gradient in one program,
    and 20.4 ms once dq and (dk, dv) came from two launches with 8 warps (bwd_grad_parts)."""
    if BWD_MODE is not None:
        return BWD_MODE
    return "split"


# Segments of the backward walks (the reverse of the forward's): None picks with bwd_segments.
BWD_SEGMENTS = None


def bwd_segments(NT, BH, mode, num_warps, device):
    """Segments for the backward walks of B*H heads of NT chunks.

    Measured on an H200 (bf16, B*H = 64, K = V = 64, T = 32768, split layout): 1 segment
    6.82 ms, 2 6.77, 4 6.18, 8 6.21; at K = 64, V = 128 the segmented split walk was checked
    on the H200 against float64 but not timed. So the split layout with 4-warp programs gets
    the forward's occupancy rule (all programs in one wave, two a multiprocessor); the fused
    layout and 8-warp programs keep one segment until they are timed."""
    if BWD_SEGMENTS is not None:
        return max(1, min(BWD_SEGMENTS, NT))
    if mode != "split" or num_warps != 4:
        return 1
    return _one_wave_segments(BH, NT, device, per_sm=2)


# How the split layout's per-chunk gradient kernel is launched: a tuple of PARTS masks
# (1 dq, 2 dk, 4 dv), one launch each; None picks with bwd_grad_parts.
BWD_GRAD_PARTS = None


def bwd_grad_parts(K, V):
    """Launches of the per-chunk gradient kernel: (7,) computes dq, dk, dv in one program,
    (1, 6) dq in one and dk, dv in another.

    Measured on an H200 (whole backward, bf16 snapshots, B*H = 64, T = 32k): at K = V = 64
    (7,) 5.34 ms, (1, 2, 4) 4.59, (3, 4) 5.42, (5, 2) 4.57, (1, 6) 4.43; at K = V = 128
    (chunks of 32, 8 warps) (7,) 24.7 ms, (1, 2, 4) 21.6, (1, 6) 20.4. One program holding
    every 64-wide gradient spills registers and needs 147 kB of shared memory (one program
    a multiprocessor); the dq kernel needs 90 kB, the (dk, dv) kernel 98 kB."""
    if BWD_GRAD_PARTS is not None:
        return tuple(BWD_GRAD_PARTS)
    return (1, 6)


def bwd_chunk_size(K, V, chunk_size):
    """Chunk of the backward: 64 rows for heads up to 64 wide, 32 above (fewer live tiles)."""
    return min(chunk_size, 64 if max(K, V) <= 64 else 32)


def fwd_chunk_size(K, V, chunk_size):
    """Chunk of the forward: at most 32 rows for heads wider than 64, else chunk_size.

    Measured on an H200 (bf16, B*H = 64, T = 32k, one segment, 8 warps): K = V = 128 took
    5.9 ms with chunks of 32 against 9.2 ms with 64; K = V = 64 (4 segments, 4 warps) took
    1.10 ms with 64 against 1.45 ms with 32. Where both passes use the same chunk the
    forward hands its chunk-start states to the backward."""
    return min(chunk_size, 32) if max(K, V) > 64 else chunk_size


def _even_blocks(n, width):
    """Bounds (start, stop) cutting range(n) into the fewest blocks at most width long, as even
    as possible."""
    parts = cdiv(n, width)
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _value_blocks(V):
    """Bounds of value blocks at most TILE_MAX wide, as even as possible."""
    return _even_blocks(V, TILE_MAX)


def bwd_launch(q, k, v, do, gamma, s0, w0, dht_s, dht_w, chunk_size, num_warps=None, mode=None,
               q2=None, k2=None, segments=None, grad_parts=None, states=None):
    """Gradients of the unnormalized (cross) operator.

    q, k: [B, T, H, K]; q2, k2: [B, T, H, K2] or None; v, do: [B, T, H, V];
    s0, w0: initial state or None; dht_s [B, H, K, K2], dht_w [B, H, K, V]: gradient of the
    final state or None. mode: "split" or "fused" (None: ``bwd_mode``). segments: sequence
    segments whose backward walks run in parallel (None: ``bwd_segments``). grad_parts: the
    split layout's gradient launches (None: ``bwd_grad_parts``). states: the chunk-start
    snapshots (cs_s, cs_w) a forward with the same chunk size stored (``fwd_launch``'s
    ``snapshots``), or None to recompute them.
    Returns dq, dk, dq2, dk2 (None unless cross; input dtypes), dv, dS0, dW0 (fp32, None
    without s0).
    """
    V = v.shape[-1]
    if V > TILE_MAX:
        # linear in v: each value block gets its columns of dO and dW_T; dS_T goes to one block
        outs = []
        for j, (a, b) in enumerate(_value_blocks(V)):
            outs.append(bwd_launch(
                q, k, v[..., a:b].contiguous(), do[..., a:b].contiguous(), gamma, s0,
                None if w0 is None else w0[..., a:b].contiguous(), dht_s if j == 0 else None,
                None if dht_w is None else dht_w[..., a:b].contiguous(), chunk_size, num_warps, mode, q2, k2,
                segments, grad_parts))  # the value blocks recompute their chunk-start states

        def total(i):
            return None if outs[0][i] is None else sum(o[i] for o in outs)

        def cat(i):
            return None if outs[0][i] is None else torch.cat([o[i] for o in outs], -1)

        return total(0), total(1), total(2), total(3), cat(4), total(5), cat(6)
    B, T, H, K = q.shape
    cross = q2 is not None
    q2 = q if q2 is None else q2
    k2 = k if k2 is None else k2
    K2 = q2.shape[-1]
    mode = bwd_mode(max(K, K2), V) if mode is None else mode
    if mode not in ("split", "fused"):
        raise ValueError(f"mode must be 'split' or 'fused', got {mode!r}")
    parts = bwd_grad_parts(max(K, K2), V) if grad_parts is None else tuple(grad_parts)
    if mode == "split" and sorted(p_ for m in parts for p_ in (1, 2, 4) if m & p_) != [1, 2, 4]:
        raise ValueError(f"grad_parts must cover dq (1), dk (2) and dv (4) once each, got {parts!r}")
    BT = chunk_size
    BK = _pow2(max(K, K2))
    BV = _pow2(V, _min_bv(q.device))
    if states is None or states[0].dtype != _snapshot_dtype(q.dtype, mode):
        states = fwd_launch(q, k, v, gamma, s0, w0, BT, mode="states", store_final=False, q2=q2, k2=k2,
                            snapshots=_snapshot_dtype(q.dtype, mode))[3]
    cs_s, cs_w = states
    do = do.contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dq2 = torch.empty_like(q2) if cross else dq
    dk2 = torch.empty_like(k2) if cross else dk
    dv = torch.empty_like(v)
    has_dht = dht_s is not None or dht_w is not None
    f32 = torch.float32
    if has_dht:
        dht_s = torch.zeros(B, H, K, K2, device=q.device, dtype=f32) if dht_s is None else dht_s.float().contiguous()
        dht_w = torch.zeros(B, H, K, V, device=q.device, dtype=f32) if dht_w is None else dht_w.float().contiguous()
    store_dh0 = s0 is not None
    dh0_s = torch.empty(B, H, K, K2, device=q.device, dtype=f32) if store_dh0 else cs_s
    dh0_w = torch.empty(B, H, K, V, device=q.device, dtype=f32) if store_dh0 else cs_w
    use_g, log2g = _gamma_args(gamma)
    common = dict(H=H, K=K, K2=K2, V=V, BT=BT, BK=BK, BV=BV, USE_G=use_g, IS_BF16=_bf16_dots(q.dtype),
                  PREC=_prec(q.dtype), num_stages=1)
    # 8 warps for the 128-wide tiles (the configuration measured on Hopper), else 4
    nw = num_warps if num_warps is not None else (8 if max(BK, BV) > 64 else 4)
    NT = cdiv(T, BT)
    nseg = bwd_segments(NT, B * H, mode, nw, q.device) if segments is None else max(1, min(int(segments), NT))
    if BK > 64 and BV > 64:
        # the fold's fp32 [BK, BV] x [BV, BK] product needs 262144 bytes of shared memory at
        # 128 x 128 on an H200 (limit 232448): heads that wide walk in one segment
        nseg = 1
    NS = cdiv(NT, nseg)
    nseg = cdiv(NT, NS)  # no empty segment
    # each walk starts from the gradient of its segment's end state (the final state's for one segment)
    de_s = dht_s if has_dht else cs_s
    de_w = dht_w if has_dht else cs_w
    walk_dh0 = store_dh0
    if nseg > 1:
        # backward summaries of the segments from a zero end gradient, folded last to first
        sum_s = torch.empty(B * H * nseg, K, K2, device=q.device, dtype=f32)
        sum_w = torch.empty(B * H * nseg, K, V, device=q.device, dtype=f32)
        sum_p = torch.empty(B * H * nseg, V, K2, device=q.device, dtype=f32)
        _hla2_bwd_state_kernel[(nseg, B * H)](
            q, q2, v, do, sum_s, sum_w, cs_s, cs_w, cs_s, cs_w, sum_p, log2g, T, NS,
            HAS_DHT=False, STORE_DH0=False, SUMMARY=True, num_warps=nw, **common)
        de_s = torch.empty(B * H * nseg, K, K2, device=q.device, dtype=f32)
        de_w = torch.empty(B * H * nseg, K, V, device=q.device, dtype=f32)
        _hla2_bwd_seg_combine_kernel[(B * H,)](
            sum_s, sum_w, sum_p, dht_s if has_dht else cs_s, dht_w if has_dht else cs_w, de_s, de_w,
            dh0_s, dh0_w, log2g, T, NS, nseg, K=K, K2=K2, V=V, BT=BT, BK=BK, BV=BV, USE_G=use_g,
            HAS_DHT=has_dht, STORE_DH0=store_dh0, PREC=_prec(q.dtype), num_warps=nw)
        has_dht, walk_dh0 = True, False
    if mode == "fused":
        _hla2_bwd_kernel[(nseg, B * H)](
            q, k, q2, k2, v, do, dq, dk, dq2, dk2, dv, cs_s, cs_w, de_s, de_w, dh0_s, dh0_w, log2g, T, NS,
            HAS_DHT=has_dht, STORE_DH0=walk_dh0, CROSS=cross, num_warps=nw, **common)
    else:
        ds_end = torch.empty_like(cs_s)
        dw_end = torch.empty_like(cs_w)
        _hla2_bwd_state_kernel[(nseg, B * H)](
            q, q2, v, do, ds_end, dw_end, de_s, de_w, dh0_s, dh0_w, cs_s, log2g, T, NS,
            HAS_DHT=has_dht, STORE_DH0=walk_dh0, SUMMARY=False, num_warps=nw, **common)
        for m in parts:
            _hla2_bwd_grad_kernel[(NT, B * H)](
                q, k, q2, k2, v, do, dq, dk, dq2, dk2, dv, cs_s, cs_w, ds_end, dw_end, log2g, T,
                CROSS=cross, PARTS=m, num_warps=nw, **common)
    return (dq, dk, dq2 if cross else None, dk2 if cross else None, dv,
            dh0_s if store_dh0 else None, dh0_w if store_dh0 else None)


# Whether a forward that will be differentiated stores its chunk-start states for the backward
# (see HLA2ChunkFunction.forward). True trades memory, held from the forward to the backward, for
# one pass over the sequence. At B=4, H=16, T=32k, bf16 on an H200 (benchmarks/results/hla2_h200.md,
# profile, and hla2_h200_variants.md): K = V = 64 holds 0.5 GB (twice the size of q); storing costs the
# forward 0.40 ms (1.48 against 1.08) and saves the backward 0.91 ms (3.50 against 4.41), so fwd+bwd
# 4.98 ms instead of about 5.5. K = V = 128 (chunks of 32) holds 4.3 GB; it costs 2.2 ms and saves
# 3.8 ms. False recomputes the states in the backward and holds nothing extra.
SAVE_CHUNK_STATES = True


class HLA2ChunkFunction(torch.autograd.Function):
    """Autograd wrapper of the unnormalized Triton (cross) HLA2.

    forward(q [B,T,H,K], k [B,T,H,K], q2 [B,T,H,K2] | None, k2 [B,T,H,K2] | None,
    v [B,T,H,V], s0 [B,H,K,K2] | None, w0 [B,H,K,V] | None, gamma, chunk_size, mode,
    bwd_chunk_size, block_v) -> (o [B,T,H,V], S_T [B,H,K,K2], W_T [B,H,K,V]).
    """

    @staticmethod
    def forward(ctx, q, k, q2, k2, v, s0, w0, gamma, chunk_size, mode, bwd_chunk_size, block_v=None):
        # A forward that will be differentiated stores its chunk-start states for the backward
        # when the backward would recompute the same ones (split layout, same chunk, one value
        # block): the backward then skips one pass over the sequence. They take
        # (K*K2 + K*V) values a chunk in the snapshot dtype (bf16 for bf16 inputs).
        K, K2, V = q.shape[-1], (q if q2 is None else q2).shape[-1], v.shape[-1]
        save = (SAVE_CHUNK_STATES and any(ctx.needs_input_grad[:7]) and mode == "fused" and bwd_chunk_size == chunk_size
                and V <= TILE_MAX and bwd_mode(max(K, K2), V) == "split")
        snap = _snapshot_dtype(q.dtype, "split") if save else None
        o, st, wt, cs = fwd_launch(q, k, v, gamma, s0, w0, chunk_size, mode=mode, block_v=block_v, q2=q2, k2=k2,
                                   snapshots=snap)
        cs = (None, None) if cs is None else cs
        ctx.save_for_backward(q, k, q2, k2, v, s0, w0, *cs)
        ctx.gamma = gamma
        ctx.bwd_chunk_size = bwd_chunk_size
        return o, st, wt

    @staticmethod
    def backward(ctx, do, dst, dwt):
        q, k, q2, k2, v, s0, w0, cs_s, cs_w = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dq2, dk2, dv, ds0, dw0 = bwd_launch(q, k, v, do, ctx.gamma, s0, w0, dst, dwt,
                                                    ctx.bwd_chunk_size, q2=q2, k2=k2,
                                                    states=None if cs_s is None else (cs_s, cs_w))
        return dq, dk, dq2, dk2, dv, ds0, dw0, None, None, None, None, None


def _feature_blocks(K):
    """Bounds of feature blocks at most FEATURE_BLOCK wide, as even as possible (one block
    when K <= TILE_MAX)."""
    return [(0, K)] if K <= TILE_MAX else _even_blocks(K, FEATURE_BLOCK)


def hla2_unnormalized(q, k, v, gamma, s0, w0, chunk_size):
    """Unnormalized HLA2 on the Triton kernels, any head size (up to 256 through the checks).

    q, k: [B, T, H, K]; v: [B, T, H, V] (contiguous); s0 [B, H, K, K], w0 [B, H, K, V] fp32
    or None. Returns (o [B, T, H, V], S_T [B, H, K, K], W_T [B, H, K, V]).

    A head wider than TILE_MAX is cut into feature blocks a, b. Because q . k is the sum
    of the blocks' dot products, the operator is the sum over block pairs (a, b) of the
    cross operator with (q_a, k_a) as the outer pair and (q_b, k_b) as the inner one.
    The pair's state is S[a, b] and its share of W's rows a; W's rows a are the sum over b.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    mode, block_v = fwd_config(B * H, K, V)
    blocks = _feature_blocks(K)
    if len(blocks) == 1:
        return HLA2ChunkFunction.apply(q, k, None, None, v, s0, w0, gamma, fwd_chunk_size(K, V, chunk_size), mode,
                                       bwd_chunk_size(K, V, chunk_size), block_v)
    # each block's features once, contiguous (the kernels read [B, T, H, width] tensors)
    qs = [q[..., a0:a1].contiguous() for a0, a1 in blocks]
    ks = [k[..., a0:a1].contiguous() for a0, a1 in blocks]
    o = None
    s_rows, w_rows = [], []
    for ia, (a0, a1) in enumerate(blocks):
        s_row, w_row = [], None
        for ib, (b0, b1) in enumerate(blocks):
            cross = ia != ib
            s0_ab = w0_ab = None
            if s0 is not None:
                s0_ab = s0[..., a0:a1, b0:b1].contiguous()
                # W's rows a start in the first pair of the row; the others start from zero
                w0_ab = w0[..., a0:a1, :].contiguous() if ib == 0 else w0.new_zeros(B, H, a1 - a0, V)
            wid = max(a1 - a0, b1 - b0)
            o_ab, s_ab, w_ab = HLA2ChunkFunction.apply(
                qs[ia], ks[ia], qs[ib] if cross else None, ks[ib] if cross else None, v, s0_ab, w0_ab, gamma,
                fwd_chunk_size(wid, V, chunk_size), mode, bwd_chunk_size(wid, min(V, TILE_MAX), chunk_size), block_v)
            o = o_ab.float() if o is None else o + o_ab.float()
            s_row.append(s_ab)
            w_row = w_ab if w_row is None else w_row + w_ab
        s_rows.append(torch.cat(s_row, -1))
        w_rows.append(w_row)
    return o.to(v.dtype), torch.cat(s_rows, -2), torch.cat(w_rows, -2)
