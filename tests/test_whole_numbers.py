"""Digits gpukit reads from files and environments: '²' is a digit to str.isdigit() but not to
int(), and int() refuses thousands of digits -- neither may end in a traceback."""

from __future__ import annotations

import pytest

from gpukit._util.units import whole_number
from gpukit.checkpoint._inspect import _tensor_entries
from gpukit.checkpoint._keys import group_keys
from gpukit.cluster._slurm import shared_gpu_problem
from gpukit.devices._env import _entry
from gpukit.errors import ConfigurationError

HOSTILE = ["²", "1²", "٣", "9" * 5000, "-1", "+1", "1_000", " ", ""]


@pytest.mark.parametrize("text", HOSTILE)
def test_only_short_ascii_digit_runs_are_numbers(text: str) -> None:
    assert whole_number(text) is None


def test_numbers() -> None:
    assert [whole_number(t) for t in ("0", " 42 ", "007", "9" * 18)] == [0, 42, 7, int("9" * 18)]


def test_hostile_key_parts_fold_as_names() -> None:
    keys = [f"layers.{i}.weight" for i in range(50)] + [f"layers.{p}.weight" for p in HOSTILE]
    lines = group_keys(keys)
    assert any("layers.{0..49}.weight" in line for line in lines), lines
    tensors = [(key, [2], "float32", "cpu") for key in keys]
    entries = _tensor_entries(tensors)  # more than the listing limit: numbered keys are grouped
    assert sum(e["count"] for e in entries) == len(keys)
    assert any(e["count"] == 50 for e in entries)


@pytest.mark.parametrize("value", ["²", "9" * 5000])
def test_slurm_gpus_on_node_that_is_no_number_is_ignored(value: str) -> None:
    env = {"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": value}
    assert shared_gpu_problem(4, 1, env) is None
    assert shared_gpu_problem(4, 1, {**env, "SLURM_GPUS_ON_NODE": "1"}) is not None


@pytest.mark.parametrize("value", ["²", "9" * 5000])
def test_a_gpu_given_as_odd_digits_is_a_clear_error(value: str) -> None:
    with pytest.raises(ConfigurationError, match="give an index as nvidia-smi shows it"):
        _entry(value, units=None)
