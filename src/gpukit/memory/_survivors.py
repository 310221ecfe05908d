"""Find what the user's code keeps alive between steps, cheaply.

Two inspections, both bounded so a check costs micro- to milliseconds:

* A frame scan: the locals of the user's frames (the training loop calling ``watcher.step()``
  or ``optimizer.step()``), one level into containers and into objects' ``__dict__``. It finds
  the variable *names* that hold tensors with autograd history and containers that grow.
* A graph-history test: each check writes its number into the ``metadata`` of the autograd
  nodes at the roots of surviving tensors. At the next check, a survivor whose graph reaches a
  node tagged earlier that is no longer any survivor's root keeps the history of a *previous*
  step -- the ``total_loss += loss`` pattern (or an RNN state never detached). That is structural
  evidence, not a statistical guess, so one check is enough to name it.
"""

from __future__ import annotations

import dis
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import BuiltinFunctionType, FrameType, FunctionType, MethodType, ModuleType
from typing import Any

import torch

__all__ = ["Survivor", "Container", "FrameScan", "scan_user_frames", "find_stale_history", "tag_roots"]

_TAG = "gpukit.memory.check"
# frames of these packages are machinery (hooks, optimizers, gpukit itself), not user code
_SKIPPED_PREFIXES = ("gpukit.", "torch.", "contextlib", "functools", "threading", "runpy", "importlib")
_CONTAINERS = (list, dict, deque)


@dataclass
class Survivor:
    """A tensor with autograd history that outlives the step, and where it lives."""

    name: str
    location: str
    tensor: torch.Tensor


@dataclass
class Container:
    """A list/dict/deque held by user code whose newest element holds tensors."""

    name: str
    location: str
    length: int
    holds_graph: bool
    device_type: str


@dataclass
class FrameScan:
    survivors: list[Survivor]
    containers: dict[str, Container]


def _user_frames(start: FrameType | None, max_frames: int) -> Iterator[FrameType]:
    frame = start
    found = 0
    while frame is not None and found < max_frames:
        module = frame.f_globals.get("__name__", "")
        if not (module == "gpukit" or module.startswith(_SKIPPED_PREFIXES) or module == "torch"):
            found += 1
            yield frame
        frame = frame.f_back


def _location(frame: FrameType, lines: list[int] | None = None) -> str:
    code = frame.f_code
    return f"{code.co_name}() at {code.co_filename}:{', '.join(map(str, lines or [frame.f_lineno]))}"


_STORES = {"STORE_FAST": False, "STORE_NAME": False, "STORE_GLOBAL": False, "STORE_DEREF": False, "STORE_ATTR": True}
_LOADS = {"LOAD_FAST": False, "LOAD_NAME": False, "LOAD_GLOBAL": False, "LOAD_DEREF": False, "LOAD_ATTR": True}


def assigned_lines(code: Any, name: str) -> list[int]:
    """The lines in ``code`` where ``name`` (``x`` or ``obj.attr``) is updated from itself (``x += ...``,
    ``x = x + ...``), else the last line assigning it; empty when ``code`` never stores it. The leak
    warning names these lines, where the fix goes, rather than the line the check ran from."""
    attribute = "." in name
    target = name.rsplit(".", 1)[-1] if attribute else name
    if not target.isidentifier():
        return []
    loaded: set[int] = set()
    updates: list[int] = []
    last_store = None
    line = 0
    for ins in dis.get_instructions(code):
        if isinstance(ins.starts_line, int) and not isinstance(ins.starts_line, bool):
            line = ins.starts_line  # Python <= 3.12 (3.13: line_number)
        positions = getattr(ins, "positions", None)
        here = getattr(ins, "line_number", None) or (positions.lineno if positions else None) or line
        if ins.argval != target:
            continue
        if _LOADS.get(ins.opname) is attribute and ins.opname in _LOADS:
            loaded.add(here)
        elif _STORES.get(ins.opname) is attribute and ins.opname in _STORES:
            last_store = here
            if here in loaded and here not in updates:
                updates.append(here)
    return updates or ([last_store] if last_store else [])


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensors in a value or one level into a tuple/list (an ``(out, loss)`` pair)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value[:8] if isinstance(v, torch.Tensor)]
    if isinstance(value, dict):
        return [v for v in list(value.values())[:8] if isinstance(v, torch.Tensor)]
    return []


