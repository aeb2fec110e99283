"""A prefill worker with planted faults, picked by a prompt's last token (importable in the spawned process)."""

from __future__ import annotations

import os
import time

import torch

from labkit.core.disagg.prefill_worker import PrefillRequest, PrefillWorker
from labkit.core.disagg.transfer import HEADER_TAG, Kind, header

FAIL_TOKEN = 7  # the prefill raises, after its blocks were allocated
CUT_TOKEN = 8  # the worker dies after sending the header: the KV never arrives
HOLD_TOKEN = 10  # the prefill never ends (until the test kills the worker): the requests behind it stay in transit
DIE_TOKEN = 11  # the worker exits (code 5) once every answer before this prompt's is sent, without answering it


class FaultyPrefillWorker(PrefillWorker):
    def compute(self, req: PrefillRequest) -> tuple[torch.Tensor, torch.Tensor]:
        marker = req.prompt_token_ids[-1]
        if marker == FAIL_TOKEN:
            assert self.block_manager.num_used_blocks > 0  # the fault strikes while the prompt holds blocks
            raise RuntimeError("planted prefill fault")
        if marker == HOLD_TOKEN:
            time.sleep(3600)
        if marker == DIE_TOKEN:
            self.link.flush()  # the answers before this one are out, whole
            os._exit(5)
        return super().compute(req)

    def send_kv(self, req: PrefillRequest, kv: torch.Tensor, logits: torch.Tensor, start: int, end: int) -> None:
        if req.prompt_token_ids[-1] == CUT_TOKEN:
            self.link.send([header(Kind.KV, req.seq_id, len(req.prompt_token_ids), kv.shape[0], 0, start, end, end)],
                           [HEADER_TAG])
            self.link.flush()
            os._exit(3)
        super().send_kv(req, kv, logits, start, end)
