"""``flodl run``: what the ranks run (a command after ``--``, or a ``--task`` shortcut
with its arguments), and the report of ranks that all ended before the run did."""

from __future__ import annotations

import pytest

from flodl.cli import LaunchError, RankCommand, _ExitWatch, _parser, _RanksEnded, rank_command

PY = "/venv/bin/python"


def parsed(*argv: str):
    a = _parser().parse_args(["run", "--local", *argv])
    return rank_command(a.task, a.task_args, PY)


def test_a_command_after_the_separator_runs_as_given():
    assert parsed("--ranks", "2", "--", "python", "train.py", "--lr", "0.1", "--", "x") == RankCommand(
        ("python", "train.py", "--lr", "0.1", "--", "x"), "train.py")  # fmt: skip
    assert parsed("--", "python3", "-u", "-m", "pkg.train", "--epochs", "3").label == "pkg.train"
    assert parsed("--", "./train.sh", "a").label == "train.sh"


def test_the_task_shortcut_takes_the_arguments_that_start_with_a_dash():
    assert parsed() == RankCommand((PY, "-m", "flodl_worker.examples.digits"), "digits")
    assert parsed("--task", "synthetic", "--", "--samples", "64") == RankCommand(
        (PY, "-m", "flodl_worker.examples.synthetic", "--samples", "64"), "synthetic")  # fmt: skip


def test_a_task_and_a_command_together_are_refused():
    with pytest.raises(LaunchError, match="give --task digits or a command after --"):
        parsed("--task", "digits", "--", "python", "train.py")


def test_ranks_that_ended_first_are_reported_with_codes_and_last_lines():
    exits = [{"rank": 0, "code": 1, "last_lines": ["Traceback ...", "ImportError: no torchvision"]},
             {"rank": 1, "code": 0, "last_lines": []}]  # fmt: skip
    ended = _RanksEnded(exits, [], 1)
    assert ended.reason() == "the ranks ended before the run did: rank 0 exited with code 1 (ImportError: no torchvision)"
    assert "    ImportError: no torchvision" in ended.details().split("\n")
    clean = _RanksEnded([{"rank": 0, "code": 0, "last_lines": []}], [], 0).reason()
    assert "does the script call flodl_worker.run_rank" in clean
    agent = _RanksEnded([], ["flodl agent: [Errno 2] No such file or directory: 'pyhton'"], 1)
    assert agent.reason() == "the agent exited with code 1 before the run did, without starting a rank"
    assert "'pyhton'" in agent.details()


def test_a_failed_rank_is_said_once_as_the_exit_log_grows(tmp_path, capsys):
    log = tmp_path / "rank-exits.jsonl"
    watch = _ExitWatch(str(log))
    watch.say_failures()  # nothing yet
    log.write_text('{"rank": 0, "code": 0, "last_lines": []}\n{"rank": 2, "code": 1, "last_lines": ["OSError: no data"]}\n'
                   '{"rank": 1, "co')  # the agent is still writing the third line
    watch.say_failures()
    watch.say_failures()
    assert capsys.readouterr().err == "flodl: rank 2 exited with code 1: OSError: no data\n"
    log.write_text(log.read_text() + 'de": -9, "last_lines": []}\n')
    watch.say_failures()
    assert capsys.readouterr().err == "flodl: rank 1 exited with code -9\n"
