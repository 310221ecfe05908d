"""select_gpus(): criteria, deterministic ranking, and errors that name each GPU and why."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest

from gpukit.devices import claim_gpus, select_gpus
from gpukit.devices._wait import poll
from gpukit.errors import ClaimTimeoutError, ConfigurationError, GpuSelectionError

GIB = 2**30


def _gpu(name: str = "Fake GPU", used_mib: int = 0, **extra: Any) -> dict[str, Any]:
    return {"name": name, "memory_total_mib": 16384, "memory_used_mib": used_mib, **extra}


def _indices(gpus: list[Any]) -> list[int]:
    return [g.index for g in gpus]


def test_most_free_memory_first(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    assert _indices(select_gpus(1)) == [2]
    assert _indices(select_gpus(2, share=True)) == [2, 1]
    assert _indices(select_gpus(4, share=True)) == [2, 1, 0, 3]
    assert _indices(select_gpus(2, order="utilization", share=True)) == [2, 1]
    assert _indices(select_gpus(3, order="index", share=True)) == [0, 1, 2]


def test_other_users_processes_make_a_gpu_busy(use_spec: Callable[[Any], Any]) -> None:
    """Another user's process on a GPU (or one whose owner cannot be seen) makes it busy whatever
    the claims say; this user's own processes do not; share=True takes such GPUs too."""
    from gpukit.devices._criteria import current_user

    me = current_user()
    use_spec({"gpus": [_gpu(processes=[{"pid": 5, "user": "mallory", "command": "x\x1b]0;owned\x07"}]),
                       _gpu(processes=[{"pid": 6}]),  # owner not visible (another container, no permission)
                       _gpu(processes=[{"pid": 7, "user": me, "command": "python mine.py"}]),
                       _gpu(used_mib=100)]})
    assert _indices(select_gpus(2)) == [2, 3]
    with pytest.raises(GpuSelectionError) as info:
        select_gpus(3)
    text = str(info.value)
    assert "GPU 0 (Fake GPU): in use by mallory's pid 5 (x\\x1b]0;owned\\x07)" in text  # escaped, not sent
    assert "\x1b" not in text
    assert "GPU 1 (Fake GPU): in use by an unknown user's pid 6" in text
    assert _indices(select_gpus(4, share=True)) == [0, 1, 2, 3]


def test_ties_are_broken_deterministically(use_spec: Callable[[Any], Any]) -> None:
    proc = [{"pid": 11, "used_memory_mib": 0}]
    use_spec({"gpus": [
        _gpu(utilization_gpu_pct=50),                   # 0: same free, busier
        _gpu(utilization_gpu_pct=10, processes=proc),   # 1: same free+util as 2, one process more
        _gpu(utilization_gpu_pct=10),                   # 2
        _gpu(utilization_gpu_pct=10),                   # 3: exact tie with 2 -> lower index first
        _gpu(),                                         # 4: utilization unknown: ranks as busiest
        _gpu(used_mib=1, utilization_gpu_pct=0),        # 5: less free memory than all others
    ]})
    assert _indices(select_gpus(6, share=True)) == [2, 3, 1, 0, 4, 5]
    assert _indices(select_gpus(6, order="utilization", share=True)) == [5, 2, 3, 1, 0, 4]
    assert _indices(select_gpus(3)) == _indices(select_gpus(3))  # stable across calls


def test_every_gpu_used_by_others_names_share_as_the_way_out(use_spec: Callable[[Any], Any]) -> None:
    """Issue 41.16: a box where other users' jobs sit on every GPU (with memory to spare) refused without
    naming --share; a GPU that fails on something else as well is not offered."""
    use_spec({"gpus": [_gpu(processes=[{"pid": 5, "user": "carol"}]), _gpu(processes=[{"pid": 6, "user": "dave"}]),
                       _gpu(used_mib=16384 - 10, processes=[{"pid": 7, "user": "erin"}])]})
    with pytest.raises(GpuSelectionError) as info:
        select_gpus(1, min_free_memory="1GiB")
    assert "GPUs 0, 1 would qualify if shared with the other users' jobs on them: add --share (share=True)" in str(
        info.value)
    assert _indices(select_gpus(1, min_free_memory="1GiB", share=True)) in ([0], [1])


