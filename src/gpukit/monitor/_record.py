"""The run record: per-step timings, logged scalars, system samples and events, one file per rank.

Format (``<dir>/rank<R>.jsonl``, version 1): UTF-8 JSON, one object per line, append-only.
Every line has ``"type"`` and ``"t"`` (unix time in seconds). Types:

* ``meta`` -- first line of each process that writes the file (a restarted or resumed run
  appends a new one): ``format`` ("gpukit-record"), ``version``, ``rank``, ``world_size``,
  ``local_rank``, ``host``, ``pid``, ``device``, ``strategy``, ``precision``,
  ``restart_count``, ``sample_interval_s``, ``full_steps`` (steps recorded one per line
  before aggregation starts).
* ``step`` -- ``n`` consecutive steps from ``step`` (0-based): ``epoch``, ``samples`` (sum),
  ``step_s`` / ``data_s`` / ``h2d_s`` / ``compute_s`` (means over the ``n`` steps; ``h2d_s``
  absent when not measured), ``max_step_s``, ``exact`` (false when the split is estimated),
  ``scalars`` (``session.log`` values, mean over the steps that logged them).
* ``sys`` -- one sample of this rank's machine: ``gpu_util_pct``, ``gpu_mem_used_bytes``,
  ``gpu_mem_total_bytes`` (NVML), ``torch_allocated_bytes``, ``torch_reserved_bytes``,
  ``process_rss_bytes``, ``cpu_pct``, ``host_mem_used_bytes``; a figure not available is left out.
* ``event`` -- ``kind`` (oom_backoff, leak_warning, checkpoint, preemption, restart, precision), ``step``
  (the last step recorded before it, or null) and the event's own fields. ``precision``:
  ``Session(fit=...)`` changed the header's precision at setup (``precision``, ``was``, ``chosen_by``).
  ``mfu`` (one per epoch of a gpukit loader, once the FLOPs per step are known): ``epoch``,
  ``steps`` and ``seconds`` (this rank's, the counted step left out), ``flops_per_step``,
  ``flops_source`` ("counted" or "given"), ``dtype``, ``peak_tflops`` (null: not known),
  ``peak_source``, ``achieved_tflops``, ``mfu`` (null without a peak).
* ``end`` -- the run closed normally: ``steps``.

Bounded size: the first ``full_steps`` steps (default 2000) get a line each; after that each
line aggregates a window of steps that doubles every time the step count does (2 steps per
line up to 2x``full_steps``, 4 up to 4x, ...), so a million steps take ~11,000 lines (~2 MB).

Crash safety and cost: the loop only appends to in-memory queues. The sampler thread starts
reading logged tensors back without waiting for the device (:mod:`gpukit.monitor._lazy_read`)
and writes the lines once their numbers are in, one flush (``sample_interval_s``) later; neither
the loop nor the sampler thread waits for the GPU. A killed run loses at most the last two
intervals and the open aggregation window, and leaves a file whose last line may be torn (readers skip it).
"""

from __future__ import annotations

import atexit
import collections
import json
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpukit.errors import ConfigurationError
from gpukit.monitor import _events
from gpukit.monitor._lazy_read import LazyRead, is_tensor
from gpukit.monitor._system import SystemSampler
from gpukit.monitor._tensorboard import thin_steps

if TYPE_CHECKING:
    import torch

    from gpukit.accelerators import Accelerator

__all__ = ["RECORD_FORMAT", "RECORD_VERSION", "RecordedRank", "Recorder", "check_scalar", "log_event",
           "record_path", "start_recorder"]

RECORD_FORMAT = "gpukit-record"
RECORD_VERSION = 1
_TB_STEP_POINTS_PER_FLUSH = 10
_TIME_FIELDS = (("step_time_s", "step_s"), ("data_wait_s", "data_s"), ("h2d_s", "h2d_s"),
                ("compute_s", "compute_s"))


def record_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """The file rank ``rank`` writes in a record directory."""
    return Path(directory) / f"rank{rank}.jsonl"


def _window(recorded: int, full_steps: int) -> int:
    """Steps per line once ``recorded`` steps are in the record (1, then doubling)."""
    if recorded < full_steps:
        return 1
    return 2 ** (int(math.log2(recorded / full_steps)) + 1)


def _is_tensor(value: Any) -> bool:
    return is_tensor(value)


