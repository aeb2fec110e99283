"""Workbook support: the CPU/GPU profile and smoke mode, workloads, the story corpus, plots, and ``make reset``."""
