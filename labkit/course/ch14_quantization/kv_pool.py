"""Checker for notebook 14's Task 2: the int8 KV pool's ``write`` and ``read_blocks``.

The learner subclasses ``labkit.core.kv.quantized_pool.QuantizedKVPool`` and replaces ``write`` (quantize the new
tokens' K/V into their slots, one float32 scale per token and KV head in ``k_scale`` / ``v_scale``) and
``read_blocks`` (the blocks back in the model's dtype). The checker writes tokens into one block, reads them back
(every value within half a step, the scales per token and head, other slots untouched), then runs the class inside
the engine (``LLM(..., kv_cache_dtype="int8", kv_pool_cls=cls)``): the greedy tokens of labkit's int8 pool, and
every block back.
"""

from __future__ import annotations

import torch

from labkit.core.kv.quantized_pool import QuantizedKVPool
from labkit.core.model.config import ModelConfig
from labkit.course import Check, CheckResult, run_checker
from labkit.course.hints import Hints

KV_HINTS = Hints(
    concept=("K and V vectors of different heads and positions differ in size by orders of magnitude. If one scale "
             "served a whole block, what would happen to the small vectors next to a large one?"),
    rule=("write: for each new token and KV head, scale = max |x| over head_dim / 127 (1 for a zero vector), "
          "q = round(x / scale) clamped to [-127, 127], stored as int8 in the token's slot, the scale beside it in "
          "k_scale / v_scale at the same slot. read_blocks: q as float times its scale, in the pool's dtype."),
    code=("write: for pool, scales, x in ((self.k[layer], self.k_scale[layer], k), ...): amax = x.abs().amax(-1); "
          "s = torch.where(amax > 0, amax / 127, 1); pool.flatten(0, 1)[slots] = (x / s[..., None]).round()"
          ".clamp(-127, 127).to(torch.int8); scales.flatten(0, 1)[slots] = s. read_blocks: "
          "(pool[blocks].float() * scales[blocks][..., None]).to(self.dtype)."),
    by_failure={
        "storage": "The pool stores int8 values (self.k[layer] is an int8 tensor): write into it, do not replace it.",
        "scale-axis": "One scale per token and KV head: k_scale[layer] has shape (num_blocks, block_size, n_kv_heads).",
        "error": "Each value read back must be within half a step (its scale / 2) of what was written: round, and "
                 "map the largest magnitude of the vector to 127.",
        "slots": "Write only the slots you are given (slot = block * block_size + offset) and leave the others.",
        "engine": "Inside the engine every layer writes and reads through your class.",
    },
)
SMALL = ModelConfig(model_type="llama", vocab_size=16, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def block_problems(cls: type[QuantizedKVPool]) -> list[tuple[str, str]]:
    pool = cls(SMALL, 3, 4, torch.device("cpu"), torch.float32, "int8")  # 3 blocks of 4 slots
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(4, 2, 16, generator=gen) * torch.tensor([[1e-3], [10.0]])  # heads of very different size
    v = torch.randn(4, 2, 16, generator=gen) * torch.tensor([[5.0], [1e-2]])
    k[2, 0] = 0.0  # a zero vector
    slots = torch.tensor([4, 5, 6, 7])  # all of block 1
    pool.write(0, slots, k, v)
    if pool.k[0].dtype != torch.int8 or pool.v[0].dtype != torch.int8:
        return [(f"the pool must hold int8 values, it holds {pool.k[0].dtype}", "storage")]
    if bool(pool.k[0][0].any() or pool.k[0][2].any() or pool.v[0][0].any() or pool.v[0][2].any()):
        return [("writing block 1 changed blocks 0 or 2", "slots")]
    got_k, got_v = cls.read_blocks(pool, 0, torch.tensor([1]))
    if got_k.shape != (1, 4, 2, 16) or got_k.dtype != torch.float32:
        return [(f"read_blocks must give (num_blocks, block_size, n_kv_heads, head_dim) float32, got "
                 f"{got_k.dtype} {tuple(got_k.shape)}", "storage")]
    problems: list[tuple[str, str]] = []
    for name, got, x, scale in (("K", got_k[0], k, pool.k_scale[0][1]), ("V", got_v[0], v, pool.v_scale[0][1])):
        if scale.shape != (4, 2) or not bool(torch.isfinite(scale).all() and (scale > 0).all()):
            problems.append((f"{name} scales of block 1 must be positive, one per token and head (shape (4, 2)), "
                             f"got {tuple(scale.shape)}", "scale-axis"))
            continue
        amax = x.abs().amax(-1)  # (4, 2)
        want_scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # (4, 2)
        bad = (got - x).abs() > want_scale[..., None] * 0.5001 + 1e-12
        if bool(bad.any()):
            t, h, d = (int(i) for i in bad.nonzero()[0])
            problems.append((f"{name} of token {t}, head {h}: {float(x[t, h, d]):.4g} reads back as "
                             f"{float(got[t, h, d]):.4g}, more than half a step from it (a scale shared beyond one "
                             "token and head, or no rounding)",
                             "scale-axis" if not torch.allclose(scale, want_scale, rtol=1e-3) else "error"))
    return problems


def engine_problems(cls: type[QuantizedKVPool], model: str = "labkit-tiny") -> list[tuple[str, str]]:
    from labkit import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "The little dog"]
    with LLM(model, kv_cache_dtype="int8", block_size=4) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    with LLM(model, kv_cache_dtype="int8", kv_pool_cls=cls, block_size=4) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        bm = llm.engine.block_manager  # type: ignore[attr-defined]
        problems = []
        if got != want:
            problems.append((f"inside the engine your pool gave {got}, labkit's int8 pool {want}", "engine"))
        if bm.num_free_blocks != bm.num_blocks:
            problems.append((f"{bm.num_blocks - bm.num_free_blocks} KV blocks still in use", "engine"))
    return problems


def check_int8_kv_pool(cls: type[QuantizedKVPool], model: str = "labkit-tiny") -> CheckResult:
    """Task 2: ``cls`` (a ``QuantizedKVPool`` subclass) writes and reads int8 K/V, one scale per token and head."""

    def body(check: Check) -> None:
        if not (isinstance(cls, type) and issubclass(cls, QuantizedKVPool)):
            check.expect(False, f"expected a subclass of labkit.core.kv.quantized_pool.QuantizedKVPool, got {cls!r}")
            return
        for failure, because in block_problems(cls):
            check.expect(False, failure, because=because)
        if not check.result.failures:
            for failure, because in engine_problems(cls, model):
                check.expect(False, failure, because=because)

    return run_checker("", "", body, task_id="14.int8_kv")
