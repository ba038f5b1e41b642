"""The project's own files agree with each other: README, CI script, pyproject, environment.yml."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_ci_runs_exactly_the_readme_test_command():
    test_cmds = [c for c in _readme_commands() if "pytest" in c]
    assert len(test_cmds) == 1, "README.md must give exactly one test command"
    ci_lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert test_cmds[0] in ci_lines


def _requirement_names(reqs):
    return {re.split(r"[<>=!\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = _requirement_names(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        names |= _requirement_names(r for r in extra if not r.startswith("hla["))
    conda = set()
    text = (ROOT / "environment.yml").read_text()
    for line in text.split("dependencies:", 1)[1].splitlines():
        m = re.match(r"\s+- ([A-Za-z][\w.-]*)", line)
        if m and m.group(1) not in ("python", "pip"):
            conda.add(m.group(1).lower())
    conda_to_pypi = {"pytorch": "torch"}
    assert {conda_to_pypi.get(n, n) for n in conda} == names


def test_hla_ref_imports_without_torch():
    code = "import sys, hla_ref; print('torch' in sys.modules or 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _min_python(spec: str) -> tuple[int, ...]:
    m = re.fullmatch(r"\s*>=\s*(\d+(?:\.\d+)*)\s*", spec)
    assert m, f"expected a plain '>=X.Y' Python requirement, got {spec!r}"
    return tuple(int(x) for x in m.group(1).split("."))


def test_python_requirement_is_one_and_true():
    """pyproject, environment.yml and the README name the same minimum Python, and it is one the
    suite runs on (this file imports tomllib, new in 3.11)."""
    pyproject = _min_python(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    conda = re.findall(r"^\s+- python\s*(>=[\d.]+)\s*$", (ROOT / "environment.yml").read_text(), flags=re.M)
    assert len(conda) == 1, "environment.yml must pin python as 'python>=X.Y'"
    readme = re.findall(r"Python (?:≥|>=) ?(\d+(?:\.\d+)+)", (ROOT / "README.md").read_text())
    assert readme, "README.md must say which Python it needs ('Python ≥ X.Y')"
    assert {_min_python(conda[0])} | {_min_python(">=" + v) for v in readme} == {pyproject}
    assert pyproject >= (3, 11), "tomllib (imported by the tests) needs Python 3.11"


def _extras(command: str) -> set[str]:
    m = re.search(r'-e "\.\[([\w,]+)\]"', command)
    return set(m.group(1).split(",")) if m else set()


def test_tutorial_install_lines_bring_what_the_notebooks_import():
    """The README's tutorial command and notebook 00's install line name the same extras, and those
    cover the notebooks' imports (notebook 09 imports torch: the fast extra)."""
    tutorial = [c for c in _readme_commands() if "jupyter lab" in c]
    assert tutorial and all(_extras(c) == {"notebooks", "fast"} for c in tutorial), tutorial
    nb00 = json.loads((ROOT / "notebooks" / "00_map.ipynb").read_text())
    text = "".join("".join(c["source"]) for c in nb00["cells"] if c["cell_type"] == "markdown")
    lines = re.findall(r'pip install -e "\.\[[\w,]+\]"', text)
    assert lines and all(_extras(ln) == {"notebooks", "fast"} for ln in lines), lines
    sources = "".join("".join(c["source"]) for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
                      for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
    if re.search(r"^\s*import torch|^\s*import hla_fast", sources, flags=re.M):
        assert "fast" in _extras(lines[0])


def test_readme_says_how_to_run_jupyterlab_as_root():
    assert "--allow-root" in (ROOT / "README.md").read_text()


def test_ci_installs_the_browser_before_the_test_command():
    """tests/test_browser.py needs Chromium (installed by .ci/run) and Playwright (the test extra)."""
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = [c for c in _readme_commands() if "pytest" in c][0]
    assert "apt-get install" in ci and "chromium" in ci[: ci.index(test_cmd)]
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert "playwright" in _requirement_names(test_extra)


def _python_examples():
    return re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_a_cpu_example_of_hla_fast():
    cpu = [c for c in _python_examples() if "hla_fast" in c and "cuda" not in c]
    assert len(cpu) == 1, "README.md must give one hla_fast example that runs on a CPU"
    assert 'backend="torch"' in cpu[0] and "g=" in cpu[0]


@pytest.mark.parametrize("index", range(len(_python_examples())))
def test_readme_python_example_runs(index, tmp_path):
    """Every Python example of the README runs as written (the GPU one only where CUDA is)."""
    code = _python_examples()[index]
    needs = [m for m in ("torch", "hla_fast") if re.search(rf"^import .*\b{m}\b", code, flags=re.M)]
    if needs and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the fast extra)")
    if "cuda" in code:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("the README's GPU example needs a CUDA device")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # as a reader runs it
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"README example {index} failed:\n{code}\n{out.stderr[-3000:]}"


