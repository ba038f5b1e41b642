"""The HLA3 state a chunked call returns and a decode step carries."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class HLA3State(NamedTuple):
    """Compact masked third-order state after token t, fp32 (float64 on the float64 torch path).

    With b_t = sum_{s <= t} g_s (g = log(gamma) for a constant decay, 0 without decay) and
    a_t = exp(g_t):

    S: [B, H, K, K]  sum_{i <= t} exp(b_t - b_i) k_i k_i^T                (key second moment)
    P: [B, H, K, V]  sum_{j <= t} exp(b_t - b_j) k_j v_j^T                (first-order moment)
    F: [B, H, K, V]  a_t^3 F_{t-1} + (S_t q_t)(q_t^T P_t)
                     = sum_{u <= t} exp(3 (b_t - b_u)) (S_u q_u)(q_u^T P_u)
    p: [B, H, K]     P with v -> 1 (kept only when normalizing, else None)
    f: [B, H, K]     F with v -> 1 (kept only when normalizing, else None)

    The output of token t is q_t^T F_t (divided by q_t^T f_t + eps when normalizing). These are
    the fields of ``hla_ref.HLA3State``.
    """

    S: torch.Tensor
    P: torch.Tensor
    F: torch.Tensor
    p: Optional[torch.Tensor] = None
    f: Optional[torch.Tensor] = None
