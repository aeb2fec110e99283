"""Loading refuses anything but safetensors, names what is wrong, and knows its presets."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from labkit import LLM, PRESETS, SamplingParams
from labkit.core.model import CausalLM, get_preset, load_checkpoint


def test_folder_without_safetensors_is_refused(tmp_path, bundled_path) -> None:
    shutil.copy(bundled_path / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_checkpoint(tmp_path, torch.device("cpu"), torch.float32)


def test_pickle_checkpoint_is_refused_not_loaded(tmp_path, bundled_path) -> None:
    shutil.copy(bundled_path / "config.json", tmp_path / "config.json")
    marker = tmp_path / "pwned"
    # A pickle that would create a file if it were ever unpickled.
    payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    (tmp_path / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(ValueError, match="pickle"):
        load_checkpoint(tmp_path, torch.device("cpu"), torch.float32)
    assert not marker.exists()


def test_folder_without_config_is_refused(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path), engine="naive")


def test_unsupported_architecture_is_named(tmp_path, bundled_path) -> None:
    cfg = json.loads((bundled_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gpt2.*llama, qwen2, qwen3"):
        load_checkpoint(tmp_path, torch.device("cpu"), torch.float32)


def test_shape_mismatch_is_named(tmp_path, bundled_path) -> None:
    cfg = json.loads((bundled_path / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(bundled_path / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="mlp.*shape"):
        load_checkpoint(tmp_path, torch.device("cpu"), torch.float32)


def test_unknown_model_and_preset_are_named() -> None:
    with pytest.raises(ValueError, match="unknown model 'qwen9-7b'.*smollm2-135m"):
        LLM("qwen9-7b", engine="naive")
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        get_preset("nope")


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("smollm2-135m", 130e6, 140e6), ("qwen2.5-0.5b", 480e6, 500e6), ("qwen3-0.6b", 580e6, 610e6),
     ("llama3.2-1b", 1.2e9, 1.3e9), ("llama3.1-8b", 7.9e9, 8.1e9)],
)
def test_presets_have_their_real_size(name: str, low: float, high: float) -> None:
    config = PRESETS[name]
    assert low < config.num_params < high
    with torch.device("meta"):
        model = CausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_params


def test_a_preset_runs_with_random_weights() -> None:
    llm = LLM("smollm2-135m", engine="naive", max_model_len=64)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    out = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert all(0 <= t < PRESETS["smollm2-135m"].vocab_size for t in out.outputs[0].token_ids)
