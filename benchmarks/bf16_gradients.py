"""How far bf16 gradients are from float64, normalized or not: the Triton kernels and the torch backend.

Every operator's gradient is a sum of terms. Normalized (o = N / (den + eps)), dq and dk are the
numerator's terms plus the denominator's, -(do . o) / d times the same operator on a column of ones,
and the two cancel in large part: an output that is a weighted mean of the values does not move
when every value moves by one constant. The kernels form each of the two with bf16 operands (their
products are bf16 tensor-core dots; AHLA's backward also carries the denominator's gradient as one
more bf16 column of dO), so their rounding is not cancelled with them; the torch backend computes in
fp32 throughout. This script measures the relative error ||x - x64|| / ||x64|| of dq, dk and dv
(and of the output) of bf16 calls on both backends, against the float64 torch path on the same
bf16-rounded inputs, for every operator, with and without normalize.

Inputs: q, k with entries in [0.05, 0.55) (positive features: the denominator stays > 0), v ~ N(0, 1),
gamma = 0.95, a loss sum(o * w) with w ~ N(0, 1) in float64.

    python benchmarks/bf16_gradients.py --tag h200            # CUDA (B=1, T=2048, H=4, K=V=64)
    python benchmarks/bf16_gradients.py --cpu --tag cpu       # the Triton interpreter (T=64, K=V=16)
    python benchmarks/bf16_gradients.py --render benchmarks/results/bf16_gradients_cpu.json

Writes ``<out>/bf16_gradients_<tag>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

if "--cpu" in sys.argv:   # must precede importing triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from records import rel_error, render_stored, write_record  # noqa: E402

OPS = ("hla2", "ahla", "hla3")
GAMMA = 0.95
GRADS = ("dq", "dk", "dv")


def make_inputs(B, T, H, K, V, seed=0):
    """bf16 q, k (entries in [0.05, 0.55)), v ~ N(0, 1) and float64 loss weights w [B, T, H, V]."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.rand(B, T, H, K, generator=gen) * 0.5 + 0.05).bfloat16()
    k = (torch.rand(B, T, H, K, generator=gen) * 0.5 + 0.05).bfloat16()
    v = torch.randn(B, T, H, V, generator=gen).bfloat16()
    w = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    return q, k, v, w


def output_and_grads(op, q, k, v, w, dtype, device, backend, normalize):
    """(o, dq, dk, dv) of sum(o * w) for ``op`` on q, k, v cast to ``dtype`` on ``device``."""
    leaves = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
    o, _ = op(*leaves, gamma=GAMMA, normalize=normalize, backend=backend)
    grads = torch.autograd.grad((o.double() * w.to(device)).sum(), leaves)
    return (o,) + grads


def measure(name, q, k, v, w, device):
    """One operator's rows: {normalize: {backend: {"o": err, "dq": err, ...}}}."""
    import hla_fast

    op = getattr(hla_fast, name)
    out = {}
    for normalize in (False, True):
        ref = output_and_grads(op, q, k, v, w, torch.float64, "cpu", "torch", normalize)
        row = {}
        for backend in ("triton", "torch"):
            got = output_and_grads(op, q, k, v, w, torch.bfloat16, device, backend, normalize)
            row[backend] = {n: rel_error(a, b) for n, a, b in zip(("o",) + GRADS, got, ref)}
        out[str(normalize)] = row
    return out


def render_markdown(res):
    s = res["shape"]
    lines = [f"# bf16 gradients against float64 ({res['device']}, {res['date']})", "",
             f"torch {res['versions']['torch']}, triton {res['versions']['triton']}; B={s['B']}, T={s['T']}, "
             f"H={s['H']}, K={s['K']}, V={s['V']}, gamma={res['gamma']}; q, k in [0.05, 0.55), v ~ N(0, 1); "
             "loss sum(o * w), w ~ N(0, 1).", "",
             "Relative error ||x - x64|| / ||x64|| of bf16 calls against the float64 torch path on the same "
             "bf16 inputs. triton: the kernels (bf16 operands, fp32 accumulation); torch: the torch backend "
             "(fp32 throughout).", "",
             "| op | normalize | backend | o | dq | dk | dv |", "|---|---|---|---|---|---|---|"]
    for name in res["ops"]:
        for normalize, row in res["rows"][name].items():
            for backend, e in row.items():
                errs = " | ".join(f"{e[n]:.1e}" for n in ("o",) + GRADS)
                lines.append(f"| {name} | {normalize} | {backend} | {errs} |")
    if res.get("command"):
        lines += ["", f"Command: `{res['command']}`"]
    return "\n".join(lines) + "\n"


def _measured_flags(argv):
    """The command-line flags that decide what was measured: ``--out`` (where the record goes) left out."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return kept


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--tag", default=None, help="files bf16_gradients_<tag>.json/md (default: h200, or cpu with --cpu)")
    ap.add_argument("--cpu", action="store_true",
                    help="small shapes on the CPU, the kernels through Triton's interpreter")
    ap.add_argument("--ops", default=",".join(OPS), help="comma list of operators")
    ap.add_argument("--render", default=None, help="only re-render the markdown of a stored JSON record")
    args = ap.parse_args()
    if args.render:
        render_stored(args.render, render_markdown)
        return
    ops = args.ops.split(",")
    unknown = [x for x in ops if x not in OPS]
    if unknown:
        ap.error(f"--ops: unknown operators {unknown}; expected a comma list of {', '.join(OPS)}")
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --cpu to run the kernels through Triton's interpreter")
    device = "cpu" if args.cpu else "cuda"
    shape = dict(B=1, T=64, H=2, K=16, V=16) if args.cpu else dict(B=1, T=2048, H=4, K=64, V=64)
    q, k, v, w = make_inputs(**shape)
    import triton

    res = {"device": "CPU (Triton interpreter)" if args.cpu else torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
           "shape": shape, "gamma": GAMMA, "ops": ops,
           "rows": {name: measure(name, q, k, v, w, device) for name in ops},
           "command": " ".join(["python benchmarks/bf16_gradients.py", *_measured_flags(sys.argv[1:])])}
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"bf16_gradients_{args.tag or ('cpu' if args.cpu else 'h200')}")
    write_record(base, res, render_markdown)
    print(render_markdown(res))


if __name__ == "__main__":
    main()
