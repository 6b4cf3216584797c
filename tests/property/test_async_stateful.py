"""The stateful core property test (``test_core_stateful``) under the Async policy.

Same rules, same independent ledger, same invariants (a position owned by at most one
live rank, never committed twice, the core's counts agree with the model, every epoch
exactly once at the end, the journal replays), with the policy fixed to Async: ranks
stream into the next epoch before the current one is aggregated, and a dead rank's
reclaimed hole in an older epoch may follow a chunk of a newer one -- so the model's
"the epoch never goes back" check on ``StartEpoch`` is the one thing relaxed (the
aggregated epoch still never goes back: ``epoch_never_goes_back``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from test_core_stateful import CoreMachine, Ledger


class AsyncLedger(Ledger):
    def command(self, c) -> None:
        self.max_epoch = -1  # Async: StartEpoch epochs interleave (streaming, reclaimed holes)
        super().command(c)


class AsyncMachine(CoreMachine):
    @initialize(
        ws=st.integers(1, 4),
        total=st.integers(1, 40),
        bs=st.integers(1, 8),
        epochs=st.integers(1, 3),
        prejoin=st.booleans(),
        anchor=st.integers(1, 4),
        max_batch_diff=st.sampled_from([None, None, 2]),
        report_ms=st.sampled_from([0.0, 25.0]),
        sweep=st.booleans(),
    )
    def setup(self, ws, total, bs, epochs, prejoin, anchor, max_batch_diff, report_ms, sweep):
        CoreMachine.setup(self, ws, total, bs, epochs, prejoin, False, "async", anchor, max_batch_diff, report_ms,
                          sweep)  # fmt: skip
        self.model = AsyncLedger(ws)


AsyncMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAsyncStateful = AsyncMachine.TestCase


def test_a_slower_batch_puts_the_ranks_a_wake_dropped_back_in_its_view():
    # Found by this machine: a slower batch raises every rank's ``round_wait_batches``,
    # so the budget of a probing rank held at its barrier; rank 1, dropped by a wake as
    # held, could be served by the next one but was out of its view (nobody woke it).
    from flodl.core._drift import view_drift

    m = AsyncMachine()
    m.setup(ws=4, total=23, bs=2, epochs=2, prejoin=False, anchor=1, max_batch_diff=None, report_ms=25.0, sweep=False)
    for _ in range(4):
        m.join()
    m.everyone_moves()
    m.everyone_moves()
    m.c.silence(0)
    m.c.advance(1.0)
    for _ in range(2):
        m.everyone_moves()
        assert view_drift(m.c.state) == []
