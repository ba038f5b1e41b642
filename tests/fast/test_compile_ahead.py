"""Compiling a call's kernels ahead of its first launch (hla_fast/ops/common/compile.py).

* The rehearsal records exactly the launches the real call makes (kernel, grid, every argument:
  tensors by dtype and alignment, numbers and flags by value), forward and backward, for every
  operator, with gates, normalization, an initial state, inputs that do or do not require grad:
  what the compiler is handed ahead is what the call will ask for.
* The key that decides whether a call was seen: shapes, dtypes, requires_grad (inside a state
  too), flags and config count; tensor identities and float values do not.
* Off CUDA nothing is rehearsed or compiled.
* On CUDA (marked gpu): after ``compile_ahead`` the real forward and backward compile nothing, and
  a second identical call is not rehearsed again.
"""
import importlib
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import hla_fast  # noqa: E402
from hla_fast.ops.common import compile as ahead  # noqa: E402

from .helpers import real_calls  # noqa: E402

OPS = ["hla2", "ahla", "hla3"]


def chunk_module(op):
    return importlib.import_module(f"hla_fast.ops.{op}.chunk")


def make_args(op, device, *, T=37, K=16, V=8, gates=False, normalize=False, state=False, grad=True, seed=0):
    """The arguments ``hla_fast.<op>`` hands to ``<op>_chunked`` (contiguous; fp32 states)."""
    gen = torch.Generator().manual_seed(seed)
    B, H = 2, 2

    def rnd(*shape, scale=0.3, positive=False):
        x = torch.rand(*shape, generator=gen) if positive else torch.randn(*shape, generator=gen)
        return (scale * x).to(device)

    q, k = rnd(B, T, H, K, positive=normalize), rnd(B, T, H, K, positive=normalize)
    v = rnd(B, T, H, V, scale=1.0)
    g = -0.2 * rnd(B, T, H, scale=1.0, positive=True) if gates else None
    gamma = None if gates else 0.9
    leaves = [q, k, v] + ([g] if gates else [])
    if op == "hla2":
        st = [rnd(B, H, K, K, scale=0.1), rnd(B, H, K, V, scale=0.1),
              rnd(B, H, K, scale=0.1, positive=True) if normalize else None] if state else [None] * 3
        args = (q, k, v, g, gamma, *st, normalize, 1e-6, None, 16)
    elif op == "ahla":
        st = [rnd(B, H, K, V, scale=0.1), rnd(B, H, K, V, scale=0.1)]
        st += [rnd(B, H, K, scale=0.1, positive=True), rnd(B, H, K, scale=0.1, positive=True)] if normalize else [None] * 2
        st = st if state else [None] * 4
        args = (q, k, v, g, gamma, *st, normalize, 1e-6, None, 16)
    else:
        st = None
        if state:
            st = hla_fast.HLA3State(rnd(B, H, K, K, scale=0.1), rnd(B, H, K, V, scale=0.1), rnd(B, H, K, V, scale=0.1),
                                    rnd(B, H, K, scale=0.1, positive=True) if normalize else None,
                                    rnd(B, H, K, scale=0.1, positive=True) if normalize else None)
        args = (q, k, v, g, gamma, st, normalize, 1e-6, None, 16)
    if grad:
        for x in leaves:
            x.requires_grad_()
    return args


def signature(launches):
    """Launches as comparable values: kernel name, grid, arguments (tensors by dtype and address
    modulo 16)."""
    out = []
    for kernel, grid, kw in launches:
        args = tuple(sorted((a, ("tensor", x.dtype, x.data_ptr() % 16) if isinstance(x, ahead.TensorArg) else x)
                            for a, x in kw.items()))
        out.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, tuple(grid), args))
    return out


