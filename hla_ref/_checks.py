"""Input validation shared by every public function.

Each check raises a ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value)
whose message starts with the argument's name, so a caller sees at once what to fix.
Nothing is silently truncated, broadcast or cast from a non-float type.

Arrays are checked *before* NumPy converts them: a torch tensor, or a list or tuple holding one,
is refused with a ``TypeError`` that names the argument (``hla_ref`` is NumPy-only and never
imports torch; a tensor is recognised by the package its type or one of its base types comes from,
``torch``, so a subclass defined elsewhere is recognised too), and a ragged nested list, which
NumPy cannot turn into an array, is refused with a ``ValueError`` that names it.
"""

from __future__ import annotations

import collections
import numbers
from typing import NamedTuple

import numpy as np

_FLOATS = (np.float32, np.float64)


def _is_torch(x) -> bool:
    """True for an object of a type from the ``torch`` package, or of a type derived from one (a
    tensor subclass defined anywhere), without importing torch."""
    return any((c.__module__ or "").split(".")[0] == "torch" for c in type(x).__mro__)


def _holds_torch(x) -> bool:
    """True for a torch object, or a list / tuple (at any depth) holding one."""
    if isinstance(x, (list, tuple)):
        return any(_holds_torch(y) for y in x)
    return _is_torch(x)


def _torch_refused(x, name: str, what: str, how: str) -> TypeError:
    """The error for a torch object given as ``name``, or for a list or tuple holding torch
    objects: ``what`` to pass instead, ``how`` to get it from a tensor."""
    if not _is_torch(x):
        return TypeError(f"{name} is a {type(x).__name__} holding torch objects; hla_ref is NumPy-only: pass "
                         f"{what} (convert the tensors first)")
    return TypeError(f"{name} is a torch object ({type(x).__name__}, dtype {getattr(x, 'dtype', '?')}); "
                     f"hla_ref is NumPy-only: pass {what}, e.g. {how}")


def to_array(x, name: str, what: str = "a NumPy float32/float64 array", how: str | None = None) -> np.ndarray:
    """``np.asarray(x)``, refusing torch tensors (``what`` to pass instead and ``how``, by default a
    NumPy float array from ``.detach().cpu().double().numpy()``) and ragged nested lists by ``name``."""
    if _holds_torch(x):
        raise _torch_refused(x, name, what, how or f"{name}.detach().cpu().double().numpy()")
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a NumPy masked array, whose mask these functions would ignore (they read every "
            f"value): pass a plain array, e.g. {name}.filled(0.0) to zero the masked entries"
        )
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"{name} cannot be converted to a NumPy array (a ragged nested list, with rows of "
            f"different lengths?): {exc}"
        ) from None


def _float_array(x, name: str, ndim: int, shape_doc: str) -> np.ndarray:
    """``x`` as a finite float32/float64 array of ``ndim`` dimensions, the last of them at least
    one feature wide, or raise naming ``name`` (``shape_doc``: the shape the caller expects)."""
    arr = to_array(x, name)
    if arr.dtype.type not in _FLOATS:
        raise TypeError(
            f"{name} must be a float32 or float64 array, got dtype {arr.dtype}"
        )
    if arr.ndim != ndim:
        raise ValueError(
            f"{name} must have shape {shape_doc} with ndim {ndim}, got shape {arr.shape}"
        )
    if arr.shape[-1] < 1:
        raise ValueError(f"{name} must have at least one feature, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return arr


def as_matrix(x, name: str) -> np.ndarray:
    """Return ``x`` as a 2-D float32/float64 array, or raise naming ``name``."""
    return _float_array(x, name, 2, "(n, features)")


def check_qk(Q, K):
    """Validate ``Q, K: (n, d)``; both come back in one dtype (float32 only if both are)."""
    Q, K = as_matrix(Q, "Q"), as_matrix(K, "K")
    if K.shape != Q.shape:
        raise ValueError(
            f"K must have the same shape (n, d) as Q {Q.shape}, got {K.shape}"
        )
    dtype = np.result_type(Q, K)
    return Q.astype(dtype, copy=False), K.astype(dtype, copy=False)


def check_qkv(Q, K, V):
    """Validate a single-head ``Q, K: (n, d)``, ``V: (n, dv)`` triple.

    Returns the three arrays in one common dtype: float32 when all three are float32,
    float64 otherwise.
    """
    Q, K = check_qk(Q, K)
    V = as_matrix(V, "V")
    if V.shape[0] != Q.shape[0]:
        raise ValueError(
            f"V must have the same length n = {Q.shape[0]} as Q and K, got shape {V.shape}"
        )
    dtype = np.result_type(Q, V)
    return Q.astype(dtype, copy=False), K.astype(dtype, copy=False), V.astype(dtype, copy=False)


def check_token(q, k, v):
    """Validate one token's ``q, k: (d,)`` and ``v: (dv,)`` (the one-token segment builders); the
    three come back in one dtype (float32 only if all three are)."""
    q, k, v = (_float_array(x, name, 1, "(features,)") for x, name in ((q, "q"), (k, "k"), (v, "v")))
    if k.shape != q.shape:
        raise ValueError(f"k must have the same shape (d,) as q {q.shape}, got {k.shape}")
    dtype = np.result_type(q, k, v)
    return q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False)


