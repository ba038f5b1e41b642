"""Slice summaries and their combines: what a rank of a context-parallel call exchanges.

A slice ``B`` of the sequence (tokens ``s .. e``) run from a zero state gives the operator's final
state over ``B`` alone. To continue a prefix state ``A`` (the state after token ``s - 1``) across
``B`` exactly, a few more sums over ``B`` are needed: the cross terms whose indices straddle the
boundary. They follow from the weights of each operator. With ``b_t = sum_{x <= t} g_x`` and
``rho_B = exp(b_e - b_{s-1}) = exp(sum_{t in B} g_t)`` (the product of B's factors), a term of order
``p`` read at ``e`` with summed indices ``x_1 .. x_p`` weighs ``exp(p b_e - b_{x_1} - .. - b_{x_p})``;
an index ``x`` in ``A`` splits as ``exp(b_e - b_x) = rho_B exp(b_{s-1} - b_x)``: one ``rho_B`` per
index in ``A``, and the rest of ``A``'s factor is already in ``A``'s state.

HLA2, state ``(S, W, z)`` (``hla_fast.ops.hla2.state``):
``S_t = sum_{i <= t} e^{b_t - b_i} k_i k_i^T``,
``W_t = sum_{j <= t} e^{2(b_t - b_j)} S_j q_j v_j^T = sum_{i <= j <= t} e^{2 b_t - b_i - b_j} k_i (k_i . q_j) v_j^T``.
The pairs ``(i, j)`` with ``i <= j``: both in ``A`` (two indices in A: ``rho_B^2 W_A``), both in
``B`` (``W_B``), or ``i`` in ``A``, ``j`` in ``B`` (one index in A:
``rho_B S_A sum_{j in B} e^{b_e - b_j} q_j v_j^T = rho_B S_A C_B``)::

    S_AB = rho_B S_A + S_B,    W_AB = rho_B^2 W_A + W_B + rho_B S_A C_B,    z_AB: W with v -> 1 (c_B)
    extra pieces of B:  C_B = sum_{j in B} e^{b_e - b_j} q_j v_j^T  [K, V],  c_B = C_B with v -> 1  [K]

AHLA, state ``(P, E, p, e)``: ``P_t = sum_{j <= t} e^{b_t - b_j} k_j v_j^T``,
``E_t = sum_{j <= i <= t} e^{b_t - b_j} k_i (q_i . k_j) v_j^T`` (the middle index ``i`` carries no
decay). ``j`` in ``A``, ``i`` in ``B``: ``rho_B (sum_{i in B} k_i q_i^T) P_A`` with the moment
``R_B = sum_{i in B} k_i q_i^T`` *not* decayed (decaying it is the erratum of the paper's scan,
``hla_ref/asymmetric.py``)::

    P_AB = rho_B P_A + P_B,    E_AB = rho_B E_A + E_B + rho_B R_B P_A,    p, e: the same with v -> 1
    extra piece of B:  R_B [K, K]

HLA3 (masked), state ``(S, P, F, p, f)``: ``F_t = sum_{i <= u, j <= u, u <= t}
e^{3 b_t - b_i - b_u - b_j} k_i (k_i . q_u)(q_u . k_j) v_j^T``. A triple crossing the boundary has
its largest index ``u`` in ``B``; with ``i`` and/or ``j`` in ``A`` (``hla_ref/third_order.py``,
``hla3_combine``, whose segment pieces these are)::

    F_AB = rho^3 F_A + F_B + rho^2 S_A SQ_B P_A + rho S_A R_B + rho N_B P_A     (rho = rho_B)
    S, P, p: rho X_A + X_B;   f: F with v -> 1 (P -> p, R -> r)
    extra pieces of B (u, i, j in B):
      SQ_B = sum_u e^{b_e - b_u} q_u q_u^T                                     [K, K]  (i, j in A)
      R_B  = sum_{j <= u} e^{2 b_e - b_u - b_j} q_u (q_u . k_j) v_j^T          [K, V]  (i in A)
      N_B  = sum_{i <= u} e^{2 b_e - b_u - b_i} k_i (k_i . q_u) q_u^T          [K, K]  (j in A)
      r_B  = R_B with v -> 1                                                   [K]

``R_B`` and ``N_B`` are sums over ``u`` of ``e^{2(b_e - b_u)} q_u o_u^T`` and ``o'_u q_u^T`` with
``o_u = sum_{j <= u} e^{b_u - b_j} (q_u . k_j) v_j`` and ``o'_u = S_u q_u`` the outputs of a decayed
first-order linear attention over ``B`` (values ``v``, resp. ``k``): :func:`decayed_linear_attention`
computes them chunk by chunk, so no ``T x T`` matrix is formed.

The state part of a summary is the operator's own final state from a zero start; the extra pieces
are torch einsums (differentiable, fp32; float64 for float64 inputs). The decays
``e^{b_e - b_u}`` come from suffix sums of the log-gates, so every exponent is ``<= 0``. A summary
holds, per batch row and head, ``log rho`` plus (K, V head sizes; normalized fields in brackets):

    HLA2: S, W, C, [z, c]             K^2 + 2 K V [+ 2 K] + 1 numbers
    AHLA: P, E, R, [p, e]             K^2 + 2 K V [+ 2 K] + 1
    HLA3: S, SQ, N, P, F, R, [p, f, r]  3 K^2 + 3 K V [+ 3 K] + 1

whatever the slice length. Every combine takes a prefix *state* (only the state fields of ``A`` are
read) and a slice summary, and returns a state.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ..common.gates import chunk_local_cumsum


def suffix_decay(lg: torch.Tensor):
    """From log-gates lg [B, T, H]: (w [B, T, H] with w_u = exp(sum_{x > u} lg_x) = e^{b_e - b_u},
    log_rho [B, H] = sum_u lg_u). The suffix sums are formed directly (no difference of prefix
    sums), so every exponent is <= 0 and none loses digits to cancellation."""
    suf = lg.flip(1).cumsum(1).flip(1)                    # sum_{x >= u}
    after = torch.cat([suf[:, 1:], torch.zeros_like(suf[:, :1])], dim=1)
    return torch.exp(after), suf[:, 0]


def linear_attention_chunk(T: int, K: int, D: int) -> int:
    """A chunk for :func:`decayed_linear_attention` that balances its two costs: the masked
    products inside chunks, ~T C (K + D), and the chunk-to-chunk matrix, ~(T / C)^2 K D; their sum
    is smallest near C^3 = T K D / (K + D). A power of two in [16, 256]."""
    c = (T * K * D / (K + D)) ** (1.0 / 3.0)
    return int(min(256, max(16, 1 << max(0, round(math.log2(max(c, 1.0)))))))


def decayed_linear_attention(q, k, v, lg, chunk_size: int = 64):
    """o_u = sum_{j <= u} exp(b_u - b_j) (q_u . k_j) v_j, chunk by chunk (first-order linear
    attention with log-gates).

    q, k: [B, T, H, K]; v: [B, T, H, D]; lg: [B, T, H] log-gates (<= 0) in the compute dtype.
    Inside a chunk: the masked C x C product with decays exp(beta_r - beta_j). Across chunks: the
    state at the start of chunk c is sum_{c' < c} exp(L_{c-1} - L_{c'}) dH_{c'}, with dH_{c'} =
    sum_{j in c'} exp(beta_last - beta_j) k_j v_j^T the chunk's own [K, D] moment and L the running
    sum of the chunks' total log-gates, taken as one [NT, NT] matrix product (no loop over chunks);
    the differences of L are formed in float64, so long sequences lose no digits to cancellation.
    Every exponent is <= 0. Returns o [B, T, H, D]. Differentiable."""
    B, T, H, K = q.shape
    D = v.shape[-1]
    C = min(chunk_size, T)
    NT = -(-T // C)
    pad = NT * C - T

    def chunks(x):  # [B, T, H, X] -> [B, H, NT, C, X]; padded rows are zeros
        x = x.transpose(1, 2)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return x.reshape(B, H, NT, C, x.shape[-1])

    Q, Kc, Vc = chunks(q), chunks(k), chunks(v)
    beta = chunk_local_cumsum(lg, C)                      # [B, H, NT, C]; padding adds 0
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = beta[..., :, None] - beta[..., None, :]
    G = torch.where(causal, torch.exp(torch.where(causal, diff, torch.zeros_like(diff))), torch.zeros_like(diff))
    intra = ((Q @ Kc.transpose(-1, -2)) * G) @ Vc         # [B, H, NT, C, D]
    bL = beta[..., -1]                                    # [B, H, NT] chunk totals
    dH = (Kc * torch.exp(bL[..., None] - beta)[..., None]).transpose(-1, -2) @ Vc  # [B, H, NT, K, D]
    L = bL.double().cumsum(-1)
    Lprev = torch.nn.functional.pad(L[..., :-1], (1, 0))  # L_{c-1}, 0 for the first chunk
    before = torch.ones(NT, NT, dtype=torch.bool, device=q.device).tril(-1)   # c' < c
    e = Lprev[..., :, None] - L[..., None, :]
    M = torch.where(before, torch.exp(torch.where(before, e, torch.zeros_like(e))), torch.zeros_like(e)).to(q.dtype)
    H0 = (M @ dH.reshape(B, H, NT, K * D)).reshape(B, H, NT, K, D)
    O = intra + torch.exp(beta)[..., None] * (Q @ H0)
    return O.reshape(B, H, NT * C, D)[:, :, :T].transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# extra pieces of a slice: (q, k, v, lg, normalize) -> {name: [B, H, ...]}
# ---------------------------------------------------------------------------------------------

def _hla2_extras(q, k, v, lg, normalize):
    w, _ = suffix_decay(lg)
    out = {"C": torch.einsum("bth,bthk,bthv->bhkv", w, q, v)}
    if normalize:
        out["c"] = torch.einsum("bth,bthk->bhk", w, q)
    return out


def _ahla_extras(q, k, v, lg, normalize):
    return {"R": torch.einsum("bthk,bthl->bhkl", k, q)}


def _hla3_extras(q, k, v, lg, normalize):
    w, _ = suffix_decay(lg)
    V = v.shape[-1]
    vals = [v] + ([torch.ones_like(v[..., :1])] if normalize else []) + [k]
    vals = torch.cat(vals, dim=-1)
    o = decayed_linear_attention(q, k, vals, lg, linear_attention_chunk(q.shape[1], k.shape[-1], vals.shape[-1]))
    w2 = w * w
    out = {"SQ": torch.einsum("bth,bthk,bthl->bhkl", w, q, q),
           "R": torch.einsum("bth,bthk,bthv->bhkv", w2, q, o[..., :V]),
           "N": torch.einsum("bth,bthk,bthl->bhkl", w2, o[..., -k.shape[-1]:], q)}
    if normalize:
        out["r"] = torch.einsum("bth,bthk->bhk", w2 * o[..., V], q)
    return out


# ---------------------------------------------------------------------------------------------
# combines: prefix state A (dict of state fields) and slice summary B (dict) -> state dict
# ---------------------------------------------------------------------------------------------

def _mm(a, b):
    """a [B, H, K, X] times b [B, H, X, Y] or b [B, H, X] (matrix times vector)."""
    return a @ b if b.dim() == a.dim() else (a @ b[..., None])[..., 0]


def _hla2_combine(A, B, normalize):
    r = torch.exp(B["log_rho"])[..., None, None]
    out = {"S": r * A["S"] + B["S"],
           "W": r * r * A["W"] + B["W"] + r * _mm(A["S"], B["C"])}
    if normalize:
        r1 = r[..., 0]
        out["z"] = r1 * r1 * A["z"] + B["z"] + r1 * _mm(A["S"], B["c"])
    return out


def _ahla_combine(A, B, normalize):
    r = torch.exp(B["log_rho"])[..., None, None]
    out = {"P": r * A["P"] + B["P"],
           "E": r * A["E"] + B["E"] + r * _mm(B["R"], A["P"])}
    if normalize:
        r1 = r[..., 0]
        out["p"] = r1 * A["p"] + B["p"]
        out["e"] = r1 * A["e"] + B["e"] + r1 * _mm(B["R"], A["p"])
    return out


def _hla3_combine(A, B, normalize):
    r = torch.exp(B["log_rho"])[..., None, None]
    SA_SQB = A["S"] @ B["SQ"]
    out = {"S": r * A["S"] + B["S"],
           "P": r * A["P"] + B["P"],
           "F": r ** 3 * A["F"] + B["F"] + r * r * (SA_SQB @ A["P"]) + r * (A["S"] @ B["R"]) + r * (B["N"] @ A["P"])}
    if normalize:
        r1 = r[..., 0]
        out["p"] = r1 * A["p"] + B["p"]
        out["f"] = (r1 ** 3 * A["f"] + B["f"] + r1 * r1 * _mm(SA_SQB, A["p"]) + r1 * _mm(A["S"], B["r"])
                    + r1 * _mm(B["N"], A["p"]))
    return out


class OpSummary(NamedTuple):
    """How one operator takes part in a context-parallel call.

    name: the attribute of ``hla_fast`` holding the operator (resolved when first used);
    state: (the state NamedTuple's attribute name in ``hla_fast``, its fields);
    norm_fields: the state fields that exist only when normalizing;
    extras: (q, k, v, lg, normalize) -> the slice's extra pieces {name: [B, H, ...]};
    extra_shapes: (K, V, normalize) -> {name: trailing shape}, in a fixed order;
    combine: (prefix state dict, slice summary dict, normalize) -> state dict.
    """

    name: str
    state: tuple
    norm_fields: frozenset
    state_shapes: Callable
    extras: Callable
    extra_shapes: Callable
    combine: Callable

    def resolve(self):
        """(operator function, state class), looked up in ``hla_fast`` by name."""
        import hla_fast

        try:
            return getattr(hla_fast, self.name), getattr(hla_fast, self.state[0])
        except AttributeError as err:
            raise ValueError(f"operator {self.name!r} is not available in this hla_fast") from err

    def fields(self, normalize):
        """The state fields a call with ``normalize`` uses."""
        return tuple(f for f in self.state[1] if normalize or f not in self.norm_fields)


SUMMARIES = {
    "hla2": OpSummary(
        "hla2", ("HLA2State", ("S", "W", "z")), frozenset({"z"}),
        lambda K, V, n: {"S": (K, K), "W": (K, V), "z": (K,) if n else None},
        _hla2_extras,
        lambda K, V, n: {"C": (K, V), **({"c": (K,)} if n else {})},
        _hla2_combine),
    "ahla": OpSummary(
        "ahla", ("AHLAState", ("P", "E", "p", "e")), frozenset({"p", "e"}),
        lambda K, V, n: {"P": (K, V), "E": (K, V), "p": (K,) if n else None, "e": (K,) if n else None},
        _ahla_extras,
        lambda K, V, n: {"R": (K, K)},
        _ahla_combine),
    "hla3": OpSummary(
        "hla3", ("HLA3State", ("S", "P", "F", "p", "f")), frozenset({"p", "f"}),
        lambda K, V, n: {"S": (K, K), "P": (K, V), "F": (K, V), "p": (K,) if n else None, "f": (K,) if n else None},
        _hla3_extras,
        lambda K, V, n: {"SQ": (K, K), "R": (K, V), "N": (K, K), **({"r": (K,)} if n else {})},
        _hla3_combine),
}


def summary_numbers(name: str, K: int, V: int, normalize: bool) -> int:
    """Numbers one summary holds per batch row and head (log rho included)."""
    spec = SUMMARIES[name]
    n = 1
    for shape in list(spec.state_shapes(K, V, normalize).values()) + list(spec.extra_shapes(K, V, normalize).values()):
        if shape is not None:
            p = 1
            for d in shape:
                p *= d
            n += p
    return n
