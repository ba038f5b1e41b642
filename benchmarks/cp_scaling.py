"""Context-parallel scaling of hla_fast's operators: compute against communication.

For each operator, slice length per rank T_r and the ranks of the launch, it times (median over
``--iters`` after ``--warmup``, every rank, the slowest rank reported):

    slice       the operator on this rank's slice alone (no context parallelism): the compute floor
    cp          ``hla_fast.context_parallel`` on the slice (two runs of the operator, the extra
                pieces, the exchange, the fold), forward and forward + backward
    exchange    one all-gather of a buffer of the summary's size alone (the communication)

    single      the whole sequence (T_r x ranks) on rank 0's device alone, forward + backward: what
                the ranks replace (``--no-single`` skips it; a sequence that does not fit is recorded
                as such)

with the peak memory of a forward + backward on CUDA (the largest rank's), the bytes each rank
sends (its summary), and a correctness check at the first slice length of ``--T``: the output and every
input gradient (dq, dk, dv, dg) of context_parallel against the whole sequence in one process (all
slices gathered onto every rank and run there), as relative errors.

Launch with torchrun (world size, rank and local rank from its environment; NCCL on CUDA, gloo on
a CPU); without torchrun it runs one process, which rehearses every code path (the exchange is then
an all-gather over one rank):

    torchrun --nproc_per_node 2 benchmarks/cp_scaling.py --tag h200x2           # GPUs: totals 64k..256k
    torchrun --nproc_per_node 2 benchmarks/cp_scaling.py --cpu-smoke --out DIR  # gloo, tiny sizes
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
    p.add_argument("--T", default=None, help="comma-separated slice lengths per rank (default 32768,65536,131072; "
                   "100,64 with --cpu-smoke); the first is also the correctness check's")
    p.add_argument("--no-single", action="store_true", help="skip the whole sequence on one device")
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
        a.T, a.H, a.K, a.V, a.dtype, a.iters, a.warmup = a.T or "100,64", 2, 16, 16, "fp32", 2, 1
        a.backend = a.backend or "torch"
        a.tag = a.tag or "cpu_smoke"
    a.T = a.T or "32768,65536,131072"
    a.ops = [x for x in a.ops.split(",") if x]
    a.T = [int(x) for x in a.T.split(",") if x]
    return a


def setup(cpu: bool = False):
    """(rank, world, device): the torchrun group, or a one-process group for a rehearsal. On CUDA
    one GPU a rank over NCCL, unless ``cpu`` (the --cpu-smoke rehearsal: gloo on the CPU, also on a
    machine with fewer GPUs than ranks)."""
    cuda = torch.cuda.is_available() and not cpu
    if "WORLD_SIZE" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if cuda:
            torch.cuda.set_device(local)
            dist.init_process_group("nccl")
            return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    store = os.path.join(tempfile.mkdtemp(), "rendezvous")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return 0, 1, torch.device("cuda" if cuda else "cpu")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn, device, iters, warmup, before=None):
    """Median seconds of fn() on this process over iters (after warmup); ``before()`` runs ahead
    of each timed call, outside the time."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def max_over_ranks(x, device):
    """The largest value of the number x over the ranks."""
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(fn, device, iters, warmup):
    """Median seconds of fn() over iters (after warmup), the slowest rank's (ranks start together)."""
    return max_over_ranks(median_s(fn, device, iters, warmup, before=dist.barrier), device)