def _start_read(lines: list[dict[str, Any]], accelerator: Accelerator | None) -> LazyRead:
    """Start reading the logged tensors of queued step windows back as floats, without waiting
    for the device (:class:`~gpukit.monitor._lazy_read.LazyRead`; the lines are written once it is
    done). The copy runs on this thread's current stream: a loss computed on a side stream should
    be logged after that stream is synchronised with the default one."""
    return LazyRead([(values, i) for line in lines for values in line.get("_scalars", {}).values()
                     for i in range(len(values))], accelerator)


class Recorder:
    """Writes one rank's run record (see the module docstring for the format).

    Usually created by ``Session(record="runs/exp1")``; feed it with :meth:`on_step` (the
    session's step timings), :meth:`log` (scalars) and the events of :mod:`gpukit.monitor._events`.

    Args:
        directory: the record directory (created; shared by all ranks).
        rank, world_size, local_rank: where this process sits.
        meta: extra header fields (device, strategy, precision).
        accelerator, device: this rank's device, for its samples; ``None``: process and host only.
        sample_interval_s: seconds between system samples and file flushes.
        full_steps: steps recorded one per line before aggregation starts.
        tensorboard: also write to TensorBoard: a directory, ``"auto"`` (``<directory>/tensorboard``
            when the ``tensorboard`` package is installed) or ``None``.

    Raises:
        ConfigurationError: bad interval or step count, or a directory that cannot be created.
    """

    def __init__(self, directory: str | os.PathLike[str], *, rank: int = 0, world_size: int = 1,
                 local_rank: int = 0, meta: dict[str, Any] | None = None,
                 accelerator: Accelerator | None = None, device: torch.device | None = None,
                 sample_interval_s: float = 1.0, full_steps: int = 2000,
                 tensorboard: str | os.PathLike[str] | None = "auto") -> None:
        if not (isinstance(sample_interval_s, (int, float)) and sample_interval_s > 0):
            raise ConfigurationError(f"record sample_interval_s={sample_interval_s!r}; use a number of seconds > 0.")
        if not isinstance(full_steps, int) or full_steps < 1:
            raise ConfigurationError(f"record full_steps={full_steps!r}; use an int >= 1.")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.path = record_path(self.directory, rank)
            from gpukit._util.safe_files import open_user_file  # no planted symlink/FIFO followed

            self._file = open_user_file(self.path, "a")
        except OSError as exc:
            raise ConfigurationError(
                f"Cannot write the run record in {str(directory)!r}: {exc.strerror or exc}. "
                "Give record= (or gpukit run --record) a writable directory."
            ) from None
        self.rank = rank
        self._accelerator = accelerator
        self.full_steps = full_steps
        self._steps = 0
        self._last_step: int | None = None
        self._window: dict[str, Any] | None = None
        self._scalars: dict[str, list[Any]] = {}
        self._defaults: dict[str, list[Any]] = {}
        self._queue: collections.deque[dict[str, Any]] = collections.deque()  # append is thread-safe
        self._held: list[dict[str, Any]] = []  # taken from the queue, to be read and written
        self._reading: tuple[LazyRead, list[dict[str, Any]]] | None = None  # lines whose numbers are on their way
        self._closed = False
        self._write_lock = threading.Lock()  # never taken by on_event (it may run in a signal handler)
        self._pid = os.getpid()
        self._tb = _tensorboard_sink(tensorboard, self.directory, rank)
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        header = {"type": "meta", "t": round(time.time(), 3), "format": RECORD_FORMAT,
                  "version": RECORD_VERSION, "rank": rank, "world_size": world_size,
                  "local_rank": local_rank, "host": socket.gethostname(), "pid": os.getpid(),
                  "restart_count": restarts, "sample_interval_s": sample_interval_s,
                  "full_steps": full_steps, **(meta or {})}
        self._write([header])
        _events.subscribe(self.on_event)
        if restarts:
            _events.emit("restart", restart_count=restarts)
        self._sampler = SystemSampler(accelerator, device, self.on_sample, sample_interval_s).start()

    # -- inputs (cheap: called in the training loop) -------------------------------------------
    def log(self, **values: Any) -> None:
        """Scalars for the step in progress: numbers or one-element tensors (kept as they are
        and converted on the writer thread, so logging a GPU loss costs no synchronisation)."""
        for name, value in values.items():
            self._scalars.setdefault(name, []).append(check_scalar(name, value))

    def log_default(self, **values: Any) -> None:
        """Scalars gpukit logs by itself (the loss given to ``session.backward``): kept for a step
        only where the user did not log the same name in it."""
        for name, value in values.items():
            self._defaults.setdefault(name, []).append(check_scalar(name, value))

    def on_step(self, timing: Any) -> None:
        """One completed step (a ``StepTiming``: step, epoch, samples, step_time_s, data_wait_s,
        h2d_s, compute_s, exact). Aggregated into windows once the record is long."""
        if self._closed:
            return
        window = self._window
        if window is None:
            window = self._window = {"type": "step", "t": 0.0, "step": int(timing.step), "n": 0,
                                     "epoch": getattr(timing, "epoch", None), "samples": 0,
                                     "max_step_s": 0.0, "exact": True, "_sums": {}, "_scalars": {}}
        window["n"] += 1
        window["samples"] += int(getattr(timing, "samples", 0) or 0)
        window["exact"] = window["exact"] and bool(getattr(timing, "exact", True))
        sums = window["_sums"]
        for attr, key in _TIME_FIELDS:
            value = getattr(timing, attr, None)
            if value is not None:
                sums[key] = sums.get(key, 0.0) + value
        step_s = getattr(timing, "step_time_s", None) or 0.0
        if step_s > window["max_step_s"]:
            window["max_step_s"] = step_s
        for name, values in self._defaults.items():
            self._scalars.setdefault(name, values)  # the user's own value of the name wins
        self._defaults = {}
        if self._scalars:
            for name, values in self._scalars.items():
                window["_scalars"].setdefault(name, []).extend(values)
            self._scalars = {}
        self._steps += 1
        self._last_step = int(timing.step)
        if window["n"] >= _window(self._steps - window["n"], self.full_steps):
            window["t"] = time.time()
            self._queue.append(window)
            self._window = None

    def on_sample(self, fields: dict[str, Any]) -> None:
        """A system sample (on the sampler thread, which then writes what is queued)."""
        self._queue.append({"type": "sys", "t": time.time(), **fields})
        self.flush()

    def on_event(self, kind: str, unix_time_s: float, fields: dict[str, Any]) -> None:
        """An event (any thread, or a signal handler: only appends to a queue)."""
        self._queue.append({"type": "event", "t": unix_time_s, "kind": kind,
                            "step": self._last_step, **fields})

    # -- output (sampler thread, and close) ----------------------------------------------------
    def flush(self, final: bool = False) -> None:
        """Write what is queued and flush it to the OS (the sampler thread does this each interval).

        Lines with logged device tensors wait until the device has copied them back (the next
        flush, usually); ``final`` waits for that copy instead (at close)."""
        with self._write_lock:  # the sampler thread and close() may both flush
            while self._queue:
                self._held.append(self._queue.popleft())
            ready: list[dict[str, Any]] = []
            if self._reading is not None:
                read, lines = self._reading
                if not self._read_done(read, lines, final):
                    return  # still on its way: the held lines go after it
                ready, self._reading = lines, None
            if self._held:
                lines, self._held = self._held, []
                try:
                    read = _start_read(lines, self._accelerator)
                except Exception:  # noqa: BLE001 - a tensor on a lost device: its scalars are left out
                    read = _drop_scalars(lines)
                if self._read_done(read, lines, final):
                    ready.extend(lines)
                else:
                    self._reading = (read, lines)
            if ready:
                self._write([_finish(line) for line in ready])

    @staticmethod
    def _read_done(read: LazyRead, lines: list[dict[str, Any]], final: bool) -> bool:
        try:
            if final:
                read.finish()
                return True
            return read.done()
        except Exception:  # noqa: BLE001 - a tensor on a lost device: its scalars are left out
            _drop_scalars(lines)
            return True

    def _write(self, lines: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(line, separators=(",", ":"), default=str) + "\n" for line in lines)
        try:
            self._file.write(text)
            self._file.flush()
        except (OSError, ValueError):  # disk full or closed: the run matters more than its record
            return
        if self._tb is not None:  # live: a few step points per flush (TensorBoard costs ~0.1 ms a point)
            for line in thin_steps(lines, _TB_STEP_POINTS_PER_FLUSH):
                self._tb.write(line)

    def close(self) -> None:
        """Stop sampling, write the open window and an ``end`` line, close the file. Idempotent."""
        if self._closed or os.getpid() != self._pid:  # a forked child (loader worker) never writes
            return
        self._closed = True
        _events.unsubscribe(self.on_event)
        self._sampler.stop()
        self._sampler.sample_once()  # the last figures (the peak is often at the end); flushes
        if self._window is not None:
            self._window["t"] = time.time()
            self._queue.append(self._window)
            self._window = None
        self._queue.append({"type": "end", "t": time.time(), "steps": self._steps})
        self.flush(final=True)
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    @property
    def steps(self) -> int:
        """Steps recorded so far by this process."""
        return self._steps


