"""The package's shape, as docs/architecture.md describes it: four layers that import only downward and never in a
cycle (checked by import-linter, and shown to fail on a planted upward import), an engine a learner can read (one
request reaches the model's forward pass in at most five calls; no engine class with more than two labkit
ancestors; a step that fits on one screen), and backends that load only when chosen."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import labkit
import labkit.core
from labkit import LLM, SamplingParams
from labkit.core.engine.engine_core import EngineCore

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the labkit package found in ``root`` (its pyproject.toml holds the contracts)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-logo", "--no-cache", "--config", str(root / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, planted, broken", [
    ("core/sequence.py", "import labkit.course.tasks", "labkit's four layers import only downward"),
    ("serving/protocol.py", "import labkit.measure.stats", "labkit's four layers import only downward"),
    ("core/kv/free_blocks.py", "import labkit.core.sched.scheduler", "no import cycles"),
])
def test_a_planted_upward_import_or_cycle_breaks_the_check(tmp_path: Path, module: str, planted: str,
                                                            broken: str) -> None:
    shutil.copytree(ROOT / "labkit", tmp_path / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "labkit" / module
    path.write_text(path.read_text() + f"\n\ndef _planted() -> None:\n    {planted}  # noqa\n")  # function-local too
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env, "HF_HUB_OFFLINE": "1"})


def test_import_labkit_imports_neither_triton_nor_the_serving_stack_nor_the_upper_layers() -> None:
    result = run_python(
        "import os, sys\n"
        "import labkit\n"
        "from labkit import LLM, SamplingParams, ENGINES, Scheduler, BlockManager, ATTENTION_BACKENDS\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('triton', 'fastapi', 'uvicorn', 'prometheus_client')"
        " or m.startswith(('labkit.serving', 'labkit.measure', 'labkit.course'))]\n"
        "print(sorted(loaded), 'TRITON_INTERPRET' in os.environ)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] False"


@pytest.mark.parametrize("backend", ["torch", "cpp", "auto"])
def test_choosing_a_backend_other_than_triton_never_imports_triton(backend: str) -> None:
    result = run_python(
        "import sys\n"
        "from labkit import LLM, SamplingParams\n"
        f"llm = LLM(engine='chunked', device='cpu', attention_backend={backend!r}, max_model_len=64)\n"
        "out = llm.generate(['Once upon'], SamplingParams(max_tokens=3), use_tqdm=False)[0]\n"
        "print(len(out.outputs[0].token_ids), 'triton' in sys.modules)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "3 False"


def test_one_request_reaches_the_forward_pass_in_at_most_five_calls() -> None:
    """From ``LLM.generate`` to the model's ``forward``: Engine.run -> EngineCore.step -> ModelRunner.execute_model
    -> ModelRunner.forward -> CausalLM.forward. Frames outside labkit.core (torch's module call) do not count."""
    llm = LLM("labkit-tiny", engine="chunked", max_model_len=64)
    core = Path(labkit.core.__file__).parent
    seen: list[list[str]] = []

    def hook(module: object, args: object) -> None:
        if not seen:
            frames = [f for f in inspect.stack() if Path(f.filename).resolve().is_relative_to(core)]
            seen.append([f.function for f in reversed(frames)])

    handle = llm.model.register_forward_pre_hook(hook)
    try:
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        handle.remove()
    (path,) = seen
    calls = path[path.index("generate") + 1 :] + ["forward"]  # the hook runs just before CausalLM.forward
    assert len(calls) <= 5, f"LLM.generate -> {' -> '.join(calls)}"
    assert calls == ["run", "step", "execute_model", "forward", "forward"]


def test_the_step_reads_as_schedule_execute_update_and_fits_on_one_screen() -> None:
    source = inspect.getsource(EngineCore.step)
    assert len(source.splitlines()) <= 40
    calls = [source.index(f"{name}(") for name in ("schedule", "execute_model", "update_from_output")]
    assert calls == sorted(calls)


def core_classes() -> list[type]:
    classes = []
    for info in pkgutil.walk_packages(labkit.core.__path__, "labkit.core."):
        if info.name.endswith("__main__") or info.name.endswith("triton_decode") or "triton" in info.name:
            continue  # the Triton modules import triton (checked by tests/core/attention)
        module = importlib.import_module(info.name)
        classes += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    return classes


def test_no_class_in_core_has_more_than_two_labkit_ancestors() -> None:
    deep = {c.__qualname__: [a.__qualname__ for a in c.__mro__[1:] if a.__module__.startswith("labkit.")]
            for c in core_classes()}
    assert len(deep) > 50
    assert {name: chain for name, chain in deep.items() if len(chain) > 2} == {}


def test_the_public_api_keeps_its_names() -> None:
    from labkit import ATTENTION_BACKENDS, ENGINES, LLM, BlockManager, SamplingParams, Scheduler  # noqa: F401

    assert list(ENGINES) == ["naive", "kvcache", "paged", "continuous", "chunked", "disaggregated"]
    assert {"torch", "cpp"} <= set(ATTENTION_BACKENDS)
    assert labkit.__all__ and all(hasattr(labkit, name) for name in labkit.__all__)
