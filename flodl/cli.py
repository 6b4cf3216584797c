"""``flodl``: the local launcher.

    flodl run --local --ranks 3 --task digits --slowdown 1,2,4
    flodl run --local --ranks 3 -- python train.py --lr 0.1
    flodl run --local --ranks 3 -- python -m flodl_worker.examples.cnn

starts a coordinator, one host agent (which starts the relay and the ranks) on this
machine, streams progress, prints the run summary and optionally writes it as JSON.
It only starts processes: every component it runs is a service you can also start
by hand on separate hosts (see README).

The ranks run the command after ``--`` (any script that calls
``flodl_worker.run_rank``), with the rank environment the agent gives each one
(FLODL_RANK, FLODL_CONNECT, ...); ``--task NAME`` is a shortcut for a bundled example,
and arguments after ``--`` that start with ``-`` go to that example. A rank that fails
is said the moment it ends (exit code, last stderr line). Ranks that all
end before the run did (a script that fails at import, or exits without training) are
reported at once: each one's exit code and last stderr lines, in the output, the
summary (``rank_exits``) and the exit code. At the end of a successful run the model
the final eval measured is written to ``--output`` (default: beside ``--summary``, else
in the run's temporary directory): ``model.pt`` (a plain ``state_dict``) + ``model.json``.

SIGTERM or SIGINT (Ctrl-C) stops the whole tree: the coordinator first (it asks the
ranks to shut down and writes the summary), then the agent, each within a bound, then
SIGKILL for what is left; the summary so far is printed and the exit code is 128 +
the signal. The children run in their own sessions and die with the launcher
(PR_SET_PDEATHSIG, ``flodl.procutil``), kill -9 included.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from flodl import statusfetch, statustable, strictjson

from .liveview import LiveView
from .procutil import death_signal_hook

__all__ = ["main"]

TASKS = {
    "digits": "flodl_worker.examples.digits",
    "synthetic": "flodl_worker.examples.synthetic",
}


class LaunchError(Exception):
    pass


DEFAULT_STATUS_HTTP = "127.0.0.1:8080"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_LEVEL_RX = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")


def shown(line: str, level: str) -> bool:
    """Whether a child's log line is at or above ``level`` (a line naming no level -- a
    traceback, a print -- always is)."""
    m = _LEVEL_RX.search(line)
    if m is None:
        return True
    order = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    return order.index(m.group(1)) >= order.index(level)


def fetch_status(hostport: str, timeout: float = 5.0) -> dict:
    """GET http://HOSTPORT/status; a coordinator that cannot be reached is a LaunchError saying why."""
    try:
        return statusfetch.fetch(hostport, timeout)
    except statusfetch.StatusUnreachable as e:
        raise LaunchError(f"{e} (is the coordinator running with --http {statusfetch.host_of(hostport)}?)") from None


def _status(args) -> int:
    doc = fetch_status(args.http, args.timeout)
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    try:
        print(statustable.render(doc))
    except statustable.StatusSchemaError as e:
        raise LaunchError(str(e)) from None
    return 0


@dataclass(frozen=True, slots=True)
class RankCommand:
    """What every rank process runs, and how the summary names it (``task``)."""

    argv: tuple[str, ...]
    label: str


def rank_command(task: str | None, rest: list[str], python: str) -> RankCommand:
    """The ranks' command from ``--task`` and what follows ``--``: a command (its first
    word does not start with ``-``) runs as given; else ``--task`` (default digits) with
    ``rest`` as the example's arguments."""
    rest = rest[1:] if rest[:1] == ["--"] else list(rest)
    if rest and not rest[0].startswith("-"):
        if task is not None:
            raise LaunchError(f"give --task {task} or a command after -- ({' '.join(rest[:2])} ...), not both")
        return RankCommand(tuple(rest), _label(rest))
    task = task or "digits"
    return RankCommand((python, "-m", TASKS[task], *rest), task)


def _label(argv: list[str]) -> str:
    """``python train.py ...`` -> ``train.py``; ``python -m pkg.mod`` -> ``pkg.mod``; else the program."""
    words = argv[1:] if os.path.basename(argv[0]).startswith("python") else argv
    for i, w in enumerate(words):
        if w == "-m" and i + 1 < len(words):
            return words[i + 1]
        if not w.startswith("-"):
            return os.path.basename(w)
    return os.path.basename(argv[0])


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


