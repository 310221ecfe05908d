"""gpukit.data: sharding, per-epoch shuffles, mid-epoch resume, workers."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, WeightedRandomSampler

from gpukit.accelerators import CPUAccelerator, CUDAAccelerator
from gpukit.data import DeviceLoader, LoaderPlace, LoaderRequest, auto_num_workers, build_loader
from gpukit.errors import CheckpointError, ConfigurationError

CPU = torch.device("cpu")


class CountingDataset(Dataset):
    """Records which samples were loaded (to prove resume skips indices, not data)."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded.append(i)
        return i


def loader(data: object, rank: int = 0, world: int = 1, seed: int = 7, **kw: object) -> DeviceLoader:
    kw.setdefault("batch_size", 4)
    kw.setdefault("shuffle", True)
    place = LoaderPlace(CPU, CPUAccelerator(), rank=rank, world_size=world, local_world_size=world, seed=seed)
    return build_loader(data, place, LoaderRequest.of(**kw))


def flat(batches: list) -> list[int]:
    return [int(i) for b in batches for i in b]


def test_epochs_advance_and_reshuffle_by_themselves() -> None:
    dl = loader(CountingDataset(20))
    first, second = flat(list(dl)), flat(list(dl))
    assert sorted(first) == sorted(second) == list(range(20)) and first != second
    assert dl.state_dict()["epoch"] == 2
    dl.set_epoch(0)
    assert flat(list(dl)) == first  # order is a function of (seed, epoch)


def test_ranks_get_disjoint_shards() -> None:
    shards = [flat(list(loader(CountingDataset(24), rank=r, world=3))) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(24))
    assert all(len(s) == 8 for s in shards)


def test_resume_mid_epoch_continues_with_the_next_batch_without_loading_skipped() -> None:
    reference = loader(CountingDataset(30), seed=11)
    list(reference)  # epoch 0
    full_epoch_1 = list(reference)

    run = loader(CountingDataset(30), seed=11)
    list(run)
    it = iter(run)
    seen = [next(it) for _ in range(3)]  # checkpoint after 3 batches of epoch 1
    state = run.state_dict()
    assert state["epoch"] == 1 and state["batches_consumed"] == 3 and state["seed"] == 11

    data = CountingDataset(30)
    fresh = loader(data, seed=999)  # a new process: different seed until the state is loaded
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert flat(seen + rest) == flat(full_epoch_1)
    assert sorted(data.loaded) == sorted(flat(rest))  # skipped batches were never loaded
    assert fresh.state_dict()["epoch"] == 2 and fresh.state_dict()["batches_consumed"] == 0


def test_break_then_iterate_again_is_the_next_epoch() -> None:
    dl = loader(CountingDataset(12))
    for _ in dl:
        break
    list(dl)
    assert dl.state_dict()["epoch"] == 2


def test_mid_epoch_state_of_a_loader_gpukit_does_not_shard_is_refused_under_another_world_size() -> None:
    custom = DataLoader(CountingDataset(8), batch_size=4, sampler=WeightedRandomSampler([1.0] * 8, 8))
    dl = loader(custom, batch_size=None, shuffle=None)
    with pytest.raises(CheckpointError, match="world_size=2") as info:
        dl.load_state_dict({"epoch": 0, "batches_consumed": 1, "world_size": 2, "batch_size": 4})
    message = str(info.value)
    assert "same number of processes as the checkpoint (2)" in message
    assert "not sharded by gpukit" in message and "setup_dataloader" in message


def test_state_from_an_epoch_boundary_loads_under_another_world_size_and_batch_size() -> None:
    state = {"epoch": 3, "batches_consumed": 0, "world_size": 2, "batch_size": 8, "seed": 11}
    dl = loader(CountingDataset(8), rank=0, world=1, seed=999)
    dl.load_state_dict(state)
    assert dl.state_dict()["epoch"] == 3 and dl.state_dict()["seed"] == 11
    same = loader(CountingDataset(8), seed=11)
    same.load_state_dict({**state, "world_size": 1, "batch_size": 4})
    assert flat(list(dl)) == flat(list(same))  # the same epoch order as a run of this world size


def test_dataloader_settings_are_kept_and_shuffle_detected() -> None:
    base = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=5, shuffle=True, drop_last=True)
    dl = loader(base, batch_size=None, shuffle=None)
    assert dl.batch_size == 5 and len(dl) == 2
    assert dl.loader.batch_sampler.sampler.shuffle is True
    ordered = loader(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=5),
                     batch_size=None, shuffle=None)
    assert torch.equal(next(iter(ordered))[0], torch.arange(5.0))


