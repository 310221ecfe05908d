"""`gpukit ls`: tables, --json, --watch, the no-driver message, and no torch import."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from gpukit.cli import main
from gpukit.devices import _nvml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "claims"))
    monkeypatch.setenv("COLUMNS", "140")
    monkeypatch.setattr(_nvml, "_notice_given", False)
    _nvml.shutdown()


def _spec(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(EXAMPLES / f"{name}.json"))


def test_tables(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _spec(monkeypatch, "shared-4gpu")
    main(["ls"])
    out = capsys.readouterr().out
    assert "4 GPUs · driver 535.104.05" in out
    assert out.count("NVIDIA TITAN X (Pascal)") == 4 and "00000000:83:00.0" in out
    assert "10.7 / 11.9 GiB" in out and "97%" in out and "231/250 W" in out
    for cell in ("44683", "alice", "python train.py --lr 3e-4", "7.52 GiB", "carol"):
        assert cell in out


def test_mig_and_lost(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _spec(monkeypatch, "mig-a100")
    main(["ls"])
    out = capsys.readouterr().out
    assert "(MIG)" in out and "MIG 3g.20gb" in out and "0:13" in out and "dave" in out
    _spec(monkeypatch, "lost-gpu")
    main(["ls"])
    assert "unusable: GPU is lost" in capsys.readouterr().out


def test_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _spec(monkeypatch, "shared-4gpu")
    main(["ls", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["driver_version"] == "535.104.05" and data["notice"] is None
    g0 = data["gpus"][0]
    assert g0["memory_total_bytes"] == 12196 * 2**20 and g0["utilization_gpu_pct"] == 97
    assert g0["processes"][0] == {"pid": 44683, "user": "alice", "command": "python train.py --lr 3e-4",
                                  "used_memory_bytes": 7703 * 2**20}
    assert data["claims"] == [] and len(data["selectable"]) == 4


def test_claims_are_shown(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from gpukit.devices import claim_gpus
    from gpukit.devices._criteria import current_user

    _spec(monkeypatch, "shared-4gpu")
    with claim_gpus(gpus=[1], share=True) as claim:
        main(["ls", "--json"])
        data = json.loads(capsys.readouterr().out)
        [shown] = data["claims"]
        assert {k: shown[k] for k in ("uuid", "pid", "user")} == {
            "uuid": claim.gpus[0].uuid, "pid": os.getpid(), "user": current_user()}  # the kernel's holder
        assert abs(shown["since"] - time.time()) < 60
        main(["ls"])
        assert f"pid {os.getpid()} ({current_user()})" in capsys.readouterr().out


def test_no_driver_is_friendly(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _spec(monkeypatch, "no-driver")
    main(["ls"])  # returns normally: exit status 0
    captured = capsys.readouterr()
    assert captured.out.startswith("No NVIDIA GPU/driver found (NVML Shared Library Not Found).")
    assert "GPUKIT_FAKE_GPUS=" in captured.out and captured.err == ""  # said once, not twice
    main(["ls", "--json"])
    assert json.loads(capsys.readouterr().out)["gpus"] == []


def test_bad_spec_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(tmp_path / "missing.json"))
    with pytest.raises(SystemExit) as info:
        main(["ls"])
    assert info.value.code == 2
    assert "gpukit: error: Fake-GPU spec" in capsys.readouterr().err


def _run(args: list[str], extra_env: dict[str, str]) -> subprocess.Popen[str]:
    env = {**os.environ, "GPUKIT_FAKE_GPUS": str(EXAMPLES / "shared-4gpu.json"), **extra_env}
    return subprocess.Popen([sys.executable, "-c", "from gpukit.cli import main; main()", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.usefixtures("ctrl_c_as_from_a_terminal")
@pytest.mark.parametrize("live", [False, True], ids=["json-lines", "rich-live"])
def test_watch_refreshes_until_ctrl_c(live: bool) -> None:
    # TTY_COMPATIBLE=1 makes rich treat the pipe as a terminal, so Live redraws in place
    proc = _run(["ls", "--watch", "0.1"] + ([] if live else ["--json"]), {"TTY_COMPATIBLE": "1"} if live else {})
    marker, per_frame = ("TITAN X", 4) if live else ('"gpus"', 1)
    seen, lines = 0, []
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while seen < 2 * per_frame and time.monotonic() < deadline:  # until two frames were drawn
        line = proc.stdout.readline()
        lines.append(line)
        seen += line.count(marker)
    assert seen >= 2 * per_frame, lines
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err  # Ctrl-C ends --watch successfully
    assert "Traceback" not in err


def test_ls_and_select_do_not_import_torch() -> None:
    script = (
        "import sys\nfrom gpukit.cli import main\n"
        "main(['ls']); main(['ls', '--json']); main(['select', '-n', '2', '--share'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {**os.environ, "GPUKIT_FAKE_GPUS": str(EXAMPLES / "shared-4gpu.json")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("2,1")


def test_sparklines_follow_the_history() -> None:
    from gpukit.cli._gpu_table import GpuHistory, sparkline
    from gpukit.devices import list_gpus

    assert sparkline([0, 50, 100, None, 12.5]) == "▁▅█ ▂"
    os.environ["GPUKIT_FAKE_GPUS"] = str(EXAMPLES / "shared-4gpu.json")
    _nvml.shutdown()
    gpus = list_gpus()
    history = GpuHistory(length=3)
    for _ in range(5):
        history.add(gpus)
    util, mem = history.cells(gpus[0], width=4)
    assert util == "███ " and mem == "███ "  # 97% busy, 10.7 of 11.9 GiB; only the last 3 kept
    assert history.cells(gpus[2], width=4)[0] == "▁▁▁ "


def test_claims_show_the_run_and_rank(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from gpukit.launch._gpus import DevicePlan

    _spec(monkeypatch, "shared-4gpu")
    from gpukit.devices import claim_gpus

    with claim_gpus(gpus=[2, 1], share=True) as claim:
        DevicePlan(claim=claim).label_claim("gpukit-3f2a9c1b2c4d", nproc=2, node_rank=1)
        main(["ls", "--json"])
        claims = {c["uuid"]: c for c in json.loads(capsys.readouterr().out)["claims"]}
        shown = claims[claim.gpus[0].uuid]
        assert {k: shown.get(k) for k in ("uuid", "pid", "run", "rank")} == {
            "uuid": claim.gpus[0].uuid, "pid": os.getpid(), "run": "gpukit-3f2a9c1b2c4d", "rank": 2}
        assert claims[claim.gpus[1].uuid]["rank"] == 3
        main(["ls"])
        assert f"3f2a9c rank 2 · pid {os.getpid()}" in capsys.readouterr().out


def _read_pty(fd: int, until: Callable[[str], bool], timeout_s: float = 60.0) -> str:
    import re
    import select

    text = ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                text += os.read(fd, 65536).decode(errors="replace")
            except OSError:  # the child closed the terminal
                break
            plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
            if until(plain):
                return plain
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


@pytest.mark.slow
@pytest.mark.usefixtures("ctrl_c_as_from_a_terminal")
def test_watch_in_a_terminal_follows_a_resize_and_stops_on_ctrl_c() -> None:
    import fcntl
    import pty
    import struct
    import termios

    def set_size(fd: int, columns: int) -> None:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))

    master, slave = pty.openpty()
    set_size(slave, 160)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TTY_COMPATIBLE")}
    env.update(GPUKIT_FAKE_GPUS=str(EXAMPLES / "shared-4gpu.json"), TERM="xterm")
    # a long interval: only the resize itself can bring the next frame in time
    proc = subprocess.Popen([sys.executable, "-m", "gpukit", "ls", "--watch", "30"], env=env,
                            stdin=slave, stdout=slave, stderr=subprocess.PIPE, text=True)
    os.close(slave)
    try:
        wide = _read_pty(master, lambda t: "Util history" in t and "GPU memory" in t)
        assert "Util history" in wide and "Memory history" in wide, wide
        assert "Free" in wide and "Temp" in wide  # room for everything at 160 columns
        set_size(master, 80)
        proc.send_signal(signal.SIGWINCH)
        started = time.monotonic()
        after = _read_pty(master, lambda t: t.count("GPU memory") >= 1, timeout_s=20)
        assert time.monotonic() - started < 20 and "GPU memory" in after, after
        frame = after[after.rindex("4 GPUs"):]
        # at 80 columns the sparklines (the point of --watch) stay, and the hint is whole
        assert "Util history" in frame and "Memory history" in frame and "█" in frame, frame
        assert "Ctrl-C to stop" in frame, frame
        assert max(len(line) for line in frame.replace("\r", "\n").splitlines()) <= 80
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


@pytest.mark.parametrize("json_lines", [False, True], ids=["tables", "json-lines"])
def test_watch_into_a_closed_pipe_exits_quietly(json_lines: bool) -> None:
    env = {**os.environ, "GPUKIT_FAKE_GPUS": str(EXAMPLES / "shared-4gpu.json")}
    extra = " --json" if json_lines else ""
    shell = f"'{sys.executable}' -m gpukit ls --watch 0.1{extra} | head -1; echo \"status ${{PIPESTATUS[0]}}\""
    result = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip().endswith("status 0"), result
    assert result.stderr == "", result.stderr


@pytest.mark.parametrize("columns", [80, 100, 64])
def test_watch_frames_keep_the_sparklines_and_the_hint_at_narrow_widths(columns: int, monkeypatch) -> None:
    from rich.console import Console

    from gpukit.cli import ls as ls_module
    from gpukit.cli._gpu_table import GpuHistory, render_gpus
    from gpukit.devices import _nvml

    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(EXAMPLES / "shared-4gpu.json"))
    _nvml.shutdown()
    state = ls_module._collect()
    history = GpuHistory()
    for _ in range(20):
        history.add(state["gpus"])
    console = Console(width=columns, record=True, color_system=None, force_terminal=False)
    console.print(render_gpus(state["gpus"], state["claims"], ls_module._header(state), width=columns,
                              history=history, hint=" · Ctrl-C to stop"))
    text = console.export_text()
    lines = text.splitlines()
    _nvml.shutdown()
    assert lines[0].endswith(" · Ctrl-C to stop") and all(len(line) <= columns for line in lines), text
    assert "trend" in lines[2] or "history" in lines[2], text
    assert "█" * 6 in text and "▁" * 6 in text, text  # GPUs 3 and 2: busy and idle, six samples or more
