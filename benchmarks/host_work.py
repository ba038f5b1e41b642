"""Where the host's time in one short call goes: the operator's own host code, each Triton launch,
and the rest of the public call.

At short sequences a call's time is set by the host, not the GPU (hla_fast/README.md, the
short-sequence target): the bench's host table gives the whole call's microseconds; this script
splits them. For each case ``op:K:T`` (``:g`` log-gates that require grad, ``:n`` normalize=True,
``:gn`` both; K = V, bf16 on CUDA, B = 1, H = 16, gamma = 0.999 without gates, the default
configuration) and each pass (an inference forward under no_grad; a forward + backward on leaves
that require grad), medians over ``--calls`` calls, no synchronize inside a timing (the GPU is
drained every 16 calls, outside the timed part):

* call: the public call, ``hla_fast.<op>(..., backend="triton")`` (CUDA only);
* own: the operator's chunked function (``hla2_chunked``, ``ahla_chunked``, ``hla3_chunked``) with a
  ``launch`` that launches nothing: the configuration rule, allocations, the autograd Function,
  without Triton;
* launches: each kernel the call launches, replayed alone as ``kernel[grid](**arguments)`` with the
  call's own arguments (Triton's launcher: heuristics, argument binding and specialization, the
  cache lookup, the driver call; CUDA only);
* checks: call - the chunked function launching its kernels (the public function's checks and
  ``compile_ahead``'s lookup);
* in the call: each launch timed where the call makes it (the backward's on autograd's device
  thread), by a ``launch`` that times ``kernel[grid](**arguments)``;
* rest: call - checks - own - the launches in the call: what running real kernels adds to the
  call's own host work beyond their launches (the autograd engine, the allocator);
* a cProfile of ``--calls`` public calls (on CPU: of the chunked calls), the functions with the most
  own time, microseconds per call.

    python benchmarks/host_work.py --tag h100                           # the recorded run (a GPU)
    python benchmarks/host_work.py --cases hla2:64:1024,ahla:64:1024:g --tag x
    python benchmarks/host_work.py --render benchmarks/results/host_work_h100.json

Without CUDA only ``own`` and the profile of the chunked calls are measured (bf16 CPU tensors, so
that the rule takes its bf16 layouts; the allocations are the CPU's), which is enough to see what
the operator's own host code costs. ``--all-parts`` under ``TRITON_INTERPRET=1`` runs the other
parts on a CPU too: that checks the script, not a host's time.
"""
from __future__ import annotations

import cProfile
import os
import platform
import pstats
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_hla2 import CUDA, fwd_bwd, fwd_only, host_us, make_gates, make_inputs, sync  # noqa: E402
from hla_fast.ops.common.compile import launch_kernel  # noqa: E402
from profile_kernels import CASES_HELP, checked_cases  # noqa: E402
from records import portable, record_parser, render_stored, stamp, write_record  # noqa: E402

CASES = "hla2:64:1024,hla2:64:1024:g,hla2:64:1024:n,ahla:64:1024,hla3:64:1024"
B, H = 1, 16
GAMMA = 0.999
TOP = 15   # profile rows kept per pass


def kernel_name(kernel) -> str:
    """The Python name of a launched kernel (through ``triton.heuristics``' wrapper)."""
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel.__name__


def nothing(kernel, grid, **kwargs):
    """A ``launch`` that launches nothing."""


class LaunchTimer:
    """A ``launch`` that launches and keeps each launch's microseconds in ``us`` (in call order)."""

    def __init__(self):
        self.us = []

    def __call__(self, kernel, grid, **kwargs):
        t0 = time.perf_counter()
        kernel[grid](**kwargs)
        self.us.append((time.perf_counter() - t0) * 1e6)


class Keeper:
    """A ``launch`` that keeps ``(kernel, grid, arguments)`` with the real tensors and launches
    nothing: the launches to replay one by one."""

    def __init__(self):
        self.launches = []

    def __call__(self, kernel, grid, **kwargs):
        self.launches.append((kernel, grid, kwargs))


