"""Chunked HLA3 on the Triton kernels: two stages of kernels the family already has.

The decay of third order splits at the middle index u,

    exp(3 b_t - b_i - b_u - b_j) = exp(3 b_t - b_i - 2 b_u) * exp(b_u - b_j),

and the sum over j involves u only. So with first-order gated linear attention

    R_u = sum_{j <= u} exp(b_u - b_j) (q_u . k_j) v_j          (state P_u = sum_j exp(b_u - b_j) k_j v_j^T)

masked third order is a second-order pass over the values R,

    o_t = sum_{i <= u <= t} exp(3 b_t - b_i - 2 b_u) (q_t . k_i)(k_i . q_u) R_u ,

HLA2 but for the exponents (3, 1, 2) on (t, i, u) where HLA2 has (2, 1, 1): its inner index decays at
rate 2 (``hla2.chunk_kernels._inner_factors``, ``rate=2`` in ``hla2.chunk``). Its states are HLA2's
S_t = sum_i exp(b_t - b_i) k_i k_i^T and, in place of W, F_t = sum_u exp(3 (b_t - b_u)) S_u q_u R_u^T:
third order's state (S, P, F) of notebook 08 (section 5 of the derivation there: F_t = a_t^3 F_{t-1} +
(S_t q_t)(q_t^T P_t)). At gamma = 1 the second pass is exactly HLA2 on (Q, K, R).

Forward (:class:`HLA3StagedFunction`): ``ahla.chunk.layer_fwd`` (the AHLA forward walk without its
second layer) gives R, P_T and the chunk-start P's; the HLA2 launcher at rate 2 gives O, S_T, F_T and
its chunk-start states. Backward: the HLA2 backward at rate 2 gives dq, dk, dR and the gate gradient of
its weights; ``ahla.chunk.layer_bwd`` takes dR as its output gradient and adds its dq, dk to the
first's in the same launch. dL/db is the sum of the two stages' (each a reverse cumulative sum of dot
products: ``hla2_bwd_grad_kernel``'s docstring for rate c, q.dq - k.dk for the first stage) and the
final state's share.

Why two stages. The kernels this replaced walked both stages in one program per head and chunk, with
three states and R recomputed in the backward; the per-chunk gradient program held some twenty tiles
and spilled kilobytes. Timed in one process against them (bf16, B = 4, H = 16, T = 32k, K = V = 64,
``benchmarks/results/hla3_h200_ab_staged.json``) the two stages are faster forward and forward +
backward and leave a smaller training peak beyond the inputs (numbers in hla_fast/README.md, third order).

The second stage as two first-order layers (``ChunkConfig.layers``, HLA2's at rate 2; the rule takes
them where HLA2's does). The second stage's weight splits at u as HLA2's does at its inner index,
exp(3 b_t - b_i - 2 b_u) = exp(3 (b_t - b_u)) exp(b_u - b_i), so

    K'_u = sum_{i <= u} exp(b_u - b_i) (q_u . k_i) k_i = S_u q_u = LA(Q, K, K; g)_u ,
    o_t  = sum_{u <= t} exp(3 (b_t - b_u)) (q_t . K'_u) R_u = LA(Q, K', R; 3 g)_t :

third order is three first-order layers, R and K' on (Q, K) and the outer one on (Q, K', R), whose
states are P, S^T and F (``hla2.chunk.layers_fwd``, ``layers_bwd``; the backward runs the outer
layer, then K''s, then R's, each adding its dq, dk to the last's). dL/db is then q.dq - k.dk of R's
and K''s layers plus 3 (q.dq - K'.dK') of the outer one, plus the final states' share. R's and K''s
layers read the same q and k, so with ``ChunkConfig.fwd_shared_walk`` (the rule's for tiles up to
SHARED_WALK_MAX wide) the forward walks them at once, P and S^T side by side
(``ahla.chunk.layer_pair_fwd``): one read of each chunk's q and k and one A = (Q K^T) o G for both.

Normalization: the Function computes the unnormalized operator; ``hla3_chunked`` runs it on the values
[v | 1] (state [P | p], [F | f]) and divides in torch, so autograd differentiates the quotient: the
denominator is the operator applied to a column of ones, the first stage's R then gains the column
sum_j exp(b_u - b_j) (q_u . k_j). This costs one more value column (for V = 64 a second value block).

Limit: heads up to TILE_MAX = 128 key features (``interface.TRITON_MAX_K``).

Launches go through each launcher's ``launch`` argument (``common.compile.launch_kernel``); the entry
point first has ``common.compile.compile_ahead`` rehearse a new call with a recorder there and compile
its kernels at once.
"""
from __future__ import annotations