def test_custom_sampler_kept_in_one_process_refused_in_several() -> None:
    data = CountingDataset(10)
    custom = DataLoader(data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 10, 10))
    dl = loader(custom, batch_size=None, shuffle=None)
    assert dl.loader is custom and len(list(dl)) == 5
    with pytest.raises(ConfigurationError, match="WeightedRandomSampler"):
        loader(custom, world=2, batch_size=None, shuffle=None)


def test_num_workers_auto_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpukit.data._workers.usable_cpu_count", lambda: 16)
    tensors = TensorDataset(torch.zeros(2))
    assert auto_num_workers(tensors, CUDAAccelerator(), 1) == 0
    assert auto_num_workers(CountingDataset(2), CPUAccelerator(), 1) == 0
    assert auto_num_workers(CountingDataset(2), CUDAAccelerator(), 1) == 8
    assert auto_num_workers(CountingDataset(2), CUDAAccelerator(), 4) == 3
    with pytest.raises(ConfigurationError, match="num_workers"):
        loader(CountingDataset(4), num_workers=-1)


class RandomDataset(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> float:
        import numpy as np

        return random.random() + float(np.random.rand()) + torch.rand(()).item()


def test_workers_are_seeded_reproducibly_and_differently() -> None:
    def draws(seed: int) -> list[float]:
        dl = loader(RandomDataset(), seed=seed, num_workers=2, batch_size=1, shuffle=False)
        return [float(b) for b in dl]

    a, b = draws(5), draws(5)
    assert a == b  # same seed, same "random" augmentations
    assert len(set(a)) == 4  # but workers do not repeat each other
    assert draws(6) != a


def test_gpu_pins_host_data_but_not_a_dataset_already_on_the_device() -> None:
    gpu = LoaderPlace(CPU, CUDAAccelerator())
    host = TensorDataset(torch.zeros(8, 2))
    assert build_loader(host, gpu, LoaderRequest(batch_size=4, move_to_device=False)).loader.pin_memory is True
    # meta stands in for cuda here: DataLoader would fail pinning it ("only dense CPU tensors can be pinned")
    on_device = TensorDataset(torch.zeros(8, 2, device="meta"))
    assert build_loader(on_device, gpu, LoaderRequest(batch_size=4, move_to_device=False)).loader.pin_memory is False
    explicit = LoaderRequest(batch_size=4, move_to_device=False, pin_memory=True)
    assert build_loader(on_device, gpu, explicit).loader.pin_memory is True  # explicit wins


def test_request_takes_setup_dataloaders_keywords_and_the_given_loaders_settings() -> None:
    request = LoaderRequest.of(4, None, 2, drop_last=True, data_timeout_s=5.0, collate_fn=list)
    assert (request.drop_last, request.data_timeout_s, dict(request.extra)) == (True, 5.0, {"collate_fn": list})

    def init(worker: int) -> None:
        pass

    given = DataLoader(CountingDataset(8), batch_size=2, num_workers=0, collate_fn=tuple, worker_init_fn=init)
    completed = LoaderRequest().completed_from(given)
    assert (completed.batch_size, completed.num_workers, completed.drop_last) == (2, 0, False)
    assert completed.extra["collate_fn"] is tuple and completed.extra["worker_init_fn"] is init
    overridden = LoaderRequest(batch_size=4, extra={"collate_fn": list}).completed_from(given)
    assert overridden.batch_size == 4 and overridden.extra["collate_fn"] is list  # what was asked wins


def test_worker_settings_reach_the_dataloader() -> None:
    with_workers = loader(CountingDataset(8), num_workers=1, persistent_workers=False, prefetch_factor=3,
                          data_timeout_s=7.0).loader
    assert (with_workers.persistent_workers, with_workers.prefetch_factor, with_workers.timeout) == (False, 3, 7.0)
    assert loader(CountingDataset(8), num_workers=1).loader.persistent_workers is True  # the default
    # without workers torch refuses a timeout and a prefetch factor: both are left out
    alone = loader(CountingDataset(8), num_workers=0, prefetch_factor=3, timeout=5).loader
    assert (alone.timeout, alone.prefetch_factor, alone.persistent_workers) == (0, None, False)


def test_a_generator_of_the_users_own_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"generator=.*Session\(seed="):
        loader(CountingDataset(8), generator=torch.Generator())
