"""The benchmark scripts on a CPU: each recorded results file renders the markdown stored beside
it (so neither goes stale alone), bench_hla3's layout sweep runs under the Triton interpreter, and
profile_kernels.py checks its cases and renders per-kernel shares."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def load(name):
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(os.path.dirname(path))
    return mod


@pytest.mark.parametrize("script, stem", [("bench_hla3", "hla3_h200"), ("bench_ahla", "ahla_h200"),
                                          ("bench_hla2", "hla2_h200_decode"),
                                          ("bench_hla2", "hla2_h200_decode_unwarmed"),
                                          ("bench_hla2", "hla2_h200_rule"),
                                          ("bench_hla2", "hla2_h200_first_call_rule"),
                                          ("short_layouts", "hla2_h200_short_layouts"),
                                          ("bench_ahla", "ahla_h200_decode"), ("bench_hla3", "hla3_h200_decode"),
                                          ("bench_ahla", "ahla_h200_layouts"),
                                          ("bench_ahla", "ahla_h200_first_call"),
                                          ("bench_ahla", "ahla_h200_variants"),
                                          ("bench_ahla", "ahla_h200_prefetch"),
                                          ("launcher_check", "launcher_check_cpu_triton36"),
                                          ("launcher_check", "launcher_check_h100"),
                                          ("bench_hla2", "hla2_h100_first_call_serial_loads"),
                                          ("bench_ahla", "ahla_h200_decode_unwarmed"),
                                          ("profile_kernels", "kernels_h200"),
                                          ("fp16_range", "fp16_range_cpu"),
                                          ("profile_kernels", "kernels_ahla_h200"),
                                          ("profile_kernels", "kernels_ahla_h200_coupled"),
                                          ("bench_ahla", "ahla_h200_before_layers"),
                                          ("bench_ahla", "ahla_h200_fwd_chunks"),
                                          ("bench_ahla", "ahla_h200_first_call_layers"),
                                          ("layer_kernels", "ahla_h200_layers_kernels"),
                                          ("compile_report", "compile_ahla_bf16_k128_layers_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k128_normalize_fwd_triton36_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k128_normalize_fwd_chunk64_w8_triton36_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k64_normalize_fwd_triton36_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k64_normalize_fwd_w8_triton36_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k128_fwd_triton36_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k64_fwd_triton36_cpu"),
                                          ("compile_report", "compile_ahla_fp32_k128_layers_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k128_fwd_chunk128_w8_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k128_fwd_chunk128_w8_prefetch_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k128_fwd_chunk128_w4_cpu"),
                                          ("profile_kernels", "kernels_ahla_h200_outer_scan"),
                                          ("profile_kernels", "kernels_hla3_h200"),
                                          ("compile_report", "compile_hla2_fp32_k64_cpu"),
                                          ("compile_report", "compile_hla2_bf16_k64_cpu"),
                                          ("compile_report", "compile_hla2_bf16_k128_layers_fwd_chunk64_cpu"),
                                          ("compile_report", "compile_hla2_bf16_k128_layers_fwd_chunk64_normalize_cpu"),
                                          ("compile_report", "compile_hla3_bf16_k64_cpu"),
                                          ("compile_report", "compile_hla3_bf16_k128_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k64_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k64_bwd_prefetch_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k128_fwd_cpu"),
                                          ("compile_report", "compile_ahla_bf16_k128_fwd_prefetch_cpu"),
                                          ("bench_hla3", "hla3_h200_stages"),
                                          ("bench_hla3", "hla3_h200_stages_ab"),
                                          ("bench_hla3", "hla3_h200_stages_k128"),
                                          ("bench_hla3", "hla3_h200_split_second_stage"),
                                          ("bench_hla3", "hla3_h200_shared_walk_bench"),
                                          ("bench_hla3", "hla3_h200_sweep"),
                                          ("bench_hla3", "hla3_h200_last_summary"),
                                          ("bench_hla2", "hla2_h200_targets_32k"),
                                          ("bench_hla2", "hla2_h200_targets_32k_normalized_layers"),
                                          ("bench_hla2", "hla2_h200_targets_32k_gate_sums"),
                                          ("profile_kernels", "kernels_h200_gates_before_sums"),
                                          ("profile_kernels", "kernels_h200_gate_sums_in_step"),
                                          ("profile_kernels", "kernels_h200_gate_sums"),
                                          ("bench_hla2", "hla2_h200_key_block_layers"),
                                          ("bench_hla2", "hla2_h200_first_call_layers"),
                                          ("profile_kernels", "kernels_h200_shared_walk"),
                                          ("profile_kernels", "kernels_hla2_h200_normalized_layers"),
                                          ("profile_kernels", "kernels_hla2_h100_den_pass_forward"),
                                          ("bench_hla2", "hla2_h100_targets_32k_den_pass"),
                                          ("compile_report", "compile_hla2_bf16_k128_layers_fwd_den_pass_cpu"),
                                          ("bench_hla2", "hla2_h200_split_rule_k64"),
                                          ("bench_hla2", "hla2_h200_split_rule_k128"),
                                          ("bench_ahla", "ahla_h200_chunk128_calls"),
                                          ("walk_rows", "ahla_h200_chunk128"),
                                          ("compile_report", "compile_ahla_bf16_k128_fwd_chunk128_w8_stages2_cpu"),
                                          ("bf16_gradients", "bf16_gradients_cpu"),
                                          ("host_work", "host_work_h100"),
                                          ("bench_hla2", "hla2_h100_short_final"),
                                          ("host_work", "host_work_h100_in_call"),
                                          ("bench_hla2", "hla2_h100_first_call_layers_den_pass"),
                                          ("bench_hla2", "hla2_h100_final"),
                                          ("bench_hla2", "hla2_h100_final_main_short"),
                                          ("bench_hla2", "hla2_h100_final_rest"),
                                          ("bench_hla2", "hla2_h100_final_rest_12_jobs"),
                                          ("bench_hla2", "hla2_h100_final_first_call_alone"),
                                          ("bench_hla2", "hla2_h100_final_first_call_layers"),
                                          ("bench_hla2", "hla2_h100_first_call_handles"),
                                          ("bench_hla2", "hla2_h100_first_call_final"),
                                          ("bench_hla2", "hla2_h100_first_call_all"),
                                          ("bench_hla2", "hla2_h100_first_call_ops_fp32"),
                                          ("bench_hla2", "hla2_h100_first_call_ops_bf16"),
                                          ("bench_hla2", "hla2_h100_first_call_ahla_fp32_one_launch"),
                                          ("compile_report", "compile_ahla_fp32_k64_cpu"),
                                          ("compile_report", "compile_ahla_fp32_k64_one_launch_cpu"),
                                          ("compile_report", "compile_ahla_fp16_k64_cpu"),
                                          ("compile_report", "compile_ahla_fp16_k64_one_launch_cpu"),
                                          ("compile_report", "compile_hla2_fp32_k64_normalize_triton36_cpu"),
                                          ("compile_report", "compile_hla2_fp32_k64_normalize_chunk64_triton36_cpu"),
                                          ("compile_report", "compile_hla2_fp32_k64_chunk32_triton36_cpu"),
                                          ("bench_hla2", "hla2_h100_first_call_fp16"),
                                          ("bench_hla2", "hla2_h100_first_call_fp16_k32"),
                                          ("bench_hla2", "hla2_h100_1207"),
                                          ("bench_hla2", "hla2_h100_1207_main_short"),
                                          ("bench_hla2", "hla2_h100_1207_rest"),
                                          ("compile_report", "compile_hla2_fp16_k64_gates_triton36_cpu"),
                                          ("compile_report", "compile_hla2_fp32_k64_gates_triton36_cpu"),
                                          ("compile_report", "compile_hla2_bf16_k64_layers_normalize_cpu"),
                                          ("compile_report", "compile_hla2_bf16_k64_layers_normalize_bwd_den_pass_cpu"),
                                          ("compile_report", "compile_hla2_bf16_k128_layers_normalize_cpu"),
                                          ("compile_report",
                                           "compile_hla2_bf16_k128_layers_normalize_bwd_den_pass_cpu"),
                                          ("bench_hla2", "hla2_h100_bwd_den_pass_k64"),
                                          ("compile_report", "compile_hla2_bf16_k64_layers_triton36_cpu"),
                                          ("compile_report", "compile_hla2_bf16_k64_layers_outer_sums_triton36_cpu"),
                                          ("compile_report", "compile_hla2_bf16_k64_layers_fwd_triton36_cpu"),
                                          ("compile_report",
                                           "compile_hla2_bf16_k64_layers_fwd_outer_sums_triton36_cpu"),
                                          ("compile_report",
                                           "compile_hla2_bf16_k64_layers_gates_triton36_cpu"),
                                          ("compile_report",
                                           "compile_hla2_bf16_k64_layers_fwd_gates_triton36_cpu"),
                                          ("compile_report",
                                           "compile_hla2_bf16_k64_layers_gates_outer_sums_triton36_cpu"),
                                          ("compile_report",
                                           "compile_hla2_bf16_k64_layers_fwd_gates_outer_sums_triton36_cpu"),
                                          ("compile_report",
                                           "compile_hla2_bf16_k64_layers_normalize_triton36_cpu"),
                                          ("compile_report",
                                           "compile_hla2_bf16_k64_layers_fwd_normalize_triton36_cpu"),
                                          ("compile_report",
                                           "compile_hla2_bf16_k64_layers_normalize_outer_sums_triton36_cpu"),
                                          ("compile_report",
                                           "compile_hla2_bf16_k64_layers_fwd_normalize_outer_sums_triton36_cpu"),
                                          ("cpu_peak", "ahla_cpu_peak_k128_normalized"),
                                          ("cpu_peak", "ahla_cpu_peak_k128_plain"),
                                          ("cpu_peak", "ahla_cpu_peak_k64_normalized"),
                                          ("profile_kernels", "kernels_hla2_h100_k64_train"),
                                          ("profile_kernels", "kernels_hla2_h100_k64_forward")])
def test_recorded_markdown_is_rendered_from_its_json(script, stem):
    with open(os.path.join(RESULTS, stem + ".json")) as f:
        res = json.load(f)
    with open(os.path.join(RESULTS, stem + ".md")) as f:
        stored = f.read()
    rendered = load(script).render_markdown(res)
    assert rendered.strip() == stored.strip()


def test_hla3_layout_sweep_runs_on_the_interpreter(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_hla3.py"), "--cpu-smoke",
                          "--sections", "variants", "--dims", "16", "--Ts", "40,64", "--out", str(tmp_path),
                          "--tag", "t"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "hla3_t.json").read_text())
    rows = res["variants"]
    names = [r["variant"] for r in rows]
    # the sweep runs at the largest T, starting from the rule's layout
    assert names[0] == "default" and {r["T"] for r in rows} == {64}
    assert {"fwd_segments=2", "bwd_segments=2", "fwd_warps=8", "bwd_warps=8", "fwd_stages=2", "chunks=16",
            "chunks=32"} <= set(names)
    for r in rows:
        assert "hla3_error" not in r, r
        assert r["hla3_fwd_ms"] > 0 and r["hla3_fwdbwd_ms"] > 0
    md = (tmp_path / "hla3_t.md").read_text()
    assert "## Layouts at the largest T" in md and md.count("| 64 | 16 |") == len(rows)


def test_ahla_variants_named_on_the_command_line(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_ahla.py"), "--cpu-smoke",
                          "--sections", "variants", "--dims", "16", "--Ts", "40", "--variants", "rule,no_prefetch",
                          "--out", str(tmp_path), "--tag", "t"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "ahla_t.json").read_text())["variants"]
    assert [r["variant"] for r in rows] == ["rule", "no_prefetch"]
    for r in rows:
        assert "error" not in r, r
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0
    assert "fwd_prefetch=False, bwd_prefetch=False" in rows[1]["fwdbwd_config"]
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_ahla.py"), "--cpu-smoke",
                          "--sections", "variants", "--variants", "rule,no_prefech", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "--variants: unknown layouts ['no_prefech']" in bad.stderr


def test_bf16_gradients_runs_on_the_interpreter(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "bf16_gradients.py")
    run = subprocess.run([sys.executable, script, "--cpu", "--ops", "hla2", "--out", str(tmp_path), "--tag", "t"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "bf16_gradients_t.json").read_text())
    assert res["ops"] == ["hla2"] and set(res["rows"]["hla2"]) == {"False", "True"}
    for row in res["rows"]["hla2"].values():
        assert set(row) == {"triton", "torch"}
        for errs in row.values():
            assert set(errs) == {"o", "dq", "dk", "dv"}
            # bf16 inputs, compared on the same rounded values: errors of bf16's order, never zero
            assert all(0 < e < 5e-2 for e in errs.values()), errs
    assert (tmp_path / "bf16_gradients_t.md").read_text() == load("bf16_gradients").render_markdown(res)
    bad = subprocess.run([sys.executable, script, "--cpu", "--ops", "hla2,hla4", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "--ops: unknown operators ['hla4']" in bad.stderr


def test_bench_hla3_refuses_an_unknown_section(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_hla3.py"), "--cpu-smoke",
                          "--sections", "mian", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 2 and "unknown sections ['mian']" in run.stderr


def test_profile_kernels_cases_and_markdown():
    pk = load("profile_kernels")
    assert pk.parse_cases("hla2:64:1024,ahla:128:8:g,hla2:64:8:n,hla2:64:8:gn") == [
        ("hla2", 64, 1024, False, False), ("ahla", 128, 8, True, False), ("hla2", 64, 8, False, True),
        ("hla2", 64, 8, True, True)]
    for bad in ("hla4:64:1024", "hla2:64", "hla2:x:1024", "ahla:64:1024:h"):
        with pytest.raises(ValueError, match="--cases: expected op:K:T"):
            pk.parse_cases(bad)
    res = {"device": "dev", "date": "d", "versions": {"torch": "t", "triton": "tr"},
           "cases": [{"op": "hla2", "K": 64, "T": 1024, "config": "c",
                      "kernels_ms": {"a_kernel": [3.0, 1], "b_kernel": [1.0, 2]}},
                     {"op": "ahla", "K": 64, "T": 1024, "gated": True, "config": "c",
                      "kernels_ms": {"c_kernel": [2.0, 1]}}]}
    md = pk.render_markdown(res)
    assert "- " not in md.split("## ")[0]
    assert "- two runs\n" in pk.render_markdown(dict(res, notes=["two runs"]))
    assert "hla2, K = V = 64, T = 1024: 4 ms of kernels" in md
    assert "ahla, gates g, K = V = 64, T = 1024: 2 ms of kernels" in md
    normed = pk.render_markdown(dict(res, cases=[dict(res["cases"][1], op="hla2", normalize=True)]))
    assert "hla2, gates g, normalized, K = V = 64, T = 1024: 2 ms of kernels" in normed
    assert "| `a_kernel` | 3 | 75% | 1 |" in md and "| `b_kernel` | 1 | 25% | 2 |" in md
    assert "the default configuration" in md
    changed = pk.render_markdown(dict(res, config={"bwd_layers": True}))
    assert 'the rule\'s configuration changed by `{"bwd_layers": true}`' in changed


def test_profile_kernels_refuses_a_config_that_is_not_an_object():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "profile_kernels.py"), "--config", "[1]"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2 and "--config: expected a JSON object of ChunkConfig fields" in run.stderr


def test_layer_kernels_needs_cuda_and_renders_its_record(tmp_path):
    """benchmarks/layer_kernels.py times compiled kernels: without CUDA it says so; --render writes
    the markdown beside a recorded JSON."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "layer_kernels.py")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 2 and "needs a CUDA device" in run.stderr
    rec = tmp_path / "ahla_x.json"
    res = {"device": "dev", "date": "d", "versions": {"torch": "t", "triton": "tr"}, "K": 128, "T": 64,
           "walk": [[64, 4, 3, 0.5]], "grad": [[64, 8, 2, "OutOfResources: shared memory"]]}
    rec.write_text(json.dumps(res))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "layer_kernels.py"), "--render", str(rec)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    md = (tmp_path / "ahla_x.md").read_text()
    assert "| 64 | 4 | 3 | 0.500 |" in md and "| 64 | 8 | 2 | OutOfResources: shared memory |" in md


