"""Chunk-local cumulative sums of the log-gates, computed once per call for the kernels that read them.

A kernel of chunk size C needs, for every chunk, beta_r = b_{start + r} - b_{start - 1} (``gates.py``):
the cumulative sum of the chunk's log-gates. Summing them inside a walk costs each chunk a scan
across the program's threads and a round trip through shared memory for every layout the sums are
used in, on the walk's critical path; read from memory, the sums are a load the compiler issues in
whichever layout a use needs. So the launchers of the first-order walks (``ahla/chunk.py``) run
:func:`chunk_sums` first, one small launch, and the walks load ``beta`` (``tiles.summed_beta``).

One call walks the same chunks several times: a training call of AHLA runs its forward walk and
its backward's kernels (two layers of them, and a recompute walk where the forward kept no states),
HLA2 as layers two layers at two rates, HLA3 its first stage and two layers at rates 1 and 3, and
heads in key blocks every layer once a block. Their launchers take the call's :class:`GateSums` in
place of g (:func:`sums_at`), which computes the sums of one rate and chunk size once and hands the
same tensor to every later walk.

Layout: ``gc`` is fp32 ``[B * H, NT * C]``, head-major, every head's tokens contiguous and padded to
whole chunks. A padded row adds the log-gate 0, so it repeats the chunk's last valid sum: the last
row of a chunk then holds the chunk's total beta_L, read with one scalar load.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .compile import launch_kernel
from .launch import cdiv, pow2_block
from .tiles import read_gates, sums_offset


@triton.jit
def chunk_sums_kernel(
    g,                       # log-gates [B, T, H] (any float dtype)
    gc,                      # out: chunk-local cumulative sums, fp32 [B * H, NT * BT]
    T,                       # sequence length
    H: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
):
    """One program per (chunk, batch): every head's beta = cumsum(g) over the chunk's rows
    (0 added past T; each g floored, ``tiles.read_gates``), read as one [BT, BH] tile of g's
    contiguous rows and stored at each head's padded row (reference: ``gates.chunk_local_cumsum``)."""
    i_c, i_b = tl.program_id(0), tl.program_id(1)
    NT = tl.cdiv(T, BT)
    t = i_c * BT + tl.arange(0, BT)                                   # the chunk's tokens [BT]
    h = tl.arange(0, BH)                                              # heads [BH]
    mh = h < H
    b_g = read_gates(g + i_b.to(tl.int64) * T * H + t[:, None] * H + h[None, :],
                     (t < T)[:, None] & mh[None, :])                  # [BT, BH], 0 past T, floored
    beta = tl.cumsum(b_g, axis=0)                                     # [BT, BH], padded rows repeat the last
    rows = sums_offset(i_b * H + h, NT, BT)                           # each head's first element of gc
    tl.store(gc + rows[None, :] + t[:, None], beta, mask=mh[None, :])


def chunk_sums(g: torch.Tensor | None, chunk: int, launch=launch_kernel) -> torch.Tensor | None:
    """The chunk-local cumulative sums of g [B, T, H] (contiguous) in chunks of
    ``chunk`` rows: fp32 [B * H, NT * chunk] (the module docstring's layout); None for a g of
    None (a constant decay or none, which the kernels form themselves)."""
    if g is None:
        return None
    B, T, H = g.shape
    NT = cdiv(T, chunk)
    gc = torch.empty(B * H, NT * chunk, device=g.device, dtype=torch.float32)
    launch(chunk_sums_kernel, (NT, B), g=g, gc=gc, T=T, H=H, BT=chunk, BH=pow2_block(H),
           num_warps=4)
    return gc


class GateSums:
    """One call's log-gates g [B, T, H] at a rate c (a layer weighted exp(c (b_t - b_j)) reads the
    sums of c g), with their chunk sums computed at most once for each rate and chunk size
    (the module docstring). ``scaled`` gives the same gates at another rate, sharing the memo;
    ``dtype`` is g's (a gradient of the gates is returned in it). Made by the autograd Functions
    (``ahla/chunk.py``, ``hla2/chunk.py``'s layers, ``hla3/chunk.py``) and kept on their context
    for the backward."""

    def __init__(self, g: torch.Tensor, rate: float = 1.0, launch=launch_kernel, memo: dict | None = None):
        self.g, self.rate, self.launch, self.dtype = g, rate, launch, g.dtype
        self._memo = {} if memo is None else memo   # (rate, chunk) -> sums; ("g", rate) -> rate * g in fp32

    def scaled(self, c: float) -> "GateSums":
        """These gates at c times this rate (the same memo)."""
        return GateSums(self.g, self.rate * c, self.launch, self._memo)

    def at(self, chunk: int) -> torch.Tensor:
        """:func:`chunk_sums` of rate * g in chunks of ``chunk`` rows, computed on the first call.
        A rate other than 1 multiplies g in fp32 first (a factor of 3 stays exact where bf16 would
        round it)."""
        key = (self.rate, chunk)
        if key not in self._memo:
            g = self.g
            if self.rate != 1:
                g = self._memo.setdefault(("g", self.rate), self.g.float() * self.rate)
            self._memo[key] = chunk_sums(g, chunk, launch=self.launch)
        return self._memo[key]


def sums_at(g, chunk: int, launch=launch_kernel) -> torch.Tensor | None:
    """The chunk sums a walk in chunks of ``chunk`` rows reads: None for g None (a constant decay or
    none), a :class:`GateSums`' own (computed once), or :func:`chunk_sums` of a tensor g [B, T, H]."""
    if isinstance(g, GateSums):
        return g.at(chunk)
    return chunk_sums(g, chunk, launch=launch)

