"""`flodl-coordinator serve` start-up errors are one line and exit 2 (the systemd unit's
RestartPreventExitStatus), and the effective configuration is logged at start."""

import os
import socket
import subprocess
import sys

import zmq

from flodl_coordinator.cli import describe
from flodl_coordinator.settings import load_settings


def _serve(*args, env_extra=None, timeout=30):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "flodl_coordinator", "serve", "--world-size", "2", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " INFO " not in line and " WARNING " not in line]


def test_a_busy_zeromq_port_is_one_line_naming_the_address_and_exit_2():
    ctx = zmq.Context()
    holder = ctx.socket(zmq.ROUTER)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        proc = _serve("--bind", f"tcp://127.0.0.1:{port}", env_extra={"FLODL_EPOCHS": "7"})
    finally:
        holder.close(0)
        ctx.term()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = _errors(proc.stderr)
    assert len(errors) == 1, proc.stderr
    assert f"cannot bind tcp://127.0.0.1:{port}: Address already in use" in errors[0]
    assert "--bind" in errors[0]
    # (d) the effective configuration, all sources merged, was logged before that.
    line = next(x for x in proc.stderr.splitlines() if "INFO settings: " in x)
    assert f"bind=tcp://127.0.0.1:{port} " in line and " epochs=7 " in line and " world_size=2 " in line


def test_a_busy_http_port_is_one_line_naming_the_address_and_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _serve("--bind", "tcp://127.0.0.1:0", "--http", f"127.0.0.1:{port}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = _errors(proc.stderr)
    assert len(errors) == 1 and f"cannot serve http on 127.0.0.1:{port}: Address already in use" in errors[0], errors
    assert "--http" in errors[0]


def test_a_typo_in_the_environment_stops_serve_with_exit_2():
    proc = _serve("--bind", "tcp://127.0.0.1:0", env_extra={"FLODL_EPOCH": "3"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "flodl-coordinator: config error: unknown variable FLODL_EPOCH in the environment (did you mean "
        "FLODL_EPOCHS?); FLODL_<KEY> must name a coordinator key (README, Configuration) or a worker variable"
    ]


def test_describe_lists_every_setting_once():
    s = load_settings(env={}, flags={"world_size": 3, "session": "abc"})
    words = describe(s).split(" ")
    assert "world_size=3" in words and "session=abc" in words and "journal=" in words
    assert len(words) == len(s.__dataclass_fields__)
