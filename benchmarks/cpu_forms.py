"""CPU time of the four forms of each hla_ref operator against sequence length n.

Prints a table of median times and the growth exponent of each form (the slope of log time against
log n over the measured range), and writes the same numbers, with the machine and versions, to
benchmarks/results/cpu_forms.json. Run from the repository root::

    python benchmarks/cpu_forms.py                 # default sizes, a minute or two
    python benchmarks/cpu_forms.py --quick         # smaller sizes
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pathlib
import platform
import time

import numpy as np

import hla_ref

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

# Which forms to time per operator, and the largest n each may take (scan and stream are serial
# Python loops; the naive third order and the paper variant are left out as O(n^4) / d^3-state).
FORMS = {
    "hla2": {"naive": hla_ref.hla2_naive, "stream": hla_ref.hla2_stream,
             "scan": hla_ref.hla2_scan, "chunked": hla_ref.hla2_chunked},
    "ahla": {"naive": hla_ref.ahla_naive, "stream": hla_ref.ahla_stream,
             "scan": hla_ref.ahla_scan, "chunked": hla_ref.ahla_chunked},
    "hla3": {"naive": hla_ref.hla3_naive, "stream": hla_ref.hla3_stream,
             "scan": hla_ref.hla3_scan, "chunked": hla_ref.hla3_chunked},
}
MAX_N = {"naive": 4096, "stream": 2048, "scan": 1024, "chunked": 8192}


def median_time(fn, *args, repeats: int = 3, **kwargs) -> float:
    """Median wall time of ``fn(*args, **kwargs)`` over ``repeats`` runs after one warm-up."""
    fn(*args, **kwargs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def growth_exponent(ns, ts) -> float:
    """Least-squares slope of log t against log n."""
    return float(np.polyfit(np.log(ns), np.log(ts), 1)[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to n = 512 only")
    parser.add_argument("--d", type=int, default=64, help="key size d (default 64)")
    parser.add_argument("--dv", type=int, default=64, help="value size dv (default 64)")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "cpu_forms.json")
    args = parser.parse_args(argv)

    ns = [64, 128, 256, 512] if args.quick else [128, 256, 512, 1024, 2048, 4096, 8192]
    rng = np.random.default_rng(0)
    results = {}
    for op, forms in FORMS.items():
        results[op] = {}
        for form, fn in forms.items():
            kwargs = {"chunk_size": args.chunk_size} if form == "chunked" else {}
            rows = []
            for n in ns:
                if n > MAX_N[form] or (op == "hla3" and form in ("scan", "stream") and n > 512):
                    continue
                Q, K = rng.standard_normal((2, n, args.d)) / np.sqrt(args.d)
                V = rng.standard_normal((n, args.dv))
                rows.append((n, median_time(fn, Q, K, V, gamma=0.999, **kwargs)))
            ns_f, ts_f = zip(*rows)
            results[op][form] = {"n": list(ns_f), "median_s": list(ts_f),
                                 "growth_exponent": growth_exponent(ns_f, ts_f)}
            line = "  ".join(f"n={n}: {t * 1e3:9.2f} ms" for n, t in rows)
            print(f"{op:5s} {form:8s} slope {results[op][form]['growth_exponent']:4.2f} | {line}")

    record = {
        "what": "hla_ref CPU time per form against n (median of 3 after a warm-up)",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "numpy": np.__version__, "hla_ref": hla_ref.__version__},
        "shapes": {"d": args.d, "dv": args.dv, "chunk_size": args.chunk_size, "gamma": 0.999},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out.name} in {args.out.parent.name}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
