"""Benchmarks behind `arctic-rl bench ...`; results go to docs/benchmarks.md."""
