"""Speed, memory, launch overhead, compile time and accuracy of hla_fast.hla2 on one GPU.

Sections (default order; ``--skip a,b`` drops some, ``--sections a,b`` runs only those):

    ceilings    bf16 matmul rate and device copy bandwidth (always measured: the roofline)
    decode      hla2_step, B=64, H=16, K=V=128: state traffic against copy bandwidth, per API call
                and replayed from a CUDA graph; also with log-gates g and with normalize=True
    main        bf16, B=4, H=16, K=V in {64, 128}, T 1k..32k: forward (no grad) and forward +
                backward medians of hla_fast with gamma, with per-token log-gates g (that require
                grad), with normalize=True (positive q, k); causal SDPA; flash-linear-attention's
                first-order chunk_linear_attn (when fla imports); hla_fast's torch backend (up to
                --torch-max-T for K > 64). FLOPs and bytes of the chunk form, TFLOP/s.
    short       T=2048, K=V=64: the whole call against SDPA (do_bench medians, and wall time per call
                of calls back to back), CUDA kernels per call (torch.profiler), host microseconds per
                call at a shape whose GPU work is small (B=1, H=16, T=1024)
    memory      K=V=128 (and 64), T=32k, B=4, H=16: peak memory of one forward + backward of
                hla_fast (default config, and save_states=False) and of fla; bytes the forward keeps
                for the backward (saved-tensor hooks)
    wide        K=V=256, T in {4k, 8k, 16k}: hla_fast against SDPA
    profile     CUDA time per hla2_* kernel of one forward + backward at T=32k (gamma, g, normalize)
    variants    the fused kernels' layouts through ``config=fused_config(...).replace(...)`` at T=32k (segments,
                chunks, warps, gradient launches, saved states); rows run only while the time budget
                leaves room for the last section
    accuracy    relative error against the float64 torch path, fp32 and bf16, T 1k..32k
    first_call  seconds of the first forward + backward of a fresh process with an empty Triton
                cache (compile included), fp32/fp16/bf16 x K=V 32/64/128 x gamma/g/normalize, of hla2 and of
                the operators --first-call-ops names (hla2,ahla,hla3 for all three), run as
                subprocesses of benchmarks/first_call.py with a timeout each, one at a time unless
                --first-call-jobs says more; overlapped with the accuracy section (which times
                nothing) unless --no-overlap

The JSON is saved after every row, the markdown after every section, so a run cut short keeps what
it measured. The ``targets`` section lists every target, met or not, with the numbers behind it.

    python benchmarks/bench_hla2.py --out benchmarks/results --tag h200      # every section (some 15 min)
    python benchmarks/bench_hla2.py --quick                                  # small sizes, GPU smoke run
    python benchmarks/bench_hla2.py --selftest                               # pure functions, no GPU
    python benchmarks/bench_hla2.py --merge a.json,b.json:decode+wide --tag ab  # runs of other sections as one
    python benchmarks/bench_hla2.py --cpu-smoke --out smoke-results           # every section on the CPU
                                                  # under the Triton interpreter, tiny shapes (no timing value)
"""
from __future__ import annotations

import sys
import os
import time

T0 = time.perf_counter()  # the time budget counts from here
if "--cpu-smoke" in sys.argv:  # must precede importing triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import concurrent.futures
import dataclasses
import datetime
import gc
import json
import math
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import traceback

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import hla_fast  # noqa: E402
from hla_fast import HLA2State  # noqa: E402
from hla_fast.ops.hla2.chunk import fused_config  # noqa: E402
from config_arg import DTYPES, OPS  # noqa: E402
from records import cpu_model, portable  # noqa: E402

SECTIONS = ("decode", "main", "short", "memory", "wide", "profile", "variants", "accuracy", "first_call")
GAMMA = 0.999
CUDA = torch.cuda.is_available() and "--cpu-smoke" not in sys.argv
DEVICE = torch.device("cuda" if CUDA else "cpu")
# targets (name -> bound), shared by targets() and the report
FLA_FWD_64, FLA_FWDBWD_64, FLA_FWD_128, FLA_FWDBWD_128 = 1.25, 1.75, 2.0, 2.5
OVERHEAD_MAX, MEMORY_MAX, DECODE_MIN, FIRST_CALL_MAX_S = 1.15, 1.5, 0.70, 15.0
TARGET_T, SHORT_T, WIDE_FROM_T = 32768, 2048, 8192


def log(msg):
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


# ----------------------------------------------------------------------------- timing helpers


def sync():
    if CUDA:
        torch.cuda.synchronize()


def bench_ms(fn, warmup=10, rep=50):
    """Median ms of fn() (triton.testing.do_bench: CUDA events, L2 flushed before each call; warmup
    and rep are milliseconds). Off CUDA (--cpu-smoke) one wall-clock call."""
    if not CUDA:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def median_ms(fn, slow_ms=200.0):
    """Median time of fn() in ms (do_bench; three CUDA-event timings when one call takes > slow_ms)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = (time.perf_counter() - t0) * 1e3
    if not CUDA:
        return once
    if once > slow_ms:
        times = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[1]
    return bench_ms(fn)


def warm_median_ms(fn):
    """``median_ms`` of fn with one whole timing thrown away first. The decode sections time their
    first step this way: a section's first timing ran slow on the H200 (114.5 us against 78-80 us
    for the steps timed after it, ``hla2_h200_decode_unwarmed.md``; AHLA 150 against 82 us,
    ``ahla_h200_decode_unwarmed.md``)."""
    median_ms(fn)
    return median_ms(fn)


def int_list(text, default):
    """The integers of a comma list such as ``--Ts 1024,2048``, or ``default`` when it is empty."""
    return [int(x) for x in text.split(",")] if text else list(default)


def graph_ms(fn, calls=10):
    """Median time (ms) of one fn() replayed from a CUDA graph holding ``calls`` of them back to
    back: the kernels' time without Python, checks or launch gaps (a decode loop captured in a graph
    runs this way). fn runs once before the capture so that nothing compiles inside it."""
    fn()
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(calls):
            fn()
    ms = bench_ms(lambda: gr.replay(), warmup=25, rep=200) / calls
    del gr
    return ms


def loop_ms(fn, n=50, reps=5):
    """Wall time per call of n calls back to back, one synchronize at the end (host and GPU work
    overlap as in a training loop); median of reps loops, ms."""
    fn()
    sync()
    out = []
    for _ in range(reps if CUDA else 1):
        t0 = time.perf_counter()
        for _ in range(n if CUDA else 1):
            fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3 / (n if CUDA else 1))
    return sorted(out)[len(out) // 2]


def host_us(fn, n=200):
    """Median microseconds of n calls from calling fn() to its return, without synchronizing: the
    host's work per call (checks, config, allocations, launches; backward() returns once autograd
    has queued its kernels). The GPU is drained every 16 calls, outside the timed part, so the
    launch queue never fills and blocks a call."""
    fn()
    sync()
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        if i % 16 == 15:
            sync()
    sync()
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------- counts


def hla2_flops(B, H, T, K, V, C=64):
    """Multiply-adds x 2 of the chunk form (forward) with chunks of C rows, per the kernel's products
    (the carry's three products since the walk forms W's update as P diag(gl) V; records before
    2026-12-02 05:00 UTC counted its earlier four: Q^T Vg, S (Q^T Vg), Ym Vg, Kg^T (Ym Vg))."""
    NT = math.ceil(T / C)
    per_chunk = (
        C * C * K * 2          # X = Q K^T and Y = K Q^T
        + C * K * K            # Q S0
        + C * C * K            # (Q S0) Q^T
        + C * C * C            # A Ym
        + C * K * V            # Q W0
        + C * C * V            # M V
        + K * K * C            # S Q^T      (the carry: W <- gC^2 W + P Vg, P = gC S Q^T + Kg^T Ym)
        + K * C * C            # Kg^T Ym
        + K * C * V            # P Vg
        + C * K * K            # Kg^T K
    )
    return 2.0 * B * H * NT * per_chunk


def hla2_bytes(B, H, T, K, V, elt=2):
    """Fewest bytes: q, k, v read once, o written once (states stay on chip)."""
    return B * T * H * (2 * K + 2 * V) * elt


def decode_state_bytes(B, H, K, V, normalize=False):
    """fp32 state read and written by one decode step: S, W (and z)."""
    return 2 * B * H * (K * K + K * V + (K if normalize else 0)) * 4


# ----------------------------------------------------------------------------- inputs and candidates


def make_inputs(B, T, H, K, V, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = (torch.randn(B, T, H, K, device=DEVICE, generator=g) * 0.3).to(dtype)
    k = (torch.randn(B, T, H, K, device=DEVICE, generator=g) * 0.3).to(dtype)
    v = torch.randn(B, T, H, V, device=DEVICE, generator=g).to(dtype)
    return q, k, v


def make_gates(B, T, H, seed=0):
    """Per-token log-gates in [-0.001, 0): a factor in (0.999, 1] per token, fp32."""
    g = torch.Generator(device=DEVICE).manual_seed(seed + 7)
    return -0.001 * torch.rand(B, T, H, device=DEVICE, generator=g)


def fwd_bwd(fn, inputs, do):
    """A closure running fn(*leaves).backward(do); every input is a leaf that requires grad."""
    leaves = [x.detach().requires_grad_() for x in inputs]

    def run():
        for x in leaves:
            x.grad = None
        fn(*leaves).backward(do)

    return run


def fwd_only(fn, inputs):
    def run():
        with torch.no_grad():
            fn(*inputs)

    return run


def hla(q, k, v, config=None):
    """hla_fast's default path, the way a layer calls it."""
    return hla_fast.hla2(q, k, v, gamma=GAMMA, backend="triton", config=config)[0]


def hla_g(q, k, v, g, config=None):
    return hla_fast.hla2(q, k, v, g=g, backend="triton", config=config)[0]


def hla_norm(q, k, v, config=None):
    return hla_fast.hla2(q, k, v, gamma=GAMMA, normalize=True, backend="triton", config=config)[0]


