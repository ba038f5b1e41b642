"""A normalized call's values and states with their ones column, and its output gradient split the
way the backward kernels take it.

A normalized call returns o = num / d with d = den + eps, where num is the operator on v and den
the operator on a column of ones. Given dL/do, the gradient of num is do / d and that of den is
dd = -(do . o) / d (one number per token and head). The backward kernels differentiate the
numerator from do / d and the denominator from dd; this kernel forms both in one pass over do and
o, instead of the half-dozen elementwise torch kernels (casts, product, row sum, divisions) that
each read or write a [B, T, H, V] fp32 tensor.

Width. A Triton call that runs the operator on [v | 1] (HLA3, HLA2 with heads wider than 128) pads
it with zero columns to ``ones_width(V)``, a multiple of ONES_ALIGN, and its states the same way;
AHLA runs its denominator on the values [1 | 0 ...] of ONES_ALIGN columns. The kernels take
the value width as the row stride of their value tensors ([B, T, H, V] rows, [K, V] states), so
with V + 1 columns (65 at V = 64) a row starts at any element and the compiler can neither widen a
load to 16 bytes nor stage it asynchronously: by an sm_90 compile with Triton 3.6, AHLA's per-chunk
gradient kernel at K = 64 on 65 values read its tiles in 352 two-byte loads (a load instruction
written once in its code), on 80 values only in 16-byte loads, as on 64 (``compile_report.py``'s
global loads, ``benchmarks/results/compile_ahla_bf16_k64_normalize_65_values_triton36_cpu.md``). A
zero value column adds nothing to any output, state or gradient (the operators are linear in the
values), and rounding V + 1 up to a multiple of 16 never adds a value block of 64. The torch
backend keeps V + 1 columns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .compile import launch_kernel
from .launch import cdiv, fp32_tiles, pow2_block

# rows (tokens x heads) per program
ROWS = 32
# the Triton kernels' [v | 1] has a multiple of this many columns (module docstring, "Width")
ONES_ALIGN = 16


def ones_width(V: int) -> int:
    """Columns of [v | 1] on the Triton kernels for V value columns: V + 1 rounded up to a
    multiple of ONES_ALIGN (the module docstring, "Width")."""
    return cdiv(V + 1, ONES_ALIGN) * ONES_ALIGN


def _padded(x: torch.Tensor, col: torch.Tensor, width) -> torch.Tensor:
    """[x | col | 0 ...] along the last dim, ``width`` columns (None: x's + 1)."""
    C = x.shape[-1]
    width = C + 1 if width is None else width
    if width < C + 1:
        raise ValueError(f"width: at least {C + 1} columns for [x | col], got {width}")
    parts = [x, col]
    if width > C + 1:
        parts.append(x.new_zeros(*x.shape[:-1], width - C - 1))
    return torch.cat(parts, -1)


def with_ones(v: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """[v | 1] along the last dim: the values of a normalized call, whose denominator is the
    operator on column V (v [..., V] -> [..., width], v's dtype): V + 1 columns, or ``width``
    (``ones_width(V)`` on the Triton kernels), the columns after the ones zero."""
    return _padded(v, torch.ones_like(v[..., :1]), width)


def quotient_values(v: torch.Tensor) -> torch.Tensor:
    """``with_ones(v, ones_width(V))`` for a Triton call that divides in torch (``quotient``), in
    the dtype the operator then stores its output in: fp32 for fp16 inputs, whose numerator and
    denominator pass fp16's largest number (65504) as the context grows (HLA3's denominator reached
    5.8e7 at T = 64 with q, k in (0, 1): the output was not finite), else v's dtype
    (``cotangent_dtype``'s rule)."""
    return with_ones(v, ones_width(v.shape[-1])).to(cotangent_dtype(v.dtype))


def with_column(x, col, width: int | None = None):
    """[x | col]: a state x [..., R, C] with one more column col [..., R] (zeros when col is None;
    cast to x's dtype), contiguous, C + 1 columns or ``width`` (zeros after col); None when x is
    None. A normalized call's state beside its denominator's (W beside z, P beside p, ...), as
    the kernels on [v | 1] carry them."""
    if x is None:
        return None
    col = torch.zeros_like(x[..., 0]) if col is None else col.to(x.dtype)
    return _padded(x, col[..., None], width)


def quotient(o: torch.Tensor, V: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The normalized output from the operator on [v | 1], o [..., V + 1] or wider (``ones_width``):
    its first V columns over column V (+ eps), in fp32, then in ``dtype``."""
    return (o[..., :V].float() / (o[..., V:V + 1].float() + eps)).to(dtype)


@triton.jit
def normalized_grad_kernel(
    do, o,          # [N, V] rows of the output gradient and the (normalized) output, input dtype
    den,            # [N] fp32 denominators
    do_num, dd,     # out: do / d [N, V] (cotangent_dtype); dd = -(do . o) / d [N] fp32
    eps, N,
    V: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
):
    """One program per BR rows of V values (the [B, T, H, V] tensors seen as B*T*H rows)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)            # rows  [BR]
    c = tl.arange(0, BV)                                    # value columns [BV]
    mr = r < N
    m = mr[:, None] & (c[None, :] < V)
    off = r.to(tl.int64)[:, None] * V + c[None, :]          # [BR, BV]
    b_do = tl.load(do + off, mask=m, other=0.0).to(tl.float32)
    b_o = tl.load(o + off, mask=m, other=0.0).to(tl.float32)
    rd = 1.0 / (tl.load(den + r, mask=mr, other=1.0) + eps)  # 1 / d  [BR]
    tl.store(do_num + off, (b_do * rd[:, None]).to(do_num.dtype.element_ty), mask=m)
    tl.store(dd + r, -tl.sum(b_do * b_o, axis=1) * rd, mask=mr)


def cotangent_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of a normalized backward's output gradient [do / d | dd] for inputs of ``dtype``: bf16
    for bf16 (fp32's exponent range), else fp32. d = den + eps grows with the context (at K = 256 an
    AHLA denominator reached 9e4), so do / d falls below fp16's smallest normal number (6.1e-5),
    where fp16 keeps fewer digits: rounded to fp16, these cotangents put AHLA's dq 1.2e-2 off at
    K = 256, V = 64 (3.1e-3 at K = V = 128), against 2e-7 in fp32 (hla_fast/README.md, "fp16
    inputs")."""
    return torch.float32 if fp32_tiles(dtype) else torch.bfloat16


def normalized_output_grad(do: torch.Tensor, o: torch.Tensor, den: torch.Tensor, eps: float,
                           launch=launch_kernel):
    """(do / d [B, T, H, V] in ``cotangent_dtype(o.dtype)``, dd = -(do . o) / d [B, T, H] fp32) with
    d = den + eps.

    do, o: [B, T, H, V] (do in any float dtype, read as fp32); den: [B, T, H] fp32."""
    B, T, H, V = o.shape
    do, o, den = do.contiguous(), o.contiguous(), den.contiguous()
    do_num = torch.empty(B, T, H, V, device=o.device, dtype=cotangent_dtype(o.dtype))
    dd = torch.empty(B, T, H, device=o.device, dtype=torch.float32)
    N = B * T * H
    launch(normalized_grad_kernel, (cdiv(N, ROWS),), do=do, o=o, den=den, do_num=do_num, dd=dd, eps=float(eps), N=N,
           V=V, BR=ROWS, BV=pow2_block(V))
    return do_num, dd
