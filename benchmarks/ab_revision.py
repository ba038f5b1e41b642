"""Time an operator of this tree's hla_fast against the hla_fast of an earlier git revision, in one
process.

The earlier package is extracted from git into a temporary folder and imported under another name,
so both run on the same GPU, inputs and Triton. bf16 (``--dtype``: fp32 or fp16 inputs), B=4, H=16,
T=32768 (``--T``), gamma=0.999, K=V in {64, 128} (``--dims``; ``--V`` another value width),
``--gates`` (log-gates that require grad instead of gamma), ``--normalize`` (on |q| and |k|),
``--config`` (a change to this tree's configuration rule, to time a rule change before making it;
for hla3 its second stage's); medians of triton.testing.do_bench (ms) of the whole call, forward
under no_grad and forward + backward, the peak memory one forward + backward allocates beyond what
was allocated before it (the inputs, do and the previous call's gradients), and the relative
difference of the two revisions' outputs (of the inference forward and of the training call) and
input gradients. ``--rounds`` (default 2) times the pair that many times, the earlier revision first
in even rounds and last in odd ones, and reports each code's median over the rounds (each round's
medians beside it): in one round with the earlier revision first, two identical forwards at
K = V = 64 once timed 1.15 against 1.51 ms (``hla2_h100_ab_dd_ahead.json``). On a CUDA machine,
from the repository root:

    python benchmarks/ab_revision.py --rev 62e7c2f --out benchmarks/results/hla2_h200_ab.json
    python benchmarks/ab_revision.py --op ahla --rev 3c5b091 --out benchmarks/results/ahla_h200_ab.json
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))   # config_arg beside this script
from config_arg import DTYPES as DTYPE_NAMES, HELP, OPS, config_changes  # noqa: E402
from records import rel_error  # noqa: E402

DTYPES = {name: getattr(torch, t) for name, t in DTYPE_NAMES.items()}   # --dtype


def extract(rev: str, dest: pathlib.Path) -> str:
    """Write the hla_fast package of ``rev`` under dest/hla_fast_<rev>; return its module name."""
    name = f"hla_fast_{rev}"
    files = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "hla_fast"], capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if f.endswith(".py"):
            out = dest / name / pathlib.Path(f).relative_to("hla_fast")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(subprocess.run(["git", "show", f"{rev}:{f}"], capture_output=True, text=True,
                                          check=True).stdout)
    return name


def time_call(op, q, k, v, do, g=None, normalize=False, config=None):
    """Forward and forward + backward medians (ms) of op(q, k, v) with gamma=0.999, or with the
    log-gates g (a leaf that requires grad) when given, the MB one forward + backward allocates at
    its peak beyond what was allocated before it, and the results {name: tensor}: the inference
    forward's output ``o_inference`` (its layout may differ from the training forward's) and the
    training call's ``o``, ``dq``, ``dk``, ``dv`` (and ``dg``). ``config``: None for the op's rule,
    or a function of ``training`` (whether autograd records) giving its config."""
    inputs = (q, k, v) if g is None else (q, k, v, g)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]

    def call(q, k, v, g=None):
        decay = dict(gamma=0.999) if g is None else dict(g=g)
        if config is not None:
            decay["config"] = config(torch.is_grad_enabled())
        return op(q, k, v, normalize=normalize, **decay)

    def fwd():
        with torch.no_grad():
            return call(*inputs)[0]

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        o, _ = call(*leaves)
        o.backward(do)
        return o

    out = {"o_inference": fwd(), "o": fwd_bwd().detach()}
    out.update((n, x.grad.clone()) for n, x in zip(("dq", "dk", "dv", "dg"), leaves))
    torch.cuda.synchronize()
    times = (do_bench(fwd, warmup=10, rep=50, return_mode="median"),
             do_bench(fwd_bwd, warmup=10, rep=50, return_mode="median"))
    # peak memory of one forward + backward beyond what was allocated before it (inputs, do, grads)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    return (*times, (torch.cuda.max_memory_allocated() - base) / 1e6, out)


def round_order(pair, rounds: int):
    """The (label, module) calls of ``rounds`` rounds of the two-element ``pair``: as given in even
    rounds, reversed in odd ones (ABBA...), so that neither code always runs first."""
    return [x for r in range(rounds) for x in (pair if r % 2 == 0 else pair[::-1])]


def summarize(label, times):
    """One row's numbers from ``times``, the (fwd ms, fwd+bwd ms, peak MB) of each round of
    ``label``: the medians over the rounds (the larger peak), and each round's timings."""
    fwd, fb, mb = (list(x) for x in zip(*times))
    return {"code": label, "fwd_ms": statistics.median(fwd), "fwdbwd_ms": statistics.median(fb),
            "fwdbwd_peak_extra_mb": max(mb), "fwd_ms_rounds": fwd, "fwdbwd_ms_rounds": fb}


