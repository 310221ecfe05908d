"""Where this process sits in a launched job: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT -- as :func:`gpukit.cluster.environment` detects them.

``torchrun``, ``gpukit run`` and ``session.launch`` start workers with these variables set;
an ``srun`` task (SLURM) and a PyTorchJob pod (Kubernetes) get them from the scheduler. A
process with none of them was started with plain ``python``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

__all__ = ["DistEnv"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a launched job (``kind``: who launched it, see gpukit.cluster)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    kind: str = "torchrun"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv | None:
        """The launch environment, or ``None`` when this process was not started by a launcher
        or scheduler.

        Raises:
            DistributedError: some of the variables are set but not all, or not integers.
            ConfigurationError: SLURM variables that cannot be read.
        """
        from gpukit.cluster import environment

        env = environment(environ)
        if not env.distributed:
            return None
        return cls(env.rank, env.local_rank, env.world_size, env.local_world_size,
                   env.master_addr, env.master_port, env.kind)

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Set the torchrun variables this environment implies where they are missing (under
        SLURM they are not set), so ``init_method="env://"`` and user code find them."""
        target = os.environ if environ is None else environ
        values = {
            "RANK": self.rank, "LOCAL_RANK": self.local_rank, "WORLD_SIZE": self.world_size,
            "LOCAL_WORLD_SIZE": self.local_world_size, "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
        }
        for key, value in values.items():
            if value is not None:
                target.setdefault(key, str(value))
