"""Accuracy of hla_fast.hla3 as the sequence grows: fp32 and bf16 kernels against float64.

Third order sums about T^3 / 6 weighted triples (i, u, j) per output: each term is a product of
three scores (q_t . k_i)(k_i . q_u)(q_u . k_j), so the output's size and the cancellation between
signed terms grow with T much faster than at second order. This script measures, for several
input scalings and decays, the relative error ||o - o64|| / ||o64|| of the Triton kernels (fp32
and bf16 inputs) against the float64 torch path run on the same (already rounded) inputs, the
worst row's relative error, the output's root-mean-square size and the final state's error.

Cases (q, k, v drawn per token and head; v ~ N(0, 1)):

    raw          q, k ~ N(0, 0.3^2) entries, no decay
    raw_gamma    the same with gamma = 0.999
    l2           q, k L2-normalized per token (|q . k| <= 1), no decay
    l2_gamma     l2 with gamma = 0.999
    l2_gates     l2 with per-token log-gates g = -0.01 U[0, 1) (factors in (0.99, 1])
    l2pos_norm   |q|, |k| L2-normalized (positive features) with normalize=True

What a user must do about scale (read the numbers in the report): the operator applies no scaling
to q or k. Keep every |q . k| at most about 1, e.g. by L2-normalizing q and k (a learned or fixed
temperature can be put in v or after the operator), and use a decay (gamma < 1 or gates) for long
sequences: it bounds the effective window, so the output's size and the error stop growing with
T. Without decay the raw output grows polynomially in T; fp32 then keeps a relative error near its
rounding level only while the sum does not cancel, and bf16 outputs carry bf16's 2^-9 relative
rounding on top. normalize=True divides by a denominator of the same order, so with positive
features its output stays O(|v|) at any T.

    python benchmarks/hla3_accuracy.py --tag h200                 # on a GPU (T 256 .. 32k)
    python benchmarks/hla3_accuracy.py --cpu-smoke --out DIR      # tiny shapes, Triton interpreter

Writes ``<out>/hla3_accuracy_<tag>.json`` and ``.md``.
"""
from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # must precede importing triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime
import json
import math
import platform
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):   # hla_fast, and records beside this script
    if _p not in sys.path:
        sys.path.insert(0, _p)

import hla_fast  # noqa: E402
from records import rel_error  # noqa: E402

CASES = ("raw", "raw_gamma", "l2", "l2_gamma", "l2_gates", "l2pos_norm")
GAMMA = 0.999