def test_walk_rows_needs_cuda_and_checks_its_layouts():
    """benchmarks/walk_rows.py times compiled kernels: without CUDA it says so; a --layouts that is
    not chunk:warps:stages is refused by name."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    script = os.path.join(ROOT, "benchmarks", "walk_rows.py")
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 2 and "needs a CUDA device" in run.stderr
    for bad in ("64:4", "64:4:x", ""):
        run = subprocess.run([sys.executable, script, "--layouts", bad], capture_output=True, text=True, timeout=300,
                             cwd=ROOT, env=env)
        assert run.returncode == 2 and "--layouts: expected chunk:warps:stages" in run.stderr, bad
    assert load("walk_rows").parse_layouts("64:4:1,128:8:2") == [(64, 4, 1), (128, 8, 2)]


def test_ab_revision_imports_an_earlier_package_beside_this_one(tmp_path):
    """The earlier revision's package is importable under its own name and computes on its own
    code path (HEAD here, so the two agree exactly on the torch backend)."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    ab = load("ab_revision")
    sys.path.insert(0, str(tmp_path))
    try:
        name = ab.extract("HEAD", tmp_path)
        old = importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
    import hla_fast
    assert old.__name__ == "hla_fast_HEAD" and old.ahla is not hla_fast.ahla
    q = torch.randn(1, 9, 2, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a, _ = old.ahla(q, q, q, gamma=0.9, backend="torch")
    b, _ = hla_fast.ahla(q, q, q, gamma=0.9, backend="torch")
    assert torch.equal(a, b)


def test_cpu_peak_counts_what_is_held_at_once():
    """cpu_peak.peak_bytes: the most a function holds allocated at once beyond what existed: an
    operand, a sum's temporary and its result alive together, not what is allocated after one is
    freed, nor the input it reads."""
    peak = load("cpu_peak").peak_bytes
    x = torch.ones(10_000)

    def fn():
        a = torch.empty(1000)
        b = torch.empty(3000) + x[:3000]   # the temporary lives until the sum is formed
        del a
        c = torch.empty(2000)
        return b, c

    assert peak(fn) == 4 * (1000 + 3000 + 3000)


def test_cpu_peak_compares_two_revisions_without_running_a_kernel(tmp_path):
    """cpu_peak.py on HEAD against this tree counts at least the gradients the call returns for
    both, the same peak where the package has no uncommitted change (the same code), and renders
    its record."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    out = tmp_path / "peak"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cpu_peak.py"), "--rev", "HEAD",
                          "--op", "ahla", "--B", "1", "--T", "100", "--H", "2", "--K", "16", "--V", "8",
                          "--normalize", "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads((tmp_path / "peak.json").read_text())
    first, second = res["rows"]
    assert min(first["peak_bytes"], second["peak_bytes"]) >= 100 * 2 * (16 + 16 + 8) * 2   # dq, dk, dv (bf16)
    if subprocess.run(["git", "-C", ROOT, "diff", "--quiet", "HEAD", "--", "hla_fast"]).returncode == 0:
        assert first["peak_bytes"] == second["peak_bytes"]
    assert "bwd_layers=False" in second["config"] and res["unit_bytes"] == 100 * 2 * 16 * 4
    assert (tmp_path / "peak.md").read_text() == load("cpu_peak").render_markdown(res)


def test_ab_revision_alternates_which_code_runs_first():
    """``--rounds``: the earlier revision first in even rounds, last in odd ones; each code's row
    holds the median of its rounds (the larger peak) and every round's timings."""
    ab = load("ab_revision")
    pair = (("old", 1), ("new", 2))
    assert ab.round_order(pair, 1) == [("old", 1), ("new", 2)]
    assert ab.round_order(pair, 3) == [("old", 1), ("new", 2), ("new", 2), ("old", 1), ("old", 1), ("new", 2)]
    row = ab.summarize("new", [(1.5, 5.0, 10.0), (1.1, 4.0, 12.0), (1.2, 4.5, 11.0)])
    assert row == {"code": "new", "fwd_ms": 1.2, "fwdbwd_ms": 4.5, "fwdbwd_peak_extra_mb": 12.0,
                   "fwd_ms_rounds": [1.5, 1.1, 1.2], "fwdbwd_ms_rounds": [5.0, 4.0, 4.5]}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ab_revision.py"), "--rev", "HEAD",
                          "--rounds", "0"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "--rounds must be an int >= 1, got 0" in run.stderr


def test_ab_revision_changes_the_rule_for_this_trees_calls():
    """``--config``: this tree's calls take the rule's layout for their shapes with the changes."""
    import hla_fast

    from hla_fast.ops.hla3.chunk import first_stage_config

    ab = load("ab_revision")
    q, v = torch.zeros(4, 256, 2, 64), torch.zeros(4, 256, 2, 32)
    shape = (4, 256, 2, 64, 32, q.dtype, q.device)
    for training in (False, True):
        for gated in (False, True):
            for normalize in (False, True):
                cfg = ab.rule_config("hla2", q, v, {"grad_parts": (1, 2, 4)}, training, gated, normalize)
                rule = hla_fast.hla2_config(*shape, gated=gated, normalize=normalize, training=training)
                assert cfg == rule.replace(grad_parts=(1, 2, 4))
            # hla3: the first stage keeps its rule, the second takes the change (V + 1 values normalized)
            for normalize, Vk in ((False, 32), (True, 33)):
                first, second = ab.rule_config("hla3", q, v, {"bwd_warps": 8}, training, gated, normalize)
                shape3 = (*shape[:4], Vk, *shape[5:])
                assert first == first_stage_config(*shape3, training=training)
                rule = hla_fast.hla3_config(*shape3, gated=gated, training=training, normalize=normalize)
                assert second == rule.replace(bwd_warps=8) and not second.layers
        cfg = ab.rule_config("ahla", q, v, {"fwd_warps": 8}, training)
        assert cfg == hla_fast.ahla_config(*shape, training=training).replace(fwd_warps=8)
    # a long bf16 hla3 call runs its second stage as layers, and its first stage in the same walk:
    # one config sets both (as fwd_shared_walk needs), changed as asked
    q, v = torch.zeros(4, 4096, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 4096, 2, 64, dtype=torch.bfloat16)
    rule = hla_fast.hla3_config(4, 4096, 2, 64, 64, q.dtype, q.device)
    assert rule.layers and rule.fwd_shared_walk
    for change in ({"fwd_warps": 8}, {"fwd_shared_walk": False}):
        assert ab.rule_config("hla3", q, v, change, False) == rule.replace(**change)


@pytest.mark.skipif(not load("compile_report").has_cuda_compiler(), reason="needs Triton's CUDA backend (compiler and ptxas)")
def test_compile_report_compiles_the_forward_for_hopper():
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compile_report.py"), "hla2", "1", "256",
                          "2", "64", "64", "bfloat16", "--pass", "forward", "--json"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout)
    assert "ChunkConfig(" in res["config"]
    names = [r["kernel"] for r in res["kernels"]]
    assert "hla2_fwd_kernel" in names and not any("bwd" in n for n in names)
    for r in res["kernels"]:
        assert 0 < r["registers"] <= 255 and 0 < r["shared_bytes"] <= 232448 and r["warps"] == 4
        assert r["spill_stores"] >= 0 and r["spill_loads"] >= 0 and r["seconds"] > 0


