"""Re-execute the tutorial notebooks top to bottom and store their outputs in place.

The stored outputs are what the test suite (nbval) compares a fresh run against, so they must come
from one clean run of each notebook. Usage, from the repository root::

    python notebooks/execute_all.py                  # every numbered notebook
    python notebooks/execute_all.py notebooks/04_decay.ipynb
    python notebooks/execute_all.py 04_decay.ipynb   # the same notebook, named alone
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent


def execute(path: pathlib.Path, timeout: int) -> float:
    """Run one notebook in a fresh kernel of this Python, in its own folder; write it back."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path, help="notebooks to run (default: all)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell")
    args = parser.parse_args(argv)
    os.environ.pop("MPLBACKEND", None)          # the inline backend, as under nbval
    paths = args.notebooks or sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
    # a bare name means the notebook of that name here; check every path before running any
    paths = [HERE / p if not p.exists() and p.parent == pathlib.Path(".") else p for p in paths]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        parser.error(f"notebooks: no such file: {', '.join(missing)}")
    for path in paths:
        seconds = execute(path.resolve(), args.timeout)
        print(f"{path.name}: {seconds:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
