"""SLURM's host-list grammar, checked against what `scontrol show hostnames` prints."""

from __future__ import annotations

import pytest

from gpukit.cluster import parse_nodelist
from gpukit.errors import ConfigurationError


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("n[1-3,7],gpu-[01-02]", ["n1", "n2", "n3", "n7", "gpu-01", "gpu-02"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        ("rack[1-2]n[001-002].cluster", ["rack1n001.cluster", "rack1n002.cluster",
                                         "rack2n001.cluster", "rack2n002.cluster"]),
        ("x[5],y,z[0-1]", ["x5", "y", "z0", "z1"]),
        (" n[1-2] ", ["n1", "n2"]),
    ],
)
def test_expands_like_scontrol(text: str, hosts: list[str]) -> None:
    assert parse_nodelist(text) == hosts


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("n[1-3", "never closed"),
        ("n1-3]", "without '['"),
        ("n[1-[2]]", "nested"),
        ("n[3-1]", "backwards"),
        ("n[a-b]", "neither a number"),
        ("n[]", "empty '[]'"),
        ("n1,,n2", "empty entry"),
    ],
)
def test_malformed_lists_say_what_and_how(text: str, why: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_nodelist(text)
    message = str(info.value)
    assert why in message and repr(text) in message and "scontrol show hostnames" in message
