"""Benchmark suites: `python -m benchmarks SUITE...` writes results/SUITE/ (docs/benchmarks.md)."""