import functools

import torch

from ..ahla.chunk import ahla_config, layer_bwd, layer_fwd, layer_pair_fwd
from ..common.compile import compile_ahead, launch_kernel
from ..common.config import ChunkConfig, chunk_or_default, refuse_ahla_fields, refuse_den_pass, refuse_split_forward
from ..common.cumsum import GateSums
from ..common.autograd import autograd_records, kernel_backward
from ..common.launch import pow2_block, snapshot_dtype
from ..common.normalize import quotient, quotient_values, with_column
from ..common.gates import log_gate_grad
from ..hla2 import chunk as hla2_chunk
from .state import HLA3State

# widest key tile one program holds (the second stage's S: a K x K fp32 tile beside F: K x BV)
TILE_MAX = 128
# widest key and value tiles whose R and K' the rule walks at once (fwd_shared_walk): the walk then
# holds P [K, V] and S^T [K, K] in fp32 beside the chunk's tiles
SHARED_WALK_MAX = 64


@functools.lru_cache(maxsize=4096)
def hla3_config(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device,
                chunk_size: int | None = None, gated: bool = False, training: bool = False,
                normalize: bool = False) -> ChunkConfig:
    """The default layout of the second stage, HLA2's rule at rate 2 (``hla2.chunk``): first-order
    layers (``hla2.chunk.layers_config``, in which the first stage then runs too) where
    ``hla2.chunk.takes_layers`` says so for HLA2, else the fused kernels' rule
    (``hla2.chunk.fused_config``). Timed in one process against the fused second stage (bf16,
    B = 4, H = 16, T = 32k, ``benchmarks/results/hla3_h200_ab_layers.json``; numbers in
    hla_fast/README.md, third order). ``gated``: the call has log-gates g; ``training``: autograd
    records the call (HLA2's fused rule then splits a long bf16 forward of 128-wide keys, whose
    chunk states the backward keeps anyway: faster forward + backward at K = V = 128, T = 32k,
    bit-identical, ``benchmarks/results/hla3_h200_ab_split_second_stage.json``; that
    rule's layout at K = V = 64 was the fastest of those swept,
    ``hla3_h200_second_stage_layouts_k64.json``); ``normalize``: the call normalizes (the layers
    are not taken). V: the values the kernels see (``ones_width(V)`` when normalizing). Without layers the
    first stage takes AHLA's rule (:func:`first_stage_config`); a ``config`` passed to ``hla3``
    sets both, or each with a pair. The result is immutable, so it is cached.

    As layers, R and K' walk at once (``fwd_shared_walk``) for key and value tiles up to
    SHARED_WALK_MAX wide: timed against the three layers walked apart, without loading ahead and in
    eight segments (bf16, B = 4, H = 16, T = 32k, K = V = 64, each in its own process,
    ``python benchmarks/split_forward.py --op hla3 --dims 64 --layouts '[{}, {"fwd_shared_walk":
    false}, {"fwd_prefetch": false}, {"fwd_segments": 8}]'``,
    ``benchmarks/results/hla3_h200_shared_walk.json``; numbers in hla_fast/README.md, third order)."""
    if hla2_chunk.takes_layers(T, K, V, dtype, normalize, training):
        cfg = hla2_chunk.layers_config(B, T, H, K, V, dtype, device, chunk_size, training)
        if max(pow2_block(K), pow2_block(V)) <= SHARED_WALK_MAX:
            cfg = cfg.replace(fwd_shared_walk=True)
        return cfg
    return hla2_chunk.fused_config(B, T, H, K, V, dtype, device, chunk_size, gated=gated, training=training)


