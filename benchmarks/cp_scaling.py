"""Context-parallel scaling of hla_fast's operators: compute against communication.

For each operator, slice length per rank T_r and the ranks of the launch, it times (median over
``--iters`` after ``--warmup``, every rank, the slowest rank reported):

    slice       the operator on this rank's slice alone (no context parallelism): the compute floor
    cp          ``hla_fast.context_parallel`` on the slice (two runs of the operator, the extra
                pieces, the exchange, the fold), forward and forward + backward
    exchange    one all-gather of a buffer of the summary's size alone (the communication)

and records the bytes each rank sends (its summary) and a correctness check of the first
configuration against one process (all slices gathered onto every rank and run there).

Launch with torchrun (world size, rank and local rank from its environment; NCCL on CUDA, gloo on
a CPU); without torchrun it runs one process, which rehearses every code path (the exchange is then
an all-gather over one rank):

    torchrun --nproc_per_node 8 benchmarks/cp_scaling.py --tag h200x8           # GPUs, defaults below
    python benchmarks/cp_scaling.py --cpu-smoke --out smoke-results            # one process, tiny sizes

Writes ``<out>/cp_<tag>.json`` and ``<out>/cp_<tag>.md`` on rank 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

if "--cpu-smoke" in sys.argv:  # must precede importing triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hla_fast  # noqa: E402
from hla_fast.ops.cp import summary_numbers  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="hla2,ahla,hla3", help="comma-separated operators")
    p.add_argument("--T", default=None, help="comma-separated slice lengths per rank (default 4096,16384,32768; "
                   "64,100 with --cpu-smoke)")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--V", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--backend", default=None, choices=[None, "triton", "torch"])
    p.add_argument("--decay", default="g", choices=["gamma", "g"], help="constant gamma or log-gates g")
    p.add_argument("--normalize", action="store_true")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on a CPU, torch backend, fp32")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.T, a.H, a.K, a.V, a.dtype, a.iters, a.warmup = a.T or "64,100", 2, 16, 16, "fp32", 2, 1
        a.backend = a.backend or "torch"
        a.tag = a.tag or "cpu_smoke"
    a.T = a.T or "4096,16384,32768"
    a.ops = [x for x in a.ops.split(",") if x]
    a.T = [int(x) for x in a.T.split(",") if x]
    return a


def setup():
    """(rank, world, device): the torchrun group, or a one-process group for a rehearsal."""
    if "WORLD_SIZE" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            dist.init_process_group("nccl")
            return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    store = os.path.join(tempfile.mkdtemp(), "rendezvous")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, iters, warmup):
    """Median seconds of fn() over iters (after warmup), the slowest rank's (ranks start together)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def inputs(a, T, rank, device, seed=0):
    gen = torch.Generator().manual_seed(seed + 1000 * rank + T)
    dt = DTYPES[a.dtype]
    draw = torch.rand if a.normalize else torch.randn   # positive q, k keep a normalized denominator > 0
    mk = lambda *s: draw(*s, generator=gen) * 0.3  # noqa: E731
    q, k = mk(a.B, T, a.H, a.K), mk(a.B, T, a.H, a.K)
    v = torch.randn(a.B, T, a.H, a.V, generator=gen)
    kw = {"gamma": 0.999} if a.decay == "gamma" else {"g": -0.001 * torch.rand(a.B, T, a.H, generator=gen)}
    q, k, v = (x.to(device=device, dtype=dt) for x in (q, k, v))
    kw = {n: (x.to(device) if torch.is_tensor(x) else x) for n, x in kw.items()}
    return q, k, v, kw


