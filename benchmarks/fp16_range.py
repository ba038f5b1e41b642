"""Where an fp16 layer's output leaves fp16's range: the first token whose output is not finite.

Without decay an operator's output is a sum over a number of index tuples that grows with the
position (O(t^2) at second order, O(t^3) at third), and the operators return it in the inputs'
dtype; fp16 holds at most 65504, bf16 and fp32 about 3.4e38 (hla_fast/README.md, "Keeping the
states in range"). For each order, gate and q/k norm, a freshly initialized
``HigherOrderLinearAttention(64, 1)`` (seed 0, the other options at their defaults) cast to fp16 runs
one random sequence of ``--T`` tokens (standard normal hidden states, seed 0) on the torch backend
under no_grad; the record names the first token with a non-finite output (None: every output finite).

    python benchmarks/fp16_range.py                    # the recorded run (CPU, about 10 seconds)
    python benchmarks/fp16_range.py --T 4096 --tag x
    python benchmarks/fp16_range.py --render benchmarks/results/fp16_range_cpu.json
"""
from __future__ import annotations

import os
import platform
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from records import record_parser, render_stored, stamp, write_record  # noqa: E402

ORDERS = ("hla2", "ahla", "hla3")
GATES = ("none", "fixed", "data")
QK_NORMS = ("l2", None)
WIDTH = 64


def first_non_finite(order, gate, qk_norm, T, dtype=torch.float16):
    """The first token (0-based) whose fp16 layer output has a non-finite entry, or None."""
    from hla_fast.layers import HigherOrderLinearAttention

    torch.manual_seed(0)
    layer = HigherOrderLinearAttention(WIDTH, 1, order=order, gate=gate, qk_norm=qk_norm, backend="torch").to(dtype)
    x = torch.randn(1, T, WIDTH, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        o, _, _ = layer(x)
    bad = (~torch.isfinite(o[0])).any(-1).nonzero()
    return int(bad[0]) if len(bad) else None


def render_markdown(res):
    v = res.get("versions", {})
    lines = [f"# First non-finite output of an fp16 layer on {res['device']}", "",
             f"Date {res['date']}; torch {v.get('torch')}, python {v.get('python')}. "
             f"`HigherOrderLinearAttention({WIDTH}, 1)` in fp16, torch backend, one sequence of {res['T']} "
             "tokens (seed 0); the first token whose output is not finite, '-' where every output is "
             "(`benchmarks/fp16_range.py`).", "",
             "| order | gate | qk_norm | first non-finite token |", "|---|---|---|---|"]
    for r in res["rows"]:
        t = r["first_non_finite"]
        lines.append(f"| {r['order']} | {r['gate']} | {r['qk_norm']} | {'-' if t is None else t} |")
    return "\n".join(lines) + "\n"


def main():
    ap = record_parser(__doc__, "fp16_range", "cpu")
    ap.add_argument("--T", type=int, default=16384, help="tokens of the sequence (>= 1)")
    args = ap.parse_args()
    if args.render:
        render_stored(args.render, render_markdown)
        return
    if args.T < 1:
        ap.error(f"--T must be >= 1, got {args.T}")
    res = {**stamp(f"CPU ({platform.processor() or platform.machine()})"), "T": args.T, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"fp16_range_{args.tag}")
    for order in ORDERS:
        for gate in GATES:
            for qk_norm in QK_NORMS:
                t = first_non_finite(order, gate, qk_norm, args.T)
                res["rows"].append({"order": order, "gate": gate, "qk_norm": qk_norm, "first_non_finite": t})
                print(f"{order} gate={gate} qk_norm={qk_norm}: {t}", flush=True)
    write_record(path, res, render_markdown)
    print(f"wrote {path}.json and {path}.md")


if __name__ == "__main__":
    main()
