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
