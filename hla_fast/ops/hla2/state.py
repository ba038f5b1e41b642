"""The HLA2 state a chunked call returns and a decode step carries."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class HLA2State(NamedTuple):
    """Compact HLA2 state after token t, fp32 (float64 on the float64 torch path).

    With b_t = sum_{s <= t} g_s (g = log(gamma) for a constant decay, 0 without decay):

    S: [B, H, K, K]  sum_{i <= t} exp(b_t - b_i) k_i k_i^T                 (key second moment)
    W: [B, H, K, V]  sum_{j <= t} exp(2 (b_t - b_j)) (S_j q_j) v_j^T      (= S C - G of the paper)
    z: [B, H, K]     W with v -> 1 (kept only when normalizing, else None)

    The output of token t is q_t^T W_t (divided by q_t^T z_t + eps when normalizing).
    """

    S: torch.Tensor
    W: torch.Tensor
    z: Optional[torch.Tensor] = None
