"""CTranslate2 in a child process of its own, timed from the benchmark's process through a pipe.

Why not in the benchmark's own process: CTranslate2's wheel brings its own copy of the OpenMP runtime (libgomp). Once
CTranslate2 has generated in a process, that process's PyTorch thread team answers slowly at every parallel region:
measured on the 2-core VM of ``docs/benchmarks/quantization.md``, one 576 x 576 float32 GEMV on labkit's kernel went
from 14-15 µs to 57-66 µs, a 8192 x 2048 one from 1.1-1.4 ms to 1.7 ms, and labkit's batch-1 decode of smollm2-135m
from 24-28 ms to 36-38 ms per token, and it stayed there after CTranslate2's generator was deleted (no thread of
CTranslate2's used any CPU meanwhile; the cause is in the two runtimes' interplay, not in a busy thread). Each engine
is used in a process of its own in practice, so each is timed in one: labkit in the benchmark's, CTranslate2 here.
Introduced with notebook 14 (``14_quantization``) as ``scripts/bench_quantization.py``'s contender.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

ANSWER_TIMEOUT_S = 600.0  # loading both models or one generation: far longer means the child is stuck


def generate_once(gen: Any, tokens: list[str], n: int) -> dict[str, float]:
    """One greedy generation of ``n`` tokens, streamed: decode ms per token from the tokens' arrival times, prefill
    tokens per second up to the first one (the same measures as labkit's contenders)."""
    start, times = time.perf_counter(), []
    for _ in gen.generate_tokens(tokens, max_length=n, min_length=n, sampling_topk=1):  # greedy, streamed
        times.append(time.perf_counter())
    return {"decode_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3,
            "prefill_tok_s": len(tokens) / (times[0] - start)}


def serve(conn: Connection, models: dict[str, tuple[str, str]], tokens: list[str], n: int, threads: int) -> None:
    """The child: load each converted model (name -> (directory, compute_type)), then answer each name received with
    one timed generation, until None (or the parent's end of the pipe closes)."""
    try:
        import ctranslate2

        gens = {name: ctranslate2.Generator(path, device="cpu", compute_type=compute, intra_threads=threads)
                for name, (path, compute) in models.items()}
    except Exception as error:  # noqa: BLE001  reported to the parent, which says CTranslate2 was not run
        conn.send(("error", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            name = conn.recv()
        except EOFError:  # the parent is gone
            return
        if name is None:
            return
        try:
            conn.send(("ok", generate_once(gens[name], tokens, n)))
        except Exception as error:  # noqa: BLE001
            conn.send(("error", f"{type(error).__name__}: {error}"))


class Ct2Process:
    """A child process holding CTranslate2 generators; ``contender(name)`` is a callable for ``labkit.measure.
    interleave`` that times one generation there. A context manager: leaving it stops the child."""

    def __init__(self, models: dict[str, tuple[str, str]], tokens: list[str], n: int, threads: int,
                 timeout_s: float = ANSWER_TIMEOUT_S) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of this process's thread pools is inherited
        self.conn, child = ctx.Pipe()
        self.timeout_s = timeout_s
        self.proc = ctx.Process(target=serve, args=(child, models, tokens, n, threads), daemon=True,
                                name="labkit-ct2-contender")
        self.proc.start()
        child.close()
        try:
            self._answer()  # "ready": both models loaded
        except BaseException:
            self.close()
            raise

    def contender(self, name: str) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            self.conn.send(name)
            return self._answer()
        return run

    def _answer(self) -> Any:
        if not self.conn.poll(self.timeout_s):
            raise RuntimeError(f"the CTranslate2 process did not answer within {self.timeout_s:.0f} s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"the CTranslate2 process ended (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"CTranslate2 failed in its process: {value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()

    def __enter__(self) -> Ct2Process:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
