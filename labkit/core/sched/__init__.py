"""Scheduling: which sequences run each step and how many tokens each computes (notebooks 06-08, 10)."""
