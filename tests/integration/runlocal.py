import json
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


ALARMING = (" WARNING ", " ERROR ", "Traceback")


def alarming(out: str, words: tuple[str, ...] = ALARMING) -> str:
    """What in ``out`` a healthy run must not say -- a warning, an error, a traceback --
    each with the lines around it (a traceback whole, up to 30 lines), so that a failure
    says where it came from; "" when nothing."""
    lines = out.splitlines()
    shown, last = [], -1
    for i, line in enumerate(lines):
        if i <= last or not any(w in line for w in words):
            continue
        last = min(len(lines) - 1, i + (30 if "Traceback" in line else 2))
        shown.append("\n".join(lines[max(0, i - 3): last + 1]))
    return "\n---\n".join(shown)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(tmp_path: Path, *args: str, timeout: float = 240, port: int | None = None):
    """Run `flodl run --local ...`; return (completed process, summary dict or None, trace dir)."""
    summary = tmp_path / "summary.json"
    trace = tmp_path / "trace"
    trace.mkdir(exist_ok=True)
    cmd = [
        sys.executable, "-m", "flodl", "run", "--local",
        "--summary", str(summary), "--trace-dir", str(trace), "--port", str(port or 0), *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    data = json.loads(summary.read_text()) if summary.exists() else None
    return proc, data, trace


def output_of(proc: subprocess.Popen, timeout: float, before=None) -> str:
    """Run ``before()`` (a fault to inject, say) then wait up to ``timeout`` s for the
    process's combined output; a process still running when either fails is killed."""
    try:
        if before is not None:
            before()
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


def traced_counts(trace: Path) -> dict[int, Counter]:
    """epoch -> Counter(sample id -> times trained), from every rank's own trace file."""
    per_epoch: dict[int, Counter] = {}
    for f in trace.glob("rank*.trace"):
        for line in f.read_text().split("\n"):
            if line.strip():
                e, s = line.split()
                per_epoch.setdefault(int(e), Counter())[int(s)] += 1
    return per_epoch


def traced_samples(trace: Path, rank: int) -> int:
    """How many samples one rank's trace file says it trained (repeats counted)."""
    f = trace / f"rank{rank}.trace"
    return sum(1 for line in f.read_text().split("\n") if line.strip()) if f.exists() else 0


def unreported_by(summary: dict, trace: Path, rank: int) -> int:
    """Samples the rank's processes trained and never reported: its trace less what the
    coordinator heard (the summary's ``samples``: totals over every process in the slot).
    A killed rank's last report frame had not carried them yet (``batch_report_ms``: up
    to 64 batches, more than one when its batches are fast), and the batch it traced as
    it died; the coordinator cannot know them, the rank's own trace does."""
    reported = next(r["samples"] for r in summary["ranks"] if r["rank"] == rank)
    return traced_samples(trace, rank) - reported


def assert_exact_coverage(summary: dict, trace: Path, epochs: int, expected: int) -> None:
    """Every epoch committed exactly once (summary) and trained exactly once (traces)."""
    cov = summary["coverage"]
    assert [c["epoch"] for c in cov] == list(range(epochs))
    for c in cov:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (expected, expected, 0, 0), c
    # Independent audit: what each rank process itself wrote down, by sample id.
    seen = traced_counts(trace)
    assert sorted(seen) == list(range(epochs))
    for e, counts in seen.items():
        assert len(counts) == expected, f"epoch {e}: {len(counts)} distinct samples"
        assert set(counts.values()) == {1}, f"epoch {e}: some sample trained twice"


def assert_committed_once_despite_a_death(summary: dict, trace: Path, expected: int, untold: int) -> None:
    """A run in which a rank died: every epoch committed exactly once (summary), every
    sample traced at least once, and any sample traced twice was trained by the dead
    process and never committed: what the coordinator discarded (``discarded_samples``)
    plus ``untold``, what it trained and the coordinator never heard of (the caller's
    bound: the batch it traced as it died, or what its last report frame had not carried)."""
    for c in summary["coverage"]:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (expected, expected, 0, 0), c
    seen = traced_counts(trace)
    for e, counts in seen.items():
        assert len(counts) == expected, f"epoch {e}: a sample was never trained"
    extra = sum(n - 1 for counts in seen.values() for n in counts.values())
    assert extra <= summary["discarded_samples"] + untold, (extra, summary["discarded_samples"], untold)


def read_journal(path: Path) -> list[dict]:
    """The coordinator's journal records so far (a line still being written is skipped)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.split("\n"):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # empty, or the line being written
    return out
