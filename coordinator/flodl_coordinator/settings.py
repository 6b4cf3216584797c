"""Coordinator settings: one typed record from a TOML file, the environment and flags.

Precedence: flag > environment (``FLODL_<KEY>``) > config file > default. Parsed once,
at the edge; everything after this sees typed fields. Any defect — unknown key, wrong
type, a value out of range, a missing required value — is a ``SettingsError`` whose
message is one line naming the key and where it came from.

The schema is declared once: the run's settings are ``flodl.core.CoreConfig``'s fields,
the service's own are ``ServiceKeys``'s below, each with its ``setting(...)`` metadata
(``flodl.core._config.Setting``). ``SCHEMA`` is derived from both, and from it: the
``Settings`` record, TOML keys, ``FLODL_<KEY>`` variables, ``--key-name`` flags (with
``--help``; ``add_flags``), what ``flodl run`` forwards, and the README's configuration
table (``python -m flodl_coordinator.settings --markdown``; a test compares them).
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
import tomllib
from dataclasses import MISSING, dataclass, field, fields, make_dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Optional, get_type_hints

from flodl.core._config import NO_BEFORE, CoreConfig, Setting, setting
from flodl.envvars import WORKER_ENV
from flodl.limits import DEFAULT_MAX_MESSAGE_BYTES, max_message_bytes_problem

from .outer import OUTER_KINDS, validate_outer

__all__ = ["Settings", "SettingsError", "load_settings", "ENV_PREFIX", "SCHEMA", "Key", "PER_PROCESS_KEYS",
           "NO_BEFORE", "journaled_settings", "add_flags", "flag_argv", "markdown_table"]  # fmt: skip

ENV_PREFIX = "FLODL_"


class SettingsError(Exception):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceKeys:
    """The service's own settings (the run's are ``CoreConfig``'s). A declaration only:
    ``Settings`` is built from these fields and the core's."""

    bind: str = setting(
        "tcp://127.0.0.1:5555", per_process=True,
        help="ZeroMQ endpoint to bind (port 0 = any)",
        doc="ZeroMQ endpoint (port 0 = any; the chosen one is printed as `COORDINATOR_READY <endpoint>`, "
        "followed by `http=HOST:PORT` when `http` is set)",
    )  # fmt: skip
    session: str = setting(
        "flodl", help="run id every peer must name; frames of another session are refused",
        doc="run id every frame must name; frames of another session are refused",
    )  # fmt: skip
    journal: str = setting(
        "", per_process=True,
        help="append every decoded event to this JSON-lines file; an unfinished run in it is recovered",
        doc="append every decoded event (JSON lines); `flodl-coordinator replay FILE` rebuilds the state. "
        "Started on a journal that holds an unfinished run with the same settings, the service *recovers* "
        "it (see Faults)",
    )  # fmt: skip
    rotate_journal: bool = setting(
        False, per_process=True,
        help="a journal holding a finished run is moved aside (J.N) and a new run starts",
        doc="a journal that holds a finished run is moved aside (`J.1`, `J.2`, ...) and a new run starts, "
        "instead of refusing to start",
    )  # fmt: skip
    summary: str = setting("", per_process=True, help="write the run summary JSON here at the end",
                           doc="write the run summary JSON here")  # fmt: skip
    output: str = setting(
        "", per_process=True,
        help="write the run's consensus model here (model.pt + model.json); empty = beside the summary",
        doc="directory for the run's output model: `model.pt` (a plain torch `state_dict`, written by the "
        "rank of the final eval: the model the summary's accuracy measures) and `model.json` (run, epochs, "
        "accuracy, coverage, policy, world, sha256). Empty: the directory of `summary`; neither: not written",
    )  # fmt: skip
    http: str = setting("", per_process=True, help="serve /status, /metrics and the dashboard (/) on host:port (port 0 = any)",
                        doc="`host:port` for `/status` (JSON, docs/status.md), `/metrics` (Prometheus) and the live "
                        "dashboard (`/`, with its `/timeline` JSON); port 0 = any (named on the ready line)")  # fmt: skip
    metrics_rank_labels: int = setting(
        64, per_process=True,
        help="/metrics: per-rank series (rank label) for ranks below this; the rest are summed as rank=other",
        doc="`/metrics`: ranks below this get their own `rank` label; counters and rates of the others are "
        "summed under `rank=\"other\"` (bounded cardinality on a large world; 0 = all under `other`)",
    )  # fmt: skip
    dashboard_out: str = setting(
        "", per_process=True,
        help="write the dashboard, with the run's data in it, to this HTML file at the end (default: beside "
        "the summary, NAME.dashboard.html)",
        doc="at the end of the run, the dashboard page (`/`) with the run's data embedded: one self-contained "
        "HTML file that opens offline. Default: beside `summary` (`NAME.json` → `NAME.dashboard.html`); "
        "none without a summary",
    )  # fmt: skip
    status_out: str = setting(
        "", per_process=True,
        help="write the last /status JSON to this file at the end (default: beside the summary, NAME.status.json)",
        doc="at the end of the run, the last `/status` as JSON. Default: beside `summary` "
        "(`NAME.json` → `NAME.status.json`); none without a summary",
    )  # fmt: skip
    status_linger_s: float = setting(
        0.0, per_process=True,
        help="after the run ends, keep serving /status, /timeline and the dashboard this long (SIGTERM ends it)",
        doc="after the run ends, keep the HTTP listener serving the final `/status`, `/timeline` and dashboard "
        "this many seconds before the process exits (SIGTERM ends the wait at once; the exit code is the run's)",
    )  # fmt: skip
    tick_interval_s: float = setting(
        0.05, per_process=True,
        help="the service's poll period: a Tick (the core's clock) at least this often, traffic or not",
    )  # fmt: skip
    allow_insecure: bool = setting(
        False, per_process=True,
        help="accepted for old configurations; unused (a non-loopback bind without CURVE keys only warns)",
    )  # fmt: skip
    max_message_bytes: int = setting(
        DEFAULT_MAX_MESSAGE_BYTES, per_process=True,
        help="largest message part (one tensor) a peer may send; a bigger one disconnects it (ZeroMQ "
        "MAXMSGSIZE; 2 GiB; 0 = no limit)",
        doc="ZeroMQ `MAXMSGSIZE` of the coordinator's socket (2 GiB): the largest message *part* a peer may "
        "send (libzmq checks each part, and each tensor is one part, so this is the largest tensor on the "
        "wire; 2 GiB holds an f32 128k × 4096 embedding). A peer that sends a bigger part is disconnected. "
        "0 = no limit. The worker side takes the same `FLODL_MAX_MESSAGE_BYTES` (or `--max-message-bytes` "
        "on the agent and relay). Independently, an envelope (the protobuf part, never tensors) over 4 MiB "
        "is dropped as `oversized`, and a hello whose model signature exceeds 64 bytes or whose host / task "
        "exceeds 255 characters is refused by name and never journaled",
    )  # fmt: skip
    curve_secret_key: str = setting(
        "", per_process=True,
        help="CURVE: this coordinator's secret certificate (NAME.key_secret); with curve_allowed_keys, only "
        "allowlisted clients can connect",
        doc="CURVE: the coordinator's secret certificate (`NAME.key_secret`, see Security); needs "
        "`curve_allowed_keys`",
    )  # fmt: skip
    curve_allowed_keys: str = setting(
        "", per_process=True,
        help="CURVE: directory of the allowed clients' public certificates (*.key)",
        doc="CURVE: directory of the allowed clients' public certificates (`*.key`); only those can connect",
    )  # fmt: skip
    outer_optimizer: str = setting(
        "none", choices=OUTER_KINDS,
        help="bus: outer step on the averaged parameters: none (plain averaging) | slowmo | nesterov (DiLoCo)",
        doc="bus: what the coordinator makes of each average: `none` (plain averaging), `slowmo` (heavy-ball "
        "momentum on the round's progress), `nesterov` (DiLoCo's outer step). Its state is saved with "
        "checkpoints (`outer.npz`)",
    )  # fmt: skip
    outer_lr: float = setting(1.0, help="bus: outer learning rate (1 with momentum 0 = plain averaging)")
    outer_momentum: float = setting(
        0.0, help="bus: outer momentum in [0, 1) (SlowMo beta / Nesterov mu; DiLoCo uses 0.9 with lr 0.7)",
        doc="bus: outer momentum in [0, 1) (SlowMo β / Nesterov μ)",
    )  # fmt: skip
    max_contribution_ratio: float = setting(
        10.0,
        help="bus: refuse a contribution farther from the last consensus c than this times max(||c||, 1); "
        "0 = no bound",
        doc="bus: a contribution whose parameters `x` lie farther from the last consensus `c` than "
        "`ratio · max(‖c‖₂, 1)` (L2 over all tensors) is refused; in the first round (no `c` yet) the "
        "coordinate-wise median of the round's contributions stands in for `c` when there are ≥ 3, else the "
        "bound is skipped. 0 = no bound. A refused contribution — this, or non-finite / malformed tensors, "
        "or a claimed weight its steps do not explain — leaves the round at once: the round completes with "
        "the others, the rank resets to the consensus, its window's samples are trained again, and "
        "`dropped_frames` counts it as `contribution_<reason>`",
    )  # fmt: skip
    checkpoint_dir: str = setting(
        "", help="write consensus checkpoints under this directory (shared storage); empty = none",
        doc="where consensus checkpoints go (`ckpt-<version>/model.pt` + `meta.json`, `latest`; a second "
        "epoch of one consensus: `ckpt-<version>-e<epoch>`, hard-linked)",
    )  # fmt: skip
    checkpoint_keep: int = setting(0, per_process=True, help="keep only the newest N checkpoints (0 = all)")
    resume: str = setting(
        "", help="resume from this checkpoint (its dir, meta.json, or a root with 'latest')",
        doc="resume from a checkpoint (its dir, `meta.json`, or a root with `latest`): trains exactly the "
        "samples its epoch had not committed, then carries on; a torn or mismatched checkpoint is refused "
        "with the reason",
    )  # fmt: skip


