"""``flodl.procutil.exit_now``: a rank ends at once, yet as a normal exit would."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_now_runs_atexit_joins_threads_flushes_files_and_keeps_the_code(tmp_path):
    out = tmp_path / "out.txt"
    script = textwrap.dedent(f"""
        import atexit, logging, sys, threading, time
        from flodl.procutil import exit_now
        def late():
            time.sleep(0.2)
            open({str(out)!r}, "a").write("thread\\n")
        threading.Thread(target=late).start()          # not a daemon: joined first
        atexit.register(lambda: open({str(out)!r}, "a").write("atexit\\n"))
        log_file = open({str(tmp_path / "left-open.txt")!r}, "w")  # never closed by the user
        log_file.write("kept")
        logging.basicConfig(stream=sys.stderr)
        logging.getLogger("x").warning("logged")
        sys.stdout.write("unflushed")                   # no newline: still buffered
        exit_now(3)
        print("never")
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stderr
    assert p.stdout == "unflushed"
    assert "logged" in p.stderr
    assert out.read_text().splitlines() == ["thread", "atexit"]
    assert (tmp_path / "left-open.txt").read_text() == "kept"


def test_exit_now_prints_no_deprecation_warning_of_the_objects_it_scans():
    """A collective rank (torch.distributed imported) exited with a FutureWarning about
    ``reduce_op``: the scan for open files touched every live object."""
    script = "import torch.distributed\nfrom flodl.procutil import exit_now\nexit_now(0)\n"
    p = subprocess.run([sys.executable, "-W", "default", "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Warning" not in p.stderr, p.stderr
