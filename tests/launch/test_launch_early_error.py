"""A worker that dies before its Session is up has its real error in the launcher's summary (issue 41.12):
a spawned function worker imports the launcher's script again, and a failure there used to read
"exited with code 1" with the traceback on the worker's own stderr only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from gpukit.launch import WorkerFailedError, WorkerFailure
from gpukit.launch._summary import with_early_errors
from gpukit.worker import read_early_errors
from gpukit.worker._run_dir import write_early_error

SCRIPT = textwrap.dedent("""
    import gpukit

    if __name__ != "__main__":  # only where the script is imported again: a spawned worker
        import a_module_only_the_launcher_lacks_not  # noqa: F401

    def train(session):
        return session.rank

    if __name__ == "__main__":
        session = gpukit.Session(accelerator="cpu", devices=2, verbose=False)
        print("RESULTS", session.launch(train))
""")


def test_a_worker_failing_to_import_the_script_again_names_its_error(tmp_path: Path) -> None:
    script = tmp_path / "train_early.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout
    summary = proc.stderr[proc.stderr.rindex("WorkerFailedError"):]
    assert "failed: ModuleNotFoundError: No module named 'a_module_only_the_launcher_lacks_not'" in summary
    assert "before its Session was up, while importing" in summary and str(script) in summary
    assert '`if __name__ == "__main__":`' in summary
    assert f"at {script}:5 in <module>" in summary
    assert "exited with code 1" not in summary


def test_early_errors_fill_only_failures_that_recorded_none(tmp_path: Path) -> None:
    trace = 'Traceback (most recent call last):\n  File "/w/t.py", line 3, in <module>\nImportError: nope\n'
    write_early_error(tmp_path, "importing /w/t.py again in the spawned worker", trace)
    (tmp_path / "early-error-pidjunk.json").write_text("{}")  # not a pid: ignored
    (tmp_path / "early-error-pid7.json").write_text("not json")  # unreadable: ignored
    errors = read_early_errors(tmp_path)
    assert list(errors) == [os.getpid()] and errors[os.getpid()].error == "ImportError: nope"
    silent = WorkerFailure(rank=0, local_rank=0, pid=os.getpid(), exitcode=1)
    raised = WorkerFailure(rank=1, local_rank=1, pid=os.getpid(), exitcode=1, error="KeyError: 1")
    filled = with_early_errors([silent, raised], errors)
    assert filled[0].error == "ImportError: nope" and filled[0].early and filled[0].location == "/w/t.py:3 in <module>"
    assert filled[1] is raised  # a worker that recorded its own error keeps it
    text = str(WorkerFailedError(filled))
    assert "before its Session was up, while importing /w/t.py again" in text
    assert read_early_errors(tmp_path / "gone") == {}
