"""Compile a call's kernels all at once, before the call launches the first of them.

Why. Triton compiles a kernel the first time it is launched with a new specialization, on the
calling thread, so a first call compiles its kernels one after another: a training step of HLA2
launches some eight distinct kernels (segment summaries, folds, the forward walk, the backward
walk, the per-chunk gradients), and its first forward + backward waits for the sum of their
compile times. A compile is native code (the MLIR passes, LLVM, ptxas) that releases the GIL, so
compiles of different kernels run in parallel threads; the first call then waits about as long as
its slowest kernel takes to compile (``benchmarks/results/hla2_h200_first_call_ahead.md`` and the
AHLA and HLA3 records beside it; hla_fast/README.md, "First calls").

How. :func:`compile_ahead` runs the operator's call once as a *rehearsal*: the same host code on the
same tensors, with a ``launch`` that records ``(kernel, grid, arguments)`` instead of launching,
followed (when autograd records) by its backward from an output gradient. Every tensor the call
allocates is allocated and freed again (no kernel writes it; the record keeps a tensor's dtype and
alignment, not the tensor), so the recorded arguments are those the real call will pass, with the
same dtypes, alignments and integers: the same specializations.
Each recorded launch goes to ``kernel.warmup`` inside Triton's ``AsyncCompileMode`` over a thread
pool, which compiles it (or loads it from Triton's disk cache) and files it in the kernel's
in-process cache; then each compiled kernel's launcher is built (:func:`_prepare_launches`), and
the real call finds every kernel compiled and ready to launch. A call that differs from its
rehearsal (a final-state gradient the rehearsal did not have) compiles what is missing the
ordinary way: the rehearsal only moves compile time, never results.

Once per distinct call (shapes, dtypes, devices, which inputs require grad, flags, config) in a
process; skipped under the Triton interpreter (nothing is compiled there), while a CUDA graph is
being captured (the rehearsal's host ops would enter the graph), and on a Triton without
``AsyncCompileMode``.
"""
from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

from .launch import interpreter_on

# distinct calls remembered per process (the oldest forgotten first): a rehearsal costs
# host time of the order of the call's own, so it runs once per distinct call, not once per call
REMEMBERED_CALLS = 4096
_seen: "collections.OrderedDict[tuple, None]" = collections.OrderedDict()
_seen_lock = threading.Lock()


def launch_kernel(kernel, grid, **kwargs):
    """Launch ``kernel[grid](**kwargs)``. Every operator's launchers take the launch as their
    ``launch`` argument (this function by default) so that a rehearsal can record instead."""
    kernel[grid](**kwargs)


