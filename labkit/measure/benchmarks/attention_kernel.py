"""``scripts/gpu_check.py``'s decode-attention check: every paged decode path (PyTorch split, PyTorch padded, the
Triton kernel) on the same batches, by batch size and context length, as bytes per second against the measured roof,
with the CUDA kernels each launches per call and its largest difference from the PyTorch split path.

Goal (issue "Notebook 11"): the Triton kernel at >= 70% of the measured bandwidth for batch 64 x 4096 tokens of
context. On the CPU (``--dry-run``) the kernel runs under Triton's interpreter at tiny sizes: the code path is
exercised, its times mean nothing.
"""

from __future__ import annotations

import statistics

import torch

from labkit.measure.attention_bytes import DecodeAttentionShape, decode_paths, kernels_per_call, paged_batch
from labkit.measure.timing import time_fn

GOAL = {"path": "triton", "batch": 64, "context_len": 4096, "fraction": 0.70}


def attention_kernel_rows(device: str, dtype: str, roof_bandwidth: float, dry_run: bool) -> dict:
    """Time every path on every (batch, context) of the plan; the attention shape is llama3.2-1b's (32 query
    heads, 8 KV heads, head_dim 64) on a GPU, a small one in the dry run."""
    dev, dt = torch.device(device), getattr(torch, dtype)
    if dry_run:
        heads, batches, contexts, repeats = (4, 2, 32), (1, 2), (16, 40), 1
    else:
        heads, batches, contexts, repeats = (32, 8, 64), (1, 16, 64), (1024, 4096, 16384), 20
    rows, paths = [], decode_paths()
    for batch in batches:
        for context in contexts:
            shape = DecodeAttentionShape(batch, context, *heads, block_size=16, dtype=dt)
            data = paged_batch(shape, dev, seed=batch + context)
            reference = None
            for name, make in paths.items():
                fn = make(data)
                out = fn()
                reference = out if reference is None else reference
                seconds = statistics.median(time_fn(fn, dev, repeats=repeats, warmup=1))
                rows.append({"batch": batch, "context_len": context, "path": name, "ms": seconds * 1e3,
                             "kv_bytes": shape.kv_bytes, "gb_per_s": shape.kv_bytes / seconds / 1e9,
                             "fraction_of_roof": shape.kv_bytes / seconds / roof_bandwidth,
                             "kernels_per_call": kernels_per_call(fn) if dev.type == "cuda" else None,
                             "max_abs_diff": float((out.float() - reference.float()).abs().max())})
                del fn, out
            del data
    tolerance = 2e-2 if dt in (torch.bfloat16, torch.float16) else 1e-4
    wrong = [r for r in rows if r["max_abs_diff"] > tolerance]
    goal_rows = [r for r in rows if all(r[k] == GOAL[k] for k in ("path", "batch", "context_len"))]
    return {"status": "failed" if wrong else "passed", "heads": list(heads), "dtype": dtype, "rows": rows,
            "tolerance": tolerance, "interpreter": dev.type != "cuda" and "triton" in paths,
            "goal": {**GOAL, "measured": goal_rows[0]["fraction_of_roof"] if goal_rows else None},
            "paths": list(paths)}


def attention_kernel_markdown(detail: dict) -> list[str]:
    n_heads, n_kv, d = detail["heads"]
    lines = ["", f"## Decode attention: {', '.join(detail['paths'])}", "",
             f"One layer, {n_heads} query heads, {n_kv} KV heads, head_dim {d}, {detail['dtype']}, blocks of 16 in "
             "random order; bytes = the K and V read; fraction of the measured roof; largest difference from "
             f"`torch split` (tolerance {detail['tolerance']}).", ""]
    if detail["interpreter"]:
        lines += ["The Triton kernel ran under Triton's CPU interpreter: its times mean nothing.", ""]
    lines += ["| batch | context | path | ms | GB/s | of roof | kernels per call | max diff |",
              "|---:|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['context_len']} | {r['path']} | {r['ms']:.3f} | {r['gb_per_s']:.1f} | "
              f"{r['fraction_of_roof']:.1%} | {r['kernels_per_call'] if r['kernels_per_call'] is not None else '-'} | "
              f"{r['max_abs_diff']:.2g} |" for r in detail["rows"]]
    goal = detail["goal"]
    measured = goal["measured"]
    verdict = ("not measured (no such row in this plan)" if measured is None else
               f"measured {measured:.0%}: {'met' if measured >= goal['fraction'] else 'NOT met'}")
    lines += ["", f"Goal: `{goal['path']}` at batch {goal['batch']} x {goal['context_len']} tokens reads at >= "
              f"{goal['fraction']:.0%} of the measured bandwidth; {verdict}."]
    return lines