# CoreConfig fields that are not settings: the service derives them.
_DERIVED: dict[str, Callable[[Any], Any]] = {
    "checkpoint_on_failure": lambda s: bool(s.checkpoint_dir),
}


@dataclass(frozen=True, slots=True)
class Key:
    """One setting as the service spells it: ``name`` (TOML key; ``FLODL_<NAME>``,
    ``--name-with-dashes``), its type (bool, int, float or str), default, ``Setting``
    metadata and, for a run setting, the ``CoreConfig`` field it fills (``core``) and how
    (``to_core``: an ``Optional[int]`` field's 0 is None, a ``bytes`` one is hex)."""

    name: str
    type: type
    default: Any
    meta: Setting
    core: str = ""
    to_core: Callable[[Any], Any] = lambda v: v

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> list[str]:
        """The flag, and for a key in seconds (``*_s``) the same without ``-s``; then the
        same for each alias (``--max-ranks`` for ``world_size``)."""
        out = []
        for name in (self.name, *self.meta.aliases):
            flag = "--" + name.replace("_", "-")
            out += [flag, flag[:-2]] if name.endswith("_s") else [flag]
        return out

    @property
    def required(self) -> bool:
        return self.name == "world_size"


def _hex_signature(text: str) -> bytes:
    try:
        sig = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"model_signature {text!r} is not hex (64 hex digits of a sha256)") from None
    if sig and len(sig) != 32:
        raise ValueError(f"model_signature {text!r} must be 64 hex digits (a sha256), got {len(sig) * 2}")
    return sig


