"""Quantize a loaded model in place: every linear layer becomes a ``QuantizedLinear`` (vLLM's ``quantization=``).

Applied by ``LLM(..., quantization=...)`` right after the weights are loaded, so every engine and every attention
backend runs the same quantized model (they only call its layers). Every check runs before the first layer changes:
a layer that int4's group size does not divide leaves the model untouched. The merged projections (q, k, v and
gate, up: ``MergedLinear``) become ``QuantizedMergedLinear``s over the new layers. Introduced in notebook 14.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from labkit.core.model.layers import MergedLinear
from labkit.core.quant.config import QuantizationConfig, check_compute_dtype
from labkit.core.quant.int4 import check_group_size
from labkit.core.quant.linear import QuantizedLinear, QuantizedMergedLinear
from labkit.core.quant.weights import Quantizer, quantize_weight


def linear_layers(model: nn.Module, config: QuantizationConfig) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, layer) for every linear layer ``config`` quantizes, by module order."""
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            full = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and (config.lm_head or full != "lm_head"):
                found.append((parent, name, child))
    return found


def quantize_model(model: nn.Module, config: QuantizationConfig, quantizer: Quantizer = quantize_weight) -> nn.Module:
    """Replace ``model``'s linear layers by quantized ones (the embedding table stays); returns ``model``.
    ``quantizer``: labkit's ``quantize_weight``, or a learner's of the same signature (notebook 14)."""
    layers = linear_layers(model, config)
    for parent, name, layer in layers:
        check_compute_dtype(layer.weight.dtype)
        if config.method == "int4":
            check_group_size(layer.in_features, config.group_size, f"{type(parent).__name__}.{name}")
    replaced: dict[int, QuantizedLinear] = {}
    for parent, name, layer in layers:
        quantized = QuantizedLinear.from_linear(layer, config, quantizer)
        replaced[id(layer)] = quantized
        setattr(parent, name, quantized)
    _replace_merged(model, replaced)
    return model


def _replace_merged(model: nn.Module, replaced: Mapping[int, QuantizedLinear]) -> None:
    for module in model.modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, MergedLinear) and all(id(lin) in replaced for lin in value.linears):
                setattr(module, attr, QuantizedMergedLinear(*(replaced[id(lin)] for lin in value.linears)))


def quantize_like(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """Give a freshly built (unquantized) model the quantized layers that ``state_dict`` (a quantized model's) holds,
    empty, so ``load_state_dict`` fills them: how a second process (notebook 12's prefill worker) rebuilds a
    quantized model from its weights. A float ``state_dict`` leaves the model as it is."""
    replaced: dict[int, QuantizedLinear] = {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            key = f"{parent_name}.{name}" if parent_name else name
            qweight = state_dict.get(f"{key}.qweight")
            if not isinstance(child, nn.Linear) or qweight is None:
                continue
            scales = state_dict[f"{key}.scales"]
            if qweight.dtype == torch.int8:
                config = QuantizationConfig("int8")
            else:
                config = QuantizationConfig("int4", group_size=child.in_features // scales.shape[1])
            layer = QuantizedLinear(child.in_features, child.out_features, config, bias=child.bias is not None,
                                    device=qweight.device if child.weight.is_meta else child.weight.device,
                                    dtype=child.weight.dtype)
            replaced[id(child)] = layer
            setattr(parent, name, layer)
    _replace_merged(model, replaced)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a decode step reads: every linear layer's (quantized: values and scales), not the
    embedding table (one row per token)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.weight_bytes
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total