def test_compile_report_refuses_a_config_that_is_not_an_object():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compile_report.py"), "hla2", "1", "256",
                          "2", "64", "64", "bfloat16", "--config", "[1, 2]"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 2 and "--config: expected a JSON object of ChunkConfig fields" in run.stderr



@pytest.mark.parametrize("op", ["hla2", "ahla", "hla3"])
def test_first_call_takes_a_config_under_the_interpreter(op):
    """first_call.py --op --config: the operator's first call, in the layout of its rule's config
    with the given fields changed (hla3: its second stage's; here under the interpreter, where
    nothing is compiled)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "first_call.py"), "--op", op,
                          "--dtype", "fp32", "--dim", "16", "--B", "1", "--T", "40", "--H", "2",
                          "--config", '{"grad_parts": [1, 6], "bwd_warps": 8}'],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    line = [x for x in run.stdout.splitlines() if x.startswith("FIRST_CALL_JSON ")]
    assert len(line) == 1
    out = json.loads(line[0][len("FIRST_CALL_JSON "):])
    assert out["op"] == op and out["config_changes"] == {"grad_parts": [1, 6], "bwd_warps": 8}
    assert "grad_parts=(1, 6)" in out["config"] and "bwd_warps=8" in out["config"]
    assert out["config"].startswith("(ChunkConfig(") == (op == "hla3")   # hla3: the stages' pair
    assert out["finite"] is True and out["fwdbwd_s"] > 0


def test_first_call_refuses_a_config_that_is_not_an_object():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "first_call.py"), "--config", "[1, 2]"],
                         capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=300)
    assert run.returncode == 2 and "--config: expected a JSON object of ChunkConfig fields" in run.stderr


def test_bench_hla2_first_calls_named_on_the_command_line(tmp_path):
    """--first-call-dtypes / --first-call-flags choose the first-call variants, each once (the smoke
    run's head size and shape are its own); a value outside the known ones is refused by option name."""
    script = os.path.join(ROOT, "benchmarks", "bench_hla2.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, script, "--cpu-smoke", "--sections", "first_call", "--first-call-dtypes",
                          "bf16", "--first-call-flags", "normalize,g,normalize", "--out", str(tmp_path), "--tag", "t"],
                         capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "hla2_t.json").read_text())
    rows = res["first_call"]
    assert sorted((r["dtype"], r["flag"], r["status"]) for r in rows) == [("bf16", "g", "ok"),
                                                                        ("bf16", "normalize", "ok")]
    assert all(r["fwdbwd_s"] > 0 for r in rows)
    # the host the compiles ran on is part of the record and its markdown
    host = load("records").cpu_model()
    assert res["first_call_setup"]["cpu_model"] == host
    if host:
        assert f"CPUs ({host}) (compiles share the CPUs)" in (tmp_path / "hla2_t.md").read_text()
    for option, value, message in (("--first-call-flags", "gamma,gates", "--first-call-flags takes a comma list"),
                                   ("--first-call-dtypes", "fp16,fp8", "--first-call-dtypes takes a comma list"),
                                   ("--first-call-ops", "hla2,hla4", "--first-call-ops takes a comma list"),
                                   ("--first-call-dims", "64,x", "--first-call-dims takes positive head sizes"),
                                   ("--first-call-T", "0", "--first-call-T a positive length")):
        bad = subprocess.run([sys.executable, script, "--cpu-smoke", option, value, "--out", str(tmp_path)],
                             capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
        assert bad.returncode == 2 and message in bad.stderr, (option, bad.stderr[-500:])


def test_short_layouts_refuses_wide_heads_and_needs_cuda():
    script = os.path.join(ROOT, "benchmarks", "short_layouts.py")
    run = subprocess.run([sys.executable, script, "--dim", "128"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--dim must be in 1..64, got 128" in run.stderr
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
        assert run.returncode != 0 and "run it on a GPU machine" in run.stderr


def test_bench_hla3_with_layout_passes_the_config_the_rule_asks(monkeypatch):
    """``bench_hla3.with_layout``: for the two stages' pair each stage takes its changes; where the
    rule runs the second stage as layers (a long bf16 call) one config sets both, so the same
    changes for both stages pass and different ones are refused (the one-segment columns of
    ``hla3_h200_shared_walk_bench.md`` errored on such a call before)."""
    import hla_fast
    from hla_fast.ops.hla3.chunk import stage_rules

    bench = load("bench_hla3")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))   # its ab_revision, as when run as a script
    seen = []
    monkeypatch.setattr(hla_fast, "hla3", lambda q, k, v, **kw: (seen.append(kw["config"]) or q, None))
    one = {"fwd_segments": 1, "bwd_segments": 1}
    # a short fp32 call: the pair, each stage changed as asked
    q = torch.zeros(2, 256, 2, 32)
    bench.with_layout(one, {"fwd_warps": 8})(q, q, q)
    first, second = stage_rules(2, 256, 2, 32, 32, q.dtype, q.device)
    assert seen.pop() == (first.replace(**one), second.replace(fwd_warps=8))
    # a long bf16 call: the layers, one config for both stages
    q = torch.zeros(2, 4096, 2, 64, dtype=torch.bfloat16)
    rule = hla_fast.hla3_config(2, 4096, 2, 64, 64, q.dtype, q.device)
    assert rule.layers
    bench.with_layout(one, one)(q, q, q)
    bench.with_layout({}, one)(q, q, q)
    assert seen == [rule.replace(**one)] * 2
    with pytest.raises(ValueError, match="the layered second stage sets both stages"):
        bench.with_layout({"fwd_warps": 8}, one)(q, q, q)


@pytest.mark.parametrize("ratios, verdict", [((1.3, None, None, None), False), ((1.1, 1.1, None, None), None),
                                             ((1.1, 1.1, 1.1, 1.1), True), ((1.1, 1.1, 1.1, 1.2), False)])
def test_bench_hla2_overhead_targets_decide_on_a_partial_run(ratios, verdict):
    """A gate or normalize ratio over the bound fails its target even when the run stopped before
    measuring the other head size; all within it stays undecided until every ratio is measured."""
    bench = load("bench_hla2")
    k64f, k64b, k128f, k128b = ratios
    rows = [{"K": 64, "T": bench.TARGET_T, "g_over_gamma_fwd": k64f, "g_over_gamma_fwdbwd": k64b},
            {"K": 128, "T": bench.TARGET_T, "g_over_gamma_fwd": k128f, "g_over_gamma_fwdbwd": k128b}]
    got = bench.targets({"main": rows})["g_overhead"]
    assert got["met"] is verdict


def test_a_failed_runs_text_names_no_directory_of_the_machine(tmp_path, monkeypatch):
    """``records.portable`` (what the scripts apply to a failed run's output before a record keeps
    it) cuts the repository's root, the import roots, the temporary folder and the home folder
    from the paths in it: files read as the repository or the package names them."""
    records = load("records")
    site = tmp_path / "site"
    monkeypatch.setattr(sys, "path", [str(site)] + sys.path)
    home = os.path.expanduser("~")
    text = (f'File "{records.REPO}/hla_fast/ops/hla2/chunk.py", line 1\n'
            f'File "{site}/triton/runtime/jit.py", line 2\n'
            f'cache {home}/.triton/cache/abc\nscratch {tmp_path}/x.json\n')
    got = records.portable(text)
    assert got == ('File "hla_fast/ops/hla2/chunk.py", line 1\nFile "triton/runtime/jit.py", line 2\n'
                   f'cache .triton/cache/abc\nscratch {os.path.relpath(tmp_path, records.tempfile.gettempdir())}/x.json\n')
    for d in (records.REPO, str(site), home, str(tmp_path)):
        assert d not in got


def test_cpu_model_reads_the_first_model_name(tmp_path, monkeypatch):
    """``records.cpu_model``: the first non-empty ``model name`` of a cpuinfo file; without one,
    or without the file, what ``platform.processor()`` says, and None where that is empty."""
    import platform

    records = load("records")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: \nmodel name\t: Some CPU 9000 @ 2.0GHz\n"
                    "processor\t: 1\nmodel name\t: Other CPU\n")
    assert records.cpu_model(str(info)) == "Some CPU 9000 @ 2.0GHz"
    info.write_text("processor\t: 0\n")
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    assert records.cpu_model(str(info)) == "x86_64"
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert records.cpu_model(str(tmp_path / "missing")) is None


