"""``flodl_coordinator.recovery``: a restarted service rebuilds itself from its journal."""

from __future__ import annotations

import copy
import json
import pathlib
import pickle
from dataclasses import asdict, replace

import pytest

from flodl.core import CoordinatorRestarted, replay, to_record
from flodl.core import FINISHED, TRAINING
from flodl.wire import pb
from flodl_coordinator.checkpointing import Checkpointing
from flodl_coordinator.cli import main
from flodl_coordinator.recovery import HeldSends, agent_record, bind_address, continuing, recover
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import NO_BEFORE, SCHEMA, Settings, SettingsError, journaled_settings

def _settings(tmp_path, **over) -> Settings:
    base = dict(world_size=2, batch_size=8, epochs=3, policy="cadence", journal=str(tmp_path / "run.journal"))
    base.update(over)
    return Settings(**base)


def _write(settings: Settings, events, *, extra=(), finished=False, endpoint="tcp://127.0.0.1:5999") -> list:
    start = {"type": "_start", "settings": asdict(settings), "endpoint": endpoint}
    lines = [start, *extra, *(to_record(ev) for ev in events)]
    pathlib.Path(settings.journal).write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in lines))
    return lines


def _half_run(Cluster, settings: Settings):
    c = Cluster(total=96, config=settings.core_config())
    c.join_all()
    c.run_until(lambda: c.state.metrics.last_aggregated == 0 and c.ranks[0].step > 14)
    return c


def test_no_journal_or_an_empty_one_is_a_fresh_run(tmp_path):
    s = _settings(tmp_path)
    assert recover(s, Checkpointing(s)) is None
    pathlib.Path(s.journal).write_text("")
    assert recover(s, Checkpointing(s)) is None
    assert recover(replace(s, journal=""), Checkpointing(s)) is None


def test_an_unfinished_run_is_rebuilt_with_the_shells_own_state(Cluster, tmp_path):
    s = _settings(tmp_path)
    c = _half_run(Cluster, s)
    agent = agent_record((b"agent-gpu1",), pb.AgentMsg.AgentHello(host="gpu1", ranks=[1, 0]))
    assert agent == {"type": "_agent", "route": [b"agent-gpu1".hex()], "ranks": [0, 1], "host": "gpu1"}
    _write(s, c.journal, extra=[agent])
    rec = recover(s, Checkpointing(s))
    assert rec is not None
    assert rec.state == c.state and rec.state.run.phase is TRAINING
    assert rec.events == len(c.journal) and rec.last_now == max(ev.now for ev in c.journal)
    assert rec.agent_ranks == {(b"agent-gpu1",): {0, 1}}
    assert rec.hops() == {b"relay", b"agent-gpu1"}
    assert rec.endpoint == "tcp://127.0.0.1:5999"


def test_the_service_starts_from_the_journal(Cluster, tmp_path):
    s = _settings(tmp_path, bind="tcp://127.0.0.1:0")
    c = _half_run(Cluster, s)
    _write(s, c.journal)
    svc = CoordinatorService(s, clock=lambda: 1.0)  # a clock below the journal's: rebooted host
    assert svc.recovered is not None and svc.state == c.state
    assert svc.clock() >= c.state.now
    assert svc.endpoint.sender.incarnation != 0
    assert svc.held is not None and b"relay" in svc.held.unheard
    assert bind_address(svc.settings, svc.recovered) == "tcp://127.0.0.1:5999"
    other = CoordinatorService(_settings(tmp_path, journal=""))
    assert other.recovered is None and other.held is None
    assert other.endpoint.sender.incarnation != svc.endpoint.sender.incarnation


