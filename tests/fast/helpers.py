"""Shared helpers of the hla_fast tests: random inputs, float64 truth, poisoned outputs, and the
list of operators the contract suite (test_contract.py) checks."""
import functools
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import hla_ref  # noqa: E402

import hla_fast  # noqa: E402
from hla_fast.ops.ahla.naive import ahla_naive_quadratic  # noqa: E402
from hla_fast.ops.hla2.naive import hla2_naive_quadratic  # noqa: E402
from hla_fast.ops.hla3.naive import hla3_naive_quadratic  # noqa: E402


# benchmarks/: compile_report.py's ahead-of-time compile for Hopper serves the shared-memory tests
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def benchmark_module(name):
    """benchmarks/<name>.py, imported from its path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=None)
def has_cuda_compiler() -> bool:
    """Whether Triton can compile for sm_90 here without a GPU (benchmarks/compile_report.py)."""
    return benchmark_module("compile_report").has_cuda_compiler()


# Hopper's shared memory a block may take (227 KB)
HOPPER_SHARED = 232448

_RULE_SHARED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[3])   # benchmarks/
from compile_report import hopper_compile, record_launches

out = []
for case in json.loads(sys.argv[2]):
    case = dict(case, dtype=getattr(torch, case["dtype"]))
    cfg, launches = record_launches(sys.argv[1], **case)
    seen = set()
    for kernel, _, kw in launches:
        name = kernel.fn.__name__
        key = (name, tuple(sorted((n, str(getattr(x, "dtype", x))) for n, x in kw.items())))
        if key not in seen:
            seen.add(key)
            out.append([name, hopper_compile(kernel, kw)[0].metadata.shared, repr(cfg)])
print(json.dumps(out))
"""


def run_compiler(args, timeout):
    """stdout of ``python *args`` run in a subprocess without TRITON_INTERPRET (so that Triton
    compiles for sm_90 instead of interpreting), which must exit 0."""
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def rule_kernels_shared(op, cases):
    """Compile for sm_90 (no GPU needed) every distinct kernel launch of ``op``'s calls in the
    layouts its rule gives on an H200-sized device: ``cases`` are keyword arguments of
    ``compile_report.record_launches`` (B, T, H, K, V, dtype as a name, gates, forward_only, ...).
    Runs in a subprocess without TRITON_INTERPRET; returns [[kernel name, shared bytes, repr of the
    config], ...]."""
    out = run_compiler(["-c", _RULE_SHARED, op, json.dumps(cases), BENCHMARKS], timeout=900)
    return json.loads(out.strip().splitlines()[-1])


def rand_qkv(B, T, H, K, V, *, seed=0, scale=0.5, positive=False, dtype=None, device="cpu"):
    """Fresh random q, k: [B, T, H, K], v: [B, T, H, V] (never zeros).

    positive=True draws q, k from (0, 1): the denominator of normalize then stays > 0."""
    g = torch.Generator().manual_seed(seed)
    if positive:
        q = torch.rand(B, T, H, K, generator=g) * scale
        k = torch.rand(B, T, H, K, generator=g) * scale
    else:
        q = torch.randn(B, T, H, K, generator=g) * scale
        k = torch.randn(B, T, H, K, generator=g) * scale
    v = torch.randn(B, T, H, V, generator=g)
    dtype = dtype or torch.float32
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def rand_gates(B, T, H, *, seed=0, strength=0.3, device="cpu", dtype=torch.float32):
    """Log-gates g [B, T, H] in [-strength, 0): factors exp(g) in (exp(-strength), 1]."""
    gen = torch.Generator().manual_seed(seed + 7919)
    return (-strength * torch.rand(B, T, H, generator=gen)).to(device=device, dtype=dtype)


def decay_kwargs(kind, B, T, H, *, seed=0, device="cpu", strength=0.3):
    """The decay arguments of one test case: kind "none", "gamma" or "g"."""
    if kind == "none":
        return {}
    if kind == "gamma":
        return {"gamma": 0.85}
    return {"g": rand_gates(B, T, H, seed=seed, device=device, strength=strength)}


