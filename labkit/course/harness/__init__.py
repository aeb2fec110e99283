"""One harness for every Build task that runs inside the real engine: describe a workload, run ``LLM(...)`` with the
learner's part in it step by step, and compare it with labkit's own part and with transformers.

``runs``: the workload (``Request``, ``Setup``), the step-by-step driver (``run_setup``) and its record (``Run``,
``StepRecord``, ``Outcome``), and labkit's own run of a setup (``reference_run``). ``compare``: everything wrong with a
run, most fundamental first, reported by ``check_setups`` / ``expect_run``. ``scheduler_records``: the recording
subclass that notes what a learner's scheduler rules did at every step. The chapter checkers build on them
(notebooks 02, 03, 05, 06, 07, 08 and 10).
"""
