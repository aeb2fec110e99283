"""CTranslate2's contenders run in a child process (labkit.measure.benchmarks.ct2_process): the pipe protocol, its
errors and its end, with a stand-in ``ctranslate2`` first on the child's path (CI does not install CTranslate2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from labkit.measure.benchmarks.ct2_process import Ct2Process

FAKE = '''
import os, time

class Generator:
    def __init__(self, path, device, compute_type, intra_threads):
        if compute_type == "unloadable":
            raise ValueError(f"cannot load {path}")
        self.compute_type, self.threads = compute_type, intra_threads

    def generate_tokens(self, tokens, max_length, min_length, sampling_topk):
        assert sampling_topk == 1 and min_length == max_length  # greedy, exactly n tokens
        if self.compute_type == "broken":
            raise RuntimeError("planted failure")
        if self.compute_type == "dies":
            os._exit(7)
        time.sleep(0.002 * len(tokens))  # the prompt
        for i in range(max_length):
            time.sleep(0.004)  # one decode step
            yield os.getpid()
'''


@pytest.fixture
def fake_ct2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ctranslate2.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned child starts with its parent's sys.path


def test_each_contender_is_timed_in_the_child_and_close_ends_it(fake_ct2: None) -> None:
    models = {"f32": ("dir-a", "float32"), "broken": ("dir-b", "broken")}
    with Ct2Process(models, tokens=["a"] * 10, n=6, threads=1) as ct2:
        result = ct2.contender("f32")()
        assert set(result) == {"decode_ms", "prefill_tok_s"}
        assert 3.0 < result["decode_ms"] < 1000  # ~4 ms a step; never zero or negative
        assert result["prefill_tok_s"] > 0
        with pytest.raises(RuntimeError, match="CTranslate2 failed in its process: RuntimeError: planted failure"):
            ct2.contender("broken")()
        assert ct2.contender("f32")()["decode_ms"] > 3.0  # one failed generation leaves the process serving
        proc = ct2.proc
        assert proc.pid != os.getpid() and proc.is_alive()
    assert not proc.is_alive()


def test_a_model_that_cannot_load_is_reported_and_the_child_ends(fake_ct2: None) -> None:
    with pytest.raises(RuntimeError, match="cannot load dir-x"):
        Ct2Process({"x": ("dir-x", "unloadable")}, tokens=["a"], n=3, threads=1)


def test_a_child_that_dies_is_reported_with_its_exit_code(fake_ct2: None) -> None:
    with Ct2Process({"d": ("dir-d", "dies")}, tokens=["a"], n=3, threads=1) as ct2:
        with pytest.raises(RuntimeError, match=r"ended \(exit code 7\)"):
            ct2.contender("d")()