def _per_head(op, q, k, v, gamma, g, normalize, eps):
    """Apply a single-head NumPy operator ``op(Q, K, V, gamma=, normalize=, eps=)`` in float64 to
    every (batch, head); gates g [B, T, H] become per-token factors exp(g). Returns [B, T, H, V]."""
    B, T, H, _ = q.shape
    out = np.zeros((B, T, H, v.shape[-1]))
    qn, kn, vn = (x.detach().double().cpu().numpy() for x in (q, k, v))
    an = None if g is None else np.exp(g.detach().double().cpu().numpy())
    for b in range(B):
        for h in range(H):
            gam = an[b, :, h] if an is not None else (1.0 if gamma is None else gamma)
            out[b, :, h] = op(qn[b, :, h], kn[b, :, h], vn[b, :, h], gamma=gam, normalize=normalize, eps=eps)
    return torch.from_numpy(out)


def ref_hla2(q, k, v, gamma=None, normalize=False, eps=1e-6, g=None):
    """hla_ref.hla2_naive in float64, per batch and head. Returns [B, T, H, V] float64."""
    return _per_head(hla_ref.hla2_naive, q, k, v, gamma, g, normalize, eps)


def brute_hla2(q, k, v, gamma=None, normalize=False, eps=1e-6, g=None):
    """The index-sum definition of tests/ref/brute.py (float64, O(T^3) memory: small T only),
    per batch and head. Returns [B, T, H, V] float64."""
    from ref import brute  # tests/ is on sys.path: pytest puts it there for these packages

    return _per_head(brute.hla2, q, k, v, gamma, g, normalize, eps)


def ref_ahla(q, k, v, gamma=None, normalize=False, eps=1e-6, g=None):
    """hla_ref.ahla_naive in float64, per batch and head. Returns [B, T, H, V] float64."""
    return _per_head(hla_ref.ahla_naive, q, k, v, gamma, g, normalize, eps)


def brute_ahla(q, k, v, gamma=None, normalize=False, eps=1e-6, g=None):
    """The index-sum definition of tests/ref/brute.py: ahla (float64, O(T^3) memory: small T
    only), per batch and head. Returns [B, T, H, V] float64."""
    from ref import brute

    return _per_head(brute.ahla, q, k, v, gamma, g, normalize, eps)


def ref_hla3(q, k, v, gamma=None, normalize=False, eps=1e-6, g=None):
    """hla_ref.hla3_naive (the masked operator) in float64, per batch and head. Returns
    [B, T, H, V] float64."""
    return _per_head(hla_ref.hla3_naive, q, k, v, gamma, g, normalize, eps)


def brute_hla3(q, k, v, gamma=None, normalize=False, eps=1e-6, g=None):
    """The index-sum definition of tests/ref/brute.py: hla3, masked (float64, O(T^4) memory:
    small T only), per batch and head. Returns [B, T, H, V] float64."""
    from ref import brute

    return _per_head(brute.hla3, q, k, v, gamma, g, normalize, eps)


def rel(a, b):
    """||a - b|| / ||b|| in float64; NaN anywhere fails."""
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values in the result"
    return float((a - b).norm() / b.norm())


