"""Engine benchmarks in process: TTFT, decode, module mix, roofline, KV store tiers (CPU and GPU)."""
