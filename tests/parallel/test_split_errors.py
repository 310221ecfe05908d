"""Bad input to split / the pipeline strategy: one clear error, before anything runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpukit.errors import ConfigurationError, DeviceError
from gpukit.parallel import split
from gpukit.strategies import PipelineStrategy, select_strategy

from parallel_models import TinyTransformer, mlp


def test_more_stages_than_layers() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ConfigurationError, match=r"3 devices, so 3 stages.*only 2 layer\(s\).*at most 2 devices"):
        split(model, ["cpu"] * 3, verbose=False)


@pytest.mark.parametrize(
    ("balance", "message"),
    [
        ([3, 3], r"sums to 6, but the model has 7 layers"),
        ([7], r"gives 1 stage\(s\) but 2 device\(s\)"),
        ([0, 7], r"at least one layer"),
        ("3,4", r"list of layer counts"),
    ],
)
def test_balance_that_does_not_fit(balance: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        split(mlp(), ["cpu", "cpu"], balance=balance, verbose=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [0, -1, 2.0, True])
def test_chunks_must_be_a_positive_int(chunks: object) -> None:
    with pytest.raises(ConfigurationError, match=r"chunks=.*int >= 1"):
        split(mlp(), ["cpu", "cpu"], chunks=chunks, verbose=False)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"chunks=.*int >= 1"):
        PipelineStrategy(["cpu", "cpu"], chunks=chunks)  # type: ignore[arg-type]


def test_batch_smaller_than_chunks_is_explained_at_run_time() -> None:
    model = split(mlp(), ["cpu", "cpu"], chunks=4, verbose=False)
    with pytest.raises(ConfigurationError, match=r"at least 4 samples.*this batch has 3.*drop_last=True"):
        model(torch.randn(3, 12))


def test_devices_that_are_not_here() -> None:
    model = mlp()
    with pytest.raises(DeviceError, match="cuda"):
        split(model, ["cpu", "cuda:1"], verbose=False)
    with pytest.raises(ConfigurationError, match="one device per stage"):
        split(model, "cpu", verbose=False)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="none is visible"):
        select_strategy(devices=2, strategy="pipeline", environ={})


def test_a_custom_model_needs_named_layers_that_exist_and_cover_it() -> None:
    model = TinyTransformer()
    with pytest.raises(ConfigurationError, match=r"not an nn.Sequential.*layers=\["):
        split(model, ["cpu", "cpu"], verbose=False)
    with pytest.raises(ConfigurationError, match=r"no sub-module 'decoder'.*'embed', 'blocks', 'head'"):
        split(model, ["cpu", "cpu"], layers=["embed", "decoder"], verbose=False)
    with pytest.raises(ConfigurationError, match=r"'head\.weight'.*never be used"):
        split(model, ["cpu", "cpu"], layers=["embed", "blocks"], verbose=False)
    with pytest.raises(ConfigurationError, match="overlap"):
        split(model, ["cpu", "cpu"], layers=["embed", "blocks", "blocks.1", "head"], verbose=False)


def test_pipeline_strategy_refuses_several_processes() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ConfigurationError, match="one process"):
        select_strategy(devices=["cpu", "cpu"], strategy="pipeline", environ=env)
    with pytest.raises(ConfigurationError, match="accelerator is 'cuda'"):
        select_strategy(devices=["cpu", "cpu"], strategy="pipeline", accelerator="cuda", environ={})


def test_tied_parameters_across_stages_are_refused_before_moving() -> None:
    model = TinyTransformer()
    model.head.weight = model.embed.weight  # tied input/output embedding
    with pytest.raises(ConfigurationError, match=r"'head\.weight' \(stage 1\).*same tied parameter"):
        split(model, ["cpu", "cpu"], balance=[2, 3], layers=["embed", "blocks", "head"], verbose=False)
    # both users in one stage is fine
    split(model, ["cpu"], layers=["embed", "blocks", "head"], verbose=False)


class _Residual(nn.Module):
    """A forward that does more than chain its layers: x + head(body(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.head(self.body(x))


def test_layers_that_do_not_reproduce_a_custom_forward_are_refused_or_warned() -> None:
    import gpukit.parallel._forward_check as forward_check

    with pytest.raises(ConfigurationError, match=r"differ by up to .*_Residual.forward.*residual connections"):
        split(_Residual(), ["cpu", "cpu"], layers=["body", "head"], example_input=torch.empty(3, 4, device="meta"),
              verbose=False)
    forward_check._WARNED.discard(_Residual)
    with pytest.warns(UserWarning, match=r"replaces _Residual.forward.*example_input") as caught:
        split(_Residual(), ["cpu", "cpu"], layers=["body", "head"], verbose=False)
        split(_Residual(), ["cpu", "cpu"], layers=["body", "head"], verbose=False)
    assert sum("replaces _Residual.forward" in str(w.message) for w in caught) == 1  # once
    chain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    split(chain, ["cpu", "cpu"], layers=["0", "1"], example_input=torch.empty(3, 4), verbose=False)  # agrees: fine
