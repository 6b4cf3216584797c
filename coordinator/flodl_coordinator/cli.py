"""``flodl-coordinator``: serve a run, or replay a journal.

    flodl-coordinator serve --world-size 3 --bind tcp://0.0.0.0:5555 [--config run.toml]
    flodl-coordinator replay run.journal
    flodl-coordinator keygen DIR NAME
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .settings import SCHEMA, Settings, SettingsError, add_flags, journaled_settings, load_settings

__all__ = ["main"]

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flodl-coordinator", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the coordinator service for one training run")
    s.add_argument("--config", help="TOML file (top-level keys or a [coordinator] table)")
    s.add_argument("--log-level", default="INFO")
    add_flags(s)  # one per key of the settings schema (flodl_coordinator.settings.SCHEMA)
    r = sub.add_parser("replay", help="rebuild the core state from a journal and print its summary")
    r.add_argument("journal")
    k = sub.add_parser("keygen", help="write a CURVE certificate pair: DIR/NAME.key (public) and DIR/NAME.key_secret",
                       description="Write a ZeroMQ CURVE certificate pair (zmq.auth.create_certificates): "
                       "DIR/NAME.key is the public certificate (hand it out: the coordinator's goes to every "
                       "client as --curve-server-key; a client's goes into the coordinator's "
                       "--curve-allowed-keys directory), DIR/NAME.key_secret the secret one (mode 0600, "
                       "stays on its host). Refuses to overwrite an existing pair.")
    k.add_argument("dir")
    k.add_argument("name")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "replay":
        return _replay(args.journal)
    if args.cmd == "keygen":
        return _keygen(args.dir, args.name)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    flags = {k: getattr(args, k) for k in SCHEMA}
    try:
        settings = load_settings(config_path=args.config, flags=flags)
    except SettingsError as e:
        print(f"flodl-coordinator: {e}", file=sys.stderr)
        return 2
    from .service import CoordinatorService  # zmq import only when serving

    try:
        service = CoordinatorService(settings)  # a bad --resume is refused here, in one line
    except SettingsError as e:
        print(f"flodl-coordinator: {e}", file=sys.stderr)
        return 2
    logging.getLogger("flodl.coordinator").info("settings: %s", describe(service.settings))
    try:
        return service.run()
    except SettingsError as e:  # BindError: a busy or bad bind / http address
        print(f"flodl-coordinator: {e}", file=sys.stderr)
        return 2


def describe(settings: Settings) -> str:
    """The effective configuration as one line of ``key=value`` (empty: ``key=``)."""
    from dataclasses import asdict

    return " ".join(f"{k}={v}" for k, v in asdict(settings).items())


def _keygen(directory: str, name: str) -> int:
    from flodl.curve import CurveError, keygen

    try:
        public, secret = keygen(directory, name)
    except (CurveError, OSError) as e:
        print(f"flodl-coordinator: keygen: {e}", file=sys.stderr)
        return 2
    print(f"public certificate: {public}\nsecret certificate: {secret}")
    return 0


def _replay(path: str) -> int:
    from flodl.core import from_record, initial_state, resume_plan, step

    try:
        with open(path, encoding="utf-8") as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        print(f"flodl-coordinator: cannot read journal {path}: {e}", file=sys.stderr)
        return 2
    if not lines or lines[0].get("type") != "_start":
        print(f"flodl-coordinator: {path} does not start with a _start record", file=sys.stderr)
        return 2
    try:
        settings = journaled_settings(lines[0].get("settings") or {}, f"journal {path}")
    except SettingsError as e:
        print(f"flodl-coordinator: {e}", file=sys.stderr)
        return 2
    resume_meta = lines[0].get("resume_meta")
    try:
        point = resume_plan(resume_meta) if resume_meta is not None else None
    except ValueError as e:
        print(f"flodl-coordinator: the journal's resume_meta is unreadable: {e}", file=sys.stderr)
        return 2
    state = initial_state(settings.core_config(), point)
    from flodl.core import RankViolation

    finished, events = None, 0
    for rec in lines[1:]:
        if str(rec.get("type", "")).startswith("_"):
            continue  # service records (_agent, _restart): not core events
        events += 1
        try:
            state, cmds = step(state, from_record(rec))
        except RankViolation:
            continue  # refused when it happened too: it changed nothing
        for c in cmds:
            if type(c).__name__ == "RunFinished":
                finished = c
    out = {"events": events, "finished": finished is not None}
    if finished is not None:
        out.update(ok=finished.ok, reason=finished.reason, summary=finished.summary)
    print(json.dumps(out, indent=2, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