def check_scalar(name: str, value: Any) -> Any:
    """``value`` as ``session.log`` keeps it (a number, or a one-element tensor detached).

    Raises:
        ConfigurationError: anything else.
    """
    if _is_tensor(value):
        if value.numel() != 1:
            raise ConfigurationError(
                f"session.log({name}=<tensor of shape {tuple(value.shape)}>): log scalars "
                "(a number or a one-element tensor), e.g. loss=loss or acc=acc.mean()."
            )
        return value.detach()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigurationError(f"session.log({name}={value!r}): log numbers or one-element tensors.")
    return value


def _drop_scalars(lines: list[dict[str, Any]]) -> LazyRead:
    """Leave out the logged values of ``lines`` (their device is lost); a read that is done."""
    for line in lines:
        line.pop("_scalars", None)
    return LazyRead([])


def _finish(line: dict[str, Any]) -> dict[str, Any]:
    """Turn a queued step window into its record line (means; tensors become numbers)."""
    line["t"] = round(line["t"], 3)
    if line["type"] != "step":
        return line
    n = line["n"]
    for key, total in line.pop("_sums").items():
        line[key] = total / n
    scalars = {name: sum(values) / len(values) for name, values in line.pop("_scalars", {}).items()
               if values and not any(_is_tensor(v) for v in values)}
    if scalars:
        line["scalars"] = scalars
    return line


