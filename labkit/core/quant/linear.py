"""``QuantizedLinear``: a linear layer whose weight is stored as int8 or int4 (with scales) and never as floats.

Its buffers are ``qweight`` (int8 (out, in), or uint8 (out, in / 2) for int4: labkit.core.quant.int4's packing)
and ``scales`` (float32: (out,) or (out, in / group_size)), plus the float ``bias`` if the layer had one; they are in
``state_dict`` under the layer's name (``...q_proj.qweight``). A call with few rows on a CPU in float32 (decode) runs
labkit's GEMV kernel (``labkit.core.quant.gemv``), which reads the packed bytes and widens them in registers; on
CUDA, the Triton kernels of ``labkit.core.quant.triton_gemv`` do the same; any other call (prefill, another device
or dtype, no compiler, no Triton) dequantizes the weight for that call and runs ``F.linear``.
``QuantizedMergedLinear`` is ``MergedLinear``'s counterpart (q, k, v or gate, up in one call): its layers' buffers
are views into one merged tensor. Introduced in notebook 14 (``14_quantization``).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

from labkit.core.quant import gemv
from labkit.core.quant.config import QuantizationConfig, gemv_kernel_name
from labkit.core.quant.weights import Quantizer, dequantize_weight, quantize_weight


def quantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, method: str, group_size: int,
                     bias: torch.Tensor | None, activations: str = "float") -> torch.Tensor:
    """(..., in) -> (..., out): the GEMV kernel for decode-shaped calls on a CPU in float32 (``activations="int16"``:
    the weights times x rounded to int16, ``"int8"``: int4 weights times x rounded to int8) or on CUDA (the Triton
    kernels, x as it is: ``activations`` picks among the CPU's kernels only), else dequantize and ``F.linear`` in x's
    dtype."""
    n_in = qweight.shape[1] * (2 if method == "int4" else 1)
    rows = x.numel() // n_in
    if (x.device.type == "cpu" and x.dtype == torch.float32 and rows <= gemv.MAX_KERNEL_ROWS
            and gemv.load_gemv() is not None):
        x2 = x.reshape(rows, n_in)  # (B, in)
        kernel = getattr(gemv, gemv_kernel_name(method, activations))
        y = kernel(x2, qweight, scales) if method == "int8" else kernel(x2, qweight, scales, group_size)  # (B, out)
    elif triton_gemv_applies(x.device.type, x.dtype, rows, method, group_size) and triton_gemv() is not None:
        y = triton_gemv().gemv_quantized(x.reshape(rows, n_in).contiguous(), qweight, scales, method,  # type: ignore
                                         group_size)  # (B, out)
    else:
        return F.linear(x, dequantize(qweight, scales, method, group_size, x.dtype), bias)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], -1)


TRITON_GEMV_ROWS = 16  # labkit.core.quant.triton_gemv.MAX_ROWS (that module imports triton: not imported here)


def triton_gemv_applies(device_type: str, dtype: torch.dtype, rows: int, method: str, group_size: int) -> bool:
    """Whether a call runs the Triton GEMV kernels: a decode-shaped call (few rows) on CUDA in a float dtype, int8
    weights or int4 in groups of 32, 64 or 128. Every other call dequantizes and runs F.linear."""
    return (device_type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and rows <= TRITON_GEMV_ROWS and (method == "int8" or group_size in (32, 64, 128)))


@functools.cache
def triton_gemv() -> ModuleType | None:
    """``labkit.core.quant.triton_gemv`` where Triton imports, else None (those calls dequantize and F.linear)."""
    from labkit.core.attention import triton_missing

    if triton_missing() is not None:
        return None
    from labkit.core.quant import triton_gemv as kernels

    return kernels


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, method: str, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    return dequantize_weight(qweight, scales, method, group_size, dtype)


class QuantizedLinear(nn.Module):
    """A linear layer over an int8 or int4 weight (weight-only quantization: activations stay float, or 16-bit
    integers with ``activations="int16"``, unless an int4 layer's config says ``activations="int8"``; only
    decode-shaped calls round them). Notebook 14."""

    def __init__(self, in_features: int, out_features: int, config: QuantizationConfig, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method, self.group_size, self.activations = config.method, config.group_size, config.activations
        if config.method == "int8":
            self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.ones(out_features, device=device))
        else:
            self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8,
                                                        device=device))
            self.register_buffer("scales", torch.ones(out_features, in_features // config.group_size, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False) \
            if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantizationConfig,
                    quantizer: Quantizer = quantize_weight) -> QuantizedLinear:
        """Quantize ``linear``'s weight with ``quantizer`` (its bias stays float)."""
        weight = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, config, bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype)
        qweight, scales = quantizer(weight, config.method, config.group_size)
        layer.qweight, layer.scales = qweight.contiguous(), scales.contiguous()
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach().clone()  # type: ignore[union-attr]
        return layer

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.method == "int4" else ""
        group += f", {self.activations} activations" if self.activations != "float" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method}{group}"

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(out, in) in ``dtype``: what the layer multiplies by."""
        return dequantize(self.qweight, self.scales, self.method, self.group_size, dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads for this layer's weight: packed values and scales."""
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_matmul(x, self.qweight, self.scales, self.method, self.group_size, self.bias, self.activations)


class QuantizedMergedLinear:
    """Several ``QuantizedLinear`` layers that read the same input, run as one call (``MergedLinear``'s counterpart:
    q, k, v and gate, up). Their buffers become views into one merged tensor, so loading into them fills it; if the
    buffers are replaced (``model.to(...)``), the next call merges again. Notebook 14."""

    def __init__(self, *linears: QuantizedLinear) -> None:
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.qweight: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.merged(x).split(self.sizes, dim=-1)

    def merged(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) -> (..., sum of out_features)."""
        if not self._is_merged():
            self._merge()
        first = self.linears[0]
        return quantized_matmul(x, self.qweight, self.scales, first.method, first.group_size,  # type: ignore[arg-type]
                                self.bias, first.activations)

    def _is_merged(self) -> bool:
        if self.qweight is None:
            return False
        for name in ("qweight", "scales"):
            whole = getattr(self, name)
            offset = whole.data_ptr()
            for lin in self.linears:
                part = getattr(lin, name)
                if part.data_ptr() != offset:
                    return False
                offset += part.numel() * part.element_size()
        return True

    def _merge(self) -> None:
        with torch.inference_mode(False), torch.no_grad():  # plain tensors even if first called in inference mode
            for name in ("qweight", "scales"):
                whole = torch.cat([getattr(lin, name) for lin in self.linears])  # (sum of out, ...)
                setattr(self, name, whole)
                for lin, part in zip(self.linears, whole.split(self.sizes)):
                    setattr(lin, name, part)  # a view: the layer's buffer now lives in the merged tensor
            self.bias = None
            if all(lin.bias is not None for lin in self.linears):
                self.bias = torch.cat([lin.bias for lin in self.linears])  # type: ignore[misc]
                for lin, part in zip(self.linears, self.bias.split(self.sizes)):
                    lin.bias.data = part  # type: ignore[union-attr]
