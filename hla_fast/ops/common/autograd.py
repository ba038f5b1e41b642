"""What the operators' autograd Functions share: whether a call is recorded for a backward, and
the guard on backwards that run Triton kernels.
"""
from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable


def autograd_records(*tensors) -> bool:
    """Whether autograd records a graph through a call on ``tensors`` (None entries skipped):
    grad mode is on and one of them requires grad. Decides a training layout, the refusal of a
    layout whose backward crashes, and the decode steps' differentiable torch path."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def kernel_backward(backward):
    """Decorate the ``backward`` of an autograd Function whose backward runs the Triton kernels,
    which are not themselves differentiable. ``once_differentiable`` alone raises only when a
    gradient flowing in requires grad; under ``create_graph=True`` with a loss linear in the
    outputs (``o.sum()``) none does, and it returns first derivatives detached, so a second
    derivative through them would silently miss this operator's share. So the backward raises
    whenever autograd would record it (grad mode on: ``create_graph=True``)."""
    inner = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError("hla_fast's Triton backward is not differentiable: a second derivative "
                               "(create_graph=True) needs backend='torch'")
        return inner(ctx, *grads)

    return wrapper
