"""Masked second-order HLA (HLA2): chunked Triton kernels, a torch backend, decode."""
from .interface import hla2, hla2_step
from .naive import hla2_naive_quadratic, hla2_naive_recurrent
from .state import HLA2State

__all__ = ["hla2", "hla2_step", "HLA2State", "hla2_naive_quadratic", "hla2_naive_recurrent"]
