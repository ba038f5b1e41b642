"""The work-efficient exclusive scan of Blelloch (1990), for any associative ``combine``.

The scan is what lets a recurrence over n tokens run in O(log n) parallel steps (paper Sec. 4,
Theorem 4.1): if summaries combine associatively, the prefix summary before every token can be
built by a tree. ``combine(earlier, later)`` need not be commutative; the order of operands is
kept everywhere.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def _check_scan(items, combine, record=None) -> list:
    """``items`` as a list (a sequence: a list, tuple or array, not a one-pass iterator),
    ``combine`` callable, ``record`` None or a list; errors name the argument."""
    if not isinstance(items, Sequence) and not isinstance(items, np.ndarray):
        raise TypeError(f"items must be a sequence (list, tuple or array) of summaries, got {type(items).__name__}")
    if not callable(combine):
        raise TypeError(f"combine must be a callable combine(earlier, later), got {type(combine).__name__}")
    if record is not None and not isinstance(record, list):
        raise TypeError(f"record must be None or a list to append the combines to, got {type(record).__name__}")
    return list(items)


def blelloch_scan(
    items: Sequence[T],
    combine: Callable[[T, T], T],
    identity: T,
    *,
    record: Optional[list] = None,
) -> List[T]:
    """Exclusive prefix scan: ``out[t] = items[0] * ... * items[t-1]``, ``out[0] = identity``.

    Two passes over a balanced binary tree on ``len(items)`` leaves, padded with ``identity`` to a
    power of two:

    * up-sweep: each node stores the combination of its leaves (``left * right``);
    * down-sweep: the root gets ``identity``; a node holding the prefix ``p`` of everything to its
      left hands ``p`` to its left child and ``p * (left child's sum)`` to its right child.

    ``record``: when a list, one tuple ``(phase, level, left, right)`` is appended per combine,
    ``phase`` being ``"up"`` or ``"down"``, ``level`` the tree level (0 = leaves' parents in the
    up-sweep), ``left``/``right`` the array slots combined. Used to draw the tree.

    Returns a list of ``len(items)`` exclusive prefixes, in order.
    """
    items = _check_scan(items, combine, record)
    n = len(items)
    if n == 0:
        return []
    size = 1
    while size < n:
        size *= 2
    tree = list(items) + [identity] * (size - n)

    # Up-sweep (reduce): after level l, slot i (i+1 a multiple of 2^(l+1)) holds its block's sum.
    step, level = 1, 0
    while step < size:
        for right in range(2 * step - 1, size, 2 * step):
            left = right - step
            tree[right] = combine(tree[left], tree[right])
            if record is not None:
                record.append(("up", level, left, right))
        step *= 2
        level += 1

    # Down-sweep: replace sums by exclusive prefixes, walking back down the tree.
    tree[size - 1] = identity
    step //= 2
    level -= 1
    while step >= 1:
        for right in range(2 * step - 1, size, 2 * step):
            left = right - step
            left_sum = tree[left]
            tree[left] = tree[right]                      # left child: the parent's prefix
            tree[right] = combine(tree[right], left_sum)  # right child: prefix, then left block
            if record is not None:
                record.append(("down", level, left, right))
        step //= 2
        level -= 1
    return tree[:n]


def serial_exclusive_scan(items: Sequence[T], combine: Callable[[T, T], T], identity: T) -> List[T]:
    """The same prefixes by a left-to-right fold: the definition the tree scan must match."""
    items = _check_scan(items, combine)
    out, acc = [], identity
    for x in items:
        out.append(acc)
        acc = combine(acc, x)
    return out


def inclusive_scan(items: Sequence[T], combine: Callable[[T, T], T], identity: T) -> List[T]:
    """Inclusive prefixes ``items[0] * ... * items[t]``: the exclusive tree scan, then one local
    combine per position ("local inclusion") to add the item itself. ``blelloch_scan`` checks
    the arguments."""
    return [combine(p, x) for p, x in zip(blelloch_scan(items, combine, identity), items)]


def token_scan(Q, K, V, a, segment, combine, identity, read):
    """Scan one-token segments and read every inclusive prefix out.

    ``a`` (n,) holds the tokens' decay factors a_t (all equal for a constant gamma);
    ``segment(q, k, v, a_t)`` builds token t's summary (its rho is a_t), ``identity(d, dv, dtype)``
    the empty one, ``read(q_t, prefix)`` returns the pair (numerator (dv,), denominator scalar) of
    token t. Returns ``num`` (n, dv) and ``den`` (n,).
    """
    (n, d), dv = Q.shape, V.shape[1]
    factors = np.asarray(a, dtype=np.float64).tolist()   # Python floats keep float32 states float32
    segs = [segment(Q[t], K[t], V[t], factors[t]) for t in range(n)]
    prefixes = inclusive_scan(segs, combine, identity(d, dv, Q.dtype))
    pairs = [read(Q[t], s) for t, s in enumerate(prefixes)]
    num = np.array([p[0] for p in pairs], Q.dtype).reshape(n, dv)
    den = np.array([p[1] for p in pairs], Q.dtype).reshape(n)
    return num, den
