"""Benchmarks for deadweight's hot paths; run ``python -m bench`` from the repository root."""
