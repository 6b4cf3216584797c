"""Formation's fail-fast rule: a world that can no longer form fails now, not at ``form_timeout_s``.

Theory of operation
-------------------
Before the world forms, an agent's exit report is not only a loss (``_step.forget_rank``
for an admitted slot): it says whether the slot can still be filled. A report whose
agent will not start the process again (``restarting`` False: no ``--max-restarts``
left, or an exit it never retries -- 0, 2, or the agent is stopping) makes the process
*gone for good*:

* a pinned process (``rank`` >= 0): its slot is gone (``RunState.gone``), with why --
  the exit, the refusal it had (a rank refused at hello exits 2), its last line;
* an unpinned process that held no slot (``rank`` is ``UNPLACED``): one process fewer
  to fill the free slots (``RunState.unplaced_gone``, keyed by agent and local rank).

A report with ``restarting`` True changes nothing but the slot's note: the next process
comes. A slot is admitted again (``on_admitted``) -- another agent pinned to it, a report
that overtook a restarted process's hello -- and it is no longer gone.

What "possible" means: every slot is possible unless it is known lost. The admitted
slots, plus the VACANT ones less those gone (a deferred hello waiting for the slot keeps
it possible) and less one for each unpinned process gone before taking one (it would
have taken one), is what the world can still have. When that is below the quorum (``min_ranks``; a fixed
world needs every slot), ``hopeless`` names the lost slots and the run fails at once
(``_run._forming_move``: ``fail_formation``). A slot nobody has claimed yet counts as
possible -- an agent not started yet may still bring it -- so such a world waits for
``form_timeout_s`` as before.

An evicted holder (the cohort vote, ``_membership._deferred``) was told to leave: the
first exit report for its slot is its exit and costs the slot nothing (``evicted``).

Everything here is a function of journaled events (the reports carry ``restarting`` and
``last_lines``), so a replay fails the run at the same event.
"""

from __future__ import annotations

from typing import Optional

from ._commands import Command, Notice
from ._events import RankExitReported
from ._phases import FORMING, JOINING, VACANT
from ._state import CoordinatorState

__all__ = ["on_exit", "on_unplaced_exit", "on_admitted", "hopeless", "MAX_EXIT_LINES", "MAX_EXIT_LINE_CHARS"]

# What a report's last lines may cost the journal and the summary (a traceback's end).
MAX_EXIT_LINES = 12
MAX_EXIT_LINE_CHARS = 300


def _last_line(ev: RankExitReported) -> str:
    lines = [ln.strip() for ln in ev.last_lines[-MAX_EXIT_LINES:] if ln.strip()]
    return lines[-1][:MAX_EXIT_LINE_CHARS] if lines else ""


def _ended(ev: RankExitReported, reason: str, refusal: str, when: str) -> str:
    """'exited with code 1 (refused: ...) before ...; its last line: X' -- what the operator reads."""
    why = reason + (f" ({refusal})" if refusal else "") + f" {when}"
    last = _last_line(ev)
    return why + (f"; its last line: {last}" if last else "")


def on_exit(st: CoordinatorState, ev: RankExitReported, reason: str, out: list[Command]) -> None:
    """A pinned slot's process ended before the world formed (its slot is VACANT now)."""
    if st.run.phase is not FORMING:
        return
    rank = ev.rank
    if rank in st.run.evicted:
        st.run.evicted.discard(rank)
        st.count_ignored("exit report of an evicted holder")
        return
    refusal = st.run.not_admitted.get(rank, "")
    refusal = refusal if refusal.startswith("refused") else ""
    ended = _ended(ev, reason, refusal, "before the world formed")
    if ev.restarting:
        st.run.not_admitted[rank] = f"{ended}; its agent starts it again"
        return
    why = f"{ended}; its agent does not start it again"
    st.run.gone[rank] = why
    st.run.not_admitted[rank] = why
    out.append(Notice("slot_gone", {"rank": rank, "code": ev.code, "detail": why, "last_lines": list(ev.last_lines)}))


def on_unplaced_exit(st: CoordinatorState, ev: RankExitReported, reason: str, out: list[Command]) -> None:
    """An unpinned process that held no slot ended: before the world forms, a process
    gone for good is one fewer to fill the free slots."""
    if st.run.phase is not FORMING:
        st.count_ignored("exit report of an unpinned process that held no slot")
        return
    if ev.restarting:
        return
    key = f"{ev.agent[:16] or '?'}/{ev.local_rank}"
    why = f"an unpinned process (agent {key}) {_ended(ev, reason, '', 'before it took a slot')}; its agent does not start it again"
    st.run.unplaced_gone[key] = why
    out.append(Notice("slot_gone", {"rank": None, "code": ev.code, "detail": why, "last_lines": list(ev.last_lines)}))


def on_admitted(st: CoordinatorState, rank: int) -> None:
    st.run.gone.pop(rank, None)
    st.run.evicted.discard(rank)


def _lost_slots(st: CoordinatorState) -> list[int]:
    return sorted(r for r in st.run.gone if st.ranks[r].phase is VACANT and r not in st.run.cohort_votes)


def hopeless(st: CoordinatorState) -> Optional[str]:
    """Why the world can no longer form (the slots still possible are below the quorum),
    or None. O(gone): it runs on every event while forming."""
    if not st.run.gone and not st.run.unplaced_gone:
        return None
    lost = _lost_slots(st)
    unplaced = st.run.unplaced_gone
    admitted = st.index.count(JOINING)
    vacant = len(st.ranks) - admitted  # (before the world forms a slot is JOINING or VACANT)
    possible = admitted + max(0, vacant - len(lost) - len(unplaced))
    quorum = st.config.quorum
    if possible >= quorum:
        return None
    named = [f"rank {r}: {st.run.gone[r]}" for r in lost] + [unplaced[k] for k in sorted(unplaced)]
    if st.config.elastic:
        need = f"{possible} of {len(st.ranks)} slots can still be filled, below min_ranks {quorum}"
    else:
        need = "every slot is needed"
    return f"the world can no longer form ({need}): {'; '.join(named)}"
