"""Decay and per-token gates, shared by every operator.

Convention (flash-linear-attention's ``g`` of ``chunk_simple_gla``): ``g[b, t, h] <= 0`` is the log of
the factor a_t in (0, 1] that every prefix moment is multiplied by at token t, and
b_t = sum_{s <= t} g_s. A term is weighted by the gates each of its decayed indices has been
through: the symmetric operators of order p by exp(p b_t - sum of b over their summed indices)
(HLA2: exp(2 b_t - b_i - b_j); third order: exp(3 b_t - b_i - b_u - b_j)), AHLA, whose inner moment
k_i q_i^T is not decayed, by exp(b_t - b_j). A constant decay gamma is g = log(gamma) at every
token; no decay is g = 0.

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

The gate floor. In fp32, beta keeps about seven significant digits of its own size, and a decay
inside a chunk is a difference of two betas. One gate that closes hard (g_s = -1e4, say) leaves
every later beta of its chunk near -1e4, where fp32's spacing is 1e-3: the decays between the tokens
after it, which do not involve the gate at all, would carry errors of 1e-3; at -1e9 the outputs were
0.2 to 0.5 off. So every fp32 path (the kernels, and the torch backend below float64) reads each
log-gate as max(g, GATE_FLOOR), with GATE_FLOOR = -30 (``gate_floor``): a factor across a floored
gate is at most e^-30 ~ 9e-14, far below fp32's resolution of 6e-8, so the gate still cuts the
context, and the later betas of its chunk sit near -30, a size strong gates reach anyway (30 tokens
of g = -1), where fp32's spacing is 2e-6: each later sum rounds by at most 1e-6, so a decay across r
tokens after the gate is off by at most about r * 1e-6 (1e-5 over a dozen tokens; notebook 09 shows
one).
float64 keeps about sixteen digits, so the same loss starts at larger gates (at g_s = -1e15 the
outputs after the gate were 1e-2 off, at -1e17 1e-1): the float64 torch path floors each log-gate
at GATE_FLOOR_64 = -50, a factor of 2e-22 against float64's resolution of 1.1e-16 (the margin the
fp32 floor keeps), beyond which the later betas of its chunk sit near -50 and round by 7e-15.
A decode step multiplies by exp(g) itself (no difference of sums) and needs no floor. The gradient
of a floored gate is that of the floor value (about e^-30, or e^-50, times the others: zero to the
path's precision, as the exact one is).
"""
from __future__ import annotations

import math

import torch


# the smallest log-gate an fp32 path uses, and the float64 path (module docstring, "The gate floor")
GATE_FLOOR = -30.0
GATE_FLOOR_64 = -50.0


def gate_floor(g: torch.Tensor) -> torch.Tensor:
    """g as a path sums it: max(g, GATE_FLOOR) below float64, max(g, GATE_FLOOR_64) in float64
    (module docstring, "The gate floor"). Differentiable (zero gradient below the floor)."""
    return g.clamp_min(GATE_FLOOR_64 if g.dtype == torch.float64 else GATE_FLOOR)


def log_gamma(gamma) -> float:
    """log(gamma) for a checked gamma (None: no decay, 0.0)."""
    return 0.0 if gamma is None else math.log(gamma)


