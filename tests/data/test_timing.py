"""gpukit.data step-time breakdown: data wait, copy and compute per step, listeners, throughput."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import gpukit
from gpukit.data import StepTiming, StepTimings
from gpukit._util.cpu import CpuClock, CpuShare
from gpukit.data._advice import LoaderFacts, diagnose
from gpukit.data._timing import PassTotals
from gpukit.errors import ConfigurationError

DATA_SLEEP_S = 0.03
COMPUTE_SLEEP_S = 0.01


class SleepyDataset(Dataset):
    """Each item takes a known time to load (sleeps are lower bounds even on a busy machine)."""

    def __init__(self, n: int, sleep_s: float = DATA_SLEEP_S) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return torch.full((3,), float(i))


def session() -> gpukit.Session:
    return gpukit.Session(devices="cpu", verbose=False)


def test_each_step_reports_its_data_wait_and_compute() -> None:
    s = session()
    records: list[StepTiming] = []
    s.timings.add_listener(records.append)
    loader = s.setup_dataloader(SleepyDataset(5), batch_size=1, num_workers=0)
    for _ in loader:
        time.sleep(COMPUTE_SLEEP_S)
    assert [r.step for r in records] == [0, 1, 2, 3, 4]  # the last step of the epoch too
    for r in records:
        assert r.data_wait_s >= DATA_SLEEP_S * 0.95
        assert r.compute_s >= COMPUTE_SLEEP_S * 0.95
        assert r.step_time_s == pytest.approx(r.data_wait_s + r.compute_s)
        assert r.h2d_s is None  # training on the host: there is no copy
        assert (r.epoch, r.rank, r.samples, r.exact) == (0, 0, 1, True)
    with pytest.raises(Exception):  # frozen: listeners cannot change what others see
        records[0].step = 9  # type: ignore[misc]


def test_data_bound_loop_is_named_data_bound() -> None:
    s = session()
    loader = s.setup_dataloader(SleepyDataset(6, 0.05), batch_size=1, num_workers=0)
    for _ in loader:
        pass  # ~0 compute: the time is the loader's
    summary = s.throughput()
    assert summary.steps == 6 and summary.samples == 6
    assert summary.data_share > 0.8
    assert "samples/s" in s.timings.status_text() and "data" in s.timings.status_text()


def test_compute_bound_loop_has_a_small_data_share() -> None:
    s = session()
    loader = s.setup_dataloader(TensorDataset(torch.randn(40, 3)), batch_size=8)
    compute_s = 0.08  # long beside a batch fetch even on a loaded 2-core machine (0.02 failed at load 12)
    for _ in loader:
        time.sleep(compute_s)  # the step's compute, not a wait for anything
    summary = s.throughput()
    assert summary.data_share < 0.2 and summary.compute_share > 0.8
    assert summary.samples_per_s is not None and summary.samples_per_s < 8 / compute_s
    assert "data" not in s.timings.status_text()


def test_steps_count_across_loaders_epochs_and_a_break() -> None:
    s = session()
    records: list[StepTiming] = []
    s.timings.add_listener(records.append)
    train = s.setup_dataloader(TensorDataset(torch.arange(10.0)), batch_size=4)
    val = s.setup_dataloader(TensorDataset(torch.arange(4.0)), batch_size=4)
    for _ in range(2):
        for _ in train:
            pass
        for _ in val:
            pass
    for i, _ in enumerate(train):  # epoch 2, cut short after two batches
        if i == 1:
            break
    assert [r.step for r in records] == list(range(10))
    assert [r.samples for r in records] == [4, 4, 2, 4, 4, 4, 2, 4, 4, 4]
    assert [r.epoch for r in records] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert s.timings.steps == 10


def test_remove_listener_and_bad_listener() -> None:
    timings = StepTimings()
    seen: list[int] = []

    def listener(r: StepTiming) -> None:
        seen.append(r.step)

    timings.add_listener(listener)
    list(timings.iterate([1, 2], epoch=0))
    timings.remove_listener(listener)
    timings.remove_listener(listener)  # twice is harmless
    list(timings.iterate([3], epoch=0))
    assert seen == [0, 1]
    with pytest.raises(ConfigurationError, match="callable"):
        timings.add_listener("not a function")  # type: ignore[arg-type]


def test_session_progress_times_a_plain_torch_loader() -> None:
    s = session()
    records: list[StepTiming] = []
    s.timings.add_listener(records.append)
    plain = DataLoader(SleepyDataset(3, 0.02), batch_size=1)
    assert len(list(s.progress(plain))) == 3
    assert len(records) == 3 and all(r.data_wait_s >= 0.019 for r in records)
    for _ in s.progress(s.setup_dataloader(TensorDataset(torch.zeros(2)), batch_size=1)):
        pass  # a gpukit loader is timed once, not twice
    assert len(records) == 5


def test_throughput_before_any_step_is_empty() -> None:
    summary = session().throughput()
    assert summary.steps == 0 and summary.samples_per_s is None and summary.data_share == 0.0


@pytest.mark.requires_gpu
def test_gpu_copy_timed_lazily_without_sync_and_exactly_when_asked() -> None:
    s = gpukit.Session(devices="cuda:0", verbose=False)
    records: list[StepTiming] = []
    s.timings.add_listener(records.append)
    data = TensorDataset(torch.randn(64, 1024, 256))
    for _ in s.setup_dataloader(data, batch_size=16, pin_memory=True):
        torch.cuda.synchronize()  # the GPU passed the copy's end event: lazy figures exist
    assert all(not r.exact and r.h2d_s is not None and r.h2d_s > 0 for r in records)
    s.timings.exact = True
    records.clear()
    for _ in s.setup_dataloader(data, batch_size=16, pin_memory=True):
        pass
    assert all(r.exact and r.h2d_s is not None and r.h2d_s > 0 for r in records)


# -- the end-of-epoch diagnosis ------------------------------------------------------------------
def totals(wait_share: float, h2d_share: float | None = None, first_wait_share: float = 0.1,
           steps: int = 10, step_s: float = 0.1) -> PassTotals:
    t = PassTotals(epoch=3)
    for i in range(steps):
        wait = step_s * wait_share
        if i == 0:  # the first batch of the epoch carries this share of the epoch's wait
            wait = first_wait_share * step_s * wait_share * steps
        elif first_wait_share > 0.5:
            wait = step_s * wait_share * (1 - first_wait_share) * steps / (steps - 1)
        t.add(32, step_s, wait, None if h2d_share is None else step_s * h2d_share)
    return t


def facts(**kw: object) -> LoaderFacts:
    base = dict(num_workers=0, pin_memory=False, persistent_workers=False, start_method="fork",
                pinning_helps=False, auto_workers=6, spare_workers=6)
    base.update(kw)
    return LoaderFacts(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ranks", "loader", "cause", "text"),
    [
        ([totals(0.41)], facts(), "workers",
         'data loading is 41% of step time: num_workers=0 -> try num_workers="auto" (6)'),
        ([totals(0.41)], facts(auto_workers=0, spare_workers=1), "workers",
         'num_workers=0 -> try num_workers="tune" (up to 1)'),
        ([totals(0.3, first_wait_share=0.8)],
         facts(num_workers=4, start_method="spawn"), "restarts",
         "workers re-import the training script at each epoch (spawn): persistent_workers=True"),
        ([totals(0.3)], facts(num_workers=2, persistent_workers=True), "more_workers",
         'num_workers=2 -> try num_workers="tune"'),
        ([totals(0.3)], facts(num_workers=6, persistent_workers=True), "dataset",
         "num_workers=6 already uses the spare cores -> make __getitem__ cheaper"),
        ([totals(0.02, h2d_share=0.18)], facts(pinning_helps=True), "pinning",
         "host-to-device copy 18%: pin_memory is off -> pin_memory=True"),
        ([totals(0.02, h2d_share=0.18)], facts(pinning_helps=True, pin_memory=True), "copy_size",
         "host-to-device copy 18%: batches are large on the wire"),
        ([totals(0.2), totals(0.6)], facts(), "workers",
         "data loading is 40% of step time (rank 1 worst: 60%)"),
    ],
)
def test_the_epoch_line_names_the_cause_and_the_fix(
    ranks: list[PassTotals], loader: LoaderFacts, cause: str, text: str
) -> None:
    report = diagnose(ranks, loader)
    assert report.causes[0] == cause
    assert text in report.line
    assert report.line.startswith("gpukit: epoch 4: ")
    assert report.worst_rank == len(ranks) - 1


def test_a_loader_that_keeps_up_says_so() -> None:
    report = diagnose([totals(0.03, h2d_share=0.01)], facts(pinning_helps=True))
    assert report.causes == () and "the loader keeps up" in report.line
    assert "320 samples/s" in report.line  # 32 samples per 0.1 s step


def test_session_prints_the_epoch_line_on_rank_zero(capsys: pytest.CaptureFixture[str]) -> None:
    s = gpukit.Session(devices="cpu", verbose=True)
    for _ in s.setup_dataloader(SleepyDataset(4, 0.02), batch_size=2, num_workers=0):
        pass
    err = capsys.readouterr().err
    assert "gpukit: epoch 1:" in err and "data loading is" in err and "num_workers=0 -> try" in err
    assert s.timings.epoch_reports[-1].causes[0] == "workers"  # then "threads" where this machine is shared
    quiet = session()
    for _ in quiet.setup_dataloader(SleepyDataset(2, 0.0), batch_size=2):
        pass
    assert "gpukit: epoch" not in capsys.readouterr().err and len(quiet.timings.epoch_reports) == 1


# -- a shared machine (issue 41.13 and 41.22b) -----------------------------------------------------
SHARED = CpuShare(usable_cpus=2, others_cpus=1.6, threads=2)  # others keep 1.6 of 2 CPUs busy, torch runs 2


def test_an_in_memory_dataset_on_shared_cpus_blames_the_cpu_not_the_data() -> None:
    report = diagnose([totals(0.41)], facts(in_memory=True, auto_workers=0, spare_workers=1), SHARED)
    assert report.causes[0] == "shared_cpu"
    assert "this is the CPU being shared, not the data: other work used 1.6 of the 2 usable CPUs" in report.line
    assert "torch.set_num_threads(1)" in report.line
    assert "__getitem__" not in report.line and "num_workers" not in report.line
    # the same dataset on CPUs nobody else uses: the usual advice
    quiet = diagnose([totals(0.41)], facts(in_memory=True, auto_workers=0, spare_workers=1),
                     CpuShare(usable_cpus=2, others_cpus=0.1, threads=2))
    assert quiet.causes == ("workers",)


def test_oversubscribed_threads_are_named_even_when_the_loader_keeps_up() -> None:
    report = diagnose([totals(0.03)], facts(), SHARED)
    assert "the loader keeps up" in report.line and report.causes == ("threads",)
    assert "the CPUs are shared (other work used 1.6 of the 2 usable CPUs) and torch runs 2 threads" in report.line
    assert "torch.set_num_threads(1) (or OMP_NUM_THREADS=1)" in report.line
    fitting = diagnose([totals(0.03)], facts(), CpuShare(usable_cpus=2, others_cpus=1.6, threads=1))
    assert fitting.causes == ()


def test_the_cpu_clock_counts_what_other_processes_used(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([(0.0, 100.0, 10.0), (2.0, 104.0, 11.0)])  # 4 busy CPU-s in 2 s, 1 of them ours
    monkeypatch.setattr(CpuClock, "_read", staticmethod(lambda: next(readings)))
    share = CpuClock().share_since(threads=4)
    assert share is not None and share.others_cpus == 1.5 and share.threads == 4
    monkeypatch.undo()
    real = CpuClock()  # this machine, for real: it reads, and what others use is never negative
    time.sleep(0.1)  # an interval to measure over, not a synchronisation
    measured = real.share_since()
    assert measured is None or measured.others_cpus >= 0
