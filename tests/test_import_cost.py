"""First-call imports: the hot paths import nothing heavy they do not need (``python -X importtime``).

Each path runs in a fresh interpreter; the modules it imported are read from the importtime
report (which also names modules imported inside functions, where ``sys.modules`` checks at
the end would miss nothing either, but importtime shows how long each took when a check fails).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: imported only where they are needed: sharded checkpoints, TensorBoard output, safetensors files
#: and torch.compile; the peers' packages never
HEAVY = (
    "torch.distributed.checkpoint", "torch.utils.tensorboard", "tensorboard", "safetensors",
    "torch._dynamo", "torch._inductor", "torch.distributed.fsdp", "lightning", "accelerate",
)


def _imported(code: str, tmp_path: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    """Module -> cumulative import seconds, for ``code`` run with ``python -X importtime``."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", textwrap.dedent(code), str(tmp_path)],
        capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})},
    )
    lines = done.stderr.splitlines()
    assert done.returncode == 0, "\n".join(line for line in lines if not line.startswith("import time:"))[-3000:]
    modules: dict[str, float] = {}
    for line in lines:
        if line.startswith("import time:") and "cumulative" not in line:
            _, cumulative, name = line[len("import time:"):].split("|")
            modules[name.strip()] = int(cumulative) / 1e6
    return modules


def _heavy(modules: dict[str, float], extra: tuple[str, ...] = ()) -> dict[str, float]:
    return {m: s for m, s in modules.items() if any(m == h or m.startswith(h + ".") for h in HEAVY + extra)}


def test_session_setup_imports_nothing_heavy(tmp_path: Path) -> None:
    modules = _imported("""
        from torch import nn
        import gpukit
        session = gpukit.Session(devices="cpu", verbose=False)
        model = session.setup(nn.Linear(3, 3))
        loader = session.setup_dataloader([[1.0], [2.0]], batch_size=2)
        for batch in loader:
            pass
    """, tmp_path)
    assert "gpukit.session._session" in modules
    assert _heavy(modules) == {}


def test_resuming_an_unsharded_checkpoint_does_not_import_dcp(tmp_path: Path) -> None:
    modules = _imported("""
        import sys
        from torch import nn
        from gpukit import CheckpointManager
        model = nn.Linear(3, 3)
        manager = CheckpointManager(sys.argv[1])
        manager.save(1, model=model)
        assert manager.resume(model=model) == 1
    """, tmp_path)
    assert "gpukit.checkpoint._lazy" in modules
    assert _heavy(modules) == {}


@pytest.mark.parametrize("command", [["ls"], ["doctor", "--json"]])
def test_cli_start_up_imports_neither_torch_nor_heavy_modules(tmp_path: Path, command: list[str]) -> None:
    modules = _imported(f"""
        from gpukit.cli import main
        try:
            main({command!r})
        except SystemExit:
            pass
    """, tmp_path, env={"GPUKIT_FAKE_GPUS": str(EXAMPLES / "fake-gpus" / "shared-4gpu.json")})
    assert "gpukit.cli._main" in modules
    assert _heavy(modules, extra=("torch", "numpy")) == {}
    if command == ["ls"]:  # issue 41.20: what gpukit itself pulled in, and `ls` does not need
        needless = {"secrets", "hmac", "_hashlib", "socket", "logging"}
        assert not needless & set(modules), {m: modules[m] for m in needless & set(modules)}


def test_version_is_answered_before_click(tmp_path: Path) -> None:
    """`gpukit --version` prints pyproject's version without importing click or importlib.metadata."""
    import tomllib

    version = tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text())["project"]["version"]
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "gpukit", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == f"gpukit, version {version}\n"
    modules = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "gpukit.cli" in modules
    assert not {m for m in modules if m.split(".")[0] in ("click", "rich", "torch")} | (
        modules & {"importlib.metadata", "email"})
    # click's own --version (other words after it) says the same
    out = subprocess.run([sys.executable, "-m", "gpukit", "--version", "ls"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == done.stdout


def test_a_first_claim_imports_neither_torch_nor_filelock(tmp_path: Path) -> None:
    modules = _imported("""
        import sys
        import gpukit
        claim = gpukit.claim_gpus(1, claim_dir=sys.argv[1])
        assert len(claim.gpus) == 1
        claim.release()
    """, tmp_path, env={"GPUKIT_FAKE_GPUS": str(EXAMPLES / "fake-gpus" / "shared-4gpu.json")})
    assert "gpukit.devices._claim_files" in modules
    assert _heavy(modules, extra=("torch", "numpy", "filelock", "click", "rich")) == {}
