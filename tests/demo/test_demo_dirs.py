"""Two demos never touch each other's files: each run writes to its own private directory.

CLI runs (`gpukit demo` through its entry point, in this process) with TMPDIR pointing at a test
directory that also holds another user's demo output (chowned to ``nobody``); and two runs sharing
one ``--out-dir``, whose record then holds both runs. The demo's checkpoint save is an event in its
record (``session.log_event``).
"""

from __future__ import annotations

import os
import re
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from gpukit.demo import DemoConfig, run_demo
from gpukit.report import read_record, summarize, write_report

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from cli_helpers import run_gpukit  # noqa: E402

NOBODY = 65534


def _demo(tmpdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[Path, str]:
    """`gpukit demo` through the console entry point in this process (a subprocess spent about half
    of each run starting the interpreter, torch and scikit-learn), with TMPDIR set as for a process."""
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() cached another directory: read TMPDIR again
    code, out, err = run_gpukit(capsys, "demo", "--cpu", "--epochs", "1", "--batch-size", "256")
    assert code == 0, out + err
    match = re.search(r"report: (\S+) \(from the run record in (\S+)\)", out.replace("\n", ""))
    assert match, out
    return Path(match.group(1)), out


def _plant_other_users_demo(tmpdir: Path) -> dict[Path, bytes]:
    """What another user's demos left: the old fixed folder and a per-run one, owned by nobody."""
    planted = {tmpdir / "gpukit-demo" / "record" / "rank0.jsonl": b'{"other": "user"}\n',
               tmpdir / "gpukit-demo" / "record" / "report.html": b"<html>their report</html>",
               tmpdir / "gpukit-demo-other-x1y2z3" / "record" / "report.html": b"<html>theirs too</html>"}
    for path, data in planted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if os.geteuid() == 0:
        for path in planted:
            for p in (path, path.parent, path.parent.parent):
                os.chown(p, NOBODY, NOBODY)
    return planted


@pytest.mark.slow  # two real `gpukit demo` runs (in this process): ~10 s on an idle 2-core machine
def test_two_demos_write_to_their_own_private_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    planted = _plant_other_users_demo(tmp_path)
    first, _ = _demo(tmp_path, monkeypatch, capsys)
    first_bytes = first.read_bytes()
    second, _ = _demo(tmp_path, monkeypatch, capsys)
    assert first.parent.parent != second.parent.parent  # <out-dir>/record/report.html: other out-dirs
    assert first.read_bytes() == first_bytes and second.is_file()  # the second run left the first alone
    for report in (first, second):
        out_dir = report.parent.parent
        assert out_dir.parent == tmp_path and out_dir.name.startswith("gpukit-demo-")
        info = out_dir.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()  # private to its user
        assert (out_dir / "digits-cnn.pt").is_file()
        summary = summarize(read_record(report.parent))
        assert len(summary.runs) == 1 and summary.events["checkpoint"] == 1  # the gpukit.save is recorded
    for path, data in planted.items():  # another user's files: untouched
        assert path.read_bytes() == data
        if os.geteuid() == 0:
            assert path.stat().st_uid == NOBODY


def test_runs_sharing_an_out_dir_are_appended_as_runs_not_deleted(tmp_path: Path) -> None:
    config = DemoConfig(epochs=1, batch_size=256, out_dir=str(tmp_path / "mine"))
    run_demo(config, cpu=True)
    first_lines = (tmp_path / "mine" / "record" / "rank0.jsonl").read_bytes()
    result = run_demo(config, cpu=True)
    assert (tmp_path / "mine" / "record" / "rank0.jsonl").read_bytes().startswith(first_lines)
    record = read_record(result.record_dir)
    assert [run.index for run in record.runs] == [1, 2] and record.finished
    events = [e for r in record.ranks.values() for e in r.events if e["kind"] == "checkpoint"]
    assert [e["path"] for e in events] == [str(tmp_path / "mine" / "digits-cnn.pt")] * 2
    assert 'id="runs"' in write_report(result.record_dir).read_text()


def test_log_event_is_checked_with_or_without_a_record(tmp_path: Path) -> None:
    import gpukit
    from gpukit.errors import ConfigurationError

    session = gpukit.Session(devices="cpu", record=tmp_path / "rec", verbose=False)
    session.log_event("eval", accuracy=0.9, split="test")
    for kind, fields in (("", {}), ("x" * 65, {}), ("eval", {"data": [1, 2]}), ("eval", {"step": 1}),
                         ("eval", {"acc": float("nan")}), ("eval", {"note": "n" * 201})):
        with pytest.raises(ConfigurationError, match="log_event"):
            session.log_event(kind, **fields)
    session.close()
    events = [e for e in read_record(tmp_path / "rec").ranks[0].events]
    assert [(e["kind"], e["accuracy"], e["split"]) for e in events] == [("eval", 0.9, "test")]
    plain = gpukit.Session(devices="cpu", verbose=False)
    with pytest.raises(ConfigurationError, match="log_event"):
        plain.log_event("eval", data={})
    plain.log_event("eval", accuracy=1.0)  # a no-op without a record
    plain.close()
