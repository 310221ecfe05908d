"""split on two GPUs: placement on cuda:0/cuda:1 and equality with the unsplit model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

import gpukit
from gpukit.parallel import split

from parallel_models import mlp


@pytest.mark.parametrize("last", [pytest.param(0, marks=pytest.mark.requires_gpu),  # both stages on one GPU
                                  pytest.param(1, marks=pytest.mark.requires_gpus(2))])
@pytest.mark.parametrize("chunks", [1, 4])
def test_gpu_split_places_stages_and_equals_unsplit(chunks: int, last: int) -> None:
    plain = mlp().to("cuda:0")
    model = split(copy.deepcopy(plain).cpu(), ["cuda:0", f"cuda:{last}"], balance=[3, 4], chunks=chunks, verbose=False)
    layers = list(model.module)
    assert {p.device for m in layers[:3] for p in m.parameters()} == {torch.device("cuda", 0)}
    assert {p.device for m in layers[3:] for p in m.parameters()} == {torch.device("cuda", last)}
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,))  # input on the CPU: moved by the model
    out = model(x)
    assert out.device == torch.device("cuda", last)
    loss = F.cross_entropy(out, y.to(f"cuda:{last}"))
    loss.backward()
    loss_ref = F.cross_entropy(plain(x.to("cuda:0")), y.to("cuda:0"))
    loss_ref.backward()
    torch.testing.assert_close(loss.cpu(), loss_ref.cpu())
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad.cpu(), want.grad.cpu(), rtol=1e-4, atol=1e-5)


@pytest.mark.requires_gpus(2)
def test_session_pipeline_on_two_gpus_feeds_the_last_device() -> None:
    session = gpukit.Session(strategy="pipeline", devices=[0, 1], verbose=False)
    assert session.device == torch.device("cuda", 1)
    model = session.setup(mlp())
    assert next(model.module[0].parameters()).device == torch.device("cuda", 0)
    assert model(torch.randn(4, 12, device="cuda:1")).device == torch.device("cuda", 1)
