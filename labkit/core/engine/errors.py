"""Errors that end an engine, as opposed to one step (``StepFailedError`` in ``base.py``).

vLLM's ``EngineDeadError``: a worker process labkit started (chapter 12's prefill worker, chapter 15's tensor-
parallel ranks) died or never joined. The engine cannot serve again; every later call raises this error naming the
cause, and the fix is ``close()`` and a new ``LLM``. Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine's worker process is gone: requests in flight fail, later calls raise this. Notebook 12."""

    def __init__(self, cause: str) -> None:
        super().__init__(f"the engine is dead: {cause}. Call close() and create a new LLM.")
        self.cause = cause


class WorkerStartError(RuntimeError):
    """A worker process died or did not join while the engine was starting; the message names the exit code, the
    worker's last error and the likely cause (the missing ``if __name__ == "__main__":`` guard). Notebook 12."""
