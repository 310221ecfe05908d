"""A stalled loader ends in a clear DataStallError within the data timeout, never a hang."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import namedtuple

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import gpukit
from gpukit.data._stall import DEFAULT_DATA_TIMEOUT_S, SharedMemoryWarning, resolve_data_timeout
from gpukit.errors import ConfigurationError, DataStallError


class Faulty(Dataset):
    """Item ``at`` hangs (sleeps far past any timeout) or kills its process with ``sig``."""

    def __init__(self, at: int, sig: int | None = None, n: int = 8) -> None:
        self.at, self.sig, self.n, self.hang_s = at, sig, n, 120.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.at:
            if self.sig is None:
                time.sleep(self.hang_s)  # the hang
            else:
                os.kill(os.getpid(), self.sig)
        return torch.tensor([float(i)])


def drain(num_workers: int, dataset: Dataset, timeout_s: float) -> tuple[DataStallError, float]:
    s = gpukit.Session(devices="cpu", verbose=False)
    loader = s.setup_dataloader(dataset, batch_size=1, num_workers=num_workers,
                                data_timeout_s=timeout_s)
    start = time.monotonic()
    with pytest.raises(DataStallError) as info:
        for _ in loader:
            pass
    return info.value, time.monotonic() - start


@pytest.mark.timeout(60, method="thread")  # pytest-timeout's own SIGALRM would switch ours off
def test_a_hanging_dataset_in_process_ends_within_the_timeout_naming_the_line() -> None:
    error, took = drain(0, Faulty(at=2), timeout_s=1.0)
    assert took < 20
    assert "within the data timeout (1 s)" in str(error)
    assert "test_stall.py" in str(error) and "__getitem__" in str(error)  # where it was stuck
    assert "data_timeout_s" in str(error)  # the fix names the setting
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)  # handler restored
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0



@pytest.mark.timeout(60, method="thread")
def test_a_loader_with_its_own_sampler_keeps_the_data_timeout_given() -> None:
    from torch.utils.data import DataLoader, WeightedRandomSampler

    # gpukit does not shard a sampler of the user's own; the timeout asked for still applies (it fell back
    # to the 600 s default before)
    always_the_hanging_item = WeightedRandomSampler([1.0] + [0.0] * 7, 4)
    own = DataLoader(Faulty(at=0), batch_size=1, sampler=always_the_hanging_item)
    loader = gpukit.Session(devices="cpu", verbose=False).setup_dataloader(own, data_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(DataStallError, match=r"within the data timeout \(1 s\)"):
        next(iter(loader))
    assert time.monotonic() - start < 20

def _steps(dataset: Dataset, batch_size: int, timeout_s: float, step: object) -> int:
    """Batches drawn from ``dataset`` through a gpukit loader, running ``step(loader)`` after each."""
    loader = gpukit.Session(devices="cpu", verbose=False).setup_dataloader(
        dataset, batch_size=batch_size, data_timeout_s=timeout_s)
    seen = 0
    for _ in loader:
        seen += 1
        step(loader)  # type: ignore[operator]
    return seen


@pytest.mark.timeout(60, method="thread")
def test_a_training_step_longer_than_the_timeout_is_not_a_stall() -> None:
    # only the wait for a batch counts: a slow step between batches is the model's time
    def compute(_loader: object) -> None:  # a step that computes for 2.5 timeouts
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pass

    assert _steps(TensorDataset(torch.zeros(3)), 1, 0.2, compute) == 3


@pytest.mark.timeout(60, method="thread")
def test_the_watchdog_s_signal_landing_after_the_batch_came_is_ignored() -> None:
    # the race: the watchdog saw a wait past the timeout, the batch arrived, then its SIGALRM
    def late_kick(loader: object) -> None:
        guard = loader._guard  # type: ignore[attr-defined]
        guard.kicked = True
        signal.pthread_kill(threading.get_ident(), signal.SIGALRM)  # handled before the next line
        assert guard.kicked is False  # seen by our handler, not by SIG_DFL (which would end us)

    assert _steps(TensorDataset(torch.zeros(4)), 2, 1.0, late_kick) == 2
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)


@pytest.mark.slow
def test_a_hanging_worker_ends_within_the_timeout() -> None:
    error, took = drain(1, Faulty(at=2), timeout_s=1.0)
    assert took < 30
    assert "1 loader worker(s)" in str(error) and "py-spy" in str(error)


@pytest.mark.slow
def test_a_worker_killed_by_sigkill_is_named_out_of_memory() -> None:
    error, took = drain(1, Faulty(at=3, sig=signal.SIGKILL), timeout_s=60)
    assert took < 30  # torch notices the dead worker itself, long before the timeout
    assert "SIGKILL" in str(error) and "out-of-memory killer" in str(error)
    assert "fewer workers" in str(error)


@pytest.mark.slow
def test_a_worker_killed_while_the_step_computes_is_named_too() -> None:
    s = gpukit.Session(devices="cpu", verbose=False)
    loader = s.setup_dataloader(Faulty(at=3, sig=signal.SIGKILL, n=40), batch_size=1, num_workers=1)
    with pytest.raises(DataStallError, match="SIGKILL"):
        for _ in loader:
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline:  # the training step: busy, not waiting for data
                pass


@pytest.mark.slow
def test_a_bus_error_names_dev_shm_and_the_docker_fix() -> None:
    error, _ = drain(1, Faulty(at=3, sig=signal.SIGBUS), timeout_s=60)
    assert "bus error" in str(error) and "/dev/shm" in str(error)
    assert "--shm-size" in str(error)


def test_shared_memory_warning_before_workers_fill_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("gpukit.data._stall.shutil.disk_usage", lambda path: usage(64e6, 63e6, 1e6))
    s = gpukit.Session(devices="cpu", verbose=False)
    loader = s.setup_dataloader(TensorDataset(torch.zeros(8, 256, 1024)), batch_size=2, num_workers=1)
    with pytest.warns(SharedMemoryWarning, match=r"1 workers x prefetch_factor 2.*--shm-size"):
        for _ in loader:
            pass


def test_a_hang_where_sigalrm_is_taken_is_reported_by_the_watchdog(
    capfd: pytest.CaptureFixture[str],
) -> None:
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: None)  # the program's own
    try:
        s = gpukit.Session(devices="cpu", verbose=False)
        loader = s.setup_dataloader(Faulty(at=1, sig=None, n=2), batch_size=1, data_timeout_s=0.3)
        loader.dataset.hang_s = 1.5  # a stall that ends by itself, after the timeout
        assert [len(b) for b in loader] == [1, 1]
    finally:
        signal.signal(signal.SIGALRM, previous)
    err = capfd.readouterr().err
    assert "produced no batch within the data timeout (0.3 s)" in err
    assert "test_stall.py" in err and "cannot be interrupted" in err


def test_the_program_s_own_sigalrm_handler_is_left_alone() -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: calls.append(signum))
    try:
        s = gpukit.Session(devices="cpu", verbose=False)
        for _ in s.setup_dataloader(TensorDataset(torch.zeros(4)), batch_size=2, data_timeout_s=1):
            signal.raise_signal(signal.SIGALRM)
        assert calls == [signal.SIGALRM] * 2
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_outside_the_main_thread_there_is_no_alarm_and_no_error() -> None:
    result: list[int] = []
    s = gpukit.Session(devices="cpu", verbose=False)
    loader = s.setup_dataloader(TensorDataset(torch.zeros(4)), batch_size=2, data_timeout_s=1)
    thread = threading.Thread(target=lambda: result.extend(len(b[0]) for b in loader))
    thread.start()
    thread.join(30)
    assert result == [2, 2]


def test_data_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_data_timeout(None) == DEFAULT_DATA_TIMEOUT_S == 600.0
    monkeypatch.setenv("GPUKIT_DATA_TIMEOUT_S", "42")
    assert resolve_data_timeout(None) == 42.0
    assert resolve_data_timeout(5) == 5.0
    for bad in (0, -1, "soon", True):
        with pytest.raises(ConfigurationError, match="seconds > 0"):
            resolve_data_timeout(bad)  # type: ignore[arg-type]
    monkeypatch.setenv("GPUKIT_DATA_TIMEOUT_S", "never")
    with pytest.raises(ConfigurationError, match="GPUKIT_DATA_TIMEOUT_S='never'"):
        resolve_data_timeout(None)
    s = gpukit.Session(devices="cpu", verbose=False)
    loader = s.setup_dataloader(TensorDataset(torch.zeros(4)), batch_size=2, num_workers=1,
                                data_timeout_s=7)
    assert loader.timeout == 7  # a worker's wait is torch's own timeout
