"""SLURM's host-list grammar, checked against what `scontrol show hostnames` (SLURM 22.05) prints."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpukit.cluster import parse_nodelist
from gpukit.cluster._nodelist import MAX_HOSTS, count_nodelist
from gpukit.errors import ConfigurationError

SCRIPT = Path(__file__).resolve().parent / "scontrol_hostnames.sh"
SEED = int(os.environ.get("GPUKIT_NODELIST_SEED", "20261124"))
GENERATED = 400


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("n[1-3,7],gpu-[01-02]", ["n1", "n2", "n3", "n7", "gpu-01", "gpu-02"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        # three groups: SLURM varies the middle one slowest, the last fastest
        ("a[1-2]b[3-4]c[5-6]", ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]),
        ("x[5],y,z[0-1]", ["x5", "y", "z0", "z1"]),
        (" n[1-2] ", ["n1", "n2"]),
        ("n1 n2\tn3", ["n1", "n2", "n3"]),  # SLURM splits on spaces and tabs too
        ("n[ 1-2]", ["n01", "n02"]),  # the width is the low end's text, space included
        ("n1,,n2", ["n1", "n2"]),
        ("n[1-]", ["n1"]),
    ],
)
def test_expands_like_scontrol_22_05(text: str, hosts: list[str]) -> None:
    assert parse_nodelist(text) == hosts


def test_a_suffix_after_the_last_group_is_read_as_slurm_23_02_reads_it() -> None:
    # SLURM 22.05 says "Invalid hostlist" here; 23.02 added text after the last bracket group.
    assert parse_nodelist("rack[1-2]n[001-002].cluster") == [
        "rack1n001.cluster", "rack1n002.cluster", "rack2n001.cluster", "rack2n002.cluster"]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "names no host"),
        (" , ", "names no host"),
        ("n[1-3", "never closed"),
        ("n1-3]", "without '['"),
        ("n[1-[2]]", "nested"),
        ("n[3-1]", "backwards"),
        ("n[a-b]", "neither a number"),
        ("n[]", "neither a number"),
        ("n[1,,2]", "neither a number"),
        ("n[1-2 ]", "neither a number"),
        ("n[1-65537]", "at most 65,536 in one range"),
        ("n[1-999999999]", "at most 65,536 in one range"),
        ("n[1-9999999999999999999999999]", "above"),
        ("a[1-65536]b[1-65536]", f"at most {MAX_HOSTS:,}"),
        ("a[1-40000,1-40000]b[1]", "before the last"),
        ("n1\nn2", "control character"),
    ],
)
def test_malformed_or_huge_lists_say_what_and_how(text: str, why: str) -> None:
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as info:
        parse_nodelist(text)
    message = str(info.value)
    assert why in message and repr(text) in message and "scontrol show hostnames" in message
    assert time.monotonic() - started < 1.0  # counted before expanding: no hang, no MemoryError


def test_counts_without_expanding() -> None:
    assert count_nodelist("a[1-65536]b[1-65536]") == 65536**2
    assert count_nodelist("n[1-3,7],gpu-[01-02]") == 6


# -- generated lists against the real scontrol --------------------------------------------------

@pytest.fixture(scope="module")
def scontrol_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("scontrol")
    try:
        result = subprocess.run([str(SCRIPT), str(directory)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        result = None
    if result is None or result.returncode != 0:
        reason = "install timed out" if result is None else (result.stderr.strip().splitlines() or ["?"])[-1]
        print(f"\nscontrol comparison skipped: {reason}", file=sys.stderr)
        pytest.skip(f"no scontrol: {reason}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = result.stdout.strip()
    return env


def _scontrol(text: str, env: dict[str, str]) -> list[str] | None:
    """Hosts as scontrol prints them, ``None`` when it refuses the list."""
    out = subprocess.run(["scontrol", "show", "hostnames", text], env=env, capture_output=True, text=True,
                         timeout=30)
    if "Invalid hostlist" in out.stdout + out.stderr or out.returncode != 0:
        return None
    return out.stdout.split("\n")[:-1] if out.stdout else []


def _number(rng: random.Random) -> tuple[str, int]:
    value = rng.choice([0, 1, 2, 7, 9, 10, 99, 100, rng.randrange(1000)])
    text = str(value).zfill(rng.choice([1, 1, 1, 2, 3]))
    return rng.choice(["", "", "", " ", "+"]) + text, value


def _item(rng: random.Random, *, valid: bool) -> str:
    lo_text, lo = _number(rng)
    form = rng.random()
    if form < 0.35:
        return lo_text
    hi = lo + rng.randrange(0, 4)
    if not valid and rng.random() < 0.5:
        return rng.choice([f"{lo + 3}-{lo}", f"{lo}-{hi} ", f"{lo}x{hi}", "", f"-{hi}", f"{lo}--{hi}", "a-b"])
    return f"{lo_text}{rng.choice(['', '', ' '])}-{rng.choice(['', '', ' ', '+'])}{hi}" if form < 0.9 else f"{lo_text}-"


def _expression(rng: random.Random, *, valid: bool) -> str:
    # a first letter: scontrol would take a list starting with '-' for an option (so would a DNS name)
    name = rng.choice("abcnode") + "".join(rng.choice("abcnode-_.") for _ in range(rng.randrange(0, 4)))
    if rng.random() < 0.25:
        return name + rng.choice(["", "1", "07", "-x"])
    parts = [name]
    for i in range(rng.choice([1, 1, 2, 2, 3, 4])):
        if i:
            parts.append(rng.choice(["", "-", "x", "r", "0"]))
        parts.append("[" + ",".join(_item(rng, valid=valid) for _ in range(rng.randrange(1, 3))) + "]")
    return "".join(parts)


def generated_lists(seed: int, count: int) -> list[str]:
    """Random host lists (seeded): mostly valid, some broken the ways a hand-edited list breaks."""
    rng = random.Random(seed)
    lists = []
    for _ in range(count):
        valid = rng.random() < 0.85
        expressions = [_expression(rng, valid=valid) for _ in range(rng.randrange(1, 4))]
        text = expressions[0]
        for expr in expressions[1:]:
            text += rng.choice([",", ",", " ", "\t", ",,", " , "]) + expr
        lists.append(text)
    return lists


def _parse_or_none(text: str) -> list[str] | None:
    try:
        return parse_nodelist(text)
    except ConfigurationError:
        return None


def _slurm_drops_silently(text: str, env: dict[str, str]) -> bool:
    """SLURM 22.05 ignores a bad group before the last-but-one (``a[1-2]-[x]-[3]-[4]``): that
    expression expands to nothing, without an error. gpukit refuses it instead."""
    from gpukit.cluster._nodelist import _tokens

    return any(_parse_or_none(token) is None and _scontrol(token, env) == [] for token in _tokens(text))


def test_generated_lists_agree_with_scontrol(scontrol_env: dict[str, str]) -> None:
    mismatches = []
    accepted = dropped = 0
    for text in generated_lists(SEED, GENERATED):
        expected = _scontrol(text, scontrol_env)
        got = _parse_or_none(text)
        accepted += expected is not None
        if got is None and expected is not None and _slurm_drops_silently(text, scontrol_env):
            dropped += 1
        elif got != expected:
            mismatches.append(f"{text!r}: scontrol {expected}, gpukit {got}")
    print(f"{GENERATED} lists (seed {SEED}): {accepted} taken by scontrol, {dropped} where it silently drops "
          "a host expression with a bad group (gpukit refuses those)")
    assert not mismatches, (f"seed {SEED} (rerun with GPUKIT_NODELIST_SEED={SEED}): {len(mismatches)} of "
                            f"{GENERATED} differ:\n" + "\n".join(mismatches[:20]))
    assert accepted > GENERATED // 2  # the generator must mostly produce lists scontrol takes


def test_the_limits_agree_with_scontrol(scontrol_env: dict[str, str]) -> None:
    for text in ("n[0-65535]", "a[1-65535,1]b[1]"):
        assert parse_nodelist(text) == _scontrol(text, scontrol_env)
    for text in ("n[1-65537]", "n[1-999999999]", "a[1-65536,1]b[1]", "rack[1-2]n[1-2].x"):
        assert _scontrol(text, scontrol_env) is None, text
    version = subprocess.run(["scontrol", "--version"], env=scontrol_env, capture_output=True, text=True).stdout
    print(f"compared with {version.strip()}")
