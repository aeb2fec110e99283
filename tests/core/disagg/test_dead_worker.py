"""A dead prefill worker ends the ``disaggregated`` engine as vLLM's ``EngineDeadError`` does (issue 34, item 6).

The worker is killed at three points, each forced (a prefill that never ends holds the requests behind it in
transit; a planted exit comes after exactly k answers), never left to timing: the requests whose KV had arrived
complete with transformers' tokens, the others fail with an error naming the exit, ``is_alive()`` turns False and
every later call raises ``EngineDeadError``. At start-up the parent watches the worker: a script without the
main-module guard fails at once, naming the guard; a worker that never arrives fails after the join timeout."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import hf_greedy
from faulty_worker import DIE_TOKEN, HOLD_TOKEN, FaultyPrefillWorker

from labkit import LLM, SamplingParams
from labkit.core.engine import engine_core
from labkit.core.engine.base import StepFailedError
from labkit.core.engine.errors import EngineDeadError
from labkit.core.engine.output_processor import RequestFailedError
from labkit.core.sequence import Sequence

N = 6  # requests per run
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def prompts(last: dict[int, int] | None = None) -> list[list[int]]:
    """N distinct prompts; ``last`` plants a marker token at the end of some of them."""
    out = [[1, 100 + 7 * i, 101 + 7 * i, 102 + 7 * i] for i in range(N)]
    for i, token in (last or {}).items():
        out[i] = [*out[i], token]
    return out


def kill(llm: LLM) -> None:
    os.kill(llm.engine.client.pid, signal.SIGKILL)
    llm.engine.client.process.join(30)


def run_to_end(llm: LLM, seqs: list[Sequence]) -> list[StepFailedError]:
    """Step by hand until every one of ``seqs`` has finished; the failed steps' errors."""
    errors = []
    while not all(s.is_finished for s in seqs):
        try:
            llm.step()
        except StepFailedError as exc:
            errors.append(exc)
    return errors


def count(llm: LLM, bundled_path, seqs: list[Sequence], cause: str) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(completed with transformers' tokens, failed with ``cause`` in their error); every request is one of them."""
    done = failed = 0
    for seq in seqs:
        if seq.finish_reason.value == "error":
            assert "the engine is dead" in seq.error and cause in seq.error, seq.error
            failed += 1
        else:
            assert seq.output_token_ids == hf_greedy(bundled_path, seq.prompt_token_ids, PARAMS.max_tokens)
            done += 1
    assert done + failed == len(seqs)
    return done, failed


def assert_dead_for_good(llm: LLM, cause: str) -> None:
    assert not llm.is_alive()
    assert cause in (llm.death_cause() or "")
    for call in (lambda: llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False), lambda: llm.add_request([1, 2, 3]),
                 lambda: llm.stream([1, 2, 3]).__next__(), llm.step):
        with pytest.raises(EngineDeadError, match=r"the engine is dead: .*Call close\(\) and create a new LLM"):
            call()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks  # nothing leaked on the decode side


def test_killed_before_any_transfer_fails_every_request(bundled_path, monkeypatch) -> None:
    # Issue 37 item 11 on the way: the worker (its second copy of the weights, its pool) exists, built, before the
    # decode pool is sized, so on a shared device the sizing sees its memory as another process's.
    seen: list[list[str]] = []
    sizing = engine_core.pool_num_blocks

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append([p.name for p in multiprocessing.active_children()])
        return sizing(*args, **kwargs)

    monkeypatch.setattr(engine_core, "pool_num_blocks", spy)
    with LLM(str(bundled_path), engine="disaggregated", prefill_worker_cls=FaultyPrefillWorker,
             max_num_inflight_prefills=N) as llm:
        assert seen == [["labkit-prefill-worker"]] and llm.engine.client.store.get("prefill_worker") == b"ready"
        seqs = [llm.add_request(p, PARAMS)[0] for p in prompts({0: HOLD_TOKEN})]
        llm.engine._dispatch()  # all six handed over; the worker holds on the first, so none comes back
        assert len(llm.engine.in_transit) == N and not llm.engine.transfers
        assert llm.is_alive()
        kill(llm)
        assert not llm.is_alive()  # seen at once, before any step
        errors = run_to_end(llm, seqs)
        assert len(errors) == 1 and isinstance(errors[0].cause, EngineDeadError)
        assert count(llm, bundled_path, seqs, "exited with code -9 (killed by SIGKILL)") == (0, N)
        assert_dead_for_good(llm, "killed by SIGKILL")


def test_worker_dying_after_k_transfers_completes_exactly_those_k(bundled_path) -> None:
    # The case (killed after 3 of 16 had arrived: 14 failed, not 13): answers already in the decode side's
    # hands must not fail with the link that broke after them. Here the worker exits right after sending 3 whole
    # answers, whether or not the decode loop has taken any of them yet.
    with LLM(str(bundled_path), engine="disaggregated", prefill_worker_cls=FaultyPrefillWorker,
             max_num_inflight_prefills=N) as llm:
        with pytest.raises(RequestFailedError) as info:
            llm.generate(prompts({3: DIE_TOKEN}), PARAMS, use_tqdm=False)
        outs = info.value.outputs
        completions = [o.outputs[0] for o in outs]
        assert [c.finish_reason != "error" for c in completions] == [True] * 3 + [False] * (N - 3)
        for out in outs[:3]:
            assert out.outputs[0].token_ids == hf_greedy(bundled_path, out.prompt_token_ids, PARAMS.max_tokens)
        for c in completions[3:]:
            assert "the engine is dead: the prefill worker" in c.error and "exited with code 5" in c.error
        assert_dead_for_good(llm, "exited with code 5")


