"""benchmarks/mqar.py on a CPU: the MQAR generator against its definition (and its vectorized
sampling against numpy's per-sequence sampling), the projection of --plan, the results file
bookkeeping and the budget guard, and the smoke run (a two-block HLA2 model learns the tiny task far
above chance)."""
import importlib.util
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def mqar():
    spec = importlib.util.spec_from_file_location("mqar", os.path.join(ROOT, "benchmarks", "mqar.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_data_follows_the_definition(mqar):
    vocab, n, T, kv = 40, 300, 32, 4
    x, y = mqar.mqar_data(vocab, n, T, kv, seed=3)
    assert x.shape == y.shape == (n, T) and x.dtype == y.dtype == torch.int64
    x, y = x.numpy(), y.numpy()
    half, ctx = vocab // 2, 2 * kv
    keys, vals = x[:, 0:ctx:2], x[:, 1:ctx:2]
    assert ((keys >= 1) & (keys < half)).all() and ((vals >= half) & (vals < vocab)).all()
    assert all(len(set(r)) == kv for r in keys) and all(len(set(r)) == kv for r in vals)
    assert ((x >= 0) & (x < vocab)).all()
    assert (y[:, :ctx] == -100).all()
    for i in range(n):
        pos = np.flatnonzero(y[i] != -100)
        assert len(pos) == kv and ((pos - ctx) % 2 == 0).all()  # queries at 2 kv + 2 gap
        pair = dict(zip(keys[i], vals[i]))
        assert sorted(x[i, pos]) == sorted(keys[i])              # every key queried once
        assert all(y[i, p] == pair[x[i, p]] for p in pos)         # the label is its value
    # power-law gaps: the first gap is the most frequent
    gaps = (np.argwhere(y != -100)[:, 1] - ctx) // 2
    counts = np.bincount(gaps, minlength=(T - ctx) // 2)
    assert counts[0] == counts.max() and counts[0] > counts[-1]
    # deterministic in the seed; another seed gives other sequences
    x2, _ = mqar.mqar_data(vocab, n, T, kv, seed=3)
    x3, _ = mqar.mqar_data(vocab, n, T, kv, seed=4)
    assert (x2.numpy() == x).all() and not (x3.numpy() == x).all()
    with pytest.raises(ValueError, match="seq_len"):
        mqar.mqar_data(vocab, 4, 30, 8, seed=0)


def test_vectorized_sampling_matches_the_per_sequence_definition(mqar):
    # distinct rows: every row distinct, in range, both paths (rejection; permutation when a repeat is likely)
    rng = np.random.default_rng(0)
    for n, k, low, high in [(4000, 64, 1, 4093), (4000, 5, 3, 9)]:
        r = mqar._distinct_rows(rng, n, k, low, high)
        assert r.shape == (n, k) and ((r >= low) & (r < high)).all()
        assert (np.diff(np.sort(r, axis=1), axis=1) > 0).all()
        # uniform in every slot: each of 6 equal bins of the range (6 | high - low here) about n / 6 times
        width = (high - low) // 6
        counts = np.stack([np.bincount((r[:, j] - low) // width, minlength=6) for j in range(k)])
        assert np.abs(counts - n / 6).max() < 6 * np.sqrt(n / 6)
    # power-law gaps: distinct per row, and each slot's distribution is that of numpy's
    # rng.choice(space, k, replace=False, p=p), row by row (successive draws proportional to p)
    space, k, a, n = 28, 4, 0.01, 20000
    g = mqar._power_law_gaps(np.random.default_rng(1), n, k, space, a)
    assert ((g >= 0) & (g < space)).all() and (np.diff(np.sort(g, axis=1), axis=1) > 0).all()
    p = a * np.arange(1, space + 1) ** (a - 1)
    p /= p.sum()
    ref_rng = np.random.default_rng(2)
    ref = np.array([ref_rng.choice(space, k, replace=False, p=p) for _ in range(n)])
    for j in range(k):
        got, want = (np.bincount(s[:, j], minlength=space) / n for s in (g, ref))
        assert np.abs(got - want).max() < 0.02, (j, got[:4], want[:4])
    assert np.abs(np.bincount(g[:, 0], minlength=space) / n - p).max() < 0.015  # the first draw is p itself
    # the hard task at the real vocabulary: the definition's properties, quickly
    x, y = mqar.mqar_data(8192, 2000, 256, 64, seed=5)
    x, y = x.numpy(), y.numpy()
    keys, vals = x[:, 0:128:2], x[:, 1:128:2]
    assert ((keys >= 1) & (keys < 4096)).all() and ((vals >= 4096) & (vals < 8192)).all()
    assert (np.diff(np.sort(keys, 1), axis=1) > 0).all() and (np.diff(np.sort(vals, 1), axis=1) > 0).all()
    assert ((y != -100).sum(1) == 64).all() and (y[:, :128] == -100).all()
    rows, cols = np.nonzero(y != -100)
    assert ((cols - 128) % 2 == 0).all()
    order = np.argsort(keys, axis=1)
    for i in range(0, 2000, 97):
        pos = cols[rows == i]
        assert sorted(x[i, pos]) == sorted(keys[i])
        assert (vals[i][order[i]][np.searchsorted(keys[i][order[i]], x[i, pos])] == y[i, pos]).all()


def test_linear_attention_chunk_form(mqar):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 37, 3, 8, generator=g), torch.randn(2, 37, 3, 8, generator=g)
    v = torch.randn(2, 37, 3, 5, generator=g)
    scores = torch.einsum("bthk,bshk->bhts", q.double(), k.double()).tril()
    want = torch.einsum("bhts,bshv->bthv", scores, v.double())
    got = mqar.linear_attention_torch(q, k, v, chunk=8)
    assert float((got.double() - want).norm() / want.norm()) < 1e-5


def test_results_file_appends_and_renders(mqar, tmp_path):
    out = str(tmp_path / "mqar_test.json")
    cfg = dict(vocab=64, train_examples=128, test_examples=64, steps=4, batch_size=32, eval_batch=64, head_dim=16,
               seed=0, conv=4, mlp=False, backend="torch", warm_steps=1)
    kw = dict(tasks=[(16, 2)], d_models=[32], lrs=[3e-3], cfg=cfg, device=torch.device("cpu"), out=out,
              log=lambda s: None)
    rows = mqar.run_grid(mixers=["attention", "hla2"], **kw)
    assert [r["mixer"] for r in rows] == ["attention", "hla2"]
    assert all(r["steps"] == 4 and r["batch_size"] == 32 and r["train_examples"] == 128 for r in rows)
    mqar.run_grid(mixers=["hla2", "linear"], **kw)  # hla2 again: its row is replaced
    res = json.load(open(out))
    assert res["schema"] == mqar.SCHEMA and sorted(r["mixer"] for r in res["runs"]) == ["attention", "hla2", "linear"]
    r = res["runs"][0]
    for field in ("accuracy", "train_tokens_per_s", "device", "versions", "date", "seq_len", "num_kv_pairs", "lr",
                  "train_examples", "test_examples", "epochs", "steps", "batch_size", "seed", "tie"):
        assert field in r, field
    assert 0.0 <= r["accuracy"] <= 1.0 and r["train_tokens_per_s"] > 0
    md = open(out[:-5] + ".md").read()
    assert "seq_len 16, 2 key-value pairs" in md and "| hla2 |" in md and "Training throughput" in md
    assert "4 steps of batch 32" in md
    # a budget of 0 s starts nothing
    assert mqar.run_grid(mixers=["attention"], budget_s=0.0, **{**kw, "lrs": [1e-2]}) == []
    assert len(json.load(open(out))["runs"]) == 3
    # a budget below a run's projection starts nothing either (no timing of this configuration yet)
    p = mqar.projected_run_s("attention", 32, 16, 32, 4) + mqar.first_call_s("attention", False)
    assert mqar.run_grid(mixers=["attention"], budget_s=0.9 * p, **{**kw, "lrs": [1e-2]}) == []


def test_answer_positions_and_loss_positions(mqar):
    x, y = mqar.mqar_data(64, 10, 32, 3, seed=0)
    pos = mqar.answer_positions(y)
    assert pos.shape == (10, 3) and (y.gather(1, pos) != -100).all()
    assert int((y != -100).sum()) == pos.numel() and (pos[:, 1:] > pos[:, :-1]).all()
    # logits at the answer positions are the full logits there
    torch.manual_seed(0)
    model = mqar.MQARModel(64, 32, "attention", head_dim=16).eval()
    with torch.no_grad():
        full, sel = model(x), model(x, pos)
    assert torch.allclose(full.gather(1, pos[..., None].expand(-1, -1, 64)), sel, atol=1e-5)
    assert model.head.weight is model.emb.weight  # tied by default
    assert mqar.MQARModel(64, 32, "attention", head_dim=16, tie=False).head.weight is not None


def test_plan_counts_runs_and_default_parts_fit(mqar, capsys):
    cfg = dict(steps=None, batch_size=None, train_examples=None)
    p = mqar.plan([(64, 4), (256, 16)], ["attention", "hla2"], [64, 128], [1e-2, 3e-3], cfg)
    assert p["runs"] == 2 * 2 * 2 * 2 and [t["steps"] for t in p["tasks"]] == [
        mqar.REGIME[(64, 4)]["steps"], mqar.REGIME[(256, 16)]["steps"]]
    assert p["total_s"] > sum(t["train_s"] for t in p["tasks"]) > 0
    more = mqar.plan([(64, 4), (256, 16)], ["attention", "hla2"], [64, 128], [1e-2, 3e-3], {**cfg, "steps": 10_000})
    assert more["total_s"] > p["total_s"] and all(t["steps"] == 10_000 for t in more["tasks"])
    # every default part of the grid, with every default mixer, d_model and learning rate, fits in
    # a 9-minute device call by the projection
    for name in mqar.DEFAULT_PARTS:
        q = mqar.plan(mqar.PARTS[name], list(mqar.MIXERS), list(mqar.D_MODELS), list(mqar.LRS), cfg)
        assert q["total_s"] <= 540, (name, q["total_s"])
    mqar.main(["--part", mqar.DEFAULT_PARTS[0], "--plan", "--budget-s", "540"])
    assert "projected on an H200" in capsys.readouterr().out


def test_cpu_smoke_hla2_learns(mqar):
    # chance: 2 / vocab = 1/32 (one value among vocab / 2); the model reaches about 0.5
    acc = mqar.smoke("hla2")
    assert acc > 0.3, acc


def test_workers_merge_and_throughput(mqar, tmp_path):
    """--workers: the tasks run in processes side by side, their rows merged into one file (marked
    concurrent); --throughput then fills the throughput table from a measurement alone."""
    out = str(tmp_path / "mqar_w.json")
    cfg = dict(vocab=64, train_examples=64, test_examples=32, steps=2, batch_size=16, eval_batch=32, head_dim=16,
               seed=0, conv=4, mlp=False, backend="torch", warm_steps=1)
    tasks = [(16, 2), (32, 4), (32, 2)]
    groups = mqar.deal_tasks(tasks, 2, cfg)
    assert len(groups) == 2 and sorted(t for g in groups for t in g) == sorted(tasks)
    assert sorted(map(len, mqar.deal_tasks(tasks, 9, cfg))) == [1, 1, 1]  # never more groups than tasks
    # more workers than tasks: a task's learning rates are shared among processes, each pair once
    jobs = mqar.deal_jobs(tasks, [1e-2, 3e-3], 6, cfg)
    assert sorted((t, lr) for g, lrs in jobs for t in g for lr in lrs) == sorted((t, lr) for t in tasks
                                                                                 for lr in [1e-2, 3e-3])
    assert len(jobs) == 6 and mqar.deal_jobs(tasks, [1e-2, 3e-3], 2, cfg) == [(g, [1e-2, 3e-3]) for g in groups]
    rows = mqar.run_workers(tasks=tasks, workers=2, mixers=["attention", "hla2"], d_models=[32], lrs=[1e-2], cfg=cfg,
                            device=torch.device("cpu"), out=out, log=lambda s: None)
    res = json.load(open(out))
    assert len(rows) == 6 and len(res["runs"]) == 6
    assert {(r["seq_len"], r["num_kv_pairs"]) for r in res["runs"]} == set(tasks)
    assert all(r["concurrent_processes"] == 2 for r in res["runs"])
    assert sorted(os.listdir(tmp_path)) == ["mqar_w.json", "mqar_w.md"]  # the per-process files are gone
    md = open(out[:-5] + ".md").read()
    # contended rates are not reported as throughput
    assert "Not measured: every run shared the device" in md.split("## Training throughput")[1]
    shape = dict(seq_len=16, kv=2, batch_size=8, warm_steps=1, steps_timed=2)
    tp = mqar.measure_throughput(mixers=["attention", "hla2"], d_models=[32], cfg=cfg, device=torch.device("cpu"),
                                 out=out, log=lambda s: None, shape=shape)
    assert [r["mixer"] for r in tp] == ["attention", "hla2"] and all(r["train_tokens_per_s"] > 0 for r in tp)
    res = json.load(open(out))
    assert len(res["runs"]) == 6 and res["throughput"]["seq_len"] == 16 and "device" in res["throughput"]
    table = open(out[:-5] + ".md").read().split("## Training throughput")[1]
    assert "one process alone" in table and "| hla2 | -" not in table
