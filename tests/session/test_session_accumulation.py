"""Accumulation at the loader's end (issue 28, item 3), against the plain-torch loop.

10 micro-batches with ``accumulate_grad_batches=4``: windows of 4, 4 and 2 -- three optimizer steps,
as Accelerate and Lightning make -- with the last window's losses divided by 2, its real size.
``step_at_loader_end=False`` keeps the old carry-over; iterables gpukit does not own warn when they
end with gradients pending.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import gpukit
from gpukit.session._steps import PendingGradientsWarning

N, BATCH, K = 40, 4, 4  # 10 batches per epoch


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randn(N, 1, generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def _gpukit(epochs: int, **options) -> tuple[nn.Module, list[bool]]:
    session = gpukit.Session(accelerator="cpu", precision="32-true", accumulate_grad_batches=K, verbose=False,
                             **options)
    model, optimizer = _setup(session)
    loader = session.setup_dataloader(_data(), batch_size=BATCH)
    stepped = []
    for _ in range(epochs):
        for x, y in loader:
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))
            stepped.append(session.step(optimizer))
    return gpukit.unwrap_model(model), stepped


def _setup(session: gpukit.Session):
    model = _model()
    return session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _plain(windows: list[list[int]]) -> nn.Module:
    """Plain torch: each window's micro-batches, each loss divided by the window's size, one step."""
    model, data = _model(), _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for window in windows:
        for b in window:
            x, y = data[b * BATCH:(b + 1) * BATCH]
            (nn.functional.mse_loss(model(x), y) / len(window)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _equal(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_ten_batches_with_four_per_step_make_three_steps_the_last_over_two() -> None:
    model, stepped = _gpukit(epochs=1)
    assert stepped == [False, False, False, True] * 2 + [False, True]
    _equal(model, _plain([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]))


def test_every_epoch_starts_a_fresh_window() -> None:
    model, stepped = _gpukit(epochs=2)
    assert sum(stepped) == 6
    windows = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    _equal(model, _plain(windows * 2))


def test_step_at_loader_end_false_carries_the_last_two_into_the_next_epoch() -> None:
    model, stepped = _gpukit(epochs=2, step_at_loader_end=False)
    assert sum(stepped) == 5  # 20 micro-batches / 4
    # the third window is batches 8, 9 of epoch 1 and 0, 1 of epoch 2, each divided by 4
    _equal(model, _plain([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]))


def test_a_plain_dataloader_through_session_progress_warns_about_pending_gradients() -> None:
    session = gpukit.Session(accelerator="cpu", accumulate_grad_batches=K, verbose=False)
    model, optimizer = _setup(session)
    plain = DataLoader(_data(), batch_size=BATCH)  # not set up by the session: its end is unknown
    with pytest.warns(PendingGradientsWarning, match="2 micro-batch\\(es\\) of an accumulation window of 4"):
        for x, y in session.progress(plain):
            session.backward(nn.functional.mse_loss(model(x), y))
            session.step(optimizer)
    assert session.optimizer_steps == 2


def test_a_gpukit_loader_ending_its_windows_gives_no_warning() -> None:
    session = gpukit.Session(accelerator="cpu", accumulate_grad_batches=K, verbose=False)
    model, optimizer = _setup(session)
    loader = session.setup_dataloader(_data(), batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingGradientsWarning)
        for x, y in session.progress(loader):
            session.backward(nn.functional.mse_loss(model(x), y))
            session.step(optimizer)
        session.close()
    assert session.optimizer_steps == 3


class _Stream(IterableDataset):
    def __iter__(self):
        data = _data()
        return iter(data[i] for i in range(N))


def test_an_iterable_dataset_loader_without_length_warns_at_its_end() -> None:
    session = gpukit.Session(accelerator="cpu", accumulate_grad_batches=K, verbose=False)
    model, optimizer = _setup(session)
    loader = session.setup_dataloader(_Stream(), batch_size=BATCH)
    with pytest.warns(PendingGradientsWarning, match="no len\\(\\)"):
        for x, y in loader:
            session.backward(nn.functional.mse_loss(model(x), y))
            session.step(optimizer)


def test_save_checkpoint_inside_a_window_warns(tmp_path) -> None:
    session = gpukit.Session(accelerator="cpu", accumulate_grad_batches=K, verbose=False)
    model, optimizer = _setup(session)
    loader = session.setup_dataloader(_data(), batch_size=BATCH)
    x, y = next(iter(loader))
    session.backward(nn.functional.mse_loss(model(x), y))
    session.step(optimizer)
    with pytest.warns(PendingGradientsWarning, match="save_checkpoint\\(step=1\\)"):
        session.save_checkpoint(tmp_path, 1, model=model)


def test_a_plain_dataloader_iterated_directly_warns_at_the_next_pass_first_step() -> None:
    """Issue 41.19: not at session.close(), but when the pending gradients meet the next pass."""
    import copy
    import pickle

    session = gpukit.Session(accelerator="cpu", accumulate_grad_batches=K, verbose=False)
    model, optimizer = _setup(session)
    train_loader = DataLoader(_data(), batch_size=BATCH)  # iterated directly: gpukit never sees its end
    val_loader = DataLoader(_data(), batch_size=BATCH)
    warned_at = []
    for epoch in range(2):
        for i, (x, y) in enumerate(train_loader):
            if epoch == 0 and i == 5:  # an evaluation mid-window (no_grad): not a training pass
                with torch.no_grad():
                    for vx, _ in val_loader:
                        model(vx)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                session.backward(nn.functional.mse_loss(model(x), y))
                session.step(optimizer)
            warned_at += [(epoch, i, str(w.message)) for w in caught if issubclass(w.category, PendingGradientsWarning)]
    assert [(e, i) for e, i, _ in warned_at] == [(1, 0)], warned_at
    assert "a new pass over the plain DataLoader `train_loader` began: 2 micro-batch(es)" in warned_at[0][2]
    assert type(train_loader).__name__ == "DataLoader" and isinstance(train_loader, DataLoader)
    assert type(copy.copy(train_loader)) is DataLoader  # copies and pickles are the user's class, unwatched
    assert type(pickle.loads(pickle.dumps(train_loader))) is DataLoader


def test_a_resume_inside_the_last_window_of_a_pass_ends_that_window_with_the_pass() -> None:
    # 7 batches with k=4: windows of 4 and 3. Saved after batch 5 (1 micro-batch of the window of 3 done),
    # the resumed run steps once, after batch 7, dividing each loss by 3 -- not after batch 6 (a window
    # sized by the 2 batches left) and again after batch 7
    def make() -> tuple:
        session = gpukit.Session(accelerator="cpu", accumulate_grad_batches=4, verbose=False)
        model = nn.Linear(1, 1)
        model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = session.setup_dataloader(TensorDataset(torch.ones(7, 1)), batch_size=1, num_workers=0)
        return session, model, optimizer, loader

    session, model, optimizer, loader = make()
    batches = iter(loader)
    stepped = []
    for _ in range(5):
        (x,) = next(batches)
        session.backward(model(x).sum())
        stepped.append(session.step(optimizer))
    assert stepped == [False, False, False, True, False]
    states = session.state_dict(), loader.state_dict()  # as a checkpoint holds them (the pending gradient is not)
    session, model, optimizer, loader = make()
    loader.load_state_dict(states[1])
    session.load_state_dict(states[0])
    stepped, bias_grads = [], []
    for (x,) in loader:
        session.backward(model(x).sum())
        bias_grads.append(float(gpukit.unwrap_model(model).bias.grad))  # type: ignore[union-attr]
        stepped.append(session.step(optimizer))
    assert stepped == [False, True]
    assert bias_grads == pytest.approx([1 / 3, 2 / 3])
