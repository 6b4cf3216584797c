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

from .settings import Settings, SettingsError, load_settings

__all__ = ["main"]

_RUN_FLAGS = {
    "world_size": (int, "number of ranks in the world (required)"),
    "batch_size": (int, "samples per step on every rank (default 32)"),
    "epochs": (int, "epochs to train (default 10)"),
    "seed": (int, "shuffle and init seed (default 42)"),
    "policy": (str, "averaging policy: cadence (default) | sync | async"),
    "easgd_alpha": (float, "async: elastic blend of the consensus, 0 < alpha <= 1 (default 0.5)"),
    "plane": (str, "averaging data plane: bus (default) | collective"),
    "collective_backend": (str, "plane collective: torch.distributed backend gloo (default) | nccl"),
    "collective_timeout_s": (float, "plane collective: group formation / all-reduce timeout (default 60)"),
    "gamma": (float, "contribution mass exponent: weight = steps**gamma (default 1)"),
    "total_samples": (int, "samples per epoch; 0 = the cohort's dataset length"),
    "heartbeat_interval_s": (float, "coordinator beacon / rank heartbeat interval (default 1)"),
    "liveness_timeout_s": (float, "silence after which a rank is declared dead (default 10)"),
    "reduce_stall_s": (float, "an averaging round pending this long ends the run (default 300)"),
    "form_timeout_s": (float, "the world must form within this long or the run fails naming who is missing (300; 0 = wait)"),
    "model_signature": (str, "hex sha256 every rank's model must match (logged at world_formed); empty = the cohort's"),
    "anchor": (int, "cadence: initial batches of the slowest rank per window (default 4)"),
    "min_anchor": (int, "cadence: growth floor; 0 = the initial anchor"),
    "max_anchor": (int, "cadence: growth ceiling (default 1000)"),
    "overhead_target": (float, "cadence: grow windows while averaging costs more than this share (0.05)"),
    "max_batch_diff": (int, "cadence: cap on per-window count moves; 0 = none"),
    "guard": (str, "cadence convergence guard: level | growth | none (default level)"),
    "epoch_callback_policy": (str, "who checkpoints and evaluates: fastest (default) or rank:N"),
    "probe_batches": (int, "cadence: batches per rank in the first, uncalibrated window (1; 0 = anchor)"),
    "outer_optimizer": (str, "bus: outer step on the average: none (default) | slowmo | nesterov (DiLoCo)"),
    "outer_lr": (float, "bus: outer learning rate (default 1; 1 with momentum 0 = plain averaging)"),
    "outer_momentum": (float, "bus: outer momentum in [0, 1) (default 0; DiLoCo uses 0.9 with lr 0.7)"),
    "max_contribution_ratio": (float, "bus: refuse a contribution farther from the last consensus c than this "
                               "times max(||c||, 1) (default 10; 0 = no bound)"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flodl-coordinator", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the coordinator service for one training run")
    s.add_argument("--config", help="TOML file (top-level keys or a [coordinator] table)")
    s.add_argument("--bind", help="ZeroMQ endpoint to bind (default tcp://127.0.0.1:5555; port 0 = any)")
    s.add_argument("--session", help="run id every peer must name (default 'flodl')")
    s.add_argument("--journal", help="append every decoded event to this JSON-lines file; an unfinished run in it is recovered")
    s.add_argument("--rotate-journal", action="store_const", const=True,
                   help="a journal holding a finished run is moved aside (J.N) and a new run starts")
    s.add_argument("--summary", help="write the run summary JSON here at the end")
    s.add_argument("--http", help="serve /status and /metrics on host:port")
    s.add_argument("--max-message-bytes", type=int, metavar="N",
                   help="largest message part (one tensor) a peer may send; a bigger one disconnects it "
                   "(ZeroMQ MAXMSGSIZE; default 2 GiB; 0 = no limit)")
    s.add_argument("--log-level", default="INFO")
    s.add_argument("--checkpoint-dir", help="write consensus checkpoints under this directory (shared storage)")
    s.add_argument("--checkpoint-every", type=int, help="a consensus checkpoint every N epochs (0 = off)")
    s.add_argument("--checkpoint-keep", type=int, help="keep only the newest N checkpoints (0 = all)")
    s.add_argument("--resume", help="resume from this checkpoint (its dir, meta.json, or a root with 'latest')")
    s.add_argument("--max-failure", help="end the run once this many ranks died: N, or P%% of the world size")
    s.add_argument("--curve-secret-key", metavar="PATH",
                   help="CURVE: this coordinator's secret certificate (NAME.key_secret); with "
                   "--curve-allowed-keys, only allowlisted clients can connect (env FLODL_CURVE_SECRET_KEY)")
    s.add_argument("--curve-allowed-keys", metavar="DIR",
                   help="CURVE: directory of the allowed clients' public certificates (*.key) "
                   "(env FLODL_CURVE_ALLOWED_KEYS)")
    for name, (typ, help_) in _RUN_FLAGS.items():
        s.add_argument("--" + name.replace("_", "-"), type=typ, help=help_)
    s.add_argument("--bf16-wire", action="store_const", const=True, help="bf16 tensors on the bus")
    s.add_argument("--no-final-eval", dest="final_eval", action="store_const", const=False)
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
    service_keys = ["bind", "session", "journal", "summary", "http", "max_message_bytes"]
    checkpoint_keys = ["checkpoint_dir", "checkpoint_every", "checkpoint_keep", "resume", "max_failure"]
    curve_keys = ["curve_secret_key", "curve_allowed_keys"]
    flags = {k: getattr(args, k) for k in list(_RUN_FLAGS) + service_keys + checkpoint_keys + curve_keys}
    flags["bf16_wire"] = args.bf16_wire
    flags["final_eval"] = args.final_eval
    flags["rotate_journal"] = args.rotate_journal
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
    settings = Settings(**lines[0]["settings"])
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