@pytest.mark.parametrize(
    "over, key",
    [({"world_size": 3}, "world_size"), ({"policy": "sync"}, "policy"), ({"session": "other"}, "session"),
     ({"seed": 7}, "seed"), ({"epochs": 4}, "epochs")],
)  # fmt: skip
def test_a_journal_of_another_run_is_refused_naming_the_key(Cluster, tmp_path, over, key):
    s = _settings(tmp_path)
    c = _half_run(Cluster, s)
    _write(s, c.journal)
    other = replace(s, **over)
    with pytest.raises(SettingsError, match=f"holds another run: {key} is") as refused:
        recover(other, Checkpointing(other))
    assert "predates" not in str(refused.value) and "absent" not in str(refused.value)  # (the key is in the journal)
    # The service's own keys may change.
    same = replace(s, bind="tcp://127.0.0.1:6000", summary="x.json", http="127.0.0.1:0", tick_interval_s=0.1)
    assert recover(same, Checkpointing(same)) is not None


@pytest.mark.parametrize("key", ["batch_reports_per_s", "batch_report_ms"])
def test_a_journal_from_before_a_setting_ran_as_its_old_behaviour(Cluster, tmp_path, key):
    """A journal written before ``key`` existed lacks it, and that run behaved as the
    setting's ``before`` (0: no stretch / a frame per batch), not as today's default:
    recovering it under the default would replay it under another rule. Refused, naming
    the key and why; with the old value set, it is the same run."""
    old = _settings(tmp_path, **{key: 0.0})
    c = _half_run(Cluster, old)
    lines = _write(old, c.journal)
    del lines[0]["settings"][key]  # as a journal written before the setting
    pathlib.Path(old.journal).write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in lines))
    today = _settings(tmp_path)
    assert getattr(today, key) != 0.0  # (the default changed the behaviour: that is the hazard)
    with pytest.raises(SettingsError, match=f"{key} is 0.0 there \\(its journal predates the setting"):
        recover(today, Checkpointing(today))
    rec = recover(old, Checkpointing(old))
    assert rec is not None and rec.state == c.state


def test_a_finished_run_is_refused_or_rotated(Cluster, tmp_path):
    s = _settings(tmp_path)
    c = Cluster(total=48, config=replace(s, epochs=1).core_config())
    s = replace(s, epochs=1)
    c.join_all()
    c.run()
    assert c.state.run.phase is FINISHED
    _write(s, c.journal)
    with pytest.raises(SettingsError, match="holds a finished run"):
        recover(s, Checkpointing(s))
    rot = replace(s, rotate_journal=True)
    assert recover(rot, Checkpointing(rot)) is None
    assert not pathlib.Path(s.journal).exists() and pathlib.Path(s.journal + ".1").exists()


def test_a_torn_last_line_is_cut_off_and_a_torn_middle_refused(Cluster, tmp_path):
    s = _settings(tmp_path)
    c = _half_run(Cluster, s)
    _write(s, c.journal)
    path = pathlib.Path(s.journal)
    good = path.read_bytes()
    path.write_bytes(good + b'{"type": "BatchDone", "now": 9')  # died mid-write
    rec = recover(s, Checkpointing(s))
    assert rec is not None and rec.state == c.state
    assert path.read_bytes() == good  # appending after it stays valid JSON lines
    lines = good.split(b"\n")
    lines[3] = lines[3][:10]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(SettingsError, match="line 4 is not JSON"):
        recover(s, Checkpointing(s))


def test_a_journal_with_a_restart_replays_via_the_cli(Cluster, tmp_path, capsys):
    s = _settings(tmp_path)
    s = replace(s, epochs=2)
    c = Cluster(total=48, config=s.core_config())
    c.join_all()
    c.run_until(lambda: c.ranks[1].step >= 2)
    c.feed(CoordinatorRestarted(now=c.now, incarnation=3))
    fin = c.run()
    # (each rank machine notices the new incarnation on its next frame and reports its resync)
    restart = {"type": "_restart", "endpoint": "tcp://127.0.0.1:5999", "incarnation": 3}
    lines = [{"type": "_start", "settings": asdict(s)}] + [to_record(ev) for ev in c.journal]
    i = next(k for k, x in enumerate(lines) if x["type"] == "CoordinatorRestarted")
    lines.insert(i, restart)
    pathlib.Path(s.journal).write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["replay", s.journal]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finished"] and out["ok"] is fin.ok is True
    assert out["events"] == len(c.journal)
    assert out["summary"]["coordinator_restarts"][0]["restart"] == 1
    assert replay(c.config, c.journal) == c.state


