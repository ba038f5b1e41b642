"""Speed, decode bandwidth and compile time of hla_fast.hla3 (masked third order) on one GPU.

Sections (``--sections a,b`` runs only some):

    ceilings    bf16 matmul rate and device copy bandwidth (always measured: the roofline)
    main        bf16, B=4, H=16, K=V in {64, 128}, T 1k..32k: forward (no grad) and forward +
                backward medians of hla3 with gamma, with per-token log-gates g (that require grad,
                at the largest T) and flash-linear-attention's first-order chunk_linear_attn (when
                fla imports); FLOPs of the chunk form and TFLOP/s
    variants    at the largest T: the second stage's default configuration against others
                (segments, warps, chunks), the first stage at its rule, forward and forward +
                backward: the measurement behind hla3_config
    decode      hla3_step, B=64, H=16, K=V=128: state traffic against copy bandwidth (also with g
                and with normalize=True)
    first_call  seconds of the first forward + backward of a fresh process with an empty Triton
                cache (compile included), bf16 and fp32 at K=V in {64, 128}, one subprocess each

Targets (issue 11): at T = 32k, bf16, B = 4, H = 16, K = V = 64, the forward within 2x and the
forward + backward within 3x of fla's chunk_linear_attn; K = V = 128 is reported beside them.
Timing helpers and inputs come from benchmarks/bench_hla2.py. The JSON is saved after every row.

    python benchmarks/bench_hla3.py --tag h200                     # the H200 run
    python benchmarks/bench_hla3.py --cpu-smoke --out DIR          # every section on the CPU under
                                                                   # the Triton interpreter, tiny shapes
"""
from __future__ import annotations

import os
import sys
import time

if "--cpu-smoke" in sys.argv or "--first-call-child" in sys.argv and "--interpret" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import argparse
import datetime
import json
import math
import platform
import shutil
import subprocess
import tempfile

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

import hla_fast  # noqa: E402
from bench_hla2 import (  # noqa: E402
    CUDA, DEVICE, bench_ms, free, fwd_bwd, fwd_only, graph_ms, hla2_flops, int_list, load_fla, log, make_gates,
    make_inputs, median_ms, warm_median_ms,
)
from records import portable  # noqa: E402

GAMMA = 0.999
TARGET_T = 32768
FLA_FWD, FLA_FWDBWD = 2.0, 3.0  # bounds against chunk_linear_attn at K = V = 64
SECTIONS = ("main", "variants", "decode", "first_call")


# ----------------------------------------------------------------------------- counts


def hla3_flops(B, H, T, K, V, C=64):
    """Multiply-adds x 2 of the forward with chunks of C rows, per the kernels' products: the first
    stage's walk (first-order attention R = LA(q, k, v): Q K^T, Q P0, A V and the carry K^T Vg) and
    the second stage, HLA2's walk at rate 2 on (q, k, R) (``bench_hla2.hla2_flops``). Records before
    2026-12-03 counted the single-walk kernels' products (hla3_h200.md and earlier)."""
    first = 2.0 * B * H * math.ceil(T / C) * (C * C * K + C * K * V + C * C * V + C * K * V)
    return first + hla2_flops(B, H, T, K, V, C)


def hla3_bytes(B, H, T, K, V, elt=2):
    """Fewest bytes of the forward: q, k, v read once, o written once."""
    return B * T * H * (2 * K + 2 * V) * elt


def decode_state_bytes(B, H, K, V, normalize=False):
    """fp32 state read and written by one decode step: S, P, F (and p, f)."""
    return 2 * B * H * (K * K + 2 * K * V + (2 * K if normalize else 0)) * 4


# ----------------------------------------------------------------------------- candidates


def hla3(q, k, v):
    return hla_fast.hla3(q, k, v, gamma=GAMMA, backend="triton")[0]


def hla3_g(q, k, v, g):
    return hla_fast.hla3(q, k, v, g=g, backend="triton")[0]