def chunked(op):
    """``fn(q, k, v, g, gamma, normalize, launch)``: the operator's chunked function from a zero
    state with the rule's configuration (the public call's path after its checks)."""
    if op == "hla2":
        from hla_fast.ops.hla2.chunk import hla2_chunked
        return lambda q, k, v, g, gamma, n, launch: hla2_chunked(q, k, v, g, gamma, None, None, None, n, 1e-6,
                                                                 launch=launch)[0]
    if op == "ahla":
        from hla_fast.ops.ahla.chunk import ahla_chunked
        return lambda q, k, v, g, gamma, n, launch: ahla_chunked(q, k, v, g, gamma, None, None, None, None, n,
                                                                 1e-6, launch=launch)[0]
    from hla_fast.ops.hla3.chunk import hla3_chunked
    return lambda q, k, v, g, gamma, n, launch: hla3_chunked(q, k, v, g, gamma, None, n, 1e-6, launch=launch)[0]


def inputs(D, T, gated, normalize):
    """The call's tensors (q, k, v, and the log-gates g when ``gated``) and an output gradient:
    ``bench_hla2``'s bf16 inputs (on CPU too, so that the rule picks the layout it picks on CUDA),
    |q|, |k| when normalizing (a positive denominator)."""
    q, k, v = make_inputs(B, T, H, D, D)
    if normalize:
        q, k = q.abs(), k.abs()
    return (q, k, v) + ((make_gates(B, T, H),) if gated else ()), torch.randn_like(v)


def profile_rows(run, calls):
    """[(function, us per call)] of the TOP functions by own time over ``calls`` calls."""
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        run()
        if i % 16 == 15:   # as host_us: the launch queue never blocks a call
            sync()
    prof.disable()
    sync()
    stats = pstats.Stats(prof).stats
    rows = sorted(((tt, f) for f, (_, _, tt, _, _) in stats.items()), reverse=True)[:TOP]
    return [[portable(f"{file}:{line}({name})"), tt / calls * 1e6] for tt, (file, line, name) in rows]


def measure_case(op, D, T, gated, normalize, calls, all_parts=CUDA):
    """One case's record: for each pass its call, own, launches and rest microseconds and its
    profile rows (call, launches and rest None unless ``all_parts``)."""
    import hla_fast

    out = {"op": op, "K": D, "V": D, "T": T, "B": B, "H": H, "gated": gated, "normalize": normalize}
    run_chunked, gamma = chunked(op), None if gated else GAMMA

    def chunked_with(launch):
        return lambda q, k, v, g=None: run_chunked(q, k, v, g, gamma, normalize, launch)

    def public(q, k, v, g=None):
        decay = {"g": g} if gated else {"gamma": gamma}
        return getattr(hla_fast, op)(q, k, v, normalize=normalize, backend="triton", **decay)[0]

    xs, do = inputs(D, T, gated, normalize)
    # bench_hla2's closures: under no_grad, or forward + backward on leaves that require grad
    for name, closure in (("fwd", lambda fn: fwd_only(fn, xs)), ("fwdbwd", lambda fn: fwd_bwd(fn, xs, do))):
        own = closure(chunked_with(nothing))
        row = {"own_us": host_us(own, calls), "call_us": None, "checks_us": None, "launches_us": None,
               "in_call_us": None, "rest_us": None}
        if all_parts:
            call = closure(public)
            row["call_us"] = host_us(call, calls)
            row["checks_us"] = row["call_us"] - host_us(closure(chunked_with(launch_kernel)), calls)
            keep = Keeper()
            closure(chunked_with(keep))()
            row["launches_us"] = [[kernel_name(kern), host_us(lambda: kern[grid](**kw), calls)]
                                  for kern, grid, kw in keep.launches]
            timer, m = LaunchTimer(), len(keep.launches)
            host_us(closure(chunked_with(timer)), calls)   # calls + 1 calls of m launches each
            row["in_call_us"] = [statistics.median_high(timer.us[i::m]) for i in range(m)]
            row["rest_us"] = row["call_us"] - row["checks_us"] - row["own_us"] - sum(row["in_call_us"])
            row["profile"] = profile_rows(call, calls)
        else:
            row["profile"] = profile_rows(own, calls)
        out[name] = row
    return out


def _us(x):
    return "-" if x is None else f"{x:.0f}"


