"""Does every compiled kernel get its own launcher? Compile-ahead's launcher step, checked.

Why. Five of some 1,600 GPU test runs (two H100 machines, 2026-12-07; hla_fast/README.md, "GPU
tests") stopped at a kernel's first launch with ``TypeError: function takes exactly N arguments
(M given)``: the kernel ran with the launcher of another kernel of its call. Triton 3.6 (the version
PyTorch 2.11 pins) compiles a launcher from C for each kernel signature and loads it as a Python
extension module named ``__triton_launcher``, whatever the kernel. CPython loads a file once a
process: loading one again (a second kernel of that signature; a process that has run other calls
does it for most kernels) hands back the module last loaded under the name, its functions replaced
by the file's. The package built its launchers in its compile threads (``ops/common/compile.py``),
so two threads loading at once could each leave with the other's functions
(``tests/fast/test_compile_ahead.py::test_loading_a_launcher_module_again_hands_back_the_last_one_loaded``).
Now the threads only compile the launchers and one thread loads them (``_prepare_launches``).

What it does. For each way of preparing the launchers, in a fresh process: record the launches of
several training calls (``compile_report.record_launches``: normalized AHLA with log-gates, HLA3,
HLA2 with gates; bf16 and fp16; head sizes whose kernels share launcher signatures), compile them as
``compile_ahead`` does (``compile.compile_launches``: Triton's ``AsyncCompileMode`` over a thread
pool), prepare the launchers, and check every compiled kernel: its launcher's argument count (its
``launch`` called with none names it) against its kernel's (13 of the launcher's own and one a
parameter). Ways: ``threads``, each kernel's ``_init_handles`` in the pool's threads (the package
before the change); ``package``, ``compile._prepare_launches``. ``--switch-interval`` sets how often
the interpreter switches threads (CPython's default is 5 ms; 1 microsecond makes the interleavings the test runs
met once in hundreds of calls happen in every call).

``--stub-driver`` needs no GPU: the kernels compile for sm_90 and the launchers link a stub CUDA
driver (a few no-op functions compiled from C here), which is all the launcher step touches. Only a
Triton that builds a launcher module per kernel (3.6) has anything to check; on others every kernel
is counted as not applicable.

    python benchmarks/launcher_check.py --stub-driver --tag cpu_triton36
    python benchmarks/launcher_check.py --tag h200
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# (op, K, V, T, dtype, normalize, gates) of each training call whose launches a process compiles
CASES = [("ahla", 16, 16, 2049, "bfloat16", True, True), ("hla3", 16, 16, 40, "bfloat16", False, False),
         ("ahla", 32, 100, 2049, "bfloat16", True, True), ("hla3", 32, 100, 40, "float16", False, False),
         ("ahla", 64, 64, 2049, "float16", True, True), ("hla2", 32, 32, 257, "bfloat16", False, True),
         ("hla2", 64, 64, 257, "bfloat16", False, True)]
WAYS = ("threads", "package")
# arguments a Triton 3.6 launcher takes before the kernel's own (grid, stream, function, metadata, hooks...)
LAUNCHER_OWN = 13

# a CUDA driver that answers what Triton's launcher step and kernel loading ask, and does nothing
STUB_DRIVER_C = r"""
#include <stddef.h>
#include <stdint.h>
typedef int CUresult;
static const char* msg = "stub";
CUresult cuCtxGetCurrent(void** c) { *c = (void*)1; return 0; }
CUresult cuCtxSetCurrent(void* c) { return 0; }
CUresult cuCtxGetLimit(size_t* v, int l) { *v = 0; return 0; }
CUresult cuCtxSetLimit(int l, size_t v) { return 0; }
CUresult cuDeviceGet(int* d, int o) { *d = 0; return 0; }
CUresult cuDeviceGetAttribute(int* v, int a, int d) { *v = (a == 16) ? 132 : 232448; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)1; return 0; }
CUresult cuFuncGetAttribute(int* v, int a, void* f) { *v = (a == 0) ? 1024 : 64; return 0; }
CUresult cuFuncSetAttribute(void* f, int a, int v) { return 0; }
CUresult cuFuncSetCacheConfig(void* f, int c) { return 0; }
CUresult cuGetErrorString(CUresult e, const char** s) { *s = msg; return 0; }
CUresult cuModuleGetFunction(void** f, void* m, const char* n) { *f = (void*)2; return 0; }
CUresult cuModuleLoadData(void** m, const void* d) { *m = (void*)3; return 0; }
CUresult cuOccupancyMaxActiveClusters(int* n, void* f, void* c) { *n = 1; return 0; }
CUresult cuTensorMapEncodeTiled(void) { return 0; }
CUresult cuPointerGetAttribute(void* d, int a, uint64_t p) { return 0; }
CUresult cuPointerGetAttributes(unsigned n, int* a, void** d, uint64_t p) { return 0; }
CUresult cuLaunchKernelEx(void) { return 0; }
CUresult cuGetProcAddress(void) { return 1; }
"""


def build_stub_driver(folder: str) -> str:
    """Compile :data:`STUB_DRIVER_C` into ``folder/libcuda.so.1`` (and ``libcuda.so``); the folder."""
    src = os.path.join(folder, "stub_cuda.c")
    with open(src, "w") as f:
        f.write(STUB_DRIVER_C)
    lib = os.path.join(folder, "libcuda.so.1")
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", lib, src], check=True)
    os.symlink("libcuda.so.1", os.path.join(folder, "libcuda.so"))
    return folder


def use_stub_driver() -> None:
    """Make Triton's active driver the CUDA one with device 0 an sm_90 (the libcuda it loads is the
    stub the parent process put on ``LD_LIBRARY_PATH``), and ``torch.cuda.device`` a no-op (a CPU
    build of PyTorch has no device to switch to)."""
    import contextlib

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    driver = CudaDriver()
    # the driver asks PyTorch for the device and stream (attributes its __init__ sets): answer for it
    driver.get_current_device = lambda: 0
    driver.get_current_stream = lambda device=None: 0
    driver.get_device_capability = lambda device=0: (9, 0)
    driver.get_current_target = lambda: GPUTarget("cuda", 90, 32)
    triton.runtime.driver.set_active(driver)
    torch.cuda.device = lambda device: contextlib.nullcontext()


def launcher_count(compiled) -> int | None:
    """How many arguments ``compiled``'s launcher takes, read off the TypeError its ``launch`` raises
    when called with none; None where the launcher is no per-kernel module (nothing to check)."""
    launch = getattr(getattr(compiled, "_run", None), "launch", None)
    if launch is None or getattr(launch, "__module__", None) != "__triton_launcher":
        return None
    try:
        launch()
    except TypeError as e:
        m = re.search(r"exactly (\d+) argument", str(e))
        return int(m.group(1)) if m else None
    return None


def check_kernels(jits) -> dict:
    """Every compiled kernel in the caches of the JIT functions ``jits``: checked (its launcher a
    per-kernel module), mismatched (listed: kernel, launcher's count, its own), not applicable."""
    rows, skipped = [], 0
    for jit in jits:
        for caches in jit.device_caches.values():
            for ck in list(caches[0].values()):
                ck = ck.result() if hasattr(ck, "result") else ck
                got = launcher_count(ck) if ck is not None else None
                if got is None:
                    skipped += 1
                    continue
                rows.append({"kernel": jit.__name__, "launcher": got, "own": LAUNCHER_OWN + len(ck.src.signature)})
    bad = [r for r in rows if r["launcher"] != r["own"]]
    return {"checked": len(rows), "mismatched": len(bad), "not_applicable": skipped, "mismatches": bad}


def child(way: str, switch_interval: float, stub: bool) -> dict:
    """Compile and prepare every case's launches in this process the way ``way``; the check."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    if stub:
        use_stub_driver()
    import compile_report

    from hla_fast.ops.common import compile as ahead

    sys.setswitchinterval(switch_interval)
    jits, prepare_s = {}, 0.0
    for op, K, V, T, dtype, normalize, gates in CASES:
        _, launches = compile_report.record_launches(op, 1, T, 2, K, V, getattr(torch, dtype), gates=gates,
                                                     normalize=normalize)
        with ThreadPoolExecutor(max_workers=min(len(launches), os.cpu_count() or 1)) as pool:
            compiled = ahead.compile_launches(launches, pool)
            t0 = time.perf_counter()
            if way == "threads":
                for done in [pool.submit(ahead._prepare_launch, k) for k in compiled]:
                    done.result()
            else:
                ahead._prepare_launches(compiled, torch.device("cuda", 0), pool)
            prepare_s += time.perf_counter() - t0
        for kernel, _, _ in launches:
            jit = kernel if hasattr(kernel, "device_caches") else kernel.fn
            jits[id(jit)] = jit
    return dict(check_kernels(jits.values()), prepare_s=round(prepare_s, 3))


def combine(reports: list) -> dict:
    """One way's processes: counts and launcher-step seconds summed, mismatches listed, the first
    report of a process that did not report kept (its output's tail)."""
    done = [r for r in reports if "checked" in r]
    out = {"processes": len(reports), "reported": len(done)}
    if done:
        out.update({k: sum(r[k] for r in done) for k in ("checked", "mismatched", "not_applicable")},
                   prepare_s=round(sum(r["prepare_s"] for r in done), 3),
                   mismatches=[m for r in done for m in r["mismatches"]])
    failed = [r for r in reports if "checked" not in r]
    if failed:
        out["tail"] = failed[0]["tail"]
    return out


def _warmup_line(r: dict) -> str:
    if "checked" not in r:
        return "A first process was to fill a fresh Triton cache and did not report (below)."
    return (f"A first process filled a fresh Triton cache, compiling every kernel and launcher the package's way "
            f"(launcher step {r['prepare_s']} s; {r['checked']} kernels checked, {r['mismatched']} with another "
            "kernel's launcher); each way then ran in a process of its own on that cache, every launcher a load:")


def render_markdown(res: dict) -> str:
    lines = [f"# Launchers of compiled kernels, checked on {res['device']}", "",
             f"Date {res['date']}; torch {res['versions']['torch']}, triton {res['versions']['triton']}, python "
             f"{res['versions']['python']}; thread switch interval {res['switch_interval']} s; "
             f"{len(res['cases'])} training calls a process (`benchmarks/launcher_check.py`).", "",
             _warmup_line(res["warmup"]), "",
             "| way | processes (reported) | kernels checked | another kernel's launcher | not applicable "
             "| launcher steps (s, summed) |", "|---|---|---|---|---|---|"]
    for way, r in res["ways"].items():
        row = f"| {way} | {r['processes']} ({r['reported']}) | "
        lines.append(row + (f"{r['checked']} | {r['mismatched']} | {r['not_applicable']} | {r['prepare_s']} |"
                            if "checked" in r else "| | | |"))
    lines.append("")
    for way, r in [("warm-up", res["warmup"]), *res["ways"].items()]:
        if r.get("mismatches"):
            lines += [f"Mismatches, `{way}`: " + "; ".join(
                f"{m['kernel']} with a launcher of {m['launcher']} (its own {m['own']})" for m in r["mismatches"]), ""]
        if "tail" in r:
            lines += [f"A process of `{way}` did not report; its output's tail:", "", "```", r["tail"], "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    from records import portable, record_parser, stamp, write_record

    ap = record_parser(__doc__, "launcher_check", "h200")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    ap.add_argument("--switch-interval", type=float, default=1e-6, help="sys.setswitchinterval in each process")
    ap.add_argument("--processes", type=int, default=4, help="processes a way, one after another (counts summed)")
    ap.add_argument("--stub-driver", action="store_true", help="no GPU: a stub CUDA driver, kernels for sm_90")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds a process may take")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        from records import render_stored

        render_stored(args.render, render_markdown)
        return 0
    if args.child:
        print("LAUNCHER_CHECK_JSON " + json.dumps(child(args.child, args.switch_interval, args.stub_driver)),
              flush=True)
        return 0
    ways = args.ways.split(",")
    if not ways or any(w not in WAYS for w in ways):
        ap.error(f"--ways takes a comma-separated list of {', '.join(WAYS)}, got {args.ways!r}")
    if args.processes < 1:
        ap.error(f"--processes must be at least 1, got {args.processes}")
    if not args.switch_interval > 0:
        ap.error(f"--switch-interval must be a positive number of seconds, got {args.switch_interval}")
    import torch

    if not args.stub_driver and not torch.cuda.is_available():
        ap.error("needs CUDA, or --stub-driver: under the interpreter nothing is compiled, so no launcher is built")
    work = tempfile.mkdtemp(prefix="launcher_check_")
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(work, "cache"))   # one fresh cache for every way
    env.pop("TRITON_INTERPRET", None)
    if args.stub_driver:
        stub = build_stub_driver(work)
        env.update(TRITON_LIBCUDA_PATH=stub, LD_LIBRARY_PATH=os.pathsep.join(
            [stub] + [p for p in [env.get("LD_LIBRARY_PATH")] if p]))

    def run_child(way):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", way,
               "--switch-interval", str(args.switch_interval)] + (["--stub-driver"] if args.stub_driver else [])
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            out = run.stdout + run.stderr
        except subprocess.TimeoutExpired as e:
            out = f"timed out after {args.timeout} s\n" + str(e.stdout or "")
        line = [x for x in out.splitlines() if x.startswith("LAUNCHER_CHECK_JSON ")]
        return json.loads(line[-1].split(" ", 1)[1]) if line else {"tail": portable(out[-2000:])}

    # the first process compiles every kernel and launcher into the fresh cache (the package's way);
    # each way then runs on that cache, as processes that share one do (every launcher a load)
    warmup = run_child("package")
    results = {way: combine([run_child(way) for _ in range(args.processes)]) for way in ways}
    device = "a CPU with a stub CUDA driver (kernels for sm_90)" if args.stub_driver else torch.cuda.get_device_name()
    res = dict(stamp(device), switch_interval=args.switch_interval, cases=[list(c) for c in CASES], warmup=warmup,
               ways=results)
    os.makedirs(args.out, exist_ok=True)
    write_record(os.path.join(args.out, f"launcher_check_{args.tag}"), res, render_markdown)
    print(render_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