def with_layout(first_changes, second_changes):
    """hla3 (gamma) with each stage's rule, asked as the call asks it (``ab_revision.rule_config``:
    autograd recording or not), changed: ``first_changes`` to the first stage's (AHLA's rule),
    ``second_changes`` to the second's (``hla3_config``), as ``config=(first, second)``; a second
    stage run as layers sets both stages (one config: the first stage is its walk), so there
    ``first_changes`` must be ``second_changes`` or empty."""
    from ab_revision import rule_config
    from hla_fast.ops.common.autograd import autograd_records

    def call(q, k, v):
        cfg = rule_config("hla3", q, v, second_changes, autograd_records(q, k, v))
        if isinstance(cfg, tuple):
            cfg = (cfg[0].replace(**first_changes), cfg[1])
        elif first_changes and first_changes != second_changes:
            raise ValueError(f"the layered second stage sets both stages: first_changes {first_changes} must be "
                             f"second_changes {second_changes} or empty")
        return hla_fast.hla3(q, k, v, gamma=GAMMA, backend="triton", config=cfg)[0]

    return call


def time_pair(row, name, fn, inputs, do):
    """Forward and forward + backward medians (ms) into row; an error is recorded instead."""
    try:
        row[f"{name}_fwd_ms"] = median_ms(fwd_only(fn, inputs))
        row[f"{name}_fwdbwd_ms"] = median_ms(fwd_bwd(fn, inputs, do))
    except Exception as e:  # noqa: BLE001
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    free()