def render_markdown(res):
    v = res.get("versions", {})
    lines = [f"# Host work of one short call on {res['device']}", "",
             f"Date {res['date']}; torch {v.get('torch')}, triton {v.get('triton')}, python {v.get('python')}; "
             f"{res['dtype']}, B = {B}, H = {H}, the default configuration, gamma = {GAMMA} without gates; "
             f"medians of {res['calls']} calls, microseconds from the call to its return without a "
             "synchronize (`benchmarks/host_work.py`).", "",
             "call: the public call. own: the operator's chunked function with a launch that launches "
             "nothing (the rule, allocations, autograd). launches: each kernel replayed alone with the "
             "call's arguments (Triton's launcher)."]
    split = any("in_call_us" in c["fwd"] for c in res["cases"])   # records before the split have no such field
    if split:
        lines[-1] += (" checks: call - the chunked function launching its kernels (the public checks, the "
                      "compile-ahead lookup). in the call: the same launches timed where the call makes them "
                      "(the backward's on autograd's thread). rest: call - checks - own - launches in the call "
                      "(what real kernels add beyond their launches: the autograd engine, the allocator).")
    else:
        lines[-1] += " rest: call - own - launches (the checks, the compile-ahead lookup)."
    lines.append("")
    if res.get("notes"):
        lines += [f"- {n}" for n in res["notes"]] + [""]
    if split:
        lines += ["| case | pass | call | checks | own | launches | in the call | rest |",
                  "|---|---|---|---|---|---|---|---|"]
    else:
        lines += ["| case | pass | call | own | launches | rest |", "|---|---|---|---|---|---|"]
    for c in res["cases"]:
        flags = (":g" if c["gated"] else "") + (":n" if c["normalize"] else "")
        for p in ("fwd", "fwdbwd"):
            r = c[p]
            ls = r["launches_us"]
            launches = "-" if ls is None else f"{sum(us for _, us in ls):.0f} ({len(ls)})"
            cells = [f"{c['op']}:{c['K']}:{c['T']}{flags}", p, _us(r["call_us"])]
            if split:
                cells.append(_us(r["checks_us"]))
            cells += [_us(r["own_us"]), launches]
            if split:
                cells.append("-" if r["in_call_us"] is None else f"{sum(r['in_call_us']):.0f}")
            lines.append("| " + " | ".join(cells + [_us(r["rest_us"])]) + " |")
    lines.append("")
    for c in res["cases"]:
        flags = (", gates g" if c["gated"] else "") + (", normalized" if c["normalize"] else "")
        for p in ("fwd", "fwdbwd"):
            r = c[p]
            lines += [f"## {c['op']}{flags}, K = V = {c['K']}, T = {c['T']}, {p}", ""]
            if r["launches_us"] is not None and r.get("in_call_us") is not None:
                lines += ["| kernel | launch us alone | in the call |", "|---|---|---|"]
                lines += [f"| `{n}` | {us:.1f} | {inc:.1f} |"
                          for (n, us), inc in zip(r["launches_us"], r["in_call_us"])] + [""]
            elif r["launches_us"] is not None:
                lines += ["| kernel | launch us |", "|---|---|"]
                lines += [f"| `{n}` | {us:.1f} |" for n, us in r["launches_us"]] + [""]
            lines += [f"Own time per call, the {TOP} largest (cProfile; its overhead inflates every row):", "",
                      "| function | us |", "|---|---|"]
            lines += [f"| `{f}` | {us:.1f} |" for f, us in r["profile"]] + [""]
    return "\n".join(lines)


def main():
    ap = record_parser(__doc__, "host_work", "h100")
    ap.add_argument("--cases", default=CASES, help=CASES_HELP)
    ap.add_argument("--calls", type=int, default=200, help="calls a median is taken over (>= 1)")
    ap.add_argument("--all-parts", action="store_true",
                    help="time the public call and each launch off CUDA too (needs TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.render:
        render_stored(args.render, render_markdown)
        return
    cases = checked_cases(ap, args.cases)
    if args.calls < 1:
        ap.error(f"--calls must be >= 1, got {args.calls}")
    from hla_fast.ops.common.launch import interpreter_on
    if args.all_parts and not CUDA and not interpreter_on():
        ap.error("--all-parts off CUDA runs the kernels on Triton's interpreter: set TRITON_INTERPRET=1")
    device = torch.cuda.get_device_name(0) if CUDA else f"CPU ({platform.processor() or platform.machine()})"
    res = {**stamp(device), "dtype": "bfloat16", "calls": args.calls, "cases": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"host_work_{args.tag}")
    for op, D, T, gated, normalize in cases:
        res["cases"].append(measure_case(op, D, T, gated, normalize, args.calls, CUDA or args.all_parts))
        write_record(path, res, render_markdown)
        print(f"{op} K={D} T={T} gated={gated} normalize={normalize}: done", flush=True)
    print(f"wrote {path}.json and {path}.md")


if __name__ == "__main__":
    main()
