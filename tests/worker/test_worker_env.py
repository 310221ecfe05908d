"""WorkerEnv: the one launcher -> worker contract, written and read back as typed values."""

from __future__ import annotations

import signal

import pytest

from gpukit._util import envvars
from gpukit.errors import ConfigurationError
from gpukit.worker import WorkerEnv

FULL = WorkerEnv(run_id="gpukit-3f2a9c1b2c4d", launcher_pid=4242, grace_s=2.5, cpu=True, run_dir="/tmp/run",
                 timeout_s=90.0, preempt_signal=signal.SIGUSR1, max_requeues=3, record_dir="/data/rec")


def test_what_the_launcher_writes_the_worker_reads_back() -> None:
    env = FULL.to_env()
    assert env == {
        "GPUKIT_RUN_ID": "gpukit-3f2a9c1b2c4d", "GPUKIT_LAUNCHER_PID": "4242", "GPUKIT_GRACE_S": "2.5",
        "GPUKIT_CPU": "1", "GPUKIT_RUN_DIR": "/tmp/run", "GPUKIT_TIMEOUT_S": "90.0",
        "GPUKIT_PREEMPT_SIGNAL": "USR1", "GPUKIT_MAX_REQUEUES": "3", "GPUKIT_RECORD_DIR": "/data/rec",
    }
    assert WorkerEnv.from_env(env) == FULL
    assert set(env) <= {getattr(envvars, name) for name in envvars.__all__}  # every name is one of the table's


def test_nothing_given_is_the_empty_contract() -> None:
    assert WorkerEnv().to_env() == {}
    assert WorkerEnv.from_env({}) == WorkerEnv()
    # an empty variable is not given (as `GPUKIT_RUN_DIR= python train.py` means)
    assert WorkerEnv.from_env({name: "" for name in FULL.to_env()}) == WorkerEnv()
    assert WorkerEnv.from_env({"GPUKIT_CPU": "0"}).cpu is False


def test_a_signal_is_read_by_any_of_its_names() -> None:
    assert WorkerEnv.from_env({"GPUKIT_PREEMPT_SIGNAL": "sigterm"}).preempt_signal == signal.SIGTERM


@pytest.mark.parametrize(("name", "value"), [
    ("GPUKIT_LAUNCHER_PID", "12ab"),
    ("GPUKIT_LAUNCHER_PID", "-1"),
    ("GPUKIT_LAUNCHER_PID", "9" * 400),
    ("GPUKIT_GRACE_S", "soon"),
    ("GPUKIT_GRACE_S", "-1"),
    ("GPUKIT_GRACE_S", "inf"),
    ("GPUKIT_TIMEOUT_S", "0"),
    ("GPUKIT_TIMEOUT_S", "nan"),
    ("GPUKIT_PREEMPT_SIGNAL", "KILL"),
    ("GPUKIT_MAX_REQUEUES", "-2"),
    ("GPUKIT_MAX_REQUEUES", "ten"),
])
def test_a_value_that_does_not_parse_is_named_with_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        WorkerEnv.from_env({name: value})
    message = str(info.value)
    assert name in message and repr(value)[:40].strip("'") in message


def test_the_contract_is_frozen() -> None:
    with pytest.raises(AttributeError):
        FULL.cpu = False  # type: ignore[misc]


def test_this_process_reads_the_contract_once_and_again_when_a_variable_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpukit.worker import worker_env

    for name in FULL.to_env():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUKIT_RUN_DIR", "/tmp/first")
    first = worker_env()
    assert first.run_dir == "/tmp/first" and worker_env() is first  # parsed once
    monkeypatch.setenv("GPUKIT_RUN_DIR", "/tmp/second")
    assert worker_env().run_dir == "/tmp/second"  # a changed variable is read again
    for name, value in FULL.to_env().items():
        monkeypatch.setenv(name, value)
    assert worker_env() == FULL
    monkeypatch.setenv("GPUKIT_GRACE_S", "soon")
    for _ in range(2):  # a bad value raises on every read, never a stale contract
        with pytest.raises(ConfigurationError, match="GPUKIT_GRACE_S"):
            worker_env()