def run_recorded(op, args):
    """The real call (forward, and backward from a fixed output gradient when it requires grad)
    with a launch that records every kernel launch and then makes it."""
    rec = ahead.Recorder()

    def launch(kernel, grid, **kw):
        rec(kernel, grid, **kw)
        ahead.launch_kernel(kernel, grid, **kw)

    fn = getattr(chunk_module(op), f"{op}_chunked")
    out = fn(*args, launch=launch)
    wrt = [x for x in (a for a in args if torch.is_tensor(a)) if x.requires_grad]
    if out[0].requires_grad:
        do = torch.randn(out[0].shape, generator=torch.Generator().manual_seed(3)).to(out[0])
        torch.autograd.grad(out[0], wrt, do, allow_unused=True)
    return rec.launches


CASES = [dict(), dict(gates=True), dict(normalize=True), dict(state=True), dict(gates=True, state=True),
         dict(normalize=True, state=True), dict(grad=False), dict(grad=False, normalize=True, gates=True)]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c) or "plain")
def test_rehearsal_records_the_launches_of_the_call(op, case, device):
    args = make_args(op, device, **case)
    rec = ahead.Recorder()
    ahead.rehearse(getattr(chunk_module(op), f"{op}_chunked"), args, rec)
    real = run_recorded(op, args)
    assert len(real) > 0
    assert signature(rec.launches) == signature(real)
    backward = any("bwd" in name for name, _, _ in signature(real))
    assert backward == case.get("grad", True)


@pytest.mark.parametrize("normalize", [False, True])
def test_rehearsal_records_the_launches_of_hla2_as_layers(normalize, device):
    """HLA2 as first-order layers (``ChunkConfig.layers``), gated from a state, normalized (z beside W
    in the outer layer's walks) or not: the rehearsal records the launches the call makes."""
    args = list(make_args("hla2", device, gates=True, normalize=normalize, state=True))
    args[10] = hla_fast.ChunkConfig(fwd_chunk=16, bwd_chunk=16, grad_parts=(7,), layers=True, fwd_segments=2)
    rec = ahead.Recorder()
    ahead.rehearse(chunk_module("hla2").hla2_chunked, tuple(args), rec)
    real = run_recorded("hla2", tuple(args))
    names = [name for name, _, _ in signature(real)]
    assert signature(rec.launches) == signature(real)
    assert "ahla_bwd_layer_kernel" in names and "hla2_fwd_kernel" not in names
    assert ("normalized_grad_kernel" in names) == normalize


