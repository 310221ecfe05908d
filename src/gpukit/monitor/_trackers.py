"""Experiment trackers: ``session.log`` scalars sent to CSV, MLflow or Weights & Biases.

``Session(log_with="csv")`` (or ``"mlflow"``, ``"wandb"``, a list of them, or tracker objects for
other settings) starts the trackers on rank 0 only, at the first ``session.log`` or at
``session.init_trackers(run_name=..., config=...)``, which gives the run's name and its
configuration (logged once, together with the session's own settings). Each goes through the
library users already have:

* ``CSVTracker`` -- Python's ``csv``: ``<dir>/metrics.csv`` with a ``step`` column and one column per
  name (the header is rewritten when a new name appears), and ``<dir>/config.json``;
* ``MLflowTracker`` -- ``mlflow`` (``pip install 'gpukit[mlflow]'``, mlflow-skinny): a local file store
  ``<dir>/mlruns`` unless ``tracking_uri`` or ``MLFLOW_TRACKING_URI`` names another;
* ``WandbTracker`` -- ``wandb`` (``pip install 'gpukit[wandb]'``): offline by default (``<dir>/wandb``,
  uploaded later with ``wandb sync``), online with ``mode="online"`` or ``WANDB_MODE=online``.

``<dir>`` is the run-record directory when recording (``record=``), else ``gpukit_logs/<run name>``;
a run name must stay inside ``gpukit_logs`` (:func:`check_run_name`: no ``/``, ``..`` or absolute
name). Every file gpukit writes there goes through :mod:`gpukit._util.safe_files`: the folders are
reached through no symlink another user made, a symlinked or FIFO ``metrics.csv`` is refused (never
written through, never waited on), and ``config.json`` is replaced atomically. MLflow's file store
and W&B's folder are made the same way before their libraries write inside them.
A missing library is a :class:`~gpukit.errors.ConfigurationError` naming the extra to install.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

from gpukit._util.safe_files import UnsafeEntry, open_user_file, walk_folder, write_user_file
from gpukit._util.text import printable
from gpukit.errors import ConfigurationError

__all__ = ["TRACKERS", "CSVTracker", "MLflowTracker", "Tracker", "WandbTracker", "check_run_name", "make_trackers"]

_RUN_NAME_MAX_CHARS = 200


def check_run_name(run_name: Any) -> str:
    """``run_name`` when it names one folder inside the log folder.

    Raises:
        ConfigurationError: not a string, empty, too long, with a path separator, ``.``/``..``,
            absolute, or with control characters; says what was given and what is allowed.
    """
    allowed = (f"a name of at most {_RUN_NAME_MAX_CHARS} printable characters without '/', '\\' or a leading "
               "'.', such as 'resnet50-lr0.1'")
    if not isinstance(run_name, str):
        raise ConfigurationError(f"run_name={run_name!r} is a {type(run_name).__name__}; give {allowed}.")
    bad = (not run_name.strip() or len(run_name) > _RUN_NAME_MAX_CHARS or run_name.startswith(".")
           or any(sep in run_name for sep in ("/", "\\", "\0")) or not run_name.isprintable())
    if bad:
        raise ConfigurationError(
            f"run_name={printable(run_name, max_chars=80)!r} would not name one folder inside the log folder "
            f"(gpukit_logs/<run name>): give {allowed}. To write somewhere else, pass record=DIR or a tracker "
            "with its own directory (CSVTracker('path/to/dir')).")
    return run_name


def _writing_error(tracker: str, where: Path, exc: OSError) -> ConfigurationError:
    return ConfigurationError(
        f"The {tracker} tracker cannot write in {printable(str(where), max_chars=200)!r}: "
        f"{exc.strerror or exc}. Give it a folder of your own (log_with=CSVTracker('dir'), record=DIR), or remove "
        "what is in the way.")


def _require(module: str, extra: str, what: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise ConfigurationError(
            f"log_with={what!r} needs the {module!r} package, which is not installed. Install it with "
            f"pip install 'gpukit[{extra}]' (or pip install {extra if extra != 'mlflow' else 'mlflow-skinny'}), "
            f"or choose another tracker: {', '.join(map(repr, TRACKERS))}."
        ) from None


class Tracker:
    """One experiment tracker. The base does nothing; subclasses write where their library writes.

    Args:
        directory: where to write; ``None``: the directory the Session gives (see the module docstring).
    """

    name = "none"

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = None if directory is None else Path(directory)

    def start(self, run_name: str, config: dict[str, Any], directory: Path) -> None:
        """Open the run ``run_name`` in ``self.directory`` (or ``directory``) and log ``config`` once."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Log ``scalars`` at ``step``."""

    def close(self) -> None:
        """Finish the run (flush, close files)."""

    def _where(self, directory: Path) -> Path:
        """The folder to write in, made where missing, reached through no symlink another user made.

        Raises:
            ConfigurationError: it cannot be made or is not safe to write in.
        """
        where = self.directory if self.directory is not None else directory
        try:
            os.close(walk_folder(where, make_mode=0o755))
        except OSError as exc:
            raise _writing_error(self.name, where, exc) from None
        return where


