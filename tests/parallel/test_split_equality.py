"""A split model computes what the unsplit model computes: forward, loss, gradients, step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpukit
from gpukit.strategies import PipelineStrategy
from gpukit.parallel import SplitModel, split

from parallel_models import TinyTransformer, mlp


def _train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = model(x)
    loss = F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return out.detach(), loss.detach(), grads


def _assert_same_step(split_model: nn.Module, plain: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """One training step of each gives the same output, loss and gradients."""
    out_ref, loss_ref, grads_ref = _train_step(plain, x, y)
    out, loss, grads = _train_step(split_model, x, y)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(loss, loss_ref)
    assert len(grads) == len(grads_ref)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("chunks", [1, 4])
def test_sequential_split_equals_unsplit(chunks: int) -> None:
    plain, model = mlp(), mlp()
    x, y = torch.randn(10, 12), torch.randint(0, 5, (10,))  # 10 samples: micro-batches 3,3,2,2
    split_model = split(model, ["cpu", "cpu", "cpu"], chunks=chunks, verbose=False)
    assert len(split_model.stages) == 3 and split_model.chunks == chunks
    _assert_same_step(split_model, plain, x, y)
    for got, want in zip(model.parameters(), plain.parameters()):  # after one Adam step
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("chunks", [1, 4])
def test_named_layers_of_a_custom_model_equal_its_forward(chunks: int) -> None:
    torch.manual_seed(0)
    plain = TinyTransformer()
    model = copy.deepcopy(plain)
    tokens, targets = torch.randint(0, 17, (8, 6)), torch.randint(0, 17, (8, 6))
    # "blocks" is a ModuleList: it counts as its three blocks, so 5 layers over 2 stages
    split_model = split(model, ["cpu", "cpu"], balance=[2, 3], chunks=chunks,
                        layers=["embed", "blocks", "head"], verbose=False)
    assert split_model.stages[0].names == ["embed", "blocks.0"]
    _assert_same_step(split_model, plain, tokens, targets)


def test_nested_input_and_output_are_cut_and_joined() -> None:
    class Pair(nn.Module):
        def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = xy
            return x * 2, y + x.sum(dim=1, keepdim=True)

    model = nn.Sequential(Pair(), Pair())
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    want = model((x, y))
    got = split(model, ["cpu", "cpu"], chunks=3, verbose=False)((x, y))
    torch.testing.assert_close(got, want)


def test_state_dict_has_plain_keys_and_round_trips(tmp_path) -> None:
    plain = mlp(seed=1)
    split_model = split(mlp(seed=2), ["cpu", "cpu"], chunks=2, verbose=False)
    assert list(split_model.state_dict()) == list(plain.state_dict())
    assert gpukit.unwrap_model(split_model) is split_model.module
    # split -> file -> plain model
    gpukit.save(split_model, tmp_path / "split.pt")
    fresh = mlp(seed=3)
    gpukit.load_state_dict(fresh, gpukit.load(tmp_path / "split.pt"))
    for a, b in zip(fresh.state_dict().values(), split_model.state_dict().values()):
        torch.testing.assert_close(a, b)
    # plain -> split (torch's own loader and gpukit's)
    split_model.load_state_dict(plain.state_dict())
    gpukit.load_state_dict(split_model, {f"module.{k}": v for k, v in plain.state_dict().items()})
    x = torch.randn(4, 12)
    torch.testing.assert_close(split_model(x), plain(x))


def test_session_pipeline_strategy_trains_like_a_plain_loop() -> None:
    plain, model = mlp(), mlp()
    session = gpukit.Session(strategy=PipelineStrategy(["cpu", "cpu"], chunks=2, verbose=False),
                             verbose=False)
    assert session.strategy.name == "pipeline"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    split_model, optimizer = session.setup(model, optimizer)
    assert isinstance(split_model, SplitModel)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(2):
        x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
        session.backward(F.cross_entropy(split_model(x), y))
        session.step(optimizer, clip_grad_norm=0.5)
        F.cross_entropy(plain(x), y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        plain_opt.step()
        plain_opt.zero_grad()
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got, want)


def test_placement_is_printed_with_planned_memory(capsys: pytest.CaptureFixture[str]) -> None:
    split(mlp(), ["cpu", "cpu"], example_input=torch.randn(64, 12))
    err = capsys.readouterr().err
    assert "split into 2 stages" in err and "balanced by planned memory" in err
    lines = [line.split() for line in err.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [line[1] for line in lines] == ["cpu", "cpu"]
    assert all(line[-1].endswith("iB") for line in lines)  # a planned size per stage


def test_true_precision_hooks_run_around_the_pipeline() -> None:
    """bf16-true casts the input in and the output back with hooks on the plain model."""
    x = torch.randn(8, 12)
    outs = []
    for strategy in ("single", PipelineStrategy(["cpu", "cpu"], chunks=2, verbose=False)):
        session = gpukit.Session(devices="cpu", strategy=strategy, precision="bf16-true", verbose=False)
        model = session.setup(mlp())
        outs.append(model(x))
        assert next(model.parameters()).dtype == torch.bfloat16
    assert outs[1].dtype == outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)


def test_pipeline_by_name_with_cpu_stages() -> None:
    session = gpukit.Session(strategy="pipeline", devices=["cpu", "cpu"], verbose=False)
    assert isinstance(session.strategy, PipelineStrategy) and session.strategy.chunks == 1
    assert session.device == torch.device("cpu") and session.world_size == 1
    model = session.setup(mlp())
    # weighed by parameter bytes 1664, 0, 4224, 0, 4224, 0, 660: the best cut is 5888 / 4884
    assert [len(stage.names) for stage in model.stages] == [3, 4]