def local_peak_bytes(fn, device):
    """Peak CUDA memory allocated during one fn() on this process, or None off CUDA."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return int(torch.cuda.max_memory_allocated(device))


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
    """Relative errors of context_parallel against the whole sequence in one process: the output
    ``o`` and the gradients ``dq, dk, dv`` (and ``dg`` with gates) of <o, w> for a random w, this
    rank's slice of each; the largest over the ranks."""
    q, k, v, kw = inputs(a, T, rank, device, seed=7)
    w = torch.randn(q.shape[0], T, a.H, a.V, generator=torch.Generator().manual_seed(11 + rank)).to(device)

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    def leaves(q, k, v, kw):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        kw = {n: (x.detach().clone().requires_grad_() if torch.is_tensor(x) else x) for n, x in kw.items()}
        return xs, kw

    (lq, lk, lv), lkw = leaves(q, k, v, kw)
    o, _ = hla_fast.context_parallel(name, lq, lk, lv, normalize=a.normalize, backend=a.backend, **lkw)
    grads = torch.autograd.grad((o.float() * w).sum(), [lq, lk, lv] + ([lkw["g"]] if "g" in lkw else []))
    full = {n: (gather(x) if torch.is_tensor(x) else x) for n, x in kw.items()}
    (fq, fk, fv), fkw = leaves(gather(q), gather(k), gather(v), full)
    ref, _ = getattr(hla_fast, name)(fq, fk, fv, normalize=a.normalize, backend=a.backend, **fkw)
    ref_grads = torch.autograd.grad((ref.float() * gather(w)).sum(), [fq, fk, fv] + ([fkw["g"]] if "g" in fkw else []))
    mine = slice(rank * T, (rank + 1) * T)
    names = ["o", "dq", "dk", "dv", "dg"][:2 + len(grads)]
    pairs = [(o, ref[:, mine])] + [(g, r[:, mine]) for g, r in zip(grads, ref_grads)]
    errs = torch.tensor([float((x.detach().double() - y.detach().double()).norm() / y.detach().double().norm())
                         for x, y in pairs], dtype=torch.float64, device=device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    return dict(zip(names, errs.tolist()))


def peak_bytes(fn, device):
    """Peak CUDA memory allocated during one fn() (the largest rank's), or None off CUDA."""
    peak = local_peak_bytes(fn, device)
    return None if peak is None else int(max_over_ranks(peak, device))


def single_device(a, name, T_total, device):
    """The whole sequence on this device alone, no collectives: (median fwd+bwd ms, peak bytes or
    None off CUDA), or (None, None) when it does not fit in memory."""
    op = getattr(hla_fast, name)
    try:
        q, k, v, kw = inputs(a, T_total, 0, device, seed=3)
        xs = [x.requires_grad_() for x in (q, k, v)] + ([kw["g"].requires_grad_()] if "g" in kw else [])

        def fwdbwd():
            o, _ = op(q, k, v, normalize=a.normalize, backend=a.backend, **kw)
            torch.autograd.grad(o.float().sum(), xs)

        ms = 1e3 * median_s(fwdbwd, device, a.iters, a.warmup)
        return ms, local_peak_bytes(fwdbwd, device)
    except torch.OutOfMemoryError:
        return None, None


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
    row["slice_fwdbwd_peak_bytes"] = peak_bytes(lambda: fwdbwd(False), device)
    row["cp_fwdbwd_peak_bytes"] = peak_bytes(lambda: fwdbwd(True), device)
    if not a.no_single:
        # the whole sequence on rank 0's device; the other ranks wait at the barrier
        if rank == 0:
            ms, peak = single_device(a, name, T * world, device)
            row.update(single_fwdbwd_ms=ms, single_fwdbwd_peak_bytes=peak, single_fits=ms is not None)
            if ms is not None:
                row["single_over_cp_fwdbwd"] = ms / row["cp_fwdbwd_ms"]
        dist.barrier()
    return row


def _mb(x):
    return "-" if x is None else f"{x / 2**20:,.0f}"


def _ms(x):
    return "-" if x is None else f"{x:.3f}"


def markdown(meta, rows):
    lines = [f"# Context-parallel scaling ({meta['device']}, {meta['world']} ranks, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta.get('triton')}, NCCL {meta.get('nccl')}; {meta['dtype']}, "
             f"B={meta['B']}, H={meta['H']}, K={meta['K']}, V={meta['V']}, decay {meta['decay']}, "
             f"normalize={meta['normalize']}, backend {meta['backend']}; environment {meta.get('env')}. Median ms "
             "of the slowest rank. `slice`: the operator on one rank's slice alone; `cp`: context_parallel on it; "
             "`exchange`: one all-gather of the summary alone; `single`: the whole sequence on one device "
             "(rank 0's), forward + backward; peaks: CUDA memory of one forward + backward, the largest rank's.", "",
             "| op | T/rank | T total | summary bytes/rank | slice fwd | cp fwd | cp/slice | slice fwd+bwd "
             "| cp fwd+bwd | cp/slice | exchange | cp peak MB/rank | single fwd+bwd | single peak MB | single/cp |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        single = ("does not fit" if r.get("single_fits") is False else _ms(r.get("single_fwdbwd_ms")))
        ratio = r.get("single_over_cp_fwdbwd")
        lines.append(f"| {r['op']} | {r['T_per_rank']} | {r['T_total']} | {r['summary_bytes_per_rank']} | "
                     f"{r['slice_fwd_ms']:.3f} | {r['cp_fwd_ms']:.3f} | {r['cp_over_slice_fwd']:.2f} | "
                     f"{r['slice_fwdbwd_ms']:.3f} | {r['cp_fwdbwd_ms']:.3f} | {r['cp_over_slice_fwdbwd']:.2f} | "
                     f"{r['exchange_ms']:.3f} | {_mb(r.get('cp_fwdbwd_peak_bytes'))} | {single} | "
                     f"{_mb(r.get('single_fwdbwd_peak_bytes'))} | {'-' if ratio is None else f'{ratio:.2f}'} |")
    lines += ["", f"Exactness at T/rank = {meta.get('check_T')} (relative error against one process on the whole "
              "sequence, the largest rank's):", ""]
    for n, e in meta["exactness"].items():
        lines.append(f"- {n}: " + ", ".join(f"{k} {x:.1e}" for k, x in e.items()))
    lines.append("")
    return "\n".join(lines)


def _version(module):
    try:
        return __import__(module).__version__
    except Exception:
        return None


def main(argv=None):
    a = parse(argv)
    rank, world, device = setup(cpu=a.cpu_smoke)
    torch.manual_seed(0)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "world": world, "torch": torch.__version__, "dtype": a.dtype, "B": a.B, "H": a.H, "K": a.K, "V": a.V,
            "decay": a.decay, "normalize": a.normalize, "backend": a.backend or "default", "exactness": {},
            "check_T": a.T[0], "triton": _version("triton"),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
            "env": {n: os.environ.get(n) for n in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}}
    names = [n for n in a.ops if hasattr(hla_fast, n)]
    rows = []
    tag = a.tag or (f"{world}ranks")
    for name in names:
        meta["exactness"][name] = check_exact(a, name, a.T[0], rank, world, device)
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
    if "WORLD_SIZE" in os.environ:
        # A torchrun rank ends here without the interpreter's teardown. On gloo (the CPU rehearsal) a
        # rank now and then aborted at exit, after its work, the report and destroy_process_group
        # were done: "terminate called without an active exception" with no Python frame on the
        # stack (a native thread of the distributed runtime destroyed while still joinable), which
        # torchrun reports as a failed launch and the rehearsal test as a failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
