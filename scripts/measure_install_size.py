"""Measure the installed size of the workbook's virtual environment (``du`` of .venv) for the README.

    .venv/bin/python scripts/measure_install_size.py [VENV]   # writes docs/install_size.json

``scripts/make_learner_docs.py`` then writes the figure into the README (region ``tasks-install-size``), so the
README states what was measured, where and when, not a number typed by hand.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "install_size.json"


def tree_bytes(folder: Path) -> int:
    """``du -sb folder`` (apparent bytes, links not followed); without ``du``, the regular files' sizes summed."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: build the environment first (make env)")
    if shutil.which("du"):
        out = subprocess.run(["du", "-sb", str(folder)], check=True, capture_output=True, text=True).stdout
        return int(out.split()[0])
    total = 0
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            path = Path(dirpath, name)
            if not path.is_symlink():
                total += path.stat().st_size
    return total


def main() -> None:
    venv = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / ".venv"
    size = {"bytes": tree_bytes(venv), "platform": f"{platform.system()} {platform.machine()}, Python "
            f"{platform.python_version()}", "date": datetime.date.today().isoformat()}
    OUT.write_text(json.dumps(size, indent=1) + "\n", encoding="utf-8")
    print(f"{venv}: {size['bytes'] / 1e9:.2f} GB -> {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
