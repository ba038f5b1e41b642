"""Masked third-order HLA (HLA3): chunked Triton kernels, a torch backend, decode."""
from .interface import hla3, hla3_step
from .naive import hla3_naive_quadratic, hla3_naive_recurrent
from .state import HLA3State

__all__ = ["hla3", "hla3_step", "HLA3State", "hla3_naive_quadratic", "hla3_naive_recurrent"]