class RankSpan:
    """``--ranks N`` (a fixed world of N) or ``--ranks MIN:MAX`` (torchrun's ``--nnodes
    MIN:MAX``): the world forms with at least MIN ranks and holds at most MAX. The local
    agent starts MIN ranks; slots MIN..MAX-1 stay open for agents started by hand."""

    __slots__ = ("lo", "hi")

    def __init__(self, text: str) -> None:
        head, sep, tail = str(text).partition(":")
        try:
            lo = int(head)
            hi = int(tail) if sep else lo
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX (e.g. 3, or 2:4)") from None
        if not 1 <= lo <= hi:
            raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
        self.lo, self.hi = lo, hi

    @property
    def elastic(self) -> bool:
        return self.lo < self.hi

    def __repr__(self) -> str:
        return f"{self.lo}:{self.hi}" if self.elastic else str(self.lo)


# Settings the launcher sets itself, from its own flags (key -> how). Every other key of
# the coordinator's settings schema (flodl_coordinator.settings.SCHEMA) is a `flodl run`
# flag too, derived from the schema and forwarded to `flodl-coordinator serve` as given:
# the defaults, checks and --help text are the coordinator's.
LAUNCHER_KEYS = {
    "world_size": "--ranks (MAX of MIN:MAX)",
    "min_ranks": "--ranks (MIN of MIN:MAX)",
    "bind": "--port (on 127.0.0.1)",
    "session": "a fresh one per run",
    "summary": "--summary (the launcher's report: the coordinator's summary plus the launcher's fields)",
    "curve_secret_key": "--curve",
    "curve_allowed_keys": "--curve",
}
# Paths the coordinator is handed absolute (the same files, whatever its working directory).
_PATH_KEYS = ("checkpoint_dir", "resume", "output", "dashboard_out", "status_out")


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
    r.add_argument("--ranks", type=RankSpan, default=RankSpan("3"),
                   help="N: a world of N ranks (default 3); MIN:MAX: an elastic world (torchrun's --nnodes "
                   "MIN:MAX) that forms once MIN are in and join_timeout_s passed, holding at most MAX; this "
                   "machine starts MIN ranks, agents started by hand may take the other slots")  # fmt: skip
    r.add_argument("--task", choices=sorted(TASKS), default=None,
                   help="a bundled example instead of a command after -- (default digits)")
    r.add_argument("--slowdown", default="1", help="per-rank emulated slowdown factors, e.g. 1,2,4")
    r.add_argument("--base-ms", type=float, default=10.0, help="emulated ms per batch per slowdown unit (10)")
    r.add_argument("--port", type=int, default=0,
                   help="coordinator TCP port on 127.0.0.1 (0, the default: a private ipc:// socket in the run's "
                   "temp dir instead)")
    r.add_argument("--summary", help="write the run summary JSON to this path")
    r.add_argument("--trace-dir", help="ranks write the sample ids they train here (coverage audit)")
    r.add_argument("--no-fold", action="store_true", help="the relay forwards averaging rounds unfolded")
    r.add_argument("--max-restarts", type=int, default=0,
                   help="the agent starts a failed rank again, up to N times (it rejoins the running world)")
    r.add_argument("--no-prefork", action="store_true",
                   help="every rank a fresh process (by default the agent forks them from one interpreter that "
                   "imported torch once)")
    r.add_argument("--curve", action="store_true",
                   help="CURVE on the coordinator's socket with throwaway keys made in the run's temp dir "
                   "(the agent and its relay get a client key; loopback needs none, this exercises it)")
    r.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    r.add_argument("--quiet", action="store_true", help="only print the summary")
    r.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                   help="show the processes' log lines at or above this level (default WARNING: a healthy "
                   "run shows its progress, one line per epoch and the summary; INFO: every decision)")
    g = r.add_argument_group(
        "coordinator settings",
        "forwarded to flodl-coordinator serve (README, Configuration); also read from FLODL_<KEY>",
    )
    _settings_module().add_flags(g, forwarded_keys(), choices=True)
    r.add_argument("task_args", nargs=argparse.REMAINDER, metavar="-- COMMAND | -- TASK-ARGS",
                   help="-- python train.py ARGS (or -m module): what each rank runs; or, with --task, "
                   "arguments for that example (-- --hidden 32)")
    st = sub.add_parser("status", help="show a running coordinator's /status as a table",
                        description="Read a coordinator's /status (docs/status.md) and print it as a table.")
    st.add_argument("--http", default=os.environ.get("FLODL_HTTP") or DEFAULT_STATUS_HTTP,
                    help=f"the coordinator's http host:port (its --http setting; default FLODL_HTTP or "
                    f"{DEFAULT_STATUS_HTTP})")
    st.add_argument("--json", action="store_true", help="print the raw /status document")
    st.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout in seconds (5)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.cmd == "status":
            return _status(args)
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
    mod = _settings_module()
    given = {k: getattr(args, k) for k in forwarded_keys()}
    span = {"world_size": args.ranks.hi, "min_ranks": args.ranks.lo if args.ranks.elastic else None}
    try:
        settings = mod.load_settings(env=os.environ, flags={**given, **span})
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


