"""load_state_dict across wrappers and prefixes; mismatch errors people can read."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit
from gpukit.checkpoint import detect_prefixes, strip_wrapper_prefixes
from gpukit.checkpoint._keys import format_indices, group_keys
from gpukit.errors import ConfigurationError, StateDictMismatchError

from ckpt_helpers import SmallNet

_PREFIXES = ["", "module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module.", "module.module."]
_WRAPPERS = {
    "plain": lambda m: m,
    "dp": nn.DataParallel,
    "compiled": torch.compile,
    "compiled_dp": lambda m: torch.compile(nn.DataParallel(m)),
    "dp_compiled": lambda m: nn.DataParallel(torch.compile(m)),
}


@pytest.mark.parametrize(("prefix", "wrapper"), list(itertools.product(_PREFIXES, _WRAPPERS)))
def test_any_prefix_into_any_wrapper(small_net: SmallNet, prefix: str, wrapper: str) -> None:
    source = {prefix + k: v for k, v in small_net.state_dict().items()}
    target = _WRAPPERS[wrapper](SmallNet())
    result = gpukit.load_state_dict(target, source)
    assert not result.missing_keys and not result.unexpected_keys
    loaded = gpukit.unwrap_model(target).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in small_net.state_dict().items())


def test_compiled_submodule_and_submodule_called_module() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)  # a real submodule named "module": must not be stripped
            self.encoder = torch.compile(nn.Linear(2, 3))

    torch.manual_seed(1)
    source = Holder()
    assert "encoder._orig_mod.weight" in source.state_dict()
    target = Holder()
    gpukit.load_state_dict(nn.DataParallel(target), {"module." + k: v for k, v in source.state_dict().items()})
    assert torch.equal(target.module.weight, source.module.weight)
    assert torch.equal(target.encoder._orig_mod.weight, source.encoder._orig_mod.weight)
    assert list(strip_wrapper_prefixes(source.state_dict())) == [
        "module.weight", "module.bias", "encoder.weight", "encoder.bias"]


def test_mismatch_lists_grouped_keys_and_detected_prefix() -> None:
    class Deep(nn.Module):
        def __init__(self, layers: int, width: int) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
            self.head = nn.Linear(width, 3)

    saved = {"module." + k: v for k, v in Deep(12, 4).state_dict().items()}
    saved["module.extra.scale"] = torch.ones(1)
    with pytest.raises(StateDictMismatchError) as info:
        gpukit.load_state_dict(torch.compile(Deep(16, 8)), saved)
    message = str(info.value)
    assert "Deep (wrapped: OptimizedModule)" in message
    assert "'module.' (DataParallel/DistributedDataParallel) on 27 of 27 keys" in message
    assert "layers.{12..15}.{weight,bias}  (8 keys)" in message  # missing, grouped
    assert "extra.scale" in message  # unexpected
    assert "layers.{0..11}.weight: [4, 4] vs [8, 8]  (12 keys)" in message  # shapes, grouped
    assert message.count("\n") < 40  # shortened, not 50 lines of keys


def test_strict_false_loads_matching_keys_but_never_wrong_shapes(small_net: SmallNet) -> None:
    partial = {k: v for k, v in small_net.state_dict().items() if k.startswith("fc1.")}
    partial["module.unknown"] = torch.zeros(1)
    target = SmallNet()
    result = gpukit.load_state_dict(target, partial, strict=False)
    assert torch.equal(target.fc1.weight, small_net.fc1.weight)
    assert "fc2.weight" in result.missing_keys and "unknown" in result.unexpected_keys
    with pytest.raises(StateDictMismatchError, match="Shape mismatch"):
        gpukit.load_state_dict(target, {"fc1.weight": torch.zeros(1, 1)}, strict=False)


def test_wrong_architecture_from_file(tmp_path: Path, small_net: SmallNet) -> None:
    gpukit.save(small_net, tmp_path / "small.pt")
    other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(StateDictMismatchError) as info:
        gpukit.load_state_dict(other, gpukit.load(tmp_path / "small.pt"))
    assert "4 missing, 9 unexpected" in str(info.value)
    assert "  {0,1}.{weight,bias}  (4 keys)" in str(info.value)
    assert "  bn.{weight,bias,running_mean,running_var,num_batches_tracked}  (5 keys)" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # untouched


def test_a_path_is_read_straight_into_the_model_and_other_things_are_refused(tmp_path: Path) -> None:
    """load_state_dict(model, path) reads the file into the model (issue 27: was an error saying to
    gpukit.load it first); what is neither a mapping nor a path is still a clear error."""
    saved = SmallNet()
    path = tmp_path / "small.pt"
    gpukit.save(saved, path)
    for given in (str(path), path):
        model = SmallNet()
        assert not all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))
        gpukit.load_state_dict(model, given)
        assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))
    with pytest.raises(ConfigurationError, match="got a list"):
        gpukit.load_state_dict(SmallNet(), [1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("strict", [True, False])
def test_a_whole_training_state_suggests_its_model_entry(strict: bool) -> None:
    model = SmallNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}
    with pytest.raises(ConfigurationError, match=r"load_state_dict\(model, state\['model'\]\)") as info:
        gpukit.load_state_dict(SmallNet(), state, strict=strict)
    assert "'optimizer'" in str(info.value) and "'epoch'" in str(info.value)
    gpukit.load_state_dict(SmallNet(), state["model"])  # the suggestion works


def test_foreign_prefix_hint() -> None:
    saved = {"model." + k: v for k, v in SmallNet().state_dict().items()}  # e.g. Lightning
    with pytest.raises(StateDictMismatchError, match="every unexpected key starts with 'model.'"):
        gpukit.load_state_dict(SmallNet(), saved)


def test_key_grouping_helpers() -> None:
    assert format_indices([0, 1, 2, 3, 7]) == "{0..3,7}"
    assert format_indices([4]) == "4"
    keys = [f"blocks.{i}.attn.{p}" for i in range(24) for p in ("weight", "bias")] + ["norm.weight"]
    assert group_keys(keys) == ["blocks.{0..23}.attn.{weight,bias}  (48 keys)", "norm.weight"]
    many = [f"m{i}.w" for i in range(20)]
    assert group_keys(many, max_lines=3)[-1] == "... and 17 more key(s)"
    assert detect_prefixes(["module._orig_mod.a", "module.b"]) == [
        "'module.' (DataParallel/DistributedDataParallel) on 2 of 2 keys",
        "'_orig_mod.' inside 1 keys (compiled submodules)"]