def _newest(container: Any) -> Any:
    if isinstance(container, dict):
        return next(reversed(container.values())) if container else None
    return container[-1] if len(container) else None


def _is_plain_object(value: Any) -> bool:
    """A user object worth one look into ``__dict__`` (a module holding ``self.outputs``)."""
    if isinstance(value, torch.nn.Module):
        return True
    if isinstance(value, (type, ModuleType, FunctionType, MethodType, BuiltinFunctionType, torch.optim.Optimizer)):
        return False
    module = type(value).__module__
    return hasattr(value, "__dict__") and module != "builtins" and not module.startswith("torch")


def scan_user_frames(start: FrameType | None = None, max_frames: int = 4, max_values: int = 2000) -> FrameScan:
    """Survivors and tensor-holding containers in the locals of the nearest user frames.

    Args:
        start: frame to start from; the caller's caller by default.
        max_frames: user frames to look at (machinery frames are skipped, not counted).
        max_values: bound on values examined, so a module-level loop with a huge namespace
            still costs little.
    """
    frame = start if start is not None else sys._getframe(2)
    survivors: list[Survivor] = []
    containers: dict[str, Container] = {}
    seen: set[int] = set()
    budget = max_values

    def visit(name: str, value: Any, location: str, depth: int) -> None:
        nonlocal budget
        if budget <= 0 or id(value) in seen:
            return
        budget -= 1
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.grad_fn is not None:
                lines = assigned_lines(current.f_code, name) if current is not None else []
                survivors.append(Survivor(name, _location(current, lines) if lines else location, value))
        elif isinstance(value, _CONTAINERS):
            tensors = _tensors_in(_newest(value))
            if tensors:
                containers[f"{location}|{name}"] = Container(
                    name=name,
                    location=location,
                    length=len(value),
                    holds_graph=any(t.grad_fn is not None for t in tensors),
                    device_type=tensors[0].device.type,
                )
        elif depth == 0 and isinstance(value, tuple):
            for i, item in enumerate(value[:8]):
                visit(f"{name}[{i}]", item, location, depth + 1)
        elif depth == 0 and _is_plain_object(value):
            attributes = getattr(value, "__dict__", None)
            if isinstance(attributes, dict):
                for attr, item in list(attributes.items())[:64]:
                    if attr not in ("_parameters", "_buffers", "_modules"):
                        visit(f"{name}.{attr}", item, location, depth + 1)

    current: FrameType | None = None
    for user_frame in _user_frames(frame, max_frames):
        current = user_frame
        location = _location(user_frame)
        for name, value in list(user_frame.f_locals.items()):
            if name.startswith("__") or isinstance(value, (ModuleType, type)):
                continue
            visit(name, value, location, 0)
    return FrameScan(survivors, containers)


def find_stale_history(
    survivors: list[Survivor], check_index: int, max_nodes: int = 4096
) -> list[tuple[Survivor, int, int]]:
    """Survivors whose graph reaches a root tagged at an earlier check that is no longer a root.

    Returns:
        ``(survivor, tagged_check_index, nodes_walked)`` per survivor keeping old history.
    """
    current_roots = {id(s.tensor.grad_fn) for s in survivors}
    found = []
    walked_roots: set[int] = set()
    for survivor in survivors:
        root = survivor.tensor.grad_fn
        if root is None or id(root) in walked_roots:
            continue
        walked_roots.add(id(root))
        queue: deque[Any] = deque([root])
        visited = {id(root)}
        keep_alive = [root]  # ids stay unique only while the node objects live
        while queue and len(visited) < max_nodes:
            node = queue.popleft()
            tag = node.metadata.get(_TAG) if node is not root else None
            if tag is not None and tag < check_index and id(node) not in current_roots:
                found.append((survivor, tag, len(visited)))
                break
            for child, _ in node.next_functions:
                if child is not None and id(child) not in visited:
                    visited.add(id(child))
                    keep_alive.append(child)
                    queue.append(child)
        del keep_alive
    return found


def tag_roots(survivors: list[Survivor], check_index: int) -> None:
    """Mark each survivor's root node with the check that saw it first."""
    for survivor in survivors:
        root = survivor.tensor.grad_fn
        if root is not None:
            root.metadata.setdefault(_TAG, check_index)
