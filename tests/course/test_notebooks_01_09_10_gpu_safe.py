"""Notebooks 01, 09 and 10 on a GPU: engines on the profile's model and device, and none left open when replaced.

Read from the notebooks' code (no GPU needed). 01 and 09 teach engine lessons, so they run ``profile.engine_model``
(a ~1B preset on a GPU, where the bundled model is bound by kernel launches); 10 profiles the bundled model and a
preset on purpose (host-bound against device-bound). No engine is pinned to the CPU, and every engine 10 builds is
closed (or a ``with`` block) before the notebook ends, so the next one gets the card's memory.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def code(name: str) -> ast.Module:
    nb = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())
    return ast.parse("\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"))


def calls(tree: ast.AST, func: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == func]


def keyword(call: ast.Call, name: str) -> str | None:
    return next((ast.unparse(k.value) for k in call.keywords if k.arg == name), None)


@pytest.mark.parametrize("name", ["01_anatomy_of_a_request", "09_serving_and_metrics"])
def test_engine_lessons_run_the_profiles_engine_model_on_its_device(name: str) -> None:
    tree = code(name)
    engines = calls(tree, "LLM")
    if name.startswith("09"):
        options = [c for c in calls(tree, "dict") if keyword(c, "model") is not None]
        assert [keyword(c, "model") for c in options] == ["profile.engine_model"]
        assert keyword(options[0], "device") == "profile.device"
    assert engines, f"{name} builds no engine"
    for call in engines:
        assert ast.unparse(call.args[0]) == "profile.engine_model", ast.unparse(call)
        assert keyword(call, "device") == "profile.device", ast.unparse(call)


@pytest.mark.parametrize("name", ["01_anatomy_of_a_request", "09_serving_and_metrics", "10_profiling_host_overhead"])
def test_no_engine_is_pinned_to_the_cpu(name: str) -> None:
    for call in calls(code(name), "LLM"):
        assert keyword(call, "device") not in ("'cpu'", '"cpu"'), ast.unparse(call)


def test_every_engine_of_notebook_10_is_closed() -> None:
    tree = code("10_profiling_host_overhead")
    closed = {ast.unparse(n.func.value) for n in ast.walk(tree) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Attribute) and n.func.attr == "close"}
    in_with = {id(item.context_expr) for n in ast.walk(tree) if isinstance(n, ast.With) for item in n.items}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name) \
                and n.value.func.id in ("LLM", "my_engine"):
            target = ast.unparse(n.targets[0])
            assert target in closed, f"{target} = {n.value.func.id}(...) is never closed"
    # engines built in a dict comprehension are closed by a loop over the dict's values
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.DictComp) and calls(n.value, "LLM"):
            target = ast.unparse(n.targets[0])
            loops = [f for f in ast.walk(tree) if isinstance(f, ast.For) and ast.unparse(f.iter) == f"{target}.values()"
                     and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "close"
                             for c in ast.walk(f))]
            assert loops, f"the engines in {target} are never closed"
    for call in calls(tree, "LLM"):
        assigned = any(isinstance(n, (ast.Assign, ast.DictComp)) and call in ast.walk(n) for n in ast.walk(tree))
        raises = any(isinstance(n, ast.Try) and call in ast.walk(n) for n in ast.walk(tree))  # the refused CUDA graphs
        assert id(call) in in_with or assigned or raises, ast.unparse(call)