class _Console:
    """Where the children's lines go: those at or above the log level, to stdout -- above
    the live view's progress bar once it runs (``view``)."""

    def __init__(self, quiet: bool, level: str) -> None:
        self.quiet, self.level = quiet, level
        self.view: LiveView | None = None

    def say(self, line: str) -> None:
        if self.quiet or not shown(line, self.level):
            return
        view = self.view
        if view is not None:
            view.emit(line)
        else:
            print(line, flush=True)


def _pump(stream, prefix: str, console: _Console, sink=None) -> None:
    for raw in iter(stream.readline, ""):
        line = raw.rstrip("\n")
        if sink is not None:
            sink.append(line)
        console.say(f"{prefix}{line}")


def _run_local(args) -> int:
    settings = _check(args)
    local = args.ranks.lo  # an elastic world: this machine brings the quorum
    slow = _slowdowns(args.slowdown, local)
    py = sys.executable
    command = rank_command(args.task, args.task_args, py)
    session = "local-" + secrets.token_hex(6)
    workdir = tempfile.mkdtemp(prefix="flodl-run-")
    summary_path = os.path.join(workdir, "summary.json")
    exit_log = os.path.join(workdir, "rank-exits.jsonl")
    if not args.output and not os.environ.get("FLODL_OUTPUT"):  # beside the summary the user asked for
        args.output = os.path.dirname(os.path.abspath(args.summary)) if args.summary else workdir
    # An address known before the coordinator binds, so that the agent (relay, ranks:
    # torch takes seconds to import) starts beside it instead of after it.
    endpoint = f"tcp://127.0.0.1:{args.port}" if args.port else f"ipc://{workdir}/coordinator.sock"
    coord_cmd = [
        py, "-m", "flodl_coordinator", "serve",
        "--bind", endpoint,
        "--session", session,
        "--world-size", str(args.ranks.hi),
        *(["--min-ranks", str(args.ranks.lo)] if args.ranks.elastic else []),
        "--summary", summary_path,
        "--log-level", args.log_level,
        *coordinator_flags(args),
        *_final_view_flags(args),
    ]  # fmt: skip
    if not settings.http:  # the live view reads /status; port 0: the coordinator says which one
        coord_cmd += ["--http", "127.0.0.1:0"]
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
    agent_tail: collections.deque = collections.deque(maxlen=20)  # for an agent that fails to start ranks
    rc, ranks_first = 1, False
    view: LiveView | None = None
    console = _Console(args.quiet, args.log_level)
    try:
        agent_cmd = [
            py, "-m", "flodl_worker", "--log-level", args.log_level, "agent",
            "--coordinator", endpoint,
            "--ranks", str(local),
            "--rank-offset", "0",  # pinned: this machine's ranks are 0..MIN-1, named so in its output
            "--world-size", str(args.ranks.hi),
            "--session", session,
            "--slowdown", ",".join(f"{s:g}" for s in slow),
            "--base-ms", f"{args.base_ms:g}",
            "--exit-log", exit_log,
        ]  # fmt: skip
        if args.trace_dir:
            agent_cmd += ["--trace-dir", args.trace_dir]
        if args.no_fold:
            agent_cmd += ["--no-fold"]
        if args.max_restarts:
            agent_cmd += ["--max-restarts", str(args.max_restarts)]
        if args.no_prefork:
            agent_cmd += ["--no-prefork"]
        agent_cmd += agent_curve
        agent_cmd += ["--", *command.argv]
        # The agent dials the coordinator's address while it comes up (ZeroMQ retries).
        agent = subprocess.Popen(agent_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **spawn)
        procs.append(agent)
        pump_args = (agent.stdout, "[agent] ", console, agent_tail)
        pumps.append(threading.Thread(target=_pump, args=pump_args, daemon=True))
        pumps[-1].start()
        # Still awaited: a coordinator that cannot start is reported, and the agent stopped.
        ready, http = _await_ready(coord, "COORDINATOR_READY", deadline=t0 + 60, stop=stop)
        if http and not args.quiet:  # its /status feeds the live view (progress, one line per epoch)
            console.view = view = LiveView(http).start()
        pumps.append(threading.Thread(target=_pump, args=(coord.stderr, "[coordinator] ", console), daemon=True))
        pumps[-1].start()
        if ready is not None and args.ranks.elastic:
            print(f"flodl: elastic world {args.ranks!r}: slots {local}..{args.ranks.hi - 1} are open to "
                  f"flodl-worker agent --coordinator {ready} --session {session} "
                  f"--world-size {args.ranks.hi} --ranks K -- ... (its ranks take the lowest free slots)",
                  flush=True)  # fmt: skip
        if ready is not None:
            rc, ranks_first = _wait_all(procs, t0 + args.timeout, stop, _ExitWatch(exit_log))
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
    exits = _read_exits(exit_log)
    ended = _RanksEnded(exits, list(agent_tail), procs[-1].returncode) if ranks_first else None
    return _report(args, settings, command, summary_path, rc, wall, coord_started, exits, ended, view)


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