def gates_from_gamma(gamma, like: torch.Tensor) -> torch.Tensor:
    """The log-gates of a constant decay: log(gamma) at every token, of ``like``'s shape, in
    float64 for a float64 ``like`` and fp32 otherwise."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.full(like.shape, log_gamma(gamma), device=like.device, dtype=dtype)


def call_gates(g, gamma, q: torch.Tensor):
    """The log-gates [B, T, H] an operator's torch path takes: ``g`` itself, those of a constant
    ``gamma`` (:func:`gates_from_gamma`), or None without decay. q: [B, T, H, K]."""
    if g is not None:
        return g
    return None if gamma is None else gates_from_gamma(gamma, q[..., 0])


def chunk_local_cumsum(g: torch.Tensor, chunk: int) -> torch.Tensor:
    """beta [B, H, NT, C] from log-gates g [B, T, H]: the cumulative sum inside each chunk of
    ``chunk`` tokens. Padding past T adds 0, so padded rows repeat the chunk's last beta.
    Differentiable (the torch backend relies on autograd through it). Each g is floored first
    (:func:`gate_floor`; below float64 as the kernels do)."""
    B, T, H = g.shape
    NT = -(-T // chunk)
    x = gate_floor(g).transpose(1, 2)
    if NT * chunk != T:
        x = torch.nn.functional.pad(x, (0, NT * chunk - T))
    return x.reshape(B, H, NT, chunk).cumsum(-1)


def reverse_cumsum(db: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """sum_{s >= t} db_s along ``dim``: the gradient of the log-gates g from that of b = cumsum(g).

    The scan runs along the last dimension of a copy that has ``dim`` last (the result has
    ``db``'s layout again): CUDA's scan along an outer dimension of a [B, T, H] tensor, with the
    heads innermost, took longer at B = 4, T = 32k, H = 16 on an H200 than AHLA's whole
    forward + backward (benchmarks/results/kernels_ahla_h200_outer_scan.md)."""
    x = db.movedim(dim, -1).flip(-1).cumsum(-1).flip(-1)
    return x.movedim(-1, dim).contiguous()


def summed_shares(db: torch.Tensor | None) -> torch.Tensor | None:
    """dL/db [B, T, H] from the gradient launches' shares [P, B, T, H] (one a launch, each adding
    the terms of the gradients it computes); the one share itself, without a sum's kernel, when a
    single launch computed every gradient. None stays None."""
    if db is None:
        return None
    return db[0] if db.shape[0] == 1 else db.sum(0)


def log_gate_grad(db: torch.Tensor, finals, dtype: torch.dtype) -> torch.Tensor:
    """dL/dg from dL/db [B, T, H] fp32 (the gradient through the outputs' weights): the final
    states' share added at the last token, then :func:`reverse_cumsum`, in ``dtype``.

    finals: (X_T, dX_T, w) for each final state (fp32 [B, H, ...]) and its cotangent (None when
    the loss does not use it), w the multiple of b_T in its weights' exponent (a state
    sum_j exp(w b_T - ...) ... carries dL/db_T = w <X_T, dX_T>). ``db`` is updated in place."""
    for x, dx, w in finals:
        if dx is not None:
            db[:, -1] += w * (x * dx.float()).flatten(2).sum(-1)
    return reverse_cumsum(db).to(dtype)


def chunk_decay_tiles(beta: torch.Tensor, valid: torch.Tensor):
    """The torch side of ``tiles.chunk_decays``: from beta [B, H, NT, C] (chunk_local_cumsum) and
    valid [NT, C] (rows < T), the factors G [B, H, NT, C, C] (exp(beta_r - beta_j) for j <= r, else
    0), g1 = exp(beta) and gl = exp(beta_L - beta) (0 on padding), both [B, H, NT, C], and
    gC = exp(beta_L) [B, H, NT]. Every exponent taken is <= 0 (selections, no exp of a positive
    difference above the diagonal), so the gradient through them stays finite too."""
    C = beta.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=beta.device).tril()
    diff = beta[..., :, None] - beta[..., None, :]
    zero = torch.zeros_like(diff)
    G = torch.where(causal, torch.exp(torch.where(causal, diff, zero)), zero)
    bL = beta[..., -1]  # padding adds log-gates 0, so the last row holds the chunk's total
    gl = torch.where(valid, torch.exp(bL[..., None] - beta), torch.zeros_like(beta))
    return G, torch.exp(beta), gl, torch.exp(bL)


def log_gates_like(q: torch.Tensor, gamma, g) -> torch.Tensor:
    """[B, T, H] log-gates in q's dtype (q: [B, T, H, K]) from g [B, T, H] or a constant gamma
    (zeros for neither): the dense form the plain references use."""
    if g is not None:
        return g.to(q.dtype)
    return torch.full(q.shape[:-1], log_gamma(gamma), dtype=q.dtype, device=q.device)


def causal_decay_matrix(b: torch.Tensor):
    """From cumulative log-gates b [..., T]: causal [T, T] (bool, row >= column) and the decay
    matrix [..., T, T] with exp(b_r - b_c) on and below the diagonal and 0 above it (every exponent
    taken is <= 0 for log-gates <= 0; above the diagonal a selection, not an exp)."""
    T = b.shape[-1]
    t = torch.arange(T, device=b.device)
    causal = t[:, None] >= t[None, :]  # [T, T], row >= column
    diff = b[..., :, None] - b[..., None, :]
    zero = torch.zeros_like(diff)
    return causal, torch.where(causal, torch.exp(torch.where(causal, diff, zero)), zero)
