"""Input validation shared by every operator of hla_fast.

Each check raises a ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value)
whose message names the argument and says what was expected. Nothing is silently truncated,
broadcast, detached, or accepted "as truthy".
"""
from __future__ import annotations

import math
import numbers

import torch

from .config import ChunkConfig
from .launch import interpreter_on

MAX_DIM = 256
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TORCH_DTYPES = KERNEL_DTYPES + (torch.float64,)
GATE_DTYPES = TORCH_DTYPES


def check_flag(x, name: str) -> bool:
    """A real bool (not 0/1, not a string, not a tensor)."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be True or False, got {type(x).__name__} {x!r}")
    return x


def check_finite_float(x, name: str, above=None, at_least=None) -> float:
    """``x`` as a float: a real number (not a bool, a string or a complex number), finite, and
    > ``above`` / >= ``at_least`` when given. The errors name ``name`` and what it must be."""
    want = "a finite float" + ("" if above is None else f" > {above}") + ("" if at_least is None else f" >= {at_least}")
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be {want}, got {type(x).__name__} {x!r}")
    x = float(x)
    if not math.isfinite(x) or (above is not None and not x > above) or (at_least is not None and not x >= at_least):
        raise ValueError(f"{name} must be {want}, got {x!r}")
    return x


def check_eps(eps) -> float:
    """A normalizer's eps: a finite real number >= 0."""
    return check_finite_float(eps, "eps", at_least=0)


def check_gamma(gamma):
    """None (no decay) or a real number in (0, 1]; returns None or a float.

    A tensor that requires grad is refused: its gradient would be silently dropped. A learnable
    decay is a log-gate ``g``, whose gradient the operators return."""
    if gamma is None:
        return None
    if isinstance(gamma, torch.Tensor):
        if gamma.requires_grad:
            raise TypeError(
                "gamma is a tensor that requires grad, but gamma is a constant and gets no gradient: "
                "for a learnable decay pass log-gates g (e.g. g = log(a) broadcast to [B, T, H]), "
                "whose gradient the op returns")
        if gamma.numel() != 1:
            raise ValueError(f"gamma must be a single number in (0, 1], got a tensor of shape {tuple(gamma.shape)}")
        if gamma.device.type == "meta":
            raise TypeError("gamma is a tensor on the meta device, which holds no value: pass a float in (0, 1]")
        gamma = gamma.item()
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(f"gamma must be None or a float in (0, 1], got {type(gamma).__name__}")
    g = float(gamma)
    if not (0.0 < g <= 1.0):
        raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
    return g


def check_backend(backend, device: torch.device) -> str:
    """Resolve backend None / "triton" / "torch" for tensors on ``device``."""
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if not isinstance(backend, str) or backend not in ("triton", "torch"):
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and device.type != "cuda" and not interpreter_on():
        raise ValueError(
            "backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set "
            f"before triton is imported); got tensors on {device}")
    return backend


