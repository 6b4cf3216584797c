"""Static checks that `make test` (and so CI) runs: the dependency rule of ARCHITECTURE §2
(import-linter, contracts in .importlinter) and mypy over flodl/core and flodl/rank
(mypy.ini).

Both run from the repository root in a subprocess of this interpreter's environment, and
a failure shows the tool's own report. Both take a few seconds.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})  # fmt: skip
    except FileNotFoundError as e:
        pytest.fail(f"{argv[0]} is not installed ({e}): `make setup` installs requirements-dev.txt")


def test_dependency_rule_holds():
    """Layers wire < core | rank < sim < coordinator | worker < launcher; core and rank
    import no I/O, clock or randomness."""
    lint = BIN / "lint-imports"
    r = _run([str(lint) if lint.exists() else "lint-imports", "--config", str(ROOT / ".importlinter"), "--no-cache"])
    assert r.returncode == 0, f"lint-imports: the dependency rule is broken\n{r.stdout}\n{r.stderr}"


def test_mypy_flodl_core_and_rank():
    r = _run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"), "--cache-dir", os.devnull])
    assert r.returncode == 0, f"mypy (mypy.ini)\n{r.stdout}\n{r.stderr}"
