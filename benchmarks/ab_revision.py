"""Time hla_fast.hla2 of this tree against the hla_fast of an earlier git revision, in one process.

The earlier package is extracted from git into a temporary folder and imported under another name,
so both run on the same GPU, inputs and Triton. bf16, B=4, H=16, T=32768, gamma=0.999, K=V in
{64, 128}; medians of triton.testing.do_bench (ms) of the whole call, forward under no_grad and
forward + backward. On a CUDA machine, from the repository root:

    python benchmarks/ab_revision.py --rev 62e7c2f --out benchmarks/results/hla2_h200_ab.json
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


def time_call(mod, q, k, v, do):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def fwd():
        with torch.no_grad():
            mod.hla2(q, k, v, gamma=0.999)

    def fwd_bwd():
        o, _ = mod.hla2(*leaves, gamma=0.999)
        o.backward(do)

    fwd(), fwd_bwd()
    torch.cuda.synchronize()
    return do_bench(fwd, warmup=10, rep=50, return_mode="median"), do_bench(fwd_bwd, warmup=10, rep=50,
                                                                             return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the earlier git revision")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp())
    sys.path.insert(0, str(tmp))
    old = importlib.import_module(extract(args.rev, tmp))
    import hla_fast as new

    rows = []
    for D in (64, 128):
        gen = torch.Generator(device="cuda").manual_seed(D)
        q, k, v = (0.3 * torch.randn(4, 32768, 16, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        do = torch.randn_like(v)
        for label, mod in ((args.rev, old), ("this tree", new)):
            f, fb = time_call(mod, q, k, v, do)
            rows.append({"K": D, "code": label, "fwd_ms": f, "fwdbwd_ms": fb})
            print(rows[-1], flush=True)
    res = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "shape": {"B": 4, "T": 32768, "H": 16, "dtype": "bfloat16", "gamma": 0.999}, "rows": rows}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
