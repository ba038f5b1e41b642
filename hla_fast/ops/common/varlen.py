"""Packed sequences (``cu_seqlens``) on the existing kernels, for every operator.

Convention (flash-linear-attention's): ``N`` sequences of lengths ``L_0 .. L_{N-1}`` are packed along
the time axis of a batch of one, ``q, k: [1, T, H, K]``, ``v: [1, T, H, V]``, ``g: [1, T, H]`` with
``T = sum_n L_n``, and ``cu_seqlens`` (int32 ``[N + 1]``) holds the offsets: sequence ``n`` is rows
``cu_seqlens[n] .. cu_seqlens[n + 1] - 1``. Each sequence is an independent causal run: it starts
from its own row of ``initial_state`` (``[N, H, ...]``, or zeros) and ends in its own row of the
final state. The operators compute this without offsets in their kernels:

    1. scatter the packed rows into a padded batch ``[N, T_max, H, .]`` (``T_max = max_n L_n``),
       with ``q = k = v = 0`` and log-gate ``g = 0`` (factor 1) on the rows after each sequence's end;
    2. run the operator on the batch of ``N`` (``initial_state`` and the final state have ``N`` rows);
    3. gather the valid rows back into ``[1, T, H, V]``.

Why this is exact. (a) Outputs: every operator is causal, so the output of row ``t < L_n`` of
sequence ``n`` reads only rows ``<= t`` of that sequence, which are its own tokens; padding comes
after them. (b) Final state: at a padded row the state update of every operator is "decay by the
row's factor, then add an increment", and every increment has a factor ``q_t`` or ``k_t`` of the
new row (HLA2: ``S += k k^T``, ``W += (S q) v^T``, ``z += S q``; AHLA: ``P += k v^T``,
``E += k (q^T P)``, ``p += k``, ``e += k (q^T p)``; HLA3: ``S += k k^T``, ``P += k v^T``,
``F += (S q)(q^T P)``, ``p += k``, ``f += (S q)(q^T p)``: the normalizer's ``v -> 1`` never stands
alone). With ``q = k = 0`` the increment is zero, and with ``g = 0`` the decay is 1, so the state
after ``T_max`` rows is the state after row ``L_n - 1``. A constant ``gamma`` would decay the state
on the padding too, which is why a padded call turns ``gamma`` into per-token log-gates
``log(gamma)`` on valid rows and ``0`` on padding (:func:`varlen_gates`). (c) Gradients: steps 1
and 3 are index operations (``index_copy`` / ``index_select``), whose backward routes each
gradient row to the packed row it came from; padded rows are constants and receive nothing.

One caveat: a normalized output on a padded row is ``0 / (0 + eps)``. With ``eps = 0`` that is
``0 / 0``, and the backward of the division would spread NaN from the discarded rows, so
``normalize=True`` with ``eps = 0`` is refused when the lengths differ.

Cost: the operator runs on ``N * T_max`` rows instead of ``T`` (plus copies of q, k, v, g and o in
the padded layout): close to ``T`` when the lengths are similar, up to ``N`` times ``T`` when one
sequence is much longer than the rest. When every length is equal the padded batch is a reshape of
the packed one (no copies, no padding, ``gamma`` stays a constant). The offsets are read to the host
once per call (the padded layout's sizes are host integers), which synchronizes a GPU stream.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .checks import check_eps, check_flag, check_gamma, check_gates, check_qkv
from .gates import gates_from_gamma


class VarlenLayout(NamedTuple):
    """Where the packed rows go in the padded batch.

    offsets: the N + 1 offsets as host ints; lengths: the N lengths; T: packed rows (= offsets[-1]);
    T_max: the longest length; padded: False when every length is equal (then the padded batch is
    a reshape); index: [T] int64 flat row ``n * T_max + t`` of each packed row (None unless padded).
    """

    offsets: tuple
    lengths: tuple
    T: int
    T_max: int
    padded: bool
    index: Optional[torch.Tensor]

    @property
    def N(self) -> int:
        return len(self.lengths)


def check_cu_seqlens(cu_seqlens, q) -> VarlenLayout:
    """Validate the offsets of packed sequences against q [1, T, H, K]; returns their layout.

    cu_seqlens must be an int32 tensor [N + 1] (N >= 1) on q's device, start at 0, increase
    strictly (every sequence has at least one token) and end at T; q must have B == 1."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32 offsets [N + 1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32 (flash-linear-attention's offsets), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1 sequences, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    if cu_seqlens.device.type == "meta":
        raise ValueError("cu_seqlens is on the meta device, which holds no values: a packed call lays its "
                         "sequences out by the offsets themselves, so it needs them on a real device")
    B, T = q.shape[0], q.shape[1]
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed along T: q must have B == 1, got B={B}")
    offsets = tuple(int(x) for x in cu_seqlens.tolist())
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {offsets[0]}")
    lengths = tuple(b - a for a, b in zip(offsets[:-1], offsets[1:]))
    bad = [n for n, L in enumerate(lengths) if L <= 0]
    if bad:
        n = bad[0]
        raise ValueError(
            "cu_seqlens must be strictly increasing (every sequence has at least one token), got "
            f"cu_seqlens[{n}] = {offsets[n]} and cu_seqlens[{n + 1}] = {offsets[n + 1]}")
    if offsets[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T} (the packed length of q), got cu_seqlens[-1] = {offsets[-1]}")
    T_max = max(lengths)
    padded = any(L != T_max for L in lengths)
    index = None
    if padded:
        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        start = torch.tensor(offsets[:-1]).repeat_interleave(torch.tensor(lengths))
        index = (seq * T_max + torch.arange(T) - start).to(q.device)
    return VarlenLayout(offsets, lengths, T, T_max, padded, index)


