"""Parts of the benchmark scripts in scripts/: measurements, reports and figures, one module each."""
