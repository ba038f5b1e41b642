"""Chunked HLA3 on the Triton kernels: the configuration rule, the launchers, the autograd Function.

Forward (``hla3_fwd``): one program per (value block, segment, head) walks its segment's chunks
in order (``hla3_fwd_kernel``), keeping the chunk-start states when the backward will read them.
With more than one segment a first launch computes every segment's summary from a zero state
(``hla3_fwd_summary_kernel``: its own S, P, F and three cross moments) and a small kernel folds
them into each segment's start state (``hla3_fwd_fold_kernel``), so that all segments then run at
once. For keys wider than FOLD_TILE that fold takes two launches, S and P first, then F by row
blocks (``hla3_fwd_fold_f_kernel``), and the backward's fold two as well (dS; dP and dF): one
program holding every [K, K] operand would not fit in shared memory.

Backward (``hla3_bwd``): the chunk-start states (kept by the forward, or recomputed by the forward
walk), a walk from the last chunk to the first carrying only the state gradients
(``hla3_bwd_state_kernel``, segmented the same way: summaries from a zero end gradient, folded from
the last segment to the first by ``hla3_bwd_fold_kernel``), then every chunk's dq, dk, dv and db in parallel
(``hla3_bwd_grad_kernel``). Value blocks give partial dq, dk, dS0 and db, summed here (the
operator is linear in the value columns); with one value block the kernel stores dq and dk in the
inputs' dtype, with no fp32 copy to sum and convert. The gradient of the log-gates g is the reverse
cumulative sum of db plus the final state's share (see ``chunk_kernels.py``).

Normalization: the Function computes the unnormalized operator; ``hla3_chunked`` runs it on the
values [v | 1] (state [P | p], [F | f]) and divides in torch, so autograd differentiates the
quotient and the kernels need no normalized variant. This costs one more value column (for
V = 64 on a GPU a second value block).

Limit: heads up to TILE_MAX = 128 key features (``interface.TRITON_MAX_K``).

Launches go through each launcher's ``launch`` argument (``common.compile.launch_kernel``); the entry
point first has ``common.compile.compile_ahead`` rehearse a new call with a recorder there and compile
its kernels at once.
"""
from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from ..common.compile import compile_ahead, launch_kernel
from ..common.config import ChunkConfig, refuse_ahla_fields
from ..common.gates import log_gamma, reverse_cumsum
from ..common.launch import (
    autograd_records, bf16_dots, cdiv, dot_precision, min_key_block, min_value_block, one_wave_segments, pow2_block,
    split_segments, value_block,
)
from .chunk_kernels import (
    hla3_bwd_fold_kernel, hla3_bwd_grad_kernel, hla3_bwd_state_kernel, hla3_fwd_fold_kernel, hla3_fwd_kernel,
    hla3_fwd_fold_f_kernel, hla3_fwd_summary_kernel,
)
from .state import HLA3State

# widest key tile one program holds (S: a K x K fp32 tile beside P, F: K x BV)
TILE_MAX = 128
# fewest chunks a forward segment walks when segments are picked by occupancy
MIN_SEGMENT_CHUNKS = 4
# widest key tile the segment folds hold whole; wider keys fold F by row blocks of this many rows
# (and no fold pipelines its loads): the [K, K] fp32 operands must fit Hopper's 227 KB of shared memory
FOLD_TILE = 64
# The wide-key bf16 walk. Why bf16 inputs with keys wider than FOLD_TILE walk the backward
# (hla3_bwd_state_kernel) on fp32 operands: with bf16 operands at K = V = 128 (chunks of 32, 8 warps)
# that kernel stopped with an illegal memory access on an H200 (Triton 3.6) whenever the backward
# was segmented, both as the segment summary and as the walk after the fold; unsegmented it ran but
# returned non-finite values in almost every element of dk (dq and dv within bf16's error), at
# B = 4, H = 16, T = 2048 and 8192. The same launches with fp32 inputs and every launch under the
# interpreter run correctly, and the kernel's addressing does not depend on the dtype.
# The fp32 operands are multiplied in plain tf32 (11 significant bits, against the 8 of the bf16
# inputs), not in fp32's tf32x3, which keeps a split copy of every operand: the tf32x3 walk spilled
# about six times as much (ptxas -v) and made the forward + backward at K = V = 128 about three times
# slower, with gradients that differ from the tf32 walk's at the level of the bf16 inputs
# (benchmarks/results/hla3_h200_ab_tf32_walk.json; hla_fast/README.md, HLA3's speed notes).
# tests/fast/test_hla3_kernels.py::test_long_sequences_on_the_gpu checks this walk at K = 128,
# segmented and in one segment.


