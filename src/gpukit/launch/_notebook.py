"""Launching from a notebook (or a REPL, or ``python -c``): workers forked from this process.

Workers are normally started fresh (spawn) and import the function they run. A function
defined in a notebook cell lives in the kernel's ``__main__``, which a fresh process cannot
import ("Can't get attribute 'train_fn' on <module '__main__'>", visible only on the
kernel's raw stderr). As ``accelerate.notebook_launcher`` does, such launches fork the
workers instead: they start as copies of the kernel, with every function and object of its
cells, and nothing needs pickling on the way in (return values still travel back pickled).

Forking is refused, with the reason and the ways out, where it cannot work: on platforms
without ``fork``, and when CUDA is already initialised in this process and the workers are
to use GPUs (a forked child cannot use its parent's CUDA context).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from gpukit.errors import ConfigurationError

__all__ = ["is_interactive", "needs_fork", "check_fork", "frozen_heap", "FORK"]

FORK = "fork"


def is_interactive() -> bool:
    """Whether this process runs interactive code: a notebook kernel, a REPL, ``python -c`` or a script
    read from standard input (``python -``, whose ``__main__.__file__`` is ``"<stdin>"``).

    Their ``__main__`` has no file to import, so a spawned worker cannot import what it defines.
    """
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    return main is None or not file or not os.path.isfile(file)


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def needs_fork(fn: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    """Whether ``fn(*args)`` can only reach workers by fork.

    True in an interactive process when ``fn`` or ``args`` use something defined there (a
    function, a class, an instance of one) or cannot be pickled at all. Nothing is kept: the
    objects are pickled into a sink that discards the bytes.
    """
    if not is_interactive():
        return False  # a script: spawned workers import its __main__ from its file
    # the common case first, without pickling (a large tensor in args would be copied):
    # the function itself, or Session.launch's (session class, config, fn, args), comes from a cell
    shallow = [fn, *args, *(a for arg in args if isinstance(arg, tuple) for a in arg)]
    if any(getattr(obj, "__module__", None) == "__main__" for obj in shallow if callable(obj)):
        return True
    import pickle
    import types

    found = []

    class _Finder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, (types.FunctionType, type)):
                if obj.__module__ == "__main__":
                    found.append(obj)
            elif type(obj).__module__ == "__main__":
                found.append(obj)
            return NotImplemented

    try:
        _Finder(_Discard()).dump((fn, args))
    except Exception:  # noqa: BLE001 - unpicklable: only a fork gets it to the workers
        return True
    return bool(found)


def check_fork(what: str, *, uses_gpus: bool) -> None:
    """Raise ConfigurationError saying why workers cannot be forked here, if they cannot.

    Args:
        what: the call being made, for the message (``"session.launch(train_fn)"``).
        uses_gpus: whether the workers will use GPUs (then CUDA must not be initialised here).
    """
    if FORK not in multiprocessing.get_all_start_methods():
        raise ConfigurationError(
            f"{what}: the function is defined interactively (a notebook cell, a REPL or python -c), so "
            f"workers would have to be forked from this process, and this platform ({sys.platform}) cannot "
            "fork. Put the function in a .py file next to the notebook and import it from there.")
    torch = sys.modules.get("torch")
    if uses_gpus and torch is not None and torch.cuda.is_initialized():
        raise ConfigurationError(
            f"{what}: the function is defined interactively (a notebook cell), so the workers are forked from "
            "this kernel -- but CUDA is already initialised here (an earlier cell used the GPU: .cuda(), "
            ".to('cuda'), torch.cuda.*, a model or Session on a GPU), and forked workers cannot use CUDA then. "
            "Restart the kernel and call launch before any GPU work (create models and tensors inside the "
            "function), or put the function in a .py file and import it (workers are then started fresh).")


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Around the fork: what the workers inherit is never garbage-collected in them.

    The kernel's heap holds the remains of earlier launches (rendezvous stores, process
    contexts) in reference cycles. Collected in a forked worker, such an object's C++
    destructor joins threads that exist only in the parent: a segfault (seen on the second
    launch from one process). So the parent collects first, and freezes the rest (``gc.freeze``)
    while it forks; workers only ever collect what they create themselves.

    It also imports ``torch._dynamo`` here first when torch is loaded: every optimizer's
    constructor imports it, which took each forked worker 10 s of a 12 s launch on a busy
    2-core machine; imported once in the parent, the workers inherit it.
    """
    if "torch" in sys.modules:
        import torch._dynamo  # noqa: F401
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
