"""Carry the workbook into a room without internet: gather everything into one folder, install from it offline.

On a machine with internet (same OS, CPU architecture and Python version as the room's machines):

    python3 scripts/offline_bundle.py gather /media/usb/labkit-bundle

copies into that folder every wheel the workbook needs (requirements.txt, the package's own dependencies, all
of their dependencies, and pip and setuptools themselves; sdists are built into wheels here, so the room needs no
compiler), plus the workbook itself (notebooks, the bundled model data/labkit-tiny, labkit, tests, docs) with
original copies of the notebooks for ``python -m labkit.course.reset``. On each machine in the room, with no network:

    python3 /media/usb/labkit-bundle/workbook/scripts/offline_bundle.py install /media/usb/labkit-bundle
    # or copy the folder first and install into the copy (the install writes .venv/ into the workbook)

creates ``workbook/.venv`` and runs ``pip install --no-index --find-links <bundle>/wheels -r requirements.txt -e .``
with every pip setting from the environment and config files switched off, so nothing is fetched from anywhere.
scripts/check_offline_roundtrip.sh proves the round trip on this machine. Uses only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "results", "runs", "screenshots", "__pycache__", ".pytest_cache", ".ipynb_checkpoints",
             "build", "dist", ".pristine"}  # used only when the workbook is not a git checkout
BIN = "Scripts" if os.name == "nt" else "bin"


def run(cmd: list[str], **kwargs: object) -> None:
    print("$", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


def workbook_files(root: Path) -> list[Path]:
    """What ships: the files git tracks plus new ones it does not ignore; without git, everything but caches."""
    try:
        cmd = ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        listed = subprocess.run(cmd, capture_output=True, check=True).stdout.decode()
        files = [root / name for name in listed.split("\0") if name]
    except (FileNotFoundError, subprocess.CalledProcessError):
        files = [p for p in root.rglob("*") if p.is_file()
                 and not SKIP_DIRS & set(p.relative_to(root).parts) and not p.name.endswith(".egg-info")]
    return sorted(p for p in files if p.is_file())  # a file deleted but not yet committed does not ship


def requirements(root: Path) -> list[str]:
    """Every requirement: requirements.txt plus the package's own dependencies and its build backend."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    return ["-r", str(root / "requirements.txt"), *pyproject["project"]["dependencies"],
            *pyproject["build-system"]["requires"], "pip"]


def gather(bundle: Path, root: Path = ROOT, pip_args: list[str] | None = None) -> None:
    wheels, workbook = bundle / "wheels", bundle / "workbook"
    if workbook.exists():
        sys.exit(f"{workbook} already exists: gather into a new, empty folder")
    wheels.mkdir(parents=True, exist_ok=True)
    # pip wheel downloads wheels as they are and builds the rest: the room needs no compiler and no index.
    run([sys.executable, "-m", "pip", "wheel", "--wheel-dir", str(wheels), *(pip_args or []), *requirements(root)])
    for src in workbook_files(root):
        dst = workbook / src.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    notebooks = sorted((workbook / "notebooks").glob("*.ipynb"))
    pristine = workbook / ".pristine" / "notebooks"  # what labkit.course.reset restores where there is no git history
    pristine.mkdir(parents=True, exist_ok=True)
    for nb in notebooks:
        shutil.copy2(nb, pristine / nb.name)
        if any(c.get("outputs") for c in json.loads(nb.read_text())["cells"]):
            print(f"warning: {nb.name} carries outputs; learners will see them (make clean-notebooks first)")
    info = {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "implementation": platform.python_implementation(),
        "platform": sysconfig.get_platform(),
        "gathered": datetime.now(UTC).isoformat(timespec="seconds"),
        "num_wheels": len(list(wheels.glob("*.whl"))),
        "num_workbook_files": sum(p.is_file() for p in workbook.rglob("*")),
    }
    (bundle / "bundle.json").write_text(json.dumps(info, indent=2) + "\n")
    (bundle / "README.md").write_text(README.format(**info))
    installer = bundle / "install.sh"
    installer.write_text('#!/bin/sh\n# Install the workbook from this folder, offline. See README.md.\nset -e\n'
                         'here="$(cd "$(dirname "$0")" && pwd)"\n'
                         'exec "${PYTHON:-python3}" "$here/workbook/scripts/offline_bundle.py" install "$here" "$@"\n')
    installer.chmod(0o755)
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    print(f"gathered {info['num_wheels']} wheels and the workbook into {bundle} ({size / 2**20:,.0f} MiB) "
          f"for {info['implementation']} {info['python']} on {info['platform']}")


