"""The AHLA state a chunked call returns and a decode step carries."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class AHLAState(NamedTuple):
    """Compact AHLA state after token t, fp32 (float64 on the float64 torch path).

    With b_t = sum_{s <= t} g_s (g = log(gamma) for a constant decay, 0 without decay):

    P: [B, H, K, V]  sum_{j <= t} exp(b_t - b_j) k_j v_j^T                 (first-order moment)
    E: [B, H, K, V]  sum_{i <= t} exp(b_t - b_i) k_i (q_i^T P_i)           (moment of the moments)
    p: [B, H, K]     P with v -> 1 (kept only when normalizing, else None)
    e: [B, H, K]     E with v -> 1 (kept only when normalizing, else None)

    The output of token t is q_t^T E_t (divided by q_t^T e_t + eps when normalizing).
    """

    P: torch.Tensor
    E: torch.Tensor
    p: Optional[torch.Tensor] = None
    e: Optional[torch.Tensor] = None
