"""Workloads: seeded generators, exact-length prompts, JSONL files, and the committed data files."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path
from types import ModuleType

import pytest

from labkit import LLM
from labkit.measure.workloads import (
    WORKLOADS_DIR,
    Workload,
    WorkloadRequest,
    fixed_lengths,
    load_workload,
    lognormal_lengths,
    materialise,
    sampling_params_for,
    uniform_lengths,
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_workloads.py"


def make_workloads_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_workloads", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generators_are_seeded() -> None:
    assert uniform_lengths(20, (1, 100), (1, 50), seed=3) == uniform_lengths(20, (1, 100), (1, 50), seed=3)
    assert uniform_lengths(20, (1, 100), (1, 50), seed=3) != uniform_lengths(20, (1, 100), (1, 50), seed=4)
    args = dict(n=50, prompt_median=64, output_median=32, sigma=1.0, prompt_max=1024, output_max=256)
    assert lognormal_lengths(**args, seed=0) == lognormal_lengths(**args, seed=0)
    assert lognormal_lengths(**args, seed=0).prompt_lens != lognormal_lengths(**args, seed=1).prompt_lens


def test_bounds_are_respected() -> None:
    wl = uniform_lengths(200, (5, 9), (2, 3), seed=0)
    assert set(wl.prompt_lens) == set(range(5, 10)) and set(wl.output_lens) == {2, 3}  # inclusive ranges
    wl = lognormal_lengths(500, prompt_median=128, output_median=64, sigma=1.2, prompt_max=1024, output_max=256,
                           seed=0, prompt_min=16, output_min=8)
    assert min(wl.prompt_lens) >= 16 and max(wl.prompt_lens) <= 1024
    assert min(wl.output_lens) >= 8 and max(wl.output_lens) <= 256
    # heavy-tailed around the median: a wide spread, the middle where asked
    assert 100 <= statistics.median(wl.prompt_lens) <= 160
    assert max(wl.prompt_lens) / min(wl.prompt_lens) >= 30
    fixed = fixed_lengths(4, 10, 5)
    assert fixed.prompt_lens == [10] * 4 and fixed.output_lens == [5] * 4 and fixed.seed is None
    with pytest.raises(ValueError, match="prompt_range"):
        uniform_lengths(3, (0, 5), (1, 2), seed=0)
    with pytest.raises(ValueError, match="prompt_len"):
        WorkloadRequest(prompt_len=0, output_len=3)


def test_totals() -> None:
    wl = Workload("t", [WorkloadRequest(3, 4), WorkloadRequest(10, 1)], seed=0)
    assert (len(wl), wl.num_prompt_tokens, wl.num_output_tokens, wl.max_seq_len) == (2, 13, 5, 11)
    params = sampling_params_for(wl)
    assert [p.max_tokens for p in params] == [4, 1]
    assert all(p.temperature == 0 and p.ignore_eos for p in params)
    with pytest.raises(ValueError, match="materialise"):
        wl.prompts()


def test_materialised_prompts_have_exact_lengths(tokenizer) -> None:  # type: ignore[no-untyped-def]
    wl = Workload("lens", [WorkloadRequest(n, 1) for n in (1, 2, 7, 64, 300, 1024)], seed=0)
    out = materialise(wl, tokenizer, seed=0)
    assert out.prompt_lens == wl.prompt_lens and wl.requests[0].prompt_token_ids is None  # a copy
    vocab = len(tokenizer)
    for r in out.requests:
        ids = r.prompt_token_ids
        assert ids is not None and len(ids) == r.prompt_len
        assert all(type(t) is int and 0 <= t < vocab for t in ids)
        assert ids[0] == tokenizer.bos_token_id
    assert "Once upon a time" in out.requests[-1].prompt  # in-domain text the bundled model continues
    assert materialise(wl, tokenizer, seed=0) == out
    firsts = [r.prompt_token_ids[:32] for r in out.requests if r.prompt_len >= 64]
    assert len({tuple(f) for f in firsts}) == len(firsts)  # different text per request
    assert out.prompts() == [r.prompt_token_ids for r in out.requests]


def test_generates_exactly_the_output_lengths(tokenizer) -> None:  # type: ignore[no-untyped-def]
    wl = materialise(Workload("e2e", [WorkloadRequest(5, 3), WorkloadRequest(12, 6), WorkloadRequest(2, 1)]),
                     tokenizer, seed=1)
    llm = LLM("labkit-tiny", engine="kvcache", device="cpu", max_num_seqs=4)
    outs = llm.generate(wl.prompts(), sampling_params_for(wl), use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in outs] == wl.prompt_lens
    assert [len(o.outputs[0].token_ids) for o in outs] == wl.output_lens


def test_jsonl_round_trip(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    wl = lognormal_lengths(10, 32, 16, 1.0, 256, 64, seed=5, name="rt")
    wl.requests[3].arrival_time = 1.5
    assert Workload.from_jsonl(wl.to_jsonl(tmp_path / "a.jsonl")) == wl
    full = materialise(wl, tokenizer, seed=0)
    assert Workload.from_jsonl(full.to_jsonl(tmp_path / "b.jsonl")) == full
    # A file of request lines only is accepted and named after the file.
    (tmp_path / "bare.jsonl").write_text('{"prompt_len": 4, "output_len": 2}\n\n{"prompt_len": 9, "output_len": 1}\n')
    bare = Workload.from_jsonl(tmp_path / "bare.jsonl")
    assert bare.name == "bare" and bare.prompt_lens == [4, 9] and bare.seed is None


def test_committed_files_match_the_script() -> None:
    script = make_workloads_script()
    files = sorted(p.stem for p in WORKLOADS_DIR.glob("*.jsonl"))
    assert files == sorted(script.WORKLOADS), "data/workloads/ and scripts/make_workloads.py disagree"
    for name, build in script.WORKLOADS.items():
        committed = load_workload(name)
        assert committed == build(), f"{name}.jsonl is stale: run python scripts/make_workloads.py"
        assert all(r.prompt_token_ids is None for r in committed.requests)  # lengths only
        header = json.loads((WORKLOADS_DIR / f"{name}.jsonl").read_text().splitlines()[0])
        assert header["workload"] == name and header["seed"] == committed.seed
    het = load_workload("heterogeneous_64")
    assert len(het) == 64 and min(het.prompt_lens) >= 16 and max(het.prompt_lens) <= 1024
    assert min(het.output_lens) >= 16 and max(het.output_lens) <= 256
    assert het.max_seq_len <= 2048  # fits the bundled model's context
    with pytest.raises(FileNotFoundError, match="heterogeneous_64"):
        load_workload("no_such_workload")
