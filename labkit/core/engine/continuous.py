"""Engines ``continuous`` and ``chunked``: iteration-level scheduling over the paged pool.

``continuous`` admits new requests at every step and prefills each prompt whole when admitted
(notebook 07, ``07_continuous_batching``). ``chunked`` also splits prefills into chunks under a
per-step token budget, after scheduling every running decode, so a long prompt never stalls the
decodes beside it (notebook 08, ``08_chunked_prefill``). ``chunked`` is ``LLM``'s default engine.
Both can plan the next step while the device runs this one (``async_scheduling=True``, notebook 10), or
speculate: propose k tokens per decode and verify them in the step's one pass (``speculative_config``, notebook 13).
"""

from __future__ import annotations

from labkit.core.attention import resolve_attention_backend
from labkit.core.engine.async_core import AsyncEngineCore
from labkit.core.engine.config import ContinuousConfig, EngineConfig
from labkit.core.model import CausalLM
from labkit.core.spec_decode.config import SpeculativeConfig
from labkit.core.spec_decode.draft_proposer import DraftModelProposer
from labkit.core.spec_decode.ngram_proposer import NgramProposer


class ContinuousEngine(AsyncEngineCore):
    """Continuous batching: requests join and leave at every step. Notebook 07."""

    name = "continuous"
    config_class = ContinuousConfig
    config: ContinuousConfig

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        super().__init__(model, config)
        spec = self.config.speculative_config
        if spec is not None:
            assert isinstance(spec, SpeculativeConfig)  # made one by ContinuousConfig.__post_init__
            spec.check_model(model.config.num_hidden_layers)
            self.scheduler.num_lookahead_tokens = spec.num_speculative_tokens
            self.rejection_sampler = spec.rejection_sampler_cls()
            if spec.method == "ngram":
                self.drafter = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
            else:
                self.drafter = DraftModelProposer(model, spec.draft_num_layers, self.pool, self.block_manager,
                                                  resolve_attention_backend(self.config.attention_backend,
                                                                            model.device.type, model.dtype))

    @property
    def max_num_batched_tokens(self) -> int:
        """The per-step token budget (default: a whole max_model_len prompt; 512 when chunking)."""
        if self.config.max_num_batched_tokens is not None:
            return self.config.max_num_batched_tokens
        assert self.config.max_model_len is not None
        return 512 if self.enable_chunked_prefill else self.config.max_model_len


class ChunkedEngine(ContinuousEngine):
    """Continuous batching with chunked prefill under a token budget. Notebook 08; LLM's default."""

    name = "chunked"
    enable_chunked_prefill = True