def make_case(case, B, T, H, K, V, device, seed=0):
    """Inputs of one case in fp32: (q, k, v, keyword arguments of hla3)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    kw = {}
    if case.startswith("raw"):
        q, k = 0.3 * q, 0.3 * k
    else:
        if case == "l2pos_norm":
            q, k = q.abs(), k.abs()
            kw["normalize"] = True
        q = q / q.norm(dim=-1, keepdim=True)
        k = k / k.norm(dim=-1, keepdim=True)
    if case.endswith("gamma"):
        kw["gamma"] = GAMMA
    if case.endswith("gates"):
        kw["g"] = (-0.01 * torch.rand(B, T, H, generator=gen)).to(device)
    return q.to(device), k.to(device), v.to(device), kw


def _worst_row(a, b):
    """Largest relative error of one output row (over tokens and heads), rows of size > 1e-30."""
    a, b = a.double(), b.double()
    num = (a - b).norm(dim=-1)
    den = b.norm(dim=-1)
    keep = den > 1e-30
    return float((num[keep] / den[keep]).max()) if bool(keep.any()) else float("nan")


def measure(case, T, dtype, *, B=1, H=2, K=16, V=16, device="cpu", seed=0, chunk_size=64):
    """One row: the kernels' relative errors for ``dtype`` inputs against float64 on the same
    rounded inputs, the output's rms size and the final F's relative error."""
    q, k, v, kw = make_case(case, B, T, H, K, V, device, seed)
    qq, kk, vv = (x.to(dtype) for x in (q, k, v))
    kw64 = {n: (x.double() if torch.is_tensor(x) else x) for n, x in kw.items()}
    o64, st64 = hla_fast.hla3(qq.double(), kk.double(), vv.double(), backend="torch", output_final_state=True,
                              chunk_size=chunk_size, **kw64)
    o, st = hla_fast.hla3(qq, kk, vv, backend="triton", output_final_state=True, chunk_size=chunk_size, **kw)
    finite = bool(torch.isfinite(o).all())
    return {"case": case, "T": T, "dtype": str(dtype).replace("torch.", ""), "B": B, "H": H, "K": K, "V": V,
            "rel_err": rel_error(o, o64) if finite else float("inf"),
            "worst_row_rel_err": _worst_row(o, o64) if finite else float("inf"),
            "out_rms": float(o64.double().pow(2).mean().sqrt()),
            "F_rel_err": rel_error(st.F, st64.F) if bool(torch.isfinite(st.F).all()) else float("inf"),
            "finite": finite}


def render_markdown(res):
    lines = [f"# hla3 accuracy against float64 ({res['device']})", "",
             f"Date {res['date']}; torch {res['versions']['torch']}, triton {res['versions']['triton']}; "
             f"B={res['shape']['B']}, H={res['shape']['H']}, K={res['shape']['K']}, V={res['shape']['V']}, "
             f"chunk {res['shape']['chunk_size']}. Reference: the float64 torch path on the same rounded inputs.", ""]
    dtypes = sorted({r["dtype"] for r in res["rows"]})
    Ts = sorted({r["T"] for r in res["rows"]})
    for metric, title in (("rel_err", "relative error ||o - o64|| / ||o64||"),
                          ("worst_row_rel_err", "worst row's relative error"),
                          ("out_rms", "rms of the float64 output (its size)")):
        lines += [f"## {title}", "", "| case | dtype | " + " | ".join(f"T={T}" for T in Ts) + " |",
                  "|---|---|" + "---|" * len(Ts)]
        for case in res["cases"]:
            for dt in (dtypes if metric != "out_rms" else dtypes[:1]):
                cells = []
                for T in Ts:
                    r = next((x for x in res["rows"] if x["case"] == case and x["T"] == T and x["dtype"] == dt), None)
                    cells.append("-" if r is None else f"{r[metric]:.1e}")
                lines.append(f"| {case} | {dt if metric != 'out_rms' else '-'} | " + " | ".join(cells) + " |")
        lines.append("")
    if any(c == "-" for line in lines for c in line.split(" | ")):
        lines += ["A '-' is a case the run did not reach (it was stopped before).", ""]
    lines += ["Cases and the advice on scale: see the docstring of benchmarks/hla3_accuracy.py.", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--tag", default=None, help="files hla3_accuracy_<tag>.json/md (default h200, cpu for --cpu-smoke)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under the Triton interpreter")
    ap.add_argument("--Ts", default=None, help="comma list of sequence lengths")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        ap.error("no CUDA device: use --cpu-smoke")
    device = "cuda" if cuda else "cpu"
    if cuda:
        B, H, K, V, C = 1, 4, 64, 64, 64
        Ts = [256, 1024, 4096, 16384, 32768]
    else:
        B, H, K, V, C = 1, 2, 16, 16, 32
        Ts = [64, 256]
    if args.Ts:
        Ts = [int(x) for x in args.Ts.split(",")]
    cases = [c for c in args.cases.split(",") if c]
    bad = set(cases) - set(CASES)
    if bad:
        ap.error(f"unknown cases {sorted(bad)}; known: {','.join(CASES)}")
    tag = args.tag or ("h200" if cuda else "cpu")
    import triton

    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (Triton interpreter)",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
           "shape": {"B": B, "H": H, "K": K, "V": V, "chunk_size": C}, "cases": cases, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hla3_accuracy_{tag}")
    t0 = time.perf_counter()
    for T in Ts:
        for case in cases:
            for dtype in (torch.float32, torch.bfloat16):
                row = measure(case, T, dtype, B=B, H=H, K=K, V=V, device=device, seed=T, chunk_size=C)
                res["rows"].append(row)
                print(f"[{time.perf_counter() - t0:6.1f} s] {case:11s} T={T:6d} {row['dtype']:8s} "
                      f"rel {row['rel_err']:.2e} worst row {row['worst_row_rel_err']:.2e} rms {row['out_rms']:.2e}",
                      flush=True)
                with open(path + ".json", "w") as f:
                    json.dump(res, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
                if cuda:
                    torch.cuda.empty_cache()
    with open(path + ".md", "w") as f:
        f.write(render_markdown(res))
    print(f"wrote {path}.json and {path}.md")


if __name__ == "__main__":
    main()