def test_rehearsal_leaves_sympy_unimported():
    """The rehearsal's backward starts from a scalar, as a training step's does: an explicit output
    gradient would make PyTorch import its symbolic-shapes module and SymPy (seconds) inside the
    first call. Checked in a fresh interpreter, with the check itself shown to detect the import."""
    import os
    import subprocess
    import sys

    script = (
        "import sys, torch, hla_fast\n"
        "from hla_fast.ops.common import compile as ahead\n"
        "from hla_fast.ops.hla2 import chunk\n"
        "q, k, v = (torch.randn(1, 9, 2, 4, requires_grad=True) for _ in range(3))\n"
        "ahead.rehearse(chunk.hla2_chunked, (q, k, v, None, 0.9, None, None, None, False, 1e-6, None, 16), "
        "ahead.Recorder())\n"
        "print('sympy' in sys.modules)\n"
        "torch.autograd.grad(q * 2, [q], torch.ones_like(q))\n"
        "print('sympy' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "True"]


def test_rehearsal_of_a_call_that_does_not_require_grad_has_no_backward(device):
    args = make_args("ahla", device, grad=False)
    rec = ahead.Recorder()
    ahead.rehearse(chunk_module("ahla").ahla_chunked, args, rec)
    assert rec.launches and not any("bwd" in name for name, _, _ in signature(rec.launches))


def test_spies_on_launchers_skip_the_rehearsal(device, monkeypatch):
    """tests/fast spies on launchers through helpers.real_calls: on CUDA a new call is rehearsed
    first, and the spy must count only the real call's launchers."""
    chunk = chunk_module("hla2")
    calls = []
    monkeypatch.setattr(chunk, "fwd_launch", real_calls(chunk.fwd_launch, lambda *a, **kw: calls.append(kw["chunk"])))
    args = make_args("hla2", device)
    ahead.rehearse(chunk.hla2_chunked, args, ahead.Recorder())
    assert calls == []
    chunk.hla2_chunked(*args)[0].sum().backward()
    assert len(calls) >= 1


def test_recorder_keeps_no_tensor():
    x = torch.zeros(8, dtype=torch.bfloat16)
    rec = ahead.Recorder()
    rec("kernel", (1,), x=x, y=None, n=3)
    (_, _, kw), = rec.launches
    assert isinstance(kw["x"], ahead.TensorArg) and not torch.is_tensor(kw["x"])
    assert kw["x"].dtype == torch.bfloat16 and kw["x"].data_ptr() == x.data_ptr() % 16
    assert kw["y"] is None and kw["n"] == 3
    assert ahead.TensorArg(torch.zeros(2, 3, 4)).stride() == (12, 4, 1)


def test_call_key_counts_shapes_flags_and_grads_not_identities():
    def key(*args):
        return ahead.call_key("hla2", args)

    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert key(a, 0.5, True) == key(b, 0.9, True)         # another tensor, another float value
    assert key(a, 0.5, True) != key(a, None, True)        # gamma given or not
    assert key(a, 0.5, True) != key(a, 0.5, False)        # a flag
    assert key(a) != key(torch.zeros(2, 4))               # a shape
    assert key(a) != key(a.double())                      # a dtype
    assert key(a) != key(a.clone().requires_grad_())      # requires_grad
    st1 = hla_fast.HLA3State(torch.zeros(1), torch.zeros(2), torch.zeros(2), None, None)
    st2 = hla_fast.HLA3State(torch.ones(1), torch.ones(2), torch.ones(2), None, None)
    assert key(st1) == key(st2)                           # tensors inside a state by shape
    assert key(st1) != key(st1._replace(P=torch.zeros(2).requires_grad_()))
    grad_on = key(a)
    with torch.no_grad():
        assert key(a) != grad_on                          # grad mode
    assert hash(key(st1, 0.5, None, hla_fast.ChunkConfig())) is not None


def test_compile_ahead_does_nothing_off_cuda():
    calls = []
    assert ahead.compile_ahead("hla2", lambda *a, **kw: calls.append(a), (torch.zeros(1),), torch.device("cpu")) == 0
    assert calls == []


def test_leaves_share_memory_and_mirror_requires_grad():
    a = torch.randn(3).requires_grad_()
    b = torch.randn(3)
    st = hla_fast.HLA3State(a * 2, b, b, None, None)
    found = []
    out = ahead._leaves((a, b, st, 0.5, None), found)
    assert out[0] is not a and out[0].data_ptr() == a.data_ptr() and out[0].requires_grad and out[0].is_leaf
    assert not out[1].requires_grad and out[1].data_ptr() == b.data_ptr()
    assert type(out[2]) is hla_fast.HLA3State and out[2].S.requires_grad and out[2].S.is_leaf
    assert out[3] == 0.5 and out[4] is None
    assert [x.data_ptr() for x in found] == [a.data_ptr(), st.S.data_ptr()]


def compiled_kernels(op):
    """Compiled specializations held in memory by every kernel ``op`` launches (hla3's: AHLA's and
    HLA2's, its two stages)."""
    total = 0
    for owner in ("ahla", "hla2") if op == "hla3" else (op,):
        mod = importlib.import_module(f"hla_fast.ops.{owner}.chunk_kernels")
        for name in dir(mod):
            kernel = getattr(mod, name)
            if name.endswith("_kernel"):
                jit = getattr(kernel, "fn", kernel)
                total += sum(len(caches[0]) for caches in jit.device_caches.values())
    return total


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", [dict(), dict(gates=True, normalize=True, state=True), dict(grad=False)],
                         ids=["plain", "gates-normalize-state", "no-grad"])
