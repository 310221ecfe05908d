"""DDP's gradient buckets across a resume: the first reduction of a resumed run is done in the
layout the uninterrupted run used.

DDP all-reduces gradients in buckets, flat buffers holding several parameters' gradients. A new
``DistributedDataParallel`` starts with one bucket in parameter order and, after its first
backward, rebuilds its buckets in the order the gradients became ready (then never again). An
all-reduce over three or more processes adds each element up in an order that depends on where
it lies in the buffer (gloo's and NCCL's rings start each segment at another rank), so the same
gradients in another layout round differently in the last bits. A run resumed into a new wrapper
therefore reduced its first step in the start-up layout where the uninterrupted run used the
rebuilt one, and every later step inherited the difference (measured: 18-172 of 494 weights off
by up to 6e-8 at 4 processes). Two processes never showed it: a + b == b + a.

So a checkpoint records the layout the next reduction would use (parameter names per bucket), and
resuming a wrapper that has not reduced yet registers a communication hook that does that first
reduction in the recorded layout -- the same buffers, sizes and all-reduce calls -- and copies the
result back; DDP then rebuilds from that backward exactly as before. Every later reduction is
DDP's own: the gradients scaled by 1/world size, then one all-reduce of the bucket. At one or two
processes nothing is recorded or hooked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gpukit._util.warnings import warn_at_user_code
from gpukit.errors import CheckpointError

__all__ = ["check_ddp_buckets", "record_ddp_buckets", "replay_ddp_buckets"]

#: the world sizes from which an all-reduce's result depends on the layout
_LAYOUT_MATTERS_FROM = 3
_MAX_NAME_CHARS = 4096
_MAX_NAMES = 1 << 22
_Layout = list[list[str]]


def _ddp_of(obj: Any) -> DistributedDataParallel | None:
    """The DistributedDataParallel in ``obj`` (through torch.compile's wrapper), else ``None``."""
    for _ in range(4):
        if isinstance(obj, DistributedDataParallel):
            return obj
        obj = getattr(obj, "_orig_mod", None)
    return None


def _layout_matters(ddp: DistributedDataParallel) -> bool:
    return dist.is_initialized() and dist.get_world_size(ddp.process_group) >= _LAYOUT_MATTERS_FROM


def _current_layout(ddp: DistributedDataParallel) -> _Layout | None:
    """The layout already known: a pending replay's, or the one read after DDP's rebuild."""
    pending = getattr(ddp, "_gpukit_replay", None)
    if pending is not None and pending.layout is not None:  # resumed, no backward since
        return pending.names
    return getattr(ddp, "_gpukit_bucket_layout", None)


def record_ddp_buckets(objects: Mapping[str, Any], *, is_main: bool) -> dict[str, _Layout]:
    """The bucket layout of every DDP model in ``objects`` (call on every rank, inside a save).

    DDP rebuilds its buckets at the forward after its first synchronised backward; a save between
    the two would see the start-up layout, so the rebuild is done here instead (collective: every
    rank saves). The layout is read on the main rank only (reading it allocates a zeroed copy of
    the gradient buckets, once per wrapper: it never changes after the rebuild).
    """
    layouts: dict[str, _Layout] = {}
    for name, obj in objects.items():
        ddp = _ddp_of(obj)
        if ddp is None or not _layout_matters(ddp):
            continue
        if ddp.reducer._rebuild_buckets():  # what DDP's next forward would have done
            ddp._has_rebuilt_buckets = True
        layout = _current_layout(ddp)
        if layout is None and is_main:
            try:
                layout = _read_layout(ddp)
            except torch.OutOfMemoryError:
                warn_at_user_code(
                    f"Could not read the gradient buckets of {name!r} (out of memory): resuming this "
                    "checkpoint on 3 or more processes may differ from an uninterrupted run in the last "
                    "bits. Free the gradients before saving (optimizer.zero_grad(set_to_none=True))."
                )
                continue
            if ddp._has_rebuilt_buckets:
                ddp._gpukit_bucket_layout = layout  # final: DDP rebuilds once
        if layout is not None:
            layouts[name] = layout
    return layouts


def _read_layout(ddp: DistributedDataParallel) -> _Layout:
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    layout = [[names[id(p)] for p in bucket.parameters()] for bucket in buckets]
    del buckets
    return layout


def check_ddp_buckets(saved: Any, where: str) -> None:
    """Refuse recorded layouts that are not what :func:`record_ddp_buckets` writes.

    Raises:
        CheckpointError: ``saved`` is not ``None`` nor a mapping of names to lists of lists of
            parameter names (bounded in count and length).
    """
    if saved is None:
        return
    problem = None
    if not isinstance(saved, Mapping):
        problem = f"are a {type(saved).__name__}, not a mapping of model names"
    else:
        for name, layout in saved.items():
            names = [n for bucket in layout for n in bucket] if _is_list_of_lists(layout) else None
            if not isinstance(name, str) or names is None or len(names) > _MAX_NAMES or not all(
                isinstance(n, str) and len(n) <= _MAX_NAME_CHARS for n in names
            ):
                problem = f"for {str(name)[:80]!r} are not lists of parameter names"
                break
    if problem is not None:
        raise CheckpointError(
            f"{where}: its recorded gradient buckets (ddp_buckets) {problem}; the file is damaged "
            "or was not written by gpukit."
        )


def _is_list_of_lists(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= _MAX_NAMES and all(isinstance(b, list) for b in value)


def replay_ddp_buckets(objects: Mapping[str, Any], saved: Mapping[str, _Layout] | None, where: str) -> None:
    """Make the first reduction of each resumed DDP model use its recorded bucket layout.

    Args:
        objects: what is being resumed, by name.
        saved: the checkpoint's recorded layouts by name, checked by :func:`check_ddp_buckets`
            (``None``: none recorded).
        where: the checkpoint, for messages.
    """
    for name, obj in objects.items():
        ddp = _ddp_of(obj)
        if saved is None or ddp is None or name not in saved or not _layout_matters(ddp):
            continue
        problem = _replay(ddp, saved[name])
        if problem is not None:
            warn_at_user_code(
                f"Resuming {name!r} from {where}: {problem}, so its first step reduces the gradients in "
                "another order than the uninterrupted run did and the result may differ in the last bits "
                "(3 or more processes)."
            )


def _replay(ddp: DistributedDataParallel, layout: _Layout) -> str | None:
    """Have ``ddp``'s next reduction use ``layout``; what prevents it, or ``None``."""
    params = dict(ddp.module.named_parameters())
    ignored = getattr(ddp, "parameters_to_ignore", set())
    reduced = sorted(n for n, p in params.items() if p.requires_grad and n not in ignored)
    if sorted(n for bucket in layout for n in bucket) != reduced:
        return "its recorded gradient buckets do not hold exactly the parameters it trains"
    if ddp.reducer._rebuild_buckets():  # it trained a step since it was wrapped (collective)
        ddp._has_rebuilt_buckets = True
    if ddp._has_rebuilt_buckets:  # its buckets are final: the same as recorded, or not
        current = getattr(ddp, "_gpukit_bucket_layout", None) or _read_layout(ddp)
        return None if current == layout else "it trained with other gradient buckets before the resume"
    pending = getattr(ddp, "_gpukit_replay", None)
    state = _Replay([[params[n] for n in bucket] for bucket in layout], layout, ddp.process_group)
    if pending is not None:  # resumed twice before a step: the newer checkpoint's layout
        pending.layout, pending.names = state.layout, state.names
        return None
    try:
        ddp.register_comm_hook(state, _replay_first_reduction)
    except RuntimeError:  # one hook per wrapper: the user registered their own
        return "it has a communication hook of its own"
    ddp._gpukit_replay = state
    return None


class _Replay:
    """The state of :func:`_replay_first_reduction` for one wrapper.

    Args:
        layout: the parameters of each bucket, in order.
        names: the same by name (what the next save records while the replay is pending).
        group: the model's process group.
    """

    def __init__(self, layout: list[list[nn.Parameter]], names: _Layout, group: Any) -> None:
        self.layout: list[list[nn.Parameter]] | None = layout  # None once the first reduction ran
        self.names = names
        self.group = group
        self.world = dist.get_world_size(group)


def _replay_first_reduction(state: _Replay, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: DDP's own reduction, the first one done in ``state.layout``."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / state.world)  # what DDP does as it copies gradients in when it has no hook
    layout, state.layout = state.layout, None
    grads = {id(p): g for p, g in zip(bucket.parameters(), bucket.gradients())} if layout else {}
    if layout and any(id(p) not in grads for params in layout for p in params):
        warn_at_user_code(  # DDP's defaults start with one bucket; custom bucket caps split it
            "The resumed model's first gradient bucket does not hold all its parameters (custom "
            "bucket sizes?): its first step is reduced in the start-up order, and may differ in "
            "the last bits from the uninterrupted run (3 or more processes)."
        )
        layout = None
    if not layout:
        return dist.all_reduce(buffer, group=state.group, async_op=True).get_future().then(lambda f: f.value()[0])
    for params in layout:  # the recorded buckets, one all-reduce each, in DDP's order
        flat = torch.cat([grads[id(p)].reshape(-1) for p in params])
        dist.all_reduce(flat, group=state.group)  # waits: one step per resume forgoes the overlap
        offset = 0
        for p in params:
            grad = grads[id(p)]
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.device.type != "cpu" else None
    )
    done.set_result(buffer)
    return done


# DDP checks a hook's annotations as objects; `from __future__ import annotations` left strings
_replay_first_reduction.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})
