"""The README's quickstart is examples/quickstart.py, and it runs (then resumes) as shown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=240)

    first = run()
    assert first.returncode == 0, first.stderr
    steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000512", "step_00000576", "step_00000640"]  # 64 steps/epoch, keep_last=3
    marker = tmp_path / "ckpt" / "step_00000640" / "complete.json"
    written_ns = marker.stat().st_mtime_ns
    second = run()  # finds the last checkpoint: all 10 epochs done, nothing left to train
    assert second.returncode == 0, second.stderr
    assert marker.stat().st_mtime_ns == written_ns  # a fresh start would have rewritten it
