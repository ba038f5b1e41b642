"""Time HLA2's layouts (or HLA3's second stage's) against fla's first-order chunk_linear_attn, each
layout in its own process.

The layouts are changes to the configuration rule's ``ChunkConfig`` (``--layouts``, a JSON list of
objects; ``{}`` is the rule itself; with ``--op hla3`` changes to its second stage's, the first
keeping its own rule), e.g. the split forward (``fwd_output_pass``, ``fwd_row_blocks``):
a state walk storing every chunk's start state, then one program per chunk computing its outputs.
Each layout runs in a subprocess, so that a layout that stops the GPU (an illegal memory access)
costs only its own row. The rule is asked as the call asks it (training or not, gated or not), then
changed. bf16 (``--dtype fp32``: fp32 inputs), B=4, H=16, gamma=0.999 (``--gates``: log-gates that
require grad), K in ``--dims`` and V = K (``--V``: another value width; ``--normalize``:
normalized, on |q| and |k|), T = ``--T``; medians of
triton.testing.do_bench (ms) of the whole call, forward under no_grad and forward + backward, the
peak memory a forward + backward allocates beyond the inputs, and the relative difference of the
layout's outputs (of the inference forward and of the training call) and gradients to the rule's
(same inputs, same process). On a CUDA machine, from
the repository root:

    python benchmarks/split_forward.py --out benchmarks/results/hla2_h200_split_forward.json
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))   # scripts beside this one
from config_arg import config_changes  # noqa: E402
from records import portable  # noqa: E402

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}   # names of torch dtypes (torch is imported in the children)
LAYOUTS = ('[{}, {"fwd_output_pass": true}, {"fwd_output_pass": true, "fwd_row_blocks": 2}, '
           '{"fwd_output_pass": true, "fwd_row_blocks": 2, "fwd_warps": 4}, '
           '{"fwd_output_pass": true, "fwd_segments": 1}]')


def one(D: int, T: int, layout: str, op: str, gates: bool, V: int | None = None, normalize: bool = False,
        dtype: str = "bf16") -> dict:
    """One layout's row (run in its own process)."""
    import torch
    from ab_revision import rule_config, time_call
    from records import rel_error

    import hla_fast
    gen = torch.Generator(device="cuda").manual_seed(D)
    q, k, v = (0.3 * torch.randn(4, T, 16, n, device="cuda", dtype=getattr(torch, DTYPES[dtype]), generator=gen)
               for n in (D, D, V or D))
    if normalize:
        q, k = q.abs(), k.abs()
    do = torch.randn_like(v)
    g = -0.001 * torch.rand(4, T, 16, device="cuda", generator=gen) if gates else None
    if layout == "fla":
        from fla.ops.linear_attn import chunk_linear_attn

        def fla_op(q, k, v, normalize=False, gamma=None, g=None):
            return chunk_linear_attn(q, k, v, normalize=False)

        f, fb, mb, _ = time_call(fla_op, q, k, v, do)
        return {"K": D, "V": V or D, "T": T, "layout": "fla chunk_linear_attn", "fwd_ms": f, "fwdbwd_ms": fb,
                "fwdbwd_peak_extra_mb": mb}
    fn = getattr(hla_fast, op)
    # the rule as the call asks it (training or not), changed (hla3: its second stage's)
    cfg = functools.partial(rule_config, op, q, v, config_changes(layout), gated=gates, normalize=normalize)

    _, _, _, ref = time_call(fn, q, k, v, do, g=g, normalize=normalize)   # the rule's outputs and gradients
    f, fb, mb, out = time_call(fn, q, k, v, do, g=g, normalize=normalize, config=cfg)
    return {"K": D, "V": V or D, "T": T, "gates": gates, "normalize": normalize, "layout": config_changes(layout),
            "config": repr(cfg(True)), "fwd_ms": f, "fwdbwd_ms": fb, "fwdbwd_peak_extra_mb": mb,
            "rel_diff_to_rule": {n: rel_error(x, ref[n]) for n, x in out.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--op", default="hla2", choices=("hla2", "hla3"))
    ap.add_argument("--dims", default="64,128", help="comma list of K=V head sizes")
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--layouts", default=LAYOUTS, help="JSON list of ChunkConfig changes; {} is the rule")
    ap.add_argument("--no-fla", action="store_true", help="leave out fla's rows")
    ap.add_argument("--gates", action="store_true", help="log-gates g (that require grad) instead of gamma")
    ap.add_argument("--normalize", action="store_true", help="normalize=True (on |q| and |k|)")
    ap.add_argument("--V", type=int, default=None, help="value width (default: K)")
    ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="the inputs' dtype")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per layout's process")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # internal: one layout, as JSON
    args = ap.parse_args()
    if args.one is not None:
        D, layout = json.loads(args.one)
        print(json.dumps(one(D, args.T, layout, args.op, args.gates, args.V, args.normalize, args.dtype)))
        return
    layouts = [json.dumps(x) for x in json.loads(args.layouts)]
    rows = []
    for D in (int(x) for x in args.dims.split(",")):
        for layout in ([] if args.no_fla else ["fla"]) + layouts:
            cmd = [sys.executable, __file__, "--op", args.op, "--T", str(args.T), "--one", json.dumps([D, layout])]
            cmd += ["--gates"] if args.gates else []
            cmd += ["--normalize"] if args.normalize else []
            cmd += ["--V", str(args.V)] if args.V else []
            cmd += ["--dtype", args.dtype]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                row = json.loads(lines[-1]) if p.returncode == 0 and lines else {
                    "K": D, "layout": layout, "failed": f"exit {p.returncode}: {portable(p.stderr.strip())[-600:]}"}
            except subprocess.TimeoutExpired:
                row = {"K": D, "layout": layout, "failed": f"timed out after {args.timeout} s"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    import torch
    import triton
    res = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "versions": {"torch": torch.__version__, "triton": triton.__version__}, "op": args.op,
        "shape": {"B": 4, "T": args.T, "H": 16, "dtype": DTYPES[args.dtype], "gamma": None if args.gates else 0.999},
        "gates": args.gates, "normalize": args.normalize, "V": args.V, "rows": rows}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