def check_scale(scale, d: int) -> float:
    """A score scale: a finite real number, or None for 1/sqrt(d) (bools and complex refused)."""
    return 1.0 / np.sqrt(d) if scale is None else _real(scale, "scale")


def check_dims(d, dv):
    """The sizes ``d``, ``dv`` of an empty segment: integers >= 1 (bools refused)."""
    for name, x in (("d", d), ("dv", dv)):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {type(x).__name__}")
        if x < 1:
            raise ValueError(f"{name} must be >= 1, got {x}")
    return int(d), int(dv)


def check_dtype(dtype) -> np.dtype:
    """An empty segment's ``dtype``: float32 or float64 (anything NumPy reads as one of them)."""
    if _is_torch(dtype):
        raise TypeError(f"dtype is a torch object ({dtype}); pass numpy.float32 or numpy.float64")
    try:
        dt = np.dtype(dtype) if dtype is not None else None
    except TypeError:
        dt = None
    if dt is None or dt.type not in _FLOATS:
        raise TypeError(f"dtype must be numpy.float32 or numpy.float64, got {dtype!r}")
    return dt


def check_segment(x, name: str, cls):
    """One segment of a combine: a ``cls`` (a segment NamedTuple) whose arrays are finite NumPy
    float32/float64 arrays and whose ``rho`` (the product of its tokens' factors, each in
    (0, 1], so 0 only where the product underflowed) is a real number in [0, 1]. Returns it with
    ``rho`` as a float (a NumPy float64 scalar would turn float32 fields into float64)."""
    if not isinstance(x, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, got {type(x).__name__}")
    rho = _real(x.rho, f"{name}.rho")
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"{name}.rho must lie in [0, 1] (a product of factors in (0, 1]), got {rho}")
    for field, value in zip(cls._fields, x):
        where = f"{name}.{field}"
        if field == "rho":
            continue
        if _is_torch(value) or not isinstance(value, np.ndarray) or isinstance(value, np.ma.MaskedArray):
            raise TypeError(f"{where} must be a NumPy float32/float64 array (as the segment builders make), "
                            f"got {type(value).__name__}")
        if value.ndim == 0:
            raise ValueError(f"{where} must be an array of {cls.__name__}'s shapes (d, ...), got a 0-d array")
        _float_array(value, where, value.ndim, str(value.shape))   # its dtype, and every value finite
    return x._replace(rho=rho)


