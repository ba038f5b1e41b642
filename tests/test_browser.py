"""The tutorial as a newcomer meets it: JupyterLab in a real browser (headless Chromium).

One JupyterLab server on a free port of 127.0.0.1 (a token, ``--no-browser``, ``--allow-root`` as
root) serves a *copy* of ``notebooks/`` (with ``benchmarks/results/``, which notebook 09 reads by a
relative path), so running cells never touches the stored notebooks. For each notebook below, the
browser clears the stored outputs, runs *Run ▸ Run All Cells*, and the test checks that every code
cell ran and none raised, that every plot came back, and that moving a widget (a slider, a
dropdown) redraws the figure beside it. Screenshots go to ``$HLA_TEST_ARTIFACTS`` (default
``test-artifacts/browser/``, git-ignored).

It needs Playwright for Python and a Chromium on disk (Debian's ``chromium``, or the path in
``$HLA_CHROMIUM``); Playwright never downloads a browser here. Without either it skips, saying
which is missing; ``.ci/run`` installs both, so CI always runs it. The server, its kernels, the
browser and Playwright's driver are all stopped at the end, and the test fails if any survived.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARTIFACTS = pathlib.Path(os.environ.get("HLA_TEST_ARTIFACTS") or ROOT / "test-artifacts" / "browser")
CHROMIUM = os.environ.get("HLA_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# Chromium as root in a container, with no network but loopback: no sandbox, no GPU, and none of
# the background traffic (updates, sync, QUIC probes) that would flood the closed network.
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

# notebook -> the widget to move in it (a notebook with a slider; notebook 09 has the dropdown)
NOTEBOOKS = {
    "01_naive_masked_forms.ipynb": "slider",
    "09_from_numpy_to_triton.ipynb": "dropdown",
}
RUN_TIMEOUT_S = 240          # Run All of one notebook (09 runs Triton under its interpreter)
REDRAW_TIMEOUT_S = 60        # a widget change until its figure is redrawn



def _missing(reason: str):
    """Skip the module, or fail it where the browser test must run (.ci/run sets HLA_REQUIRE_BROWSER)."""
    if os.environ.get("HLA_REQUIRE_BROWSER"):
        pytest.fail(f"{reason}, and HLA_REQUIRE_BROWSER is set", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


try:
    import playwright.sync_api as playwright_api
except ImportError:
    _missing("Playwright for Python is not installed (the test extra; pip install playwright)")
try:
    import psutil
except ImportError:
    _missing("psutil is not installed (the test extra)")
try:
    import jupyterlab  # noqa: F401
except ImportError:
    _missing("JupyterLab is not installed (the notebooks extra)")
if not os.access(CHROMIUM, os.X_OK):
    _missing(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; or set HLA_CHROMIUM)")

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


# ------------------------------------------------------------------------------------------------
# The server and the browser
# ------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path: pathlib.Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


class Lab:
    """A running JupyterLab server on a copy of the notebooks, and every process it started."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.pids: dict[int, str] = {}            # every descendant seen: pid -> name
        self.log = root / "jupyter-server.log"

    def api(self, method: str, path: str, timeout: float = 10):
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def note_children(self) -> None:
        if self.proc is None:
            return
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.pids.setdefault(p.pid, p.name())
        except psutil.NoSuchProcess:
            pass

    def start(self) -> None:
        home = self.root / "jupyter-home"          # config, data, settings: none of the user's
        settings = home / "lab-settings"
        # every cell attached to the page (no virtual scrolling), and no news / update checks
        _write_json(settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings",
                    {"windowingMode": "none"})
        _write_json(settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings",
                    {"fetchNews": "false", "checkForUpdates": False})
        env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}   # inline plots
        env.update(
            JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
            JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"),
            JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
            PATH=os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")]),
        )
        cmd = [
            sys.executable, "-m", "jupyterlab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-root")                 # JupyterLab refuses root without it
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            try:
                self.api("GET", "/api/status", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start:\n{self.log.read_text()[-3000:]}")
                time.sleep(0.3)

    def shut_down_kernels(self) -> None:
        self.note_children()
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")

    def stop(self) -> list[str]:
        """Stop the server and everything it started; return what had to be killed by force."""
        if self.proc is None:
            return []
        self.note_children()
        try:                                           # the polite way: kernels go first
            self.api("POST", "/api/shutdown", timeout=5)
            self.proc.wait(timeout=30)
        except Exception:
            pass
        if self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        return _kill_survivors(self.pids)


def _kill_survivors(pids: dict[int, str]) -> list[str]:
    """Wait a moment for ``pids`` to exit, kill those still alive, and name them."""
    procs = []
    for pid, name in pids.items():
        try:
            procs.append((psutil.Process(pid), name))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs([p for p, _ in procs], timeout=10)
    survivors = []
    for p in alive:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            survivors.append(f"{p.pid} {p.name()}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return survivors


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", root / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    shutil.copytree(ROOT / "benchmarks" / "results", root / "benchmarks" / "results")
    server = Lab(root)
    try:
        server.start()
        yield server
    finally:
        survivors = server.stop()
        assert not survivors, f"processes of the JupyterLab server outlived it: {survivors}"


@pytest.fixture(scope="module")
def browser():
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with playwright_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            mine = {p.pid: p.name() for p in me.children(recursive=True) if p.pid not in before}
            chromium.close()
    survivors = _kill_survivors(mine)      # the browser's processes and Playwright's driver
    assert not survivors, f"browser processes outlived the test: {survivors}"


# ------------------------------------------------------------------------------------------------
# What a reader does in the page
# ------------------------------------------------------------------------------------------------

def _menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-item", has_text=re.compile(rf"^{menu}$")).click()
    page.locator(".lm-Menu-item:not(.lm-mod-disabled)",
                 has_text=re.compile(rf"^{re.escape(item)}")).first.click()


def _prompts(page) -> list[str]:
    return page.eval_on_selector_all(
        ".jp-Notebook .jp-CodeCell .jp-InputArea-prompt", "els => els.map(e => e.textContent.trim())")


def _kernel_idle(page) -> bool:
    return page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0


def _figure(cell) -> str:
    """What the figures of a widget cell show: the ``src`` of each image in its output widget."""
    return "|".join(img.get_attribute("src") or "" for img in cell.locator(".widget-output img").all())


def _shot(target, name: str) -> pathlib.Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    target.screenshot(path=str(path))
    return path


def _stored_plots(nb: dict) -> int:
    return sum("image/png" in out.get("data", {})
               for cell in nb["cells"] if cell["cell_type"] == "code" for out in cell.get("outputs", []))


def _move_slider(page, cell) -> str:
    handle = cell.locator(".widget-slider .noUi-handle").first
    readout = cell.locator(".widget-readout").first
    before = readout.inner_text()
    box = handle.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + 60, y, steps=8)
    page.mouse.up()
    page.wait_for_function("([el, v]) => el.textContent.trim() !== v",
                           arg=[readout.element_handle(), before], timeout=10_000)
    return f"slider {before} -> {readout.inner_text()}"


def _pick_dropdown(page, cell) -> str:
    select = cell.locator(".widget-dropdown select").first
    options = select.locator("option").all_inner_texts()
    current = select.evaluate("s => s.options[s.selectedIndex].text")
    choice = next(o for o in options if o != current)
    select.select_option(label=choice)
    return f"dropdown {current} -> {choice}"


@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_notebook_runs_in_jupyterlab_and_its_widget_redraws(lab, browser, name):
    widget = NOTEBOOKS[name]
    stem = pathlib.Path(name).stem
    stored = json.loads((ROOT / "notebooks" / name).read_text())
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        page.goto(f"{lab.url}/lab/tree/notebooks/{name}?token={lab.token}&reset")
        n_code = sum(c["cell_type"] == "code" for c in stored["cells"])
        page.wait_for_function(        # every cell on the page, and the kernel started and idle
            """n => document.querySelectorAll('.jp-Notebook .jp-CodeCell').length === n
                   && document.querySelector(".jp-Notebook-ExecutionIndicator[data-status='idle']")""",
            arg=n_code, timeout=90_000)

        # A clean slate, so that everything on the page below comes from this run.
        _menu(page, "Edit", "Clear Outputs of All Cells")
        page.wait_for_function("() => !document.querySelector('.jp-Notebook .jp-OutputArea-output')",
                               timeout=10_000)

        start = time.monotonic()
        _menu(page, "Run", "Run All Cells")
        while True:                    # done: the kernel idle and no cell waiting ([*]) to run
            page.wait_for_timeout(500)
            prompts = _prompts(page)
            if _kernel_idle(page) and not any("*" in p for p in prompts) and prompts[0] != "[ ]:":
                break
            assert time.monotonic() - start < RUN_TIMEOUT_S, f"Run All still going: {prompts}"
        run_s = time.monotonic() - start
        _shot(page, f"{stem}-after-run-all")

        not_run = [i for i, p in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:", p)]
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                              has_text=re.compile(r"Traceback|Error\b"))
        error_text = errors.first.inner_text()[:2000] if errors.count() else ""
        assert not not_run, f"code cells {not_run} did not run (Run All stops at an error):\n{error_text}"

        # The run as saved: no error output, and as many plots as the stored notebook has.
        _menu(page, "File", "Save Notebook")
        page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')", timeout=20_000)
        saved = json.loads((lab.root / "notebooks" / name).read_text())
        raised = [out for c in saved["cells"] if c["cell_type"] == "code"
                  for out in c.get("outputs", []) if out["output_type"] == "error"]
        assert not raised, f"{name}: a cell raised {raised[0]['ename']}: {raised[0]['evalue']}"
        assert _stored_plots(saved) == _stored_plots(stored), "a plot did not come back"

        # Move the widget; the figure beside it must be redrawn.
        cell = page.locator(f".jp-CodeCell:has(.widget-{widget})").first
        cell.scroll_into_view_if_needed()
        page.wait_for_function(
            "el => el.querySelector('.widget-output img')", arg=cell.element_handle(), timeout=20_000)
        before = _figure(cell)
        _shot(cell, f"{stem}-{widget}-before")
        moved = _move_slider(page, cell) if widget == "slider" else _pick_dropdown(page, cell)
        page.wait_for_function(
            """([el, before]) => {
                const srcs = [...el.querySelectorAll('.widget-output img')].map(i => i.getAttribute('src') || '');
                return srcs.length > 0 && srcs.join('|') !== before;
            }""", arg=[cell.element_handle(), before], timeout=REDRAW_TIMEOUT_S * 1000)
        page.wait_for_timeout(300)
        after = _figure(cell)
        assert after and after != before, f"{moved}: the figure did not change"
        _shot(cell, f"{stem}-{widget}-after")
        print(f"{name}: Run All {run_s:.1f} s, {n_code} code cells; {moved} redrew the figure")
    finally:
        context.close()
        lab.shut_down_kernels()
