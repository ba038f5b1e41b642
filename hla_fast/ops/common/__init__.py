"""Machinery every operator shares: input checks, the kernel configuration, launch arithmetic,
decay and gate factors, the host side of the decode steps (``step.py``), the chunking of the torch
backends (``torch_chunks.py``), and ``@triton.jit`` tile helpers."""
from .config import ChunkConfig

__all__ = ["ChunkConfig"]
