"""gpukit.layout: how a job is parallel, and the one registry of strategy names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import gpukit
from gpukit.errors import ConfigurationError
from gpukit.layout import (REGISTRY, Layout, StrategyEntry, plan_layout, plan_name_of, plan_names,
                           register_strategy, session_arguments, strategy_names)
from gpukit.strategies import select_strategy

SRC = Path(__file__).resolve().parents[1] / "src" / "gpukit"


def test_data_parallel_coordinates_put_tensor_innermost() -> None:
    layout = Layout(shards=2, tensor=2)  # world 4 = 2 x 2
    assert (layout.devices, layout.processes, layout.data_parallel_size) == (4, 4, 2)
    # ranks 0,1 form the first tensor group: one batch between them
    assert [layout.data_parallel_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.tensor_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert layout.describe() == "2 shards x 2 tensor"


def test_one_process_layouts_load_one_shard_of_data() -> None:
    for layout in (Layout(replicas=4, one_process=True), Layout(stages=3, one_process=True)):
        assert layout.processes == 1 and layout.data_parallel_size == 1 and layout.data_parallel_rank(0) == 0
    assert Layout().describe() == "1 device" and Layout(shards=2, offload=True).describe() == "2 shards, offloaded"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_degree_that_is_no_whole_number_is_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"Layout\(tensor=.*whole number >= 1"):
        Layout(tensor=bad)  # type: ignore[arg-type]


def test_every_strategy_exposes_its_layout() -> None:
    assert select_strategy("cpu", "single", "cpu").layout == Layout()
    assert select_strategy(["cpu", "cpu"], "pipeline").layout == Layout(stages=2, one_process=True)
    fsdp = gpukit.strategies.FSDPStrategy(cpu_offload=True).bind(
        gpukit.accelerators.get_accelerator("cpu"), torch.device("cpu"), None, 1)
    assert fsdp.layout == Layout(offload=True)
    ddp = select_strategy("cpu", "ddp", "cpu")
    assert (ddp.layout, ddp.data_parallel_rank, ddp.data_parallel_size) == (Layout(), 0, 1)


def test_the_planner_names_and_session_lines_come_from_the_registry() -> None:
    assert plan_names() == ("single", "ddp", "fsdp", "fsdp-offload", "pipeline")
    for label in plan_names():
        assert plan_name_of(plan_layout(label, 4)) == label
    assert session_arguments(plan_layout("ddp", 2)) == ["devices=2", "strategy='ddp'"]
    assert session_arguments(plan_layout("fsdp-offload", 2)) == [
        "devices=2", "strategy=gpukit.strategies.FSDPStrategy(cpu_offload=True)"]
    assert session_arguments(plan_layout("pipeline", 2)) == [
        "strategy=gpukit.strategies.PipelineStrategy(list(range(2)), chunks=8)"]
    assert session_arguments(Layout(tensor=2)) == ["devices=2", "tensor_parallel=2"]  # tensor groups: written too
    assert session_arguments(plan_layout("fsdp+tp2", 4)) == ["devices=4", "strategy='fsdp'", "tensor_parallel=2"]
    # one group, offloaded: the offload is written too (it was dropped, and the line ran without it)
    assert session_arguments(plan_layout("fsdp-offload+tp2", 2)) == [
        "devices=2", "strategy=gpukit.strategies.FSDPStrategy(cpu_offload=True)", "tensor_parallel=2"]
    assert session_arguments(plan_layout("fsdp-offload+tp2", 4)) == [
        "devices=4", "strategy=gpukit.strategies.FSDPStrategy(cpu_offload=True)", "tensor_parallel=2"]
    with pytest.raises(ConfigurationError, match="no registered strategy runs the layout '2 replicas x 2 shards'"):
        session_arguments(Layout(replicas=2, shards=2))


def test_no_second_list_of_strategy_names_in_the_source() -> None:
    # the registry is the one list: a tuple or list literal naming two strategies elsewhere is a second copy
    pattern = re.compile(r"""[(\[]\s*["'](single|ddp|fsdp|dp|pipeline)["']\s*,\s*["'](single|ddp|fsdp|dp|pipeline|fsdp-offload)["']""")
    found = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py") if path.name != "layout.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


@pytest.fixture()
def toy(monkeypatch: pytest.MonkeyPatch) -> StrategyEntry:
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "strategies"))
    monkeypatch.setattr("gpukit.layout.REGISTRY", dict(REGISTRY))  # the registration ends with the test
    # the one registry line a new strategy needs
    return register_strategy(StrategyEntry("toy", "toy_strategy:ToyStrategy", "one-device", summary="a test"))


def test_a_strategy_added_in_one_file_plus_one_registry_line_trains(toy: StrategyEntry) -> None:
    assert "toy" in strategy_names()
    session = gpukit.Session(accelerator="cpu", strategy="toy", verbose=False)
    model = torch.nn.Linear(4, 2)
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(session.strategy).__name__ == "ToyStrategy" and session.strategy.modules_set_up == 1
    before = model.weight.detach().clone()
    session.backward(model(torch.randn(3, 4)).sum())
    session.step(opt)
    assert not torch.equal(before, model.weight)
    with pytest.raises(ConfigurationError, match="choose one of 'auto', 'single', .*'toy'"):
        select_strategy("cpu", "toys", "cpu")


def test_a_bad_registry_entry_is_refused(toy: StrategyEntry) -> None:
    with pytest.raises(ConfigurationError, match="'toy' is taken"):
        register_strategy(StrategyEntry("toy", "x:Y", "one-device"))
    with pytest.raises(ConfigurationError, match="placement='everywhere'"):
        StrategyEntry("odd", "x:Y", "everywhere")
    register_strategy(StrategyEntry("broken", "toy_strategy:NoSuchClass", "one-device"))
    with pytest.raises(ConfigurationError, match="strategy 'broken': cannot import 'toy_strategy:NoSuchClass'"):
        select_strategy("cpu", "broken", "cpu")
