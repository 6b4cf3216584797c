"""The shipped systemd units and the compose rig, checked by their own tools.

* ``systemd-analyze verify`` over the template units (instance ``example``) in a scratch
  root laid out as the README's install steps leave a host: the venv's console scripts
  under /opt/flodl/bin, the configs under /etc/flodl. The host's own unit tree stands in
  for the distribution's (``sysinit.target`` and friends).
* The example configs load: the TOML through the coordinator's settings, the agent's
  environment file through the variables its unit uses.
* ``docker-compose config`` over the rig; its build context, as Docker computes it from
  ``.dockerignore`` (docker-py, the library docker-compose itself runs on).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from flodl_coordinator.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
COORD_UNIT = ROOT / "coordinator/systemd/flodl-coordinator@.service"
AGENT_UNIT = ROOT / "worker/systemd/flodl-agent@.service"
EXAMPLE_TOML = ROOT / "coordinator/systemd/example.toml"
AGENT_ENV = ROOT / "worker/systemd/agent-example.env"
COMPOSE = ROOT / "docker/docker-compose.yml"
VENV = "/opt/flodl"  # where the README's install steps create the venv


def _console_scripts() -> set[str]:
    names = set()
    for p in ("pyproject.toml", "coordinator/pyproject.toml", "worker/pyproject.toml"):
        names |= set(tomllib.loads((ROOT / p).read_text())["project"].get("scripts", {}))
    return names


def _exec_start(unit: Path) -> list[str]:
    return re.search(r"^ExecStart=(.*)$", unit.read_text(), re.M).group(1).split()


def test_units_run_console_scripts_the_readme_installs():
    readme = (ROOT / "README.md").read_text()
    assert f"python3 -m venv {VENV}" in readme, "the README must create the venv the units run from"
    for unit in (COORD_UNIT, AGENT_UNIT):
        exe = _exec_start(unit)[0]
        assert os.path.dirname(exe) == f"{VENV}/bin" and os.path.basename(exe) in _console_scripts(), exe
        assert f"install -m 0644 {unit.relative_to(ROOT)} /etc/systemd/system/" in readme, unit.name
        assert re.search(r"^Type=notify$", unit.read_text(), re.M), f"{unit.name}: readiness is notified"


def test_systemd_analyze_verifies_the_units(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd; .ci/run does)")
    if not Path("/usr/lib/systemd/system/sysinit.target").exists():
        pytest.skip("no systemd unit tree on this host (/usr/lib/systemd/system) to verify against")
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "usr/lib/systemd").mkdir(parents=True)
    (root / "usr/lib/systemd/system").symlink_to("/usr/lib/systemd/system")
    (root / "etc/flodl").mkdir()
    for unit in (COORD_UNIT, AGENT_UNIT):
        shutil.copy(unit, root / "etc/systemd/system" / unit.name)
        exe = root / _exec_start(unit)[0].lstrip("/")
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text("#!/bin/sh\n")  # stands for the console script pip puts there
        exe.chmod(0o755)
    shutil.copy(EXAMPLE_TOML, root / "etc/flodl/example.toml")
    shutil.copy(AGENT_ENV, root / "etc/flodl/agent-example.env")
    units = ["flodl-coordinator@example.service", "flodl-agent@example.service"]
    out = subprocess.run([tool, "verify", f"--root={root}", *units], capture_output=True, text=True, timeout=60)
    # The host tree's own symlinks do not resolve inside the scratch root: its noise, not ours.
    said = [line for line in (out.stdout + out.stderr).splitlines() if "Failed to resolve symlink" not in line]
    assert out.returncode == 0 and not said, "\n".join(said)


def test_a_unit_systemd_rejects_is_reported(tmp_path):
    """The check above can fail: a unit with a typo'd key and a missing binary does."""
    tool = shutil.which("systemd-analyze")
    if tool is None or not Path("/usr/lib/systemd/system/sysinit.target").exists():
        pytest.skip("systemd-analyze or the host's unit tree is missing")
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "usr/lib/systemd").mkdir(parents=True)
    (root / "usr/lib/systemd/system").symlink_to("/usr/lib/systemd/system")
    bad = COORD_UNIT.read_text().replace("RestartSec=1", "RestartSecs=1")
    (root / "etc/systemd/system/flodl-coordinator@.service").write_text(bad)
    out = subprocess.run([tool, "verify", f"--root={root}", "flodl-coordinator@x.service"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "is not executable" in text and "RestartSecs" in text


def test_the_example_configs_load():
    s = load_settings(config_path=str(EXAMPLE_TOML), env={})
    assert (s.session, s.world_size) == ("example", 4) and s.http and s.bind.startswith("tcp://")
    env = dict(line.split("=", 1) for line in AGENT_ENV.read_text().splitlines() if line and not line.startswith("#"))
    used = set(re.findall(r"\$\{?(\w+)\}?", " ".join(_exec_start(AGENT_UNIT))))
    assert used <= set(env), f"the agent unit uses {sorted(used - set(env))}, which the example does not set"
    assert env["FLODL_SESSION"] == s.session and int(env["FLODL_WORLD_SIZE"]) == s.world_size
    assert all(re.fullmatch(r"[^#]*", v) for v in env.values()), "systemd takes a '#' after a value as the value"


def _compose_python() -> str | None:
    """The interpreter docker-compose runs on (its shebang): it has PyYAML and docker-py."""
    exe = shutil.which("docker-compose")
    if exe is None:
        return None
    first = Path(exe).read_text(errors="replace").split("\n", 1)[0]
    return first[2:].strip().split()[0] if first.startswith("#!") else None


def test_docker_compose_validates_the_rig():
    exe, py = shutil.which("docker-compose"), _compose_python()
    if exe is None or py is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose; .ci/run does)")
    out = subprocess.run([exe, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60,
                         cwd=COMPOSE.parent)  # fmt: skip
    assert out.returncode == 0, out.stderr
    to_json = "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"
    cfg = json.loads(subprocess.run([py, "-c", to_json], input=out.stdout, capture_output=True, text=True,
                                    check=True).stdout)  # fmt: skip
    services = cfg["services"]
    assert set(services) == {"coordinator", "host-a", "host-b"}
    assert {s["image"] for s in services.values()} == {"flodl:rig"}  # one shared image ...
    assert [n for n, s in services.items() if "build" in s] == ["coordinator"]  # ... built once
    assert all(s.get("restart", "no") != "no" for s in services.values())
    coord = services["coordinator"]
    journal = re.search(r"--journal (\S+)", coord["command"]).group(1)
    volume = next(v for v in coord["volumes"] if v.startswith("journal:"))
    assert journal.startswith(volume.split(":")[1] + "/") and "journal" in cfg["volumes"]


def test_the_build_context_leaves_out_the_venv_and_history(tmp_path):
    py = _compose_python()
    if py is None or subprocess.run([py, "-c", "import docker"], capture_output=True).returncode:
        pytest.skip("docker-py (docker-compose's library) is not installed")
    context = "import json, sys; from docker.utils.build import exclude_paths as x; " \
              "print(json.dumps(sorted(x(sys.argv[1], open(sys.argv[2]).read().splitlines(), 'docker/Dockerfile'))))"
    # A tree as a developer's checkout has it, with the virtualenv (1.2 GB) and .git.
    for rel in (".venv/lib/python3.11/site-packages/torch/big.so", ".git/objects/ab/cd", "flodl/__init__.py",
                "coordinator/pyproject.toml", "worker/flodl_worker/__init__.py", "pyproject.toml", "docker/Dockerfile",
                "tests/unit/test_x.py", "flodl/__pycache__/x.pyc"):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    shutil.copy(ROOT / ".dockerignore", tmp_path / ".dockerignore")
    sent = json.loads(subprocess.run([py, "-c", context, str(tmp_path), str(tmp_path / ".dockerignore")],
                                     capture_output=True, text=True, check=True).stdout)  # fmt: skip
    files = {p for p in sent if (tmp_path / p).is_file()}
    assert files == {".dockerignore", "flodl/__init__.py", "coordinator/pyproject.toml", "worker/flodl_worker/__init__.py",
                     "pyproject.toml", "docker/Dockerfile"}  # fmt: skip