class TensorArg:
    """What a kernel's specialization reads of a tensor argument: its dtype and whether its
    address is a multiple of 16 (``data_ptr`` returns the address modulo 16). Recorded instead of
    the tensor, so that a rehearsal frees its tensors when the real call would."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self._rest = t.data_ptr() % 16

    def data_ptr(self) -> int:
        return self._rest

    def stride(self):
        return torch.empty(self.shape, device="meta").stride()


class Recorder:
    """A ``launch`` that records ``(kernel, grid, kwargs)`` in ``launches`` (tensors as
    :class:`TensorArg`) and launches nothing."""

    def __init__(self):
        self.launches = []

    def __call__(self, kernel, grid, **kwargs):
        self.launches.append((kernel, grid, {a: TensorArg(x) if torch.is_tensor(x) else x
                                             for a, x in kwargs.items()}))


def call_key(op: str, args) -> tuple:
    """What decides the kernels a call of ``op`` on ``args`` compiles: each tensor's shape, dtype,
    device and requires_grad (inside tuples such as a state too), the type of each float (its
    value is a kernel argument, not a specialization), every other argument itself (None, flags,
    ints, a ChunkConfig); and whether autograd records."""
    def one(x):
        if torch.is_tensor(x):
            return ("tensor", tuple(x.shape), x.dtype, x.device, x.requires_grad)
        if isinstance(x, float):
            return float
        if isinstance(x, tuple):
            return (type(x), *(one(y) for y in x))
        return x

    return (op, torch.is_grad_enabled(), *(one(x) for x in args))


def _leaves(x, found):
    """``x`` with every tensor (inside tuples too) replaced by a detached one sharing its memory
    and requiring grad where it does; those are appended to ``found``."""
    if torch.is_tensor(x):
        leaf = x.detach().requires_grad_(x.requires_grad)
        if leaf.requires_grad:
            found.append(leaf)
        return leaf
    if isinstance(x, tuple):
        parts = [_leaves(y, found) for y in x]
        return type(x)(*parts) if hasattr(x, "_fields") else tuple(parts)
    return x


def rehearse(fn, args, launch) -> None:
    """Run ``fn(*args, launch=launch)`` on detached copies of the tensor arguments (sharing their
    memory, requiring grad where the originals do) and, when its first output requires grad, its
    backward from an output gradient (uninitialized: nothing reads its values).

    The backward starts from the scalar ``(o * do).sum()``, whose gradient reaches ``o`` as ``do``
    (a fresh contiguous tensor of o's shape and dtype), rather than from ``do`` passed to
    ``torch.autograd.grad``: an explicit output gradient makes PyTorch import its symbolic-shapes
    module (and SymPy) the first time, about 2 s that a training step's ``loss.backward()`` never
    pays and that the rehearsal would otherwise add to the first call."""
    wrt = []
    leaves = [_leaves(x, wrt) for x in args]
    out = fn(*leaves, launch=launch)
    o = out[0] if isinstance(out, (tuple, list)) else out
    if o.requires_grad and wrt:
        torch.autograd.grad((o * torch.empty_like(o)).sum(), wrt, allow_unused=True)


def _remember(key) -> None:
    with _seen_lock:
        _seen[key] = None
        if len(_seen) > REMEMBERED_CALLS:
            _seen.popitem(last=False)


def _identity(x):
    return x


def compile_ahead(op: str, fn, args, device: torch.device, workers: int | None = None) -> int:
    """Compile, in parallel, every kernel a call ``fn(*args, launch=...)`` of operator ``op``
    (and its backward, when autograd records) will launch, unless this process already did for a
    call like it (:func:`call_key`). ``workers``: compile threads (default: one a kernel, at most
    the CPUs). Returns the number of launches handed to the compiler (0 when skipped).

    The rehearsal never raises: an error it meets (a layout the backward refuses, memory) is left
    to the real call, which meets it where it belongs; the launches recorded before it are still
    compiled. Its autograd graph keeps its saved tensors as they are, whatever saved-tensor hooks
    the caller set (activation checkpointing must not recompute anything for it)."""
    if device.type != "cuda" or interpreter_on():
        return 0
    key = call_key(op, args)
    if key in _seen or not hasattr(triton, "AsyncCompileMode"):
        return 0
    if torch.cuda.is_current_stream_capturing():
        return 0   # not remembered: the same call outside the capture compiles ahead
    _remember(key)
    rec = Recorder()
    try:
        with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            rehearse(fn, args, rec)
    except Exception:  # noqa: BLE001 - see the docstring: the real call raises it
        pass
    if not rec.launches:
        return 0
    n = workers or min(len(rec.launches), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="hla-compile") as pool:
        compiled = compile_launches(rec.launches, pool)
        if compiled is None:   # another AsyncCompileMode is active in this thread: compile as usual
            return 0
        if compiled:   # the device as this thread sees it: a worker thread's current device may differ
            on = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
            _prepare_launches(compiled, on, pool)
    return len(rec.launches)


def compile_launches(launches, pool) -> list | None:
    """Compile every recorded launch ``(kernel, grid, kwargs)`` over the threads of ``pool`` (Triton's
    ``AsyncCompileMode``) and wait: the compiled kernels, each once however many launches use it
    (a launch whose compile failed is left to the real call). None where another
    ``AsyncCompileMode`` is active in this thread (nothing compiled)."""
    try:
        mode = triton.AsyncCompileMode(pool, ignore_errors=True).__enter__()
    except RuntimeError:
        return None
    try:
        pending = [_warm(kernel, grid, kwargs) for kernel, grid, kwargs in launches]
    finally:
        mode.__exit__(None, None, None)   # waits for every compile
    return list({id(k): k for k in (_compiled(p) for p in pending) if k is not None}.values())


def _warm(kernel, grid, kwargs):
    """Hand one recorded launch to the compiler (``kernel.warmup``); what it returns (the compiled
    kernel, or a future of it), or None. A launch it cannot take is left to the real call, which
    compiles it (or raises) as without this module."""
    try:
        return kernel.warmup(grid=grid, **kwargs)
    except Exception:  # noqa: BLE001 - the real launch raises it, with its context
        return None


def _compiled(pending):
    """The compiled kernel a warmup handed back (resolving a future of it), or None where the
    compile failed (left to the real call)."""
    if pending is not None and hasattr(pending, "result"):
        try:
            pending = pending.result(ignore_errors=True)
        except Exception:  # noqa: BLE001 - as in _warm
            return None
    return pending


# held while a call's launchers are built and loaded (_prepare_launches): one call at a time a process
_launchers_lock = threading.Lock()


def _prepare_launches(compiled: list, device: torch.device, pool) -> None:
    """Do what the first launch of each kernel in ``compiled`` would do before launching: build its
    launcher and load it onto ``device`` (Triton's ``_init_handles``), in two steps.

    Why two. Some Triton versions (3.6, the one PyTorch 2.11 pins) compile a launcher from C for each
    kernel signature with the system's C compiler, 0.2 to 0.5 s each, and load it as a Python
    extension module; every such module is named ``__triton_launcher``. CPython loads a library once
    a process: loading the same file again (a second kernel of the same signature, as a process that
    has run other calls meets all the time) hands back the module last loaded under that name with
    its functions replaced by the file's, not a module of its own. Two threads doing that at once
    can each leave with the other's functions: a kernel then runs with another kernel's launcher and
    stops at ``TypeError: function takes exactly N arguments (M given)`` (hla_fast/README.md, "GPU
    tests"; ``benchmarks/launcher_check.py --stub-driver`` shows it on a CPU). So:

    1. the threads of ``pool`` build every launcher at once and keep none: each lands in Triton's
       disk cache, so the C compiles run in parallel;
    2. this thread then loads each kernel and builds its launcher again, one after another (each a
       load from the disk cache, milliseconds), so no two loads overlap.

    A lock keeps two calls' launchers (compile-ahead in two threads) from overlapping. Anything
    either step meets (a kernel too large for the device) is left to the real launch, which raises
    it."""
    with _launchers_lock:
        launcher = _launcher_class()
        if launcher is not None:
            for done in [pool.submit(_build_launcher, launcher, k) for k in compiled]:
                done.result()
        with torch.cuda.device(device):
            for k in compiled:
                _prepare_launch(k)


def _launcher_class():
    """The class the active Triton driver builds a compiled kernel's launcher with, from the kernel's
    ``src`` and ``metadata`` (what ``_init_handles`` calls); None where this Triton has none."""
    try:
        return triton.runtime.driver.active.launcher_cls
    except Exception:  # noqa: BLE001 - no driver: each kernel's first launch builds its own
        return None


def _build_launcher(launcher, compiled) -> None:
    """Build ``compiled``'s launcher with the class ``launcher`` and drop it (step 1 of
    :func:`_prepare_launches`): what stays is its library in Triton's disk cache, where the version
    compiles one."""
    try:
        launcher(compiled.src, compiled.metadata)
    except Exception:  # noqa: BLE001 - the real launch raises it, with its context
        pass


def _prepare_launch(compiled) -> None:
    """Load ``compiled`` onto the current device and build its launcher (Triton's ``_init_handles``,
    what its first launch does before launching). Anything it meets (a kernel too large for the
    device) is left to the real launch, which raises it."""
    init = getattr(compiled, "_init_handles", None)
    if init is None:
        return
    try:
        init()
    except Exception:  # noqa: BLE001 - the real launch raises it, with its context
        pass
