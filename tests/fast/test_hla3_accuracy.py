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


def r_rounding_reach(case, T, seed):
    """How far a relative rounding of the first stage's output R reaches o, relative to o, in norm:
    ||A|| / ||o|| with A_t = sum_{i <= u <= t} e^{3 b_t - b_i - 2 b_u} |q_t . k_i| |k_i . q_u| |R_u|
    (float64 on the case's bf16-rounded inputs; the unnormalized numerator). hla3 stores R in the
    inputs' dtype between its stages (hla_fast/ops/hla3/chunk.py)."""
    q, k, v, kw = acc.make_case(case, SHAPE["B"], T, SHAPE["H"], SHAPE["K"], SHAPE["V"], "cpu", seed)
    q, k, v = (x.bfloat16().double()[0].transpose(0, 1) for x in (q, k, v))       # [H, T, D]
    b = torch.zeros(q.shape[:2], dtype=torch.float64) if "g" not in kw else kw["g"].double()[0].T.cumsum(1)
    if "gamma" in kw:
        b = torch.arange(1, T + 1, dtype=torch.float64).expand(q.shape[0], T) * torch.log(torch.tensor(kw["gamma"]))
    x = q @ k.transpose(1, 2)                                                         # q_t . k_i  [H, T, T]
    low = torch.ones(T, T, dtype=torch.bool).tril()
    r = torch.where(low, x * torch.exp(b[:, :, None] - b[:, None, :]), 0.0) @ v       # R [H, T, V]
    o = torch.zeros_like(r)
    reach = torch.zeros_like(r)
    for t in range(T):   # one row of output at a time: [H, u, i] tiles
        w = torch.where(low[:t + 1, :t + 1], torch.exp(3 * b[:, t, None, None] - 2 * b[:, :t + 1, None]
                                                       - b[:, None, :t + 1]), 0.0)
        xt = x[:, t, None, :t + 1]                                                     # q_t . k_i
        xu = x[:, :t + 1, :t + 1]                                                      # q_u . k_i
        o[:, t] = torch.einsum("hui,hui,huv->hv", w * xt, xu, r[:, :t + 1])
        reach[:, t] = torch.einsum("hui,hui,huv->hv", w * xt.abs(), xu.abs(), r[:, :t + 1].abs())
    return float(reach.norm() / o.norm())


@pytest.mark.parametrize("case", ["l2_gates", "l2pos_norm"])
def test_normalized_keys_keep_the_error_at_precision(case, device, poison):
    """fp32: below 1e-5 (a few fp32 roundings per product chain, 2^-24 each) and not growing from
    T = 64 to 256 by more than 4x. bf16 on the interpreter, where the dots run in fp32: two bf16
    roundings (unit 2^-9), the output's and R's between the stages, which reaches o as far as
    ``r_rounding_reach`` says (normalized: the numerator's, plus the positive denominator's own);
    bf16 operands on a GPU add their rounding."""
    rows = {(T, dt): acc.measure(case, T, dt, device=device, seed=T, **SHAPE)
            for T in (64, 256) for dt in (torch.float32, torch.bfloat16)}
    for T in (64, 256):
        assert rows[T, torch.float32]["rel_err"] < 1e-5
        reach = r_rounding_reach(case, T, T) + (1 if case == "l2pos_norm" else 0)
        tol = 2 ** -9 * (1 + reach) + 1e-5 if device == "cpu" else 3e-2
        assert rows[T, torch.bfloat16]["rel_err"] < tol
    assert rows[256, torch.float32]["rel_err"] < 4 * max(rows[64, torch.float32]["rel_err"], 1e-7)


def test_raw_output_grows_normalized_stays_small(device):
    """Without decay the output's size grows with T (a sum over ~T^3 / 6 triples); normalize=True
    on positive L2-normalized features keeps it below |v|'s size."""
    raw = [acc.measure("raw", T, torch.float32, device=device, seed=T, **SHAPE)["out_rms"] for T in (64, 256)]
    norm = [acc.measure("l2pos_norm", T, torch.float32, device=device, seed=T, **SHAPE)["out_rms"] for T in (64, 256)]
    assert raw[1] > 10 * raw[0]
    assert max(norm) < 1.0
