"""``flodl``: the local launcher.

    flodl run --local --ranks 3 --task digits --slowdown 1,2,4

starts a coordinator, one host agent (which starts the relay and the ranks) on this
machine, streams progress, prints the run summary and optionally writes it as JSON.
It only starts processes: every component it runs is a service you can also start
by hand on separate hosts (see README).

SIGTERM or SIGINT (Ctrl-C) stops the whole tree: the coordinator first (it asks the
ranks to shut down and writes the summary), then the agent, each within a bound, then
SIGKILL for what is left; the summary so far is printed and the exit code is 128 +
the signal. The children run in their own sessions and die with the launcher
(PR_SET_PDEATHSIG, ``flodl.procutil``), kill -9 included.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from flodl import strictjson

from .procutil import death_signal_hook

__all__ = ["main"]

TASKS = {
    "digits": "flodl_worker.examples.digits",
    "synthetic": "flodl_worker.examples.synthetic",
}


class LaunchError(Exception):
    pass


def _slowdowns(text: str, ranks: int) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LaunchError(f"--slowdown {text!r} must be comma-separated numbers, e.g. 1,2,4") from None
    if not vals:
        vals = [1.0]
    if any(v < 0 for v in vals):
        raise LaunchError(f"--slowdown {text!r}: factors must be >= 0")
    if len(vals) == 1:
        vals = vals * ranks
    if len(vals) != ranks:
        raise LaunchError(f"--slowdown has {len(vals)} factors for {ranks} ranks (give one, or one per rank)")
    return vals


# Settings the launcher sets itself, from its own flags (key -> how). Every other key of
# the coordinator's settings schema (flodl_coordinator.settings.SCHEMA) is a `flodl run`
# flag too, derived from the schema and forwarded to `flodl-coordinator serve` as given:
# the defaults, checks and --help text are the coordinator's.
LAUNCHER_KEYS = {
    "world_size": "--ranks",
    "bind": "--port (on 127.0.0.1)",
    "session": "a fresh one per run",
    "summary": "--summary (the launcher's report: the coordinator's summary plus the launcher's fields)",
    "curve_secret_key": "--curve",
    "curve_allowed_keys": "--curve",
}
# Paths the coordinator is handed absolute (the same files, whatever its working directory).
_PATH_KEYS = ("checkpoint_dir", "resume", "dashboard_out", "status_out")


def _settings_module():
    """``flodl_coordinator.settings``: the launcher sits on top of every package (ARCHITECTURE §2)."""
    try:
        from flodl_coordinator import settings
    except ImportError as e:
        raise LaunchError(f"flodl run needs the coordinator package (pip install flodl-coordinator): {e}") from None
    return settings


def forwarded_keys() -> list[str]:
    """The coordinator settings ``flodl run`` takes as flags and forwards."""
    return [k for k in _settings_module().SCHEMA if k not in LAUNCHER_KEYS]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flodl", description="flodl launcher")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a training job", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    r.add_argument("--local", action="store_true", required=True, help="all processes on this machine")
    r.add_argument("--ranks", type=int, default=3, help="number of ranks (default 3; the world size)")
    r.add_argument("--task", choices=sorted(TASKS), default="digits", help="example task (default digits)")
    r.add_argument("--slowdown", default="1", help="per-rank emulated slowdown factors, e.g. 1,2,4")
    r.add_argument("--base-ms", type=float, default=10.0, help="emulated ms per batch per slowdown unit (10)")
    r.add_argument("--port", type=int, default=0,
                   help="coordinator TCP port on 127.0.0.1 (0, the default: a private ipc:// socket in the run's "
                   "temp dir instead)")
    r.add_argument("--summary", help="write the run summary JSON to this path")
    r.add_argument("--trace-dir", help="ranks write the sample ids they train here (coverage audit)")
    r.add_argument("--no-fold", action="store_true", help="the relay forwards averaging rounds unfolded")
    r.add_argument("--curve", action="store_true",
                   help="CURVE on the coordinator's socket with throwaway keys made in the run's temp dir "
                   "(the agent and its relay get a client key; loopback needs none, this exercises it)")
    r.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    r.add_argument("--quiet", action="store_true", help="only print the summary")
    g = r.add_argument_group(
        "coordinator settings",
        "forwarded to flodl-coordinator serve (README, Configuration); also read from FLODL_<KEY>",
    )
    _settings_module().add_flags(g, forwarded_keys(), choices=True)
    r.add_argument("task_args", nargs=argparse.REMAINDER, help="-- extra arguments for the task script")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        return _run_local(args)
    except LaunchError as e:
        print(f"flodl: {e}", file=sys.stderr)
        return 2


def coordinator_flags(args) -> list[str]:
    """The forwarded settings ``args`` gives, as ``flodl-coordinator serve`` flags."""
    given = {k: getattr(args, k) for k in forwarded_keys()}
    for k in _PATH_KEYS:
        if given.get(k):
            given[k] = os.path.abspath(given[k])
    return _settings_module().flag_argv(given)


def _check(args):
    """The run's settings, checked with the coordinator's own rules before anything starts."""
    if args.ranks < 1:
        raise LaunchError(f"--ranks must be >= 1, got {args.ranks}")
    mod = _settings_module()
    given = {k: getattr(args, k) for k in forwarded_keys()}
    try:
        settings = mod.load_settings(env=os.environ, flags={**given, "world_size": args.ranks})
    except mod.SettingsError as e:
        raise LaunchError(str(e)) from None
    if settings.plane != "collective" and (args.collective_backend or args.collective_timeout_s is not None):
        raise LaunchError("--collective-backend and --collective-timeout need --plane collective")
    return settings


def _final_view_flags(args) -> list[str]:
    """The coordinator's last status and dashboard go beside the launcher's --summary (the
    coordinator's own summary lives in a temporary directory), unless placed elsewhere."""
    if not args.summary:
        return []
    stem = os.path.abspath(args.summary[: -len(".json")] if args.summary.endswith(".json") else args.summary)
    out = []
    if not args.dashboard_out:
        out += ["--dashboard-out", f"{stem}.dashboard.html"]
    if not args.status_out:
        out += ["--status-out", f"{stem}.status.json"]
    return out


def _pump(stream, prefix: str, quiet: bool, sink: list | None = None) -> None:
    for raw in iter(stream.readline, ""):
        line = raw.rstrip("\n")
        if sink is not None:
            sink.append(line)
        if not quiet:
            print(f"{prefix}{line}", flush=True)


def _run_local(args) -> int:
    settings = _check(args)
    slow = _slowdowns(args.slowdown, args.ranks)
    session = "local-" + secrets.token_hex(6)
    workdir = tempfile.mkdtemp(prefix="flodl-run-")
    summary_path = os.path.join(workdir, "summary.json")
    py = sys.executable
    # An address known before the coordinator binds, so that the agent (relay, ranks:
    # torch takes seconds to import) starts beside it instead of after it.
    endpoint = f"tcp://127.0.0.1:{args.port}" if args.port else f"ipc://{workdir}/coordinator.sock"
    coord_cmd = [
        py, "-m", "flodl_coordinator", "serve",
        "--bind", endpoint,
        "--session", session,
        "--world-size", str(args.ranks),
        "--summary", summary_path,
        *coordinator_flags(args),
        *_final_view_flags(args),
    ]  # fmt: skip
    agent_curve: list[str] = []
    if args.curve:
        coord_curve, agent_curve = _throwaway_keys(workdir)
        coord_cmd += coord_curve
    t0 = time.monotonic()
    stop = _StopSignals()
    # Own sessions: a terminal's Ctrl-C reaches only this launcher, which stops the tree
    # in order; PR_SET_PDEATHSIG: a launcher killed outright takes its children along.
    spawn = dict(text=True, bufsize=1, start_new_session=True, preexec_fn=death_signal_hook())
    coord = subprocess.Popen(coord_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **spawn)
    coord_started = time.monotonic() - t0  # its timeline_s counts from here
    procs = [coord]
    pumps: list[threading.Thread] = []
    rc = 1
    try:
        extra = [a for a in args.task_args if a != "--"]
        agent_cmd = [
            py, "-m", "flodl_worker", "agent",
            "--coordinator", endpoint,
            "--ranks", str(args.ranks),
            "--world-size", str(args.ranks),
            "--session", session,
            "--slowdown", ",".join(f"{s:g}" for s in slow),
            "--base-ms", f"{args.base_ms:g}",
        ]  # fmt: skip
        if args.trace_dir:
            agent_cmd += ["--trace-dir", args.trace_dir]
        if args.no_fold:
            agent_cmd += ["--no-fold"]
        agent_cmd += agent_curve
        agent_cmd += ["--", py, "-m", TASKS[args.task], *extra]
        # The agent dials the coordinator's address while it comes up (ZeroMQ retries).
        agent = subprocess.Popen(agent_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **spawn)
        procs.append(agent)
        pumps.append(threading.Thread(target=_pump, args=(agent.stdout, "[agent] ", args.quiet), daemon=True))
        pumps[-1].start()
        # Still awaited: a coordinator that cannot start is reported, and the agent stopped.
        ready = _await_ready(coord, "COORDINATOR_READY", deadline=t0 + 60, stop=stop)
        pumps.append(threading.Thread(target=_pump, args=(coord.stderr, "[coordinator] ", args.quiet), daemon=True))
        pumps[-1].start()
        if ready is not None:
            rc = _wait_all(procs, t0 + args.timeout, stop)
    finally:
        if stop.signum is not None or any(p.poll() is None for p in procs):
            _stop_tree(procs, stop)
        stop.restore()
    for t in pumps:  # the children's last lines before the summary
        t.join(timeout=2)
    if stop.signum is not None:
        name = signal.Signals(stop.signum).name
        print(f"flodl: stopped by {name} before the run completed", file=sys.stderr, flush=True)
        rc = 128 + stop.signum
    wall = time.monotonic() - t0
    return _report(args, settings, summary_path, rc, wall, coord_started)


# After a stop signal: the coordinator asks the ranks to shut down and writes its summary
# (it gives them liveness_timeout_s at most); the agent then ends once its ranks have left
# (it gives a rank --term-timeout, 10 s, after SIGTERM, then stops its relay). Past these
# bounds the rest is killed.
COORDINATOR_STOP_S = 20.0
AGENT_SETTLE_S = 5.0
AGENT_STOP_S = 20.0


class _StopSignals:
    """SIGTERM / SIGINT to the launcher: the handler only notes the signal; the waiting
    loops see it and stop the tree (``_stop_tree``). A second signal: kill at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handler(self, signum, _frame) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum

    @property
    def hurry(self) -> bool:
        return self.count >= 2

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _wait_until(done, deadline: float, stop: _StopSignals) -> bool:
    while not done():
        if time.monotonic() >= deadline or stop.hurry:
            return False
        time.sleep(0.05)  # polling child exit codes
    return True


def _stop_tree(procs, stop: _StopSignals) -> None:
    """Stop the coordinator (SIGTERM: it shuts the ranks down and writes the summary),
    then the agent, each within a bound; SIGKILL what is left (the agent's relay and
    ranks then get SIGTERM from their PR_SET_PDEATHSIG)."""
    coord, agents = procs[0], procs[1:]
    if stop.signum is not None:
        print(f"flodl: {signal.Signals(stop.signum).name}: stopping the run (the coordinator asks the ranks "
              f"to shut down; a second signal kills at once)", file=sys.stderr, flush=True)
    _signal(coord, signal.SIGTERM)
    _wait_until(lambda: coord.poll() is not None, time.monotonic() + COORDINATOR_STOP_S, stop)
    gone = lambda: all(a.poll() is not None for a in agents)  # noqa: E731
    if not _wait_until(gone, time.monotonic() + AGENT_SETTLE_S, stop):
        for a in agents:
            _signal(a, signal.SIGTERM)
        _wait_until(gone, time.monotonic() + AGENT_STOP_S, stop)
    for p in procs:
        if p.poll() is None:
            print(f"flodl: {' '.join(p.args[1:5])} did not stop in time: SIGKILL", file=sys.stderr, flush=True)
            p.kill()
        p.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _throwaway_keys(workdir: str) -> tuple[list[str], list[str]]:
    """CURVE certificates for one local run: (coordinator flags, agent flags)."""
    from .curve import CurveError, keygen

    keys = os.path.join(workdir, "curve")
    allowed = os.path.join(keys, "allowed")
    try:
        server_public, server_secret = keygen(keys, "coordinator")
        host_public, host_secret = keygen(keys, "host")
        os.makedirs(allowed)
        shutil.copy(host_public, allowed)  # the allowlist: the host's public certificate
    except (CurveError, OSError, ImportError) as e:
        raise LaunchError(f"--curve: cannot make keys: {e}") from None
    coord = ["--curve-secret-key", server_secret, "--curve-allowed-keys", allowed]
    agent = ["--curve-server-key", server_public, "--curve-secret-key", host_secret]
    return coord, agent


def _await_ready(proc, token: str, deadline: float, stop: _StopSignals) -> str | None:
    """The endpoint the coordinator prints once bound; None if a stop signal came first."""
    while time.monotonic() < deadline:
        if stop.signum is not None:
            return None
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.poll() is not None else ""
            raise LaunchError(f"coordinator exited before it was ready: {err.strip()[-2000:]}")
        if line.startswith(token):
            return line.split()[1]
    raise LaunchError("coordinator did not become ready within 60 s")


def _wait_all(procs, deadline: float, stop: _StopSignals) -> int:
    """The coordinator's exit code once the run ended; on a stop signal, return at once
    (the caller stops the tree)."""
    coord = procs[0]
    while time.monotonic() < deadline and stop.signum is None:
        if coord.poll() is not None:
            # Give the agent a bounded moment to see its ranks leave.
            _wait_until(lambda: all(p.poll() is not None for p in procs[1:]), time.monotonic() + 30, stop)
            return coord.returncode
        if all(p.poll() is not None for p in procs[1:]) and len(procs) > 1:
            # Every rank is gone: the coordinator notices (agent reports / liveness).
            if not _wait_until(lambda: coord.poll() is not None, time.monotonic() + 60, stop):
                _stop_tree(procs, stop)
            return coord.returncode if coord.returncode is not None else 1
        time.sleep(0.2)  # polling child exit codes, not synchronising with them
    if stop.signum is not None:
        return 1
    print("flodl: run timed out; stopping", file=sys.stderr)
    return 124


def _report(args, settings, summary_path: str, rc: int, wall: float, coord_started: float = 0.0) -> int:
    try:
        with open(summary_path, encoding="utf-8") as fh:
            summary = json.load(fh)
    except (OSError, json.JSONDecodeError):
        print(f"flodl: the run produced no summary (coordinator exit code {rc})", file=sys.stderr)
        return rc or 1
    summary["launcher_wall_s"] = round(wall, 3)
    # From the launcher's start to the first batch, and from the run's end to the
    # launcher's (the coordinator's timeline counts from its own start).
    timeline = summary.get("timeline_s") or {}
    if "first_batch" in timeline:
        summary["time_to_first_batch_s"] = round(coord_started + timeline["first_batch"], 3)
    if "run_finished" in timeline:
        summary["teardown_s"] = round(wall - coord_started - timeline["run_finished"], 3)
    summary.setdefault("task", args.task)
    summary["slowdown"] = args.slowdown
    summary.setdefault("plane", settings.plane)
    train_wall = summary.get("wall_s") or wall
    committed = sum(e.get("trained", 0) - e.get("duplicates", 0) for e in summary.get("coverage", []))
    summary.setdefault("samples_per_s", round(committed / train_wall, 2) if train_wall else 0.0)
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as fh:
            fh.write(strictjson.dumps(summary, indent=2, sort_keys=True))
    _print_summary(summary)
    ok = bool(summary.get("ok")) and rc == 0
    return 0 if ok else (rc or 1)


def _print_summary(s: dict) -> None:
    print("\n=== flodl run summary ===")
    print(f"ok: {s.get('ok')}  ({s.get('reason')})")
    acc = s.get("accuracy")
    print(f"task: {s.get('task')}  policy: {s.get('policy')}  plane: {s.get('plane')}  ranks: {s.get('world_size')}  slowdown: {s.get('slowdown')}")
    print(f"wall: {s.get('wall_s')} s   samples/s: {s.get('samples_per_s')}   averages: {s.get('averages')}")
    print(f"launcher: {s.get('launcher_wall_s')} s   time to first batch: {s.get('time_to_first_batch_s')} s   "
          f"teardown: {s.get('teardown_s')} s")
    print(f"accuracy: {acc if acc is None else round(acc, 4)}")
    for r in s.get("ranks", []):
        print(f"  rank {r.get('rank')}: samples {r.get('samples')}  batches {r.get('batches')}")
    cov = s.get("coverage", [])
    exact = all(c.get("duplicates") == 0 and c.get("missing") == 0 for c in cov) and bool(cov)
    print(f"coverage: {len(cov)} epochs, every sample exactly once: {exact}")


if __name__ == "__main__":
    sys.exit(main())
