"""CURVE on the worker side: the rank's env, the agent's hand-off, the CLI's one-line errors."""

import pytest

from flodl.curve import keygen
from flodl_worker import cli
from flodl_worker._env import EnvError, RankEnv
from flodl_worker.agent import AgentConfig, rank_env

BASE = {"FLODL_RANK": "0", "FLODL_WORLD_SIZE": "1", "FLODL_CONNECT": "tcp://head:5555"}


@pytest.fixture
def pair(tmp_path):
    server_pub, _ = keygen(str(tmp_path), "coordinator")
    _, own_sec = keygen(str(tmp_path), "rank")
    return server_pub, own_sec


def test_rank_env_loads_both_keys_or_neither(pair):
    server_pub, own_sec = pair
    assert RankEnv.from_environ(BASE).curve is None
    cfg = RankEnv.from_environ({**BASE, "FLODL_CURVE_SERVER_KEY": server_pub, "FLODL_CURVE_SECRET_KEY": own_sec})
    assert cfg.curve is not None and len(cfg.curve.secret) == 40
    assert "secret=" not in repr(cfg)  # the secret never lands in a log line
    with pytest.raises(EnvError, match="FLODL_CURVE_SECRET_KEY is missing"):
        RankEnv.from_environ({**BASE, "FLODL_CURVE_SERVER_KEY": server_pub})
    with pytest.raises(EnvError, match="holds no secret key"):
        RankEnv.from_environ({**BASE, "FLODL_CURVE_SERVER_KEY": server_pub, "FLODL_CURVE_SECRET_KEY": server_pub})


def test_agent_gives_keys_only_to_ranks_that_dial_the_coordinator(pair):
    server_pub, own_sec = pair
    inherited = {"FLODL_CURVE_SERVER_KEY": server_pub, "FLODL_CURVE_SECRET_KEY": own_sec}
    cfg = AgentConfig(coordinator="tcp://head:5555", ranks=1, command=("true",),
                      curve_server_key=server_pub, curve_secret_key=own_sec)  # fmt: skip
    behind_relay = rank_env(cfg, 0, "ipc:///tmp/r.sock", inherited)
    assert "FLODL_CURVE_SERVER_KEY" not in behind_relay and "FLODL_CURVE_SECRET_KEY" not in behind_relay
    direct = rank_env(AgentConfig(**{**_fields(cfg), "no_relay": True}), 0, "tcp://head:5555", {})
    assert (direct["FLODL_CURVE_SERVER_KEY"], direct["FLODL_CURVE_SECRET_KEY"]) == (server_pub, own_sec)


def _fields(cfg):
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def test_cli_curve_errors_are_one_line_exit_2(pair, capsys, monkeypatch):
    server_pub, own_sec = pair
    monkeypatch.delenv("FLODL_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("FLODL_CURVE_SECRET_KEY", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["relay", "--coordinator", "tcp://h:1", "--bind", "ipc:///tmp/x", "--curve-server-key", server_pub])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--curve-secret-key is missing" in err and "\n" not in err
    with pytest.raises(SystemExit) as e:
        cli.main(["agent", "--coordinator", "tcp://h:1", "--ranks", "1", "--curve-server-key", "/nope.key",
                  "--curve-secret-key", own_sec, "--", "true"])  # fmt: skip
    assert e.value.code == 2
    assert "/nope.key does not exist" in capsys.readouterr().err
