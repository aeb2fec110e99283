"""``LLM(..., decode_plan=True)``: CPU decode steps as prebuilt C++ calls (labkit.core.engine.decode_plan). The same
greedy tokens as transformers and as the layer-by-layer path, float32 and quantized; the plan runs exactly the steps
it was built for and is rebuilt, or declined, when something it read changes, so a changed weight, a kernel choice
or a learner's module is never bypassed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.core.attention import cpp_decode
from labkit.core.engine import decode_plan
from labkit.core.engine.decode_plan import DecodePlan, load_step
from labkit.core.model.layers import MLP
from labkit.core.model.linear import STALL_WATCH, set_linear_kernel
from labkit.core.quant import QuantizationConfig
from labkit.course.oracle import transformers_greedy

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Tom and Lily", "She was happy because"]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpp_decode.load_extension() is not None, "the C++ kernels should build here (g++, ninja)"


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stall watch's verdict is injected: left to the clock, a loaded machine (CI, another test run) trips it and
    every step runs layer by layer, as it should there (test_a_tripped_stall_watch_runs_layer_by_layer)."""
    monkeypatch.setattr(STALL_WATCH, "recent", lambda: False)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(bundled_path: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(bundled_path, prompt_ids, PARAMS.max_tokens)


def plan_of(llm: LLM) -> DecodePlan:
    plan = llm.engine.runner.decode_plan  # type: ignore[attr-defined]
    assert plan is not None
    return plan


def tokens(llm: LLM, prompt_ids: list[list[int]], params: SamplingParams = PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]


@pytest.mark.parametrize("engine,options", [
    ("continuous", dict(max_num_seqs=3)),  # a finished sequence's slot refilled beside running decodes
    ("chunked", dict(max_num_batched_tokens=16, enable_prefix_caching=True)),
])
def test_tokens_equal_transformers(engine: str, options: dict, bundled_path: Path, prompt_ids: list[list[int]],
                                   reference: list[list[int]]) -> None:
    with LLM(str(bundled_path), engine=engine, device="cpu", decode_plan=True, block_size=8, **options) as llm:
        assert tokens(llm, prompt_ids) == reference
        plan = plan_of(llm)
        assert plan.steps > 0 and plan.builds == 1 and plan.why_not is None  # it ran, built once
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # no KV block leaked


@pytest.mark.parametrize("quantization", ["int8", "int4", QuantizationConfig("int4", activations="int8"),
                                          QuantizationConfig("int8", activations="int16"),
                                          QuantizationConfig("int4", activations="int16")],
                         ids=["int8", "int4", "int4-a8", "int8-a16", "int4-a16"])
def test_quantized_tokens_equal_the_layer_by_layer_path(quantization: object, bundled_path: Path,
                                                        prompt_ids: list[list[int]]) -> None:
    runs = []
    for plan in (False, True):
        with LLM(str(bundled_path), engine="continuous", device="cpu", quantization=quantization,
                 decode_plan=plan) as llm:
            runs.append(tokens(llm, prompt_ids))
            if plan:
                assert plan_of(llm).steps > 0
                layers = plan_of(llm).layers or []
                kernels = {call.kernel for layer in layers for call in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                        layer.down)}
                config = quantization if isinstance(quantization, QuantizationConfig) else \
                    QuantizationConfig(quantization)  # type: ignore[arg-type]
                suffix = {"float": "", "int16": "_a16", "int8": "_a8"}[config.activations]
                want = f"gemv_{config.method}{suffix}"  # the kernel the layers run layer by layer (QuantizedLinear's)
                assert kernels == {want}
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kind,quantization", [
    ("bundled", None), ("bundled", "int8"), ("bundled", "int4"),
    ("bundled", QuantizationConfig("int4", activations="int8")),
    ("bundled", QuantizationConfig("int8", activations="int16")),
    ("bundled", QuantizationConfig("int4", 64, activations="int16")),
    ("qwen2", None),  # biases on q/k/v: (y + bias), then the residual
    ("llama3-rope", "int8"),  # one KV head (GQA 4:1), untied lm_head
], ids=["float32", "int8", "int4", "int4-a8", "int8-a16", "int4-g64-a16", "qwen2-bias", "llama3-gqa"])
def test_the_cpp_step_computes_the_python_loops_bits(kind: str, quantization: object, bundled_path: Path,
                                                      random_checkpoint, prompt_ids: list[list[int]],  # type: ignore
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``DecodeStep`` (the layer loop in C++) against ``run_layers`` (the same loop in Python) on every decode step of
    a batch of 1 to 4 sequences: the same hidden states, bit for bit. Both write the step's K/V to the same slots
    (the second write stores what the first did, or the outputs differ)."""
    compared: list[int] = []
    original = DecodePlan.run

    def both(self: DecodePlan, input_ids: torch.Tensor, positions: torch.Tensor, backend: object) -> torch.Tensor:
        assert self.step is not None, load_step().missing
        self.use_step = False
        from_python = original(self, input_ids, positions, backend)  # type: ignore[arg-type]
        self.use_step = True
        from_cpp = original(self, input_ids, positions, backend)  # type: ignore[arg-type]
        assert torch.equal(from_python, from_cpp), (from_python - from_cpp).abs().max()
        compared.append(input_ids.shape[1])
        return from_cpp

    monkeypatch.setattr(DecodePlan, "run", both)
    path = bundled_path if kind == "bundled" else random_checkpoint(kind)
    with LLM(str(path), engine="continuous", device="cpu", quantization=quantization, decode_plan=True,
             block_size=8) as llm:
        plan = plan_of(llm)
        with torch.no_grad():  # HF initialises biases to zero, where a dropped bias would change no bit
            for name, param in plan.model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.5)
        tokens(llm, prompt_ids)
        assert plan.step.num_layers == plan.model.config.num_hidden_layers  # type: ignore[attr-defined]
        biases = [layer.qkv.bias for layer in plan.layers or [] if layer.qkv.bias is not None]
        assert (kind == "qwen2") == bool(biases) and all(b.abs().sum() > 0 for b in biases)
    assert compared and max(compared) == len(PROMPTS) and min(compared) >= 1


def test_without_the_cpp_step_the_plan_loops_in_python(bundled_path: Path, prompt_ids: list[list[int]],
                                                       reference: list[list[int]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the step's module cannot be built, the plan still runs (its Python loop), with the same tokens."""
    monkeypatch.setattr(decode_plan, "load_step", lambda: cpp_decode.CppExtension(None, "no compiler (test)"))
    with LLM(str(bundled_path), engine="continuous", device="cpu", decode_plan=True) as llm:
        assert tokens(llm, prompt_ids) == reference
        plan = plan_of(llm)
        assert plan.steps > 0 and plan.step is None


def test_only_the_steps_it_was_built_for(bundled_path: Path, prompt_ids: list[list[int]],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill steps, the PyTorch attention backend, an 8-bit KV pool and float64 run layer by layer, and so does a
    decode step of more rows than the GEMV kernel takes (16)."""
    rows: list[int] = []
    original = DecodePlan.run

    def recording(self: DecodePlan, input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(input_ids.shape[1])
        return original(self, input_ids, *args)  # type: ignore[arg-type]
    monkeypatch.setattr(DecodePlan, "run", recording)
    with LLM(str(bundled_path), engine="continuous", device="cpu", decode_plan=True) as llm:
        tokens(llm, prompt_ids[:1], SamplingParams(max_tokens=1, temperature=0))  # a prefill only
    assert rows == []
    for options in (dict(attention_backend="torch"), dict(kv_cache_dtype="int8"), dict(dtype="float64")):
        with LLM(str(bundled_path), engine="continuous", device="cpu", decode_plan=True, **options) as llm:
            assert len(tokens(llm, prompt_ids)) == len(prompt_ids)
    assert rows == []
    with LLM(str(bundled_path), engine="continuous", device="cpu", decode_plan=True, max_num_seqs=20) as llm:
        staggered = [SamplingParams(max_tokens=4 + i % 8, temperature=0, ignore_eos=True) for i in range(20)]
        tokens(llm, prompt_ids * 5, staggered)  # 20 decodes at first, fewer as they finish
        decode_rows = [s.num_seqs for s in llm.engine.step_stats if not s.is_prefill]
    assert max(decode_rows) > 16 and rows and max(rows) <= 16  # only the steps of at most 16 decodes were planned


def test_a_changed_weight_is_read_by_a_rebuilt_plan(bundled_path: Path, prompt_ids: list[list[int]]) -> None:
    with LLM(str(bundled_path), engine="continuous", device="cpu", decode_plan=True) as planned, \
            LLM(str(bundled_path), engine="continuous", device="cpu") as eager:
        assert tokens(planned, prompt_ids) == tokens(eager, prompt_ids)
        for llm in (planned, eager):  # the same edits to both: new tensors (.data), a part of a merged layer
            layer = llm.model.model.layers[1]
            with torch.no_grad():
                layer.mlp.down_proj.weight.data = layer.mlp.down_proj.weight.data * 3  # type: ignore[operator]
                layer.self_attn.k_proj.weight.data = layer.self_attn.k_proj.weight.data.flip(0)  # type: ignore
                llm.model.model.layers[0].input_layernorm.weight.data = torch.full_like(
                    llm.model.model.layers[0].input_layernorm.weight, 0.5)
        changed = tokens(eager, prompt_ids)
        assert tokens(planned, prompt_ids) == changed
        assert plan_of(planned).builds == 2  # rebuilt once, for the edit


def test_what_the_plan_read_is_checked_once_after_requests_arrive(bundled_path: Path,
                                                                  prompt_ids: list[list[int]],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with LLM(str(bundled_path), engine="continuous", device="cpu", decode_plan=True) as llm:
        plan = plan_of(llm)
        tokens(llm, prompt_ids)
        checks: list[int] = []
        monkeypatch.setattr(DecodePlan, "build", lambda self: checks.append(self.steps))  # the plan kept as it is
        plan.addresses = []  # what a tensor given new memory (.data) looks like to the check: every check rebuilds
        steps = plan.steps
        tokens(llm, prompt_ids[:1])  # one request arrives: 7 decode steps
        assert plan.steps - steps == PARAMS.max_tokens - 1
        assert checks == [steps]  # checked before the first of them, not before each


def test_a_kernel_choice_or_a_learners_module_is_never_bypassed(bundled_path: Path,
                                                                 prompt_ids: list[list[int]]) -> None:
    with LLM(str(bundled_path), engine="continuous", device="cpu", decode_plan=True) as llm:
        want = tokens(llm, prompt_ids)
        plan = plan_of(llm)
        set_linear_kernel(llm.model, "torch")  # F.linear: the plan would run labkit's GEMV instead
        steps = plan.steps
        assert tokens(llm, prompt_ids) == want and plan.steps == steps  # every decode ran layer by layer
        assert plan.why_not is not None and "another kernel" in plan.why_not
        set_linear_kernel(llm.model, "auto")
        tokens(llm, prompt_ids)
        assert plan.steps > steps and plan.why_not is None  # planned again

        calls: list[int] = []

        class LearnersMLP(MLP):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                calls.append(x.shape[1])
                return super().forward(x)

        layer = llm.model.model.layers[0]
        mine = LearnersMLP(llm.model.config)
        mine.load_state_dict(layer.mlp.state_dict())
        layer.mlp = mine
        steps = plan.steps
        assert tokens(llm, prompt_ids) == want
        assert plan.steps == steps and "not labkit's own" in (plan.why_not or "")
        assert len(prompt_ids) in calls  # the decode steps (4 rows) ran the learner's module


def test_a_patched_forward_is_never_bypassed(bundled_path: Path, prompt_ids: list[list[int]],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with LLM(str(bundled_path), engine="continuous", device="cpu", decode_plan=True) as llm:
        want = tokens(llm, prompt_ids)
        seen: list[int] = []
        original = MLP.forward

        def patched(self: MLP, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.shape[1])
            return original(self, x)
        monkeypatch.setattr(MLP, "forward", patched)
        steps = plan_of(llm).steps
        assert tokens(llm, prompt_ids) == want
        assert plan_of(llm).steps == steps and len(prompt_ids) in seen  # the decode steps (4 rows) ran it
        assert "MLP.forward was replaced" in (plan_of(llm).why_not or "")
        monkeypatch.setattr(MLP, "forward", original)  # the class as shipped again
        tokens(llm, prompt_ids)
        assert plan_of(llm).steps > steps  # the class as shipped: planned again


def test_a_tripped_stall_watch_runs_layer_by_layer(bundled_path: Path, prompt_ids: list[list[int]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """While another process holds a core, the layer-by-layer path puts decode calls on one thread; the plan, which
    runs thread teams, steps aside."""
    with LLM(str(bundled_path), engine="continuous", device="cpu", decode_plan=True) as llm:
        want = tokens(llm, prompt_ids)
        steps = plan_of(llm).steps
        monkeypatch.setattr(STALL_WATCH, "recent", lambda: True)
        assert tokens(llm, prompt_ids) == want and plan_of(llm).steps == steps


@pytest.mark.parametrize("options,message", [
    (dict(decode_plan="yes"), "decode_plan must be True or False, got 'yes'"),
    (dict(decode_plan=True, tensor_parallel_size=2), "cannot be combined with tensor_parallel_size=2"),
])
def test_bad_options_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(engine="continuous", device="cpu", **options)
