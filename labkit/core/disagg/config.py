"""Options of the ``disaggregated`` engine: the colocated engine's, plus the prefill worker and the KV transfer.

Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.core.disagg.prefill_worker import PrefillWorker
from labkit.core.disagg.receive import KVReceiver
from labkit.core.engine.config import PagedConfig, check_positive_int, resolve_class
from labkit.core.engine.workers import DEFAULT_JOIN_TIMEOUT_S


@dataclass
class DisaggregatedConfig(PagedConfig):
    """The decode worker's options are ``chunked``'s (its pool, scheduler and budget: a preempted request is
    recomputed there); the rest are the prefill worker's and the link's. Notebook 12."""

    max_num_inflight_prefills: int = 2  # prompts handed to the prefill worker and not yet back
    prefill_num_threads: int | None = None  # torch threads of the prefill process (None: torch's default)
    # The longest the prefill worker may go without an answer while prompts are out (idle, the link never times out);
    # also bounds forming the group and building the worker.
    transfer_timeout_s: float = 120.0
    # How long the spawned worker may take to reach its entry point (it imports the main module, torch and labkit
    # first): past it, start-up fails naming the likely cause, a script without `if __name__ == "__main__":`.
    worker_join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    # Pluggable parts, as classes or import paths: the prefill process's worker, the decode side's receive.
    prefill_worker_cls: type[PrefillWorker] = PrefillWorker
    kv_receiver_cls: type[KVReceiver] = KVReceiver

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("max_num_inflight_prefills", self.max_num_inflight_prefills)
        if self.prefill_num_threads is not None:
            check_positive_int("prefill_num_threads", self.prefill_num_threads)
        for name in ("transfer_timeout_s", "worker_join_timeout_s"):
            timeout = getattr(self, name)
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {timeout!r}")
        if self.async_scheduling:
            raise ValueError("engine 'disaggregated' runs its decode steps synchronously: async_scheduling=True is "
                             "not supported (use engine 'chunked' for it)")
        self.prefill_worker_cls = resolve_class("prefill_worker_cls", self.prefill_worker_cls, PrefillWorker)
        self.kv_receiver_cls = resolve_class("kv_receiver_cls", self.kv_receiver_cls, KVReceiver)
