"""A loader position saved mid-epoch by N ranks resumes on M ranks, at another batch size too.

Every rank of a job is simulated by its own loader in this process (the loaders of one job share
nothing but the seed, as real ranks do): N loaders consume k batches each, rank 0's state is loaded
into M fresh loaders, and what they hand out for the rest of the epoch is checked against the
epoch's global order: every sample not yet seen is seen once (padding repeats aside, which
``samples_in_batch`` counts as not real) and none twice.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from gpukit.accelerators import CPUAccelerator
from gpukit.data import DeviceLoader, LoaderPlace, LoaderRequest, build_loader
from gpukit.data._shard import make_sampler, rank_positions
from gpukit.errors import CheckpointError

CPU = torch.device("cpu")


class Ids(Dataset):
    """Sample ``i`` is the id ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def ranks(n: int, world: int, batch: int, even: str | bool = "pad", seed: int = 5, workers: int = 0) -> list[DeviceLoader]:
    """One loader per rank of a ``world``-rank job."""
    out = []
    for rank in range(world):
        place = LoaderPlace(CPU, CPUAccelerator(), rank=rank, world_size=world, local_world_size=world, seed=seed)
        out.append(build_loader(Ids(n), place, LoaderRequest.of(batch, True, workers, even)))
    return out


def consume(loaders: list[DeviceLoader], batches: int) -> list[int]:
    """Every rank takes ``batches`` batches of the next pass; the real (not padding) ids, by rank."""
    seen: list[int] = []
    for loader in loaders:
        it = iter(loader)
        for batch in itertools.islice(it, batches):
            real = loader.samples_in_batch()[1]  # type: ignore[index]
            seen += [int(i) for i in batch[:real]]
    return seen


def rest_of_pass(loaders: list[DeviceLoader]) -> list[int]:
    seen: list[int] = []
    for loader in loaders:
        for batch in loader:
            real = loader.samples_in_batch()[1]  # type: ignore[index]
            seen += [int(i) for i in batch[:real]]
    return seen


@pytest.mark.parametrize("before, after", [(n, m) for n in (1, 2, 3, 4) for m in (1, 2, 3, 4) if n != m]
                         + [(4, 8), (8, 3)])
@pytest.mark.parametrize("even", ["pad", False])
def test_every_unseen_sample_of_the_epoch_is_seen_once_after_n_to_m(before: int, after: int, even: str | bool) -> None:
    n = 53  # divides by none of the world sizes: padding (pad) or uneven shares (False) on both sides
    old = ranks(n, before, 3, even)
    first = consume(old, 2)  # 2 batches of 3 on each of `before` ranks, epoch 0
    states = [loader.state_dict() for loader in old]
    assert {s["samples_consumed"] for s in states} == {min(2 * 3 * before, n)}  # the same global position everywhere
    new = ranks(n, after, 2, even, seed=99)  # another batch size; the seed comes from the state
    for loader in new:
        loader.load_state_dict(states[0])
    rest = rest_of_pass(new)
    assert sorted(first + rest) == list(range(n))  # each sample of the epoch once: none lost, none twice
    assert all(loader.epoch == 1 and loader.batches_consumed == 0 for loader in new)
    # the rest is the epoch's order from that position on, dealt round-robin over the new ranks
    sampler = new[0].shard_sampler
    assert sampler is not None and sampler.epoch == 0
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
    assert sorted(order[len(first):]) == sorted(rest)


def test_drop_leaves_out_the_tail_of_the_rest_and_nothing_else() -> None:
    old = ranks(50, 3, 4, "drop")
    first = consume(old, 1)
    new = ranks(50, 4, 4, "drop")
    for loader in new:
        loader.load_state_dict(old[0].state_dict())
    rest = rest_of_pass(new)
    assert len(set(first + rest)) == len(first + rest)  # none twice
    assert len(rest) == (50 - 12) // 4 * 4  # the rest's last (50 - 12) mod 4 are left out


