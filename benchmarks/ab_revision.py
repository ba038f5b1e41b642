"""Time an operator of this tree's hla_fast against the hla_fast of an earlier git revision, in one
process.

The earlier package is extracted from git into a temporary folder and imported under another name,
so both run on the same GPU, inputs and Triton. bf16, B=4, H=16, T=32768 (``--T``), gamma=0.999,
K=V in {64, 128} (``--dims``); medians of triton.testing.do_bench (ms) of the whole call, forward
under no_grad and forward + backward, and the relative difference of the two revisions' outputs
and input gradients. On a CUDA machine, from the repository root:

    python benchmarks/ab_revision.py --rev 62e7c2f --out benchmarks/results/hla2_h200_ab.json
    python benchmarks/ab_revision.py --op ahla --rev 3c5b091 --out benchmarks/results/ahla_h200_ab.json
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import pathlib
import subprocess
import sys
import tempfile

import torch
import triton
from triton.testing import do_bench


def extract(rev: str, dest: pathlib.Path) -> str:
    """Write the hla_fast package of ``rev`` under dest/hla_fast_<rev>; return its module name."""
    name = f"hla_fast_{rev}"
    files = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "hla_fast"], capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if f.endswith(".py"):
            out = dest / name / pathlib.Path(f).relative_to("hla_fast")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(subprocess.run(["git", "show", f"{rev}:{f}"], capture_output=True, text=True,
                                          check=True).stdout)
    return name


def time_call(op, q, k, v, do):
    """Forward and forward + backward medians (ms) of op(q, k, v, gamma=0.999), and (o, dq, dk, dv)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def fwd():
        with torch.no_grad():
            op(q, k, v, gamma=0.999)

    def fwd_bwd():
        o, _ = op(*leaves, gamma=0.999)
        o.backward(do)
        return o

    fwd()
    o = fwd_bwd().detach()
    out = (o, *(x.grad.clone() for x in leaves))
    torch.cuda.synchronize()
    return (do_bench(fwd, warmup=10, rep=50, return_mode="median"),
            do_bench(fwd_bwd, warmup=10, rep=50, return_mode="median"), out)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the earlier git revision")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--package-dir", default=None,
                    help="a folder holding the earlier package as hla_fast_<rev> (extracted beforehand, for a "
                         "checkout without git history); default: extract it from git")
    ap.add_argument("--op", default="hla2", choices=("hla2", "ahla", "hla3"))
    ap.add_argument("--dims", default="64,128", help="comma list of K=V head sizes")
    ap.add_argument("--T", type=int, default=32768)
    args = ap.parse_args()
    if args.package_dir:
        sys.path.insert(0, args.package_dir)
        old = importlib.import_module(f"hla_fast_{args.rev}")
    else:
        tmp = pathlib.Path(tempfile.mkdtemp())
        sys.path.insert(0, str(tmp))
        old = importlib.import_module(extract(args.rev, tmp))
    import hla_fast as new

    rows = []
    for D in (int(x) for x in args.dims.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(D)
        q, k, v = (0.3 * torch.randn(4, args.T, 16, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        do = torch.randn_like(v)
        outs = {}
        for label, mod in ((args.rev, old), ("this tree", new)):
            f, fb, outs[label] = time_call(getattr(mod, args.op), q, k, v, do)
            rows.append({"K": D, "code": label, "fwd_ms": f, "fwdbwd_ms": fb})
            print(rows[-1], flush=True)
        rows[-1]["rel_diff_to_rev"] = {n: rel(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), outs["this tree"],
                                                                     outs[args.rev])}
        print(rows[-1]["rel_diff_to_rev"], flush=True)
        del q, k, v, do, outs
        torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "op": args.op, "rev": args.rev,
        "shape": {"B": 4, "T": args.T, "H": 16, "dtype": "bfloat16", "gamma": 0.999}, "rows": rows}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
