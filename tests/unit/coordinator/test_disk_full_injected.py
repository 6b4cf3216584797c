"""Issue 9, item 3: a full disk is named, never a traceback or a cryptic torch message.

* the journal cannot be written (ENOSPC injected): the coordinator stops the run cleanly,
  names "no space left on device: PATH (journal)" and exits 2 -- the code the systemd
  unit does not restart -- at start as well as mid-run;
* a checkpoint that cannot be written (the rank's save, the coordinator's commit) fails
  with "no space left on device: PATH (...)"; the run goes on (and ends not ok, item 1).
"""

from __future__ import annotations

import configparser
import errno
import hashlib
import json
import pathlib
import threading

import pytest
import zmq

from flodl.core import CoreConfig, checkpoint_meta, initial_state
from flodl.wire import Endpoint, decode, pb, split_routing
from flodl_coordinator import journal as journal_mod
from flodl_coordinator.checkpoints import CheckpointStore
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import load_settings

SESSION = "disk-full-test"
ROOT = pathlib.Path(__file__).resolve().parents[3]


def enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def settings(tmp_path, **over):
    flags = {"world_size": 1, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 4,
             "liveness_timeout_s": 1.0, "journal": str(tmp_path / "run.journal"),
             "summary": str(tmp_path / "summary.json")}  # fmt: skip
    flags.update(over)
    return load_settings(env={}, flags=flags)


def run_in_thread(svc: CoordinatorService):
    box: dict = {}
    ready = threading.Event()

    def on_ready(ep: str) -> None:
        box["ep"] = ep
        ready.set()

    svc._ready = on_ready
    t = threading.Thread(target=lambda: box.setdefault("rc", svc.run(install_signals=False)), daemon=True)
    t.start()
    return box, ready, t


def full_from(monkeypatch, first: str | None = None) -> None:
    """The journal's disk is full from the first record of type ``first`` on (None: from
    the very first record); the OSError goes through the journal's own naming."""
    real = journal_mod.Journal.write
    full = {"on": first is None}

    def write(self, record):
        full["on"] = full["on"] or record.get("type") == first
        if not full["on"]:
            return real(self, record)
        try:
            raise enospc()
        except OSError as e:
            raise journal_mod.JournalError(journal_mod.describe_write_error(e, self.path, "journal")) from None

    monkeypatch.setattr(journal_mod.Journal, "write", write)


def test_a_journal_full_at_start_stops_cleanly_with_the_reason_and_exit_2(tmp_path, monkeypatch):
    full_from(monkeypatch)
    svc = CoordinatorService(settings(tmp_path))
    box, ready, t = run_in_thread(svc)
    t.join(10)
    assert not t.is_alive() and box["rc"] == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is False
    assert f"no space left on device: {tmp_path / 'run.journal'} (journal)" in summary["reason"]
    assert "can no longer guarantee recovery" in summary["reason"]


def test_a_journal_that_fills_mid_run_stops_the_run_and_tells_the_ranks(tmp_path, monkeypatch):
    full_from(monkeypatch, "RankHello")  # the start and the ticks fit; the rank's hello does not
    svc = CoordinatorService(settings(tmp_path))
    box, ready, t = run_in_thread(svc)
    assert ready.wait(10)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(box["ep"])
        me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=0, incarnation=1)
        sock.send_multipart(me.frames("hello", pb.RankHello(rank=0, world_size=1, model_sig=b"s" * 32, dataset_len=64)))
        kinds = []
        while sock.poll(5000):
            d = decode(split_routing(sock.recv_multipart())[1], session=SESSION)
            kinds.append(d.kind if d.kind != "control" else d.envelope.control.WhichOneof("cmd"))
            if kinds[-1] == "shutdown":
                reason = d.envelope.control.shutdown.reason
                break
        assert "shutdown" in kinds, kinds  # the rank is told, not left to time out
        assert "no space left on device" in reason and "(journal)" in reason
    finally:
        ctx.destroy(0)
    t.join(15)
    assert not t.is_alive() and box["rc"] == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is False and "no space left on device" in summary["reason"]


def test_the_systemd_unit_does_not_restart_exit_2():
    unit = configparser.ConfigParser(strict=False, interpolation=None)  # (%i: a systemd specifier)
    unit.read(ROOT / "coordinator" / "systemd" / "flodl-coordinator@.service")
    assert unit.sections(), "the unit file is missing"
    assert unit["Service"]["Restart"] == "on-failure"
    assert "2" in unit["Service"]["RestartPreventExitStatus"].split()


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(str(tmp_path / "ck"))


def test_a_commit_on_a_full_checkpoint_dir_fails_naming_it(store, tmp_path, monkeypatch):
    import flodl_coordinator.checkpoints as ck_mod

    st = initial_state(CoreConfig(world_size=1, batch_size=4, num_epochs=1, total_samples=16, policy="sync"))
    path = store.model_path(1, 0)
    pathlib.Path(path).write_bytes(b"weights")
    monkeypatch.setattr(ck_mod, "write_json_atomic", lambda *a, **k: (_ for _ in ()).throw(enospc()))
    store.stage_meta(1, json.loads(json.dumps(checkpoint_meta(st, 1))))
    (f,) = store.on_result(1, 0, error=None, sha256=hashlib.sha256(b"weights").digest())
    assert f.reason == f"commit failed: no space left on device: {tmp_path / 'ck'} (checkpoint_dir)"
    assert store.committed == []