def hla_torch(q, k, v):
    return hla_fast.hla2(q, k, v, gamma=GAMMA, backend="torch")[0]


def sdpa(q, k, v):
    """Causal softmax attention on the same [B, T, H, D] tensors."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


def load_fla():
    try:
        import fla
        from fla.ops.linear_attn import chunk_linear_attn

        return chunk_linear_attn, getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        return None, f"import failed: {type(e).__name__}: {e}"


def hla_candidates(q, k, v, g):
    """hla_fast with gamma, with log-gates g and normalized (positive q, k): name -> (fn, inputs)."""
    return {"hla_fast": (hla, (q, k, v)),
            "hla_fast_g": (hla_g, (q, k, v, g)),
            "hla_fast_norm": (hla_norm, (q.abs(), k.abs(), v))}


def time_candidates(row, cands, do):
    """Median forward (no grad) and forward+backward ms of each candidate into row; errors are recorded."""
    for name, (fn, inputs) in cands.items():
        try:
            row[f"{name}_fwd_ms"] = median_ms(fwd_only(fn, inputs))
            row[f"{name}_fwdbwd_ms"] = median_ms(fwd_bwd(fn, inputs, do))
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {portable(str(e))[:300]}"
        free()


def free():
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def add_ratios(row):
    """Overheads of g against gamma and of normalize against the plain call, in place."""
    for s in ("fwd", "fwdbwd"):
        base = row.get(f"hla_fast_{s}_ms")
        for name, key in (("hla_fast_g", "g_over_gamma"), ("hla_fast_norm", "norm_over_plain")):
            x = row.get(f"{name}_{s}_ms")
            if isinstance(x, float) and isinstance(base, float) and base > 0:
                row[f"{key}_{s}"] = x / base


def count_kernels(fn):
    """CUDA activity of one call of fn (torch.profiler, after a warm-up call): kernels, hla2_* kernels,
    memsets and memcpys, and the kernel names with their counts."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=acts) as prof:
        fn()
        sync()
    names = {}
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            names[e.name] = names.get(e.name, 0) + 1
    mem = {n: c for n, c in names.items() if n.startswith(("Memset", "Memcpy"))}
    kern = {n: c for n, c in names.items() if n not in mem}
    return {"kernels": sum(kern.values()), "hla2_kernels": sum(c for n, c in kern.items() if "hla2_" in n),
            "memsets_memcpys": sum(mem.values()), "by_name": dict(sorted(kern.items(), key=lambda kv: -kv[1]))}


