"""Real processes: kill -9 the coordinator mid-epoch, start it again on its journal.

The restarted coordinator rebuilds its state by replaying the journal, the ranks hear
its new incarnation and resync, and the run finishes as if nothing happened: every
epoch's samples committed exactly once (the summary), every sample trained exactly once
(the ranks' own traces: a batch whose report died with the old process is recovered from
the rank, never trained again), and every rank ends on the same parameters.
"""

from __future__ import annotations

import signal
import sys

import pytest

from flodl.core import batches_in
from restartrig import RestartRun, check_restarted_run, resume_gap, wait_for
from runlocal import read_journal

pytestmark = pytest.mark.integration

TRAIN = 1437  # load_digits, 80% train split
BATCH = 16
DIGITS = ("--slowdown", "1,1,2", "--base-ms", "3", "--", sys.executable, "-m", "flodl_worker.examples.digits")


def _batches(run: RestartRun) -> int:
    return sum(batches_in(r) for r in read_journal(run.journal))


@pytest.mark.parametrize("policy, kill_at", [("cadence", 50), ("sync", 120)])
def test_kill9_the_coordinator_mid_epoch_and_restart_it(tmp_path, policy, kill_at):
    run = RestartRun(tmp_path, policy, BATCH, agent_args=DIGITS)
    try:
        coord = run.start_coordinator("coordinator-1")
        agent = run.start_agent()
        wait_for(lambda: _batches(run) >= kill_at, f"{kill_at} batches journaled", coord)
        coord.send_signal(signal.SIGKILL)
        coord.wait(timeout=10)
        assert coord.returncode == -signal.SIGKILL
        # systemd's Restart=on-failure: the same command line, the same journal.
        coord2 = run.start_coordinator("coordinator-2")
        rc = coord2.wait(timeout=120)
        assert rc == 0, run.tail()
        assert agent.wait(timeout=60) == 0, run.tail()
    finally:
        run.stop_all()
    summary, restart, _ = check_restarted_run(run, TRAIN)
    journal = read_journal(run.journal)
    assert sum(r.get("type") == "_start" for r in journal) == 1
    assert sum(r.get("type") == "_restart" for r in journal) == 1
    back, batch = resume_gap(journal)
    print(f"\n{policy}: kill -9 after {kill_at} batches journaled; the restarted coordinator's first "
          f"event came {back:.2f}s after the last one of the killed process, its first BatchDone after "
          f"{batch if batch is None else round(batch, 2)}s; {restart}")  # fmt: skip
