"""The failure summary picks the real root cause, not a worker the launcher stopped."""

from __future__ import annotations

import pytest

from gpukit.errors import ConfigurationError
from gpukit.launch import PREEMPTED_EXIT_CODE, GpuRequest, WorkerFailedError, WorkerFailure
from gpukit.launch._summary import format_summary

TB = 'Traceback (most recent call last):\n  File "/x/runpy.py", line 9, in run\n  File "/w/train.py", line 42, in step\nKeyError: 3\n'


def test_root_cause_is_the_worker_with_an_error_even_if_a_stopped_one_looks_earlier():
    stopped = WorkerFailure(rank=0, local_rank=0, pid=10, exitcode=-15, timestamp=100.0)
    crashed = WorkerFailure(rank=3, local_rank=1, pid=11, exitcode=1, error="KeyError: 3", traceback=TB,
                            timestamp=100.0)
    err = WorkerFailedError([stopped, crashed], attempts=3)
    assert err.root is crashed
    assert err.exit_code == 1
    text = str(err)
    assert text.splitlines()[0] == "rank 3 (local rank 1, pid 11) failed: KeyError: 3"
    assert "at /w/train.py:42 in step" in text
    assert "rank 0 killed by SIGTERM" in text
    assert "after 3 attempts" in text


def test_exit_codes_for_signals_and_preemption():
    segv = WorkerFailedError([WorkerFailure(rank=1, local_rank=1, pid=5, exitcode=-11)])
    assert segv.exit_code == 128 + 11 and "killed by SIGSEGV" in str(segv)
    preempted = WorkerFailedError([
        WorkerFailure(rank=0, local_rank=0, pid=5, exitcode=PREEMPTED_EXIT_CODE),
        WorkerFailure(rank=1, local_rank=1, pid=6, exitcode=-15),
    ])
    assert preempted.preempted and preempted.exit_code == PREEMPTED_EXIT_CODE
    assert format_summary([]) == "workers failed (no details recorded)"


@pytest.mark.parametrize(("text", "expected"), [
    ("2", GpuRequest(count=2)), ("all", GpuRequest(every=True)), ("ALL", GpuRequest(every=True)),
    ("1,3", GpuRequest(ids=(1, 3))), ("3,", GpuRequest(ids=(3,))),
    ("GPU-abc,1", GpuRequest(ids=("GPU-abc", 1))), (" 0 , 2 ", GpuRequest(ids=(0, 2))),
    # one GPU by its full UUID needs no trailing comma (issue 26.6)
    ("GPU-7c1d2e5a-3b4f-4a8c-8d9e-2f3a4b5c6d7e", GpuRequest(ids=("GPU-7c1d2e5a-3b4f-4a8c-8d9e-2f3a4b5c6d7e",))),
    ("MIG-bb22cc33", GpuRequest(ids=("MIG-bb22cc33",))),
])
def test_parse_gpu_request(text, expected):
    assert GpuRequest.parse(text) == expected
    assert GpuRequest.parse(str(expected)) == expected  # shown as --gpus takes it


@pytest.mark.parametrize(("value", "expected"), [
    (None, GpuRequest()), (2, GpuRequest(count=2)), ("all", GpuRequest(every=True)), ("1,3", GpuRequest(ids=(1, 3))),
    ([1, "GPU-abc"], GpuRequest(ids=(1, "GPU-abc"))), (GpuRequest(count=1), GpuRequest(count=1)),
])
def test_gpus_from_python_are_the_same_request(value, expected):
    assert GpuRequest.of(value) == expected
    assert GpuRequest.of(value).automatic is (value is None)


@pytest.mark.parametrize("text", ["two", "", ",", "1,x", "-1"])
def test_parse_gpu_request_rejects_with_the_accepted_forms(text):
    with pytest.raises(ConfigurationError, match="comma-separated list"):
        GpuRequest.parse(text)


@pytest.mark.parametrize("value", [True, [], ()])
def test_gpus_from_python_that_name_no_gpu_are_refused(value):
    with pytest.raises(ConfigurationError, match="comma-separated list"):
        GpuRequest.of(value)


@pytest.mark.parametrize("text", ["0", "00", " 0 "])
def test_zero_gpus_is_refused_with_a_pointer_to_cpu(text):
    with pytest.raises(ConfigurationError, match=r"at least 1 GPU.*--cpu") as from_cli:
        GpuRequest.parse(text)
    with pytest.raises(ConfigurationError, match=r"at least 1 GPU.*--cpu") as from_python:
        GpuRequest.of(int(text))
    # one place refuses it, with one message: only how the value was given differs
    assert str(from_cli.value).replace(f"--gpus {text!r}", "X") == str(from_python.value).replace("gpus=0", "X")


