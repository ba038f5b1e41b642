"""What the compiler makes of an operator's kernels for Hopper, without a GPU: shared memory and
the tiles it holds, registers, register spills and compile seconds of every launch one call makes.

The operator's launchers run on ``meta`` tensors (nothing is allocated or computed) with a
``launch`` that records (``hla_fast.ops.common.compile.Recorder``, what ``compile_ahead`` rehearses
with); each distinct launch is then compiled ahead of time for
sm_90 (``triton.compile`` on an ``ASTSource``) and its PTX assembled by the ptxas that ships with
Triton, with ``-v`` for the register and spill counts. The device is an H200-sized one (132
multiprocessors), so the layouts are those the configuration rule gives on that GPU.

    python benchmarks/compile_report.py hla2 4 32768 16 64 64 bfloat16
    python benchmarks/compile_report.py ahla 4 32768 16 128 128 bfloat16 --config '{"grad_parts": [1, 6]}'
    python benchmarks/compile_report.py ahla 4 32768 16 64 64 bfloat16 --pass forward --gates

``--pass both`` (the default) records a training call: the forward (keeping chunk states when the
configuration says so) and the backward. ``--pass forward`` records an inference forward.
Compiles run with an empty Triton cache of their own. Compile seconds include the ptxas run for
the counts; a first call on a GPU compiles the same kernels (on that machine's CPU).

Shared-memory tiles: every shared-memory allocation of the compiled kernel (Triton's GPU IR,
``local_alloc``) by shape and dtype, with how many there are. A shape with a leading count
(``2x64x64 bf16``) is a loaded tile the compiler pipelines (``num_stages``) in that many buffers;
``1x..`` is one it pipelines in a single buffer, whose load each step then waits for; one without
(``64x64 bf16``) holds a dot operand that was computed in registers.

Global loads: the load instructions of the kernel's PTX by width (``ld.global.v4.b32``: 16 bytes a
thread, ``ld.global.b16``: 2), as written once in its code (a loop's body counts once). A tile whose
rows the compiler cannot prove 16-byte aligned is read in narrow loads (AHLA's per-chunk gradient
kernel on 65 value columns: 352 two-byte loads, ``compile_ahla_bf16_k64_normalize_65_values_triton36_cpu.md``;
on 80, as on 64: loads of 16 bytes, ``common.normalize``, "Width").
"""
from __future__ import annotations

import argparse
import atexit
import collections
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):   # hla_fast, and config_arg beside this script
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import triton  # noqa: E402

from config_arg import HELP, OPS, config_changes  # noqa: E402

SMS = 132  # multiprocessors of an H200
TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
ALIGNED = [["tt.divisibility", 16]]   # the attribute the JIT gives an aligned pointer or an int divisible by 16


def hopper_launchers(op):
    """Make ``op``'s launchers plan for an H200: the shared launch arithmetic answers for 132
    multiprocessors and CUDA tiles. Returns (the operator's ``chunk`` module, the CUDA device the
    rules are asked about, a Recorder to pass as the launchers' ``launch``: its ``launches`` are
    ``(kernel, grid, kwargs)``, tensors as ``TensorArg``)."""
    from hla_fast.ops.common import launch
    from hla_fast.ops.common.compile import Recorder

    cuda = torch.device("cuda")
    launch.sm_count = lambda device: SMS
    launch.interpreter_on = lambda: False
    # hla3 runs hla2's and ahla's launchers (its two stages), hla2 as layers ahla's
    for name_op in ("hla2", "ahla") if op in ("hla2", "hla3") else (op,):
        mod = importlib.import_module(f"hla_fast.ops.{name_op}.chunk")
        for name in ("min_key_block", "min_value_block"):   # imported by name into the operator's module
            if hasattr(mod, name):
                real = getattr(launch, name)
                setattr(mod, name, lambda device, real=real: real(cuda))
        if hasattr(mod, "value_block"):
            mod.value_block = lambda V, block_v, device, real=launch.value_block: real(V, block_v, cuda)
    return importlib.import_module(f"hla_fast.ops.{op}.chunk"), cuda, Recorder()