class CSVTracker(Tracker):
    """``metrics.csv`` (``step`` and one column per name) and ``config.json`` in the directory."""

    name = "csv"

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        super().__init__(directory)
        self.path: Path | None = None
        self._columns: list[str] = []
        self._file: Any = None

    def start(self, run_name: str, config: dict[str, Any], directory: Path) -> None:
        where = self._where(directory)
        self.path = where / "metrics.csv"
        try:
            write_user_file(where / "config.json",
                            json.dumps({"run_name": run_name, **config}, indent=1, default=str).encode())
            self._file = open_user_file(self.path, "w+", newline="")
        except (UnsafeEntry, OSError) as exc:
            raise _writing_error(self.name, where, exc) from None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        new = [name for name in scalars if name not in self._columns]
        if new:
            self._columns += new
            self._rewrite_header()
        csv.writer(self._file).writerow([step, *(scalars.get(c, "") for c in self._columns)])

    def _rewrite_header(self) -> None:
        """A new name: the file again with the wider header (rows before it have the column empty)."""
        self._file.flush()
        self._file.seek(0)
        rows = list(csv.reader(self._file.read().splitlines()))[1:]  # the file opened: not a path again
        self._file.seek(0)
        self._file.truncate()
        writer = csv.writer(self._file)
        writer.writerow(["step", *self._columns])
        for row in rows:
            writer.writerow(row + [""] * (len(self._columns) + 1 - len(row)))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class MLflowTracker(Tracker):
    """An MLflow run: parameters once (``log_params``), scalars with ``log_metrics(step=)``.

    Args:
        directory: where the default file store goes (``<directory>/mlruns``).
        tracking_uri: another store (``sqlite:///mlflow.db``, a server); default ``MLFLOW_TRACKING_URI``
            or the file store.
        experiment: the experiment's name.
    """

    name = "mlflow"

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, tracking_uri: str | None = None,
                 experiment: str = "gpukit") -> None:
        _require("mlflow", "mlflow", "mlflow")
        super().__init__(directory)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_id: str | None = None
        self._client: Any = None

    def start(self, run_name: str, config: dict[str, Any], directory: Path) -> None:
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            store = self._where(directory) / "mlruns"
            try:
                os.close(walk_folder(store, make_mode=0o755))  # made here: no planted link for mlflow to follow
            except OSError as exc:
                raise _writing_error(self.name, store, exc) from None
            uri = store.resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps the file store (no server, no database) behind this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(self.experiment)
        self.run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
        self._client = client
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # the store takes at most 100 per batch
            client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in scalars.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id)
            self._client = None


class WandbTracker(Tracker):
    """A Weights & Biases run (``wandb.init``), offline unless asked otherwise.

    Args:
        directory: wandb's ``dir`` (it writes ``<directory>/wandb/``).
        project: the project's name.
        mode: ``"offline"`` (default, or ``WANDB_MODE``), ``"online"`` or ``"disabled"``.
        **init: other ``wandb.init`` arguments (``entity``, ``tags``, ``group``...).
    """

    name = "wandb"

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, project: str = "gpukit",
                 mode: str | None = None, **init: Any) -> None:
        _require("wandb", "wandb", "wandb")
        super().__init__(directory)
        self.project = project
        self.mode = mode or os.environ.get("WANDB_MODE") or "offline"
        self._init = init
        self.run: Any = None

    def start(self, run_name: str, config: dict[str, Any], directory: Path) -> None:
        import wandb

        self.run = wandb.init(project=self.project, name=run_name, config=config, mode=self.mode,
                              dir=str(self._where(directory)), reinit="finish_previous", **self._init)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


#: the trackers ``log_with`` names, by each class's ``name`` (the one list of tracker names)
_BY_NAME: dict[str, type[Tracker]] = {cls.name: cls for cls in (CSVTracker, MLflowTracker, WandbTracker)}
TRACKERS = tuple(_BY_NAME)


def make_trackers(log_with: Any) -> list[Tracker]:
    """The trackers ``log_with`` names (see the module docstring); ``[]`` for ``None``.

    Raises:
        ConfigurationError: an unknown name or object, or a library that is not installed.
    """
    if log_with is None:
        return []
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    trackers: list[Tracker] = []
    for item in items:
        if isinstance(item, Tracker):
            trackers.append(item)
        elif isinstance(item, str) and item.strip().lower() in _BY_NAME:
            trackers.append(_BY_NAME[item.strip().lower()]())
        else:
            raise ConfigurationError(
                f"log_with={item!r}; use {', '.join(map(repr, TRACKERS))}, a list of them, or tracker objects "
                "(gpukit.monitor.CSVTracker(dir), MLflowTracker(tracking_uri=...), WandbTracker(project=...)). "
                "TensorBoard files come with record=DIR."
            )
    return trackers


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config as ``a.b`` keys (MLflow parameters are flat)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _mlflow_key(name: str) -> str:
    # MLflow allows letters, digits, _ - . space / ; anything else would fail the whole batch
    return re.sub(r"[^\w\-. /]", "_", name)