class _NaNTorch:
    """torch, except that empty / empty_like return NaN-filled float tensors."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty_like(x, *a, **kw):
        return torch.full_like(x, float("nan"), *a, **kw)

    @staticmethod
    def empty(*a, **kw):
        out = torch.empty(*a, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out


# the modules whose code allocates kernel outputs: the operators' launchers, and the decode steps'
# shared buffers (their new state and output)
KERNEL_MODULES = ["hla_fast.ops.hla2.chunk", "hla_fast.ops.ahla.chunk", "hla_fast.ops.hla3.chunk",
                  "hla_fast.ops.common.step", "hla_fast.ops.common.denominator"]


def real_calls(fn, record):
    """``fn`` wrapped so that ``record(*args, **kwargs)`` sees each call first, except the calls of
    a rehearsal (``hla_fast.ops.common.compile``: their ``launch`` is a Recorder), which on CUDA
    run a new call once more, recording, before it launches anything. For spies on launchers."""
    from hla_fast.ops.common.compile import Recorder

    def wrapped(*args, **kwargs):
        if not isinstance(kwargs.get("launch"), Recorder):
            record(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapped


def poison_kernel_buffers(monkeypatch):
    """Every buffer the launchers allocate starts as NaN, so an element a kernel forgets to write
    fails the check (the ``poison`` fixture of conftest.py)."""
    for name in KERNEL_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "torch", _NaNTorch())


@dataclass(frozen=True)
class Operator:
    """One member of the contract suite."""

    name: str
    op: Callable            # op(q, k, v, *, gamma, g, normalize, eps, initial_state, output_final_state, chunk_size, backend)
    step: Callable          # step(q, k, v, state, *, gamma, g, normalize, eps, backend)
    State: type             # the state NamedTuple
    state_shapes: Callable  # (B, H, K, V, normalize) -> {field: shape or None}
    ref: Callable           # hla_ref form, per head (ref_hla2's signature)
    brute: Callable         # index sums, per head
    norm_fields: frozenset = frozenset({"z"})  # state fields that exist only when normalizing
    naive: Callable = None  # plain torch O(T^2) form naive(q, k, v, gamma=, g=) (the torch path's gradient check)
    # a non-finite q or k at token t leaves the outputs before t alone; False: only those of the
    # chunks before t's (the operator feeds a row computed from q_t, k_t into a matrix product)
    garbage_within_chunk: bool = True
    package: str = ""       # its subpackage of hla_fast.ops (and the name its errors give), when not ``name``

    @property
    def module(self) -> str:
        return self.package or self.name


def _in_chunks(op, make_config, name):
    """``op`` whose triton calls run in ``make_config(chunk)``'s layout, chunk = ``chunk_size``
    (DEFAULT_CHUNK, 64, when None), whatever the rule would take; other backends, an explicit
    config and a bad ``chunk_size`` go to ``op`` as given (its checks name them)."""
    def call(q, k, v, *, backend=None, chunk_size=None, config=None, **kw):
        if backend == "triton" and config is None and chunk_size in (None, 16, 32, 64, 128):
            config = make_config(chunk_size or 64)
        return op(q, k, v, backend=backend, chunk_size=chunk_size, config=config, **kw)

    call.__name__ = name
    return call


def _as_layers(op, shared=False, den_pass=False):
    """``op`` run as first-order layers (``ChunkConfig.layers``; hla3's second stage; ``shared``:
    hla3's R and K' in one walk, ``fwd_shared_walk``; ``den_pass``: hla2's normalized outer layer
    with its denominator and its state's gradients from passes of their own, ``fwd_den_pass`` and
    ``bwd_den_pass``), in chunks as ``_in_chunks``'."""
    def make(c):
        return hla_fast.ChunkConfig(fwd_chunk=c, bwd_chunk=c, grad_parts=(7,), layers=True, fwd_shared_walk=shared,
                                    fwd_den_pass=den_pass, bwd_den_pass=den_pass)

    kind = 'shared_walk' if shared else 'den_pass' if den_pass else 'layers'
    return _in_chunks(op, make, f"{op.__name__}_{kind}")


def checked_layers_flag(name):
    """(layers, layers with the bool field ``name`` set) for ``hla_fast.ChunkConfig(layers=True)`` in
    chunks of 16, after checking that ``name`` needs layers and takes only a bool."""
    layers = hla_fast.ChunkConfig(fwd_chunk=16, bwd_chunk=16, grad_parts=(7,), layers=True)
    with pytest.raises(ValueError, match=f"config.{name} needs config.layers .*got layers=False"):
        hla_fast.ChunkConfig(**{name: True})
    with pytest.raises(TypeError, match=f"config.{name} must be True or False, got 1"):
        layers.replace(**{name: 1})
    return layers, layers.replace(**{name: True})


hla2_layers = _as_layers(hla_fast.hla2)
hla2_den_pass = _as_layers(hla_fast.hla2, den_pass=True)
hla3_layers = _as_layers(hla_fast.hla3)
hla3_shared_walk = _as_layers(hla_fast.hla3, shared=True)
# AHLA's triton backward as two first-order layers (ChunkConfig.bwd_layers, the rule's for bf16
# training of 128-wide key tiles; a normalized call adds its denominator's part into the
# numerator's dq, dk)
ahla_layers = _in_chunks(hla_fast.ahla, lambda c: hla_fast.ChunkConfig(fwd_chunk=c, bwd_chunk=c, bwd_layers=True),
                         "ahla_layers")