def test_idle_node_picks_lowest_indices(use_spec: Callable[[Any], Any]) -> None:
    use_spec("idle-8gpu")
    assert _indices(select_gpus(3, min_free_memory="70GiB", max_processes=0)) == [0, 1, 2]


def test_all_busy_error_names_each_gpu_and_criterion(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    with pytest.raises(GpuSelectionError) as info:
        select_gpus(2, min_free_memory="8GiB", max_utilization=50)
    lines = str(info.value).splitlines()
    assert lines[0] == "Need 2 GPUs with free memory >= 8.00 GiB, utilization <= 50%; 1 of 4 qualify:"
    assert lines[1] == ("  GPU 0 (NVIDIA TITAN X (Pascal)): free 1.17 GiB < required 8.00 GiB; "
                        "utilization 97% > max 50%; in use by alice's pid 44683 (python train.py --lr 3e-4) and 1 more")
    assert lines[2] == ("  GPU 1 (NVIDIA TITAN X (Pascal)): free 7.50 GiB < required 8.00 GiB; "
                        "in use by bob's pid 51002 (jupyter-lab)")
    assert lines[3] == "  GPU 2 (NVIDIA TITAN X (Pascal)): ok"
    assert "GPU 3" in lines[4] and "utilization 100% > max 50%" in lines[4]
    assert "wait=True" in lines[-1]


def test_other_criteria(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    assert _indices(select_gpus(1, max_processes=0)) == [2]
    assert _indices(select_gpus(2, exclude=[2], share=True)) == [1, 0]
    assert _indices(select_gpus(2, exclude=["GPU-6b0c", "3"], share=True)) == [2, 0]
    with pytest.raises(GpuSelectionError, match=r"GPU 2 .*: excluded"):
        select_gpus(4, exclude=(2,), share=True)


def test_unusable_and_compute_modes_never_qualify(use_spec: Callable[[Any], Any]) -> None:
    use_spec({"gpus": [_gpu(lost=True), _gpu(compute_mode="Prohibited"),
                       _gpu(compute_mode="Exclusive_Process", processes=[{"pid": 77}]),
                       _gpu(compute_mode="Exclusive_Process", used_mib=100)]})
    assert _indices(select_gpus(1)) == [3]
    with pytest.raises(GpuSelectionError) as info:
        select_gpus(2)
    text = str(info.value)
    assert "GPU 0 (name n/a): unusable: GPU is lost" in text
    assert "GPU 1 (Fake GPU): compute mode Prohibited" in text
    assert "GPU 2 (Fake GPU): Exclusive_Process mode and in use by pid 77" in text


def test_hidden_by_cuda_visible_devices(use_spec: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    use_spec("shared-4gpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")  # e.g. what a cluster scheduler granted
    assert _indices(select_gpus(2, share=True)) == [0, 3]
    with pytest.raises(GpuSelectionError, match=r"GPU 2 .*hidden by CUDA_VISIBLE_DEVICES='0,3'"):
        select_gpus(3, share=True)


def test_mig_devices_are_selectable(use_spec: Callable[[Any], Any]) -> None:
    use_spec("mig-a100")
    chosen = select_gpus(2, min_free_memory="9GiB", share=True)
    assert [g.is_mig for g in chosen] == [False, True]
    assert chosen[1].uuid.startswith("MIG-aa11") and chosen[1].label.startswith("GPU 0 MIG 3g.20gb")
    with pytest.raises(GpuSelectionError, match=r"GPU 0 MIG 1g.5gb \(MIG-cc33dd44…\): free 3.88 GiB"):
        select_gpus(4, min_free_memory="9GiB", share=True)


def test_claimed_gpus_are_skipped(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    with claim_gpus(gpus=[2]):
        assert _indices(select_gpus(1, share=True)) == [1]
        with pytest.raises(GpuSelectionError, match=r"GPU 2 .*: claimed by pid \d+ \(this process\)"):
            select_gpus(4, share=True)
    assert _indices(select_gpus(1)) == [2]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"count": 0}, r"count=0: give the number of GPUs"),
        ({"count": True}, r"count=True"),
        ({"count": 1, "order": "fastest"}, r"order='fastest' is not known; choose one of: free-memory, utilization"),
        ({"count": 1, "min_free_memory": "8 bananas"}, r"Invalid size '8 bananas': expected .*8GiB, 8000MiB, 8G"),
        ({"count": 1, "max_utilization": 150}, r"between 0 and 100"),
        ({"count": 1, "max_processes": -1}, r"max_processes=-1"),
        ({"count": 1, "exclude": ["gpu0"]}, r"Cannot exclude 'gpu0': give a GPU index"),
        ({"count": 1, "wait": True, "timeout_s": -1}, r"timeout_s=-1"),
    ],
)
def test_bad_arguments(use_spec: Callable[[Any], Any], kwargs: dict[str, Any], pattern: str) -> None:
    use_spec("shared-4gpu")
    with pytest.raises(ConfigurationError, match=pattern):
        select_gpus(**kwargs)