def check_chunk_size(chunk_size, backend: str):
    """None (the default: the configuration rule's chunks on the triton backend, DEFAULT_CHUNK
    rows on torch) or an int: 16, 32, 64 or 128 on the triton backend (a power of two tile),
    >= 1 on torch."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be None or an int, got {type(chunk_size).__name__}")
    if backend == "triton":
        if chunk_size not in (16, 32, 64, 128):
            raise ValueError(f"chunk_size must be None, 16, 32, 64 or 128 on the triton backend, got {chunk_size}")
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be None or >= 1, got {chunk_size}")
    return chunk_size


def _check_tensor(name, x, ndim, shape_doc):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got {tuple(x.shape)}")


def check_qkv(q, k, v, seq: bool):
    """Check q, k: [B, T, H, K], v: [B, T, H, V] (seq) or [B, H, K] / [B, H, V] (one step).

    Returns the dims (B, T, H, K, V) (T = 1 for a step)."""
    nd = 4 if seq else 3
    qk_doc = "[B, T, H, K]" if seq else "[B, H, K]"
    v_doc = "[B, T, H, V]" if seq else "[B, H, V]"
    _check_tensor("q", q, nd, qk_doc)
    _check_tensor("k", k, nd, qk_doc)
    _check_tensor("v", v, nd, v_doc)
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} {qk_doc}, got {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        lead = "[B, T, H]" if seq else "[B, H]"
        raise ValueError(
            f"v must share q's leading dims {lead} = {tuple(q.shape[:-1])}, got v of shape {tuple(v.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}: all inputs must share a device")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}: q, k, v must share a dtype")
    if q.dtype not in TORCH_DTYPES:
        raise TypeError(f"q, k, v must be float32, bfloat16, float16 (or float64 on the torch backend), got {q.dtype}")
    if seq:
        B, T, H, K = q.shape
    else:
        (B, H, K), T = q.shape, 1
    V = v.shape[-1]
    if T == 0:
        raise ValueError("q, k, v have T = 0 tokens: the sequence must not be empty")
    if B == 0 or H == 0:
        raise ValueError(f"q must have B >= 1 and H >= 1, got shape {tuple(q.shape)}")
    if K < 1 or V < 1:
        raise ValueError(f"q (K) and v (V) need a feature size >= 1, got K={K}, V={V}")
    if K > MAX_DIM:
        raise ValueError(f"q, k head size K={K} is too large: at most {MAX_DIM}")
    if V > MAX_DIM:
        raise ValueError(f"v head size V={V} is too large: at most {MAX_DIM}")
    return B, T, H, K, V


def check_kernel_dtype(q, arg="q"):
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"backend='triton' takes float32, bfloat16 or float16 {arg}, got {q.dtype}")


def check_gates(g, gamma, q, seq: bool):
    """Log-gates ``g``: None, or a float tensor [B, T, H] ([B, H] for one step) on q's device with
    every value finite and <= 0 (a factor exp(g) in (0, 1]). Mutually exclusive with gamma.

    The values are checked for tensors off CUDA only: on a GPU the check would read a result back
    to the host, synchronizing the device on every call (and breaking CUDA-graph capture). On
    CUDA a positive g is the caller's to avoid (a factor above 1 lets the states grow). A tensor
    on the meta device has no values (a call there infers shapes only)."""
    if g is None:
        return None
    if gamma is not None:
        raise ValueError("pass either gamma (a constant decay) or g (per-token log-gates), not both")
    want = tuple(q.shape[:-1])
    doc = "[B, T, H]" if seq else "[B, H]"
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"g must be a torch.Tensor of shape {doc} = {list(want)}, got {type(g).__name__}")
    if tuple(g.shape) != want:
        raise ValueError(f"g must have shape {doc} = {list(want)} (no broadcasting), got {tuple(g.shape)}")
    if g.dtype not in GATE_DTYPES:
        raise TypeError(f"g must be a float tensor (log-gates), got {g.dtype}")
    if g.device != q.device:
        raise ValueError(f"g is on {g.device} but q is on {q.device}")
    if g.device.type not in ("cuda", "meta") and not bool(((g <= 0) & torch.isfinite(g)).all()):
        raise ValueError("g must hold finite log-gates <= 0 (a factor exp(g) in (0, 1] per token and head)")
    return g


def state_dtype(q_dtype):
    """States are fp32, except on the float64 torch path."""
    return torch.float64 if q_dtype == torch.float64 else torch.float32


def check_state_parts(state, cls, want: dict, optional: set, device, name: str, dtype):
    """Validate a state NamedTuple ``cls`` against ``want`` = {field: shape, or None for a field
    this call does not use}.

    A used field that is None, or of the wrong type, shape, device or dtype, raises naming the
    field; the message for a missing field in ``optional`` (those only some calls keep, such as z
    for normalization) says which states carry it. Returns ``cls`` with the unused fields None."""
    if state is None:
        return None
    if not isinstance(state, tuple) or len(state) != len(cls._fields):
        raise TypeError(f"{name} must be a {cls.__name__}{cls._fields}, got {type(state).__name__}")
    parts = {}
    for field, x in zip(cls._fields, state):
        shape = want[field]
        if shape is None:
            parts[field] = None
            continue
        if x is None:
            raise ValueError(f"{name}.{field} is None but this call needs it"
                             + (" (pass a state made with normalize=True)" if field in optional else ""))
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}.{field} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name}.{field} must have shape {list(shape)}, got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name}.{field} is on {x.device} but q is on {device}")
        if x.dtype != dtype:
            raise TypeError(f"{name}.{field} must be {dtype}, got {x.dtype}")
        parts[field] = x
    return cls(**parts)


def check_call(q, k, v, gamma, g, normalize, eps, backend, seq: bool, op: str = "", triton_max_k=None):
    """The checks an operator's sequence call and its decode step share.

    q, k: [B, T, H, K], v: [B, T, H, V] (seq) or [B, H, K] / [B, H, V] (one step); g: None or
    log-gates [B, T, H] ([B, H] for one step). ``triton_max_k`` (with the operator's name ``op``
    for the message): the widest key head the operator's Triton kernels take, None for no limit.

    Returns ((B, T, H, K, V), gamma, g, eps, backend) with gamma a float or None and backend
    resolved to "triton" or "torch"."""
    dims = check_qkv(q, k, v, seq=seq)
    gamma = check_gamma(gamma)
    g = check_gates(g, gamma, q, seq=seq)
    check_flag(normalize, "normalize")
    eps = check_eps(eps)
    backend = check_backend(backend, q.device)
    if backend == "triton":
        check_kernel_dtype(q)
        if triton_max_k is not None and dims[3] > triton_max_k:
            raise ValueError(f"{op} on backend='triton' takes q, k head sizes K <= {triton_max_k}, got K={dims[3]} "
                             "(use backend='torch' for wider heads)")
    return dims, gamma, g, eps, backend


def check_sequence_options(output_final_state, chunk_size, backend: str, config, stages: int = 1):
    """The options only a sequence call has: ``output_final_state`` a bool, ``chunk_size`` one
    the backend takes, ``config`` None or a ChunkConfig (for an operator of ``stages`` > 1
    stages of kernels also a tuple of one ChunkConfig a stage)."""
    check_flag(output_final_state, "output_final_state")
    check_chunk_size(chunk_size, backend)
    if config is None:
        return
    if isinstance(config, ChunkConfig):
        configs = (config,)
    elif stages > 1 and isinstance(config, tuple) and len(config) == stages and all(
            isinstance(c, ChunkConfig) for c in config):
        configs = config
    else:
        if stages > 1 and isinstance(config, tuple):
            got = f"a tuple of {len(config)}: ({', '.join(type(c).__name__ for c in config)})"
        else:
            got = type(config).__name__
        want = f", a tuple of {stages} ChunkConfigs (one a stage)" if stages > 1 else ""
        raise TypeError(f"config must be a ChunkConfig{want} or None, got {got}")
    # a config is the whole layout of the Triton kernels: nothing else may ask for one it overrides
    if backend != "triton":
        raise ValueError(f"config is a layout of the triton backend's kernels; backend {backend!r} takes none "
                         f"(pass config=None, or backend='triton')")
    if chunk_size is not None and any(c.fwd_chunk != chunk_size or c.bwd_chunk != chunk_size for c in configs):
        chunks = [(c.fwd_chunk, c.bwd_chunk) for c in configs]
        raise ValueError(f"chunk_size={chunk_size} asks for chunks the config does not have (fwd_chunk, bwd_chunk: "
                         f"{chunks}): with a config pass chunk_size=None, its chunks are the config's")


def check_state(state, cls, want: dict, optional: set, q, name: str):
    """:func:`check_state_parts` for a state that must sit on q's device in the state dtype of q
    (fp32, float64 on the float64 torch path). ``want`` = {field: shape or None}, e.g.
    {"S": (B, H, K, K), "z": (B, H, K) if normalize else None}. Returns ``cls`` or None."""
    return check_state_parts(state, cls, want, optional, q.device, name, state_dtype(q.dtype))


def zero_state(cls, want: dict, q):
    """A state ``cls`` of zeros in the state dtype of q on q's device: each field of ``want``
    = {field: shape or None} with a shape gets zeros of that shape, the others None."""
    sd = state_dtype(q.dtype)
    return cls(**{f: None if want[f] is None else q.new_zeros(want[f], dtype=sd) for f in cls._fields})