def _await_ready(proc, token: str, deadline: float, stop: _StopSignals) -> tuple[str | None, str | None]:
    """(endpoint, http host:port or None) the coordinator prints once bound; (None, None)
    if a stop signal came first."""
    while time.monotonic() < deadline:
        if stop.signum is not None:
            return None, None
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.poll() is not None else ""
            raise LaunchError(f"coordinator exited before it was ready: {err.strip()[-2000:]}")
        if line.startswith(token):
            words = line.split()
            http = next((w.removeprefix("http=") for w in words[2:] if w.startswith("http=")), None)
            return words[1], http
    raise LaunchError("coordinator did not become ready within 60 s")


# Every rank is gone but the coordinator still runs: after a normal end it finishes at
# once (it has the ranks' Exiting frames, or the agent's exit reports of admitted ranks);
# ranks that never joined (a script that failed at import, or exited without calling
# run_rank) it cannot know about, so after this grace the launcher stops it and says why.
RANKS_GONE_GRACE_S = 5.0


def _wait_all(procs, deadline: float, stop: _StopSignals, exits: "_ExitWatch") -> tuple[int, bool]:
    """(the coordinator's exit code once the run ended, whether the ranks ended first and
    the coordinator had to be stopped); on a stop signal, return at once (the caller
    stops the tree). A rank that fails meanwhile is said at once (``exits``)."""
    coord = procs[0]
    while time.monotonic() < deadline and stop.signum is None:
        exits.say_failures()
        if coord.poll() is not None:
            # Give the agent a bounded moment to see its ranks leave.
            _wait_until(lambda: all(p.poll() is not None for p in procs[1:]), time.monotonic() + 30, stop)
            return coord.returncode, False
        if all(p.poll() is not None for p in procs[1:]) and len(procs) > 1:
            if _wait_until(lambda: coord.poll() is not None, time.monotonic() + RANKS_GONE_GRACE_S, stop):
                return coord.returncode, False
            _stop_tree(procs, stop)
            return (coord.returncode if coord.returncode is not None else 1), stop.signum is None
        time.sleep(0.2)  # polling child exit codes, not synchronising with them
    if stop.signum is not None:
        return 1, False
    print("flodl: run timed out; stopping", file=sys.stderr)
    return 124, False


