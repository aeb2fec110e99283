"""A CPU decode step as a prebuilt list of C++ calls: the CPU's counterpart of CUDA graphs (notebook 10).

Run layer by layer, a decode step of a small model spends milliseconds in Python between its kernels: each layer is
a dozen module calls, each linear layer re-checks its shape, dtype, layout and kernel, and every PyTorch op costs
~2-5 µs of dispatch for a few hundred floats (notebook 10 measures it; on smollm2-135m about 100 µs a layer, 3 ms
a step, measured with the GEMV kernel stubbed out). A CUDA graph removes that on a GPU by replaying the recorded
kernels. On a CPU, ``DecodePlan`` does the checks once: it walks the model, records for every layer which C++
kernel runs each step (labkit's GEMV kernels for float32, int8 and int4 weights, RMSNorm, RoPE, SwiGLU's gate, the
paged K/V write and decode attention) and the tensors each reads, and then runs a decode step as that list of calls.
The arithmetic is the same as the layer-by-layer path's decode (the same kernels, in the same order): so are the
tokens. ``run_layers`` is that loop in Python, a dozen calls a layer (0.35-1.3 ms of a smollm2-135m step, by format,
in one-off A/Bs); ``DecodeStep`` (``csrc/decode_step_cpu.cpp``, one module built from both kernels' sources) runs the
same loop in C++, one call a step, and is what runs wherever it builds.

Like a captured graph, a plan goes stale when what it recorded changes: before the first decode step after requests
arrive (``EngineCore.add_request`` calls ``recheck``) it checks that every module, parameter and kernel choice it read
is still in place and is rebuilt if not. That is where user code can have changed the model (between ``generate``
calls); checked before every step, its ~1,800 objects (on smollm2-135m), cold in the cache after the weights
streamed past, cost a visible share of a quantized step (about 0.5 ms, once, on a 2-core VM). It runs only what it
was built for: float32 activations on a CPU, a decode-only step of at most ``max_rows`` sequences on the ``"cpp"``
attention backend, Llama-style layers (labkit's own modules, no q/k norm), no stall watch tripped; every other step
runs layer by layer. Opt in with ``LLM(..., decode_plan=True)``. Notebook 14 measures it
(``scripts/bench_quantization.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from labkit.core.attention.cpp_decode import CppAttentionBackend, CppExtension, compile_extension, load_extension
from labkit.core.model import CausalLM
from labkit.core.model.attention import Attention
from labkit.core.model.decoder import DecoderLayer
from labkit.core.model.layers import MLP, MergedLinear, RMSNorm
from labkit.core.model.linear import STALL_WATCH, Linear
from labkit.core.quant import gemv
from labkit.core.quant.config import gemv_kernel_name
from labkit.core.quant.linear import QuantizedLinear, QuantizedMergedLinear

STEP_SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_step_cpu.cpp"

# What must still hold for a plan to be current: (a dict that holds an object, its key, the object), and the
# addresses of the tensors the plan reads (a tensor whose .data was replaced moves).
Ref = tuple[dict, str, object]

# The classes whose forward a plan stands in for: a learner's replacement (or a patched forward) runs layer by layer.
PLANNED_FORWARDS = {cls: cls.forward for cls in (DecoderLayer, Attention, MLP, RMSNorm, Linear, QuantizedLinear)}


@dataclass(frozen=True)
class LinearCall:
    """One linear layer as the plan runs it: x (N, in) contiguous float32 -> (N, out); ``run(x, residual)`` returns
    residual + the layer's output, the add done by the kernel as it writes each output (the same float addition as
    the layer-by-layer path's ``residual + layer(x)``, so the same bits). The C++ step (``DecodeStep``) makes the
    same call from the same fields."""

    run: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    kernel: str  # the C++ function it calls: "gemv_f32", "gemv_int8", "gemv_int4", or one with "_a16" / "_a8" added
    weight: torch.Tensor  # (out, in) float32 or int8, or (out, in / 2) uint8 (int4, two per byte)
    scales: torch.Tensor | None  # int8: (out,); int4: (out, in / group); float32: None
    group_size: int  # int4's group (0 otherwise)
    grain: int  # output rows per thread task
    bias: torch.Tensor | None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it reads (their addresses are checked after requests arrive)."""
        return tuple(t for t in (self.weight, self.scales, self.bias) if t is not None)


