"""Passes of a plain ``torch.utils.data.DataLoader`` that start with an accumulation window still open.

A gpukit loader ends every accumulation window with its pass. A plain ``DataLoader`` iterated
directly (``for x, y in loader:``, not through ``session.progress``) tells the Session nothing: with
``accumulate_grad_batches=4`` and 10 batches an epoch, the last 2 micro-batches' gradients stay
waiting and are summed into the next epoch's first step, and the only warning came at
``session.close()``. :class:`PlainLoaderPasses` finds the plain loaders in the training loop's
frame (once per accumulation window, only while accumulating), and from then on each of their
passes that starts with gradients on says so; the first ``session.step`` after such a start warns
while micro-batches of the last pass are still pending -- at the line of the loop.

Finding them: the loader is a local of the function that calls ``session.step`` (or an attribute
of its ``self``). Its class is swapped, in place and once, for a subclass of its own class that
only reports each ``__iter__`` (everything else, ``isinstance`` and pickling included, is as
before); no torch code is patched.
"""

from __future__ import annotations

import copyreg
import sys
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
from torch.utils.data import DataLoader

from gpukit._util.warnings import is_internal

__all__ = ["PlainLoaderPasses"]

_WATCHED: dict[type, type] = {}  # a DataLoader class -> its watching subclass
_ATTRIBUTE = "_gpukit_pass_listeners"


def _watching_class(cls: type) -> type:
    """``cls`` with an ``__iter__`` that tells its listeners a pass starts (made once per class)."""
    if getattr(cls, "_gpukit_watching", False):
        return cls
    made = _WATCHED.get(cls)
    if made is None:
        def __iter__(self: Any) -> Iterator[Any]:  # noqa: N807 - the method being wrapped
            for listener in list(getattr(self, _ATTRIBUTE, ())):
                notify = listener()
                if notify is not None:
                    notify(self)
            return super(made, self).__iter__()  # type: ignore[misc]

        def __reduce_ex__(self: Any, protocol: Any) -> Any:  # noqa: N807 - pickles and copies as the user's class
            reduced = super(made, self).__reduce_ex__(protocol)  # type: ignore[misc]
            if not isinstance(reduced, tuple) or len(reduced) < 2:
                return reduced
            func, args, *rest = reduced
            if func is copyreg.__newobj__ and args and args[0] is made:
                # pickle checks __newobj__'s class against the object's: rebuild as protocols 0/1 do
                func, args = copyreg._reconstructor, (cls, object, None)
            if rest and isinstance(rest[0], dict) and _ATTRIBUTE in rest[0]:  # the listeners stay here
                rest[0] = {key: value for key, value in rest[0].items() if key != _ATTRIBUTE}
            return (func, args, *rest)

        made = type(cls.__name__, (cls,), {"__iter__": __iter__, "__reduce_ex__": __reduce_ex__,
                                            "_gpukit_watching": True, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__})
        _WATCHED[cls] = made
    return made


def _user_frame() -> FrameType | None:
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _plain_loaders(frame: FrameType) -> Iterator[tuple[str, DataLoader]]:
    """The plain DataLoaders among ``frame``'s locals and its ``self``'s attributes, with their names."""
    names = dict(frame.f_locals)
    owner = names.get("self")
    if owner is not None and isinstance(getattr(owner, "__dict__", None), dict):
        names.update({f"self.{key}": value for key, value in vars(owner).items()})
    for name, value in names.items():
        if isinstance(value, DataLoader):
            yield name, value


class PlainLoaderPasses:
    """Warns when a plain DataLoader's training pass starts with an accumulation window still open.

    Args:
        warn: Called with where the pending gradients were found (``TrainingSteps.warn_if_pending``).
    """

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._warn = warn
        self._seen: weakref.WeakSet[DataLoader] = weakref.WeakSet()
        self._names: weakref.WeakKeyDictionary[DataLoader, str] = weakref.WeakKeyDictionary()
        self._started: str | None = None  # the name of a loader whose training pass just started
        self._listener = weakref.WeakMethod(self._pass_started)

    def before_micro_batch(self, in_window: int) -> None:
        """Called by ``session.step`` before it counts a micro-batch (only while accumulating)."""
        started, self._started = self._started, None
        if in_window == 0:
            self._find_loaders()  # a window opens: look for plain loaders in the loop (cheap: one frame)
        elif started is not None:
            self._warn(f"a new pass over the plain DataLoader `{started}` began")

    def _find_loaders(self) -> None:
        frame = _user_frame()
        if frame is None:
            return
        for name, loader in _plain_loaders(frame):
            if loader in self._seen:
                continue
            self._seen.add(loader)
            self._names[loader] = name
            listeners = loader.__dict__.setdefault(_ATTRIBUTE, [])
            listeners.append(self._listener)
            loader.__class__ = _watching_class(type(loader))

    def _pass_started(self, loader: DataLoader) -> None:
        if torch.is_grad_enabled():  # an evaluation pass (under no_grad) sums no gradients
            self._started = self._names.get(loader, "loader")