def check_segments(A, B, cls):
    """The two segments of a combine: each as :func:`check_segment` says, every field shaped as
    ``cls.SHAPES`` says for A's sizes, B's the same. Returns (A, B) with each ``rho`` as a float.

    A's sizes are the ones most of its fields agree on (d: the first dimension of every array
    field; dv: the last of every field with a "v"), so the error names the field that is off."""
    A, B = check_segment(A, "A", cls), check_segment(B, "B", cls)

    def most_common(sizes):
        return collections.Counter(sizes).most_common(1)[0][0]

    d = most_common([np.shape(a)[0] for a, s in zip(A, cls.SHAPES) if s])
    dv = most_common([np.shape(a)[-1] for a, s in zip(A, cls.SHAPES) if "v" in s])
    want = {"d": d, "v": dv}
    for name, seg in (("A", A), ("B", B)):
        for field, value, spec in zip(cls._fields, seg, cls.SHAPES):
            shape = tuple(want[c] for c in spec)
            if np.shape(value) != shape:
                doc = "(" + ", ".join("dv" if c == "v" else "d" for c in spec) + (",)" if len(spec) == 1 else ")")
                raise ValueError(f"{name}.{field} must have shape {doc} = {shape} (d = {d}, dv = {dv}, read from "
                                 f"A), got {np.shape(value)}: segments of different sizes, or a field shaped for none, do not combine")
    return A, B


def _real(x, name: str) -> float:
    if _is_torch(x):
        raise _torch_refused(x, name, "a Python float", f"{name}.item()")
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    try:
        x = float(x)
    except OverflowError:   # an int beyond float's range
        raise ValueError(f"{name} must be finite, got an int of {x.bit_length()} bits") from None
    if not np.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def check_gamma(gamma) -> float:
    """A constant decay ``gamma``: a finite real in (0, 1]; 1 means no decay.

    Used where only one factor makes sense (a one-token segment's factor, and the paper's
    formulas in ``hla_ref.published``); the operator forms take per-token gates through
    :func:`check_gates`."""
    if _holds_torch(gamma):
        raise _torch_refused(gamma, "gamma", "a Python float", "gamma.item()")
    if isinstance(gamma, (list, tuple, np.ndarray)):
        raise TypeError(
            f"gamma must be a real number in (0, 1] here, got {type(gamma).__name__}: this "
            f"function takes one constant decay factor (the paper's formulas in "
            f"hla_ref.published, or one token's own factor in a *_segment builder), not an "
            f"array of per-token gates"
        )
    g = _real(gamma, "gamma")
    if not 0.0 < g <= 1.0:
        raise ValueError(f"gamma must lie in (0, 1], got {g}")
    return g


class Gates(NamedTuple):
    """The per-token decay of a sequence of n tokens, as every operator form uses it.

    a:     (n,) float64, the factors a_t in (0, 1] (all equal to gamma for a float gamma)
    log_a: (n,) float64, log a_t <= 0; finite, since the log of a positive float64 is > -745
    b:     (n,) float64, b_t = sum_{s <= t} log a_s (non-increasing)

    Everything decays by differences of b: a term that entered at token x and is read at token
    t >= x carries exp(b_t - b_x) = a_{x+1} ... a_t (empty product 1 at x = t); a constant gamma
    is b_t = (t + 1) log gamma, and exp(b_t - b_x) = gamma^(t-x). The first factor a_0 multiplies
    only the (empty) state before the sequence, so it never changes an output.
    """
    a: np.ndarray
    log_a: np.ndarray
    b: np.ndarray


def check_gates(gamma, n: int) -> Gates:
    """Validate ``gamma`` for a sequence of ``n`` tokens and return its :class:`Gates`.

    ``gamma`` is either a real number in (0, 1] (the same factor for every token) or a 1-D float
    array of shape ``(n,)`` of per-token factors a_t in (0, 1]: any NumPy float dtype, or a
    Python list / tuple of floats that NumPy turns into one (a list of ints or bools is refused
    like an int array). Refused: int / bool / object / complex dtypes (``TypeError``), any other
    shape, a length other than n (no broadcasting), NaN, inf, a_t <= 0 or a_t > 1
    (``ValueError``), a torch tensor (``TypeError``) and a ragged list (``ValueError``).
    """
    if isinstance(gamma, (bool, np.bool_)) or gamma is None or isinstance(gamma, (str, bytes)):
        raise TypeError(
            f"gamma must be a real number in (0, 1] or a float array of per-token factors of "
            f"shape (n,), got {type(gamma).__name__}"
        )
    if isinstance(gamma, numbers.Real) and not _is_torch(gamma):
        a = np.full(n, check_gamma(gamma))
    else:
        arr = to_array(gamma, "gamma", "a Python float or a NumPy float array of per-token factors",
                       "gamma.item() or gamma.detach().cpu().double().numpy()")
        if not np.issubdtype(arr.dtype, np.floating):
            raise TypeError(
                f"gamma as an array of per-token factors must have a float dtype, got dtype "
                f"{arr.dtype} (a list of ints such as [1, 1] is refused too: write 1.0)"
            )
        if arr.shape != (n,):
            raise ValueError(
                f"gamma as an array of per-token factors must have shape (n,) = ({n},), one "
                f"factor per token, got shape {arr.shape}"
            )
        a = arr.astype(np.float64)
        bad = ~np.isfinite(a)
        if bad.any():
            t = int(np.argmax(bad))
            raise ValueError(f"gamma must be finite, got gamma[{t}] = {float(a[t])}")
        bad = ~((a > 0.0) & (a <= 1.0))
        if bad.any():
            t = int(np.argmax(bad))
            raise ValueError(f"gamma factors must lie in (0, 1], got gamma[{t}] = {float(a[t])!r}")
    log_a = np.log(a)
    return Gates(a, log_a, np.cumsum(log_a))


