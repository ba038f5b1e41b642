"""AHLA's forward walk kernel alone, with the state update's decay on the columns of K^T or on the
rows of V and R (``_chunk_carry``'s SCALE_ROWS), in several layouts: the measurement behind
``SCALE_ROWS_MIN_CHUNK`` in ``hla_fast/ops/ahla/chunk.py``.

bf16, B = 4, H = 16, K = V = 128, T = 32768, gamma = 0.999, one segment. Each layout runs in its own
process: a forward at T = 777 against the float64 torch path first, then the walk kernel of the
full shape, launched as the operator launches it but for SCALE_ROWS, timed alone
(triton.testing.do_bench, median ms). On a CUDA machine, from the repository root:

    python benchmarks/walk_rows.py --out benchmarks/results --tag h200_chunk128 [--layouts 64:4:1,128:8:2]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from records import portable, write_record  # noqa: E402

LAYOUTS = "64:4:1,64:4:2,64:8:1,64:8:2,128:8:1,128:8:2"   # chunk:warps:stages


def one(spec):
    """Check, then time, one (chunk, warps, stages, scale_rows) layout; returns a result row."""
    import torch
    import triton

    import hla_fast
    from bench_hla2 import make_inputs
    from hla_fast.ops.ahla import chunk as C
    from hla_fast.ops.common.compile import launch_kernel

    B, T, H, D = 4, 32768, 16, 128
    dev = torch.device("cuda")
    changes = {"fwd_chunk": spec["chunk"], "fwd_warps": spec["warps"], "fwd_stages": spec["stages"],
               "fwd_prefetch": False, "fwd_segments": 1}
    calls = []

    def launch(kernel, grid, **kw):   # the operator's launch, with SCALE_ROWS as the layout asks
        kw["SCALE_ROWS"] = spec["scale_rows"]
        calls.append((kernel, grid, kw))
        launch_kernel(kernel, grid, **kw)

    def forward(q, k, v, cfg):
        return C.fwd_launch(q, k, v, None, 0.999, None, None, None, chunk=cfg.fwd_chunk, segments=1,
                            warps=cfg.fwd_warps, block_v=cfg.fwd_block_v, stages=cfg.fwd_stages,
                            prefetch=False, store_final=False, launch=launch)[0]

    row = dict(spec)
    with torch.no_grad():
        qs, ks, vs = make_inputs(1, 777, 2, D, D, seed=3)
        small = hla_fast.ahla_config(1, 777, 2, D, D, torch.bfloat16, dev).replace(**changes)
        o = forward(qs, ks, vs, small)
        ref = hla_fast.ahla(qs.double(), ks.double(), vs.double(), gamma=0.999, backend="torch")[0]
        row["rel_err_T777"] = float((o.double() - ref).norm() / ref.norm())
        q, k, v = make_inputs(B, T, H, D, D)
        cfg = hla_fast.ahla_config(B, T, H, D, D, torch.bfloat16, dev).replace(**changes)
        calls.clear()
        forward(q, k, v, cfg)
        (kernel, grid, kw), = calls
        row["walk_ms"] = triton.testing.do_bench(lambda: launch_kernel(kernel, grid, **kw))
    return row


def parse_layouts(text):
    """'64:4:1,128:8:2' -> [(64, 4, 1), (128, 8, 2)] (chunk, warps, stages); a clear error else."""
    try:
        out = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        out = None
    if not out or any(len(t) != 3 for t in out):
        raise argparse.ArgumentTypeError(f"--layouts: expected chunk:warps:stages[,...], got {text!r}")
    return out


def render_markdown(res):
    """The record's markdown: one row per (layout, decay placement)."""
    a = res["args"]
    lines = [f"# AHLA forward walk kernel: decay on K^T's columns or on V's and R's rows ({res['device']})", "",
             f"Date {res['date']}; versions {res['versions']}; shape {res['shape']}; one segment, value blocks "
             f"of 64, no loading ahead. `python benchmarks/walk_rows.py --layouts {a['layouts']} --tag {a['tag']}`.",
             "", "| chunk | warps | stages | decay on | walk ms (median) | rel. error at T = 777 |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        ms = f"{r['walk_ms']:.3f}" if "walk_ms" in r else r.get("error", "-")[-80:].replace("|", "/").replace("\n", " ")
        err = f"{r['rel_err_T777']:.2e}" if "rel_err_T777" in r else "-"
        lines.append(f"| {r['chunk']} | {r['warps']} | {r['stages']} | "
                     f"{'V, R rows' if r['scale_rows'] else 'K^T columns'} | {ms} | {err} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="h200_chunk128", help="files ahla_<tag>.json and ahla_<tag>.md")
    ap.add_argument("--layouts", default=LAYOUTS, type=parse_layouts,
                    help=f"comma list of chunk:warps:stages (default {LAYOUTS})")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(json.loads(args.one))), flush=True)
        return
    import torch
    import triton

    if not torch.cuda.is_available():
        print("walk_rows.py times compiled kernels: it needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    rows = []
    for chunk, warps, stages in args.layouts:
        for scale_rows in (False, True):
            spec = {"chunk": chunk, "warps": warps, "stages": stages, "scale_rows": scale_rows}
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(spec)],
                               capture_output=True, text=True, timeout=300)
            got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(got[0][7:]) if got else dict(spec, error=portable(p.stderr or p.stdout)[-300:])
            print(row, flush=True)
            rows.append(row)
    res = {"device": torch.cuda.get_device_name(0), "versions": {"torch": torch.__version__, "triton": triton.__version__},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "shape": {"B": 4, "T": 32768, "H": 16, "K": 128, "V": 128, "dtype": "bfloat16", "gamma": 0.999},
           "args": {"layouts": ",".join(":".join(str(x) for x in t) for t in args.layouts), "tag": args.tag},
           "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    write_record(os.path.join(args.out, f"ahla_{args.tag}"), res, render_markdown)


if __name__ == "__main__":
    main()