def record_launches(op, B, T, H, K, V, dtype, changes=None, forward_only=False, gates=False, normalize=False,
                    layers=False):
    """Run ``op``'s launchers on meta tensors; return (config, [(kernel, grid, kwargs), ...]).
    normalize (HLA2 and AHLA): a normalized call, whose backward carries the ones column (``dd``;
    AHLA's: its autograd Function rehearsed, as the call runs it).
    layers (HLA2 only): the call in the layout of ``hla2_config``, which must take the first-order
    layers for it (AHLA's single-layer kernels; in key blocks for heads wider than 128), its
    autograd Function rehearsed (forward, and backward unless forward_only)."""
    if normalize and op not in ("hla2", "ahla"):
        raise ValueError(f"normalize: only hla2's and ahla's launchers are recorded normalized, not {op}'s")
    if layers and op != "hla2":
        raise ValueError(f"layers: only hla2's calls are recorded as first-order layers, not {op}'s")
    chunk, cuda, rec = hopper_launchers(op)
    import hla_fast
    from hla_fast.ops.common.launch import snapshot_dtype

    # hla2: the fused kernels' rule, whose launchers these are, or with ``layers`` hla2_config's
    rule = (chunk.hla2_config if layers else chunk.fused_config) if op == "hla2" else getattr(hla_fast, f"{op}_config")
    # the rule as the call asks it (a training call unless forward_only; hla3: its second stage's)
    kw = {"training": not forward_only} if op == "ahla" else (
        {"gated": gates, "normalize": normalize, "training": not forward_only} if op == "hla2" else
        {"gated": gates, "training": not forward_only})
    cfg = rule(B, T, H, K, V, dtype, cuda, **kw).replace(**(changes or {}))
    if layers and not cfg.layers:
        raise ValueError(f"layers: hla2_config does not take the first-order layers for K={K}, V={V}, T={T}, {dtype}")
    meta = torch.device("meta")
    q = torch.empty(B, T, H, K, dtype=dtype, device=meta)
    k = torch.empty_like(q)
    v = torch.empty(B, T, H, V, dtype=dtype, device=meta)
    do = torch.empty_like(v)
    g = torch.empty(B, T, H, device=meta) if gates else None
    gamma = None if gates else 0.999
    save = cfg.save_states and cfg.fwd_chunk == cfg.bwd_chunk and not forward_only
    if (op == "hla2" and layers) or (op == "ahla" and normalize):
        from hla_fast.ops.common.compile import rehearse

        def call(q, k, v, g, launch):
            if op == "ahla":
                return chunk.ahla_chunked(q, k, v, g, gamma, None, None, None, None, True, 1e-6, cfg, launch=launch)
            return chunk.hla2_chunked(q, k, v, g, gamma, None, None, None, normalize, 1e-6, cfg, launch=launch)

        rehearse(call, tuple(None if x is None else x.requires_grad_(not forward_only) for x in (q, k, v, g)), rec)
    elif op == "hla2":
        snap = snapshot_dtype(cfg, dtype) if save else None
        cs = chunk.fwd_launch(q, k, v, g, gamma, None, None, None, snapshots=snap, normalize=normalize, eps=1e-6,
                              launch=rec, **chunk.forward_layout(cfg))[5]
        if not forward_only:
            dd = torch.empty(B, T, H, device=meta) if normalize else None
            chunk.bwd_launch(q, k, v, do, g, gamma, None, None, None, None, cfg, states=cs, want_db=gates,
                             dd=dd, launch=rec)
    elif op == "ahla":
        snap = snapshot_dtype(cfg, dtype) if save else None
        cs = chunk.fwd_launch(q, k, v, g, gamma, None, None, None, snapshots=snap, keep_r=cfg.bwd_layers,
                              launch=rec, **chunk.forward_layout(cfg))[5]
        if not forward_only:
            chunk.bwd_launch(q, k, v, do, g, gamma, None, None, None, None, cfg, states=cs, want_db=gates,
                             launch=rec)
    else:   # hla3: its autograd Function itself (both stages, and their backward when training)
        from hla_fast.ops.common.compile import rehearse

        # the first stage in its own rule's layout (the config changes apply to both stages), or,
        # when the second runs as layers, in the same walk (``hla3.chunk.stage_configs``)
        if cfg.layers:
            cfg1, cfg = chunk.stage_configs(cfg)
        else:
            cfg1 = chunk.first_stage_config(B, T, H, K, V, dtype, cuda, training=not forward_only).replace(
                **(changes or {}))

        def call(q, k, v, g, launch):
            return chunk.HLA3StagedFunction.apply(q, k, v, g, None, None, None, gamma, cfg1, cfg, launch)

        rehearse(call, tuple(None if x is None else x.requires_grad_(not forward_only) for x in (q, k, v, g)), rec)
    return cfg, rec.launches


def _ptxas():
    """The ptxas Triton itself uses for sm_90 (``get_ptxas``; its signature differs between
    Triton versions)."""
    from triton.backends.nvidia import compiler

    try:
        tool = compiler.get_ptxas(90)
    except TypeError:
        tool = compiler.get_ptxas()
    return tool.path


