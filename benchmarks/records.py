"""Writing a benchmark's record: its results as ``<base>.json`` and their markdown as ``<base>.md``,
the command line every recording script starts from (:func:`record_parser`),
the markdown always rendered from the same results (``tests/test_benchmarks.py`` renders every
stored JSON and compares), and the markdown again from a stored JSON (a script's ``--render``);
the relative error every record's accuracy columns report (:func:`rel_error`); an error's text as
a record keeps it, without the directories of the machine that ran it (:func:`portable`); and the
host's processor (:func:`cpu_model`), which first calls depend on: Triton compiles on the CPU."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record_parser(doc: str, stem: str, tag: str) -> argparse.ArgumentParser:
    """A script's command line with the options every record shares: its docstring as the help,
    ``--out`` (the folder, ``benchmarks/results``), ``--tag`` (the files ``<stem>_<tag>.json`` and
    ``.md``; ``tag`` the default) and ``--render`` (only the markdown beside a stored JSON)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc)
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument("--tag", default=tag, help=f"files {stem}_<tag>.json and {stem}_<tag>.md")
    ap.add_argument("--render", default=None, help="only write the markdown beside this recorded JSON")
    return ap


def stamp(device: str) -> dict:
    """What every record names first: the device, the versions (torch, triton, python) and the
    date (UTC, to the second)."""
    import datetime
    import platform

    import triton

    return {"device": device,
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_record(base, res, render):
    """``base.json`` (``res``, indented) and ``base.md`` (``render(res)``)."""
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(render(res))


def render_stored(json_path, render):
    """The markdown of the record stored at ``json_path``, written beside it (same stem, ``.md``)."""
    with open(json_path) as f:
        res = json.load(f)
    with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
        f.write(render(res))


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The host processor's name: the first ``model name`` of ``cpuinfo`` (Linux), else what
    ``platform.processor()`` says, else None. Kernel compiles run on the host, so a first call's
    seconds depend on it too (``hla_fast/README.md``, Targets, compares two hosts)."""
    import platform

    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius norms over every element) in float64, on a's device (b is
    moved there): the relative error of a result a against a reference b."""
    a = a.detach().double()
    b = b.detach().to(a.device).double()
    return float((a - b).norm() / b.norm())


def portable(text: str) -> str:
    """``text`` (the tail of a failed run's output, which a record keeps) with this machine's
    directories cut from the paths in it: the repository's root, every import root (``sys.path``:
    site-packages, a ``--target`` folder), the temporary folder and the home folder. Files then
    read as the repository or the package names them (``hla_fast/ops/...``, ``triton/...``), and
    the record names no directory of the machine that wrote it (``tests/test_packaging.py``)."""
    roots = {os.path.abspath(p) for p in sys.path if p}
    roots |= {REPO, os.path.realpath(REPO), tempfile.gettempdir(), os.path.expanduser("~")}
    for root in sorted(roots, key=len, reverse=True):   # the longest first: a root inside another
        if root != os.sep:
            text = text.replace(root + os.sep, "")
    return text