def variant_changes(base, K):
    """Layouts timed against the default ``base`` (a ChunkConfig) for K-wide keys: the segment
    counts of each walk around the rule's, the other warp count, both passes on the other chunk
    sizes that fit (chunks of 64 only up to K = 64: wider, the tiles overflow shared memory), and
    the forward's loads pipelined two stages deep."""
    out = {"default": {}}
    out["fwd_stages=2"] = {"fwd_stages": 2}
    for field in ("fwd_segments", "bwd_segments"):
        n = getattr(base, field)
        for s in sorted({1, 2, n * 2, n * 4, max(1, n // 2)} - {n}):
            out[f"{field}={s}"] = {field: s}
    for field in ("fwd_warps", "bwd_warps"):
        other = 8 if getattr(base, field) == 4 else 4
        out[f"{field}={other}"] = {field: other}
    for c in (16, 32, 64):
        if c != base.fwd_chunk and (c < 64 or K <= 64):
            out[f"chunks={c}"] = {"fwd_chunk": c, "bwd_chunk": c, "save_states": True}
    return out


# ----------------------------------------------------------------------------- first call


def first_call_child(args):
    """In a fresh process: time the first hla3 forward and backward (compile included), then the
    same again warm. Prints one line FIRST_CALL_JSON {...}."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    D = args.dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.B, args.T, args.H, D, generator=gen).mul(0.3).to(dev, dt).requires_grad_() for _ in range(3))
    do = torch.randn(args.B, args.T, args.H, D, generator=gen).to(dev, dt)
    (q * 1).sum()  # the device context exists before the clock starts

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    out = {"dtype": args.dtype, "K": D, "V": D, "B": args.B, "T": args.T, "H": args.H}
    t0 = time.perf_counter()
    o, _ = hla_fast.hla3(q, k, v, gamma=GAMMA, backend="triton")
    sync()
    out["fwd_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    o.backward(do)
    sync()
    out["bwd_s"] = time.perf_counter() - t0
    out["fwdbwd_s"] = out["fwd_s"] + out["bwd_s"]
    t0 = time.perf_counter()
    o, _ = hla_fast.hla3(q, k, v, gamma=GAMMA, backend="triton")
    o.backward(do)
    sync()
    out["warm_fwdbwd_s"] = time.perf_counter() - t0
    print("FIRST_CALL_JSON " + json.dumps(out), flush=True)


def run_first_call(dtype, dim, shape, timeout_s, interpret):
    """One first-call subprocess with an empty TRITON_CACHE_DIR; returns its row."""
    cache = tempfile.mkdtemp(prefix="hla3_first_call_")
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    cmd = [sys.executable, os.path.abspath(__file__), "--first-call-child", "--dtype", dtype, "--dim", str(dim),
           "--B", str(shape["B"]), "--T", str(shape["T"]), "--H", str(shape["H"])] + (["--interpret"] if interpret else [])
    row = {"dtype": dtype, "K": dim, **shape}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        line = next((ln for ln in p.stdout.splitlines()[::-1] if ln.startswith("FIRST_CALL_JSON ")), None)
        if p.returncode == 0 and line:
            row.update(json.loads(line[len("FIRST_CALL_JSON "):]), status="ok")
        else:
            row.update(status="error", error=f"rc={p.returncode}: " + portable(p.stderr or p.stdout)[-600:])
    except subprocess.TimeoutExpired:
        row["status"] = "timeout"
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    row["wall_s"] = time.perf_counter() - t0
    return row


# ----------------------------------------------------------------------------- targets and report


def targets(res):
    """Every target, met or not, with the numbers behind it."""
    out = []
    rows = [r for r in res.get("main", []) if r["T"] == max([x["T"] for x in res.get("main", [])] or [0])]
    for r in rows:
        for s, bound in (("fwd", FLA_FWD), ("fwdbwd", FLA_FWDBWD)):
            a, b = r.get(f"hla3_{s}_ms"), r.get(f"fla_{s}_ms")
            ratio = a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None
            desc = f"{'fwd' if s == 'fwd' else 'fwd+bwd'} <= {bound}x fla chunk_linear_attn, K=V={r['K']}, T={r['T']}"
            binding = r["K"] == 64
            out.append({"target": desc, "binding": binding, "hla3_ms": a, "fla_ms": b, "ratio": ratio,
                        "met": None if ratio is None else ratio <= bound})
    return out


def _f(x, nd=3):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}g}"
    return str(x)


def render_markdown(res):
    v = res.get("versions", {})
    lines = [f"# hla3 on {res.get('device')}", "",
             f"Date {res.get('date')}; torch {v.get('torch')}, triton {v.get('triton')}, cuda {v.get('cuda')}, "
             f"flash-linear-attention {v.get('flash-linear-attention')}. bf16 inputs, gamma = {GAMMA}.", ""]
    c = res.get("ceilings") or {}
    if c:
        lines += [f"Ceilings: bf16 matmul {_f(c.get('bf16_matmul_tflops'))} TFLOP/s, copy {_f(c.get('copy_gbs'))} GB/s.", ""]
    if res.get("main"):
        lines += ["## Forward and forward + backward (median ms)", "",
                  "| T | K=V | segments fwd/bwd | hla3 fwd | hla3 fwd+bwd | 1 segment fwd | 1 segment fwd+bwd "
                  "| hla3 g fwd+bwd | fla fwd | fla fwd+bwd | fwd / fla | fwd+bwd / fla | hla3 fwd TFLOP/s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["main"]:
            fr = [r.get(f"hla3_{s}_ms") / r.get(f"fla_{s}_ms") if isinstance(r.get(f"hla3_{s}_ms"), float)
                  and isinstance(r.get(f"fla_{s}_ms"), float) else None for s in ("fwd", "fwdbwd")]
            lines.append(f"| {r['T']} | {r['K']} | {r.get('fwd_segments')}/{r.get('bwd_segments')} | "
                         f"{_f(r.get('hla3_fwd_ms'))} | {_f(r.get('hla3_fwdbwd_ms'))} | "
                         f"{_f(r.get('hla3_one_segment_fwd_ms'))} | {_f(r.get('hla3_one_segment_fwdbwd_ms'))} | "
                         f"{_f(r.get('hla3_g_fwdbwd_ms'))} | {_f(r.get('fla_fwd_ms'))} | {_f(r.get('fla_fwdbwd_ms'))} | "
                         f"{_f(fr[0])} | {_f(fr[1])} | {_f(r.get('hla3_fwd_tflops'))} |")
        errs = [(r["T"], r["K"], k_, x) for r in res["main"] for k_, x in r.items() if k_.endswith("_error")]
        lines += [""] + [f"- error at T={a}, K={b}, {n}: {e}" for a, b, n, e in errs] + [""]
        sh = res.get("shapes") or {}
        done = {(r["T"], r["K"]) for r in res["main"]}
        missing = [(T, K) for K in sh.get("K=V", []) for T in sh.get("T", []) if (T, K) not in done]
        if missing:
            lines += ["Not measured (the run ended before these rows): " +
                      ", ".join(f"T={T} at K=V={K}" for T, K in missing) + ".", ""]
    if res.get("variants"):
        lines += ["## Layouts at the largest T (median ms)", "",
                  "| T | K=V | variant | fwd | fwd+bwd | error |", "|---|---|---|---|---|---|"]
        for r in res["variants"]:
            lines.append(f"| {r['T']} | {r['K']} | {r['variant']} | {_f(r.get('hla3_fwd_ms'))} | "
                         f"{_f(r.get('hla3_fwdbwd_ms'))} | {r.get('hla3_error', '')[:120]} |")
        lines.append("")
    d = res.get("decode")
    if d:
        lines += ["## Decode (hla3_step)", "", f"B={d['B']}, H={d['H']}, K={d['K']}, V={d['V']}: "
                  f"{_f(d.get('ms'))} ms, {_f(d.get('gbs'))} GB/s of fp32 state ({_f(d.get('fraction_of_copy'))} of copy "
                  f"bandwidth); with g {_f(d.get('g_ms'))} ms; normalized {_f(d.get('norm_ms'))} ms; torch step "
                  f"{_f(d.get('torch_ms'))} ms." + (f" Replayed from a CUDA graph: {_f(d['graph_ms'])} ms, "
                  f"{_f(d['graph_fraction_of_copy'])} of copy bandwidth." if "graph_ms" in d else ""), ""]
    if res.get("first_call"):
        lines += ["## First call of a fresh process (compile included, s)", "",
                  "| dtype | K=V | status | fwd | bwd | fwd+bwd | warm fwd+bwd |", "|---|---|---|---|---|---|---|"]
        for r in res["first_call"]:
            lines.append(f"| {r['dtype']} | {r['K']} | {r['status']} | {_f(r.get('fwd_s'))} | {_f(r.get('bwd_s'))} | "
                         f"{_f(r.get('fwdbwd_s'))} | {_f(r.get('warm_fwdbwd_s'))} |")
        lines.append("")
    if res.get("targets"):
        lines += ["## Targets", "", "| target | binding | hla3 ms | fla ms | ratio | met |", "|---|---|---|---|---|---|"]
        for t in res["targets"]:
            lines.append(f"| {t['target']} | {t['binding']} | {_f(t['hla3_ms'])} | {_f(t['fla_ms'])} | {_f(t['ratio'])} | "
                         f"{'-' if t['met'] is None else ('yes' if t['met'] else 'no')} |")
        lines.append("")
    if res.get("runs"):
        lines += ["## Runs merged into this file", ""]
        for r in res["runs"]:
            lines.append(f"- {r['sections']}: {r['date']}, arguments {r.get('args')}" + (f" ({r['note']})" if r.get("note") else ""))
        lines.append("")
    lines += ["Timings: medians of triton.testing.do_bench of the whole Python call (three CUDA-event timings "
              "for calls over 200 ms), helpers of benchmarks/bench_hla2.py. fwd: under torch.no_grad(); "
              "fwd+bwd: q, k, v (and g) require grad, o.backward(do).", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--tag", default="h200", help="files hla3_<tag>.json and hla3_<tag>.md")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under the Triton interpreter")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--dims", default=None, help="comma list of K=V head sizes (default 64,128; 16,32 with --cpu-smoke)")
    ap.add_argument("--Ts", default=None, help="comma list of sequence lengths (default 1024..32768; 64,128 with --cpu-smoke)")
    ap.add_argument("--variants", default=None,
                    help="comma list of the variants section's layouts to time (default: all), e.g. default,fwd_stages=1")
    ap.add_argument("--first-call-timeout", type=float, default=300.0)
    # the first-call child (internal)
    ap.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--interpret", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--dim", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--B", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--T", type=int, default=2048, help=argparse.SUPPRESS)
    ap.add_argument("--H", type=int, default=16, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.first_call_child:
        first_call_child(args)
        return
    chosen = [s for s in args.sections.split(",") if s]
    if set(chosen) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(set(chosen) - set(SECTIONS))}; known: {','.join(SECTIONS)}")
    if not CUDA and not args.cpu_smoke:
        ap.error("no CUDA device: use --cpu-smoke on a machine without a GPU")
    smoke = args.cpu_smoke
    os.makedirs(args.out, exist_ok=True)
    chunk_linear_attn, fla_version = load_fla()
    res = {"device": torch.cuda.get_device_name(0) if CUDA else "cpu (Triton interpreter, --cpu-smoke)",
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                        "python": platform.python_version(), "flash-linear-attention": fla_version},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "dtype": "bfloat16", "gamma": GAMMA,
           "args": {a: b for a, b in vars(args).items() if a != "out"}}  # no path of the measuring machine
    path = os.path.join(args.out, f"hla3_{args.tag}")

    def save():
        with open(path + ".json", "w") as f:
            json.dump(res, f, indent=1, default=str)

    B, H = (1, 2) if smoke else (4, 16)
    Ts = int_list(args.Ts, [64, 128] if smoke else [1024, 2048, 4096, 8192, 16384, TARGET_T])
    Ds = int_list(args.dims, [16, 32] if smoke else [64, 128])
    res["shapes"] = {"B": B, "H": H, "T": Ts, "K=V": Ds}
    fla_fn = (lambda q, k, v: chunk_linear_attn(q, k, v, normalize=False)[0]) if chunk_linear_attn else None

    # -- ceilings ---------------------------------------------------------------------------------
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, warmup=25, rep=100)
    nbytes = (1 << 20) if smoke else (1 << 31)
    x = torch.randn(nbytes // 4, device=DEVICE)
    y = torch.empty_like(x)
    ms_c = bench_ms(lambda: y.copy_(x), warmup=25, rep=100)
    res["ceilings"] = {"bf16_matmul_tflops": 2 * n ** 3 / ms / 1e9, "copy_gbs": 2 * nbytes / ms_c / 1e6}
    del a, b, x, y
    free()
    save()
    log(f"ceilings {res['ceilings']}")

    if "main" in chosen:
        res["main"] = []
        for D in Ds:
            for T in Ts:
                q, k, v = make_inputs(B, T, H, D, D)
                do = torch.randn_like(v)
                cfg = hla_fast.hla3_config(B, T, H, D, D, q.dtype, q.device)   # gamma: ungated rule
                row = {"B": B, "H": H, "T": T, "K": D, "V": D, "flop_chunk": cfg.fwd_chunk,
                       "gflop_fwd": hla3_flops(B, H, T, D, D, cfg.fwd_chunk) / 1e9,
                       "mbytes_fwd": hla3_bytes(B, H, T, D, D) / 1e6}
                time_pair(row, "hla3", hla3, (q, k, v), do)
                row["fwd_segments"], row["bwd_segments"] = cfg.fwd_segments, cfg.bwd_segments
                if T == Ts[-1]:
                    time_pair(row, "hla3_g", hla3_g, (q, k, v, make_gates(B, T, H)), do)
                    # every walk of both stages as one segment: what the segments buy
                    one = {"fwd_segments": 1, "bwd_segments": 1}
                    time_pair(row, "hla3_one_segment", with_layout(one, one), (q, k, v), do)
                if fla_fn is not None:
                    time_pair(row, "fla", fla_fn, (q, k, v), do)
                if isinstance(row.get("hla3_fwd_ms"), float):
                    row["hla3_fwd_tflops"] = row["gflop_fwd"] / row["hla3_fwd_ms"]
                res["main"].append(row)
                save()
                log(f"main {row}")
                del q, k, v, do
                free()

    if "variants" in chosen:
        res["variants"] = []
        T = Ts[-1]
        wanted = set(args.variants.split(",")) if args.variants else None
        if wanted:
            known = {n for D in Ds for n in variant_changes(hla_fast.hla3_config(B, T, H, D, D, torch.bfloat16, DEVICE), D)}
            unknown = sorted(wanted - known)
            if unknown:
                ap.error(f"--variants: unknown layouts {unknown}; known: {', '.join(sorted(known))}")
        for D in Ds:
            q, k, v = make_inputs(B, T, H, D, D)
            do = torch.randn_like(v)
            base = hla_fast.hla3_config(B, T, H, D, D, q.dtype, q.device)
            for name, changes in variant_changes(base, D).items():
                if wanted and name not in wanted:
                    continue
                row = {"T": T, "K": D, "variant": name, "changes": changes}
                try:
                    row["config"] = str(base.replace(**changes))   # the second stage's, inference
                    time_pair(row, "hla3", with_layout({}, changes), (q, k, v), do)
                except Exception as e:  # noqa: BLE001
                    row["hla3_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                res["variants"].append(row)
                save()
                log(f"variants {row}")
            del q, k, v, do
            free()

    if "decode" in chosen:
        Bd, Hd, Kd, Vd = (2, 2, 16, 16) if smoke else (64, 16, 128, 128)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        q, k, v = (torch.randn(Bd, Hd, d, device=DEVICE, generator=gen).bfloat16() for d in (Kd, Kd, Vd))
        gates = -0.001 * torch.rand(Bd, Hd, device=DEVICE, generator=gen)
        parts = [torch.randn(s, device=DEVICE, generator=gen) for s in [(Bd, Hd, Kd, Kd), (Bd, Hd, Kd, Vd), (Bd, Hd, Kd, Vd)]]
        st = hla_fast.HLA3State(*parts)
        stn = hla_fast.HLA3State(*parts, torch.rand(Bd, Hd, Kd, device=DEVICE, generator=gen),
                                 torch.rand(Bd, Hd, Kd, device=DEVICE, generator=gen))
        copy = res["ceilings"]["copy_gbs"]
        sb = decode_state_bytes(Bd, Hd, Kd, Vd)
        ms = warm_median_ms(lambda: hla_fast.hla3_step(q, k, v, st, gamma=GAMMA, backend="triton"))
        d = {"B": Bd, "H": Hd, "K": Kd, "V": Vd, "ms": ms, "state_bytes_rw": sb, "gbs": sb / ms / 1e6,
             "fraction_of_copy": sb / ms / 1e6 / copy}
        d["torch_ms"] = median_ms(lambda: hla_fast.hla3_step(q, k, v, st, gamma=GAMMA, backend="torch"))
        d["g_ms"] = median_ms(lambda: hla_fast.hla3_step(q, k, v, st, g=gates, backend="triton"))
        qa, ka = q.abs(), k.abs()
        d["norm_ms"] = median_ms(lambda: hla_fast.hla3_step(qa, ka, v, stn, gamma=GAMMA, normalize=True, backend="triton"))
        d["norm_fraction_of_copy"] = decode_state_bytes(Bd, Hd, Kd, Vd, True) / d["norm_ms"] / 1e6 / copy
        if CUDA:  # replayed from a CUDA graph: the kernel without the call's host work
            d["graph_ms"] = graph_ms(lambda: hla_fast.hla3_step(q, k, v, st, gamma=GAMMA, backend="triton"))
            d["graph_fraction_of_copy"] = sb / d["graph_ms"] / 1e6 / copy
        res["decode"] = d
        save()
        log(f"decode {d}")

    if "first_call" in chosen:
        res["first_call"] = []
        shape = {"B": 1, "T": 128, "H": 2} if smoke else {"B": 4, "T": 2048, "H": 16}
        for dtype in ("bf16", "fp32"):
            for dim in ([16] if smoke else [64, 128]):
                row = run_first_call(dtype, dim, shape, args.first_call_timeout, interpret=smoke)
                res["first_call"].append(row)
                save()
                log(f"first_call {row}")

    res["targets"] = targets(res)
    save()
    with open(path + ".md", "w") as f:
        f.write(render_markdown(res))
    log(f"wrote {path}.json and {path}.md")


if __name__ == "__main__":
    main()