def test_same_layout_resume_is_the_uninterrupted_pass_and_positions_from_0_are_torchs() -> None:
    whole = [[int(i) for b in loader for i in b] for loader in ranks(30, 2, 4)]
    old = ranks(30, 2, 4)
    first = [[int(i) for b in itertools.islice(iter(loader), 2) for i in b] for loader in old]
    new = ranks(30, 2, 4)
    for loader, state in zip(new, [loader.state_dict() for loader in old]):
        loader.load_state_dict(state)
    rest = [[int(i) for b in loader for i in b] for loader in new]
    assert [f + r for f, r in zip(first, rest)] == whole  # rank by rank, in order
    for even, world, rank in itertools.product(("pad", "drop", False), (1, 3, 4), (0, 2)):
        if rank >= world:
            continue
        sampler = make_sampler(Ids(30), world_size=world, rank=rank, shuffle=True, seed=3, even_batches=even)
        sampler.set_epoch(2)
        assert rank_positions(sampler, 0) == list(iter(sampler)), (even, world, rank)
    plain = DistributedSampler(Ids(7), num_replicas=4, rank=3, shuffle=False)  # padding beyond the dataset
    assert rank_positions(plain, 0) == list(iter(plain))


def test_a_state_of_the_older_form_counts_batches_times_batch_size_times_world_size() -> None:
    old = ranks(40, 2, 5)
    first = consume(old, 3)
    state = {k: v for k, v in old[0].state_dict().items() if k not in ("samples_consumed", "dataset_size")}
    assert state["batches_consumed"] == 3 and state["world_size"] == 2 and state["batch_size"] == 5
    new = ranks(40, 3, 2)
    for loader in new:
        loader.load_state_dict(state)
    assert new[0].state_dict()["samples_consumed"] == 30
    assert sorted(first + rest_of_pass(new)) == list(range(40))


def test_resumed_pass_counts_batches_left_and_saves_its_position_again() -> None:
    old = ranks(53, 3, 3)
    consume(old, 2)  # 18 of 53 done
    new = ranks(53, 2, 4)
    for loader in new:
        loader.load_state_dict(old[0].state_dict())
    rest_per_rank = math.ceil((53 - 18) / 2)
    loader = new[0]
    assert loader.batches_per_rank() == [math.ceil(rest_per_rank / 4)] * 2
    it = iter(loader)
    next(it)
    assert len(loader) - loader.batches_consumed + 1 == math.ceil(rest_per_rank / 4)  # batches left, this included
    assert loader.state_dict()["samples_consumed"] == 18 + 8  # a second switch starts from here
    third = ranks(53, 4, 1)
    third[1].load_state_dict(loader.state_dict())
    assert [int(b[0]) for b in third[1]][:2] == [int(i) for i in rank_positions(third[1].shard_sampler, 26)[:2]]


def test_a_mid_epoch_state_of_another_dataset_size_is_refused() -> None:
    old = ranks(40, 2, 5)
    consume(old, 1)
    new = ranks(41, 2, 5)
    with pytest.raises(CheckpointError, match="dataset of 40 samples; this one has 41"):
        new[0].load_state_dict(old[0].state_dict())


def test_with_loader_workers_the_rest_arrives_whole() -> None:
    old = ranks(24, 2, 3)
    first = consume(old, 1)
    new = ranks(24, 3, 2, workers=2)
    for loader in new:
        loader.load_state_dict(old[0].state_dict())
    assert sorted(first + rest_of_pass(new)) == list(range(24))


def test_a_users_distributed_sampler_loader_is_resharded_and_resumes_at_another_size() -> None:
    from torch.utils.data import DataLoader

    def job(world: int) -> list[DeviceLoader]:
        out = []
        for rank in range(world):
            given = DataLoader(Ids(30), batch_size=3,
                               sampler=DistributedSampler(Ids(30), num_replicas=world, rank=rank, shuffle=True))
            place = LoaderPlace(CPU, CPUAccelerator(), rank=rank, world_size=world, local_world_size=world, seed=5)
            out.append(build_loader(given, place, LoaderRequest.of(num_workers=0)))
        return out

    old = job(2)
    first = consume(old, 2)
    new = job(3)
    for loader in new:
        assert loader.shard_sampler is not None  # gpukit's own shard of the same dataset, so its position is known
        loader.load_state_dict(old[0].state_dict())
    assert sorted(first + rest_of_pass(new)) == list(range(30))