def _zero_is_none(v: int) -> Optional[int]:
    return v or None


def _schema() -> dict[str, Key]:
    keys: dict[str, Key] = {}
    hints = get_type_hints(CoreConfig)
    for f in fields(CoreConfig):
        meta = f.metadata.get("setting")
        if meta is None:
            if f.name not in _DERIVED:
                raise TypeError(f"CoreConfig.{f.name} is neither a setting nor derived by the service (_DERIVED)")
            continue
        default = 0 if f.default is MISSING else f.default  # world_size: required, 0 = unset
        typ, to_core = hints[f.name], (lambda v: v)
        if typ == Optional[int]:
            typ, to_core, default = int, _zero_is_none, default or 0
        elif typ is bytes:
            typ, to_core, default = str, _hex_signature, default.hex()
        keys[meta.key or f.name] = Key(meta.key or f.name, typ, default, meta, f.name, to_core)
    hints = get_type_hints(ServiceKeys)
    for f in fields(ServiceKeys):
        keys[f.name] = Key(f.name, hints[f.name], f.default, f.metadata["setting"])
    return keys


SCHEMA: dict[str, Key] = _schema()
# Another spelling of a key -> the key (``Setting.aliases``: ``max_ranks`` is ``world_size``).
ALIASES: dict[str, str] = {a: k.name for k in SCHEMA.values() for a in k.meta.aliases}
# Settings that may differ between a run's first process and a restarted one.
PER_PROCESS_KEYS = frozenset(k.name for k in SCHEMA.values() if k.meta.per_process)


