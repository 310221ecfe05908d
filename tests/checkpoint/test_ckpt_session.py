"""Session.save_checkpoint / Session.resume: exact mid-epoch resume, one process and DDP."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpukit
from gpukit.errors import LaunchError

TOTAL_STEPS = 12
STOP_AT = 7  # mid-epoch: 5 batches per epoch in one process, 3 per rank under 2-process DDP


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    return TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))


def _train(session, directory: str, *, stop_at: int | None, resume: bool, kill: bool = False,
           background: bool = False):
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_dataloader(_dataset(), batch_size=8, shuffle=True)
    objects = dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    step = (session.resume(directory, **objects) or 0) if resume else 0
    while step < TOTAL_STEPS:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            session.backward(loss)
            session.step(optimizer)
            scheduler.step()
            step += 1
            if step == stop_at and background:  # training goes on while the save writes
                session.save_checkpoint(directory, step, background=True, **objects)
            elif background and kill and step == stop_at + 2:
                gpukit.checkpoint.wait_for_saves()
                session.barrier()
                os.kill(os.getpid(), signal.SIGKILL)  # two steps past the save, as in a crash
            elif step == stop_at:
                session.save_checkpoint(directory, step, **objects)
                if kill:
                    session.barrier()
                    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, as in a crash
                return None
            if step == TOTAL_STEPS:
                break
    module = gpukit.unwrap_model(model)
    return {
        "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizer": optimizer.state_dict(),
    }


def _assert_identical(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key
    for pid, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            other = b["optimizer"]["state"][pid][name]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (pid, name)


def test_single_process_resume_is_bit_identical(tmp_path) -> None:
    straight = _train(gpukit.Session(accelerator="cpu", seed=0, verbose=False), str(tmp_path / "a"),
                      stop_at=None, resume=False)
    assert _train(gpukit.Session(accelerator="cpu", seed=0, verbose=False), str(tmp_path / "b"),
                  stop_at=STOP_AT, resume=False) is None
    # a fresh session, model and optimizer, as after a restart
    resumed = _train(gpukit.Session(accelerator="cpu", seed=0, verbose=False), str(tmp_path / "b"),
                     stop_at=None, resume=True)
    _assert_identical(straight, resumed)
    assert gpukit.CheckpointManager(tmp_path / "b").latest().name == f"step_{STOP_AT:08d}"


def test_background_save_resumes_bit_identical_while_training_went_on(tmp_path) -> None:
    straight = _train(gpukit.Session(accelerator="cpu", seed=0, verbose=False), str(tmp_path / "a"),
                      stop_at=None, resume=False)
    session = gpukit.Session(accelerator="cpu", seed=0, verbose=False)
    after = _train(session, str(tmp_path / "b"), stop_at=STOP_AT, resume=False, background=True)
    session.close()  # waits for the save
    _assert_identical(straight, after)  # saving in the background changed nothing in training
    resumed = _train(gpukit.Session(accelerator="cpu", seed=0, verbose=False), str(tmp_path / "b"),
                     stop_at=None, resume=True)
    _assert_identical(straight, resumed)


def test_resume_with_empty_directory_starts_fresh(tmp_path) -> None:
    session = gpukit.Session(accelerator="cpu", seed=0, verbose=False)
    model = nn.Linear(2, 2)
    assert session.resume(tmp_path / "none-yet", model=model) is None


def _ddp_job(directory: str, stop_at: int | None, resume: bool, kill: bool, background: bool = False):
    session = gpukit.Session(accelerator="cpu", seed=0, verbose=False)
    return _train(session, directory, stop_at=stop_at, resume=resume, kill=kill, background=background)


@pytest.fixture(scope="module")
def ddp_straight(tmp_path_factory: pytest.TempPathFactory) -> list:
    """Each rank's result of the 2-process DDP job trained uninterrupted (one launch for both tests)."""
    from gpukit.launch import launch_function

    directory = tmp_path_factory.mktemp("ddp-straight")
    return launch_function(_ddp_job, (str(directory), None, False, False), nproc=2, cpu=True, echo=None)


@pytest.mark.slow
# make test: the background save (the plain one is test_ckpt_resume's two-process SIGKILL test)
@pytest.mark.parametrize("background", [pytest.param(False, marks=pytest.mark.extended), True])
def test_two_process_ddp_resume_after_sigkill_is_bit_identical(tmp_path, ddp_straight: list, background: bool) -> None:
    """With ``background``, both ranks train two more steps while the save writes, then die."""
    from gpukit.launch import launch_function

    straight = ddp_straight
    with pytest.raises(LaunchError):
        launch_function(_ddp_job, (str(tmp_path / "b"), STOP_AT, False, True, background), nproc=2, cpu=True,
                        echo=None)
    assert gpukit.CheckpointManager(tmp_path / "b").latest().name == f"step_{STOP_AT:08d}"
    resumed = launch_function(_ddp_job, (str(tmp_path / "b"), None, True, False), nproc=2, cpu=True, echo=None)
    for rank in (0, 1):
        _assert_identical(straight[rank], resumed[rank])
    _assert_identical(resumed[0], resumed[1])  # DDP kept the replicas equal
