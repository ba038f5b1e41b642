"""hla_ref: a readable NumPy reference of Higher-order Linear Attention.

Higher-order Linear Attention (HLA; Zhang, Qin, Wang, Gu, arXiv 2510.27258) replaces the n x n
attention matrix with small prefix moments of the keys, queries and values, keeps exact causality
with cross-summaries, and trains chunk-parallel through associative scans. This package holds every
operator in four forms that compute the same numbers, for a constant decay gamma or for per-token
gates a_t (below):

=========  ==============================================================  =========================
form       what it does                                                    cost
=========  ==============================================================  =========================
naive      materializes the n x n weights straight from the definition     O(n^2) memory
stream     serial recurrence over prefix summaries, one token at a time    O(1) state per token
scan       one-token segments combined by an associative operator through  O(log n) depth
           an exclusive Blelloch scan, then local inclusion
chunked    dense masked work inside a chunk, a carried state across        what a GPU kernel runs
           chunks (any n)
=========  ==============================================================  =========================

Single head throughout: ``Q, K`` have shape ``(n, d)``, ``V`` has shape ``(n, dv)``, outputs
``(n, dv)``. float64 by default; float32 inputs stay float32. Every operator form (and
``linear_attention``) takes ``gamma=1.0``, ``normalize=False`` and ``eps=1e-6`` (output
``num / (den + eps)``, den being the same sum with every v_j replaced by 1); the ``*_weights``
matrices take ``gamma`` only (the weights of the unnormalized operator, ``o = T V``).

``gamma`` is either a float in (0, 1] (one decay for every token) or a 1-D float array of shape
``(n,)`` of per-token gates a_t in (0, 1] (a list of floats is accepted too; no broadcasting).
With b_t = sum_{s <= t} log a_s, every operator keeps its index set and weighs a term with summed
indices x_1..x_p read at token t by exp(p b_t - b_{x_1} - ... - b_{x_p}), the product of the
gates each index has been through: exp(2 b_t - b_i - b_j) at second order, exp(b_t - b_j) for
AHLA and first-order linear attention, exp(3 b_t - b_i - b_u - b_j) at third order. Every
recurrence multiplies by a_t at step t where it multiplied by gamma, a segment's rho is the
product of its tokens' factors, and the chunked forms only ever exponentiate sums of log a <= 0,
so a gate near 0 (down to the smallest positive float64) cannot overflow. A constant gamma is
b_t = (t + 1) log gamma, and an array filled with gamma gives the float-gamma result. A gate
closing at s (a_s -> 0) cuts the context: outputs at t >= s no longer see the tokens before s.
``hla_ref.published`` (the paper's formulas as printed) takes a float gamma only. HLA2's two
variants beyond the masked operator, unmasked (``masked=False``) and ``ridge``, exist in the forms
that take those flags: naive and stream for ``masked=False``, stream for ``ridge``.
Inputs must be NumPy arrays (or nested lists of floats): torch tensors are refused by name.

Glossary: code names and the paper's symbols
--------------------------------------------
=====================  ===================================================  =======================
code                   paper                                                where
=====================  ===================================================  =======================
``L``, causal_mask     L, lower-triangular mask with the diagonal           (notation)
``X = Q @ K.T``        QK^T; ``W = X o L`` the masked first-order weights    (notation)
``S`` (HLA2State.S)    S^K_t = sum_i k_i k_i^T                              Sec. 3
``C``                  C^QV_t = sum_j q_j v_j^T                             Sec. 3
``m``                  m^Q_t = sum_j q_j (normalizer)                       Sec. 3
``G``, ``h``           cross-summaries G_t, h_t removing pairs i > j        Theorem 3.1, Alg. 1
masked=False           unmasked output q_t^T S^K_t C^QV_t                   eq. 3.1
``ridge``              the optional lambda I added to S^K                   (optional)
``W``, ``z``           compact state S C - G, S m - h (decoder)             (this project)
``gamma``, ``rho``     decay per token; rho = gamma^(segment length)        Sec. 4.3
``gamma`` array, a_t   per-token gate a_t in (0, 1]; rho = prod of a_t      (this project)
``b``, ``log_a``       b_t = sum_{s <= t} log a_s; decay exp(b_t - b_x)     (this project)
HLA2Segment, combine   segment summary and its associative operator         Sec. 4, Theorem 4.1
``P``, ``E``           AHLA moments P^KV_t, E_t                             Sec. 6, Theorem 6.1
``R``                  AHLA segment moment sum k_i q_i^T (undecayed)        Sec. 6.2 (Erratum B)
``SQ``                 S^Q_t = sum q_u q_u^T                                Sec. 7
``F``, ``G1..G3``      third-order state; Algorithm 3's corrections         Sec. 7, Alg. 3
``M`` (d, d, d, dv)    Algorithm 3's segment map (paper M^KQP)              Theorem 7.2
=====================  ===================================================  =======================

Where the paper's formulas are wrong (checked against the definitions; see ``hla_ref.published``
for the formulas as printed, and notebooks 04, 05, 07, 08):

* Erratum A: with decay, G and h must decay by gamma^2 and their increment by gamma; the paper's
  scan operator for them is not associative.
* Erratum B: the AHLA scan's cross term needs the undecayed moment R.
* Erratum C: Algorithm 3 computes ``hla3_*(variant="paper")``, the operator over triples whose
  largest index occurs at least twice, not the masked third-order operator (Theorem 7.1).
"""

from . import published
from .asymmetric import (
    AHLASegment, AHLAState, ahla_chunked, ahla_combine, ahla_identity, ahla_naive, ahla_scan,
    ahla_segment, ahla_stream, ahla_weights,
)
from .baselines import causal_mask, linear_attention, softmax_attention
from .scan import blelloch_scan, inclusive_scan, serial_exclusive_scan
from .second_order import (
    HLA2CompactState, HLA2Segment, HLA2State, hla2_chunked, hla2_combine, hla2_identity, hla2_naive,
    hla2_scan, hla2_segment, hla2_stream, hla2_weights,
)
from .third_order import (
    HLA3PaperSegment, HLA3PaperState, HLA3Segment, HLA3State, hla3_chunked, hla3_combine,
    hla3_identity, hla3_naive, hla3_paper_combine, hla3_paper_identity, hla3_paper_segment,
    hla3_scan, hla3_segment, hla3_stream, hla3_weights, largest_index_twice,
)

__version__ = "0.1.0"

__all__ = [
    "published",
    "causal_mask", "softmax_attention", "linear_attention",
    "blelloch_scan", "inclusive_scan", "serial_exclusive_scan",
    "HLA2State", "HLA2CompactState", "HLA2Segment",
    "hla2_weights", "hla2_naive", "hla2_stream", "hla2_scan", "hla2_chunked",
    "hla2_segment", "hla2_identity", "hla2_combine",
    "AHLAState", "AHLASegment",
    "ahla_weights", "ahla_naive", "ahla_stream", "ahla_scan", "ahla_chunked",
    "ahla_segment", "ahla_identity", "ahla_combine",
    "HLA3State", "HLA3PaperState", "HLA3Segment", "HLA3PaperSegment",
    "hla3_weights", "hla3_naive", "hla3_stream", "hla3_scan", "hla3_chunked",
    "hla3_segment", "hla3_identity", "hla3_combine",
    "hla3_paper_segment", "hla3_paper_identity", "hla3_paper_combine", "largest_index_twice",
]