def test_compile_ahead_leaves_nothing_to_compile(op, case):
    if not hasattr(__import__("triton"), "AsyncCompileMode"):
        pytest.skip("this Triton has no AsyncCompileMode")
    # a length no other test uses, so that the call's kernels are new to this process
    args = make_args(op, "cuda", T=1000 + 7 * OPS.index(op), K=32, V=24, **case)
    fn = getattr(chunk_module(op), f"{op}_chunked")
    assert ahead.compile_ahead(op, fn, args, torch.device("cuda")) > 0
    before = compiled_kernels(op)
    out = fn(*args)   # seen: not rehearsed again; launches what was compiled
    if out[0].requires_grad:
        wrt = [x for x in args if torch.is_tensor(x) and x.requires_grad]
        torch.autograd.grad(out[0], wrt, torch.randn_like(out[0]), allow_unused=True)
    torch.cuda.synchronize()
    assert compiled_kernels(op) == before
    assert ahead.compile_ahead(op, fn, args, torch.device("cuda")) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [False, True])
def test_compile_ahead_covers_the_layered_backward(normalize):
    """bf16 training at K = V = 128 takes AHLA's layered backward (its walks and per-chunk kernels,
    normalized: recomputing the states and R): the rehearsal compiles every kernel the call runs."""
    if not hasattr(__import__("triton"), "AsyncCompileMode"):
        pytest.skip("this Triton has no AsyncCompileMode")
    T = 1100 + normalize
    args = list(make_args("ahla", "cuda", T=T, K=128, V=128, normalize=normalize))
    args[:3] = [x.detach().bfloat16().requires_grad_() for x in args[:3]]
    assert hla_fast.ahla_config(2, T, 2, 128, 128, torch.bfloat16, torch.device("cuda"), 16, training=True).bwd_layers
    fn = chunk_module("ahla").ahla_chunked
    assert ahead.compile_ahead("ahla", fn, tuple(args), torch.device("cuda")) > 0
    before = compiled_kernels("ahla")
    out = fn(*args)
    torch.autograd.grad(out[0], args[:3], torch.randn_like(out[0]))
    torch.cuda.synchronize()
    assert compiled_kernels("ahla") == before


class FakeKernel:
    """Stands in for a Triton kernel: records what ``warmup`` is given; fails when told to."""

    def __init__(self, fail=False):
        self.warmed, self.fail = [], fail

    def warmup(self, grid, **kwargs):
        self.warmed.append((grid, kwargs))
        if self.fail:
            raise TypeError("cannot specialize")


@pytest.fixture
def as_if_cuda(monkeypatch):
    """compile_ahead's CUDA path on a CPU: no interpreter, no graph capture, fresh memory of calls."""
    monkeypatch.setattr(ahead, "interpreter_on", lambda: False)
    monkeypatch.setattr(ahead.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ahead, "_seen", type(ahead._seen)())
    return torch.device("cuda")


def test_compile_ahead_warms_each_recorded_launch_once_per_call(as_if_cuda):
    good, bad = FakeKernel(), FakeKernel(fail=True)
    x = torch.zeros(4)

    def fn(x, n, launch):
        launch(good, (n,), x=x, n=n)
        launch(bad, (1,), x=x)
        return (x,)

    assert ahead.compile_ahead("op", fn, (x, 3), as_if_cuda) == 2
    assert len(good.warmed) == 1 and len(bad.warmed) == 1       # a failing warmup is left to the real call
    grid, kw = good.warmed[0]
    assert grid == (3,) and isinstance(kw["x"], ahead.TensorArg) and kw["n"] == 3
    assert ahead.compile_ahead("op", fn, (torch.ones(4), 3), as_if_cuda) == 0   # the same call: seen
    assert ahead.compile_ahead("op", fn, (torch.ones(5), 3), as_if_cuda) == 2   # another shape


class FakeCompiled:
    """Stands in for a compiled kernel: records the thread and device its handles were made on, and
    in ``events`` the order of launcher builds (``build``) and handle making (``init``)."""

    def __init__(self, fail=False, events=None):
        self.inits, self.fail, self.events = [], fail, events if events is not None else []
        self.src, self.metadata = object(), object()

    def _init_handles(self):
        import threading

        self.inits.append((threading.current_thread().name, current_device[0]))
        self.events.append(("init", self))
        if self.fail:
            raise RuntimeError("out of resources: shared memory")


class FakeFuture:
    def __init__(self, kernel):
        self.kernel = kernel

    def result(self, ignore_errors=False):
        return self.kernel


