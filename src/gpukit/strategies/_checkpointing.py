"""Activation checkpointing on the session's strategy: which policy, from where.

The mechanism (block detection, the forward that checkpoints, the policies) is
``gpukit.memory``'s (``memory/_activation.py``), which the planner simulates too; every strategy's
``setup_module`` applies ``strategy.activation_checkpointing`` before it wraps the model.
"""

from __future__ import annotations

from typing import Any

from gpukit.errors import ConfigurationError
from gpukit.memory import (
    ActivationCheckpointing,
    apply_activation_checkpointing,
    check_policy,
    checkpoint_targets,
    is_checkpointed,
)

__all__ = [
    "ActivationCheckpointing",
    "apply_activation_checkpointing",
    "check_policy",
    "checkpoint_targets",
    "configure_strategy",
    "is_checkpointed",
]


def configure_strategy(strategy: Any, activation_checkpointing: Any, *, verbose: bool) -> None:
    """The session's settings onto its strategy: the checkpointing policy and whether set-up speaks.

    ``Session(activation_checkpointing=...)`` wins over nothing; a strategy object that was
    given a different policy of its own is a contradiction.

    Raises:
        ConfigurationError: a bad policy, or two different ones.
    """
    policy = check_policy(activation_checkpointing)
    own = getattr(strategy, "activation_checkpointing", None)
    if policy is not None and own is not None and own != policy:
        raise ConfigurationError(
            f"activation_checkpointing={activation_checkpointing!r} was given to the Session, but the strategy "
            f"object was built with activation_checkpointing={own!r}; give it in one place."
        )
    if policy is not None:
        strategy.activation_checkpointing = policy
    strategy.announce = bool(verbose) and strategy.rank == 0
