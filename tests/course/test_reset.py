"""labkit.course.reset: a notebook goes back to its original (git HEAD, else .pristine/), the learner's copy is
kept."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from labkit.course.reset import (
    BACKUP_DIR,
    PRISTINE_DIR,
    ResetError,
    find_notebook,
    main,
    reset_notebook,
    snapshot,
    status,
)

ROOT = Path(__file__).resolve().parents[2]
ORIGINAL = json.dumps({"cells": [{"cell_type": "code", "source": "def write_kv(cache, new, start):\n    raise "
                                  "NotImplementedError", "metadata": {}, "outputs": [], "execution_count": None}],
                       "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1) + "\n"
LEARNERS = ORIGINAL.replace("raise NotImplementedError", "return cache  # my attempt")


@pytest.fixture(autouse=True)
def _no_enclosing_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git must not find a repository above tmp_path


def workbook(tmp_path: Path, git: bool) -> Path:
    """A minimal workbook folder: labkit/ and two notebooks, committed to git or not."""
    root = tmp_path / "workbook"
    (root / "labkit").mkdir(parents=True)
    (root / "notebooks").mkdir()
    (root / "notebooks" / "03_kv_cache.ipynb").write_text(ORIGINAL)
    (root / "notebooks" / "04_prefill_vs_decode.ipynb").write_text(ORIGINAL.replace("write_kv", "decode_cost"))
    if git:
        for cmd in (["init", "-q"], ["add", "-A"],
                    ["-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "workbook"]):
            subprocess.run(["git", "-C", str(root), *cmd], check=True, capture_output=True)
    return root


def test_restores_from_git_and_keeps_the_learners_version(tmp_path: Path) -> None:
    root = workbook(tmp_path, git=True)
    nb = root / "notebooks" / "03_kv_cache.ipynb"
    nb.write_text(LEARNERS)
    result = reset_notebook("03", root, now=datetime(2026, 1, 2, 3, 4, 5))
    assert nb.read_text() == ORIGINAL
    assert result.changed and result.source == "git HEAD"
    assert result.backup == root / BACKUP_DIR / "03_kv_cache-20260102-030405.ipynb"
    assert result.backup.read_text() == LEARNERS
    # untouched notebooks stay as they are
    assert "decode_cost" in (root / "notebooks" / "04_prefill_vs_decode.ipynb").read_text()


def test_an_original_notebook_is_left_alone(tmp_path: Path) -> None:
    root = workbook(tmp_path, git=True)
    result = reset_notebook("3", root)
    assert not result.changed and result.backup is None
    assert not (root / BACKUP_DIR).exists()


def test_two_resets_in_the_same_second_keep_both_backups(tmp_path: Path) -> None:
    root = workbook(tmp_path, git=True)
    nb = root / "notebooks" / "03_kv_cache.ipynb"
    now = datetime(2026, 1, 2, 3, 4, 5)
    nb.write_text(LEARNERS)
    first = reset_notebook("03", root, now=now)
    nb.write_text(LEARNERS + " ")
    second = reset_notebook("03", root, now=now)
    assert first.backup != second.backup
    assert first.backup.read_text() == LEARNERS and second.backup.read_text() == LEARNERS + " "


def test_a_deleted_notebook_comes_back(tmp_path: Path) -> None:
    root = workbook(tmp_path, git=True)
    (root / "notebooks" / "03_kv_cache.ipynb").unlink()
    assert dict(status(root))["03_kv_cache.ipynb"] == "missing"
    result = reset_notebook("03_kv_cache", root)
    assert result.changed and result.backup is None
    assert (root / "notebooks" / "03_kv_cache.ipynb").read_text() == ORIGINAL


def test_without_git_the_pristine_copy_is_used(tmp_path: Path) -> None:
    root = workbook(tmp_path, git=False)
    nb = root / "notebooks" / "03_kv_cache.ipynb"
    with pytest.raises(ResetError, match=r"no original of notebooks/03_kv_cache.ipynb.*Download the notebook again"):
        reset_notebook("03", root)
    assert [p.name for p in snapshot(root)] == ["03_kv_cache.ipynb", "04_prefill_vs_decode.ipynb"]
    nb.write_text(LEARNERS)
    assert snapshot(root) == [], "a snapshot never overwrites the originals it already holds"
    assert (root / PRISTINE_DIR / nb.name).read_text() == ORIGINAL
    result = reset_notebook("03", root)
    assert result.source == str(PRISTINE_DIR / nb.name)
    assert nb.read_text() == ORIGINAL and result.backup.read_text() == LEARNERS


def test_snapshot_in_a_git_checkout_takes_the_committed_version(tmp_path: Path) -> None:
    root = workbook(tmp_path, git=True)
    nb = root / "notebooks" / "03_kv_cache.ipynb"
    nb.write_text(LEARNERS)  # already edited before the snapshot: git still knows the original
    snapshot(root)
    assert (root / PRISTINE_DIR / nb.name).read_text() == ORIGINAL


def test_notebook_names(tmp_path: Path) -> None:
    root = workbook(tmp_path, git=False)
    for spec in ("03", "3", "03_kv_cache", "03_kv_cache.ipynb", "notebooks/03_kv_cache.ipynb"):
        assert find_notebook(spec, root) == "03_kv_cache.ipynb", spec
    with pytest.raises(ResetError, match=r"no notebook '99': give its number \(03, 04\)"):
        find_notebook("99", root)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = workbook(tmp_path, git=True)
    (root / "notebooks" / "04_prefill_vs_decode.ipynb").write_text(LEARNERS)
    assert main(["--list", "--root", str(root)]) == 0
    listing = capsys.readouterr().out
    assert "03_kv_cache.ipynb" in listing and "original" in listing and "changed" in listing
    assert main(["--all", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "04_prefill_vs_decode.ipynb: restored from git HEAD" in out and "03_kv_cache" not in out
    assert main(["--all", "--root", str(root)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(["42", "--root", str(root)]) == 1
    assert "no notebook '42'" in capsys.readouterr().err


def test_runs_as_a_module_on_this_workbook() -> None:
    # Read-only: --list changes nothing. The committed notebooks all have an original here.
    proc = subprocess.run([sys.executable, "-m", "labkit.course.reset", "--list"], cwd=ROOT / "notebooks",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "03_kv_cache.ipynb" in proc.stdout