def has_cuda_compiler() -> bool:
    """Whether this Triton can compile for a CUDA target without a GPU (its CUDA backend)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return False
    return True


def hopper_compile(kernel, kw):
    """Compile the launch ``kernel[grid](**kw)`` (a recorded one) for sm_90: the kernel's
    ``triton.heuristics`` applied, tensors (or their recorded ``TensorArg``) typed by dtype, None
    and constexprs specialized, and the other arguments specialized as Triton's JIT does at a
    launch (but for ``do_not_specialize``): pointers 16-byte aligned, integers equal to 1 as
    constants, integers divisible by 16 marked so. Without those marks the compiler cannot widen
    the loads nor pipeline a loop's loads (``num_stages``), and the counts would not be the GPU's.
    Returns (the CompiledKernel, num_warps)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hla_fast.ops.common.compile import TensorArg

    args = dict(kw)
    options = dict(num_warps=args.pop("num_warps", 4), num_stages=args.pop("num_stages", 3))
    fn = kernel
    if isinstance(kernel, triton.runtime.Heuristics):   # the kernel's triton.heuristics, applied
        for name, rule in kernel.values.items():
            args[name] = rule(args)
        fn = kernel.fn
    loose = set(getattr(fn, "do_not_specialize", None) or ())
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        x = args.get(p.name, p.default)
        if p.is_constexpr or x is None:
            sig[p.name] = "constexpr"
            consts[(i,)] = x
        elif isinstance(x, (torch.Tensor, TensorArg)):
            sig[p.name] = TYPES[x.dtype]
            attrs[(i,)] = ALIGNED      # a fresh torch allocation: 16-byte aligned, as the JIT finds it
        elif isinstance(x, float):
            sig[p.name] = "fp32"
        elif p.name in loose or i in loose:
            sig[p.name] = "i32"
        elif x == 1:                   # the JIT compiles an int argument equal to 1 as a constant
            sig[p.name] = "constexpr"
            consts[(i,)] = 1
        else:
            sig[p.name] = "i32"
            if x % 16 == 0:            # and marks one divisible by 16
                attrs[(i,)] = ALIGNED
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    return compiled, options["num_warps"]


