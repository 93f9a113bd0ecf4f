"""The cluster's error tree: everything promptcache.cluster raises is a ClusterError (an `assert`-like
"unreachable" and SIGTERM turned into KeyboardInterrupt aside), and the server's one error table gives each a
status, invalid options included."""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest

import promptcache.cluster
from promptcache.cluster import (
    AffinityConfig,
    ClusterConfigError,
    ClusterError,
    ClusterOptions,
    NoReplicaError,
    RequestTooLargeError,
)
from promptcache.cluster.placement import BalanceBound
from promptcache.cluster.policy import LoadGuard, RoutingPolicy
from promptcache.server.errors import ERROR_TABLE, status_for

CLUSTER = Path(promptcache.cluster.__file__).parent
NEEDS_RAY = {"app", "gateway", "replica", "router", "readiness"}


def _raised_names(path: Path) -> list[tuple[int, str]]:
    """(line, class name) of every `raise Name(...)` / `raise Name` in a module."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name):
                names.append((node.lineno, target.id))
    return names


@pytest.mark.parametrize("path", sorted(CLUSTER.glob("*.py")), ids=lambda p: p.stem)
def test_every_exception_the_cluster_raises_is_a_cluster_error(path):
    if path.stem in NEEDS_RAY:
        pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")
    module = importlib.import_module(f"promptcache.cluster.{path.stem}")
    for line, name in _raised_names(path):
        cls = getattr(module, name, None) or getattr(builtins, name, None)
        assert isinstance(cls, type), f"{path.name}:{line} raises {name}, which is not a class in scope"
        assert issubclass(cls, ClusterError) or cls in (AssertionError, KeyboardInterrupt), \
            f"{path.name}:{line} raises {name}"


@pytest.mark.parametrize("build", [
    lambda: ClusterOptions(num_replicas=0),
    lambda: ClusterOptions.from_dict({"replicaz": 2}),
    lambda: AffinityConfig(prefix_chars=0),
    lambda: BalanceBound(factor=0.5),
    lambda: LoadGuard(rel_threshold=0.5),
])
def test_invalid_cluster_options_are_cluster_config_errors_not_value_errors(build):
    with pytest.raises(ClusterConfigError) as caught:
        build()
    assert not isinstance(caught.value, ValueError)  # the error table has no ValueError row to catch it


def test_no_candidate_replica_is_a_no_replica_error():
    with pytest.raises(NoReplicaError):
        RoutingPolicy().choose(b"k" * 16, {})


def test_every_cluster_error_has_a_row_and_only_a_body_too_large_is_the_callers():
    subclasses = [ClusterError, *ClusterError.__subclasses__()]
    assert set(subclasses) <= {cls for cls, _, _ in ERROR_TABLE}
    for cls in subclasses:
        status, _ = status_for(cls("x"))
        assert status == 413 if cls is RequestTooLargeError else status in (500, 503), cls