def rule_config(op, q, v, changes, training, gated=False, normalize=False, package="hla_fast"):
    """The configuration ``op``'s call on inputs shaped as q [B, T, H, K] and v [.., V] asks its
    rule for (autograd recording it or not: ``training``; with log-gates: ``gated``; normalized),
    changed by ``changes``. hla3: the pair (first stage's rule, second stage's changed:
    ``hla3.chunk.stage_rules``), so that a change times the second stage's layout alone (its
    kernels see V + 1 values when normalized); a second stage changed into (or kept as) layers is
    passed alone, setting both stages as the rule's pair does then (and as ``fwd_shared_walk``
    needs). package: the hla_fast whose rule is asked (an earlier revision's, ``extract``)."""
    hla_fast = importlib.import_module(package)

    B, T, H, K = q.shape
    V = v.shape[-1] + (normalize and op == "hla3")
    shape = (B, T, H, K, V, q.dtype, q.device)
    if op == "ahla":
        return hla_fast.ahla_config(*shape, training=training).replace(**changes)
    if op == "hla2":
        return hla_fast.hla2_config(*shape, gated=gated, normalize=normalize, training=training).replace(**changes)
    stage_rules = importlib.import_module(f"{package}.ops.hla3.chunk").stage_rules
    first, second = stage_rules(*shape, gated=gated, training=training, normalize=normalize)
    second = second.replace(**changes)
    return second if second.layers else (first, second)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the earlier git revision")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--package-dir", default=None,
                    help="a folder holding the earlier package as hla_fast_<rev> (extracted beforehand, for a "
                         "checkout without git history); default: extract it from git")
    ap.add_argument("--op", default="hla2", choices=OPS)
    ap.add_argument("--dims", default="64,128", help="comma list of K=V head sizes")
    ap.add_argument("--V", type=int, default=None, help="value width of every row (default: V = K)")
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the inputs' dtype")
    ap.add_argument("--gates", action="store_true",
                    help="per-token log-gates g = -0.001 * U[0, 1) (that require grad) instead of gamma")
    ap.add_argument("--normalize", action="store_true",
                    help="normalize=True, on |q| and |k| (positive features keep the denominator positive)")
    ap.add_argument("--config", type=config_changes, default=None, help=HELP + "; for this tree's calls only")
    ap.add_argument("--rounds", type=int, default=2,
                    help="timings of the pair, alternating which code runs first; each code's median is reported")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be an int >= 1, got {args.rounds}")
    if args.package_dir:
        sys.path.insert(0, args.package_dir)
        old = importlib.import_module(f"hla_fast_{args.rev}")
    else:
        tmp = pathlib.Path(tempfile.mkdtemp())
        sys.path.insert(0, str(tmp))
        old = importlib.import_module(extract(args.rev, tmp))
    import hla_fast as new

    rows = []
    dtype = DTYPES[args.dtype]
    for D in (int(x) for x in args.dims.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(D)
        q, k, v = (0.3 * torch.randn(4, args.T, 16, n, device="cuda", dtype=dtype, generator=gen)
                   for n in (D, D, args.V or D))
        if args.normalize:
            q, k = q.abs(), k.abs()
        g = -0.001 * torch.rand(4, args.T, 16, device="cuda", generator=gen) if args.gates else None
        do = torch.randn_like(v)
        outs, times = {}, {args.rev: [], "this tree": []}
        for label, mod in round_order(((args.rev, old), ("this tree", new)), args.rounds):
            cfg = None
            if args.config and mod is new:
                cfg = functools.partial(rule_config, args.op, q, v, args.config, gated=args.gates,
                                        normalize=args.normalize)
            f, fb, mb, out = time_call(getattr(mod, args.op), q, k, v, do, g=g, normalize=args.normalize, config=cfg)
            outs.setdefault(label, out)
            times[label].append((f, fb, mb))
            print({"K": D, "code": label, "fwd_ms": f, "fwdbwd_ms": fb}, flush=True)
        for label in times:
            rows.append({"K": D, "V": args.V or D, **summarize(label, times[label])})
            print(rows[-1], flush=True)
        rows[-1]["rel_diff_to_rev"] = {n: rel_error(x, outs[args.rev][n]) for n, x in outs["this tree"].items()}
        print(rows[-1]["rel_diff_to_rev"], flush=True)
        del q, k, v, g, do, outs
        torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "op": args.op, "rev": args.rev,
        "shape": {"B": 4, "T": args.T, "H": 16, "dtype": str(dtype).removeprefix("torch."), "gamma": 0.999},
        "gates": args.gates, "normalize": args.normalize, "config": args.config, "rounds": args.rounds,
        "rows": rows}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
