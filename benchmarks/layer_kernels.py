"""AHLA's layered backward (``ChunkConfig.bwd_layers``), its two kernels alone in several launch
layouts: the state-gradient walk ``ahla_bwd_dh_kernel`` (key block, warps, pipelining stages) and
the per-chunk kernel ``ahla_bwd_layer_kernel`` (value block, warps, stages). The constants of
``hla_fast/ops/ahla/chunk.py`` (DH_BLOCK_K, DH_WARPS, DH_STAGES, LAYER_STAGES) cite this record.

bf16, B = 4, H = 16, K = V (default 128), T (default 32768), chunks of 64, gamma = 0.999, random
inputs and states (a layout's time does not depend on the values); median ms of
``triton.testing.do_bench``. Each layout is a fresh compile; one that fails to compile or launch is
recorded with its error.

    python benchmarks/layer_kernels.py --tag h200_layers_kernels        # a GPU
    python benchmarks/layer_kernels.py --render benchmarks/results/ahla_h200_layers_kernels.json
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):   # hla_fast, and records beside this script
    if _p not in sys.path:
        sys.path.insert(0, _p)

from records import record_parser, render_stored, write_record  # noqa: E402

B, H, BT, GAMMA = 4, 16, 64, 0.999
WALKS = [(bk, w, s) for bk in (32, 64, 128) for w in (2, 4, 8) for s in (1, 2, 3)]
GRADS = [(bv, w, s) for bv in (32, 64) for w in (4, 8) for s in (1, 2)]


def measure(D, T):
    """{"walk": [[BK, warps, stages, ms or error]], "grad": [[BV, warps, stages, ms or error]]}."""
    import triton
    from hla_fast.ops.ahla.chunk_kernels import ahla_bwd_dh_kernel, ahla_bwd_layer_kernel

    bf, dev = torch.bfloat16, "cuda"
    q, k = ((torch.randn(B, T, H, D, device=dev) / D ** 0.5).to(bf) for _ in range(2))
    v, do = (torch.randn(B, T, H, D, device=dev).to(bf) for _ in range(2))
    NT, BH = triton.cdiv(T, BT), B * H
    states = [torch.randn(BH, NT, D, D, device=dev).to(bf) for _ in range(2)]
    dq, dk, dx = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(log_gamma=math.log(GAMMA), T=T, H=H, K=D, V=D, BT=BT, HAS_DECAY=True, IS_BF16=True, PREC="tf32")
    out = {"walk": [], "grad": []}
    for BK, w, s in WALKS:
        def f():
            ahla_bwd_dh_kernel[(triton.cdiv(D, 64), triton.cdiv(D, BK), BH)](
                q=q, dy=do, g=None, dh_end=states[1], dht=None, dh0=None, BK=BK, BV=64, num_warps=w, num_stages=s,
                **common)
        out["walk"].append([BK, w, s, _time(f)])
    for BV, w, s in GRADS:
        def f():
            ahla_bwd_layer_kernel[(NT, BH)](
                q=q, k=k, x=v, dy=do, g=None, h0=states[0], dh_end=states[1], dx=dx, dq=dq, dk=dk, dq_in=dq, dk_in=dk,
                db=None, DB_OWN=False, BK=triton.next_power_of_2(D), BV=BV, num_warps=w, num_stages=s, **common)
        out["grad"].append([BV, w, s, _time(f)])
    return out


def _time(f):
    import triton
    try:
        return triton.testing.do_bench(f, warmup=5, rep=50)
    except Exception as e:  # noqa: BLE001  (a layout that does not compile or launch is a result)
        return f"{type(e).__name__}: {str(e)[:120]}"


def render_markdown(res):
    v = res["versions"]
    lines = [f"# AHLA's layered backward, its kernels alone, on {res['device']}", "",
             f"Date {res['date']}; torch {v['torch']}, triton {v['triton']}. bf16, B = {B}, H = {H}, "
             f"K = V = {res['K']}, T = {res['T']}, chunks of {BT}; median ms (`benchmarks/layer_kernels.py`).", ""]
    if res.get("notes"):
        lines += [f"- {n}" for n in res["notes"]] + [""]
    for key, title, col in (("walk", "`ahla_bwd_dh_kernel` (one walk)", "key block"),
                            ("grad", "`ahla_bwd_layer_kernel` (one launch)", "value block")):
        lines += [f"## {title}", "", f"| {col} | warps | stages | ms |", "|---|---|---|---|"]
        for b, w, s, ms in res[key]:
            lines.append(f"| {b} | {w} | {s} | {ms if isinstance(ms, str) else f'{ms:.3f}'} |")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = record_parser(__doc__, "ahla", "h200_layers_kernels")
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--T", type=int, default=32768)
    args = ap.parse_args()
    if args.render:
        render_stored(args.render, render_markdown)
        return
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the kernels are timed compiled)")
    import triton
    res = {"device": torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "K": args.dim, "T": args.T, **measure(args.dim, args.T)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ahla_{args.tag}")
    write_record(path, res, render_markdown)
    print(render_markdown(res))
    print(f"wrote {path}.json and {path}.md")


if __name__ == "__main__":
    main()