@dataclass(frozen=True, slots=True)
class _RanksEnded:
    """The ranks all ended before the run did: their exits, and the agent's last lines."""

    exits: list[dict]
    agent_tail: list[str]
    agent_code: int | None

    def reason(self) -> str:
        failed = [e for e in self.exits if e.get("code") != 0]
        if failed:
            parts = [f"{_who(e)} exited with code {e['code']}" + (f" ({e['last_lines'][-1].strip()})"
                     if e.get("last_lines") else "") for e in failed]  # fmt: skip
            return "the ranks ended before the run did: " + "; ".join(parts)
        if self.exits:
            return ("every rank exited with code 0 before the run did: does the script call "
                    "flodl_worker.run_rank (and train, rather than exit early)?")
        return f"the agent exited with code {self.agent_code} before the run did, without starting a rank"

    def details(self) -> str:
        """The reason, with each failed rank's last stderr lines (or the agent's)."""
        lines = [f"flodl: {self.reason()}"]
        for e in self.exits:
            if e.get("code") != 0 and e.get("last_lines"):
                lines.append(f"  {_who(e)} (exit code {e['code']}), its last lines:")
                lines += [f"    {t}" for t in e["last_lines"]]
        if not self.exits and self.agent_tail:
            lines.append("  the agent's last lines:")
            lines += [f"    {t}" for t in self.agent_tail]
        return "\n".join(lines)


class _ExitWatch:
    """The agent's exit log as it grows: each failed rank is said on stderr the moment it
    ends (``--quiet`` too: the agent's own line is not shown then), with its last line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen = 0

    def say_failures(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                *complete, _partial = fh.read().split("\n")  # a line being written waits
        except FileNotFoundError:
            return  # no rank has ended yet
        except OSError:
            return  # the report at the end reads it again, and says why if it cannot
        for line in complete[self.seen :]:
            try:
                e = json.loads(line)
            except ValueError:
                continue  # (the report at the end names a bad line)
            if e.get("code") != 0:
                last = f": {e['last_lines'][-1].strip()}" if e.get("last_lines") else ""
                print(f"flodl: {_who(e)} exited with code {e.get('code')}{last}", file=sys.stderr, flush=True)
        self.seen = len(complete)


def _who(e: dict) -> str:
    """An exit log record's rank: 'rank 3', or an unpinned agent's 'local rank 1'."""
    return f"rank {e['rank']}" if e.get("rank") is not None else f"local rank {e.get('local_rank')}"


def _read_exits(path: str) -> list[dict]:
    """The agent's exit log: one record per rank exit (rank, code, restarts, last_lines)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        print(f"flodl: cannot read the agent's exit log {path}: {e}", file=sys.stderr)
        return []


def _num(v, digits: int):
    """A summary number for the terminal, rounded (the summary file keeps it whole); None stays None."""
    return round(v, digits) if isinstance(v, float) else v


def _report(args, settings, command: RankCommand, summary_path: str, rc: int, wall: float, coord_started: float,
            exits: list[dict], ended: _RanksEnded | None, view: LiveView | None = None) -> int:  # fmt: skip
    if ended is not None:
        print(ended.details(), file=sys.stderr, flush=True)
    try:
        with open(summary_path, encoding="utf-8") as fh:
            summary = json.load(fh)
    except (OSError, json.JSONDecodeError):
        if view is not None:
            view.finish(None)
        print(f"flodl: the run produced no summary (coordinator exit code {rc})", file=sys.stderr)
        return rc or 1
    if view is not None:  # the epochs the live view had not shown yet
        view.finish(summary, settings.epochs)
    if ended is not None or any(e.get("code") != 0 for e in exits):  # who ended how
        summary["rank_exits"] = exits
    if ended is not None:
        summary.update(ok=False, reason=ended.reason())
    summary["launcher_wall_s"] = round(wall, 3)
    # From the launcher's start to the first batch, and from the run's end to the
    # launcher's (the coordinator's timeline counts from its own start).
    timeline = summary.get("timeline_s") or {}
    if "first_batch" in timeline:
        summary["time_to_first_batch_s"] = round(coord_started + timeline["first_batch"], 3)
    if "run_finished" in timeline:
        summary["teardown_s"] = round(wall - coord_started - timeline["run_finished"], 3)
    if "run_finished" in timeline and "committed_99pct" in timeline:
        # 99 % of the samples committed -> the run over: about a round and a round trip,
        # unless the run waited at its end (the timeline's marks say on what).
        summary["end_of_run_s"] = round(timeline["run_finished"] - timeline["committed_99pct"], 3)
    summary.setdefault("task", command.label)
    summary["slowdown"] = args.slowdown
    summary.setdefault("plane", settings.plane)
    train_wall = summary.get("wall_s") or wall
    committed = sum(e.get("trained", 0) - e.get("duplicates", 0) for e in summary.get("coverage", []))
    summary.setdefault("samples_per_s", round(committed / train_wall, 2) if train_wall else 0.0)
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as fh:
            fh.write(strictjson.dumps(summary, indent=2, sort_keys=True))
    _print_summary(summary)
    ok = bool(summary.get("ok")) and rc == 0 and ended is None
    return 0 if ok else (rc or 1)