def _core_config(self) -> CoreConfig:
    """The run's ``CoreConfig`` (a defect is a one-line ``SettingsError``)."""
    values = {k.core: k.to_core(getattr(self, k.name)) for k in SCHEMA.values() if k.core}
    values.update({name: derive(self) for name, derive in _DERIVED.items()})
    try:
        return CoreConfig(**values)
    except ValueError as e:
        raise SettingsError(f"config error: {e}") from None


# The typed record: one field per key of SCHEMA (frozen; ``Settings(**journal_record)``).
Settings = make_dataclass(
    "Settings",
    [(k.name, k.type, field(default=k.default, metadata={"setting": k.meta})) for k in SCHEMA.values()],
    namespace={"core_config": _core_config, "__doc__": "The coordinator's settings (see SCHEMA)."},
    frozen=True,
    slots=True,
)
Settings.__module__ = __name__


def journaled_settings(record: Mapping[str, Any], where: str) -> Settings:
    """The settings a journaled run ran with, from its ``_start`` record. A key the record
    lacks was written before the setting existed: that run ran as the setting's
    ``before`` where it declares one (``flodl.core._config.Setting``), else as its
    default. A key this version does not know (a newer flodl's journal) is refused, named:
    dropped, the run would be rebuilt under a rule it did not run; so is a record without
    a required key (no run's journal lacks ``world_size``)."""
    unknown = sorted(set(record) - set(SCHEMA))
    if unknown:
        raise SettingsError(f"{where}: its settings name keys this flodl does not know: {', '.join(unknown)} "
                            f"(written by a newer flodl: read it with that version)")  # fmt: skip
    missing = [k.name for k in SCHEMA.values() if k.required and k.name not in record]
    if missing:
        raise SettingsError(f"{where}: its settings lack {', '.join(missing)}: not a run's journal")
    return Settings(**{k.name: (record[k.name] if k.name in record else k.meta.before) for k in SCHEMA.values()
                       if k.name in record or k.meta.before is not NO_BEFORE})  # fmt: skip


def _coerce(key: str, value: Any, source: str) -> Any:
    want = SCHEMA[key].type
    try:
        if want is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(value)
        if want is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if want is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise SettingsError(
            f"config error: {key} = {value!r} from {source} is not a valid {want.__name__}"
        ) from None