def check_exact(a, name, T, rank, world, device):
    """Relative error of context_parallel's output against the whole sequence in one process."""
    q, k, v, kw = inputs(a, T, rank, device, seed=7)
    o, _ = hla_fast.context_parallel(name, q, k, v, normalize=a.normalize, backend=a.backend, **kw)

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    full = {"g": gather(kw["g"])} if "g" in kw else dict(kw)
    ref, _ = getattr(hla_fast, name)(gather(q), gather(k), gather(v), normalize=a.normalize, backend=a.backend, **full)
    ref = ref[:, rank * T:(rank + 1) * T]
    err = float((o.double() - ref.double()).norm() / ref.double().norm())
    err = torch.tensor([err], dtype=torch.float64, device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return float(err)


def run_row(a, name, T, rank, world, device):
    op = getattr(hla_fast, name)
    q, k, v, kw = inputs(a, T, rank, device)
    call = dict(normalize=a.normalize, backend=a.backend)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    if "g" in kw:
        kw["g"].requires_grad_()
        leaves.append(kw["g"])

    def fwd(cp):
        with torch.no_grad():
            return hla_fast.context_parallel(name, q, k, v, **call, **kw) if cp else op(q, k, v, **call, **kw)

    def fwdbwd(cp):
        o, _ = hla_fast.context_parallel(name, q, k, v, **call, **kw) if cp else op(q, k, v, **call, **kw)
        torch.autograd.grad(o.float().sum(), leaves)

    n = summary_numbers(name, a.K, a.V, a.normalize) * a.B * a.H
    sd = torch.float64 if DTYPES[a.dtype] == torch.float64 else torch.float32
    buf = torch.randn(n, device=device, dtype=sd)
    outs = [torch.empty_like(buf) for _ in range(world)]
    row = {"op": name, "world": world, "T_per_rank": T, "T_total": T * world,
           "summary_bytes_per_rank": n * buf.element_size(),
           "slice_fwd_ms": 1e3 * timed(lambda: fwd(False), device, a.iters, a.warmup),
           "cp_fwd_ms": 1e3 * timed(lambda: fwd(True), device, a.iters, a.warmup),
           "slice_fwdbwd_ms": 1e3 * timed(lambda: fwdbwd(False), device, a.iters, a.warmup),
           "cp_fwdbwd_ms": 1e3 * timed(lambda: fwdbwd(True), device, a.iters, a.warmup),
           "exchange_ms": 1e3 * timed(lambda: dist.all_gather(outs, buf), device, a.iters, a.warmup)}
    row["cp_over_slice_fwd"] = row["cp_fwd_ms"] / row["slice_fwd_ms"]
    row["cp_over_slice_fwdbwd"] = row["cp_fwdbwd_ms"] / row["slice_fwdbwd_ms"]
    return row


def markdown(meta, rows):
    lines = [f"# Context-parallel scaling ({meta['device']}, {meta['world']} ranks, {meta['date']})", "",
             f"torch {meta['torch']}; {meta['dtype']}, B={meta['B']}, H={meta['H']}, K={meta['K']}, V={meta['V']}, "
             f"decay {meta['decay']}, normalize={meta['normalize']}, backend {meta['backend']}; median ms of "
             "the slowest rank. `slice`: the operator on one rank's slice alone; `cp`: context_parallel on it; "
             "`exchange`: one all-gather of the summary alone.", "",
             "| op | T/rank | T total | summary bytes/rank | slice fwd | cp fwd | cp/slice | slice fwd+bwd "
             "| cp fwd+bwd | cp/slice | exchange |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['T_per_rank']} | {r['T_total']} | {r['summary_bytes_per_rank']} | "
                     f"{r['slice_fwd_ms']:.3f} | {r['cp_fwd_ms']:.3f} | {r['cp_over_slice_fwd']:.2f} | "
                     f"{r['slice_fwdbwd_ms']:.3f} | {r['cp_fwdbwd_ms']:.3f} | {r['cp_over_slice_fwdbwd']:.2f} | "
                     f"{r['exchange_ms']:.3f} |")
    lines += ["", "Exactness (relative error of the output against one process on the whole sequence): "
              + ", ".join(f"{n} {e:.1e}" for n, e in meta["exactness"].items()), ""]
    return "\n".join(lines)


def main(argv=None):
    a = parse(argv)
    rank, world, device = setup()
    torch.manual_seed(0)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "world": world, "torch": torch.__version__, "dtype": a.dtype, "B": a.B, "H": a.H, "K": a.K, "V": a.V,
            "decay": a.decay, "normalize": a.normalize, "backend": a.backend or "default", "exactness": {}}
    names = [n for n in a.ops if hasattr(hla_fast, n)]
    rows = []
    tag = a.tag or (f"{world}ranks")
    for name in names:
        meta["exactness"][name] = check_exact(a, name, min(a.T), rank, world, device)
        for T in a.T:
            rows.append(run_row(a, name, T, rank, world, device))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
                os.makedirs(a.out, exist_ok=True)
                with open(os.path.join(a.out, f"cp_{tag}.json"), "w") as fh:
                    json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    if rank == 0:
        with open(os.path.join(a.out, f"cp_{tag}.md"), "w") as fh:
            fh.write(markdown(meta, rows))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
