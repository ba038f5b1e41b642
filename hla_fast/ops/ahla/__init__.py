"""Asymmetric HLA (AHLA): chunked Triton kernels, a torch backend, decode."""
from .interface import ahla, ahla_step
from .naive import ahla_naive_quadratic, ahla_naive_recurrent
from .state import AHLAState

__all__ = ["ahla", "ahla_step", "AHLAState", "ahla_naive_quadratic", "ahla_naive_recurrent"]
