"""ElChe's per-rank columns (numpy) against the loop they replaced, bit for bit.

``TrustRings`` and the column-wise ``recompute_batch_counts`` / window cap are meant to be
the same arithmetic as a Python loop over every rank (``.importlinter`` allows numpy in
``_elche`` on that condition). ``Reference`` below is that loop, as it was: deques of the
last five readings, a left-to-right mean, one rank at a time. Random worlds -- readings
with gaps and non-finite values, callback slack, ``max_batch_diff``, a binding window cap,
restores -- go through both, and every smoothed mean and every count must be equal
(``==`` on floats: not close, the same).
"""

import math
from collections import deque
from functools import reduce
from operator import add

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.core.cadence import _elche
from flodl.core.cadence._elche import (
    DEAD_ZONE,
    MAX_SPEED_RATIO,
    TRUST_WINDOW_CAP,
    ElChe,
    round_half_away,
)


class Reference:
    """The per-rank loops of ElChe before its columns (the rules, one rank at a time)."""

    def __init__(self, ws: int) -> None:
        self.rings = [deque(maxlen=TRUST_WINDOW_CAP) for _ in range(ws)]
        self.missed = [0] * ws

    def push(self, wall_ms, batches) -> None:
        for r in range(len(self.rings)):
            wall, n = float(wall_ms[r]), int(batches[r])
            if n > 0 and wall > 0.0 and math.isfinite(wall):
                self.rings[r].append(wall / n)
                self.missed[r] = 0
            else:
                self.missed[r] += 1
                if self.missed[r] >= TRUST_WINDOW_CAP:
                    self.rings[r].clear()

    def means(self) -> list[float]:
        return [reduce(add, ring, 0.0) / len(ring) if ring else 0.0 for ring in self.rings]

    def counts(self, el: ElChe, before: list[int], slow_ms: float, slack_of: list[float]) -> list[int]:
        counts = list(before)
        for r, ms in enumerate(self.means()):
            if ms <= 0.0 or abs(ms - slow_ms) < _elche._SAME_MS:
                base = el.anchor
            else:
                base = max(1, round_half_away(el.anchor * min(slow_ms / ms, MAX_SPEED_RATIO)))
            slack = math.ceil(slack_of[r] / ms) if slack_of[r] > 0.0 and ms > 0.0 else 0
            target = max(1, base - slack)
            current = counts[r]
            if abs(target - current) > current * DEAD_ZONE or not el.calibrated or slack > 0:
                m = el.max_batch_diff
                if m is not None and el.calibrated:
                    target = min(current + m, target) if target > current else max(current - m, target, 1)
                counts[r] = target
        return cap(counts, el.max_total_batches)


def cap(counts: list[int], cap_total) -> list[int]:
    total = sum(counts)
    if cap_total is None or not total > cap_total > 0:
        return counts
    scale = cap_total / total
    exact = [c * scale for c in counts]
    out = [max(1, math.floor(x)) for x in exact]
    left = cap_total - sum(out)
    if left > 0:
        order = sorted(range(len(out)), key=lambda r: (exact[r] - math.floor(exact[r]), out[r], r), reverse=True)
        for r in order[:left]:
            out[r] += 1
    return out


reading = st.one_of(
    st.floats(min_value=0.5, max_value=5000.0),
    st.sampled_from([0.0, -1.0, math.inf, math.nan]),  # a rank that did not move, a hostile frame
)


@settings(max_examples=80, deadline=None)
@given(
    ws=st.integers(min_value=1, max_value=40),
    data=st.data(),
    anchor=st.integers(min_value=1, max_value=64),
    max_diff=st.one_of(st.none(), st.integers(min_value=1, max_value=8)),
    cap_total=st.integers(min_value=0, max_value=400),
)
def test_columns_compute_what_the_rank_by_rank_loop_computes(ws, data, anchor, max_diff, cap_total):
    el = ElChe(ws, anchor, max_batch_diff=max_diff, max_total_batches=cap_total)
    ref = Reference(ws)
    for _window in range(data.draw(st.integers(min_value=1, max_value=12))):
        wall = data.draw(st.lists(reading, min_size=ws, max_size=ws))
        batches = data.draw(st.lists(st.integers(min_value=0, max_value=50), min_size=ws, max_size=ws))
        el._push_readings(wall, batches)
        ref.push(wall, batches)
        means = el.ms_per_batch()
        assert means == ref.means()
        for r in range(ws):
            one = el.smoothed_ms_per_batch(r)
            assert (one if one is not None else 0.0) == means[r]
        if data.draw(st.booleans()):
            el.apply_callback_slack(data.draw(st.lists(st.floats(min_value=0.0, max_value=900.0),
                                                       min_size=ws, max_size=ws)))  # fmt: skip
        slack, before = list(el.pending_callback_slack_ms), list(el.batch_counts)
        slow_ms = max([0.0, *means]) or 1.0
        el.recompute_batch_counts(slow_ms)
        assert el.batch_counts == ref.counts(el, before, slow_ms, slack)
        assert all(type(c) is int for c in el.batch_counts)
        el.calibrated = el.calibrated or data.draw(st.booleans())


def test_a_restored_ring_holds_one_reading_its_saved_mean():
    el = ElChe(3, 4)
    el._push_readings([30.0, 0.0, 90.0], [3, 0, 9])
    el._push_readings([40.0, 0.0, 100.0], [4, 0, 10])
    saved = el.to_state()
    back = ElChe(3, 4)
    back.restore_from_state(saved)
    assert back.ms_per_batch() == [10.0, 0.0, 10.0]
    assert back.smoothed_ms_per_batch(1) is None
    assert back._rings.count.tolist() == [1, 0, 1]


def test_a_count_exactly_half_way_rounds_away_from_zero_as_the_loop_does():
    # anchor x slow / ms = 1.5 and 4.5: Rust's round (half away from zero), not banker's.
    for anchor, want in ((1, [1, 2]), (3, [3, 5])):
        el, ref = ElChe(2, anchor), Reference(2)
        el._push_readings([30.0, 20.0], [1, 1])
        ref.push([30.0, 20.0], [1, 1])
        before, slack = list(el.batch_counts), list(el.pending_callback_slack_ms)
        el.recompute_batch_counts(30.0)
        assert el.batch_counts == want == ref.counts(el, before, 30.0, slack)
