"""Coordinator settings: one typed record from a TOML file, the environment and flags.

Precedence: flag > environment (``FLODL_<KEY>``) > config file > default. Parsed once,
at the edge; everything after this sees typed fields. Any defect — unknown key, wrong
type, a value out of range, a missing required value — is a ``SettingsError`` whose
message is one line naming the key and where it came from.
"""

from __future__ import annotations

import difflib
import math
import os
import tomllib
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from flodl.core import CoreConfig
from flodl.envvars import WORKER_ENV
from flodl.limits import DEFAULT_MAX_MESSAGE_BYTES, max_message_bytes_problem

from .outer import validate_outer

__all__ = ["Settings", "SettingsError", "load_settings", "ENV_PREFIX"]

ENV_PREFIX = "FLODL_"


class SettingsError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Settings:
    # service
    bind: str = "tcp://127.0.0.1:5555"
    session: str = "flodl"
    journal: str = ""  # path of the event journal (JSON lines); empty = none
    summary: str = ""  # path where the run summary is written at the end
    http: str = ""  # host:port for /status and /metrics; empty = off
    tick_interval_s: float = 0.05
    allow_insecure: bool = False  # permit a non-loopback bind without CURVE keys
    # ZeroMQ MAXMSGSIZE of the ROUTER: the largest message *part* (one tensor) a peer may
    # send; a bigger one disconnects it (flodl.limits). 0 = no limit.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # CURVE (flodl.curve): the coordinator's secret certificate and a directory of the
    # allowed clients' public certificates (*.key). Both set = CURVE server + ZAP allowlist.
    curve_secret_key: str = ""
    curve_allowed_keys: str = ""
    # a journal holding a *finished* run is moved aside (J.<n>) and a new run starts; an
    # unfinished one is always recovered (flodl_coordinator.recovery)
    rotate_journal: bool = False
    # run (handed to flodl.core)
    world_size: int = 0
    batch_size: int = 32
    epochs: int = 10
    seed: int = 42
    policy: str = "cadence"
    plane: str = "bus"
    collective_backend: str = "gloo"  # plane collective: gloo (CPU tensors) | nccl (GPU tensors)
    collective_timeout_s: float = 60.0  # plane collective: group formation / one all-reduce
    gamma: float = 1.0
    easgd_alpha: float = 0.5
    bf16_wire: bool = False
    # bus outer optimizer on the averaged parameters (flodl_coordinator.outer)
    outer_optimizer: str = "none"  # none | slowmo | nesterov (DiLoCo)
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    # bus: a contribution farther than this times max(||last consensus||, 1) from the last
    # consensus is refused (flodl_coordinator.reducer); 0 = no bound
    max_contribution_ratio: float = 10.0
    total_samples: int = 0
    heartbeat_interval_s: float = 1.0
    liveness_timeout_s: float = 10.0
    reduce_stall_s: float = 300.0
    form_timeout_s: float = 300.0  # the world must form within this long, or the run fails naming who is missing; 0 = wait
    model_signature: str = ""  # hex sha256 every rank's model must match (logged when the world forms); "" = the cohort's
    final_eval: bool = True
    # cadence (ElChe)
    anchor: int = 4
    min_anchor: int = 0  # 0: the initial anchor
    max_anchor: int = 1000
    overhead_target: float = 0.05
    max_batch_diff: int = 0  # 0: no cap on how far counts move per window
    guard: str = "level"
    meta_controller: bool = True
    probe_batches: int = 1  # first (uncalibrated) window, batches per rank; 0 = the anchor
    epoch_callback_policy: str = "fastest"  # who checkpoints / evaluates: "fastest" or "rank:N"
    # checkpoints (flodl_coordinator.checkpoints): where, how often, how many, resume
    checkpoint_dir: str = ""  # root of ckpt-<version>/ dirs; empty = no checkpoints
    checkpoint_every: int = 0  # epochs between consensus checkpoints; 0 = off
    checkpoint_keep: int = 0  # keep the newest N checkpoints; 0 = all
    resume: str = ""  # checkpoint dir (or its root / latest / meta.json) to resume from
    max_failure: str = ""  # dead ranks that end the run: "N" or "P%" of world_size; "" = never

    def core_config(self) -> CoreConfig:
        try:
            return CoreConfig(
                world_size=self.world_size,
                batch_size=self.batch_size,
                num_epochs=self.epochs,
                seed=self.seed,
                policy=self.policy,
                plane=self.plane,
                collective_backend=self.collective_backend,
                collective_timeout_s=self.collective_timeout_s,
                gamma=self.gamma,
                easgd_alpha=self.easgd_alpha,
                bf16_wire=self.bf16_wire,
                total_samples=self.total_samples,
                heartbeat_interval_s=self.heartbeat_interval_s,
                liveness_timeout_s=self.liveness_timeout_s,
                reduce_stall_s=self.reduce_stall_s,
                form_timeout_s=self.form_timeout_s,
                model_signature=_hex_signature(self.model_signature),
                final_eval=self.final_eval,
                anchor=self.anchor,
                min_anchor=self.min_anchor or None,
                max_anchor=self.max_anchor,
                overhead_target=self.overhead_target,
                max_batch_diff=self.max_batch_diff or None,
                guard=self.guard,
                meta_controller=self.meta_controller,
                probe_batches=self.probe_batches or None,
                epoch_callback_policy=self.epoch_callback_policy,
                checkpoint_every=self.checkpoint_every,
                checkpoint_on_failure=bool(self.checkpoint_dir),
                max_failure=self.max_failure,
            )
        except ValueError as e:
            raise SettingsError(f"config error: {e}") from None


def _hex_signature(text: str) -> bytes:
    try:
        sig = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"model_signature {text!r} is not hex (64 hex digits of a sha256)") from None
    if sig and len(sig) != 32:
        raise ValueError(f"model_signature {text!r} must be 64 hex digits (a sha256), got {len(sig) * 2}")
    return sig


_FIELDS = {f.name: f for f in fields(Settings)}


def _coerce(key: str, value: Any, source: str) -> Any:
    want = type(getattr(Settings(), key))
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
    close = difflib.get_close_matches(key.lower(), list(_FIELDS), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0].upper() if prefix else close[0]}?)" if close else ""


def _merge(base: dict, items: Mapping[str, Any], source: str) -> None:
    for key, value in items.items():
        k = key.replace("-", "_")
        if k not in _FIELDS:
            known = ", ".join(sorted(_FIELDS))
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
        if key in _FIELDS:
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
    if s.tick_interval_s <= 0:
        raise SettingsError("config error: tick_interval_s must be > 0")
    if max_message_bytes_problem(s.max_message_bytes):
        raise SettingsError(f"config error: max_message_bytes {max_message_bytes_problem(s.max_message_bytes)}")
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
