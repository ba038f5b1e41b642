"""Host-side plumbing of the one-token decode steps, shared by every operator.

A decode step takes q, k: [B, H, K], v: [B, H, V], log-gates g: [B, H] or None (then a constant
gamma, None for no decay) and a state whose parts are fp32 [B, H, *] tensors; its kernel reads
each of them as [B*H, *] rows (contiguous), writes the new state into fresh buffers of the same
shapes and stores the output [B*H, V] in v's dtype, divided by its denominator in-kernel when
normalizing (``store_step_output`` in tiles.py): one launch a step. The torch steps multiply the
state by the token's factor a = exp(g) (gamma, 1 without decay).
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


def step_out(v):
    """The output buffer of a step kernel: o [B*H, V] in v's dtype (the kernel stores the finished,
    normalized output, so a step is one launch)."""
    B, H, V = v.shape
    return torch.empty(B * H, V, device=v.device, dtype=v.dtype)


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
