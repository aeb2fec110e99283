"""Start a notebook over: restore its original version, keeping a backup of yours. No git knowledge needed.

    python -m labkit.course.reset 03          # notebook 03 as shipped; yours goes to notebooks/.backups/
    python -m labkit.course.reset 03 07       # several at once
    python -m labkit.course.reset --all       # every notebook you changed
    python -m labkit.course.reset --list      # which notebooks differ from the original
    python -m labkit.course.reset --snapshot  # keep original copies in .pristine/ (for a copy without git history)

The original comes from git's last commit when the workbook is a git checkout (``git show HEAD:...``), else
from ``.pristine/notebooks/``, which the offline bundle ships (scripts/offline_bundle.py) and ``--snapshot``
writes. The learner's version is never lost: it is copied to ``notebooks/.backups/NN_name-<time>.ipynb``
first (a hidden folder, so neither the test suite nor JupyterLab's file list picks it up).

Not a notebook's subject: the README's "Start a notebook over" section describes it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

PRISTINE_DIR = Path(".pristine") / "notebooks"  # relative to the workbook's root
BACKUP_DIR = Path("notebooks") / ".backups"


class ResetError(Exception):
    """A notebook that cannot be found, or whose original version is not available."""


@dataclass(frozen=True)
class ResetResult:
    """What ``reset_notebook`` did. Described in the README's "Start a notebook over" section."""

    notebook: Path  # the notebook restored
    source: str  # where the original came from: "git HEAD" or the .pristine/ file
    changed: bool  # False: it already was the original, nothing written
    backup: Path | None  # the learner's version, kept before overwriting (None if nothing was there or unchanged)


def find_root(start: Path | None = None) -> Path:
    """The workbook folder (the one holding notebooks/): from ``start`` (default: cwd) upwards, else labkit's."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "notebooks").is_dir() and (folder / "labkit").is_dir():
            return folder
    package_root = Path(__file__).resolve().parents[2]
    if (package_root / "notebooks").is_dir():
        return package_root
    raise ResetError(f"no workbook found from {here} upwards (a folder with notebooks/ and labkit/); "
                     "run this from the workbook folder")


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes] | None:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):  # no git installed, or a stuck repository
        return None


def git_original(root: Path, relpath: str) -> bytes | None:
    """The file as of the last commit, or None (not a git checkout, no git, or not committed)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or top.returncode:
        return None
    try:
        inside = (root / relpath).resolve().relative_to(Path(top.stdout.decode().strip()).resolve())
    except ValueError:  # root is not inside that checkout
        return None
    shown = _git(root, "show", f"HEAD:{inside.as_posix()}")
    return shown.stdout if shown is not None and shown.returncode == 0 else None


def original(root: Path, name: str) -> tuple[bytes, str]:
    """(contents, where from) of the original version of ``notebooks/<name>``."""
    from_git = git_original(root, f"notebooks/{name}")
    if from_git is not None:
        return from_git, "git HEAD"
    copy = root / PRISTINE_DIR / name
    if copy.is_file():
        return copy.read_bytes(), str(PRISTINE_DIR / name)
    raise ResetError(f"no original of notebooks/{name}: this folder has no git history for it and no "
                     f"{PRISTINE_DIR / name}. Download the notebook again from the workbook's repository "
                     "(or ask your instructor for the offline bundle).")


