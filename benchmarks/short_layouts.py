"""HLA2 layouts on short sequences, where launches and host work weigh as much as the kernels.

For each T of ``--Ts`` (bf16, B=4, H=16, K=V=``--dim``, gamma=0.999) and each layout below, the wall
time per call of calls back to back (forward under no_grad, and forward + backward), the do_bench
median of one call, and the CUDA kernels one call launches; causal SDPA on the same tensors beside
them. Then the host's own work per call (from the call to its return, without synchronizing) at
B=1, H=16, T=1024, and a cProfile of that host work by function, so that the next cut is chosen by
what costs, not by guess.

Layouts (``ChunkConfig`` fields set on ``hla2_config``'s result; S is the rule's segment count for
long sequences, ``one_wave_segments``):

    rule            the configuration rule as it stands (``hla_fast.hla2_config``)
    seg_recomputed  S segments in both walks, the backward recomputes the chunk states, gradients
                    in two launches (the rule for every length before short sequences had their own)
    seg_kept        the same with the chunk states kept by the forward (no recompute launches)
    one_kept_1grad  one segment in both walks, states kept, every gradient in one launch

    python benchmarks/short_layouts.py --out benchmarks/results/hla2_h200_short
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import triton  # noqa: E402

import bench_hla2 as bh  # noqa: E402
import hla_fast  # noqa: E402
from hla_fast.ops.common import launch  # noqa: E402
from hla_fast.ops.hla2 import chunk  # noqa: E402

LAYOUTS = {
    "rule": None,
    "seg_recomputed": {"save_states": False, "grad_parts": (1, 6)},
    "seg_kept": {"save_states": True, "grad_parts": (1, 6)},
    "one_kept_1grad": {"fwd_segments": 1, "bwd_segments": 1, "save_states": True, "grad_parts": (7,)},
}


def layout_config(name, B, T, H, D):
    """The config of layout ``name`` for this call (None: the rule itself, as a caller passing no
    config gets it)."""
    changes = LAYOUTS[name]
    if changes is None:
        return None
    dev = torch.device(bh.DEVICE)
    if "fwd_segments" not in changes:   # the rule's segments for a long sequence of these heads
        S = launch.one_wave_segments(B * H * launch.cdiv(D, 64), launch.cdiv(T, 64), dev, 2, chunk.MIN_SEGMENT_CHUNKS)
        changes = {**changes, "fwd_segments": S, "bwd_segments": S}
    return hla_fast.hla2_config(B, T, H, D, D, torch.bfloat16, dev).replace(**changes)


def hla_with(cfg):
    def call(q, k, v):
        return hla_fast.hla2(q, k, v, gamma=bh.GAMMA, backend="triton", config=cfg)[0]
    return call


def host_profile(run, n=200, top=25):
    """cProfile of n calls of run (no synchronize inside): the top functions by own time."""
    run()
    bh.sync()
    pr = cProfile.Profile()
    pr.enable()
    for i in range(n):
        run()
        if i % 16 == 15:
            bh.sync()
    pr.disable()
    bh.sync()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).strip_dirs().sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--Ts", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--dim", type=int, default=64, help="K = V, at most 64 (the seg_* layouts are those of "
                                                          "4-warp programs, two a multiprocessor)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()
    if not 1 <= args.dim <= 64:
        ap.error(f"--dim must be in 1..64, got {args.dim}")
    if not bh.CUDA:
        raise SystemExit("short_layouts.py times CUDA calls: run it on a GPU machine")
    B, H, D = 4, 16, args.dim
    names = args.layouts.split(",")
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__, "triton": triton.__version__,
                        "python": platform.python_version()},
           "shape": {"B": B, "H": H, "K": D, "V": D, "dtype": "bf16", "gamma": bh.GAMMA},
           "layouts": {n: None if LAYOUTS[n] is None else {k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in LAYOUTS[n].items()} for n in names},
           "rows": [], "host": {}}
    for T in bh.int_list(args.Ts, []):
        q, k, v = bh.make_inputs(B, T, H, D, D)
        do = torch.randn_like(v)
        row = {"T": T}
        cfgs = {n: layout_config(n, B, T, H, D) for n in names}
        cands = {n: hla_with(cfg) for n, cfg in cfgs.items()}
        cands["sdpa"] = bh.sdpa
        for n, fn in cands.items():
            for s, run in (("fwd", bh.fwd_only(fn, (q, k, v))), ("fwdbwd", bh.fwd_bwd(fn, (q, k, v), do))):
                row[f"{n}_{s}_loop_ms"] = bh.loop_ms(run)
                row[f"{n}_{s}_median_ms"] = bh.bench_ms(run)
                row[f"{n}_{s}_kernels"] = bh.count_kernels(run)["kernels"]
        row["configs"] = {n: str(cfg or hla_fast.hla2_config(B, T, H, D, D, torch.bfloat16, torch.device(bh.DEVICE)))
                          for n, cfg in cfgs.items()}
        res["rows"].append(row)
        bh.log(f"T={T}: " + ", ".join(f"{n} {row[f'{n}_fwd_loop_ms']:.3f}/{row[f'{n}_fwdbwd_loop_ms']:.3f}"
                                      for n in cands))
        del q, k, v, do
        bh.free()
    # -- host work per call where the GPU work is small ---------------------------------------
    Bh, Th = 1, 1024
    q, k, v = bh.make_inputs(Bh, Th, H, D, D)
    do = torch.randn_like(v)
    cands = {n: hla_with(layout_config(n, Bh, Th, H, D)) for n in names}
    cands["sdpa"] = bh.sdpa
    profiles = {}
    for n, fn in cands.items():
        x = {}
        for s, run in (("fwd", bh.fwd_only(fn, (q, k, v))), ("fwdbwd", bh.fwd_bwd(fn, (q, k, v), do))):
            x[f"{s}_host_us"] = bh.host_us(run)
            x[f"{s}_loop_us"] = bh.loop_ms(run, n=200, reps=3) * 1e3
            if n in ("rule", "seg_recomputed"):
                profiles[f"{n}_{s}"] = host_profile(run)
        res["host"][n] = x
    res["host_shape"] = {"B": Bh, "H": H, "T": Th, "K": D}
    res["profiles"] = profiles
    md = render(res)
    print(md)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(md + "\n")


def render(res):
    names = list(res["layouts"]) + ["sdpa"]
    lines = [f"# HLA2 layouts on short sequences ({res['device']}, {res['date']})", "",
             f"torch {res['versions']['torch']}, triton {res['versions']['triton']}; bf16, "
             f"B={res['shape']['B']}, H={res['shape']['H']}, K=V={res['shape']['K']}, gamma={res['shape']['gamma']}. "
             "loop: wall ms per call of calls back to back (one synchronize at the end); median: do_bench "
             "median of one call; kernels: CUDA kernels of one call.", "",
             "Layouts (fields set on the rule's config; the segments of seg_* are the rule's for long sequences): "
             + "; ".join(f"`{n}` {c or 'the rule'}"
                                                                    for n, c in res["layouts"].items()), "",
             "| T | call | fwd loop | fwd median | fwd kernels | fwd+bwd loop | fwd+bwd median | fwd+bwd kernels |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        for n in names:
            lines.append(f"| {r['T']} | {n} | {r[n + '_fwd_loop_ms']:.3f} | {r[n + '_fwd_median_ms']:.3f} | "
                         f"{r[n + '_fwd_kernels']} | {r[n + '_fwdbwd_loop_ms']:.3f} | {r[n + '_fwdbwd_median_ms']:.3f} | "
                         f"{r[n + '_fwdbwd_kernels']} |")
    hs = res["host_shape"]
    lines += ["", f"Host work per call at B={hs['B']}, H={hs['H']}, T={hs['T']}, K=V={hs['K']} (us; host: from the "
              "call to its return without synchronizing; loop: wall us per call back to back):", "",
              "| call | fwd host | fwd loop | fwd+bwd host | fwd+bwd loop |", "|---|---|---|---|---|"]
    for n, x in res["host"].items():
        lines.append(f"| {n} | {x['fwd_host_us']:.1f} | {x['fwd_loop_us']:.1f} | {x['fwdbwd_host_us']:.1f} | "
                     f"{x['fwdbwd_loop_us']:.1f} |")
    for n, p in res.get("profiles", {}).items():
        lines += ["", f"cProfile of 200 calls, `{n}` (top functions by own time):", "", "```", p.strip(), "```"]
    return "\n".join(lines)


render_markdown = render   # the name the other benchmark scripts give their record renderer


if __name__ == "__main__":
    main()
