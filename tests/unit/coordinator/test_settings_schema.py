"""One settings schema (issue 10): CoreConfig's fields and the service's own keys are the
only declaration; Settings, flags, --help, what `flodl run` forwards and the README's
configuration table are derived from it."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from flodl import cli as launcher
from flodl.core import CoreConfig
from flodl_coordinator import recovery
from flodl_coordinator.cli import _parser as coordinator_parser
from flodl_coordinator.settings import (
    PER_PROCESS_KEYS,
    SCHEMA,
    Settings,
    flag_argv,
    load_settings,
    markdown_table,
    shown_default,
)

ROOT = Path(__file__).resolve().parents[3]


def _readme_table() -> str:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").split("\n")
    section = lines.index("## Configuration (coordinator)")
    start = lines.index("| key | default | meaning |", section)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end]) + "\n"


def test_the_readme_configuration_table_is_the_schemas():
    assert _readme_table() == markdown_table(), (
        "README.md's configuration table differs from the settings schema: paste the output of "
        "`.venv/bin/python -m flodl_coordinator.settings --markdown` over it"
    )


def test_the_collective_docs_show_the_schemas_defaults():
    rows = [line.split("|") for line in (ROOT / "docs" / "collective.md").read_text(encoding="utf-8").split("\n")
            if line.startswith("| `")]  # fmt: skip
    shown = {cells[1].strip().strip("`"): cells[2].strip() for cells in rows}
    assert {"plane", "collective_backend", "collective_timeout_s"} <= set(shown)
    for key, default in shown.items():
        assert default == shown_default(SCHEMA[key], markdown=True), key


def test_the_generator_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "flodl_coordinator.settings", "--markdown"], capture_output=True,
                         text=True, timeout=60, check=True, cwd=ROOT).stdout  # fmt: skip
    assert out == markdown_table()


def test_one_default_per_setting_the_service_and_the_core_agree():
    # Was: probe_batches 1 in the service, None (= the anchor) in the core.
    assert Settings(world_size=2).core_config() == CoreConfig(world_size=2)
    assert CoreConfig(world_size=2).probe_batches == 1
    assert load_settings(env={}, flags={"world_size": 2}) == Settings(world_size=2)


def test_every_core_field_is_a_setting_or_derived_and_every_setting_a_field():
    settings = {f.name for f in fields(Settings)}
    assert settings == set(SCHEMA)
    core = {k.core for k in SCHEMA.values() if k.core}
    assert {f.name for f in fields(CoreConfig)} - core == {"checkpoint_on_failure"}
    assert SCHEMA["epochs"].core == "num_epochs"


def test_sentinels_and_the_hex_signature_reach_the_core_in_its_types():
    c = Settings(world_size=2, min_anchor=0, max_batch_diff=3, probe_batches=0, model_signature="ab" * 32).core_config()
    assert (c.min_anchor, c.max_batch_diff, c.probe_batches, c.model_signature) == (None, 3, None, b"\xab" * 32)


def test_names_are_derived_from_the_key():
    k = SCHEMA["liveness_timeout_s"]
    assert (k.env, k.flags) == ("FLODL_LIVENESS_TIMEOUT_S", ["--liveness-timeout-s", "--liveness-timeout"])
    assert load_settings(env={"FLODL_PROBE_BATCHES": "3"}, flags={"world_size": 2}).probe_batches == 3


def test_restart_comparison_skips_exactly_the_per_process_keys():
    assert recovery.SERVICE_KEYS == PER_PROCESS_KEYS


def test_every_key_is_a_coordinator_flag_and_round_trips():
    values = {k.name: (not k.default) if k.type is bool else k.default for k in SCHEMA.values()}
    values["world_size"] = 3
    values["max_failure"] = "25%"
    args = coordinator_parser().parse_args(["serve", *flag_argv(values)])
    assert {k: getattr(args, k) for k in SCHEMA} == values


def test_coordinator_help_lists_every_key_with_its_default_and_env():
    text = coordinator_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for k in SCHEMA.values():
        assert k.flag in text and k.env in text, k.name


def _launch_argv(*argv: str) -> list[str]:
    return launcher.coordinator_flags(launcher._parser().parse_args(["run", "--local", *argv]))


def test_flodl_run_forwards_any_coordinator_key_it_does_not_set_itself():
    assert set(launcher.forwarded_keys()) == set(SCHEMA) - set(launcher.LAUNCHER_KEYS)
    argv = _launch_argv("--probe-batches", "2", "--http", "127.0.0.1:0", "--no-final-eval", "--bf16-wire",
                        "--max-contribution-ratio", "0", "--liveness-timeout", "3", "--form-timeout", "5")  # fmt: skip
    args = coordinator_parser().parse_args(["serve", *argv])
    assert (args.probe_batches, args.http, args.final_eval, args.bf16_wire, args.max_contribution_ratio) == (
        2, "127.0.0.1:0", False, True, 0.0)  # fmt: skip
    assert (args.liveness_timeout_s, args.form_timeout_s) == (3.0, 5.0)
    assert _launch_argv() == []  # nothing given: the coordinator's defaults, not the launcher's


def test_flodl_run_keeps_its_flags_and_makes_paths_absolute(tmp_path):
    # The flags tests/, bench/, the Makefile and README give `flodl run`.
    args = launcher._parser().parse_args([
        "run", "--local", "--ranks", "3", "--task", "digits", "--slowdown", "1,2,4", "--base-ms", "0",
        "--epochs", "15", "--checkpoint-dir", "ck", "--checkpoint-every", "1", "--policy", "async", "--plane", "bus",
        "--journal", "j", "--trace-dir", "t", "--port", "0", "--summary", "s.json", "--curve",
        "--liveness-timeout", "4", "--form-timeout", "60", "--max-failure", "1", "--no-fold", "--bf16-wire",
        "--outer-optimizer", "slowmo", "--outer-lr", "0.5", "--outer-momentum", "0.5", "--resume", "ck",
        "--seed", "7", "--batch-size", "16", "--easgd-alpha", "0.5", "--anchor", "2", "--timeout", "60", "--quiet",
    ])  # fmt: skip
    assert (args.ranks.lo, args.ranks.hi, args.slowdown, args.base_ms, args.no_fold, args.curve, args.trace_dir) == (
        3, 3, "1,2,4", 0.0, True, True, "t")  # fmt: skip
    forwarded = coordinator_parser().parse_args(["serve", *launcher.coordinator_flags(args)])
    assert forwarded.checkpoint_dir == forwarded.resume == str(Path("ck").resolve())
    assert (forwarded.epochs, forwarded.policy, forwarded.liveness_timeout_s, forwarded.outer_optimizer) == (
        15, "async", 4.0, "slowmo")  # fmt: skip
    with pytest.raises(SystemExit):
        launcher._parser().parse_args(["run", "--local", "--world-size", "3"])  # that is --ranks