def test_a_journals_settings_are_read_as_the_run_ran(tmp_path, capsys):
    """``journaled_settings``: a key the record lacks is the setting's ``before`` where it
    declares one, else its default; a key this version does not know is refused, named
    (``replay`` too: exit 2, one line), not dropped."""
    s = _settings(tmp_path)
    record = asdict(s)
    del record["batch_reports_per_s"], record["seed"]  # one declares a before, one does not
    ran = journaled_settings(record, "journal J")
    assert ran.batch_reports_per_s == 0.0 and ran.seed == s.seed == 42
    assert replace(ran, batch_reports_per_s=s.batch_reports_per_s) == s
    with pytest.raises(SettingsError, match="journal J: its settings name keys this flodl does not know: zeta"):
        journaled_settings({**asdict(s), "zeta": 1}, "journal J")
    with pytest.raises(SettingsError, match="journal J: its settings lack world_size: not a run's journal"):
        journaled_settings({k: v for k, v in asdict(s).items() if k != "world_size"}, "journal J")
    # (the "no before" mark is the same object after a copy or a pickle: never read as a value)
    meta = next(k.meta for k in SCHEMA.values() if k.name == "seed")
    assert copy.deepcopy(meta).before is pickle.loads(pickle.dumps(meta)).before is NO_BEFORE
    pathlib.Path(s.journal).write_text(json.dumps({"type": "_start", "settings": {**asdict(s), "zeta": 1}}) + "\n")
    assert main(["replay", s.journal]) == 2
    assert "does not know: zeta" in capsys.readouterr().err


def test_continuing_clock_never_runs_backwards():
    class R:
        last_now = 100.0

    clock = continuing(lambda: 5.0, R())
    assert clock() == 100.0
    assert continuing(lambda: 200.0, R())() == 200.0
    assert continuing(lambda: 1.0, None)() == 1.0


def test_held_sends_wait_for_their_peer_in_order():
    held = HeldSends({b"relay-a", b"rank-9"})
    sent: list = []
    up = {b"relay-a": False}

    def send(frames):
        if not up.get(bytes(frames[0]), True):
            return False
        sent.append(frames)
        return True

    f1 = [b"relay-a", b"rank-0", b"", b"one"]
    f2 = [b"relay-a", b"rank-1", b"", b"two"]
    assert held.intercept(f1) and held.intercept(f2)
    assert not held.intercept([b"relay-b", b"", b"x"])  # never known: not held
    assert not held.intercept([b"", b"x"])  # no route
    held.retry(send)
    assert sent == [] and b"relay-a" in held.unheard  # still unroutable
    up[b"relay-a"] = True
    held.heard(b"relay-a", send)
    assert sent == [f1, f2] and b"relay-a" not in held.unheard
    assert not held.intercept([b"relay-a", b"rank-0", b"", b"three"])  # back: sent directly
    assert held  # rank-9 is still away
    held.retry(send)  # nothing held for it: nothing to prove yet
    assert held.intercept([b"rank-9", b"", b"beat"])
    held.retry(send)
    assert not held and sent[-1] == [b"rank-9", b"", b"beat"]


def test_a_recovered_service_shows_the_run_from_its_start_on_the_dashboard(Cluster, tmp_path):
    s = _settings(tmp_path)
    c = _half_run(Cluster, s)
    _write(s, c.journal)
    svc = CoordinatorService(s)  # replays the journal: the timeline sees every replayed step
    snap = svc.timeline.snapshot()
    assert [lane["marks"][0]["kind"] for lane in snap["lanes"]] == ["join", "join"]
    assert all(any(sp[0] == "round" for sp in lane["spans"]) for lane in snap["lanes"])
    assert [e["epoch"] for e in snap["epochs"]] == [h["epoch"] for h in c.state.metrics.history] == [0]
