"""Shared fixtures: the bundled model, tiny random Llama/Qwen2/Qwen3 checkpoints, and their references.

Every test runs its paged engines in debug mode (``LABKIT_DEBUG_CHECKS=1``: the block manager's books
are checked after every step), and every engine a test creates must give all its KV memory back: after
the test (or, for an engine made by a module-scoped fixture, after the module) its unfinished requests
are aborted and every block must be free, with the books balanced.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402

from labkit.core.llm import LLM  # noqa: E402
from labkit.core.model.source import bundled_model_path  # noqa: E402
from labkit.core.text.tokenizer import load_tokenizer  # noqa: E402

# labkit's Triton module before any test runs transformers (whose models import triton through torch._dynamo): on a
# machine without a GPU it chooses Triton's interpreter, which has to happen before triton is first imported, whatever
# order the tests run in. (``import labkit`` itself never imports triton; notebook 11 imports this module first.)
if importlib.util.find_spec("triton") is not None:
    importlib.import_module("labkit.core.attention.triton_decode")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# Small but complete: GQA, tied and untied embeddings, Llama 3 RoPE scaling, Qwen2 bias, Qwen3 q/k norm.
RANDOM_KINDS: dict[str, Callable[[int], object]] = {
    "llama": lambda v: LlamaConfig(
        vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0),
    "llama3-rope": lambda v: LlamaConfig(
        vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "qwen2": lambda v: Qwen2Config(
        vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": lambda v: Qwen3Config(
        vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        rope_theta=1000000.0),
}


# ``make check`` (the fast tier) leaves these out with ``-m "not integration and not slow"``: they start servers,
# worker processes, subprocesses or whole benchmark runs. ``make test`` (CI) runs everything.
INTEGRATION = (
    "tests/serving/", "tests/core/disagg/", "tests/core/parallel/test_tp_engine.py",
    "tests/course/test_ch15_tensor_parallelism.py::test_task_b_reference_passes_inside_the_two_process_engine",
    "tests/e2e/", "tests/measure/loadgen/test_bench_scripts.py",
    "tests/measure/loadgen/test_bench_serve.py", "tests/measure/test_verdicts_under_load.py",
    "tests/measure/profiling/test_quiet_profiler.py", "tests/course/test_gpu_check.py",
    "tests/measure/test_ct2_process.py",
    "tests/course/test_time_notebooks.py", "tests/course/test_reset.py", "tests/course/test_offline_bundle.py",
    "tests/core/reliability/test_interrupts.py", "tests/core/engine/test_stress.py",
    "tests/core/reliability/test_workers.py",
    # a fresh Python process each (import checks, a compiler taken away, a kernel compiled ahead of time)
    "tests/test_architecture.py::test_a_planted", "tests/test_architecture.py::test_import_labkit",
    "tests/test_architecture.py::test_choosing_a_backend",
    "tests/core/attention/test_cpp_backend.py::test_without_a_compiler",
    "tests/core/attention/test_cpp_backend.py::test_auto_without_a_compiler",
    "tests/core/attention/test_cpp_backend.py::test_a_failed_build",
    "tests/core/attention/test_triton_backend.py::test_without_triton",
    "tests/core/attention/test_triton_backend.py::test_compiles_ahead",
    "tests/core/attention/test_triton_gpu_path.py::test_no_register_spills",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(INTEGRATION) or "disaggregated" in item.name:  # "disaggregated": two processes
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True, scope="session")
def _threads() -> None:
    # LABKIT_TEST_THREADS=1 avoids oversubscription when several test runs share a small machine.
    torch.set_num_threads(int(os.environ.get("LABKIT_TEST_THREADS", "0")) or min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True, scope="module")
def _debug_checks() -> Iterator[None]:
    """Paged engines check the block manager's invariants after every step (set per module, before any
    module-scoped fixture builds an engine, and unset afterwards so notebooks run at normal speed)."""
    old = os.environ.get("LABKIT_DEBUG_CHECKS")
    os.environ["LABKIT_DEBUG_CHECKS"] = "1"
    yield
    if old is None:
        del os.environ["LABKIT_DEBUG_CHECKS"]
    else:
        os.environ["LABKIT_DEBUG_CHECKS"] = old


def assert_memory_returned(llms: list[LLM]) -> None:
    """Abort whatever each engine still runs, then every KV block must be free and the books balanced."""
    for llm in llms:
        engine = llm.engine
        engine.abort_all()
        assert not engine.has_unfinished_requests(), f"{llm!r} still has requests after abort_all"
        bm = getattr(engine, "block_manager", None)
        if bm is not None:
            assert bm.num_free_blocks == bm.num_blocks, (
                f"{llm!r} still holds {bm.num_used_blocks} of {bm.num_blocks} KV blocks with no request left")
            bm.check_invariants([])


@pytest.fixture(autouse=True, scope="session")
def _created_llms() -> Iterator[list[LLM]]:
    """Every ``LLM`` built during the session (by wrapping ``LLM.__init__``), for the checks below."""
    created: list[LLM] = []
    original = LLM.__init__

    @functools.wraps(original)
    def init(self: LLM, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        created.append(self)

    LLM.__init__ = init  # type: ignore[method-assign]
    try:
        yield created
    finally:
        LLM.__init__ = original  # type: ignore[method-assign]


@pytest.fixture(autouse=True, scope="module")
def _module_llms_return_memory(_created_llms: list[LLM]) -> Iterator[None]:
    yield  # torn down after the module's own fixtures: their engines are idle (or stopped) by now
    llms = list(_created_llms)
    _created_llms.clear()
    assert_memory_returned(llms)


@pytest.fixture(autouse=True)
def _test_llms_return_memory(_created_llms: list[LLM]) -> Iterator[None]:
    before = len(_created_llms)  # engines of module-scoped fixtures come before: checked after the module
    yield
    llms = _created_llms[before:]
    del _created_llms[before:]
    assert_memory_returned(llms)


@pytest.fixture(scope="session")
def bundled_path() -> Path:
    path = bundled_model_path()
    assert (path / "model.safetensors").is_file(), f"bundled model missing at {path}"
    return path


@pytest.fixture(scope="session")
def tokenizer(bundled_path: Path):  # type: ignore[no-untyped-def]
    return load_tokenizer(bundled_path)


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory: pytest.TempPathFactory, bundled_path: Path, tokenizer
                      ) -> Callable[[str], Path]:
    """kind -> folder with a seeded random HF checkpoint (safetensors) and the bundled tokenizer."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            torch.manual_seed(1234)
            config = RANDOM_KINDS[kind](len(tokenizer))
            config.bos_token_id = tokenizer.bos_token_id
            config.eos_token_id = tokenizer.eos_token_id
            model = AutoModelForCausalLM.from_config(config)
            with torch.no_grad():  # larger than the default init so greedy choices are clear-cut
                for p in model.parameters():
                    if p.dim() > 1:
                        p.normal_(0.0, 0.08)
            folder = tmp_path_factory.mktemp(kind)
            model.save_pretrained(folder)
            for name in TOKENIZER_FILES:
                if (bundled_path / name).is_file():
                    shutil.copy(bundled_path / name, folder / name)
            made[kind] = folder
        return made[kind]

    return make


@functools.lru_cache(maxsize=16)
def hf_model(path: Path, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    """transformers' own model for a checkpoint: the reference every engine is compared with."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@functools.lru_cache(maxsize=1024)
def _hf_greedy(path: Path, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    ids = torch.tensor([prompt_ids])
    out = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)
    return tuple(out[0, len(prompt_ids):].tolist())


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' ``generate(do_sample=False)`` continuation of one prompt (cached)."""
    return list(_hf_greedy(Path(path), tuple(prompt_ids), max_new_tokens))