def offline_env() -> dict[str, str]:
    """The environment for pip with every index, link and config file switched off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def install(bundle: Path, workbook: Path | None = None) -> None:
    bundle = bundle.resolve()
    workbook = (workbook or bundle / "workbook").resolve()
    wheels = bundle / "wheels"
    if not wheels.is_dir() or not (workbook / "requirements.txt").is_file():
        sys.exit(f"{bundle} is not a bundle: expected {wheels} and {workbook / 'requirements.txt'} "
                 "(made by `offline_bundle.py gather DIR`)")
    info = json.loads((bundle / "bundle.json").read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if info["python"] != here or info["platform"] != sysconfig.get_platform():
        sys.exit(f"the bundle's wheels are for Python {info['python']} on {info['platform']}; this is Python {here} "
                 f"on {sysconfig.get_platform()}. Run the install with a matching python "
                 f"(PYTHON=python{info['python']} ./install.sh), or gather on a machine like this one.")
    venv_python = workbook / ".venv" / BIN / "python"
    if not venv_python.exists():
        run([sys.executable, "-m", "venv", str(workbook / ".venv")])
    pip = [str(venv_python), "-m", "pip", "install", "--no-index", "--find-links", str(wheels)]
    env = offline_env()
    run([*pip, "--upgrade", "pip"], env=env)
    run([*pip, "-r", "requirements.txt", "-e", "."], cwd=workbook, env=env)
    (workbook / ".venv" / ".installed").touch()  # `make lab` / `make test` then skip their (online) install step
    print(f"\nInstalled offline into {workbook / '.venv'}. Open the workbook with:\n"
          f"  cd {workbook} && make lab\n"
          f"or, without make:\n"
          f"  cd {workbook} && HF_HUB_OFFLINE=1 .venv/{BIN}/jupyter lab --ip=127.0.0.1 --notebook-dir=notebooks")


README = """# The inference-engine workbook, for a room without internet

Gathered {gathered} for {implementation} {python} on `{platform}`: {num_wheels} wheels in `wheels/` and the
workbook in `workbook/` (notebooks, the bundled model `data/labkit-tiny`, the `labkit` package, tests, docs).

## Install on each machine (no network needed)

The machine needs Python {python} (the same version as above) on the same kind of system. Copy this folder
to the machine (a USB stick, a shared drive), then:

```bash
./install.sh                      # or: python3 workbook/scripts/offline_bundle.py install .
cd workbook && make lab           # or: HF_HUB_OFFLINE=1 .venv/bin/jupyter lab --ip=127.0.0.1 --notebook-dir=notebooks
```

`install.sh` creates `workbook/.venv` and installs every package from `wheels/` with pip's indexes and config
files switched off: nothing is downloaded. If your `python3` is another version, point at the right one:
`PYTHON=python{python} ./install.sh`.

## Start a notebook over

`cd workbook && .venv/bin/python -m labkit.course.reset 03` restores notebook 03 as shipped (from `.pristine/`) and
keeps your version in `notebooks/.backups/`. `--list` shows which notebooks you changed.

## Check the installation

`cd workbook && make test` runs every test offline (unit tests, then every notebook in smoke mode). For a
quicker check, `.venv/bin/python -m pytest -o addopts="" tests/course/test_exercises.py` runs the exercise checkers.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gather", help="download and build every wheel, copy the workbook (needs internet)")
    g.add_argument("bundle", type=Path, help="a new folder to gather into")
    g.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `pip wheel`, e.g. --pip-arg=--extra-index-url=URL for a CUDA torch")
    i = sub.add_parser("install", help="create workbook/.venv from the bundle (no network)")
    i.add_argument("bundle", type=Path, help="the folder made by gather")
    i.add_argument("--workbook", type=Path, help="install into this copy of the workbook instead of bundle/workbook")
    args = parser.parse_args()
    if args.command == "gather":
        gather(args.bundle.resolve(), pip_args=args.pip_arg)
    else:
        install(args.bundle, args.workbook)


if __name__ == "__main__":
    main()