def _print_summary(s: dict) -> None:
    print("\n=== flodl run summary ===")
    print(f"ok: {s.get('ok')}  ({s.get('reason')})")
    acc = s.get("accuracy")
    el = s.get("elastic")
    ranks = s.get("world_size") if not el else f"{len(el['formed_with'])} of {el['max_ranks']} (min {el['min_ranks']})"
    print(f"task: {s.get('task')}  policy: {s.get('policy')}  plane: {s.get('plane')}  ranks: {ranks}  slowdown: {s.get('slowdown')}")
    print(f"wall: {_num(s.get('wall_s'), 2)} s   samples/s: {_num(s.get('samples_per_s'), 1)}   averages: {s.get('averages')}")
    print(f"launcher: {s.get('launcher_wall_s')} s   time to first batch: {s.get('time_to_first_batch_s')} s   "
          f"teardown: {s.get('teardown_s')} s   end of run: {s.get('end_of_run_s')} s")
    print(f"accuracy: {acc if acc is None else round(acc, 4)}")
    for r in s.get("ranks", []):
        if r.get("phase") == "VACANT":
            print(f"  rank {r.get('rank')}: never joined (open slot)")
            continue
        frames = f" in {r['batch_frames']} report frames" if r.get("batch_frames") else ""
        waited = f"  trained {r['train_s']} s, waited {r['wait_s']} s for plans" if r.get("train_s") else ""
        print(f"  rank {r.get('rank')}: samples {r.get('samples')}  batches {r.get('batches')}{frames}{waited}")
    if s.get("plan_wait_share") is not None:
        print(f"plan wait: the ranks spent {100 * s['plan_wait_share']:.1f} % of their time waiting for a plan")
    loop = s.get("coordinator_loop")
    if loop:
        print(f"coordinator: busy {100 * loop['busy_share']:.1f} % of its time, {loop['frames']} frames, each handled in"
              f" <= {loop['frame_p50_le_ms']:g} ms (median), <= {loop['frame_p99_le_ms']:g} ms (p99), max {loop['frame_max_ms']:g} ms"
              + (f" (a {loop['frame_max_event']})" if loop.get("frame_max_event") else ""))
        if loop.get("round_triggers"):
            print(f"  {loop['round_triggers']} rounds opened, each decided and sent to its ranks in"
                  f" <= {loop['round_trigger_p50_le_ms']:g} ms (median), <= {loop['round_trigger_p99_le_ms']:g} ms (p99),"
                  f" max {loop['round_trigger_max_ms']:g} ms")
    cov = s.get("coverage", [])
    exact = all(c.get("duplicates") == 0 and c.get("missing") == 0 for c in cov) and bool(cov)
    print(f"coverage: {len(cov)} epochs, every sample exactly once: {exact}")
    model = s.get("model") or {}
    if model.get("written"):
        print(f"model: {model.get('path')}  (metadata {model.get('meta', 'not written')})")
    elif model:
        print(f"model: not written ({model.get('reason')})")


if __name__ == "__main__":
    sys.exit(main())
