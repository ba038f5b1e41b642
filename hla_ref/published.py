"""The paper's decayed formulas exactly as printed, kept so a reader can watch them fail.

Nothing here is used by the rest of ``hla_ref``. Each function names the place in the paper it
transcribes and the erratum (see the notebooks 04, 05 and 07) that explains why it is wrong for
gamma < 1. At gamma = 1 they coincide with the corrected forms.

* Erratum A (Sec. 4.3, Algorithm 1 line 6): ``G_t = gamma G_{t-1} + k_t k_t^T C_{t-1}`` neither decays
  the old pairs by gamma^2 nor the new ones by gamma; its scan operator
  ``G_AB = rho_B G_A + G_B + S_B (rho_B C_A)`` disagrees with it and is not associative.
* Erratum B (Sec. 6.2): the AHLA scan decays the segment moment R = sum k_i q_i^T
  (``R_AB = rho_B R_A + R_B``) although its cross term needs it undecayed.
* Erratum C (Theorem 7.1) is not a formula to keep: Algorithm 3 is implemented as
  ``hla3_*(variant="paper")``, the operator it really computes.

The paper prints these formulas for one constant decay, so here ``gamma`` must be a float in
(0, 1]: an array of per-token gates is refused with a ``TypeError`` (the corrected forms in
``hla_ref`` take them).
"""

# Helpers under private names, so that the module's public names are exactly ``__all__``; no
# ``from __future__ import annotations``, so that help() shows the annotations as real types.
import numpy as _np

from ._checks import check_common_constant as _check_common_constant
from ._checks import check_segments as _check_segments
from ._readout import read_out as _read_out
from .asymmetric import AHLASegment as _AHLASegment
from .asymmetric import scan_ahla as _scan_ahla
from .second_order import HLA2Segment as _HLA2Segment
from .second_order import scan_hla2 as _scan_hla2

__all__ = [
    "hla2_stream_published", "hla2_combine_published", "hla2_scan_published",
    "ahla_combine_published", "ahla_scan_published",
]


def hla2_stream_published(Q, K, V, *, gamma: float = 1.0, normalize: bool = False,
                          eps: float = 1e-6) -> _np.ndarray:
    """Algorithm 1 with the paper's decay: ``G_t = gamma G_{t-1} + k_t k_t^T C_{t-1}`` (h likewise),
    S, C, m decayed by gamma, o_t = q_t^T (S_t C_t - G_t). Q, K (n, d); V (n, dv) -> (n, dv).
    Wrong for gamma < 1 (Erratum A)."""
    Q, K, V, gamma, normalize, eps = _check_common_constant(Q, K, V, gamma, normalize, eps)
    (n, d), dv, dt = Q.shape, V.shape[1], Q.dtype
    S, C, m = _np.zeros((d, d), dt), _np.zeros((d, dv), dt), _np.zeros(d, dt)
    G, h = _np.zeros((d, dv), dt), _np.zeros(d, dt)
    num, den = _np.zeros((n, dv), dt), _np.zeros(n, dt)
    for t in range(n):
        q, k, v = Q[t], K[t], V[t]
        G = gamma * G + _np.outer(k, k @ C)
        h = gamma * h + k * (k @ m)
        S = gamma * S + _np.outer(k, k)
        C = gamma * C + _np.outer(q, v)
        m = gamma * m + q
        num[t] = q @ (S @ C - G)
        den[t] = q @ (S @ m - h)
    return _read_out(num, den, normalize, eps)


def hla2_combine_published(A: _HLA2Segment, B: _HLA2Segment) -> _HLA2Segment:
    """The paper's decayed scan operator: G_AB = rho_B G_A + G_B + S_B (rho_B C_A) (h likewise).
    Not associative for gamma < 1 (Erratum A)."""
    A, B = _check_segments(A, B, _HLA2Segment)
    r = B.rho
    return _HLA2Segment(
        S=r * A.S + B.S,
        C=r * A.C + B.C,
        m=r * A.m + B.m,
        G=r * A.G + B.G + B.S @ (r * A.C),
        h=r * A.h + B.h + B.S @ (r * A.m),
        rho=A.rho * B.rho,
    )


def hla2_scan_published(Q, K, V, *, gamma: float = 1.0, normalize: bool = False,
                        eps: float = 1e-6) -> _np.ndarray:
    """:func:`hla_ref.hla2_scan` run with :func:`hla2_combine_published`. (n, dv)."""
    Q, K, V, gamma, normalize, eps = _check_common_constant(Q, K, V, gamma, normalize, eps)
    return _scan_hla2(Q, K, V, _np.full(Q.shape[0], gamma), normalize, eps, hla2_combine_published)


def ahla_combine_published(A: _AHLASegment, B: _AHLASegment) -> _AHLASegment:
    """The paper's AHLA scan operator (Sec. 6.2): R decays, R_AB = rho_B R_A + R_B, and the cross
    term is R_B (rho_B P_A). Right for one-token segments only (Erratum B)."""
    A, B = _check_segments(A, B, _AHLASegment)
    r = B.rho
    return _AHLASegment(
        P=r * A.P + B.P,
        E=r * A.E + B.E + B.R @ (r * A.P),
        R=r * A.R + B.R,
        p=r * A.p + B.p,
        e=r * A.e + B.e + B.R @ (r * A.p),
        rho=A.rho * B.rho,
    )


def ahla_scan_published(Q, K, V, *, gamma: float = 1.0, normalize: bool = False,
                        eps: float = 1e-6) -> _np.ndarray:
    """:func:`hla_ref.ahla_scan` run with :func:`ahla_combine_published`. (n, dv)."""
    Q, K, V, gamma, normalize, eps = _check_common_constant(Q, K, V, gamma, normalize, eps)
    return _scan_ahla(Q, K, V, _np.full(Q.shape[0], gamma), normalize, eps, ahla_combine_published)
