"""labkit's decoder against transformers' modelling code, logit for logit."""

from __future__ import annotations

import pytest
import torch
from conftest import RANDOM_KINDS, hf_model

from labkit.core.model import CausalLM, ModelConfig, load_checkpoint


def _compare(path, ids: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    ref = hf_model(path)
    ours = load_checkpoint(path, torch.device("cpu"), torch.float32)
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours.compute_logits(ours(ids, positions))
    assert got.shape == expected.shape
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("kind", list(RANDOM_KINDS))
def test_random_checkpoint_logits_match_transformers(random_checkpoint, kind: str) -> None:
    path = random_checkpoint(kind)
    ids = torch.randint(0, ModelConfig.from_json_file(path / "config.json").vocab_size, (2, 100),
                        generator=torch.Generator().manual_seed(0))
    assert _compare(path, ids) < 1e-4


def test_bundled_model_logits_match_transformers(bundled_path, tokenizer) -> None:
    ids = torch.tensor([tokenizer.encode("Once upon a time, there was a little fox named Lily. One day, Lily")])
    assert _compare(bundled_path, ids) < 1e-4


def test_features_are_read_from_config(random_checkpoint) -> None:
    llama = ModelConfig.from_json_file(random_checkpoint("llama") / "config.json")
    assert llama.tie_word_embeddings and not llama.attention_bias and not llama.qk_norm
    assert llama.num_key_value_heads < llama.num_attention_heads  # GQA
    assert ModelConfig.from_json_file(random_checkpoint("qwen2") / "config.json").attention_bias
    qwen3 = ModelConfig.from_json_file(random_checkpoint("qwen3") / "config.json")
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.tie_word_embeddings
    scaled = ModelConfig.from_json_file(random_checkpoint("llama3-rope") / "config.json")
    assert scaled.rope_scaling is not None and scaled.rope_theta == 500000.0


def test_rope_scaling_changes_the_output(random_checkpoint) -> None:
    """Guards the parity test above: dropping the Llama 3 scaling must be visible in the logits."""
    path = random_checkpoint("llama3-rope")
    model = load_checkpoint(path, torch.device("cpu"), torch.float32)
    cfg = model.config
    plain = CausalLM(ModelConfig(**{**cfg.to_dict(), "rope_scaling": None}))
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(300)[None]
    with torch.no_grad():
        diff = (model.compute_logits(model(ids, pos)) - plain.compute_logits(plain(ids, pos))).abs().max()
    assert diff > 1e-3


def test_float64_forward_runs_and_agrees_with_float32(random_checkpoint) -> None:
    path = random_checkpoint("qwen3")
    m32 = load_checkpoint(path, torch.device("cpu"), torch.float32)
    m64 = load_checkpoint(path, torch.device("cpu"), torch.float64)
    ids = torch.randint(0, m32.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(20)[None]
    with torch.no_grad():
        l64 = m64.compute_logits(m64(ids, pos))
        l32 = m32.compute_logits(m32(ids, pos))
    assert l64.dtype == torch.float64
    assert (l64 - l32.double()).abs().max() < 1e-3
