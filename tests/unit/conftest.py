"""Shared fixtures of the unit tests.

``Cluster`` is the core's in-memory cluster (tests/unit/core/cluster.py), loaded by path
once: the checkpoint and coordinator tests drive the real core to a mid-run state (a
checkpoint meta, a journal to recover) without a package import of tests/unit/core.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_CLUSTER = pathlib.Path(__file__).resolve().parent / "core" / "cluster.py"


def _load_cluster_module():
    name = "flodl_tests_core_cluster"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _CLUSTER)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def Cluster():
    return _load_cluster_module().Cluster


@pytest.fixture
def serve():
    """``serve(settings) -> (service, endpoint, zmq context)``: a coordinator service in a
    thread (its loop owns its socket), stopped and joined at teardown."""
    import zmq

    from flodl_coordinator.service import CoordinatorService

    started = []

    def start(settings):
        svc = CoordinatorService(settings)
        ep, t = svc.start_thread()
        ctx = zmq.Context()
        started.append((svc, t, ctx))
        return svc, ep, ctx

    yield start
    for svc, t, ctx in reversed(started):
        # Twice: stop now. Once would wait for the test's peers to acknowledge their
        # Shutdown, which they never do (until the liveness timeout).
        svc.request_stop()
        svc.request_stop()
        t.join(15)
        ctx.destroy(0)
        assert not t.is_alive(), "the coordinator service thread did not stop at a second stop request"
