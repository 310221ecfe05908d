"""A spawned function worker's first step (:mod:`gpukit.worker._spawn_main`), importing the launcher's ``__main__`` again, with its error
kept for the launcher's summary.

A function worker started with spawn is a fresh ``python`` that runs the launcher's script again
(as ``__mp_main__``) before it can unpickle the function -- before any gpukit code runs in it. A
script whose module-level code fails there (an import only the launcher's environment has, a
``session.launch`` call outside ``if __name__ == "__main__":``, a file read relative to somewhere
else) made the worker exit 1 with its traceback on its own stderr only (a notebook's kernel log),
and the summary said "exited with code 1".

:func:`main_imported_by_gpukit` (around the launcher's start of spawned workers) names this module
as the ``__main__`` that multiprocessing re-imports in each worker (:mod:`gpukit.worker._spawn_main`,
kept apart so that the package does not import it before runpy runs it), and the real one in
``GPUKIT_SPAWN_MAIN``. Run as ``__mp_main__`` in the worker, that module then imports the real one
exactly as multiprocessing would (same ``run_path`` / ``run_module``, same ``__mp_main__`` name, so
every function of the script unpickles as before); if that fails it writes the error to the run's
directory (``GPUKIT_RUN_DIR``, under the worker's pid) for the launcher, then lets it end the worker
as before.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from typing import Any

from gpukit._util.envvars import SPAWN_MAIN_ENV
from gpukit.errors import GpukitError
from gpukit.worker._env import worker_env
from gpukit.worker._run_dir import write_early_error

__all__ = ["main_imported_by_gpukit", "become_real_main"]

_OWN_NAME = "gpukit.worker._spawn_main"


def _real_main() -> str | None:
    """What multiprocessing would re-import in a spawned worker, as ``path:...`` / ``module:...``."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        if name == "__main__" or name.endswith(".__main__"):
            return None  # multiprocessing runs no module-level code again for these
        return f"module:{name}"
    file = getattr(main, "__file__", None)
    if not file or not os.path.isfile(file):
        return None  # interactive: such launches fork (launch/_notebook.py)
    return f"path:{os.path.abspath(file)}"


@contextlib.contextmanager
def main_imported_by_gpukit() -> Iterator[None]:
    """While workers are spawned: they import the launcher's ``__main__`` through this module.

    Nothing changes where multiprocessing would import nothing (interactive code, a package's
    ``__main__``). Restored on exit.
    """
    real = _real_main()
    main = sys.modules.get("__main__")
    own = importlib.util.find_spec(_OWN_NAME)
    if real is None or main is None or own is None:
        yield
        return
    had_spec, saved_spec = hasattr(main, "__spec__"), getattr(main, "__spec__", None)
    saved_env = os.environ.get(SPAWN_MAIN_ENV)
    os.environ[SPAWN_MAIN_ENV] = real
    main.__spec__ = own  # multiprocessing's get_preparation_data reads __main__.__spec__.name
    try:
        yield
    finally:
        if had_spec:
            main.__spec__ = saved_spec
        else:
            del main.__spec__
        if saved_env is None:
            os.environ.pop(SPAWN_MAIN_ENV, None)
        else:
            os.environ[SPAWN_MAIN_ENV] = saved_env


def _user_frames(exc: BaseException) -> str:
    """The traceback as ``python script.py`` prints it: without runpy's, multiprocessing's and our frames."""
    tb = exc.__traceback__
    skip = (os.path.dirname(os.path.abspath(__file__)), "<frozen runpy>", runpy.__file__ or "runpy")
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(skip):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _import_real_main(real: str) -> dict[str, Any]:
    kind, _, target = real.partition(":")
    try:
        if kind == "module":
            return runpy.run_module(target, run_name="__mp_main__", alter_sys=True)
        return runpy.run_path(target, run_name="__mp_main__")
    except BaseException as exc:
        what = f"module {target}" if kind == "module" else target
        doing = (f"importing {what} again in the spawned worker (a spawned worker runs the script's module-level "
                 "code before the function: keep what only the launcher should run under "
                 "`if __name__ == \"__main__\":`)")
        try:
            run_dir = worker_env().run_dir
        except GpukitError:  # a bad GPUKIT_* value: the worker's own start will say which
            run_dir = None
        write_early_error(run_dir, doing, _user_frames(exc))
        raise


def become_real_main(namespace: dict[str, Any]) -> None:
    """Inside a spawned worker: fill ``namespace`` (the ``__mp_main__`` being run) with the real
    ``__main__``'s names instead of its own; an error is left for the launcher, then raised."""
    content = _import_real_main(os.environ.get(SPAWN_MAIN_ENV, ""))
    namespace.clear()  # the runner module's own names are not the script's
    namespace.update(content)