def test_no_driver_fails_at_once_even_when_waiting(use_spec: Callable[[Any], Any]) -> None:
    use_spec("no-driver")
    start = time.monotonic()
    with pytest.raises(GpuSelectionError, match=r"Need 1 GPU but no NVIDIA GPU/driver found"):
        select_gpus(1, wait=True, timeout_s=30)
    assert time.monotonic() - start < 5


def test_wait_times_out_and_shows_what_it_waits_for(use_spec: Callable[[Any], Any],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    use_spec("shared-4gpu")
    start = time.monotonic()
    with pytest.raises(ClaimTimeoutError, match=r"(?s)GPU 3 .*Gave up after waiting 0\.\d s"):
        select_gpus(2, min_free_memory="8GiB", wait=True, timeout_s=0.3, poll_interval_s=0.05)
    assert 0.3 <= time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert err.count("gpukit: waiting for 2 GPUs with free memory >= 8.00 GiB: GPU 0") == 1  # once per change


def test_poll_returns_as_soon_as_the_attempt_succeeds() -> None:
    calls: list[int] = []

    def attempt() -> tuple[str | None, Callable[[float | None], GpuSelectionError]]:
        calls.append(1)
        return ("done" if len(calls) == 3 else None), (lambda waited: GpuSelectionError("Need 1 GPU\n  x: busy\nhint"))

    assert poll(attempt, wait=True, timeout_s=30, poll_interval_s=0.01, what="1 GPU") == "done"
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(GpuSelectionError):
        poll(attempt, wait=False, timeout_s=None, poll_interval_s=0.01, what="1 GPU")
    assert len(calls) == 1


def test_more_gpus_than_the_machine_has_says_so_instead_of_suggesting_to_wait(
    use_spec: Callable[[Any], Any],
) -> None:
    use_spec("shared-4gpu")
    for call in (lambda: select_gpus(5), lambda: select_gpus(5, wait=True, timeout_s=30),
                 lambda: claim_gpus(5, wait=True, timeout_s=30)):
        started = time.monotonic()
        with pytest.raises(GpuSelectionError) as info:
            call()
        assert time.monotonic() - started < 5  # fails at once: waiting cannot help
        message = str(info.value)
        assert "this machine has only 4 GPUs" in message and "at most 4" in message
        assert "wait" not in message.lower()


@pytest.mark.parametrize("exclude", [(9,), ["GPU-ffff"], (0, 7)])
def test_excluding_a_gpu_that_does_not_exist_is_an_error(
    use_spec: Callable[[Any], Any], exclude: Any
) -> None:
    use_spec("shared-4gpu")
    for call in (select_gpus, claim_gpus):
        with pytest.raises(ConfigurationError, match="no GPU here has that index or UUID") as info:
            call(1, exclude=exclude)
        message = str(info.value)
        assert "GPU 0" in message and "GPU 3" in message  # lists the GPUs that exist
        assert repr(exclude[-1]) in message
