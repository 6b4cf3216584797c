"""Issue 9, item 3, on a real full file system (a 64 KiB tmpfs; needs root, else skipped).

* The journal's disk fills while the coordinator runs: it stops cleanly, names
  "no space left on device: J (journal)" and exits 2 (not restarted by systemd); started
  again on the still-full disk, it fails the same clean way -- never a traceback.
* The checkpoint directory is full: every save fails naming the cause, the run trains on
  to its end, and ends not ok, exit 1, listing the missing checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from runlocal import ROOT, run_local

pytestmark = pytest.mark.integration


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    except OSError:
        pytest.skip("no mount(8) here")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(mnt, leave: int = 0) -> None:
    """Fill the file system, leaving about ``leave`` bytes."""
    with open(mnt / "filler", "ab") as fh:
        try:
            while True:
                st = os.statvfs(mnt)
                free = st.f_bavail * st.f_frsize
                if free <= leave:
                    break
                fh.write(b"\0" * min(4096, free - leave))
                fh.flush()
        except OSError:
            pass


def serve(journal, summary, timeout=60):
    cmd = [sys.executable, "-m", "flodl_coordinator", "serve", "--world-size", "1", "--bind", "tcp://127.0.0.1:0",
           "--journal", str(journal), "--summary", str(summary), "--session", "disk-full"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_journal_whose_disk_fills_stops_cleanly_and_a_restart_fails_the_same_way(tiny_fs, tmp_path):
    journal = tiny_fs / "run.journal"
    proc = serve(journal, tmp_path / "s1.json")
    try:
        deadline = time.monotonic() + 30
        while not (journal.exists() and journal.stat().st_size > 0):  # its _start record is written
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        fill(tiny_fs)  # the ticks it journals soon need a page the disk does not have
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, out[-3000:]
    assert f"no space left on device: {journal} (journal)" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    summary = json.loads((tmp_path / "s1.json").read_text())
    assert summary["ok"] is False and "(journal)" in summary["reason"]

    for attempt in range(2):  # what systemd would do, were it to restart it: the same clean stop
        proc = serve(journal, tmp_path / f"s{attempt + 2}.json")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 2, out[-3000:]
        assert f"no space left on device: {journal} (journal)" in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]


def test_a_full_checkpoint_dir_fails_each_save_by_name_and_the_run_goes_on_not_ok(tiny_fs, tmp_path):
    ck = tiny_fs / "ck"
    ck.mkdir()
    fill(tiny_fs, leave=4096)
    proc, summary, _ = run_local(
        tmp_path, "--ranks", "2", "--task", "digits", "--slowdown", "1,2", "--base-ms", "0", "--epochs", "3",
        "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--quiet",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["ok"] is False and summary["epochs_completed"] == 3  # it trained on to the end
    cks = summary["checkpoints"]
    assert cks["committed"] == [] and len(cks["missing"]) == len(cks["asked"]) >= 1
    assert "asked checkpoint(s) not committed" in summary["reason"]
    for m in cks["missing"]:
        assert "no space left on device" in m["reason"], m
    assert all("no space left on device" in f["reason"] for f in cks["failed"]), cks["failed"]
    assert "unexpected pos" not in json.dumps(cks)