def _tensorboard_sink(tensorboard: Any, directory: Path, rank: int) -> Any:
    if tensorboard is None:
        return None
    from gpukit.monitor._tensorboard import TensorBoardSink, tensorboard_available

    if tensorboard == "auto":
        if not tensorboard_available():
            return None
        try:
            return TensorBoardSink(directory / "tensorboard" / f"rank{rank}")
        except Exception:  # noqa: BLE001 - a broken tensorboard install must not stop the run
            return None
    return TensorBoardSink(Path(tensorboard) / f"rank{rank}")


@dataclass(frozen=True)
class RecordedRank:
    """The process that writes a record: its place in the run, its device, what it trains with.

    Attributes:
        rank, world_size, local_rank: where this process sits in the run.
        device: the device it trains on.
        strategy: the strategy as described in the header (``"ddp x2 (gloo)"``).
        precision: the precision's name (``"bf16-mixed"``).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    strategy: str
    precision: str


def start_recorder(record: str | os.PathLike[str], who: RecordedRank, accelerator: Accelerator) -> Recorder:
    """The recorder of a launched Session: ``who``'s file in the directory ``record``."""
    meta: dict[str, Any] = {"device": str(who.device), "strategy": who.strategy, "precision": who.precision}
    snapshot = accelerator.gpu_snapshot(who.device)
    if snapshot is not None:  # the GPU's name and NVML index, for the report
        meta.update(gpu_name=snapshot.name, gpu_index=snapshot.index)
    recorder = Recorder(record, rank=who.rank, world_size=who.world_size, local_rank=who.local_rank, meta=meta,
                        accelerator=accelerator, device=who.device)
    atexit.register(recorder.close)  # a script that never calls session.close() still ends its record
    return recorder


def log_event(recorder: Recorder | None, kind: str, fields: dict[str, Any]) -> None:
    """Record event ``kind`` with ``fields`` in ``recorder`` (``session.log_event``).

    The fields are checked even when nothing is recorded (``recorder`` is ``None``), so a bad
    call fails the same way with and without ``record=``.

    Raises:
        ConfigurationError: a kind or field that cannot be recorded (see :func:`check_event`).
    """
    _events.check_event(kind, fields)
    if recorder is not None:
        recorder.on_event(kind, time.time(), fields)
