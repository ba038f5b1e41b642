"""The project's own files agree with each other: README, CI script, pyproject, environment.yml."""

import pathlib
import re
import subprocess
import sys
import tomllib

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
