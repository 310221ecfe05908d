"""A pipeline session's checkpoint resumes into a split model and loads into the plain one."""

from __future__ import annotations

import torch
from torch.nn import functional as F

import gpukit
from gpukit.parallel import split
from gpukit.strategies import PipelineStrategy

from parallel_models import mlp


def _session_and_model(seed: int):
    session = gpukit.Session(strategy=PipelineStrategy(["cpu", "cpu"], chunks=2, verbose=False), verbose=False)
    model = mlp(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = session.setup(model, optimizer)
    return session, model, optimizer


def _step(session, model, optimizer, x, y) -> None:
    session.backward(F.cross_entropy(model(x), y))
    session.step(optimizer)


def test_resume_into_split_and_load_into_plain(tmp_path) -> None:
    batches = [(torch.randn(8, 12), torch.randint(0, 5, (8,))) for _ in range(3)]
    session, model, optimizer = _session_and_model(seed=0)
    _step(session, model, optimizer, *batches[0])
    session.save_checkpoint(tmp_path, step=1, model=model, optimizer=optimizer)

    resumed_session, resumed, resumed_opt = _session_and_model(seed=5)  # other weights
    assert resumed_session.resume(tmp_path, model=resumed, optimizer=resumed_opt) == 1
    for a, b in zip(resumed.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(a, b)
    for x, y in batches[1:]:
        _step(session, model, optimizer, x, y)
        _step(resumed_session, resumed, resumed_opt, x, y)
    for a, b in zip(resumed.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)

    plain = mlp(seed=7)
    assert gpukit.CheckpointManager(tmp_path).resume(model=plain, restore_rng=False) == 1
    x = batches[0][0]
    torch.testing.assert_close(plain(x), resumed_session_free_forward(tmp_path, x))


def resumed_session_free_forward(path, x: torch.Tensor) -> torch.Tensor:
    """The checkpoint's model, loaded by a split model outside any session."""
    model = split(mlp(seed=9), ["cpu", "cpu"], verbose=False)
    gpukit.CheckpointManager(path).resume(model=model, restore_rng=False)
    return model(x)
