"""``flodl-worker``: the per-host side of flodl.

    flodl-worker agent --coordinator tcp://HEAD:5555 --ranks 2 -- python train.py [ARGS]
    flodl-worker relay --coordinator tcp://HEAD:5555 --bind ipc:///tmp/flodl/relay.sock
    flodl-worker keygen DIR NAME

Flags win over the environment (FLODL_COORDINATOR, FLODL_SESSION, FLODL_HOST,
FLODL_CURVE_SERVER_KEY, FLODL_CURVE_SECRET_KEY, FLODL_MAX_MESSAGE_BYTES). A bad flag or
an unusable key file is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

__all__ = ["main"]

_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (plus a pointer to --help), exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _endpoint(s: str) -> str:
    if not s.startswith(_ENDPOINT_SCHEMES):
        raise argparse.ArgumentTypeError(f"{s!r} is not a ZeroMQ endpoint (tcp://HOST:PORT or ipc://PATH)")
    return s


def _count(lo: int):
    def parse(s: str) -> int:
        try:
            n = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"{n} must be >= {lo}")
        return n

    return parse


def _nonneg_float(s: str) -> float:
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be a finite number >= 0")
    return x


def _max_message_bytes(s: str) -> int:
    from flodl.limits import parse_max_message_bytes

    try:
        return parse_max_message_bytes(s, "--max-message-bytes")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _max_message_flag(p: argparse.ArgumentParser, what: str) -> None:
    from flodl.limits import DEFAULT_MAX_MESSAGE_BYTES, ENV_MAX_MESSAGE_BYTES

    p.add_argument("--max-message-bytes", metavar="N", type=_max_message_bytes,
                   default=os.environ.get(ENV_MAX_MESSAGE_BYTES) or str(DEFAULT_MAX_MESSAGE_BYTES),
                   help=f"largest message part (one tensor) {what} accepts; a peer sending a bigger one is "
                   f"disconnected (ZeroMQ MAXMSGSIZE; env {ENV_MAX_MESSAGE_BYTES}, default 2 GiB, 0 = no limit)")


def _factors(s: str) -> tuple[float, ...]:
    parts = [p for p in s.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expects comma-separated factors, e.g. 1,2,4")
    return tuple(_nonneg_float(p.strip()) for p in parts)


def _parser() -> _Parser:
    env = os.environ
    p = _Parser(prog="flodl-worker", description="flodl-worker: the per-host side of flodl (agent, relay).",
                epilog="run 'flodl-worker agent --help' or 'flodl-worker relay --help' for their flags")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   type=str.upper, help="default INFO (logs go to stderr)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{agent,relay,keygen}")

    a = sub.add_parser(
        "agent",
        help="start this host's relay and ranks; report every rank's exit to the coordinator",
        usage="%(prog)s --coordinator URL --ranks N [options] -- COMMAND [ARGS...]",
        description="Start the host's relay and N rank processes running COMMAND (torchrun-style: "
        "each gets FLODL_RANK, FLODL_LOCAL_RANK, FLODL_WORLD_SIZE, FLODL_CONNECT, FLODL_SESSION, "
        "FLODL_HOST and the emulation variables), report each exit to the coordinator at once, "
        "restart a failed rank only with --max-restarts (a dead relay is restarted up to 3 times a minute). "
        "Exit 0 if every rank exited 0, 2 if the coordinator refused the agent, else 1.",
        epilog="example: flodl-worker agent --coordinator tcp://head:5555 --ranks 3 --slowdown 1,2,4 "
        "-- python -m flodl_worker.examples.digits --hidden 64",
    )
    a.add_argument("--coordinator", metavar="URL", type=_endpoint, default=env.get("FLODL_COORDINATOR") or None,
                   help="coordinator endpoint, e.g. tcp://head:5555 (env FLODL_COORDINATOR)")
    a.add_argument("--ranks", metavar="N", type=_count(1), required=True, help="rank processes to start on this host")
    a.add_argument("--rank-offset", metavar="K", type=_count(0), default=None,
                   help="pin the ranks: global rank of the first one is K, the next K+1, ... (default: none "
                   "pinned, the coordinator numbers them in admission order: the lowest free slots)")
    a.add_argument("--world-size", metavar="W", type=_count(1), default=None,
                   help="ranks in the whole run (default rank-offset + ranks; unpinned: ranks)")
    a.add_argument("--session", metavar="S", default=env.get("FLODL_SESSION") or "flodl",
                   help="run id every frame names (env FLODL_SESSION, default 'flodl')")
    a.add_argument("--host", metavar="NAME", default=env.get("FLODL_HOST") or None,
                   help="logical host name (env FLODL_HOST, default the hostname)")
    a.add_argument("--slowdown", metavar="F[,F...]", type=_factors, default=(),
                   help="emulated device speed factors, e.g. 1,2,4: each batch of a rank sleeps an extra "
                   "base-ms x factor. One factor for all, one per local rank, or one per global rank")
    a.add_argument("--base-ms", metavar="MS", type=_nonneg_float, default=None,
                   help="base of the emulated sleep (default 10)")
    a.add_argument("--trace-dir", metavar="DIR", default=None,
                   help="ranks append 'epoch sample_id' per trained sample to DIR/rank<R>.trace")
    g = a.add_mutually_exclusive_group()
    g.add_argument("--relay-bind", metavar="URL", type=_endpoint, default=None,
                   help="relay frontend endpoint (default ipc:// in a private temp dir; tcp port 0 = any)")
    g.add_argument("--no-relay", action="store_true", help="ranks dial the coordinator directly")
    a.add_argument("--no-fold", action="store_true",
                   help="the relay forwards averaging rounds untouched instead of folding them into one")
    a.add_argument("--term-timeout", metavar="SECONDS", type=_nonneg_float, default=10.0,
                   help="seconds ranks get after SIGTERM before SIGKILL (default 10)")
    a.add_argument("--max-restarts", metavar="N", type=_count(0), default=0,
                   help="start a rank process that failed (a signal, or an exit code other than 0 and 2) "
                   "again, up to N times, after 1 s doubling (FLODL_RESTART_COUNT in its environment); "
                   "the restarted rank rejoins the run (mid-run on the bus plane: seeded with the latest consensus; a "
                   "collective run refuses it); none once the coordinator said the run ended (default 0)")
    a.add_argument("--no-prefork", action="store_true",
                   help="start every rank as a fresh process; by default, when the command is this Python running "
                   "-m MODULE or a script, the ranks fork from one interpreter that imported torch once "
                   "(3-4 s of CPU per rank saved)")
    a.add_argument("--exit-log", metavar="PATH", default=None,
                   help="append one JSON line per rank exit here ({rank, code, restarts, last_lines}: "
                   "its last stderr lines), for a launcher to report why ranks ended")
    _curve_flags(a, "the agent's and the relay's connections to the coordinator (with --no-relay: "
                 "the ranks' too, as FLODL_CURVE_SERVER_KEY / FLODL_CURVE_SECRET_KEY)")
    _max_message_flag(a, "the relay and the ranks (as FLODL_MAX_MESSAGE_BYTES)")

    r = sub.add_parser(
        "relay",
        help="forward this host's ranks to the coordinator, folding their averaging rounds",
        description="Frontend ROUTER bound for the host's ranks, backend DEALER to the coordinator. "
        "Folds the host's averaging rounds into one frame upstream (unless --no-fold). "
        "Prints 'RELAY_READY <endpoint>' on stdout once bound. SIGTERM: clean exit 0.",
    )
    r.add_argument("--coordinator", metavar="URL", type=_endpoint, default=env.get("FLODL_COORDINATOR") or None,
                   help="coordinator endpoint (env FLODL_COORDINATOR)")
    r.add_argument("--bind", metavar="URL", type=_endpoint, required=True,
                   help="frontend endpoint for local ranks: tcp://127.0.0.1:PORT (0 = any) or ipc://PATH")
    r.add_argument("--host", metavar="NAME", default=env.get("FLODL_HOST") or None,
                   help="logical host name, used in the relay's identity (default the hostname)")
    r.add_argument("--no-fold", action="store_true",
                   help="forward averaging rounds untouched (default: fold the host's ranks into one frame)")
    r.add_argument("--identity", metavar="ID", default=None,
                   help="routing id of the uplink at the coordinator (default relay-<host>-<pid>); the agent "
                   "passes one fixed for its lifetime, so a relay it restarts keeps its ranks' routes")
    _curve_flags(r, "the relay's uplink (backend) to the coordinator; the frontend stays plaintext")
    _max_message_flag(r, "the relay (from its ranks and from the coordinator)")

    k = sub.add_parser(
        "keygen",
        help="write a CURVE certificate pair: DIR/NAME.key (public) and DIR/NAME.key_secret",
        description="Write a ZeroMQ CURVE certificate pair (zmq.auth.create_certificates): DIR/NAME.key "
        "is the public certificate (copy it into the coordinator's curve_allowed_keys directory), "
        "DIR/NAME.key_secret the secret one (mode 0600; give it as --curve-secret-key on this host). "
        "Refuses to overwrite an existing pair.",
    )
    k.add_argument("dir")
    k.add_argument("name")
    return p


def _curve_flags(p: argparse.ArgumentParser, what: str) -> None:
    env = os.environ
    p.add_argument("--curve-server-key", metavar="PATH", default=env.get("FLODL_CURVE_SERVER_KEY") or None,
                   help=f"CURVE: the coordinator's public certificate (NAME.key); secures {what} "
                   "(env FLODL_CURVE_SERVER_KEY; give --curve-secret-key too)")
    p.add_argument("--curve-secret-key", metavar="PATH", default=env.get("FLODL_CURVE_SECRET_KEY") or None,
                   help="CURVE: this host's own secret certificate (NAME.key_secret), allowlisted at the "
                   "coordinator (env FLODL_CURVE_SECRET_KEY)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    p = _parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from flodl.curve import CurveError, client_keys, keygen

    if args.cmd == "keygen":
        try:
            public, secret = keygen(args.dir, args.name)
        except (CurveError, OSError) as e:
            print(f"flodl-worker: keygen: {e}", file=sys.stderr)
            return 2
        print(f"public certificate: {public}\nsecret certificate: {secret}")
        return 0
    try:
        curve = client_keys(args.curve_server_key, args.curve_secret_key)
    except CurveError as e:
        p.error(f"{args.cmd}: {e}")
    if args.coordinator is None:
        p.error(f"{args.cmd}: --coordinator is required (or set FLODL_COORDINATOR)")
    if args.cmd == "relay":
        if command:
            p.error("relay takes no command after --")
        from .relay import run_relay

        return run_relay(args.coordinator, args.bind, args.host, fold=not args.no_fold, curve=curve,
                         identity=args.identity,
                         max_message_bytes=args.max_message_bytes)

    from .agent_config import AgentConfig, ranks_prefork, slowdown_for

    if not command:
        p.error("agent: give the rank command after --, e.g. -- python train.py")
    offset = args.rank_offset or 0
    world = args.world_size or offset + args.ranks
    if offset + args.ranks > world:
        what = f"ranks {offset}..{offset + args.ranks - 1}" if args.rank_offset is not None else f"{args.ranks} ranks"
        p.error(f"agent: {what} exceed --world-size {world}")
    try:
        slowdown_for(args.slowdown, 0, args.rank_offset, args.ranks, world)
    except ValueError as e:
        p.error(f"agent: {e}")
    cfg = AgentConfig(
        coordinator=args.coordinator,
        ranks=args.ranks,
        command=tuple(command),
        rank_offset=args.rank_offset,
        world_size=world,
        session=args.session,
        host=args.host or "",
        slowdown=args.slowdown,
        base_ms=args.base_ms,
        trace_dir=os.path.abspath(args.trace_dir) if args.trace_dir else None,
        relay_bind=args.relay_bind,
        no_relay=args.no_relay,
        fold=not args.no_fold,
        term_timeout_s=args.term_timeout,
        curve_server_key=args.curve_server_key if curve is not None else None,
        curve_secret_key=args.curve_secret_key if curve is not None else None,
        max_message_bytes=args.max_message_bytes,
        max_restarts=args.max_restarts,
        exit_log=os.path.abspath(args.exit_log) if args.exit_log else None,
        prefork=not args.no_prefork,
    )
    # The prefork server first, before the rest of the agent is imported: its torch
    # import is the longest part of this host's start-up (flodl_worker.agent_config).
    prefork = ranks_prefork(cfg)
    from .agent import run_agent

    return run_agent(cfg, prefork)


if __name__ == "__main__":
    sys.exit(main())
