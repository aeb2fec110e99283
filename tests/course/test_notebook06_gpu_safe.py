"""Notebook 06 on a GPU: the engines it measures run the card's engine model, and every engine has a KV pool of
fixed size (on CUDA an unsized pool takes most of the card, and the notebook keeps several engines at once).
Read from the notebook's code, no GPU needed."""

from __future__ import annotations

import ast
import json
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "06_paged_attention.ipynb"


def llm_calls() -> list[ast.Call]:
    nb = json.loads(NOTEBOOK.read_text())
    trees = [ast.parse("".join(c["source"])) for c in nb["cells"] if c["cell_type"] == "code"]
    return [n for tree in trees for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "LLM"]


def test_every_engine_has_a_sized_kv_pool() -> None:
    calls = llm_calls()
    assert len(calls) >= 6
    for call in calls:
        keywords = {k.arg for k in call.keywords}
        spread = {ast.unparse(k.value) for k in call.keywords if k.arg is None}
        assert "num_gpu_blocks" in keywords or "KV_OPTIONS" in spread, ast.unparse(call)[:100]


def test_the_measured_engines_run_the_engine_model() -> None:
    source = "\n".join(ast.unparse(c) for c in llm_calls())
    assert "ENGINE_MODEL = profile.engine_model" in NOTEBOOK.read_text().replace('\\n"', "").replace('"', "")
    measured = [c for c in llm_calls() if c.args and ast.unparse(c.args[0]) == "ENGINE_MODEL"]
    # at least section 2's run, section 4's two engines (one comprehension) and Task 2's rerun of section 4
    assert len(measured) >= 3, source
