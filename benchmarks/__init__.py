"""Benchmarks: scripts that print JSON lines and draw plots; not tests (benchmarks/README.md)."""
