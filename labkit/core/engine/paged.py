"""Engine ``paged``: static batches over the paged KV pool.

Same policy as ``kvcache`` (a batch of up to ``max_num_seqs`` runs until its last request finishes;
freed slots are not refilled), but memory is handed out block by block as sequences grow, and
returned the moment a sequence finishes. The batch is ragged: no padding is computed. With
``enable_prefix_caching`` a prompt that starts like an earlier one reuses its blocks and skips that
part of the prefill. Its scheduler (``StaticScheduler``) is the only thing that separates it from
``continuous``. Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from labkit.core.engine.core import EngineCore
from labkit.core.sched.static import StaticScheduler


class PagedEngine(EngineCore):
    """Static batches over the paged pool. Notebook 06."""

    name = "paged"
    scheduler_cls = StaticScheduler
