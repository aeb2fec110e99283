"""Disaggregated prefill: a prefill worker and a decode worker in two processes, KV moved over torch.distributed.

``DisaggregatedEngine`` (engine ``disaggregated``) is the decode worker; ``PrefillWorker`` runs in the spawned
process; ``KVReceiver.receive_kv`` takes a transferred prompt into the decode pool (notebook 12's Build task).
Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from labkit.core.disagg.config import DisaggregatedConfig
from labkit.core.disagg.engine import DisaggregatedEngine, TransferRecord
from labkit.core.disagg.prefill_worker import PrefillWorker
from labkit.core.disagg.receive import KVReceiver
from labkit.core.disagg.transfer import TransferError

__all__ = ["DisaggregatedConfig", "DisaggregatedEngine", "KVReceiver", "PrefillWorker", "TransferError",
           "TransferRecord"]
