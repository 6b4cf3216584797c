"""``flodl-coordinator replay`` of a resumed run's journal starts from its checkpoint."""

from __future__ import annotations

import json
from dataclasses import asdict

from flodl.core import checkpoint_meta, initial_state, resume_plan, to_record
from flodl_coordinator.cli import main
from flodl_coordinator.settings import Settings


def test_replay_uses_the_journal_resume_meta(Cluster, tmp_path, capsys):
    kw = dict(world_size=2, total=96, batch_size=8, epochs=4, policy="sync")
    first = Cluster(**kw)
    first.join_all()
    first.run_until(lambda: first.state.metrics.last_aggregated == 1)
    meta = json.loads(json.dumps(checkpoint_meta(first.state, first.state.rounds.version)))
    c = Cluster(**kw)
    c.state = initial_state(c.config, resume_plan(meta))
    c.join_all()
    fin = c.run()
    settings = Settings(world_size=2, batch_size=8, epochs=4, policy="sync")
    journal = tmp_path / "journal.jsonl"
    start = {"type": "_start", "settings": asdict(settings), "resume_meta": meta}
    lines = [start] + [to_record(ev) for ev in c.journal]
    journal.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["replay", str(journal)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finished"] and out["ok"] is fin.ok is True
    assert out["summary"]["epochs_completed"] == 4 == fin.summary["epochs_completed"]
    assert out["summary"]["global_step"] == fin.summary["global_step"]
