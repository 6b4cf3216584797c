"""flodl_worker.shell: carry out the rank machine's commands with torch and a socket.

``flodl.rank.RankMachine`` decides; ``MachineShell`` (mixed into the rank runtime, and
into the tests' doubles of it) executes each command in the order the machine returned
them. It needs from its host: ``m`` (the machine), ``averager`` (``take``, ``apply``,
``abandon``), ``checkpoints`` (``save``), ``_timing``, ``_send``, ``_drop``, and, for
the commands that reach them, ``_run_eval``, ``_run_epoch_fn`` / ``epoch_fn``,
``collective`` and ``_exit``.
"""

from __future__ import annotations

import logging

from flodl.rank import (
    AbandonRounds,
    ApplyConsensus,
    ConsensusReady,
    Drop,
    Event,
    Exit,
    FormGroup,
    RunEpochFn,
    RunEval,
    SaveCheckpoint,
    SendMetrics,
    SendTiming,
    TakeSnapshot,
    Warn,
)

__all__ = ["MachineShell"]

log = logging.getLogger("flodl.rank")


class MachineShell:
    def feed(self, ev: Event) -> list:
        """Step the machine with ``ev`` and carry out its commands; returns them."""
        cmds = self.m.handle(ev)
        self.execute(cmds)
        return cmds

    def consensus_ready(self, cycle: int, arrays) -> None:
        """An averager has the consensus of ``cycle`` (``arrays`` None: keep local)."""
        self.feed(ConsensusReady(cycle=cycle, arrays=arrays))

    def execute(self, cmds: list) -> None:
        for c in cmds:
            t = type(c)
            if t is SendTiming:
                self._timing(**{c.kind: c.body})
            elif t is TakeSnapshot:
                self.averager.take(c)
            elif t is ApplyConsensus:
                self.averager.apply(c)
            elif t is SaveCheckpoint:
                self.checkpoints.save(c)
            elif t is SendMetrics:
                self._send("metrics", c.metrics)
            elif t is Drop:
                self._drop(c.reason, c.detail)
            elif t is Warn:
                (log.info if c.level == "info" else log.warning)("%s", c.text)
            elif t is AbandonRounds:
                self.averager.abandon(c.cycles)
            elif t is RunEval:
                self._run_eval(c.command)
            elif t is RunEpochFn:
                if getattr(self, "epoch_fn", None) is not None:
                    self._run_epoch_fn(c.metrics)
            elif t is FormGroup:
                if self.collective is not None:
                    self.collective.on_rendezvous(c.command)
            elif t is Exit:
                self._exit(c)
            else:
                raise TypeError(f"no shell for the rank machine's {t.__name__}")
