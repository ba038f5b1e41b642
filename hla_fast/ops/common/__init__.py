"""Machinery every operator shares: input checks, the kernel configuration, launch arithmetic,
decay and gate factors, and ``@triton.jit`` tile helpers."""
from .config import ChunkConfig

__all__ = ["ChunkConfig"]
