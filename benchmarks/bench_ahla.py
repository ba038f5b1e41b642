"""Speed, compile time and accuracy of hla_fast.ahla (asymmetric HLA) on one GPU.

Sections (default order; ``--sections a,b`` runs only those):

    ceilings    bf16 matmul rate and device copy bandwidth (always measured)
    main        bf16, B=4, H=16, K=V in {64, 128}, T 1k..32k: forward (no grad) and forward +
                backward medians of ahla with gamma and with per-token log-gates g (that require
                grad), against flash-linear-attention's first-order ``chunk_linear_attn`` (when fla
                imports); FLOPs of the chunk form and TFLOP/s
    variants    at T = 32k (the largest T), the layouts of ``hla_fast.ahla_config(...).replace(...)``:
                gradient launches, warps, segments, chunks and kept states against the rule's
    decode      ahla_step, B=64, H=16, K=V=128: the fp32 state read and written (P, E) against a
                device copy of the same bytes, with gamma and with g
    accuracy    relative error of the bf16 and fp32 kernels against the float64 torch path
    first_call  seconds of the first forward + backward in a fresh process with an empty Triton
                cache (compile included), bf16 K=V=64 and 128, one subprocess each

Targets (at T = 32k, K = V = 64 and 128): forward <= 1.5x and forward + backward <= 2x
flash-linear-attention's chunk_linear_attn; decode at >= 70% of copy bandwidth. The report lists
each, met or not, with its numbers.

    python benchmarks/bench_ahla.py --out benchmarks/results --tag h200     # writes ahla_h200.{json,md}
    python benchmarks/bench_ahla.py --cpu-smoke --out /some/dir           # every section on the CPU under
                                                   # the Triton interpreter at tiny shapes (no timing value)

Timing and input helpers come from ``benchmarks/bench_hla2.py``.
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
import subprocess
import tempfile
import time

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import hla_fast  # noqa: E402
from bench_hla2 import (  # noqa: E402
    CUDA, DEVICE, GAMMA, bench_ms, free, fwd_bwd, fwd_only, graph_ms, int_list, load_fla, log, make_gates,
    make_inputs, median_ms, warm_median_ms,
)
from hla_fast import AHLAState  # noqa: E402
from hla_fast.ops.common.launch import BWD_PIECES  # noqa: E402
from records import rel_error  # noqa: E402

SECTIONS = ("main", "variants", "decode", "accuracy", "first_call")
FWD_MAX, FWDBWD_MAX, DECODE_MIN = 1.5, 2.0, 0.70
TARGET_T = 32768


# ----------------------------------------------------------------------------- counts and candidates


def ahla_flops(B, H, T, K, V, C=64):
    """Multiply-adds x 2 of the chunk form (forward), one chunk of C rows at a time."""
    per_chunk = (C * C * K          # X = Q K^T
                 + 2 * C * K * V    # Q P0, Q E0
                 + 2 * C * C * V    # A V, A R
                 + 2 * C * K * V)   # Kg^T V, Kg^T R
    return 2.0 * B * H * math.ceil(T / C) * per_chunk


def decode_state_bytes(B, H, K, V):
    """fp32 state read and written by one decode step: P and E."""
    return 2 * 2 * B * H * K * V * 4


def ahla_gamma(q, k, v):
    return hla_fast.ahla(q, k, v, gamma=GAMMA, backend="triton")[0]


def ahla_g(q, k, v, g):
    return hla_fast.ahla(q, k, v, g=g, backend="triton")[0]


def variant_changes(K):
    """Layouts to compare against the rule's: name -> ChunkConfig.replace(**changes), applied to
    the rule's inference layout for the forward alone and to its training layout for forward +
    backward. Both sizes: walks that load ahead in neither pass or both, the per-chunk gradients
    in one, two or three launches, 4 and 8 warps, one segment. K = 64 adds the forward's segments,
    warps and chunk; wider heads add the forward of 64 whose states the backward recomputes at 32,
    the warps of each pass, and 8-warp forwards with and without loading ahead. Both sizes: the
    backward as two first-order layers (``bwd_layers``, the wider heads' rule) in 4 and 8 warps;
    wider heads: the coupled backward in the layout the rule took before (chunks of 32, 8-warp
    forward loading ahead, backward in pieces), the layered one in chunks of 32 and with an 8-warp
    forward; forwards of chunks of 128 in 8 warps (one and two stages) and of 32 in 4."""
    layers = {"bwd_layers": True, "bwd_segments": 1, "bwd_pieces": 1, "bwd_prefetch": False}
    out = {"rule": {}, "no_prefetch": {"fwd_prefetch": False, "bwd_prefetch": False},
           "prefetch": {"fwd_prefetch": True, "bwd_prefetch": True},
           "grad_1_6": {"grad_parts": (1, 6)}, "grad_1_2_4": {"grad_parts": (1, 2, 4)},
           "grad_3_4": {"grad_parts": (3, 4)}, "warps_4": {"fwd_warps": 4, "bwd_warps": 4},
           "warps_8": {"fwd_warps": 8, "bwd_warps": 8}, "one_segment": {"fwd_segments": 1, "bwd_segments": 1},
           "layers": layers, "layers_bwd_warps_4": dict(layers, bwd_warps=4),
           "layers_bwd_warps_8": dict(layers, bwd_warps=8)}
    if K <= 64:
        out.update({"fwd_segments_2": {"fwd_segments": 2}, "fwd_segments_8": {"fwd_segments": 8},
                    "fwd_warps_8_segments_2": {"fwd_warps": 8, "fwd_segments": 2},
                    "chunk_32": {"fwd_chunk": 32, "bwd_chunk": 32},
                    "grad_1_6_bwd_warps_8": {"grad_parts": (1, 6), "bwd_warps": 8}})
    else:
        out.update({"fwd_64_recomputed": {"fwd_chunk": 64, "save_states": False},
                    "fwd_warps_4": {"fwd_warps": 4}, "fwd_warps_8": {"fwd_warps": 8}, "bwd_warps_4": {"bwd_warps": 4},
                    "grad_1_6_bwd_warps_4": {"grad_parts": (1, 6), "bwd_warps": 4},
                    "warps_4_segments_2": {"fwd_warps": 4, "bwd_warps": 4, "fwd_segments": 2, "bwd_segments": 2},
                    "fwd_warps_8_no_prefetch": {"fwd_warps": 8, "fwd_prefetch": False},
                    "fwd_32_warps_8": {"fwd_chunk": 32, "fwd_warps": 8, "fwd_prefetch": True},
                    "coupled": {"bwd_layers": False, "fwd_chunk": 32, "bwd_chunk": 32, "fwd_warps": 8,
                                "fwd_prefetch": True, "bwd_prefetch": True, "bwd_pieces": BWD_PIECES},
                    "layers_32": dict(layers, fwd_chunk=32, bwd_chunk=32),
                    "layers_fwd_warps_8": dict(layers, fwd_warps=8, fwd_prefetch=True),
                    "fwd_128_warps_8": {"fwd_chunk": 128, "fwd_warps": 8, "fwd_prefetch": False},
                    "fwd_128_warps_8_stages_2": {"fwd_chunk": 128, "fwd_warps": 8, "fwd_prefetch": False,
                                                 "fwd_stages": 2},
                    "fwd_32_warps_4": {"fwd_chunk": 32, "fwd_warps": 4, "fwd_prefetch": False},
                    "fwd_32_warps_4_prefetch": {"fwd_chunk": 32, "fwd_warps": 4, "fwd_prefetch": True}})
    return out


def ceilings(smoke):
    """bf16 matmul TFLOP/s and device copy GB/s (bytes read + written), the roofline's two lines."""
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, warmup=25, rep=100)
    nbytes = (1 << 20) if smoke else (1 << 31)
    x = torch.randn(nbytes // 4, device=DEVICE)
    y = torch.empty_like(x)
    ms_c = bench_ms(lambda: y.copy_(x), warmup=25, rep=100)
    return {"bf16_matmul_tflops": 2 * n ** 3 / ms / 1e9, "copy_gbs": 2 * nbytes / ms_c / 1e6}


# ----------------------------------------------------------------------------- first call (subprocess)


def first_call_child(K, dtype):
    """Run in a fresh process: seconds of the first ahla forward + backward (compiles included)."""
    q, k, v = make_inputs(1, 256, 2, K, K, dtype=getattr(torch, dtype))
    g = make_gates(1, 256, 2)
    leaves = [x.requires_grad_() for x in (q, k, v, g)]
    t0 = time.perf_counter()
    o, _ = hla_fast.ahla(*leaves[:3], g=leaves[3], backend="triton")
    o.float().sum().backward()
    if CUDA:
        torch.cuda.synchronize()
    print(json.dumps({"seconds": time.perf_counter() - t0}))


def first_call(K, dtype, timeout_s, smoke):
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        cmd = [sys.executable, os.path.abspath(__file__), "--first-call-child", f"{K},{dtype}"]
        if smoke:
            cmd.append("--cpu-smoke")
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=True)
            return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e)[:200]}"


