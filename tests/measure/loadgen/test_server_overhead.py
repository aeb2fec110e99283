"""The server-overhead measurement through a real (in-process) server: the client's ITL beside the server's
breakdown of the same run."""

from __future__ import annotations

import pytest

from labkit import LLM
from labkit.measure.loadgen.datasets import RandomDataset
from labkit.measure.server_overhead import hand_off_contenders, measure_overhead
from labkit.serving import ServerThread


def test_measure_overhead_puts_the_client_and_the_server_side_by_side() -> None:
    llm = LLM("labkit-tiny", engine="chunked", max_model_len=128, max_num_seqs=4)
    with ServerThread(llm, served_model_name="labkit-tiny", server_options={"record_timings": True}) as server:
        dataset = RandomDataset(input_len=16, output_len=6)
        run = measure_overhead(server.base_url, dataset, num_prompts=4, max_concurrency=2)
        runs: dict = {}
        contenders = hand_off_contenders({"a": server.base_url}, dataset, 2, 2, runs)
        again = contenders["a"]()
    b = run.breakdown
    assert b.num_requests == 4 and b.num_tokens == 4 * 6
    b.check_nesting()
    assert run.mean_itl_ms > 0 and run.engine_step_ms > 0 and run.output_throughput > 0
    assert run.non_engine_ms == pytest.approx(run.mean_itl_ms - run.engine_step_ms)
    assert 0 < b.engine_share_of_turn <= 1
    m = run.metrics()
    assert {"itl_ms", "engine_step_ms", "non_engine_%", "server_share_%", "post_ms"} <= set(m)
    assert len(runs["a"]) == 1 and again["itl_ms"] > 0


def test_a_server_without_timings_is_named() -> None:
    llm = LLM("labkit-tiny", engine="chunked", max_model_len=64, max_num_seqs=2)
    with ServerThread(llm, served_model_name="labkit-tiny") as server, pytest.raises(RuntimeError,
                                                                                    match="record-timings"):
        measure_overhead(server.base_url, RandomDataset(input_len=8, output_len=2), 1, 1)
