"""FLODL_* variables: a typo of a coordinator key stops the service; the worker's own pass."""

import re
from pathlib import Path

import pytest

from flodl.envvars import WORKER_ENV
from flodl_coordinator.settings import Settings, SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[3]


def test_a_typo_of_a_coordinator_key_in_the_environment_is_refused_with_the_closest_key():
    with pytest.raises(SettingsError, match=r"unknown variable FLODL_EPOCH in the environment \(did you mean FLODL_EPOCHS\?\)"):
        load_settings(env={"FLODL_EPOCH": "3"}, flags={"world_size": 2})
    with pytest.raises(SettingsError, match=r"FLODL_LIVENESS_TIMEOUT\b.*did you mean FLODL_LIVENESS_TIMEOUT_S"):
        load_settings(env={"FLODL_LIVENESS_TIMEOUT": "3"}, flags={"world_size": 2})
    with pytest.raises(SettingsError, match=r"unknown variable FLODL_ZQXJ in the environment;"):
        load_settings(env={"FLODL_ZQXJ": "1"}, flags={"world_size": 2})


def test_a_typo_in_the_file_suggests_the_closest_key(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("world_size = 2\nepoch = 3\n")
    with pytest.raises(SettingsError, match=r"unknown key 'epoch' in .*run.toml \(did you mean epochs\?\)"):
        load_settings(config_path=str(cfg), env={})


def test_the_worker_sides_variables_share_the_coordinators_environment():
    env = {name: "x" for name in WORKER_ENV - {"FLODL_WORLD_SIZE", "FLODL_SESSION", "FLODL_CURVE_SECRET_KEY"}}
    s = load_settings(env={**env, "FLODL_EPOCHS": "4", "PATH": "/bin"}, flags={"world_size": 2})
    assert s.epochs == 4


def test_every_flodl_variable_the_source_reads_is_a_coordinator_key_or_a_worker_variable():
    keys = {"FLODL_" + name.upper() for name in Settings.__dataclass_fields__}
    used: dict[str, str] = {}
    for top in ("flodl", "worker/flodl_worker", "coordinator/flodl_coordinator", "bench"):
        for f in (ROOT / top).rglob("*.py"):
            for name in re.findall(r"\bFLODL_[A-Z0-9_]*[A-Z0-9]\b", f.read_text(encoding="utf-8")):
                used.setdefault(name, str(f.relative_to(ROOT)))
    assert "FLODL_RANK" in used and "FLODL_TRACE_DIR" in used  # the scan sees the rank's variables
    unknown = {n: where for n, where in used.items() if n not in keys and n not in WORKER_ENV}
    assert not unknown, f"add these to flodl/envvars.py WORKER_ENV (or make them settings): {unknown}"
