"""Elastic settings: min_ranks / max_ranks / join windows, and their older spellings."""

import argparse

import pytest

from flodl import cli as launcher
from flodl_coordinator.cli import _parser as coordinator_parser
from flodl_coordinator.settings import SettingsError, load_settings


def test_max_ranks_and_max_join_timeout_are_the_capacity_and_the_hard_cap():
    s = load_settings(env={}, flags={"max_ranks": 4, "min_ranks": 2, "max_join_timeout_s": 90, "join_timeout_s": 5})
    cfg = s.core_config()
    assert (cfg.world_size, cfg.quorum, cfg.form_timeout_s, cfg.join_timeout_s, cfg.elastic) == (4, 2, 90.0, 5.0, True)


def test_an_existing_config_with_world_size_stays_a_fixed_world(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("world_size = 3\nform_timeout_s = 60\n")
    cfg = load_settings(config_path=str(path), env={}).core_config()
    assert (cfg.world_size, cfg.quorum, cfg.elastic, cfg.form_timeout_s) == (3, 3, False, 60.0)


def test_the_aliases_work_in_the_environment_and_on_the_command_line():
    s = load_settings(env={"FLODL_MAX_RANKS": "5", "FLODL_MIN_RANKS": "2"}, flags={})
    assert (s.world_size, s.min_ranks) == (5, 2)
    args = coordinator_parser().parse_args(["serve", "--max-ranks", "4", "--min-ranks", "3", "--max-join-timeout", "7"])
    assert (args.world_size, args.min_ranks, args.form_timeout_s) == (4, 3, 7.0)


def test_one_setting_given_twice_under_two_names_is_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("world_size = 3\nmax_ranks = 4\n")
    with pytest.raises(SettingsError, match="'world_size' and 'max_ranks' in .* are the same setting"):
        load_settings(config_path=str(path), env={})


def test_a_quorum_above_the_capacity_is_a_config_error():
    with pytest.raises(SettingsError, match=r"min_ranks must be in \[1, world_size=2\], got 3"):
        load_settings(env={}, flags={"world_size": 2, "min_ranks": 3})


def test_flodl_run_takes_ranks_as_min_max():
    args = launcher._parser().parse_args(["run", "--local", "--ranks", "2:4", "--join-timeout", "3"])
    assert (args.ranks.lo, args.ranks.hi, args.ranks.elastic) == (2, 4, True)
    settings = launcher._check(args)
    assert (settings.world_size, settings.min_ranks, settings.join_timeout_s) == (4, 2, 3.0)
    fixed = launcher._parser().parse_args(["run", "--local", "--ranks", "3"])
    assert (fixed.ranks.lo, fixed.ranks.hi, fixed.ranks.elastic) == (3, 3, False)
    assert launcher._check(fixed).min_ranks == 0
    for bad in ("4:2", "0", "a:b", "2:"):
        with pytest.raises(argparse.ArgumentTypeError):
            launcher.RankSpan(bad)
    with pytest.raises(SystemExit):
        launcher._parser().parse_args(["run", "--local", "--min-ranks", "2"])  # that is --ranks MIN:MAX
