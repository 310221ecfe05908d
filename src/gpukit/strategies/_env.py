"""The torchrun environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT.

``torchrun``, ``gpukit run`` and ``session.launch`` all start workers with these variables set;
a process without them was started with plain ``python``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gpukit.errors import DistributedError

__all__ = ["DistEnv"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a launched job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv | None:
        """The launch environment, or ``None`` when this process was not started by a launcher.

        Raises:
            DistributedError: some of the variables are set but not all, or not integers.
        """
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env and "RANK" not in env:
            return None
        try:
            world_size = int(env["WORLD_SIZE"])
            rank = int(env["RANK"])
            local_rank = int(env.get("LOCAL_RANK", rank))
            local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
            port = env.get("MASTER_PORT")
            master_port = int(port) if port else None
        except (KeyError, ValueError) as exc:
            shown = {k: env.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
            raise DistributedError(
                f"Incomplete or invalid launch environment {shown}: RANK and WORLD_SIZE must both "
                "be set to integers (LOCAL_RANK, MASTER_ADDR, MASTER_PORT too for several "
                "processes). Start the script with torchrun or `gpukit run`, or unset them."
            ) from exc
        if not 0 <= rank < world_size:
            raise DistributedError(f"RANK={rank} is outside 0..WORLD_SIZE-1 ({world_size}).")
        return cls(rank, local_rank, world_size, local_world_size, env.get("MASTER_ADDR"), master_port)