# ----------------------------------------------------------------------------- report


def targets(res):
    out = []
    for D in res["shapes"]["K=V"]:
        rows = [r for r in res.get("main", []) if r["K"] == D and r["T"] == res["shapes"]["T"][-1]]
        r = rows[0] if rows else {}
        for s, bound in (("fwd", FWD_MAX), ("fwdbwd", FWDBWD_MAX)):
            a, b = r.get(f"ahla_{s}_ms"), r.get(f"fla_{s}_ms")
            ratio = a / b if isinstance(a, float) and isinstance(b, float) else None
            out.append({"target": f"K=V={D}, T={r.get('T')}: ahla {s} <= {bound}x fla chunk_linear_attn",
                        "ratio": ratio, "met": None if ratio is None else ratio <= bound})
    d = res.get("decode", {})
    frac = d.get("fraction_of_copy")
    out.append({"target": f"decode state traffic >= {DECODE_MIN:.0%} of copy bandwidth, per ahla_step call",
                "ratio": frac, "met": None if frac is None else frac >= DECODE_MIN})
    frac = d.get("graph_fraction_of_copy")
    out.append({"target": f"decode state traffic >= {DECODE_MIN:.0%} of copy bandwidth, steps replayed from a CUDA graph",
                "ratio": frac, "met": None if frac is None else frac >= DECODE_MIN})
    return out


