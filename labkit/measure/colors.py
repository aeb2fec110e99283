"""One colour per engine stage and per phase, the same in every plot of the workbook (the course's plots and the
profiler's timeline). Introduced in notebook 01 (``01_anatomy_of_a_request``)."""

STAGE_COLORS: dict[str, str] = {
    "tokenize": "#8c564b",
    "schedule": "#7f7f7f",
    "prepare": "#ff7f0e",
    "forward": "#1f77b4",
    "sample": "#2ca02c",
    "detokenize": "#9467bd",
}
PHASE_COLORS: dict[str, str] = {"prefill": "#d62728", "decode": "#1f77b4"}