def _did_you_mean(key: str, prefix: str = "") -> str:
    """' (did you mean X?)' for the closest known key, or '' (difflib)."""
    close = difflib.get_close_matches(key.lower(), list(SCHEMA), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0].upper() if prefix else close[0]}?)" if close else ""


def _merge(base: dict, items: Mapping[str, Any], source: str) -> None:
    seen: dict[str, str] = {}  # key -> the spelling this source used for it
    for key, value in items.items():
        k = key.replace("-", "_")
        k = ALIASES.get(k, k)
        if k in seen and seen[k] != key:
            raise SettingsError(f"config error: {seen[k]!r} and {key!r} in {source} are the same setting; give one")
        seen[k] = key
        if k not in SCHEMA:
            known = ", ".join(sorted(SCHEMA))
            raise SettingsError(f"config error: unknown key {key!r} in {source}{_did_you_mean(k)} (known: {known})")
        base[k] = _coerce(k, value, source)


def _env_items(env: Mapping[str, str]) -> dict[str, str]:
    """The coordinator keys in ``env`` (``FLODL_<KEY>``). Any other ``FLODL_*`` variable is
    refused as a typo, except the worker side's own (``flodl.envvars.WORKER_ENV``)."""
    items = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key in SCHEMA or key in ALIASES:
            items[key] = value
        elif name not in WORKER_ENV:
            raise SettingsError(
                f"config error: unknown variable {name} in the environment{_did_you_mean(key, ENV_PREFIX)}; "
                f"FLODL_<KEY> must name a coordinator key (README, Configuration) or a worker variable"
            )
    return items