@functools.lru_cache(maxsize=4096)
def hla3_config(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device,
                chunk_size: int = 64) -> ChunkConfig:
    """The default layout for one call (a rule measured at T = 32k, B = 4, H = 16 on an H200:
    the layouts table of benchmarks/results/hla3_h200.md for K = V = 64, its sweep for the rest):

    * chunks of at most 32 in both passes, the forward keeping its chunk-start states for the
      backward. At K = V = 64 in bf16 chunks of 32 beat 64 and 16 in the forward and in forward +
      backward (the layouts table; hla_fast/README.md quotes it): the per-chunk gradient program
      holds about twenty [BT, BT] and [BT, BK] tiles and spills half as much on chunks of 32
      (by ptxas -v, benchmarks/compile_report.py). Wider heads and inputs other than bf16 (their dot
      operands are fp32) need chunks of 32 anyway: shared memory, 227 KB a program on Hopper, bounds
      the tiles (the fp32 gradient program on chunks of 64 at K = 64 asks for 288 KB). The states
      kept cost ceil(T / 32) * (K^2 + 2 K V) fp32 numbers a head, twice what chunks of 64 keep;
    * value blocks of at most 64 columns in both passes;
    * 4 warps for tiles up to 64 x 64, 8 above;
    * segments of the forward and of the backward walk: as many as keep every program in one
      wave (two 4-warp programs or one 8-warp program a multiprocessor), at least
      MIN_SEGMENT_CHUNKS chunks each (1 off CUDA);
    * the forward's loads pipelined two stages deep (``fwd_stages``) for bf16 key tiles up to 64
      wide: each next chunk's tiles are copied into shared memory while the current one is
      computed: 3.23 against 3.84 ms forward at K = V = 64, T = 32k, forward + backward 28.9
      against 28.7 (benchmarks/results/hla3_h200_stages_ab.md). Not at K = V = 128, where two
      stages were slower (3.13 against 2.98 ms forward at T = 8192, hla3_h200_stages_k128.md).
      The backward keeps one stage; fp32 tiles were not measured.
    The result is immutable, so it is cached."""
    fwd_chunk = bwd_chunk = min(chunk_size, 32)
    block_v = min(64, pow2_block(V, min_value_block(device)))
    BK = pow2_block(K, min_key_block(device))
    warps = 4 if BK <= 64 and block_v <= 64 else 8
    per_sm = 2 if warps == 4 else 1
    seg = one_wave_segments(cdiv(V, block_v) * B * H, cdiv(T, fwd_chunk), device, per_sm, MIN_SEGMENT_CHUNKS)
    stages = 2 if bf16_dots(dtype) and BK <= 64 else 1
    return ChunkConfig(fwd_chunk=fwd_chunk, bwd_chunk=bwd_chunk, fwd_segments=seg, bwd_segments=seg,
                       fwd_warps=warps, bwd_warps=warps, fwd_block_v=block_v, save_states=True, bf16_snapshots=False,
                       fwd_stages=stages)


