"""The offline API's option errors (issue 19): each is a ValueError naming the option (or file) and the limit,
never a busy loop, a bare KeyError, an allocator traceback or a message about the wrong folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from labkit import LLM, SamplingParams
from labkit.core.model.config import ModelConfig

MODEL = "labkit-tiny"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, engine="chunked", max_model_len=64)


@pytest.mark.timeout(60)  # before the fix, nan never arrived: generate busy-looped forever
@pytest.mark.parametrize("offset", [float("nan"), float("inf"), -float("inf"), -1.0])
def test_arrival_times_must_be_finite(llm: LLM, offset: float) -> None:
    with pytest.raises(ValueError, match=rf"arrival_times\[1\] must be a number of seconds >= 0 and finite, "
                                         rf"got {offset!r}"):
        llm.generate(["Hi", "Hello"], SamplingParams(max_tokens=2), arrival_times=[0.0, offset], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), arrival_times=[0.01], use_tqdm=False)[0].finished


def checkpoint_with(tmp_path: Path, source: Path, edit: object) -> Path:
    """A copy of the bundled checkpoint whose config.json is ``edit(config)`` (a dict) or the given text."""
    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    text = edit if isinstance(edit, str) else json.dumps(edit(config))  # type: ignore[operator]
    (folder / "config.json").write_text(text)
    return folder


def without(*keys: str):  # type: ignore[no-untyped-def]
    return lambda config: {k: v for k, v in config.items() if k not in keys}


def with_values(**values: object):  # type: ignore[no-untyped-def]
    return lambda config: {**config, **values}


@pytest.mark.parametrize("edit, message", [
    (without("vocab_size"), r"config.json has no vocab_size; a llama config needs vocab_size, hidden_size, "
                            r"intermediate_size, num_hidden_layers, num_attention_heads"),
    (without("vocab_size", "hidden_size"), r"config.json has no vocab_size, hidden_size; "),
    ("{not json", r"config.json is not valid JSON: Expecting property name"),
    ("[1, 2]", r"config.json must hold a JSON object, got list"),
    (with_values(num_attention_heads=0), r"config.json: num_attention_heads must be an integer >= 1, got 0"),
    (with_values(vocab_size="2048"), r'config.json: vocab_size must be an integer >= 1, got "2048"'),
    (with_values(model_type="gpt2"), r"config.json has model_type 'gpt2'; labkit implements llama, qwen2, qwen3"),
    (with_values(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}),
     r"config.json: rope_type llama3 needs a number low_freq_factor, got null"),
])
def test_a_bad_config_json_is_named_with_the_problem(tmp_path: Path, bundled_path: Path, edit: object,
                                                     message: str) -> None:
    folder = checkpoint_with(tmp_path, bundled_path, edit)
    with pytest.raises(ValueError, match=message) as info:
        LLM(str(folder))
    assert str(info.value).startswith(str(folder / "config.json"))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_json_file(folder / "config.json")


def test_an_empty_model_name_and_a_folder_without_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"model is empty; give the bundled model 'labkit-tiny', a checkpoint folder, "
                                         r"or a preset \("):
        LLM("")
    monkeypatch.chdir(tmp_path)  # "." is a folder; the message says which one
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path.resolve()} has no config.json"):
        LLM(".")


@pytest.mark.parametrize("option, value", [("num_gpu_blocks", 10**12), ("num_gpu_blocks", 2**62),
                                           ("kv_cache_memory", 10**18)])
def test_a_kv_pool_larger_than_the_device_is_refused_before_allocating(option: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"{option}={value} asks for a KV pool of \d+ blocks x 32768 bytes "
                                         rf"\(block_size 16\) = [\d.]+ GiB, more than this cpu device's [\d.]+ GiB of "
                                         rf"memory; at most \d+ blocks fit: lower {option}"):
        LLM(MODEL, engine="chunked", **{option: value})
    assert LLM(MODEL, engine="chunked", max_model_len=64, num_gpu_blocks=64).engine.num_blocks == 64
