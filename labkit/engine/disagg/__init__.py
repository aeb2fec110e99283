"""Disaggregated prefill: a prefill worker and a decode worker in two processes, KV moved over torch.distributed.

``DisaggregatedEngine`` (engine ``disaggregated``) is the decode worker; ``PrefillWorker`` runs in the spawned
process; ``KVReceiver.receive_kv`` takes a transferred prompt into the decode pool (notebook 12's Build task).
Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from labkit.engine.disagg.config import DisaggregatedConfig
from labkit.engine.disagg.engine import DisaggregatedEngine, TransferRecord
from labkit.engine.disagg.prefill_worker import PrefillWorker
from labkit.engine.disagg.receive import KVReceiver
from labkit.engine.disagg.transfer import TransferError

__all__ = ["DisaggregatedConfig", "DisaggregatedEngine", "KVReceiver", "PrefillWorker", "TransferError",
           "TransferRecord"]