def _tiles(q, v, block_v):
    """Key tile BK, value block BV and the number of value blocks for q [.., K], v [.., V]. The
    value block is at most ``block_v`` wide but never below the device's ``min_value_block``."""
    BK = pow2_block(q.shape[-1], min_key_block(q.device))
    BV = value_block(v.shape[-1], block_v, q.device)
    return BK, BV, cdiv(v.shape[-1], BV)


def _flags(q, gamma, g):
    """Constexprs and the log-decay scalar every launch shares. Inputs other than bf16 (fp16 too)
    are widened to fp32 in the kernels and take fp32's products (tf32x3 on a GPU): with fp32
    operands in plain tf32 the gradient program asks Hopper for more shared memory than it has
    (over 270 KB even on chunks of 16 at K = 64)."""
    prec = dot_precision(q.dtype if q.dtype == torch.bfloat16 else torch.float32)
    return (dict(HAS_DECAY=g is not None or gamma is not None, IS_BF16=bf16_dots(q.dtype), PREC=prec),
            log_gamma(gamma) if g is None else 0.0)


def hla3_fwd(q, k, v, g, gamma, s0, p0, f0, *, chunk, warps, block_v, segments=1, stages=1, outputs=True,
             store_final=True, snapshots=False, o_dtype=None, launch=launch_kernel):
    """The forward walk of the unnormalized operator.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None; all contiguous. s0 [B, H, K, K],
    p0, f0 [B, H, K, V]: fp32 initial state, or all None. segments: pieces of the sequence walked
    in parallel (after the summaries and the fold). outputs: compute o (in ``o_dtype``, default
    v's). snapshots: also store every chunk-start state.
    Returns (o [B, T, H, V] or None, S_T, P_T, F_T (fp32, or None unless store_final),
    (cs_s [B*H, NT, K, K], cs_p [B*H, NT, K, V], cs_f [B*H, NT, K, V]) or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK, BV, NV = _tiles(q, v, block_v)
    BH, dev, f32 = B * H, q.device, torch.float32
    NT = cdiv(T, chunk)
    NS, nseg = split_segments(NT, segments)
    flags, lg = _flags(q, gamma, g)
    kw = dict(log_gamma=lg, T=T, NS=NS, H=H, K=K, V=V, BT=chunk, BK=BK, BV=BV, num_warps=warps, num_stages=stages,
              **flags)
    h0 = (s0, p0, f0)
    if nseg > 1:
        # -- every segment's summary from a zero state, then every segment's start state ----------
        kk, kv = (BH * nseg, K, K), (BH * nseg, K, V)
        sums = dict(sum_s=torch.empty(kk, device=dev, dtype=f32), sum_p=torch.empty(kv, device=dev, dtype=f32),
                    sum_f=torch.empty(kv, device=dev, dtype=f32), sum_z1=torch.empty(kk, device=dev, dtype=f32),
                    sum_z2=torch.empty(kv, device=dev, dtype=f32), sum_z3=torch.empty(kk, device=dev, dtype=f32),
                    sum_lr=torch.empty(BH * nseg, device=dev, dtype=f32))
        launch(hla3_fwd_summary_kernel, (NV, nseg, BH), q=q, k=k, v=v, g=g, **sums, **kw)
        seg = (torch.empty(kk, device=dev, dtype=f32), torch.empty(kv, device=dev, dtype=f32),
               torch.empty(kv, device=dev, dtype=f32))
        fold = dict(h0_s=s0, h0_p=p0, h0_f=f0, seg_s=seg[0], seg_p=seg[1], seg_f=seg[2], NSEG=nseg,
                    K=K, V=V, BK=BK, BV=BV, PREC=flags["PREC"])
        if BK <= FOLD_TILE:
            launch(hla3_fwd_fold_kernel, (NV, BH), **sums, **fold, num_warps=warps)
        else:
            # S and P first, then F by row blocks (whole [BK, BK] operands would overflow shared memory)
            launch(hla3_fwd_fold_kernel, (NV, BH), **sums, **fold, CROSS=False, num_warps=warps, num_stages=1)
            launch(hla3_fwd_fold_f_kernel, (cdiv(K, FOLD_TILE), NV, BH),
                sum_f=sums["sum_f"], sum_z1=sums["sum_z1"], sum_z2=sums["sum_z2"], sum_z3=sums["sum_z3"],
                sum_lr=sums["sum_lr"], h0_f=f0, seg_s=seg[0], seg_p=seg[1], seg_f=seg[2], NSEG=nseg,
                K=K, V=V, BK=BK, BV=BV, BR=FOLD_TILE, BC=FOLD_TILE, PREC=flags["PREC"], num_warps=4, num_stages=1)
        h0 = seg
    o = torch.empty(B, T, H, V, device=dev, dtype=o_dtype or v.dtype) if outputs else None
    ht = ((torch.empty(B, H, K, K, device=dev, dtype=f32), torch.empty(B, H, K, V, device=dev, dtype=f32),
           torch.empty(B, H, K, V, device=dev, dtype=f32)) if store_final else (None, None, None))
    cs = None
    if snapshots:
        cs = (torch.empty(BH, NT, K, K, device=dev, dtype=f32), torch.empty(BH, NT, K, V, device=dev, dtype=f32),
              torch.empty(BH, NT, K, V, device=dev, dtype=f32))
    launch(hla3_fwd_kernel, (NV, nseg, BH),
        q=q, k=k, v=v, g=g, o=o, h0_s=h0[0], h0_p=h0[1], h0_f=h0[2], ht_s=ht[0], ht_p=ht[1], ht_f=ht[2],
        cs_s=None if cs is None else cs[0], cs_p=None if cs is None else cs[1], cs_f=None if cs is None else cs[2],
        **kw)
    return o, ht[0], ht[1], ht[2], cs


def hla3_bwd(q, k, v, do, g, gamma, s0, p0, f0, dsT, dpT, dfT, cfg: ChunkConfig, *, states=None, want_db=False,
             launch=launch_kernel):
    """Gradients of the unnormalized operator.

    q, k: [B, T, H, K]; v, do: [B, T, H, V]; g: [B, T, H] or None; s0, p0, f0: initial state or
    None; dsT [B, H, K, K], dpT, dfT [B, H, K, V]: gradient of the final state, each or None.
    states: the chunk-start snapshots a forward with chunk ``cfg.bwd_chunk`` stored, or None to
    recompute them. want_db: also return dL/db [B, T, H] fp32 (without the final state's share).
    Returns dq, dk, dv (input dtypes), dS0, dP0, dF0 (fp32, None without s0), db (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, nw = cfg.bwd_chunk, cfg.bwd_warps
    BK, BV, NV = _tiles(q, v, cfg.fwd_block_v)
    BH, dev, f32 = B * H, q.device, torch.float32
    NT = cdiv(T, BT)
    if states is None:
        states = hla3_fwd(q, k, v, g, gamma, s0, p0, f0, chunk=BT, warps=nw, block_v=cfg.fwd_block_v,
                          segments=cfg.fwd_segments, stages=cfg.bwd_stages, outputs=False, store_final=False,
                          snapshots=True, launch=launch)[4]
    cs_s, cs_p, cs_f = states
    do = do.contiguous()
    flags, lg = _flags(q, gamma, g)
    common = dict(log_gamma=lg, T=T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, num_warps=nw, num_stages=cfg.bwd_stages,
                  **flags)
    has_dht = any(x is not None for x in (dsT, dpT, dfT))
    de = (None, None, None)
    if has_dht:
        # dS is carried as one partial per value block: the final state's enters the first
        de_s = torch.zeros(NV, B, H, K, K, device=dev, dtype=f32)
        if dsT is not None:
            de_s[0] = dsT.float()
        de = (de_s, torch.zeros(B, H, K, V, device=dev, dtype=f32) if dpT is None else dpT.float().contiguous(),
              torch.zeros(B, H, K, V, device=dev, dtype=f32) if dfT is None else dfT.float().contiguous())
    dh0 = ((torch.empty(NV, B, H, K, K, device=dev, dtype=f32), torch.empty(B, H, K, V, device=dev, dtype=f32),
            torch.empty(B, H, K, V, device=dev, dtype=f32)) if s0 is not None else (None, None, None))
    NS, nseg = split_segments(NT, cfg.bwd_segments)
    walk = dict(NS=NS, **common)
    if flags["IS_BF16"] and BK > FOLD_TILE:
        # bf16 with keys wider than FOLD_TILE: the walk takes fp32 operands and tf32 products
        # (the wide-key bf16 walk, beside FOLD_TILE)
        walk.update(IS_BF16=False, PREC="tf32")
    walk_dh0 = dh0
    if nseg > 1:
        # -- backward summaries of the segments from a zero end gradient, folded last to first -----
        kk, kv = (BH * nseg, K, K), (BH * nseg, K, V)
        sums = dict(sum_s=torch.empty(NV * BH * nseg, K, K, device=dev, dtype=f32),
                    sum_p=torch.empty(kv, device=dev, dtype=f32), sum_f=torch.empty(kv, device=dev, dtype=f32),
                    sum_m=torch.empty(kk, device=dev, dtype=f32), sum_n=torch.empty(BH * nseg, V, K, device=dev, dtype=f32),
                    sum_lr=torch.empty(BH * nseg, device=dev, dtype=f32))
        launch(hla3_bwd_state_kernel, (NV, nseg, BH),
            q=q, k=k, v=v, do=do, g=g, cs_s=cs_s, cs_p=cs_p, de_s=None, de_p=None, de_f=None,
            ds_end=sums["sum_s"], dp_end=sums["sum_p"], df_end=sums["sum_f"], dh0_s=None, dh0_p=None, dh0_f=None,
            sum_m=sums["sum_m"], sum_n=sums["sum_n"], sum_lr=sums["sum_lr"], **walk)
        seg = (torch.empty(NV * BH * nseg, K, K, device=dev, dtype=f32), torch.empty(kv, device=dev, dtype=f32),
               torch.empty(kv, device=dev, dtype=f32))
        fold = dict(dht_s=de[0], dht_p=de[1], dht_f=de[2], de_s=seg[0], de_p=seg[1], de_f=seg[2],
                    dh0_s=dh0[0], dh0_p=dh0[1], dh0_f=dh0[2], NSEG=nseg, K=K, V=V, BK=BK, BV=BV, PREC=flags["PREC"])
        if BK <= FOLD_TILE:
            launch(hla3_bwd_fold_kernel, (NV, BH), **sums, **fold, num_warps=nw)
        else:
            # dS in one launch, dP and dF in another (both products' operands would overflow shared memory)
            for part in ({"DP": False}, {"DS": False}):
                launch(hla3_bwd_fold_kernel, (NV, BH), **sums, **fold, **part, num_warps=nw, num_stages=1)
        de, walk_dh0 = seg, (None, None, None)
    # -- the walk: every chunk's end-state gradient ------------------------------------------------
    ds_end = torch.empty(NV * BH, NT, K, K, device=dev, dtype=f32)
    dp_end, df_end = torch.empty(BH, NT, K, V, device=dev, dtype=f32), torch.empty(BH, NT, K, V, device=dev, dtype=f32)
    launch(hla3_bwd_state_kernel, (NV, nseg, BH),
        q=q, k=k, v=v, do=do, g=g, cs_s=cs_s, cs_p=cs_p, de_s=de[0], de_p=de[1], de_f=de[2],
        ds_end=ds_end, dp_end=dp_end, df_end=df_end, dh0_s=walk_dh0[0], dh0_p=walk_dh0[1], dh0_f=walk_dh0[2],
        sum_m=None, sum_n=None, sum_lr=None, **walk)
    # -- every chunk's gradients -----------------------------------------------------------------
    # one value block stores dq, dk in q's dtype; several store fp32 shares, summed below
    part = q.dtype if NV == 1 else f32
    dq_part = torch.empty(NV, B, T, H, K, device=dev, dtype=part)
    dk_part = torch.empty(NV, B, T, H, K, device=dev, dtype=part)
    dv = torch.empty_like(v)
    db = torch.empty(NV, B, T, H, device=dev, dtype=f32) if want_db else None
    launch(hla3_bwd_grad_kernel, (NT, NV, BH),
        q=q, k=k, v=v, do=do, g=g, dq=dq_part, dk=dk_part, dv=dv, db=db, cs_s=cs_s, cs_p=cs_p, cs_f=cs_f,
        ds_end=ds_end, dp_end=dp_end, df_end=df_end, **common)

    def total(shares, dtype=f32):
        """The sum of the value blocks' shares [NV, ...] (one block: its share as stored)."""
        return None if shares is None else (shares[0] if NV == 1 else shares.sum(0).to(dtype))

    return total(dq_part, q.dtype), total(dk_part, k.dtype), dv, total(dh0[0]), dh0[1], dh0[2], total(db)


class HLA3ChunkFunction(torch.autograd.Function):
    """Autograd of the unnormalized HLA3 on the Triton kernels.

    forward(q [B,T,H,K], k, v [B,T,H,V], g [B,T,H] | None, s0 [B,H,K,K] | None, p0 [B,H,K,V] | None,
    f0 [B,H,K,V] | None, gamma, cfg, o_dtype, launch) -> (o [B,T,H,V] in o_dtype, S_T, P_T, F_T fp32).
    The backward is not itself differentiable (it raises if asked)."""

    @staticmethod
    def forward(ctx, q, k, v, g, s0, p0, f0, gamma, cfg, o_dtype, launch):
        # an output the loss does not use gets None, not a materialized zero tensor (the final
        # state's cotangents are [B, H, K, K]-sized: zeros would cost memory and a walk from zero)
        ctx.set_materialize_grads(False)
        grads = any(ctx.needs_input_grad[:7])
        save = grads and cfg.save_states and cfg.fwd_chunk == cfg.bwd_chunk
        o, sT, pT, fT, cs = hla3_fwd(q, k, v, g, gamma, s0, p0, f0, chunk=cfg.fwd_chunk, warps=cfg.fwd_warps,
                                     block_v=cfg.fwd_block_v, segments=cfg.fwd_segments, stages=cfg.fwd_stages,
                                     snapshots=save, o_dtype=o_dtype, launch=launch)
        cs = (None, None, None) if cs is None else cs
        # the final state is read back only for the log-gates' gradient (its own factor e^{b_T})
        final = (sT, pT, fT) if g is not None and ctx.needs_input_grad[3] else (None, None, None)
        ctx.save_for_backward(q, k, v, g, s0, p0, f0, *final, *cs)
        ctx.gamma, ctx.cfg, ctx.launch = gamma, cfg, launch
        return o, sT, pT, fT

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dsT, dpT, dfT):
        q, k, v, g, s0, p0, f0, sT, pT, fT, cs_s, cs_p, cs_f = ctx.saved_tensors
        want_dg = g is not None and ctx.needs_input_grad[3]
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, ds0, dp0, df0, db = hla3_bwd(
            q, k, v, do, g, ctx.gamma, s0, p0, f0, dsT, dpT, dfT, ctx.cfg,
            states=None if cs_s is None else (cs_s, cs_p, cs_f), want_db=want_dg, launch=ctx.launch)
        dg = None
        if want_dg:
            # S_T, P_T carry exp(b_T - .), F_T exp(3 b_T - .): their share of dL/db_T
            last = torch.zeros(db.shape[0], db.shape[2], device=db.device, dtype=db.dtype)
            for x, dx, w in ((sT, dsT, 1.0), (pT, dpT, 1.0), (fT, dfT, 3.0)):
                if dx is not None:
                    last = last + w * (x * dx.float()).sum((-1, -2))
            db[:, -1] += last
            dg = reverse_cumsum(db).to(g.dtype)
        return dq, dk, dv, dg, ds0, dp0, df0, None, None, None, None


def check_grad_layout(cfg: ChunkConfig, K: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse the backward layout known to crash: on CUDA, bf16 inputs with keys up to FOLD_TILE
    wide, backward chunks of 32 and 8 warps. There ``hla3_bwd_grad_kernel`` stopped with an illegal
    memory access on an H200 (Triton 3.6, B = 4, H = 16, K = V = 64, T = 4096 and 32768, in one
    segment and in four), while the same kernel runs on 4 warps (the rule's), on chunks of 64 with
    8 warps, and at K = 128 with 8 warps (the rule's there). Raises ValueError naming the field."""
    if (device.type == "cuda" and dtype == torch.bfloat16 and cfg.bwd_warps > 4 and cfg.bwd_chunk == 32
            and pow2_block(K, min_key_block(device)) <= FOLD_TILE):
        raise ValueError(f"config.bwd_warps={cfg.bwd_warps} with bf16 inputs, K={K} <= {FOLD_TILE} and "
                         f"bwd_chunk=32 is refused: the HLA3 gradient kernel stops with an illegal memory "
                         f"access in that layout (Triton 3.6); use bwd_warps=4, the rule's")


def hla3_chunked(q, k, v, g, gamma, state, normalize, eps, config=None, chunk_size=64, launch=None):
    """HLA3 on the Triton kernels (K <= TILE_MAX through the checks).

    q, k: [B, T, H, K]; v: [B, T, H, V] (contiguous); g: [B, T, H] or None; state: a checked fp32
    HLA3State or None; config: a ChunkConfig, or None for ``hla3_config``'s rule. launch: how
    kernels are launched (``common.compile``); None launches them, after compiling a new call's
    kernels at once (``compile_ahead``).
    Returns (o [B, T, H, V] in v's dtype, HLA3State)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    vv = v
    s0 = p0 = f0 = None
    if state is not None:
        s0, p0, f0 = state.S.contiguous(), state.P, state.F
    if normalize:
        # the denominator is the numerator with v -> 1: one more value column, one more state column
        vv = torch.cat([v, torch.ones_like(v[..., :1])], -1)
        if state is not None:
            p0 = torch.cat([p0, state.p[..., None]], -1)
            f0 = torch.cat([f0, state.f[..., None]], -1)
    if state is not None:
        p0, f0 = p0.contiguous(), f0.contiguous()
    cfg = config if config is not None else hla3_config(B, T, H, K, vv.shape[-1], q.dtype, q.device, chunk_size)
    refuse_ahla_fields(cfg, "hla3")
    if cfg.bwd_pieces != 1:   # HLA3's backward walk has no pieces (HLA2's and AHLA's have)
        raise ValueError(f"config.bwd_pieces must be 1 for hla3 (its backward walks the sequence in one piece), "
                         f"got {cfg.bwd_pieces}")
    if autograd_records(q, k, v, g, s0, p0, f0):
        check_grad_layout(cfg, K, q.dtype, q.device)
    if launch is None:   # the rehearsal takes the layout chosen here
        compile_ahead("hla3", hla3_chunked, (q, k, v, g, gamma, state, normalize, eps, cfg, chunk_size), q.device)
        launch = launch_kernel
    o, S, P, F = HLA3ChunkFunction.apply(q, k, vv, g, s0, p0, f0, gamma, cfg,
                                         torch.float32 if normalize else v.dtype, launch)
    if not normalize:
        return o, HLA3State(S, P, F, None, None)
    o = (o[..., :V] / (o[..., V:] + eps)).to(v.dtype)
    return o, HLA3State(S, P[..., :V], F[..., :V], P[..., V], F[..., V])
