"""The world of the multi-user attacks (issue 26): two users, a fresh folder, and how an outcome is judged.

Two real unprivileged accounts (``tests/devices/other_users.py``): ``gpukit-bob`` attacks,
``gpukit-alice`` is the victim. Every probe builds its own world under a fresh root-owned
folder (a fake 4-GPU spec, a sticky "temp dir", the victim's private file), lets bob plant his
files, runs one of alice's gpukit commands (the library or the CLI, in a process of hers), and
says what happened. Nothing is committed: every input is made here, at test time.

Outcomes (the multi-user table of bench/RESULTS.md; the goal is 0 in the last five):

* ``refused cleanly`` -- a gpukit error (CLI: exit 2 with one ``gpukit: error:`` line) that names
  the other user when he caused it;
* ``correct`` -- it worked, and did the right thing (the probe's own check);
* ``wrong`` -- anything else: an escape sequence reached the terminal, an error that does not say
  who caused it, a check that failed;
* ``hang`` -- it did not finish within the probe's time (it is killed);
* ``traceback`` -- a Python exception that is not a gpukit error;
* ``file changed`` -- alice's private file changed (content, mode, owner or inode);
* ``claim stolen`` -- two processes held one GPU.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "devices"))

from other_users import Outcome, User, cli, run_as, shared_area, sticky_folder  # noqa: E402

OUTCOMES = ("refused cleanly", "correct", "wrong", "hang", "traceback", "file changed", "claim stolen")
SAFE = ("refused cleanly", "correct")
ESC = "\x1b"
UUIDS = [f"GPU-{i}1111111-2222-4333-8444-55555555555{i}" for i in range(4)]


def _spec(processes: dict[int, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    return {"driver_version": "550.54.15", "gpus": [
        {"name": "NVIDIA A100", "uuid": uuid, "memory_total_mib": 40960, "memory_used_mib": 0,
         "utilization_gpu_pct": 0, "processes": (processes or {}).get(i, [])} for i, uuid in enumerate(UUIDS)]}


@dataclass
class World:
    """One probe's machine: the folders, the spec, the two users and alice's private file."""

    base: Path
    alice: User
    bob: User
    spec: Path
    tmp: Path  # a /tmp of this world: root-owned, sticky, world-writable
    claims: Path  # the shared claim folder (made by `claims setup` where a probe says so)
    secret: Path  # alice's private file: no gpukit command of hers may change it
    env: dict[str, str] = field(default_factory=dict)

    def write_spec(self, spec: dict[str, Any]) -> None:
        self.spec.write_text(json.dumps(spec))
        os.chmod(self.spec, 0o644)

    def fingerprint(self) -> tuple[Any, ...]:
        info = os.lstat(self.secret)
        return (self.secret.read_bytes(), stat.S_IMODE(info.st_mode), info.st_uid, info.st_ino)


def make_world(alice: User, bob: User) -> World:
    base = shared_area()
    home = base / "alice"
    home.mkdir()
    secret = home / "secret"
    secret.write_text("alice's secret\n")
    os.chmod(secret, 0o600)
    os.chown(secret, alice.uid, alice.gid)
    os.chmod(home, 0o755)  # bob may name the file (symlinks), not read it
    os.chown(home, alice.uid, alice.gid)
    world = World(base, alice, bob, base / "spec.json", sticky_folder(base / "tmp"), base / "claims", secret)
    world.write_spec(_spec())
    world.env = {"GPUKIT_FAKE_GPUS": str(world.spec), "TMPDIR": str(world.tmp), "HOME": str(home)}
    return world


def setup_shared(world: World) -> None:
    """What an administrator does once: ``gpukit claims setup --dir <claims>`` (as root, here)."""
    from gpukit.devices import _nvml
    from gpukit.devices._claims_admin import setup_folder

    os.environ["GPUKIT_FAKE_GPUS"] = str(world.spec)
    _nvml.shutdown()
    setup_folder(world.claims)
    world.env["GPUKIT_CLAIM_DIR"] = str(world.claims)


def as_bob(world: World, fn: Callable[..., Any], *args: Any, **kw: Any) -> Outcome:
    return run_as(world.bob, functools.partial(fn, *args, **kw), env=dict(world.env), timeout_s=30)


def as_alice(world: World, fn: Callable[..., Any], *args: Any, **kw: Any) -> Outcome:
    return run_as(world.alice, functools.partial(fn, *args, **kw), env=dict(world.env), timeout_s=30)


_GPUKIT_ERRORS: set[str] | None = None


def _gpukit_errors() -> set[str]:
    global _GPUKIT_ERRORS
    if _GPUKIT_ERRORS is None:
        import gpukit.errors as errors

        _GPUKIT_ERRORS = {name for name, value in vars(errors).items()
                          if isinstance(value, type) and issubclass(value, errors.GpukitError)}
    return _GPUKIT_ERRORS


def judge(outcome: Outcome, *, names: str | None = None, check: Callable[[Outcome], bool] | None = None,
          cli_run: bool = False, expect: str | None = None) -> str:
    """The outcome of one victim action (see the module docstring); ``names``: the user an error must
    name; ``expect``: the one safe outcome that is right here (the other one then counts as wrong)."""
    verdict = _judge(outcome, names, check, cli_run)
    return "wrong" if expect is not None and verdict in SAFE and verdict != expect else verdict


def _judge(outcome: Outcome, names: str | None, check: Callable[[Outcome], bool] | None, cli_run: bool) -> str:
    if outcome.kind == "hang":
        return "hang"
    if ESC in outcome.stdout or ESC in outcome.stderr or ESC in outcome.message:
        return "wrong"
    if "Traceback (most recent call last)" in outcome.stderr:
        return "traceback"
    if outcome.kind == "raise":
        if outcome.error_type not in _gpukit_errors():
            return "traceback"
        return "refused cleanly" if names is None or names in outcome.message else "wrong"
    if cli_run and outcome.value == 2:
        lines = [line for line in outcome.stderr.splitlines() if line.strip()]
        clean = bool(lines) and lines[0].startswith("gpukit: error:")
        return "refused cleanly" if clean and (names is None or names in outcome.stderr) else "wrong"
    if check is not None and not check(outcome):
        return "wrong"
    return "correct"


# -- what bob plants ----------------------------------------------------------------------------------

def _plant_links(folder: str, target: str, names: list[str]) -> int:
    made = 0
    for name in names:
        try:
            os.symlink(target, os.path.join(folder, name))
            made += 1
        except OSError:
            pass
    return made


def _make_folder(path: str, mode: int) -> None:
    os.mkdir(path)
    os.chmod(path, mode)


def _mkfifo(path: str) -> None:
    os.mkfifo(path)
    os.chmod(path, 0o666)


def _note_names(pids: range) -> list[str]:
    return [f"{uuid}.{pid}.owner" for uuid in UUIDS for pid in pids] + [
        f".{uuid}.owner.{pid}.tmp" for uuid in UUIDS for pid in pids]  # the names older gpukit used


# -- alice's actions ------------------------------------------------------------------------------------

def _claim(**kw: Any) -> list[str]:
    from gpukit.devices import claim_gpus

    with claim_gpus(**kw) as claim:
        return [g.uuid or "" for g in claim.gpus]


def _ls_json() -> dict[str, Any]:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli("ls", "--json")
    return {"code": code, "data": json.loads(buffer.getvalue()) if code == 0 else None}


# -- the probes -----------------------------------------------------------------------------------------
# Each returns [(reader, outcome), ...]: one attack, seen by one or more of alice's commands.

Result = list[tuple[str, str]]


def _file_check(world: World, before: tuple[Any, ...], out: Result) -> Result:
    if world.fingerprint() != before:
        return [(reader, "file changed") for reader, _ in out]
    return out
