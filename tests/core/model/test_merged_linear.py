"""``MergedLinear`` (q/k/v and gate/up in one matmul, notebook 10): the same outputs as the separate layers,
parameters and checkpoints unchanged, no weight stored twice, and still right after weights change."""

from __future__ import annotations

import torch
from torch import nn

from labkit.core.model.layers import MergedLinear


def layers(bias: bool) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(16, 32, bias=bias), nn.Linear(16, 8, bias=bias), nn.Linear(16, 8, bias=bias)


def separate(linears: tuple[nn.Linear, ...], x: torch.Tensor) -> list[torch.Tensor]:
    return [lin(x) for lin in linears]


def test_outputs_equal_the_separate_layers_with_and_without_bias() -> None:
    for bias in (False, True):
        linears = layers(bias)
        x = torch.randn(2, 5, 16, dtype=torch.float32)
        want = separate(linears, x)
        got = MergedLinear(*linears)(x)
        assert [g.shape for g in got] == [(2, 5, 32), (2, 5, 8), (2, 5, 8)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_parameters_become_views_of_one_tensor() -> None:
    linears = layers(True)
    module = nn.ModuleList(linears)
    keys_before = list(module.state_dict())
    merged = MergedLinear(*linears)
    merged(torch.randn(1, 16))
    assert merged.weight is not None and merged.weight.shape == (48, 16)
    assert linears[0].weight.data_ptr() == merged.weight.data_ptr()  # a view, not a copy
    assert linears[2].weight.untyped_storage().data_ptr() == merged.weight.untyped_storage().data_ptr()
    assert list(module.state_dict()) == keys_before  # checkpoints load and save as before


def test_loading_into_a_layer_reaches_the_merged_matmul() -> None:
    linears = layers(False)
    merged = MergedLinear(*linears)
    x = torch.randn(3, 16)
    merged(x)
    with torch.no_grad():
        linears[1].weight.copy_(torch.randn(8, 16))  # what the checkpoint loader does
    torch.testing.assert_close(merged(x)[1], linears[1](x))


def test_replaced_tensors_are_merged_again() -> None:
    linears = layers(True)
    merged = MergedLinear(*linears)
    module = nn.ModuleList(linears)
    merged(torch.randn(1, 16))
    module.to(torch.float64)  # every parameter gets a new tensor
    x = torch.randn(4, 16, dtype=torch.float64)
    with torch.inference_mode():
        got = merged(x)
    assert got[0].dtype == torch.float64
    for g, w in zip(got, separate(linears, x)):
        torch.testing.assert_close(g, w)
    assert not merged.weight.is_inference()  # merged inside inference_mode, usable outside it
    linears[2].weight = nn.Parameter(torch.zeros(8, 16, dtype=torch.float64))  # one layer replaced alone
    assert torch.equal(merged(x)[2], linears[2](x))
