"""Real processes, collective plane: kill -9 the coordinator mid-epoch, start it again on
its journal (``flodl-coordinator serve --plane collective --journal J``).

The restarted coordinator replays the journal, abandons the open round and announces a
new process-group generation (``flodl.core._collective``: a restart re-forms the group
among the alive ranks); each rank, on hearing the new incarnation, sends its resync and
abandons its pending collective work (``flodl_worker.collective``), then builds the new
generation's group. The run finishes as if nothing happened: every epoch's samples
committed exactly once (summary) and trained exactly once (the ranks' own traces), every
rank on the same parameters, and the journal replays to the same finished run.
"""

from __future__ import annotations

import signal
import sys

import pytest

from restartrig import RestartRun, check_restarted_run, resume_gap, wait_for
from runlocal import read_journal

pytestmark = pytest.mark.integration

TRAIN = 1024  # the synthetic task (quick start: no dataset import)
BATCH = 16
SYNTHETIC = (
    "--slowdown", "1,2,4", "--base-ms", "2", "--", sys.executable, "-m", "flodl_worker.examples.synthetic",
    "--samples", str(TRAIN), "--test-samples", "256", "--hidden", "32",
)  # fmt: skip


def _acked_cycles(run: RestartRun) -> set[int]:
    return {r["cycle"] for r in read_journal(run.journal) if r.get("type") == "SyncAcked"}


@pytest.mark.parametrize("policy", ["cadence", "sync"])
def test_kill9_the_coordinator_on_the_collective_plane_and_restart_it(tmp_path, policy):
    run = RestartRun(tmp_path, policy, BATCH, coordinator_args=("--plane", "collective"), agent_args=SYNTHETIC)
    try:
        coord = run.start_coordinator("coordinator-1")
        agent = run.start_agent()
        # Strike while the group of generation 1 is live and reducing: right after a
        # second cycle was acked by someone (the next round is about to open or open).
        wait_for(lambda: any(c >= 2 for c in _acked_cycles(run)), "cycle 2 acked", coord)
        coord.send_signal(signal.SIGKILL)
        coord.wait(timeout=10)
        assert coord.returncode == -signal.SIGKILL
        coord2 = run.start_coordinator("coordinator-2")  # systemd: same command, same journal
        rc = coord2.wait(timeout=90)
        assert rc == 0, run.tail()
        assert agent.wait(timeout=60) == 0, run.tail()
    finally:
        run.stop_all()
    (tmp_path / "out.txt").write_text("\n".join(run.logs))  # kept for a post-mortem
    summary, restart, rep = check_restarted_run(run, TRAIN)
    col = summary["collective"]
    # The restart re-formed the group among the same ranks as a new generation.
    assert col["generation"] >= 2 and col["reforms"] >= 1 and sorted(col["members"]) == [0, 1, 2], col
    assert summary["bus"]["rounds"] == 0
    assert rep["summary"]["collective"] == col
    journal = read_journal(run.journal)
    assert sum(r.get("type") == "_restart" for r in journal) == 1
    back, batch = resume_gap(journal)
    print(f"\n{policy}: the restarted coordinator's first event came {back:.2f}s after the killed one's "
          f"last, its first BatchDone after {batch if batch is None else round(batch, 2)}s; {restart}; {col}")  # fmt: skip