def train_memory(fn, inputs, do):
    """Memory of one forward + backward of fn on leaves that require grad.

    peak_mb: torch.cuda.max_memory_allocated during the call (reset before), less whatever was
    allocated before apart from this call's inputs and output gradient: the inputs, do, the
    forward's buffers, the saved tensors, the backward's buffers and the gradients at their high
    point. saved_mb: the distinct storages the forward hands to autograd (saved_tensors_hooks),
    saved_extra_mb the part of it that is not an input. after_fwd_mb: allocated after the forward
    beyond the inputs (output + what is kept for the backward)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    in_bytes = sum(x.nbytes for x in leaves) + do.nbytes
    in_ptrs = {x.untyped_storage().data_ptr() for x in leaves}
    free()
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    out = {"inputs_mb": in_bytes / 1e6}
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = fn(*leaves)
    sync()
    if CUDA:
        out["after_fwd_mb"] = (torch.cuda.memory_allocated() - base) / 1e6
        out["peak_fwd_mb"] = (torch.cuda.max_memory_allocated() - base + in_bytes) / 1e6
    out["saved_mb"] = sum(saved.values()) / 1e6
    out["saved_extra_mb"] = sum(b for p, b in saved.items() if p not in in_ptrs) / 1e6
    out["output_mb"] = o.nbytes / 1e6
    o.backward(do)
    sync()
    if CUDA:
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base + in_bytes) / 1e6
    del o, leaves
    free()
    return out


# ----------------------------------------------------------------------------- first call (subprocesses)


FIRST_CALL_FLAGS = ("gamma", "g", "normalize")
FIRST_CALL_DTYPES = tuple(DTYPES)   # fp32, fp16, bf16: the slowest compiles start first


def first_call_variants(dims=(32, 64, 128), dtypes=FIRST_CALL_DTYPES, flags=FIRST_CALL_FLAGS, ops=("hla2",)):
    """Every (op, dtype, K=V, flag), fp32 and fp16 first: they compile slowest, so they start first."""
    dtypes = sorted(dtypes, key=FIRST_CALL_DTYPES.index)
    return [{"op": op, "dtype": dt, "K": d, "flag": f} for dt in dtypes for op in ops for d in sorted(dims, reverse=True)
            for f in flags]


def first_call_op(row) -> str:
    """The operator a first-call row timed (rows recorded before first_call.py took --op: hla2)."""
    return row.get("op", "hla2")


def run_first_call(var, shape, timeout_s, env_extra=None):
    """Run benchmarks/first_call.py for one variant in a fresh process with an empty TRITON_CACHE_DIR;
    returns its result row (status "ok", "timeout" or "error")."""
    cache = tempfile.mkdtemp(prefix="first_call_")
    env = dict(os.environ)
    env.update(env_extra or {})
    env["TRITON_CACHE_DIR"] = cache
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "first_call.py"), "--op", first_call_op(var),
           "--dtype", var["dtype"],
           "--dim", str(var["K"]), "--flag", var["flag"], "--B", str(shape["B"]), "--T", str(shape["T"]),
           "--H", str(shape["H"])]
    row = dict(var, V=var["K"], **shape, timeout_s=round(timeout_s, 1))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        row["wall_s"] = time.perf_counter() - t0
        line = next((ln for ln in out.splitlines()[::-1] if ln.startswith("FIRST_CALL_JSON ")), None)
        if proc.returncode == 0 and line:
            row.update(json.loads(line[len("FIRST_CALL_JSON "):]))
            row["status"] = "ok"
        else:
            row["status"] = "error"
            row["error"] = f"rc={proc.returncode}: " + portable(err or out)[-600:]
    except subprocess.TimeoutExpired:
        try:  # the child and anything it started (compilers): its own session
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        row["wall_s"] = time.perf_counter() - t0
        row["status"] = "timeout"
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return row


class FirstCallPool:
    """The first_call variants on a pool of `jobs` parallel subprocesses, each with a timeout that
    also keeps the section inside `deadline` (perf_counter time); rows go to `record` as they end."""

    def __init__(self, variants, shape, jobs, timeout_s, deadline, record, env_extra=None, min_timeout_s=30.0):
        self.record = record
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
        self.futures = []

        def one(var):
            left = deadline - time.perf_counter()
            if left <= 0:
                row = dict(var, V=var["K"], **shape, status="not run: time budget spent")
            else:
                row = run_first_call(var, shape, min(timeout_s, max(min_timeout_s, left)), env_extra)
            record(row)
            return row

        for var in variants:
            self.futures.append(self.pool.submit(one, var))

    def join(self):
        rows = []
        for f in self.futures:
            try:
                rows.append(f.result())
            except Exception as e:  # noqa: BLE001
                rows.append({"status": "error", "error": f"{type(e).__name__}: {portable(str(e))}"})
        self.pool.shutdown()
        return rows


# ----------------------------------------------------------------------------- targets and report


def _fmt(x, nd=3):
    if isinstance(x, bool) or x is None:
        return "-" if x is None else str(x)
    if isinstance(x, float):
        if x != 0 and (abs(x) < 10 ** -nd or abs(x) >= 1e6):
            return f"{x:.2e}"
        return f"{x:.{nd}f}"
    return str(x)


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def _target(desc, goal, met, **numbers):
    return {"target": desc, "goal": goal, "met": met, **numbers}


def targets(res):
    """Every target, met (True), not met (False) or not measured (None), with the numbers behind it."""
    t = {}
    main = res.get("main") or []
    rows = {(r["K"], r["T"]): r for r in main}
    Tt = TARGET_T if any(T == TARGET_T for _, T in rows) else max((T for _, T in rows), default=None)
    peak = (res.get("ceilings") or {}).get("bf16_matmul_tflops")
    for K, bf, bb in ((64, FLA_FWD_64, FLA_FWDBWD_64), (128, FLA_FWD_128, FLA_FWDBWD_128)):
        r = rows.get((K, Tt), {})
        for s, bound in (("fwd", bf), ("fwdbwd", bb)):
            ratio = _ratio(r.get(f"hla_fast_{s}_ms"), r.get(f"fla_linear_attn_{s}_ms"))
            extra = {}
            if s == "fwd" and r.get("hla_fast_fwd_tflops"):
                extra = {"tflops": r["hla_fast_fwd_tflops"],
                         "fraction_of_matmul": _ratio(r["hla_fast_fwd_tflops"], peak)}
            t[f"{s}_vs_fla_k{K}"] = _target(
                f"{'fwd' if s == 'fwd' else 'fwd+bwd'} <= {bound}x fla chunk_linear_attn, K=V={K}, T={Tt}",
                f"<= {bound}", None if ratio is None else ratio <= bound, ratio=ratio,
                hla_fast_ms=r.get(f"hla_fast_{s}_ms"), fla_ms=r.get(f"fla_linear_attn_{s}_ms"), **extra)
    wide = [w for w in res.get("wide") or [] if w["T"] >= WIDE_FROM_T]
    by_T = {w["T"]: {"hla_fast_ms": w.get("hla_fast_fwdbwd_ms"), "sdpa_ms": w.get("sdpa_fwdbwd_ms"),
                     "ratio": _ratio(w.get("hla_fast_fwdbwd_ms"), w.get("sdpa_fwdbwd_ms"))} for w in wide}
    met = None if not by_T or any(v["ratio"] is None for v in by_T.values()) else all(
        v["ratio"] < 1 for v in by_T.values())
    t["wide_k256_fwdbwd_beats_sdpa"] = _target(f"K=V=256 fwd+bwd faster than SDPA from T={WIDE_FROM_T}", "< 1x SDPA",
                                               met, by_T=by_T)
    sh = (res.get("short") or [None])[0] or {}
    parts = {}
    for s in ("fwd", "fwdbwd"):
        parts[s] = {"hla_fast_loop_ms": sh.get(f"hla_fast_{s}_loop_ms"), "sdpa_loop_ms": sh.get(f"sdpa_{s}_loop_ms"),
                    "ratio": _ratio(sh.get(f"hla_fast_{s}_loop_ms"), sh.get(f"sdpa_{s}_loop_ms")),
                    "hla_fast_median_ms": sh.get(f"hla_fast_{s}_ms"), "sdpa_median_ms": sh.get(f"sdpa_{s}_ms")}
    met = None if any(p["ratio"] is None for p in parts.values()) else all(p["ratio"] < 1 for p in parts.values())
    t["short_beats_sdpa"] = _target(
        f"T={sh.get('T', SHORT_T)}, K=V=64: the whole call faster than causal SDPA, fwd and fwd+bwd "
        "(wall time per call, calls back to back)", "< 1x SDPA", met, **parts)
    for key, name, desc in (("norm_over_plain", "normalize_overhead", "normalize=True <= 1.15x unnormalized"),
                            ("g_over_gamma", "g_overhead", "log-gates g <= 1.15x constant gamma")):
        vals = {f"K{K}_{s}": rows.get((K, Tt), {}).get(f"{key}_{s}") for K in (64, 128) for s in ("fwd", "fwdbwd")}
        got = [v for v in vals.values() if v is not None]
        # one ratio over the bound settles it; all within it only once every ratio is measured
        met = False if any(v > OVERHEAD_MAX for v in got) else (None if len(got) < len(vals) else True)
        t[name] = _target(f"{desc} (T={Tt}, fwd and fwd+bwd)", f"<= {OVERHEAD_MAX}", met, **vals)
    mem = {m["K"]: m for m in res.get("memory") or []}
    m = mem.get(128, {})
    hp = (m.get("hla_fast") or {}).get("peak_mb")
    hp2 = (m.get("hla_fast_no_saved_states") or {}).get("peak_mb")
    fp = (m.get("fla_linear_attn") or {}).get("peak_mb")
    ratio = _ratio(hp, fp)
    t["memory_vs_fla_k128"] = _target(
        f"training peak memory <= {MEMORY_MAX}x fla, K=V=128, T={m.get('T', TARGET_T)}, B=4, H=16, bf16",
        f"<= {MEMORY_MAX}", None if ratio is None else ratio <= MEMORY_MAX, ratio=ratio, hla_fast_peak_mb=hp,
        fla_peak_mb=fp, no_saved_states_peak_mb=hp2, no_saved_states_ratio=_ratio(hp2, fp))
    d = res.get("decode") or {}
    fr = d.get("fraction_of_copy")
    t["decode_fraction_of_copy"] = _target(
        f"decode B={d.get('B', 64)}, H={d.get('H', 16)}, K=V={d.get('K', 128)}: state traffic >= "
        f"{int(DECODE_MIN * 100)}% of copy bandwidth", f">= {DECODE_MIN}", None if fr is None else fr >= DECODE_MIN,
        fraction_of_copy=fr, graph_fraction_of_copy=d.get("graph_fraction_of_copy"))
    fc = res.get("first_call") or []
    # keyed dtype_K_flag, with the op in front for another operator's rows (hla2's keys as they were)
    secs = {("" if first_call_op(r) == "hla2" else f"{first_call_op(r)}_") + f"{r['dtype']}_K{r['K']}_{r['flag']}":
            (r.get("fwdbwd_s") if r.get("status") == "ok" else r.get("status")) for r in fc if "dtype" in r}
    ok = [v for v in secs.values() if isinstance(v, float)]
    if not secs:
        met = None
    elif len(ok) < len(secs):
        met = False if any(r.get("status") == "timeout" for r in fc) or any(v > FIRST_CALL_MAX_S for v in ok) else None
    else:
        met = all(v < FIRST_CALL_MAX_S for v in ok)
    t["first_call_under_15s"] = _target(
        f"every first fwd+bwd call of a fresh process (compile included) < {FIRST_CALL_MAX_S:.0f} s",
        f"< {FIRST_CALL_MAX_S}", met, worst_s=max(ok) if ok else None, seconds=secs)
    r = rows.get((64, Tt), {})
    sp = {s: _ratio(r.get(f"torch_backend_{s}_ms"), r.get(f"hla_fast_{s}_ms")) for s in ("fwd", "fwdbwd")}
    t["speedup_vs_torch_backend"] = _target(f">= 10x the torch backend, K=V=64, T={Tt}",
                                            ">= 10", None if None in sp.values() else all(x >= 10 for x in sp.values()),
                                            **sp)
    return t


def _rounded(x):
    """Floats to 4 significant digits, inside dicts and lists (for the markdown)."""
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k_: _rounded(v_) for k_, v_ in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v_) for v_ in x]
    return x


def _met(v):
    return {True: "met", False: "NOT met", None: "not measured"}[v]


def render_markdown(res):
    """The markdown report of a result dict (any section may be missing)."""
    v = res.get("versions", {})
    c = res.get("ceilings") or {}
    lines = [f"# HLA2 benchmark ({res.get('device')}, {res.get('date')})", "",
             f"torch {v.get('torch')}, triton {v.get('triton')}, flash-linear-attention "
             f"{v.get('flash-linear-attention')}; bf16 unless stated, median ms (triton.testing.do_bench), "
             f"gamma = {GAMMA}, log-gates g in [-0.001, 0) that require grad.", ""]
    if c:
        lines += [f"Ceilings: bf16 matmul {c.get('bf16_matmul_tflops', 0):.0f} TFLOP/s, "
                  f"copy {c.get('copy_gbs', 0):.0f} GB/s.", ""]
    if res.get("merged_from"):
        lines += ["Merged from runs on this device (each section and its baselines from one "
                  "process; the ceilings above from the run of `main`):", ""]
        for m in res["merged_from"]:
            mc = m.get("ceilings") or {}
            lines.append(f"- `{m['record']}` ({m.get('date')}): {', '.join(m['sections'])}; ceilings "
                         f"{mc.get('bf16_matmul_tflops', 0):.0f} TFLOP/s, {mc.get('copy_gbs', 0):.0f} GB/s")
        lines.append("")
        if res.get("merge_note"):
            lines += [res["merge_note"], ""]
    t = res.get("targets") or targets(res)
    if t:
        lines += ["## Targets", "", "| target | goal | result | numbers |", "|---|---|---|---|"]
        for name, x in t.items():
            nums = {k_: v_ for k_, v_ in x.items() if k_ not in ("target", "goal", "met")}
            lines.append(f"| {x['target']} | {x['goal']} | {_met(x['met'])} | "
                         f"`{json.dumps(_rounded(nums), default=str, separators=(', ', ': '), allow_nan=True)}` |")
        lines.append("")
    if res.get("main"):
        cols = ["hla_fast", "fla_linear_attn", "sdpa", "torch_backend"]
        lines += ["## Main table (B={B}, H={H})".format(**res.get("shapes", {"B": "?", "H": "?"})), "",
                  "| K=V | T | " + " | ".join(f"{c} fwd | {c} fwd+bwd" for c in cols) + " | hla_fast TFLOP/s |",
                  "|" + "---|" * (3 + 2 * len(cols))]
        for r in res["main"]:
            cells = [_fmt(r.get(f"{c}_{s}_ms")) for c in cols for s in ("fwd", "fwdbwd")]
            lines.append(f"| {r['K']} | {r['T']} | " + " | ".join(cells) + f" | {_fmt(r.get('hla_fast_fwd_tflops'), 0)} |")
        lines += ["", "Gates and normalization (ms; ratios against the gamma call):", "",
                  "| K=V | T | gamma fwd | g fwd | normalize fwd | gamma fwd+bwd | g fwd+bwd | normalize fwd+bwd "
                  "| g/gamma fwd | g/gamma fwd+bwd | norm/plain fwd | norm/plain fwd+bwd |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["main"]:
            cells = [r.get(k_) for k_ in ("hla_fast_fwd_ms", "hla_fast_g_fwd_ms", "hla_fast_norm_fwd_ms",
                                          "hla_fast_fwdbwd_ms", "hla_fast_g_fwdbwd_ms", "hla_fast_norm_fwdbwd_ms",
                                          "g_over_gamma_fwd", "g_over_gamma_fwdbwd", "norm_over_plain_fwd",
                                          "norm_over_plain_fwdbwd")]
            lines.append(f"| {r['K']} | {r['T']} | " + " | ".join(_fmt(x) for x in cells) + " |")
        errs = [(r["K"], r["T"], k_, v_) for r in res["main"] for k_, v_ in r.items() if k_.endswith("_error")]
        if errs:
            lines += [""] + [f"- error K={K} T={T} {k_}: {v_}" for K, T, k_, v_ in errs]
        lines.append("")
    for sh in res.get("short") or []:
        lines += [f"## Short sequences (T={sh['T']}, K=V={sh['K']}, B={sh['B']}, H={sh['H']})", "",
                  "median: do_bench median of one call (CUDA events; host gaps inside the call count). "
                  "loop: wall time per call of calls back to back, one synchronize at the end.", "",
                  "| call | fwd median | fwd loop | fwd+bwd median | fwd+bwd loop | kernels fwd | kernels fwd+bwd |",
                  "|---|---|---|---|---|---|---|"]
        la = sh.get("launches", {})
        for n in ("hla_fast", "hla_fast_g", "hla_fast_norm", "sdpa", "fla_linear_attn"):
            if not any(k_.startswith(n + "_f") for k_ in sh):
                continue
            lines.append(f"| {n} | {_fmt(sh.get(f'{n}_fwd_ms'))} | {_fmt(sh.get(f'{n}_fwd_loop_ms'))} | "
                         f"{_fmt(sh.get(f'{n}_fwdbwd_ms'))} | {_fmt(sh.get(f'{n}_fwdbwd_loop_ms'))} | "
                         f"{(la.get(f'{n}_fwd') or {}).get('kernels', '-')} | "
                         f"{(la.get(f'{n}_fwdbwd') or {}).get('kernels', '-')} |")
        h = sh.get("host") or {}
        if h:
            lines += ["", f"Host time per call at B={h.get('B')}, H={h.get('H')}, T={h.get('T')}, K=V={h.get('K')} "
                          "(GPU work of a call small against its host work). host: median us from the call to its "
                          "return, no synchronize (the host's own work); loop: wall us per call back to back.", "",
                      "| call | fwd host us | fwd loop us | fwd+bwd host us | fwd+bwd loop us |", "|---|---|---|---|---|"]
            for n, x in h.items():
                if isinstance(x, dict):
                    lines.append(f"| {n} | {_fmt(x.get('fwd_host_us'), 1)} | {_fmt(x.get('fwd_loop_us'), 1)} | "
                                 f"{_fmt(x.get('fwdbwd_host_us'), 1)} | {_fmt(x.get('fwdbwd_loop_us'), 1)} |")
        if la:
            lines += ["", "Kernels of one call (torch.profiler CUDA kernel events; memsets/memcpys apart):", ""]
            for n, x in la.items():
                if isinstance(x, dict):
                    lines.append(f"- {n}: {x.get('kernels')} kernels ({x.get('hla2_kernels')} hla2_*), "
                                 f"{x.get('memsets_memcpys')} memset/memcpy: "
                                 + ", ".join(f"{k_} x{c_}" for k_, c_ in (x.get("by_name") or {}).items()))
        lines.append("")
    if res.get("memory"):
        lines += ["## Training memory (one forward + backward, MB)", "",
                  "peak: max_memory_allocated during the call (reset before) including the inputs and do; "
                  "saved: storages the forward hands to autograd (saved_tensors_hooks), extra: of those, not inputs.",
                  "", "| K=V | T | call | peak | peak fwd | after fwd | saved | saved extra | inputs | peak / fla |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for m in res["memory"]:
            fp = (m.get("fla_linear_attn") or {}).get("peak_mb")
            for n in ("hla_fast", "hla_fast_one_piece", "hla_fast_no_saved_states", "hla_fast_norm", "fla_linear_attn"):
                x = m.get(n)
                if not isinstance(x, dict):
                    continue
                lines.append(f"| {m['K']} | {m['T']} | {n} | {_fmt(x.get('peak_mb'), 0)} | {_fmt(x.get('peak_fwd_mb'), 0)} | "
                             f"{_fmt(x.get('after_fwd_mb'), 0)} | {_fmt(x.get('saved_mb'), 0)} | "
                             f"{_fmt(x.get('saved_extra_mb'), 0)} | {_fmt(x.get('inputs_mb'), 0)} | "
                             f"{_fmt(_ratio(x.get('peak_mb'), fp), 2)} |")
        lines.append("")
    if res.get("wide"):
        lines += ["## Wide heads, K = V = 256 (median ms)", "",
                  "| T | hla_fast fwd | hla_fast fwd+bwd | sdpa fwd | sdpa fwd+bwd | fwd+bwd / sdpa |",
                  "|---|---|---|---|---|---|"]
        for r in res["wide"]:
            cells = [r.get(f"{c}_{s}_ms") for c in ("hla_fast", "sdpa") for s in ("fwd", "fwdbwd")]
            lines.append(f"| {r['T']} | " + " | ".join(_fmt(x) for x in cells)
                         + f" | {_fmt(_ratio(r.get('hla_fast_fwdbwd_ms'), r.get('sdpa_fwdbwd_ms')), 2)} |")
        lines.append("")
    if res.get("decode"):
        d = res["decode"]
        lines += ["## Decode", "", f"B={d['B']} H={d['H']} K=V={d['K']}: {d['ms'] * 1e3:.1f} us, {d['gbs']:.0f} GB/s of "
                  f"state traffic = {100 * d['fraction_of_copy']:.0f}% of copy bandwidth "
                  f"(torch step {_fmt(d.get('torch_ms', 0) * 1e3, 1)} us)."]
        if "graph_ms" in d:
            lines[-1] += (f" Replayed from a CUDA graph: {d['graph_ms'] * 1e3:.1f} us "
                          f"= {100 * d['graph_fraction_of_copy']:.0f}%.")
        for n in ("g", "norm"):
            if f"{n}_ms" in d:
                lines[-1] += (f" With {'log-gates g' if n == 'g' else 'normalize=True'}: {d[f'{n}_ms'] * 1e3:.1f} us "
                              f"= {100 * d[f'{n}_fraction_of_copy']:.0f}%.")
        lines.append("")
    if res.get("profile"):
        lines += ["## CUDA time per kernel, one forward + backward through `hla2()` (torch.profiler, ms)", "",
                  "| K=V | T | call | kernel | ms | calls |", "|---|---|---|---|---|---|"]
        for r in res["profile"]:
            for name, x in sorted(r["kernels"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
                lines.append(f"| {r['K']} | {r['T']} | {r.get('call', 'hla_fast')} | {name} | "
                             f"{x['ms_per_step']:.3f} | {x['calls_per_step']:.0f} |")
        lines.append("")
    if res.get("variants"):
        lines += ["## Layouts (`config=fused_config(...).replace(...)`, through `hla2()`, gamma, median ms)", "",
                  "| K=V | T | pass | change | ms | against default |", "|---|---|---|---|---|---|"]
        base = {(r["K"], r["pass"]): r.get("ms") for r in res["variants"] if r.get("change") == "default"}
        for r in res["variants"]:
            ms = r.get("ms")
            lines.append(f"| {r['K']} | {r['T']} | {r['pass']} | {r['change']} | "
                         f"{_fmt(ms) if ms is not None else r.get('error', r.get('status', '-'))[:120]} | "
                         f"{_fmt(_ratio(ms, base.get((r['K'], r['pass']))), 2)} |")
        cfgs = res.get("variant_defaults") or {}
        for K, cfg in cfgs.items():
            lines.append(f"\nDefault config at K=V={K}: `{json.dumps(cfg)}`")
        lines.append("")
    if res.get("accuracy"):
        lines += ["## Accuracy against the float64 torch path", "", "| T | rel. err fp32 | rel. err bf16 |", "|---|---|---|"]
        for r in res["accuracy"]:
            lines.append(f"| {r['T']} | {r['fp32']:.1e} | {r['bf16']:.1e} |")
        lines.append("")
    if res.get("first_call"):
        fc = res["first_call"]
        info = res.get("first_call_setup", {})
        host = f" ({info['cpu_model']})" if info.get("cpu_model") else ""   # recorded since 2026-12-06
        lines += ["## First call of a fresh process (compile included, s)", "",
                  f"{info.get('jobs', '?')} subprocesses at a time on {info.get('cpus', '?')} CPUs{host} (compiles "
                  f"share the CPUs), empty TRITON_CACHE_DIR each, timeout {info.get('timeout_s', '?')} s, shape "
                  f"B={info.get('B')}, T={info.get('T')}, H={info.get('H')}.", ""]
        # records since first_call.py timed PyTorch's first-backward setup apart from the call
        autograd = any("autograd_s" in r for r in fc)
        if autograd:
            lines += ["Not counted in the first call: importing torch and hla_fast (import) and PyTorch's one-time "
                      "setup of a first backward given an output gradient (autograd; first_call.py's docstring).", ""]
        ops = any(first_call_op(r) != "hla2" for r in fc)   # an op column where not every row is hla2's
        heads = ["op"] if ops else []
        heads += ["dtype", "K=V", "flag", "status", "fwd", "bwd", "fwd+bwd", "warm fwd+bwd", "cubins", "import"]
        heads += ["autograd"] if autograd else []
        lines += ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        order = lambda r: (OPS.index(first_call_op(r)), r["dtype"], r["K"], r["flag"])  # noqa: E731
        named = lambda r: (f"{first_call_op(r)} " if ops else "") + f"{r.get('dtype')} K={r.get('K')} {r.get('flag')}"  # noqa: E731
        for r in sorted((r for r in fc if "dtype" in r), key=order):
            cells = [first_call_op(r)] if ops else []
            cells += [r["dtype"], r["K"], r["flag"], r.get("status"), _fmt(r.get("fwd_s"), 1), _fmt(r.get("bwd_s"), 1),
                      _fmt(r.get("fwdbwd_s"), 1), _fmt(r.get("warm_fwdbwd_s"), 3), r.get("cubins", "-"),
                      _fmt(r.get("import_s"), 1)]
            cells += [_fmt(r.get("autograd_s"), 1)] if autograd else []
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        errs = [r for r in fc if r.get("status") == "error"]
        if errs:
            lines += [""] + [f"- error {named(r)}: {str(r.get('error', ''))[-300:]!r}" for r in errs]
        logged = sorted((r for r in fc if r.get("compiles")), key=order)
        if logged:
            lines += ["", "Compiles of each first call (Triton's compilation listener; they run in parallel threads, "
                          "so the call waits for the slowest): the slowest with its stages (s), and when the last "
                          "one ended, seconds into the call:", ""]
            for r in logged:
                cs = r["compiles"]
                top = max(cs, key=lambda c: c["s"])
                stages = ", ".join(f"{k_} {v_:.1f}" for k_, v_ in top["stages"].items())
                lines.append(f"- {named(r)}: {len(cs)} compiles ({sum(c['s'] for c in cs):.1f} s "
                             f"in all), slowest `{top['kernel']}` {top['s']:.1f} s ({stages}); the last ended at "
                             f"{max(c['end_s'] for c in cs):.1f} s (forward {_fmt(r.get('fwd_s'), 1)} s)")
        lines.append("")
    if res.get("timing"):
        lines += ["## Run time per section (s)", "", ", ".join(f"{k_} {v_:.0f}" for k_, v_ in res["timing"].items()), ""]
    if res.get("errors"):
        lines += ["## Section errors", ""] + [f"- {k_}: `{v_.strip().splitlines()[-1]}`" for k_, v_ in res["errors"].items()]
        lines.append("")
    if res.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def write_report(res, out, tag, show=True):
    """Compute the targets, write the JSON and the markdown; returns the markdown."""
    res["targets"] = targets(res)
    with open(os.path.join(out, f"hla2_{tag}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    md = render_markdown(res)
    with open(os.path.join(out, f"hla2_{tag}.md"), "w") as f:
        f.write(md)
    if show:
        print(md, flush=True)
    return md


# what each section writes into a record beside its timing (``shapes``: the main table's sizes)
SECTION_KEYS = {"decode": ("decode",), "main": ("main", "shapes"), "short": ("short",), "memory": ("memory",),
                "wide": ("wide",), "profile": ("profile", "profile_status"),
                "variants": ("variants", "variant_defaults"), "accuracy": ("accuracy",),
                "first_call": ("first_call", "first_call_setup")}


def merge_records(records, note=None):
    """One record from ``records`` = [(name, result dict, sections or None)]: runs on one device
    that each timed other sections (a run has a section when its ``timing`` names
    it; ``sections`` takes only those of a run), so that every target lands in one results file
    when the sections were timed in separate processes (each run shorter). Each target still
    compares numbers of one process (a section's rows and their baselines come from the run that
    timed the section). The ceilings are those of the run that timed ``main`` (its TFLOP/s
    fractions), else the first run's; ``merged_from`` keeps each run's name, date, the sections
    taken, ceilings and arguments; ``note`` (``merge_note``, shown under that list) says which code
    each run measured where they differ.

    Raises ValueError naming the records when two give the same section, a run is asked for a
    section it did not time, or their devices or versions differ (numbers of different machines or
    installs do not belong in one record)."""
    if len(records) < 2:
        raise ValueError(f"--merge takes two or more records, got {len(records)}")
    first = records[0][1]
    owner, taken = {}, {}
    for name, r, only in records:
        for field in ("device", "versions"):
            if r.get(field) != first.get(field):
                raise ValueError(f"records {records[0][0]} and {name} differ in {field}: "
                                 f"{first.get(field)!r} against {r.get(field)!r}")
        timed = [s for s in (r.get("timing") or {}) if s != "total"]
        missing = sorted(set(only or ()) - set(timed))
        if missing:
            raise ValueError(f"record {name} did not time {', '.join(missing)} (it timed {', '.join(timed)})")
        taken[name] = [s for s in timed if only is None or s in only]
        for sec in taken[name]:
            if sec in owner:
                raise ValueError(f"section {sec} was timed by both {owner[sec]} and {name}: merge runs of other sections")
            owner[sec] = name
    by_name = {name: r for name, r, _ in records}
    main_run = by_name[owner["main"]] if "main" in owner else first
    res = {"device": first.get("device"), "sms": first.get("sms"), "cpus": first.get("cpus"),
           "versions": first.get("versions"), "date": max(r.get("date") or "" for _, r, _ in records),
           "dtype": first.get("dtype"), "ceilings": main_run.get("ceilings"), "notes": first.get("notes"),
           "merged_from": [{"record": name, "date": r.get("date"), "ceilings": r.get("ceilings"), "args": r.get("args"),
                            "sections": taken[name]} for name, r, _ in records],
           "timing": {}, "errors": {}}
    if note:
        res["merge_note"] = note
    for sec in SECTIONS:
        if sec not in owner:
            continue
        run = by_name[owner[sec]]
        for key in SECTION_KEYS[sec]:
            if key in run:
                res[key] = run[key]
        res["timing"][sec] = run["timing"][sec]
        if sec in (run.get("errors") or {}):
            res["errors"][sec] = run["errors"][sec]
    return res


NOTES = [
    "Timings are medians of triton.testing.do_bench (warmup 10 ms, rep 50 ms; L2 flushed before each call; "
    "three CUDA-event timings for calls over 200 ms) of the whole Python call: hla2()'s checks, configuration "
    "and allocations are inside it, and host gaps show when the host is slower than the GPU.",
    "fwd: forward under torch.no_grad(); fwd+bwd: forward on leaves that require grad (q, k, v and g) and "
    "o.backward(do). hla_fast_g uses per-token log-gates g = -0.001 * U[0, 1) that require grad; hla_fast_norm "
    "uses normalize=True on |q|, |k| (positive features keep the denominator positive).",
    "FLOPs are counted with the chunk size the default config uses for the forward (hla2_flop_chunk: 64 at "
    "K=V<=64, 32 above).",
    "Log-gates g are checked for shape, dtype and device on CUDA; their values (<= 0, finite) only off CUDA, since reading the check back would synchronize the device every call (hla_fast/ops/common/checks.py, check_gates).",
    "First-call rows run as subprocesses (first_call_setup.jobs at a time; each compiles its kernels in parallel "
    "threads) while the accuracy section runs (unless --no-overlap): more than one at a time share the CPUs, and "
    "the compile times are then an upper side of a user's.",
]


# ----------------------------------------------------------------------------- self-test (no GPU)


def fake_results():
    """A full result dict with made-up numbers, for --selftest."""
    res = {"device": "fake", "date": "1970-01-01T00:00:00+00:00", "dtype": "bfloat16", "notes": list(NOTES),
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "flash-linear-attention": "0.0"},
           "ceilings": {"bf16_matmul_tflops": 700.0, "copy_gbs": 4000.0}, "shapes": {"B": 4, "H": 16},
           "main": [], "timing": {"main": 1.0}}
    for K in (64, 128):
        for T in (2048, TARGET_T):
            r = {"B": 4, "H": 16, "T": T, "K": K, "V": K, "hla2_flop_chunk": 64 if K == 64 else 32,
                 "hla2_gflop_fwd": hla2_flops(4, 16, T, K, K, 64 if K == 64 else 32) / 1e9,
                 "hla2_mbytes_fwd": hla2_bytes(4, 16, T, K, K) / 1e6}
            for i, n in enumerate(("hla_fast", "hla_fast_g", "hla_fast_norm", "fla_linear_attn", "sdpa", "torch_backend")):
                r[f"{n}_fwd_ms"] = 1.0 + 0.05 * i * (K / 64)
                r[f"{n}_fwdbwd_ms"] = 4.0 + 0.1 * i
            r["hla_fast_fwd_tflops"] = r["hla2_gflop_fwd"] / r["hla_fast_fwd_ms"]
            add_ratios(r)
            res["main"].append(r)
    res["short"] = [{"B": 4, "H": 16, "T": SHORT_T, "K": 64, "V": 64, "hla_fast_fwd_ms": 0.1, "hla_fast_fwdbwd_ms": 0.5,
                     "hla_fast_fwd_loop_ms": 0.12, "hla_fast_fwdbwd_loop_ms": 0.6, "sdpa_fwd_ms": 0.1,
                     "sdpa_fwdbwd_ms": 0.4, "sdpa_fwd_loop_ms": 0.11, "sdpa_fwdbwd_loop_ms": 0.45,
                     "launches": {"hla_fast_fwd": {"kernels": 3, "hla2_kernels": 3, "memsets_memcpys": 0,
                                                   "by_name": {"hla2_fwd_kernel": 1}}},
                     "host": {"B": 1, "H": 16, "T": 1024, "K": 64,
                              "hla_fast": {"fwd_host_us": 50.0, "fwd_loop_us": 60.0, "fwdbwd_host_us": 200.0,
                                           "fwdbwd_loop_us": 210.0}}}]
    res["memory"] = [{"K": 128, "T": TARGET_T, "B": 4, "H": 16,
                      "hla_fast": {"peak_mb": 9000.0, "saved_mb": 5000.0, "saved_extra_mb": 4000.0, "inputs_mb": 2000.0},
                      "hla_fast_no_saved_states": {"peak_mb": 5000.0},
                      "fla_linear_attn": {"peak_mb": 4000.0}}]
    res["wide"] = [{"T": T, "K": 256, "hla_fast_fwd_ms": 5.0, "hla_fast_fwdbwd_ms": 20.0 * T / 8192,
                    "sdpa_fwd_ms": 4.0, "sdpa_fwdbwd_ms": 25.0 * (T / 8192) ** 2} for T in (4096, 8192, 16384)]
    res["decode"] = {"B": 64, "H": 16, "K": 128, "V": 128, "ms": 0.08, "gbs": 3300.0, "fraction_of_copy": 0.8,
                     "torch_ms": 0.3, "graph_ms": 0.07, "graph_fraction_of_copy": 0.85, "g_ms": 0.09,
                     "g_fraction_of_copy": 0.75, "norm_ms": 0.09, "norm_fraction_of_copy": 0.75}
    res["profile"] = [{"K": 64, "T": TARGET_T, "call": "hla_fast",
                       "kernels": {"hla2_fwd_kernel": {"ms_per_step": 1.0, "calls_per_step": 1.0}}}]
    res["variants"] = [{"K": 64, "T": TARGET_T, "pass": "fwd", "change": "default", "ms": 1.0},
                       {"K": 64, "T": TARGET_T, "pass": "fwd", "change": "fwd_segments=1", "ms": 2.0},
                       {"K": 64, "T": TARGET_T, "pass": "fwd", "change": "fwd_chunk=128", "error": "ValueError: x"}]
    res["accuracy"] = [{"T": 1024, "fp32": 4e-7, "bf16": 3e-3}]
    res["first_call"] = [dict(v, V=v["K"], status="ok", fwd_s=3.0, bwd_s=5.0, fwdbwd_s=8.0 + v["K"] / 16)
                         for v in first_call_variants()]
    res["first_call"][0]["status"] = "timeout"
    res["first_call"][1]["compiles"] = [
        {"kernel": "hla2_fwd_kernel", "s": 4.0, "stages": {"ir": 0.2, "ttir": 0.3, "cubin": 3.5}, "cache_hit": False,
         "end_s": 4.5},
        {"kernel": "hla2_bwd_grad_kernel", "s": 6.0, "stages": {"ir": 0.3, "ttir": 0.4, "cubin": 5.3},
         "cache_hit": False, "end_s": 6.4}]
    res["first_call_setup"] = {"jobs": 12, "cpus": 16, "timeout_s": 150, "B": 4, "T": 2048, "H": 16}
    return res


def selftest():
    """Check the pure parts on made-up rows: counts, targets, report, the variants' configs."""
    # FLOPs grow linearly in T at a fixed chunk; bytes count q, k, v, o once
    assert abs(hla2_flops(4, 16, 2 * 4096, 64, 64) / hla2_flops(4, 16, 4096, 64, 64) - 2) < 1e-12
    assert hla2_bytes(1, 1, 1, 64, 64) == (2 * 64 + 2 * 64) * 2
    assert decode_state_bytes(64, 16, 128, 128) == 268435456
    res = fake_results()
    t = targets(res)
    want = {"fwd_vs_fla_k64", "fwdbwd_vs_fla_k64", "fwd_vs_fla_k128", "fwdbwd_vs_fla_k128",
            "wide_k256_fwdbwd_beats_sdpa", "short_beats_sdpa", "normalize_overhead", "g_overhead",
            "memory_vs_fla_k128", "decode_fraction_of_copy", "first_call_under_15s", "speedup_vs_torch_backend"}
    assert set(t) == want, set(t) ^ want
    assert t["fwd_vs_fla_k64"]["met"] is True and abs(t["fwd_vs_fla_k64"]["ratio"] - 1 / 1.15) < 1e-9
    assert t["memory_vs_fla_k128"]["met"] is False and t["memory_vs_fla_k128"]["ratio"] == 9000 / 4000
    assert t["decode_fraction_of_copy"]["met"] is True
    assert t["first_call_under_15s"]["met"] is False  # one timeout
    assert t["short_beats_sdpa"]["met"] is False     # 0.12 > 0.11
    assert t["wide_k256_fwdbwd_beats_sdpa"]["met"] is True and set(t["wide_k256_fwdbwd_beats_sdpa"]["by_T"]) == {8192, 16384}
    assert t["g_overhead"]["met"] is True and t["normalize_overhead"]["met"] is False
    assert t["speedup_vs_torch_backend"]["met"] is False
    empty = targets({})
    assert set(empty) == want and all(x["met"] is None for x in empty.values()), empty
    with tempfile.TemporaryDirectory() as d:
        md = write_report(res, d, "selftest", show=False)
        back = json.load(open(os.path.join(d, "hla2_selftest.json")))
        for key in ("device", "date", "versions", "ceilings", "main", "accuracy", "decode", "targets"):
            assert key in back, key
        for head in ("## Targets", "## Main table", "Gates and normalization", "## Short sequences",
                     "## Training memory", "## Wide heads", "## Decode", "## CUDA time per kernel", "## Layouts",
                     "## Accuracy", "## First call", "## Notes"):
            assert head in md, head
        assert "2 compiles (10.0 s in all), slowest `hla2_bwd_grad_kernel` 6.0 s (ir 0.3, ttir 0.4, cubin 5.3); " \
               "the last ended at 6.4 s" in md
        assert md.count("| NOT met |") + md.count("| met |") + md.count("| not measured |") == len(want)
        # the autograd column only where a record timed it (earlier records render as they were)
        assert "| cubins | import |\n" in md and "(autograd;" not in md
        timed = dict(res, first_call=[dict(r, autograd_s=2.25) for r in res["first_call"]])
        assert "| import | autograd |\n" in render_markdown(timed) and "| 2.2 |\n" in render_markdown(timed)
        # an op column, and each variant named by its op, where some rows are another operator's
        assert "| dtype | K=V | flag |" in md and "| op |" not in md
        mixed = dict(res, first_call=res["first_call"] + [dict(r, op="ahla") for r in res["first_call"][1:2]])
        mixed_md = render_markdown(mixed)
        assert "| op | dtype | K=V | flag |" in mixed_md and "| hla2 | fp32 | 128 | g |" in mixed_md
        assert "| ahla | fp32 | 128 | g |" in mixed_md and "- ahla fp32 K=128 g: 2 compiles" in mixed_md
        secs = targets(mixed)["first_call_under_15s"]["seconds"]
        assert secs["fp32_K128_g"] == secs["ahla_fp32_K128_g"] == 16.0 and len(secs) == len(mixed["first_call"])
        render_markdown({"device": "x", "date": "y", "versions": {}})  # every section missing
        write_report({"device": "x", "date": "y", "versions": {}}, d, "empty", show=False)
    # every layout variant is a valid ChunkConfig change of both default rules
    for K in (64, 128):
        base = hla_fast.ChunkConfig(fwd_chunk=64 if K == 64 else 32, bwd_chunk=64 if K == 64 else 32)
        for _, ch in variant_changes(K):
            base.replace(**ch)
    assert len(first_call_variants()) == 27 and first_call_variants()[0]["dtype"] == "fp32"
    every = first_call_variants(ops=OPS)
    assert len(every) == 81 and [v["op"] for v in every[:27:9]] == list(OPS)
    print(md)
    print("selftest passed", flush=True)


