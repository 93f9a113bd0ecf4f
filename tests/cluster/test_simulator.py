"""The routing simulator: the real RoutingPolicy against load-only policies, no model and no Ray."""

from __future__ import annotations

import pytest

from promptcache.cluster import ClusterConfigError
from promptcache.cluster.simulator import POLICIES, SimulationConfig, main, simulate

CONFIG = SimulationConfig(num_replicas=4, num_requests_per_replica=150, device_modules_per_replica=16)


def test_affinity_keeps_more_in_the_device_tiers_than_load_only_routing():
    results = {policy: simulate(CONFIG, policy) for policy in POLICIES}
    for cache_blind in ("power_of_two", "random"):
        for affinity in ("affinity", "affinity_schema"):
            assert results[affinity].device_hit_rate > results[cache_blind].device_hit_rate + 0.1, results
    for result in results.values():
        assert result.num_requests == 600 and result.max_over_mean_requests >= 1.0
        assert 0 < result.p50_latency_s <= result.p99_latency_s


def test_runs_are_reproducible_and_policies_checked(capsys):
    assert simulate(CONFIG, "affinity") == simulate(CONFIG, "affinity")
    with pytest.raises(ClusterConfigError, match="policy"):
        simulate(CONFIG, "round_robin")
    assert main(["--replicas", "2", "--requests-per-replica", "20"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(POLICIES)


def test_the_balance_bound_evens_out_requests_per_replica():
    skewed = SimulationConfig(num_replicas=16, num_requests_per_replica=200)
    unbounded = simulate(SimulationConfig(num_replicas=16, num_requests_per_replica=200, balance_factor=None),
                         "affinity")
    bounded = simulate(skewed, "affinity")
    assert bounded.max_over_mean_requests < unbounded.max_over_mean_requests - 0.1, (bounded, unbounded)
    assert bounded.device_hit_rate > unbounded.device_hit_rate - 0.05, (bounded, unbounded)