def check_eps(eps) -> float:
    """Normalizer offset ``eps`` must be a finite real >= 0."""
    e = _real(eps, "eps")
    if e < 0:
        raise ValueError(f"eps must be >= 0, got {e}")
    return e


def check_ridge(ridge) -> float:
    """Ridge ``lambda`` must be a finite real >= 0."""
    r = _real(ridge, "ridge")
    if r < 0:
        raise ValueError(f"ridge must be >= 0, got {r}")
    return r


def check_chunk_size(chunk_size) -> int:
    """``chunk_size`` must be an integer >= 1 (bools are refused)."""
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an integer, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)


def check_flag(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(x).__name__}")
    return bool(x)


def check_variant(variant) -> str:
    if variant not in ("masked", "paper"):
        raise ValueError(f"variant must be 'masked' or 'paper', got {variant!r}")
    return variant


def check_common(Q, K, V, gamma, normalize, eps):
    """Validate the arguments every operator form takes; returns ``Q, K, V, gates, normalize,
    eps`` cleaned, ``gates`` being the :class:`Gates` of ``gamma`` (float or per-token array)."""
    Q, K, V = check_qkv(Q, K, V)
    return (Q, K, V, check_gates(gamma, Q.shape[0]), check_flag(normalize, "normalize"),
            check_eps(eps))


def check_common_constant(Q, K, V, gamma, normalize, eps):
    """:func:`check_common` for a constant decay only (``hla_ref.published``): ``gamma`` comes
    back as a float, and an array gamma is refused."""
    Q, K, V = check_qkv(Q, K, V)
    return Q, K, V, check_gamma(gamma), check_flag(normalize, "normalize"), check_eps(eps)


def with_ones(V: np.ndarray) -> np.ndarray:
    """``[V | 1]``: the normalizer is the same sum with every ``v_j`` replaced by 1,
    so one extra column of ones carries the denominator through any form."""
    return np.concatenate([V, np.ones((V.shape[0], 1), V.dtype)], axis=1)


def decay_matrix(log_a, power: int = 1, dtype=np.float64) -> np.ndarray:
    """``D[r, c] = exp(power (b_r - b_c)) = (a_{c+1} ... a_r)^power`` for ``c <= r``, 0 above: (n, n).

    ``log_a`` (n,) are the log factors of the tokens (of a whole sequence or of one chunk: only
    differences of b enter). The exponent is built as a column-wise running sum
    ``E[r, c] = sum_{c < s <= r} log a_s``, so it is never positive (no entry exceeds 1: a gate
    near 0 cannot overflow anything) and no two large b's are subtracted. For a constant gamma,
    ``D[r, c] = gamma^(power (r - c))``.
    """
    log_a = np.asarray(log_a, dtype=np.float64)
    n = log_a.shape[0]
    lower = np.tril(np.ones((n, n), dtype=bool))
    E = np.cumsum(np.where(np.tril(lower, -1), log_a[:, None], 0.0), axis=0)
    return np.where(lower, np.exp(power * E), 0.0).astype(dtype)
