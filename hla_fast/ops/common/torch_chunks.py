"""Chunk preparation shared by the operators' pure-torch chunked backends.

Each backend cuts the sequence into NT chunks of C rows (C = min(chunk_size, T), the last chunk
zero-padded past T), batches everything inside a chunk over all chunks at once and runs only the
small state recurrence between chunks as a Python loop. This module does the cutting, the
chunk-local cumulative log-gates beta (``gates.chunk_local_cumsum``) and the way back; the decay
tiles of beta are ``gates.chunk_decay_tiles``. :func:`full_precision` keeps autocast out of every
torch path (the backends and the decode steps).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from .gates import chunk_local_cumsum
from .normalize import with_column, with_ones


def full_precision(fn):
    """Run ``fn`` with autocast off, where it is on, for the device type of its first tensor
    argument. The torch paths promise fp32 products and states (float64 for float64 inputs), as
    the Triton kernels keep whatever the region: under ``torch.autocast`` their ``@`` products
    would otherwise run in fp16 / bf16 (an fp16 region overflowed third order's normalized
    outputs to inf, and a bf16 one left fp32 states 2e-3 off)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        kind = next(a for a in args if isinstance(a, torch.Tensor)).device.type
        on = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
        with torch.autocast(kind, enabled=False) if on else contextlib.nullcontext():
            return fn(*args, **kwargs)

    return wrapper


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


@full_precision
def run_with_normalizer(chunk_fn, cls, norm_of: dict, q, k, v, g, normalize, eps, initial_state, chunk_size):
    """A torch backend's entry, the same for every operator: compute in fp32 (float64 for float64
    inputs), autocast or not (:func:`full_precision`), and, when ``normalize``, carry the
    denominator (the numerator with v -> 1) as one more value column, then divide (den + eps).

    chunk_fn(q, k, v, g, state, chunk_size) -> (o [B, T, H, V'], *carried): the operator's chunked
    torch form on V' value columns, ``state`` None or the carried fields in ``cls`` order.
    cls: the state NamedTuple; norm_of: {value-carrying field: its normalizer field}, e.g.
    {"W": "z"}; the other fields of cls not named as normalizers are carried as they are.
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-gates or None; initial_state: cls or
    None. Returns (o [B, T, H, V] in v's dtype, cls)."""
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
    gc = None if g is None else g.to(cd)
    V = v.shape[-1]
    carried = [f for f in cls._fields if f not in norm_of.values()]
    st = None
    if normalize:
        vc = with_ones(vc)
        if initial_state is not None:
            st = tuple(with_column(getattr(initial_state, f), getattr(initial_state, norm_of[f]))
                       if f in norm_of else getattr(initial_state, f) for f in carried)
    elif initial_state is not None:
        st = tuple(getattr(initial_state, f) for f in carried)
    o, *out = chunk_fn(qc, kc, vc, gc, st, chunk_size)
    parts = dict.fromkeys(cls._fields)
    for f, x in zip(carried, out):
        if normalize and f in norm_of:
            parts[f], parts[norm_of[f]] = x[..., :V], x[..., V]
        else:
            parts[f] = x
    if normalize:
        o = o[..., :V] / (o[..., V:] + eps)
    return o.to(v.dtype), cls(**parts)