def stage_configs(config) -> tuple[ChunkConfig, ChunkConfig]:
    """The two stages' layouts from ``hla3``'s ``config`` (checked: a ChunkConfig or a pair of
    them): one config sets both (with ``layers``, the first stage's one layer runs in its
    forward and backward fields); of a pair, the first stage's may not ask for what only HLA2's
    forward, AHLA's backward walk or the second stage has (the split forward, ``bwd_prefetch``,
    ``layers``), the second's not for what only AHLA's walks have (loading ahead, the layered
    backward), unless it runs as layers (which load ahead as AHLA's forward walk does); neither
    for HLA2's normalized outer layer (``fwd_den_pass``)."""
    for cfg in (config,) if isinstance(config, ChunkConfig) else config:
        refuse_den_pass(cfg, "hla3")
    if isinstance(config, ChunkConfig):
        if config.layers:
            return first_of_layers(config), config
        refuse_ahla_fields(config, "hla3")
        return config, config
    cfg1, cfg2 = config
    if cfg2.fwd_shared_walk:
        raise ValueError("config[1].fwd_shared_walk runs the first stage's layer in the second stage's walk and layout: "
                         "pass one ChunkConfig for both stages, not a pair")
    if cfg1.layers:
        raise ValueError("config[0].layers must be False for hla3's first stage (it is one first-order layer "
                         "whatever the config; layers is the second stage's field, config[1]), got True")
    refuse_split_forward(cfg1, "hla3's first stage (config[0])")
    if cfg1.bwd_prefetch:
        raise ValueError("config[0].bwd_prefetch must be False for hla3's first stage (its backward runs AHLA's "
                         "per-layer kernels, which do not load ahead), got True")
    if not cfg2.layers:
        refuse_ahla_fields(cfg2, "hla3's second stage (config[1])")
    return cfg1, cfg2


def first_of_layers(cfg2: ChunkConfig) -> ChunkConfig:
    """The first stage's layout when the second runs as layers (``cfg2``): the same walk, one layer."""
    return cfg2.replace(layers=False, fwd_shared_walk=False)


def first_stage_config(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device,
                       chunk_size: int | None = None, training: bool = False) -> ChunkConfig:
    """The default layout of the first stage: AHLA's rule (``ahla.chunk.ahla_config``), whose
    forward walk it runs without the second layer and whose layer kernels give its backward
    (``training``: the forward will be differentiated). Timed in one process against HLA2's rule
    for both stages (bf16, B = 4, H = 16, T = 32k, ``benchmarks/results/hla3_h200_ab_first_stage.json``;
    numbers in hla_fast/README.md, third order): faster forward and forward + backward at K = V = 64
    (AHLA's walk loads ahead there) and at 128 (chunks of 64 in 4 warps instead of HLA2's 32 in 8).
    A ``chunk_size`` of None is DEFAULT_CHUNK here: AHLA's rule would run a bf16
    inference forward of 128-wide keys in chunks of 128, measured for AHLA's walk with its second
    layer, not for this one. Without ``bwd_prefetch``, which AHLA's rule gives its own backward walk
    at 128-wide keys: this stage's backward runs the per-layer kernels, which do not load ahead (so
    the pair of both rules passes ``stage_configs``' checks)."""
    return ahla_config(B, T, H, K, V, dtype, device, chunk_or_default(chunk_size), training=training).replace(
        bwd_prefetch=False)


def stage_rules(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device,
                chunk_size: int | None = None, gated: bool = False, training: bool = False,
                normalize: bool = False) -> tuple[ChunkConfig, ChunkConfig]:
    """The layouts a call without ``config`` takes (the arguments as :func:`hla3_config`'s): the
    second stage's by :func:`hla3_config`; the first stage's the same walk when the second runs as
    layers (three first-order layers in one layout), else AHLA's (:func:`first_stage_config`)."""
    cfg2 = hla3_config(B, T, H, K, V, dtype, device, chunk_size, gated=gated, training=training, normalize=normalize)
    if cfg2.layers:
        return first_of_layers(cfg2), cfg2
    return first_stage_config(B, T, H, K, V, dtype, device, chunk_size, training=training), cfg2


