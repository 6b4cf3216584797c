"""No round frame outruns the rank's batches, in virtual time: the simulator records a
violation for a snapshot of a step the rank had not reported (the reducer bounds a
snapshot's weight by the steps the coordinator heard, and refuses one above them). The
core's cluster checks the same rule with random interleavings
(tests/unit/core/test_round_frame_order.py); here it holds through every policy, with
unequal ranks and a coordinator crash. (With the rank machine reporting its batches
after a snapshot -- a defect of ab7ca5e's kind, made on purpose -- 5 of these 6 fail.)"""

import pytest

from flodl.sim import SimConfig, simulate


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
@pytest.mark.parametrize("ms, crash", [((10, 20, 40), ()), ((5, 5, 8, 13), (80,))])
def test_no_snapshot_outruns_the_batches_it_counts(policy, ms, crash):
    r = simulate(SimConfig(ms_per_batch=ms, total_samples=2400, batch_size=16, epochs=2, policy=policy, seed=3,
                           crash_at=crash))  # fmt: skip
    assert r.finished is not None and r.finished.ok, r.finished
    assert r.violations == []
    assert r.restarts == len(crash)
    for c in r.summary["coverage"]:
        assert (c["missing"], c["duplicates"]) == (0, 0), c
