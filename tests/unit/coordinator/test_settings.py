"""Settings: file < env < flags, and one clear line per defect."""

import pytest

from flodl_coordinator.settings import SettingsError, load_settings


def test_precedence_flag_over_env_over_file(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[coordinator]\nworld_size = 2\nepochs = 3\nbatch_size = 16\n')
    s = load_settings(config_path=str(cfg), env={"FLODL_EPOCHS": "5"}, flags={"batch_size": 8})
    assert (s.world_size, s.epochs, s.batch_size) == (2, 5, 8)


def test_unknown_key_names_the_key_and_file(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("world_size = 2\nwrold_size = 3\n")
    with pytest.raises(SettingsError, match=r"unknown key 'wrold_size' in .*bad.toml"):
        load_settings(config_path=str(cfg), env={})


def test_missing_world_size_says_how_to_set_it():
    with pytest.raises(SettingsError, match="world_size must be >= 1 .*--world-size"):
        load_settings(env={})


def test_ranks_below_one_is_refused():
    with pytest.raises(SettingsError, match="world_size must be >= 1"):
        load_settings(env={}, flags={"world_size": 0})


def test_wrong_type_names_the_source():
    with pytest.raises(SettingsError, match="epochs = 'many' from the environment is not a valid int"):
        load_settings(env={"FLODL_WORLD_SIZE": "2", "FLODL_EPOCHS": "many"})


def test_bad_policy_is_refused_by_the_core_rules():
    with pytest.raises(SettingsError, match="policy must be one of"):
        load_settings(env={}, flags={"world_size": 2, "policy": "fastest"})


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(config_path=str(tmp_path / "nope.toml"), env={})
    bad = tmp_path / "x.toml"
    bad.write_text("world_size = = 2")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(config_path=str(bad), env={})


def test_max_failure_reaches_the_core_and_is_checked_there():
    s = load_settings(env={"FLODL_MAX_FAILURE": "25%"}, flags={"world_size": 4})
    assert s.core_config().max_failure == "25%"
    assert load_settings(env={}, flags={"world_size": 4, "max_failure": "2"}).core_config().max_failure == "2"
    with pytest.raises(SettingsError, match="max_failure must be 'N' or 'P%'"):
        load_settings(env={}, flags={"world_size": 4, "max_failure": "lots"})


def test_checkpoint_settings_reach_the_core(tmp_path):
    s = load_settings(env={}, flags={"world_size": 2, "checkpoint_dir": str(tmp_path), "checkpoint_every": 2})
    cfg = s.core_config()
    assert (cfg.checkpoint_every, cfg.checkpoint_on_failure) == (2, True)
    assert load_settings(env={}, flags={"world_size": 2}).core_config().checkpoint_on_failure is False


def test_the_cli_has_a_max_failure_flag():
    from flodl_coordinator.cli import _parser

    args = _parser().parse_args(["serve", "--max-failure", "30%"])
    assert args.max_failure == "30%"
