"""A global batch size, given once, turned into micro-batches per step for this job's world size.

nanoGPT's ``gradient_accumulation_steps //= ddp_world_size`` needs the world size, which only the
Session knows: ``Session(global_batch_size=480, micro_batch_size=12)`` under 4 processes gives
``accumulate_grad_batches = 480 / (12 * 4) = 10``, under 8 gives 5, and
``setup_dataloader(dataset)`` batches by 12. The same script then trains on the same number of
samples per optimizer step whatever the launch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpukit._util.warnings import warn_at_user_code
from gpukit.errors import ConfigurationError

__all__ = ["BatchPlan", "Rescaled", "plan_batches", "rescale_accumulation", "restarted_job"]


@dataclass(frozen=True)
class BatchPlan:
    """Samples per step, as the Session was asked for them."""

    #: micro-batches per optimizer step on each rank
    accumulate_grad_batches: int
    #: samples per micro-batch on each rank (the loader's default ``batch_size``), ``None``: not given
    micro_batch_size: int | None


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{name}={value!r}; use an int >= 1.")
    return value


def restarted_job(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process belongs to a job restarted at whatever size it got: torch elastic re-formed
    its group (``TORCHELASTIC_RESTART_COUNT``: a node lost or joined) or SLURM requeued it."""
    environ = os.environ if environ is None else environ
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = environ.get(name, "0").strip()
        if value.isdigit() and int(value) > 0:
            return True
    return False


def plan_batches(global_batch_size: Any, micro_batch_size: Any, accumulate_grad_batches: Any,
                 world_size: int, *, restarted: bool = False) -> BatchPlan:
    """The accumulation that makes ``global_batch_size`` samples a step over ``world_size`` ranks.

    ``restarted`` (a job re-formed at the size it got, :func:`restarted_job`): a global batch that does
    not divide is not refused (the job would fail at every restart) but rounded to the nearest
    accumulation, with one warning that gives the new global batch.

    Raises:
        ConfigurationError: a size that is not an int >= 1, a global batch without a micro-batch
            size, both a global batch and ``accumulate_grad_batches``, or a global batch that is no
            whole multiple of ``micro_batch_size * world_size`` (the message names the nearest ones).
    """
    micro = None if micro_batch_size is None else _positive_int("micro_batch_size", micro_batch_size)
    if global_batch_size is None:
        return BatchPlan(accumulate_grad_batches, micro)
    total = _positive_int("global_batch_size", global_batch_size)
    if micro is None:
        raise ConfigurationError(
            f"global_batch_size={total} needs micro_batch_size= too (samples per process per forward): "
            "the Session then accumulates global_batch_size / (micro_batch_size * world_size) micro-batches."
        )
    if accumulate_grad_batches != 1:
        raise ConfigurationError(
            f"global_batch_size={total} with accumulate_grad_batches={accumulate_grad_batches!r}: give "
            "one of them; with a global batch the Session works the accumulation out for the world size."
        )
    per_step = micro * world_size
    if total % per_step and restarted:
        accumulate = max(1, round(total / per_step))
        warn_at_user_code(UserWarning(
            f"global_batch_size={total} is not a whole number of micro-batches of {micro} over the {world_size} "
            f"ranks this restarted job got: accumulating {accumulate} makes it {accumulate * per_step} samples per "
            "optimizer step (scale the learning rate if it should follow)."))
        return BatchPlan(accumulate, micro)
    if total % per_step:
        below, above = (total // per_step) * per_step, (total // per_step + 1) * per_step
        nearest = " or ".join(str(n) for n in (below, above) if n > 0)
        raise ConfigurationError(
            f"global_batch_size={total} is not a whole number of micro-batches: micro_batch_size {micro} x "
            f"world size {world_size} = {per_step} samples per micro-step. Use global_batch_size={nearest}, "
            "or a micro_batch_size that divides it."
        )
    return BatchPlan(total // per_step, micro)


@dataclass(frozen=True)
class Rescaled:
    """The accumulation a resume under another data-parallel size settles on (see :func:`rescale_accumulation`)."""

    #: micro-batches per optimizer step on each rank from now on
    accumulate_grad_batches: int
    #: the global batch is the saved one exactly (else the line says the new one)
    exact: bool
    #: one line for the user
    line: str


def rescale_accumulation(saved_samples_per_step: int, accumulate: int, micro_batch_size: int,
                         ranks: int, saved_ranks: int) -> Rescaled | None:
    """Keep a checkpoint's global batch (samples per optimizer step) on this job's ranks and micro-batch.

    The accumulation becomes ``saved_samples_per_step / (micro_batch_size * ranks)`` where that is a whole
    number, else the nearest one (at least 1), and the line says the new global batch.

    Args:
        saved_samples_per_step: micro-batch x data-parallel ranks x accumulation when it was saved.
        accumulate, micro_batch_size, ranks: this session's accumulation, micro-batch and data-parallel ranks.
        saved_ranks: the data-parallel ranks it was saved by (for the line).

    Returns:
        ``None`` when the accumulation already keeps it.
    """
    per_micro = micro_batch_size * ranks  # samples per micro-step over all ranks
    if accumulate * per_micro == saved_samples_per_step:
        return None
    exact = saved_samples_per_step % per_micro == 0
    new = saved_samples_per_step // per_micro if exact else max(1, round(saved_samples_per_step / per_micro))
    where = f"saved on {saved_ranks} data-parallel rank(s), resumed on {ranks} (micro-batch {micro_batch_size})"
    if exact:
        line = (f"gpukit: {where}: accumulate_grad_batches {accumulate} -> {new} keeps the global batch "
                f"({saved_samples_per_step} samples per optimizer step)")
    else:
        line = (f"gpukit: {where}: the global batch of {saved_samples_per_step} samples does not divide into "
                f"micro-batches of {per_micro}; accumulate_grad_batches {accumulate} -> {new} makes it "
                f"{new * per_micro} samples per optimizer step (scale the learning rate if it should follow)")
    return Rescaled(new, exact, line)
