"""hla_fast: GPU (Triton) kernels for Higher-order Linear Attention.

Public API (``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, log-gates ``g: [B, T, H]``):
    hla2(q, k, v, *, gamma=None, g=None, normalize=False, eps=1e-6, initial_state=None,
         output_final_state=False, chunk_size=64, backend=None, config=None) -> (o, final_state)
    hla2_step(q, k, v, state=None, *, gamma=None, g=None, normalize=False, eps=1e-6,
              backend=None) -> (o, state)
    HLA2State(S, W, z)
    ChunkConfig: the kernels' layout, chosen per call by ``hla2_config`` or passed as ``config``.

The operators live in ``hla_fast.ops`` (one folder each, on the shared ``hla_fast.ops.common``).
"""
from .ops.common.config import ChunkConfig
from .ops.hla2 import HLA2State, hla2, hla2_step

__all__ = ["hla2", "hla2_step", "HLA2State", "ChunkConfig", "hla2_config"]


def __getattr__(name):
    # hla2_config lives beside the kernels; importing it imports Triton, so only on first use
    if name == "hla2_config":
        from .ops.hla2.chunk import hla2_config

        return hla2_config
    raise AttributeError(f"module 'hla_fast' has no attribute {name!r}")