def test_host_work_splits_a_call_and_renders_its_record(tmp_path):
    """benchmarks/host_work.py on a CPU: the operator's own host work (a launch that launches
    nothing), then with --all-parts under the interpreter the public call and each launch replayed;
    the markdown is rendered from the JSON; bad arguments are refused."""
    script = os.path.join(ROOT, "benchmarks", "host_work.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--tag", "t", "--calls", "1",
                          "--cases", "hla2:16:16:g", "--all-parts"], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    res = json.loads((tmp_path / "host_work_t.json").read_text())
    (case,) = res["cases"]
    assert (case["op"], case["K"], case["T"], case["gated"], case["normalize"]) == ("hla2", 16, 16, True, False)
    fwd, fb = case["fwd"], case["fwdbwd"]
    assert [n for n, _ in fwd["launches_us"]] == ["hla2_fwd_kernel"]
    assert len(fb["launches_us"]) > len(fwd["launches_us"])
    for r in (fwd, fb):
        assert r["own_us"] > 0 and r["call_us"] > 0 and all(us > 0 for _, us in r["launches_us"])
        # each launch timed where the call makes it too, in the call's order
        assert len(r["in_call_us"]) == len(r["launches_us"]) and all(us > 0 for us in r["in_call_us"])
        assert r["rest_us"] == pytest.approx(r["call_us"] - r["checks_us"] - r["own_us"] - sum(r["in_call_us"]))
        assert r["profile"] and all(us >= 0 for _, us in r["profile"])
    hw = load("host_work")
    assert (tmp_path / "host_work_t.md").read_text() == hw.render_markdown(res)
    md = hw.render_markdown(res)
    assert "| hla2:16:16:g | fwdbwd |" in md and "| call | checks | own | launches | in the call | rest |" in md
    plain = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--tag", "c", "--calls", "2",
                            "--cases", "ahla:16:16:n"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                           env=dict(env, TRITON_INTERPRET="0"))
    assert plain.returncode == 0, plain.stderr
    (case,) = json.loads((tmp_path / "host_work_c.json").read_text())["cases"]
    assert case["fwd"]["own_us"] > 0 and case["fwdbwd"]["call_us"] is None and case["fwd"]["launches_us"] is None
    assert case["fwd"]["checks_us"] is None and case["fwdbwd"]["in_call_us"] is None
    for args, msg in ((["--calls", "0"], "--calls must be >= 1"), (["--cases", "hla2:16"], "--cases: expected"),
                      (["--all-parts"], "set TRITON_INTERPRET=1")):
        bad = subprocess.run([sys.executable, script, "--out", str(tmp_path), *args], capture_output=True, text=True,
                             timeout=300, cwd=ROOT, env=dict(env, TRITON_INTERPRET="0"))
        assert bad.returncode == 2 and msg in bad.stderr


