"""Attention kernel micro-benchmarks: which kernel for which shape, on a CPU and on a GPU."""
