"""Where the time of one forward + backward (or, with ``--forward``, of one inference forward)
goes: CUDA time per kernel, from torch.profiler.

For each case ``op:K:T`` (op in hla2, ahla, hla3; K = V; bf16, B = 4, H = 16, gamma = 0.999, the
default configuration), ``op:K:T:g`` (per-token log-gates g that require grad instead of gamma),
``op:K:T:n`` (normalize=True, on |q| and |k|) or ``op:K:T:gn`` (both), two warm-up calls, then three
forward + backward calls under the profiler; every kernel's self CUDA time is divided by three.
Triton kernels appear under their function names (``hla2_bwd_grad_kernel``), torch's own (sums,
casts, fills) under theirs.

    python benchmarks/profile_kernels.py --tag h200                 # the recorded run (a GPU)
    python benchmarks/profile_kernels.py --cases ahla:128:32768 --config '{"bwd_layers": true}' --tag x
    python benchmarks/profile_kernels.py --cases hla2:64:32768,hla2:64:32768:n --tag hla2_normalize
    python benchmarks/profile_kernels.py --cases hla2:128:32768:n --forward --tag hla2_forward
    python benchmarks/profile_kernels.py --render benchmarks/results/kernels_h200.json
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from config_arg import HELP, config_changes  # noqa: E402
from records import record_parser, render_stored, stamp, write_record  # noqa: E402

CASES = "ahla:128:32768,ahla:64:32768,hla3:64:32768,hla3:128:8192,hla2:128:32768,hla2:64:32768"
CALLS = 3
FLAGS = ("g", "n", "gn")   # a case's optional suffix: gates, normalize, both


def parse_cases(text):
    """'op:K:T[:g|:n|:gn],...' -> [(op, K, T, gated, normalize)], checked."""
    out = []
    for item in text.split(","):
        parts = item.split(":")
        flags = parts.pop() if len(parts) == 4 and parts[3] in FLAGS else ""
        if len(parts) != 3 or parts[0] not in ("hla2", "ahla", "hla3") or not all(x.isdigit() for x in parts[1:]):
            raise ValueError(f"--cases: expected op:K:T or op:K:T:FLAGS (FLAGS one of g, n, gn) with op in hla2, "
                             f"ahla, hla3, got {item!r}")
        out.append((parts[0], int(parts[1]), int(parts[2]), "g" in flags, "n" in flags))
    return out


def checked_cases(ap, text):
    """parse_cases(text), or the command line's error naming --cases."""
    try:
        return parse_cases(text)
    except ValueError as e:
        ap.error(str(e))


CASES_HELP = "comma list of op:K:T or op:K:T:FLAGS (g, n or gn)"


def profile_case(op, D, T, gated=False, changes=None, normalize=False, forward=False):
    """{kernel name: [ms per call, launches per call]}, largest first; a call is a forward +
    backward, or with ``forward`` an inference forward (under no_grad, the rule as such a call asks it).
    gated: log-gates g [B, T, H] (``bench_hla2.make_gates``) that require grad, instead of gamma.
    normalize: normalize=True, on |q| and |k| (a positive denominator).
    changes: ChunkConfig fields changed from the rule's training layout (None: the rule's; hla3:
    the second stage's, ``ab_revision.rule_config``)."""
    import hla_fast
    from ab_revision import rule_config
    from bench_hla2 import make_gates, make_inputs
    from torch.profiler import ProfilerActivity, profile

    fn = getattr(hla_fast, op)
    q, k, v = make_inputs(4, T, 16, D, D)
    if normalize:
        q, k = q.abs(), k.abs()
    q, k, v = (x.requires_grad_(not forward) for x in (q, k, v))
    decay = {"g": make_gates(4, T, 16).requires_grad_(not forward)} if gated else {"gamma": 0.999}
    do = torch.randn_like(v)
    # the rule as the call with these flags asks it (hla3: each stage's), changed
    cfg = rule_config(op, q, v, changes or {}, training=not forward, gated=gated, normalize=normalize)

    def step():
        if forward:
            with torch.no_grad():
                fn(q, k, v, backend="triton", config=cfg, normalize=normalize, **decay)
            return
        for x in (q, k, v, *(x for x in decay.values() if torch.is_tensor(x))):
            x.grad = None   # a fresh gradient each call, not an accumulation into the last one
        o, _ = fn(q, k, v, backend="triton", config=cfg, normalize=normalize, **decay)
        o.backward(do)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            step()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if t > 0:
            rows[e.key[:80]] = [t / CALLS / 1000, e.count // CALLS]
    return {"op": op, "K": D, "V": D, "T": T, "B": 4, "H": 16, "gated": gated, "normalize": normalize,
            "forward": forward, "config": str(cfg),
            "kernels_ms": dict(sorted(rows.items(), key=lambda kv: -kv[1][0]))}


def render_markdown(res):
    v = res.get("versions", {})
    call = "inference forward" if res.get("forward") else "forward + backward"
    lines = [f"# Kernel times of one {call} on {res['device']}", "",
             f"Date {res['date']}; torch {v.get('torch')}, triton {v.get('triton')}"
             + (f"; code {res['code']}" if res.get("code") else "") + ". bf16, B = 4, H = 16, gamma = 0.999, "
             + (f"the rule's configuration changed by `{json.dumps(res['config'])}`" if res.get("config")
                else "the default configuration")
             + f"; self CUDA time per call, the mean of {CALLS} profiled calls (`benchmarks/profile_kernels.py`).", ""]
    if res.get("notes"):
        lines += [f"- {n}" for n in res["notes"]] + [""]
    for r in res["cases"]:
        total = sum(ms for ms, _ in r["kernels_ms"].values())
        gates = (", gates g" if r.get("gated") else "") + (", normalized" if r.get("normalize") else "")
        lines += [f"## {r['op']}{gates}, K = V = {r['K']}, T = {r['T']}: {total:.3g} ms of kernels", "",
                  f"`{r['config']}`", "", "| kernel | ms | share | launches |", "|---|---|---|---|"]
        for name, (ms, n) in r["kernels_ms"].items():
            if ms >= 0.001:
                lines.append(f"| `{name}` | {ms:.3g} | {ms / total:.0%} | {n} |")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = record_parser(__doc__, "kernels", "h200")
    ap.add_argument("--cases", default=CASES, help=CASES_HELP)
    ap.add_argument("--config", type=config_changes, default=None, help=HELP + " (every case)")
    ap.add_argument("--forward", action="store_true", help="profile inference forwards instead")
    args = ap.parse_args()
    if args.render:
        render_stored(args.render, render_markdown)
        return
    cases = checked_cases(ap, args.cases)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (kernel times come from the CUDA profiler)")
    res = {**stamp(torch.cuda.get_device_name(0)), "cases": [], "forward": args.forward,
           **({"config": args.config} if args.config else {})}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"kernels_{args.tag}")
    for op, D, T, gated, normalize in cases:
        t0 = time.perf_counter()
        res["cases"].append(profile_case(op, D, T, gated, args.config, normalize, args.forward))
        print(f"{op} K={D} T={T} gated={gated} normalize={normalize}: {time.perf_counter() - t0:.1f} s", flush=True)
        write_record(path, res, render_markdown)
        torch.cuda.empty_cache()
    print(f"wrote {path}.json and {path}.md")


if __name__ == "__main__":
    main()
