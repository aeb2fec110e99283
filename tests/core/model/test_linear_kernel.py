"""labkit.core.model.linear: the per-shape choice (labkit's C++ GEMV kernel for decode-shaped float32 CPU calls,
oneDNN over a repacked weight, or F.linear over (in, out) memory without the kernel) is exact enough, does not depend
on the thread count, follows weight changes, and leaves parameters, names, values and autograd as nn.Linear's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from labkit.core.model import linear as linear_module
from labkit.core.model.config import ModelConfig
from labkit.core.model.decoder import CausalLM
from labkit.core.model.linear import (
    ONEDNN_MIN_ROWS,
    ONEDNN_MIN_WEIGHT,
    STALL_WINDOW_CALLS,
    STALLS_TO_TRIP,
    GemvKernel,
    Linear,
    LinearKernel,
    StallWatch,
    gemv_kernel,
    linear_kernels,
    onednn_linear_available,
    set_linear_kernel,
)
from labkit.core.quant import gemv as quant_gemv

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")
needs_gemv = pytest.mark.skipif(quant_gemv.load_gemv(warn=False) is None, reason="labkit's C++ GEMV kernels not built")
BIG = (1024, 512)  # out, in


def onednn_layer(*args: int, bias: bool = True, watch: StallWatch | None = None) -> Linear:
    """A Linear on the "onednn" choice (what "auto" does without labkit's GEMV kernel)."""
    layer = Linear(*args, bias=bias)
    layer.kernel = LinearKernel(watch or StallWatch())
    layer.kernel.choice = "onednn"
    return layer


def test_float32_on_the_cpu_only_and_few_rows_for_large_weights_only() -> None:
    layer, small = Linear(BIG[1], BIG[0]), Linear(64, 32)
    layer.kernel = LinearKernel(StallWatch())  # its own watch: another test may have just tripped the process's
    assert BIG[0] * BIG[1] >= ONEDNN_MIN_WEIGHT > 64 * 32
    with torch.inference_mode():
        assert layer.kernel.uses_onednn(torch.randn(1, BIG[1]), layer.weight) == onednn_linear_available()
        assert not small.kernel.uses_onednn(torch.randn(ONEDNN_MIN_ROWS - 1, 64), small.weight)  # in the caches
        assert small.kernel.uses_onednn(torch.randn(ONEDNN_MIN_ROWS, 64), small.weight) == onednn_linear_available()
        assert not layer.kernel.uses_onednn(torch.randn(64, BIG[1], dtype=torch.float64), layer.weight.double())
        assert not layer.kernel.wants_gemv_layout(layer.weight.bfloat16())
        built = gemv_kernel() is not None
        for rows in (1, quant_gemv.MAX_KERNEL_ROWS):  # decode-shaped: labkit's GEMV kernel when it is built
            assert layer.kernel.uses_gemv(torch.randn(rows, BIG[1]), layer.weight) == built
        assert not layer.kernel.uses_gemv(torch.randn(quant_gemv.MAX_KERNEL_ROWS + 1, BIG[1]), layer.weight)
        assert not layer.kernel.uses_gemv(torch.randn(1, BIG[1]).double(), layer.weight.double())
    assert not layer.kernel.uses_gemv(torch.randn(1, BIG[1], requires_grad=True), layer.weight)  # no backward


def test_stall_watch_trips_on_repeated_stalls_only_and_holds_for_a_while() -> None:
    watch = StallWatch(hold_s=60.0)
    assert not watch.observe(0.5e-3, 1e-5)  # 50x its fastest, but under a millisecond: not a stall
    assert not watch.observe(3e-3, 1e-3)  # 3x its fastest: a slow spell, not a stall
    assert watch.stalls == 0
    for _ in range(STALLS_TO_TRIP):  # 40x, 8 ms: a thread waited for its core, but now and then: housekeeping
        assert watch.observe(8e-3, 2e-4)
        for _ in range(STALL_WINDOW_CALLS):
            watch.observe(2e-4, 2e-4)
    assert not watch.recent() and watch.stalls == STALLS_TO_TRIP and watch.trips == 0
    for _ in range(STALLS_TO_TRIP):  # one after the other: another process holds a core
        watch.observe(8e-3, 2e-4)
        watch.observe(2e-4, 2e-4)
    assert watch.recent() and watch.trips == 1 and watch.stalls == 2 * STALLS_TO_TRIP
    assert not StallWatch(hold_s=0.0).recent()


@needs_onednn
def test_decode_shaped_calls_leave_onednn_after_a_stall_and_large_ones_stay() -> None:
    torch.manual_seed(4)
    watch = StallWatch(hold_s=60.0)
    layer = onednn_layer(BIG[1], BIG[0], bias=False, watch=watch)
    one, many = torch.randn(1, BIG[1]), torch.randn(ONEDNN_MIN_ROWS, BIG[1])
    with torch.inference_mode():
        layer(one)
        assert layer.kernel.packed is not None and layer.kernel.fastest < float("inf")  # ran on oneDNN, timed
        for _ in range(STALLS_TO_TRIP):
            watch.observe(1.0, layer.kernel.fastest)  # as if another process were holding a core
        assert not layer.kernel.uses_onednn(one, layer.weight)  # decode-shaped: F.linear for now
        torch.testing.assert_close(layer(one), F.linear(one, layer.weight), rtol=0, atol=0)
        assert layer.kernel.uses_onednn(many, layer.weight)  # many rows: the stall is amortised


def test_onednn_choice_keeps_weights_in_in_out_memory_with_shape_values_and_names_unchanged() -> None:
    torch.manual_seed(3)
    layer = onednn_layer(BIG[1], BIG[0])
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(2, 3, BIG[1])
    with torch.inference_mode():
        got = layer(x)
    assert layer.weight.shape == (BIG[0], BIG[1]) and layer.weight.stride() == (1, BIG[0])  # (in, out) memory
    assert isinstance(layer.weight, nn.Parameter) and list(layer.state_dict()) == list(before)
    for name, value in layer.state_dict().items():
        assert torch.equal(value, before[name])
    torch.testing.assert_close(got, F.linear(x, before["weight"], before["bias"]), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [ONEDNN_MIN_ROWS, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    layer = onednn_layer(BIG[1], BIG[0], bias=bias)
    x = torch.randn(2, rows, BIG[1])  # (B, T, in): the model's shape
    with torch.inference_mode():
        got = layer(x)
    assert layer.kernel.packed is not None  # it did run on oneDNN
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_repacks_when_the_weight_changes_in_place_or_is_replaced() -> None:
    torch.manual_seed(1)
    layer = onednn_layer(BIG[1], BIG[0], bias=False)
    x = torch.randn(ONEDNN_MIN_ROWS, BIG[1])
    with torch.inference_mode():
        layer(x)
    assert layer.kernel.packed is not None
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
    qkv = model.model.layers[0].self_attn.qkv_proj
    with torch.inference_mode():
        auto = model.compute_logits(model(ids, pos))
        assert any(k.packed is not None for k in kernels)
        if gemv_kernel() is not None:  # labkit's GEMV kernel reads (out, in) memory
            assert qkv.weight.is_contiguous() and model.lm_head.weight.is_contiguous()
        set_linear_kernel(model, "onednn")
        onednn = model.compute_logits(model(ids, pos))
        assert qkv.weight.stride(0) == 1 and model.lm_head.weight.stride(0) == 1  # (in, out) memory, merged too
        assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == qkv.weight.data_ptr()  # still merged
        set_linear_kernel(model, "torch")
        assert all(k.packed is None and k.choice == "torch" for k in kernels)
        plain = model.compute_logits(model(ids, pos))
        assert all(k.packed is None for k in kernels)  # "torch": nothing repacked
        assert qkv.weight.is_contiguous() and model.lm_head.weight.is_contiguous()  # back to (out, in) memory
        assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == qkv.weight.data_ptr()  # still merged
        set_linear_kernel(model, "auto")
        again = model.compute_logits(model(ids, pos))
    torch.testing.assert_close(auto, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(onednn, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(auto, again, rtol=0, atol=0)
    with pytest.raises(ValueError, match="'mkl' is not one of auto, onednn, torch"):
        set_linear_kernel(model, "mkl")


@needs_gemv
@pytest.mark.parametrize("bias", [False, True])
def test_decode_shaped_calls_run_on_labkits_gemv_kernel_over_out_in_memory(bias: bool) -> None:
    torch.manual_seed(5)
    layer = Linear(BIG[1], BIG[0], bias=bias)
    layer.kernel = LinearKernel(StallWatch())
    x = torch.randn(2, 3, BIG[1])  # (B, T, in): 6 rows, decode-shaped
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (2, 3, BIG[0]) and layer.weight.is_contiguous()  # nn.Linear's own (out, in) memory
    assert layer.kernel.packed is None and layer.kernel.fastest < float("inf")  # not oneDNN; timed for stalls
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


@needs_gemv
def test_gemv_outputs_do_not_depend_on_the_thread_count_or_the_batch() -> None:
    torch.manual_seed(6)
    layer = Linear(BIG[1], 4 * BIG[0], bias=False)  # 8 MiB: several thread tasks
    x = torch.randn(quant_gemv.MAX_KERNEL_ROWS, BIG[1])
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one_thread = layer(x)
            torch.set_num_threads(max(2, threads))
            many_threads = layer(x)
            row_by_row = torch.cat([layer(x[i: i + 1]) for i in range(x.shape[0])])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(many_threads, one_thread, rtol=0, atol=0)
    torch.testing.assert_close(row_by_row, one_thread, rtol=0, atol=0)


@needs_gemv
def test_gemv_runs_on_one_thread_after_a_stall_untimed() -> None:
    torch.manual_seed(7)
    watch = StallWatch(hold_s=60.0)
    layer = Linear(BIG[1], BIG[0], bias=False)
    layer.kernel = LinearKernel(watch)
    one = torch.randn(1, BIG[1])
    calls: list[bool] = []
    real = linear_module.GEMV_KERNEL[0]
    spy = GemvKernel(run=lambda x, w, threads: calls.append(threads) or real.run(x, w, threads),
                     max_rows=real.max_rows, available=real.available)
    linear_module.GEMV_KERNEL[:] = [spy]
    try:
        with torch.inference_mode():
            expected = layer(one)
            for _ in range(STALLS_TO_TRIP):
                watch.observe(1.0, layer.kernel.fastest)  # as if another process were holding a core
            observed = watch.calls
            got = layer(one)
    finally:
        linear_module.GEMV_KERNEL[:] = [real]
    assert calls == [True, False] and watch.calls == observed  # one thread, and that call not counted
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # the same sums, in the same order


def test_without_the_gemv_kernel_auto_falls_back_to_in_out_memory_and_f_linear() -> None:
    torch.manual_seed(8)
    saved = list(linear_module.GEMV_KERNEL)
    linear_module.GEMV_KERNEL[:] = [GemvKernel(run=lambda x, w, threads: pytest.fail("the kernel ran"), max_rows=16,
                                               available=lambda: False)]  # as without a compiler
    try:
        layer = Linear(64, 32)
        x = torch.randn(1, 64)
        with torch.inference_mode():
            got = layer(x)
        assert not layer.kernel.uses_gemv(x, layer.weight) and layer.weight.stride(0) == 1  # (in, out) memory
    finally:
        linear_module.GEMV_KERNEL[:] = saved
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
