"""The run record: format, aggregation, events, crash safety, Session and TensorBoard wiring."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gpukit
from gpukit._util.envvars import RECORD_DIR_ENV
from gpukit.accelerators import get_accelerator
from gpukit.data import StepTiming
from gpukit.errors import ConfigurationError
from gpukit.memory import OomBackoff
from gpukit.monitor import Recorder, emit, tensorboard_available
from gpukit.monitor._record import _window
from gpukit.monitor._system import read_system
from gpukit.report import read_record


def Timing(step: int, **fields: object) -> StepTiming:  # noqa: N802 - reads like the type
    """gpukit's StepTiming, as the recorder receives it from session.timings, with defaults."""
    values: dict[str, object] = dict(epoch=0, rank=0, samples=8, step_time_s=0.010, data_wait_s=0.002,
                                     h2d_s=None, compute_s=0.008, exact=True)
    values.update(fields)
    return StepTiming(step=step, **values)  # type: ignore[arg-type]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _recorder(directory: Path, **kwargs) -> Recorder:
    kwargs.setdefault("tensorboard", None)
    kwargs.setdefault("sample_interval_s", 30.0)  # the test flushes by closing
    return Recorder(directory, **kwargs)


def test_steps_scalars_events_and_end_are_written_in_order(tmp_path: Path) -> None:
    rec = _recorder(tmp_path, meta={"device": "cpu", "strategy": "single on cpu", "precision": "32-true"})
    for i in range(3):
        rec.log(loss=torch.tensor(float(i + 1)), lr=0.1)
        rec.on_step(Timing(step=i, h2d_s=0.001 if i else None))
    emit("checkpoint", saved_step=3, path="ckpt/step_3")
    rec.close()
    rec.close()  # idempotent
    lines = _lines(rec.path)
    assert [line["type"] for line in lines if line["type"] != "sys"] == ["meta", "step", "step", "step", "event", "end"]
    meta = lines[0]
    assert meta["format"] == "gpukit-record" and meta["version"] == 1 and meta["device"] == "cpu"
    steps = [line for line in lines if line["type"] == "step"]
    assert [s["scalars"]["loss"] for s in steps] == [1.0, 2.0, 3.0]
    assert steps[0]["step_s"] == pytest.approx(0.010) and "h2d_s" not in steps[0]
    assert steps[1]["h2d_s"] == pytest.approx(0.001)
    event = next(line for line in lines if line["type"] == "event")
    assert event["kind"] == "checkpoint" and event["step"] == 2 and event["saved_step"] == 3
    assert lines[-1] == {**lines[-1], "type": "end", "steps": 3}
    emit("checkpoint", saved_step=4)  # after close: no longer subscribed, nothing written
    assert len(_lines(rec.path)) == len(lines)


def test_long_runs_are_aggregated_into_doubling_windows(tmp_path: Path) -> None:
    assert [_window(k, 4) for k in (0, 3, 4, 7, 8, 15, 16)] == [1, 1, 2, 2, 4, 4, 8]
    rec = _recorder(tmp_path, full_steps=4)
    for i in range(100):
        rec.log(loss=float(i))
        rec.on_step(Timing(step=i, step_time_s=0.01 * (i + 1)))
    rec.close()
    steps = [line for line in _lines(rec.path) if line["type"] == "step"]
    assert sum(s["n"] for s in steps) == 100  # nothing lost
    assert [s["n"] for s in steps[:8]] == [1, 1, 1, 1, 2, 2, 4, 4]
    assert len(steps) < 20
    window = steps[4]  # steps 4 and 5: means of the two
    assert window["step"] == 4 and window["samples"] == 16
    assert window["step_s"] == pytest.approx(0.055) and window["max_step_s"] == pytest.approx(0.06)
    assert window["scalars"]["loss"] == pytest.approx(4.5)


def test_log_rejects_what_is_not_a_scalar(tmp_path: Path) -> None:
    rec = _recorder(tmp_path)
    with pytest.raises(ConfigurationError, match="shape \\(3,\\)"):
        rec.log(loss=torch.ones(3))
    with pytest.raises(ConfigurationError, match="numbers or one-element"):
        rec.log(name="text")
    rec.close()


def test_bad_settings_and_unwritable_directory_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="sample_interval_s"):
        Recorder(tmp_path, sample_interval_s=0)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigurationError, match="writable directory"):
        Recorder(blocker / "sub", tensorboard=None)


