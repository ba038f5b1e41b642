"""hla_fast: GPU (Triton) kernels for Higher-order Linear Attention.

Public API:
    hla2(q, k, v, *, gamma=None, normalize=False, eps=1e-6, initial_state=None,
         output_final_state=False, chunk_size=64, backend=None) -> (o, final_state)
    hla2_step(q, k, v, state, *, gamma=None, normalize=False) -> (o, state)
    HLA2State(S, W, z)
"""
from .hla2 import HLA2State, hla2, hla2_step

__all__ = ["hla2", "hla2_step", "HLA2State"]
