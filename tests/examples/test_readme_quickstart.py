"""The README's quickstart is examples/quickstart.py, and it runs (then resumes) as shown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpukit.report import read_record, render_report

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart.py"


def _readme_quickstart_code() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("```python", text.index("## Quickstart")) + len("```python\n")
    return text[start:text.index("```", start)]


def test_example_file_is_the_readme_snippet() -> None:
    body = EXAMPLE.read_text().split('"""', 2)[2].lstrip("\n")
    assert body == _readme_quickstart_code()


def test_quickstart_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    def run(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=240, env={**os.environ, **env})

    first = run(GPUKIT_RECORD_DIR=str(tmp_path / "record"))  # what `gpukit run --record` sets
    assert first.returncode == 0, first.stderr
    assert "gpukit: no checkpoint in ckpt yet; starting from the beginning" in first.stderr
    # the loss given to session.backward is in the record without a session.log call: the report's
    # loss chart is drawn (it was "Not recorded")
    record = read_record(tmp_path / "record")
    assert "loss" in record.ranks[0].scalar_names
    assert 'class="chart empty"><figcaption>loss' not in render_report(record)
    steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000512", "step_00000576", "step_00000640"]  # 64 steps/epoch, keep_last=3
    marker = tmp_path / "ckpt" / "step_00000640" / "complete.json"
    written_ns = marker.stat().st_mtime_ns
    second = run()  # finds the last checkpoint: all 10 epochs done, nothing left to train
    assert second.returncode == 0, second.stderr
    assert "gpukit: resumed from ckpt/step_00000640 (step 640; loader at epoch 10, batch 0)" in second.stderr
    assert marker.stat().st_mtime_ns == written_ns  # a fresh start would have rewritten it