@dataclass(frozen=True)
class LayerCalls:
    """One decoder layer's weights, as its kernels read them."""

    input_norm: torch.Tensor  # (hidden,)
    input_eps: float
    qkv: LinearCall  # -> (N, (n_heads + 2 * n_kv_heads) * head_dim)
    o_proj: LinearCall
    post_norm: torch.Tensor
    post_eps: float
    gate_up: LinearCall  # -> (N, 2 * intermediate)
    down: LinearCall


def float_linear(module: ModuleType, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearCall:
    task_rows = gemv.task_rows(weight.shape[1] * 4)  # for a thread team (applies() declines while one stalls)

    def run(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if bias is None:
            return module.gemv_f32(x, weight, task_rows, residual)
        return with_bias(module.gemv_f32(x, weight, task_rows), bias, residual)
    return LinearCall(run, "gemv_f32", weight, None, 0, task_rows, bias)


def with_bias(y: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """(y + bias), then the residual added in the layer-by-layer path's order: residual + (y + bias)."""
    y = y + bias
    return y if residual is None else residual + y


def quantized_linear(module: ModuleType, method: str, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                     bias: torch.Tensor | None, activations: str = "float") -> LinearCall:
    name = gemv_kernel_name(method, activations)  # the layer's own choice (QuantizedLinear)
    kernel = getattr(module, name)
    if method == "int8":
        group_size = 0
        task_rows = gemv.task_rows(qweight.shape[1])

        def run(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            if bias is None:
                return kernel(x, qweight, scales, task_rows, residual)
            return with_bias(kernel(x, qweight, scales, task_rows), bias, residual)
    else:
        task_rows = gemv.task_rows(qweight.shape[1] + scales.shape[1] * 4)

        def run(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            if bias is None:
                return kernel(x, qweight, scales, group_size, task_rows, residual)
            return with_bias(kernel(x, qweight, scales, group_size, task_rows), bias, residual)
    return LinearCall(run, name, qweight, scales, group_size, task_rows, bias)


@functools.cache
def load_step() -> CppExtension:
    """The C++ decode step (``csrc/decode_step_cpu.cpp``: the GEMV and attention kernels' sources in one module, the
    layer loop in C++), loaded or built once per process; ``missing`` says why not (then the plan loops in Python)."""
    return compile_extension(STEP_SOURCE, prefix="labkit_decode_step", what="C++ decode step (the plan in one call)")


class DecodePlan:
    """Runs a model's decode steps as prebuilt C++ calls when they qualify (module docstring). Notebook 14."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.layers: list[LayerCalls] | None = None
        self.refs: list[Ref] = []
        self.tensors: list[torch.Tensor] = []
        self.addresses: list[int] = []
        self.why_not: str | None = None  # why the last build found the model unplannable
        self.built = False  # whether build ran (successfully or not) since the plan was made
        self.forwards: dict[type, Callable[..., torch.Tensor]] = {}  # each planned class's forward at the build
        self.builds = 0  # how often a plan was built (a rebuild means something it read changed)
        self.checked = False  # whether current() has checked what the plan read since requests last arrived
        self.steps = 0  # decode steps it ran
        self.step: object | None = None  # the C++ step (DecodeStep) built from ``layers``, or None: Python loops
        self.use_step = True  # False: run the layers from Python even where the C++ step is built (to compare them)

    def applies(self, input_ids: torch.Tensor, backend: object) -> bool:
        """Whether this step can run as the plan: a CPU float32 decode-only step on the "cpp" backend, few rows."""
        return (type(backend) is CppAttentionBackend and backend.writes_kv and backend.cpp_decode is not None
                and input_ids.shape[0] == 1 and input_ids.shape[1] <= gemv.MAX_KERNEL_ROWS
                and self.model.device.type == "cpu" and self.model.dtype == torch.float32
                and not torch.is_grad_enabled() and not STALL_WATCH.recent())

    def recheck(self) -> None:
        """Check what the plan read again before its next step (requests arrived: the model may have changed)."""
        self.checked = False

    def current(self) -> bool:
        """Whether everything the plan read is still what the model holds (built now if it never was); checked
        once after each ``recheck``."""
        if not self.checked:
            self.checked = True
            if not self.built or any(holder.get(key) is not obj for holder, key, obj in self.refs) \
                    or any(cls.forward is not forward for cls, forward in self.forwards.items()) \
                    or [t.data_ptr() for t in self.tensors] != self.addresses:
                self.build()
        return self.layers is not None

    def build(self) -> None:
        """Record every layer's calls, or why it cannot (``why_not``). Either way, what was read is remembered, so an
        unplannable model is looked at again only when one of those things changes."""
        self.layers, self.refs, self.tensors, self.why_not, self.built = None, [], [], None, True
        self.step = None
        self.forwards = {cls: cls.forward for cls in PLANNED_FORWARDS}
        patched = [cls.__name__ for cls, forward in PLANNED_FORWARDS.items() if cls.forward is not forward]
        if patched:
            self.why_not = f"{', '.join(patched)}.forward was replaced: the replacement runs, layer by layer"
            return
        module = gemv.load_gemv(warn=False)
        if module is None or load_extension(warn=False) is None:
            self.why_not = "labkit's C++ kernels are not built"
            return
        layers = []
        decoder = self.model.model
        self.refs += [(vars(decoder), "_modules", decoder._modules), (decoder._modules, "layers", decoder.layers)]
        for index, layer in decoder.layers._modules.items():
            self.refs.append((decoder.layers._modules, index, layer))
            calls = self._layer(module, layer)  # type: ignore[arg-type]
            if calls is None:
                self.addresses = [t.data_ptr() for t in self.tensors]
                return
            layers.append(calls)
        self.layers = layers
        self.tensors += [t for calls in layers for t in (calls.input_norm, calls.post_norm) + tuple(
            t for call in (calls.qkv, calls.o_proj, calls.gate_up, calls.down) for t in call.tensors)]
        self.addresses = [t.data_ptr() for t in self.tensors]
        self.step = self._step(layers)
        self.builds += 1

    def _step(self, layers: list[LayerCalls]) -> object | None:
        """The same calls as one C++ object (``DecodeStep``), or None where its module cannot be built."""
        step_module = load_step().module
        if step_module is None:
            return None
        config = self.model.config
        step = step_module.DecodeStep(config.num_attention_heads, config.num_key_value_heads, config.head_dim)

        def planned(call: LinearCall) -> object:
            return step_module.PlannedLinear(call.kernel, call.weight, call.scales, call.group_size, call.grain,
                                             call.bias)
        for calls in layers:
            step.add_layer(calls.input_norm, calls.input_eps, planned(calls.qkv), planned(calls.o_proj),
                           calls.post_norm, calls.post_eps, planned(calls.gate_up), planned(calls.down))
        return step

    def _layer(self, module: ModuleType, layer: nn.Module) -> LayerCalls | None:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
        self.refs.append((vars(layer), "_modules", layer._modules))
        self.refs += [(layer._modules, name, child) for name, child in layer._modules.items()]  # type: ignore[misc]
        self.refs += [(vars(n), "use_kernel", vars(n).get("use_kernel")) for n in norms if n is not None]
        if type(layer) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not MLP \
                or any(type(n) is not RMSNorm or not n.use_kernel for n in norms):  # type: ignore[union-attr]
            self.why_not = "a layer is not labkit's own Llama-style layer (or a norm runs F.rms_norm)"
            return None
        if attn.q_norm is not None:  # type: ignore[union-attr]
            self.why_not = "q/k norms (Qwen3) are not planned"
            return None
        for holder in (attn, mlp):
            self.refs.append((vars(holder), "_modules", holder._modules))  # type: ignore[union-attr]
            self.refs += [(holder._modules, name, child) for name, child in holder._modules.items()]  # type: ignore
        self.refs += [(vars(attn), "qkv_proj", vars(attn)["qkv_proj"]), (vars(mlp), "gate_up", vars(mlp)["gate_up"])]
        calls = [self._linear(module, part) for part in (attn.qkv_proj, attn.o_proj, mlp.gate_up,  # type: ignore
                                                         mlp.down_proj)]  # type: ignore[union-attr]
        if any(c is None for c in calls):
            return None
        n_in, n_post = norms
        for norm in norms:
            self.refs.append((norm._parameters, "weight", norm.weight))  # type: ignore[union-attr]
        return LayerCalls(n_in.weight, n_in.eps, calls[0], calls[1], n_post.weight, n_post.eps,  # type: ignore
                          calls[2], calls[3])

    def _linear(self, module: ModuleType, part: object) -> LinearCall | None:
        """The call that runs ``part`` (a Linear, a merged layer or their quantized counterparts) on a decode row."""
        if isinstance(part, (MergedLinear, QuantizedMergedLinear)):
            if not part._is_merged():
                part._merge()
            linears = part.linears
        else:
            linears = (part,)
        for lin in linears:  # each part's tensors: a part moved (model.to, .data replaced) means a merge to redo
            owned = list(lin._parameters.items()) + list(lin._buffers.items())  # type: ignore[union-attr]
            self.refs += [(lin._parameters if name in lin._parameters else lin._buffers, name, t)  # type: ignore
                          for name, t in owned]
            self.tensors += [t for _, t in owned if t is not None]
        if type(part) is Linear or type(part) is MergedLinear:
            kernel = part.kernel  # type: ignore[union-attr]
            weight = part.weight
            self.refs.append((vars(kernel), "choice", kernel.choice))
            if kernel.choice != "auto" or not isinstance(weight, torch.Tensor) or not weight.is_contiguous() \
                    or weight.dtype != torch.float32:  # (autograd: applies() runs the plan only without it)
                self.why_not = "a linear layer runs another kernel than labkit's GEMV (set_linear_kernel)"
                return None
            return float_linear(module, weight, part.bias)  # type: ignore[arg-type]
        if type(part) is QuantizedLinear or type(part) is QuantizedMergedLinear:
            first = linears[0]
            self.refs.append((vars(first), "activations", first.activations))  # the kernel it picks
            return quantized_linear(module, first.method, part.qweight, part.scales,  # type: ignore[union-attr]
                                    first.group_size, part.bias, first.activations)  # type: ignore[union-attr]
        self.why_not = f"a linear layer of type {type(part).__name__} is not planned"
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: CppAttentionBackend) -> torch.Tensor:
        """input_ids, positions: (1, N) -> hidden states (1, N, hidden), as ``CausalLM.forward`` returns them."""
        assert self.layers is not None and backend.cpp_decode is not None
        d = self.model.config.head_dim
        decoder = self.model.model
        x = decoder.embed_tokens(input_ids)[0]  # (N, hidden)
        n = x.shape[0]
        cos, sin = decoder.rotary_emb.cos_sin(positions, x.dtype)  # (1, N, 1, d) each
        cos, sin = cos.reshape(n, d), sin.reshape(n, d)
        if self.step is not None and self.use_step:  # run_layers' loop, in C++
            batch, pool = backend.cpp_decode, backend.pool
            x = self.step.run(x, cos, sin, pool.k, pool.v, backend.meta.slot_mapping,  # type: ignore[attr-defined]
                              batch.block_tables, batch.context_lens, d ** -0.5, batch.num_splits)
        else:
            x = self.run_layers(x, cos, sin, backend)
        self.steps += 1
        return decoder.norm(x)[None]  # (1, N, hidden)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   backend: CppAttentionBackend) -> torch.Tensor:
        """The decoder layers from Python: x (N, hidden), cos / sin (N, d) -> (N, hidden), before the final norm.
        ``DecodeStep`` (``csrc/decode_step_cpu.cpp``) makes the same calls in the same order from C++."""
        assert self.layers is not None and backend.cpp_decode is not None
        module, attention = gemv.load_gemv(warn=False), load_extension(warn=False)
        assert module is not None and attention is not None
        config = self.model.config
        n_heads, n_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        n = x.shape[0]
        batch, slots, pool = backend.cpp_decode, backend.meta.slot_mapping, backend.pool
        scale, grain = d ** -0.5, 1
        for i, layer in enumerate(self.layers):
            h = module.rms_norm_f32(x, layer.input_norm, layer.input_eps)
            qkv = layer.qkv.run(h, None)  # (N, (n_heads + 2 * n_kv) * d)
            qk = module.rope_f32(qkv, cos, sin, n_heads + n_kv)  # (N, (n_heads + n_kv) * d), rotated
            k = qk[:, n_heads * d:].view(n, n_kv, d)
            v = qkv[:, (n_heads + n_kv) * d:].view(n, n_kv, d)
            attention.write_kv(pool.k[i], pool.v[i], k, v, slots)
            q = qk[:, : n_heads * d].view(n, n_heads, d).contiguous()  # (N, n_heads, d): a copy if N > 1
            out = attention.paged_decode(q, pool.k[i], pool.v[i], batch.block_tables, batch.context_lens, scale,
                                         grain, batch.num_splits)  # (N, n_heads, d)
            x = layer.o_proj.run(out.view(n, n_heads * d), x)  # x + o_proj(out): (N, hidden), contiguous
            h = module.rms_norm_f32(x, layer.post_norm, layer.post_eps)
            x = layer.down.run(module.silu_mul_f32(layer.gate_up.run(h, None)), x)
        return x