def _hla2_state_shapes(B, H, K, V, norm):
    return {"S": (B, H, K, K), "W": (B, H, K, V), "z": (B, H, K) if norm else None}


def _ahla_state_shapes(B, H, K, V, norm):
    return {"P": (B, H, K, V), "E": (B, H, K, V), "p": (B, H, K) if norm else None, "e": (B, H, K) if norm else None}


def _hla3_state_shapes(B, H, K, V, norm):
    return {"S": (B, H, K, K), "P": (B, H, K, V), "F": (B, H, K, V), "p": (B, H, K) if norm else None,
            "f": (B, H, K) if norm else None}


OPERATORS = [
    Operator("hla2", hla_fast.hla2, hla_fast.hla2_step, hla_fast.HLA2State, _hla2_state_shapes,
             ref_hla2, brute_hla2, naive=hla2_naive_quadratic),
    # as layers, a non-finite k at token t enters the inner layer's product A K as a value row
    Operator("hla2_layers", hla2_layers, hla_fast.hla2_step, hla_fast.HLA2State, _hla2_state_shapes,
             ref_hla2, brute_hla2, naive=hla2_naive_quadratic, garbage_within_chunk=False, package="hla2"),
    Operator("hla2_den_pass", hla2_den_pass, hla_fast.hla2_step, hla_fast.HLA2State, _hla2_state_shapes,
             ref_hla2, brute_hla2, naive=hla2_naive_quadratic, garbage_within_chunk=False, package="hla2"),
    Operator("ahla", hla_fast.ahla, hla_fast.ahla_step, hla_fast.AHLAState, _ahla_state_shapes,
             ref_ahla, brute_ahla, norm_fields=frozenset({"p", "e"}), naive=ahla_naive_quadratic,
             garbage_within_chunk=False),
    Operator("ahla_layers", ahla_layers, hla_fast.ahla_step, hla_fast.AHLAState, _ahla_state_shapes,
             ref_ahla, brute_ahla, norm_fields=frozenset({"p", "e"}), naive=ahla_naive_quadratic,
             garbage_within_chunk=False, package="ahla"),
    Operator("hla3", hla_fast.hla3, hla_fast.hla3_step, hla_fast.HLA3State, _hla3_state_shapes,
             ref_hla3, brute_hla3, norm_fields=frozenset({"p", "f"}), naive=hla3_naive_quadratic,
             garbage_within_chunk=False),
    Operator("hla3_layers", hla3_layers, hla_fast.hla3_step, hla_fast.HLA3State, _hla3_state_shapes,
             ref_hla3, brute_hla3, norm_fields=frozenset({"p", "f"}), naive=hla3_naive_quadratic,
             garbage_within_chunk=False, package="hla3"),
    Operator("hla3_shared_walk", hla3_shared_walk, hla_fast.hla3_step, hla_fast.HLA3State, _hla3_state_shapes,
             ref_hla3, brute_hla3, norm_fields=frozenset({"p", "f"}), naive=hla3_naive_quadratic,
             garbage_within_chunk=False, package="hla3"),
]


def rand_state(op, B, H, K, V, normalize, *, seed=0, scale=0.2, device="cpu", dtype=torch.float32):
    """A random initial state of ``op`` (symmetric square parts, positive where normalizing)."""
    gen = torch.Generator().manual_seed(seed + 104729)
    parts = {}
    for field, shape in op.state_shapes(B, H, K, V, normalize).items():
        if shape is None:
            parts[field] = None
            continue
        x = torch.rand(shape, generator=gen) if field in op.norm_fields else torch.randn(shape, generator=gen)
        if len(shape) == 4 and shape[-1] == shape[-2] and field == "S":
            x = 0.5 * (x + x.transpose(-1, -2))
        parts[field] = (scale * x).to(device=device, dtype=dtype)
    return op.State(**parts)
