"""The ``--config`` argument of the benchmark scripts that time or compile one layout: a JSON object
of ``ChunkConfig`` fields to change from the configuration rule's result (lists become tuples, as
``grad_parts`` wants). No torch import, so a script can parse its arguments before it times its
imports (``first_call.py``)."""
from __future__ import annotations

import argparse
import json

# the operators a script can be asked for by name (``--op``)
OPS = ("hla2", "ahla", "hla3")
# the input dtypes a script can be asked for by name (``--dtype``), each with its name in torch; in
# the order a first-call run starts them (the fp32 tiles of fp32 and fp16 inputs compile slowest)
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
HELP = "JSON object of ChunkConfig fields changed from the rule's, e.g. '{\"grad_parts\": [1, 2, 4]}'"


def config_changes(text: str) -> dict:
    """``--config``'s value as keyword arguments of ``ChunkConfig.replace`` (an argparse ``type``:
    anything but a JSON object is refused with a message that names the argument's form)."""
    try:
        changes = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object of ChunkConfig fields, got {text!r} ({e})")
    if not isinstance(changes, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of ChunkConfig fields, got {text!r}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()}
