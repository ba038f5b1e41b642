"""The qualitative claims of benchmarks/hla3_accuracy.py at small sizes (fixed seeds, seconds):
L2-normalized keys with gates keep the kernels' relative error at the precision's level as T
grows, the raw output's size grows with T while normalized positive features keep it O(1)."""
import importlib.util
import os

import pytest

from .helpers import torch

_path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "hla3_accuracy.py")
_spec = importlib.util.spec_from_file_location("hla3_accuracy", _path)
acc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(acc)

SHAPE = dict(B=1, H=2, K=16, V=16, chunk_size=32)


@pytest.mark.parametrize("case", ["l2_gates", "l2pos_norm"])
def test_normalized_keys_keep_the_error_at_precision(case, device, poison):
    """fp32: below 1e-5 (a few fp32 roundings per product chain, 2^-24 each) and not growing from
    T = 64 to 256 by more than 4x; bf16: the output's own rounding (2^-9 relative) on the
    interpreter, where the dots run in fp32; bf16 operands on a GPU add their rounding."""
    rows = {(T, dt): acc.measure(case, T, dt, device=device, seed=T, **SHAPE)
            for T in (64, 256) for dt in (torch.float32, torch.bfloat16)}
    for T in (64, 256):
        assert rows[T, torch.float32]["rel_err"] < 1e-5
        assert rows[T, torch.bfloat16]["rel_err"] < (4e-3 if device == "cpu" else 3e-2)
    assert rows[256, torch.float32]["rel_err"] < 4 * max(rows[64, torch.float32]["rel_err"], 1e-7)


def test_raw_output_grows_normalized_stays_small(device):
    """Without decay the output's size grows with T (a sum over ~T^3 / 6 triples); normalize=True
    on positive L2-normalized features keeps it below |v|'s size."""
    raw = [acc.measure("raw", T, torch.float32, device=device, seed=T, **SHAPE)["out_rms"] for T in (64, 256)]
    norm = [acc.measure("l2pos_norm", T, torch.float32, device=device, seed=T, **SHAPE)["out_rms"] for T in (64, 256)]
    assert raw[1] > 10 * raw[0]
    assert max(norm) < 1.0
