"""Speed and accuracy of hla_fast.hla2 on one GPU, against its baselines.

Times (median of triton.testing.do_bench, bf16, B=4, H=16, K=V in {64, 128},
T from 1k to 32k): hla_fast forward and forward+backward; torch's causal
scaled_dot_product_attention; the torch backend of hla_fast; and
flash-linear-attention's first-order chunk_linear_attn when it imports.
Also measures the two ceilings (bf16 matmul rate, device copy bandwidth), counts
HLA2's FLOPs and bytes, times the decode step, records accuracy against T,
compares kernel layouts (forward: segments, pipeline stages, two-pass; backward:
split or fused walks, segments), records the CUDA time of each kernel in one
forward + backward (torch.profiler), and times K = V = 256 heads against SDPA.

Writes JSON (device, versions, date, shapes, medians) and a markdown table:
    python benchmarks/bench_hla2.py --out benchmarks/results
Options: --quick (small sizes, for a smoke run), --torch-max-T (largest T for
the slow torch backend; larger ones are recorded as skipped).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
import traceback

import torch
import triton
from triton.testing import do_bench

import hla_fast
from hla_fast.hla2 import HLA2State
import importlib

chunk = importlib.import_module("hla_fast.hla2.chunk")


def median_ms(fn, slow_ms=200.0):
    """Median time of fn() in ms (CUDA events through do_bench; few repeats when slow)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = (time.perf_counter() - t0) * 1e3
    if once > slow_ms:
        times = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[1]
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def hla2_flops(B, H, T, K, V, C=64):
    """Multiply-adds x 2 of the chunk form (forward), per the kernel's products."""
    NT = math.ceil(T / C)
    per_chunk = (
        C * C * K * 2          # X = Q K^T and Y = K Q^T
        + C * K * K            # Q S0
        + C * C * K            # (Q S0) Q^T
        + C * C * C            # A Ym
        + C * K * V            # Q W0
        + C * C * V            # M V
        + C * K * V            # Q^T Vg
        + K * K * V            # S (Q^T Vg)
        + C * C * V            # Ym Vg
        + C * K * V            # Kg^T (Ym Vg)
        + C * K * K            # Kg^T K
    )
    return 2.0 * B * H * NT * per_chunk


def hla2_bytes(B, H, T, K, V, elt=2):
    """Fewest bytes: q, k, v read once, o written once (states stay on chip)."""
    return B * T * H * (2 * K + 2 * V) * elt


