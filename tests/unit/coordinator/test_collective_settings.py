"""--plane collective: settings, flags and their one-line errors (coordinator and launcher)."""

from __future__ import annotations

import pytest

from flodl.cli import main as flodl_main
from flodl_coordinator.cli import main as coordinator_main
from flodl_coordinator.settings import SettingsError, load_settings


def test_collective_settings_reach_the_core_config():
    s = load_settings(
        env={"FLODL_COLLECTIVE_TIMEOUT_S": "12.5"},
        flags={"world_size": 3, "plane": "collective", "collective_backend": "nccl"},
    )
    c = s.core_config()
    assert (c.plane, c.collective_backend, c.collective_timeout_s) == ("collective", "nccl", 12.5)
    d = load_settings(env={}, flags={"world_size": 2}).core_config()
    assert (d.plane, d.collective_backend, d.collective_timeout_s) == ("bus", "gloo", 60.0)


@pytest.mark.parametrize(
    "flags, match",
    [
        ({"plane": "ring"}, r"^config error: plane must be one of \('bus', 'collective'\), got 'ring'$"),
        ({"plane": "collective", "collective_backend": "mpi"}, r"^config error: collective_backend must be one of"),
        ({"plane": "collective", "collective_timeout_s": 0}, r"^config error: collective_timeout_s must be > 0"),
        ({"plane": "collective", "bf16_wire": True}, r"^config error: bf16_wire needs plane = bus"),
    ],
)
def test_bad_collective_settings_are_one_line(flags, match):
    with pytest.raises(SettingsError, match=match) as e:
        load_settings(env={}, flags={"world_size": 2, **flags})
    assert "\n" not in str(e.value)


def test_coordinator_cli_refuses_a_bad_plane_in_one_line(capsys):
    assert coordinator_main(["serve", "--world-size", "2", "--plane", "collective", "--collective-backend", "mpi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flodl-coordinator: config error: collective_backend must be one of") and "\n" not in err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--collective-backend", "nccl"], "--collective-backend and --collective-timeout need --plane collective"),
        # The launcher checks its settings with the coordinator's own rules (issue 10: it no
        # longer re-declares them), so these are the coordinator's one-line messages.
        (["--plane", "collective", "--collective-timeout", "0"], "config error: collective_timeout_s must be > 0"),
        (["--plane", "collective", "--bf16-wire"], "config error: bf16_wire needs plane = bus"),
        (["--plane", "collective", "--outer-optimizer", "slowmo"], "config error: outer_optimizer needs plane = bus"),
    ],
)
def test_launcher_refuses_inconsistent_plane_flags_before_starting_anything(capsys, argv, match):
    assert flodl_main(["run", "--local", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flodl: ") and match in err and "\n" not in err


def test_launcher_plane_flag_is_a_choice(capsys):
    with pytest.raises(SystemExit) as e:
        flodl_main(["run", "--local", "--plane", "ring"])
    assert e.value.code == 2
    assert "invalid choice: 'ring'" in capsys.readouterr().err
