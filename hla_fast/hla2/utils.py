"""State container, input checks and backend selection shared by the HLA2 paths."""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

MIN_DIM = 16
MAX_DIM = 256
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_DTYPES = _KERNEL_DTYPES + (torch.float64,)


class HLA2State(NamedTuple):
    """Compact HLA2 state, fp32 (float64 on the float64 torch path).

    S: [B, H, K, K]  decayed key second moment, sum_i gamma^(t-i) k_i k_i^T
    W: [B, H, K, V]  sum_j gamma^(2(t-j)) (S_j q_j) v_j^T
    z: [B, H, K]     sum_j gamma^(2(t-j)) S_j q_j (only when normalizing, else None)
    """

    S: torch.Tensor
    W: torch.Tensor
    z: Optional[torch.Tensor] = None


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints. (``triton.cdiv`` is a jit function: calling it from Python
    goes through the JIT's dispatch and costs microseconds per call on the host.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1), without the JIT dispatch of ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length()


def interpreter_on() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_gamma(gamma):
    """None or a real number in (0, 1]. Returns a float (1.0 for None)."""
    if gamma is None:
        return 1.0
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)):
        if isinstance(gamma, torch.Tensor) and gamma.numel() == 1:
            gamma = float(gamma)
        else:
            raise TypeError(f"gamma must be None or a float in (0, 1], got {type(gamma).__name__}")
    g = float(gamma)
    if not (0.0 < g <= 1.0):
        raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
    return g


def check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float >= 0, got {type(eps).__name__}")
    if not (float(eps) >= 0.0):
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    return float(eps)


def check_backend(backend, device: torch.device) -> str:
    """Resolve backend None/"triton"/"torch" for tensors on `device`."""
    if backend is None:
        if device.type == "cuda":
            return "triton"
        return "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and device.type != "cuda" and not interpreter_on():
        raise ValueError(
            "backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set "
            f"before triton is imported); got tensors on {device}"
        )
    return backend


def _check_tensor(name, x, ndim, shape_doc):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got {tuple(x.shape)}")


def check_qkv(q, k, v, seq: bool):
    """Check q, k: [B, T, H, K], v: [B, T, H, V] (seq) or [B, H, K] / [B, H, V] (step).

    Returns the dims (B, T, H, K, V) (T = 1 for a step).
    """
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
            f"v must share q's leading dims {lead} = {tuple(q.shape[:-1])}, got v of shape {tuple(v.shape)}"
        )
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}: all inputs must share a device")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}: q, k, v must share a dtype")
    if q.dtype not in _TORCH_DTYPES:
        raise TypeError(f"q, k, v must be float32, bfloat16, float16 (or float64 on the torch backend), got {q.dtype}")
    if seq:
        B, T, H, K = q.shape
    else:
        B, H, K = q.shape
        T = 1
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
    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"backend='triton' takes float32, bfloat16 or float16 {arg}, got {q.dtype}")


def check_state(state, B, H, K, V, normalize, device, name="initial_state", dtype=torch.float32):
    """Validate an HLA2State (S [B,H,K,K], W [B,H,K,V], z [B,H,K] when normalizing)."""
    if state is None:
        return None
    if not isinstance(state, tuple) or len(state) not in (2, 3):
        raise TypeError(f"{name} must be an HLA2State (S, W, z), got {type(state).__name__}")
    S, W = state[0], state[1]
    z = state[2] if len(state) == 3 else None
    want = {"S": (B, H, K, K), "W": (B, H, K, V), "z": (B, H, K)}
    for part, x in (("S", S), ("W", W), ("z", z)):
        if part == "z" and not normalize:
            continue
        if x is None:
            raise ValueError(f"{name}.z is None but normalize=True needs it: pass a state made with normalize=True")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}.{part} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != want[part]:
            raise ValueError(f"{name}.{part} must have shape {list(want[part])}, got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name}.{part} is on {x.device} but q is on {device}")
        if x.dtype != dtype:
            raise TypeError(f"{name}.{part} must be {dtype}, got {x.dtype}")
    return HLA2State(S, W, z if normalize else None)


def state_dtype(q_dtype):
    """States are fp32, except on the float64 torch path."""
    return torch.float64 if q_dtype == torch.float64 else torch.float32
