"""The core's test cluster (``tests/unit/core/cluster.py``) for the property tests, loaded
once by path: the test directories are not packages, so it cannot be imported by name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "unit" / "core" / "cluster.py"
_NAME = "_flodl_core_test_cluster"


def _load():
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, _PATH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = mod
        spec.loader.exec_module(mod)
    return sys.modules[_NAME]


Cluster = _load().Cluster
