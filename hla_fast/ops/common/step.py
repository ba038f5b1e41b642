"""Host-side plumbing of the one-token decode steps, shared by every operator.

A decode step takes q, k: [B, H, K], v: [B, H, V], log-gates g: [B, H] or None (then a constant
gamma, None for no decay) and a state whose parts are fp32 [B, H, *] tensors; its kernel reads
each of them as [B*H, *] rows (contiguous), writes the new state into fresh buffers of the same
shapes and returns fp32 numerators [B*H, V] (and denominators [B*H] when normalizing). The torch
steps multiply the state by the token's factor a = exp(g) (gamma, 1 without decay).
"""
from __future__ import annotations

import torch


def step_inputs(q, k, v, g):
    """q, k [B, H, K], v [B, H, V] and g [B, H] (or None) made contiguous for a step kernel."""
    return q.contiguous(), k.contiguous(), v.contiguous(), None if g is None else g.contiguous()


def step_state_buffers(state, normalize: bool, norm_fields):
    """(parts, outs) for a state NamedTuple of [B, H, *] tensors: its parts made contiguous (the
    fields named in ``norm_fields`` None unless ``normalize``) and uninitialized buffers of the
    same shapes for the new state (None where the part is None)."""
    parts = tuple(None if (f in norm_fields and not normalize) else x.contiguous()
                  for f, x in zip(state._fields, state))
    return parts, tuple(None if x is None else torch.empty_like(x) for x in parts)


def step_gamma(gamma) -> float:
    """The constant factor a step kernel multiplies by when g is None (1.0 for no decay)."""
    return 1.0 if gamma is None else float(gamma)


def step_output(num, den, eps: float, B: int, H: int, dtype):
    """o [B, H, V] in ``dtype`` from the numerators num [B*H, V] and, when normalizing, the
    denominators den [B*H] (None: no normalization): num / (den + eps)."""
    o = num.view(B, H, num.shape[-1])
    if den is not None:
        o = o / (den.view(B, H, 1) + eps)
    return o.to(dtype)


def step_factors(g, gamma, dtype, device):
    """The torch step's factor a = exp(g) in ``dtype``, shaped to multiply the state:
    (a against [B, H, K] vectors, a against [B, H, K, *] matrices), i.e. exp(g) [B, H, 1] and
    [B, H, 1, 1] for log-gates g [B, H]; for g None both are the same 0-d tensor gamma (1 for no
    decay)."""
    if g is not None:
        a = torch.exp(g.to(dtype))
        return a[..., None], a[..., None, None]
    a = torch.tensor(1.0 if gamma is None else float(gamma), dtype=dtype, device=device)
    return a, a
