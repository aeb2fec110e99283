"""``scripts/gpu_check.py --dry-run``: the GPU plan runs on the CPU at tiny sizes and writes both reports, naming the
hardware, with what needs CUDA skipped for a stated reason; and the Markdown report shows a GPU run's tables
(built here from a made-up GPU result, since no GPU is at hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_both_reports(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "dry-run.json").read_text(encoding="utf-8"))
    assert report["dry_run"] and report["hardware"]["device"] == "cpu" and report["hardware"]["name"]
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["hardware probe", "CUDA tests", "kernel registers (sm_90)", "triton float32 precision",
                            "notebooks", "decode MBU", "decode attention", "async + graphs stability",
                            "quantized GEMV"]
    assert report["complete"]
    assert checks["CUDA tests"]["status"] == "skipped" and "needs a CUDA GPU" in checks["CUDA tests"]["reason"]
    assert all(c["status"] == "passed" for name, c in checks.items() if name != "CUDA tests"), checks
    assert checks["hardware probe"]["detail"]["memory_bandwidth"] > 0
    assert checks["notebooks"]["detail"]["notebooks"]  # at least one notebook ran, under nbval
    mbu = checks["decode MBU"]["detail"]
    assert [r["batch"] for r in mbu["rows"]] == list(report["plan"]["batches"])
    assert all(r["mbu_forward"] > 0 and r["bytes_per_step"] > 0 for r in mbu["rows"])
    assert mbu["skipped"] == ["CUDA graphs: they need CUDA"]
    assert {r["attention_backend"] for r in mbu["rows"]} == {"torch"}  # the interpreter is not timed in an engine
    attention = checks["decode attention"]["detail"]
    from labkit.core.attention import ATTENTION_BACKENDS

    paths = ["torch split", "torch padded"] + (["triton"] if "triton" in ATTENTION_BACKENDS else [])
    assert attention["paths"] == paths and attention["interpreter"] == ("triton" in paths)
    assert len(attention["rows"]) == 4 * len(paths)  # batches (1, 2) x contexts (16, 40)
    assert all(r["max_abs_diff"] <= attention["tolerance"] and r["gb_per_s"] > 0 for r in attention["rows"])
    assert attention["goal"]["measured"] is None  # batch 64 x 4096 is the GPU plan's
    stable = checks["async + graphs stability"]["detail"]
    assert all(r["same_tokens"] for r in stable["runs"]) and stable["captures_after_start"] == 0
    assert len(stable["sync_seconds"]) == len(stable["runs"]) and min(stable["sync_seconds"]) > 0  # the baseline
    registers = checks["kernel registers (sm_90)"]["detail"]  # ptxas from the triton wheel: no GPU needed
    assert registers["spilling"] == 0 and {r["head_dim"] for r in registers["rows"]} == {64, 128}
    precision = checks["triton float32 precision"]["detail"]
    assert precision["dot_precision"] == "ieee" and precision["max_abs_diff"] <= 1e-4 and precision["interpreter"]
    gemv = checks["quantized GEMV"]["detail"]  # the Triton int8 / int4 kernels, under the interpreter
    assert {r["path"] for r in gemv["rows"]} == {"F.linear (float32)", "int8, Triton", "int4-g32, Triton",
                                                 "int8, dequantize + F.linear"}
    assert all(r["gb_per_s"] > 0 for r in gemv["rows"]) and gemv["interpreter"]
    assert all(r["max_rel_diff"] is None or r["max_rel_diff"] <= gemv["tolerance"] for r in gemv["rows"])
    text = (tmp_path / "dry-run.md").read_text(encoding="utf-8")
    assert text.startswith(f"# GPU check: {report['hardware']['name']}")
    for section in ("## Hardware", "## Checks", "## Notebooks (smoke sizes)", "## Decode MBU", "## Decode attention",
                    "## Triton kernel registers (sm_90", "## Stability", "## Quantized decode GEMV (batch 1)"):
        assert section in text
    assert "| CUDA tests | skipped |" in text and "dry run on the CPU" in text


def load_gpu_check():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return gpu_check


def test_a_failed_probe_skips_what_needs_it_and_the_report_grows_as_it_goes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks that need the probe's roof are reported as skipped with the reason (not dropped), and every check
    finds the reports on disk already holding the checks before it."""
    gpu_check = load_gpu_check()
    seen: dict[str, list[str]] = {}

    def probe(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no roof today")

    def recorder(name: str):  # type: ignore[no-untyped-def]
        def check(*args: object) -> dict:
            report = json.loads((tmp_path / "dry-run.json").read_text(encoding="utf-8"))
            seen[name] = [c["name"] for c in report["checks"]]
            assert not report["complete"]
            return {}
        return check

    monkeypatch.setattr(gpu_check, "probe", probe)
    for fn in ("check_kernel_registers", "check_triton_precision", "check_notebooks", "check_stability"):
        monkeypatch.setattr(gpu_check, fn, recorder(fn))
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1  # the probe failed
    report = json.loads((tmp_path / "dry-run.json").read_text(encoding="utf-8"))
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["hardware probe"]["status"] == "failed" and "no roof today" in checks["hardware probe"]["reason"]
    for name in ("decode MBU", "decode attention", "quantized GEMV"):
        assert checks[name]["status"] == "skipped" and "hardware probe" in checks[name]["reason"]
    assert seen["check_kernel_registers"] == ["hardware probe", "CUDA tests"]
    names = list(checks)
    assert seen["check_stability"] == names[:names.index("async + graphs stability")] and report["complete"]
    assert "| decode MBU | skipped |" in (tmp_path / "dry-run.md").read_text(encoding="utf-8")


def test_the_dry_run_hides_a_gpu(tmp_path: Path) -> None:
    """On a GPU host the dry run is still the CPU plan: the GPU is hidden before torch or triton look for it."""
    code = ("import runpy, sys; sys.argv = ['gpu_check.py', '--dry-run', '--help']\n"
            "try:\n    runpy.run_path('scripts/gpu_check.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), os.environ['TRITON_INTERPRET'], "
            "torch.cuda.is_available())")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "'' 1 False"


def test_markdown_of_a_gpu_run() -> None:
    gpu_check = load_gpu_check()
    row = {"forward_ms": 2.5, "step_ms": 3.0, "bytes_per_step": 2.6e9, "mbu_forward": 0.6, "mbu_step": 0.5}
    report = {
        "dry_run": False, "date": "2026-01-01T00:00:00+00:00", "command": ".venv/bin/python scripts/gpu_check.py",
        "seconds": 400.0,
        "hardware": {"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "memory": "85.0 GB",
                     "compute_capability": "9.0"},
        "checks": [
            {"name": "CUDA tests", "status": "passed", "reason": "", "seconds": 60.0, "detail": {}},
            {"name": "decode MBU", "status": "passed", "reason": "", "seconds": 30.0, "detail": {
                "preset": "llama3.2-1b", "dtype": "bfloat16", "prompt_len": 128, "decode_steps": 32,
                "roof_bandwidth": 3.0e12, "skipped": [],
                "rows": [{**row, "batch": 1, "graphs": False, "attention_backend": "torch"},
                         {**row, "batch": 1, "graphs": True, "attention_backend": "(graph decode)"}]}},
            {"name": "decode attention", "status": "passed", "reason": "", "seconds": 20.0, "detail": {
                "heads": [32, 8, 64], "dtype": "bfloat16", "tolerance": 0.02, "interpreter": False,
                "paths": ["torch split", "triton"],
                "goal": {"path": "triton", "batch": 64, "context_len": 4096, "fraction": 0.7, "measured": 0.75},
                "rows": [{"batch": 64, "context_len": 4096, "path": "triton", "ms": 0.2, "gb_per_s": 2700.0,
                          "fraction_of_roof": 0.75, "kernels_per_call": 2, "max_abs_diff": 0.004}]}},
            {"name": "async + graphs stability", "status": "passed", "reason": "", "seconds": 9.0, "detail": {
                "model": "llama3.2-1b", "graphs": True, "captures_after_start": 0,
                "runs": [{"seconds": 1.0, "same_tokens": True}], "sync_seconds": [1.25]}},
        ],
    }
    text = gpu_check.markdown(report)
    assert text.startswith("# GPU check: NVIDIA H100 80GB HBM3") and "| compute_capability | 9.0 |" in text
    assert "| 1 | yes | (graph decode) | 2.50 | 3.00 | 60.0% | 50.0% |" in text
    assert "## Stability: async scheduling + CUDA graphs (llama3.2-1b)" in text
    assert "median 1.25 s over 1 runs; async scheduling took 0.80x that" in text
    assert "| 64 | 4096 | triton | 0.200 | 2700.0 | 75.0% | 2 | 0.004 |" in text
    assert "measured 75%: met" in text and "interpreter" not in text
    assert gpu_check.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
