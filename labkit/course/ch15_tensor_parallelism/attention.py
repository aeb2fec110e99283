"""Notebook 15's Build task (b): shard one layer's attention heads (and so its KV pool share) for a rank.

The learner writes ``shard_attention(weights, config, world_size, rank)``, the same interface as labkit's
``labkit.core.parallel.weights.shard_attention_weights``: from one layer's q/k/v (and their biases) and o_proj
weights, the slices rank ``rank`` keeps. The rank's KV pool stores exactly the K/V heads its k/v slices compute.
The checker first runs every rank as a thread (``run_ranks``) on small models in float64, which must give the
unsharded model's logits: heads split, K/V heads fewer than the ranks (replicated), q/k/v biases. Then it runs
the function inside the engine: ``LLM(engine=<a TensorParallelEngineCore with your shard_attention>,
tensor_parallel_size=2)``, two processes, whose greedy tokens must equal one process's. Notebook 15.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from labkit.core.llm import LLM
from labkit.core.model import ModelConfig, random_model
from labkit.core.parallel import TensorParallelEngineCore
from labkit.core.parallel.local_group import run_ranks
from labkit.core.parallel.weights import build_rank_model, shard_state_dict
from labkit.core.sampling_params import SamplingParams
from labkit.course import Check, CheckResult, run_checker
from labkit.course.hints import Hints

Sharder = Callable[[dict[str, torch.Tensor], ModelConfig, int, int], dict[str, torch.Tensor]]

ATTENTION_HINTS = Hints(
    concept=("Attention heads are independent until o_proj mixes them. Which rows of q_proj belong to query head "
             "h? Which K/V head does query head h read when several query heads share one? And which part of "
             "o_proj's input do this rank's heads produce?"),
    rule=("Rank r keeps query heads [r*H/N, (r+1)*H/N): rows h*head_dim ... (h+1)*head_dim of q_proj (and its "
          "bias) for each. K/V: with KV >= N heads, heads [r*KV/N, (r+1)*KV/N); with KV < N, the one head "
          "r*KV//N (replicated). o_proj keeps the columns of this rank's query heads."),
    code=("d = config.head_dim; q = torch.arange(r*H//N*d, (r+1)*H//N*d); kv = heads [a, b) as above -> "
          "torch.arange(a*d, b*d); out[name] = w[q] for q_proj.*, w[kv] for k_proj.* / v_proj.*, "
          "w[:, q] for o_proj.weight."),
    by_failure={
        "shapes": "Every tensor you return must have the shape of this rank's share: H/N heads of q, its K/V heads "
                  "(KV/N, or one replicated head when KV < N) of k and v, and o_proj's columns of its q heads.",
        "values": "The shapes are right but the numbers are not: are a head's head_dim rows taken together, and "
                  "does each query head sit with the K/V head its group reads?",
        "replicated": "With fewer K/V heads than ranks, each rank still needs the K/V head its query heads read: "
                      "several ranks hold (and compute) the same one.",
        "engine": "Inside the engine each rank's pool holds the K/V heads your slices compute: the tokens must "
                  "equal one process's.",
    },
)

# (model type, query heads, K/V heads, world size, what it exercises)
CASES = (("llama", 8, 4, 2, "K/V heads split"), ("qwen2", 4, 1, 2, "one K/V head replicated, q/k/v biases"),
         ("llama", 8, 2, 4, "4 ranks, each K/V head on 2 of them"))


def small_config(kind: str, heads: int, kv: int) -> ModelConfig:
    return ModelConfig(model_type=kind, vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=8, max_position_embeddings=64,
                       attention_bias=kind == "qwen2")


def run_in_process(check: Check, fn: Sharder) -> bool:
    """Each case's ranks, as threads, against the unsharded model in float64; True if all agree."""
    ids, positions = torch.arange(3, 12)[None], torch.arange(9)[None]  # (1, 9) each
    for kind, heads, kv, n, what in CASES:
        cfg = small_config(kind, heads, kv)
        model = random_model(cfg, torch.device("cpu"), torch.float64, seed=5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(6))
        whole = {k: v.detach() for k, v in model.state_dict().items()}
        with torch.inference_mode():
            want = model.compute_logits(model(ids, positions))
        case = f"{what} ({heads} query heads, {kv} K/V heads, {n} ranks)"

        def rank(group, cfg=cfg, whole=whole):  # type: ignore[no-untyped-def]
            state = shard_state_dict(whole, cfg, group.world_size, group.rank, fn)
            mine = build_rank_model(copy.copy(cfg), state, group, torch.device("cpu"), torch.float64)
            return mine.compute_logits(mine(ids, positions))

        try:
            outs = run_ranks(n, rank, timeout_s=30)
        except NotImplementedError:
            raise  # the stub: "not started"
        except (ValueError, RuntimeError, IndexError) as exc:
            check.expect(False, f"{case}: {type(exc).__name__}: {exc}", because="replicated" if kv < n else "shapes")
            return False
        for r, out in enumerate(outs):
            if not torch.allclose(out, want, rtol=0, atol=1e-9):
                check.expect(False, f"{case}: rank {r}'s logits differ from the unsharded model's by up to "
                                    f"{(out - want).abs().max():.3g}", because="replicated" if kv < n else "values")
                return False
    return True


def run_in_engine(check: Check, fn: Sharder, model: str) -> None:
    """The function inside the engine at N=2 (two processes): greedy tokens equal one process's, in float64."""
    engine = type("YourTensorParallelEngine", (TensorParallelEngineCore,), {"shard_attention": staticmethod(fn)})
    prompts = [[1, 200, 201, 202], [1, 300, 301], list(range(5, 30))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(model, engine="continuous", dtype="float64", device="cpu") as one:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM(model, engine=engine, dtype="float64", device="cpu", tensor_parallel_size=2) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
    for i, (g, w) in enumerate(zip(got, want)):
        check.expect(g == w, f"inside the engine at tensor_parallel_size=2, request {i} gave {g}; one process "
                             f"gives {w}", because="engine")


def check_shard_attention(fn: Sharder, model: str = "labkit-tiny", in_engine: bool = True) -> CheckResult:
    """Task (b): ``fn`` cuts each rank's attention weights so that the sharded model equals the whole one, first
    in threads (small models), then (``in_engine``) inside the two-process engine on ``model``."""

    def body(check: Check) -> None:
        if run_in_process(check, fn) and in_engine:
            run_in_engine(check, fn, model)

    return run_checker("", "", body, task_id="15.shard_attention")
