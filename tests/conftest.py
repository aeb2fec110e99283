"""Shared fixtures: the bundled model, tiny random Llama/Qwen2/Qwen3 checkpoints, and their references."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402

from labkit.model.source import bundled_model_path  # noqa: E402
from labkit.tokenizer import load_tokenizer  # noqa: E402

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


@pytest.fixture(autouse=True, scope="session")
def _threads() -> None:
    torch.set_num_threads(min(2, os.cpu_count() or 1))


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
