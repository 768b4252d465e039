"""Benchmarks: each writes JSON (and optionally a PNG plot)."""