def first_stage_states(q, k, v, g, gamma, p0, cfg: ChunkConfig, launch=launch_kernel):
    """The first stage's chunk-start states P at the backward's chunks (a walk without outputs in
    the backward's chunks and warps), for a backward whose forward did not keep them."""
    again = cfg.replace(fwd_chunk=cfg.bwd_chunk, fwd_warps=cfg.bwd_warps)
    return layer_fwd(q, k, v, g, gamma, p0, again, keep_states=True, launch=launch)[2]


class HLA3StagedFunction(torch.autograd.Function):
    """Autograd of the unnormalized HLA3 on the Triton kernels, as its two stages (module docstring),
    the second on HLA2's fused kernels or, with ``cfg2.layers``, as two first-order layers; with
    ``cfg2.fwd_shared_walk`` too, the forward walks R and K' at once (both read q and k), in cfg2's
    layout (cfg1 is then cfg2's first layer alone, ``first_of_layers``).

    forward(q [B,T,H,K], k, v [B,T,H,V], g [B,T,H] | None, s0 [B,H,K,K] | None, p0 [B,H,K,V] | None,
    f0 [B,H,K,V] | None, gamma, cfg1, cfg2, launch) -> (o [B,T,H,V] in v's dtype, S_T, P_T, F_T fp32),
    cfg1 and cfg2 the stages' layouts. The backward is not itself differentiable (it raises if asked)."""

    @staticmethod
    def forward(ctx, q, k, v, g, s0, p0, f0, gamma, cfg1, cfg2, launch):
        # an output the loss does not use gets None, not a materialized zero tensor (the final
        # state's cotangents are [B, H, K, K]-sized: zeros would cost memory and a walk from zero)
        ctx.set_materialize_grads(False)
        grads = any(ctx.needs_input_grad[:7])
        # the first-order walks share the gate sums (rate 1, and 3 for the outer layer), with the backward too;
        # HLA2's fused second stage reads g itself
        sums = None if g is None else GateSums(g, launch=launch)
        if cfg2.layers:   # the stage's initial state from here on is S0^T: the inner layer reads q^T S0
            s0 = hla2_chunk.transposed(s0)
        if cfg2.fwd_shared_walk:
            # -- R = LA(q, k, v) from P0 and K' = LA(q, k, k; g) from S0^T in one walk, then
            # o = LA(q, K', R; 3 g) from F0 ---------------------------------------------------------
            keep = grads and cfg2.keeps_states
            r, kp, pT, sT, cs_p, cs_s = layer_pair_fwd(q, k, v, k, sums, gamma, p0, s0, cfg2, keep_states=keep,
                                                       launch=launch)
            o, fT, cs_f = hla2_chunk.outer_layer_fwd(q, kp, r, sums, gamma, f0, cfg2, 2, keep, launch)
            sT = hla2_chunk.transposed(sT)
        else:
            # -- first stage: R = LA(q, k, v) from P0 --------------------------------------------
            r, pT, cs_p = layer_fwd(q, k, v, sums, gamma, p0, cfg1, keep_states=grads and cfg1.keeps_states,
                                    launch=launch)
            # -- second stage: HLA2 at rate 2 on (q, k, R) from (S0, F0) -------------------------
            if cfg2.layers:
                # K' = LA(q, k, k; g) from S0^T, then o = LA(q, K', R; 3 g) from F0
                keep = grads and cfg2.keeps_states
                o, sT, fT, kp, cs_s, cs_f = hla2_chunk.layers_fwd(q, k, r, sums, gamma, s0, f0, cfg2, 2, keep,
                                                                  launch)
            else:
                keep = grads and hla2_chunk.keeps_states(cfg2, q, None, v.shape[-1])
                o, _, sT, fT, _, cs = hla2_chunk.fwd_launch(
                    q, k, r, g, gamma, s0, f0, None, snapshots=snapshot_dtype(cfg2, q.dtype) if keep else None,
                    rate=2, launch=launch, **hla2_chunk.forward_layout(cfg2))
                kp = None
                cs_s, cs_f = (None, None) if cs is None else cs[:2]
        # the final state is read back only for the log-gates' gradient (its own factor e^{b_T})
        final = (sT, pT, fT) if g is not None and ctx.needs_input_grad[3] else (None, None, None)
        ctx.save_for_backward(q, k, v, g, s0, p0, f0, r, kp, *final, cs_p, cs_s, cs_f)
        ctx.gamma, ctx.cfgs, ctx.launch, ctx.sums = gamma, (cfg1, cfg2), launch, sums
        return o, sT, pT, fT

    @staticmethod
    @kernel_backward
    def backward(ctx, do, dsT, dpT, dfT):
        q, k, v, g, s0, p0, f0, r, kp, sT, pT, fT, cs_p, cs_s, cs_f = ctx.saved_tensors
        (cfg1, cfg2), gamma, launch = ctx.cfgs, ctx.gamma, ctx.launch
        want_dg = g is not None and ctx.needs_input_grad[3]
        if do is None:
            do = torch.zeros_like(v)
        # -- second stage: dq, dk, dR (and its share of dL/db) ------------------------------------
        if cfg2.layers:
            dq, dk, dr, ds0, df0, db, _ = hla2_chunk.layers_bwd(q, k, r, kp, do, ctx.sums, gamma, s0, f0, cs_s, cs_f,
                                                             dsT, dfT, cfg2, 2, want_dg, launch)
        else:
            dq, dk, _, _, dr, ds0, df0, db, _ = hla2_chunk.bwd_launch(
                q, k, r, do, g, gamma, s0, f0, dsT, dfT, cfg2, states=None if cs_s is None else (cs_s, cs_f, None),
                want_db=want_dg, rate=2, launch=launch)
        # -- first stage, from dR: dv, and its dq, dk added to the second's in the same launch -----
        if cs_p is None:
            cs_p = first_stage_states(q, k, v, ctx.sums, gamma, p0, cfg1, launch)
        dv, dq, dk, dp0, db1 = layer_bwd(q, k, v, dr.contiguous(), ctx.sums, gamma, cs_p, dpT, p0 is not None, cfg1,
                                         dq_in=dq, dk_in=dk, want_db=want_dg, db_own=True, launch=launch)
        dg = None
        if want_dg:
            # S_T, P_T carry exp(b_T - .), F_T exp(3 b_T - .): their share of dL/db_T
            dg = log_gate_grad(db + db1, ((sT, dsT, 1.0), (pT, dpT, 1.0), (fT, dfT, 3.0)), g.dtype)
        return dq, dk, dv, dg, ds0, dp0, df0, None, None, None, None


