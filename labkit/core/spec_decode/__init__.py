"""Speculative decoding (vLLM's ``speculative_config``): propose k tokens cheaply, verify them in one pass.

``config`` checks the option; ``ngram_proposer`` (prompt lookup) and ``draft_proposer`` (a layer-truncated copy of
the target) propose; ``rejection_sampler`` keeps or replaces each proposal so the output has exactly the target's
distribution. The engines ``continuous`` and ``chunked`` run it. Introduced in notebook 13
(``13_speculative_decoding``).
"""

from labkit.core.spec_decode.config import SpeculativeConfig
from labkit.core.spec_decode.rejection_sampler import RejectionSampler

__all__ = ["RejectionSampler", "SpeculativeConfig"]