def compile_launch(kernel, kw, ptxas):
    """Compile one recorded launch for sm_90; its shared bytes, registers, spill bytes and seconds."""
    t0 = time.perf_counter()
    compiled, warps = hopper_compile(kernel, kw)
    fn = kernel.fn
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        run = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed on {fn.__name__}: {run.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", run.stderr)
    spill = {kind: int(n) for n, kind in re.findall(r"(\d+) bytes spill (stores|loads)", run.stderr)}
    return {"kernel": fn.__name__, "warps": warps, "shared_bytes": compiled.metadata.shared,
            "registers": int(regs.group(1)) if regs else None, "spill_stores": spill.get("stores", 0),
            "spill_loads": spill.get("loads", 0), "seconds": round(seconds, 2),
            "shared_tiles": shared_tiles(compiled.asm["ttgir"]), "global_loads": global_loads(compiled.asm["ptx"])}


def global_loads(ptx: str) -> list:
    """[[width, count], ...] of the PTX's global load instructions (``ld.global`` with its vector
    and element width, cache qualifiers dropped), the most frequent first (module docstring)."""
    found = collections.Counter((m.group(1) or "") + m.group(2) for m in
                                re.finditer(r"\bld\.global(?:\.[a-z]+[0-9]*::?[a-z0-9_:]+|\.nc|\.L[12]::[a-z0-9_]+)*"
                                            r"(\.v[248])?(\.[bfsu](?:8|16|32|64))\b", ptx))
    return [[w.lstrip("."), n] for w, n in sorted(found.items(), key=lambda x: (-x[1], x[0]))]


def shared_tiles(ttgir: str) -> list:
    """[[shape and dtype, count], ...] of a kernel's shared-memory allocations (``local_alloc`` in
    its GPU IR), the widest first: e.g. [["2x64x64 bf16", 3], ["64x64 bf16", 5]] (module docstring)."""
    found = collections.Counter(re.findall(r"ttg\.local_alloc\b[^\n]*?-> !ttg\.memdesc<([0-9x]+)x([a-z]+[0-9]+)[,>]",
                                           ttgir))
    return [[f"{shape} {dt}", n] for (shape, dt), n in sorted(found.items(), key=lambda x: (-x[0][0].count("x"), x[0]))]


def report(op, B, T, H, K, V, dtype, changes=None, forward_only=False, gates=False, only=None, normalize=False,
           layers=False):
    """Compile every distinct launch of one call; returns {"config": str, "kernels": [row, ...]}."""
    from hla_fast.ops.common.compile import TensorArg

    cfg, log = record_launches(op, B, T, H, K, V, dtype, changes, forward_only, gates, normalize, layers)
    ptxas = _ptxas()
    rows, seen = [], set()
    for kernel, _, kw in log:
        name = kernel.fn.__name__
        if only and only not in name:
            continue
        # arguments the kernel does not specialize on (do_not_specialize) do not make a new compile
        loose = set(getattr(kernel.fn, "do_not_specialize", None) or ())
        key = (name, tuple(sorted((a, str(b.dtype) if isinstance(b, TensorArg) else repr(b)) for a, b in kw.items()
                                  if a not in loose)))
        if key in seen:
            continue
        seen.add(key)
        rows.append(compile_launch(kernel, kw, ptxas))
    return {"config": str(cfg), "kernels": rows}


def render(res):
    # records written before the shared-memory tiles were reported render as they were
    tiles = bool(res["kernels"]) and all("shared_tiles" in r for r in res["kernels"])
    loads = bool(res["kernels"]) and all("global_loads" in r for r in res["kernels"])
    head = ["kernel", "warps", "shared KB", "registers", "spill stores B", "spill loads B", "compile s"]
    head += ["shared-memory tiles"] if tiles else []
    head += ["global loads"] if loads else []
    lines = [f"`{res['config']}`", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["kernels"]:
        cells = [f"`{r['kernel']}`", r["warps"], f"{r['shared_bytes'] / 1024:.1f}", r["registers"], r["spill_stores"],
                 r["spill_loads"], r["seconds"]]
        cells += [", ".join(f"{n} x {s}" for s, n in r["shared_tiles"])] if tiles else []
        cells += [", ".join(f"{n} x {w}" for w, n in r["global_loads"])] if loads else []
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    total = sum(r["seconds"] for r in res["kernels"])
    n = len(res["kernels"])
    lines += ["", f"{n} kernel{'' if n == 1 else 's'}, {total:.1f} s of compiles."]
    return "\n".join(lines)


def render_record(res):
    """The markdown of a record written by ``--out``: what was compiled, where, then the table."""
    v = res["versions"]
    return "\n".join([f"# Kernels compiled for sm_90: `compile_report.py {res['call']}`", "",
                      f"Date {res['date']}; torch {v['torch']}, triton {v['triton']}, python {v['python']}; "
                      f"compiled on a CPU ({res['cpu']}), no GPU.", "", render(res)])


render_markdown = render_record   # the name the other benchmark scripts give their record renderer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("op", choices=OPS)
    for name in ("B", "T", "H", "K", "V"):
        ap.add_argument(name, type=int)
    ap.add_argument("dtype", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--config", type=config_changes, default={}, help=HELP)
    ap.add_argument("--pass", dest="which", choices=("both", "forward"), default="both")
    ap.add_argument("--gates", action="store_true", help="log-gates g (that require grad) instead of gamma")
    ap.add_argument("--normalize", action="store_true", help="a normalized call (hla2, ahla)")
    ap.add_argument("--layers", action="store_true",
                    help="hla2 as first-order layers in its rule's layout (hla2_config must take them)")
    ap.add_argument("--only", default=None, help="compile only kernels whose name contains this")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    ap.add_argument("--out", default=None, help="also write OUT.json and OUT.md (with date, versions, CPU)")
    args = ap.parse_args(argv)
    # compile for the GPU, not the interpreter (read when the kernels' modules are imported), into
    # an empty Triton cache of this run's own, so that compile seconds are compiles, not cache hits
    os.environ.pop("TRITON_INTERPRET", None)
    cache = tempfile.mkdtemp(prefix="hla-compile-report-")
    os.environ["TRITON_CACHE_DIR"] = cache
    atexit.register(shutil.rmtree, cache, True)
    res = report(args.op, args.B, args.T, args.H, args.K, args.V, getattr(torch, args.dtype), args.config,
                 args.which == "forward", args.gates, args.only, args.normalize, args.layers)
    if args.out:
        import datetime
        import platform

        res = {"call": " ".join(sys.argv[1:]) if argv is None else " ".join(argv),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "versions": {"torch": torch.__version__, "triton": triton.__version__,
                            "python": platform.python_version()},
               "cpu": f"{platform.machine()}, {os.cpu_count()} cores", **res}
        with open(args.out + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(render_record(res) + "\n")
    print(json.dumps(res, indent=1) if args.json else render(res))


if __name__ == "__main__":
    main()
