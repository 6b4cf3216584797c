"""The Throttle's floor under ``max_batch_diff``: the fewest window steps any rank ran,
kept as a lazy heap (``cadence._dispatcher._min_window_steps``) instead of a walk over
every rank per batch. Checked at every call, in simulated runs that throttle, lose and
restart ranks and admit a late one, against that walk."""

from __future__ import annotations

import pytest

from flodl.core import Send, initial_state, step
from flodl.core.cadence import _dispatcher
from flodl.sim import SimConfig, simulate


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_the_throttle_floor_is_the_fewest_window_steps_of_any_rank(monkeypatch, policy):
    real = _dispatcher._min_window_steps
    asked = []

    def checked(st):
        got = real(st)
        assert got == min(_dispatcher.window_steps(st, r) for r in range(len(st.ranks)))
        asked.append(got)
        return got

    monkeypatch.setattr(_dispatcher, "_min_window_steps", checked)
    ms = tuple(10.0 * f for f in (1, 1, 2, 3, 5, 8)) * 2
    cfg = SimConfig(ms_per_batch=ms, total_samples=16 * 40 * 12, batch_size=16, epochs=4, policy=policy, seed=1,
                    fail_at={2: 30, 7: 55}, respawn_after_s=0.5, liveness_timeout_s=2.0, hello_at={11: 0.8},
                    core_overrides={"max_batch_diff": 2})  # fmt: skip
    res = simulate(cfg)
    assert res.finished is not None and res.finished.ok
    assert res.respawns >= 1 and len(asked) > 200  # ranks were lost and came back; the floor was asked often
    st, throttles = initial_state(res.state.config), 0
    for ev in res.events:  # (the journal replayed: the commands it decided)
        st, cmds = step(st, ev)
        throttles += sum(1 for c in cmds if type(c) is Send and c.kind == "throttle")
    assert throttles > 10  # the floor decided something
