"""Notebooks 07 and 08 on a GPU: their engines run the card's engine model and never stay open side by side.

On CUDA each engine sizes its KV pool from the memory it finds, and every open engine keeps its weights and pool;
notebook 08 once built seven engines and kept them all. Read from the notebooks' code (no GPU needed): every
``LLM(...)`` takes ``model`` (``profile.engine_model``), and is either a ``with`` block or closed in the same cell.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
ENGINE_NOTEBOOKS = ["07_continuous_batching", "08_chunked_prefill"]


def code_cells(name: str) -> list[ast.Module]:
    nb = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())
    return [ast.parse("".join(c["source"])) for c in nb["cells"] if c["cell_type"] == "code"]


def llm_calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "LLM"]


@pytest.mark.parametrize("name", ENGINE_NOTEBOOKS)
def test_model_comes_from_the_profile(name: str) -> None:
    cells = code_cells(name)
    assigned = [n for tree in cells for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "model" for t in n.targets)]
    assert len(assigned) == 1 and ast.unparse(assigned[0].value) == "profile.engine_model"
    calls = [c for tree in cells for c in llm_calls(tree)]
    assert calls, "the notebook builds no engine"
    for call in calls:
        assert call.args and ast.unparse(call.args[0]) == "model", f"LLM({ast.unparse(call)[4:60]}...) not on model"


@pytest.mark.parametrize("name", ENGINE_NOTEBOOKS)
def test_every_engine_is_closed_in_its_cell(name: str) -> None:
    for tree in code_cells(name):
        in_with = {id(item.context_expr) for n in ast.walk(tree) if isinstance(n, ast.With) for item in n.items}
        closed = {ast.unparse(n.func.value) for n in ast.walk(tree) if isinstance(n, ast.Call)
                  and isinstance(n.func, ast.Attribute) and n.func.attr == "close"}
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and n.value in llm_calls(n):
                target = ast.unparse(n.targets[0])
                assert target in closed, f"{name}: engine {target} = LLM(...) is never closed in its cell"
        for call in llm_calls(tree):
            assigned = any(isinstance(n, ast.Assign) and n.value is call for n in ast.walk(tree))
            assert id(call) in in_with or assigned, f"{name}: an LLM(...) neither in a with block nor closed"
