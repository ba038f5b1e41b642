"""Decay and per-token gates, shared by every operator.

Convention (flash-linear-attention's ``g`` of ``chunk_simple_gla``): ``g[b, t, h] <= 0`` is the log of
the factor a_t in (0, 1] that every prefix moment is multiplied by at token t, and
b_t = sum_{s <= t} g_s. An operator of order p weights a term by exp(p b_t - sum of b over its summed
indices) (HLA2: exp(2 b_t - b_i - b_j)). A constant decay gamma is g = log(gamma) at every token;
no decay is g = 0.

Inside a chunk only differences of b enter, so the kernels use the chunk-local cumulative sum
beta_r = b_{start + r} - b_{start - 1} (r = 0 .. C-1, <= 0 and non-increasing). Every factor a kernel
forms is exp of a difference arranged to be <= 0, so a gate near 0 underflows to 0 instead of
overflowing:

    G[r, j] = exp(beta_r - beta_j)  (j <= r, else 0)   decay from token j to token r
    g1[r]   = exp(beta_r)                                 from the chunk start to row r
    gl[r]   = exp(beta_L - beta_r)                        from row r to the chunk end (0 on padding)
    gC      = exp(beta_L)                                 across the whole chunk

with L the chunk's last valid row. Padded rows (past T) get g = 0, so their beta equals beta_L.
The kernels' side of this (``chunk_beta``, ``chunk_decays``) is in ``tiles.py``; this module is
the host side and imports no Triton, so the torch backend runs without it.
"""
from __future__ import annotations

import math

import torch


def log_gamma(gamma) -> float:
    """log(gamma) for a checked gamma (None: no decay, 0.0)."""
    return 0.0 if gamma is None else math.log(gamma)


def gates_from_gamma(gamma, like: torch.Tensor) -> torch.Tensor:
    """The log-gates of a constant decay: log(gamma) at every token, of ``like``'s shape, in
    float64 for a float64 ``like`` and fp32 otherwise."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.full(like.shape, log_gamma(gamma), device=like.device, dtype=dtype)


def chunk_local_cumsum(g: torch.Tensor, chunk: int) -> torch.Tensor:
    """beta [B, H, NT, C] from log-gates g [B, T, H]: the cumulative sum inside each chunk of
    ``chunk`` tokens. Padding past T adds 0, so padded rows repeat the chunk's last beta.
    Differentiable (the torch backend relies on autograd through it)."""
    B, T, H = g.shape
    NT = -(-T // chunk)
    x = g.transpose(1, 2)
    if NT * chunk != T:
        x = torch.nn.functional.pad(x, (0, NT * chunk - T))
    return x.reshape(B, H, NT, chunk).cumsum(-1)


def reverse_cumsum(db: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """sum_{s >= t} db_s along ``dim``: the gradient of the log-gates g from that of b = cumsum(g)."""
    return db.flip(dim).cumsum(dim).flip(dim)
