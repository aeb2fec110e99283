"""Notebook 14's checkers pass labkit's references and fail each planted bug with its own failure class."""

from __future__ import annotations

import pytest
import torch

from labkit.core.kv.quantized_pool import QuantizedKVPool
from labkit.core.quant.int4 import pack_int4
from labkit.core.quant.weights import quantize_weight
from labkit.course.ch14_quantization import check_int8_kv_pool, check_quantize_weight


def planted_quantizer(bug: str):  # type: ignore[no-untyped-def]
    def fn(weight, method, group_size=32, scales=None):  # type: ignore[no-untyped-def]
        w = weight.float()
        top, low = (127, -127) if method == "int8" else (7, -8)
        if method == "int8":
            amax = w.abs().amax(dim=0 if bug == "wrong axis" else 1)
            s = scales if scales is not None else torch.where(amax > 0, amax / (128 if bug == "scale overflow" else
                                                                                   127), torch.ones_like(amax))
            s = amax / 127 if bug == "zero scale" else s  # a row of zeros gets scale 0 (then 0 / 0)
            q = torch.round(w / (s[None, :] if bug == "wrong axis" else s[:, None]))
            q = q if bug == "missing clamp" else q.clamp(low, top)
            return q.to(torch.int8), s.float()
        g = w.reshape(w.shape[0], -1, group_size)
        amax = g.abs().amax(2)
        s = scales if scales is not None else torch.where(amax > 0, amax / (8 if bug == "scale overflow" else 7),
                                                          torch.ones_like(amax))
        s = amax / 7 if bug == "zero scale" else s
        q = torch.round(g / s[..., None])
        q = (q if bug == "missing clamp" else q.clamp(low, top)).flatten(1)
        if bug == "missing clamp":
            return ((q.to(torch.int16) + 8) & 0x0F).to(torch.uint8)[:, 0::2] | \
                (((q.to(torch.int16) + 8) & 0x0F).to(torch.uint8)[:, 1::2] << 4), s.float()  # wraps in 4 bits
        packed = pack_int4(q)
        if bug == "nibble order":
            packed = ((packed & 0x0F) << 4) | (packed >> 4)
        return packed, s.float()
    return fn


def test_the_reference_quantizer_passes() -> None:
    assert check_quantize_weight(quantize_weight).passed


@pytest.mark.parametrize(("bug", "because"), [("wrong axis", "axis"), ("missing clamp", "clamp"),
                                              ("scale overflow", "error"), ("nibble order", "nibbles"),
                                              ("zero scale", "zero")])
def test_each_planted_quantizer_bug_fails_with_its_class(bug: str, because: str) -> None:
    result = check_quantize_weight(planted_quantizer(bug))
    assert not result.passed and because in result.because, (result.failures, result.because)


class PerBlockScale(QuantizedKVPool):
    def write(self, layer, slots, k, v):  # type: ignore[no-untyped-def]
        for pool, scales, x in ((self.k[layer], self.k_scale[layer], k), (self.v[layer], self.v_scale[layer], v)):
            s = x.abs().amax() / 127  # one scale for everything written
            pool.flatten(0, 1)[slots] = torch.round(x / s).clamp(-127, 127).to(torch.int8)
            scales.flatten(0, 1)[slots] = s


class Truncated(QuantizedKVPool):
    def write(self, layer, slots, k, v):  # type: ignore[no-untyped-def]
        for pool, scales, x in ((self.k[layer], self.k_scale[layer], k), (self.v[layer], self.v_scale[layer], v)):
            amax = x.abs().amax(-1)
            s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            pool.flatten(0, 1)[slots] = (x / s[..., None]).to(torch.int8)  # truncates toward zero
            scales.flatten(0, 1)[slots] = s


class WholeBlocks(QuantizedKVPool):
    def write(self, layer, slots, k, v):  # type: ignore[no-untyped-def]
        super().write(layer, slots, k, v)
        blocks = slots // self.block_size
        self.k[layer][blocks - 1] = 1  # scribbles over the block before


def test_the_reference_kv_pool_passes() -> None:
    assert check_int8_kv_pool(QuantizedKVPool).passed


@pytest.mark.parametrize(("cls", "because"), [(PerBlockScale, "scale-axis"), (Truncated, "error"),
                                              (WholeBlocks, "slots")])
def test_each_planted_kv_bug_fails_with_its_class(cls: type[QuantizedKVPool], because: str) -> None:
    result = check_int8_kv_pool(cls)
    assert not result.passed and because in result.because, (result.failures, result.because)