def _tracked_text_files():
    """(path relative to the root, contents) of every file git tracks that is not binary; the test
    asking is skipped outside a git checkout."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for rel in filter(None, files.decode().split("\0")):
        path = ROOT / rel
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" not in data[:8192]:                  # binary files are left out
            yield rel, data


def test_no_tracked_file_cites_a_document_outside_the_repository():
    """Every reference a reader meets resolves inside the repository: the old external derivation
    notes are cited nowhere (the name is assembled here so that this file does not contain it)."""
    name = ("hla" + "-math").encode()
    offenders = [rel for rel, data in _tracked_text_files() if name in data.lower()]
    assert not offenders, f"files citing {name.decode()!r}, a document not in the repository: {offenders}"


RECORD_PREFIXES = ("ahla", "compile", "cpu", "hla2", "hla3", "kernels", "mqar")


def _expand_braces(name: str) -> list[str]:
    """``a{,_b}c`` -> ``["ac", "a_bc"]`` (nested groups expanded left to right)."""
    group = re.search(r"\{([^{}]*)\}", name)
    if not group:
        return [name]
    return [x for alt in group.group(1).split(",")
            for x in _expand_braces(name[:group.start()] + alt + name[group.end():])]


def test_every_record_the_documentation_cites_exists():
    """A measurement the documentation cites (README files, the packages' docstrings, the
    notebooks) names a file of ``benchmarks/results`` that is there: ``hla2_h200_layers_k64.json``,
    ``benchmarks/results/ahla_h200.md``, ``{hla2,ahla}_h200_ab_x.json`` and ``x{,_gates}.json``
    alike (a record renamed or never committed would leave a reader with a dead reference)."""
    have = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    sources = [ROOT / "README.md", *sorted((ROOT / "hla_fast").rglob("*.md")), *sorted((ROOT / "hla_fast").rglob("*.py")),
               *sorted((ROOT / "hla_ref").rglob("*.py")), *sorted((ROOT / "notebooks").glob("*.ipynb"))]
    token = re.compile(r"[A-Za-z0-9_{},./-]+\.(?:json|md)\b")
    cited, dead = 0, []
    for path in sources:
        for found in token.findall(path.read_text()):
            for name in _expand_braces(found):
                name = name.rsplit("/", 1)[-1]
                if name.split("_", 1)[0] not in RECORD_PREFIXES:
                    continue
                cited += 1
                if name not in have:
                    dead.append(f"{path.relative_to(ROOT)}: {name}")
    assert cited > 100, f"the pattern found only {cited} citations: it no longer matches how records are cited"
    assert not dead, "documentation cites records that benchmarks/results does not have:\n" + "\n".join(sorted(set(dead)))


# directories of a machine that a record or a document must not name (a script's --out on the
# machine that ran it, a traceback's file names): spelled in pieces so that this file does not
# name them itself
_MACHINE_DIRS = re.compile(rb"(?<![\w.~-])/(?:%s)/"
                           % b"|".join((b"ro" + b"ot", b"ho" + b"me", b"wo" + b"rk", b"t" + b"mp")))


def test_no_file_names_a_directory_of_the_machine_that_wrote_it():
    """Records, notebooks (their stored outputs too), docs and code name no absolute path of a
    machine (a record's command with ``--out`` into a scratch directory once did)."""
    found = [f"{rel}: {m.group(0).decode()}" for rel, data in _tracked_text_files()
             for m in [_MACHINE_DIRS.search(data)] if m]
    assert not found, found


def test_hla_fast_without_torch_names_what_to_install():
    """`pip install hla` brings NumPy only: without torch (or Triton), hla_ref works, and importing
    hla_fast says which extra brings them instead of failing deep inside an import."""
    for missing in ("torch", "triton"):
        code = (f"import sys; sys.modules[{missing!r}] = None  # as if it were not installed\n"
                "import numpy as np, hla_ref\n"
                "assert hla_ref.hla2_naive(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 1))).shape == (2, 1)\n"
                "try:\n"
                "    import hla_fast\n"
                "except ModuleNotFoundError as exc:\n"
                "    print(exc.name, exc)\n")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.startswith(f"{missing} hla_fast needs PyTorch and Triton"), run.stdout
        assert f"({missing} is missing): pip install 'hla[fast]'" in run.stdout, run.stdout


def test_execute_all_refuses_a_missing_notebook_before_running_any(capsys):
    """notebooks/execute_all.py takes paths or bare names of notebooks in notebooks/; a name that
    is neither stops the run before any notebook executes, with an error naming the argument."""
    spec = importlib.util.spec_from_file_location("execute_all", ROOT / "notebooks" / "execute_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ran = []
    mod.execute = lambda path, timeout: ran.append(path) or 0.0
    with pytest.raises(SystemExit) as e:
        mod.main(["00_map.ipynb", "no_such_notebook.ipynb"])
    assert e.value.code == 2 and ran == []
    assert "notebooks: no such file" in capsys.readouterr().err
    assert mod.main(["00_map.ipynb", str(ROOT / "notebooks" / "01_naive_masked_forms.ipynb")]) == 0
    assert [p.name for p in ran] == ["00_map.ipynb", "01_naive_masked_forms.ipynb"]