def hla3_chunked(q, k, v, g, gamma, state, normalize, eps, config=None, chunk_size=None, launch=None):
    """HLA3 on the Triton kernels (K <= TILE_MAX through the checks).

    q, k: [B, T, H, K]; v: [B, T, H, V] (contiguous); g: [B, T, H] or None; state: a checked fp32
    HLA3State or None; config: a ChunkConfig for both stages, a pair (first stage's, second
    stage's), or None for each stage's rule (``first_stage_config``, ``hla3_config``). launch: how
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
        # (padded with zero columns to a multiple of 16: common.normalize, "Width")
        vv = quotient_values(v)
        if state is not None:
            p0, f0 = with_column(p0, state.p, vv.shape[-1]), with_column(f0, state.f, vv.shape[-1])
    if state is not None:
        p0, f0 = p0.contiguous(), f0.contiguous()
    if config is not None:
        cfg1, cfg2 = stage_configs(config)
    else:
        Vk, training = vv.shape[-1], autograd_records(q, k, v, g, s0, p0, f0)
        cfg1, cfg2 = stage_rules(B, T, H, K, Vk, q.dtype, q.device, chunk_size, gated=g is not None,
                                 training=training, normalize=normalize)
    if launch is None:   # the rehearsal takes the layouts chosen here (a config as given)
        compile_ahead("hla3", hla3_chunked, (q, k, v, g, gamma, state, normalize, eps, config, chunk_size), q.device)
        launch = launch_kernel
    o, S, P, F = HLA3StagedFunction.apply(q, k, vv, g, s0, p0, f0, gamma, cfg1, cfg2, launch)
    if not normalize:
        return o, HLA3State(S, P, F, None, None)
    o = quotient(o, V, eps, v.dtype)
    return o, HLA3State(S, P[..., :V], F[..., :V], P[..., V], F[..., V])