current_device = [None]


def test_compile_ahead_prepares_each_compiled_kernel_on_the_calls_device(as_if_cuda, monkeypatch):
    """After the compiles, each compiled kernel (once, however many launches use it) has its
    launcher built in a compile thread and dropped, then, every build done, is loaded and its
    launcher built again on the calling thread, one kernel after another, on the device of the call
    (not the thread's own current device); what either step meets is left to the real launch."""
    import contextlib
    import threading

    @contextlib.contextmanager
    def on_device(dev):
        current_device[0] = dev
        yield

    events = []

    def launcher_class(src, metadata):
        events.append(("build", threading.current_thread().name, src))
        if src is bad.src:
            raise RuntimeError("no C compiler")

    monkeypatch.setattr(ahead.torch.cuda, "device", on_device)
    monkeypatch.setattr(ahead.torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(ahead, "_launcher_class", lambda: launcher_class)
    one, bad = FakeCompiled(events=events), FakeCompiled(fail=True, events=events)

    class Returns(FakeKernel):
        def __init__(self, gives):
            super().__init__()
            self.gives = gives

        def warmup(self, grid, **kwargs):
            super().warmup(grid, **kwargs)
            return self.gives

    kernels = [Returns(FakeFuture(one)), Returns(one), Returns(FakeFuture(bad)), Returns(FakeFuture(None)),
               Returns(None), FakeKernel(fail=True)]

    def fn(x, launch):
        for kernel in kernels:
            launch(kernel, (1,), x=x)
        return (x,)

    assert ahead.compile_ahead("op", fn, (torch.zeros(2),), as_if_cuda) == len(kernels)
    assert [len(k.warmed) for k in kernels] == [1] * len(kernels)
    assert len(one.inits) == 1 and len(bad.inits) == 1   # one kernel warmed twice is prepared once
    builds = [e for e in events if e[0] == "build"]
    assert sorted(id(e[2]) for e in builds) == sorted([id(one.src), id(bad.src)])
    assert all(name.startswith("hla-compile") for _, name, _ in builds)
    assert [e[0] for e in events] == ["build", "build", "init", "init"]   # every build before any load
    (thread, dev), = one.inits
    assert thread == threading.current_thread().name and dev == torch.device("cuda", 1)
    kernels[:] = [Returns(FakeFuture(FakeCompiled()))]
    assert ahead.compile_ahead("op2", fn, (torch.zeros(2),), torch.device("cuda", 3)) == 1
    assert kernels[0].gives.kernel.inits[0][1] == torch.device("cuda", 3)
    monkeypatch.setattr(ahead, "_launcher_class", lambda: None)          # a Triton without the class
    kernels[:] = [Returns(FakeFuture(FakeCompiled()))]
    assert ahead.compile_ahead("op3", fn, (torch.zeros(2),), as_if_cuda) == 1
    assert len(kernels[0].gives.kernel.inits) == 1


# Triton 3.6 loads each kernel's launcher as a C extension module, every one named __triton_launcher.
# These tests build such modules (one name, each returning its own number) with the system's C
# compiler and load them with importlib, as Triton does.
LAUNCHER_SRC = """
#include <Python.h>
static PyObject* ident(PyObject* self, PyObject* args) { return PyLong_FromLong(%d); }
static PyMethodDef methods[] = {{"ident", ident, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "hla_test_launcher", NULL, -1, methods};
PyMODINIT_FUNC PyInit_hla_test_launcher(void) { return PyModule_Create(&def); }
"""


def launcher_modules(folder, n):
    """Paths of ``n`` extension modules, all named hla_test_launcher; the i-th's ``ident()`` is i.
    Skips where no C compiler or no Python headers are found."""
    import shutil
    import subprocess
    import sysconfig

    cc = shutil.which("cc") or shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    if cc is None or not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip("needs a C compiler and Python's headers")
    paths = []
    for i in range(n):
        d = folder / f"m{i}"
        d.mkdir()
        (d / "m.c").write_text(LAUNCHER_SRC % i)
        so = d / ("hla_test_launcher" + sysconfig.get_config_var("EXT_SUFFIX"))
        subprocess.run([cc, "-shared", "-fPIC", "-I" + include, "-o", str(so), str(d / "m.c")], check=True)
        paths.append(str(so))
    return paths


def load_module(path):
    """Load the extension module at ``path`` as Triton 3.6 loads a launcher."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hla_test_launcher", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_loading_a_launcher_module_again_hands_back_the_last_one_loaded(tmp_path):
    """Why ``_prepare_launches`` loads one launcher at a time: a second load of a file already
    loaded returns the module last loaded under the name, its functions replaced by the file's.
    A thread that reads a function off it while another thread loads again can get the other's."""
    a, b = launcher_modules(tmp_path, 2)
    first_a, first_b = load_module(a), load_module(b)
    assert (first_a.ident(), first_b.ident()) == (0, 1)
    again = load_module(a)
    assert again is first_b and again.ident() == 0 and first_b.ident() == 0   # b's module, a's function
    assert load_module(b) is first_b and first_b.ident() == 1


class ModuleKernel:
    """A compiled kernel whose launcher is a real extension module: ``_init_handles`` loads it."""

    def __init__(self, path):
        self.src, self.metadata = path, None

    def _init_handles(self):
        self.run = load_module(self.src).ident


def test_prepare_launches_gives_every_kernel_its_own_launcher(tmp_path, monkeypatch):
    """Sixteen kernels whose launchers were each loaded before (a process that has run other calls),
    prepared over sixteen threads with the interpreter switching threads every microsecond: each
    kernel ends with its own launcher, round after round."""
    import contextlib
    import sys
    from concurrent.futures import ThreadPoolExecutor

    paths = launcher_modules(tmp_path, 16)
    for p in paths:
        load_module(p)
    monkeypatch.setattr(ahead, "_launcher_class", lambda: lambda src, metadata: load_module(src).ident)
    monkeypatch.setattr(ahead.torch.cuda, "device", lambda dev: contextlib.nullcontext())
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(16) as pool:
            for _ in range(50):
                kernels = [ModuleKernel(p) for p in paths]
                ahead._prepare_launches(kernels, torch.device("cuda", 0), pool)
                assert [k.run() for k in kernels] == list(range(16))
    finally:
        sys.setswitchinterval(interval)


def test_compile_ahead_never_raises_what_the_rehearsal_meets(as_if_cuda):
    kernel = FakeKernel()

    def fn(x, launch):
        launch(kernel, (1,), x=x)
        raise ValueError("a layout the backward refuses")

    assert ahead.compile_ahead("op", fn, (torch.zeros(2),), as_if_cuda) == 1
    assert len(kernel.warmed) == 1                               # what was recorded before the error


def test_compile_ahead_steps_aside(as_if_cuda, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    import triton

    kernel = FakeKernel()

    def fn(x, launch):
        launch(kernel, (1,), x=x)
        return (x,)

    with ThreadPoolExecutor(1) as pool, triton.AsyncCompileMode(pool):   # the caller's own async compiles
        assert ahead.compile_ahead("op", fn, (torch.zeros(2),), as_if_cuda) == 0
    monkeypatch.setattr(ahead.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert ahead.compile_ahead("op", fn, (torch.zeros(3),), as_if_cuda) == 0  # a CUDA graph is captured
    monkeypatch.setattr(ahead.torch.cuda, "is_current_stream_capturing", lambda: False)
    assert ahead.compile_ahead("op", fn, (torch.zeros(3),), as_if_cuda) == 1  # not remembered while capturing
    assert len(kernel.warmed) == 1


def test_rehearsal_keeps_saved_tensors_from_the_callers_hooks(as_if_cuda):
    packed = []
    kernel = FakeKernel()

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, do):
            (x,) = ctx.saved_tensors
            return 2 * x * do

    def fn(x, launch):
        launch(kernel, (1,), x=x)
        return (Square.apply(x),)

    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        assert ahead.compile_ahead("op", fn, (x,), as_if_cuda) == 1
    assert packed == []   # the rehearsal's graph did not go through the caller's hooks
