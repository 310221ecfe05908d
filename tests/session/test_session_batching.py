"""Global batch vs world size (issue 28, item 5): ``Session(global_batch_size=, micro_batch_size=)``
works the accumulation out for the world size; ``accumulate_grad_batches`` is settable between steps.
Per-rank seeding and the same-stream warning need several ranks: test_session_two_ranks.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpukit
from gpukit.errors import ConfigurationError
from gpukit.session._batching import plan_batches


@pytest.mark.parametrize(("world", "accumulate"), [(1, 40), (2, 20), (4, 10), (8, 5)])
def test_nanogpt_numbers_for_each_world_size(world: int, accumulate: int) -> None:
    # nanoGPT: 5 * 8 micro-batches of 12 = 480 samples per step, whatever the world size
    plan = plan_batches(480, 12, 1, world)
    assert (plan.accumulate_grad_batches, plan.micro_batch_size) == (accumulate, 12)


def test_session_global_batch_sets_accumulation_and_the_loaders_batch_size() -> None:
    session = gpukit.Session(accelerator="cpu", global_batch_size=16, micro_batch_size=4, verbose=False)
    assert (session.accumulate_grad_batches, session.micro_batch_size, session.global_batch_size) == (4, 4, 16)
    loader = session.setup_dataloader(torch.utils.data.TensorDataset(torch.arange(40)))
    assert loader.batch_size == 4 and len(loader) == 10
    assert session.setup_dataloader(torch.utils.data.TensorDataset(torch.arange(40)), batch_size=8).batch_size == 8


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(global_batch_size=16), "needs micro_batch_size= too"),
    (dict(global_batch_size=10, micro_batch_size=4), "Use global_batch_size=8 or 12"),
    (dict(global_batch_size=16, micro_batch_size=4, accumulate_grad_batches=2), "give one of them"),
    (dict(global_batch_size=0, micro_batch_size=4), "global_batch_size=0; use an int >= 1"),
    (dict(micro_batch_size=2.5), "micro_batch_size=2.5; use an int >= 1"),
])
def test_bad_batch_settings_say_what_to_use(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        gpukit.Session(accelerator="cpu", verbose=False, **kwargs)


def test_accumulation_is_settable_between_steps_and_refused_inside_a_window() -> None:
    session = gpukit.Session(accelerator="cpu", accumulate_grad_batches=2, verbose=False)
    model = nn.Linear(3, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    session.backward(model(torch.ones(1, 3)).sum())
    session.step(optimizer)
    with pytest.raises(ConfigurationError, match="1 micro-batch\\(es\\) of a window pending"):
        session.accumulate_grad_batches = 3
    session.backward(model(torch.ones(1, 3)).sum())
    assert session.step(optimizer) is True
    session.accumulate_grad_batches = 3
    stepped = []
    for _ in range(3):
        session.backward(model(torch.ones(1, 3)).sum())
        stepped.append(session.step(optimizer))
    assert stepped == [False, False, True]
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches=0"):
        session.accumulate_grad_batches = 0


def test_new_accumulation_applies_to_a_window_already_sized_by_a_backward() -> None:
    session = gpukit.Session(accelerator="cpu", verbose=False)
    model = nn.Linear(3, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    session.backward(model(torch.ones(1, 3)).sum())  # sizes the open window (1) without a step
    optimizer.zero_grad()
    session.accumulate_grad_batches = 4
    stepped = []
    for _ in range(4):
        session.backward(model(torch.ones(1, 3)).sum())
        stepped.append(session.step(optimizer))
    assert stepped == [False, False, False, True]


def test_a_resume_on_other_ranks_keeps_the_global_batch_through_the_accumulation() -> None:
    from gpukit.session._batching import rescale_accumulation

    assert rescale_accumulation(24, 6, 2, 2, 2) is None  # already keeps it
    grown = rescale_accumulation(24, 6, 2, 3, 2)  # 2 -> 3 ranks, micro-batches of 2
    assert grown is not None and (grown.accumulate_grad_batches, grown.exact) == (4, True)
    assert "accumulate_grad_batches 6 -> 4 keeps the global batch (24 samples per optimizer step)" in grown.line
    other_micro = rescale_accumulation(24, 6, 4, 3, 2)  # a resume with micro-batches of 4 keeps it too
    assert other_micro is not None and other_micro.accumulate_grad_batches == 2
    odd = rescale_accumulation(24, 3, 2, 5, 4)  # 24 samples over 5 ranks of 2: 2 each, 20 in all
    assert odd is not None and (odd.accumulate_grad_batches, odd.exact) == (2, False)
    assert "does not divide into micro-batches of 10" in odd.line and "makes it 20 samples" in odd.line
    assert rescale_accumulation(4, 1, 4, 8, 1).accumulate_grad_batches == 1  # type: ignore[union-attr]  # never below 1


def test_a_restarted_job_rounds_a_global_batch_that_does_not_divide_with_one_warning() -> None:
    from gpukit.session._batching import restarted_job

    with pytest.raises(ConfigurationError, match="not a whole number"):
        plan_batches(8, 2, 1, 3)  # a fresh launch: refused, with the nearest sizes
    with pytest.warns(UserWarning, match="accumulating 1 makes it 6 samples per optimizer step"):
        assert plan_batches(8, 2, 1, 3, restarted=True).accumulate_grad_batches == 1
    assert restarted_job({"TORCHELASTIC_RESTART_COUNT": "2"}) and restarted_job({"SLURM_RESTART_COUNT": "1"})
    assert not restarted_job({"TORCHELASTIC_RESTART_COUNT": "0"}) and not restarted_job({"SLURM_RESTART_COUNT": "x"})


@pytest.mark.parametrize(("saved", "micro", "after"), [
    # 4 ranks x micro 2 x 4 = 32 samples a step, 2 micro-batches (16 samples) of the window done; on 1 rank
    # of micro 2 that is 8 of 16 micro-batches: the step comes after 8 more, where the saved run's would
    (dict(data_parallel_size=4, accumulate_grad_batches=4, samples_per_step=32, in_window=2), 2, 8),
    (dict(data_parallel_size=4, accumulate_grad_batches=4, samples_per_step=32, in_window=3), 2, 4),
    # 3 ranks x micro 2 x 2 = 12 a step, 6 done; micro 4 on 1 rank: 3 a step, 6 samples are no whole
    # number of micro-batches of 4, so the window restarts (3 micro-batches)
    (dict(data_parallel_size=3, accumulate_grad_batches=2, samples_per_step=12, in_window=1), 4, 3),
])
@pytest.mark.parametrize("global_batch", [False, True])  # the accumulation rescaled, or the Session's own for the size
def test_a_resume_on_another_size_counts_the_open_window_in_its_own_micro_batches(
        saved: dict, micro: int, after: int, global_batch: bool) -> None:
    kwargs = dict(global_batch_size=saved["samples_per_step"]) if global_batch else {}
    session = gpukit.Session(accelerator="cpu", micro_batch_size=micro, verbose=False, **kwargs)
    model = nn.Linear(3, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = session.state_dict()
    state.update(micro_step=saved["accumulate_grad_batches"] + saved["in_window"], optimizer_steps=1, **saved)
    session.load_state_dict(state)
    stepped = []
    for _ in range(after):
        session.backward(model(torch.ones(1, 3)).sum())
        stepped.append(session.step(optimizer))
    assert stepped == [False] * (after - 1) + [True]
