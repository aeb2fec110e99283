"""Which kernel runs a linear layer, chosen per shape: PyTorch's ``F.linear`` or oneDNN over a repacked weight.

``F.linear`` multiplies by the (out, in) weight through the BLAS library PyTorch was built with (MKL on x86).
Decode multiplies every weight by one row (a matrix-vector product, GEMV), and how fast that streams the weight
depends on the kernel and the layout far more than on the arithmetic. On an x86 CPU in float32, oneDNN (the
library behind PyTorch's ``mkldnn`` ops) over a weight repacked once into its blocked layout streams large
weights close to the memory's read bandwidth, where MKL's GEMV reaches about half of it; it also runs the
compute-bound prefill GEMMs faster. Its call costs more fixed time (~15 µs against ~2 µs), so a small weight
times a few rows stays on ``F.linear``. Notebook 04 measures both (``bench_kvcache.py``, the GEMV roof).

The repacked weight is an extra copy, made on the first call and remade whenever the weight changes (loading a
checkpoint, ``model.to(...)``): parameters, names and ``state_dict`` stay exactly nn.Linear's.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

ONEDNN_MIN_WEIGHT = 1 << 18  # elements (1 MiB in float32): larger weights stream from memory, oneDNN's strength
ONEDNN_MIN_MACS = 1 << 22  # rows x in x out: enough arithmetic to pay for oneDNN's fixed cost per call
LINEAR_KERNELS = ("auto", "torch")  # "auto": oneDNN where it pays (CPU, float32, no autograd); "torch": F.linear


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this PyTorch build runs oneDNN's packed linear (x86 and most ARM builds do), checked once, exactly."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.randn(8, 16), torch.randn(3, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, F.linear(x, w), atol=1e-5))


class LinearKernel:
    """Runs ``x @ weight.T + bias`` on the kernel that suits this call's shape; keeps the oneDNN copy. Notebook 04."""

    def __init__(self) -> None:
        self.choice = "auto"  # one of LINEAR_KERNELS; set_linear_kernel changes it for a whole model
        self.packed: torch.Tensor | None = None  # oneDNN's blocked layout of the weight (opaque)
        self.packed_from: tuple[int, int, torch.Size] | None = None  # (data_ptr, version, shape) it was made from

    def uses_onednn(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        if self.choice != "auto" or x.device.type != "cpu" or weight.dtype != torch.float32 or x.dtype != weight.dtype:
            return False
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
            return False  # oneDNN's packed op has no backward
        rows = x.numel() // x.shape[-1]
        return (weight.numel() >= ONEDNN_MIN_WEIGHT or rows * weight.numel() >= ONEDNN_MIN_MACS) and \
            onednn_linear_available()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.uses_onednn(x, weight):
            return F.linear(x, weight, bias)
        made_from = (weight.data_ptr(), weight._version, weight.shape)
        if self.packed is None or self.packed_from != made_from:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor even if first made in inference mode
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            self.packed_from = made_from
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")  # (..., out)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same names) whose matmul runs on ``LinearKernel``'s choice. Notebook 04."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel = LinearKernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


def set_linear_kernel(model: nn.Module, choice: str) -> None:
    """Run every linear layer of ``model`` on ``choice``: "auto" (oneDNN where it pays) or "torch" (``F.linear``)."""
    if choice not in LINEAR_KERNELS:
        raise ValueError(f"linear kernel {choice!r} is not one of {', '.join(LINEAR_KERNELS)}")
    for kernel in linear_kernels(model):
        kernel.choice = choice
        kernel.packed = kernel.packed_from = None  # "torch" frees the copies; "auto" remakes them on first use


def linear_kernels(model: nn.Module) -> list[LinearKernel]:
    """Every ``LinearKernel`` in ``model``: its ``Linear`` layers' and its merged layers' (attributes, not modules)."""
    kernels = []
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, LinearKernel):
                kernels.append(value)
            elif isinstance(getattr(value, "kernel", None), LinearKernel) and not isinstance(value, nn.Module):
                kernels.append(value.kernel)
    return kernels
