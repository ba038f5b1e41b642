"""HLACache: the recurrent states of a stack of HLA layers between calls.

A softmax-attention cache grows with every token (keys and values); an HLA layer's cache is a
fixed-size state per layer (``HLA2State``, ``AHLAState`` or ``HLA3State``: fp32 tensors, float64 for a
float64 layer, of shape [B, H, K, K] / [B, H, K, V] / [B, H, K]), replaced on every call. The cache
holds one entry per ``layer_idx`` and counts the tokens each layer has seen, so a prefill of T
tokens followed by single-token calls continues exactly where the prefill stopped.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch


class HLACache:
    """States of HLA layers, indexed by ``layer_idx``.

    ``cache[i]`` is layer i's state (None before its first call); ``update(i, state, n)`` stores
    layer i's new state after it has consumed n more tokens; ``get_seq_length(i)`` is the number
    of tokens layer i has consumed. Empty on creation; a layer creates one when asked to cache
    without being given one.
    """

    def __init__(self):
        self.states: List[Optional[Any]] = []
        self.seen_tokens: List[int] = []

    @staticmethod
    def _check_idx(layer_idx) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise TypeError(f"layer_idx must be an int >= 0, got {layer_idx!r}")
        return layer_idx

    def __getitem__(self, layer_idx: int):
        """Layer ``layer_idx``'s state, or None if it has none yet."""
        i = self._check_idx(layer_idx)
        return self.states[i] if i < len(self.states) else None

    def __len__(self) -> int:
        """Number of layer slots (the highest layer_idx stored + 1)."""
        return len(self.states)

    def update(self, layer_idx: int, state, n_tokens: int) -> None:
        """Store layer ``layer_idx``'s state after ``n_tokens`` more tokens."""
        i = self._check_idx(layer_idx)
        if not (isinstance(state, tuple) and hasattr(state, "_fields")
                and all(x is None or isinstance(x, torch.Tensor) for x in state)):
            raise TypeError(f"state must be an HLA state NamedTuple (HLA2State, AHLAState, HLA3State) of tensors, "
                            f"got {type(state).__name__}")
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
            raise ValueError(f"n_tokens must be an int >= 1, got {n_tokens!r}")
        while len(self.states) <= i:
            self.states.append(None)
            self.seen_tokens.append(0)
        self.states[i] = state
        self.seen_tokens[i] += n_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens layer ``layer_idx`` has consumed (0 before its first call)."""
        i = self._check_idx(layer_idx)
        return self.seen_tokens[i] if i < len(self.seen_tokens) else 0

    def reset(self) -> None:
        """Forget every state (start a new sequence)."""
        self.states.clear()
        self.seen_tokens.clear()

    def __repr__(self) -> str:
        return f"HLACache(layers={len(self.states)}, seen_tokens={self.seen_tokens})"