# ----------------------------------------------------------------------------- layout variants


def variant_changes(K):
    """(pass, ChunkConfig changes) for one head size, most informative first; {} is the default."""
    if K <= 64:
        return [("fwd", {}), ("fwdbwd", {}),
                ("fwd", {"fwd_segments": 1}), ("fwdbwd", {"bwd_segments": 1}),
                ("fwdbwd", {"save_states": False}), ("fwdbwd", {"grad_parts": (7,)}),
                ("fwd", {"fwd_segments": 8}), ("fwd", {"fwd_chunk": 32}),
                ("fwdbwd", {"fwd_chunk": 32, "bwd_chunk": 32}), ("fwdbwd", {"grad_parts": (1, 2, 4)}),
                ("fwdbwd", {"bf16_snapshots": False}), ("fwd", {"fwd_warps": 8}),
                ("fwdbwd", {"bwd_segments": 8}), ("fwd", {"fwd_chunk": 128})]
    return [("fwd", {}), ("fwdbwd", {}), ("fwdbwd", {"bwd_pieces": 1}),
            ("fwdbwd", {"save_states": False}), ("fwd", {"fwd_chunk": 64}),
            ("fwd", {"fwd_segments": 2}), ("fwdbwd", {"grad_parts": (7,)}),
            ("fwd", {"fwd_warps": 4}), ("fwdbwd", {"fwd_chunk": 64, "bwd_chunk": 64, "fwd_warps": 4, "bwd_warps": 4})]


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="h200", help="files hla2_<tag>.json and hla2_<tag>.md")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run on a GPU")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="every section on the CPU under the Triton interpreter at tiny shapes (tests the script)")
    ap.add_argument("--selftest", action="store_true", help="check counts, targets and report on made-up rows")
    ap.add_argument("--torch-max-T", type=int, default=8192, help="largest T for the torch backend at K > 64")
    ap.add_argument("--dims", default="64,128", help="comma list of K=V head sizes of the main table")
    ap.add_argument("--Ts", default="", help="comma list of the main table's T (default 1024 to 32768)")
    ap.add_argument("--gated-T", default="all", help="T values of the g / normalize rows (comma list, or all)")
    ap.add_argument("--only", default="", help="comma list of main-table candidates to time (default: all)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: " + ",".join(SECTIONS))
    ap.add_argument("--sections", default="", help="comma list of the only sections to run")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds for the whole run: variants stop early and first-call timeouts shrink to fit")
    ap.add_argument("--first-call-jobs", type=int, default=1,
                    help="first-call subprocesses at a time (default 1: each call compiles its kernels in parallel "
                         "threads, so concurrent subprocesses share the CPUs and each takes longer than a user's)")
    ap.add_argument("--first-call-timeout", type=float, default=150.0, help="seconds per first-call subprocess")
    ap.add_argument("--first-call-T", type=int, default=2048,
                    help="T of the first-call shape (B = 4, H = 16); 8192 times bf16 heads of 64 as first-order layers")
    ap.add_argument("--first-call-dims", default="32,64,128", help="comma list of the first calls' K = V")
    ap.add_argument("--first-call-dtypes", default=",".join(FIRST_CALL_DTYPES),
                    help="comma list of the first calls' dtypes: " + ",".join(FIRST_CALL_DTYPES))
    ap.add_argument("--first-call-flags", default=",".join(FIRST_CALL_FLAGS),
                    help="comma list of the first calls' flags: " + ",".join(FIRST_CALL_FLAGS))
    ap.add_argument("--first-call-ops", default="hla2",
                    help="comma list of the operators whose first calls are timed: " + ",".join(OPS))
    ap.add_argument("--first-call-reserve", type=float, default=150.0,
                    help="seconds the variants section leaves for accuracy + first_call")
    ap.add_argument("--no-overlap", action="store_true", help="run the first-call subprocesses after accuracy")
    ap.add_argument("--from-json", default=None, help="only rebuild the report from a results JSON")
    ap.add_argument("--merge", default=None,
                    help="comma list of results JSONs of one device, each of other sections "
                         "(PATH:a+b takes only sections a and b of one): write them as one record hla2_<tag> "
                         "(merge_records)")
    ap.add_argument("--merge-note", default=None,
                    help="with --merge: a sentence for the record saying which code each run measured")
    args = ap.parse_args()
    if args.selftest:
        selftest()
        return
    if args.merge_note is not None and not args.merge:
        ap.error("--merge-note goes with --merge")
    if args.merge:
        records = []
        for item in filter(None, args.merge.split(",")):
            p, _, only = item.partition(":")
            unknown = set(filter(None, only.split("+"))) - set(SECTIONS)
            if unknown:
                ap.error(f"--merge {item}: unknown sections {sorted(unknown)}; known: {','.join(SECTIONS)}")
            with open(p) as f:
                records.append((os.path.splitext(os.path.basename(p))[0], json.load(f), only.split("+") if only else None))
        try:
            merged = merge_records(records, args.merge_note)
        except ValueError as e:
            ap.error(str(e))
        os.makedirs(args.out, exist_ok=True)
        write_report(merged, args.out, args.tag, show=False)
        return
    if args.from_json:
        with open(args.from_json) as f:
            write_report(json.load(f), args.out, args.tag)
        return
    unknown = set(filter(None, (args.skip + "," + args.sections).split(","))) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {','.join(SECTIONS)}")
    # each named once, in the order given (a repeated name would time the same first call twice)
    fc_dtypes, fc_flags, fc_ops = (list(dict.fromkeys(x.split(","))) for x in (
        args.first_call_dtypes, args.first_call_flags, args.first_call_ops))
    for name, given, known in (("--first-call-dtypes", fc_dtypes, FIRST_CALL_DTYPES),
                               ("--first-call-flags", fc_flags, FIRST_CALL_FLAGS),
                               ("--first-call-ops", fc_ops, OPS)):
        if not given or set(given) - set(known):
            ap.error(f"{name} takes a comma list of {','.join(known)}; got {','.join(given)!r}")
    try:
        fc_dims = list(dict.fromkeys(int_list(args.first_call_dims, [])))
    except ValueError:
        fc_dims = []
    if not fc_dims or min(fc_dims) < 1 or args.first_call_T < 1:
        ap.error(f"--first-call-dims takes positive head sizes and --first-call-T a positive length; "
                 f"got {args.first_call_dims!r} and {args.first_call_T}")
    chosen = [s for s in SECTIONS if (not args.sections or s in args.sections.split(",")) and s not in args.skip.split(",")]
    if not CUDA and not args.cpu_smoke:
        ap.error("no CUDA device: use --selftest or --cpu-smoke on a machine without a GPU")
    smoke = args.cpu_smoke
    if smoke:
        from hla_fast.ops.common.launch import interpreter_on

        assert interpreter_on(), "--cpu-smoke needs TRITON_INTERPRET=1 before triton is imported"
    os.makedirs(args.out, exist_ok=True)
    chunk_linear_attn, fla_version = load_fla()
    res = {
        "device": torch.cuda.get_device_name(0) if CUDA else "cpu (Triton interpreter, --cpu-smoke)",
        "sms": torch.cuda.get_device_properties(0).multi_processor_count if CUDA else None,
        "cpus": os.cpu_count(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version(), "flash-linear-attention": fla_version},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": "bfloat16",
        "args": {a: b for a, b in vars(args).items() if a != "out"},  # no path of the measuring machine
        "notes": list(NOTES),
        "timing": {},
        "errors": {},
    }
    lock = threading.RLock()
    path = os.path.join(args.out, f"hla2_{args.tag}.json")

    def save():
        with lock:
            text = json.dumps(res, indent=1, default=str)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

    def put(key, value):
        with lock:
            res[key] = value
        save()

    def record(section, row):
        """Append a result row, show it (floats rounded) and save the JSON so far."""
        with lock:
            res.setdefault(section, []).append(row)
        print(section, {k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()
                        if k_ not in ("by_name", "launches", "kernels")}, flush=True)
        save()

    def left_s():
        return args.budget_s - (time.perf_counter() - T0)

    # -- shapes -----------------------------------------------------------------------------------
    if smoke:
        B, H, Ts, Ds = 1, 2, [64, 128], [16, 32]
    elif args.quick:
        B, H, Ts, Ds = 2, 4, [1024, 2048, 4096], [64]
    else:
        B, H, Ts, Ds = 4, 16, int_list(args.Ts, [1024, 2048, 4096, 8192, 16384, 32768]), [int(x) for x in args.dims.split(",")]
    gated_T = set(Ts) if args.gated_T == "all" else {int(x) for x in args.gated_T.split(",")}
    res["shapes"] = {"B": B, "H": H, "T": Ts, "K=V": Ds, "gated_T": sorted(gated_T)}
    Tbig = Ts[-1]
    fla_fn = (lambda q, k, v: chunk_linear_attn(q, k, v, normalize=False)[0]) if chunk_linear_attn else None

    # -- ceilings -----------------------------------------------------------------------------------
    n = 256 if smoke else (4096 if args.quick else 8192)
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, warmup=25, rep=100)
    nbytes = (1 << 20) if smoke else ((1 << 28) if args.quick else (1 << 31))
    x = torch.randn(nbytes // 4, device=DEVICE)
    y = torch.empty_like(x)
    ms_c = bench_ms(lambda: y.copy_(x), warmup=25, rep=100)
    put("ceilings", {"bf16_matmul_tflops": 2 * n ** 3 / ms / 1e9, "matmul_n": n, "copy_gbs": 2 * nbytes / ms_c / 1e6,
                     "copy_bytes_each_way": nbytes})
    del a, b, x, y
    free()
    log(f"ceilings {res['ceilings']}")

    # -- sections -----------------------------------------------------------------------------------
    def sec_decode():
        Bd, Hd, Kd, Vd = (2, 2, 16, 16) if smoke else (64, 16, 128, 128)
        g = torch.Generator(device=DEVICE).manual_seed(1)
        q = torch.randn(Bd, Hd, Kd, device=DEVICE, generator=g).bfloat16()
        k = torch.randn(Bd, Hd, Kd, device=DEVICE, generator=g).bfloat16()
        v = torch.randn(Bd, Hd, Vd, device=DEVICE, generator=g).bfloat16()
        gates = -0.001 * torch.rand(Bd, Hd, device=DEVICE, generator=g)
        st = HLA2State(torch.randn(Bd, Hd, Kd, Kd, device=DEVICE, generator=g),
                       torch.randn(Bd, Hd, Kd, Vd, device=DEVICE, generator=g))
        stz = HLA2State(st.S, st.W, torch.rand(Bd, Hd, Kd, device=DEVICE, generator=g))
        copy = res["ceilings"]["copy_gbs"]
        sb = decode_state_bytes(Bd, Hd, Kd, Vd)

        def step():
            return hla_fast.hla2_step(q, k, v, st, gamma=GAMMA, backend="triton")

        ms = warm_median_ms(step)   # 78.9 us with the warm-up, hla2_h200_decode.md
        d = {"B": Bd, "H": Hd, "K": Kd, "V": Vd, "ms": ms, "state_bytes_rw": sb, "gbs": sb / ms / 1e6,
             "fraction_of_copy": sb / ms / 1e6 / copy}
        d["torch_ms"] = median_ms(lambda: hla_fast.hla2_step(q, k, v, st, gamma=GAMMA, backend="torch"))
        ms_g = median_ms(lambda: hla_fast.hla2_step(q, k, v, st, g=gates, backend="triton"))
        d.update(g_ms=ms_g, g_fraction_of_copy=sb / ms_g / 1e6 / copy)
        sbz = decode_state_bytes(Bd, Hd, Kd, Vd, normalize=True)
        qa, ka = q.abs(), k.abs()
        ms_n = median_ms(lambda: hla_fast.hla2_step(qa, ka, v, stz, gamma=GAMMA, normalize=True, backend="triton"))
        d.update(norm_ms=ms_n, norm_fraction_of_copy=sbz / ms_n / 1e6 / copy)
        if CUDA:  # the same step replayed from a CUDA graph: no Python or launch gaps between steps
            ms_gr = graph_ms(step)
            d.update(graph_ms=ms_gr, graph_fraction_of_copy=sb / ms_gr / 1e6 / copy)
        put("decode", d)
        log(f"decode {d}")

    def sec_main():
        put("main", [])
        for D in Ds:
            for T in Ts:
                q, k, v = make_inputs(B, T, H, D, D)
                do = torch.randn_like(v)
                g = make_gates(B, T, H)
                C = hla_fast.hla2_config(B, T, H, D, D, q.dtype, q.device).fwd_chunk
                row = {"B": B, "H": H, "T": T, "K": D, "V": D, "hla2_flop_chunk": C,
                       "hla2_gflop_fwd": hla2_flops(B, H, T, D, D, C) / 1e9,
                       "hla2_mbytes_fwd": hla2_bytes(B, H, T, D, D) / 1e6}
                cands = hla_candidates(q, k, v, g)
                if T not in gated_T:
                    cands = {"hla_fast": cands["hla_fast"]}
                cands["sdpa"] = (sdpa, (q, k, v))
                if fla_fn is not None:
                    cands["fla_linear_attn"] = (fla_fn, (q, k, v))
                if T <= (args.torch_max_T if D > 64 else max(args.torch_max_T, 32768)):
                    cands["torch_backend"] = (hla_torch, (q, k, v))
                else:
                    row["torch_backend"] = f"skipped: T > {args.torch_max_T} (slow)"
                if args.only:
                    cands = {n_: f_ for n_, f_ in cands.items() if n_ in args.only.split(",")}
                time_candidates(row, cands, do)
                if "hla_fast_fwd_ms" in row:
                    row["hla_fast_fwd_tflops"] = row["hla2_gflop_fwd"] / row["hla_fast_fwd_ms"]
                    row["hla_fast_fwd_fraction_of_matmul"] = row["hla_fast_fwd_tflops"] / res["ceilings"]["bf16_matmul_tflops"]
                add_ratios(row)
                record("main", row)
                del q, k, v, do, g, cands
                free()

    def sec_short():
        Bs, Hs, Tsh, D = (1, 2, 128, 16) if smoke else ((2, 4, 1024, 64) if args.quick else (4, 16, SHORT_T, 64))
        put("short", [])
        q, k, v = make_inputs(Bs, Tsh, Hs, D, D)
        do = torch.randn_like(v)
        g = make_gates(Bs, Tsh, Hs)
        row = {"B": Bs, "H": Hs, "T": Tsh, "K": D, "V": D}
        cands = hla_candidates(q, k, v, g)
        cands["sdpa"] = (sdpa, (q, k, v))
        if fla_fn is not None:
            cands["fla_linear_attn"] = (fla_fn, (q, k, v))
        time_candidates(row, cands, do)
        row["launches"] = {}
        for name, (fn, inputs) in cands.items():
            for s, run in (("fwd", fwd_only(fn, inputs)), ("fwdbwd", fwd_bwd(fn, inputs, do))):
                try:
                    row[f"{name}_{s}_loop_ms"] = loop_ms(run)
                    row["launches"][f"{name}_{s}"] = count_kernels(run)
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_{s}_loop_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        del q, k, v, do, g, cands
        free()
        # host work per call where the GPU work is small; B=1, H=16, T=1024 keeps the kernels of the
        # main table's K=64 rows (4 segments), so nothing new is compiled
        Bh, Hh, Th = (1, 2, 64) if smoke else (1, 16, 1024)
        q, k, v = make_inputs(Bh, Th, Hh, D, D)
        do = torch.randn_like(v)
        host = {"B": Bh, "H": Hh, "T": Th, "K": D}
        for name, fn in (("hla_fast", hla), ("sdpa", sdpa)):
            x = {}
            for s, run in (("fwd", fwd_only(fn, (q, k, v))), ("fwdbwd", fwd_bwd(fn, (q, k, v), do))):
                x[f"{s}_host_us"] = host_us(run, n=200 if CUDA else 2)
                x[f"{s}_loop_us"] = loop_ms(run, n=200, reps=3) * 1e3
            host[name] = x
        row["host"] = host
        record("short", row)
        del q, k, v, do
        free()

    def sec_memory():
        put("memory", [])
        Tm = 128 if smoke else (4096 if args.quick else TARGET_T)
        for D in ([32] if smoke else ([64] if args.quick else [128, 64])):
            q, k, v = make_inputs(B, Tm, H, D, D)
            do = torch.randn_like(v)
            cfg = hla_fast.hla2_config(B, Tm, H, D, D, q.dtype, q.device, training=True)   # the training layout
            row = {"B": B, "H": H, "T": Tm, "K": D, "V": D, "default_config": dataclasses.asdict(cfg)}
            cands = {"hla_fast": (hla, (q, k, v)),
                     "hla_fast_no_saved_states": (lambda q, k, v: hla(q, k, v, config=cfg.replace(save_states=False)),
                                                  (q, k, v)),
                     "hla_fast_norm": (hla_norm, (q.abs(), k.abs(), v))}
            if cfg.bwd_pieces > 1:  # what the backward in pieces saves
                cands["hla_fast_one_piece"] = (lambda q, k, v: hla(q, k, v, config=cfg.replace(bwd_pieces=1)), (q, k, v))
            if fla_fn is not None:
                cands["fla_linear_attn"] = (fla_fn, (q, k, v))
            for name, (fn, inputs) in cands.items():
                try:
                    fwd_bwd(fn, inputs, do)()  # compile / autotune outside the measured call
                    sync()
                    row[name] = train_memory(fn, inputs, do)
                except Exception as e:  # noqa: BLE001
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                free()
            record("memory", row)
            del q, k, v, do, cands
            free()

    def sec_wide():
        put("wide", [])
        Bw, Hw = (1, 1) if smoke else (B, H)
        Kw = 160 if smoke else 256  # smoke: three feature blocks and two value blocks, as 256 has four
        for T in ([32] if smoke else ([1024] if args.quick else [4096, 8192, 16384])):
            q, k, v = make_inputs(Bw, T, Hw, Kw, Kw)
            do = torch.randn_like(v)
            row = {"B": Bw, "H": Hw, "T": T, "K": Kw, "V": Kw}
            time_candidates(row, {"hla_fast": (hla, (q, k, v)), "sdpa": (sdpa, (q, k, v))}, do)
            record("wide", row)
            del q, k, v, do
            free()

    def sec_profile():
        put("profile", [])
        if left_s() < args.first_call_reserve:
            put("profile_status", "skipped: time budget")
            return
        from torch.profiler import ProfilerActivity, profile

        for D in Ds:
            q, k, v = make_inputs(B, Tbig, H, D, D)
            do = torch.randn_like(v)
            g = make_gates(B, Tbig, H)
            for call, (fn, inputs) in hla_candidates(q, k, v, g).items():
                run = fwd_bwd(fn, inputs, do)
                run()
                sync()
                with profile(activities=[ProfilerActivity.CUDA if CUDA else ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        run()
                    sync()
                kernels = {}
                for ev in prof.key_averages():
                    t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                    if t and "hla2_" in ev.key:
                        kernels[ev.key] = {"ms_per_step": t / 3 / 1e3, "calls_per_step": ev.count / 3}
                record("profile", {"B": B, "H": H, "T": Tbig, "K": D, "V": D, "call": call, "kernels": kernels})
            del q, k, v, do, g
            free()

    def sec_variants():
        put("variants", [])
        defaults = {}
        Tv = Tbig
        for D in Ds:
            q, k, v = make_inputs(B, Tv, H, D, D)
            do = torch.randn_like(v)
            # the fused kernels' layouts (the fields varied are theirs; the rule may take the layers)
            base = fused_config(B, Tv, H, D, D, q.dtype, q.device)
            defaults[D] = dataclasses.asdict(base)
            put("variant_defaults", defaults)
            for kind, ch in variant_changes(D):
                label = ",".join(f"{k_}={v_}" for k_, v_ in ch.items()) or "default"
                row = {"K": D, "V": D, "T": Tv, "B": B, "H": H, "pass": kind, "change": label}
                if left_s() < args.first_call_reserve:
                    row["status"] = "skipped: time budget"
                    record("variants", row)
                    continue
                try:
                    cfg = base.replace(**ch)
                    row["config"] = dataclasses.asdict(cfg)
                    fn = lambda q, k, v, cfg=cfg: hla(q, k, v, config=cfg)  # noqa: E731
                    run = fwd_only(fn, (q, k, v)) if kind == "fwd" else fwd_bwd(fn, (q, k, v), do)
                    t0 = time.perf_counter()
                    row["ms"] = median_ms(run)
                    row["seconds_incl_compile"] = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                record("variants", row)
                free()
            del q, k, v, do
            free()

    def sec_accuracy():
        put("accuracy", [])
        Ha, Da = (2, 16) if smoke else (4, 64)
        for T in ([64, 128] if smoke else ([1024, 4096] if args.quick else [1024, 4096, 16384, 32768])):
            q, k, v = make_inputs(1, T, Ha, Da, Da, dtype=torch.float32, seed=T)
            ref, _ = hla_fast.hla2(q.double(), k.double(), v.double(), gamma=GAMMA, backend="torch")
            row = {"T": T, "B": 1, "H": Ha, "K": Da, "V": Da, "gamma": GAMMA}
            for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                qq, kk, vv = (x.to(dt) for x in (q, k, v))
                ref_d = ref if dt == torch.float32 else hla_fast.hla2(
                    qq.double(), kk.double(), vv.double(), gamma=GAMMA, backend="torch")[0]
                o, _ = hla_fast.hla2(qq, kk, vv, gamma=GAMMA, backend="triton")
                row[name] = float((o.double() - ref_d).norm() / ref_d.norm())
            record("accuracy", row)
            del q, k, v, ref
            free()

    fc_state = {}

    def start_first_call():
        shape = ({"B": 1, "T": 64, "H": 2} if smoke else {"B": 4, "T": args.first_call_T, "H": 16})
        variants = first_call_variants(dims=(16,) if smoke else ((64,) if args.quick else fc_dims),
                                       dtypes=fc_dtypes, flags=fc_flags, ops=fc_ops)
        # at least a minute for this section even when the run is behind its budget
        deadline = time.perf_counter() + max(left_s(), 60.0)
        jobs = min(args.first_call_jobs, 2) if smoke else args.first_call_jobs
        put("first_call_setup", dict(shape, jobs=jobs, cpus=os.cpu_count(), cpu_model=cpu_model(),
                                     timeout_s=args.first_call_timeout,
                                     budget_left_s=left_s(), overlapped_with_accuracy=not args.no_overlap))
        put("first_call", [])
        env_extra = {"TRITON_INTERPRET": "1"} if smoke else None
        fc_state["t0"] = time.perf_counter()
        fc_state["pool"] = FirstCallPool(variants, shape, jobs, args.first_call_timeout, deadline,
                                         lambda row: record("first_call", row), env_extra=env_extra)
        log(f"first_call: {len(variants)} subprocesses started, {jobs} at a time")

    def join_first_call():
        fc_state["pool"].join()
        with lock:
            res["first_call_setup"]["section_s"] = time.perf_counter() - fc_state["t0"]
        log(f"first_call done, {time.perf_counter() - fc_state['t0']:.1f} s since its subprocesses started")

    section_fns = {"decode": sec_decode, "main": sec_main, "short": sec_short, "memory": sec_memory,
                   "wide": sec_wide, "profile": sec_profile, "variants": sec_variants, "accuracy": sec_accuracy,
                   "first_call": join_first_call}

    def run_section(name):
        t0 = time.perf_counter()
        log(f"section {name} ...")
        try:
            section_fns[name]()
        except Exception:  # noqa: BLE001
            tb = traceback.format_exc()
            print(tb, flush=True)
            with lock:
                res["errors"][name] = tb
        free()
        with lock:
            res["timing"][name] = time.perf_counter() - t0
        try:
            with lock:  # first-call threads may be saving rows meanwhile
                write_report(res, args.out, args.tag, show=False)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        log(f"section {name} done in {time.perf_counter() - t0:.1f} s")

    for name in chosen:
        if name == "accuracy" and "first_call" in chosen and not args.no_overlap:
            start_first_call()  # accuracy times nothing: compile the first calls meanwhile
        if name == "first_call" and "pool" not in fc_state:
            start_first_call()
        run_section(name)
    with lock:
        res["timing"]["total"] = time.perf_counter() - T0
        write_report(res, args.out, args.tag)
    log(f"wrote {os.path.join(args.out, f'hla2_{args.tag}.json')} and .md")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
