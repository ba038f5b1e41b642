"""What one training call allocates at its peak, counted on a CPU without running a kernel: this
tree's hla_fast against an earlier git revision's, in one process.

The operator's chunked function (``ahla_chunked``, ``hla2_chunked``) runs on CPU tensors with a
``launch`` that launches nothing, so every buffer its launchers allocate (``torch.empty`` on the
inputs' device) is allocated at the point where a GPU call allocates it, in the layout and dtypes
of the configuration rule (bf16 snapshots for bf16 inputs; without Triton's interpreter the rule
takes its bf16 layouts), and autograd keeps and frees what it keeps and frees on a GPU; only the
values are garbage. PyTorch's profiler (``profile_memory=True``) follows each storage from its
allocation to its free; the peak is the most held at once over one forward + backward of a loss
``(o * do).sum()``, beyond the inputs, the gradients it returns included (``ab_revision.py``'s
count on a GPU starts from the gradients of a call before, which the new ones replace: for bf16
q, k, v of one width 1.5 fp32 ``[B, T, H, K]`` tensors less than this count). The rule off CUDA walks one segment (its segment
summaries, a few small buffers, are not counted) and CUDA's allocator rounds each block up to
512 bytes: otherwise the count is what ``torch.cuda.max_memory_allocated`` shows on a GPU (compare
``ab_revision.py``'s peak). The peak is given in bytes and in fp32 ``[B, T, H, K]`` tensors; the
buffers scale with T, so a shorter sequence gives the same count in those units (T = 8192 by
default; large buffers a CPU allocates but never touches cost no memory).

``--config`` changes the rule's configuration (the same changes for both revisions).

    python benchmarks/cpu_peak.py --op ahla --rev a1dacff --normalize \\
        --out benchmarks/results/ahla_cpu_peak_k128_normalized
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import platform
import sys
import tempfile
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))   # the scripts beside this one
from ab_revision import extract, rule_config  # noqa: E402
from config_arg import DTYPES, HELP, config_changes  # noqa: E402
from records import stamp, write_record  # noqa: E402


def peak_bytes(fn) -> int:
    """The most that ``fn()`` holds allocated at once beyond what was allocated before it: the
    memory timeline of PyTorch's profiler for the CPU (``export_memory_timeline``, which tracks
    each tensor's storage from its allocation to its free, whatever operator frees it), its
    largest total less its first, the storages that existed before (PyTorch 2.13 marks that export
    deprecated in favour of CUDA's memory snapshots, which need a GPU)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)
    totals = [sum(x) for x in sizes]
    return max(totals) - totals[0]


def nothing(kernel, grid, **kwargs):
    """A launch that launches nothing (the buffers are allocated, the kernels do not run)."""


def training_call(package: str, op: str, inputs, do, normalize: bool, changes: dict):
    """(run, config): ``run()`` is one forward + backward of ``package``'s chunked ``op`` on fresh
    leaves sharing the storage of ``inputs`` (q, k, v, g or None) in the rule's training
    configuration changed by ``changes``, launching nothing."""
    chunk = importlib.import_module(f"{package}.ops.{op}.chunk")
    q, k, v, g = inputs
    cfg = rule_config(op, q, v, changes, True, gated=g is not None, normalize=normalize, package=package)
    states = (None,) * (4 if op == "ahla" else 3)   # no initial state

    def run():
        leaves = [None if x is None else x.detach().requires_grad_() for x in inputs]
        o = getattr(chunk, f"{op}_chunked")(*leaves, None if g is not None else 0.999, *states, normalize, 1e-6,
                                            config=cfg, launch=nothing)[0]
        (o * do).sum().backward()

    return run, cfg


def render_markdown(res: dict) -> str:
    s = res["shape"]
    lines = [f"# Training peak of one {res['op']} call, counted on a CPU (`cpu_peak.py`)", "",
             f"Date {res['date']}; torch {res['versions']['torch']}, python {res['versions']['python']}; "
             f"B = {s['B']}, T = {s['T']}, H = {s['H']}, K = {s['K']}, V = {s['V']}, {s['dtype']}, "
             f"{'log-gates g' if res['gates'] else 'gamma = 0.999'}{', normalized' if res['normalize'] else ''}; "
             f"config changes {json.dumps(res['config'])} from the rule's. Bytes one forward + backward "
             f"holds at its peak beyond the inputs (PyTorch profiler's memory timeline, no kernel run); "
             f"in fp32 [B, T, H, K] tensors of {res['unit_bytes']} bytes.", "",
             "| code | peak bytes | in fp32 [B, T, H, K] |", "|---|---|---|"]
    for row in res["rows"]:
        lines.append(f"| {row['code']} | {row['peak_bytes']} | {row['peak_units']:.2f} |")
    lines += ["", f"Configuration: `{res['rows'][-1]['config']}`"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the earlier git revision")
    ap.add_argument("--op", default="ahla", choices=("ahla", "hla2"))
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=None, help="value width (default: V = K)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--gates", action="store_true", help="log-gates g that require grad instead of gamma")
    ap.add_argument("--normalize", action="store_true", help="normalize=True")
    ap.add_argument("--config", type=config_changes, default={}, help=HELP + "; for both revisions")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp())
    sys.path.insert(0, str(tmp))
    old = extract(args.rev, tmp)

    dtype = getattr(torch, DTYPES[args.dtype])
    B, T, H, K, V = args.B, args.T, args.H, args.K, args.V or args.K
    q, k = (torch.empty(B, T, H, K, dtype=dtype) for _ in range(2))   # values never read
    v, do = (torch.empty(B, T, H, V, dtype=dtype) for _ in range(2))
    g = torch.empty(B, T, H) if args.gates else None
    unit = B * T * H * K * 4
    rows = []
    for label, package in ((args.rev, old), ("this tree", "hla_fast")):
        run, cfg = training_call(package, args.op, (q, k, v, g), do, args.normalize, args.config)
        run()   # once before counting: nothing a first call sets up counts
        top = peak_bytes(run)
        rows.append({"code": label, "peak_bytes": top, "peak_units": top / unit, "config": repr(cfg)})
        print({n: rows[-1][n] for n in ("code", "peak_bytes", "peak_units")}, flush=True)
    res = {**stamp(f"CPU ({platform.processor() or platform.machine()})"), "op": args.op, "rev": args.rev,
           "shape": {"B": B, "T": T, "H": H, "K": K, "V": V, "dtype": DTYPES[args.dtype]},
           "gates": args.gates, "normalize": args.normalize, "config": args.config, "unit_bytes": unit,
           "rows": rows}
    if args.out:
        write_record(args.out, res, render_markdown)


if __name__ == "__main__":
    main()