def test_fp16_range_records_the_first_non_finite_token(tmp_path):
    """benchmarks/fp16_range.py on a short sequence: one row per order, gate and q/k norm, every
    output finite at 64 tokens; the markdown is rendered from the JSON; a bad --T is refused."""
    script = os.path.join(ROOT, "benchmarks", "fp16_range.py")
    run = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--tag", "t", "--T", "64"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    res = json.loads((tmp_path / "fp16_range_t.json").read_text())
    fr = load("fp16_range")
    assert [(r["order"], r["gate"], r["qk_norm"]) for r in res["rows"]] == [
        (o, g, n) for o in fr.ORDERS for g in fr.GATES for n in fr.QK_NORMS]
    assert res["T"] == 64 and all(r["first_non_finite"] is None for r in res["rows"])
    assert (tmp_path / "fp16_range_t.md").read_text() == fr.render_markdown(res)
    bad = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--T", "0"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "--T must be >= 1" in bad.stderr


def test_bench_hla2_merges_runs_of_other_sections_into_one_record(tmp_path):
    """``--merge``: two runs of other sections make one record whose targets are those of the whole
    run they split; a section timed twice, or runs of different devices, are refused by name."""
    bench = load("bench_hla2")
    full = bench.fake_results()
    rest = ("decode", "short", "memory", "wide", "accuracy", "first_call")
    a = {k: v for k, v in full.items() if k not in rest + ("first_call_setup",)}
    a.update(timing={"main": 10.0, "total": 12.0}, date="1970-01-01T00:00:00+00:00")
    b = {k: v for k, v in full.items() if k not in ("main", "shapes", "profile", "variants")}
    b.update(timing=dict({s: 1.0 for s in rest}, total=7.0), date="1970-01-02T00:00:00+00:00",
             ceilings={"bf16_matmul_tflops": 1.0, "copy_gbs": 2.0})
    paths = []
    for name, r in (("hla2_a", a), ("hla2_b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
        paths.append(str(tmp_path / f"{name}.json"))
    script = os.path.join(ROOT, "benchmarks", "bench_hla2.py")
    note = "Run a measured the code before commit x."
    run = subprocess.run([sys.executable, script, "--merge", ",".join(paths), "--out", str(tmp_path), "--tag", "ab",
                          "--merge-note", note], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    merged = json.loads((tmp_path / "hla2_ab.json").read_text())
    assert merged["merge_note"] == note and f"GB/s\n\n{note}\n" in (tmp_path / "hla2_ab.md").read_text()
    want = bench.targets(full)
    # every target decided as in the unsplit run, with the same numbers (JSON turns int keys to str)
    assert json.loads(json.dumps(merged["targets"])) == json.loads(json.dumps(want))
    assert merged["ceilings"] == a["ceilings"] and merged["date"] == b["date"]
    assert [(m["record"], m["sections"]) for m in merged["merged_from"]] == [("hla2_a", ["main"]), ("hla2_b", list(rest))]
    assert set(merged["timing"]) == {"main", *rest}
    md = (tmp_path / "hla2_ab.md").read_text()
    assert md == bench.render_markdown(merged) and "- `hla2_b` (1970-01-02T00:00:00+00:00): decode, short" in md
    # sections named after a record's path: only those are taken from it
    twice = dict(b, timing={"main": 1.0, "decode": 1.0, "short": 1.0})
    picked = bench.merge_records([("hla2_a", a, None), ("hla2_c", twice, ["decode", "short"])])
    assert picked["merged_from"][1]["sections"] == ["decode", "short"] and set(picked["timing"]) == {"main", "decode", "short"}
    assert picked["main"] == a["main"] and picked["short"] == b["short"] and "memory" not in picked
    other = dict(b, device="another")
    c = str(tmp_path / "hla2_c.json")
    for bad, suffix, msg in ((twice, "", "section main was timed by both hla2_a and hla2_c"),
                             (other, "", "records hla2_a and hla2_c differ in device"),
                             (twice, ":memory", "record hla2_c did not time memory"),
                             (twice, ":decode+mian", "unknown sections ['mian']")):
        (tmp_path / "hla2_c.json").write_text(json.dumps(bad))
        run = subprocess.run([sys.executable, script, "--merge", f"{paths[0]},{c}{suffix}",
                              "--out", str(tmp_path), "--tag", "bad"], capture_output=True, text=True, timeout=300,
                             cwd=ROOT)
        assert run.returncode == 2 and msg in run.stderr, run.stderr
    with pytest.raises(ValueError, match="two or more records"):
        bench.merge_records([("hla2_a", a, None)])
    run = subprocess.run([sys.executable, script, "--merge-note", note, "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2 and "--merge-note goes with --merge" in run.stderr


_COMPILE_LOG = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import first_call


@triton.jit
def twice(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, 2 * tl.load(x_ptr + offs))


t0 = time.perf_counter()
log = first_call.compile_log(lambda: time.perf_counter() - t0)
triton.compile(ASTSource(fn=twice, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "N": "constexpr"},
                         constexprs={"N": 64}), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(json.dumps({"log": log, "elapsed": time.perf_counter() - t0}))
"""


def test_first_call_logs_each_compile_with_its_stages(tmp_path):
    """first_call.compile_log: Triton's compilation listener (where this Triton has one) files one
    entry per kernel compile, with its seconds, each stage's, and when it ended; compiled here for
    sm_90 on the CPU in a fresh interpreter (no TRITON_INTERPRET: the interpreter compiles nothing)."""
    cr = load("compile_report")
    if not cr.has_cuda_compiler():
        pytest.skip("needs triton's CUDA backend to compile for sm_90 without a GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "compile_log.py"   # a file: triton.jit reads its kernel's source
    script.write_text(_COMPILE_LOG)
    run = subprocess.run([sys.executable, str(script), os.path.join(ROOT, "benchmarks")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=dict(env, TRITON_CACHE_DIR=str(tmp_path / "cache")))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if got["log"] is None:
        pytest.skip("this Triton has no compilation listener")
    (entry,) = got["log"]
    assert entry["kernel"] == "twice" and entry["cache_hit"] is False
    assert 0 < entry["s"] <= got["elapsed"] and 0 < entry["end_s"] <= got["elapsed"]
    # the stages account for the compile: make_ir and each lowering (ttir ... cubin)
    assert {"ir", "ttir", "ttgir", "llir", "ptx", "cubin"} <= set(entry["stages"])
    assert sum(entry["stages"].values()) == pytest.approx(entry["s"], rel=0.05)


def test_launcher_check_sums_each_ways_processes_and_refuses_bad_arguments(tmp_path):
    """launcher_check.py: a way's processes are summed (a process without a report kept by its
    output's tail), the record renders from its JSON (made-up results here); bad arguments and, off
    CUDA, a run without the stub driver are refused by name."""
    lc = load("launcher_check")
    one = {"checked": 71, "mismatched": 2, "not_applicable": 0, "prepare_s": 0.03,
           "mismatches": [{"kernel": "ahla_fwd_kernel", "launcher": 35, "own": 66}]}
    clean = dict(one, mismatched=0, mismatches=[])
    threads = lc.combine([one, one, {"tail": "Segmentation fault"}])
    assert threads == {"processes": 3, "reported": 2, "checked": 142, "mismatched": 4, "not_applicable": 0,
                       "prepare_s": 0.06, "mismatches": one["mismatches"] * 2, "tail": "Segmentation fault"}
    assert lc.combine([{"tail": "killed"}]) == {"processes": 1, "reported": 0, "tail": "killed"}
    res = {"device": "NVIDIA H200", "versions": {"torch": "2.11.0", "triton": "3.6.0", "python": "3.12.3"},
           "date": "2026-12-07T09:00:00+00:00", "switch_interval": 1e-6, "cases": [list(c) for c in lc.CASES],
           "warmup": dict(clean, prepare_s=2.8), "ways": {"threads": threads, "package": lc.combine([clean])}}
    text = lc.render_markdown(res)
    assert "launcher step 2.8 s; 71 kernels checked, 0 with another kernel's launcher" in text
    assert "| threads | 3 (2) | 142 | 4 | 0 | 0.06 |" in text and "| package | 1 (1) | 71 | 0 | 0 | 0.03 |" in text
    assert "Mismatches, `threads`: ahla_fwd_kernel with a launcher of 35 (its own 66);" in text
    assert "A process of `threads` did not report" in text and "Segmentation fault" in text
    stored = tmp_path / "launcher_check_x.json"
    stored.write_text(json.dumps(res))
    script = os.path.join(ROOT, "benchmarks", "launcher_check.py")
    run = subprocess.run([sys.executable, script, "--render", str(stored)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "launcher_check_x.md").read_text() == text
    for bad, says in [(["--ways", "threads,some"], "--ways takes a comma-separated list of threads, package"),
                      (["--processes", "0"], "--processes must be at least 1, got 0"),
                      (["--switch-interval", "0"], "--switch-interval must be a positive number of seconds")]:
        run = subprocess.run([sys.executable, script, *bad], capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and says in run.stderr, (bad, run.stderr)
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, script, "--out", str(tmp_path)], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 2 and "needs CUDA, or --stub-driver" in run.stderr


def test_launcher_check_reads_a_launchers_argument_count():
    """launcher_check.launcher_count reads the count off the TypeError of a launch called with none,
    only for a launcher module of Triton's (``__triton_launcher``); check_kernels compares it with the
    kernel's own (13 beside one a parameter) for every compiled kernel of each JIT function."""
    lc = load("launcher_check")

    def launch_taking(n, module="__triton_launcher"):
        def launch(*args):
            raise TypeError(f"function takes exactly {n} arguments ({len(args)} given)")
        launch.__module__ = module
        return launch

    class Compiled:
        def __init__(self, n_params, launcher_n, module="__triton_launcher"):
            self.src = type("Src", (), {"signature": {i: "i32" for i in range(n_params)}})()
            self._run = type("Run", (), {})()
            self._run.launch = launch_taking(launcher_n, module)

    class Future:
        def __init__(self, k):
            self.k = k

        def result(self):
            return self.k

    assert lc.launcher_count(Compiled(3, 16)) == 16
    assert lc.launcher_count(Compiled(3, 16, module="cuda_utils")) is None   # a launcher shared by every kernel
    assert lc.launcher_count(object()) is None

    class Jit:
        __name__ = "some_kernel"
        device_caches = {0: ({"a": Compiled(3, 16), "b": Future(Compiled(5, 16)), "c": None,
                              "d": Compiled(2, 15, module="other")}, None)}

    got = lc.check_kernels([Jit()])
    assert got == {"checked": 2, "mismatched": 1, "not_applicable": 2,
                   "mismatches": [{"kernel": "some_kernel", "launcher": 16, "own": 18}]}


def test_launcher_check_builds_a_stub_cuda_driver(tmp_path):
    """The stub driver compiles and answers as the launcher step needs: a context, an sm count."""
    import ctypes
    import shutil

    lc = load("launcher_check")
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("needs a C compiler")
    folder = lc.build_stub_driver(str(tmp_path))
    lib = ctypes.CDLL(os.path.join(folder, "libcuda.so.1"))
    value = ctypes.c_int(0)
    assert lib.cuDeviceGetAttribute(ctypes.byref(value), 16, 0) == 0 and value.value == 132
    ctx = ctypes.c_void_p(0)
    assert lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value
    assert os.readlink(os.path.join(folder, "libcuda.so")) == "libcuda.so.1"
