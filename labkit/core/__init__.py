"""The engine a learner reads: one request's path from ``LLM.generate`` to the model and back.

    from labkit.core import LLM, SamplingParams, ENGINES

``llm`` (the front end) -> ``engine`` (input processing, the engine loop, output processing) -> ``sched`` (who runs
this step) -> ``kv`` (where their K/V live) -> ``model`` and ``attention`` (the forward pass) -> ``sampler``;
``spec_decode`` and ``disagg`` extend the loop. This layer imports nothing from ``serving``, ``measure`` or
``course``. Introduced in notebook 01 (``01_anatomy_of_a_request``).
"""