def ceilings(quick):
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    tflops = 2 * n ** 3 / ms / 1e9
    nbytes = (1 << 28) if quick else (1 << 31)  # 2 GiB source
    x = torch.randn(nbytes // 4, device="cuda")
    y = torch.empty_like(x)
    ms_c = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    gbs = 2 * nbytes / ms_c / 1e6
    del a, b, x, y
    return {"bf16_matmul_tflops": tflops, "matmul_n": n, "copy_gbs": gbs, "copy_bytes_each_way": nbytes}


def make_inputs(B, T, H, K, V, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(B, T, H, K, device="cuda", generator=g) * 0.3).to(dtype)
    k = (torch.randn(B, T, H, K, device="cuda", generator=g) * 0.3).to(dtype)
    v = torch.randn(B, T, H, V, device="cuda", generator=g).to(dtype)
    return q, k, v


def fwd_bwd(fn, inputs, do):
    leaves = [x.detach().requires_grad_() for x in inputs]

    def run():
        for x in leaves:
            x.grad = None
        o = fn(*leaves)
        o.backward(do)

    return run


def hla(q, k, v):
    """hla_fast's default path, the way a layer calls it."""
    return hla_fast.hla2(q, k, v, gamma=0.999)[0]


def hla_torch(q, k, v):
    return hla_fast.hla2(q, k, v, gamma=0.999, backend="torch")[0]


def sdpa(q, k, v):
    """Causal softmax attention on the same [B, T, H, D] tensors."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


def time_candidates(row, cands, inputs, do):
    """Median forward (no grad) and forward+backward ms of each candidate into row; errors are recorded."""
    for name, fn in cands.items():
        try:
            with torch.no_grad():
                row[f"{name}_fwd_ms"] = median_ms(lambda: fn(*inputs))
            row[f"{name}_fwdbwd_ms"] = median_ms(fwd_bwd(fn, inputs, do))
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.empty_cache()


def load_fla():
    try:
        from fla.ops.linear_attn import chunk_linear_attn

        import fla

        return chunk_linear_attn, getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        return None, f"import failed: {type(e).__name__}: {e}"


def targets(res):
    """The issue's speed targets at T=32k, K=V=64 (and decode), with the numbers behind each."""
    t = {}
    rows = {(r["K"], r["T"]): r for r in res.get("main", [])}
    r = rows.get((64, 32768))
    if r:
        def ratio(a, b):
            return r[a] / r[b] if a in r and b in r else None
        fr = ratio("hla_fast_fwd_ms", "fla_linear_attn_fwd_ms")
        t["fwd_vs_fla_first_order"] = {"ratio": fr, "target": "<= 1.25", "met": fr is not None and fr <= 1.25}
        fb = ratio("hla_fast_fwdbwd_ms", "fla_linear_attn_fwdbwd_ms")
        t["fwdbwd_vs_fla_first_order"] = {"ratio": fb, "target": "<= 2", "met": fb is not None and fb <= 2}
        sp = [ratio(f"torch_backend_{s}_ms", f"hla_fast_{s}_ms") for s in ("fwd", "fwdbwd")]
        t["speedup_vs_torch_backend"] = {"fwd": sp[0], "fwdbwd": sp[1], "target": ">= 10",
                                         "met": all(x is not None and x >= 10 for x in sp)}
    faster = {}
    for (K, T), row in sorted(rows.items()):
        if K == 64 and T >= 2048 and "sdpa_fwd_ms" in row and "hla_fast_fwd_ms" in row:
            faster[T] = {"fwd": row["hla_fast_fwd_ms"] < row["sdpa_fwd_ms"],
                         "fwdbwd": row.get("hla_fast_fwdbwd_ms", 1e9) < row.get("sdpa_fwdbwd_ms", 0)}
    if faster:
        t["faster_than_sdpa_from_2k"] = {"by_T": faster, "met": all(v["fwd"] and v["fwdbwd"] for v in faster.values())}
    d = res.get("decode")
    if d:
        t["decode_state_traffic"] = {"fraction_of_copy": d["fraction_of_copy"],
                                     "graph_fraction_of_copy": d.get("graph_fraction_of_copy"),
                                     "target": ">= 0.60", "met": d["fraction_of_copy"] >= 0.6}
    return t


def write_report(res, out, tag):
    """Write the markdown table (and the targets) next to the JSON."""
    res["targets"] = targets(res)
    with open(os.path.join(out, f"hla2_{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# HLA2 benchmark ({res['device']}, {res['date']})", "",
             f"torch {res['versions']['torch']}, triton {res['versions']['triton']}, "
             f"flash-linear-attention {res['versions']['flash-linear-attention']}; bf16, median ms "
             "(triton.testing.do_bench).", "",
             f"Ceilings: bf16 matmul {res['ceilings']['bf16_matmul_tflops']:.0f} TFLOP/s, "
             f"copy {res['ceilings']['copy_gbs']:.0f} GB/s.", ""]
    if res.get("main"):
        cols = ["hla_fast", "fla_linear_attn", "sdpa", "torch_backend"]
        lines.append("| K=V | T | " + " | ".join(f"{c} fwd | {c} fwd+bwd" for c in cols) + " | hla_fast TFLOP/s |")
        lines.append("|" + "---|" * (3 + 2 * len(cols)))
        for r in res["main"]:
            cells = []
            for c in cols:
                for s in ("fwd", "fwdbwd"):
                    x = r.get(f"{c}_{s}_ms")
                    cells.append(f"{x:.3f}" if isinstance(x, float) else "-")
            tf = r.get("hla_fast_fwd_tflops")
            lines.append(f"| {r['K']} | {r['T']} | " + " | ".join(cells) + f" | {tf:.0f} |" if tf else
                         f"| {r['K']} | {r['T']} | " + " | ".join(cells) + " | - |")
    if res.get("variants"):
        lines += ["", "Kernel layouts (direct kernel launches, gamma = 0.999):", "",
                  "| K=V | T | pass | layout | segments | stages | warps | chunk | grad launches | ms |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["variants"]:
            parts = r.get("grad_parts", "-") if r["pass"] == "bwd" and r["mode"] == "split" else "-"
            lines.append(f"| {r['K']} | {r.get('T', '-')} | {r['pass']} | {r['mode']} | {r.get('segments', 1)} | "
                         f"{r.get('num_stages', 1)} | {r.get('num_warps', 'auto')} | {r['chunk']} | {parts} | "
                         f"{r.get('ms', float('nan')):.3f} |")
    if res.get("profile"):
        lines += ["", "CUDA time per kernel, one forward + backward through `hla2()` (torch.profiler, ms):", "",
                  "| K=V | T | kernel | ms | calls |", "|---|---|---|---|---|"]
        for r in res["profile"]:
            for name, x in sorted(r["kernels"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
                lines.append(f"| {r['K']} | {r['T']} | {name} | {x['ms_per_step']:.3f} | {x['calls_per_step']:.0f} |")
    if res.get("wide"):
        lines += ["", "Wide heads, K = V = 256 (median ms):", "",
                  "| T | hla_fast fwd | hla_fast fwd+bwd | sdpa fwd | sdpa fwd+bwd |", "|---|---|---|---|---|"]
        for r in res["wide"]:
            cells = [r.get(f"{c}_{s}_ms") for c in ("hla_fast", "sdpa") for s in ("fwd", "fwdbwd")]
            lines.append(f"| {r['T']} | " + " | ".join(f"{x:.3f}" if isinstance(x, float) else "-" for x in cells) + " |")
    if res.get("decode"):
        d = res["decode"]
        lines += ["", f"Decode B={d['B']} H={d['H']} K=V={d['K']}: {d['ms'] * 1e3:.1f} us, "
                      f"{d['gbs']:.0f} GB/s of state traffic = {100 * d['fraction_of_copy']:.0f}% of copy bandwidth "
                      f"(torch step {d['torch_ms'] * 1e3:.1f} us)."]
        if "graph_ms" in d:
            lines[-1] += (f" Replayed from a CUDA graph: {d['graph_ms'] * 1e3:.1f} us "
                          f"= {100 * d['graph_fraction_of_copy']:.0f}%.")
    if res.get("accuracy"):
        lines += ["", "| T | rel. err fp32 | rel. err bf16 |", "|---|---|---|"]
        for r in res["accuracy"]:
            lines.append(f"| {r['T']} | {r['fp32']:.1e} | {r['bf16']:.1e} |")
    if res["targets"]:
        lines += ["", "Targets (T=32k, K=V=64; decode B=64, H=16, K=V=128):", ""]
    for name, v in res["targets"].items():
        lines.append(f"- {name}: {'met' if v.get('met') else 'NOT met'} "
                     f"({json.dumps({k_: v_ for k_, v_ in v.items() if k_ != 'met'}, default=str)})")
    if res.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in res["notes"]]
    with open(os.path.join(out, f"hla2_{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--torch-max-T", type=int, default=8192)
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--dims", default="64,128", help="comma list of K=V head sizes")
    ap.add_argument("--only", default="", help="comma list of baselines to time (default: all)")
    ap.add_argument("--from-json", default=None, help="only rebuild the report from a results JSON")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: variants,profile,wide,main,decode,accuracy")
    args = ap.parse_args()
    skip = set(s for s in args.skip.split(",") if s)
    if args.from_json:
        with open(args.from_json) as f:
            write_report(json.load(f), args.out, args.tag)
        return
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_properties(0)
    chunk_linear_attn, fla_version = load_fla()
    res = {
        "device": torch.cuda.get_device_name(0),
        "sms": dev.multi_processor_count,
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version(), "flash-linear-attention": fla_version},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": "bfloat16",
        "notes": [],
    }
    path = os.path.join(args.out, f"hla2_{args.tag}.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    def record(section, row):
        """Append a result row, show it (floats rounded) and save the JSON so far."""
        res[section].append(row)
        print(section, {k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
        save()

    res["ceilings"] = ceilings(args.quick)
    save()
    print("ceilings", res["ceilings"], flush=True)
    B, H = (2, 4) if args.quick else (4, 16)
    Ts = [1024, 2048, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    Ds = [64] if args.quick else [int(x) for x in args.dims.split(",")]
    res["shapes"] = {"B": B, "H": H, "T": Ts, "K=V": Ds}

    # -- decode: B=64, H=16, K=V=128 ----------------------------------------------
    if "decode" not in skip:
        Bd, Hd, Kd, Vd = 64, 16, 128, 128
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(Bd, Hd, Kd, device="cuda", generator=g).bfloat16()
        k = torch.randn(Bd, Hd, Kd, device="cuda", generator=g).bfloat16()
        v = torch.randn(Bd, Hd, Vd, device="cuda", generator=g).bfloat16()
        st = HLA2State(torch.randn(Bd, Hd, Kd, Kd, device="cuda", generator=g),
                       torch.randn(Bd, Hd, Kd, Vd, device="cuda", generator=g))
        ms = median_ms(lambda: hla_fast.hla2_step(q, k, v, st, gamma=0.999))
        state_bytes = 2 * Bd * Hd * (Kd * Kd + Kd * Vd) * 4  # read + write, fp32
        res["decode"] = {"B": Bd, "H": Hd, "K": Kd, "V": Vd, "ms": ms, "state_bytes_rw": state_bytes,
                         "gbs": state_bytes / ms / 1e6,
                         "fraction_of_copy": state_bytes / ms / 1e6 / res["ceilings"]["copy_gbs"]}
        ms_t = median_ms(lambda: hla_fast.hla2_step(q, k, v, st, gamma=0.999, backend="torch"))
        res["decode"]["torch_ms"] = ms_t
        # the same step replayed from a CUDA graph: no Python or launch gaps between steps
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for _ in range(10):
                hla_fast.hla2_step(q, k, v, st, gamma=0.999)
        ms_g = do_bench(lambda: gr.replay(), warmup=25, rep=200, return_mode="median") / 10
        res["decode"]["graph_ms"] = ms_g
        res["decode"]["graph_fraction_of_copy"] = state_bytes / ms_g / 1e6 / res["ceilings"]["copy_gbs"]
        print("decode", res["decode"], flush=True)
        save()

    # -- layouts: forward segments / stages / two-pass, backward split vs fused ----------
    if "variants" not in skip:
        res["variants"] = []
        # (mode, segments, pipeline stages, chunk, warps); None: the launcher's choice
        fwd_layouts = [("fused", 1, 1, 64, None), ("fused", 1, 2, 64, None), ("fused", 2, 1, 64, None),
                       ("fused", 4, 1, 64, None), ("fused", 8, 1, 64, None), ("fused", 16, 1, 64, None),
                       ("fused", None, 1, 64, None), ("fused", None, 2, 64, None), ("fused", None, 1, 64, 8),
                       ("fused", None, 1, 32, None), ("fused", None, 1, 128, None), ("two_pass", 1, 1, 64, None)]
        for D in Ds:
            for Tv in sorted({Ts[-1], min(2048, Ts[-1])}, reverse=True):
                q, k, v = make_inputs(B, Tv, H, D, D)
                do = torch.randn_like(v)
                Cb = chunk.bwd_chunk_size(D, D, 64)
                runs = [("fwd",) + lay + (None,) for lay in fwd_layouts]
                # heads with K and V both above 64 walk in one segment (bwd_launch), so no segment rows there
                runs += [("bwd", m, sg, 1, Cb, None, None) for m in ("split", "fused")
                         for sg in ((1, 2, 4, 8) if D <= 64 else (1,))]
                # the split layout's per-chunk gradient launches (1 dq, 2 dk, 4 dv)
                runs += [("bwd", "split", None, 1, Cb, None, parts) for parts in ((7,), (1, 2, 4), (1, 6))]
                for kind, mode, seg, stages, C, warps, parts in runs:
                    row = {"K": D, "V": D, "T": Tv, "pass": kind, "mode": mode, "chunk": C,
                           "segments": "auto" if seg is None else seg, "num_stages": stages,
                           "num_warps": "auto" if warps is None else warps,
                           "grad_parts": "auto" if parts is None else list(parts)}
                    try:
                        if kind == "fwd":
                            fn = lambda: chunk.fwd_launch(q, k, v, 0.999, None, None, C, mode=mode, store_final=False,
                                                          segments=seg, num_stages=stages, num_warps=warps)
                        else:
                            fn = lambda: chunk.bwd_launch(q, k, v, do, 0.999, None, None, None, None, Cb, mode=mode,
                                                          segments=seg, grad_parts=parts)
                        row["ms"] = median_ms(fn)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    record("variants", row)
                del q, k, v, do
                torch.cuda.empty_cache()

    # -- where the time goes: CUDA time per kernel of one forward + backward (torch.profiler) ----
    if "profile" not in skip:
        res["profile"] = []
        Tp = Ts[-1]
        for D in Ds:
            q, k, v = make_inputs(B, Tp, H, D, D)
            do = torch.randn_like(v)
            run = fwd_bwd(hla, (q, k, v), do)
            run()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
            kernels = {}
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if t and ev.key.startswith("_hla2"):
                    kernels[ev.key] = {"ms_per_step": t / 3 / 1e3, "calls_per_step": ev.count / 3}
            row = {"B": B, "H": H, "T": Tp, "K": D, "V": D, "kernels": kernels}
            record("profile", row)
            del q, k, v, do
            torch.cuda.empty_cache()

    # -- wide heads (K = V = 256: feature-block pairs and value blocks) against SDPA ------
    if "wide" not in skip:
        res["wide"] = []
        for T in ([1024] if args.quick else [1024, 4096, 16384]):
            q, k, v = make_inputs(B, T, H, 256, 256)
            do = torch.randn_like(v)
            row = {"B": B, "H": H, "T": T, "K": 256, "V": 256}
            time_candidates(row, {"hla_fast": hla, "sdpa": sdpa}, (q, k, v), do)
            record("wide", row)
            del q, k, v, do
            torch.cuda.empty_cache()

    # -- main table -------------------------------------------------------------
    if "main" not in skip:
        res["main"] = []
        for D in Ds:
            for T in Ts:
                q, k, v = make_inputs(B, T, H, D, D)
                do = torch.randn_like(v)
                row = {"B": B, "H": H, "T": T, "K": D, "V": D,
                       "hla2_gflop_fwd": hla2_flops(B, H, T, D, D) / 1e9,
                       "hla2_mbytes_fwd": hla2_bytes(B, H, T, D, D) / 1e6}
                cands = {"hla_fast": hla, "sdpa": sdpa}
                if chunk_linear_attn is not None:
                    cands["fla_linear_attn"] = lambda q, k, v: chunk_linear_attn(q, k, v, normalize=False)[0]
                if T <= (args.torch_max_T if D > 64 else max(args.torch_max_T, 32768)):
                    cands["torch_backend"] = hla_torch
                else:
                    row["torch_backend"] = f"skipped: T > {args.torch_max_T} (slow)"
                if args.only:
                    cands = {n_: f_ for n_, f_ in cands.items() if n_ in args.only.split(",")}
                time_candidates(row, cands, (q, k, v), do)
                if "hla_fast_fwd_ms" in row:
                    row["hla_fast_fwd_tflops"] = row["hla2_gflop_fwd"] / row["hla_fast_fwd_ms"]
                record("main", row)
                del q, k, v, do
                torch.cuda.empty_cache()

    # -- accuracy against T (fp32 and bf16, against the float64 torch path) -------
    if "accuracy" not in skip:
        res["accuracy"] = []
        for T in ([1024, 4096] if args.quick else [1024, 4096, 16384, 32768]):
            q, k, v = make_inputs(1, T, 4, 64, 64, dtype=torch.float32, seed=T)
            ref, _ = hla_fast.hla2(q.double(), k.double(), v.double(), gamma=0.999, backend="torch")
            row = {"T": T, "B": 1, "H": 4, "K": 64, "V": 64, "gamma": 0.999}
            for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                qq, kk, vv = (x.to(dt) for x in (q, k, v))
                ref_d = ref if dt == torch.float32 else hla_fast.hla2(
                    qq.double(), kk.double(), vv.double(), gamma=0.999, backend="torch")[0]
                o, _ = hla_fast.hla2(qq, kk, vv, gamma=0.999)
                row[name] = float((o.double() - ref_d).norm() / ref_d.norm())
            record("accuracy", row)

    write_report(res, args.out, args.tag)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
