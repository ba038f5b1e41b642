"""Writing a benchmark's record: its results as ``<base>.json`` and their markdown as ``<base>.md``,
the markdown always rendered from the same results (``tests/test_benchmarks.py`` renders every
stored JSON and compares), and the markdown again from a stored JSON (a script's ``--render``)."""
from __future__ import annotations

import json
import os


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
