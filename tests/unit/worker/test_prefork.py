"""The prefork server (``flodl_worker.prefork``) and the agent's view of its children
(``flodl_worker.forked``): a forked rank runs its command as a fresh interpreter would
-- argv, environment, cwd, ``sys.path[0]``, ``__main__``, stdio, exit code, its own
session -- with torch already imported, and the agent sees it through the ``Popen``
subset it uses: poll / wait / returncode / send_signal, and a server that dies."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from flodl_worker.forked import Prefork

def _start() -> Prefork:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    env["PYTHONUNBUFFERED"] = "1"
    return Prefork.start(env)


@pytest.fixture(scope="module")
def server():
    srv = _start()  # one for the module: each costs a torch import
    yield srv
    srv.close()


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan waits for whoever adopts it to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _finish(child, timeout: float = 60.0) -> tuple[int, str, str]:
    code = child.wait(timeout)
    return code, child.stdout.read().decode(), child.stderr.read().decode()


def test_a_forked_script_runs_as_a_fresh_interpreter_would_with_torch_already_imported(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path, """
        import os, sys
        print("preloaded", "torch" in sys.modules)
        print("main", __name__)
        print("argv", sys.argv)
        print("path0", sys.path[0])
        print("cwd", os.getcwd())
        print("env", os.environ.get("FLODL_LOCAL_RANK"), os.environ.get("FLODL_ONLY_HERE"))
        print("session", os.getsid(0) == os.getpid())
        print("oops", file=sys.stderr)
        sys.exit(3)
    """)
    env = dict(server.env, FLODL_LOCAL_RANK="1", FLODL_ONLY_HERE="yes")
    argv = [sys.executable, script, "--lr", "0.1"]
    assert server.serves(argv, env)
    child = server.spawn(argv, env)
    code, out, err = _finish(child)
    assert code == 3 and child.returncode == 3 and child.poll() == 3
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    assert lines["preloaded"] == "True"  # imported by the server, not by the job
    assert lines["main"] == "__main__"
    assert lines["argv"] == repr([script, "--lr", "0.1"])
    assert lines["path0"] == str(tmp_path) and lines["cwd"] == str(tmp_path)
    assert lines["env"] == "1 yes"
    assert lines["session"] == "True"
    assert err.strip() == "oops"


def test_a_module_runs_with_minus_m_semantics_and_an_uncaught_error_exits_1_with_its_traceback(server, tmp_path,
                                                                                             monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobmod.py").write_text("import sys\nprint(__name__, sys.argv[1:])\nraise ValueError('bad input')\n")
    argv = [sys.executable, "-m", "jobmod", "a", "b"]
    child = server.spawn(argv, dict(server.env))
    code, out, err = _finish(child)
    assert code == 1
    assert out.strip() == "__main__ ['a', 'b']"
    assert "Traceback" in err and "ValueError: bad input" in err


def test_signals_reach_the_child_and_its_death_reads_as_popen_s(server, tmp_path):
    script = _script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    child = server.spawn([sys.executable, script], dict(server.env))
    assert child.stdout.readline() == b"up\n"
    assert child.poll() is None and child.pid is not None
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM
    child.send_signal(signal.SIGKILL)  # ended: nothing is sent (its pid may be another's)


def _proc_words(pid: int, name: str) -> list[bytes]:
    with open(f"/proc/{pid}/{name}", "rb") as fh:
        return [w for w in fh.read().split(b"\0") if w]  # the room beyond them reads as NULs


def test_ps_and_proc_environ_show_a_forked_child_s_own_command_and_environment(server, tmp_path):
    """What finds a fresh rank (ps, pgrep -f, /proc/PID/environ) finds a forked one."""
    script = _script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    argv = [sys.executable, script, "--tag", "x" * 300]
    env = dict(server.env, FLODL_RANK="5", FLODL_TRACE_DIR=str(tmp_path))
    child = server.spawn(argv, env)
    try:
        assert child.stdout.readline() == b"up\n"
        assert child.poll() is None and child.pid is not None  # (the server said its pid before it ran)
        assert _proc_words(child.pid, "cmdline") == [os.fsencode(a) for a in argv]
        shown = _proc_words(child.pid, "environ")
        assert sorted(shown) == sorted(os.fsencode(f"{k}={v}") for k, v in env.items())
        assert not any(w.startswith(b"FLODL_PREFORK_ROOM") for w in shown)
        # The server itself shows its command, not the room it keeps for its children.
        assert _proc_words(server.proc.pid, "cmdline")[-1] != b" " * 4096
    finally:
        child.kill()
        child.wait(30)


def test_a_forked_child_can_use_the_gpu_as_a_fresh_interpreter_would(server, tmp_path):
    """The preload runs no torch op and initialises no CUDA: a fork after CUDA's
    initialisation leaves the child unable to use it ('Cannot re-initialize CUDA in forked
    subprocess'). Here without a GPU the child must still not be in a bad fork, and say
    what a fresh interpreter says; on a GPU host it puts a tensor on the device."""
    script = _script(tmp_path, """
        import torch
        print("bad_fork", torch.cuda._is_in_bad_fork())
        ok = torch.cuda.is_available()
        print("available", ok)
        print("value", torch.ones(1, device="cuda").add(1).item() if ok else None)
    """)
    child = server.spawn([sys.executable, script], dict(server.env))
    code, out, err = _finish(child)
    assert code == 0, err
    fresh = subprocess.run([sys.executable, script], capture_output=True, text=True, env=dict(server.env), timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    assert out == fresh.stdout and "bad_fork False" in out


def test_a_command_too_long_to_show_as_its_own_is_not_forked(server, tmp_path):
    script = _script(tmp_path, "pass\n")
    assert not server.serves([sys.executable, script, "x" * 5000], dict(server.env))
    assert not server.serves([sys.executable, script], dict(server.env, FLODL_BIG="y" * 20000))


def test_a_wait_that_runs_out_raises_timeout_expired(server, tmp_path):
    script = _script(tmp_path, "import time\ntime.sleep(60)\n")
    child = server.spawn([sys.executable, script], dict(server.env))
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.3)
    child.kill()
    assert child.wait(30) == -signal.SIGKILL


def test_only_this_python_running_a_module_or_a_script_in_the_server_s_environment_is_forked(server, tmp_path):
    script = _script(tmp_path, "pass\n")
    assert Prefork.eligible([sys.executable, "-m", "flodl_worker.examples.digits"])
    assert Prefork.eligible([sys.executable, script])
    assert not Prefork.eligible([sys.executable, "-c", "print(1)"])  # interpreter options: a fresh one
    assert not Prefork.eligible([sys.executable, "-u", script])
    assert not Prefork.eligible([sys.executable, "-m"])
    assert not Prefork.eligible(["/bin/sh", script])
    assert not Prefork.eligible([sys.executable, str(tmp_path / "missing.py")])
    assert server.serves([sys.executable, script], dict(server.env, FLODL_RANK="4"))
    # torch read OMP_NUM_THREADS (and may read others) when the server imported it
    assert not server.serves([sys.executable, script], dict(server.env, OMP_NUM_THREADS="7"))


def test_a_server_that_dies_takes_its_children_and_says_so(tmp_path, caplog):
    server = _start()
    script = _script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    child = server.spawn([sys.executable, script], dict(server.env))
    assert child.stdout.readline() == b"up\n"
    pid = child.pid
    os.kill(server.proc.pid, signal.SIGKILL)
    with caplog.at_level(logging.ERROR, logger="flodl.agent"):
        assert child.wait(30) == -signal.SIGKILL
    assert server.dead and not server.serves([sys.executable, script], dict(server.env))
    assert "prefork server exited (signal 9) with 1 rank(s)" in caplog.text
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # its death signal (SIGTERM) ended the child too
        if not _running(pid):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the forked child {pid} outlived its server")