def load_settings(
    *, config_path: str | None = None, env: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None
) -> Settings:
    values: dict[str, Any] = {}
    if config_path:
        try:
            with open(config_path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise SettingsError(f"config error: config file {config_path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"config error: {config_path} is not valid TOML: {e}") from None
        # Either top-level keys or a [coordinator] table.
        table = data.get("coordinator", data)
        if not isinstance(table, dict):
            raise SettingsError(f"config error: [coordinator] in {config_path} must be a table")
        _merge(values, table, config_path)
    env = os.environ if env is None else env
    _merge(values, _env_items(env), "the environment")
    _merge(values, {k: v for k, v in (flags or {}).items() if v is not None}, "the command line")
    s = replace(Settings(), **values)
    if s.world_size < 1:
        raise SettingsError(
            "config error: world_size must be >= 1 (flag --world-size, env FLODL_WORLD_SIZE or key world_size)"
        )
    if not s.bind.startswith(("tcp://", "ipc://", "inproc://")):
        raise SettingsError(f"config error: bind {s.bind!r} must start with tcp://, ipc:// or inproc://")
    if not (s.status_linger_s >= 0 and math.isfinite(s.status_linger_s)):
        raise SettingsError("config error: status_linger_s must be a finite number >= 0 (0 = exit at once)")
    if s.tick_interval_s <= 0:
        raise SettingsError("config error: tick_interval_s must be > 0")
    if max_message_bytes_problem(s.max_message_bytes):
        raise SettingsError(f"config error: max_message_bytes {max_message_bytes_problem(s.max_message_bytes)}")
    if s.metrics_rank_labels < 0:
        raise SettingsError("config error: metrics_rank_labels must be >= 0 (flag --metrics-rank-labels)")
    if s.checkpoint_every < 0 or s.checkpoint_keep < 0:
        raise SettingsError("config error: checkpoint_every and checkpoint_keep must be >= 0")
    if s.checkpoint_every > 0 and not s.checkpoint_dir:
        raise SettingsError(
            "config error: checkpoint_every needs checkpoint_dir (flag --checkpoint-dir, env FLODL_CHECKPOINT_DIR)"
        )
    if not (math.isfinite(s.max_contribution_ratio) and s.max_contribution_ratio >= 0):
        raise SettingsError("config error: max_contribution_ratio must be a finite number >= 0 (0 = no bound)")
    why = validate_outer(s.outer_optimizer, s.outer_lr, s.outer_momentum)
    if why:
        raise SettingsError(f"config error: {why}")
    if s.outer_optimizer != "none" and s.plane != "bus":
        raise SettingsError("config error: outer_optimizer needs plane = bus (the coordinator applies it)")
    if s.bf16_wire and s.plane != "bus":
        raise SettingsError("config error: bf16_wire needs plane = bus (the collective plane all-reduces f32)")
    _check_curve(s)
    s.core_config()  # validates the run fields with the core's own rules
    return s


def _check_curve(s: Settings) -> None:
    """Both CURVE keys or neither; the files must load (the service loads them again)."""
    if not s.curve_secret_key and not s.curve_allowed_keys:
        return
    if not s.curve_secret_key or not s.curve_allowed_keys:
        missing = "curve_secret_key" if not s.curve_secret_key else "curve_allowed_keys"
        raise SettingsError(
            f"config error: CURVE needs both curve_secret_key and curve_allowed_keys; {missing} is not set "
            f"(flag --{missing.replace('_', '-')}, env FLODL_{missing.upper()})"
        )
    from flodl.curve import CurveError, server_keys

    try:
        server_keys(s.curve_secret_key, s.curve_allowed_keys)
    except CurveError as e:
        raise SettingsError(f"config error: {e}") from None


# -- derived: flags, --help, the README table -------------------------------------------


def shown_default(k: Key, *, markdown: bool = False) -> str:
    """A key's default as ``--help`` and the README show it."""
    v = k.default
    if k.required:
        return "— (required)" if markdown else "required"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, str):
        if not v:
            return "—" if markdown else "empty"
        return f"`{v}`" if markdown else v
    return str(v)


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None, *, choices: bool = False) -> None:
    """A flag per key (``--key-name``, and without ``-s`` for a key in seconds; a bool key
    also ``--no-key-name``), dest = the key, default None (= not given). ``choices``: let
    argparse refuse a word outside a key's choices (else ``load_settings`` does, in one line)."""
    for k in (SCHEMA[n] for n in (SCHEMA if names is None else names)):
        help_ = f"{k.meta.help} (default {shown_default(k)}; env {k.env})".replace("%", "%%")
        if k.type is bool:
            parser.add_argument(*k.flags, dest=k.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            parser.add_argument(*k.flags, dest=k.name, type=k.type, default=None, help=help_,
                                choices=(k.meta.choices or None) if choices else None,
                                metavar=None if choices and k.meta.choices else k.type.__name__.upper())  # fmt: skip


def flag_argv(values: Mapping[str, Any]) -> list[str]:
    """``values`` (key -> value; None: not given) as the flags ``add_flags`` reads."""
    argv: list[str] = []
    for name, v in values.items():
        if v is None:
            continue
        k = SCHEMA[name]
        if k.type is bool:
            argv.append(k.flag if v else "--no-" + k.flag[2:])
        else:
            argv += [k.flag, str(v)]
    return argv


def markdown_table() -> str:
    """The README's configuration table (section "Configuration (coordinator)")."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for k in SCHEMA.values():
        if "|" in k.meta.doc or "\n" in k.meta.doc:
            raise ValueError(f"{k.name}: its doc text must be one table cell (no '|' or newline)")
        name = " / ".join(f"`{n}`" for n in (k.name, *k.meta.aliases))
        rows.append(f"| {name} | {shown_default(k, markdown=True)} | {k.meta.doc} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flodl_coordinator.settings",
                                description="print the settings schema")  # fmt: skip
    p.add_argument("--markdown", action="store_true", help="the README's configuration table")
    p.parse_args(argv)
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