@pytest.mark.parametrize("text", ["9" * 5000, "1,\u00b2", "1234567890"])
def test_gpu_numbers_are_bounded_ascii_digits(text):
    with pytest.raises(ConfigurationError, match="at most 9 digits"):
        GpuRequest.parse(text)


@pytest.mark.parametrize("killed_rank", [0, 1, 2])
def test_worker_killed_first_is_the_root_cause_not_the_ones_the_launcher_stopped(killed_rank):
    # elastic: the SIGKILLed worker is found first, then the agent SIGTERMs the others;
    # all in the same second (timestamps are whole seconds)
    killed = WorkerFailure(rank=killed_rank, local_rank=killed_rank, pid=20, exitcode=-9,
                           timestamp=100.0, sequence=0)
    stopped = [WorkerFailure(rank=r, local_rank=r, pid=30 + r, exitcode=-15, timestamp=100.0, sequence=1 + i)
               for i, r in enumerate(r for r in range(3) if r != killed_rank)]
    err = WorkerFailedError([*reversed(stopped), killed])
    assert err.root is killed
    assert err.exit_code == 137
    assert str(err).splitlines()[0] == f"rank {killed_rank} (local rank {killed_rank}, pid 20) failed: killed by SIGKILL"
    assert "then: " in str(err) and "killed by SIGTERM" in str(err)


def test_a_crash_found_first_is_not_hidden_by_workers_that_then_stopped_cleanly():
    killed = WorkerFailure(rank=1, local_rank=1, pid=20, exitcode=-9, timestamp=100.0, sequence=0)
    stopped = WorkerFailure(rank=0, local_rank=0, pid=21, exitcode=PREEMPTED_EXIT_CODE, timestamp=100.0,
                            sequence=1)
    err = WorkerFailedError([stopped, killed])
    assert err.root is killed and not err.preempted and err.exit_code == 137


def test_preemption_notice_names_no_rank_outside_a_job(monkeypatch, capfd):
    import signal

    from gpukit.worker import _stop as _preemption

    monkeypatch.delenv("RANK", raising=False)
    _preemption.clear_stop_request()
    try:
        _preemption._on_signal(signal.SIGTERM, None)
        assert "gpukit: SIGTERM received, stopping" in capfd.readouterr().err
        _preemption.clear_stop_request()
        monkeypatch.setenv("RANK", "3")
        _preemption._on_signal(signal.SIGTERM, None)
        assert "gpukit: rank 3: SIGTERM received" in capfd.readouterr().err
    finally:
        _preemption.clear_stop_request()
    assert "rank ?" not in capfd.readouterr().err


def test_a_worker_sigkilled_before_the_stop_is_the_root_cause_whatever_the_others_raised():
    killed = WorkerFailure(rank=1, local_rank=1, pid=7, exitcode=-9, timestamp=101.0, sequence=1, before_stop=True)
    peer = WorkerFailure(rank=0, local_rank=0, pid=6, exitcode=1, error="RuntimeError: Connection reset by peer",
                         timestamp=100.0, sequence=0)
    err = WorkerFailedError([peer, killed])
    assert err.root is killed and err.exit_code == 137
    assert str(err).splitlines()[0].endswith("killed by SIGKILL (possibly the out-of-memory killer: see "
                                             "`dmesg` or `journalctl -k`)")
    # the launcher's own SIGKILL after the grace period is not called an OOM kill
    assert WorkerFailure(rank=0, local_rank=0, pid=6, exitcode=-9).describe() == "killed by SIGKILL"


def test_a_stalled_rank_is_blamed_over_the_ranks_whose_collective_timed_out():
    waiting = WorkerFailure(rank=0, local_rank=0, pid=6, exitcode=1, error="DistBackendError: timed out",
                            timestamp=100.0)
    stalled = WorkerFailure(rank=1, local_rank=1, pid=7, exitcode=-15, timestamp=101.0,
                            stalled="rank 1 stalled at t.py:3 in f")
    err = WorkerFailedError([waiting, stalled])
    assert err.root is stalled and err.exit_code == 124
    assert str(err).splitlines()[0].endswith("failed: rank 1 stalled at t.py:3 in f")
    # a stalled rank that raised an error of its own exits as a raised error
    raised = WorkerFailure(rank=1, local_rank=1, pid=7, exitcode=-15, error="CheckpointError: x",
                           stalled="rank 1 stalled")
    assert WorkerFailedError([waiting, raised]).exit_code == 1
