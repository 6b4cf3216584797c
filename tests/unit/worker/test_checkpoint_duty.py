"""flodl_worker.checkpoint_duty against a fake rank (no process, no socket).

Issue 9: the coordinator asks for the consensus of cycle c after the round finished,
and under Cadence the rank has trained on meanwhile: it must still save exactly that
consensus (it holds it until the next one lands), and refuse by name a cycle it no
longer holds.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from flodl.rank import Admitted, BatchTrained, ControlReceived, RankMachine
from flodl.wire import pb
from flodl_worker.averaging import BusAverager
from flodl_worker.buffers import averaged_buffers
from flodl_worker.checkpoint_duty import CheckpointDuty
from flodl_worker.shell import MachineShell


class FakeRank(MachineShell):
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.params = list(self.model.parameters())
        self.buffers = averaged_buffers(self.model)
        self.cfg = SimpleNamespace(rank=0)
        self.spec = pb.RunSpec(policy=pb.POLICY_CADENCE, gamma=1.0, total_samples=100, batch_size=8)
        self.m = RankMachine(0)
        self.m.handle(Admitted(spec=self.spec))
        self.timings: list = []
        self.checkpoints = CheckpointDuty(self)
        self.averager = BusAverager(self)

    def _timing(self, **event) -> None:
        self.timings.append(event)

    def _send(self, field, body, blobs=()) -> None:
        pass  # the round frame: the test plays the reducer

    def _drop(self, reason, detail) -> None:
        raise AssertionError(f"dropped: {reason}: {detail}")

    def step(self) -> None:
        x = torch.randn(8, 4)
        loss = self.model(x).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.feed(BatchTrained(epoch=0, offset=0, samples=8, loss=float(loss.detach())))

    def request(self, cycle: int) -> None:
        self.feed(ControlReceived(control=pb.Control(request_params=pb.Control.RequestParams(cycle=cycle))))

    def apply(self, cycle: int, consensus) -> None:
        """What ``round{cycle}`` does: snapshot, then the consensus (None: not included)."""
        self.request(cycle)
        self.consensus_ready(cycle, consensus)

    def results(self) -> list[pb.Timing.CheckpointResult]:
        return [t["checkpoint_result"] for t in self.timings if "checkpoint_result" in t]


def consensus_for(r: FakeRank, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(tuple(p.shape)).astype(np.float32) for p in r.params]


def ask(r: FakeRank, version: int, cycle: int, path) -> pb.Timing.CheckpointResult:
    r.feed(ControlReceived(control=pb.Control(
        checkpoint=pb.Control.Checkpoint(version=version, target_rank=0, path=str(path), cycle=cycle))))
    return r.results()[-1]


def test_the_consensus_asked_after_steps_since_is_saved_exactly(tmp_path):
    r = FakeRank()
    r.step()
    c1 = consensus_for(r, 1)
    r.apply(1, c1)
    for _ in range(3):  # Cadence: the next window trains before the Checkpoint arrives
        r.step()
    assert not np.allclose(r.params[0].detach().numpy(), c1[0])
    res = ask(r, 5, 1, tmp_path / "a" / "model.pt")
    assert not res.HasField("error"), res.error
    saved = torch.load(tmp_path / "a" / "model.pt", map_location="cpu", weights_only=True)
    names = [n for n, _ in r.model.named_parameters()]
    assert [saved["model"][n].numpy().tolist() for n in names] == [a.tolist() for a in c1]
    # the buffers and the optimizer state are the rank's, as they are now
    assert torch.equal(saved["model"]["1.running_mean"], r.model[1].running_mean)
    assert int(saved["model"]["1.num_batches_tracked"]) == 4
    assert len(saved["optimizer"]["state"]) == len(r.params)
    # the model itself is untouched by the save
    assert not np.allclose(r.params[0].detach().numpy(), c1[0])


def test_a_consensus_with_buffers_saves_the_averaged_f32_buffers_and_the_local_counter(tmp_path):
    r = FakeRank()
    r.step()
    rng = np.random.default_rng(3)
    bufs = [rng.random(tuple(b.shape)).astype(np.float32) + 0.5 for b in r.buffers]
    c1 = consensus_for(r, 1) + bufs  # params, then the f32 buffers (running_mean, running_var)
    r.apply(1, c1)
    assert [b.numpy().tolist() for b in r.buffers] == [a.tolist() for a in bufs]  # applied: overwritten
    r.step()  # trains on: the running stats move again, the held consensus does not
    res = ask(r, 8, 1, tmp_path / "d" / "model.pt")
    assert not res.HasField("error"), res.error
    saved = torch.load(tmp_path / "d" / "model.pt", map_location="cpu", weights_only=True)["model"]
    assert saved["1.running_mean"].numpy().tolist() == bufs[0].tolist()
    assert saved["1.running_var"].numpy().tolist() == bufs[1].tolist()
    assert int(saved["1.num_batches_tracked"]) == 2  # an integer buffer: the rank's own


def test_a_cycle_no_longer_held_is_refused_by_name(tmp_path):
    r = FakeRank()
    r.step()
    r.apply(1, consensus_for(r, 1))
    r.step()
    r.apply(2, consensus_for(r, 2))
    res = ask(r, 6, 1, tmp_path / "b" / "model.pt")
    assert res.HasField("error") and "consensus of cycle 1 is no longer held" in res.error
    assert "last applied cycle 2" in res.error
    assert not (tmp_path / "b" / "model.pt").exists()


def test_a_rank_whose_weights_are_not_in_the_consensus_holds_nothing(tmp_path):
    r = FakeRank()
    r.step()
    r.apply(1, consensus_for(r, 1))
    r.step()
    r.apply(2, None)  # not included (e.g. weight 0)
    r.step()  # moved on from its own weights: cycle 2 is not held as a consensus
    res = ask(r, 7, 2, tmp_path / "c" / "model.pt")
    assert res.HasField("error") and "no longer held" in res.error


def test_a_full_disk_is_named_not_torchs_message(tmp_path, monkeypatch):
    """Issue 9, item 3: torch.save on a full disk raises "unexpected pos ..." (its context
    is the OSError): the answer names the cause and the place."""
    import errno

    import flodl_worker.checkpoint_duty as duty_mod

    def full(path, *a, **k):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(duty_mod, "save_model_file", full)
    r = FakeRank()
    r.step()
    r.apply(1, consensus_for(r, 1))
    res = ask(r, 3, 1, tmp_path / "ck" / "model.pt")
    assert res.error == f"no space left on device: {tmp_path / 'ck'} (checkpoint)"