def test_killed_mid_transfer_completes_the_arrived_and_fails_the_rest(bundled_path) -> None:
    with LLM(str(bundled_path), engine="disaggregated", prefill_worker_cls=FaultyPrefillWorker,
             max_num_inflight_prefills=N) as llm:
        seqs = [llm.add_request(p, PARAMS)[0] for p in prompts({3: HOLD_TOKEN})]
        while len(llm.engine.transfers) < 3:  # the first three come back; the fourth holds the rest in transit
            llm.step()
        kill(llm)
        run_to_end(llm, seqs)
        assert count(llm, bundled_path, seqs, "killed by SIGKILL") == (3, N - 3)
        assert [s.finish_reason.value != "error" for s in seqs] == [True] * 3 + [False] * (N - 3)
        assert_dead_for_good(llm, "killed by SIGKILL")


def test_killed_after_all_transfers_completes_everything(bundled_path) -> None:
    # A pool of 4 blocks (4 tokens each, one per prompt): every KV is taken in before any decode step, so two
    # received prompts wait in `arrived` for blocks when the worker dies; they arrived, so they complete too.
    with LLM(str(bundled_path), engine="disaggregated", prefill_worker_cls=FaultyPrefillWorker, block_size=4,
             num_gpu_blocks=4, max_num_inflight_prefills=N) as llm:
        seqs = [llm.add_request(p, PARAMS)[0] for p in prompts()]
        engine = llm.engine
        while engine.to_prefill or engine.in_transit:
            engine._dispatch()
            failed: list[object] = []
            engine._take(engine.client.wait(), time.perf_counter(), [], failed)
            assert not failed
            engine._admit_arrived()
        assert len(engine.transfers) == N and len(engine.scheduler.running) == 4 and len(engine.arrived) == 2
        kill(llm)
        assert not llm.is_alive()
        assert run_to_end(llm, seqs) == []
        assert count(llm, bundled_path, seqs, "killed by SIGKILL") == (N, 0)
        assert_dead_for_good(llm, "killed by SIGKILL")


def test_an_idle_link_outlives_the_transfer_timeout(bundled_path) -> None:
    # gloo ends a receive after its group's timeout; each end always has one posted, so an idle link (a notebook
    # left open between cells) once broke after transfer_timeout_s. Only an answer that is late counts now.
    with LLM(str(bundled_path), engine="disaggregated", transfer_timeout_s=4) as llm:
        (before,) = llm.generate([[1, 5, 6, 7]], PARAMS, use_tqdm=False)
        time.sleep(6)  # idle past the timeout
        assert llm.is_alive()
        (after,) = llm.generate([[1, 5, 6, 7]], PARAMS, use_tqdm=False)
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
        assert after.outputs[0].token_ids == hf_greedy(bundled_path, [1, 5, 6, 7], PARAMS.max_tokens)


NO_GUARD = """
import sys
from labkit import LLM
llm = LLM(sys.argv[1], engine="disaggregated", worker_join_timeout_s=600)  # no main-module guard
print("unreachable", flush=True)
"""

NEVER_JOINS = """
import sys, time
from labkit import LLM
if __name__ == "__mp_main__":  # what the spawned worker runs when it imports this script again
    time.sleep(600)  # long work at import time: the worker never reaches its entry point
if __name__ == "__main__":
    LLM(sys.argv[1], engine="disaggregated", worker_join_timeout_s=3)
"""


def run_script(tmp_path, source: str, bundled_path) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, str(script), str(bundled_path)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)


def test_a_worker_that_dies_at_import_is_reported_at_once_naming_the_guard(bundled_path, tmp_path) -> None:
    # The join timeout is 600 s, the subprocess's 300 s: the error can only come from watching the worker die.
    run = run_script(tmp_path, NO_GUARD, bundled_path)
    assert run.returncode == 1 and "unreachable" not in run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("labkit.core.engine.errors.WorkerStartError: the prefill worker (pid ")
    assert "exited with code 1 before it started" in last
    assert "bootstrapping phase" in last  # its last error, quoted
    assert 'no main-module guard' in last and 'if __name__ == "__main__":' in last
    assert "did not start within" not in last


def test_a_worker_that_never_joins_fails_after_the_join_timeout(bundled_path, tmp_path) -> None:
    run = run_script(tmp_path, NEVER_JOINS, bundled_path)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1, run.stderr[-2000:]
    assert "WorkerStartError: the prefill worker (pid " in last and "did not start within 3 s (join timeout)" in last
    assert 'if __name__ == "__main__":' in last and "worker_join_timeout_s" in last


def test_join_timeout_is_an_option() -> None:
    from labkit.core.disagg import DisaggregatedConfig
    with pytest.raises(ValueError, match="worker_join_timeout_s must be a positive number"):
        DisaggregatedConfig(worker_join_timeout_s=0)
