"""labkit.model.linear: the per-shape kernel choice (F.linear or oneDNN over a repacked weight) is exact enough, follows
weight changes, and leaves parameters, names and autograd as nn.Linear's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from labkit.model.config import ModelConfig
from labkit.model.decoder import CausalLM
from labkit.model.linear import (
    ONEDNN_MIN_WEIGHT,
    Linear,
    linear_kernels,
    onednn_linear_available,
    set_linear_kernel,
)

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")
BIG = (1024, 512)  # out, in: 2**19 elements, above ONEDNN_MIN_WEIGHT


def test_thresholds_pick_onednn_for_large_weights_and_large_batches_only() -> None:
    assert BIG[0] * BIG[1] >= ONEDNN_MIN_WEIGHT
    big, small = Linear(BIG[1], BIG[0]), Linear(64, 32)
    with torch.inference_mode():
        assert big.kernel.uses_onednn(torch.randn(1, BIG[1]), big.weight) == onednn_linear_available()
        assert not small.kernel.uses_onednn(torch.randn(1, 64), small.weight)  # small weight, one row: F.linear
        assert small.kernel.uses_onednn(torch.randn(4096, 64), small.weight) == onednn_linear_available()
        assert not big.kernel.uses_onednn(torch.randn(1, BIG[1], dtype=torch.float64), big.weight.double())


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(BIG[1], BIG[0], bias=bias)
    x = torch.randn(2, rows, BIG[1])  # (B, T, in): the model's shape
    with torch.inference_mode():
        got = layer(x)
    assert layer.kernel.packed is not None  # it did run on oneDNN
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_repacks_when_the_weight_changes_in_place_or_is_replaced() -> None:
    torch.manual_seed(1)
    layer = Linear(BIG[1], BIG[0], bias=False)
    x = torch.randn(1, BIG[1])
    with torch.inference_mode():
        layer(x)
    other = nn.Linear(BIG[1], BIG[0], bias=False)
    layer.load_state_dict(other.state_dict())  # an in-place copy: same storage, new version
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, other.weight), rtol=1e-5, atol=1e-4)
    layer.weight = nn.Parameter(torch.randn(BIG[0], BIG[1]))  # a new tensor
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)


def test_autograd_and_names_are_nn_linears() -> None:
    layer = Linear(BIG[1], BIG[0])
    assert list(layer.state_dict()) == list(nn.Linear(BIG[1], BIG[0]).state_dict())
    x = torch.randn(3, BIG[1], requires_grad=True)
    layer(x).sum().backward()  # gradients on: F.linear, which has a backward
    assert layer.kernel.packed is None and layer.weight.grad is not None and x.grad is not None


@needs_onednn
def test_set_linear_kernel_switches_a_whole_model_and_rejects_unknown_names() -> None:
    torch.manual_seed(2)
    config = ModelConfig(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=512, tie_word_embeddings=True)
    model = CausalLM(config).eval()
    kernels = linear_kernels(model)
    # per layer: the merged qkv and gate_up, o_proj, down_proj, and the four layers' own kernels, plus lm_head
    assert len(kernels) == model.config.num_hidden_layers * 9 + 1
    ids = torch.randint(0, model.config.vocab_size, (1, 300))
    pos = torch.arange(300)[None]
    with torch.inference_mode():
        auto = model(ids, pos)
        assert any(k.packed is not None for k in kernels)
        set_linear_kernel(model, "torch")
        assert all(k.packed is None and k.choice == "torch" for k in kernels)
        plain = model(ids, pos)
        assert all(k.packed is None for k in kernels)  # "torch": nothing repacked
    torch.testing.assert_close(auto, plain, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="'mkl' is not one of auto, torch"):
        set_linear_kernel(model, "mkl")