def to_padded(x: torch.Tensor, layout: VarlenLayout) -> torch.Tensor:
    """Packed [1, T, ...] -> padded [N, T_max, ...], zeros after each sequence's end
    (a reshape, no copy of a contiguous x, when every length is equal). Differentiable."""
    rest = tuple(x.shape[2:])
    if not layout.padded:
        return x.reshape(layout.N, layout.T_max, *rest)
    out = x.new_zeros((layout.N * layout.T_max,) + rest)
    return out.index_copy(0, layout.index, x[0]).reshape(layout.N, layout.T_max, *rest)


def from_padded(y: torch.Tensor, layout: VarlenLayout) -> torch.Tensor:
    """Padded [N, T_max, ...] -> packed [1, T, ...] (the valid rows). Differentiable."""
    rest = tuple(y.shape[2:])
    if not layout.padded:
        return y.reshape(1, layout.T, *rest)
    return y.reshape(layout.N * layout.T_max, *rest).index_select(0, layout.index)[None]


def varlen_gates(gamma, g, layout: VarlenLayout, q: torch.Tensor):
    """The decay arguments of the padded call: (gamma, g) for checked ``gamma``, ``g`` [1, T, H]
    and packed q [1, T, H, K].

    Equal lengths keep them (reshaped). With padding, ``g`` gets 0 (factor 1) on padded rows and a
    constant ``gamma`` becomes log-gates log(gamma) on valid rows, 0 on padded ones, so padding
    never decays a final state. No decay stays no decay."""
    if g is not None:
        return None, to_padded(g, layout)
    if gamma is None or not layout.padded:
        return gamma, None
    return None, to_padded(gates_from_gamma(gamma, q[..., 0]), layout)


def varlen_call(op, q, k, v, cu_seqlens, *, gamma=None, g=None, normalize=False, eps=1e-6, **kwargs):
    """Run ``op`` (an operator with hla2's signature) on packed sequences.

    q, k: [1, T, H, K]; v: [1, T, H, V]; g: None or [1, T, H]; cu_seqlens: int32 [N + 1];
    ``kwargs`` (initial_state with N rows, output_final_state, chunk_size, backend, config) go to
    ``op`` unchanged. Returns (o [1, T, H, V], final state with N rows or None)."""
    check_qkv(q, k, v, seq=True)
    gamma = check_gamma(gamma)
    g = check_gates(g, gamma, q, seq=True)
    check_flag(normalize, "normalize")
    eps = check_eps(eps)
    layout = check_cu_seqlens(cu_seqlens, q)
    tiny = torch.finfo(torch.float64 if q.dtype == torch.float64 else torch.float32).tiny
    if normalize and eps < tiny and layout.padded:
        raise ValueError(
            f"cu_seqlens with normalize=True needs eps >= {tiny:.4g} (eps > 0, and a normal number of the "
            f"denominator's dtype) when the sequences differ in length, got eps={eps!r}: padded rows have a zero "
            "denominator, and 0 / 0 there (an eps that is 0, rounds to 0 or is flushed to 0) would put NaN into "
            "the gradients")
    gamma_p, g_p = varlen_gates(gamma, g, layout, q)
    qp, kp, vp = (to_padded(x, layout) for x in (q, k, v))
    o, state = op(qp, kp, vp, gamma=gamma_p, g=g_p, normalize=normalize, eps=eps, **kwargs)
    return from_padded(o, layout), state