def known_notebooks(root: Path) -> list[str]:
    """File names of every notebook: on disk, in the pristine copies, or committed (even if deleted here)."""
    names = {p.name for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    names |= {p.name for p in (root / PRISTINE_DIR).glob("[0-9][0-9]_*.ipynb")}
    listed = _git(root, "ls-files", "notebooks")
    if listed is not None and listed.returncode == 0:
        names |= {Path(line).name for line in listed.stdout.decode().splitlines()
                  if Path(line).parent.name == "notebooks" and line.endswith(".ipynb")}
    return sorted(names)


def find_notebook(spec: str, root: Path) -> str:
    """``"3"``, ``"03"``, ``"03_kv_cache"`` or ``"notebooks/03_kv_cache.ipynb"`` -> ``"03_kv_cache.ipynb"``."""
    names = known_notebooks(root)
    wanted = Path(spec).name.removesuffix(".ipynb")
    if wanted.isdigit():
        matches = [n for n in names if n.startswith(f"{int(wanted):02d}_")]
    else:
        matches = [n for n in names if n.removesuffix(".ipynb") == wanted]
    if len(matches) != 1:
        choices = ", ".join(n[:2] for n in names)
        raise ResetError(f"no notebook {spec!r}: give its number ({choices}) or its file name")
    return matches[0]


def reset_notebook(spec: str, root: Path | None = None, now: datetime | None = None) -> ResetResult:
    """Restore one notebook to its original version, first copying the learner's to notebooks/.backups/."""
    root = root or find_root()
    name = find_notebook(spec, root)
    contents, source = original(root, name)
    path = root / "notebooks" / name
    if path.is_file() and path.read_bytes() == contents:
        return ResetResult(path, source, changed=False, backup=None)
    backup = None
    if path.is_file():
        stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
        backup = root / BACKUP_DIR / f"{path.stem}-{stamp}.ipynb"
        n = 1
        while backup.exists():  # two resets within a second keep both backups
            backup = backup.with_name(f"{path.stem}-{stamp}-{n}.ipynb")
            n += 1
        backup.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, backup)
    path.write_bytes(contents)
    return ResetResult(path, source, changed=True, backup=backup)


def snapshot(root: Path | None = None) -> list[Path]:
    """Write .pristine/notebooks/ (from git HEAD where committed, else the current files); never overwrites."""
    root = root or find_root()
    written = []
    for name in known_notebooks(root):
        target = root / PRISTINE_DIR / name
        if target.exists():
            continue
        contents = git_original(root, f"notebooks/{name}")
        if contents is None:
            contents = (root / "notebooks" / name).read_bytes()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(contents)
        written.append(target)
    return written


def status(root: Path) -> list[tuple[str, str]]:
    """(notebook, "original" | "changed" | "missing" | "no original") for every notebook."""
    rows = []
    for name in known_notebooks(root):
        path = root / "notebooks" / name
        try:
            contents, _ = original(root, name)
        except ResetError:
            rows.append((name, "no original"))
            continue
        state = "missing" if not path.is_file() else "original" if path.read_bytes() == contents else "changed"
        rows.append((name, state))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.course.reset", description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="notebook numbers or names, e.g. 03 or 03_kv_cache")
    parser.add_argument("--all", action="store_true", help="reset every notebook that differs from the original")
    parser.add_argument("--list", action="store_true", help="show which notebooks differ from the original")
    parser.add_argument("--snapshot", action="store_true", help="save original copies to .pristine/notebooks/")
    parser.add_argument("--root", type=Path, help="the workbook folder (default: found from here)")
    args = parser.parse_args(argv)
    try:
        root = args.root.resolve() if args.root else find_root()
        if args.snapshot:
            written = snapshot(root)
            print(f"saved {len(written)} original notebook(s) to {root / PRISTINE_DIR}" if written
                  else f"{root / PRISTINE_DIR} already holds every notebook")
            return 0
        if args.list:
            for name, state in status(root):
                print(f"{name:<36} {state}")
            return 0
        specs = args.notebooks or []
        if args.all:
            specs = [name for name, state in status(root) if state in ("changed", "missing")]
            if not specs:
                print("every notebook is the original: nothing to do")
                return 0
        if not specs:
            parser.error("name a notebook (e.g. 03), or pass --all, --list or --snapshot")
        for spec in specs:
            result = reset_notebook(spec, root)
            if not result.changed:
                print(f"{result.notebook.name}: already the original, nothing to do")
                continue
            kept = f"; your version is kept in {result.backup.relative_to(root)}" if result.backup else ""
            print(f"{result.notebook.name}: restored from {result.source}{kept}")
        print("If the notebook is open in JupyterLab: File > Reload Notebook from Disk, then Kernel > Restart Kernel.")
    except ResetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