def _f(x, nd=3):
    return f"{x:.{nd}g}" if isinstance(x, float) else ("-" if x is None else str(x))


def render_markdown(res):
    L = [f"# hla_fast.ahla on {res['device']}", "",
         f"Date {res['date']}; versions {res['versions']}; shapes {res['shapes']}"
         + (f"; code {res['code']} (an earlier revision of hla_fast)" if res.get("code") else "") + ".", "",
         *([res["notes"], ""] if res.get("notes") else []),
         f"Ceilings: {res.get('ceilings')}", "", "## Targets", "", "| target | ratio | met |", "|---|---|---|"]
    for t in res.get("targets", []):
        L.append(f"| {t['target']} | {_f(t['ratio'])} | {t['met']} |")
    L += ["", "## Forward and forward + backward (ms, medians)", "",
          "| K=V | T | ahla fwd | ahla fwd+bwd | ahla g fwd | ahla g fwd+bwd | fla fwd | fla fwd+bwd "
          "| fwd / fla | fwd+bwd / fla | ahla fwd TFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("main", []):
        L.append("| " + " | ".join(_f(r.get(c)) for c in (
            "K", "T", "ahla_fwd_ms", "ahla_fwdbwd_ms", "ahla_g_fwd_ms", "ahla_g_fwdbwd_ms", "fla_fwd_ms",
            "fla_fwdbwd_ms", "fwd_over_fla", "fwdbwd_over_fla", "ahla_fwd_tflops")) + " |")
    errs = {k: v for r in res.get("main", []) for k, v in r.items() if k.endswith("_error")}
    if errs:
        L += ["", f"Errors: {errs}"]
    L += ["", "## Layouts at the largest T (ms, medians)", "", "| K=V | variant | changes | fwd | fwd+bwd | error |",
          "|---|---|---|---|---|---|"]
    for r in res.get("variants", []):
        L.append("| " + " | ".join(_f(r.get(c)) for c in ("K", "variant", "changes", "fwd_ms", "fwdbwd_ms", "error"))
                 + " |")
    L += ["", "## Decode", "", f"{res.get('decode')}", "", "## Accuracy (relative error against float64)", ""]
    for r in res.get("accuracy", []):
        L.append(f"- {r}")
    L += ["", "## First call (s, compile included, empty Triton cache)", "", f"{res.get('first_call')}", ""]
    return "\n".join(L)


def write_report(res, out, tag, show=True):
    res["targets"] = targets(res)
    with open(os.path.join(out, f"ahla_{tag}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    md = render_markdown(res)
    with open(os.path.join(out, f"ahla_{tag}.md"), "w") as f:
        f.write(md)
    if show:
        print(md, flush=True)


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="h200", help="files ahla_<tag>.json and ahla_<tag>.md")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    ap.add_argument("--dims", default=None, help="comma list of K=V head sizes (default 64,128; 16,32 with --cpu-smoke)")
    ap.add_argument("--Ts", default=None, help=f"comma list of sequence lengths (default 1024..{TARGET_T}; 32,64 with --cpu-smoke)")
    ap.add_argument("--sections", default="", help="comma list of the only sections to run: " + ",".join(SECTIONS))
    ap.add_argument("--variants", default=None,
                    help="comma list of the only layouts the variants section times (names from variant_changes; "
                         "default all)")
    ap.add_argument("--first-call-timeout", type=float, default=300.0)
    ap.add_argument("--first-call-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.first_call_child:
        K, dtype = args.first_call_child.split(",")
        first_call_child(int(K), dtype)
        return
    if not CUDA and not args.cpu_smoke:
        ap.error("no CUDA device: use --cpu-smoke on a machine without a GPU")
    chosen = [s for s in SECTIONS if not args.sections or s in args.sections.split(",")]
    wanted = set(args.variants.split(",")) if args.variants else None   # None: every layout
    if wanted:
        known = set(variant_changes(64)) | set(variant_changes(128))
        unknown = sorted(wanted - known)
        if unknown:
            ap.error(f"--variants: unknown layouts {unknown}; known: {', '.join(sorted(known))}")
    smoke = args.cpu_smoke
    os.makedirs(args.out, exist_ok=True)
    chunk_linear_attn, fla_version = load_fla()
    B, H = (1, 2) if smoke else (4, 16)
    Ts = int_list(args.Ts, [32, 64] if smoke else [1024, 2048, 4096, 8192, 16384, TARGET_T])
    Ds = int_list(args.dims, [16, 32] if smoke else [64, 128])
    res = {
        "device": torch.cuda.get_device_name(0) if CUDA else "cpu (Triton interpreter, --cpu-smoke)",
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version(), "flash-linear-attention": fla_version},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": "bfloat16", "gamma": GAMMA,
        "args": {a: b for a, b in vars(args).items() if a != "out"},  # no path of the measuring machine
        "shapes": {"B": B, "H": H, "T": Ts, "K=V": Ds},
    }

    res["ceilings"] = ceilings(smoke)
    free()
    log(f"ceilings {res['ceilings']}")

    if "main" in chosen:
        fla_fn = (lambda q, k, v: chunk_linear_attn(q, k, v, normalize=False)[0]) if chunk_linear_attn else None
        rows = res.setdefault("main", [])
        for D in Ds:
            for T in Ts:
                q, k, v = make_inputs(B, T, H, D, D)
                g = make_gates(B, T, H)
                do = torch.randn_like(v)
                row = {"K": D, "V": D, "T": T, "B": B, "H": H}
                cands = {"ahla": (ahla_gamma, (q, k, v)), "ahla_g": (ahla_g, (q, k, v, g))}
                if fla_fn is not None:
                    cands["fla"] = (fla_fn, (q, k, v))
                for name, (fn, inputs) in cands.items():
                    try:
                        row[f"{name}_fwd_ms"] = median_ms(fwd_only(fn, inputs))
                        row[f"{name}_fwdbwd_ms"] = median_ms(fwd_bwd(fn, inputs, do))
                    except Exception as e:  # noqa: BLE001
                        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    free()
                for s in ("fwd", "fwdbwd"):
                    a_, b_ = row.get(f"ahla_{s}_ms"), row.get(f"fla_{s}_ms")
                    if isinstance(a_, float) and isinstance(b_, float):
                        row[f"{s}_over_fla"] = a_ / b_
                if isinstance(row.get("ahla_fwd_ms"), float):
                    row["ahla_fwd_tflops"] = ahla_flops(B, H, T, D, D) / row["ahla_fwd_ms"] / 1e9
                rows.append(row)
                log(f"main {row}")
                write_report(res, args.out, args.tag, show=False)  # after every row: a time limit keeps what was measured
                del q, k, v, g, do
                free()

    if "variants" in chosen:
        rows = res.setdefault("variants", [])
        T = Ts[-1]
        for D in Ds:
            q, k, v = make_inputs(B, T, H, D, D)
            do = torch.randn_like(v)
            # the forward alone from the rule's inference layout, forward + backward from its training one
            bases = {s: hla_fast.ahla_config(B, T, H, D, D, q.dtype, q.device, 64, training=s == "fwdbwd")
                     for s in ("fwd", "fwdbwd")}
            for name, changes in variant_changes(D).items():
                if wanted and name not in wanted:
                    continue
                row = {"K": D, "T": T, "variant": name, "changes": changes}
                try:
                    for s, base in bases.items():
                        cfg = base.replace(**changes)
                        row[f"{s}_config"] = str(cfg)

                        def fn(q_, k_, v_, cfg=cfg):
                            return hla_fast.ahla(q_, k_, v_, gamma=GAMMA, backend="triton", config=cfg)[0]

                        run = fwd_only(fn, (q, k, v)) if s == "fwd" else fwd_bwd(fn, (q, k, v), do)
                        row[f"{s}_ms"] = median_ms(run)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                log(f"variants {row}")
                free()
            del q, k, v, do
            free()

    if "decode" in chosen:
        Bd, Hd, Kd, Vd = (2, 2, 16, 16) if smoke else (64, 16, 128, 128)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        q, k = (torch.randn(Bd, Hd, Kd, device=DEVICE, generator=gen).bfloat16() for _ in range(2))
        v = torch.randn(Bd, Hd, Vd, device=DEVICE, generator=gen).bfloat16()
        gates = -0.001 * torch.rand(Bd, Hd, device=DEVICE, generator=gen)
        st = AHLAState(torch.randn(Bd, Hd, Kd, Vd, device=DEVICE, generator=gen),
                       torch.randn(Bd, Hd, Kd, Vd, device=DEVICE, generator=gen))
        sb = decode_state_bytes(Bd, Hd, Kd, Vd)
        # the same bytes moved by a device copy of the state
        src = torch.cat([st.P.flatten(), st.E.flatten()])
        dst = torch.empty_like(src)
        copy_ms = median_ms(lambda: dst.copy_(src))

        def step():
            return hla_fast.ahla_step(q, k, v, st, gamma=GAMMA, backend="triton")

        ms = warm_median_ms(step)
        ms_g = median_ms(lambda: hla_fast.ahla_step(q, k, v, st, g=gates, backend="triton"))
        res["decode"] = {"B": Bd, "H": Hd, "K": Kd, "V": Vd, "ms": ms, "g_ms": ms_g, "state_copy_ms": copy_ms,
                         "state_bytes_rw": sb, "gbs": sb / ms / 1e6, "fraction_of_copy": copy_ms / ms,
                         "g_fraction_of_copy": copy_ms / ms_g,
                         "torch_ms": median_ms(lambda: hla_fast.ahla_step(q, k, v, st, gamma=GAMMA, backend="torch"))}
        if CUDA:  # replayed from a CUDA graph: the kernel without the call's host work
            gms = graph_ms(step)
            res["decode"].update(graph_ms=gms, graph_fraction_of_copy=copy_ms / gms)
        log(f"decode {res['decode']}")
        write_report(res, args.out, args.tag, show=False)
        free()

    if "accuracy" in chosen:
        rows = res.setdefault("accuracy", [])
        for D in Ds:
            for T in ([64] if smoke else [1024, 8192]):
                for dtype in (torch.float32, torch.bfloat16):
                    q, k, v = make_inputs(1, T, 2, D, D, dtype=dtype)
                    g = make_gates(1, T, 2)
                    want, _ = hla_fast.ahla(q.double(), k.double(), v.double(), g=g.double(), backend="torch")
                    got, _ = hla_fast.ahla(q, k, v, g=g, backend="triton")
                    rows.append({"K=V": D, "T": T, "dtype": str(dtype), "rel_err": rel_error(got, want)})
                    log(f"accuracy {rows[-1]}")
                    free()

    if "first_call" in chosen:
        res["first_call"] = {f"bf16 K=V={D}": first_call(D, "bfloat16", args.first_call_timeout, smoke) for D in Ds}
        log(f"first_call {res['first_call']}")

    write_report(res, args.out, args.tag)


if __name__ == "__main__":
    main()