def test_system_samples_hold_the_fake_gpu_of_this_process(tmp_path: Path, monkeypatch) -> None:
    spec = {"gpus": [{"name": "A", "memory_total_mib": 1000, "memory_used_mib": 100, "utilization_gpu_pct": 30},
                     {"name": "B", "memory_total_mib": 2000, "memory_used_mib": 500, "utilization_gpu_pct": 90}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(tmp_path / "spec.json"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # cuda:0 of this process is physical GPU 1
    sample = read_system(get_accelerator("cuda"), torch.device("cuda", 0), lambda: 12.5)
    assert sample["gpu_util_pct"] == 90 and sample["gpu_mem_used_bytes"] == 500 * 2**20
    assert sample["gpu_mem_total_bytes"] == 2000 * 2**20
    assert sample["cpu_pct"] == 12.5 and sample["process_rss_bytes"] > 0 and sample["host_mem_total_bytes"] > 0


def test_the_sampler_thread_writes_samples_while_the_run_goes_on(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, accelerator=get_accelerator("cpu"), device=torch.device("cpu"),
                   sample_interval_s=0.02, tensorboard=None)
    rec.on_step(Timing(step=0))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # written by the thread, without close()
        kinds = [line["type"] for line in _lines(rec.path)]
        if "sys" in kinds and "step" in kinds:
            break
        time.sleep(0.01)
    else:
        pytest.fail(f"no sample/step flushed by the sampler thread: {kinds}")
    rec.close()
    sample = next(line for line in _lines(rec.path) if line["type"] == "sys")
    assert sample["cpu_pct"] >= 0 and sample["process_rss_bytes"] > 0


def test_oom_backoff_and_preemption_become_events(tmp_path: Path) -> None:
    from gpukit.launch import clear_stop_request, install_preemption_handler, uninstall_preemption_handler

    rec = _recorder(tmp_path)

    def step(micro: torch.Tensor, weight: float) -> float:
        if micro.shape[0] > 4:
            raise torch.OutOfMemoryError("injected")
        return 0.0

    OomBackoff(8).run(step, torch.zeros(8, 2))
    assert install_preemption_handler()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # handled: sets the stop flag, emits the event
    finally:
        uninstall_preemption_handler()
        clear_stop_request()
    rec.close()
    events = [line for line in _lines(rec.path) if line["type"] == "event"]
    assert [e["kind"] for e in events] == ["oom_backoff", "preemption"]
    assert events[0]["from_micro_batch"] == 8 and events[0]["to_micro_batch"] == 4
    assert events[1]["signal"] == "SIGTERM"


_KILLED_WRITER = """
import sys, time, torch
from gpukit.monitor import Recorder
class T:
    def __init__(self, i): self.step, self.epoch, self.samples = i, 0, 4
    step_time_s, data_wait_s, h2d_s, compute_s, exact = 0.001, 0.0005, None, 0.0005, True
rec = Recorder(sys.argv[1], sample_interval_s=0.02, tensorboard=None)
i = 0
while True:
    rec.log(loss=torch.tensor(1.0 / (i + 1)))
    rec.on_step(T(i))
    i += 1
    time.sleep(0.001)
"""


@pytest.mark.slow
def test_a_killed_run_leaves_a_readable_record(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], env=env)
    path = tmp_path / "rank0.jsonl"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().count('"type":"step"') >= 20:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the writer recorded no steps")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with open(path, "a") as handle:  # as if killed in the middle of writing a line
        handle.write('{"type":"step","t":1,"step":99')
    record = read_record(tmp_path)
    rank = record.ranks[0]
    assert not record.finished and rank.skipped_lines == 1
    assert len(rank.steps) >= 20 and rank.steps[0]["scalars"]["loss"] == 1.0
    assert [s["step"] for s in rank.steps] == list(range(len(rank.steps)))


def test_session_records_to_the_directory_given_or_the_env(tmp_path: Path, monkeypatch) -> None:
    session = gpukit.Session(devices="cpu", record=tmp_path / "a", verbose=False)
    session.log(loss=1.0)
    session.save_checkpoint(tmp_path / "ckpt", 1, model=torch.nn.Linear(2, 2))
    session.close()
    lines = _lines(tmp_path / "a" / "rank0.jsonl")
    assert lines[0]["strategy"] == session.strategy.describe() and lines[0]["precision"] == "32-true"
    assert any(line["type"] == "event" and line["kind"] == "checkpoint" for line in lines)
    assert lines[-1]["type"] == "end"

    monkeypatch.setenv(RECORD_DIR_ENV, str(tmp_path / "b"))
    other = gpukit.Session(devices="cpu", verbose=False)
    assert other.recorder is not None and other.recorder.path == tmp_path / "b" / "rank0.jsonl"
    other.close()
    monkeypatch.delenv(RECORD_DIR_ENV)
    plain = gpukit.Session(devices="cpu", verbose=False)
    assert plain.recorder is None
    plain.log(loss=torch.tensor(1.0))  # a no-op without a record
    plain.close()


@pytest.mark.skipif(not tensorboard_available(), reason="the tensorboard package is not installed")
def test_live_forwarding_writes_tensorboard_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec = Recorder(tmp_path, accelerator=get_accelerator("cpu"), device=torch.device("cpu"),
                   sample_interval_s=30.0, tensorboard="auto")
    for i in range(5):
        rec.log(loss=torch.tensor(5.0 - i))
        rec.on_step(Timing(step=i))
    rec.close()
    events = EventAccumulator(str(tmp_path / "tensorboard" / "rank0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "time/step_s", "time/data_s", "throughput/samples_per_s", "system/cpu_pct"} <= tags
    assert [e.value for e in events.Scalars("train/loss")] == [5.0, 4.0, 3.0, 2.0, 1.0]
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2, 3, 4]


_TRAIN = """
import torch, gpukit
from torch import nn
session = gpukit.Session(verbose=False)
model = nn.Linear(4, 2)
model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
for x, y in session.setup_dataloader(data, batch_size=8):
    loss = nn.functional.cross_entropy(model(x), y)
    session.backward(loss)
    session.step(opt)
    session.log(loss=loss.detach())
session.close()
"""


@pytest.mark.slow
def test_gpukit_run_record_sets_the_directory_for_its_workers(tmp_path: Path) -> None:
    # one worker: the two-rank record is covered by the demo's DDP test
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop(RECORD_DIR_ENV, None)
    result = subprocess.run([sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "1", "--record",
                             str(tmp_path / "rec"), str(script)], env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr
    assert f"gpukit report {tmp_path / 'rec'}" in result.stderr
    record = read_record(tmp_path / "rec")
    assert record.finished and sorted(record.ranks) == [0]
    rank_record = record.ranks[0]
    assert rank_record.meta["world_size"] == 1 and "cpu" in rank_record.meta["device"]
    assert [s["step"] for s in rank_record.steps] == list(range(8))  # 64 samples / batches of 8
    assert all("loss" in s["scalars"] and s["data_s"] >= 0 for s in rank_record.steps)


@pytest.mark.requires_gpu
def test_recording_on_a_gpu_has_allocator_and_nvml_figures(tmp_path: Path) -> None:
    session = gpukit.Session(devices=1, record=tmp_path, verbose=False)
    model = session.setup(torch.nn.Linear(256, 256))
    for i in range(5):
        loss = model(torch.randn(64, 256, device=session.device)).square().mean()
        session.log(loss=loss.detach())  # a CUDA tensor: converted on the writer thread
        session.recorder.on_step(Timing(step=i))
    session.recorder.on_sample(read_system(session.accelerator, session.device, lambda: None))
    session.close()
    lines = _lines(tmp_path / "rank0.jsonl")
    assert lines[0]["gpu_name"] == torch.cuda.get_device_name(session.device)
    steps = [line for line in lines if line["type"] == "step"]
    assert len(steps) == 5 and all(isinstance(s["scalars"]["loss"], float) for s in steps)
    sample = next(line for line in lines if line["type"] == "sys")
    assert sample["torch_allocated_bytes"] > 0 and sample["torch_reserved_bytes"] >= sample["torch_allocated_bytes"]
    assert sample["gpu_mem_used_bytes"] > 0 and "gpu_util_pct" in sample


def test_live_tensorboard_gets_step_lines_merged_to_a_few_points_per_flush() -> None:
    from gpukit.monitor._tensorboard import thin_steps

    lines = [{"type": "step", "t": float(i), "step": i, "n": 1, "samples": 8, "step_s": 0.01 * (i + 1),
              "scalars": {"loss": float(i)}} for i in range(25)]
    lines.insert(3, {"type": "sys", "t": 3.0, "cpu_pct": 50.0})
    thinned = thin_steps(lines, 10)
    steps = [line for line in thinned if line["type"] == "step"]
    assert len(steps) == 9 and sum(s["n"] for s in steps) == 25 and sum(s["samples"] for s in steps) == 200
    assert steps[0]["step"] == 0 and steps[0]["n"] == 3 and steps[0]["scalars"]["loss"] == pytest.approx(1.0)
    assert steps[0]["step_s"] == pytest.approx(0.02)
    assert [line["type"] for line in thinned].count("sys") == 1
    assert thin_steps(lines[:5], 10) == lines[:5]


def test_leak_warnings_and_restarts_become_events(tmp_path: Path, monkeypatch) -> None:
    from gpukit.memory import LeakWatcher

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # this process is the run's 2nd restart
    rec = _recorder(tmp_path)
    watcher = LeakWatcher(warn=False)
    model = torch.nn.Linear(4, 1)
    total_loss: object = 0.0
    for _ in range(20):
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        total_loss += loss  # the classic leak: every step's graph kept
        if watcher.step():
            break
    rec.close()
    lines = _lines(rec.path)
    assert lines[0]["restart_count"] == 2
    events = [line for line in lines if line["type"] == "event"]
    assert [e["kind"] for e in events] == ["restart", "leak_warning"]
    assert events[0]["restart_count"] == 2 and "total_loss" in events[1]["message"]
