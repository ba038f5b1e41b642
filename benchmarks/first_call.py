"""Time the first forward + backward of an operator (``--op``: hla2, ahla or hla3) in a fresh process
(Triton compile included).

Run by ``bench_hla2.py`` (section ``first_call``) once per variant, in a fresh interpreter with
``TRITON_CACHE_DIR`` pointing at an empty directory, so every kernel the call needs is compiled
inside the timed call. Prints one line ``FIRST_CALL_JSON {...}`` with the seconds of:

    import_s        importing torch and hla_fast (not part of the first call)
    autograd_s      PyTorch's one-time setup of a first backward given an explicit output
                    gradient, done on a two-element tensor before the clock (not part of the first
                    call): it imports PyTorch's symbolic-shapes module and SymPy, some 2 s that any
                    op's first such backward pays once per process (a scalar loss's backward does not)
    fwd_s           the first hla2() call with inputs that require grad (compiles the forward)
    bwd_s           the first o.backward(do) (compiles the backward)
    fwdbwd_s        fwd_s + bwd_s: the first training call
    warm_fwdbwd_s   the same fwd + bwd again (kernels cached in memory): what is left is not compile
    compiles        each kernel compiled in the process, where Triton reports compiles (its
                    compilation listener): kernel, seconds, seconds of each stage, and when it
                    ended (end_s, seconds since the first call started)

The inputs are created, and a torch op run on them, before the clock starts, so CUDA context
creation is not counted; nor is PyTorch's own setup of a first backward (``autograd_s``). On a
machine without CUDA it runs the kernels under the Triton interpreter (TRITON_INTERPRET=1, set
before the import), where nothing is compiled: only the plumbing is tested.

    python benchmarks/first_call.py --dtype bf16 --dim 64 --flag g
    python benchmarks/first_call.py --op ahla --dtype fp32 --dim 64 --config '{"grad_parts": [1, 2, 4]}'

``--config`` takes a JSON object of ``ChunkConfig`` fields changed from the configuration the
operator's rule gives a training call of these shapes and flags (``ab_revision.rule_config``; for
hla3 its second stage's): how a layout's first call is measured before the rule takes it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_START = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):   # hla_fast, and config_arg beside this script
    if _p not in sys.path:
        sys.path.insert(0, _p)

from config_arg import DTYPES, HELP, OPS, config_changes  # noqa: E402  (no torch: the import is timed below)


def compile_log(clock):
    """A list that fills with one entry per kernel compile of this process (``compiles`` above),
    through Triton's compilation listener; None where this Triton has none. ``clock()`` gives the
    seconds that ``end_s`` counts. The first call compiles its kernels in parallel threads, so
    the slowest compile, not their sum, is what it waits for."""
    import triton

    comp = getattr(getattr(triton, "knobs", None), "compilation", None)
    if comp is None or not hasattr(comp, "listener"):
        return None
    log = []

    def listen(*, src, metadata, metadata_group, times, cache_hit, **_):
        stages = {"ir": getattr(times, "ir_initialization", getattr(times, "prologue", 0)) / 1e6}
        stages.update({ext: us / 1e6 for ext, us in getattr(times, "lowering_stages", ())})
        log.append({"kernel": getattr(src, "name", None), "s": times.total / 1e6, "stages": stages,
                    "cache_hit": bool(cache_hit), "end_s": clock()})

    comp.listener = listen
    return log


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=OPS, default="hla2")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--dim", type=int, default=64, help="K = V")
    ap.add_argument("--flag", choices=("gamma", "g", "normalize"), default="gamma")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--config", type=config_changes, default={}, help=HELP)
    args = ap.parse_args()
    out = {"op": args.op, "dtype": args.dtype, "K": args.dim, "V": args.dim, "flag": args.flag, "B": args.B,
           "T": args.T, "H": args.H, "pid": os.getpid(),
           "interpret": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), "config_changes": args.config}
    t0 = time.perf_counter()
    import torch

    import hla_fast

    out["import_s"] = time.perf_counter() - t0
    from ab_revision import rule_config   # after the clock: import_s is torch and hla_fast alone
    cuda = torch.cuda.is_available()
    if not cuda and not out["interpret"]:
        raise SystemExit("no CUDA device: set TRITON_INTERPRET=1 to run the kernels on the CPU")
    dev = torch.device("cuda" if cuda else "cpu")
    out["device"] = torch.cuda.get_device_name(0) if cuda else "cpu (Triton interpreter)"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    dt = getattr(torch, DTYPES[args.dtype])
    gen = torch.Generator(device=dev).manual_seed(0)
    B, T, H, D = args.B, args.T, args.H, args.dim
    q = torch.randn(B, T, H, D, device=dev, generator=gen) * 0.3
    k = torch.randn(B, T, H, D, device=dev, generator=gen) * 0.3
    if args.flag == "normalize":  # positive features: the denominator stays positive
        q, k = q.abs(), k.abs()
    q, k = q.to(dt), k.to(dt)
    v = torch.randn(B, T, H, D, device=dev, generator=gen).to(dt)
    do = torch.randn(B, T, H, D, device=dev, generator=gen).to(dt)
    g = -0.001 * torch.rand(B, T, H, device=dev, generator=gen)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]
    # the rule of a forward + backward call (hla3: the stages' pair), changed by --config
    rule = rule_config(args.op, q, v, args.config, training=True, gated=args.flag == "g",
                       normalize=args.flag == "normalize")
    out["config"] = str(rule)
    cfg = rule if args.config else None   # None: the call picks the rule itself
    float((leaves[0].float().sum() + leaves[3].sum()).item())  # a torch op on the device first
    sync()
    t0 = time.perf_counter()
    x = torch.ones(2, requires_grad=True)
    torch.autograd.grad(x * 2, [x], torch.ones(2))   # PyTorch's first-backward setup (autograd_s)
    out["autograd_s"] = time.perf_counter() - t0
    started = {"t": time.perf_counter()}   # reset to the first call's start, which end_s counts from
    compiles = compile_log(lambda: time.perf_counter() - started["t"])

    op = getattr(hla_fast, args.op)

    def call():
        ql, kl, vl, gl = leaves
        if args.flag == "g":
            return op(ql, kl, vl, g=gl, backend="triton", config=cfg)[0]
        return op(ql, kl, vl, gamma=0.999, normalize=args.flag == "normalize", backend="triton", config=cfg)[0]

    t0 = started["t"] = time.perf_counter()
    o = call()
    sync()
    t1 = time.perf_counter()
    o.backward(do)
    sync()
    t2 = time.perf_counter()
    out["fwd_s"], out["bwd_s"], out["fwdbwd_s"] = t1 - t0, t2 - t1, t2 - t0
    out["finite"] = bool(torch.isfinite(o.float()).all().item())
    for x in leaves:
        x.grad = None
    t0 = time.perf_counter()
    call().backward(do)
    sync()
    out["warm_fwdbwd_s"] = time.perf_counter() - t0
    cache = os.environ.get("TRITON_CACHE_DIR")
    if cache and os.path.isdir(cache):  # kernels compiled into the fresh cache by this process
        out["cubins"] = sum(f.endswith(".cubin") for _, _, fs in os.walk(cache) for f in fs)
    out["process_s"] = time.perf_counter() - T_START
    out["compiles"] = compiles
    print("FIRST_CALL_JSON " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
