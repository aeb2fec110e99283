"""The processes the browser tests need: Debian's Chromium and a private JupyterLab, each stopped by pid.

* ``ensure_chromium``: Debian's ``/usr/bin/chromium``, installed with apt-get when missing (CI runs as
  root on a clean Debian machine). Playwright's own browser download is never used.
* ``running_jupyterlab``: JupyterLab on 127.0.0.1, a free port, a fresh token, ``--allow-root``,
  serving a *copy* of the notebooks in smoke mode, with private Jupyter folders so a developer's own
  settings, kernels or extensions never leak in.
* ``running_chromium``: Chromium headless with a new empty profile; Playwright attaches to it over the
  DevTools protocol, so this module, not Playwright, owns the browser's pid.

Both context managers stop their process by its own pid on exit, also when the body raised, and then
every descendant it had (Jupyter starts kernels in sessions of their own, so a process-group kill
would miss them).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[3]
NOTEBOOKS_DIR = REPO / "notebooks"
SCREENSHOTS_DIR = REPO / "screenshots"
CHROMIUM = Path("/usr/bin/chromium")
# The flags the issue asks for: headless, no sandbox (CI runs as root), nothing that phones home.
# Notebooks run in several tabs at once: none may be throttled for being in the background.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--disable-background-timer-throttling",
                  "--disable-backgrounding-occluded-windows", "--disable-renderer-backgrounding")
# JupyterLab user settings: attach every cell to the page (no windowing, so off-screen outputs are in
# the DOM), and no news, update or extension-manager requests (offline).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/extensionmanager-extension/plugin": {"disabled": True},
}
# Top-level entries the copied notebooks may reach by relative path (e.g. ``../data``): linked, not copied.
LINKED = ("data", "labkit", "scripts", "docs", "results")
START_TIMEOUT_S = 180.0


class ServiceError(RuntimeError):
    """A browser-test service could not be installed or started; the message says what to do."""


@dataclass(frozen=True)
class Lab:
    """A running JupyterLab: where it listens, its token, the folder it serves (a copy), its pid."""

    url: str
    token: str
    root_dir: Path
    pid: int

    def api(self, path: str, method: str = "GET") -> object:
        """Call the Jupyter server's REST API (``/api/...``) with the token; returns the decoded JSON."""
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self, path: str) -> None:
        """End the sessions (and kernels) of the notebook at ``path``: each holds memory and threads."""
        for session in self.api("/api/sessions"):  # type: ignore[union-attr]
            if session["path"] == path:
                self.api(f"/api/sessions/{session['id']}", method="DELETE")


def ensure_chromium() -> Path:
    """Debian's Chromium at /usr/bin/chromium; installs the ``chromium`` package with apt-get when missing."""
    if CHROMIUM.is_file():
        return CHROMIUM
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        raise ServiceError(f"{CHROMIUM} is missing and cannot be installed here (apt-get: {apt}, "
                           f"root: {os.geteuid() == 0}); install it: `sudo apt-get install -y chromium`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [apt, "install", "-y", "--no-install-recommends", "chromium"]
    log: list[str] = []

    def run(step: list[str]) -> bool:
        done = subprocess.run(step, env=env, capture_output=True, text=True, timeout=900)
        log.append(f"$ {' '.join(step)} -> exit {done.returncode}\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
        return done.returncode == 0

    # A clean machine may have no package lists, or stale ones: update, then try again.
    if not (_apt_knows_chromium() and run(install)):
        run([apt, "update"]) and run(install)
    if not CHROMIUM.is_file():
        raise ServiceError(f"could not install Debian's chromium (needed at {CHROMIUM}):\n" + "\n".join(log))
    return CHROMIUM


def _apt_knows_chromium() -> bool:
    shown = subprocess.run(["apt-cache", "policy", "chromium"], capture_output=True, text=True)
    return "Candidate:" in shown.stdout and "Candidate: (none)" not in shown.stdout


def default_tabs() -> int:
    """How many notebooks run side by side: ``LABKIT_BROWSER_TABS``, else 2 (1 on a one-core machine)."""
    return max(1, int(os.environ.get("LABKIT_BROWSER_TABS", min(2, os.cpu_count() or 1))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process_tree(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """Stop ``proc`` by its pid (SIGTERM, then SIGKILL), then each descendant still alive by its own pid."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # Jupyter shuts its kernels down on SIGTERM
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for child in descendants:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(descendants, timeout=5)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def _log_tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else "(no log)"


def copy_workbook(dest: Path) -> Path:
    """``dest/notebooks``: a copy of the committed notebooks, beside links to the folders they may reach."""
    shutil.copytree(NOTEBOOKS_DIR, dest / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for name in LINKED:
        if (REPO / name).exists():
            (dest / name).symlink_to(REPO / name)
    return dest / "notebooks"


@contextmanager
def running_jupyterlab(root_dir: Path, home: Path, tabs: int = 1) -> Iterator[Lab]:
    """JupyterLab serving ``root_dir`` (smoke mode, offline); its settings, data and logs live in ``home``.

    With ``tabs`` kernels running at once, each kernel's torch gets an equal share of the cores (unless
    OMP_NUM_THREADS is set already): oversubscribed OpenMP threads spin and slow every kernel down.
    """
    settings = home / "settings"
    for plugin, values in LAB_SETTINGS.items():
        folder, name = plugin.rsplit("/", 1)
        (settings / folder).mkdir(parents=True, exist_ok=True)
        (settings / folder / f"{name}.jupyterlab-settings").write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(24)
    env = {**os.environ, "LABKIT_SMOKE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
           "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime")}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tabs)))
    env.pop("LABKIT_DEBUG_CHECKS", None)  # the unit tests' invariant checks would only slow the notebooks down
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--port-retries=0", "--allow-root", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    log_path = home / "jupyterlab.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        lab = Lab(f"http://127.0.0.1:{port}", token, root_dir, proc.pid)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise ServiceError(f"JupyterLab exited with {proc.returncode} before serving:\n{_log_tail(log_path)}")
            try:
                lab.api("/api/status")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise ServiceError(f"JupyterLab did not answer on {lab.url} within {START_TIMEOUT_S:.0f} s:\n"
                                       f"{_log_tail(log_path)}") from None
                time.sleep(0.5)
        yield lab
    finally:
        stop_process_tree(proc)


@contextmanager
def running_chromium(chromium: Path, profile: Path) -> Iterator[str]:
    """Chromium headless on a new empty profile; yields its DevTools endpoint (http://127.0.0.1:PORT)."""
    cmd = [str(chromium), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
           "--remote-debugging-port=0", "about:blank"]
    log_path = profile.parent / f"{profile.name}.log"
    with open(log_path, "wb") as log:  # /usr/bin/chromium is a script that execs the browser: same pid
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        active = profile / "DevToolsActivePort"  # Chromium writes its DevTools port here once it listens
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (active.is_file() and active.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServiceError(f"Chromium did not start (exit {proc.poll()}):\n{_log_tail(log_path)}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{active.read_text().split()[0]}"
    finally:
        stop_process_tree(proc)
