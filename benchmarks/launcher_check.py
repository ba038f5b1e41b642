"""First training calls in several processes at once, each failed launch recorded: does a kernel ever
run with a launcher built for another kernel?

Why. On two H100 machines (2026-12-07, hla_fast/README.md, "GPU tests") five test runs of
``tests/fast`` under pytest-xdist (16 worker processes sharing one Triton cache) stopped at a kernel's launch with
``TypeError: function takes exactly N arguments (M given)``: the kernel's argument count was that of
the kernel itself, the launcher's that of another kernel of the same call. This script repeats the
kind of call that failed (normalized AHLA training calls with gates and an initial state, T = 2049;
segmented HLA3 training calls, T = 40), each of a new shape and dtype so that its kernels compile
(``ops/common/compile.py`` compiles a new call's kernels in parallel threads first), in ``--procs``
processes at once, with one Triton cache for all of them (``--cache shared``, as pytest-xdist
workers have) or one each (``--cache own``). A TypeError at a launch is counted as a mismatch; any
other error is recorded with its text. Needs CUDA.

Each process also reports the launcher libraries it has mapped (``/proc/self/maps``): how many,
how many of their files were replaced after it loaded them (another process wrote the same
launcher again), and how many launcher files of its cache have the inode of a library it mapped
from another path. The dynamic loader hands back a library already loaded when a new file has its
device and inode, so such a file would give a kernel another kernel's launcher; the record also
names the file system the cache is on (``/proc/mounts``).

    python benchmarks/launcher_check.py --procs 8 --cache shared --tag h100_shared
    python benchmarks/launcher_check.py --procs 8 --cache own --tag h100_own
    python benchmarks/launcher_check.py --cache-root ~/.triton --tag h100_home   # the default cache's file system
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# (operator, K, V, T) of each call a process makes, in bf16 and then fp16
CASES = [("ahla", 32, 100, 2049), ("hla3", 32, 100, 40), ("ahla", 64, 64, 2049), ("hla3", 64, 64, 40),
         ("ahla", 16, 16, 2049), ("hla3", 16, 16, 40)]
DTYPES = ("bfloat16", "float16")


def one_call(op: str, K: int, V: int, T: int, dtype) -> None:
    """One first training call: AHLA normalized with log-gates and an initial state, or HLA3 in
    chunks of 16 and two segments with a constant decay (the layouts of the failed tests)."""
    import torch

    import hla_fast

    gen = torch.Generator(device="cuda").manual_seed(K + V)
    q, k = (0.15 * torch.rand(1, T, 2, K, device="cuda", generator=gen, dtype=dtype) for _ in range(2))
    v = 0.15 * torch.rand(1, T, 2, V, device="cuda", generator=gen, dtype=dtype)
    g = -0.01 * torch.rand(1, T, 2, device="cuda", generator=gen)
    leaves = [x.requires_grad_() for x in (q, k, v, g)]
    if op == "ahla":
        state = hla_fast.AHLAState(*(0.1 * torch.rand(1, 2, K, V, device="cuda", generator=gen) for _ in range(2)),
                                   *(0.1 * torch.rand(1, 2, K, device="cuda", generator=gen) for _ in range(2)))
        o, _ = hla_fast.ahla(*leaves[:3], g=leaves[3], normalize=True, initial_state=state, output_final_state=True)
    else:
        cfg = hla_fast.ChunkConfig(fwd_chunk=16, bwd_chunk=16, fwd_block_v=16, fwd_segments=2, bwd_segments=2,
                                   grad_parts=(7,))
        o, _ = hla_fast.hla3(*leaves[:3], gamma=0.9, backend="triton", config=cfg)
    o.float().sum().backward()
    torch.cuda.synchronize()


def mapped_launchers(cache_dir: str, maps: str = "/proc/self/maps") -> dict:
    """The Triton launcher libraries this process has mapped, from ``maps``: their number, how many
    of their paths now name another inode (the file was replaced after the load) or no file, and how
    many launcher files under ``cache_dir`` have the inode of one mapped from another path (module
    docstring)."""
    by_path = {}
    try:
        with open(maps) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and "__triton_launcher" in parts[5]:
                    by_path[parts[5]] = int(parts[4])
    except OSError:
        return {}
    replaced = 0
    for path, inode in by_path.items():
        try:
            replaced += os.stat(path).st_ino != inode
        except OSError:
            replaced += 1
    mapped_inodes = set(by_path.values())
    shadowed = 0
    for root, _, files in os.walk(cache_dir):
        for name in files:
            path = os.path.join(root, name)
            if name.startswith("__triton_launcher") and name.endswith(".so") and path not in by_path:
                try:
                    shadowed += os.stat(path).st_ino in mapped_inodes
                except OSError:
                    pass
    return {"mapped": len(by_path), "replaced_after_load": replaced, "shadowed": shadowed}


def file_system(path: str, mounts: str = "/proc/mounts") -> str | None:
    """The type of the file system ``path`` is on: the longest mount point of ``mounts`` above it."""
    path, best = os.path.realpath(path), (None, "")
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) > len(best[1]):
                        best = (parts[2], parts[1])
    except OSError:
        pass
    return best[0]


def child() -> dict:
    """Every case in this process; what each call raised, if anything; its mapped launchers."""
    import torch

    rows = []
    for dtype in DTYPES:
        for op, K, V, T in CASES:
            row = dict(op=op, K=K, V=V, T=T, dtype=dtype, error=None, mismatch=False)
            try:
                one_call(op, K, V, T, getattr(torch, dtype))
            except TypeError as e:   # a launcher of another argument count (module docstring)
                row.update(error=str(e)[:300], mismatch=True)
            except Exception as e:  # noqa: BLE001 - recorded, not raised: the other calls still run
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
    return {"calls": rows, "launchers": mapped_launchers(os.environ.get("TRITON_CACHE_DIR", ""))}


def summarize(processes: list) -> dict:
    """Counts over every process's calls: calls, launcher mismatches, other errors, processes that
    did not report."""
    calls = [r for p in processes for r in p.get("calls", [])]
    loaded = [p.get("launchers") or {} for p in processes]
    return {"calls": len(calls), "mismatches": sum(r["mismatch"] for r in calls),
            "other_errors": sum(bool(r["error"]) and not r["mismatch"] for r in calls),
            "processes_without_report": sum("calls" not in p for p in processes),
            **{k: sum(x.get(k, 0) for x in loaded) for k in ("mapped", "replaced_after_load", "shadowed")}}


def render(res: dict) -> str:
    s = res["summary"]
    lines = [f"# First calls in {res['procs']} processes at once on {res['device']}", "",
             f"Date {res['date']}; torch {res['versions']['torch']}, triton {res['versions']['triton']}, python "
             f"{res['versions']['python']}; Triton cache: {res['cache']}, on {res.get('cache_fs')} "
             "(`benchmarks/launcher_check.py`).", "",
             f"{s['calls']} training calls, {s['mismatches']} launched with another kernel's launcher (TypeError), "
             f"{s['other_errors']} other errors, {s['processes_without_report']} processes without a report.", "",
             f"Launcher libraries mapped, summed over the processes: {s['mapped']}; replaced after the load: "
             f"{s['replaced_after_load']}; cache files with the inode of a library mapped from another path: "
             f"{s['shadowed']}.", ""]
    failed = [(i, r) for i, p in enumerate(res["processes"]) for r in p.get("calls", []) if r["error"]]
    if failed:
        lines += ["| process | op | dtype | K | V | T | error |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {i} | {r['op']} | {r['dtype']} | {r['K']} | {r['V']} | {r['T']} | {r['error']} |"
                  for i, r in failed]
        lines.append("")
    for i, p in enumerate(res["processes"]):
        if "calls" not in p:
            lines += [f"Process {i} did not report; its output's tail:", "", "```", p.get("tail", ""), "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    from records import portable, record_parser, stamp, write_record

    ap = record_parser(__doc__, "launcher_check", "h200")
    ap.add_argument("--procs", type=int, default=8, help="processes at once")
    ap.add_argument("--cache", choices=("shared", "own"), default="shared",
                    help="one Triton cache for every process, or one each")
    ap.add_argument("--cache-root", default=tempfile.gettempdir(),
                    help="folder the fresh Triton caches are made in (its file system is the one tested)")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds a process may take")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        from records import render_stored

        render_stored(args.render, render)
        return 0
    if args.child:
        print("LAUNCHER_CHECK_JSON " + json.dumps(child()), flush=True)
        return 0
    if args.procs < 1:
        ap.error(f"--procs must be at least 1, got {args.procs}")
    import torch

    if not torch.cuda.is_available():
        ap.error("needs CUDA: under the interpreter nothing is compiled, so no launcher is built")
    os.makedirs(args.cache_root, exist_ok=True)
    shared = tempfile.mkdtemp(prefix="triton_cache_", dir=args.cache_root)
    procs = []
    for _ in range(args.procs):
        env = dict(os.environ, TRITON_CACHE_DIR=shared if args.cache == "shared"
                   else tempfile.mkdtemp(prefix="triton_cache_", dir=args.cache_root))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    processes = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        line = [x for x in out.splitlines() if x.startswith("LAUNCHER_CHECK_JSON ")]
        processes.append(json.loads(line[-1].split(" ", 1)[1]) if line else {"tail": portable(out[-2000:])})
    res = dict(stamp(torch.cuda.get_device_name()), procs=args.procs, cache=args.cache, cache_fs=file_system(shared),
               processes=processes)
    res["summary"] = summarize(processes)
    write_record(os.path.join(args.out, f"launcher_check_{args.tag}"), res, render)
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
