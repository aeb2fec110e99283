"""scripts/offline_bundle.py without the network: what ships, what pip is told, and clear refusals.

The real round trip (downloads, a fresh venv, install with the network cut off) is
scripts/check_offline_roundtrip.sh: too slow and too online for the test suite.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "scripts" / "offline_bundle.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bundle = load_script()


def test_the_workbook_ships_notebooks_model_and_package_but_no_local_state() -> None:
    shipped = {p.relative_to(ROOT).as_posix() for p in bundle.workbook_files(ROOT)}
    for needed in ("requirements.txt", "pyproject.toml", "Makefile", "labkit/__init__.py", "labkit/course/reset.py",
                   "notebooks/00_setup_and_hardware.ipynb", "data/labkit-tiny/model.safetensors",
                   "data/labkit-tiny/tokenizer.json", "scripts/offline_bundle.py"):
        assert needed in shipped, needed
    for local in (".venv/", "results/", ".git/", "__pycache__/", ".pytest_cache/"):
        assert not any(p.startswith(local) or f"/{local}" in p for p in shipped), local


def test_every_requirement_and_the_build_backend_is_gathered() -> None:
    args = bundle.requirements(ROOT)
    assert args[:2] == ["-r", str(ROOT / "requirements.txt")]
    assert "torch==2.13.0" in args and "pip" in args
    assert any(a.startswith("setuptools") for a in args), "editable install needs the build backend offline"


def test_pip_is_cut_off_from_every_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", "/somewhere")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://example.invalid/simple")
    env = bundle.offline_env()
    assert env["PIP_NO_INDEX"] == "1" and env["PIP_CONFIG_FILE"] == os.devnull
    assert "PIP_FIND_LINKS" not in env and "PIP_EXTRA_INDEX_URL" not in env


def test_gather_lays_out_the_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(bundle, "run", lambda cmd, **kw: calls.append(cmd))  # no downloads here
    root = tmp_path / "src"
    for rel, text in (("requirements.txt", "numpy\n"), ("pyproject.toml", (ROOT / "pyproject.toml").read_text()),
                      ("notebooks/03_kv_cache.ipynb", json.dumps({"cells": [{"cell_type": "code", "outputs": []}]})),
                      ("data/labkit-tiny/config.json", "{}"), (".venv/bin/python", ""), ("results/roof.json", "{}")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # not a git checkout: the fallback file walk
    out = tmp_path / "bundle"
    bundle.gather(out, root=root)
    assert calls and calls[0][1:4] == ["-m", "pip", "wheel"] and str(out / "wheels") in calls[0]
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {"README.md", "install.sh", "bundle.json", "workbook/requirements.txt",
            "workbook/data/labkit-tiny/config.json", "workbook/notebooks/03_kv_cache.ipynb",
            "workbook/.pristine/notebooks/03_kv_cache.ipynb"} <= files
    assert not any(f.startswith(("workbook/.venv", "workbook/results")) for f in files)
    info = json.loads((out / "bundle.json").read_text())
    assert info["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert os.access(out / "install.sh", os.X_OK)
    with pytest.raises(SystemExit, match="already exists"):
        bundle.gather(out, root=root)  # never mixes two gathers


def test_install_refuses_a_folder_that_is_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="is not a bundle"):
        bundle.install(tmp_path)


def test_install_refuses_wheels_for_another_python(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "workbook").mkdir()
    (tmp_path / "workbook" / "requirements.txt").write_text("")
    (tmp_path / "bundle.json").write_text(json.dumps({"python": "3.99", "platform": sysconfig.get_platform()}))
    with pytest.raises(SystemExit, match=r"wheels are for Python 3.99 on .*\(PYTHON=python3.99 ./install.sh\)"):
        bundle.install(tmp_path)
    assert not (tmp_path / "workbook" / ".venv").exists()
