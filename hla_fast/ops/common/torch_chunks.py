"""Chunk preparation shared by the operators' pure-torch chunked backends.

Each backend cuts the sequence into NT chunks of C rows (C = min(chunk_size, T), the last chunk
zero-padded past T), batches everything inside a chunk over all chunks at once and runs only the
small state recurrence between chunks as a Python loop. This module does the cutting, the
chunk-local cumulative log-gates beta (``gates.chunk_local_cumsum``) and the way back; the decay
tiles of beta are ``gates.chunk_decay_tiles``.
"""
from __future__ import annotations

import torch

from .gates import chunk_local_cumsum


def to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, NT, C, D], NT = ceil(T / C), zero rows past T."""
    B, T, H, D = x.shape
    NT = -(-T // C)
    pad = NT * C - T
    x = x.transpose(1, 2)
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(B, H, NT, C, D)


def from_chunks(o: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, NT, C, V] -> [B, T, H, V]: the inverse of :func:`to_chunks` (padding dropped)."""
    B, H, NT, C, V = o.shape
    return o.reshape(B, H, NT * C, V)[:, :, :T].transpose(1, 2)


def chunk_inputs(q, k, v, g, chunk_size: int):
    """Chunked inputs of a torch backend.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-gates or None (no decay), all in the
    compute dtype. Returns (C, NT, Q, Kc, Vc, beta, valid): C = min(chunk_size, T) rows per chunk
    and NT chunks; Q, Kc [B, H, NT, C, K] and Vc [B, H, NT, C, V] (zero rows past T); beta
    [B, H, NT, C] the chunk-local cumulative log-gates (zeros for g None); valid [NT, C] the rows < T."""
    B, T, H, _ = q.shape
    C = min(chunk_size, T)
    NT = -(-T // C)
    dev = q.device
    valid = (torch.arange(NT * C, device=dev) < T).reshape(NT, C)
    beta = chunk_local_cumsum(g, C) if g is not None else torch.zeros(B, H, NT, C, device=dev, dtype=q.dtype)
    return C, NT, to_chunks(q, C), to_chunks(k, C), to_chunks(v, C), beta, valid
