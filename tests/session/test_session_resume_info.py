"""Resume says what it did and gives back what was saved (issue 28, item 6)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpukit


def _run(directory, *, save_at: int | None, verbose: bool = True):
    session = gpukit.Session(accelerator="cpu", seed=0, verbose=verbose)
    model = nn.Linear(3, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = session.setup_dataloader(TensorDataset(torch.randn(20, 3), torch.randn(20, 1)), batch_size=4)
    step = session.resume(directory, model=model, optimizer=optimizer, loader=loader) or 0
    for _epoch in range(3):
        for x, y in loader:
            session.backward(nn.functional.mse_loss(model(x), y))
            session.step(optimizer)
            step += 1
            if step == save_at:
                session.save_checkpoint(directory, step, extra={"best_val_loss": 0.125, "iter_num": step},
                                        model=model, optimizer=optimizer, loader=loader)
                return session
    return session


def test_resume_gives_back_the_extras_and_says_where_from(tmp_path, capsys) -> None:
    _run(tmp_path, save_at=7, verbose=False)  # epoch 1 (5 batches an epoch), 2 batches into it
    capsys.readouterr()
    session = gpukit.Session(accelerator="cpu", seed=0, verbose=True)
    model = nn.Linear(3, 1)
    loader = session.setup_dataloader(TensorDataset(torch.randn(20, 3), torch.randn(20, 1)), batch_size=4)
    assert session.resume(tmp_path, model=model, loader=loader) == 7
    info = session.resumed
    assert info.extra == {"best_val_loss": 0.125, "iter_num": 7}
    assert (info.step, info.epoch, info.batch) == (7, 1, 2)
    assert info.path == tmp_path / "step_00000007"
    err = capsys.readouterr().err
    assert f"gpukit: resumed from {tmp_path / 'step_00000007'} (step 7; loader at epoch 1, batch 2)" in err


def test_nothing_to_resume_says_so_and_leaves_resumed_empty(tmp_path, capsys) -> None:
    session = gpukit.Session(accelerator="cpu", verbose=True)
    assert session.resume(tmp_path / "ckpt", model=nn.Linear(2, 2)) is None
    assert session.resumed is None
    assert f"gpukit: no checkpoint in {tmp_path / 'ckpt'} yet; starting from the beginning" in capsys.readouterr().err


def test_quiet_session_resumes_without_a_line(tmp_path, capsys) -> None:
    _run(tmp_path, save_at=3, verbose=False)
    capsys.readouterr()
    session = gpukit.Session(accelerator="cpu", verbose=False)
    assert session.resume(tmp_path, model=nn.Linear(3, 1)) == 3
    assert session.resumed.extra["best_val_loss"] == 0.125 and session.resumed.epoch is None
    assert "resumed" not in capsys.readouterr().err
